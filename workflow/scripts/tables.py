"""Rule report_table: results/summary.parquet -> one model's table as .md, .html and .parquet."""

import polars as pl
from _wf import atomic, start

start(snakemake)  # noqa: F821
from kvarn.report import build_table, to_html, to_markdown  # noqa: E402

model = snakemake.wildcards.model  # noqa: F821
out = snakemake.output  # noqa: F821
table = build_table(pl.read_parquet(snakemake.input.summary), model,  # noqa: F821
                    paired=pl.read_parquet(snakemake.input.paired))  # noqa: F821
with atomic(out.parquet) as tmp:
    table.write_parquet(tmp)
with atomic(out.md) as tmp:
    tmp.write_text(to_markdown(table), encoding="utf-8")
with atomic(out.html) as tmp:
    tmp.write_text(to_html(table), encoding="utf-8")
print(f"{model}: {table.height} rows -> {out.md}, {out.html}, {out.parquet}")
