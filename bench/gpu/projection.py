"""The article's GPU-hours before the device: FLOPs and bytes per token from the models'
geometry, a stated attainable fraction of an H100 / H200, a roofline per part.

    python -m bench.gpu.projection [--device h200|h100] [--compute bf16-attn|tf32-attn] [--out FILE]

Torch-free and fast: the device script (bench/gpu/article.py's successor) imports it, passes
the seconds per chunk it measured (`project(measured=...)`) and gets the same table with
measured rows in place of modelled ones.

What is counted (per forward token of a chunk; parts that run only at the scored second half
of the chunk are scaled by n_scored / n_ctx): see `per_token`. Each part is timed as a roofline,
max(FLOPs / (peak x its compute fraction), bytes / (HBM x its memory fraction)), or, for work
with a stated rate instead (the baseline's log-probs to the host and their encoding there, the
GPU waiting; the cells' dump reads; KVarN's Triton quantization, measured), bytes at that rate.
A cell kind's seconds per chunk are the mean over that kind's article cells (their tails
differ); `project` adds a fixed overhead per cell and one model load per model. The attention's
arithmetic is the article's own (its cells' `compute`, `article_compute`) unless one is given; only
bf16-attn and tf32-attn are modelled (exact, fp32 attention off the tensor cores, is not: an article
on it is projected under FALLBACK_COMPUTE, and the result says so in its `note`).

Every constant below says where it comes from: a datasheet, a count (the bytes per element of
the cache update, the flex mask and the KLD were counted on CPU by summing the bytes of every
non-view aten op's inputs and outputs under a TorchDispatchMode: the figures of a GPU's eager
ops are the same ops'), a measurement (bench/gpu/results/kvarn_gpu.md, bench/perf/results/
baseline_size.md), or an assumption named as such. docs/notes/scale.md, "Projection (before the
device)", gives the derivation and the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import yaml

from bench import REPO
from bench.gpu.article import STUDY_CHUNKS
from kvarn.plan import matrix as kvm
from kvarn.spec import facts, scoring
from kvarn.spec.geometry import Geometry, geometry_from_config
from kvarn.spec.policy import layer_policy

ARTICLE = REPO / "config" / "article.yaml"
MODELS = REPO / "config" / "models"
GOAL_HOURS = 8.0  # issue 42: the article on one H200 in at most this many hours
KINDS = ("baseline", "standard t0", "standard tail", "kvarn")
FIXED = "per-cell fixed overhead"  # the part name of CELL_FIXED_S in `project`'s breakdown

# Peak dense bf16 tensor-core FLOP/s and HBM bytes/s from NVIDIA's datasheets (SXM parts; the
# 1979 TFLOP/s printed there is with 2:4 sparsity), and the attainable fractions assumed:
#   gemm       0.45: cuBLAS bf16 GEMMs of a 512-token ubatch against 5-17k-wide weights reach
#              ~55-70 % of peak alone; eager PyTorch adds the model's elementwise kernels (norms,
#              activations, RoPE, residuals) between them, which this fraction absorbs.
#   attention  0.30 at head dim <= 256, 0.15 at 512: flex_attention's Triton kernel (bf16 in,
#              fp32 accumulation) is published at ~85-90 % of FlashAttention-2's forward, itself
#              ~35-40 % of peak at head dim 128; larger head dims need smaller tiles (Gemma 4's
#              global 512 may need reduced kernel_options), so half again there.
#   linear     0.15: fla's chunked gated-delta-rule kernels: 64-token chunks, small matmuls.
#   hbm        0.75: eager elementwise kernels over large tensors reach ~70-80 % of peak bandwidth.
DEVICES = {
    "h100": {"name": "NVIDIA H100 SXM", "peak_flops": 989e12, "hbm_Bps": 3.35e12},
    "h200": {"name": "NVIDIA H200 SXM", "peak_flops": 989e12, "hbm_Bps": 4.8e12},
}
for _d in DEVICES.values():
    _d["fraction"] = {"gemm": 0.45, "attention": 0.30, "attention_d512": 0.15, "linear": 0.15, "hbm": 0.75}
    # compute tf32-attn: the same kernels' efficiency on TF32 tensor cores, whose dense peak is half
    # the bf16 one (494.7 of 989 TFLOP/s), stated against the bf16 peak
    _d["fraction"].update(attention_tf32=0.15, attention_d512_tf32=0.075)
ATTENTION_COMPUTES = ("bf16-attn", "tf32-attn")  # the arithmetic the article's attention runs in (kvarn.spec.options)
# What an article on an unmodelled compute (exact) is projected under: the GPU path whose own KLD is
# below every format's (bench/perf/results/attn_rounding_tf32_truncP.md, P read as the kernel reads it)
FALLBACK_COMPUTE = "tf32-attn"

# The host side (the same on both nodes: 16 cores, PCIe gen 5):
#   d2h_Bps      12 GB/s: `lp.cpu()` of pageable memory (pinned would reach ~50).
#   encode_Bps   0.5 GB/s of fp32 log-probs: kvarn.baseline.encoding.encode_rows + sparse.pack_rows
#                measured 0.08 GB/s here (2 cores at load ~4.6, 13.3 ms per 262,144-entry row),
#                assumed x6 on the node's 16 cores (torch's intra-op threads, not linear).
#   read_Bps     5 GB/s: the cells' memory-mapped sparse dump (8 GB per model: page cache after
#                the first cell).
#   kvarn_Bps    41 GB/s of fp32 K/V input: KVarN's Triton quantize+pack on the H200
#                (bench/gpu/results/kvarn_gpu.md, 128x128 tiles; compute-bound, ~1 % of the
#                copy bandwidth, taken as the same on the H100).
HOST = {"d2h_Bps": 12e9, "encode_Bps": 0.5e9, "read_Bps": 5e9, "kvarn_Bps": 41e9}

# Bytes moved per element, counted on CPU (see the module doc):
UPDATE_BYTES = {"baseline": 109, "standard": 255, "kvarn": 110}  # KVarnCache.update per K/V element
# (bf16 baseline: the fp32 widening, its checks, the bf16 body; standard: q8_0 t0 263, q4_0 t128 252,
# q8_0/q6_0 289, q5_1/q4_1 215, q3_0/q2_0 t1024 252; KVarN: its staging and exact copy like the
# baseline's, the quantization itself at HOST["kvarn_Bps"])
CONCAT_BYTES = {"none": 0, "body": 6, "body+exact": 14}  # kvarn.kvcache.flex.attention per body row element:
# the bf16 baseline's keys pass as they are; an fp32 body is rounded to bf16 (4 read + 2 written); with
# an exact copy both are concatenated into 2L bf16 rows (+ 2 + 2 read, 4 written)
CONCAT_BYTES_TF32 = {"none": 6, "body": 0, "body+exact": 22}  # the same under tf32-attn, fp32 operands:
# the bf16 baseline's keys widened to fp32 (2 read + 4 written); an fp32 body passes as it is; with an
# exact copy the 16-bit copy widened (2 + 4) and both concatenated into 2L fp32 rows (4 + 4 read, 8 written)
TF32_ROUND_BYTES = 42  # kvarn.kvcache.rounding.round_operand per fp32 element, every call, on Q, K and V:
# the magnitude word (4 read + 4 written), its finite test (4 + 1), the word plus half a step (4 + 4),
# masked (4 + 4), the result chosen where finite (1 + 4 + 4 read, 4 written), counted as UPDATE_BYTES were
QUERY_WIDEN_BYTES = 6  # tf32-attn: the model's bf16 queries widened to fp32 before rounding (2 read + 4 written)
MASK_BUILD_BYTES = 48  # create_block_mask's dense mask_mod per (query, key row) element
MASK_CHECK_BYTES = 50  # flex.check_mask per (query, key) element
LOGSOFTMAX_BYTES = 14  # log_softmax(logits.float()) per vocabulary entry (bf16 logits)
SOFTCAP_BYTES = 12  # a final logit softcap (divide, tanh, multiply on bf16) per entry
KLD_BYTES = 32 + 38  # dump.decode on the device (bitmap expanded) + metrics.token_metrics, per entry
# The baseline's entries above the 16-nat floor, as a share of the vocabulary: Gemma 3 270M's
# measured mean, 12,812 of 262,144 (bench/perf/results/baseline_size.md; the real models' is unknown).
NONZERO_SHARE = 12812 / 262144

QUERY_BLOCK = 128  # flex_attention's tile (queries and keys)
EDGE_KEYS = QUERY_BLOCK // 2  # keys computed past a mask edge per query (one diagonal tile, aligned)
DELTA_CHUNK = 64  # fla's chunk length for the gated delta rule
UBATCH = 512  # config/article.yaml's ubatch
CELL_FIXED_S = 10.0  # per cell: the Snakemake job, the worker request, writing per-token parquet + summary
LOAD_DISK_Bps = 2e9  # model load: safetensors shards from local NVMe, bf16
COMPILE_S = 120.0  # flex_attention compiled once per process and head dim (22-122 s per dim on CPU)


# ----------------------------------------------------------------------------- the models


def config(model: str) -> dict:
    """config/models/<model>.json: the study model's decoder config."""
    return json.loads((MODELS / f"{model}.json").read_text())


