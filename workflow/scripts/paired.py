"""Rule paired: one model's paired statistics (kvarn.report.paired_table.run_table) -> results/paired/{model}.parquet."""

import polars as pl
from _wf import atomic, start

start(snakemake)
from kvarn.report.paired_table import run_table
from kvarn.report import prepare

prep = prepare(pl.read_parquet(snakemake.input.summary), snakemake.wildcards.model)
table = run_table(
    prep,
    list(snakemake.input.tokens),
    n_boot=snakemake.params.boot,
    seed=snakemake.params.seed,
    tail=snakemake.params.tail,
)
with atomic(snakemake.output[0]) as tmp:
    table.write_parquet(tmp)
print(table)
