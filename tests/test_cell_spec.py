"""kvarn.vocab.cell: a cell's one path encoding, written by the matrix and read back by the report."""

import dataclasses

import pytest
import yaml

from kvarn.plan import matrix as kvm
from kvarn.plan import paths as kvp
from kvarn.report import data as rdata
from kvarn.vocab.cell import CellError, CellSpec, parse_opts
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
    (("q4_0", "q4_0", 0), {"compute": "fast"}, "compute", ["'fast'", "exact, llamacpp-cpu, bf16-attn, tf32-attn"]),
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

    from kvarn.cli.parser import UsageError, cell_spec

    args = Namespace(k="kvarn4", v="kvarn4", tail=0, rot=True, tail_dtype=None, iters=None, sink=3, compute="exact")
    with pytest.raises(UsageError, match=r"^--sink 3: sink 3 for kvarn4/kvarn4: KVarN's sink is fixed at 128"):
        cell_spec(args)
    args.sink = None
    assert cell_spec(args) == CellSpec("kvarn4", "kvarn4", 0)  # iters None: CellSpec's default


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
    assert kvp.parse_run_dir(path) == want
    assert kvp.RUN_DIR.format(**want) in path
    run, cell = kvp.parse_cell_dir(f"{path}/cells/q4_0-q4_0-t0-norot")
    assert run == want and cell == CellSpec("q4_0", "q4_0", 0, rot=False)


@pytest.mark.parametrize("path", ["results/m/ctx512-c4x", "results/m/ctx512", "m/ctx512-c4", "results/m/ctx-c4",
                                  "results/m/ctx512-c4/extra"])
def test_a_path_outside_the_layout_is_refused(path):
    with pytest.raises(ValueError, match="not a run directory"):
        kvp.parse_run_dir(path)


# ---------------------------------------------------------------- each check and encoding, by hand

ACCEPTED_TYPES = ("q8_0, q6_0, q6_1, q5_1, q5_0, q4_1, q4_0, iq4_nl, q3_1, q3_0, q2_1, q2_0, f32, f16, bf16, "
                  "kvarn2, kvarn3, kvarn4, kvarn5, kvarn6, kvarn7, kvarn8, quanto4, quanto2, hqq4, hqq2, kivi4, kivi2")


def test_defaults_by_hand():
    s = CellSpec("q4_0", "q8_0", 0)
    assert (s.rot, s.tail_dtype, s.iters, s.sink, s.compute) == (True, None, 16, None, "exact")
    assert s.opts == "" and s.name == "q4_0-q8_0-t0"


# (fields given, the CellError field, its value, the whole message)
MESSAGES = [
    (("q9_0", "q4_0", 0), {}, "k", "q9_0", f"K type: unknown KV cache type 'q9_0'; accepted: {ACCEPTED_TYPES}"),
    (("q4_0", None, 0), {}, "v", None, f"V type: unknown KV cache type None; accepted: {ACCEPTED_TYPES}"),
    (("kvarn4", "q4_0", 0), {}, "pair", "kvarn4/q4_0",
     "K type 'kvarn4' and V type 'q4_0' mix KVarN with a standard type; use kvarnN for both K and V, "
     "or standard types for both"),
    (("q4_0", "q4_0", -1), {}, "tail", -1, "tail must be an integer >= 0, got -1"),
    (("q4_0", "q4_0", 1.0), {}, "tail", 1.0, "tail must be an integer >= 0, got 1.0"),
    (("q4_0", "q4_0", "8"), {}, "tail", "8", "tail must be an integer >= 0, got '8'"),
    (("q4_0", "q4_0", 0), {"rot": 1}, "rot", 1, "rot must be true or false, got 1"),
    (("q4_0", "q4_0", 0), {"tail_dtype": "fp16"}, "tail_dtype", "fp16",
     "tail_dtype 'fp16' is not accepted; use one of bf16, f16, f32 (or none: the pair's own)"),
    (("kvarn4", "kvarn4", 0), {"iters": 0}, "iters", 0,
     "iters must be an integer >= 1 (KVarN's normalization passes; default 16), got 0"),
    (("kvarn4", "kvarn4", 0), {"iters": True}, "iters", True,
     "iters must be an integer >= 1 (KVarN's normalization passes; default 16), got True"),
    (("q4_0", "q4_0", 0), {"sink": -1}, "sink", -1,
     "sink must be an integer >= 0 (or none: the pair's own, 0), got -1"),
    (("q4_0", "q4_0", 0), {"sink": True}, "sink", True,
     "sink must be an integer >= 0 (or none: the pair's own, 0), got True"),
    (("kvarn4", "kvarn4", 0), {"sink": 1.5}, "sink", 1.5,
     "sink must be an integer >= 0 (or none: the pair's own, 128), got 1.5"),
    (("kvarn4", "kvarn2", 0), {"sink": 129}, "sink", 129,
     "sink 129 for kvarn4/kvarn2: KVarN's sink is fixed at 128 (a sink is an option of the standard types only)"),
    (("q4_0", "q4_0", 0), {"compute": "fast"}, "compute", "fast", "compute 'fast' not accepted; use one of exact, "
                                                                    "llamacpp-cpu, bf16-attn, tf32-attn"),
]


