"""Rules report_figures and report_decode: the figures of one model -> per figure .vl.json
(Vega-Lite), .svg, .png, in one job (one interpreter and one Vega renderer for all of them).

Summary figures read results/summary.parquet (kernel_share: its rows of both compute paths,
through kvarn.report.compare.compute_split; ranked: with results/paired/{model}.parquet); the
position and distribution figures read the chosen cells' tokens.parquet (chosen in
workflow/rules/report.smk from their paths); decode reads the model's decode summaries.
"""

from functools import cache

import polars as pl
from _wf import start

start(snakemake)
from kvarn.report import load_tokens, prepare, save_chart, summary_figure, token_figure
from kvarn.report.compare import compute_split
from kvarn.report.data import decode_frame
from kvarn.report.figures_cells import ranked
from kvarn.report.figures_compare import kernel_share
from kvarn.report.figures_generation import decode
from kvarn.report.workflow import PAIRED_FIGURES, SPLIT_FIGURES, TOKEN_FIGURES

model = snakemake.wildcards.model


@cache
def summary() -> pl.DataFrame:
    return pl.read_parquet(snakemake.input.summary)


@cache
def tokens():
    return load_tokens(snakemake.input.tokens)


def chart(figure: str, options: dict):
    if figure == "decode":
        return decode(decode_frame(snakemake.input.decode), **options)
    if figure in PAIRED_FIGURES:
        return ranked(prepare(summary(), model), pl.read_parquet(snakemake.input.paired), **options)
    if figure in SPLIT_FIGURES:
        return kernel_share(compute_split(summary(), model), model)
    if figure in TOKEN_FIGURES:
        return token_figure(figure, tokens(), **options)
    return summary_figure(figure, prepare(summary(), model), **options)


for figure in snakemake.params.figures:
    stem = str(snakemake.output[f"{figure}_vl"])[: -len(".vl.json")]
    for path in save_chart(chart(figure, dict(snakemake.params.options[figure])), stem):
        print(f"{model}/{figure}: wrote {path}")
