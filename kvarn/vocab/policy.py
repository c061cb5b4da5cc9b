"""Which key positions a query reads exactly (DESIGN §2): the sink and the tail.

For a query at p and a key at j <= p (and p - j < W on a sliding layer of window W),
attention reads the exact copy if j < sink or p - j < tail, else the body copy.

The functions take two objects with the type facts' attributes (name, family, sink,
default_tail_dtype, effective_tail): `kvarn.formats` formats or `kvarn.vocab.facts.TypeFacts`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvarn.vocab.scoring import scored_range


@dataclass(frozen=True)
class LayerPolicy:
    sink: int  # exact leading tokens
    tail: int  # exact most recent tokens (effective, after rounding and capping)
    window: int | None  # sliding window W, None on full-attention layers


def pair_family(k_fmt, v_fmt) -> str:
    """'kvarn', 'ecosystem' (transformers' QuantizedCache backends) or 'standard'; KVarN and
    the ecosystem types cannot be mixed with other types in one cache."""
    fams = {k_fmt.family == "kvarn", v_fmt.family == "kvarn"}
    if len(fams) != 1:
        raise ValueError(
            f"K type {k_fmt.name!r} and V type {v_fmt.name!r} mix KVarN with a standard type; "
            "use kvarnN for both K and V, or standard types for both"
        )
    eco = {k_fmt.family == "ecosystem", v_fmt.family == "ecosystem"}
    if len(eco) != 1:
        raise ValueError(
            f"K type {k_fmt.name!r} and V type {v_fmt.name!r} mix a QuantizedCache backend type with another "
            "family; use quantoN, hqqN or kiviN for both K and V"
        )
    return "kvarn" if True in fams else "ecosystem" if True in eco else "standard"


def default_sink(k_fmt, v_fmt) -> int:
    """The pair's own sink on full-attention layers (the facts: 0 standard, 128 KVarN)."""
    return max(k_fmt.sink, v_fmt.sink)


def layer_policy(k_fmt, v_fmt, tail: int, window: int | None = None, sink: int | None = None) -> LayerPolicy:
    """The sink and effective tail one layer uses for a requested tail (and sink).

    Standard types: sink 0 (or `sink` when asked), tail as requested. KVarN: sink 128 on
    full-attention layers, tail max(128, roundup(tail, 128)) capped at the window. No
    sink on sliding-window layers (KVarN's rule, kept for a standard type's sink too).
    The tail and sink are a cell's, already checked (`kvarn.vocab.cell.CellSpec.validate`).
    """
    eff = max(k_fmt.effective_tail(tail), v_fmt.effective_tail(tail))
    sink = default_sink(k_fmt, v_fmt) if sink is None else sink
    if window is not None:
        sink = 0
        eff = min(eff, window)
    return LayerPolicy(sink=sink, tail=eff, window=window)


def default_tail_dtype(k_fmt, v_fmt) -> str:
    """The exact copy's dtype when none is asked: the pair's own default from the facts
    table (`kvarn.vocab.facts`): BF16 for standard types, F16 for KVarN (DESIGN §2)."""
    pair_family(k_fmt, v_fmt)
    return k_fmt.default_tail_dtype


def exact_pairs(policy: LayerPolicy, n_ctx: int) -> tuple[int, int]:
    """(exact, read) (query, key) pairs of one layer over the scored queries of a chunk.

    Scored queries p = n_ctx/2 … n_ctx−2 (DESIGN §6); a query reads the keys
    lo(p) = max(0, p − W + 1) … p (lo = 0 on full layers), each from the exact copy iff
    j < sink or p − j < tail (DESIGN §2). Counted per query in O(1): the exact keys are the
    union of [lo, min(sink, p + 1)) and [max(lo, p − tail + 1), p].
    """
    exact = read = 0
    for p in scored_range(n_ctx):
        lo = 0 if policy.window is None else max(0, p - policy.window + 1)
        read += p + 1 - lo
        sink_hi = max(lo, min(policy.sink, p + 1))  # sink keys: [lo, sink_hi)
        tail_lo = max(lo, p - policy.tail + 1)  # tail keys: [tail_lo, p]
        exact += (sink_hi - lo) + (p + 1 - max(tail_lo, sink_hi))
    return exact, read


def exact_share(policies, n_ctx: int) -> float:
    """The fraction of (scored query, key) pairs read from the exact copy, per attention
    layer, averaged over the layers (each layer weighs the same, as each adds its own
    error to the residual stream). 1 − exact_share is the share read from the body."""
    cache: dict[LayerPolicy, float] = {}
    for pol in policies:
        if pol not in cache:
            e, r = exact_pairs(pol, n_ctx)
            cache[pol] = e / r
    return sum(cache[p] for p in policies) / len(policies)
