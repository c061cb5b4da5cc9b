"""Engine cost: quantized cell vs BF16 baseline wall time, tokens/s, dump bytes per scored token.

    .venv/bin/python -m bench.perf.forward_speed [--ctx 512 2048 4096] [--skip MODEL:CTX ...] [--dump MODEL=PATH ...]
        [--cells q8_0/q8_0/0 kvarn4/kvarn4/0 q4_0-q4_0-t128-tdf16-s128 ...] [--ref-normalization] [--no-dump]

1. Overhead: forward wall time (cache model + scored logits + log-softmax, as timed by
   run_cell) of q8_0, q4_0 tail 128 and kvarn4 cells divided by the bf16 baseline cell's,
   same model, same chunk, interleaved (baseline, cell, baseline, cell, ...); each cell's
   ratio is min over `--reps` of its runs / min over its paired baseline runs, so load from
   other processes hits both alike. `--ref-normalization` adds, for each KVarN cell, a row
   with the torch reference of the normalization and rounding (`quantize_normalized`:
   `normalize_ref` + `quantize_rows`) in place of the compiled CPU path
   (`quantize_normalized_fast`): the same bits, the speed-up side by side.
2. Throughput: tokens/s of the baseline cell for each model at each context (1 chunk).
3. Dump size: bytes of a real baseline dump (`kvarn baseline`) per scored token (`--no-dump`: skipped).
Writes the Markdown table to --out atomically.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvarn.formats import kvarn_tiles

from bench import REPO, TEXT

from kvarn.vocab import scoring

from kvarn.baseline import data

from kvarn.run import forward, torch_engine
from kvarn.vocab.cell import CellSpec  # noqa: E402

from kvarn.weights import models, sources  # noqa: E402
from kvarn.files.atomic import write_text  # noqa: E402

CELLS = [CellSpec("q8_0", "q8_0", 0), CellSpec("q4_0", "q4_0", 128), CellSpec("kvarn4", "kvarn4", 0)]
BASELINE = CellSpec("bf16", "bf16", 0)
REF_NORM = " (torch reference)"  # a cell's label suffix: run with the reference normalization and rounding


def cell_arg(text: str) -> CellSpec:
    """K/V/TAIL (e.g. kvarn4/kvarn4/0) or a cell's directory name (e.g. q4_0-q4_0-t128-tdf16-s128)."""
    try:
        if "/" not in text:
            return CellSpec.from_name(text)
        k, v, tail = text.split("/")
        return CellSpec(k, v, int(tail))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"a cell is K/V/TAIL (e.g. kvarn4/kvarn4/0) or a cell name "
                                         f"(e.g. q4_0-q4_0-t128-tdf16-s128), got {text!r}: {e}") from None


def label(cell: CellSpec) -> str:
    plain = CellSpec(cell.k, cell.v, cell.tail)
    return f"{cell.k}/{cell.v} tail {cell.tail}" + ("" if cell == plain else f" ({cell.name})")


