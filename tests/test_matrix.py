"""kvarn.plan.matrix: the config -> cells expansion and the checks a JSON schema cannot make."""

import copy
import re
from pathlib import Path

import pytest
import yaml

from kvarn.vocab import facts
from kvarn.plan import matrix as kvm
from kvarn.plan import paths as kvp
from kvarn.plan import rows as kvr
from kvarn.weights.sources import unpinned

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "models": [{"name": "smollm2-135m", "source": "embedded:smollm2-135m", "n_ctx": [512], "chunks": 2}],
    "cells": [
        {"types": ["q8_0", "q4_0"], "tail": [0, 128]},
        {"types": ["kvarn4"], "tail": 0},
        {"k": ["q8_0", "q4_0"], "v": ["q8_0", "q4_0"], "tail": 128},
    ],
}


def with_(path, value):
    """BASE with the field at `path` (a tuple of keys/indices) set to `value`."""
    cfg = copy.deepcopy(BASE)
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return cfg


def test_expand_dedupes_and_encodes_the_cell_in_its_path():
    m = kvm.expand(BASE)
    names = [c.name for c in m.cells]
    # 2 types x 2 tails + kvarn4 + the 2x2 product at 128 minus its 2 diagonal cells already listed
    assert len(names) == len(set(names)) == 4 + 1 + 2
    assert "q8_0-q4_0-t128" in names and "kvarn4-kvarn4-t0" in names
    assert m.cells[0].dir == "results/smollm2-135m/ctx512-c2/cells/q8_0-q8_0-t0"
    assert m.runs() == [("smollm2-135m", 512, 2)]


def test_options_roundtrip_through_the_path_and_normalize():
    cfg = copy.deepcopy(BASE)
    cfg["cells"] = [
        {"types": ["q4_0"], "tail": 0, "rot": False, "tail_dtype": "f16"},
        {"types": ["q4_0"], "tail": 0, "tail_dtype": "bf16", "iters": 8},  # = the default cell
        {"types": ["kvarn4"], "tail": 0, "rot": False, "iters": 8},  # KVarN always rotates
    ]
    cells = kvm.expand(cfg).cells
    assert [c.name for c in cells] == ["q4_0-q4_0-t0-norot-tdf16", "q4_0-q4_0-t0", "kvarn4-kvarn4-t0-i8"]
    for c in cells:
        assert kvm.parse_opts(c.opts) == {"rot": c.rot, "tail_dtype": c.tail_dtype, "iters": c.iters, "sink": c.sink,
                                          "compute": c.compute}


def test_tail_label_and_family():
    assert facts.tail_label("kvarn4", "kvarn4", 0) == "128*"
    assert facts.tail_label("kvarn4", "kvarn4", 128) == "128"
    assert facts.tail_label("q4_0", "q4_0", 0) == "0"
    assert facts.pair_family("q8_0", "q4_0") == "standard" and facts.pair_family("kvarn6", "kvarn5") == "kvarn"


def test_a_tail_the_format_rounds_names_the_job_it_runs():
    # KVarN rounds a tail up to whole 128-token groups: 500 runs at 512, so it is the 512 job (one
    # path for both requests); 100 runs at 128. A tail of 0 keeps its path (t0, printed 128*), and
    # a standard type's tail is never rounded.
    cfg = copy.deepcopy(BASE)
    cfg["models"][0]["n_ctx"] = [1024]
    cfg["cells"] = [{"types": ["kvarn4"], "tail": [0, 100, 500, 512]}, {"types": ["q4_0"], "tail": [0, 100, 500]}]
    names = [c.name for c in kvm.expand(cfg).cells]
    assert names == ["kvarn4-kvarn4-t0", "kvarn4-kvarn4-t128", "kvarn4-kvarn4-t512",
                     "q4_0-q4_0-t0", "q4_0-q4_0-t100", "q4_0-q4_0-t500"]
    assert facts.job_tail("kvarn4", "kvarn4", 500) == 512 and facts.job_tail("kvarn4", "kvarn4", 0) == 0


