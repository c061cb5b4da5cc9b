"""The teacher-forced KLD engine (DESIGN §6): the BF16 baseline dump and one cell per cache config.

Both runs go through the same cache model (`kvarn.kvcache.cache`, `kvarn.kvcache.attention`): the baseline
is the `bf16`/`bf16` cell with tail 0. Per chunk: a fresh cache, the chunk fed in
micro-batches of `ubatch` tokens, logits computed only at the scored positions (the
model's own head via `logits_to_keep`, so any final softcap or logit scaling is the
model's), log-softmax in fp32 in row slices (Gemma's 262k vocabulary would otherwise need
gigabytes), then either the dump (baseline) or per-token metrics against it (cell). What a run loads is
`kvarn.run.load`'s, the forward `kvarn.run.forward`'s; this module writes the dump, the tokens and the summary.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import polars as pl

import kvarn
import kvarn.kvcache.attention as kattn
from kvarn.vocab import scoring
from kvarn.baseline import dump
from kvarn.baseline.protocol import Baseline
from kvarn.budget import memory
from kvarn.files import identity
from kvarn.llamacpp_cpu import llamakld
from kvarn.stats import metrics
from kvarn.files.atomic import atomic_path, write_text
from kvarn.kvcache.cache import KVarnCache
from kvarn.vocab.cell import CellSpec
from kvarn.run.ahead import ahead
from kvarn.run.load import load_job, set_compute
from kvarn.run.forward import attention_path, baseline_cell, chunk_logprobs, new_cache, timed
from kvarn.vocab.options import ATTENTION_ROUNDING, COMPUTE_VERSION
from kvarn.vocab.policy import exact_share
from kvarn.weights.sources import DEFAULT_CACHE_DIR

# Log-prob slices the baseline's forward may run ahead of the dump's writer (kvarn.run.ahead: the
# host's encoding overlaps the next slices' forward); 0: one after the other, in one thread.
AHEAD = 2


def check_baseline_compute(base: Baseline, compute: str) -> None:
    """A cell scores only against a baseline of the same compute path and version
    (`kvarn.vocab.options.COMPUTE_VERSION`; dumps before those fields existed were `exact`, 1)."""
    found = base.header.get("compute", "exact")
    if found != compute:
        raise ValueError(
            f"dump {base.path}: baseline computed with compute {found!r}, this cell uses {compute!r}; "
            f"make the baseline with the same --compute")
    version = base.header.get("compute_version", 1)
    if version != COMPUTE_VERSION[compute]:
        raise ValueError(
            f"dump {base.path}: baseline computed with compute {compute!r} version {version}, this kvarn "
            f"emulates version {COMPUTE_VERSION[compute]} (kvarn.vocab.options.COMPUTE_VERSION); make the baseline again")


def progress(iterable, desc, total, unit="chunk"):
    """A tqdm bar on stderr over `iterable` (what a Snakemake job's log shows while it runs)."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=False)


# --- baseline -------------------------------------------------------------------------

def run_baseline(spec, n_ctx, chunks, out, ubatch=512, text=None, device="auto", dtype="auto",
                 cache_dir=DEFAULT_CACHE_DIR, compute="exact", llama_kld_out=None, context=None,
                 attention="auto") -> dict:
    """BF16-cache run (bf16 K and V, tail 0, same cache model); writes the log-prob dump to `out`.

    `compute`: the attention arithmetic (kvarn.llamacpp_cpu.compute), recorded in the header.
    `attention`: ref | flex | auto (`kvarn.kvcache.attention.resolve_attention`): how the exact
    compute path is computed, the same numbers at fp32 noise; the path taken is recorded in
    the header, not in the dump's identity.
    `llama_kld_out`: also write the log-probs as llama-perplexity's --kl-divergence-base
    file (kvarn.llamacpp_cpu.llamakld), so llama-perplexity can score against our baseline.
    Returns the dump header (identity fields, vocab size, timing).
    """
    cell = baseline_cell(compute)  # validates the compute path
    kattn.resolve_attention(attention, "cpu")  # a bad option is refused before any work

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    loaded, chunk_ids, ident = load_job(context, spec, n_ctx, chunks, text, device, dtype, cache_dir, ubatch, True,
                                       attention, compute)
    set_compute(loaded.model, spec, cache_dir, compute)
    model, info = loaded.model, loaded.info
    path = attention_path(attention, info.device, compute)
    scored = scoring.scored_positions(n_ctx)
    timing = {"forward_s": 0.0}

    def chunk_slices(c):
        # The chunk's log-probs a LOGIT_ROWS slice at a time, straight to the writer: the host
        # never holds a whole chunk (32 GB at Qwen 3.6's 64k). Only the forward (and the copy
        # to the host, which waits for it) is timed, not the writer.
        cache = new_cache(model, cell, attention=path or "ref")
        return timed((lp.cpu() for _, lp in chunk_logprobs(model, chunk_ids[c], cache, ubatch, scored)), timing)

    def blocks():
        for c in progress(range(chunk_ids.shape[0]), f"baseline {info.name} ctx {n_ctx}", chunk_ids.shape[0]):
            yield chunk_slices(c)

    header = dict(ident)
    header.update({
        "source": info.source,
        "vocab_size": info.vocab_size,
        "scored_start": scored.start,
        "scored_stop": scored.stop,
        "k_type": cell.k,
        "v_type": cell.v,
        "tail": cell.tail,
        "ubatch": ubatch,
        "compute": compute,
        "compute_version": COMPUTE_VERSION[compute],
        "attention": path,
        "kvarn_version": kvarn.__version__,
        "device": info.device,
    })
    # the forward runs ahead in a thread while the writer encodes (the same slices, in order)
    dump.write_dump(out, header, ahead(blocks(), AHEAD) if AHEAD else blocks())
    if llama_kld_out is not None:
        llamakld.write_from_dump(out, chunk_ids, llama_kld_out)
    n_tok = int(chunk_ids.numel())
    header["tokens_per_s"] = n_tok / timing["forward_s"] if timing["forward_s"] else float("nan")
    header["wall_s"] = time.perf_counter() - t0
    return header


# --- one cell -------------------------------------------------------------------------

def policy_fields(cache: KVarnCache) -> dict:
    """The summary's policy fields of a cell's cache: the effective tail of its full and
    sliding layers and its sink. Attention layers only: linear-attention layers have no
    KV cache and no policy."""
    full = [p for p in cache.kv_policies if p.window is None]
    sliding = [p for p in cache.kv_policies if p.window is not None]
    return {
        "tail_eff_full": full[0].tail if full else None,
        "tail_eff_sliding": max(p.tail for p in sliding) if sliding else None,
        "sink": full[0].sink if full else 0,
    }


def run_cell(spec, n_ctx, chunks, cell: CellSpec, baseline, out_dir, ubatch=512, text=None, device="auto",
             dtype="auto", cache_dir=DEFAULT_CACHE_DIR, accounting="packed", context=None, attention="auto") -> dict:
    """One cell (`kvarn.vocab.cell.CellSpec`: types, tail, options, all validated there) against
    the baseline dump; writes out_dir/tokens.parquet and summary.json.

    `context`: a loaded `Context` of the same job arguments (kvarn.run.worker), else loads now.

    `attention`: ref | flex | auto (`kvarn.kvcache.attention.resolve_attention`), how the exact
    compute path's attention is computed: the same numbers at fp32 noise, so not part of
    the cell's path; the summary records the path taken (`attention`) and the baseline's.

    `cell.compute` (kvarn.llamacpp_cpu.compute): `exact` or `llamacpp-cpu`; the baseline must have been made
    with the same. `baseline` may also be llama-perplexity's --kl-divergence-base file
    (kvarn.llamacpp_cpu.llamakld), checked against our tokens.

    Returns the summary dict (the metric keys of kvarn.stats.metrics.summarize + the cell fields;
    the KV bytes under the memory `accounting` of kvarn.budget.memory, with the geometry they
    came from, so another accounting can be computed later without a rerun).
    """
    if not isinstance(cell, CellSpec):
        raise TypeError(f"run_cell takes a kvarn.vocab.cell.CellSpec, got {cell!r}")
    compute = cell.compute
    kattn.resolve_attention(attention, "cpu")  # a bad option is refused before any work
    out_dir = Path(out_dir)
    memory.check_accounting(accounting)
    t0 = time.perf_counter()
    # A missing, foreign or truncated dump is refused before the model is even looked at.
    base: Baseline | None = (None if llamakld.is_llama_kld(baseline)
                             else (context.open_dump if context else dump.open_dump)(baseline))
    loaded, chunk_ids, ident = load_job(context, spec, n_ctx, chunks, text, device, dtype, cache_dir, ubatch, False,
                                       attention, compute)
    set_compute(loaded.model, spec, cache_dir, compute)
    model, info = loaded.model, loaded.info
    path = attention_path(attention, info.device, compute)
    # Checks the types' head dims against the model before any work is done.
    probe = new_cache(model, cell)
    if base is None:
        base = llamakld.open_llama_kld(baseline, chunk_ids, n_ctx, info.vocab_size)
    else:
        identity.check_baseline(base.header, ident, baseline,
                                identity.rebuild_command(spec, n_ctx, ident["n_chunks"], info.device, info.dtype,
                                                         baseline))
        check_baseline_compute(base, compute)
    scored = scoring.scored_positions(n_ctx)
    pos = np.arange(scored.start, scored.stop, dtype=np.int32)

    cols = {key: [] for key in metrics.PER_TOKEN_KEYS}
    chunk_col, pos_col = [], []
    timing = {"forward_s": 0.0}
    for c in progress(range(chunk_ids.shape[0]), f"{info.name} {cell.k}/{cell.v} tail {cell.tail}", chunk_ids.shape[0]):
        cache = new_cache(model, cell, path or "ref")
        targets = chunk_ids[c, scored.start + 1 : scored.stop + 1]
        for a, lp in timed(chunk_logprobs(model, chunk_ids[c], cache, ubatch, scored), timing):
            b = a + lp.shape[0]
            # the baseline's stored codes, decoded a slice at a time where the log-probs are
            tm = metrics.token_metrics(lp, base.decode(c, a, b, lp.device), targets[a:b])
            for key in cols:
                cols[key].append(tm[key])
        chunk_col.append(np.full(len(pos), c, dtype=np.int32))
        pos_col.append(pos)

    frame = pl.DataFrame({
        "chunk": np.concatenate(chunk_col),
        "pos": np.concatenate(pos_col),
        **{key: np.concatenate(cols[key]) for key in metrics.PER_TOKEN_KEYS},
    })
    summary = metrics.summarize(frame)
    kv = memory.summary_fields(info.geometry, n_ctx, cell, ubatch=ubatch, accounting=accounting)
    n_tok = int(chunk_ids.numel())
    summary.update({
        "model": info.name,
        "source": info.source,
        "revision": info.revision,
        "n_ctx": n_ctx,
        "chunks": int(chunk_ids.shape[0]),
        "ubatch": ubatch,
        "k_type": cell.k,
        "v_type": cell.v,
        "rot": cell.rot,
        "tail": cell.tail,
        "sink_requested": cell.sink,
        **policy_fields(probe),
        "exact_share": exact_share(probe.kv_policies, n_ctx),
        "tail_dtype": probe.tail_dtype_name,
        "iters": cell.iters,
        "compute": compute,
        "compute_version": COMPUTE_VERSION[compute],
        "attention": path,
        # dumps written before the option existed were all made on the reference path
        "baseline_attention": base.header.get("attention", "ref" if compute in ATTENTION_ROUNDING else None)
        if base.kind == "kvarn" else None,
        "baseline_kind": base.kind,
        **kv,
        "tokens_per_s": n_tok / timing["forward_s"],
        "wall_s": time.perf_counter() - t0,
        "kvarn_version": kvarn.__version__,
        "format_version": max(probe.k_fmt.version, probe.v_fmt.version),
        "device": info.device,
        "dtype": info.dtype,
    })
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "tokens.parquet") as tmp:
        frame.write_parquet(tmp)
    write_text(out_dir / "summary.json", json.dumps(summary, indent=1, default=json_default) + "\n")
    return summary


def json_default(x):
    """json.dumps' `default` for a summary: a numpy or torch scalar as its Python value; anything else refused."""
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
