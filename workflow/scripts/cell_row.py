"""Rule cell_row: one tidy row (parquet) from a cell's summary.json, with the columns tables need
(the KV bytes under the model's memory accounting, recomputed from the recorded geometry)."""

import json

import polars as pl
from _wf import atomic, start

start(snakemake)
from kvarn.plan.rows import summary_row  # no torch: columns come as params

with open(snakemake.input[0]) as f:
    summary = json.load(f)
row = summary_row(summary, snakemake.params.columns, where=snakemake.input[0])
with atomic(snakemake.output[0]) as tmp:
    pl.DataFrame([row]).write_parquet(tmp)
print(row)