def forward_s(lm, ids, cell: CellSpec, ubatch=512, ref_norm=False) -> float:
    lm.model.set_attn_implementation("kvarn")
    cache = forward.new_cache(lm.model, cell)
    fast = kvarn_tiles.quantize_normalized_fast
    if ref_norm:
        kvarn_tiles.quantize_normalized_fast = kvarn_tiles.quantize_normalized
    try:
        t = time.perf_counter()
        for _ in forward.chunk_logprobs(lm.model, ids, cache, ubatch, scoring.scored_positions(ids.shape[0])):
            pass
        return time.perf_counter() - t
    finally:
        kvarn_tiles.quantize_normalized_fast = fast


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--ctx", nargs="+", type=int, default=[512, 2048, 4096])
    ap.add_argument("--overhead-ctx", type=int, default=512)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--cells", nargs="+", type=cell_arg, default=CELLS, metavar="CELL")
    ap.add_argument("--ref-normalization", action="store_true",
                    help="also run each KVarN cell with the torch reference normalization and rounding")
    ap.add_argument("--no-dump", action="store_true", help="skip the dump-size section")
    ap.add_argument("--dump", nargs="*", default=[], metavar="MODEL=PATH",
                    help="measure an existing baseline dump instead of writing one")
    ap.add_argument("--skip", nargs="*", default=[], metavar="MODEL:CTX", help="throughput points to leave out")
    ap.add_argument("--cache-dir", default=str(REPO / sources.DEFAULT_CACHE_DIR))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "forward_speed.md"))
    ap.add_argument("-t", "--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    text = data.load_text(TEXT if TEXT.is_file() else None)
    over_rows, tps_rows, dump_rows = [], [], []
    t_start = time.perf_counter()
    for name in args.models:
        spec = sources.ModelSpec(name, f"embedded:{name}")
        lm = models.load(spec, cache_dir=args.cache_dir)
        tokens = data.tokenize(lm.tokenizer, text)

        # 1. overhead at one context
        ids = data.make_chunks(tokens, args.overhead_ctx, 1, lm.info.bos_id)[0]
        # Each cell is paired with the baseline run just before it; min over reps of each.
        runs = [(c, False) for c in args.cells]
        if args.ref_normalization:
            runs += [(c, True) for c in args.cells if c.k.startswith("kvarn") or c.v.startswith("kvarn")]
        base_t, cell_t = {r: [] for r in runs}, {r: [] for r in runs}
        for _ in range(args.reps):
            for r in runs:
                base_t[r].append(forward_s(lm, ids, BASELINE))
                cell_t[r].append(forward_s(lm, ids, r[0], ref_norm=r[1]))
        b = min(min(v) for v in base_t.values())
        for (c, ref_norm) in runs:
            bc, t = min(base_t[c, ref_norm]), min(cell_t[c, ref_norm])
            over_rows.append((name, args.overhead_ctx, label(c) + (REF_NORM if ref_norm else ""), bc, t, t / bc))
            print(over_rows[-1], flush=True)

        # 2. throughput of the baseline cell
        for ctx in args.ctx:
            if f"{name}:{ctx}" in args.skip:
                tps_rows.append((name, ctx, None, None))
                continue
            if ctx == args.overhead_ctx:
                t = b  # the baseline cell just timed
            else:
                ids = data.make_chunks(tokens, ctx, 1, lm.info.bos_id)[0]
                t = forward_s(lm, ids, BASELINE)
            tps_rows.append((name, ctx, t, ctx / t))
            print(tps_rows[-1], flush=True)

        # 3. a real dump at the overhead context (or one given with --dump MODEL=PATH)
        if args.no_dump:
            del lm
            continue
        given = dict(x.split("=", 1) for x in args.dump)
        with tempfile.TemporaryDirectory() as d:
            if name in given and Path(given[name]).is_file():
                from kvarn.baseline import dump

                p = Path(given[name])
                hdr = dump.open_dump(p, verify=False).header
                ctx, n_chunks = hdr["n_ctx"], hdr["n_chunks"]
            else:
                p, ctx, n_chunks = Path(d) / "base.kvd", args.overhead_ctx, 1
                torch_engine.run_baseline(spec, ctx, 1, p, text=str(TEXT), cache_dir=args.cache_dir)
            n_scored = n_chunks * len(scoring.scored_positions(ctx))
            size = p.stat().st_size
            dump_rows.append((name, lm.info.vocab_size, ctx, size, size / n_scored,
                              size / n_scored / lm.info.vocab_size))
        del lm

    total = time.perf_counter() - t_start
    L = [
        "# Engine benchmark",
        "",
        f"`.venv/bin/python -m bench.perf.forward_speed {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores visible, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), fp32 compute on CPU; load average at the end "
        f"{os.getloadavg()[0]:.1f} (shared machine: absolute times are noisy, ratios are interleaved). "
        f"Total bench wall time {total / 60:.1f} min.",
        "",
        f"## Quantized cell / BF16 baseline cell (forward wall time, 1 chunk, min of {args.reps})",
        "",
        "| model | n_ctx | cell | baseline s | cell s | ratio |",
        "|---|---:|---|---:|---:|---:|",
    ]
    L += [f"| {m} | {c} | {cell} | {b:.2f} | {t:.2f} | {r:.2f}x |" for m, c, cell, b, t, r in over_rows]
    L += ["", "## Throughput of the BF16 baseline cell (prompt processing incl. scored logits)", "",
          "| model | n_ctx | forward s | tokens/s |", "|---|---:|---:|---:|"]
    for m, c, t, tps in tps_rows:
        L.append(f"| {m} | {c} | {t:.1f} | {tps:.1f} |" if t else f"| {m} | {c} | skipped | – |")
    if not args.no_dump:
        L += ["", "## Baseline dump size", "",
              "| model | vocab | n_ctx | file bytes | bytes / scored token | bytes / token / vocab entry |",
              "|---|---:|---:|---:|---:|---:|"]
        L += [f"| {m} | {v} | {c} | {s:,} | {pt:,.0f} | {pv:.3f} |" for m, v, c, s, pt, pv in dump_rows]
    write_text(args.out, "\n".join(L) + "\n")
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
