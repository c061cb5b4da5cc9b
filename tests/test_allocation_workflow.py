"""Per-layer allocations in the Snakemake workflow, planned in a copy of it in a temp directory
(tests/test_workflow.py's helpers): their cells are jobs of their own, a bad one is refused before
any job, the definitions are written where the jobs look them up, and editing one plans only its
cells again."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from kvarn.vocab.allocation import Allocation
from test_workflow import CTX, fake_done, plan, smk, workflow_copy

pytestmark = pytest.mark.xdist_group("allocation-workflow")

EDGES = {"k": "0-1:q8_0,2-27:q4_0,28-29:q8_0", "v": "q4_0", "v_first": "q8_0,2", "v_last": "q8_0,2"}
CONFIG = {
    "models": [{"name": "smollm2-135m", "source": "embedded:smollm2-135m", "n_ctx": [CTX], "chunks": 1}],
    "allocations": {"edges": EDGES, "flat": {"k": "q4_0", "v": "q4_0"}},
    "cells": [{"types": ["q4_0"], "tail": 128}, {"alloc": ["edges", "flat"], "tail": 128}],
}
TOKEN = Allocation.parse("edges", EDGES).token


def test_allocation_cells_are_planned_and_their_definitions_published(tmp_path):
    wd = workflow_copy(tmp_path, CONFIG)
    assert plan(wd) == {"fetch_model": 1, "wikitext": 1, "baseline": 1, "cell": 2, "cell_row": 2, "summary": 1}
    out = smk(wd, "-n", "--summary").stdout
    run = f"results/smollm2-135m/ctx{CTX}-c1/cells"
    assert f"{run}/q4_0-q4_0-t128-a{TOKEN}/summary.json" in out and f"{run}/q4_0-q4_0-t128/summary.json" in out
    record = json.loads((wd / ".snakemake" / "kvarn-allocations" / f"{TOKEN}.json").read_text())
    assert Allocation.from_record(record).token == TOKEN


@pytest.mark.parametrize("change, field", [
    (lambda c: c["allocations"].update(bad={"k": "0-1:q8_0,3-29:q4_0", "v": "q4_0"}),
     "allocations.bad.k: layer 2 is not named (between '0-1:q8_0' and '3-29:q4_0')"),
    (lambda c: c["allocations"]["edges"].update(k="0-1:q8_0,2-27:q4_0,28-29:kvarn4"),
     "allocations.edges: mixes families: q8_0 (k, layers 0-1) is a standard type; kvarn4 (k, layers 28-29) is KVarN"),
    (lambda c: c["cells"].append({"alloc": ["edgse"]}),
     "cells[2].alloc[0]: unknown allocation 'edgse'; defined: edges, flat"),
    (lambda c: c["allocations"]["edges"].update(k_frist="q8_0,2"),
     "allocations.edges: unknown field 'k_frist'; accepted: k, v, k_first, k_last, v_first, v_last"),
])
def test_a_bad_allocation_fails_before_any_job(tmp_path, change, field):
    wd = workflow_copy(tmp_path, CONFIG)
    bad = copy.deepcopy(CONFIG)
    change(bad)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    p = smk(wd, "-n", "--configfile", str(tmp_path / "bad.yaml"), check=False)
    assert p.returncode != 0 and field in p.stdout + p.stderr, p.stdout + p.stderr
    assert "Failed validating" not in p.stdout + p.stderr
    assert not (wd / "results").exists()


@pytest.mark.slow
def test_editing_an_allocation_plans_only_its_cells(tmp_path):
    wd = workflow_copy(tmp_path, CONFIG)
    fake_done(wd)
    edited = copy.deepcopy(CONFIG)
    edited["allocations"]["edges"]["v_last"] = "q8_0,4"
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(edited))
    assert plan(wd, "--configfile", str(tmp_path / "edited.yaml")) == {"cell": 1, "cell_row": 1, "summary": 1}
    # the old definition's file stays: a worker still serving it reads what its cell ran
    new = Allocation.parse("edges", edited["allocations"]["edges"]).token
    names = {p.name for p in (wd / ".snakemake" / "kvarn-allocations").iterdir()}
    assert {f"{TOKEN}.json", f"{new}.json"} <= names and new != TOKEN
