"""Rule report_generation: one figure of one decode run's statistics (rule generation_stats)
-> .vl.json (Vega-Lite), .svg, .png (kvarn.report.figures.generation_figure)."""

import polars as pl
from _wf import start

start(snakemake)  # noqa: F821
from kvarn.report import save_chart  # noqa: E402
from kvarn.report.figures import generation_figure  # noqa: E402

sm = snakemake  # noqa: F821
tables = {key: pl.read_parquet(sm.input[key]) for key in ("cells", "paired", "survival", "curves")}
chart = generation_figure(sm.wildcards.gfig, tables)
for path in save_chart(chart, str(sm.output.vl)[: -len(".vl.json")]):
    print(f"{sm.wildcards.model}/{sm.wildcards.gfig}: wrote {path}")
