"""The traffic model behind the projection (bench/gpu/projection.py): per forward token of a
chunk, each part's FLOPs and bytes from the models' geometry (`per_token`), its roofline seconds on
a device (`part_seconds`), and a model's load (`model_load_s`). Torch-free.

Every constant below says where it comes from: a datasheet, a count (the bytes per element of
the cache update, the flex mask and the KLD were counted on CPU by summing the bytes of every
non-view aten op's inputs and outputs under a TorchDispatchMode: the figures of a GPU's eager
ops are the same ops'), a measurement (bench/gpu/results/kvarn_gpu.md, bench/perf/results/
baseline_size.md), or an assumption named as such. docs/notes/scale.md, "Projection (before the
device)", gives the derivation and the table.
"""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

from bench import REPO
from kvarn.vocab import facts, scoring
from kvarn.vocab.geometry import Geometry, geometry_from_config
from kvarn.vocab.policy import layer_policy

MODELS = REPO / "config" / "models"
KINDS = ("baseline", "standard t0", "standard tail", "kvarn")

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
ATTENTION_COMPUTES = ("bf16-attn", "tf32-attn")  # the arithmetic the article's attention runs in (kvarn.vocab.options)

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
    """kvarn.vocab.geometry's reading of a config.json dict without transformers: the one
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
    the baseline (bf16, tail 0). kvarn.vocab.policy.layer_policy over the type facts."""
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


def model_load_s(model: str) -> float:
    """Once per model: the bf16 weights from disk and flex's compilation per head dim."""
    cfg = config(model)
    geom = geometry(cfg)
    w = gemm_params(cfg, geom) + cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg.get("tie_word_embeddings") else 2)
    return 2 * w / LOAD_DISK_Bps + COMPILE_S * len({x.head_dim for x in geom.layers if x.has_kv})
