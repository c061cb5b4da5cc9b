"""How much one position's rounding draw moves a cell's KLD: BOS (position 0) against a control.

Issue 21, the rotated q4_0 tail-128 row: kvarn `llamacpp-cpu` sits 1.10x above BeeLlama on every
chunk, and keeping position 0 exact (`--sink 1`) halves kvarn's KLD on that row. Every chunk starts
with the same BOS, so its K/V rows round the same way in every chunk: a small upstream difference
between the two programs' BOS rows (before the cache rounds them) would be one draw, repeated in
every chunk, i.e. a systematic ratio. This script measures the spread of that draw in kvarn.

For each seed s it runs the cell with the K and V rows of one position p, on every attention
layer, multiplied by (1 + eps * sign) before the cache stores them (sign = +-1 per value, drawn
from a generator seeded by (s, layer, K/V)); the model is otherwise unchanged, and the body's
q4_0 blocks of that position round anew. Both copies (body and exact/tail) see the perturbed
row, as they would see another program's slightly different row. Done by wrapping
`kvarn.kvcache.cache.KVarnLayer.update` in this process (`patched`), not by an option of kvarn's.
Positions: `--position` (default 0, BOS) and `--control` (default 1, the first text token, read
by as many queries); runs: the unperturbed cell, then for each seed the BOS run and the control
run, and with `--inject-beellama` one run with the position's rows replaced by BeeLlama's own
(`bos_rows`: the direct test of whether BeeLlama's draw is what separates the two programs). Every
run scores against the same base file; results are appended to
`OUT/runs.jsonl` as they finish (a rerun skips the runs it finds there) and summarized in
`OUT/bos_draw.md` and on stdout, beside BeeLlama's figures when `--beellama-log` is given.

    OMP_NUM_THREADS=1 nice -n 10 python -m bench.oracles.beellama.bos_draw --baseline base.kld \\
        --out OUT --model gemma3-270m -c 4096 --chunks 1 -ctk q4_0 -ctv q4_0 --tail 128 \\
        --seeds 8 --eps 1e-3 [--beellama-log bee-q4_0-t128.log] [-t 1]
    python -m bench.oracles.beellama.bos_draw --baseline base.kld --out OUT --table-only ...

`base.kld`: kvarn's baseline in llama's format (`kvarn baseline ... --llama-kld-out base.kld`,
what grid.py writes); a base file of more chunks serves a 1-chunk run. TEXT defaults to bench.TEXT.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import REPO, TEXT

MAX_EPS = 0.05  # a larger relative change is no longer "the same model, another rounding draw"
ROLES = ("k", "v")
INJECT_TYPES = ("f16", "bf16", "q4_0")  # the cache types bos_rows.c runs BeeLlama with


@dataclass(frozen=True)
class Perturbation:
    """Multiply the K and V rows of absolute position `position` by (1 + eps * sign), sign = +-1 per
    value from a generator seeded by (seed, layer, role)."""

    position: int
    eps: float
    seed: int

    @property
    def label(self) -> str:
        return f"p{self.position}-s{self.seed}"


@dataclass(frozen=True)
class Replacement:
    """Replace the K and V rows of absolute position `position` by another program's: `rows` maps
    the `bos_rows` node names `Kcur-L` / `Vcur-L` to the values of layer L's row (heads x dim, as
    ggml lays out one token of `Kcur`: each head's dim values in turn)."""

    position: int
    rows: dict
    eps = None
    seed = None

    @property
    def label(self) -> str:
        return f"p{self.position}-beellama"


def replace_rows(x, offset: int, r: Replacement, layer: int, role: str):
    """x [batch, heads, n, dim] holding positions offset..offset+n-1: x in fp32 with the row of
    position r.position (if among them) set to r's row of (layer, role) in every batch entry;
    KeyError if r has none. x is not modified."""
    import torch

    x = x.float()
    i = r.position - offset
    if not 0 <= i < x.shape[-2]:
        return x
    name = f"{'K' if role == 'k' else 'V'}cur-{layer}"
    row = torch.tensor(r.rows[name], dtype=torch.float32).reshape(x.shape[1], x.shape[-1])
    out = x.clone()
    out[..., i, :] = row.to(out.device)
    return out


def check_args(seeds: int, eps: float, position: int, control: int, n_ctx: int) -> None:
    """Refuse what would not measure a rounding draw, naming the value and what is accepted."""
    if not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"--seeds {seeds!r}: must be an integer >= 1")
    if not (isinstance(eps, float) and math.isfinite(eps) and 0 < eps <= MAX_EPS):
        raise ValueError(f"--eps {eps!r}: must be a relative size in (0, {MAX_EPS}]")
    for name, p in (("--position", position), ("--control", control)):
        if not isinstance(p, int) or not 0 <= p < n_ctx:
            raise ValueError(f"{name} {p!r}: must be a position in 0..{n_ctx - 1} (n_ctx {n_ctx})")
    if position == control:
        raise ValueError(f"--control {control}: must differ from --position {position}")


