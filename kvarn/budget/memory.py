"""Persistent KV-cache bytes of one sequence (DESIGN §5): the "KV cache MiB" column. Torch-free.

Owns the named memory accountings (`ACCOUNTINGS`, `DEFAULT_ACCOUNTING` `packed`;
`beellama-qwen`, `beellama-gemma`, `beellama-v043`) and their arithmetic over a model's
per-layer geometry (`kvarn.vocab.geometry`) and the type facts (`kvarn.vocab.facts`):
total = body + staging + overlay bytes, one sequence, all layers, K and V, per layer
(`layer_bytes`, `body_bytes`) and summed (`kv_bytes`); `bits_per_value`; the memory keys of a
cell's summary.json (`summary_fields`) and their recomputation under another accounting from
the geometry it recorded (`resummarize`): memory is computed, never measured.

Definitions of each accounting: docs/notes/memory.md "Definitions"; why two, and how they
reconcile with the study: the same note.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvarn.vocab import facts
from kvarn.vocab.allocation import Allocation, layer_types, lookup
from kvarn.vocab.cell import CellSpec, cell_spec
from kvarn.vocab.geometry import Geometry
from kvarn.vocab.options import DEFAULT_COMPUTE
from kvarn.vocab.policy import default_tail_dtype, layer_policy, pair_family

MIB = 2**20

ACCOUNTINGS: dict[str, str] = {
    "packed": "what this cache design must hold: real packed buffers, the exact rows a query "
              "reads, sliding layers as llama.cpp sizes them (default)",
    "beellama-qwen": "BeeLlama's allocation as the study's Qwen 3.6 27B runs printed it "
                     "(KVarN staging 256 rows, KVarN overlay roundup256(N + ubatch), standard N)",
    "beellama-gemma": "BeeLlama's allocation as the study's Gemma 4 31B runs printed it "
                      "(KVarN staging 256 rows, overlay N + 1 rows for both families)",
    "beellama-v043": "BeeLlama v0.4.3's allocation as its CPU build prints it (KVarN staging "
                     "3 x 128 rows on full layers, 2 x 128 on sliding ones; overlay N + 1 rows; "
                     "no body on a sliding layer whose tail covers its window)",
}
DEFAULT_ACCOUNTING = "packed"
BEELLAMA_STAGING_ROWS = 256  # KVarN's F16 staging area, rows over all attention layers
BEELLAMA_TAIL_STRIDE = 256  # the tail arena rounds N + ubatch up to this (flash-attention stride)
BEELLAMA_ROLLBACK = 1  # rows the compact tail history keeps beyond N
V043_STAGE_GROUPS = {"full": 3, "sliding": 2}  # v0.4.3's KVarN F16 stage, in 128-row groups per layer


def check_accounting(name, where: str = "accounting") -> str:
    """The accounting name, or ValueError naming the value, where it came from and the accepted ones."""
    if not isinstance(name, str) or name not in ACCOUNTINGS:
        raise ValueError(f"{where}: unknown memory accounting {name!r}; accepted: {', '.join(ACCOUNTINGS)}")
    return name


@dataclass(frozen=True)
class KVBytes:
    body: int
    staging: int
    overlay: int
    total: int
    accounting: str = DEFAULT_ACCOUNTING

    def mib(self) -> dict:
        return {"body_mib": self.body / MIB, "staging_mib": self.staging / MIB,
                "overlay_mib": self.overlay / MIB, "total_mib": self.total / MIB}


def int_at_least(name: str, v, lo: int) -> int:
    """`v` if it is an integer (not a bool) of at least `lo`, else a ValueError naming `name`, the value
    and what is accepted."""
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        what = "a positive integer" if lo == 1 else f"an integer >= {lo}"
        raise ValueError(f"{name} must be {what}, got {v!r}")
    return v


@dataclass(frozen=True)
class LayerBytes:
    """One attention layer's share of `kv_bytes`: its body rows and the bytes of each part."""
    layer: int
    n_body: int  # rows of the body copy (what `body_bytes` prices a type over)
    k_body: int
    v_body: int
    staging: int
    overlay: int


