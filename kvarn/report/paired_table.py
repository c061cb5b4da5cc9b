"""The per-run table of paired statistics behind the report's `band` column and ranked
figure: each cell's own interval and its paired Δ against the standard floor and the
same-width partner (`kvarn.stats.paired` computes the statistics; `kvarn.report.data` and
`kvarn.report.compare` pick the partners)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from kvarn.stats.paired import LEVEL, N_BOOT, SEED, cell_interval, compare, load_cell
from kvarn.report import data as D
from kvarn.report.compare import same_width


def run_table(prep, token_paths, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL, tail: int = 128):
    """Per cell of one prepared run (kvarn.report.data.prepare): its own median interval, the
    paired Δ median against the standard floor, and KVarN vs the same-width standard type.

    Columns: cell, kld_median, kld_median_lo/hi, block, floor_cell, floor_delta, floor_lo,
    floor_hi, band ("floor", "≈ floor" when the interval of Δ vs the floor holds 0, else
    ""), sw_cell, sw_delta, sw_lo, sw_hi, sw_significant (KVarN rows with a same-width
    partner at `tail`, see kvarn.report.compare.same_width; Δ = KVarN − standard).
    The standard floor is kvarn.report.data.standard_floor: the study's, the standard pair
    with the lowest median KLD at tail 128 (ties: the smaller cache).
    """
    by_name = {Path(p).parent.name: Path(p).parent for p in token_paths}
    missing = [c for c in prep["cell"].to_list() if c not in by_name]
    if missing:
        raise ValueError(f"no tokens.parquet given for cells {missing}; got {sorted(by_name)}")
    cells = {r["cell"]: load_cell(by_name[r["cell"]], summary=r) for r in prep.iter_rows(named=True)}
    floor = D.standard_floor(prep)
    sw = {r["pair_kvarn"]: r["pair_std"] for r in same_width(prep, tail=tail).iter_rows(named=True)}
    cell_of_pair = {(r["pair"], r["tail_requested"]): r["cell"] for r in prep.iter_rows(named=True)}
    rows = []
    for r in prep.iter_rows(named=True):
        c = cells[r["cell"]]
        row = {"cell": r["cell"], **cell_interval(c, n_boot, seed, level)}
        row.update(floor_cell=None, floor_delta=None, floor_lo=None, floor_hi=None, band="",
                   sw_cell=None, sw_delta=None, sw_lo=None, sw_hi=None, sw_significant=None)
        if floor is not None:
            row["floor_cell"] = floor["cell"]
            if r["cell"] == floor["cell"]:
                row.update(floor_delta=0.0, floor_lo=0.0, floor_hi=0.0, band="floor")
            else:
                s = compare(cells[floor["cell"]], c, n_boot, seed, level)["stats"]["kld_median"]
                row.update(floor_delta=s["delta"], floor_lo=s["lo"], floor_hi=s["hi"],
                           band="" if s["significant"] else "≈ floor")
        partner = sw.get(r["pair"]) if r["family"] == "kvarn" and r["tail_eff_full"] == tail else None
        std_cell = cell_of_pair.get((partner, tail)) if partner else None
        if std_cell is not None and r["tail_requested"] == 0:
            s = compare(cells[std_cell], c, n_boot, seed, level)["stats"]["kld_median"]
            row.update(sw_cell=std_cell, sw_delta=s["delta"], sw_lo=s["lo"], sw_hi=s["hi"],
                       sw_significant=s["significant"])
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None)