def signs(shape, seed: int, layer: int, role: str):
    """float32 +-1 of `shape`, the same for the same (seed, layer, role), on the CPU."""
    import torch

    if role not in ROLES:
        raise ValueError(f"role {role!r}: must be one of {', '.join(ROLES)}")
    g = torch.Generator().manual_seed((seed * 1_000_003 + layer) * 2 + ROLES.index(role))
    return torch.randint(0, 2, tuple(shape), generator=g).float().mul_(2).sub_(1)


def perturb_rows(x, offset: int, p: Perturbation, layer: int, role: str):
    """x [batch, heads, n, dim] holding positions offset..offset+n-1: x in fp32 with the row of
    position p.position (if among them) times (1 + eps * sign); every other row unchanged. x is
    not modified."""
    x = x.float()
    i = p.position - offset
    if not 0 <= i < x.shape[-2]:
        return x
    out = x.clone()
    row = out[..., i, :]
    out[..., i, :] = row * (1 + p.eps * signs(row.shape, p.seed, layer, role).to(row.device))
    return out


@contextlib.contextmanager
def patched(p: Perturbation | Replacement | None):
    """KVarnLayer.update perturbing (`perturb_rows`) or replacing (`replace_rows`) position p's K
    and V rows before they are stored; nothing when p is None. The original method is restored
    on exit."""
    from kvarn.kvcache.cache import KVarnLayer

    original = KVarnLayer.update
    if p is not None:
        change = replace_rows if isinstance(p, Replacement) else perturb_rows

        def update(self, key_states, value_states, *args, **kwargs):
            off = self.n_tokens
            return original(self, change(key_states, off, p, self.layer_idx, "k"),
                            change(value_states, off, p, self.layer_idx, "v"), *args, **kwargs)

        KVarnLayer.update = update
    try:
        yield
    finally:
        KVarnLayer.update = original


def plan(seeds: int, eps: float, position: int, control: int) -> list[Perturbation | None]:
    """The runs in order: unperturbed, then per seed the position's run and the control's (so a
    stopped run leaves both sets the same size, give or take one)."""
    out: list[Perturbation | None] = [None]
    for s in range(seeds):
        out += [Perturbation(position, eps, s), Perturbation(control, eps, s)]
    return out


def spread(xs: list[float]) -> dict:
    """min, max, mean, sample sd (None for one value), median of xs (non-empty)."""
    if not xs:
        raise ValueError("spread of no values")
    return {"n": len(xs), "min": min(xs), "max": max(xs), "mean": statistics.fmean(xs),
            "sd": statistics.stdev(xs) if len(xs) > 1 else None, "median": statistics.median(xs)}


KEYS = ("kld_median", "kld_mean", "kld_p99", "same_top", "ppl_q")


