"""The cache model's attention as one FlexAttention call per layer call (attention path "flex").

The same maths as `kvarn.kvcache.attention`'s reference path (DESIGN §2: one fp32 softmax in which
every allowed (query, key position) pair is counted once, from the exact or the body copy),
computed by torch's `flex_attention` instead of a materialised mask and sdpa per query block:

    keys   = [K_body ; K_exact]   (2L rows, fp32; the exact copy widened, exact)
    values = [V_body ; V_exact]
    row r  -> (source, position): exact iff r >= L, position kv_offset + r mod L

and a `mask_mod` allowing (query q, row r) iff the model's rule allows (p, j) (causal, and
p - j < W on a sliding layer) AND (source is exact) == `kvarn.kvcache.cache.reads_exact(p, j, ...)`,
the one DESIGN §2 selection rule. `create_block_mask` turns it into a `BlockMask`, so whole
128 x 128 blocks no query reads (most of the exact half, the causal future) are skipped.

Positions, offsets, sink, tail and window enter the mask_mod as 0-d tensors, not Python ints,
so the compiled kernel (`torch.compile(flex_attention, dynamic=True)`, once per process) is
not recompiled per ubatch or layer. The model's boolean mask is still checked against the
rule on every call (a mask the rule does not reproduce, e.g. padding, is refused), and a
KVarN body row of an incomplete group is refused as on the reference path (shared checks:
`kvarn.kvcache.cache.check_body_rows`).

`COMPILE = False` runs flex_attention eagerly (an unfused dense path; the tests use it on
tiny shapes to stay fast). `calls` counts the layer calls served here (tests and benches
assert that this path ran).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from kvarn.kvcache.cache import check_body_rows, exact_selection, reads_exact
from kvarn.kvcache.rounding import round_operand

COMPILE = True
calls = 0
_compiled = None
# The BlockMasks of the current ubatch, one per (positions, lengths, layer policy, device): every
# layer of one kind in a ubatch has the same mask, so it is built once per (layer kind, length),
# not once per layer call (a dense mask_mod evaluation each). Cleared when full; `built` counts builds.
MASK_CACHE = 8
_masks: dict = {}
built = 0


def allowed(p, j, window):
    """The model's own mask rule, elementwise: key j is visible to the query at p iff j <= p
    and p - j < window (window: W on a sliding layer, anything beyond the context otherwise)."""
    return (j <= p) & (p - j < window)


def _kernel():
    global _compiled
    if not COMPILE:
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=True)
    return _compiled


def _window(policy, q_end: int) -> int:
    # A full layer's "window" reaches past every key a query of this call can see.
    return policy.window if policy.window is not None else q_end + 1


def block_mask(q_offset: int, n_q: int, kv_offset: int, n_body: int, n_exact: int, policy, device) -> BlockMask:
    """The BlockMask of one call: n_q queries from position q_offset over [body ; exact] rows,
    n_body body rows from position kv_offset, then n_exact (0 or n_body) exact rows. Built once
    per distinct call shape and kept (`_masks`): the other layers of the ubatch reuse it."""
    global built
    key = (q_offset, n_q, kv_offset, n_body, n_exact, policy, str(torch.device(device)))
    bm = _masks.get(key)
    if bm is None:
        if len(_masks) >= MASK_CACHE:
            _masks.clear()
        bm = _masks[key] = build_block_mask(q_offset, n_q, kv_offset, n_body, n_exact, policy, device)
        built += 1
    return bm


def clear_masks() -> None:
    """Forget the kept BlockMasks (a test counting builds starts from none)."""
    _masks.clear()


def build_block_mask(q_offset: int, n_q: int, kv_offset: int, n_body: int, n_exact: int, policy, device) -> BlockMask:
    """`block_mask` without the cache: the mask_mod of DESIGN §2's rule, made into a BlockMask."""
    t = lambda x: torch.tensor(x, device=device)  # noqa: E731
    q0, k0, rows = t(q_offset), t(kv_offset), t(n_body)
    sink, tail, window = t(policy.sink), t(policy.tail), t(_window(policy, q_offset + n_q))

    def mask_mod(b, h, q_idx, kv_idx):
        from_exact = kv_idx >= rows
        j = k0 + torch.where(from_exact, kv_idx - rows, kv_idx)
        p = q0 + q_idx
        return allowed(p, j, window) & (from_exact == reads_exact(p, j, sink, tail))

    return create_block_mask(mask_mod, None, None, n_q, n_body + n_exact, device=device)


