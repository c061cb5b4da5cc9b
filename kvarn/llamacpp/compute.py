"""The compute path (DESIGN §6b): `exact` attention, or llama.cpp's CPU flash-attention arithmetic.

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
  for q8_0/q5_0/q4_0/iq4_nl K, q8_1 blocks for q5_1/q4_1 K; each score is K's `vec_dot`
  with that Q row, times the scale; an online softmax over the keys in order; V is
  accumulated in an **f16** vector when V is f16 (`ggml_vec_mad_f16` / `ggml_vec_scale_f16`
  round the accumulator to f16 at every key), else widened to fp32 and accumulated in
  fp32. The bf16 baseline (`-ctk bf16 -ctv bf16`) takes this path: its Q is rounded to
  bf16, which is most of what an f16 cache "costs" in llama-perplexity.
* Q8 blocks of Q, as the x86 (AVX2/AVX-512) `quantize_row_q8_0/q8_1`: `d = amax/127`,
  codes `round-half-to-even(x * (127/amax))`, `d` stored fp16; q8_1 also stores
  `s = fp16(d * Σ codes)` with the fp32 `d`.
* Quantized dot (`ggml_vec_dot_q*_q8_*`): per 32-block an integer dot of K's codes (q4_0:
  code − 8, q5_0: code − 16, iq4_nl: the table level, q8_0: the code; q4_1/q5_1: the
  unsigned code) with Q's codes, times `d_K·d_Q`; the `_1` types add `m_K·s_Q`.
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
iq4_nl) for K and V, tail 0 and no sink (llama.cpp keeps no token exact). A KVarN pair, or any
BeeLlama type with a tail, takes BeeLlama's scalar CPU route instead (`kvarn.spec.options.
scalar_route`: `flash_attn_ext_kvarn` / `flash_attn_ext_tail_ref`, the exact path's arithmetic
over the rounded cache, K rounded in the GGUF's order); this module's kernel is not used there.
Anything else is refused with an error naming it, rather than emulating a kernel we have not read.
"""

from __future__ import annotations

import torch

from kvarn.formats.blocks import IQ4NL_VALUES, QK, dequantize_blocks, quantize_blocks
from kvarn.formats.floats import FLOAT_DTYPES
from kvarn.formats.hadamard import V_ROTATION_BLOCK, k_rotation_block, rotate_blocks
from kvarn.weights.gguf_file import architecture, reader
from kvarn.spec.options import LLAMACPP_CPU, VEC_DOT_TYPE

FA_TILE_Q = 64  # ggml-cpu common.h GGML_FA_TILE_Q: the tiled path needs at least this many query rows



# --- llama.cpp's channel order of Q and K ---------------------------------------------------
#
# transformers rotates the two halves of a head (`rotate_half`: channel i with i + d/2) for
# every architecture below. llama.cpp rotates adjacent pairs (2i, 2i+1) where its RoPE type
# (src/llama-model.cpp `llama_model_rope_type`) is NORM, so its converter reorders those
# architectures' q_proj/k_proj rows per head (conversion/llama.py `LlamaModel.permute`: GGUF
# position 2i+s holds HF dimension s*d/2+i) and transformers' GGUF loader
# (`LlamaTensorProcessor`) reorders them back. NEOX/IMROPE architectures rotate the halves,
# as transformers does, and are stored unpermuted. The value: whether llama.cpp's Q and K
# channels are in the GGUF (interleaved) order rather than transformers' order.
GGUF_QK_PERMUTED = {
    "llama": True, "mistral": True, "mixtral": True,  # LLM_ARCH_LLAMA: NORM
    "gemma3": False, "gemma3_text": False, "gemma4": False, "gemma4_text": False,  # NEOX
    "qwen2": False, "qwen3": False,  # NEOX
    "qwen3_5": False, "qwen3_5_text": False,  # IMROPE (neox halves, interleaved sections)
}


def gguf_qk_permuted(model_type: str) -> bool:
    """Whether llama.cpp holds this architecture's Q/K head channels in the GGUF's interleaved order."""
    if model_type not in GGUF_QK_PERMUTED:
        raise ValueError(
            f"compute {LLAMACPP_CPU}: model_type {model_type!r}: llama.cpp's channel order of Q and K "
            f"(whether its GGUF permutes q_proj/k_proj) is not known for it; known: {', '.join(GGUF_QK_PERMUTED)}")
    return GGUF_QK_PERMUTED[model_type]


