"""The compute path (DESIGN §6b): `exact` attention, or llama.cpp's CPU flash-attention arithmetic.

This module emulates the attention; llama.cpp's channel order of Q and K is
`kvarn.llamacpp_cpu.channel_order`, its Q8 blocks of activations `kvarn.llamacpp_cpu.q8`, and the
rounding of the weight matmuls' activations `kvarn.llamacpp_cpu.activations`.

`exact` (the default, `kvarn.kvcache.attention`) isolates the format: fp32 attention over the
rounded K and V, nothing else rounded. `llamacpp-cpu` reproduces what ggml-cpu's
`flash_attn_ext` (ggml/src/ggml-cpu/ops.cpp, llama-cpp-python 0.3.36) does on top of the
cache rounding, so our numbers can be checked against llama-perplexity and the two modes
together split a KLD into format damage and kernel arithmetic. What ggml does, per
(K type, V type, queries in the ubatch `n_q`):

* **tiled path** (`flash_attn_ext_tiled`): K and V of the same type, f16 or f32, and
  `n_q >= GGML_FA_TILE_Q` (64). Q stays fp32, K/V are widened to fp32, an fp32 GEMM gives
  the scores, softmax and V accumulation in fp32: the `exact` arithmetic over the rounded
  cache. With llama-perplexity's ubatch of 512 an f16/f16 cache takes this path.
* **one-chunk path** (`flash_attn_ext_f16_one_chunk`), everything else: Q is converted
  to K's `vec_dot_type` (`type_traits_cpu`): bf16 for bf16 K, f16 for f16 K, q8_0 blocks
  for q8_0/q5_0/q4_0/iq4_nl K (and BeeLlama's q6_0/q3_0/q2_0), q8_1 blocks for q5_1/q4_1 K
  (and q6_1/q3_1/q2_1); each score is K's `vec_dot`
  with that Q row, times the scale; an online softmax over the keys in order; V is
  accumulated in an **f16** vector when V is f16 (`ggml_vec_mad_f16` / `ggml_vec_scale_f16`
  round the accumulator to f16 at every key), else widened to fp32 and accumulated in
  fp32. The bf16 baseline (`-ctk bf16 -ctv bf16`) takes this path: its Q is rounded to
  bf16, which is most of what an f16 cache "costs" in llama-perplexity.
* Q8 blocks of Q, as the x86 (AVX2/AVX-512) `quantize_row_q8_0/q8_1`: `d = amax/127`,
  codes `round-half-to-even(x * (127/amax))`, `d` stored fp16; q8_1 also stores
  `s = fp16(d * Σ codes)` with the fp32 `d`.
* Quantized dot (`ggml_vec_dot_q*_q8_*`): per 32-block an integer dot of K's codes (q4_0:
  code − 8, q5_0: code − 16, q6_0 / q3_0 / q2_0: code − 32 / − 4 / − 2, iq4_nl: the table
  level, q8_0: the code; the _1 types: the unsigned code) with Q's codes, times `d_K·d_Q`;
  the `_1` types add `m_K·s_Q`.
* Rotation (llama-graph.cpp `llama_mul_mat_hadamard`, llama-kv-cache.cpp): with a quantized
  K, Q and K are rotated by the Hadamard of `k_rotation_block(head_dim)` before the kernel
  (so Q is quantized to q8 in the rotated frame); with a quantized V, V is rotated by the
  64-Hadamard and the attention output rotated back. f16/bf16 caches are never rotated.
* Channel order: for an architecture whose GGUF permutes Q/K (`gguf_qk_permuted`, the
  llama arch), llama.cpp holds each head of Q and K in the GGUF's interleaved order, so its
  rotation and its 32-wide K blocks see other channels than transformers' order gives
  them. Q and K are gathered into that order (`gguf_order`) before the rotation and the
  rounding; the scores do not depend on a common channel order, so nothing is gathered back.

Approximations (each far below the effects this mode exists to show; the slow reference
in tests/test_compute.py shows how far): dot products are computed exactly (float64) and
rounded once to fp32, where ggml sums SIMD lanes in fp32 (relative difference ~1e-7);
on the fp32-accumulator paths the softmax and V sum are done at once in fp32 instead of
ggml's key-by-key online update (same arithmetic up to fp32 rounding order); the f16
accumulator path is reproduced key by key (exactly ggml's order, fp32 fma then f16
rounding); decode with ubatch 1 over >= 512 keys splits the keys across threads in ggml
(`use_split_kv_path`, thread-count dependent) — we treat it as one chunk. The cache
itself is written with kvarn.formats.blocks (ggml's reference quantizers; x86's SIMD
`quantize_row_q8_0` for a q8_0 cache rounds ties to even and uses 127/amax: codes can
differ on exact ties only).

Supported: the upstream llama.cpp types (f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0,
iq4_nl) and BeeLlama v0.4.3's (q6_0, q6_1, q3_0, q3_1, q2_0, q2_1) for K and V, tail 0 and no
sink (llama.cpp keeps no token exact). BeeLlama's types take the same one-chunk routine at tail 0
(`ggml_compute_forward_flash_attn_ext_f16_one_chunk` through `type_traits_cpu`): Q to q8_0 blocks
for the _0 types, q8_1 for the _1 types, the same integer block dot (`kvarn.vocab.options.
VEC_DOT_TYPE`), V widened by its `to_float`; rotated like upstream's (`attn_rot_k` / `attn_rot_v`:
any quantized type). A KVarN pair, or any BeeLlama type with a tail, takes BeeLlama's scalar CPU
route instead (`kvarn.vocab.options.scalar_route`: `flash_attn_ext_kvarn` /
`flash_attn_ext_tail_ref`, the exact path's arithmetic over the rounded cache, K rounded in the
GGUF's order); this module's kernel is not used there. Anything else (the ecosystem's caches) is
refused with an error naming it, rather than emulating a kernel we have not read.
"""

