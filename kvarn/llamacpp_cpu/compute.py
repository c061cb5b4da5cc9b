"""The compute path (DESIGN §6b): `exact` attention, or llama.cpp's CPU flash-attention arithmetic.

Owns the `llamacpp-cpu` emulation of ggml-cpu's `flash_attn_ext` (llama-cpp-python 0.3.36): the
routine a ubatch takes (`kernel_path`: tiled, or one-chunk; `FA_TILE_Q`), the operands ggml
reads (`k_operand`: K in K's `vec_dot` form, in the GGUF channel order and rotated;
`v_operand`; `append_kv`), the scores (`scores`: Q in K's `vec_dot_type`), the f16 V
accumulator (`f16_accumulate`) and `attention`. Upstream llama.cpp types and BeeLlama v0.4.3's
block types, tail 0, no sink; anything else is refused by name. llama.cpp's channel order of Q
and K is `kvarn.llamacpp_cpu.channel_order`, its Q8 blocks `kvarn.llamacpp_cpu.q8`, the
rounding of the weight matmuls' activations `kvarn.llamacpp_cpu.activations`.

What ggml does per path, the approximations, what is supported and why: docs/notes/llamacpp.md
"The emulated kernel"; BeeLlama's types and its scalar route: docs/notes/beellama.md.
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