def body_bytes(layer, n_body: int, type_name: str, role: str, rot: bool = True) -> int:
    """Bytes of one layer's K (`role` "k") or V body of `n_body` rows in `type_name` over its KV heads
    (`layer`: a kvarn.vocab.geometry layer): what the per-layer search prices a layer's type at."""
    return layer.n_kv_heads * facts.get(type_name).nbytes(n_body, layer.head_dim, role, rot)


def layer_bytes(geom: Geometry, n_ctx: int, cell: CellSpec, ubatch: int = 512,
                accounting: str = DEFAULT_ACCOUNTING, alloc: Allocation | None = None) -> list[LayerBytes]:
    """`kv_bytes` layer by layer (attention layers only, in layer order)."""
    if not isinstance(cell, CellSpec):
        raise TypeError(f"kv_bytes takes a kvarn.vocab.cell.CellSpec, got {cell!r}")
    int_at_least("n_ctx", n_ctx, 1)
    int_at_least("ubatch", ubatch, 1)
    check_accounting(accounting)
    rot = cell.rot
    family = pair_family(facts.get(cell.k), facts.get(cell.v))  # one family on every layer
    tail_dtype = cell.tail_dtype or default_tail_dtype(facts.get(cell.k), facts.get(cell.v))
    exact, f16 = facts.get(tail_dtype), facts.get("f16")
    out = []
    for i, (layer, (kt, vt)) in enumerate(zip(geom.layers, layer_types(cell, geom, alloc))):
        if not layer.has_kv:
            continue
        k, v = facts.get(kt), facts.get(vt)
        group = max(k.group, v.group)
        h, d, w = layer.n_kv_heads, layer.head_dim, layer.window
        pol = layer_policy(k, v, cell.tail, w, cell.sink)
        stored = n_ctx if w is None else min(n_ctx, w + ubatch)
        row = 2 * h * exact.nbytes(1, d)  # one token's K and V over this layer's heads
        staging = 0
        if accounting == "packed":
            n_body = stored - stored % group
            rows = min(pol.tail, stored) + min(pol.sink, stored)
        else:
            bodyless = accounting == "beellama-v043" and w is not None and pol.tail >= w
            if bodyless:
                n_body = 0
            elif family == "kvarn":
                groups = math.ceil(n_ctx / group)
                if w is not None:
                    groups = min(groups, math.ceil((w + ubatch) / group))
                n_body = groups * group
                stage_rows = BEELLAMA_STAGING_ROWS if accounting != "beellama-v043" else \
                    group * V043_STAGE_GROUPS["full" if w is None else "sliding"]
                staging = stage_rows * 2 * h * f16.nbytes(1, d)
            else:
                n_body = stored
            rows = _beellama_rows(accounting, family, pol.tail, ubatch)
        kb = body_bytes(layer, n_body, kt, "k", rot) if n_body else 0
        vb = body_bytes(layer, n_body, vt, "v", rot) if n_body else 0
        out.append(LayerBytes(i, n_body, kb, vb, staging, rows * row))
    return out


def kv_bytes(geom: Geometry, n_ctx: int, cell: CellSpec, ubatch: int = 512,
             accounting: str = DEFAULT_ACCOUNTING, alloc: Allocation | None = None) -> KVBytes:
    """Bytes of the K and V cache of one sequence of n_ctx tokens for `cell` (its types, per layer
    where it has an allocation: `alloc`, else the one its token names; tail, tail dtype, rotation
    and sink; docs/notes/memory.md "Definitions"): the sum of `layer_bytes`."""
    layers = layer_bytes(geom, n_ctx, cell, ubatch, accounting, alloc)
    body = sum(x.k_body + x.v_body for x in layers)
    staging = sum(x.staging for x in layers)
    overlay = sum(x.overlay for x in layers)
    return KVBytes(body, staging, overlay, body + staging + overlay, accounting)


def _beellama_rows(accounting: str, family: str, n_eff: int, ubatch: int) -> int:
    """Exact-overlay rows of one layer under a BeeLlama accounting (n_eff: its effective tail)."""
    if accounting == "beellama-qwen":
        if family == "kvarn":
            return BEELLAMA_TAIL_STRIDE * math.ceil((n_eff + ubatch) / BEELLAMA_TAIL_STRIDE)
        return n_eff
    return n_eff + BEELLAMA_ROLLBACK if n_eff else 0


