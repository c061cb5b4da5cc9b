"""Rule perlayer_table: the searches, the run's summary and the cells' tokens -> results/perlayer/perlayer.md
and .parquet (kvarn.perlayer.report), and each model's sensitivity heatmap."""

import json

import polars as pl
from _wf import atomic, start

start(snakemake)
from kvarn.perlayer import plan, report
from kvarn.report.figures import save_chart

searches = [json.loads(open(p).read()) for p in snakemake.input.searches]
frame = report.build(
    pl.read_parquet(snakemake.input.summary),
    searches,
    report.cell_dir_map(snakemake.input.tokens),
    plan.expand(snakemake.config),
    n_boot=snakemake.params.boot,
    seed=snakemake.params.seed,
)
with atomic(snakemake.output.parquet) as tmp:
    frame.write_parquet(tmp)
with atomic(snakemake.output.md) as tmp:
    tmp.write_text(report.markdown(frame, searches), encoding="utf-8")
sens = report.sensitivity_frame(snakemake.input.sensitivity)
for model in sens["model"].unique(maintain_order=True):
    save_chart(report.heatmap(sens.filter(pl.col("model") == model), model), plan.HEATMAP.format(model=model))
print(report.markdown(frame, searches))
