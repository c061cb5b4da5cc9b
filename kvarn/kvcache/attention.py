"""The attention function of the cache model: one fp32 softmax over exact and body keys.

Owns `kvarn_attention_forward`, registered with transformers as attn_implementation "kvarn"
(`ATTN_NAME`; in `AttentionInterface`, and with `kvarn_mask` in
`masking_utils.AttentionMaskInterface`, without which transformers passes no mask at all);
the checks both paths share (`check_call`, `check_mask_size`); the reference path
`attention_ref` (keys [body ; exact], mask [allowed & ~sel ; allowed & sel], queries in blocks
of `QUERY_BLOCK` over the key spans of `block_spans` / `single_query_spans`, masks from
`split_mask`), its bf16-attn / tf32-attn form `rounded_attention`, and `resolve_attention`
("auto" to "ref" or "flex"; the flex path is `kvarn.kvcache.flex`).

Why (the one softmax, the blocks, the mask registration): docs/notes/engine.md "Design";
the rounded computes and flex: docs/notes/scale.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvarn.kvcache import flex

from kvarn.llamacpp_cpu import compute
from kvarn.kvcache.cache import KVarnCache, check_body_rows, exact_selection
from kvarn.kvcache.rounding import round_operand, round_p
from kvarn.vocab.options import attention_for

ATTN_NAME = "kvarn"


def kvarn_mask(*args, **kwargs):
    """The mask function registered for attn_implementation "kvarn" (and for any probe
    that wraps this attention, e.g. `kvarn.run.layer_error`): sdpa's boolean mask, always
    materialized, because the attention splits it between the two copies, so sdpa's
    is_causal shortcut (mask None) cannot be used."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


QUERY_BLOCK = 128  # queries per sdpa call: keys outside a block's reach are not computed
DECODE_SPANS = True  # one-query calls take their spans from single_query_spans (False: from the masks, the tests' reference)


def block_spans(block: int, *masks_ranges) -> list[list[tuple[int, int] | None]]:
    """Per block of `block` query rows: [lo, hi) of the columns selected in each (mask, (a, z)).

    Each mask is [..., n_q, L]. All blocks and ranges are computed on the masks' device and
    read back in one transfer (one host sync per layer call, not one per block).
    """
    parts = []
    for mask, (a, z) in masks_ranges:
        n_q, L = mask.shape[-2:]
        n_blocks = -(-n_q // block)
        if z <= a:
            parts.append(torch.zeros(n_blocks, 3, dtype=torch.long, device=mask.device))
            continue
        m = mask[..., a:z].reshape(-1, n_q, z - a).any(0)
        if n_blocks * block > n_q:
            m = torch.cat([m, m.new_zeros(n_blocks * block - n_q, z - a)])
        cols = m.view(n_blocks, block, z - a).any(1).to(torch.uint8)  # [n_blocks, z - a]
        first = cols.argmax(1)
        last = (z - a - 1) - cols.flip(1).argmax(1)
        parts.append(torch.stack([cols.amax(1).long(), a + first, a + last + 1], dim=1))
    table = torch.stack(parts, dim=1).tolist()  # [n_blocks][n_ranges][has, lo, hi]
    return [[(lo, hi) if has else None for has, lo, hi in row] for row in table]


def single_query_spans(q_pos: int, kv_offset: int, L: int, sink: int, tail: int) -> list[tuple[int, int] | None]:
    """`block_spans`' row for one query at q_pos whose mask allows all L keys (positions
    kv_offset .. q_pos): a decode step, where computing the spans from the masks (~40
    small tensor ops and a host sync per layer) would cost more than the attention itself.
    Same spans, from `reads_exact`'s intervals: the body reads positions j >= sink with
    q_pos - j >= tail; the exact copy the sink (j < sink) and the band q_pos - j < tail."""
    sink_c = min(max(sink - kv_offset, 0), L)
    body = (max(0, sink - kv_offset), min(L, q_pos - tail - kv_offset + 1))
    band = (max(sink_c, q_pos - tail - kv_offset + 1), L)
    return [body if body[0] < body[1] else None, (0, sink_c) if sink_c > 0 else None,
            band if band[0] < band[1] else None]


def _block_keys(key, value, layer, body_mask, exact_mask, spans):
    """Keys, values (fp32) and mask for one block of queries: only the key spans it reads.

    spans: (body span, exact sink span, exact tail-band span) from `block_spans`. A block
    of B queries with tail N thus reads about (last position + B) keys instead of 2L, and
    none beyond its last query. The exact copy (stored in the tail dtype) is widened to
    fp32 span by span: exact, its values are that dtype's.
    """
    ks, vs, ms = [], [], []
    for i, span in enumerate(spans):
        if span is None:
            continue
        lo, hi = span
        k, v, m = (key, value, body_mask) if i == 0 else (layer.exact_keys, layer.exact_values, exact_mask)
        ks.append(k[..., lo:hi, :].float())
        vs.append(v[..., lo:hi, :].float())
        ms.append(m[..., lo:hi])
    if len(ks) == 1:
        return ks[0], vs[0], ms[0]
    return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2), torch.cat(ms, dim=-1)