def test_summary_row_adds_the_table_columns():
    columns = kvr.cell_columns(kvm.CellSpec("kvarn4", "kvarn4", 0))
    row = kvr.summary_row({"kv_total_bytes": 1000, "kv_total_bytes_tail0": 900, "kld_median": 0.1}, columns)
    assert row["family"] == "kvarn" and row["tail_label"] == "128*" and row["tail_requested"] == 0
    assert row["kv_delta_bytes_vs_tail0"] == 100 and row["cell"] == "kvarn4-kvarn4-t0"
    assert isinstance(row["k_version"], int) and row["kld_median"] == 0.1


def test_memory_accounting_is_per_model_and_not_in_the_cell_path():
    m = kvm.expand(with_(("models", 0, "memory_accounting"), "beellama-qwen"))
    assert m.models["smollm2-135m"].memory_accounting == "beellama-qwen"
    assert kvm.expand(BASE).models["smollm2-135m"].memory_accounting == "packed"  # the default
    assert [c.dir for c in m.cells] == [c.dir for c in kvm.expand(BASE).cells]  # no cell moves
    schema = yaml.safe_load((ROOT / "workflow" / "schemas" / "config.schema.yaml").read_text())
    prop = schema["properties"]["models"]["items"]["properties"]["memory_accounting"]
    assert prop["enum"] == list(kvm.ACCOUNTINGS) and prop["default"] == "packed"


def test_summary_row_recomputes_memory_under_the_models_accounting():
    from kvarn.vocab.geometry import Geometry
    from kvarn.budget.memory import MIB, summary_fields

    geom = Geometry.uniform(16, 4, 256)  # Qwen 3.6 27B's attention layers
    summary = {"n_ctx": 65536, "k_type": "kvarn4", "v_type": "kvarn4", "tail": 0, "tail_dtype": "f16",
               "rot": True, "ubatch": 512, "kld_median": 0.1,
               **summary_fields(geom, 65536, kvm.CellSpec("kvarn4", "kvarn4", 0))}  # as run_cell writes it (packed)
    row = kvr.summary_row(summary, kvr.cell_columns(kvm.CellSpec("kvarn4", "kvarn4", 0), "beellama-qwen"))
    assert row["memory_accounting"] == "beellama-qwen" and row["kv_total_bytes"] == 1184 * MIB
    assert row["kv_staging_bytes"] == 16 * MIB and row["kv_delta_bytes_vs_tail0"] == 0
    assert "kv_geometry" not in row  # per-layer lists stay in summary.json
    row = kvr.summary_row(summary, kvr.cell_columns(kvm.CellSpec("kvarn4", "kvarn4", 0)))
    assert row["memory_accounting"] == "packed" and row["kv_total_bytes"] == 1136 * MIB