from __future__ import annotations

import torch

from kvarn.formats.blocks import IQ4NL_VALUES, QK, dequantize_blocks, quantize_blocks
from kvarn.formats.floats import FLOAT_DTYPES
from kvarn.formats.hadamard import V_ROTATION_BLOCK, k_rotation_block, rotate_blocks
from kvarn.llamacpp_cpu.channel_order import gguf_order
from kvarn.llamacpp_cpu.q8 import quantize_q8
from kvarn.vocab.options import VEC_DOT_TYPE

FA_TILE_Q = 64  # ggml-cpu common.h GGML_FA_TILE_Q: the tiled path needs at least this many query rows


def kernel_path(k: str, v: str, n_q: int) -> str:
    """'tiled' or 'one_chunk': which ggml-cpu flash-attention routine a ubatch of n_q queries takes."""
    if k == v and k in ("f16", "f32") and n_q >= FA_TILE_Q:
        return "tiled"
    return "one_chunk"


# --- the cache layer operands ----------------------------------------------------------

def k_operand(fmt, x: torch.Tensor, gguf: bool = False) -> dict:
    """What ggml's K vec_dot reads for K rows x fp32 [..., n, D] (in the GGUF channel order
    if `gguf`, then rotated if fmt.rot).

    Float types: {"val"}; quantized: {"int": the integer operand of the block dot, "d": d
    per block, "m": m per block (q4_1/q5_1) or None}, all fp32.
    """
    if gguf:
        x = x[..., gguf_order(x.shape[-1], x.device)]
    if fmt.family == "float":
        return {"val": x.to(FLOAT_DTYPES[fmt.name]).float()}
    spec = fmt.spec
    if fmt.rot:
        x = rotate_blocks(x, k_rotation_block(x.shape[-1]))
    q, d, m = quantize_blocks(spec, x.reshape(-1, QK))
    nb = x.shape[-1] // QK
    if spec.kind == "q8":
        qi = q.float()
    elif spec.kind == "sym":
        qi = (q - (1 << spec.bits) // 2).float()
    elif spec.kind == "iq4nl":
        qi = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=x.device).take(q)
    else:  # asym: the unsigned code; the min enters through m·s_Q
        qi = q.float()
    shape = (*x.shape[:-1], nb)
    return {
        "int": qi.reshape(x.shape),
        "d": d.to(torch.float16).float().reshape(shape),
        "m": None if m is None else m.to(torch.float16).float().reshape(shape),
    }


def v_operand(fmt, x: torch.Tensor) -> torch.Tensor:
    """V rows as ggml's v_to_float gives them (rotated frame when V is quantized and rot)."""
    if fmt.family == "float":
        return x.to(FLOAT_DTYPES[fmt.name]).float()
    if fmt.rot:
        x = rotate_blocks(x, V_ROTATION_BLOCK)
    q, d, m = quantize_blocks(fmt.spec, x.reshape(-1, QK))
    m16 = None if m is None else m.to(torch.float16).float()
    return dequantize_blocks(fmt.spec, q, d.to(torch.float16).float(), m16).reshape(x.shape)


def _cat(a, b):
    if a is None:
        return b
    if isinstance(b, dict):
        return {key: None if b[key] is None else torch.cat([a[key], b[key]], dim=-2) for key in b}
    return torch.cat([a, b], dim=-2)


