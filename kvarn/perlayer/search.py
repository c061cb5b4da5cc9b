"""Per-layer K and V types for a byte budget, searched on the validation text only.

Two allocators, each within one family (standard or KVarN types: one family per allocation,
kvarn.vocab.allocation), for a budget given as a uniform cell's bytes at the evaluation context:

* **knapsack** (`knapsack`): every attention layer's K and every layer's V is one group of a
  multiple-choice knapsack (Kellerer, Pferschy & Pisinger, *Knapsack Problems*, 2004, ch. 11): pick
  one type per group, its cost the layer's body bytes in that type (kvarn.budget.memory.body_bytes),
  its value the KLD its probe added on the search text (kvarn.perlayer.sensitivity), minimising the
  summed KLD within the budget's body bytes. Solved exactly by dynamic programming over the costs in
  units of their greatest common divisor. Choosing K and V types per layer separately is KVTuner's
  search space (Li et al., "KVTuner: Sensitivity-Aware Layer-wise Mixed Precision KV Cache
  Quantization", ICML 2025), searched here on measured one-layer sensitivities, assumed additive
  (the table shows the sum beside the measured KLD on the search text).
* **first/last** (`first_last_candidates`): ik_llama.cpp's form (`-ctk B -ctk-first E,N -ctk-last E,N`,
  the same for V): a base type cheaper than the budget's, the family's edge type on the first and
  last N layers, every N that fits; N (and the base) chosen by the KLD measured on the search text.

The overlay (exact rows) and staging of a family do not depend on its types, so the knapsack's
budget is the budget's bytes less the family's fixed bytes; every allocation is checked against the
budget with kvarn.budget.memory.kv_bytes, the same sum every table uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import numpy as np

from kvarn.budget import memory
from kvarn.vocab import facts
from kvarn.vocab.allocation import Allocation, range_string
from kvarn.vocab.cell import CellSpec, cell_spec

MAX_UNITS = 2_000_000  # dynamic-programming states per group: beyond it costs are rounded up (never over budget)


@dataclass(frozen=True)
class Choice:
    """One group's option: a type, its cost in bytes and its value (KLD added)."""
    type: str
    cost: int
    value: float


def knapsack(groups: list[list[Choice]], budget: int) -> tuple[list[int], float, int]:
    """(index of the chosen option per group, summed value, summed cost) of least summed value with
    summed cost <= `budget`; ties to the lower cost. ValueError naming the cheapest total when even
    the cheapest option of every group exceeds the budget."""
    cheapest = sum(min(c.cost for c in g) for g in groups)
    if cheapest > budget:
        raise ValueError(f"budget {budget:,} bytes is below the cheapest choice of every layer ({cheapest:,} bytes)")
    unit = reduce(math.gcd, [c.cost for g in groups for c in g] + [0]) or 1
    units = budget // unit
    if units > MAX_UNITS:  # coarser units, each cost rounded up: a pick still fits the budget
        unit = math.ceil(budget / MAX_UNITS)
        units = budget // unit
    cost_units = [[math.ceil(c.cost / unit) for c in g] for g in groups]
    inf = np.inf
    best = np.zeros(units + 1)  # best[b]: least value of the groups so far within b units
    picks = np.zeros((len(groups), units + 1), dtype=np.int16)
    for gi, (g, cu) in enumerate(zip(groups, cost_units)):
        new = np.full(units + 1, inf)
        arg = np.zeros(units + 1, dtype=np.int16)
        for ci in sorted(range(len(g)), key=lambda i: g[i].cost):  # cheaper first: ties keep the cheaper
            if cu[ci] > units:
                continue
            cand = np.full(units + 1, inf)
            cand[cu[ci]:] = best[: units + 1 - cu[ci]] + g[ci].value
            better = cand < new
            new[better], arg[better] = cand[better], ci
        best, picks[gi] = new, arg
    if not np.isfinite(best[units]):  # only where costs were rounded up to coarser units
        raise ValueError(f"budget {budget:,} bytes: no choice fits once costs are rounded up to {unit:,}-byte units "
                         f"(search.MAX_UNITS = {MAX_UNITS:,})")
    b = units
    while b > 0 and best[b - 1] <= best[b]:  # the least budget reaching the best value: ties to the lower cost
        b -= 1
    out = [0] * len(groups)
    for gi in range(len(groups) - 1, -1, -1):
        out[gi] = int(picks[gi, b])
        b -= cost_units[gi][out[gi]]
    value = sum(groups[i][c].value for i, c in enumerate(out))
    return out, value, sum(groups[i][c].cost for i, c in enumerate(out))


