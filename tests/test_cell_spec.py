"""kvarn.spec.cell: a cell's one path encoding, written by the matrix and read back by the report."""

import dataclasses

import pytest
import yaml

from kvarn.plan import matrix as kvm
from kvarn.report import data as rdata
from kvarn.spec.cell import CellError, CellSpec, parse_opts
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


# (fields given, the CellError field, words the message must hold: the value and what is accepted)
REFUSED = [
    (("q9_0", "q4_0", 0), {}, "k", ["'q9_0'", "q8_0, q6_0"]),
    (("q4_0", "kvarn9", 0), {}, "v", ["'kvarn9'", "kvarn8"]),
    (("kvarn4", "q4_0", 0), {}, "pair", ["'kvarn4'", "'q4_0'", "kvarnN for both"]),
    (("quanto4", "q4_0", 0), {}, "pair", ["'quanto4'", "quantoN, hqqN or kiviN for both"]),
    (("q4_0", "q4_0", -1), {}, "tail", ["-1", ">= 0"]),
    (("q4_0", "q4_0", True), {}, "tail", ["True", ">= 0"]),
    (("q4_0", "q4_0", 0), {"rot": "yes"}, "rot", ["'yes'", "true or false"]),
    (("q4_0", "q4_0", 0), {"tail_dtype": "q8_0"}, "tail_dtype", ["'q8_0'", "bf16, f16, f32"]),
    (("kvarn4", "kvarn4", 0), {"iters": 0}, "iters", ["0", ">= 1"]),
    (("kvarn4", "kvarn4", 0), {"iters": 2.5}, "iters", ["2.5", ">= 1"]),
    (("q4_0", "q4_0", 0), {"sink": -1}, "sink", ["-1", ">= 0"]),
    (("kvarn4", "kvarn4", 0), {"sink": 0}, "sink", ["sink 0", "fixed at 128"]),
    (("q4_0", "q4_0", 0), {"compute": "fast"}, "compute", ["'fast'", "exact, llamacpp-cpu"]),
    (("quanto4", "quanto4", 128), {"compute": "llamacpp-cpu"}, "compute",
     ["'quanto4'", "not a llama.cpp or BeeLlama cache type"]),
    (("q4_0", "q4_0", 0), {"sink": 4, "compute": "llamacpp-cpu"}, "compute", ["sink 4", "not accepted"]),
    (("q4_0", "q4_0", 128), {"sink": 4, "compute": "llamacpp-cpu"}, "compute", ["sink 4", "not accepted"]),
    (("kivi2", "kivi2", 0), {"compute": "llamacpp-cpu"}, "compute",
     ["K type 'kivi2'", "not a llama.cpp or BeeLlama cache type"]),
]


@pytest.mark.parametrize("args, opts, field, words", REFUSED, ids=[f"{r[2]}-{i}" for i, r in enumerate(REFUSED)])
def test_every_option_is_checked_on_construction(args, opts, field, words):
    with pytest.raises(CellError) as e:
        CellSpec(*args, **opts)
    assert e.value.field == field
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    # a valid cell cannot be made invalid afterwards: replace() checks again
    with pytest.raises(CellError):
        dataclasses.replace(CellSpec("q8_0", "q8_0", 0), **dict(zip(("k", "v", "tail"), args)), **opts)


def test_valid_edges_are_accepted():
    assert CellSpec("q4_0", "q4_0", 0, sink=0).sink == 0  # a standard pair takes any sink >= 0
    assert CellSpec("kvarn4", "kvarn4", 0, sink=128).sink == 128  # KVarN its own
    assert CellSpec("kvarn4", "kvarn4", 0, iters=1).iters == 1
    assert CellSpec("f32", "f32", 0, tail_dtype="f32").family == "standard"
    assert CellSpec("kvarn4", "kvarn2", 0).family == "kvarn" and CellSpec("hqq4", "hqq2", 0).family == "ecosystem"


def test_entry_points_name_their_own_field():
    """The matrix and the CLI prefix a CellError with their name for the field, not a second check."""
    cfg = {"models": [{"name": "m", "source": "embedded:smollm2-135m", "n_ctx": [512], "chunks": 2}],
           "cells": [{"k": ["q4_0"], "v": ["q8_0", "q9_9"], "tail": 0}]}
    with pytest.raises(kvm.MatrixError, match=r"^cells\[0\]\.v\[1\]: V type: unknown KV cache type 'q9_9'"):
        kvm.expand(cfg)
    cfg["cells"] = [{"types": ["kvarn4"], "tail": 0, "iters": 0}]
    with pytest.raises(kvm.MatrixError, match=r"^cells\[0\]\.iters: iters must be an integer >= 1"):
        kvm.expand(cfg)
    from argparse import Namespace

    from kvarn import cli

    args = Namespace(k="kvarn4", v="kvarn4", tail=0, rot=True, tail_dtype=None, iters=None, sink=3, compute="exact")
    with pytest.raises(cli.UsageError, match=r"^--sink 3: sink 3 for kvarn4/kvarn4: KVarN's sink is fixed at 128"):
        cli.cell_spec(args)
    args.sink = None
    assert cli.cell_spec(args) == CellSpec("kvarn4", "kvarn4", 0)  # iters None: CellSpec's default


def test_from_wildcards_is_from_name():
    from types import SimpleNamespace

    w = SimpleNamespace(k="q8_0", v="q4_0", tail="128", opts="-tdf16-s128")
    assert CellSpec.from_wildcards(w) == CellSpec("q8_0", "q4_0", 128, tail_dtype="f16", sink=128)
    with pytest.raises(ValueError, match="cell name"):
        CellSpec.from_wildcards(SimpleNamespace(k="kvarn4", v="kvarn4", tail="0", opts="-s64"))


@pytest.mark.parametrize("path, want", [
    ("results/m/ctx512-c4", {"model": "m", "n_ctx": 512, "chunks": 4}),
    ("/abs/prefix/results/gemma-3.1_x/ctx2048-call", {"model": "gemma-3.1_x", "n_ctx": 2048, "chunks": "all"}),
])
def test_run_dirs_read_back_through_the_layout(path, want):
    assert kvm.parse_run_dir(path) == want
    assert kvm.RUN_DIR.format(**want) in path
    run, cell = kvm.parse_cell_dir(f"{path}/cells/q4_0-q4_0-t0-norot")
    assert run == want and cell == CellSpec("q4_0", "q4_0", 0, rot=False)


@pytest.mark.parametrize("path", ["results/m/ctx512-c4x", "results/m/ctx512", "m/ctx512-c4", "results/m/ctx-c4",
                                  "results/m/ctx512-c4/extra"])
def test_a_path_outside_the_layout_is_refused(path):
    with pytest.raises(ValueError, match="not a run directory"):
        kvm.parse_run_dir(path)
