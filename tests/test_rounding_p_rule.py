"""Compute tf32-attn's P rule (kvarn.kvcache.rounding.round_p, `rounded_attention(p_rule=...)`):
the flex kernel's TF32 dot reads the fp32 numerators P truncated, not rounded (the evidence:
kvarn.kvcache.rounding's module doc). Both rules against a float64 reference written here on
hand-made tensors; truncation shrinks every numerator, so on diffuse attention the output is scaled
down coherently, where rounding to nearest errs both ways and averages out.
"""

from __future__ import annotations

import pytest
import torch

import kvarn.kvcache.attention as kattn
from kvarn.kvcache import rounding


def tf32_64(x: torch.Tensor, rule: str) -> torch.Tensor:
    """x (float64) with TF32's 11 significant bits: m · 2^e, m in [0.5, 1), keeps trunc(m · 2^11)
    ("truncate", toward zero) or round(m · 2^11) with ties away from zero ("nearest")."""
    m, e = torch.frexp(x)
    s = m * 2.0 ** 11
    kept = torch.trunc(s) if rule == "truncate" else torch.sign(s) * torch.floor(s.abs() + 0.5)
    return torch.ldexp(kept / 2.0 ** 11, e)


def reference(q, k, v, scale, rule):
    """Attention in float64, unmasked: Q, K, V to TF32 to nearest, P = exp(s - max) by `rule`,
    divided by the unrounded sum of P."""
    r = lambda x: tf32_64(x.double(), "nearest")  # noqa: E731
    s = r(q) @ r(k).T * scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (tf32_64(p, rule) @ r(v)) / p.sum(-1, keepdim=True)


def diffuse(n=4, L=1024, D=8, seed=3):
    """Queries that spread their weight over every key: scores within about a nat of each other, so
    every numerator P lies in (0.4, 1] (mean ~0.75; TF32's step 2^-11 in [0.5, 1), 2^-12 below)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, D, generator=g) * 0.3
    k = torch.randn(L, D, generator=g) * 0.3
    return q, k, D ** -0.5


@pytest.mark.parametrize("rule", ["truncate", "nearest"])
def test_each_rule_against_float64(rule):
    q, k, scale = diffuse()
    v = torch.randn(k.shape[0], 8, generator=torch.Generator().manual_seed(4))
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    got = kattn.rounded_attention(q, k, v, mask, scale, "tfloat32", rule)
    want = reference(q, k, v, scale, rule)
    other = reference(q, k, v, scale, "nearest" if rule == "truncate" else "truncate")
    err, apart = (got.double() - want).abs().max(), (other - want).abs().max()
    # fp32 sums of 1024 terms, and the rare numerator whose fp32 and float64 values straddle a
    # rounding edge; the other rule is far beyond that
    assert err < 2e-6, err
    assert apart > 20 * err, (apart, err)


def test_truncation_shrinks_coherently_where_rounding_does_not():
    # V all ones: the exact output is 1 for every query. Rounded to nearest, P's errors (up to half
    # a step either way) average out over the 1024 keys: |out - 1| ~ 2^-12 / sqrt(3 · 1024) ~ 5e-6.
    # Truncated, every P loses [0, one step) of its value, half a step on average (2^-12 in [0.5, 1)),
    # against a mean P of ~0.75: out ~ 1 - 2^-12 / 0.75 ~ 1 - 3e-4 (measured 3-4e-4), below 1 in every row.
    q, k, scale = diffuse()
    v = torch.ones(k.shape[0], 8)
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    trunc = kattn.rounded_attention(q, k, v, mask, scale, "tfloat32", "truncate").double()
    near = kattn.rounded_attention(q, k, v, mask, scale, "tfloat32", "nearest").double()
    for out, rule in ((trunc, "truncate"), (near, "nearest")):
        assert (out - reference(q, k, v, scale, rule)).abs().max() < 1e-6
    shrink = 1 - trunc
    assert (shrink > 1.5e-4).all() and (shrink < 2 ** -11).all(), shrink  # every row, by about 2^-12 / mean P
    assert (near - 1).abs().max() < 3e-5, near
    assert shrink.min() > 10 * (near - 1).abs().max()
    # the default is the kernel's rule
    assert rounding.TF32_P_RULE == "truncate"
    assert torch.equal(kattn.rounded_attention(q, k, v, mask, scale, "tfloat32").double(), trunc)


def test_q_k_and_v_stay_rounded_to_nearest_under_either_rule():
    # the P rule touches P alone: with a single key (P = 1 exactly, on every grid) both rules give
    # V rounded to nearest, and the scores do not matter
    v = torch.tensor([[1 + 3 * 2 ** -12, -(1 + 3 * 2 ** -12)]])  # to nearest: ±(1 + 2^-10); truncated ±1
    q, k = torch.randn(1, 4), torch.randn(1, 4)
    mask = torch.ones(1, 1, dtype=torch.bool)
    for rule in rounding.TF32_P_RULES:
        out = kattn.rounded_attention(q, k, v, mask, 0.5, "tfloat32", rule)
        assert out.tolist() == [[1 + 2 ** -10, -(1 + 2 ** -10)]], rule
