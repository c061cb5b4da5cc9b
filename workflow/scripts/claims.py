"""Rule claims: results/summary.parquet (+ the report run's tokens) -> the study's claims ledger
(results/claims.md, .parquet, .html) and each model's decision tables (results/tables/decisions/)."""

from pathlib import Path

import polars as pl
from _wf import atomic, start

start(snakemake)
from kvarn.report.claims.ledger import run_claims
from kvarn.report.claims.render import claims_html, claims_markdown
from kvarn.report.claims.study import load_study

ledger, decisions = run_claims(
    pl.read_parquet(snakemake.input.summary),
    list(snakemake.input.tokens),
    load_study(snakemake.input.study),
    snakemake.params.study_models,
    n_boot=snakemake.params.boot,
    seed=snakemake.params.seed,
)
with atomic(snakemake.output.parquet) as tmp:
    ledger.write_parquet(tmp)
with atomic(snakemake.output.md) as tmp:
    tmp.write_text(claims_markdown(ledger, decisions), encoding="utf-8")
with atomic(snakemake.output.html) as tmp:
    tmp.write_text(claims_html(ledger, decisions), encoding="utf-8")
for path in snakemake.output.decisions:  # results/tables/decisions/{model}.md
    with atomic(path) as tmp:
        tmp.write_text(decisions[Path(path).stem], encoding="utf-8")
print(ledger.group_by("verdict").len())
