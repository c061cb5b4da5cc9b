"""kvarn.spec.cell: a cell's one path encoding, written by the matrix and read back by the report."""

import dataclasses

import pytest
import yaml

from kvarn.plan import matrix as kvm
from kvarn.report import data as rdata
from kvarn.spec.cell import CellSpec, parse_opts
from paths import REPO


@pytest.mark.parametrize("config", ["matrix.yaml", "article.yaml", "ecosystem.yaml"])
def test_every_planned_cell_reads_back_from_its_name(config):
    cells = kvm.expand(yaml.safe_load((REPO / "config" / config).read_text())).cells
    assert cells
    for c in cells:
        assert CellSpec.from_name(c.name) == c.spec
        assert c.dir.endswith("/cells/" + c.name)


def test_options_by_hand():
    s = CellSpec("q4_0", "q4_0", 128, rot=False, tail_dtype="f16", iters=8, sink=64)
    assert s.name == "q4_0-q4_0-t128-norot-tdf16-i8-s64"
    assert CellSpec.from_name(s.name) == s
    c = CellSpec("q4_0", "q8_0", 0, rot=False, compute="llamacpp-cpu")
    assert c.name == "q4_0-q8_0-t0-norot-llamacpp_cpu" and CellSpec.from_name(c.name) == c
    assert CellSpec.from_name("kvarn4-kvarn4-t0") == CellSpec("kvarn4", "kvarn4", 0)
    assert parse_opts("") == {f.name: f.default for f in dataclasses.fields(CellSpec) if f.name not in ("k", "v", "tail")}
    assert kvm.CELL_DEFAULTS == parse_opts("")


@pytest.mark.parametrize("name", [
    "q4_0-q4_0-t128-s64-norot",  # options out of their order
    "kvarn4-kvarn4-t0-i16",  # the default passes written out
    "q4_0-q4_0-t0-llamacpp_cpu-s1",
    "q4_0-q4_0",  # no tail
    "q4_0-q4_0-t12x",
    "Q4_0-q4_0-t0",
    "q4_0-q4_0-t0-fast",
])
def test_a_name_the_matrix_would_not_write_is_refused(name):
    with pytest.raises(ValueError, match="cell name"):
        CellSpec.from_name(name)


def test_the_report_reads_cell_paths_with_the_same_encoding():
    with pytest.raises(ValueError, match="not a cell path"):
        rdata.parse_cell_path("results/m/ctx512-c4/cells/q4_0-q4_0-t0-s1-norot/tokens.parquet")
    assert rdata.parse_cell_path("results/m/ctx512-c4/cells/q4_0-q4_0-t0-norot-s1/tokens.parquet")["opts"] == "-norot-s1"

