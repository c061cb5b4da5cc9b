"""Free-running greedy decode through a quantized cache: where generation leaves the baseline.

Owns: the decode prompts (`decode_prompts`), the lock-step greedy decode of a cell against
the BF16-cache baseline (`decode`), its per-prompt summary (`summarize_decode`) and the
runner that writes one (cell, decode) result (`run_decode`).

The teacher-forced KLD of `kvarn.run.engine` never lets an error feed back: every position sees
the true text. Here the cell generates its own text, one token at a time through its own
cache (so KVarN groups seal during generation, as in deployment), and the baseline re-scores
that same text in lock step through its own BF16 cache:

* prompts: the first `n_ctx − tokens` tokens of P consecutive Wikitext chunks of `n_ctx`
  tokens (BOS at position 0 as in the teacher-forced run), so prompt + generation fills
  exactly the run's context;
* step s: the cell's next-token distribution q_s and the baseline's p_s, both conditioned on
  the prompt and the cell's tokens 0..s−1; the cell emits argmax q_s, fed to both caches;
* per step: KLD(p_s ‖ q_s) (the rule of `kvarn.stats.metrics.token_metrics`), whether argmax p_s
  equals the cell's token, the baseline NLL of the cell's token;
* first divergence of a prompt: the first step whose tokens differ. Until then the prefix is
  the baseline's own greedy text, so argmax p_s is exactly the baseline's greedy token there;
  a prompt that never diverges is censored at `tokens`.

All P prompts go as one batch (no padding is needed: equal lengths). Greedy ties break to the
lowest token id (torch.argmax), the same in both runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch

import kvarn
from kvarn.stats import metrics
from kvarn.files.atomic import atomic_path, write_text
from kvarn.run.engine import attention_path, baseline_cell, new_cache, set_compute, setup
from kvarn.spec.cell import CellSpec
from kvarn.weights.sources import DEFAULT_CACHE_DIR

STEP_KEYS = ("prompt", "step", "token", "base_token", "kld", "same_top", "nll_base")


def decode_prompts(chunk_ids: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """LongTensor [P, n_ctx − n_tokens]: the first part of each chunk (kvarn.baseline.data.make_chunks)."""
    n_ctx = chunk_ids.shape[1]
    if not isinstance(n_tokens, int) or not 1 <= n_tokens <= n_ctx - 2:
        raise ValueError(f"decode tokens must be an integer in 1..{n_ctx - 2} (n_ctx {n_ctx} minus a prompt "
                         f"of at least 2 tokens), got {n_tokens!r}")
    return chunk_ids[:, : n_ctx - n_tokens]


@torch.inference_mode()
def feed(model, ids: torch.Tensor, cache, ubatch: int) -> torch.Tensor:
    """Feed ids [P, n] through `cache` in ubatches; fp32 logits [P, V] of the last position."""
    out = None
    for start in range(0, ids.shape[1], ubatch):
        out = model(input_ids=ids[:, start : start + ubatch], cache=cache, kvarn_cache=cache, use_cache=True,
                    logits_to_keep=1)
    return out.logits[:, -1].float()


@torch.inference_mode()
def decode(model, prompts: torch.Tensor, cell: CellSpec, n_tokens: int, ubatch=512, attention="ref",
           timing: dict | None = None) -> dict[str, np.ndarray]:
    """Greedy-generate `n_tokens` per prompt with the cell's cache, the BF16 baseline (on the cell's compute path)
    re-scoring the cell's text in lock step. Returns the STEP_KEYS columns, [P · n_tokens] rows
    ordered by (prompt, step). `model` must use attn_implementation "kvarn"; `attention`: the
    attention path of both caches ("ref" or "flex", `kvarn.run.engine.attention_path`).
    `timing`: if given, gets prefill_s (both prompts) and steps_s (the rest) added."""
    device = next(model.parameters()).device
    prompts = prompts.to(device)
    n_p = prompts.shape[0]
    base = new_cache(model, baseline_cell(cell.compute), attention=attention)
    cell = new_cache(model, cell, attention=attention)
    t0 = time.perf_counter()
    lc, lb = feed(model, prompts, cell, ubatch), feed(model, prompts, base, ubatch)
    t1 = time.perf_counter()
    cols = {key: [] for key in STEP_KEYS}
    for s in range(n_tokens):
        lq, lp = torch.log_softmax(lc, dim=-1), torch.log_softmax(lb, dim=-1)
        tok = lq.argmax(dim=-1)
        tm = metrics.token_metrics(lq.cpu(), lp.cpu(), tok.cpu())
        cols["prompt"].append(np.arange(n_p, dtype=np.int32))
        cols["step"].append(np.full(n_p, s, dtype=np.int32))
        cols["token"].append(tok.cpu().numpy().astype(np.int64))
        cols["base_token"].append(lp.argmax(dim=-1).cpu().numpy().astype(np.int64))
        cols["kld"].append(tm["kld"])
        cols["same_top"].append(tm["same_top"])
        cols["nll_base"].append(tm["nll_base"])
        if s + 1 < n_tokens:
            lc, lb = feed(model, tok[:, None], cell, 1), feed(model, tok[:, None], base, 1)
    out = {key: np.stack(cols[key], axis=1).reshape(-1) for key in STEP_KEYS}  # [P, G] -> (prompt, step)
    if timing is not None:
        timing["prefill_s"] = timing.get("prefill_s", 0.0) + t1 - t0
        timing["steps_s"] = timing.get("steps_s", 0.0) + time.perf_counter() - t1
    return out


def first_divergence(steps: dict[str, np.ndarray], n_prompts: int, n_tokens: int) -> np.ndarray:
    """int [P]: per prompt the first step where the cell's token differs from the baseline's
    greedy token; n_tokens where it never does (censored)."""
    diff = (np.asarray(steps["token"]) != np.asarray(steps["base_token"])).reshape(n_prompts, n_tokens)
    return np.where(diff.any(axis=1), diff.argmax(axis=1), n_tokens)


def summarize_decode(steps: dict[str, np.ndarray], n_prompts: int, n_tokens: int) -> dict:
    """Per cell: first divergence per prompt, its median (censored prompts count as n_tokens),
    the survival curve S(t) = fraction of prompts still on the baseline's text after t tokens
    (t = 0..n_tokens), KLD along the cell's own text (mean, median, mean per step) and the
    per-step agreement with the baseline's argmax."""
    fd = first_divergence(steps, n_prompts, n_tokens)
    kld = np.asarray(steps["kld"]).reshape(n_prompts, n_tokens)
    same = np.asarray(steps["same_top"]).reshape(n_prompts, n_tokens)
    t = np.arange(n_tokens + 1)
    return {
        "n_prompts": n_prompts,
        "n_tokens": n_tokens,
        "first_divergence": fd.tolist(),
        "first_divergence_median": float(np.median(fd)),
        "n_diverged": int((fd < n_tokens).sum()),
        "survival": [float((fd >= x).mean()) for x in t],
        "decode_kld_mean": float(kld.mean()),
        "decode_kld_median": float(np.median(kld)),
        "decode_kld_step_mean": kld.mean(axis=0).tolist(),
        "decode_same_top": float(same.mean()),
    }


