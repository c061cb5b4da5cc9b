"""Seconds per chunk, tokens/s and peak memory of the study's cell types on random-weight
models of the study's exact geometry, and the projected GPU-hours of config/article.yaml.

    python -m bench.gpu.article [--out bench/gpu/results/article.md] [--budget-s 420]
    python -m bench.gpu.article --smoke --out OUT.md        # tiny configs on CPU: checks the script

Per model (`random:config/models/<name>.json`, bf16 weights drawn on the device, the byte
tokenizer; kvarn.weights.random_model): one `kvarn.run.engine.Context` (the model loaded once, as the
worker does), then the baseline and the cells q8_0 t0, q4_0 t128, kvarn4, kvarn2 over one
chunk at the study's n_ctx, each timed end to end (forward, log-softmax, dump encoding or
metrics against the dump) with the device's peak allocated memory and the process's peak
resident memory during that run. Random weights: the log-probs mean nothing; only time and
memory are read.

Attention paths (`--attention`, kvarn.kvcache.attention.resolve_attention): each run on `flex` (one
compiled flex_attention call per layer call; the projection reads these) and then, where the
budget still allows, on `ref` (sdpa per query block, the reference), each cell against the
baseline of its own path; the table puts their seconds per chunk side by side. `--smoke`
runs flex eagerly (kvarn.kvcache.flex.COMPILE = False): compiling on a CPU takes minutes.

Projection: each article cell (kvarn.plan.matrix.expand of config/article.yaml) takes the
measured time of its nearest type (standard at tail 0: q8_0 t0; standard at tail > 0:
q4_0 t128; KVarN: the mean of kvarn4 and kvarn2), times the study's chunk count per model
(`--study-chunks`: the real tokenizers' counts are not computable here; the defaults are
issue 9's reading, ~4 Qwen chunks at 65,536 and ~17 Gemma chunks at 16,384), plus one
baseline and one model load per model. `--budget-s`: runs that would start after this many
seconds are skipped and marked (the device call is limited); Gemma first, it is cheaper.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import REPO as ROOT
from bench import TEXT

STUDY = {"gemma4-31b": 16384, "qwen3.6-27b": 65536}  # name -> the study's n_ctx (config/article.yaml)
STUDY_CHUNKS = {"gemma4-31b": 17, "qwen3.6-27b": 4}
RUNS = [("baseline", None), ("q8_0 t0", ("q8_0", "q8_0", 0)), ("q4_0 t128", ("q4_0", "q4_0", 128)),
        ("kvarn4", ("kvarn4", "kvarn4", 0)), ("kvarn2", ("kvarn2", "kvarn2", 0))]
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "global_head_dim": 128, "num_global_key_value_heads": 1, "sliding_window": 64,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "vocab_size": 256, "vocab_size_per_layer_input": 256}
TINY_LAYERS = 8


def tiny_config(study_json: Path, out: Path) -> Path:
    """The study config shrunk (same architecture and layer-type pattern, 8 layers, small dims)."""
    cfg = json.loads(study_json.read_text())
    cfg.update({k: v for k, v in TINY.items() if k in cfg})
    cfg["num_hidden_layers"] = TINY_LAYERS
    types = cfg["layer_types"]
    cfg["layer_types"] = types[:TINY_LAYERS - 1] + [types[-1]]  # keep a last layer of the final type
    out.write_text(json.dumps(cfg, indent=1))
    return out


class PeakRSS:
    """The process's peak resident memory while the block runs (sampled from /proc every 20 ms)."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(name: str, source: str, n_ctx: int, device: str, dtype: str, text, deadline: float,
            work: Path, paths=("flex", "ref")) -> tuple[float, list[dict]]:
    """(model load seconds, one dict per run of RUNS) for one model: the first path's
    figures, and `<path>_s_per_chunk` of the others where they ran."""
    import torch

    from kvarn.run import engine
    from kvarn.spec.cell import CellSpec
    from kvarn.weights.sources import ModelSpec

    spec = ModelSpec(name, source)
    cuda = device.startswith("cuda")
    common = dict(text=text, device=device, dtype=dtype, cache_dir=work / "models")
    t0 = time.perf_counter()
    try:
        ctx = engine.Context(spec, n_ctx, 1, **common, baseline=True)
    except Exception as e:  # a refusal by kvarn.budget.preflight or an out-of-memory: recorded, the next model runs
        print(f"{name}: could not load: {type(e).__name__}: {e}", flush=True)
        return float("nan"), [{"run": label, "skipped": f"load failed: {type(e).__name__}: {_short(e)}"}
                              for label, _ in RUNS]
    load_s = time.perf_counter() - t0
    rows, last = [], {}
    for label, cell in RUNS:
        row = {"run": label}
        for path in paths:
            first = path == paths[0]
            # a path not yet timed on this model is guessed at twice the first path's last run
            if time.monotonic() + last.get(path, 2 * last.get(paths[0], 0.0)) > deadline:
                row.update({"skipped": "budget"} if first else {f"{path}_s_per_chunk": "skipped (budget)"})
                if first:
                    break
                continue
            base = work / f"{name}-{path}.kvd"
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            try:
                with PeakRSS() as rss:
                    t = time.perf_counter()
                    if cell is None:
                        out = engine.run_baseline(spec, n_ctx, 1, base, **common, context=ctx, attention=path)
                    else:
                        out = engine.run_cell(spec, n_ctx, 1, CellSpec(*cell), base, work / f"{name}-{path}-{label}",
                                              **common, context=ctx, attention=path)
                    if cuda:
                        torch.cuda.synchronize()
                    last[path] = time.perf_counter() - t
            except Exception as e:  # e.g. out of device memory: recorded with the peak reached, the next run goes on
                peak = torch.cuda.max_memory_allocated() if cuda else None
                print(f"{name} {label} {path}: failed: {type(e).__name__}: {e}", flush=True)
                why = (f"failed: {type(e).__name__}: {_short(e)}" + (f" (peak device {_gib(peak)} GiB)" if peak else ""))
                row.update({"skipped": why} if first else {f"{path}_s_per_chunk": why})
                if cuda:
                    torch.cuda.empty_cache()
                if first:
                    break
                continue
            print(f"{name} {label} {path}: {last[path]:.2f} s/chunk, {out['tokens_per_s']:.0f} tok/s", flush=True)
            if not first:
                row[f"{path}_s_per_chunk"] = last[path]
                continue
            row.update({"s_per_chunk": last[path], "tokens_per_s": out["tokens_per_s"],
                        "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                        "peak_host_bytes": rss.peak,
                        "dump_bytes_per_chunk": (base.stat().st_size - 64) if cell is None else None})
        rows.append(row)
    del ctx
    import gc

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return load_s, rows


