"""Free-running decode through a quantized cache: where generation leaves the baseline.

Owns the decode prompts (`decode_prompts`), the token choice (`choose`: greedy, or Gumbel-max
sampled with the shared noise of `gumbel`), the decode of a cell that the BF16-cache baseline
re-scores in blocks of `block_steps` steps (`decode`), the first divergence and per-prompt
summary (`first_divergence`, `summarize_decode`) and the runner that writes one (cell, decode)
result (`run_decode`); the result's columns `STEP_KEYS` and `TIMING_KEYS`.

Why (prompts, per-step metrics, common random numbers, the block path and the noise it adds
against lock step, `DECODE_VERSION`): docs/notes/decode.md.
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
from kvarn.run.forward import attention_path, baseline_cell, new_cache
from kvarn.run.load import set_compute, setup
from kvarn.run.torch_engine import progress
from kvarn.vocab.cell import CellSpec
from kvarn.vocab.options import DECODE_VERSION, check_sampling, sampling_label, sampling_name
from kvarn.weights.sources import DEFAULT_CACHE_DIR

STEP_KEYS = ("prompt", "step", "token", "base_token", "kld", "same_top", "nll_base")
# the summary's wall-clock fields: what two runs of the same decode may differ in
TIMING_KEYS = ("wall_s", "decode_s", "prefill_s", "steps_s", "cell_s", "base_s", "metrics_s", "step_ms")
# One block's fp32 vocabulary rows, each of the three arrays alive at once (the cell's log-probs,
# the baseline's logits and log-probs, P x B x V x 4 bytes each; four when sampled: the block's
# Gumbel noise), stay within this: at most 4 x 128 MiB, no more than one teacher-forced ubatch of
# 512 positions at Gemma 3's 262k vocabulary (512 MiB).
BLOCK_BYTES = 128 * 2**20


def block_steps(n_prompts: int, vocab: int, n_tokens: int, ubatch: int, budget: int = BLOCK_BYTES) -> int:
    """Decode steps per block: the most whose fp32 log-probs [P, B, V] fit `budget` bytes, at least 1,
    at most `n_tokens` and `ubatch` (the baseline takes a block in one forward of B tokens)."""
    for name, x in (("n_prompts", n_prompts), ("vocab", vocab), ("n_tokens", n_tokens), ("ubatch", ubatch),
                    ("budget", budget)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"block_steps: {name} must be a positive integer, got {x!r}")
    return max(1, min(budget // (4 * n_prompts * vocab), n_tokens, ubatch))


def decode_prompts(chunk_ids: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """LongTensor [P, n_ctx − n_tokens]: the first part of each chunk (kvarn.baseline.data.make_chunks)."""
    n_ctx = chunk_ids.shape[1]
    if not isinstance(n_tokens, int) or not 1 <= n_tokens <= n_ctx - 2:
        raise ValueError(f"decode tokens must be an integer in 1..{n_ctx - 2} (n_ctx {n_ctx} minus a prompt "
                         f"of at least 2 tokens), got {n_tokens!r}")
    return chunk_ids[:, : n_ctx - n_tokens]


def gumbel(gen: torch.Generator, shape) -> torch.Tensor:
    """Standard Gumbel noise −log(−log u) as float32 [shape], u ~ U[0, 1) drawn in float64 from the
    CPU generator `gen` (u = 0 has probability 2^-53; a float32 u would give −inf ~ once per
    2^24 draws, a token made unpickable)."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    return (-torch.log(-torch.log(u))).float()


