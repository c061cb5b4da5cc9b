"""Rule report_table: results/summary.parquet -> one model's table as .md, .html and .parquet.

The .md also carries the compute split (format damage beside llama.cpp's total) when a cell
was run in both compute paths (kvarn.report.compare.compute_split).
"""

import polars as pl
from _wf import atomic, start

start(snakemake)
from kvarn.report import build_table, to_html, to_markdown
from kvarn.report.compare import compute_split
from kvarn.report.tables import split_markdown

model = snakemake.wildcards.model
out = snakemake.output
summary = pl.read_parquet(snakemake.input.summary)
table = build_table(summary, model, paired=pl.read_parquet(snakemake.input.paired))
split = compute_split(summary, model)
md = to_markdown(table)
if not split.is_empty():
    md += "\n### Format damage (exact) beside llama.cpp's total (llamacpp-cpu)\n\n" + split_markdown(split)
with atomic(out.parquet) as tmp:
    table.write_parquet(tmp)
with atomic(out.md) as tmp:
    tmp.write_text(md, encoding="utf-8")
with atomic(out.html) as tmp:
    tmp.write_text(to_html(table), encoding="utf-8")
print(f"{model}: {table.height} rows -> {out.md}, {out.html}, {out.parquet}")
