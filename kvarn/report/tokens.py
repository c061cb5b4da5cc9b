"""Per-token rows of the report: the cells' `tokens.parquet` files read and tagged with their cell
(`load_tokens`), and the two views the position and distribution figures draw (`position_bins`,
`ecdf`). Which files are read is chosen from their paths by `kvarn.report.data`."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import polars as pl

from kvarn.report.data import cell_name, family_of, parse_cell_path, type_bits


def load_tokens(paths: Iterable[str | Path]) -> pl.DataFrame:
    """Concatenate per-token parquets, tagged with their cell (parsed from the path)."""
    frames = []
    for p in paths:
        d = parse_cell_path(p)
        fam = family_of(d["k_type"])
        frames.append(
            pl.read_parquet(p, columns=["chunk", "pos", "kld"]).with_columns(
                pl.lit(d["model"]).alias("model"),
                pl.lit(d["n_ctx"]).alias("n_ctx"),
                pl.lit(cell_name(d["k_type"], d["v_type"], d["tail_requested"], opts=d["opts"])).alias("cell"),
                pl.lit(fam).alias("family"),
                pl.lit(type_bits(d["k_type"])).alias("width"),
            )
        )
    if not frames:
        raise ValueError("no token parquets given; the position and distribution figures need at least one cell")
    return pl.concat(frames, how="vertical_relaxed")


def position_bins(tokens: pl.DataFrame, n_bins: int = 24, floor: float = 1e-8) -> pl.DataFrame:
    """Mean per-token KLD per position bin and cell (equal-width bins over the scored range).

    A bin mean below `floor` (an exact cell, or rounding noise) is clipped to it for a log axis.
    """
    lo, hi = tokens["pos"].min(), tokens["pos"].max()
    width = max(1.0, (hi - lo + 1) / n_bins)
    return (
        tokens.with_columns(((pl.col("pos") - lo) / width).floor().cast(pl.Int32).clip(0, n_bins - 1).alias("bin"))
        .group_by(["cell", "family", "width", "bin"])
        .agg(
            pl.col("kld").mean().clip(lower_bound=floor).alias("kld_mean"),
            pl.col("kld").median().clip(lower_bound=floor).alias("kld_median"),
            pl.len().alias("n"),
            pl.col("pos").min().alias("pos_lo"),
            pl.col("pos").max().alias("pos_hi"),
        )
        .with_columns(((pl.col("pos_lo") + pl.col("pos_hi")) / 2).alias("pos_mid"))
        .sort(["cell", "bin"])
    )


def ecdf(tokens: pl.DataFrame, points: int = 200, floor: float = 1e-8) -> pl.DataFrame:
    """Per-cell ECDF of per-token KLD, thinned to ~`points` quantiles (dense in the upper tail).

    KLD below `floor` (0 or rounding noise) is clipped to it so a log axis can show it.
    """
    import numpy as np

    probs = np.unique(np.concatenate([np.linspace(0, 0.99, points // 2), 1 - np.geomspace(1e-2, 1e-4, points // 2), [1.0]]))
    out = []
    for (cell, fam, width), g in tokens.group_by(["cell", "family", "width"], maintain_order=True):
        v = np.sort(np.clip(g["kld"].to_numpy(), floor, None))
        q = np.quantile(v, probs)
        out.append(pl.DataFrame({"cell": cell, "family": fam, "width": width, "kld": q, "fraction": probs}))
    return pl.concat(out).sort(["cell", "fraction"])
