"""Steps 1 and 2 of the device run (bench/gpu/device_run.py): 1. Qwen 3.6 27B at 65,536, then 2.
Gemma 4 31B at 16,384: random weights of the study's geometry (`random:config/models/<name>.json`,
bf16, kvarn.weights.random_model), one `kvarn.run.load.Context`, then the baseline, q4_0 t128,
kvarn4 and q8_0 t0 (`RUNS`, most needed first) on one chunk on the flex path with `--compute`
(tf32-attn: TF32 dots in flex, fp32 accumulation). Each run is preceded by a warm-up of the same
code on the chunk's first 2 ubatches (compiles flex, the KVarN and fla Triton kernels): a line after
the warm-up (`phase` "warm-up": its seconds and peak memory), a line after the timed chunk (`phase`
"chunk": seconds, tokens/s, peak device and host memory, graphs dynamo still compiled in it). A run
after the first starts only where its estimate fits before the deadline: the last timed chunk's
seconds x `CHUNK_FACTOR` + `WARMUP_EST_S` (never the last run's whole time, whose warm-up compiled
what the next one reuses); the estimate is kept in its line. The engine's own building blocks run
(chunk_logprobs, the dump's encoding, kvarn.stats.metrics), not run_baseline / run_cell: the
baseline's dump is never written (random weights: its log-probs mean nothing, and at 64k it is ~16
GB dense). The baseline's rows are copied to the host as the engine does; the first `--encode-rows`
of them are encoded and packed exactly as kvarn.baseline.dump writes them (sha256 included) and kept
in memory, and that time is extrapolated to the chunk's rows (`encode_s_chunk`; the disk write
itself is not timed). The cells decode those kept rows in place of the chunk's (row r reads kept row
r mod n, the same bytes per row at random weights) and compute the per-token metrics and the summary
as run_cell does.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
import time
from pathlib import Path

from bench import REPO as ROOT
from bench.gpu.device_plan import CHUNK_FACTOR, MIN_START_S, MODELS, RUNS, SMOKE, WARMUP_EST_S
from bench.gpu.device_record import Recorder, compiled_graphs, short_error

TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "global_head_dim": 128, "num_global_key_value_heads": 1, "sliding_window": 64,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "vocab_size": 256, "vocab_size_per_layer_input": 256}
TINY_LAYERS = 8


# --- steps 1 and 2: one model, one chunk per run -------------------------------------------

class KeptRows:
    """The baseline rows kept in memory, read as a dump is: `decode(c, a, b, device)` gives rows
    a..b of the chunk, row r from kept row r mod n (n: the rows kept, all of them when the chunk
    had no more), decoded by kvarn.baseline.dump.Dump itself from the bytes the file would hold."""

    kind = "kvarn"

    def __init__(self, parts: list[bytes], lengths: list, vocab: int):
        import numpy as np

        from kvarn.baseline import dump

        lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        self.n = len(lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        payload = np.frombuffer(b"".join(parts), dtype=np.uint8)
        header = {"n_chunks": 1, "n_scored": self.n, "vocab_size": vocab, "layout": "sparse"}
        self.dump = dump.Dump(Path("<kept in memory>"), header, payload, verify=False, offsets=offsets)

    def decode(self, c: int, a: int, b: int, device=None):
        if b - a > self.n:
            raise ValueError(f"{b - a} rows asked, {self.n} kept")
        a2 = a % self.n
        a2 = min(a2, self.n - (b - a))
        return self.dump.decode(0, a2, a2 + (b - a), device)


def time_baseline(model, ids, cell, path: str, ubatch: int, encode_rows: int, sync) -> tuple[KeptRows, dict]:
    """One baseline chunk as kvarn.run.torch_engine.run_baseline computes it (the log-probs a slice at a
    time, copied to the host inside the timed forward), the first `encode_rows` rows encoded,
    packed and hashed as kvarn.baseline.dump.write_dump does, nothing written."""
    from kvarn.baseline.encoding import encode_rows as encode
    from kvarn.baseline.sparse import pack_rows
    from kvarn.run import forward
    from kvarn.vocab import scoring

    scored = scoring.scored_positions(int(ids.shape[0]))
    cache = forward.new_cache(model, cell, attention=path)
    timing = {"forward_s": 0.0, "encode_s": 0.0}
    parts, lengths, vocab, h = [], [], None, hashlib.sha256()
    t0 = time.perf_counter()
    rows = ((a, lp.cpu()) for a, lp in forward.chunk_logprobs(model, ids, cache, ubatch, scored))
    for a, host in forward.timed(rows, timing):
        vocab = int(host.shape[1])
        if a >= encode_rows:
            continue
        t = time.perf_counter()
        data, lens = pack_rows(encode(host), vocab)
        h.update(data)
        parts.append(data)
        lengths.append(lens)
        timing["encode_s"] += time.perf_counter() - t
    sync()
    timing["wall_s"] = time.perf_counter() - t0
    kept = KeptRows(parts, lengths, vocab)
    n = len(scored)
    timing["encode_rows"] = kept.n
    timing["encode_s_chunk"] = timing["encode_s"] * n / kept.n
    timing["s_per_chunk"] = timing["wall_s"] - timing["encode_s"] + timing["encode_s_chunk"]
    timing["kept_bytes"] = sum(len(p) for p in parts)
    return kept, timing


def time_cell(model, ids, cell, path: str, ubatch: int, base, sync) -> tuple[dict, dict]:
    """One cell chunk as kvarn.run.torch_engine.run_cell computes it against `base`: the forward, the
    baseline's rows decoded where the log-probs are, the per-token metrics and their summary.
    Returns (timing, the per-token columns)."""
    import numpy as np

    from kvarn.run import forward
    from kvarn.vocab import scoring
    from kvarn.stats import metrics

    scored = scoring.scored_positions(int(ids.shape[0]))
    cache = forward.new_cache(model, cell, path)
    targets = ids[scored.start + 1: scored.stop + 1]
    cols = {key: [] for key in metrics.PER_TOKEN_KEYS}
    timing = {"forward_s": 0.0, "metrics_s": 0.0}
    t0 = time.perf_counter()
    for a, lp in forward.timed(forward.chunk_logprobs(model, ids, cache, ubatch, scored), timing):
        t = time.perf_counter()
        b = a + lp.shape[0]
        tm = metrics.token_metrics(lp, base.decode(0, a, b, lp.device), targets[a:b])
        for key in cols:
            cols[key].append(tm[key])
        timing["metrics_s"] += time.perf_counter() - t
    cols = {key: np.concatenate(v) for key, v in cols.items()}
    t = time.perf_counter()
    metrics.summarize(cols)
    timing["summary_s"] = time.perf_counter() - t
    sync()
    timing["wall_s"] = timing["s_per_chunk"] = time.perf_counter() - t0
    return timing, cols


def next_run(left: float, chunk_s: float | None) -> tuple[float | None, str | None]:
    """Whether the next run of a model step starts with `left` seconds before the deadline:
    (its estimate, None) or (its estimate, why not). The estimate is `WARMUP_EST_S` + `CHUNK_FACTOR`
    x the last timed chunk's seconds (`chunk_s`; None before the first run, which starts whenever
    `MIN_START_S` is left): a warm-up's seconds, compiles included, never count."""
    est = None if chunk_s is None else WARMUP_EST_S + CHUNK_FACTOR * chunk_s
    if left < MIN_START_S or (est is not None and est > left):
        why = (f"estimated {est:.0f} s (warm-up {WARMUP_EST_S:.0f} + {CHUNK_FACTOR} x the last timed chunk's "
               f"{chunk_s:.1f} s), {left:.0f} s left" if est is not None else f"{left:.0f} s left")
        return est, why + " before the run's deadline"
    return est, None


