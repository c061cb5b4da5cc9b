"""Q8 blocks as ggml-cpu's x86 `quantize_row_q8_0/q8_1` make them: the form llama.cpp gives a query row
before a quantized K's dot (`kvarn.llamacpp_cpu.compute`) and an activation before a quantized weight's
(`kvarn.llamacpp_cpu.activations`)."""

from __future__ import annotations

import torch

from kvarn.formats.blocks import QK


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
