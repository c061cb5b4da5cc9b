"""Per-layer K and V types (kvarn.vocab.allocation), torch-free: the two config forms, every refusal's
text, the cell's name and identity, where a job finds the definition, the engines' spellings, the
matrix and schema, and the memory accounting as the exact per-layer sum of real packed buffers."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvarn.budget.memory import ACCOUNTINGS, kv_bytes, resummarize, summary_fields
from kvarn.plan import allocations as kva
from kvarn.plan import matrix as kvm
from kvarn.plan import rows as kvr
from kvarn.plan.config_check import config_errors
from kvarn.vocab import allocation as alc
from kvarn.vocab import facts
from kvarn.vocab.allocation import Allocation, AllocationError
from kvarn.vocab.cell import AllocCellSpec, CellError, CellSpec, cell_spec, parse_opts
from kvarn.vocab.geometry import Geometry, LayerGeometry

ROOT = Path(__file__).resolve().parents[1]
EDGES = {"k": "0-1:q8_0,2-27:q4_0,28-29:q8_0", "v": "0-1:q8_0,2-27:q4_0,28-29:q8_0"}
IK = {"k": "q4_0", "v": "q4_0", "k_first": "q8_0,2", "k_last": "q8_0,2", "v_first": "q8_0,2", "v_last": "q8_0,2"}


def parse(raw, name="x"):
    return Allocation.parse(name, raw)


def refusal(fn, *args, exc=AllocationError) -> str:
    with pytest.raises(exc) as e:
        fn(*args)
    return str(e.value)


# ---- the two forms ----------------------------------------------------------------------------

def test_ranges_name_every_layer_and_resolve_per_layer():
    a = parse(EDGES, "edges8")
    ks, vs = a.resolve(30)
    assert ks == vs == ("q8_0",) * 2 + ("q4_0",) * 26 + ("q8_0",) * 2
    assert a.base == ("q4_0", "q4_0") and a.family == "standard" and not a.uniform
    assert a.token == f"edges8.{a.digest}" and alc.TOKEN_RE.fullmatch(a.token)


def test_the_first_last_form_is_ik_llamas_on_any_layer_count():
    a = parse(IK)
    for n in (4, 30, 64):
        ks, vs = a.resolve(n)
        assert ks == vs == ("q8_0",) * 2 + ("q4_0",) * (n - 4) + ("q8_0",) * 2
    one_sided = parse({"k": "q4_0", "v": "q5_0", "k_last": "q8_0,3"}).resolve(5)
    assert one_sided == (("q4_0",) * 2 + ("q8_0",) * 3, ("q5_0",) * 5)


def test_one_definition_is_one_token_however_spelled():
    same = [EDGES, {"k": "28-29:q8_0, 0-1:q8_0,2-27:q4_0", "v": "0:q8_0,1:q8_0,2-27:q4_0,28-29:q8_0"}]
    assert len({parse(d, "edges8").token for d in same}) == 1
    # an edge of the base type or of 0 layers is no edge
    assert parse({"k": "q4_0", "v": "q4_0", "k_first": "q4_0,2", "v_last": "q8_0,0"}).definition() == \
        {"k": "q4_0", "v": "q4_0"}
    edited = parse({**EDGES, "v": "0-2:q8_0,3-27:q4_0,28-29:q8_0"}, "edges8")
    assert edited.token != parse(EDGES, "edges8").token and edited.name == "edges8"


def test_main_types_are_the_most_layers_ties_to_the_first():
    assert parse({"k": "0-1:q8_0,2-3:q4_0", "v": "0:q5_0,1-3:q8_0"}).base == ("q8_0", "q8_0")
    assert parse({"k": "kvarn6", "v": "kvarn4", "k_first": "kvarn8,1"}).base == ("kvarn6", "kvarn4")


def test_a_uniform_allocation_is_the_first_last_form_without_edges():
    assert parse({"k": "q4_0", "v": "q8_0"}).uniform
    assert not parse({"k": "0-29:q4_0", "v": "q4_0"}).uniform  # a range string pins the layer count


# ---- every refusal's text ---------------------------------------------------------------------

ACCEPTED = ", ".join(facts.FACTS)
PARSE_REFUSALS = [
    ({"k": "0-1:q8_0,2_27:q4_0", "v": "q4_0"},
     "allocations.x.k: '2_27:q4_0' is not a range; write FIRST-LAST:TYPE or LAYER:TYPE items, comma-separated, "
     "e.g. 0-1:q8_0,2-27:q4_0,28-29:q8_0"),
    ({"k": "0-1:q8_0,5-2:q4_0", "v": "q4_0"},
     "allocations.x.k: '5-2:q4_0' runs backwards; write the lower layer first (2-5:q4_0)"),
    ({"k": "0-1:q8_0,2-27:q9_0", "v": "q4_0"},
     f"allocations.x.k: unknown KV cache type 'q9_0' for layers 2-27; accepted: {ACCEPTED}"),
    ({"k": "q4_0", "v": "q9_0"}, f"allocations.x.v: unknown KV cache type 'q9_0'; accepted: {ACCEPTED}"),
    ({"k": "0-1:q8_0,3-27:q4_0", "v": "q4_0"},
     "allocations.x.k: layer 2 is not named (between '0-1:q8_0' and '3-27:q4_0'); name every decoder layer "
     "from 0 once"),
    ({"k": "2-27:q4_0", "v": "q4_0"},
     "allocations.x.k: layers 0-1 are not named (the ranges start at '2-27:q4_0'); name every decoder layer "
     "from 0 once"),
    ({"k": "0-7:q4_0,5-9:q8_0", "v": "q4_0"},
     "allocations.x.k: layer 5 is named twice ('0-7:q4_0' and '5-9:q8_0'); name every decoder layer once"),
    ({"k": "q4_0", "v": "q4_0", "k_first": "q8_0;2"},
     "allocations.x.k_first: 'q8_0;2' is not TYPE,N as ik_llama.cpp's -ctk-first takes it, e.g. q8_0,2"),
    ({"k": "q4_0", "v": "q4_0", "v_last": "f16,-1"},
     "allocations.x.v_last: 'f16,-1' is not TYPE,N as ik_llama.cpp's -ctk-first takes it, e.g. q8_0,2"),
    ({"k": "q4_0", "v": "q4_0", "v_last": "q9_0,2"},
     f"allocations.x.v_last: unknown KV cache type 'q9_0'; accepted: {ACCEPTED}"),
    ({"k": "0-1:q8_0,2-5:q4_0", "v": "q4_0", "k_first": "q8_0,2"},
     "allocations.x.k_first: 'q8_0,2' needs one base type in k, which gives ranges ('0-1:q8_0,2-5:q4_0'); "
     "name those layers in the ranges instead"),
    ({"k": "", "v": "q4_0"},
     "allocations.x.k: ''; give one type for every layer (e.g. q4_0) or ranges (FIRST-LAST:TYPE or LAYER:TYPE "
     "items, comma-separated, e.g. 0-1:q8_0,2-27:q4_0,28-29:q8_0)"),
    ({"k": "0-1:kvarn4,2-5:kvarn6", "v": "q4_0"},
     "allocations.x: mixes families: kvarn4 (k, layers 0-1) is KVarN; q4_0 (v, every layer) is a standard type. "
     "The layers of one allocation take all standard types, all KVarN or all QuantizedCache types (each family "
     "has its own tail, sink and group rules)"),
    ({"k": "quanto4", "v": "quanto4", "v_first": "q8_0,1"},
     "allocations.x: mixes families: quanto4 (k, every layer) is a QuantizedCache type; q8_0 (v, the first 1) is a "
     "standard type. The layers of one allocation take all standard types, all KVarN or all QuantizedCache types "
     "(each family has its own tail, sink and group rules)"),
    ({"k": "q4_0"},
     "allocations.x: {'k': 'q4_0'}; give k and v (ranges or one type each) and any of k_first, k_last, v_first, "
     "v_last; accepted: k, v, k_first, k_last, v_first, v_last"),
    ({"k": "q4_0", "v": "q4_0", "k_frist": "q8_0,2"},
     "allocations.x: unknown field 'k_frist'; give k and v (ranges or one type each) and any of k_first, k_last, "
     "v_first, v_last; accepted: k, v, k_first, k_last, v_first, v_last"),
]


@pytest.mark.parametrize("raw, text", PARSE_REFUSALS)
def test_each_bad_definition_is_refused_naming_the_layer_or_value(raw, text):
    assert refusal(parse, raw) == text


def test_a_bad_name_is_refused():
    assert refusal(Allocation.parse, "ik-first2", IK) == (
        "allocations.ik-first2: allocation name 'ik-first2'; use 1 to 40 of a-z, 0-9 and '_' (a cell name's '-' "
        "separates its options)")


@pytest.mark.parametrize("raw, n, text", [
    (EDGES, 28, "allocations.x.k: layer 28 is past the model, which has 28 decoder layers (0-27); the ranges "
                "'0-1:q8_0,2-27:q4_0,28-29:q8_0' name layers 0-29"),
    (EDGES, 32, "allocations.x.k: layers 30-31 of the model's 32 decoder layers (0-31) are not named; the ranges "
                "'0-1:q8_0,2-27:q4_0,28-29:q8_0' end at layer 29"),
    (EDGES, 31, "allocations.x.k: layer 30 of the model's 31 decoder layers (0-30) is not named; the ranges "
                "'0-1:q8_0,2-27:q4_0,28-29:q8_0' end at layer 29"),
    ({"k": "q4_0", "v": "q4_0", "v_first": "q8_0,8"}, 6,
     "allocations.x.v_first: 8 layers: layer 6 is past the model, which has 6 decoder layers (0-5)"),
    (IK, 3, "allocations.x.k: layer 1 is named twice on the model's 3 decoder layers: by k_first (layers 0-1) and "
            "k_last (layers 1-2)"),
])
def test_a_layer_count_the_definition_does_not_fit_is_refused_naming_the_layer(raw, n, text):
    assert refusal(parse(raw).resolve, n) == text


def test_a_record_whose_token_is_not_its_definitions_is_refused():
    rec = {**parse(EDGES, "edges8").record(), "token": "edges8.00000000"}
    assert refusal(Allocation.from_record, rec, "summary.json: kv_alloc").startswith(
        "summary.json: kv_alloc: the definition's token is edges8.")


# ---- the cell: name, identity, options ---------------------------------------------------------

def test_the_cell_name_carries_the_token_and_reads_back_without_the_definition():
    a = parse(EDGES, "edges8")
    c = cell_spec("q4_0", "q4_0", 128, alloc=a.token, sink=64)
    assert c.name == f"q4_0-q4_0-t128-a{a.token}-s64" and isinstance(c, AllocCellSpec)
    assert CellSpec.from_name(c.name) == c and parse_opts(c.opts)["alloc"] == a.token
    # a process that never saw the definition reads the name all the same (tables, the answer)
    code = f"from kvarn.vocab.cell import CellSpec; print(CellSpec.from_name({c.name!r}).alloc)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == a.token


def test_a_plain_cell_keeps_its_fields_so_nothing_already_run_reruns():
    # the workflow's `cell` param is dataclasses.asdict of the cell: a plain cell's must not change
    assert list(dataclasses.asdict(CellSpec("q4_0", "q4_0", 128))) == [
        "k", "v", "tail", "rot", "tail_dtype", "iters", "sink", "compute"]
    assert CellSpec("q4_0", "q4_0", 128).alloc is None and "alloc" not in parse_opts("")
    assert dataclasses.asdict(cell_spec("q4_0", "q4_0", 0, alloc="x.0123abcd"))["alloc"] == "x.0123abcd"


@pytest.mark.parametrize("kw, field, text", [
    (dict(alloc="edges8"), "alloc",
     "alloc must be an allocation's token, its name and 8 hex digits of its definition (e.g. edges8.1a2b3c4d), "
     "got 'edges8'"),
    (dict(alloc="x.0123abcd", compute="llamacpp-cpu"), "compute",
     "allocation x.0123abcd with compute llamacpp-cpu: per-layer types are not emulated there (llama.cpp keeps one "
     "K and one V type); use compute exact, bf16-attn or tf32-attn"),
])
def test_a_bad_allocation_option_is_refused(kw, field, text):
    with pytest.raises(CellError) as e:
        cell_spec("q4_0", "q4_0", 0, **kw)
    assert (e.value.field, str(e.value)) == (field, text)


def test_a_cell_whose_types_are_not_its_allocations_main_types_is_refused():
    a = alc.define(parse(EDGES, "edges8"))
    with pytest.raises(CellError) as e:
        cell_spec("q8_0", "q4_0", 0, alloc=a.token)
    assert str(e.value) == (f"allocation {a.token} has main types q4_0/q4_0: its cells are named q4_0-q4_0-t..., "
                            "not q8_0-q4_0-t...")
    assert refusal(parse_opts, "-aedges8.1a2b3c4g-norot", exc=ValueError) == (
        "'-aedges8.1a2b3c4g-norot' is not a cell's options suffix; expected tokens of -a<allocation>.<digest> "
        "(e.g. -aedges8.1a2b3c4d), -norot, -td<dtype>, -i<n>, -s<n>, -llamacpp_cpu, -bf16_attn or -tf32_attn")


# ---- where a job finds the definition ----------------------------------------------------------

def test_published_definitions_reach_a_child_process_and_an_edit_is_a_new_file(tmp_path, monkeypatch):
    monkeypatch.setenv(alc.DIR_ENV, "")  # unset ("" is no directory) and restored after: publish sets it
    old, new = parse(EDGES, "pubtest"), parse({**EDGES, "k": "q4_0"}, "pubtest")
    d = kva.publish_allocations([old], tmp_path / "defs")
    assert os.environ[alc.DIR_ENV] == str(d) and (d / f"{old.token}.json").is_file()
    kva.publish_allocations([new], tmp_path / "defs")  # the edit: another file; the first stays as it was
    assert sorted(p.name for p in d.iterdir()) == sorted(f"{a.token}.json" for a in (old, new))
    code = ("import sys; from kvarn.vocab import allocation as a; "
            "print(a.lookup(sys.argv[1]).resolve(30)[0][:3], a.lookup(sys.argv[2]).resolve(30)[0][:3])")
    out = subprocess.run([sys.executable, "-c", code, old.token, new.token], capture_output=True, text=True,
                         cwd=tmp_path, check=True, env=os.environ.copy())
    assert out.stdout.strip() == "('q8_0', 'q8_0', 'q4_0') ('q4_0', 'q4_0', 'q4_0')"
    assert kva.publish_allocations([]) is None


def test_an_unknown_token_is_refused_naming_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv(alc.DIR_ENV, str(tmp_path))
    assert refusal(alc.lookup, "nowhere.0123abcd") == (
        f"allocation 'nowhere.0123abcd' is not defined here: this process has not defined it and "
        f"{tmp_path / 'nowhere.0123abcd.json'} does not exist (the workflow writes the config's allocations there "
        "when it plans; elsewhere define it first)")
    a = parse(EDGES, "swapped")
    (tmp_path / "swapped.0123abcd.json").write_text(json.dumps(a.record()))
    assert refusal(alc.lookup, "swapped.0123abcd") == (
        f"{tmp_path / 'swapped.0123abcd.json'}: holds allocation {a.token}, not swapped.0123abcd")


def test_layer_types_take_the_cells_own_allocation_only():
    a, b = parse(EDGES, "own"), parse(IK, "own")
    c = cell_spec("q4_0", "q4_0", 0, alloc=a.token)
    geom = Geometry.uniform(30, 2, 64)
    assert alc.layer_types(c, geom, a)[:3] == [("q8_0", "q8_0"), ("q8_0", "q8_0"), ("q4_0", "q4_0")]
    assert refusal(alc.layer_types, c, geom, b) == (
        f"cell q4_0-q4_0-t0-a{a.token}: given allocation {b.token}, not its own {a.token}")
    assert alc.layer_types(CellSpec("q8_0", "q5_0", 0), Geometry.uniform(2, 2, 64)) == [("q8_0", "q5_0")] * 2


# ---- the engines' spellings ---------------------------------------------------------------------

def test_export_gives_ik_llama_flags_range_strings_and_the_per_layer_list():
    out = alc.export(parse(IK), 6)
    assert out["per_layer"] == {"k": ["q8_0", "q8_0", "q4_0", "q4_0", "q8_0", "q8_0"],
                                "v": ["q8_0", "q8_0", "q4_0", "q4_0", "q8_0", "q8_0"]}
    assert out["ranges"] == {"k": "0-1:q8_0,2-3:q4_0,4-5:q8_0", "v": "0-1:q8_0,2-3:q4_0,4-5:q8_0"}
    assert out["ik_llama_cpp"] == ["-ctk", "q4_0", "-ctv", "q4_0", "-ctk-first", "q8_0,2", "-ctk-last", "q8_0,2",
                                   "-ctv-first", "q8_0,2", "-ctv-last", "q8_0,2"]
    # ranges that are a first run, a base and a last run are the first/last form
    assert alc.export(parse(EDGES), 30)["ik_llama_cpp"] == out["ik_llama_cpp"]
    two = alc.export(parse({"k": "0-5:q4_0,6:q8_0", "v": "0:f16,1-6:q4_0"}), 7)
    assert two["ik_llama_cpp"] == ["-ctk", "q4_0", "-ctv", "q4_0", "-ctk-last", "q8_0,1", "-ctv-first", "f16,1"]
    assert two["ranges"] == {"k": "0-5:q4_0,6:q8_0", "v": "0:f16,1-6:q4_0"}


def test_what_ik_llama_cannot_express_is_said_naming_the_layer():
    out = alc.export(parse({"k": "0:q8_0,1-2:q4_0,3:q8_0,4-5:q4_0", "v": "q4_0"}), 6)
    assert out["ik_llama_cpp"] is None and out["ranges"]["k"] == "0:q8_0,1-2:q4_0,3:q8_0,4-5:q4_0"
    assert out["ik_llama_cpp_refused"] == ("k: '0:q8_0,1-2:q4_0,3:q8_0,4-5:q4_0' is not a first run, a base and a "
                                           "last run: layer 3 (q8_0) starts another run; -ctk-first / -ctk-last "
                                           "cannot express it")
    assert refusal(alc.ik_llama_args, ["kvarn4"] * 3, ["kvarn4"] * 3, exc=ValueError) == (
        "k: kvarn4 is KVarN, not a llama.cpp cache type")


# ---- the matrix and the schema ------------------------------------------------------------------

BASE = {"models": [{"name": "m", "source": "embedded:smollm2-135m", "n_ctx": [512], "chunks": 1}],
        "allocations": {"edges8": EDGES, "ik_edges2": IK, "flat": {"k": "q4_0", "v": "q4_0", "k_first": "q4_0,3"}},
        "cells": [{"alloc": ["edges8", "ik_edges2", "flat"], "tail": [0, 128]}, {"types": ["q4_0"], "tail": 128}]}


def test_the_matrix_plans_allocation_cells_by_token_and_a_uniform_one_as_its_plain_cell():
    m = kvm.expand(copy.deepcopy(BASE))
    e, i = m.allocations["edges8"].token, m.allocations["ik_edges2"].token
    assert [c.name for c in m.cells] == [f"q4_0-q4_0-t0-a{e}", f"q4_0-q4_0-t128-a{e}", f"q4_0-q4_0-t0-a{i}",
                                         f"q4_0-q4_0-t128-a{i}", "q4_0-q4_0-t0", "q4_0-q4_0-t128"]
    c = m.cells[1]
    assert c.spec == CellSpec.from_name(c.name) and c.dir.endswith(f"/cells/q4_0-q4_0-t128-a{e}")
    cols = kvr.cell_columns(c.spec)
    assert (cols["alloc"], cols["cell"], cols["k_version"], cols["family"]) == (e, c.name, 1, "standard")
    assert kva.allocation_versions(c.spec) == {"alloc": {"q8_0": 1, "q4_0": 1}}
    assert kva.allocation_versions(CellSpec("q4_0", "q4_0", 0)) == {}
    kv = copy.deepcopy(BASE)
    kv["allocations"]["kv"] = {"k": "kvarn4", "v": "kvarn4", "k_first": "kvarn6,1"}
    kv["cells"] = [{"alloc": "kv", "tail": 0, "models": ["m"]}]
    (cell,) = kvm.expand(kv).cells
    assert cell.name == f"kvarn4-kvarn4-t0-a{kvm.expand(kv).allocations['kv'].token}"


@pytest.mark.parametrize("change, text", [
    (lambda c: c["cells"].append({"alloc": ["edges9"]}),
     "cells[2].alloc[0]: unknown allocation 'edges9'; defined: edges8, ik_edges2, flat"),
    (lambda c: c.update(allocations={}, cells=[{"alloc": ["edges8"]}]),
     "cells[0].alloc[0]: unknown allocation 'edges8'; defined: none (name them under allocations:)"),
    (lambda c: c["cells"].append({"alloc": ["edges8"], "types": ["q4_0"]}),
     "cells[2]: give exactly one of 'types' (K = V), 'k' and 'v' (their product), 'pairs' ('K/V') or 'alloc' "
     "(named allocations)"),
    (lambda c: c["allocations"].update(bad={"k": "0-1:q8_0,3-29:q4_0", "v": "q4_0"}),
     "allocations.bad.k: layer 2 is not named (between '0-1:q8_0' and '3-29:q4_0'); name every decoder layer from "
     "0 once"),
    (lambda c: c["cells"].append({"alloc": ["edges8"], "compute": "llamacpp-cpu"}),
     "cells[2].compute: allocation edges8."),
    (lambda c: c["models"][0].update(engine="llama.cpp", source="hf:o/r/m.gguf"),
     "cells[0].alloc: allocation edges8."),
    (lambda c: c.update(allocations=["edges8"]),
     "allocations: ['edges8']; give a mapping of names to {k, v, k_first, k_last, v_first, v_last}"),
])
def test_the_matrix_refuses_before_any_job_naming_the_field(change, text):
    cfg = copy.deepcopy(BASE)
    change(cfg)
    with pytest.raises(kvm.MatrixError) as e:
        kvm.expand(cfg)
    assert str(e.value).startswith(text), str(e.value)
    if "engine llama.cpp" in str(e.value) or text.startswith("cells[0].alloc: "):
        assert str(e.value).endswith("which runs engine llama.cpp: the program takes one K and one V type; per-layer "
                                     "types run on the torch engine")


def test_the_schema_takes_allocations_and_names_a_bad_field():
    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    assert config_errors(copy.deepcopy(BASE), schema) == []
    bad = copy.deepcopy(BASE)
    bad["allocations"]["edges8"]["k_frist"] = "q8_0,2"
    bad["cells"][0]["alloc"] = 3
    assert config_errors(bad, schema) == [
        "allocations.edges8: unknown field 'k_frist'; accepted: k, v, k_first, k_last, v_first, v_last",
        "cells[0].alloc: 3 is not accepted; accepted: a string, or a non-empty list of strings",
    ]


# ---- memory: the exact per-layer sum -----------------------------------------------------------

def _real_layer_bytes(layer, n_ctx, k_type, v_type, ubatch):
    """One layer's body: the sizes of actually encoded K and V buffers (as tests/test_memory.py)."""
    import torch

    from kvarn.formats import get_format

    stored = n_ctx if layer.window is None else min(n_ctx, layer.window + ubatch)
    total = 0
    for role, name in (("k", k_type), ("v", v_type)):
        fmt = get_format(name, role=role)
        n = stored - stored % fmt.group
        if n:
            x = torch.randn(layer.n_kv_heads, n, layer.head_dim, generator=torch.Generator().manual_seed(n))
            total += fmt.encode(x).data.numel()
    return total