def geometry(cfg: dict) -> Geometry:
    """kvarn.spec.geometry's reading of a config.json dict without transformers: the one
    override it takes from transformers' config class is Gemma 4's, whose full layers use
    `global_head_dim` and (with attention_k_eq_v) `num_global_key_value_heads`
    (Gemma4TextConfig.per_layer_config); tests check it against geometry_from_config(dict)."""
    over = {}
    if "global_head_dim" in cfg:
        over = {"head_dim": cfg["global_head_dim"]}
        if cfg.get("attention_k_eq_v", True) and cfg.get("num_global_key_value_heads"):
            over["num_key_value_heads"] = cfg["num_global_key_value_heads"]
    c = SimpleNamespace(**cfg)
    if over:
        c.per_layer_config = [SimpleNamespace(**(over if t == "full_attention" else {})) for t in cfg["layer_types"]]
    return geometry_from_config(c)


def gemm_params(cfg: dict, geom: Geometry) -> int:
    """Weights of the decoder layers' matmuls (the lm head apart), from the config: attention's
    q/k/v/o (Qwen's q doubled by its output gate; no v where Gemma 4 feeds K as V), Gated
    DeltaNet's in/out projections, the gated MLP."""
    h, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    total = 0
    for layer in geom.layers:
        total += 3 * h * cfg["intermediate_size"]
        if layer.has_kv:
            d, kv = layer.head_dim, layer.n_kv_heads
            q = n_heads * d * (2 if cfg.get("attn_output_gate") else 1)
            total += h * q + h * kv * d * (1 if layer.k_eq_v else 2) + n_heads * d * h
        else:
            k, v = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"], \
                cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
            total += h * (2 * k + v) + h * v + 2 * h * cfg["linear_num_value_heads"] + v * h
    return total


