"""Rule cell_row: one tidy row (parquet) from a cell's summary.json, with the columns tables need
(the KV bytes under the model's memory accounting, recomputed from the recorded geometry)."""

import json

import polars as pl
from _wf import atomic, start

start(snakemake)  # noqa: F821
from kvarn.plan.rows import summary_row  # noqa: E402  (no torch: columns come as params)

with open(snakemake.input[0]) as f:  # noqa: F821
    summary = json.load(f)
row = summary_row(summary, snakemake.params.columns, where=snakemake.input[0])  # noqa: F821
with atomic(snakemake.output[0]) as tmp:  # noqa: F821
    pl.DataFrame([row]).write_parquet(tmp)
print(row)
