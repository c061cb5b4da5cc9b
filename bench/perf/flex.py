"""The two attention paths side by side (issue 9): seconds per chunk of `ref` and compiled
`flex`, and how far their KLD statistics agree, on the embedded models.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.perf.flex [--ctx 2048] [--out bench/perf/results/flex.md]

Per model, one process and one model load (`kvarn.run.load.Context`), first chunk of Wikitext:

1. warm-up: one untimed flex baseline run, which compiles `torch.compile(flex_attention,
   dynamic=True)` for this head dim (its wall time, compile included, is reported);
2. for each run, ref then flex: the baseline (bf16/bf16 t0) and the cells q4_0 t128 and
   kvarn4, each against the baseline of its own path; s/chunk is the engine's timed forward
   (n_ctx / tokens_per_s), wall the whole run_cell / run_baseline;
3. the ref path's own spread: the same two cells on ref at ubatch 200, and with query blocks
   of 96 instead of 128 (every sdpa call then reduces over other key spans: fp32 noise on
   every call, as flex has), the size of the differences a KLD statistic shows between two
   correct computations (quantized cells are not continuous in their inputs).

Dynamo's compiled-graph count is read before and after the timed flex runs: it must not grow
(no recompile per ubatch or layer: offsets and positions enter the mask_mod as tensors).
Writes --out atomically (and a .json beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from bench import REPO, TEXT

MODELS = ("smollm2-135m", "gemma3-270m")
RUNS = [("baseline", None), ("q4_0 t128", ("q4_0", "q4_0", 128)), ("kvarn4", ("kvarn4", "kvarn4", 0))]
STATS = ("kld_mean", "kld_median", "kld_p99", "same_top")


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def measure(name: str, n_ctx: int, work: Path) -> dict:
    from kvarn.run import load, torch_engine
    from kvarn.vocab.cell import CellSpec
    from kvarn.weights.sources import ModelSpec

    spec = ModelSpec(name, f"embedded:{name}")
    common = dict(text=str(TEXT), cache_dir=REPO / "resources" / "models")
    t = time.perf_counter()
    ctx = load.Context(spec, n_ctx, 1, **common, baseline=True)
    out = {"load_s": time.perf_counter() - t, "runs": {}, "spread": {}}
    t = time.perf_counter()
    torch_engine.run_baseline(spec, n_ctx, 1, work / f"{name}-warm.kvd", **common, context=ctx, attention="flex")
    out["warmup_flex_s"] = time.perf_counter() - t
    graphs = _graphs()
    for label, cell in RUNS:  # ref and flex interleaved per run: a shared machine's load drifts
        for path in ("ref", "flex"):
            base = work / f"{name}-{path}.kvd"
            if cell is None:
                r = torch_engine.run_baseline(spec, n_ctx, 1, base, **common, context=ctx, attention=path)
            else:
                r = torch_engine.run_cell(spec, n_ctx, 1, CellSpec(*cell), base, work / f"{name}-{path}-{label}", **common,
                                    context=ctx, attention=path)
                assert r["attention"] == path and r["baseline_attention"] == path
            out["runs"][(path, label)] = {"s_per_chunk": n_ctx / r["tokens_per_s"], "wall_s": r["wall_s"],
                                          **{k: r[k] for k in STATS if k in r}}
            print(f"{name} {path} {label}: {n_ctx / r['tokens_per_s']:.2f} s/chunk", flush=True)
    out["recompiles"] = _graphs() - graphs
    import kvarn.kvcache.attention as kattn

    for label, cell in RUNS[1:]:
        r = torch_engine.run_cell(spec, n_ctx, 1, CellSpec(*cell), work / f"{name}-ref.kvd", work / f"{name}-ref200-{label}",
                            **common, context=ctx, attention="ref", ubatch=200)
        out["spread"][label] = {k: r[k] for k in STATS}
        block, kattn.QUERY_BLOCK = kattn.QUERY_BLOCK, 96  # every sdpa call reduces over other spans
        try:
            r = torch_engine.run_cell(spec, n_ctx, 1, CellSpec(*cell), work / f"{name}-ref.kvd", work / f"{name}-refqb96-{label}",
                                **common, context=ctx, attention="ref")
        finally:
            kattn.QUERY_BLOCK = block
        out["spread_qb96"] = {**out.get("spread_qb96", {}), label: {k: r[k] for k in STATS}}
    return out


def _rel(a, b) -> str:
    return f"{100 * (a - b) / b:+.2f} %" if b else "n/a"


def report(results: dict, args, elapsed: float) -> str:
    import torch

    L = ["# Attention paths side by side: ref (sdpa per query block) and flex (compiled flex_attention)", "",
         f"Written by `bench/perf/flex.py --ctx {args.ctx}` ({elapsed:.0f} s in all) on {platform.processor() or 'CPU'}"
         f" ({os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s); a shared "
         "machine: single runs, read the ratios). First Wikitext chunk; s/chunk is the engine's timed forward "
         "(the same number `tokens_per_s` reports), after a warm-up flex run that compiles the kernel.", "",
         "| model | n_ctx | run | ref s/chunk | flex s/chunk | flex / ref |", "|---|---:|---|---:|---:|---:|"]
    for name, r in results.items():
        for label, _ in RUNS:
            a, b = r["runs"][("ref", label)]["s_per_chunk"], r["runs"][("flex", label)]["s_per_chunk"]
            L.append(f"| {name} | {args.ctx} | {label} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    L += ["", "Compile and load (once per process and head dim; a `kvarn.run.worker` keeps the compiled kernel "
          "for all the cells it serves):", ""]
    for name, r in results.items():
        L.append(f"* {name}: model load {r['load_s']:.1f} s; first flex baseline run, compile included, "
                 f"{r['warmup_flex_s']:.1f} s; graphs compiled during the timed flex runs: {r['recompiles']}")
    L += ["", "KLD statistics of each cell against the baseline of its own path: flex vs ref, and the ref "
          "path's own spread: ubatch 200 instead of 512 (at 256 it is bit-identical, its query blocks of 128 "
          "falling on the same positions), and query blocks of 96 instead of 128 (fp32 noise on every call, "
          "as between flex and ref). Quantized cells are not "
          "continuous in their inputs (fp32 noise in a K can flip a q4_0 / KVarN rounding), so two correct "
          "paths differ by about this spread; per attention call the paths agree at fp32 noise "
          "(tests/test_flex.py).", "",
          "| model | cell | statistic | ref | flex | flex vs ref | ref ub200 vs ref | ref qblock 96 vs ref |",
          "|---|---|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        for label, _ in RUNS[1:]:
            a, b, c = r["runs"][("ref", label)], r["runs"][("flex", label)], r["spread"][label]
            d = r["spread_qb96"][label]
            for k in STATS:
                L.append(f"| {name} | {label} | {k} | {a[k]:.6g} | {b[k]:.6g} | {_rel(b[k], a[k])} | "
                         f"{_rel(c[k], a[k])} | {_rel(d[k], a[k])} |")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "flex.md"))
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvarn-flex-") as tmp:
        for name in args.models.split(","):
            results[name] = measure(name, args.ctx, Path(tmp))
    md = report(results, args, time.monotonic() - t0)
    from kvarn.files.atomic import write_text

    write_text(Path(args.out), md)
    raw = {n: {**r, "runs": {f"{p} {lab}": v for (p, lab), v in r["runs"].items()}} for n, r in results.items()}
    write_text(Path(args.out).with_suffix(".json"), json.dumps(raw, indent=1) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
