"""Rule perlayer_table: the searches, the run's summary and the cells' tokens -> results/perlayer/perlayer.md
and .parquet (kvarn.perlayer.report), and each model's sensitivity heatmap."""

import json

import polars as pl
from _wf import atomic, start

start(snakemake)
from kvarn.perlayer import plan, report
from kvarn.report.figures import save_chart

sm = snakemake
searches = [json.loads(open(p).read()) for p in sm.input.searches]
frame = report.build(pl.read_parquet(sm.input.summary), searches, report.cell_dir_map(sm.input.tokens),
                    plan.expand(sm.config), n_boot=sm.params.boot, seed=sm.params.seed)
with atomic(sm.output.parquet) as tmp:
    frame.write_parquet(tmp)
with atomic(sm.output.md) as tmp:
    tmp.write_text(report.markdown(frame, searches), encoding="utf-8")
sens = report.sensitivity_frame(sm.input.sensitivity)
for model in sens["model"].unique(maintain_order=True):
    save_chart(report.heatmap(sens.filter(pl.col("model") == model), model),
               plan.HEATMAP.format(model=model))
print(report.markdown(frame, searches))
