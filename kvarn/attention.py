"""The attention function of the cache model: one fp32 softmax over exact and body keys.

Registered with transformers as attn_implementation "kvarn" (both in `AttentionInterface`
and in `masking_utils.AttentionMaskInterface`: without the mask registration transformers
silently passes no mask at all, i.e. no causal masking).

For a ubatch of queries at positions q_offset .. q_offset + n_q - 1 over L cached keys:

    keys   = [K_body ; K_exact]              (2L rows)
    values = [V_body ; V_exact]
    mask   = [allowed & ~sel ; allowed & sel]

where `allowed` is the model's own causal / sliding-window mask and `sel` the SPEC §2
selection (`kvarn.cache.exact_selection`). Every allowed (query, key position) pair is
therefore counted exactly once, from one of the two copies, in a single softmax. For
speed the queries go in blocks of QUERY_BLOCK, each with only the key rows its mask can
select (body: one span; exact: the sink and the tail band), so the exact half costs about
one block of extra keys instead of doubling attention, and causal waste is cut too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvarn.cache import KVarnCache, exact_selection

ATTN_NAME = "kvarn"


def _kvarn_mask(*args, **kwargs):
    # Always materialize the boolean mask: the attention splits it between the two copies,
    # so sdpa's is_causal shortcut (mask None) cannot be used.
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


QUERY_BLOCK = 128  # queries per sdpa call: keys outside a block's reach are not computed


def _span(cols: torch.Tensor) -> tuple[int, int] | None:
    """[lo, hi) of the True entries of a 1-D bool tensor, or None."""
    idx = cols.nonzero()
    return (int(idx[0]), int(idx[-1]) + 1) if idx.numel() else None


def _block_keys(key, value, layer, body_mask, exact_mask):
    """Keys, values and mask for one block of queries: only the key ranges it reads.

    Body rows in one contiguous span; exact rows in at most two (the sink, and the tail
    band of the block's queries), so a block of B queries with tail N reads about
    (last position + B) keys instead of 2L, and none beyond its last query.
    """
    ks, vs, ms = [], [], []
    span = _span(body_mask.flatten(0, -2).any(0))
    if span:
        lo, hi = span
        ks.append(key[..., lo:hi, :])
        vs.append(value[..., lo:hi, :])
        ms.append(body_mask[..., lo:hi])
    e_cols = exact_mask.flatten(0, -2).any(0)
    L = e_cols.shape[0]
    sink = min(layer.policy.sink, L)
    for a, z in ((0, sink), (sink, L)):
        span = _span(e_cols[a:z])
        if span:
            lo, hi = a + span[0], a + span[1]
            ks.append(layer.exact_keys[..., lo:hi, :])
            vs.append(layer.exact_values[..., lo:hi, :])
            ms.append(exact_mask[..., lo:hi])
    if len(ks) == 1:
        return ks[0], vs[0], ms[0]
    return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2), torch.cat(ms, dim=-1)


def split_mask(allowed: torch.Tensor, q_offset: int, policy) -> tuple[torch.Tensor, torch.Tensor]:
    """(body_mask, exact_mask) from the model's boolean mask `allowed` [..., n_q, L].

    Queries sit at positions q_offset .. q_offset + n_q - 1, keys at 0 .. L - 1. Every
    allowed pair is True in exactly one of the two masks.
    """
    n_q, L = allowed.shape[-2:]
    q_pos = torch.arange(q_offset, q_offset + n_q, device=allowed.device)
    sel = exact_selection(q_pos, L, policy)
    return allowed & ~sel, allowed & sel


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
    """query [b, H, n_q, D]; key/value: the body copies [b, H_kv, L, D] from KVarnLayer.update."""
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
            "masking_utils.AttentionMaskInterface (import kvarn.attention does it)"
        )
    layer = kvarn_cache.layers[module.layer_idx]
    policy = layer.policy
    if sliding_window != policy.window and (sliding_window is not None or policy.window is not None):
        raise RuntimeError(
            f"layer {module.layer_idx}: model uses sliding window {sliding_window}, cache policy expects {policy.window}"
        )
    b, n_heads, n_q, d = query.shape
    n_kv, L = key.shape[1], key.shape[-2]
    rep = n_heads // n_kv
    if scaling is None:
        scaling = d**-0.5

    body_mask, exact_mask = split_mask(attention_mask[..., -n_q:, -L:], layer.q_offset, policy)
    if layer.n_body < L and body_mask[..., layer.n_body :].any():
        raise AssertionError(
            f"layer {module.layer_idx}: a query reads body rows {layer.n_body}..{L - 1} of an incomplete "
            f"{layer.group}-token group; the tail ({policy.tail}) must cover them"
        )
    q = query.float()
    outs = []
    for qs in range(0, n_q, QUERY_BLOCK):
        qe = min(qs + QUERY_BLOCK, n_q)
        k_blk, v_blk, m_blk = _block_keys(key, value, layer, body_mask[..., qs:qe, :], exact_mask[..., qs:qe, :])
        # GQA without repeating K/V: the `rep` query heads sharing a KV head become extra
        # query rows of that head (same per-row maths as repeat_kv).
        q_blk = q[:, :, qs:qe].reshape(b, n_kv, rep * (qe - qs), d)
        o = F.scaled_dot_product_attention(q_blk, k_blk, v_blk, attn_mask=m_blk.repeat(1, 1, rep, 1), scale=scaling)
        outs.append(o.reshape(b, n_heads, qe - qs, d))
    out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, kvarn_attention_forward)
AttentionMaskInterface.register(ATTN_NAME, _kvarn_mask)
