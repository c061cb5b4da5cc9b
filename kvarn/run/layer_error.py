"""Per-layer attention error of a cell: which layers, and which of K and V, the damage comes from.

Owns: the probe (`layer_errors`) and its table. The model runs teacher-forced on the cell's
own path (its quantized cache, so errors of earlier layers reach later ones as in the
cell's run). At every attention layer the same queries also attend

* over an fp32 copy of the same keys and values (the exact cache: reference output o),
* with the cell's K and exact V (K error only) and with exact K and the cell's V (V only),

and the relative L2 error ‖o_variant − o‖ / ‖o‖ of the attention output (before o_proj) is
accumulated over the scored positions (n_ctx/2 … n_ctx−2) of every chunk. The cell's exact
copies (sink, tail, at the tail dtype) are read as in the cell; only the body differs between
the variants. The fp32 copy is a second `KVarnCache` (`f32`/`f32`, tail 0) fed the same K/V.
"""

from __future__ import annotations

import polars as pl
import torch

import kvarn.kvcache.attention as kattn
from kvarn.vocab import scoring
from kvarn.run.forward import new_cache
from kvarn.vocab.cell import CellSpec
from kvarn.vocab.options import EXACT

VARIANTS = ("kv", "k", "v")  # both quantized (the cell), K only, V only
REFERENCE = CellSpec("f32", "f32", 0)  # the fp32 copy every variant is compared with


class _Probe:
    """Per layer: Σ‖o_variant − o‖² and Σ‖o‖² over scored query rows."""

    def __init__(self, ref, n_layers: int, scored: range):
        self.ref, self.scored = ref, scored
        self.num = {v: torch.zeros(n_layers, dtype=torch.float64) for v in VARIANTS}
        self.den = torch.zeros(n_layers, dtype=torch.float64)
        self.seen = torch.zeros(n_layers, dtype=torch.long)


def _probe_forward(module, query, key, value, attention_mask, kvarn_cache=None, kvarn_probe=None, **kwargs):
    fwd = kattn.kvarn_attention_forward
    out, w = fwd(module, query, key, value, attention_mask, kvarn_cache=kvarn_cache, **kwargs)
    if kvarn_probe is None:
        return out, w
    i = module.layer_idx
    layer, ref = kvarn_cache.layers[i], kvarn_probe.ref.layers[i]
    n_q = query.shape[2]
    lo = max(kvarn_probe.scored.start - layer.q_offset, 0)
    hi = min(kvarn_probe.scored.stop - layer.q_offset, n_q)
    if hi <= lo:
        return out, w
    o_ref = fwd(module, query, ref.keys, ref.values, attention_mask, kvarn_cache=kvarn_probe.ref, **kwargs)[0]
    o_k = fwd(module, query, key, ref.values, attention_mask, kvarn_cache=kvarn_cache, **kwargs)[0]
    o_v = fwd(module, query, ref.keys, value, attention_mask, kvarn_cache=kvarn_cache, **kwargs)[0]
    r = o_ref[:, lo:hi].double()
    kvarn_probe.den[i] += float((r * r).sum())
    for name, o in (("kv", out), ("k", o_k), ("v", o_v)):
        d = o[:, lo:hi].double() - r
        kvarn_probe.num[name][i] += float((d * d).sum())
    kvarn_probe.seen[i] += hi - lo
    return out, w


PROBE_NAME = "kvarn_probe"


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PROBE_NAME, _probe_forward)
    AttentionMaskInterface.register(PROBE_NAME, kattn.kvarn_mask)


def _tee(cell, ref):
    """Make every cell layer's update also store the same K/V in the fp32 reference layer."""
    for cl, rl in zip(cell.layers, ref.layers):
        orig = cl.update

        def update(k, v, *a, _orig=orig, _ref=rl, **kw):
            _ref.update(k, v, *a, **kw)
            return _orig(k, v, *a, **kw)
        cl.update = update


@torch.inference_mode()
def layer_errors(model, chunk_ids: torch.Tensor, cell: CellSpec, ubatch=512):
    """polars DataFrame, one row per attention layer: layer, kind ("sliding"/"full"), window,
    rel_err_kv, rel_err_k, rel_err_v (relative L2 error of the attention output), n_rows.
    The probe compares exact attention outputs: the cell's compute path must be exact."""
    if not isinstance(cell, CellSpec):
        raise TypeError(f"layer_errors takes a kvarn.vocab.cell.CellSpec, got {cell!r}")
    if cell.compute != EXACT:
        raise ValueError(f"layer errors are measured on the exact compute path; cell {cell.name} has compute "
                         f"{cell.compute!r}")
    _register()
    model.set_attn_implementation(PROBE_NAME)
    try:
        n_ctx = chunk_ids.shape[1]
        scored = scoring.scored_positions(n_ctx)
        device = next(model.parameters()).device
        probe = None
        for c in range(chunk_ids.shape[0]):
            cache = new_cache(model, cell)
            ref = new_cache(model, REFERENCE)
            _tee(cache, ref)
            if probe is None:
                probe = _Probe(ref, len(cache.layers), scored)
                windows = cache.windows
            probe.ref = ref
            ids = chunk_ids[c].to(device)
            for start in range(0, n_ctx, ubatch):
                model(input_ids=ids[None, start : start + ubatch], cache=cache, kvarn_cache=cache, kvarn_probe=probe,
                      use_cache=True, logits_to_keep=1)
    finally:
        model.set_attn_implementation(kattn.ATTN_NAME)
    rows = []
    for i in range(len(probe.den)):
        if probe.seen[i] == 0:
            continue  # not an attention layer (linear attention / recurrent state)
        den = float(probe.den[i])
        rows.append({"layer": i, "kind": "full" if windows[i] is None else "sliding", "window": windows[i],
                     **{f"rel_err_{n}": (float(probe.num[n][i]) / den) ** 0.5 if den > 0 else 0.0 for n in VARIANTS},
                     "n_rows": int(probe.seen[i])})
    return pl.DataFrame(rows, schema_overrides={"window": pl.Int64})
