"""config/ledger.yaml (`make study`) plans every cell the claims ledger reads: from the config
alone (no model run), its cells with made-up medians leave no ledger row "not measurable" for want
of a cell; only rows whose study figure is absent say so. The default matrix, which the README says
answers part of the ledger, does leave rows without a cell: the check can fail."""

import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
import synthetic  # noqa: E402

from kvarn.budget.memory import summary_fields  # noqa: E402
from kvarn.plan.matrix import expand  # noqa: E402
from kvarn.report.claims.decisions import cheapest_match_table  # noqa: E402
from kvarn.report.claims.ledger import ledger  # noqa: E402
from kvarn.report.claims.study import load_study  # noqa: E402
from kvarn.report.claims.verdicts import lacks_a_cell  # noqa: E402
from kvarn.report.data import prepare  # noqa: E402
from kvarn.vocab import facts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STUDY = load_study()


def planned_summary(config: dict) -> pl.DataFrame:
    """One summary row per planned cell: the byte accounting of kvarn.budget.memory at the model's
    geometry, a median from tests/synthetic.py's model of the damage (falls with width, the tail helps)."""
    rows = []
    for c in expand(config).cells:
        mem = summary_fields(synthetic.geometry(c.model), c.n_ctx, c.spec)
        mem.pop("kv_geometry")
        med = synthetic._median(c.model, c.k, c.v, c.tail) * (0.6 if c.sink else 1.0)
        rows.append({"model": c.model, "n_ctx": c.n_ctx, "chunks": c.chunks, "k_type": c.k, "v_type": c.v,
                     "tail": c.tail, "tail_eff_full": facts.pair_effective_tail(c.k, c.v, c.tail), "cell": c.name,
                     "kld_median": med, "kld_mean": 2 * med, "memory_accounting": "packed", "same_top": 0.9,
                     "same_top_err": 0.01, "tokens_per_s": 1000.0, **mem})
    return pl.DataFrame(rows, infer_schema_length=None)


def ledger_of(summary: pl.DataFrame) -> pl.DataFrame:
    return pl.concat([ledger(prepare(summary, m), m, STUDY) for m in summary["model"].unique(maintain_order=True)])


def ledger_rows(config_name: str) -> pl.DataFrame:
    return ledger_of(planned_summary(yaml.safe_load((ROOT / "config" / config_name).read_text())))


def for_want_of_a_cell(ledger: pl.DataFrame) -> pl.DataFrame:
    return ledger.filter(lacks_a_cell())


def test_the_ledger_config_leaves_no_row_without_its_cells():
    ledger = ledger_rows("ledger.yaml")
    assert set(ledger["model"]) == {"smollm2-135m", "gemma3-270m"}
    lacking = for_want_of_a_cell(ledger)
    assert lacking.is_empty(), lacking.select(["model", "claim_id", "missing"]).rows()
    # the rows that stay "not measurable" are the ones the study printed no figure for
    rest = ledger.filter(pl.col("verdict") == "not measurable")
    assert rest["missing"].str.starts_with("study figure").all()


def test_the_default_matrix_leaves_rows_without_their_cells():
    lacking = for_want_of_a_cell(ledger_rows("matrix.yaml"))
    assert lacking.height >= 10, lacking.select(["model", "claim_id", "missing"]).rows()


def without_group(drop: int) -> pl.DataFrame:
    config = yaml.safe_load((ROOT / "config" / "ledger.yaml").read_text())
    assert len(config["cells"]) == 6
    del config["cells"][drop]
    return planned_summary(config)


@pytest.mark.parametrize("drop", [0, 1, 2, 4, 5])
def test_each_cell_group_of_the_ledger_config_is_needed(drop):
    """Without any one of its cell groups, some ledger row lacks a cell (no group is decoration)..."""
    assert not for_want_of_a_cell(ledger_of(without_group(drop))).is_empty()


def test_the_mixed_standard_pairs_change_the_cheapest_match():
    """... except the mixed standard pairs (group 3), which no row names as missing: without them the
    cheapest standard match of a KVarN row is a symmetric pair, though a mixed pair (the study's
    q5_0-q4_0 for kvarn4) is cheaper at the same or a lower median."""
    config = yaml.safe_load((ROOT / "config" / "ledger.yaml").read_text())
    for summary, mixed in ((planned_summary(config), True), (without_group(3), False)):
        for m in ("smollm2-135m", "gemma3-270m"):
            t = cheapest_match_table(prepare(summary, m)).drop_nulls("match")
            k, v = t["match"].str.extract(r"^(\w+)-(\w+) ", 1), t["match"].str.extract(r"^(\w+)-(\w+) ", 2)
            assert (k != v).any() == mixed, (m, t.rows())
            if mixed:
                assert t.filter(pl.col("pair") == "kvarn4-kvarn4")["match"].item() == "q5_0-q4_0 t128"