def split_mask(allowed: torch.Tensor, q_offset: int, policy, kv_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(body_mask, exact_mask) from the model's boolean mask `allowed` [..., n_q, L].

    Queries sit at positions q_offset .. q_offset + n_q - 1, keys at kv_offset ..
    kv_offset + L - 1. Every allowed pair is True in exactly one of the two masks.
    """
    n_q, L = allowed.shape[-2:]
    q_pos = torch.arange(q_offset, q_offset + n_q, device=allowed.device)
    sel = exact_selection(q_pos, L, policy, kv_offset)
    return allowed & ~sel, allowed & sel


def resolve_attention(attention: str, device) -> str:
    """The attention path a run takes on `device`: "ref" or "flex" (`kvarn.vocab.options.attention_for`:
    "auto" is flex on CUDA, ref elsewhere)."""
    return attention_for(attention, torch.device(device).type)


def check_call(module, attention_mask, dropout, softcap, sliding_window, kvarn_cache):
    """The checks every path makes on one attention call; returns (layer, policy)."""
    if kvarn_cache is None:
        raise RuntimeError(
            "attn_implementation 'kvarn' needs the cache passed as a forward kwarg: "
            "model(ids, cache=cache, kvarn_cache=cache)"
        )
    if softcap is not None or getattr(module, "attn_logit_softcapping", None) is not None:
        raise NotImplementedError(
            f"attention logit softcapping ({softcap or module.attn_logit_softcapping}) is not supported by the kvarn "
            "cache model (Gemma 2 style); Gemma 3 and models without it are"
        )
    if dropout:
        raise ValueError(f"dropout {dropout} in attention: put the model in eval() mode")
    if attention_mask is None or attention_mask.dtype != torch.bool:
        raise RuntimeError(
            "kvarn attention received no boolean mask: 'kvarn' must be registered with "
            "masking_utils.AttentionMaskInterface (import kvarn.kvcache.attention does it)"
        )
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(
            f"layer {module.layer_idx} attends bidirectionally (e.g. Gemma 4 use_bidirectional_attention='all'); "
            "the kvarn cache model is for causal decoders"
        )
    layer = kvarn_cache.layers[module.layer_idx]
    policy = kvarn_cache.policies[module.layer_idx]
    if policy is None:
        raise RuntimeError(
            f"layer {module.layer_idx} calls attention, but the config gives it a layer type without a KV cache "
            f"({kvarn_cache.geometry.layers[module.layer_idx].kind}); the model and the cache's config disagree"
        )
    if sliding_window != policy.window and (sliding_window is not None or policy.window is not None):
        raise RuntimeError(
            f"layer {module.layer_idx}: model uses sliding window {sliding_window}, cache policy expects {policy.window}"
        )
    return layer, policy


def check_mask_size(module, layer, attention_mask, n_keys: int) -> None:
    if attention_mask.shape[-1] != n_keys:
        raise RuntimeError(f"layer {module.layer_idx}: the mask covers {attention_mask.shape[-1]} keys, the cache "
                           f"returned {n_keys} (from position {layer.kv_offset}); its get_mask_sizes and update disagree")


def kvarn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kvarn_cache: KVarnCache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [b, H, n_q, D]; key/value: the body rows [b, H_kv, L, D] from KVarnLayer.update.

    Runs the cache's attention path: this module's blocked sdpa (`attention_ref`, "ref")
    or one flex_attention call (`kvarn.kvcache.flex`, "flex"), after the same checks.
    """
    layer, policy = check_call(module, attention_mask, dropout, softcap, sliding_window, kvarn_cache)
    if layer.compute != "exact":
        return compute.attention(module, query, layer, attention_mask, scaling or query.shape[-1] ** -0.5), None
    check_mask_size(module, layer, attention_mask, key.shape[-2])
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if kvarn_cache.attention == "flex":
        return flex.attention(module, query, key, value, attention_mask, scaling, layer, policy,
                              kvarn_cache.attn_rounding), None
    return attention_ref(module, query, key, value, attention_mask, scaling, layer, policy,
                         kvarn_cache.attn_rounding), None


def rounded_attention(q, k, v, mask, scale: float, rounding: str, p_rule: str | None = None) -> torch.Tensor:
    """Attention on operands rounded as `rounding` (compute bf16-attn, tf32-attn: `round_operand`),
    as a GPU's flash attention computes it: S = (Q·K^T)·scale from rounded operands summed in fp32,
    the softmax's max and sum in fp32, the numerators P = exp(S - max) rounded for P·V (summed in
    fp32), divided by the fp32 sum last (flex_attention's kernel: scores scaled in fp32, p cast to
    V's dtype). The products are formed on the rounded values in fp32: a product of two bf16 (TF32)
    values is exact in fp32, so only the accumulation order differs from tensor cores.
    P under TF32 (`kvarn.kvcache.rounding.round_p`): `p_rule` "truncate" (None: TF32_P_RULE, the
    flex kernel's TF32 dot, which reads its fp32 P truncated; the evidence in that module) or
    "nearest"; Q, K and V are rounded to nearest either way (the flex path rounds them before the
    kernel, whose truncation then changes nothing).
    q [..., n, D], k and v [..., L, D] (fp32), mask [..., n, L] (bool, a True in every row);
    returns fp32 [..., n, D]."""
    r = lambda x: round_operand(x, rounding)  # noqa: E731
    s = torch.matmul(r(q), r(k).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return torch.matmul(round_p(p, rounding, p_rule), r(v)) / p.sum(-1, keepdim=True)


def attention_ref(module, query, key, value, attention_mask, scaling, layer, policy,
                  attn_rounding: str | None = None) -> torch.Tensor:
    """The reference path: fp32 sdpa per block of QUERY_BLOCK queries over the key spans the
    block reads (docs/notes/engine.md "Design"); with `attn_rounding` (compute bf16-attn, tf32-attn)
    `rounded_attention` in its place. Returns [b, n_q, H, D] in the query's dtype."""
    b, n_heads, n_q, d = query.shape
    n_kv, L = key.shape[1], key.shape[-2]
    rep = n_heads // n_kv
    off = layer.kv_offset
    body_mask, exact_mask = split_mask(attention_mask[..., -n_q:, :], layer.q_offset, policy, off)
    sink = min(max(policy.sink - off, 0), L)
    # Per query block: the body span, the exact sink span, the exact tail-band span.
    if DECODE_SPANS and n_q == 1 and layer.q_offset == off + L - 1 and bool(attention_mask[..., -1:, :].all()):
        spans = [single_query_spans(layer.q_offset, off, L, policy.sink, policy.tail)]  # a decode step
    else:
        spans = block_spans(QUERY_BLOCK, (body_mask, (0, L)), (exact_mask, (0, sink)), (exact_mask, (sink, L)))
    check_body_rows(module, layer, max((off + body[1] for body, *_ in spans if body is not None), default=0))
    # A bf16 / f16 body (float-type cells, the baseline) is widened once per call (exact:
    # its values are that dtype's); the exact copy's few rows per block in _block_keys.
    key, value = key.float(), value.float()
    q = query.float()
    outs = []
    for i, qs in enumerate(range(0, n_q, QUERY_BLOCK)):
        qe = min(qs + QUERY_BLOCK, n_q)
        k_blk, v_blk, m_blk = _block_keys(key, value, layer, body_mask[..., qs:qe, :], exact_mask[..., qs:qe, :],
                                          spans[i])
        # GQA without repeating K/V: the `rep` query heads sharing a KV head become extra
        # query rows of that head (same per-row maths as repeat_kv).
        q_blk = q[:, :, qs:qe].reshape(b, n_kv, rep * (qe - qs), d)
        if attn_rounding is None:
            o = F.scaled_dot_product_attention(q_blk, k_blk, v_blk, attn_mask=m_blk.repeat(1, 1, rep, 1), scale=scaling)
        else:
            o = rounded_attention(q_blk, k_blk, v_blk, m_blk.repeat(1, 1, rep, 1), scaling, attn_rounding)
        outs.append(o.reshape(b, n_heads, qe - qs, d))
    out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).to(query.dtype)
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(ATTN_NAME, kvarn_attention_forward)
AttentionMaskInterface.register(ATTN_NAME, kvarn_mask)