def cell_policy(cell: tuple[str, str, int] | None, window: int | None):
    """(sink, tail, exact copy kept, body dtype bytes) of one layer for a cell (k, v, tail), None
    the baseline (bf16, tail 0). kvarn.spec.policy.layer_policy over the type facts."""
    if cell is None:
        return 0, 0, False, 2
    k, v, tail = cell
    pol = layer_policy(facts.get(k), facts.get(v), tail, window)
    return pol.sink, pol.tail, bool(pol.sink or pol.tail), 4


def _calls(n_ctx: int, ubatch: int, window: int | None):
    """Per ubatch call of a layer: (queries, body rows L it attends over)."""
    for start in range(0, n_ctx, ubatch):
        stop = min(start + ubatch, n_ctx)
        yield stop - start, stop if window is None else min(stop, window - 1 + (stop - start))


def _visible(n_ctx: int, window: int | None) -> float:
    """Mean keys a query of a chunk may read: (n + 1) / 2 causal, min(p + 1, W) sliding."""
    if window is None or window >= n_ctx:
        return (n_ctx + 1) / 2
    return (window * (window + 1) / 2 + (n_ctx - window) * window) / n_ctx


def _edges(window: int | None, tail: int, exact: bool) -> int:
    """Mask edges a query row crosses in flex's tiles: the causal diagonal, a window's lower
    edge, and with an exact copy the band edge p - tail in both halves (a sink is tile-aligned;
    a tail that covers the window leaves the body half empty)."""
    base = 1 + (window is not None)
    if not exact or tail == 0:
        return base
    return base if window is not None and tail >= window else base + 2


