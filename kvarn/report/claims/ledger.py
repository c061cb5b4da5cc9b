"""The ledger: every claim's rows for one model (`ledger`), and for every model of a run with its
decision tables (`run_claims`, the `claims` rule). What a row says: docs/notes/report.md."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import polars as pl

from kvarn.report.claims.definitions import CLAIMS
from kvarn.report.claims.render import decisions_markdown
from kvarn.report.claims.study import load_study, study_model_of
from kvarn.report.claims.verdicts import LEDGER_COLUMNS, no_delta, paired_delta


def ledger(prep: pl.DataFrame, model: str, study: dict | None = None, cells: Mapping | None = None,
           study_model: str | None = None, n_boot: int = 2000, seed: int = 0) -> pl.DataFrame:
    """Every claim's rows for one model's prepared run (LEDGER_COLUMNS). `cells`: cell name ->
    kvarn.stats.paired.CellTokens for the paired intervals (none: the interval columns stay empty)."""
    study = study if study is not None else load_study()
    sm = study_model or study_model_of(model, study)
    delta = paired_delta(cells, n_boot, seed) if cells else no_delta
    rows = [r for f in CLAIMS for r in f(prep, model, sm, study, delta)]
    for r in rows:  # a misspelt field would be dropped below without a word
        if set(r) != set(LEDGER_COLUMNS):
            raise AssertionError(f"ledger row {r.get('claim_id')!r} has fields {sorted(set(r) ^ set(LEDGER_COLUMNS))} "
                                 f"outside or missing from LEDGER_COLUMNS")
    schema = {c: pl.String for c in LEDGER_COLUMNS} | {c: pl.Float64 for c in ("study", "ours", "delta", "delta_lo",
                                                                                 "delta_hi")}
    return pl.DataFrame([{c: r[c] for c in LEDGER_COLUMNS} for r in rows], schema=schema)


def run_claims(summary: pl.DataFrame, token_paths=(), study: dict | None = None,
               study_models: Mapping[str, str] | None = None, n_boot: int = 2000, seed: int = 0):
    """The ledger of every model of a run and each model's decision tables (Markdown).

    `token_paths`: the tokens.parquet of the cells each model's tables show (the paired
    intervals are computed for the cells found among them). Returns (ledger, {model: md})."""
    from kvarn.stats.paired import load_cell
    from kvarn.report.data import prepare

    study = study if study is not None else load_study()
    by_name: dict[tuple[str, str], Path] = {}
    for p in token_paths:
        d = Path(p).parent
        by_name[(d.parent.parent.parent.name, d.name)] = d  # results/{model}/ctx.../cells/{cell}
    ledgers, decisions = [], {}
    for model in summary["model"].unique(maintain_order=True).to_list():
        prep = prepare(summary, model)
        cells = {r["cell"]: load_cell(by_name[(model, r["cell"])], summary=r)
                 for r in prep.iter_rows(named=True) if (model, r["cell"]) in by_name}
        sm = study_model_of(model, study, study_models)
        ledgers.append(ledger(prep, model, study, cells, sm, n_boot, seed))
        decisions[model] = decisions_markdown(prep, model, paired_delta(cells, n_boot, seed) if cells else no_delta)
    return pl.concat(ledgers), decisions
