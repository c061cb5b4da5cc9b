"""Rules report_<figure>: one figure of one model -> .vl.json (Vega-Lite), .svg, .png.

Summary figures read results/summary.parquet (kernel_share: its rows of both compute
paths, through kvarn.report.data.compute_split); the position and distribution figures read
the chosen cells' tokens.parquet (chosen in workflow/rules/report.smk from their paths).
"""

import polars as pl
from _wf import start

start(snakemake)  # noqa: F821
from kvarn.report import load_tokens, prepare, save_chart, summary_figure, token_figure  # noqa: E402
from kvarn.report.data import compute_split, decode_frame  # noqa: E402
from kvarn.report.figures import decode, kernel_share, ranked  # noqa: E402

sm = snakemake  # noqa: F821
figure, options, model = sm.params.figure, dict(sm.params.options), sm.wildcards.model
if "decode" in sm.input.keys():
    chart = decode(decode_frame(sm.input.decode), **options)
elif "paired" in sm.input.keys():
    chart = ranked(prepare(pl.read_parquet(sm.input.summary), model), pl.read_parquet(sm.input.paired), **options)
elif figure == "kernel_share":
    chart = kernel_share(compute_split(pl.read_parquet(sm.input.summary), model), model)
elif "tokens" in sm.input.keys():
    chart = token_figure(figure, load_tokens(sm.input.tokens), **options)
else:
    chart = summary_figure(figure, prepare(pl.read_parquet(sm.input.summary), model), **options)
stem = str(sm.output.vl)[: -len(".vl.json")]
for path in save_chart(chart, stem):
    print(f"{model}/{figure}: wrote {path}")
