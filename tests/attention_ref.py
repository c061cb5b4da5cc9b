"""A reference for the cache model's attention (DESIGN §2), written independently of kvarn.kvcache.attention.

`reference_attention` computes, densely and in float64, what one attention call must
return: each (query p, key j) pair reads the exact copy iff j < sink or p − j < tail,
else the body copy; causal, and p − j < W on a sliding layer; one softmax. `checking`
registers an attention implementation that runs kvarn's attention and this reference on
the very same inputs and records how far apart they are, next to the fp32 noise of the
reference itself (the same dense maths in float32 against float64): the two must agree
at fp32 noise, whatever the ubatch or query blocking.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import kvarn.kvcache.attention as kattn

CHECK_NAME = "kvarn_check"


def rounded(x: torch.Tensor, how: str) -> torch.Tensor:
    """x rounded to bf16 (torch's cast, to nearest even) or to TF32's 11 significant bits (to
    nearest, ties away from zero), in float64: m · 2^e with m in [0.5, 1) keeps round(m · 2^11).
    "tfloat32-truncate": TF32's 11 bits by truncation toward zero, m keeps trunc(m · 2^11) (how the
    flex kernel's TF32 dot reads its fp32 P, kvarn.kvcache.rounding's module doc)."""
    if how == "bfloat16":
        return x.to(torch.bfloat16).double()
    assert how in ("tfloat32", "tfloat32-truncate"), how
    m, e = torch.frexp(x.double())
    scaled = m * 2.0 ** 11
    kept = torch.trunc(scaled) if how == "tfloat32-truncate" else torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return torch.ldexp(kept / 2.0 ** 11, e)


def p_rounding(how: str, p_rule: str = "truncate") -> str:
    """How P is rounded under `how`: TF32's numerators by `p_rule` (the kernel's: truncate), bf16's
    as the other operands."""
    return "tfloat32-truncate" if how == "tfloat32" and p_rule == "truncate" else how


def reference_attention(query, layer, scaling, body_k, body_v, dtype=torch.float64, round_to=None, p_rule="truncate"):
    """query [b, H, n_q, D]; body_k/body_v [b, H_kv, L, D] (what the cache returned).
    Returns [b, H, n_q, D] in `dtype`.

    `round_to` (compute bf16-attn, tf32-attn: "bfloat16", "tfloat32"): Q, both copies of K and V,
    and the softmax numerators exp(s - max) are rounded so before the products (`rounded`; under
    TF32 the numerators by `p_rule`, `p_rounding`); the sums, the max and the denominator stay in
    `dtype`."""
    rnd = (lambda x: rounded(x, round_to).to(dtype)) if round_to is not None else (lambda x: x.to(dtype))  # noqa: E731
    rnd_p = (lambda x: rounded(x, p_rounding(round_to, p_rule)).to(dtype)) if round_to is not None else rnd  # noqa: E731
    pol = layer.policy
    b, H, n_q, D = query.shape
    n_kv, L = body_k.shape[1], body_k.shape[-2]
    p = torch.arange(layer.q_offset, layer.q_offset + n_q)[:, None]
    j = torch.arange(layer.kv_offset, layer.kv_offset + L)[None, :]  # the positions of the rows returned
    allowed = j <= p
    if pol.window is not None:
        allowed &= p - j < pol.window
    exact = (j < pol.sink) | (p - j < pol.tail)  # [n_q, L]
    ek = layer.exact_keys if layer.exact_keys is not None and layer.exact_keys.shape[-2] else body_k
    ev = layer.exact_values if layer.exact_values is not None and layer.exact_values.shape[-2] else body_v
    # Every (p, j) score against both copies, then the one the pair reads: the same sums as
    # gathering a key per pair, without an [n_q, L, D] tensor per call.
    rep = H // n_kv
    q = rnd(query).reshape(b, n_kv, rep, n_q, D)
    s_exact = torch.einsum("bgrqd,bgld->bgrql", q, rnd(ek))
    s_body = torch.einsum("bgrqd,bgld->bgrql", q, rnd(body_k))
    s = torch.where(exact, s_exact, s_body) * scaling
    s = s.masked_fill(~allowed, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    a = rnd_p(e) / e.sum(-1, keepdim=True)  # the softmax; its numerators rounded under round_to
    zero = torch.zeros((), dtype=dtype)
    out = (torch.einsum("bgrql,bgld->bgrqd", torch.where(exact, a, zero), rnd(ev))
           + torch.einsum("bgrql,bgld->bgrqd", torch.where(exact, zero, a), rnd(body_v)))
    return out.reshape(b, H, n_q, D)


class Recorder:
    def __init__(self):
        self.diffs: list[float] = []  # max |kvarn − ref64| per call
        self.noise: list[float] = []  # max |ref32 − ref64| per call
        self.calls = 0

    def worst_ratio(self) -> float:
        return max(d / max(n, 1e-12) for d, n in zip(self.diffs, self.noise))


@contextlib.contextmanager
def checking():
    """Register CHECK_NAME for the duration; yields a Recorder."""
    rec = Recorder()

    def fwd(module, query, key, value, attention_mask, scaling=None, kvarn_cache=None, **kw):
        out, _ = kattn.kvarn_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                               kvarn_cache=kvarn_cache, **kw)
        layer = kvarn_cache.layers[module.layer_idx]
        sc = scaling if scaling is not None else query.shape[-1] ** -0.5
        rd = kvarn_cache.attn_rounding  # compute bf16-attn, tf32-attn: the reference rounds as that path does
        ref64 = reference_attention(query, layer, sc, key, value, round_to=rd).transpose(1, 2)
        ref32 = reference_attention(query, layer, sc, key, value, torch.float32, round_to=rd).transpose(1, 2)
        rec.diffs.append((out.double() - ref64).abs().max().item())
        rec.noise.append((ref32.double() - ref64).abs().max().item())
        rec.calls += 1
        return out, None

    with registered(CHECK_NAME, fwd):
        yield rec


@contextlib.contextmanager
def registered(name: str, fwd):
    """Register `fwd` as attn_implementation `name` (with kvarn's boolean mask) for the block."""
    AttentionInterface.register(name, fwd)
    AttentionMaskInterface.register(name, kattn.kvarn_mask)
    try:
        yield
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
