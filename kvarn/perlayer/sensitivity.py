"""Per-layer sensitivity: the KLD that storing one layer's K (or V) alone in a type adds, the rest
of the cache the baseline's (BF16, tail 0), on the search text (Wikitext-2 valid).

One probe per (attention layer, role, type) (`kvarn.kvcache.cache.probe_cache`): the layer's role
stored as the type under its uniform cell's policy (sink, effective tail, exact-copy dtype), every
other layer the baseline's bit for bit. The KLD of each scored token is against the baseline's
log-probs from the same process and text (kvarn.stats.metrics.token_metrics), so a type that stores
exactly (bf16) reads 0. Recurrent layers (a hybrid model's) have no KV cache and get no probe; a
sliding-window layer is probed under its own policy (its window caps the tail), as every cell is.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import torch

from kvarn.baseline import data
from kvarn.kvcache import attention as kattn
from kvarn.kvcache.cache import probe_cache
from kvarn.run.forward import BASELINE, chunk_logprobs, new_cache
from kvarn.run.torch_engine import progress
from kvarn.vocab import scoring
from kvarn.stats import metrics

COLUMNS = ("layer", "kind", "role", "type", "kld_mean", "kld_median", "kld_p99", "tokens")


def load_search_text(loaded, path, n_ctx: int, chunks: int):
    """(chunk ids [chunks, n_ctx], text sha256) of Wikitext-2 valid, verified, cut as the cells cut theirs."""
    raw = data.load_text(path, split="validation")
    ids = data.make_chunks(data.tokenize(loaded.tokenizer, raw), n_ctx, chunks, loaded.info.bos_id)
    return ids, data.text_sha256(raw)


@torch.inference_mode()
def chunk_klds(model, chunk_ids, make_cache, base_lps, ubatch: int) -> np.ndarray:
    """Per scored token of every chunk, the KLD of the caches `make_cache()` gives against `base_lps`."""
    n_ctx = chunk_ids.shape[1]
    scored = scoring.scored_range(n_ctx)
    out = []
    for c in range(chunk_ids.shape[0]):
        targets = chunk_ids[c, scored.start + 1 : scored.stop + 1]
        for a, lp in chunk_logprobs(model, chunk_ids[c], make_cache(), ubatch, scored):
            b = a + lp.shape[0]
            out.append(metrics.token_metrics(lp, base_lps[c][a:b], targets[a:b])["kld"])
    return np.concatenate(out)


@torch.inference_mode()
def baseline_logprobs(model, chunk_ids, ubatch: int, attention: str) -> list[torch.Tensor]:
    """The baseline cache's (BF16, tail 0) log-probs at every scored position, one [n, V] tensor per chunk."""
    scored = scoring.scored_range(chunk_ids.shape[1])
    return [torch.cat([lp for _, lp in chunk_logprobs(model, chunk_ids[c], new_cache(model, BASELINE, attention),
                                                       ubatch, scored)])
            for c in range(chunk_ids.shape[0])]


def describe(kld: np.ndarray) -> dict:
    return {"kld_mean": float(kld.mean()), "kld_median": float(np.median(kld)),
            "kld_p99": float(np.quantile(kld, 0.99)), "tokens": int(kld.size)}


def measure(model, chunk_ids, type_name: str, tail: int, ubatch: int = 512, attention: str = "ref",
            base_lps=None, show_progress: bool = True) -> pl.DataFrame:
    """One row per (attention layer, role) of `model`: the KLD its probe in `type_name` adds (`COLUMNS`)."""
    if base_lps is None:
        base_lps = baseline_logprobs(model, chunk_ids, ubatch, attention)
    geom = new_cache(model, BASELINE).geometry
    jobs = [(i, r) for i in geom.kv_layers for r in ("k", "v")]
    rows = []
    it = progress(jobs, f"{type_name} per layer", len(jobs), unit="probe") if show_progress else jobs
    for i, role in it:
        kld = chunk_klds(model, chunk_ids, lambda: probe_cache(model.config, i, role, type_name, tail, attention),
                         base_lps, ubatch)
        rows.append({"layer": i, "kind": geom.layers[i].kind, "role": role, "type": type_name, **describe(kld)})
    return pl.DataFrame(rows, schema_overrides={"layer": pl.Int32, "tokens": pl.Int64}).select(COLUMNS)
