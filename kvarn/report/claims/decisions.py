"""The rows of a prepared run the study read (standard pairs at tail 128, KVarN at 128*) and the
study's decision tables: below the floor, the cheapest standard match, equal memory, presets.
Their definitions: docs/notes/report.md ("The claims ledger")."""

from __future__ import annotations

import polars as pl

from kvarn.report.claims.verdicts import Delta, no_delta
from kvarn.report.data import FLOOR_TAIL, figure_rows, standard_floor

PRESET_LEVELS = (("quality", 8), ("balanced", 5), ("compact", 4))


def _plain(prep: pl.DataFrame) -> pl.DataFrame:
    """Rows with the default options (what the study ran), KVarN duplicates of 128* dropped."""
    return figure_rows(prep).filter(pl.col("opts") == "")


def matched(prep: pl.DataFrame) -> pl.DataFrame:
    """The study's rows at its matched tail: standard pairs at tail 128 and KVarN at 128*
    (default options). The decision tables read these, as the study's did."""
    return _plain(prep).filter(((pl.col("family") == "standard") & (pl.col("tail_requested") == FLOOR_TAIL))
                               | ((pl.col("family") == "kvarn") & (pl.col("tail_eff_full") == FLOOR_TAIL)))


def std_row(prep: pl.DataFrame, pair: str, tail: int) -> dict | None:
    """A standard row of default options at a requested tail."""
    r = prep.filter((pl.col("family") == "standard") & (pl.col("opts") == "") & (pl.col("pair") == pair)
                    & (pl.col("tail_requested") == tail))
    return r.row(0, named=True) if r.height else None


def kvarn_row(prep: pl.DataFrame, pair: str, tail_eff: int = 128) -> dict | None:
    """A KVarN row of default options at an effective tail (128: the request-0 cell, 128*)."""
    r = _plain(prep).filter((pl.col("family") == "kvarn") & (pl.col("pair") == pair)
                            & (pl.col("tail_eff_full") == tail_eff)).sort("tail_requested")
    return r.row(0, named=True) if r.height else None


def row_mib(r: dict) -> float:
    """A row's KV cache in MiB (its kv_total_bytes)."""
    return r["kv_total_bytes"] / float(1 << 20)


def row_name(r: dict) -> str:
    """A row as the ledger names a cell: `K-V tTAIL`."""
    return f"{r['pair']} t{r['tail_label']}"


def below_floor_table(prep: pl.DataFrame, delta: Delta = no_delta) -> pl.DataFrame:
    """Decision table: every KVarN row at 128* (default options) whose median is below the standard floor,
    with the MiB it saves against the floor row and the paired Δ median (row − floor)."""
    floor = standard_floor(prep)
    cols = {"pair": pl.String, "tail_label": pl.String, "kld_median": pl.Float64, "kv_mib": pl.Float64,
            "floor_pair": pl.String, "floor_median": pl.Float64, "floor_mib": pl.Float64, "mib_saved": pl.Float64,
            "delta": pl.Float64, "delta_lo": pl.Float64, "delta_hi": pl.Float64}
    if floor is None:
        return pl.DataFrame(schema=cols)
    out = []
    for r in matched(prep).filter((pl.col("family") == "kvarn") & (pl.col("kld_median") < floor["kld_median"])).iter_rows(named=True):
        d, lo, hi = delta(floor, r)
        out.append({"pair": r["pair"], "tail_label": r["tail_label"], "kld_median": r["kld_median"], "kv_mib": row_mib(r),
                    "floor_pair": floor["pair"], "floor_median": floor["kld_median"], "floor_mib": row_mib(floor),
                    "mib_saved": row_mib(floor) - row_mib(r), "delta": d, "delta_lo": lo, "delta_hi": hi})
    return pl.DataFrame(out, schema=cols).sort("mib_saved", descending=True)


def cheapest_match_table(prep: pl.DataFrame) -> pl.DataFrame:
    """Decision table: per KVarN row at 128*, the cheapest standard pair at tail 128 (the matched
    tail; default options) whose median is at most the KVarN row's, and the MiB the KVarN row
    saves against it (negative: it costs more). A KVarN row below every standard row has no match."""
    rows = matched(prep)
    std = rows.filter(pl.col("family") == "standard")
    out = []
    for r in rows.filter(pl.col("family") == "kvarn").sort("kv_total_bytes").iter_rows(named=True):
        m = std.filter(pl.col("kld_median") <= r["kld_median"]).sort(["kv_total_bytes", "kld_median"])
        match = m.row(0, named=True) if m.height else None
        out.append({"pair": r["pair"], "tail_label": r["tail_label"], "kld_median": r["kld_median"], "kv_mib": row_mib(r),
                    "match": row_name(match) if match else None, "match_median": match["kld_median"] if match else None,
                    "match_mib": row_mib(match) if match else None,
                    "mib_saved": row_mib(match) - row_mib(r) if match else None})
    schema = {"pair": pl.String, "tail_label": pl.String, "kld_median": pl.Float64, "kv_mib": pl.Float64,
              "match": pl.String, "match_median": pl.Float64, "match_mib": pl.Float64, "mib_saved": pl.Float64}
    return pl.DataFrame(out, schema=schema)


def equal_memory_table(prep: pl.DataFrame) -> pl.DataFrame:
    """Decision table: rows at the matched tail (`matched`) of one family that share their KV
    bytes exactly but split them differently between K and V, best median first in each group."""
    rows = matched(prep)  # kv_mib as kvarn.report.data.prepare computes it
    groups = rows.group_by(["family", "kv_total_bytes"]).agg(pl.col("pair").n_unique().alias("n")).filter(pl.col("n") > 1)
    out = rows.join(groups.select(["family", "kv_total_bytes"]), on=["family", "kv_total_bytes"])
    out = out.with_columns((pl.col("k_type") == pl.col("v_type")).alias("symmetric"))
    return out.select(["family", "kv_mib", "pair", "tail_label", "symmetric", "k_bits", "v_bits", "kld_median"]) \
        .sort(["family", "kv_mib", "kld_median"])


def presets_table(prep: pl.DataFrame) -> pl.DataFrame:
    """Decision table, our stated rule: for each reference qN_0-qN_0 at tail 128 (quality q8_0,
    balanced q5_0, compact q4_0), the cheapest row at the matched tail (`matched`: standard at
    128, KVarN at 128*) whose median is at most the reference's. No reference, no preset."""
    rows = matched(prep)
    out = []
    for name, w in PRESET_LEVELS:
        ref = std_row(prep, f"q{w}_0-q{w}_0", FLOOR_TAIL)
        if ref is None:
            continue
        m = rows.filter(pl.col("kld_median") <= ref["kld_median"]).sort(["kv_total_bytes", "kld_median"]).row(0, named=True)
        out.append({"preset": name, "reference": row_name(ref), "reference_median": ref["kld_median"],
                    "reference_mib": row_mib(ref), "pair": m["pair"], "tail_label": m["tail_label"], "family": m["family"],
                    "kld_median": m["kld_median"], "kv_mib": row_mib(m), "mib_saved": row_mib(ref) - row_mib(m)})
    schema = {"preset": pl.String, "reference": pl.String, "reference_median": pl.Float64, "reference_mib": pl.Float64,
              "pair": pl.String, "tail_label": pl.String, "family": pl.String, "kld_median": pl.Float64,
              "kv_mib": pl.Float64, "mib_saved": pl.Float64}
    return pl.DataFrame(out, schema=schema)