def gguf_order(d: int, device=None) -> torch.Tensor:
    """Gather index of one head of width d: x[..., gguf_order(d)] is x in the GGUF order
    (position 2i+s holds transformers' dimension s*d/2+i)."""
    if d % 2:
        raise ValueError(f"head dim {d} is odd; the GGUF Q/K order pairs channels i and i + d/2")
    return torch.arange(d, device=device).view(2, d // 2).t().reshape(-1)


def kernel_path(k: str, v: str, n_q: int) -> str:
    """'tiled' or 'one_chunk': which ggml-cpu flash-attention routine a ubatch of n_q queries takes."""
    if k == v and k in ("f16", "f32") and n_q >= FA_TILE_Q:
        return "tiled"
    return "one_chunk"


def _round_half_even(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # torch.round rounds half to even, as _mm256_round_ps(_MM_ROUND_NEAREST)


def quantize_q8(x: torch.Tensor, kind: str):
    """Q rows -> (codes fp32 [..., D], d fp32 [..., D/32] (fp16 values), s fp32 [..., D/32] or None).

    x86 quantize_row_q8_0 / q8_1: d = amax/127, id = 127/amax (0 if amax == 0), codes =
    round-half-even(x·id); d is stored fp16; q8_1's s = fp16(d · Σ codes) with the fp32 d.
    """
    if kind not in ("q8_0", "q8_1"):
        raise ValueError(f"Q block type {kind!r}; accepted: q8_0, q8_1")
    D = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], D // QK, QK)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    idv = torch.where(amax != 0, 127.0 / torch.where(amax != 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    q = _round_half_even(xb * idv)
    s = None
    if kind == "q8_1":
        s = (d * q.sum(-1, keepdim=True)).to(torch.float16).float().squeeze(-1)
    d16 = d.to(torch.float16).float().squeeze(-1)
    return q.reshape(x.shape), d16, s


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


# --- the weight matmuls ------------------------------------------------------------------
#
# llama.cpp multiplies a quantized weight with its activations converted to the weight
# type's vec_dot_type: q8_0 (32-blocks, fp16 d) for q4_0/q5_0/q8_0/iq4_nl weights, q8_1
# for q4_1/q5_1, q8_K (256-blocks, fp32 d) for the k-quants, f16/bf16 for f16/bf16
# weights. Our model holds the dequantized weights, so `llamacpp-cpu` rounds each Linear's
# input the same way (forward pre-hook). Measured on SmolLM2 (n_ctx 2048): this rounding is
# what turns a tiny attention perturbation (f16 vs bf16 cache, mean KLD 4e-5 in fp32) into
# llama-perplexity's 0.0035: a perturbation ε flips q8 codes with probability ~ε/d, so the
# noise it leaves grows like sqrt(ε·d), not ε. Approximation: the q8_1 `s = d·Σq` term is
# taken as d16·Σq (exact dot of the dequantized codes) instead of fp16(d·Σq).
# ggml-cpu's tanh GELU (Gemma's GEGLU) is a table of fp16 values indexed by the fp16-rounded
# input (`ggml_gelu_f16`): another rounding of the same kind, so `llamacpp-cpu` computes it
# so too (in place of the forward of transformers' tanh-GELU modules). Measured on Gemma 3 (n_ctx 4096,
# bench/results/llamacpp.md §10): base PPL +0.37 % from llama-perplexity's (was +0.67 %).

WEIGHT_ACT_TYPE = {
    "Q4_0": "q8_0", "Q5_0": "q8_0", "Q8_0": "q8_0", "IQ4_NL": "q8_0",
    "Q4_1": "q8_1", "Q5_1": "q8_1",
    "Q2_K": "q8_K", "Q3_K": "q8_K", "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K",
    "F16": "f16", "BF16": "bf16", "F32": None,
}


def round_activations(x: torch.Tensor, kind: str | None) -> torch.Tensor:
    """x [..., n] rounded as ggml converts activations to `kind` (values, same dtype as x)."""
    if kind is None:
        return x
    if kind in FLOAT_DTYPES:
        return x.to(FLOAT_DTYPES[kind]).to(x.dtype)
    if kind in ("q8_0", "q8_1"):
        q, d, _ = quantize_q8(x.float(), kind)
        nb = x.shape[-1] // QK
        return (q.reshape(*x.shape[:-1], nb, QK) * d[..., None]).reshape(x.shape).to(x.dtype)
    if kind == "q8_K":  # quantize_row_q8_K_ref: iscale = -127/vmax, d = 1/iscale (fp32), nearest int
        xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // 256, 256)
        vmax = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))
        iscale = torch.where(vmax != 0, -127.0 / torch.where(vmax != 0, vmax, torch.ones_like(vmax)), 0.0)
        q = torch.round(xb * iscale).clamp(max=127)
        d = torch.where(iscale != 0, 1.0 / torch.where(iscale != 0, iscale, torch.ones_like(iscale)), 0.0)
        return (q * d).reshape(x.shape).to(x.dtype)
    raise ValueError(f"activation type {kind!r}; accepted: q8_0, q8_1, q8_K, f16, bf16, None")


