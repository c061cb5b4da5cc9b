"""The per-layer study in the Snakemake workflow, run for real on a random-weight model in a copy of the
workflow: sensitivities, the search (a checkpoint), its allocations as cells, the held-out table and
heatmap; then a budget added plans only that budget's search and what reads it."""

from __future__ import annotations

import copy
import json
import os
import sys

import polars as pl
import pytest
import yaml

from paths import VALID_TEXT
from test_workflow import smk, workflow_copy

pytestmark = [pytest.mark.xdist_group("perlayer-workflow"), pytest.mark.slow,
              pytest.mark.skipif(not VALID_TEXT.is_file(), reason="needs the shared wiki.valid.raw")]

TOY = {"model_type": "llama", "vocab_size": 300, "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 6,
       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 1024}
CONFIG = {
    "models": [{"name": "toy", "source": "random:config/models/toy.json", "n_ctx": [512], "chunks": 1, "dtype": "float32"}],
    "cells": [{"types": ["q8_0"], "tail": 128}],
    "report": {"boot": 200},
    "perlayer": {"text": str(VALID_TEXT), "n_ctx": 512, "budgets": ["q4_0"],
                 "types": {"standard": ["q8_0", "q4_0", "q2_0"], "kvarn": ["kvarn8", "kvarn2"]}},
}


def counts(wd, *args) -> dict:
    import re

    out = smk(wd, *args, "-n", "--quiet", "rules")
    return {r: int(n) for r, n in re.findall(r"^(\w+)\s+(\d+)\s*$", out.stdout + out.stderr, flags=re.M)
            if r != "total"}


def test_the_per_layer_study_runs_and_a_new_budget_plans_only_its_jobs(tmp_path):
    wd = workflow_copy(tmp_path, CONFIG)
    (wd / "config" / "models" / "toy.json").write_text(json.dumps(TOY))
    env_before = dict(os.environ)
    os.environ.update(OMP_NUM_THREADS="1")
    try:
        smk(wd, "perlayer", "--cores", "2", "--resources", "gpu=1", timeout=1200)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    out = wd / "results" / "perlayer"
    table = pl.read_parquet(out / "perlayer.parquet")
    assert table["method"].to_list()[0] == "uniform" and set(table["method"]) >= {"uniform", "knapsack"}
    assert (table["bytes"] <= table["budget_bytes"]).all()
    search = json.loads((out / "toy" / "search" / "q4_0.json").read_text())
    run = wd / "results" / "toy" / "ctx512-c1" / "cells"
    for e in search["allocations"]:  # every searched allocation ran as a cell of the run, and is in the summary
        assert (run / e["cell"] / "summary.json").is_file()
    summary = pl.read_parquet(wd / "results" / "summary.parquet")
    assert {e["cell"] for e in search["allocations"]} <= set(summary["cell"])
    assert {"q8_0-q2_0-t128", "kvarn2-kvarn8-t0"} <= set(summary["cell"])  # the uniform pairs joined the matrix
    for ext in ("svg", "png", "vl.json"):
        assert (out / "figures" / f"toy-sensitivity.{ext}").stat().st_size > 0
    md = (out / "perlayer.md").read_text()
    assert "## toy" in md and "At q4_0's bytes" in md
    assert counts(wd, "perlayer") == {}
    more = copy.deepcopy(CONFIG)
    more["perlayer"]["budgets"] = ["q4_0", "q8_0"]
    (tmp_path / "more.yaml").write_text(yaml.safe_dump(more))
    planned = counts(wd, "perlayer", "--configfile", str(tmp_path / "more.yaml"))
    # the new budget's search, then (once it has run) its cells, the summary and the table: nothing else
    assert planned.get("perlayer_search") == 1 and "perlayer_sensitivity" not in planned and "baseline" not in planned
    assert set(planned) <= {"perlayer_search", "summary", "perlayer_table", "perlayer"}, planned
