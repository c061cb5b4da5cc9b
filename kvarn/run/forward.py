"""The forward a cell runs through, alone: a fresh cache per cell (`new_cache`), one chunk's scored log-probs
in ubatches and row slices (`chunk_logprobs`, `LOGIT_ROWS`), the time spent producing them (`timed`), the
baseline's cell (`BASELINE`, `baseline_cell`) and the attention path a run records (`attention_path`).
What the torch engine (`kvarn.run.torch_engine`), the decode and the benchmarks share; no polars, so the
GPU device run imports it on a machine without. Why: docs/notes/engine.md.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

import kvarn.kvcache.attention as kattn
from kvarn.kvcache.cache import KVarnCache
from kvarn.vocab.cell import CellSpec
from kvarn.vocab.options import ATTENTION_ROUNDING

BASELINE = CellSpec("bf16", "bf16", 0)  # the baseline is the bf16/bf16 cell at tail 0 (its compute aside)
LOGIT_ROWS = 64  # rows per log-softmax slice: 64 x 262144 x 4 B = 64 MiB at Gemma's vocabulary


@torch.inference_mode()
def chunk_logprobs(model, ids: torch.Tensor, cache: KVarnCache, ubatch: int, scored: range):
    """Yield (first scored row, fp32 log-probs [r, V]) for one chunk, `LOGIT_ROWS` rows at a time.

    ids: LongTensor [n_ctx]. The whole chunk is fed in ubatches with `cache` persisting;
    logits are computed only at the scored positions. The caller times the generator.
    """
    if not isinstance(ubatch, int) or ubatch < 1:
        raise ValueError(f"ubatch must be a positive integer, got {ubatch!r}")
    device = next(model.parameters()).device
    ids = ids.to(device)
    n = ids.shape[0]
    cache.reserve(n)  # buffers allocated once at their final size
    row = 0
    for start in range(0, n, ubatch):
        stop = min(start + ubatch, n)
        lo, hi = max(start, scored.start), min(stop, scored.stop)
        keep = torch.arange(lo - start, max(hi, lo) - start, device=device)
        out = model(input_ids=ids[None, start:stop], cache=cache, kvarn_cache=cache, use_cache=True,
                    logits_to_keep=keep)
        logits = out.logits[0]
        for a in range(0, logits.shape[0], LOGIT_ROWS):
            yield row + a, torch.log_softmax(logits[a : a + LOGIT_ROWS].float(), dim=-1)
        row += logits.shape[0]
    assert row == len(scored), (row, len(scored))


def timed(gen, timing: dict, key: str = "forward_s"):
    """Yield the items of `gen`, adding the time spent producing each to timing[key]: the
    caller's work on an item (metrics, encoding) is not counted."""
    while True:
        t = time.perf_counter()
        item = next(gen, None)
        timing[key] += time.perf_counter() - t
        if item is None:
            return
        yield item


def new_cache(model, cell: CellSpec, attention: str = "ref") -> KVarnCache:
    """A fresh `KVarnCache` for `model` and one cell: what the engine makes per chunk, and
    what the decode, layer-error and bench paths feed a model with."""
    return KVarnCache(model.config, cell, attention=attention)


def baseline_cell(compute: str = "exact") -> CellSpec:
    """The baseline's cell (bf16 K and V, tail 0) on a compute path."""
    return replace(BASELINE, compute=compute)


def attention_path(attention: str, device: str, compute: str) -> str | None:
    """The attention path a run takes (`kvarn.kvcache.attention.resolve_attention`), None under
    compute llamacpp-cpu (kvarn.llamacpp_cpu.compute has its own). What summaries and dumps record."""
    path = kattn.resolve_attention(attention, device)  # validates the option in every case
    return path if compute in ATTENTION_ROUNDING else None
