"""Which compute path the study's tables show (kvarn.report.data.primary_compute), and that every compute
path has its own baseline dump the workflow can make (kvarn.vocab.cell.BASELINE_OPTS_PATTERN, the
Snakefile's `bopts`): a run on the GPU's tf32-attn alone (config/article.yaml) fills the tables."""

import re

import polars as pl
import pytest

from kvarn.plan import matrix as kvm
from kvarn.plan import paths as kvp
from kvarn.report.data import primary_compute
from kvarn.vocab.options import COMPUTES


def rows(*cells):
    return pl.DataFrame([{"model": m, "compute": c, "cell": name} for m, c, name in cells],
                        schema={"model": pl.String, "compute": pl.String, "cell": pl.String})


def test_exact_rows_win_where_a_model_has_them_and_row_order_is_kept():
    df = rows(("a", None, "q4"), ("b", "tf32-attn", "q4-tf32"), ("a", "llamacpp-cpu", "q4-cpu"),
              ("b", "tf32-attn", "q8-tf32"), ("a", "exact", "q8"))
    assert primary_compute(df)["cell"].to_list() == ["q4", "q4-tf32", "q8-tf32", "q8"]


def test_a_model_on_one_non_exact_path_keeps_its_rows():
    df = rows(("qwen", "tf32-attn", "x"), ("qwen", "tf32-attn", "y"))
    assert primary_compute(df)["cell"].to_list() == ["x", "y"]


def test_a_model_mixing_paths_without_exact_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model 'qwen': cells on compute paths \['bf16-attn', 'tf32-attn'\] and "
                                         r"none on exact"):
        primary_compute(rows(("qwen", "tf32-attn", "x"), ("qwen", "bf16-attn", "y")))


def test_a_summary_without_a_compute_column_is_all_exact():
    df = pl.DataFrame({"model": ["a"], "cell": ["q4"]})
    assert primary_compute(df).equals(df)


@pytest.mark.parametrize("compute", COMPUTES)
def test_every_compute_path_has_a_baseline_the_workflow_can_make(compute):
    path = kvp.baseline_path("results/m/ctx512-c1", compute)
    bopts = re.fullmatch(r"results/m/ctx512-c1/baseline(.*)\.kvd", path)[1]
    assert re.fullmatch(kvp.BASELINE_OPTS_PATTERN, bopts)


def test_the_article_runs_tf32_attn_and_plans_its_baselines():
    import yaml
    from pathlib import Path

    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "article.yaml").read_text())
    m = kvm.expand(cfg)
    assert {c.compute for c in m.cells} == {"tf32-attn"}
    assert {kvp.baseline_path(c.run_dir, c.compute) for c in m.cells} == {
        "results/qwen3.6-27b/ctx65536-call/baseline-tf32_attn.kvd", "results/gemma4-31b/ctx16384-call/baseline-tf32_attn.kvd"}
