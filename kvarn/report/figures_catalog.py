"""The report's figures by name: the summary figures (`summary_figure`) and the per-token ones
(`token_figure`) the workflow's figure rules draw, and the names of all of them (`FIGURES`).
"""

from __future__ import annotations

import altair as alt
import polars as pl

from kvarn.report.figures_cells import heatmap
from kvarn.report.figures_compare import same_width, tail_effect, tail_sweep
from kvarn.report.figures_pareto import pareto
from kvarn.report.figures_tokens import distribution, position


FIGURES = ("pareto", "same_width", "tail_effect", "tail_sweep", "heatmap", "position", "distribution", "ranked", "decode")

SUMMARY_FIGURES = {"pareto": pareto, "same_width": same_width, "tail_effect": tail_effect, "tail_sweep": tail_sweep,
                   "heatmap": heatmap}
TOKEN_FIGURES = {"position": position, "distribution": distribution}


def summary_figure(name: str, prep: pl.DataFrame, **options) -> alt.TopLevelMixin:
    """A figure drawn from the prepared summary rows of one model (`options`: the builder's keywords)."""
    if name not in SUMMARY_FIGURES:
        raise ValueError(f"unknown summary figure {name!r}; expected one of {sorted(SUMMARY_FIGURES)}")
    return SUMMARY_FIGURES[name](prep, **options)


def token_figure(name: str, tokens: pl.DataFrame, **options) -> alt.TopLevelMixin:
    """A figure drawn from per-token rows (kvarn.report.tokens.load_tokens)."""
    if name not in TOKEN_FIGURES:
        raise ValueError(f"unknown per-token figure {name!r}; expected one of {sorted(TOKEN_FIGURES)}")
    return TOKEN_FIGURES[name](tokens, **options)
