"""A cell's row of results/summary.parquet: the columns the workflow computes from the cell's path
when it plans (`cell_columns`, with the types' numerics versions, `format_version`) and the tidy row
built from its summary.json (`summary_row`). Torch-free: the row job gets its columns as params.

A model's `memory_accounting` (kvarn.budget.memory) is not part of any cell path: memory is
computed, not measured, so changing it reruns only the per-cell row jobs (their
`columns` param changes) and the aggregation, which recompute the bytes from the geometry
each summary.json recorded.
"""

from __future__ import annotations

from kvarn.budget.memory import bits_per_value, resummarize
from kvarn.vocab import allocation, facts
from kvarn.vocab.cell import CellSpec


def format_version(name: str, role: str = "k") -> int:
    """The numerics version of a type (the same for K and V; `role` kept for the rule's callers)."""
    return facts.get(name).version


def cell_columns(cell: CellSpec, memory_accounting: str = "packed") -> dict:
    """What the tables need about a cell and the engine does not write.

    The pair's family, the requested tail and its printed label (`128*`), the cell's path
    name, the K and V numerics versions and the model's memory accounting. The workflow
    computes these at planning time (from the cell's path, `CellSpec.from_wildcards`) and
    hands them to the row job as params.
    """
    out = {
        "memory_accounting": memory_accounting,
        "family": cell.family,
        "tail_requested": cell.tail,
        "tail_label": facts.tail_label(cell.k, cell.v, cell.tail),
        "cell": cell.name,
        "k_version": format_version(cell.k, "k"),
        "v_version": format_version(cell.v, "v"),
    }
    if cell.alloc is not None:  # the newest version among the types of each role
        a = allocation.lookup(cell.alloc)
        out.update(alloc=cell.alloc, k_version=max(map(format_version, a.k.types())),
                   v_version=max(map(format_version, a.v.types())))
    return out


def summary_row(summary: dict, columns: dict, where: str = "summary.json") -> dict:
    """One tidy row of results/summary.parquet: a cell's summary.json + `cell_columns`
    + the KV bytes saved or spent against the same pair at tail 0 + its bits per value
    (`kvarn.budget.memory.bits_per_value`).

    The memory keys are those of `columns["memory_accounting"]` (default: as recorded),
    recomputed from the geometry the cell recorded (`kvarn.budget.memory.resummarize`)."""
    accounting = columns.get("memory_accounting") or summary.get("memory_accounting", "packed")
    row = {**summary, **columns, **resummarize(summary, accounting, where)}
    # stay in summary.json, not in the table
    for nested in ("kv_geometry", "engine_identity", "program_env", "self_check", "kv_alloc"):
        row.pop(nested, None)
    for role in ("k", "v"):  # an allocation's types per layer: the table's one string, '0-1:q8_0,2-27:q4_0,...'
        if f"kv_alloc_{role}" in row:
            row[f"alloc_{role}"] = allocation.range_string(row.pop(f"kv_alloc_{role}"))
    if "kv_total_bytes" in row and "kv_total_bytes_tail0" in row:
        row["kv_delta_bytes_vs_tail0"] = row["kv_total_bytes"] - row["kv_total_bytes_tail0"]
    if row.get("kv_bf16_bytes"):
        row["bits_per_value"] = bits_per_value(row["kv_total_bytes"], row["kv_bf16_bytes"])
    return row
