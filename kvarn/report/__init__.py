"""Tables and figures of a kvarn run: pure functions of polars DataFrames.

* `kvarn.report.data`    — shaping `results/summary.parquet` and per-token parquets
* `kvarn.report.tables`  — the per-model benchmark table (DataFrame, Markdown, HTML)
* `kvarn.report.figures` — Altair charts and their offline rendering (Vega-Lite JSON, SVG, PNG)
* `kvarn.report.claims`  — the study's claims as a computed ledger, and its decision tables

How to read each table and figure: docs/notes/report.md.
"""

from kvarn.report.data import load_tokens, prepare, select_token_paths, standard_floor
from kvarn.report.figures import (
    FIGURES, SUMMARY_FIGURES, TOKEN_FIGURES, distribution, heatmap, pareto, position, same_width, save_chart, summary_figure, tail_effect, tail_sweep,
    token_figure,
)
from kvarn.report.tables import build_table, to_html, to_markdown

__all__ = [
    "FIGURES", "SUMMARY_FIGURES", "TOKEN_FIGURES", "build_table", "distribution", "heatmap", "load_tokens", "pareto", "position", "prepare",
    "same_width", "save_chart", "select_token_paths", "standard_floor", "summary_figure", "tail_effect", "tail_sweep",
    "to_html", "to_markdown", "token_figure",
]