def choose(logp: torch.Tensor, temperature: float = 0.0, noise: torch.Tensor | None = None) -> torch.Tensor:
    """The decode's token per row of logp [..., V]: argmax (temperature 0), else the Gumbel-max
    sample argmax(logp / temperature + noise), noise [..., V] from `gumbel`. Ties: the lowest id."""
    if temperature == 0:
        return logp.argmax(dim=-1)
    if noise is None or noise.shape != logp.shape:
        raise ValueError(f"a sampled choice (temperature {temperature}) needs Gumbel noise of the log-probs' shape "
                         f"{tuple(logp.shape)}, got {None if noise is None else tuple(noise.shape)}")
    return (logp / temperature + noise).argmax(dim=-1)


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
           timing: dict | None = None, block: int | None = None, desc: str | None = None,
           temperature: float = 0.0, seed: int = 0) -> dict[str, np.ndarray]:
    """Generate `n_tokens` per prompt with the cell's cache, the BF16 baseline (on the cell's compute path)
    re-scoring the cell's text in blocks of `block` steps (None: `block_steps`; 1: lock step).
    `temperature` 0: greedy; T > 0: sampled at T with the Gumbel noise of a generator seeded with
    `seed` (docs/notes/decode.md, "Sampled decoding"; `kvarn.vocab.options.check_sampling` names the accepted values).
    Returns the STEP_KEYS columns, [P · n_tokens] rows ordered by (prompt, step). `model` must use
    attn_implementation "kvarn"; `attention`: the attention path of both caches ("ref" or "flex",
    `kvarn.run.forward.attention_path`). `timing`: if given, gets prefill_s (both prompts), steps_s
    (the rest; of it: cell_s the cell's steps, base_s the baseline's block forwards, metrics_s)
    added, and block (the steps per block) set. `desc`: if given, a progress bar of the generated
    steps with that label."""
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"decode block must be a positive integer (steps per baseline forward) or None, got {block!r}")
    temperature, seed = check_sampling(temperature, seed)
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    device = next(model.parameters()).device
    prompts = prompts.to(device)
    n_p = prompts.shape[0]
    base = new_cache(model, baseline_cell(cell.compute), attention=attention)
    cell = new_cache(model, cell, attention=attention)
    n_ctx = prompts.shape[1] + n_tokens
    base.reserve(n_ctx)
    cell.reserve(n_ctx)
    clock = {"cell_s": 0.0, "base_s": 0.0, "metrics_s": 0.0}
    t0 = time.perf_counter()
    lc, lb = feed(model, prompts, cell, ubatch), feed(model, prompts, base, ubatch)
    t1 = time.perf_counter()
    B = block or block_steps(n_p, lc.shape[-1], n_tokens, ubatch)
    toks, blocks = [], []
    bar = progress(None, desc, n_tokens, unit="step") if desc is not None else None
    for a in range(0, n_tokens, B):
        b = min(a + B, n_tokens)
        t = time.perf_counter()
        lq = torch.empty(n_p, b - a, lc.shape[-1], dtype=torch.float32, device=device)
        noise = None if gen is None else torch.empty_like(lq)
        for s in range(a, b):  # the cell alone, one token at a time: the tokens of a lock-step run
            lq[:, s - a] = torch.log_softmax(lc, dim=-1)
            if noise is not None:  # step s's draw, in step order whatever the block size
                noise[:, s - a] = gumbel(gen, (n_p, lc.shape[-1])).to(device)
            toks.append(choose(lq[:, s - a], temperature, None if noise is None else noise[:, s - a]))
            if s + 1 < n_tokens:
                lc = feed(model, toks[-1][:, None], cell, 1)
            if bar is not None:
                bar.update()
        t2 = time.perf_counter()
        # The baseline's log-probs of steps a..b-1: it has read the prompt and tokens ..a-2; one
        # forward of tokens a-1..b-2 (block 0: the prefill gave step 0; tokens 0..b-2).
        fed = torch.stack(toks[max(a - 1, 0) : b - 1], dim=1) if b - 1 > max(a - 1, 0) else None
        rows = [lb[:, None]] if a == 0 else []
        if fed is not None:
            out = model(input_ids=fed, cache=base, kvarn_cache=base, use_cache=True, logits_to_keep=0)
            rows.append(out.logits.float())
            del out
        lp = torch.log_softmax(torch.cat(rows, dim=1) if len(rows) > 1 else rows[0], dim=-1)
        del rows
        t3 = time.perf_counter()
        tok = torch.stack(toks[a:b], dim=1)
        tm = metrics.token_metrics(lq.reshape(-1, lq.shape[-1]), lp.reshape(-1, lp.shape[-1]), tok.reshape(-1))
        blocks.append({
            "token": tok.cpu().numpy().astype(np.int64),
            "base_token": choose(lp, temperature, noise).cpu().numpy().astype(np.int64),
            **{key: tm[key].reshape(n_p, b - a) for key in ("kld", "same_top", "nll_base")},
        })
        del lq, lp, noise
        t4 = time.perf_counter()
        for key, dt in (("cell_s", t2 - t), ("base_s", t3 - t2), ("metrics_s", t4 - t3)):
            clock[key] += dt
    if bar is not None:
        bar.close()
    steps = np.arange(n_tokens, dtype=np.int32)
    out = {"prompt": np.repeat(np.arange(n_p, dtype=np.int32), n_tokens), "step": np.tile(steps, n_p)}
    for key in STEP_KEYS[2:]:  # [P, G] -> (prompt, step)
        out[key] = np.concatenate([blk[key] for blk in blocks], axis=1).reshape(-1)
    if timing is not None:
        timing["prefill_s"] = timing.get("prefill_s", 0.0) + t1 - t0
        timing["steps_s"] = timing.get("steps_s", 0.0) + time.perf_counter() - t1
        for key, v in clock.items():
            timing[key] = timing.get(key, 0.0) + v
        timing["block"] = B
    return out