def check_mask(module, layer, policy, attention_mask, n_q: int, L: int) -> None:
    """What `attention` checks before each flex call: the model's mask must be the rule the
    mask_mod applies; and no query may read a body row KVarN has not written yet (one host
    sync for both)."""
    dev = attention_mask.device
    p = torch.arange(layer.q_offset, layer.q_offset + n_q, device=dev)
    j = torch.arange(layer.kv_offset, layer.kv_offset + L, device=dev)
    rule = allowed(p[:, None], j[None, :], _window(policy, layer.q_offset + n_q))
    same = (attention_mask[..., -n_q:, :] == rule).all()
    body_cols = (rule & ~exact_selection(p, L, policy, layer.kv_offset)).any(0)
    body_end = torch.where(body_cols, j + 1, 0).max()
    same, body_end = torch.stack([same.long(), body_end]).tolist()
    if not same:
        raise RuntimeError(
            f"layer {module.layer_idx}: the model's attention mask is not the causal"
            f"{'' if policy.window is None else f' / sliding-window ({policy.window})'} mask of queries "
            f"{layer.q_offset}..{layer.q_offset + n_q - 1} over keys {layer.kv_offset}..{layer.kv_offset + L - 1} "
            "(padding or another mask?); the flex path computes only that rule: use attention 'ref'")
    check_body_rows(module, layer, body_end)


def attention(module, query, key, value, attention_mask, scaling, layer, policy,
              attn_rounding: str | None = None) -> torch.Tensor:
    """query [b, H, n_q, D]; key/value: the body rows [b, H_kv, L, D]. Returns [b, n_q, H, D]
    in the query's dtype (as `kvarn.kvcache.attention.attention_ref`).

    `attn_rounding` (kvarn.vocab.options.ATTENTION_ROUNDING): "bfloat16" (compute bf16-attn): Q, K
    and V go to flex_attention in bf16, whose compiled kernel sums Q·K and P·V in fp32, keeps the
    softmax in fp32 and rounds P to V's dtype (`kvarn.kvcache.attention.rounded_attention`'s
    arithmetic); eager (`COMPILE = False`) flex also rounds the scores to bf16: the tests'
    tolerance, never a run's path on a GPU. "tfloat32" (tf32-attn): fp32 operands rounded to TF32
    here, and the compiled kernel's dots in TF32 (FLOAT32_PRECISION 'tf32': P truncated to TF32 as the MMA reads it, kvarn.kvcache.rounding);
    eager flex computes them in fp32."""
    global calls
    n_heads, n_q = query.shape[1], query.shape[-2]
    n_kv, L = key.shape[1], key.shape[-2]
    check_mask(module, layer, policy, attention_mask, n_q, L)
    ek, ev = layer.exact_keys, layer.exact_values
    n_exact = 0 if ek is None else ek.shape[-2]
    if n_exact not in (0, L) or (n_exact == 0 and (policy.sink or policy.tail)):
        raise RuntimeError(f"layer {module.layer_idx}: {n_exact} exact rows beside {L} body rows "
                           f"(sink {policy.sink}, tail {policy.tail}); the cache and the policy disagree")
    # fp32 keys and values (widening the bf16 / f16 body of the float types and the exact copy
    # is exact: their values are those dtypes'), or all operands rounded as `attn_rounding`.
    dt = torch.bfloat16 if attn_rounding == "bfloat16" else torch.float32
    if n_exact:
        k = torch.cat([key.to(dt), ek.to(dt)], dim=-2)
        v = torch.cat([value.to(dt), ev.to(dt)], dim=-2)
    else:
        k, v = key.to(dt), value.to(dt)
    q = query.to(dt)
    options = {}
    if attn_rounding == "tfloat32":
        q, k, v = (round_operand(x, attn_rounding) for x in (q, k, v))
        if COMPILE:
            options = {"kernel_options": {"FLOAT32_PRECISION": "'tf32'"}}
    bm = block_mask(layer.q_offset, n_q, layer.kv_offset, L, n_exact, policy, query.device)
    out = _kernel()(q, k, v, block_mask=bm, scale=scaling, enable_gqa=n_heads != n_kv, **options)
    calls += 1
    return out.to(query.dtype).transpose(1, 2).contiguous()