def per_token(model: str, n_ctx: int, kind: str = "baseline", cell: tuple[str, str, int] | None = None,
              ubatch: int = UBATCH, compute: str = "bf16-attn") -> dict[str, dict]:
    """FLOPs and bytes per forward token of one chunk, by part: {part: {"flops", "bytes",
    "unit"}} where unit names the fraction the part runs at (DEVICES' "fraction" keys, or
    "rate" for work timed at a HOST rate, its seconds per token under "rate_s").

    `kind` (KINDS) and `cell` (k, v, tail; default the kind's plainest article cell: bf16 for the
    baseline, q8_0 t0, q4_0 t128, kvarn4) choose the cache's work and the dump's direction.
    `compute` (ATTENTION_COMPUTES): the attention on bf16 operands, or on fp32 ones read as TF32
    (half the tensor-core rate, K/V tiles of 4 bytes; the fp32 [body ; exact] rows staged with
    CONCAT_BYTES_TF32 and Q, K and V rounded to TF32 every call, TF32_ROUND_BYTES per element).
    """
    if compute not in ATTENTION_COMPUTES:
        raise ValueError(f"compute {compute!r}: expected one of {ATTENTION_COMPUTES}")
    tf32 = compute == "tf32-attn"
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {KINDS}")
    cell = cell if kind != "baseline" else None
    if kind != "baseline" and cell is None:
        cell = {"standard t0": ("q8_0", "q8_0", 0), "standard tail": ("q4_0", "q4_0", 128),
                "kvarn": ("kvarn4", "kvarn4", 0)}[kind]
    cfg = config(model)
    geom = geometry(cfg)
    h, n_heads, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    scored = scoring.n_scored(n_ctx) / n_ctx  # share of a chunk's tokens with logits
    parts = {}

    def add(name, flops=0.0, nbytes=0.0, unit="hbm", rate_s=0.0):
        p = parts.setdefault(name, {"flops": 0.0, "bytes": 0.0, "unit": unit, "rate_s": 0.0})
        p["flops"] += flops
        p["bytes"] += nbytes
        p["rate_s"] += rate_s

    w = gemm_params(cfg, geom)
    # every ubatch reads every weight once (bf16)
    add("weights' GEMMs", 2 * w, 2 * w / ubatch, "gemm")
    kv_elems = 0  # K and V elements stored per token
    # kvarn.kvcache.flex builds a ubatch's BlockMask once per layer kind (window), not per layer
    same_kind = Counter(layer.window for layer in geom.layers if layer.has_kv)
    for layer in geom.layers:
        if not layer.has_kv:
            hk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
            hv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
            conv = 2 * hk * dk + hv * dv
            # per value head: the state S (dk x dv) read, updated and applied (3 x 2 dk dv), the
            # intra-chunk scores and WY terms (~4 C (dk + dv)); the causal depthwise conv
            flops = hv * (6 * dk * dv + 4 * DELTA_CHUNK * (dk + dv)) + 2 * conv * cfg["linear_conv_kernel_dim"]
            add("Gated DeltaNet", flops, 4 * (conv + hv * dv) * 4, "linear")  # fp32 q/k/v/out, ~4 passes
            continue
        sink, tail, exact, body_bytes = cell_policy(cell, layer.window)
        d, kv = layer.head_dim, layer.n_kv_heads
        keys = _visible(n_ctx, layer.window) + EDGE_KEYS * _edges(layer.window, tail, exact)
        name = "sliding attention" if layer.window else "full attention"
        unit = ("attention_d512" if d > 256 else "attention") + ("_tf32" if tf32 else "")
        # QK and PV: 2 x 2 d FLOPs per (query head, key); K and V tiles read once per query tile
        # and KV head (the GQA group's query heads served from L2), bf16 (fp32 under TF32)
        add(name, 4 * d * n_heads * keys, keys * kv * d * 2 * (4 if tf32 else 2) / QUERY_BLOCK, unit)
        calls = list(_calls(n_ctx, ubatch, layer.window))
        rows = sum(L for _, L in calls) / n_ctx  # body rows per token, over the chunk's calls
        pairs = sum(q * L for q, L in calls) / n_ctx  # (query, key) pairs the mask covers per token
        concat = "body+exact" if exact else ("body" if body_bytes == 4 else "none")
        add("flex mask and K/V staging", 0,
            pairs * (MASK_CHECK_BYTES + MASK_BUILD_BYTES * (2 if exact else 1) / same_kind[layer.window])
            + rows * kv * d * (1 if layer.k_eq_v else 2) * (CONCAT_BYTES_TF32 if tf32 else CONCAT_BYTES)[concat])
        if tf32:
            # kvarn.kvcache.flex rounds Q and both K and V (a K-as-V layer's too: two tensors) over
            # every row the call passes, [body ; exact] (2L) with an exact copy, every call
            add("TF32 operand rounding", 0, rows * (2 if exact else 1) * kv * d * 2 * TF32_ROUND_BYTES
                + n_heads * d * (QUERY_WIDEN_BYTES + TF32_ROUND_BYTES))
        kv_elems += kv * d * (1 if layer.k_eq_v else 2)
    if kind == "baseline":
        add("KV cache write", 0, kv_elems * UPDATE_BYTES["baseline"])
    elif kind == "kvarn":
        add("KV cache write", 0, kv_elems * UPDATE_BYTES["kvarn"])
        add("KVarN quantize (Triton)", unit="rate", rate_s=kv_elems * 4 / HOST["kvarn_Bps"])
    else:
        add("KV cache write", 0, kv_elems * UPDATE_BYTES["standard"])
    add("lm head", 2 * h * vocab * scored, (2 * h * vocab / ubatch + 2 * vocab) * scored, "gemm")
    add("log-softmax", 0, vocab * scored * (LOGSOFTMAX_BYTES + (SOFTCAP_BYTES if cfg.get("final_logit_softcapping")
                                                                 else 0)))
    sparse_row = vocab / 8 + 2 * NONZERO_SHARE * vocab + 16  # bitmap, nonzero codes, scale/floor, offset
    if kind == "baseline":
        add("dump: log-probs to the host", unit="rate", rate_s=4 * vocab * scored / HOST["d2h_Bps"])
        add("dump: encode on the host", unit="rate", rate_s=4 * vocab * scored / HOST["encode_Bps"])
    else:
        add("KLD against the baseline", 0, vocab * scored * KLD_BYTES)
        add("dump: read (memory-mapped)", unit="rate", rate_s=sparse_row * scored / HOST["read_Bps"])
    return parts