def step_model(name: str, args, rec: Recorder) -> None:
    import torch

    import kvarn.kvcache.flex
    from kvarn.run import forward, load
    from kvarn.vocab.cell import CellSpec
    from kvarn.weights.sources import ModelSpec

    smoke = args.smoke
    kvarn.kvcache.flex.COMPILE = not smoke  # compiling on a CPU takes minutes; this process only
    device, dtype = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n_ctx = SMOKE["n_ctx"] if smoke else MODELS[name]
    ubatch = SMOKE["ubatch"] if smoke else 512
    warm_ctx = 2 * ubatch
    work = Path(tempfile.mkdtemp(prefix="kvarn-device-run-"))
    cfg = ROOT / "config" / "models" / f"{name}.json"
    if smoke:
        cfg = tiny_config(cfg, work / f"{name}-tiny.json")
    spec = ModelSpec(name, f"random:{cfg}")
    base_rec = {"step": name, "n_ctx": n_ctx, "ubatch": ubatch, "compute": args.compute}
    t = time.perf_counter()
    try:
        ctx = load.Context(spec, n_ctx, 1, text=str(args.text), device=device, dtype=dtype,
                             cache_dir=work / "models", ubatch=ubatch, baseline=True)
    except Exception as e:  # a preflight refusal or an out-of-memory: recorded, the runs with it
        rec.add({**base_rec, "item": "load", "status": "error", "error": short_error(e)})
        for label, _, kind in RUNS:
            rec.add({**base_rec, "item": label, "kind": kind, "phase": "chunk", "status": "skipped",
                     "why": "the model did not load"})
        return
    model = ctx.loaded.model
    sync()
    loaded = {**base_rec, "item": "load", "status": "ok", "s": time.perf_counter() - t,
            "source": spec.source if smoke else f"random:config/models/{name}.json",
            "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    if "linear_attention" in json.loads(cfg.read_text()).get("layer_types", []):
        loaded["linear_attention"] = linear_attention_kernel()
    rec.add(loaded)
    load.set_compute(model, spec, work / "models", args.compute)
    path = forward.attention_path("flex", device, args.compute) or "ref"
    ids = ctx.chunk_ids[0]
    base, chunk_s = None, None  # the kept baseline rows; the last timed chunk's seconds
    for label, cell_args, kind in RUNS:
        r = {**base_rec, "item": label, "kind": kind, "attention": path}
        if cell_args is not None and base is None:
            rec.add({**r, "phase": "chunk", "status": "skipped", "why": "no baseline"})
            continue
        est, why = next_run(args.deadline - time.time(), chunk_s)
        if why:
            rec.add({**r, "phase": "chunk", "status": "skipped", "why": why})
            continue
        if est is not None:
            r["est_s"] = round(est, 1)
        phase = "warm-up"
        try:
            cell = forward.baseline_cell(args.compute) if cell_args is None else CellSpec(*cell_args,
                                                                                        compute=args.compute)
            r["cell"] = cell.name

            def once(chunk):
                if cell_args is None:
                    return time_baseline(model, chunk, cell, path, ubatch, args.encode_rows, sync)
                return time_cell(model, chunk, cell, path, ubatch, base, sync)

            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            once(ids[:warm_ctx])  # compiles what this run compiles: not in the chunk's time
            sync()
            r.update({"warmup_s": time.perf_counter() - t, "warmup_ctx": warm_ctx})
            rec.add({**r, "phase": "warm-up", "status": "ok",
                     "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None})
            phase = "chunk"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            graphs = compiled_graphs()
            with PeakRSS() as rss:
                got = once(ids)
            kept, timing = got if cell_args is None else (None, got[0])
            r.update({"phase": "chunk", "status": "ok", **timing, "tokens_per_s": n_ctx / timing["forward_s"],
                      "graphs_compiled_in_chunk": None if graphs is None else compiled_graphs() - graphs,
                      "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                      "peak_host_bytes": rss.peak})
            chunk_s = timing["wall_s"]
            if kept is not None:
                base = kept
        except Exception as e:  # e.g. out of device memory: recorded with the peak reached; the next run goes on
            r.update({"phase": phase, "status": "error", "error": short_error(e),
                      "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None})
            if cuda:
                torch.cuda.empty_cache()
        rec.add(r)


def tiny_config(study_json: Path, out: Path) -> Path:
    """The study config shrunk (same architecture and layer-type pattern, 8 layers, small dims)."""
    cfg = json.loads(study_json.read_text())
    cfg.update({k: v for k, v in TINY.items() if k in cfg})
    cfg["num_hidden_layers"] = TINY_LAYERS
    types = cfg["layer_types"]
    cfg["layer_types"] = types[:TINY_LAYERS - 1] + [types[-1]]  # keep a last layer of the final type
    out.write_text(json.dumps(cfg, indent=1))
    return out


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