# full, sliding (W 200), a recurrent layer without a KV cache, a wider full layer
GEOM = Geometry((LayerGeometry("full_attention", 2, 64), LayerGeometry("sliding_attention", 2, 64, 200),
                 LayerGeometry("linear_attention"), LayerGeometry("full_attention", 1, 128)))


@pytest.mark.parametrize("raw", [
    {"k": "0:q8_0,1:q4_0,2:q2_0,3:f16", "v": "0:q5_1,1:q4_0,2:q2_0,3:q8_0"},
    {"k": "kvarn4", "v": "kvarn3", "k_first": "kvarn8,1", "v_last": "kvarn6,1"},
    {"k": "0-1:quanto4,2-3:hqq2", "v": "kivi2"},
])
def test_body_is_the_sum_of_each_layers_real_buffers(raw, one_thread):
    a = parse(raw)
    c = cell_spec(*a.base, 0, alloc=a.token)
    ks, vs = a.resolve(GEOM.n_layers)
    got = kv_bytes(GEOM, 300, c, ubatch=64, alloc=a)
    want = sum(_real_layer_bytes(layer, 300, k, v, 64) for layer, k, v in zip(GEOM.layers, ks, vs) if layer.has_kv)
    assert got.body == want and got.staging == 0
    # the exact rows are the family's on every layer: the overlay is the plain cell's
    assert got.overlay == kv_bytes(GEOM, 300, CellSpec(*a.base, 0), ubatch=64).overlay