def first_divergence(steps: dict[str, np.ndarray], n_prompts: int, n_tokens: int) -> np.ndarray:
    """int [P]: per prompt the first step where the cell's token differs from the baseline's
    choice (`base_token`: its greedy token, or its sample from the same noise); n_tokens where it
    never does (censored)."""
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
               dtype="auto", cache_dir=DEFAULT_CACHE_DIR, attention="auto", context=None, block=None,
               temperature=0.0, seed=0) -> dict:
    """One (cell, decode) result: out_dir/steps.parquet (STEP_KEYS) and out_dir/summary.json.

    `attention`: ref | flex | auto (`kvarn.kvcache.attention.resolve_attention`), recorded in the summary.
    `context`: a loaded `kvarn.run.load.Context` of (model, n_ctx, chunks = prompts, text, ...)
    (kvarn.run.worker: the teacher-forced cells of the same chunks share it), else loads now.
    `block`: decode steps the baseline scores in one forward (`decode`: None from `block_steps`,
    1 lock step), recorded in the summary. `temperature`, `seed`: how tokens are chosen (`decode`;
    0: greedy), recorded in the summary with `sampling` (`kvarn.vocab.options.sampling_name`)."""
    out_dir = Path(out_dir)
    if not isinstance(cell, CellSpec):
        raise TypeError(f"run_decode takes a kvarn.vocab.cell.CellSpec, got {cell!r}")
    attention_path(attention, "cpu", cell.compute)  # a bad option is refused before any work
    temperature, seed = check_sampling(temperature, seed)
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
    timing: dict = {}
    steps = decode(loaded.model, p_ids, cell, tokens, ubatch=ubatch, attention=path or "ref", timing=timing,
                   block=block, temperature=temperature, seed=seed,
                   desc=f"{loaded.info.name} decode {cell.k}/{cell.v} tail {cell.tail}"
                        + ("" if temperature == 0 else f", {sampling_label(temperature, seed)}"))
    decode_s = time.perf_counter() - td
    summary = summarize_decode(steps, prompts, tokens)
    info = loaded.info
    summary.update({
        "model": info.name, "source": info.source, "revision": info.revision, "n_ctx": n_ctx,
        "prompt_tokens": int(p_ids.shape[1]), "k_type": cell.k, "v_type": cell.v, "tail": cell.tail,
        "rot": cell.rot, "tail_dtype": cell.tail_dtype, "iters": cell.iters, "sink": cell.sink, "compute": cell.compute, "ubatch": ubatch, "attention": path,
        "text_sha256": ident.get("text_sha256"), "tokenizer_hash": ident.get("tokenizer_hash"), "decode_s": decode_s,
        "decode_version": DECODE_VERSION, "block": timing["block"], "wall_s": time.perf_counter() - t0,
        "temperature": temperature, "seed": seed if temperature > 0 else None,
        "sampling": sampling_name(temperature, seed),
        # where decode_s went: both caches' prefills, then the steps (the cell's, the baseline's
        # block forwards, the metrics); step_ms = the steps' time per generated step
        **{k: timing[k] for k in ("prefill_s", "steps_s", "cell_s", "base_s", "metrics_s")},
        "step_ms": 1000 * timing["steps_s"] / tokens,
        "kvarn_version": kvarn.__version__, "device": info.device, "dtype": info.dtype,
    })
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "steps.parquet") as tmp:
        pl.DataFrame(steps).write_parquet(tmp)
    write_text(out_dir / "summary.json", json.dumps(summary, indent=1) + "\n")
    return summary