def knapsack_ref(groups: list[list[Choice]], budget: int) -> tuple[list[int], float, int]:
    """`knapsack` by enumerating every combination (the tests' reference; a few groups only)."""
    import itertools

    best = None
    for combo in itertools.product(*[range(len(g)) for g in groups]):
        cost = sum(groups[i][c].cost for i, c in enumerate(combo))
        if cost > budget:
            continue
        value = sum(groups[i][c].value for i, c in enumerate(combo))
        if best is None or (value, cost) < (best[1], best[2]):
            best = (list(combo), value, cost)
    if best is None:
        raise ValueError("no combination fits the budget")
    return best


def cell_of(alloc: Allocation, tail: int) -> CellSpec:
    """The cell an allocation runs as (its main types' names, `tail`); the plain cell when it is uniform."""
    k, v = alloc.base
    return cell_spec(k, v, tail, alloc=None if alloc.uniform else alloc.token)


def allocation(name: str, k_types, v_types) -> Allocation:
    """The range-form allocation of per-layer lists; one type per role is the first/last form without
    edges (a uniform allocation, which runs as the plain cell)."""
    if len(set(k_types)) == 1 and len(set(v_types)) == 1:
        return Allocation.parse(name, {"k": k_types[0], "v": v_types[0]})
    return Allocation.parse(name, {"k": range_string(k_types), "v": range_string(v_types)})


def budget_bytes(geom, n_ctx: int, budget_type: str, tail: int, ubatch: int, accounting: str) -> int:
    return memory.kv_bytes(geom, n_ctx, CellSpec(budget_type, budget_type, tail), ubatch, accounting).total


def searched(geom, n_ctx: int, sens: dict, types, tail: int, budget: int, name: str, ubatch: int = 512,
             accounting: str = memory.DEFAULT_ACCOUNTING) -> dict:
    """The knapsack's allocation of `types` (one family) within `budget` bytes. `sens[(layer, role, type)]`:
    the KLD the probe added. A layer without a KV cache takes the role's most chosen type (it stores
    nothing). Returns {allocation, bytes, predicted} (predicted: the summed sensitivities)."""
    ref = CellSpec(types[0], types[0], tail)
    per_layer = memory.layer_bytes(geom, n_ctx, ref, ubatch, accounting)
    fixed = sum(x.staging + x.overlay for x in per_layer)
    keys, groups = [], []
    for x in per_layer:
        layer = geom.layers[x.layer]
        for role in ("k", "v"):
            missing = [t for t in types if (x.layer, role, t) not in sens]
            if missing:
                raise ValueError(f"no sensitivity for layer {x.layer} {role.upper()} in {', '.join(missing)}")
            keys.append((x.layer, role))
            groups.append([Choice(t, memory.body_bytes(layer, x.n_body, t, role, ref.rot), sens[x.layer, role, t])
                           for t in types])
    picks, value, _ = knapsack(groups, budget - fixed)
    chosen = {key: groups[i][c].type for i, (key, c) in enumerate(zip(keys, picks))}
    lists = {}
    for role in ("k", "v"):
        mine = [t for (l_, r), t in chosen.items() if r == role]
        most = max(dict.fromkeys(mine), key=mine.count)
        lists[role] = [chosen.get((i, role), most) for i in range(geom.n_layers)]
    alloc = allocation(name, lists["k"], lists["v"])
    cell = cell_of(alloc, tail)
    total = memory.kv_bytes(geom, n_ctx, cell, ubatch, accounting, alloc=None if alloc.uniform else alloc).total
    if total > budget:
        raise AssertionError(f"{alloc.token}: {total:,} bytes over the budget {budget:,}")  # the knapsack's contract
    return {"allocation": alloc, "bytes": total, "predicted": value}


def first_last_candidates(geom, n_ctx: int, types, edge: str, budget_type: str, tail: int, budget: int,
                          ubatch: int = 512, accounting: str = memory.DEFAULT_ACCOUNTING) -> list[dict]:
    """Every first/last allocation (base cheaper than `budget_type`, `edge` on the first and last N
    layers of K and V, N >= 1) whose bytes fit `budget`: [{allocation, bytes, base, n}]."""
    out = []
    cheaper = [t for t in types if facts.get(t).bits < facts.get(budget_type).bits]
    for base in cheaper:
        for n in range(1, geom.n_layers // 2 + 1):
            e = f"{edge},{n}"
            alloc = Allocation.parse(f"firstlast_{base}_{n}",
                                     {"k": base, "v": base, "k_first": e, "k_last": e, "v_first": e, "v_last": e})
            total = memory.kv_bytes(geom, n_ctx, cell_of(alloc, tail), ubatch, accounting, alloc=alloc).total
            if total > budget:
                break
            out.append({"allocation": alloc, "bytes": total, "base": base, "n": n})
    return out