def append_kv(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store a ubatch's K/V operands on `layer` (a KVarnLayer in llamacpp-cpu mode)."""
    layer.k_op = _cat(layer.k_op, k_operand(layer.k_fmt, k, layer.qk_gguf_order))
    layer.v_op = _cat(layer.v_op, v_operand(layer.v_fmt, v))


# --- the kernel ------------------------------------------------------------------------

def scores(q: torch.Tensor, k_op: dict, k_type: str, path: str) -> torch.Tensor:
    """fp32 K·Q dot products [..., n_q, L] as ggml's kq_vec_dot gives them (before the scale).

    q: fp32 [..., n_q, D] (already rotated when K is); k_op: `k_operand` [..., L, D].
    """
    if path == "tiled":
        qq, kk = q.double(), k_op["val"].double()
        return (qq @ kk.transpose(-1, -2)).float()
    vdt = VEC_DOT_TYPE[k_type]
    if vdt in FLOAT_DTYPES:
        qq = q.to(FLOAT_DTYPES[vdt]).double()
        return (qq @ k_op["val"].double().transpose(-1, -2)).float()
    qi, dq, sq = quantize_q8(q, vdt)
    D = q.shape[-1]
    nb = D // QK

    def scaled(ints, d):  # codes · d per block, exact in float64
        return (ints.double().reshape(*ints.shape[:-1], nb, QK) * d.double()[..., None]).reshape(*ints.shape)

    out = scaled(qi, dq) @ scaled(k_op["int"], k_op["d"]).transpose(-1, -2)
    if k_op["m"] is not None:
        out = out + sq.double() @ k_op["m"].double().transpose(-1, -2)
    return out.float()


def f16_accumulate(s: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """ggml's one-chunk online softmax with an f16 V accumulator, key by key in order.

    s: fp32 scaled scores [B, R, L]; v: fp32 values of f16 V [B, L, D]; valid: bool [B or 1, R, L].
    Per key j with s_j > M: VKQ = f16(VKQ · exp(M − s_j)), M = s_j, vs = 1; else
    vs = exp(s_j − M). Then VKQ = f16(VKQ + v_j · vs) (fp32 fma, one f16 rounding) and
    S = S·ms + vs. Returns fp32 VKQ / S [B, R, D].
    """
    B, R, L = s.shape
    D = v.shape[-1]
    valid = valid.expand(B, R, L)
    M = torch.full((B, R), float("-inf"), dtype=torch.float32, device=s.device)
    S = torch.zeros((B, R), dtype=torch.float32, device=s.device)
    acc = torch.zeros((B, R, D), dtype=torch.float16, device=s.device)
    cols = valid.any(1).any(0).nonzero().flatten().tolist()  # keys nobody reads are skipped by all rows
    for j in cols:
        ok = valid[..., j]
        sj = s[..., j]
        new = ok & (sj > M)
        ms = torch.where(new, torch.exp(M - sj), torch.ones_like(sj))
        vs = torch.where(new, torch.ones_like(sj), torch.exp(sj - M))
        vs = torch.where(ok, vs, torch.zeros_like(vs))
        scaled = (acc.float() * ms[..., None]).to(torch.float16)
        acc = torch.where(new[..., None], scaled, acc)
        summed = (acc.double() + v[:, j, None, :].double() * vs.double()[..., None]).float().to(torch.float16)
        acc = torch.where(ok[..., None], summed, acc)
        M = torch.where(new, sj, M)
        S = torch.where(ok, S * ms + vs, S)
    inv = torch.where(S == 0, torch.zeros_like(S), 1.0 / torch.where(S == 0, torch.ones_like(S), S))
    return acc.float() * inv[..., None]


def attention(module, query: torch.Tensor, layer, allowed: torch.Tensor, scaling: float) -> torch.Tensor:
    """llama.cpp CPU flash attention over `layer`'s operands; returns [b, n_q, H, D] in query.dtype.

    query [b, H, n_q, D] (post-RoPE); allowed: the model's boolean mask [b or 1, 1, n_q, L].
    Records the routine taken in `layer.last_path` (the tests assert it).
    """
    b, n_heads, n_q, d = query.shape
    k_fmt, v_fmt = layer.k_fmt, layer.v_fmt
    L = layer.v_op.shape[-2]
    n_kv = layer.v_op.shape[1]
    rep = n_heads // n_kv
    path = kernel_path(k_fmt.name, v_fmt.name, n_q)
    layer.last_path = path
    q = query.float()
    if layer.qk_gguf_order:  # K was gathered the same way (k_operand)
        q = q[..., gguf_order(d, q.device)]
    if k_fmt.family != "float" and k_fmt.rot:
        q = rotate_blocks(q, k_rotation_block(d))
    # GQA: the rep query heads sharing a KV head become extra rows of that head.
    q = q.reshape(b, n_kv, rep * n_q, d)
    mask = allowed[..., -n_q:, -L:].expand(b, 1, n_q, L).repeat(1, 1, rep, 1)  # [b, 1, rep*n_q, L]
    s = scores(q, layer.k_op, k_fmt.name, path) * torch.tensor(scaling, dtype=torch.float32)
    if v_fmt.name == "f16" and path == "one_chunk":
        sv = s.reshape(b * n_kv, rep * n_q, L)
        vv = layer.v_op.reshape(b * n_kv, L, -1)
        mv = mask.expand(b, n_kv, rep * n_q, L).reshape(b * n_kv, rep * n_q, L)
        out = f16_accumulate(sv, vv, mv).reshape(b, n_kv, rep * n_q, -1)
    else:
        s = s.masked_fill(~mask, float("-inf"))
        out = torch.softmax(s, dim=-1) @ layer.v_op
    if v_fmt.family != "float" and v_fmt.rot:
        out = rotate_blocks(out, V_ROTATION_BLOCK)
    out = out.reshape(b, n_heads, n_q, -1).to(query.dtype)
    return out.transpose(1, 2).contiguous()