@pytest.mark.parametrize("args, opts, field, value, message", MESSAGES, ids=[f"{r[2]}-{i}" for i, r in enumerate(MESSAGES)])
def test_each_refusal_names_field_value_and_what_is_accepted(args, opts, field, value, message):
    with pytest.raises(CellError) as e:
        CellSpec(*args, **opts)
    assert (e.value.field, e.value.value, str(e.value)) == (field, value, message)
    assert isinstance(e.value, ValueError)


def test_an_ecosystem_pair_mixed_with_a_standard_type_is_refused():
    with pytest.raises(CellError) as e:
        CellSpec("q4_0", "hqq4", 0)
    assert (e.value.field, e.value.value) == ("pair", "q4_0/hqq4")
    assert str(e.value) == ("K type 'q4_0' and V type 'hqq4' mix a QuantizedCache backend type with another family; "
                            "use quantoN, hqqN or kiviN for both K and V")


def test_a_standard_pair_takes_any_sink_and_the_ecosystem_its_own():
    assert CellSpec("q4_0", "q4_0", 0, sink=1).sink == 1
    assert CellSpec("q4_0", "q4_0", 0, sink=4096).sink == 4096
    assert CellSpec("quanto4", "quanto4", 0, sink=0).sink == 0
    assert CellSpec("kvarn4", "kvarn4", 0, iters=2).iters == 2
    assert CellSpec("q4_0", "q4_0", 0, rot=False).rot is False


@pytest.mark.parametrize("spec, name", [
    (CellSpec("q8_0", "q8_0", 0, rot=False), "q8_0-q8_0-t0-norot"),
    (CellSpec("q8_0", "q8_0", 0, tail_dtype="bf16"), "q8_0-q8_0-t0-tdbf16"),  # written even when the pair's own
    (CellSpec("kvarn4", "kvarn4", 0, iters=8), "kvarn4-kvarn4-t0-i8"),
    (CellSpec("kvarn4", "kvarn4", 0, iters=17), "kvarn4-kvarn4-t0-i17"),
    (CellSpec("q8_0", "q8_0", 0, sink=0), "q8_0-q8_0-t0-s0"),  # a sink asked is written, 0 included
    (CellSpec("kvarn4", "kvarn4", 0, sink=128), "kvarn4-kvarn4-t0-s128"),
    (CellSpec("q8_0", "q4_0", 512, compute="llamacpp-cpu"), "q8_0-q4_0-t512-llamacpp_cpu"),
    (CellSpec("q8_0", "q4_0", 512, sink=2, compute="bf16-attn"), "q8_0-q4_0-t512-s2-bf16_attn"),
    (CellSpec("kvarn5", "kvarn3", 1000, rot=False, tail_dtype="f32", iters=1, compute="llamacpp-cpu"),
     "kvarn5-kvarn3-t1000-norot-tdf32-i1-llamacpp_cpu"),
])
def test_each_option_token_by_hand(spec, name):
    assert spec.name == name
    assert CellSpec.from_name(name) == spec
    assert spec.opts == name[len(f"{spec.k}-{spec.v}-t{spec.tail}"):]


