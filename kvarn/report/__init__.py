"""Tables and figures of a kvarn run: pure functions of polars DataFrames.

* `kvarn.report.data`    — shaping `results/summary.parquet`, choosing the per-token parquets
* `kvarn.report.compare` — the comparisons of prepared rows (same width, tail, compute split)
* `kvarn.report.migrate` — older summaries brought up to the columns the report reads
* `kvarn.report.tokens`  — the per-token parquets read, binned by position and as an ECDF
* `kvarn.report.tables`  — the per-model benchmark table (DataFrame, Markdown, HTML)
* `kvarn.report.figures` — the figures' shared style and their offline rendering (Vega-Lite JSON,
  SVG, PNG); the Altair charts in `figures_pareto`, `figures_compare`, `figures_cells`,
  `figures_tokens`, `figures_generation`, by name in `figures_catalog`
* `kvarn.report.claims`  — the study's claims as a computed ledger, and its decision tables

How to read each table and figure: docs/notes/report.md.

The names below are imported from their module on first use (PEP 562): every Snakefile parse
imports `kvarn.report.workflow` (workflow/rules/report.smk), which needs neither Altair nor the
figures, and importing them took about half a second of each snakemake invocation.
"""

import importlib

# name -> the kvarn.report module that defines it
_EXPORTS = {
    **dict.fromkeys(["prepare", "select_token_paths", "standard_floor"], "data"),
    "load_tokens": "tokens",
    **dict.fromkeys(["FIGURES", "SUMMARY_FIGURES", "TOKEN_FIGURES", "summary_figure", "token_figure"],
                    "figures_catalog"),
    "save_chart": "figures",
    "pareto": "figures_pareto",
    **dict.fromkeys(["same_width", "tail_effect", "tail_sweep"], "figures_compare"),
    "heatmap": "figures_cells",
    **dict.fromkeys(["distribution", "position"], "figures_tokens"),
    **dict.fromkeys(["build_table", "to_html", "to_markdown"], "tables"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvarn.report' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvarn.report.{module}"), name)


def __dir__():
    return sorted({*globals(), *__all__})