def report(records: list[dict], bee: dict | None = None) -> str:
    """Markdown: every run, then per position the spread of median and mean KLD over seeds, the
    unperturbed value and (given BeeLlama's parsed log) BeeLlama's, and whether BeeLlama's falls
    inside the seeds' min..max."""
    f = lambda x, nd=6: "—" if x is None else f"{x:.{nd}f}"  # noqa: E731
    lines = ["| run | position | eps | seed | median KLD | mean KLD | p99 KLD | same top % | PPL(Q) | CPU s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['label']} | {r['position'] if r['position'] is not None else '—'} | "
                     f"{r['eps'] if r['eps'] is not None else '—'} | {r['seed'] if r['seed'] is not None else '—'} | "
                     f"{f(r['kld_median'])} | {f(r['kld_mean'])} | {f(r['kld_p99'], 4)} | {f(100 * r['same_top'], 2)} | "
                     f"{f(r['ppl_q'], 4)} | {r['cpu_s']:.0f} |")
    base = next((r for r in records if r["position"] is None), None)
    lines += ["", "| perturbed position | seeds | statistic | unperturbed | seeds min | seeds max | seeds mean | seeds sd "
              "| max/min | BeeLlama | BeeLlama inside min..max |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for pos in sorted({r["position"] for r in records if r["eps"] is not None}):
        runs = [r for r in records if r["position"] == pos and r["eps"] is not None]
        for key in ("kld_median", "kld_mean"):
            s = spread([r[key] for r in runs])
            b = (bee or {}).get(key)
            inside = "—" if b is None else ("yes" if s["min"] <= b <= s["max"] else "no")
            lines.append(f"| {pos} | {s['n']} | {key[4:]} | {f(base[key]) if base else '—'} | {f(s['min'])} | "
                         f"{f(s['max'])} | {f(s['mean'])} | {f(s['sd'])} | {s['max'] / s['min']:.3f} | {f(b)} | "
                         f"{inside} |")
    return "\n".join(lines) + "\n"


def load_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def record(label: str, p: Perturbation | None, s: dict, cpu_s: float) -> dict:
    return {"label": label, "position": p and p.position, "eps": p and p.eps, "seed": p and p.seed,
            **{k: s[k] for k in KEYS}, "cpu_s": cpu_s}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, type=Path, help="base file (llama KLD format or a kvarn dump)")
    ap.add_argument("--out", required=True, type=Path, help="folder for runs.jsonl, bos_draw.md and the cells")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("-ctk", "--cache-type-k", dest="k", default="q4_0")
    ap.add_argument("-ctv", "--cache-type-v", dest="v", default="q4_0")
    ap.add_argument("--tail", type=int, default=128)
    ap.add_argument("--no-rot", action="store_true")
    ap.add_argument("--compute", default="llamacpp-cpu")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--eps", type=float, default=1e-3, help=f"relative size, in (0, {MAX_EPS}]")
    ap.add_argument("--position", type=int, default=0, help="the perturbed position (default 0: BOS)")
    ap.add_argument("--control", type=int, default=1, help="the control position (default 1)")
    ap.add_argument("--beellama-log", type=Path, help="BeeLlama's llama-perplexity --kl-divergence log of the same row")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--inject-beellama", action="store_true",
                    help="one more run: --position's K and V rows on every layer replaced by BeeLlama's "
                         "(bos_rows: its graph's Kcur-L / Vcur-L on the first 512 tokens, one ubatch, this cache "
                         "type and tail; needs BEELLAMA_SRC and BEELLAMA_BUILD)")
    ap.add_argument("--table-only", action="store_true", help="run nothing: the summary from OUT/runs.jsonl")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        check_args(args.seeds, args.eps, args.position, args.control, args.ctx)
    except ValueError as e:
        ap.error(str(e))
    if args.inject_beellama and (args.k != args.v or args.k not in INJECT_TYPES):
        ap.error(f"--inject-beellama: -ctk/-ctv must be one of {', '.join(INJECT_TYPES)} for both "
                 f"(bos_rows' harness), got {args.k} / {args.v}")
    jsonl = args.out / "runs.jsonl"
    records = load_records(jsonl)
    if not args.table_only:
        import torch

        from kvarn.run import load, torch_engine
        from kvarn.vocab.cell import CellSpec
        from kvarn.weights.sources import parse_model

        torch.set_num_threads(args.threads)
        spec = parse_model(args.model)
        cell = CellSpec(args.k, args.v, args.tail, rot=not args.no_rot, compute=args.compute)
        cache_dir = str(REPO / "resources" / "models")
        ctx = load.Context(spec, args.ctx, args.chunks, str(TEXT), "cpu", "auto", cache_dir)
        args.out.mkdir(parents=True, exist_ok=True)
        done = {r["label"] for r in records}
        runs = plan(args.seeds, args.eps, args.position, args.control)
        if args.inject_beellama and Replacement(args.position, {}).label not in done:
            from bench.oracles.beellama.bos_rows import beellama_rows
            from kvarn.weights.sources import gguf_path

            rows = beellama_rows(gguf_path(spec, cache_dir), 512, args.position, args.k, args.tail)
            runs.insert(1, Replacement(args.position, rows))
        for p in runs:
            label = p.label if p else "none"
            if label in done:
                continue
            t = time.process_time()
            with patched(p):
                s = torch_engine.run_cell(spec, args.ctx, args.chunks, cell, args.baseline, args.out / label,
                                    text=str(TEXT), device="cpu", cache_dir=cache_dir, context=ctx)
            records.append(record(label, p, s, time.process_time() - t))
            with jsonl.open("a") as fh:
                fh.write(json.dumps(records[-1]) + "\n")
            print(f"{time.strftime('%H:%M:%S', time.gmtime())}Z {label}: median {s['kld_median']:.6f} "
                  f"mean {s['kld_mean']:.6f}", flush=True)
    from bench.oracles.llamacpp.runs import parse_llama

    bee = parse_llama(args.beellama_log) if args.beellama_log else None
    text = report(records, bee)
    if args.out.is_dir():
        (args.out / "bos_draw.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
