"""Whose rounding of one token decides a row: kvarn with llama.cpp's K and V at one position (issue 13).

For each row (cache type, rotation) of a llama-perplexity grid made by bench/oracles/llamacpp/perplexity.sh:

1. llama.cpp's own post-RoPE K and V of chunk 1 up to the last swapped position, every
   layer, from its eval callback (`bench/oracles/llamacpp/dump.c`, chunk 1 of the same base file, the same cache type
   and rotation: `LLAMA_ATTN_ROT_DISABLE=1` for "norot");
2. kvarn's `llamacpp-cpu` cell again, with position P's (positions A–B's, or all) K and V
   (before rotation and rounding) replaced by llama.cpp's at every layer — nothing else
   changes;
3. the KLD of that run beside llama-perplexity's and our unchanged cell, and per layer how
   far the two programs' rows are apart before the cache rounds them (relative) and after
   (relative to the rounding error itself: ~0 if both round to the same codes, ~1.4 if the
   roundings are unrelated);
4. with `--reroll N`, N more runs with our own rows there times (1 + EPS·N(0, 1)): other
   draws of their rounding, and whether llama-perplexity's KLD lies within their spread.

Position 0 holds BOS, which every later query attends to (the attention sink) and which
sees only itself, so its K and V are the same in every chunk: its rounding is one draw
that no number of chunks averages away.

    python -m bench.oracles.llamacpp.sink --model gemma3-270m --rows q4_1-rot q5_1-rot [--position 0 | 0-511 | all]
                                  [--reroll N] [--out FILE]

Needs the llama.cpp build and runs of bench/oracles/llamacpp/perplexity.sh ($LLAMACPP_DIR); never run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from bench import REPO

from bench.oracles.llamacpp import runs as lc  # the runs layout and the log parser

SRC = Path(__file__).with_name("dump.c")


def build() -> Path:
    """The dumper, compiled against the llama.cpp build (once, outside the repo)."""
    return lc.build_c(SRC, lc.LLAMACPP_DIR / "dump" / "llamacpp_dump", ["llama", "ggml", "ggml-base"])


# The node each name ends on in llama.cpp's graph (it gives one name to several: Kcur is the
# MUL_MAT, its RESHAPE and the ROPE); a name not listed has one node.
FINAL_OP = {"Qcur": "ROPE", "Kcur": "ROPE", "Vcur": "RESHAPE"}


def dump_tensors(exe: Path, gguf: Path, base_kld: Path, k_type: str, rot: bool, n_tokens: int, layers, names,
                 threads: int, out_dir) -> None:
    """llama.cpp's named nodes NAME-LAYER over positions 0..n_tokens-1 of chunk 1, with the cache
    type and rotation of the row (`LLAMA_ATTN_ROT_DISABLE=1` for no rotation), into out_dir."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_ATTN_ROT_DISABLE"}
    if not rot:
        env["LLAMA_ATTN_ROT_DISABLE"] = "1"
    res = subprocess.run([str(exe), str(gguf), str(base_kld), k_type, k_type, str(threads), str(n_tokens),
                          str(out_dir), ",".join(map(str, layers)), ",".join(names)], env=env, capture_output=True,
                         text=True)
    if res.returncode:
        raise SystemExit(f"llamacpp_dump failed ({res.returncode}):\n{res.stderr[-2000:]}")


def load_node(out_dir, name: str, layer: int):
    """The fp32 values (flat) of node NAME-LAYER as `dump_tensors` left them: its final op."""
    import numpy as np
    import torch

    files = sorted(Path(out_dir).glob(f"{name}-{layer}.*.f32"))
    op = FINAL_OP.get(name)
    pick = [f for f in files if op is None or f.name.endswith(f".{op}.f32")]
    if len(pick) != 1:
        raise SystemExit(f"llama.cpp dumped {[f.name for f in files]} for {name}-{layer}; expected one "
                         f"{op or 'node'}")
    return torch.from_numpy(np.fromfile(pick[0], dtype=np.float32))


