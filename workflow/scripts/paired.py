"""Rule paired: one model's paired statistics (kvarn.report.paired_table.run_table) -> results/paired/{model}.parquet."""

import polars as pl
from _wf import atomic, start

start(snakemake)
from kvarn.report.paired_table import run_table
from kvarn.report import prepare

sm = snakemake
prep = prepare(pl.read_parquet(sm.input.summary), sm.wildcards.model)
table = run_table(prep, list(sm.input.tokens), n_boot=sm.params.boot, seed=sm.params.seed, tail=sm.params.tail)
with atomic(sm.output[0]) as tmp:
    table.write_parquet(tmp)
print(table)