def run_decode(spec, n_ctx, prompts, tokens, cell: CellSpec, out_dir, ubatch=512, text=None, device="auto",
               dtype="auto", cache_dir=DEFAULT_CACHE_DIR, attention="auto", context=None) -> dict:
    """One (cell, decode) result: out_dir/steps.parquet (STEP_KEYS) and out_dir/summary.json.

    `attention`: ref | flex | auto (`kvarn.kvcache.attention.resolve_attention`), recorded in the summary.
    `context`: a loaded `kvarn.run.engine.Context` of (model, n_ctx, chunks = prompts, text, ...)
    (kvarn.run.worker: the teacher-forced cells of the same chunks share it), else loads now."""
    out_dir = Path(out_dir)
    if not isinstance(cell, CellSpec):
        raise TypeError(f"run_decode takes a kvarn.spec.cell.CellSpec, got {cell!r}")
    attention_path(attention, "cpu", cell.compute)  # a bad option is refused before any work
    t0 = time.perf_counter()
    if context is None:
        loaded, chunk_ids, ident = setup(spec, n_ctx, prompts, text, device, dtype, cache_dir)
    else:  # another job's context is refused
        loaded, chunk_ids, ident = context.for_job(spec, n_ctx, prompts, text, device, dtype, cache_dir)
    if chunk_ids.shape[0] < prompts:
        raise ValueError(f"decode prompts {prompts}: the text holds only {chunk_ids.shape[0]} chunks of {n_ctx} tokens")
    p_ids = decode_prompts(chunk_ids, tokens)
    set_compute(loaded.model, spec, cache_dir, cell.compute)
    path = attention_path(attention, loaded.info.device, cell.compute)
    td = time.perf_counter()
    steps = decode(loaded.model, p_ids, cell, tokens, ubatch=ubatch, attention=path or "ref")
    decode_s = time.perf_counter() - td
    summary = summarize_decode(steps, prompts, tokens)
    info = loaded.info
    summary.update({
        "model": info.name, "source": info.source, "revision": info.revision, "n_ctx": n_ctx,
        "prompt_tokens": int(p_ids.shape[1]), "k_type": cell.k, "v_type": cell.v, "tail": cell.tail,
        "rot": cell.rot, "tail_dtype": cell.tail_dtype, "iters": cell.iters, "sink": cell.sink, "compute": cell.compute, "ubatch": ubatch, "attention": path,
        "text_sha256": ident.get("text_sha256"), "tokenizer_hash": ident.get("tokenizer_hash"), "decode_s": decode_s, "wall_s": time.perf_counter() - t0,
        "kvarn_version": kvarn.__version__, "device": info.device, "dtype": info.dtype,
    })
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "steps.parquet") as tmp:
        pl.DataFrame(steps).write_parquet(tmp)
    write_text(out_dir / "summary.json", json.dumps(summary, indent=1) + "\n")
    return summary
