"""bench/gpu/device_run.p_rule_check, the device's answer to "which P rule does compiled flex's
TF32 dot follow": fed an output computed under each rule, it names that rule (the CPU smoke run
only sees eager flex's fp32 P, which reads as "nearest")."""

from __future__ import annotations

import pytest
import torch

from bench.gpu import device_flex as dflex
from kvarn.kvcache.attention import rounded_attention
from kvarn.kvcache.rounding import round_operand


@pytest.mark.parametrize("rule", ["truncate", "nearest"])
def test_the_p_rule_check_names_the_rule_the_output_follows(rule):
    g = torch.Generator().manual_seed(0)
    n_q, n_k, dim, hq, hkv = 64, 512, 64, 4, 2
    q, k, v = (torch.randn(1, h, n, dim, generator=g) for h, n in ((hq, n_q), (hkv, n_k), (hkv, n_k)))
    q, k, v = (round_operand(x, "tfloat32") for x in (q, k, v + 1.0))
    offset, scale = n_k - n_q, dim ** -0.5
    mask = torch.arange(n_q)[:, None] + offset >= torch.arange(n_k)[None, :]
    rep = hq // hkv
    y = rounded_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), mask, scale, "tfloat32",
                          p_rule=rule)
    out = dflex.p_rule_check(q, k, v, y, offset, scale, heads=hq)
    assert out["closer"] == rule
    assert out[rule]["mean"] == 0.0 and out[rule]["rms"] == 0.0  # the same arithmetic, bit for bit
    other = "nearest" if rule == "truncate" else "truncate"
    assert abs(out[other]["mean"]) > 1e-5  # truncation's shrink: about half a TF32 step on every numerator