def gguf_weight_types(gguf_path) -> dict[str, str]:
    """GGUF tensor name -> ggml type name (e.g. 'blk.0.attn_q.weight' -> 'Q4_1')."""
    return {t.name: t.tensor_type.name for t in reader(gguf_path).tensors}


GELU_COEF_A = 0.044715
GELU_SQRT_2_OVER_PI = 0.79788456080286535587989211986876
# transformers' tanh-approximate GELU modules: what ggml's GELU (Gemma's GEGLU) computes
GELU_TANH_MODULES = ("GELUTanh", "NewGELUActivation")


def ggml_gelu_f16(x: torch.Tensor) -> torch.Tensor:
    """ggml-cpu's tanh GELU (`ggml_vec_gelu_f32` / `ggml_vec_geglu_f32` under GGML_GELU_FP16,
    ggml-cpu/vec.h): x <= -10 gives 0, x >= 10 gives x, otherwise x is rounded to fp16 and
    the result read from a table of fp16 values, fp16(gelu_tanh(fp16 x)) computed in fp32."""
    x32 = x.float()
    h = x32.half().float()
    t = (0.5 * h * (1.0 + torch.tanh(GELU_SQRT_2_OVER_PI * h * (1.0 + GELU_COEF_A * h * h)))).half().float()
    return torch.where(x32 <= -10.0, torch.zeros_like(x32), torch.where(x32 >= 10.0, x32, t)).to(x.dtype)


def install_activation_rounding(model, gguf_path) -> dict[str, str | None]:
    """Round every Linear's input as llama.cpp does for that weight's GGUF type, and compute
    every tanh GELU as ggml-cpu does (`ggml_gelu_f16`).

    Returns {module name: activation type} for the modules hooked (a GELU as "gelu_f16"). A
    Linear with no GGUF tensor (e.g. a tied lm_head) uses its source tensor (token_embd); an
    unknown GGUF type is an error naming it.
    """
    import gguf

    types = gguf_weight_types(gguf_path)
    arch = architecture(gguf_path)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    n_layers = model.config.get_text_config().num_hidden_layers
    names = gguf.get_tensor_name_map(arch_id, n_layers)
    hooked = {}
    for mod_name, mod in model.named_modules():
        if type(mod).__name__ in GELU_TANH_MODULES:  # its forward replaced: transformers' GELU not computed too
            mod.forward = lambda x, _own=mod.forward: (
                ggml_gelu_f16(x) if getattr(model, "_kvarn_round_activations", True) else _own(x))
            hooked[mod_name] = "gelu_f16"
            continue
        if not isinstance(mod, torch.nn.Linear):
            continue
        g = names.get_name(f"{mod_name}.weight", try_suffixes=(".weight",))
        g = g.removesuffix(".weight") if g else g
        if g == "output" and "output.weight" not in types:
            g = "token_embd"  # tied embeddings: llama.cpp multiplies with token_embd
        wtype = types.get(f"{g}.weight") if g else None
        if wtype is None:
            raise ValueError(f"{gguf_path}: no GGUF tensor for {mod_name} (mapped to {g!r})")
        if wtype not in WEIGHT_ACT_TYPE:
            raise ValueError(f"{gguf_path}: {g}.weight has type {wtype}; llamacpp-cpu knows "
                             f"{', '.join(WEIGHT_ACT_TYPE)}")
        kind = WEIGHT_ACT_TYPE[wtype]
        mod.register_forward_pre_hook(
            lambda m, args, _k=kind: (round_activations(args[0], _k), *args[1:])
            if getattr(model, "_kvarn_round_activations", True) else None)
        hooked[mod_name] = kind
    model._kvarn_activation_types = hooked
    model._kvarn_round_activations = True
    return hooked


def set_activation_rounding(model, gguf_path, enabled: bool) -> dict | None:
    """Turn the weight-matmul activation rounding on (installing the hooks once, from the
    GGUF's tensor types) or off. A model without GGUF weights (gguf_path None) is left
    unrounded: its weights are not quantized. Returns the hooked {module: type} or None."""
    if enabled and gguf_path is not None and getattr(model, "_kvarn_activation_types", None) is None:
        install_activation_rounding(model, gguf_path)
    if getattr(model, "_kvarn_activation_types", None) is not None:
        model._kvarn_round_activations = bool(enabled and gguf_path is not None)
    return getattr(model, "_kvarn_activation_types", None)
