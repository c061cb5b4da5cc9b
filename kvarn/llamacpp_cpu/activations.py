"""The weight matmuls under `llamacpp-cpu`: each Linear's input rounded as llama.cpp converts it for
that weight's type, and ggml-cpu's fp16-table tanh GELU.

llama.cpp multiplies a quantized weight with its activations converted to the weight
type's vec_dot_type: q8_0 (32-blocks, fp16 d) for q4_0/q5_0/q8_0/iq4_nl weights, q8_1
for q4_1/q5_1, q8_K (256-blocks, fp32 d) for the k-quants, f16/bf16 for f16/bf16
weights. Our model holds the dequantized weights, so `llamacpp-cpu` rounds each Linear's
input the same way (forward pre-hook). Measured on SmolLM2 (n_ctx 2048): this rounding is
what turns a tiny attention perturbation (f16 vs bf16 cache, mean KLD 4e-5 in fp32) into
llama-perplexity's 0.0035: a perturbation ε flips q8 codes with probability ~ε/d, so the
noise it leaves grows like sqrt(ε·d), not ε. Approximation: the q8_1 `s = d·Σq` term is
taken as d16·Σq (exact dot of the dequantized codes) instead of fp16(d·Σq).
ggml-cpu's tanh GELU (Gemma's GEGLU) is a table of fp16 values indexed by the fp16-rounded
input (`ggml_gelu_f16`): another rounding of the same kind, so `llamacpp-cpu` computes it
so too (in place of the forward of transformers' tanh-GELU modules). Measured on Gemma 3 (n_ctx 4096,
bench/oracles/llamacpp/results/llamacpp.md §10): base PPL +0.37 % from llama-perplexity's (was +0.67 %).
"""

from __future__ import annotations

import torch

from kvarn.formats.blocks import QK
from kvarn.formats.floats import FLOAT_DTYPES
from kvarn.llamacpp_cpu.q8 import quantize_q8
from kvarn.weights.gguf_file import architecture, reader

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