def part_seconds(part: dict, device: str = "h200") -> float:
    """Seconds per token of one part: its roofline on `device`, or its seconds at a stated rate."""
    if part["unit"] == "rate":
        return part["rate_s"]
    dev = DEVICES[device]
    f = dev["fraction"]
    compute = part["flops"] / (dev["peak_flops"] * f[part["unit"]]) if part["flops"] else 0.0
    memory = part["bytes"] / (dev["hbm_Bps"] * f["hbm"])
    return max(compute, memory)


# ----------------------------------------------------------------------------- the article


def kind_of(cell) -> str:
    """An article cell's kind: "kvarn" with a KVarN K or V type, else standard at tail 0 or > 0."""
    if facts.pair_family(cell.k, cell.v) == "kvarn":
        return "kvarn"
    return "standard t0" if cell.tail == 0 else "standard tail"


def article_cells(article: Path = ARTICLE) -> dict[str, dict[str, list]]:
    """model -> kind -> its cells (kvarn.plan.matrix.expand of the article config)."""
    m = kvm.expand(yaml.safe_load(Path(article).read_text()))
    out = {name: {k: [] for k in KINDS[1:]} for name in m.models}
    for c in m.cells:
        out[c.model][kind_of(c)].append(c)
    return out


def article_compute(article: Path = ARTICLE) -> str:
    """The attention arithmetic config/article.yaml's cells run (their `compute`; ValueError for a mix)."""
    computes = {c.compute for kinds in article_cells(article).values() for cells in kinds.values() for c in cells}
    if len(computes) != 1:
        raise ValueError(f"{article}: its cells run computes {sorted(computes)}; the projection takes one")
    return computes.pop()