def llama_rows(exe: Path, gguf: Path, base_kld: Path, k_type: str, rot: bool, n_layers: int, n_tokens: int,
               threads: int) -> list[tuple]:
    """[(K [n_tokens, H_kv·D], V [n_tokens, H_kv·D])] per layer, positions 0.. of chunk 1, as llama.cpp
    stores them (before rotation)."""
    with tempfile.TemporaryDirectory() as tmp:
        dump_tensors(exe, gguf, base_kld, k_type, rot, n_tokens, range(n_layers), ("Kcur", "Vcur"), threads, tmp)
        return [tuple(load_node(tmp, name, i).reshape(n_tokens, -1) for name in ("Kcur", "Vcur"))
                for i in range(n_layers)]


def swapped_cell(model: str, n_ctx: int, chunks: int, k_type: str, rot: bool, baseline: Path, out: Path,
                 replace, position: slice, n_layers: int) -> dict:
    """kvarn's llamacpp-cpu cell (chunk 1) with the K and V of the positions `position` replaced at every layer.

    replace(layer, positions, ours_k, ours_v, gguf_order) -> (k, v): the new rows [H_kv, n, D]
    of those positions (a slice of the chunk) in transformers' channel order, given ours
    (fp32) and whether llama.cpp holds this architecture's K in the GGUF's order.
    """
    from kvarn.llamacpp_cpu import compute

    from kvarn.run import torch_engine

    from kvarn.vocab import options
    from kvarn.vocab.cell import CellSpec
    from kvarn.weights import sources
    from kvarn.formats.registry import get_format

    spec = sources.parse_model(model)
    layer_index: dict[int, int] = {}
    done: dict[int, int] = {}  # per layer: positions appended so far
    sums: dict[int, dict] = {}  # per layer: squared norms behind the stats
    append_kv = compute.append_kv
    fmt = {r: get_format(k_type, r, rot=rot) for r in ("k", "v")}

    def swap(layer, k, v):  # k, v: [b, H_kv, n, D], post-RoPE, before rotation and rounding
        i = layer_index.setdefault(id(layer), len(layer_index))
        s = done.get(i, 0)
        done[i] = s + k.shape[2]
        lo, hi = max(position.start, s), min(position.stop, done[i])
        if lo >= hi:
            return append_kv(layer, k, v)
        here = slice(lo - s, hi - s)
        k, v = k.clone(), v.clone()
        ours_k, ours_v = k[0, :, here].float(), v[0, :, here].float()
        lk, lv = replace(i, slice(lo, hi), ours_k, ours_v, layer.qk_gguf_order)
        acc = sums.setdefault(i, {})
        for role, ours, theirs in (("k", ours_k, lk), ("v", ours_v, lv)):
            r_ours, r_theirs = (fmt[role].roundtrip(x[None]).squeeze(0) for x in (ours, theirs))
            for key, num, den in (("rel", theirs - ours, ours), ("rounded_rel", r_theirs - r_ours, r_ours - ours)):
                n0, d0 = acc.get(f"{role}_{key}", (0.0, 0.0))
                acc[f"{role}_{key}"] = (n0 + float(num.square().sum()), d0 + float(den.square().sum()))
        k[0, :, here] = lk.to(k.dtype)
        v[0, :, here] = lv.to(v.dtype)
        return append_kv(layer, k, v)

    if not (out / "summary.json").is_file():
        compute.append_kv = swap
        try:
            torch_engine.run_cell(spec, n_ctx, chunks, CellSpec(k_type, k_type, 0, rot=rot, compute=options.LLAMACPP_CPU),
                            baseline, out, text=str(lc.TEXT), cache_dir=str(REPO / "resources" / "models"))
        finally:
            compute.append_kv = append_kv
        if sorted(sums) != list(range(n_layers)) or len(layer_index) != n_layers:
            raise SystemExit(f"swapped at layers {sorted(sums)} of {len(layer_index)}; the model has {n_layers}")
        stats = [{"layer": i, **{key: (n / d) ** 0.5 for key, (n, d) in sorted(sums[i].items())}} for i in range(n_layers)]
        (out / "swap.json").write_text(json.dumps({"positions": [position.start, position.stop - 1], "layers": stats},
                                                  indent=1) + "\n")
    return {**json.loads((out / "summary.json").read_text()), **json.loads((out / "swap.json").read_text())}