def projection(results: dict, article: Path, study_chunks: dict) -> tuple[list[str], float | None]:
    """Markdown lines and the total GPU-hours of config/article.yaml from the measured seconds."""
    import yaml

    from kvarn.plan import matrix as kvm

    cells = kvm.expand(yaml.safe_load(article.read_text())).cells
    lines, total = [], 0.0
    for name, (load_s, rows) in results.items():
        t = {r["run"]: r.get("s_per_chunk") for r in rows}
        kv = [x for x in (t.get("kvarn4"), t.get("kvarn2")) if x is not None]
        need = {"baseline": t.get("baseline"), "q8_0 t0": t.get("q8_0 t0"), "q4_0 t128": t.get("q4_0 t128"),
                "kvarn": sum(kv) / len(kv) if kv else None}
        mine = [c for c in cells if c.model == name]
        counts = {"q8_0 t0": 0, "q4_0 t128": 0, "kvarn": 0}
        for c in mine:
            counts["kvarn" if "kvarn" in c.k + c.v else "q8_0 t0" if c.tail == 0 else "q4_0 t128"] += 1
        measured = [v for k, v in need.items() if k != "baseline" and v is not None]
        guessed = [k for k, v in need.items() if k != "baseline" and v is None and counts.get(k) and measured]
        for k in guessed:  # skipped for the budget: the slowest measured cell type stands in (an upper guess)
            need[k] = max(measured)
        missing = [k for k, v in need.items() if v is None and (k == "baseline" or counts.get(k))]
        n = study_chunks.get(name)
        if missing or n is None:
            lines.append(f"| {name} | {len(mine)} | {n} | not projected: {', '.join(missing) or 'chunks'} "
                         "not measured | |")
            total = None
            continue
        per_chunk = need["baseline"] + sum(counts[k] * need[k] for k in counts)
        hours = (load_s + n * per_chunk) / 3600
        total = None if total is None else total + hours
        lines.append(f"| {name} | {len(mine)} ({counts['q8_0 t0']} t0, {counts['q4_0 t128']} t128, "
                     f"{counts['kvarn']} KVarN) | {n} | {per_chunk:.0f} | {hours:.2f}"
                     + (f" ({', '.join(guessed)} not measured: the slowest measured cell type stands in)" if guessed
                        else "") + " |")
    return lines, total


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:160].replace("|", "/")


