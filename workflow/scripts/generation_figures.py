"""Rule report_generation: the figures of one decode run's statistics (rule generation_stats)
-> per figure .vl.json (Vega-Lite), .svg, .png (kvarn.report.figures_generation.generation_figure), in one job."""

import polars as pl
from _wf import start

start(snakemake)
from kvarn.report import save_chart
from kvarn.report.figures_generation import generation_figure
from kvarn.plan.generation import GENERATION_FIGURES

tables = {key: pl.read_parquet(snakemake.input[key]) for key in ("cells", "paired", "survival", "curves")}
for figure in GENERATION_FIGURES:
    for path in save_chart(
        generation_figure(figure, tables), str(snakemake.output[f"{figure}_vl"])[: -len(".vl.json")]
    ):
        print(f"{snakemake.wildcards.model}/{figure}: wrote {path}")