def resolve_compute(compute: str | None, article: Path = ARTICLE) -> tuple[str, str | None]:
    """(the compute to project, a note or None): `compute` as given; None: the article's, or
    FALLBACK_COMPUTE with a note where the article runs one the projection does not model."""
    if compute is not None:
        return compute, None
    own = article_compute(article)
    if own in ATTENTION_COMPUTES:
        return own, None
    return FALLBACK_COMPUTE, (f"{Path(article).name} runs compute {own!r}, which this does not model (fp32 attention "
                              f"off the tensor cores); projected under {FALLBACK_COMPUTE}, the path its cells would "
                              "need to run on for these hours")


def plan(article: Path = ARTICLE, study_chunks: dict | None = None) -> dict[str, dict[str, dict]]:
    """Per model, per kind: cells, chunks per cell, n_ctx and tokens (cells x chunks x n_ctx).
    Chunk counts: `study_chunks` (default bench.gpu.article.STUDY_CHUNKS, issue 9's reading of
    the real tokenizers' counts); one baseline per model."""
    chunks = dict(STUDY_CHUNKS if study_chunks is None else study_chunks)
    out = {}
    for name, kinds in article_cells(article).items():
        n_ctx = {c.n_ctx for cells in kinds.values() for c in cells}
        if len(n_ctx) != 1:
            raise ValueError(f"{name}: the article runs one n_ctx per model, found {sorted(n_ctx)}")
        n_ctx = n_ctx.pop()
        if name not in chunks:
            raise ValueError(f"{name}: no study chunk count (known: {sorted(chunks)})")
        counts = {"baseline": 1, **{k: len(v) for k, v in kinds.items()}}
        out[name] = {k: {"cells": n, "chunks": chunks[name], "n_ctx": n_ctx, "tokens": n * chunks[name] * n_ctx}
                     for k, n in counts.items()}
    return out


def modelled_parts(model: str, kind: str, device: str = "h200", article: Path = ARTICLE,
                   compute: str | None = None) -> dict[str, float]:
    """Seconds per chunk by part for `kind` on `model`: the mean over the kind's article cells
    (cells of one tail and family cost the same here, so each distinct one is costed once and
    weighted by its count). `compute` None: the article's (`resolve_compute`)."""
    compute = resolve_compute(compute, article)[0]
    cells = article_cells(article)[model]
    n_ctx = next(c.n_ctx for kind_cells in cells.values() for c in kind_cells)
    if kind == "baseline":
        variants = Counter([None])
    else:
        # the cost depends on a cell only through its family and its policy (sink, tail)
        variants = Counter((c.k if kind == "kvarn" else "q4_0", c.v if kind == "kvarn" else "q4_0", c.tail)
                           for c in cells[kind])
    total = sum(variants.values())
    out: dict[str, float] = {}
    for cell, n in variants.items():
        for name, part in per_token(model, n_ctx, kind, cell, compute=compute).items():
            out[name] = out.get(name, 0.0) + n / total * n_ctx * part_seconds(part, device)
    return out


def modelled(model: str, kind: str, device: str = "h200", compute: str | None = None,
             article: Path = ARTICLE) -> float:
    """Seconds per chunk of one cell of `kind` on `model` (the roofline sum of `per_token`'s
    parts; `compute` None: the article's, `resolve_compute`); `project` adds CELL_FIXED_S per
    cell and the model load per model."""
    return sum(modelled_parts(model, kind, device, article, compute).values())


def model_load_s(model: str) -> float:
    """Once per model: the bf16 weights from disk and flex's compilation per head dim."""
    cfg = config(model)
    geom = geometry(cfg)
    w = gemm_params(cfg, geom) + cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg.get("tie_word_embeddings") else 2)
    return 2 * w / LOAD_DISK_Bps + COMPILE_S * len({x.head_dim for x in geom.layers if x.has_kv})