#: The reference a cell's bits per value are counted against: a BF16 cache, no tail.
BF16_CELL = CellSpec("bf16", "bf16", 0)


def bits_per_value(kv_total_bytes: float, kv_bf16_bytes: float) -> float:
    """Bits per cached K or V value: 16 × the cell's KV bytes / a BF16 cache's on the same geometry,
    n_ctx and accounting (so a sliding layer's window and every scale, sink and tail byte count).
    Comparable across models, unlike MiB: q8_0 is 8.5, q4_0 4.5 (blocks of 32, an f16 scale)."""
    if not kv_bf16_bytes or kv_bf16_bytes <= 0:
        raise ValueError(f"kv_bf16_bytes must be a positive byte count, got {kv_bf16_bytes!r}")
    return 16.0 * kv_total_bytes / kv_bf16_bytes


def at_tail0(cell: CellSpec) -> CellSpec:
    """The cell's pair at tail 0, for the Δ of its tail's bytes. The bytes do not depend on the
    compute path, so the tail-0 twin is taken on the default one."""
    return replace(cell, tail=0, compute=DEFAULT_COMPUTE)


def summary_fields(geom: Geometry, n_ctx: int, cell: CellSpec, ubatch: int = 512,
                   accounting: str = DEFAULT_ACCOUNTING, alloc: Allocation | None = None) -> dict:
    """The memory keys of a cell's summary.json: the accounting, body/staging/overlay/total
    bytes, the total at tail 0 (for Δ), a BF16 cache's total on the same geometry (for bits per
    value, `bits_per_value`) and the geometry they were computed from; for a cell of an
    allocation (`alloc`, else the one its token names) also the allocation (`kv_alloc`) and the
    types of each decoder layer (`kv_alloc_k`, `kv_alloc_v`)."""
    if cell.alloc is not None and alloc is None:
        alloc = lookup(cell.alloc)
    b = kv_bytes(geom, n_ctx, cell, ubatch, accounting, alloc)
    b0 = kv_bytes(geom, n_ctx, at_tail0(cell), ubatch, accounting, alloc)
    bf16 = kv_bytes(geom, n_ctx, BF16_CELL, ubatch, accounting)
    per_layer = {}
    if alloc is not None:
        ks, vs = zip(*layer_types(cell, geom, alloc))
        per_layer = {"kv_alloc": alloc.record(), "kv_alloc_k": list(ks), "kv_alloc_v": list(vs)}
    return {
        "memory_accounting": accounting,
        "kv_body_bytes": b.body,
        "kv_staging_bytes": b.staging,
        "kv_overlay_bytes": b.overlay,
        "kv_total_bytes": b.total,
        "kv_total_bytes_tail0": b0.total,
        "kv_bf16_bytes": bf16.total,
        "kv_geometry": geom.to_list(),
        **per_layer,
    }


def resummarize(summary: dict, accounting: str, where: str = "summary.json") -> dict:
    """A cell's memory keys under `accounting`, recomputed from what its summary.json
    recorded (geometry, n_ctx, types, tail, tail dtype, ubatch, the allocation): no rerun of the
    cell. A summary without the geometry (older runs) is taken as it is if its accounting matches."""
    check_accounting(accounting, where=f"{where}: memory_accounting")
    recorded = summary.get("memory_accounting", DEFAULT_ACCOUNTING)
    if "kv_geometry" not in summary:
        if recorded != accounting:
            raise ValueError(
                f"{where}: written under memory accounting {recorded!r} without kv_geometry, so it cannot "
                f"be recomputed under {accounting!r}; rerun the cell"
            )
        return {"memory_accounting": recorded}
    alloc = Allocation.from_record(summary["kv_alloc"], f"{where}: kv_alloc") if summary.get("kv_alloc") else None
    cell = cell_spec(summary["k_type"], summary["v_type"], int(summary["tail"]), rot=bool(summary.get("rot", True)),
                     tail_dtype=summary.get("tail_dtype"), sink=summary.get("sink_requested"),
                     alloc=None if alloc is None else alloc.token)
    return summary_fields(Geometry.from_list(summary["kv_geometry"]), int(summary["n_ctx"]), cell,
                          int(summary.get("ubatch", 512)), accounting, alloc)
