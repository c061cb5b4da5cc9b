"""Persistent KV-cache bytes of one sequence (SPEC §5): the "KV cache MiB" column.

    total = body + overlay, summed over layers, KV heads, K and V:

    body    = fmt_K.nbytes(n_body, D) + fmt_V.nbytes(n_body, D)
    overlay = (rows_tail + rows_sink) * D * bytes(tail_dtype) * 2        (K and V)

per layer and KV head, with, for a layer of sliding window W (None = full attention):

    n_stored  = n_ctx if W is None else min(n_ctx, W)
    n_body    = n_stored                           standard types (every token, group 1)
              = 128 * floor(n_stored / 128)        KVarN: whole 128-token groups only
    rows_tail = min(tail_eff, n_stored)            tail_eff from kvarn.policy.layer_policy:
                                                   standard = tail as asked (0 allowed);
                                                   KVarN = max(128, roundup(tail, 128)), <= W
    rows_sink = min(128, n_stored) on KVarN full-attention layers, else 0

Conventions (decided here, stated in the README):

* The body stores every token, sink and tail tokens included; the tail and sink are
  extra exact copies (SPEC §2). The byte counts are the sizes of the packed buffers the
  formats produce (`fmt.nbytes`), not an allocator's capacity.
* KVarN's F16 staging group (the tokens of the incomplete last group, n_stored mod 128 of
  them, which have no body copy yet) is the newest part of the exact tail: tail_eff >= 128
  always covers it, so it adds no bytes of its own. "Tail 128*" therefore costs
  sink + 128 exact rows per full-attention layer and is KVarN's own baseline: tables
  report it with the overlay included, and a requested tail 0 gives the same bytes.
* Sink and tail are counted as separate buffers; below n_ctx = sink + tail they hold some
  tokens twice, as two buffers would.
* A sliding layer keeps exactly min(n_ctx, W) tokens (a ring of W, no extra slack for an
  unaligned group); with KVarN its body is the whole groups among them and its tail is
  capped at W (no sink).
"""

from __future__ import annotations

from dataclasses import dataclass

from .formats import get_format
from .geometry import Geometry
from .policy import default_tail_dtype, layer_policy, pair_family

MIB = 2**20


@dataclass(frozen=True)
class KVBytes:
    body: int
    overlay: int
    total: int


def kv_bytes(geom: Geometry, n_ctx: int, k_type: str, v_type: str, tail: int,
             tail_dtype: str | None = None, rot: bool = True) -> KVBytes:
    """Bytes of the K and V cache of one sequence of n_ctx tokens (see the module docstring)."""
    if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx < 1:
        raise ValueError(f"n_ctx must be a positive integer, got {n_ctx!r}")
    k_fmt = get_format(k_type, role="k", rot=rot)
    v_fmt = get_format(v_type, role="v", rot=rot)
    family = pair_family(k_fmt, v_fmt)
    tail_dtype = tail_dtype or default_tail_dtype(k_fmt, v_fmt)
    exact = get_format(tail_dtype)
    if exact.family != "float":
        raise ValueError(f"tail_dtype must be a float type (f16, bf16, f32), got {tail_dtype!r}")
    group = max(k_fmt.group, v_fmt.group)
    body = overlay = 0
    for layer in geom.layers:
        if not layer.has_kv:
            continue
        d, h, window = layer.head_dim, layer.n_kv_heads, layer.window
        row = exact.nbytes(1, d)  # one exact token of one head, K or V
        pol = layer_policy(k_fmt, v_fmt, tail, window)
        stored = n_ctx if window is None else min(n_ctx, window)
        n_body = stored - stored % group
        body += h * (k_fmt.nbytes(n_body, d) + v_fmt.nbytes(n_body, d))
        rows = min(pol.tail, stored) + (min(pol.sink, stored) if family == "kvarn" else 0)
        overlay += h * 2 * rows * row
    return KVBytes(body=body, overlay=overlay, total=body + overlay)


def tail_label(k_type: str, v_type: str, tail: int) -> str:
    """The tail as tables print it: '128*' where KVarN raised the request to its minimum."""
    eff = max(get_format(k_type, "k").effective_tail(tail), get_format(v_type, "v").effective_tail(tail))
    return f"{eff}*" if eff != tail else str(tail)


def bytes_table(geom: Geometry, n_ctx: int, pairs, tails=(0, 128), tail_dtype: str | None = None,
                rot: bool = True) -> list[dict]:
    """One row per (K type, V type, tail): body/overlay/total MiB and the Δ vs tail 0."""
    out = []
    for k_type, v_type in pairs:
        base = kv_bytes(geom, n_ctx, k_type, v_type, 0, tail_dtype, rot)
        for tail in tails:
            b = kv_bytes(geom, n_ctx, k_type, v_type, tail, tail_dtype, rot)
            out.append({
                "k_type": k_type, "v_type": v_type, "tail": tail,
                "tail_label": tail_label(k_type, v_type, tail),
                "body_mib": b.body / MIB, "overlay_mib": b.overlay / MIB, "total_mib": b.total / MIB,
                "delta_tail0_mib": (b.total - base.total) / MIB,
            })
    return out