def project(device: str = "h200", measured: dict[str, dict[str, float]] | None = None,
            study_chunks: dict | None = None, article: Path = ARTICLE, compute: str | None = None) -> dict:
    """The article's device-hours on `device` under `compute` (None: the article's own, or
    FALLBACK_COMPUTE with a `note` where it is not modelled, `resolve_compute`): one row per
    (model, kind) with cells, chunks,
    s_per_chunk (`measured[model][kind]` where given, else `modelled`), its source, fixed_s (per
    cell) and gpu_hours = cells x (chunks x s_per_chunk + fixed_s) / 3600; one "model load" row
    per model; the total; and the dominant (model, kind, part): the part with the most hours
    (a measured row's seconds shared among its parts as the model shares them)."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: expected one of {sorted(DEVICES)}")
    compute, note = resolve_compute(compute, article)
    measured = measured or {}
    rows, part_hours, device_hours = [], {}, 0.0
    for model, kinds in plan(article, study_chunks).items():
        for kind, p in kinds.items():
            parts = modelled_parts(model, kind, device, article, compute)
            rated = {name for name, part in per_token(model, p["n_ctx"], kind, compute=compute).items()
                     if part["unit"] == "rate"}
            model_s = sum(parts.values())
            got = measured.get(model, {}).get(kind)
            s = float(got) if got is not None else model_s
            hours = p["cells"] * (p["chunks"] * s + CELL_FIXED_S) / 3600
            rows.append({"model": model, "kind": kind, "cells": p["cells"], "chunks": p["chunks"],
                         "n_ctx": p["n_ctx"], "tokens": p["tokens"], "s_per_chunk": s,
                         "source": "measured" if got is not None else "model", "fixed_s": CELL_FIXED_S,
                         "gpu_hours": hours})
            for name, t in parts.items():
                part_hours[(model, kind, name)] = p["cells"] * p["chunks"] * t * (s / model_s) / 3600
                if name not in rated:
                    device_hours += part_hours[(model, kind, name)]
            part_hours[(model, kind, FIXED)] = p["cells"] * CELL_FIXED_S / 3600
        load = model_load_s(model)
        rows.append({"model": model, "kind": "model load", "cells": 0, "chunks": 0, "n_ctx": None, "tokens": 0,
                     "s_per_chunk": None, "source": "model", "fixed_s": load, "gpu_hours": load / 3600})
        part_hours[(model, "model load", "model load")] = load / 3600
    total = sum(r["gpu_hours"] for r in rows)
    top = max(part_hours, key=part_hours.get)
    by_part = Counter()
    for (_, _, name), hrs in part_hours.items():
        by_part[name] += hrs
    rest = total - device_hours
    return {"device": device, "compute": compute, "note": note, "rows": rows, "total_hours": total, "goal_hours": GOAL_HOURS,
            "tokens": sum(r["tokens"] for r in rows),
            "dominant": {"model": top[0], "kind": top[1], "part": top[2], "gpu_hours": part_hours[top]},
            "by_part": dict(by_part.most_common()),
            "part_hours": [{"model": m, "kind": k, "part": n, "gpu_hours": h} for (m, k, n), h in part_hours.items()],
            # the goal holds while the device reaches at least this share of every assumed
            # fraction (roofline parts scale as 1/x; rated, fixed and load hours stay): x = device / (goal - rest)
            "break_even": device_hours / (GOAL_HOURS - rest) if rest < GOAL_HOURS else None,
            "device_hours": device_hours,
            "study_chunks": dict(STUDY_CHUNKS if study_chunks is None else study_chunks)}


# ----------------------------------------------------------------------------- the report


def markdown(proj: dict) -> str:
    """The table, the total against the goal, what dominates and the assumptions, in Markdown."""
    dev = DEVICES[proj["device"]]
    L = [f"Projected device-hours of config/article.yaml on one {dev['name']} "
         f"({dev['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16, {dev['hbm_Bps'] / 1e12:.2f} TB/s HBM), "
         "`python -m bench.gpu.projection"
         + ("" if proj["device"] == "h200" else f" --device {proj['device']}")
         + f" --compute {proj['compute']}"
         + f"` (attention: compute {proj.get('compute', 'bf16-attn')}):", "",
         "| model | kind | cells | chunks | n_ctx | tokens | s/chunk | source | GPU-hours |",
         "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in proj["rows"]:
        if r["kind"] == "model load":
            L.append(f"| {r['model']} | model load (once) | | | | | | {r['source']} | {r['gpu_hours']:.2f} |")
            continue
        L.append(f"| {r['model']} | {r['kind']} | {r['cells']} | {r['chunks']} | {r['n_ctx']:,} | {r['tokens']:,} | "
                 f"{r['s_per_chunk']:.1f} | {r['source']} | {r['gpu_hours']:.2f} |")
    total, goal = proj["total_hours"], proj["goal_hours"]
    verdict = "within" if total <= goal else "over"
    L += ["", f"**Total: {total:.2f} GPU-hours for {proj['tokens']:,} tokens, {verdict} the goal of "
          f"≤ {goal:g} H200-hours** ({proj['tokens'] / (total * 3600):,.0f} tokens/s on average; the goal needs "
          f"{proj['tokens'] / (goal * 3600):,.0f}).", ""]
    if proj.get("note"):
        L += [f"Note: {proj['note']}.", ""]
    d = proj["dominant"]
    share = d["gpu_hours"] / total
    L.append(f"Dominant: **{d['part']}** of {d['model']} {d['kind']} cells, {d['gpu_hours']:.2f} h "
             f"({share:.0%} of the total). By part over all rows (GPU-hours):")
    L.append("")
    L.append("| part | GPU-hours | share |")
    L.append("|---|---:|---:|")
    for name, hrs in proj["by_part"].items():
        L.append(f"| {name} | {hrs:.2f} | {hrs / total:.0%} |")
    be = proj["break_even"]
    L += ["", f"Roofline parts {proj['device_hours']:.2f} h; parts at stated rates, per-cell fixed and model load "
          f"{total - proj['device_hours']:.2f} h: "
          + (f"the goal holds while the device reaches at least {be:.0%} of every assumed fraction below "
             f"(compute and bandwidth alike)." if be is not None else
             "the rated, fixed and load hours alone exceed the goal.")]
    f = dev["fraction"]
    L += ["", "Assumptions (bench/gpu/projection.py states where each comes from):", "",
          f"* attainable fractions of peak: GEMMs {f['gemm']:.0%} (eager elementwise kernels included), flex "
          f"attention {f['attention']:.0%} (head dim ≤ 256) and {f['attention_d512']:.0%} (512), Gated DeltaNet "
          f"{f['linear']:.0%}; HBM {f['hbm']:.0%} for streaming ops; each part max(compute, memory) time",
          f"* host: log-probs to the host {HOST['d2h_Bps'] / 1e9:g} GB/s, baseline encoding "
          f"{HOST['encode_Bps'] / 1e9:g} GB/s of fp32 log-probs, dump reads {HOST['read_Bps'] / 1e9:g} GB/s, "
          f"KVarN's Triton quantize {HOST['kvarn_Bps'] / 1e9:g} GB/s of fp32 K/V (measured on an H200)",
          f"* study chunk counts: {proj['study_chunks']} (bench.gpu.article.STUDY_CHUNKS: issue 9's reading; "
          "the real tokenizers' counts are not computable offline)",
          f"* per cell {CELL_FIXED_S:g} s fixed; per model the weights at {LOAD_DISK_Bps / 1e9:g} GB/s and "
          f"{COMPILE_S:g} s of flex compilation per head dim; flex tiles of {QUERY_BLOCK}, ubatch {UBATCH}, "
          f"baseline entries above the floor {NONZERO_SHARE:.1%} of the vocabulary (Gemma 3 270M's mean)"]
    if proj.get("compute") == "tf32-attn":
        L.append(f"* tf32-attn: the attention at half those fractions of the bf16 peak (TF32's dense rate), K/V tiles "
                 f"of 4 bytes, the fp32 [body ; exact] rows staged ({CONCAT_BYTES_TF32['body+exact']} B per body row "
                 f"element with an exact copy) and Q, K and V rounded to TF32 every call ({TF32_ROUND_BYTES} B per "
                 "element, kvarn.kvcache.rounding)")
    sources = Counter(r["source"] for r in proj["rows"] if r["kind"] != "model load")
    L.append(f"* rows measured on the device: {sources.get('measured', 0)}, modelled: {sources.get('model', 0)}")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="h200", choices=sorted(DEVICES))
    ap.add_argument("--compute", default=None, choices=ATTENTION_COMPUTES,
                    help=f"the attention's arithmetic (default config/article.yaml's, or {FALLBACK_COMPUTE} where "
                         "the projection does not model it)")
    ap.add_argument("--out", default=None, help="write the Markdown here too")
    args = ap.parse_args(argv)
    try:
        md = markdown(project(args.device, compute=args.compute))
    except ValueError as e:  # an article whose cells mix computes
        print(f"bench.gpu.projection: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