def test_one_layers_bytes_by_hand():
    # layer 0 q8_0 / q5_1, the rest q4_0: 300 tokens x 2 heads x 64/32 blocks x (34 + 24 vs 18 + 18) bytes
    geom = Geometry.uniform(3, 2, 64)
    a = parse({"k": "0:q8_0,1-2:q4_0", "v": "0:q5_1,1-2:q4_0"})
    got = kv_bytes(geom, 300, cell_spec("q4_0", "q4_0", 128, alloc=a.token), alloc=a)
    plain = kv_bytes(geom, 300, CellSpec("q4_0", "q4_0", 128))
    assert got.body - plain.body == 300 * 2 * 2 * ((34 + 24) - (18 + 18)) and got.overlay == plain.overlay


@pytest.mark.parametrize("accounting", list(ACCOUNTINGS))
@pytest.mark.parametrize("pair, raw", [(("q4_0", "q8_0"), {"k": "0-3:q4_0", "v": "q8_0"}),
                                       (("kvarn4", "kvarn4"), {"k": "kvarn4", "v": "0-3:kvarn4"})])
def test_a_uniform_allocations_bytes_are_its_plain_cells(accounting, pair, raw):
    a = parse(raw)
    for tail in (0, 128, 300):
        plain = CellSpec(*pair, tail)
        assert kv_bytes(GEOM, 500, cell_spec(*pair, tail, alloc=a.token), 64, accounting, a) == \
            kv_bytes(GEOM, 500, plain, 64, accounting)


