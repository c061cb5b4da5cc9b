"""A ledger row's columns and its verdict: the four verdicts, the paired Δ median a difference is
graded by (`kvarn.stats.paired.compare`, B − A), and which rows are the study's claims. The
verdicts and signs: docs/notes/report.md ("The claims ledger")."""

from __future__ import annotations

from typing import Callable, Mapping

import polars as pl

VERDICTS = ("holds", "does not hold", "not separable", "not measurable")


#: Columns of results/claims.parquet, in order.
LEDGER_COLUMNS = ["model", "study_model", "claim_id", "claim", "origin", "section", "quoted", "study", "study_text",
                  "figure_of", "ours", "ours_text", "delta", "delta_lo", "delta_hi", "delta_of", "verdict", "missing",
                  "note"]


Delta = Callable[[dict, dict], tuple]


def paired_delta(cells: Mapping | None, n_boot: int, seed: int) -> Delta:
    """(a, b) -> (Δ median = b − a, lo, hi) from `kvarn.stats.paired.compare` over the two cells'
    tokens (`cells`: cell name -> kvarn.stats.paired.CellTokens); (None, None, None) without them."""
    from kvarn.stats.paired import compare

    def delta(a: dict, b: dict):
        if not cells or a["cell"] not in cells or b["cell"] not in cells:
            return None, None, None
        s = compare(cells[a["cell"]], cells[b["cell"]], n_boot=n_boot, seed=seed)["stats"]["kld_median"]
        return s["delta"], s["lo"], s["hi"]

    return delta


def no_delta(a, b):
    """The `Delta` of a run without tokens: no interval."""
    return None, None, None


def directional(sign_ok: bool, lo, hi, want: int) -> tuple[str, str]:
    """Verdict of a difference that should have sign `want` (−1: B below A): its interval when there
    is one (holding 0: not separable, whichever way the point estimate points), then `sign_ok`."""
    if lo is None:
        return ("holds" if sign_ok else "does not hold"), ""
    if lo <= 0 <= hi:
        return "not separable", "the paired interval of the difference holds 0"
    return ("holds" if sign_ok and (hi < 0 if want < 0 else lo > 0) else "does not hold"), ""


def has_study_figure() -> pl.Expr:
    """Ledger rows for which the study printed a figure (config/study.yaml): those a reader can check."""
    return pl.col("study_text").fill_null("") != ""


def lacks_a_cell() -> pl.Expr:
    """Ledger rows "not measurable" because the run lacks a cell they read (not for want of a study figure)."""
    return (pl.col("verdict") == "not measurable") & ~pl.col("missing").fill_null("").str.starts_with("study figure")


def is_study_claim() -> pl.Expr:
    """The study's claims: rows of origin `study` whose figure the study printed."""
    return (pl.col("origin") == "study") & has_study_figure()


def verdict_counts(table: pl.DataFrame, model: str) -> dict[str, int]:
    """Per verdict, how many of a model's study claims (`is_study_claim`) have it."""
    rows = table.filter((pl.col("model") == model) & is_study_claim())
    return {v: rows.filter(pl.col("verdict") == v).height for v in VERDICTS}
