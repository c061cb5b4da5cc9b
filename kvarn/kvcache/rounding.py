"""How a tensor core reads an attention operand: the rounding of compute bf16-attn and tf32-attn
(kvarn.vocab.options.ATTENTION_ROUNDING), for `kvarn.kvcache.attention.rounded_attention` and the
flex path.

Under tf32-attn Q, K and V are rounded here (`round_operand`, to nearest) before the kernel sees
them; the softmax numerators P are made inside flex_attention's kernel in fp32 and go to its TF32
dot as they are, which reads them truncated (`TF32_P_RULE`, `round_p`). Why truncated: torch's
flex template (torch/_inductor/kernel/flex/templates/common.py.jinja, forward_block_mn) computes
`tl.dot(p.to(MATMUL_PRECISION), v, acc, input_precision=FLOAT32_PRECISION)` with MATMUL_PRECISION
fp32 for fp32 inputs, so P reaches Triton's dot as fp32; Triton lowers an fp32 dot of
input_precision "tf32" with no conversion of its operands (triton-lang/triton
third_party/nvidia/lib/TritonNVIDIAGPUToLLVM/DotOpToLLVM/WGMMA.cpp at 02d918bea5ed,
getMmaOperandType ~l. 51-58: an f32 operand is handed to wgmma as type .tf32, bits unchanged; the
only cvt.rna.tf32.f32 is in lib/Dialect/TritonGPU/Transforms/F32DotTC.cpp at 09858fcbc10c ~l. 35-45,
which applies to input_precision "tf32x3" alone), and NVIDIA's PTX ISA (wgmma.mma_async,
"Semantics") says: "wgmma.mma_async operation involving type .tf32 will truncate lower 13 bits of
the 32-bit input data before multiplication is issued". Triton's own test reference does the same
(python/test/gluon/test_core.py at b97a7ac85d74: `x & ~((1 << 13) - 1)` for fp32 operands). On
Ampere's mma.sync path (triton-lang/triton issue 4574) Triton's TF32 dot matched torch's rounded TF32 only
after inserting cvt.rna.tf32.f32 by hand. docs/notes/scale.md has the same, with the table it
changed.
"""

from __future__ import annotations

import torch

TF32_P_RULES = ("truncate", "nearest")
TF32_P_RULE = "truncate"  # how flex_attention's TF32 dot reads P as it runs (the module doc)


def _tf32(x: torch.Tensor, half: int) -> torch.Tensor:
    """x's fp32 words with the low 13 bits cleared after adding `half` (0x1000: to nearest, ties
    away from zero; 0: truncation toward zero) to the magnitude; inf and nan as they are. The sign
    bit is not part of the magnitude: adding to the word of a negative value adds to its magnitude,
    and a finite value's magnitude word is below 0x7F800000 whatever its sign."""
    bits = x.float().contiguous().view(torch.int32)
    finite = (bits & 0x7FFFFFFF) < 0x7F800000
    return ((bits + half) & ~0x1FFF).view(torch.float32).where(finite, x.float())


def round_operand(x: torch.Tensor, rounding: str) -> torch.Tensor:
    """x rounded as a tensor core reads it, as fp32 values: "bfloat16" (8 significant bits, to
    nearest even: torch's cast) or "tfloat32" (11 significant bits, to nearest with ties away from
    zero: PTX's cvt.rna.tf32.f32, the low 13 bits of the fp32 word cleared after adding half
    their range to the magnitude; subnormals likewise, either sign; inf and nan unchanged)."""
    if rounding == "bfloat16":
        return x.to(torch.bfloat16).float()
    if rounding == "tfloat32":
        return _tf32(x, 0x1000)
    raise ValueError(f"rounding {rounding!r}: expected bfloat16 or tfloat32")


def truncate_tf32(x: torch.Tensor) -> torch.Tensor:
    """x with TF32's 11 significant bits kept by truncation toward zero (the low 13 bits of the
    fp32 word cleared; |x| never grows): what a TF32 tensor core reads from an fp32 operand that
    was not rounded first. inf and nan unchanged."""
    return _tf32(x, 0)


def round_p(p: torch.Tensor, rounding: str, p_rule: str | None = None) -> torch.Tensor:
    """The softmax numerators P as the P·V product reads them: "bfloat16" as `round_operand` (the
    flex kernel casts P to V's bf16, to nearest even); "tfloat32" by `p_rule` (TF32_P_RULES; None:
    TF32_P_RULE, the kernel's truncation; "nearest": `round_operand`'s rounding)."""
    if rounding != "tfloat32":
        return round_operand(p, rounding)
    rule = TF32_P_RULE if p_rule is None else p_rule
    if rule == "truncate":
        return truncate_tf32(p)
    if rule == "nearest":
        return round_operand(p, rounding)
    raise ValueError(f"TF32 P rule {rule!r}: expected one of {', '.join(TF32_P_RULES)}")