def test_the_summary_records_the_allocation_and_is_recomputed_from_it_alone():
    a = parse({"k": "0:q8_0,1-3:q4_0", "v": "q4_0", "v_last": "q8_0,1"}, "summ_only")
    c = cell_spec("q4_0", "q4_0", 128, alloc=a.token)
    fields = summary_fields(GEOM, 500, c, 64, alloc=a)
    assert fields["kv_alloc"] == a.record()
    assert fields["kv_alloc_k"] == ["q8_0", "q4_0", "q4_0", "q4_0"]
    assert fields["kv_alloc_v"] == ["q4_0", "q4_0", "q4_0", "q8_0"]
    assert fields["kv_total_bytes_tail0"] == kv_bytes(GEOM, 500, cell_spec("q4_0", "q4_0", 0, alloc=a.token), 64,
                                                      alloc=a).total
    summary = {"k_type": "q4_0", "v_type": "q4_0", "tail": 128, "n_ctx": 500, "ubatch": 64, **fields}
    # this process never defined the allocation: the summary alone suffices
    assert alc.known(a.token) is None
    again = resummarize(summary, "beellama-gemma")
    assert again["kv_total_bytes"] == kv_bytes(GEOM, 500, c, 64, "beellama-gemma", a).total
    row = kvr.summary_row(summary, {"cell": c.name, "alloc": a.token})
    assert (row["alloc_k"], row["alloc_v"]) == ("0:q8_0,1-3:q4_0", "0-2:q4_0,3:q8_0")
    assert not {"kv_alloc", "kv_alloc_k", "kv_alloc_v"} & set(row) and row["bits_per_value"] > 0
