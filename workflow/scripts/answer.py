"""Rule answer: results/summary.parquet + the report run's tokens -> results/answer.md and .parquet
(kvarn.report.advise at its default tolerance)."""

from pathlib import Path

import polars as pl
from _wf import atomic, start

start(snakemake)
from kvarn.report import advise
from kvarn.report.data import parse_cell_path

summary = pl.read_parquet(snakemake.input.summary)
dirs = {(parse_cell_path(p)["model"], Path(p).parent.name): Path(p).parent for p in snakemake.input.tokens}
answers = advise.advise(summary, dirs, n_boot=snakemake.params.boot, seed=snakemake.params.seed)
with atomic(snakemake.output.parquet) as tmp:
    advise.frontier_frame(answers).write_parquet(tmp)
with atomic(snakemake.output.md) as tmp:
    tmp.write_text(advise.answers_markdown(answers), encoding="utf-8")
print(advise.answers_markdown(answers))
