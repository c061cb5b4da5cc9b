"""How a tensor core reads an attention operand: the rounding of compute bf16-attn and tf32-attn
(kvarn.spec.options.ATTENTION_ROUNDING), for `kvarn.kvcache.attention.rounded_attention` and the
flex path."""

from __future__ import annotations

import torch


def round_operand(x: torch.Tensor, rounding: str) -> torch.Tensor:
    """x rounded as a tensor core reads it, as fp32 values: "bfloat16" (8 significant bits, to
    nearest even: torch's cast) or "tfloat32" (11 significant bits, to nearest with ties away from
    zero: PTX's cvt.rna.tf32.f32, the low 13 bits of the fp32 word cleared after adding half
    their range to the magnitude)."""
    if rounding == "bfloat16":
        return x.to(torch.bfloat16).float()
    if rounding == "tfloat32":
        bits = x.float().contiguous().view(torch.int32)
        return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).where(bits.abs() < 0x7F800000, x.float())
    raise ValueError(f"rounding {rounding!r}: expected bfloat16 or tfloat32")