def _gib(b):
    return "" if b is None else f"{b / 2**30:.2f}"


def linear_attention_kernel() -> str:
    """The chunked gated-delta-rule function transformers' Qwen 3.5/3.6 linear layers call:
    flash-linear-attention's Triton kernel when `fla` imports, else transformers' torch
    reference (read from the closure of transformers' kernel-or-fallback wrapper)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    f = m.torch_chunk_gated_delta_rule
    free = dict(zip(f.__code__.co_freevars, (c.cell_contents for c in f.__closure__ or ())))
    impl = free.get("implementation")
    if impl is None:
        return "unknown (transformers' wrapper changed; see the run's log)"
    return f"{impl.__module__}.{impl.__qualname__}"


def report(results, proj, total, args, device_name, elapsed) -> str:
    L = ["# The article matrix on one device: measured seconds per chunk and the projection", "",
         f"Written by `bench/gpu/article.py{' --smoke' if args.smoke else ''}` on {device_name} "
         f"({elapsed:.0f} s in all). Random-weight models of "
         + ("tiny configs derived from the study's (8 layers, the same layer-type pattern): **a check of the "
            "script, not a measurement of the study**." if args.smoke else "the study's exact geometry "
            "(config/models) at the study's n_ctx, bf16 weights.")
         + " One chunk per run; s/chunk is end to end (forward, log-softmax, dump encoding or metrics);"
         " tokens/s is the forward alone; peak device memory is torch's max allocated during the run; "
         "peak host memory is the process's resident set, sampled."
         f" Qwen's Gated DeltaNet layers call `{linear_attention_kernel()}`. Attention path {args.paths[0]} "
         + (f"(s/chunk, tokens/s, memory) beside {', '.join(args.paths[1:])} (s/chunk only), each cell against "
            "the baseline of its own path" if len(args.paths) > 1 else "only")
         + (" (flex eager here: the smoke checks the script, not flex's speed)." if args.smoke else "."), "",
         "| model | n_ctx | run | s/chunk | " + "".join(f"{p} s/chunk | " for p in args.paths[1:])
         + "×baseline | tokens/s | peak device GiB | peak host GiB |",
         "|---|---:|---|---:|" + "---:|" * len(args.paths[1:]) + "---:|---:|---:|---:|"]
    for name, (load_s, rows) in results.items():
        base = next((r.get("s_per_chunk") for r in rows if r["run"] == "baseline"), None)
        for r in rows:
            if "skipped" in r:
                L.append(f"| {name} | {args.n_ctx[name]} | {r['run']} | skipped ({r['skipped']}) | "
                         + "| " * len(args.paths[1:]) + "| | | |")
                continue
            ratio = f"{r['s_per_chunk'] / base:.2f}" if base else ""
            others = "".join((f"{x:.2f}" if isinstance(x, float) else str(x or "")) + " | "
                             for x in (r.get(f"{p}_s_per_chunk") for p in args.paths[1:]))
            L.append(f"| {name} | {args.n_ctx[name]} | {r['run']} | {r['s_per_chunk']:.2f} | {others}{ratio} | "
                     f"{r['tokens_per_s']:.0f} | {_gib(r['peak_device_bytes'])} | {_gib(r['peak_host_bytes'])} |")
        L.append(f"| {name} | | model load (once per model) | {load_s:.1f} | " + "| " * len(args.paths[1:])
                 + "| | | |")
    L += ["", "Baseline dump on disk at the study's chunk count (kvarn.baseline.dump's sparse layout; random weights give "
          "near-flat log-probs, so nearly every row is stored dense: the real models' size is projected in "
          "bench/perf/results/baseline_size.md):", ""]
    for name, (_, rows) in results.items():
        d = next((r["dump_bytes_per_chunk"] for r in rows if r["run"] == "baseline" and "skipped" not in r), None)
        if d is not None:
            n = args.study_chunks.get(name, 0)
            L.append(f"* {name}: {d / 2**20:.1f} MiB per chunk, × {n} chunks = {n * d / 2**30:.2f} GiB")
    L += ["", "Projected device time of config/article.yaml (one baseline and one model load per model; "
          "each cell at its nearest measured type):", "",
          "| model | cells | study chunks | s per chunk, all cells + baseline | hours |", "|---|---|---:|---:|---:|",
          *proj, "",
          f"**Projected total: {total:.2f} device-hours**"
          + (" (of the tiny smoke models: checks the arithmetic, says nothing of the study)" if args.smoke else "")
          if total is not None else
          "**Projected total: not available** (a run was skipped or failed; see above)",
          "", f"Study chunk counts used: {args.study_chunks} (`--study-chunks`)."]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "article.md"))
    ap.add_argument("--smoke", action="store_true", help="tiny configs, n_ctx 512, CPU, fp32: checks the script")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    ap.add_argument("--text", default=None, help="wiki.test.raw (default $TEXT, else ../shared beside the checkout)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip runs that would start after this")
    ap.add_argument("--study-chunks", default=",".join(f"{k}={v}" for k, v in STUDY_CHUNKS.items()))
    ap.add_argument("--models", default=",".join(STUDY), help="comma-separated, from config/models")
    ap.add_argument("--attention", default="flex,ref",
                    help="attention paths, comma-separated: the first is measured fully and projected, the "
                         "others' s/chunk is put beside it where the budget allows (default flex,ref)")
    args = ap.parse_args(argv)
    args.paths = tuple(p for p in args.attention.split(",") if p)
    if not args.paths or any(p not in ("ref", "flex") for p in args.paths) or len(set(args.paths)) < len(args.paths):
        ap.error(f"--attention {args.attention!r}: give distinct paths from ref, flex")
    args.study_chunks = {k: int(v) for k, v in (x.split("=") for x in args.study_chunks.split(",") if x)}
    names = [m for m in args.models.split(",") if m]
    bad = [m for m in names if m not in STUDY]
    if bad:
        ap.error(f"--models: {bad} unknown; accepted: {list(STUDY)}")
    device = args.device or ("cpu" if args.smoke else "cuda")
    dtype = "float32" if args.smoke else "bfloat16"
    text = args.text or TEXT
    if not Path(text).is_file():
        ap.error(f"--text: {text} is not a file; pass wiki.test.raw (the random models only need its bytes, "
                 "but the engine verifies its sha256)")
    args.n_ctx = {m: 512 if args.smoke else STUDY[m] for m in names}
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    import torch

    import kvarn.kvcache.flex

    compile_flex = kvarn.kvcache.flex.COMPILE
    kvarn.kvcache.flex.COMPILE = compile_flex and not args.smoke  # restored below (main runs inside the tests too)
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvarn-gpu-article-") as tmp:
        work = Path(tmp)
        (work / "models").mkdir()
        try:
            for name in names:
                cfg = ROOT / "config" / "models" / f"{name}.json"
                if args.smoke:
                    cfg = tiny_config(cfg, work / f"{name}-tiny.json")
                results[name] = measure(name, f"random:{cfg}", args.n_ctx[name], device, dtype, text, deadline,
                                        work, args.paths)
        finally:
            kvarn.kvcache.flex.COMPILE = compile_flex
    proj, total = projection(results, ROOT / "config" / "article.yaml", args.study_chunks)
    md = report(results, proj, total, args, device_name, time.monotonic() - t_start)
    from kvarn.files.atomic import write_text

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text(Path(args.out), md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