# (bad config, the field the message must name, a word the message must contain)
BAD = {
    "unknown type": (with_(("cells", 0, "types"), ["q8_0", "q9_9"]), "cells[0].types[1]", "q9_9"),
    "kvarn9": (with_(("cells", 1, "types"), ["kvarn9"]), "cells[1].types[0]", "kvarn9"),
    "negative tail": (with_(("cells", 0, "tail"), [0, -1]), "cells[0].tail", "-1"),
    "tail >= n_ctx": (with_(("cells", 0, "tail"), 512), "cells[0].tail", "n_ctx 512"),
    "odd n_ctx": (with_(("models", 0, "n_ctx"), [511]), "models[0].n_ctx", "511"),
    "duplicate model": (with_(("models",), BASE["models"] * 2), "models[1].name", "duplicate"),
    "missing source": (with_(("models", 0), {"name": "x", "n_ctx": [512]}), "models[0].source", "source"),
    "kvarn mixed": (with_(("cells", 0), {"pairs": ["kvarn4/q4_0"]}), "cells[0].pairs[0]", "mix"),
    "two pair kinds": (with_(("cells", 0, "pairs"), ["q8_0/q8_0"]), "cells[0]", "exactly one"),
    "unknown model": (with_(("cells", 0, "models"), ["nope"]), "cells[0].models", "nope"),
    "unknown accounting": (with_(("models", 0, "memory_accounting"), "beellama"), "models[0].memory_accounting",
                           "packed, beellama-qwen, beellama-gemma"),
    "chunks word": (with_(("models", 0, "chunks"), "most"), "models[0].chunks", '"all"'),
    "chunks zero": (with_(("models", 0, "chunks"), 0), "models[0].chunks", "0"),
    "allow_unpinned": ({**BASE, "allow_unpinned": "yes"}, "allow_unpinned", "true or false"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_config_is_rejected_naming_the_field(name):
    cfg, field, word = BAD[name]
    with pytest.raises(kvm.MatrixError) as e:
        kvm.expand(cfg)
    assert str(e.value).startswith(field) and word in str(e.value)


@pytest.mark.parametrize("name", ["matrix.yaml", "matrix-512.yaml", "article.yaml"])
def test_shipped_configs_expand(name):
    cfg = yaml.safe_load((ROOT / "config" / name).read_text())
    m = kvm.expand(cfg)
    fams = {facts.pair_family(c.k, c.v) for c in m.cells}
    assert fams == {"standard", "kvarn"}
    if name == "article.yaml":  # 48 standard pairs x tails 0, 128 + 15 KVarN pairs + the sweep
        per_model = [sum(c.model == mm for c in m.cells) for mm in m.models]  # (12 types x 512, 1024)
        assert per_model == [48 * 2 + 15 + 12 * 2] * 2
    if name.startswith("matrix"):  # the default runs: the format-only rows and the tail sweep
        names = {c.name for c in m.cells}
        assert "q4_0-q4_0-t128-tdf16-s128" in names and "kvarn4-kvarn4-t256" in names
        n_ctx = m.cells[0].n_ctx
        sweep = {c.tail for c in m.cells if c.k == "q4_0" and c.v == "q4_0" and not c.opts}
        assert sweep == {t for t in (0, 128, 256, 512, 1024) if t <= n_ctx // 2}
    if name == "matrix.yaml":  # the honest default: a context where the exact tokens are a small share
        assert {c.n_ctx for c in m.cells} == {2048} and len(m.models) == 2


def test_sink_option_paths():
    # A sink is part of the cell path only when it differs from the pair's own, so every
    # existing path stays; the format-only row is q4_0 at tail 128 with sink 128 and f16.
    cfg = {"models": BASE["models"], "cells": [
        {"types": ["q4_0"], "tail": 128, "sink": 128, "tail_dtype": "f16"},
        {"types": ["q4_0"], "tail": 128, "sink": 0},        # the standard default: no suffix
        {"types": ["kvarn4"], "tail": 0, "sink": 128},      # KVarN's own: no suffix
    ]}
    names = [c.name for c in kvm.expand(cfg).cells]
    assert names == ["q4_0-q4_0-t128-tdf16-s128", "q4_0-q4_0-t128", "kvarn4-kvarn4-t0"]
    assert kvm.parse_opts("-tdf16-s128") == {**kvm.CELL_DEFAULTS, "tail_dtype": "f16", "sink": 128}
    import re

    assert re.fullmatch(kvp.OPTS_PATTERN, "-norot-tdf16-i8-s64")


@pytest.mark.parametrize("sink,needle", [(64, "KVarN's sink is fixed at 128"), (-1, "must be an integer >= 0"),
                                         ("x", "must be an integer >= 0")])
def test_bad_sink_is_rejected(sink, needle):
    cfg = {"models": BASE["models"], "cells": [{"types": ["q4_0"], "tail": 0}, {"types": ["kvarn4"], "tail": 0,
                                                                              "sink": sink}]}
    with pytest.raises(kvm.MatrixError, match=r"^cells\[1\]\.sink") as e:
        kvm.expand(cfg)
    assert needle in str(e.value)


def test_chunks_all_is_a_stable_path():
    m = kvm.expand(with_(("models", 0, "chunks"), "all"))
    assert m.cells[0].dir == "results/smollm2-135m/ctx512-call/cells/q8_0-q8_0-t0"
    assert m.runs() == [("smollm2-135m", 512, "all")]
    assert kvp.chunks_arg("all") is None and kvp.chunks_arg("3") == 3
    # a count keeps the path it always had
    assert kvm.expand(BASE).cells[0].dir == "results/smollm2-135m/ctx512-c2/cells/q8_0-q8_0-t0"


@pytest.mark.parametrize("source,revision,pinned", [
    ("embedded:smollm2-135m", None, True),
    ("random:config/models/qwen3.6-27b.json", None, True),
    ("hf:Qwen/Qwen3.6-27B", None, False),
    ("hf:Qwen/Qwen3.6-27B", "main", False),
    ("hf:Qwen/Qwen3.6-27B", "0123456789abcdef0123456789abcdef01234567", True),
    ("hf:Qwen/Qwen3.6-27B@0123456789abcdef0123456789abcdef01234567", None, True),
    ("hf:org/repo-GGUF/m-Q5_K_S.gguf", None, False),
    ("hf:org/repo-GGUF/m-Q5_K_S.gguf", "sha256:" + "ab" * 32, True),
    ("models/local.gguf", None, False),
])
def test_unpinned_sources_refused_unless_allowed(source, revision, pinned):
    m = kvm.expand(with_(("models", 0), {**BASE["models"][0], "source": source, "revision": revision})).models
    assert (unpinned(m["smollm2-135m"].source, m["smollm2-135m"].revision) is None) == pinned
    if pinned:
        assert kvm.check_pinned(m, False) == []
        return
    with pytest.raises(kvm.MatrixError, match=r"smollm2-135m: .*allow_unpinned=true"):
        kvm.check_pinned(m, False)
    assert kvm.check_pinned(m, True) == []
    assert kvm.check_pinned(m, False, plan_only=True)  # planning proceeds, with a note


def test_compute_path_is_part_of_the_cell_and_its_baseline():
    cfg = copy.deepcopy(BASE)
    cfg["cells"] = [{"types": ["q4_0"], "tail": 0}, {"types": ["q4_0"], "tail": 0, "compute": "llamacpp-cpu"}]
    m = kvm.expand(cfg)
    assert [c.name for c in m.cells] == ["q4_0-q4_0-t0", "q4_0-q4_0-t0-llamacpp_cpu"]  # default path unchanged
    assert [c.baseline for c in m.cells] == ["results/smollm2-135m/ctx512-c2/baseline.kvd",
                                             "results/smollm2-135m/ctx512-c2/baseline-llamacpp_cpu.kvd"]
    assert m.baselines() == [c.baseline for c in m.cells] and len(m.runs()) == 1
    assert kvm.parse_opts(m.cells[1].opts)["compute"] == "llamacpp-cpu"
    assert re.fullmatch(kvp.OPTS_PATTERN, "-norot-llamacpp_cpu")


@pytest.mark.parametrize("entry,needle", [
    ({"types": ["quanto4"], "tail": 128, "compute": "llamacpp-cpu"}, "not a llama.cpp or BeeLlama cache type"),
    ({"types": ["q4_0"], "tail": 0, "sink": 4, "compute": "llamacpp-cpu"}, "sink 4 not accepted"),
    ({"types": ["kivi2"], "tail": 0, "compute": "llamacpp-cpu"}, "K type 'kivi2' is not a llama.cpp or BeeLlama cache type"),
    ({"types": ["q4_0"], "tail": 0, "compute": "fast"}, "cells[0].compute: compute 'fast' not accepted"),
])
def test_compute_refusals(entry, needle):
    cfg = copy.deepcopy(BASE)
    cfg["cells"] = [entry]
    with pytest.raises(kvm.MatrixError, match=re.escape(needle)):
        kvm.expand(cfg)


def test_attention_option_is_in_no_cell_path():
    # The attention path moves results only by fp32 noise: it names no cell or baseline.
    paths = {}
    for value in (None, "ref", "flex", "auto"):
        cfg = copy.deepcopy(BASE)
        if value is not None:
            cfg["attention"] = value
        m = kvm.expand(cfg)
        assert m.attention == (value or "auto")
        paths[value] = ([c.dir for c in m.cells], m.baselines())
    assert len({repr(p) for p in paths.values()}) == 1
    cfg = copy.deepcopy(BASE)
    cfg["attention"] = "fast"
    with pytest.raises(kvm.MatrixError, match=re.escape("attention: 'fast' is not an attention path; accepted: "
                                                        "ref, flex, auto")):
        kvm.expand(cfg)
