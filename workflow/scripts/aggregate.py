"""Rule summary: every cell's row -> results/summary.parquet and .csv (one tidy row per cell)."""

import polars as pl
from _wf import atomic, start

start(snakemake)

KEYS = ["model", "n_ctx", "chunks", "family", "k_type", "v_type", "tail_requested", "cell"]
rows = pl.concat([pl.read_parquet(p) for p in snakemake.input], how="diagonal_relaxed")
first = [c for c in KEYS if c in rows.columns]
rows = rows.select(first + [c for c in rows.columns if c not in first]).sort(first)
out = snakemake.output
with atomic(out.parquet) as tmp:
    rows.write_parquet(tmp)
with atomic(out.csv) as tmp:
    rows.write_csv(tmp)
print(f"{rows.height} cells, {rows.width} columns -> {out.parquet}, {out.csv}")