def test_parse_opts_by_hand():
    base = {"rot": True, "tail_dtype": None, "iters": 16, "sink": None, "compute": "exact"}
    assert parse_opts("") == base and parse_opts(None) == base
    assert parse_opts("-norot") == {**base, "rot": False}
    assert parse_opts("-tdf16") == {**base, "tail_dtype": "f16"}
    assert parse_opts("-i3") == {**base, "iters": 3}
    assert parse_opts("-s0") == {**base, "sink": 0}
    assert parse_opts("-s12") == {**base, "sink": 12}
    assert parse_opts("-llamacpp_cpu") == {**base, "compute": "llamacpp-cpu"}
    assert parse_opts("-s3-bf16_attn") == {**base, "sink": 3, "compute": "bf16-attn"}
    assert parse_opts("-norot-tdbf16-i2-s5-llamacpp_cpu") == {"rot": False, "tail_dtype": "bf16", "iters": 2,
                                                               "sink": 5, "compute": "llamacpp-cpu"}


@pytest.mark.parametrize("opts", ["norot", "-rot", "-td", "-i", "-s", "-sx", "-llamacpp-cpu", "-bf16-attn", "-norot ", "-TDf16"])
def test_parse_opts_refuses_a_bad_suffix_by_name(opts):
    with pytest.raises(ValueError) as e:
        parse_opts(opts)
    assert str(e.value) == (f"{opts!r} is not a cell's options suffix; expected tokens of -norot, -td<dtype>, "
                            "-i<n>, -s<n>, -llamacpp_cpu, -bf16_attn or -tf32_attn")


NOT_A_NAME = ("is not a cell name; expected {k}-{v}-t{tail}{opts}, e.g. q4_0-q4_0-t128 or kvarn4-kvarn4-t0-s64 "
              "(opts: -norot, -td<dtype>, -i<n>, -s<n>, -llamacpp_cpu, -bf16_attn or -tf32_attn, in that order)")


@pytest.mark.parametrize("name", [None, 7, "", "q4_0-q4_0-t", "q4_0-q4_0-t0-", "xq4_0-q4_0-t0 ", "q4_0-q4-0-t0",
                                  "q4_0-q4_0-t-1", "q4_0--t0", "-q4_0-t0"])
def test_a_string_that_is_not_a_cell_name_is_refused_by_name(name):
    with pytest.raises(ValueError) as e:
        CellSpec.from_name(name)
    assert str(e.value) == f"{name!r} {NOT_A_NAME}"


def test_a_name_of_an_invalid_cell_keeps_the_field():
    with pytest.raises(CellError) as e:
        CellSpec.from_name("q9_9-q4_0-t0")
    assert (e.value.field, e.value.value) == ("k", "q9_9")
    assert str(e.value) == ("'q9_9-q4_0-t0' is not the cell name of a valid cell: K type: unknown KV cache type "
                            f"'q9_9'; accepted: {ACCEPTED_TYPES}")
    with pytest.raises(CellError) as e:
        CellSpec.from_name("kvarn4-kvarn4-t0-s64")
    assert (e.value.field, e.value.value) == ("sink", 64)
    assert str(e.value).startswith("'kvarn4-kvarn4-t0-s64' is not the cell name of a valid cell: sink 64 for ")


@pytest.mark.parametrize("name, same", [
    ("kvarn4-kvarn4-t0-i16", "kvarn4-kvarn4-t0"),
    ("q4_0-q4_0-t007", "q4_0-q4_0-t7"),
    ("q4_0-q4_0-t0-s01", "q4_0-q4_0-t0-s1"),
    ("q4_0-q4_0-t0-s1-norot", "q4_0-q4_0-t0-norot-s1"),
])
def test_a_name_the_matrix_would_write_otherwise_names_its_own(name, same):
    with pytest.raises(ValueError) as e:
        CellSpec.from_name(name)
    assert not isinstance(e.value, CellError)
    assert str(e.value) == f"{name!r} is not a cell name as the matrix writes it; the same cell is {same!r}"


def test_compute_suffix_by_hand():
    from kvarn.vocab.cell import compute_suffix

    assert compute_suffix("exact") == "" and compute_suffix("llamacpp-cpu") == "-llamacpp_cpu"
    with pytest.raises(ValueError) as e:
        compute_suffix("llamacpp_cpu")
    assert str(e.value) == "compute 'llamacpp_cpu' is not one of exact, llamacpp-cpu, bf16-attn, tf32-attn"


def test_family_of_each_pair():
    assert CellSpec("q4_0", "f16", 0).family == "standard"
    assert CellSpec("kvarn8", "kvarn2", 0).family == "kvarn"
    assert CellSpec("kivi4", "quanto2", 128).family == "ecosystem"