def from_llama(rows: list[tuple]):
    """The replacement by llama.cpp's rows (`llama_rows`)."""
    from kvarn.llamacpp_cpu import channel_order

    def replace(i, positions, ours_k, ours_v, gguf_order):  # ours [H_kv, n, D]; rows [n_dumped, H_kv·D]
        lk, lv = (r[positions].reshape(x.shape[1], x.shape[0], x.shape[2]).transpose(0, 1)
                  for r, x in zip(rows[i], (ours_k, ours_v)))
        if gguf_order:  # back to transformers' order: llama.cpp's channel j is ours gguf_order[j]
            hf = lk.clone()
            hf[..., channel_order.gguf_order(lk.shape[-1])] = lk
            lk = hf
        return lk, lv
    return replace


def rerolled(seed: int, eps: float):
    """The replacement by our own rows times (1 + eps * N(0, 1)): another draw of their rounding."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def replace(i, positions, ours_k, ours_v, gguf_order):
        return tuple(x * (1 + eps * torch.randn(x.shape, generator=gen)) for x in (ours_k, ours_v))
    return replace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", choices=sorted(lc.CTX))
    ap.add_argument("--rows", nargs="+", required=True, help="TYPE-rot or TYPE-norot, rows of the llama-perplexity grid")
    ap.add_argument("--position", default="0", metavar="P|A-B|all",
                    help="the position of chunk 1 to swap, an inclusive range, or all of them (default 0, BOS)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for kvarn and -t for the dumper (default 1)")
    ap.add_argument("--reroll", type=int, default=0, metavar="N",
                    help="also N runs with position P's K and V of our own, times (1 + EPS * N(0, 1)), seeds 0..N-1: "
                         "the spread of the KLD over draws of that position's rounding (default 0)")
    ap.add_argument("--reroll-eps", type=float, default=0.01, metavar="EPS", help="relative size of that noise (default 0.01)")
    ap.add_argument("--out", default=None, help="also write the table here (and FILE.json)")
    a = ap.parse_args()
    n_ctx = lc.CTX[a.model]
    try:
        lo, hi = (0, n_ctx - 1) if a.position == "all" else \
            (int(x) for x in (a.position.split("-", 1) if "-" in a.position else (a.position, a.position)))
    except ValueError:
        raise SystemExit(f"--position {a.position!r}: expected P, A-B (integers) or all") from None
    if not 0 <= lo <= hi < n_ctx:
        raise SystemExit(f"--position {a.position!r}: expected P or A-B with 0 <= A <= B < {n_ctx} (n_ctx)")
    pos = slice(lo, hi + 1)
    import torch

    torch.set_num_threads(a.threads)
    from kvarn.weights import sources

    d = lc.run_dir(a.model, 1)  # the chunk-1 grid: the dumper runs chunk 1
    chunks = 1
    kv = d / "kvarn" / "llamacpp-cpu"
    spec = sources.parse_model(a.model)
    gguf = sources.gguf_path(spec, str(REPO / "resources" / "models"))
    exe = build()
    baseline = lc.kvarn_baseline(a.model, n_ctx, chunks, "llamacpp-cpu", kv / "base.kvd", kv / "base.kld")
    lines = [f"### {a.model}, n_ctx {n_ctx}, {chunks} chunk(s): kvarn llamacpp-cpu with llama.cpp's K and V "
             f"at position {a.position}", "",
             "| cache | rot | llama median | kvarn median | swapped median | kvarn/llama | swapped/llama | "
             "llama mean | kvarn mean | swapped mean | kvarn/llama | swapped/llama |", "|---|---|" + "---:|" * 10]
    detail, spread, every, n_layers = [], [], [], 0
    for row in a.rows:
        t, rot_s = row.rsplit("-", 1)
        if rot_s not in ("rot", "norot"):
            raise SystemExit(f"row {row!r}: expected TYPE-rot or TYPE-norot")
        rot = rot_s == "rot"
        ll = lc.parse_llama(d / f"{row}.log")
        if not ll or "kld_median" not in ll:
            raise SystemExit(f"no llama-perplexity result {d / f'{row}.log'}: run bench/oracles/llamacpp/perplexity.sh first")
        ours = lc.kvarn_cell(a.model, n_ctx, chunks, t, rot, "llamacpp-cpu", baseline, kv / row)
        n_layers = len(ours["kv_geometry"])  # one entry per attention layer
        rows = llama_rows(exe, gguf, d / "base.kld", t, rot, n_layers, pos.stop, a.threads)
        sw = swapped_cell(a.model, n_ctx, chunks, t, rot, baseline, kv / f"swap{a.position}-llama" / row,
                          from_llama(rows), pos, n_layers)
        rr = [swapped_cell(a.model, n_ctx, chunks, t, rot, baseline,
                           kv / f"reroll{a.position}-eps{a.reroll_eps:g}-s{seed}" / row, rerolled(seed, a.reroll_eps),
                           pos, n_layers) for seed in range(a.reroll)]
        if rr:
            spread.append(f"| {t} | {'on' if rot else 'off'} | " + " | ".join(
                f"{lc.fmt(ll[key])} | {lc.fmt(ours[key])} | {lc.fmt(min(x[key] for x in rr))} – "
                f"{lc.fmt(max(x[key] for x in rr))} | "
                f"{'yes' if min(x[key] for x in rr) <= ll[key] <= max(x[key] for x in rr) else 'no'}"
                for key in ("kld_median", "kld_mean")) + " |")
        r = {key: (ll[key], ours[key], sw[key]) for key in ("kld_median", "kld_mean")}
        lines.append(f"| {t} | {'on' if rot else 'off'} | " + " | ".join(
            f"{lc.fmt(x[0])} | {lc.fmt(x[1])} | {lc.fmt(x[2])} | {x[1] / x[0]:.3f} | {x[2] / x[0]:.3f}"
            for x in r.values()) + " |")
        st = sw["layers"]
        detail.append(f"| {t} | {'on' if rot else 'off'} | " + " | ".join(
            f"{min(s[key] for s in st):.1e} – {max(s[key] for s in st):.1e}" for key in ("k_rel", "v_rel")) + " | "
            + " | ".join(" ".join(f"{s[key]:.2f}" for s in st) for key in ("k_rounded_rel", "v_rounded_rel")) + " |")
        every.append({"row": row, "llama": ll, "kvarn": {k: ours[k] for k in ("kld_median", "kld_mean")},
                      "swapped": {k: sw[k] for k in ("kld_median", "kld_mean")}, "layers": st,
                      "rerolled": [{k: x[k] for k in ("kld_median", "kld_mean")} for x in rr]})
    lines += ["", f"Position {a.position}, before the swap, over the {n_layers} layers: the two programs' rows apart "
              "(|llama − kvarn| / |kvarn|, least – most), and per layer (0, 1, ...) their rounded rows apart relative "
              "to the rounding error, |r(llama) − r(kvarn)| / |r(kvarn) − kvarn|: 0 when both round to the same "
              "codes, about 1.4 when the two roundings are unrelated.", "",
              "| cache | rot | K apart | V apart | K rounded apart / rounding error, per layer | "
              "V rounded apart / rounding error, per layer |",
              "|---|---|---:|---:|---:|---:|"] + detail
    if spread:
        lines += ["", f"Position {a.position}'s rounding drawn again: {a.reroll} runs with our own K and V there times "
                  f"(1 + {a.reroll_eps:g}·N(0, 1)) at every layer (seeds 0..{a.reroll - 1}); least – most KLD, and "
                  "whether llama-perplexity's lies inside.", "",
                  "| cache | rot | llama median | kvarn median | re-drawn median | inside | "
                  "llama mean | kvarn mean | re-drawn mean | inside |", "|---|---|" + "---:|" * 3 + "---|" + "---:|" * 3 + "---|"]
        lines += spread
    print("\n".join(lines))
    if a.out:
        from kvarn.files.atomic import write_text

        write_text(a.out, "\n".join(lines) + "\n")
        write_text(Path(a.out).with_suffix(".json"), json.dumps(every, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
