"""The per-layer study (kvarn.perlayer): the plan's refusals, the knapsack against enumeration and a
hand-worked optimum, the searched allocation's bytes against the budget, the first/last candidates,
the sensitivity probe against the baseline and an allocation cell, and the search never reading the
test text."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import kvarn.kvcache.attention as kattn
from kvarn.baseline import data
from kvarn.budget import memory
from kvarn.kvcache.cache import KVarnCache, probe_cache
from kvarn.perlayer import plan, search
from kvarn.perlayer.search import Choice, knapsack, knapsack_ref
from kvarn.vocab.allocation import Allocation, define
from kvarn.vocab.cell import CellSpec, cell_spec
from kvarn.vocab.geometry import geometry_from_config
import test_cache
from paths import VALID_TEXT, WIKI_TEXT


# --------------------------------------------------------------------------------------------- the plan

def test_the_default_plan():
    p = plan.expand({"perlayer": {}})
    assert p.types == {"standard": ("q8_0", "q4_0", "q2_0"), "kvarn": ("kvarn8", "kvarn4", "kvarn3", "kvarn2")}
    assert p.budgets == ("q4_0", "kvarn4", "kvarn3", "kvarn2") and (p.n_ctx, p.chunks, p.tail) == (512, 1, 128)
    assert p.tail_of("q4_0") == 128 and p.tail_of("kvarn3") == 0  # KVarN at its 128*
    assert len(p.uniform_pairs()) == 9 + 16 and ("q8_0", "q2_0", 128) in p.uniform_pairs()
    assert plan.expand({}) is None
    assert p.sensitivity_files("m")[:2] == ["results/perlayer/m/sensitivity/q8_0.parquet",
                                            "results/perlayer/m/sensitivity/q4_0.parquet"]


@pytest.mark.parametrize("raw, message", [
    ({"budgets": ["q5_0"]}, "perlayer.budgets: q5_0 is not among perlayer.types.standard (q8_0, q4_0, q2_0); a budget "
                            "is the bytes of one of the searched types' uniform cells"),
    ({"types": {"standard": ["q8_0", "kvarn4"]}}, "perlayer.types.standard: ['q8_0', 'kvarn4']; give at least two "
                                                  "distinct standard types (kvarn4 is not)"),
    ({"types": {"kvarn": ["kvarn4"]}}, "perlayer.types.kvarn: ['kvarn4']; give at least two distinct kvarn types"),
    ({"types": {"standard": ["q8_0", "q9_0"]}}, "perlayer.types.standard: unknown type 'q9_0'; accepted: q8_0, q6_0,"),
    ({"types": {"standard": ["q8_0", "kvarn4", "kvarn2"]}}, "(kvarn4, kvarn2 are not)"),
    ({"types": ["q8_0"]}, "perlayer.types: expected a mapping of standard and kvarn to type lists, got ['q8_0']"),
    ({"types": {"standard": ["q8_0", "bf16"]}}, "perlayer.types.standard: bf16 is a float type"),
    ({"edge": {"standard": "q5_0"}}, "perlayer.edge.standard: q5_0 is not among perlayer.types.standard"),
    ({"n_ctx": 511}, "perlayer.n_ctx: 511 must be even"),
    ({"n_ctx": 2}, "perlayer.n_ctx: 2 is not an integer >= 4"),
    ({"chunks": 0}, "perlayer.chunks: 0 is not an integer >= 1"),
    ({"budget": ["q4_0"]}, "perlayer: unknown key(s) budget; accepted: text, n_ctx"),
])
def test_a_bad_plan_is_refused_naming_the_value(raw, message):
    with pytest.raises(plan.PerLayerError) as e:
        plan.expand({"perlayer": raw})
    assert message in str(e.value)


def test_the_uniform_cells_join_the_matrix_on_torch_models_only():
    p = plan.expand({"perlayer": {}})
    cfg = {"cells": [{"types": ["q4_0"], "tail": 128}]}
    out = plan.with_uniform_cells(cfg, p, ["a"])
    assert out["cells"][0] == cfg["cells"][0] and cfg["cells"] == [{"types": ["q4_0"], "tail": 128}]  # not edited
    assert out["cells"][1:] == [{"k": ["q8_0", "q4_0", "q2_0"], "v": ["q8_0", "q4_0", "q2_0"], "tail": 128, "models": ["a"]},
                                {"k": list(p.types["kvarn"]), "v": list(p.types["kvarn"]), "tail": 0, "models": ["a"]}]
    assert plan.with_uniform_cells(cfg, None, ["a"]) is cfg and plan.with_uniform_cells(cfg, p, []) is cfg


# --------------------------------------------------------------------------------------------- the knapsack

def test_the_knapsack_on_a_hand_worked_case():
    # Two groups, budget 10: (a 4, 1.0) + (c 6, 0.5) = 1.5 fits; (b 8, 0.1) + anything costs >= 10 + 2:
    # b + d = 8 + 2 = 10 fits at 0.1 + 2.0 = 2.1; a + c = 1.5 is the optimum.
    groups = [[Choice("a", 4, 1.0), Choice("b", 8, 0.1)], [Choice("c", 6, 0.5), Choice("d", 2, 2.0)]]
    assert knapsack(groups, 10) == ([0, 0], 1.5, 10)
    assert knapsack(groups, 9) == ([0, 1], 3.0, 6)  # a + d: the only fit
    # a tie in value goes to the cheaper pick
    tie = [[Choice("x", 4, 1.0), Choice("y", 2, 1.0)]]
    assert knapsack(tie, 10) == ([1], 1.0, 2)
    with pytest.raises(ValueError, match=r"budget 5 bytes is below the cheapest choice of every layer \(6 bytes\)"):
        knapsack(groups, 5)


def test_the_knapsack_equals_enumeration():
    rng = random.Random(0)
    for _ in range(400):
        groups = [[Choice(f"t{j}", rng.choice([2, 4, 6, 10, 18, 34]), rng.random()) for j in range(rng.randint(1, 4))]
                  for _ in range(rng.randint(1, 5))]
        budget = rng.randint(0, 80)
        try:
            ref = knapsack_ref(groups, budget)
        except ValueError:
            with pytest.raises(ValueError):
                knapsack(groups, budget)
            continue
        got = knapsack(groups, budget)
        assert got[1] == pytest.approx(ref[1], abs=1e-12) and got[2] == ref[2], (groups, budget)


def test_the_cost_unit_is_the_costs_common_divisor(monkeypatch):
    # costs in thousands of bytes: 4 units of 1000 fit 50 states exactly; counted in bytes (4000 states) they
    # would be rounded up to 80-byte units, 13 + 38 > 50 of them, and the pick would no longer fit
    monkeypatch.setattr(search, "MAX_UNITS", 50)
    groups = [[Choice("a", 1000, 1.0), Choice("b", 2000, 0.0)], [Choice("c", 3000, 0.0)]]
    assert knapsack(groups, 4000) == ([0, 0], 1.0, 4000)
    with pytest.raises(ValueError, match="no combination fits the budget"):
        knapsack_ref(groups, 3999)


def test_coarse_units_never_pass_the_budget(monkeypatch):
    monkeypatch.setattr(search, "MAX_UNITS", 7)  # force the rounded-up costs
    rng = random.Random(1)
    for _ in range(200):
        groups = [[Choice("t", rng.randint(1, 50), rng.random()) for _ in range(3)] for _ in range(4)]
        budget = rng.randint(100, 200)
        try:
            picks, value, cost = knapsack(groups, budget)
        except ValueError as e:  # the rounded-up costs may not fit where the exact ones do: said, never passed
            assert "no choice fits once costs are rounded up" in str(e)
            continue
        assert cost <= budget and cost == sum(groups[i][c].cost for i, c in enumerate(picks))


# --------------------------------------------------------------------------------------------- the search

@pytest.fixture(scope="module")
def llama():
    return test_cache._llama(n_layers=4, max_positions=1024)


def test_the_searched_allocation_spends_the_bits_where_the_probes_say(llama):
    geom = geometry_from_config(llama.config)
    n_ctx, tail, types = 1024, 128, ("q8_0", "q4_0", "q2_0")
    # Layer 2's K is sensitive, the others barely: at q4_0's bytes the knapsack gives layer 2's K q8_0 and
    # pays for it with q2_0 elsewhere, exactly as many q2_0 roles as the bytes require.
    sens = {(i, r, t): {"q8_0": 1e-6, "q4_0": 1e-5, "q2_0": 1e-4}[t] * (1000 if (i, r) == (2, "k") else 1)
            for i in range(4) for r in "kv" for t in types}
    budget = search.budget_bytes(geom, n_ctx, "q4_0", tail, 512, "packed")
    got = search.searched(geom, n_ctx, sens, types, tail, budget, "t1")
    ks, vs = got["allocation"].resolve(4)
    assert ks[2] == "q8_0" and got["bytes"] <= budget
    # q8_0 costs 34 B per 32 values, q4_0 18, q2_0 10: one q8_0 role (+16) is paid by two q2_0 roles (-8 each)
    assert sorted(ks + vs).count("q2_0") == 2 and sorted(ks + vs).count("q8_0") == 1
    cell = search.cell_of(got["allocation"], tail)
    assert memory.kv_bytes(geom, n_ctx, cell, alloc=got["allocation"]).total == got["bytes"] == budget
    assert got["predicted"] == pytest.approx(sum(sens[i, r, t] for i, (k, v) in enumerate(zip(ks, vs))
                                                 for r, t in (("k", k), ("v", v))))


def test_a_role_of_one_type_is_one_type_and_the_other_its_ranges():
    a = search.allocation("x", ["q4_0"] * 3, ["q8_0", "q4_0", "q4_0"])
    assert a.definition() == {"k": "0-2:q4_0", "v": "0:q8_0,1-2:q4_0"} and not a.uniform
    assert search.allocation("y", ["q4_0"] * 3, ["q8_0"] * 3).definition() == {"k": "q4_0", "v": "q8_0"}


def test_a_hybrid_models_recurrent_layers_take_the_roles_most_chosen_type():
    """Qwen 3.6's geometry (three Gated DeltaNet layers, then one full-attention layer): only the 16 attention
    layers are searched; the 48 others store nothing and take each role's most chosen type."""
    from transformers import AutoConfig

    from paths import REPO

    raw = json.loads((REPO / "config" / "models" / "qwen3.6-27b.json").read_text())
    geom = geometry_from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
    kv = list(geom.kv_layers)
    assert len(kv) == 16 and geom.n_layers == 64
    for types, tail in ((("q8_0", "q4_0", "q2_0"), 128), (("kvarn8", "kvarn4", "kvarn2"), 0)):
        sens = {(i, r, t): dict(zip(types, (1e-6, 1e-5, 1e-4)))[t] * (1000 if i == kv[0] else 1)
                for i in kv for r in "kv" for t in types}
        for acc in ("packed", "beellama-qwen"):  # KVarN's staging and tail arena: the accountings part there
            budget = search.budget_bytes(geom, 4096, types[1], tail, 512, acc)
            got = search.searched(geom, 4096, sens, types, tail, budget, "h", accounting=acc)
            ks, vs = got["allocation"].resolve(64)
            assert (ks[kv[0]], vs[kv[0]]) == (types[0], types[0])
            for role in (ks, vs):
                mine = [role[i] for i in kv]
                assert all(role[i] == max(set(mine), key=mine.count) for i in range(64) if i not in kv)
            cell = search.cell_of(got["allocation"], tail)
            assert got["bytes"] == memory.kv_bytes(geom, 4096, cell, accounting=acc, alloc=got["allocation"]).total <= budget


def test_a_missing_sensitivity_is_named(llama):
    geom = geometry_from_config(llama.config)
    with pytest.raises(ValueError, match="no sensitivity for layer 0 K in q8_0, q4_0, q2_0"):
        search.searched(geom, 1024, {}, ("q8_0", "q4_0", "q2_0"), 128, 10**9, "t")


def test_the_per_layer_bytes_add_up_to_kv_bytes(llama):
    geom = geometry_from_config(llama.config)
    for cell in (CellSpec("q4_0", "q8_0", 128), CellSpec("kvarn3", "kvarn3", 0)):
        for acc in memory.ACCOUNTINGS:
            layers = memory.layer_bytes(geom, 1024, cell, accounting=acc)
            total = memory.kv_bytes(geom, 1024, cell, accounting=acc)
            assert sum(x.k_body + x.v_body for x in layers) == total.body
            assert sum(x.overlay for x in layers) == total.overlay and sum(x.staging for x in layers) == total.staging
            for x in layers:
                assert memory.body_bytes(geom.layers[x.layer], x.n_body, cell.k, "k", cell.rot) == x.k_body


def test_first_last_candidates_fit_and_stop_at_the_budget(llama):
    geom = geometry_from_config(llama.config)
    budget = search.budget_bytes(geom, 1024, "q4_0", 128, 512, "packed")
    got = search.first_last_candidates(geom, 1024, ("q8_0", "q4_0", "q2_0"), "q8_0", "q4_0", 128, budget)
    # 4 layers: base q2_0 (10 B / 32) with N q8_0 (34 B) layers at each end: N = 1 costs 2*24 = 48 over
    # 4*10 = 40 against 4*18 = 72 -> fits (88 > 72? no: 2*34 + 2*10 = 88 > 72), so nothing fits
    assert got == []
    wide = test_cache._llama(n_layers=12, max_positions=1024)
    geom = geometry_from_config(wide.config)
    budget = search.budget_bytes(geom, 1024, "q4_0", 128, 512, "packed")
    got = search.first_last_candidates(geom, 1024, ("q8_0", "q4_0", "q2_0"), "q8_0", "q4_0", 128, budget)
    # 12 layers: 2N*34 + (12-2N)*10 <= 12*18 = 216  <=>  48N <= 96  <=>  N <= 2 (per role; K and V alike)
    assert [(c["base"], c["n"]) for c in got] == [("q2_0", 1), ("q2_0", 2)]
    assert all(c["bytes"] <= budget for c in got) and got[-1]["bytes"] == budget
    assert got[0]["allocation"].definition() == {"k": "q2_0", "k_first": "q8_0,1", "k_last": "q8_0,1",
                                                 "v": "q2_0", "v_first": "q8_0,1", "v_last": "q8_0,1"}
    # at q8_0's bytes every N fits up to the first and last half (every layer q8_0: the budget itself); a base
    # of the budget's own width is no base (with any edge it passes the budget)
    top = search.budget_bytes(geom, 1024, "q8_0", 128, 512, "packed")
    got = search.first_last_candidates(geom, 1024, ("q8_0", "q4_0"), "q8_0", "q8_0", 128, top)
    assert [(c["base"], c["n"]) for c in got] == [("q4_0", n) for n in range(1, 7)] and got[-1]["bytes"] == top
    assert search.first_last_candidates(geom, 1024, ("q8_0", "q4_1", "q4_0"), "q8_0", "q4_0", 128, budget) == []


# --------------------------------------------------------------------------------------------- the probe

@torch.no_grad()
def _forward(model, cache, n=256, ubatch=64):
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation(kattn.ATTN_NAME)
    return torch.cat([model(ids[:, s: s + ubatch], cache=cache, kvarn_cache=cache, use_cache=True).logits[0]
                      for s in range(0, n, ubatch)])


def test_a_bf16_probe_is_the_baseline_bit_for_bit(llama):
    base = _forward(llama, KVarnCache(llama.config, CellSpec("bf16", "bf16", 0)))
    for layer, role in ((0, "k"), (3, "v")):
        assert torch.equal(_forward(llama, probe_cache(llama.config, layer, role, "bf16", 0)), base)
    assert not torch.equal(_forward(llama, probe_cache(llama.config, 1, "k", "q4_0", 128)), base)


def test_a_standard_probe_is_the_allocation_cell_of_that_one_layer(llama):
    # K (or V) of layer 1 in q4_0, every other role BF16: the standard-family allocation of that map runs
    # the same stores through the cache's own per-layer path. At tail 0 both read every layer one way (a
    # tail splits the attention of the allocation's BF16 layers too: the same values, summed in another order).
    base = _forward(llama, KVarnCache(llama.config, CellSpec("bf16", "bf16", 0)))
    for role in "kv":
        raw = {"k": "0:bf16,1:q4_0,2-3:bf16" if role == "k" else "bf16",
               "v": "0:bf16,1:q4_0,2-3:bf16" if role == "v" else "bf16"}
        a = define(Allocation.parse(f"probe_{role}", raw))
        probe = _forward(llama, probe_cache(llama.config, 1, role, "q4_0", 0))
        assert torch.equal(probe, _forward(llama, KVarnCache(llama.config, cell_spec(*a.base, 0, alloc=a.token))))
        assert not torch.equal(probe, base)


def test_a_kvarn_probe_quantizes_that_role_only(llama):
    cache = probe_cache(llama.config, 2, "k", "kvarn4", 0)
    base_cache = KVarnCache(llama.config, CellSpec("bf16", "bf16", 0))
    _forward(llama, cache)
    _forward(llama, base_cache)
    layer = cache.layers[2]
    assert (layer.k_fmt.name, layer.v_fmt.name, layer.policy.sink, layer.policy.tail) == ("kvarn4", "bf16", 128, 128)
    assert layer.tail_dtype == torch.float16  # KVarN's exact copy
    nb = layer.n_body
    assert nb == 256  # two whole 128-token groups
    staged_k, staged_v = layer.rows["ek"].view(0, nb).float(), layer.rows["ev"].view(0, nb).float()
    assert torch.equal(layer.rows["k"].view(0, nb), layer.k_fmt.roundtrip(staged_k))  # KVarN's K body
    assert torch.equal(layer.rows["v"].view(0, nb).float(), staged_v.to(torch.bfloat16).float())  # V: BF16 only
    for i in (0, 1):  # the layers before the probe see the baseline's inputs: the same rows bit for bit
        assert torch.equal(cache.layers[i].keys, base_cache.layers[i].keys)
        assert torch.equal(cache.layers[i].values, base_cache.layers[i].values)


def test_a_probe_of_a_layer_without_a_kv_cache_is_refused(llama):
    with pytest.raises(ValueError, match=r"layer 4 is not a layer with a KV cache of this model; its KV layers are 0, 1, 2, 3"):
        probe_cache(llama.config, 4, "k", "q4_0", 128)
    with pytest.raises(ValueError, match="role 'kv': use 'k' or 'v'"):
        probe_cache(llama.config, 0, "kv", "q4_0", 128)


# --------------------------------------------------------------------------------------------- the texts

@pytest.mark.skipif(not VALID_TEXT.is_file(), reason="needs the shared wiki.valid.raw")
def test_the_validation_split_is_verified():
    assert data.load_text(VALID_TEXT, split="validation").startswith(" \n = Homarus gammarus")
    with pytest.raises(ValueError, match="is not the original wikitext-2-raw-v1 wiki.valid.raw"):
        data.load_text(WIKI_TEXT, split="validation")
    with pytest.raises(ValueError, match="is not the original wikitext-2-raw-v1 wiki.test.raw"):
        data.load_text(VALID_TEXT)
    with pytest.raises(ValueError, match="split 'train' is not a Wikitext-2 split kvarn reads; use one of test, validation"):
        data.load_text(VALID_TEXT, split="train")


@pytest.mark.slow
@pytest.mark.skipif(not VALID_TEXT.is_file(), reason="needs the shared wiki.valid.raw")
def test_the_search_never_reads_the_test_text(tmp_path, monkeypatch):
    """Both jobs end to end on a random-weight model; every text they read goes through load_text, which
    here records its calls, and the bytes of wiki.test.raw are never opened."""
    from kvarn.perlayer import run
    from kvarn.weights.sources import ModelSpec

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 300, "hidden_size": 128, "intermediate_size": 64,
                               "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "head_dim": 64, "max_position_embeddings": 1024}))
    spec = ModelSpec("tiny", f"random:{cfg}")
    calls, real = [], data.load_text

    def recorded(path=None, *, verify=True, split="test"):
        calls.append((str(path), split))
        return real(path, verify=verify, split=split)

    monkeypatch.setattr(data, "load_text", recorded)
    opened, real_open = [], open

    def watched(file, *a, **k):
        opened.append(str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr("builtins.open", watched)
    p = plan.expand({"perlayer": {"n_ctx": 512, "types": {"standard": ["q8_0", "q2_0"], "kvarn": ["kvarn8", "kvarn2"]},
                                  "budgets": ["q8_0"]}})
    common = dict(device="cpu", dtype="float32", cache_dir=tmp_path / "models", ubatch=64)
    paths = [tmp_path / f"{t}.parquet" for t in p.all_types()]
    added = {}
    for t, path in zip(p.all_types(), paths):
        frame = run.run_sensitivity(spec, str(VALID_TEXT), p, t, path, **common)
        assert frame.height == 8 and frame["tokens"].to_list() == [255] * 8  # 4 layers x K, V; n_ctx/2 - 1 tokens
        added[t] = frame["kld_mean"].sum()
    assert added["q2_0"] > 10 * added["q8_0"] and added["kvarn2"] > 10 * added["kvarn8"]
    result = run.run_search(spec, str(VALID_TEXT), p, "q8_0", paths, tmp_path / "s.json", eval_n_ctx=1024, **common)
    assert calls and all(split == "validation" and path == str(VALID_TEXT) for path, split in calls)
    assert not any("wiki.test" in f for f in opened)
    assert result["search_text_sha256"] == data.WIKI_VALID_SHA256
    methods = [(e["method"], e["family"]) for e in result["allocations"]]
    assert ("knapsack", "standard") in methods and ("first/last", "standard") in methods
    for e in result["allocations"]:
        assert e["bytes"] <= result["budget_bytes"] and e["valid"]["tokens"] == 255


def test_the_tables_words_for_gains_and_verdicts():
    from kvarn.perlayer import report

    assert report.gain_text(13.44) == "+13.4 %" and report.gain_text(-12.8) == "-12.8 %"
    assert report.gain_text(-3289.1) == "33.9× the uniform median" and report.gain_text(None) == ""
    assert report.verdict(-2.0, -1.0) == "lower" and report.verdict(1.0, 2.0) == "higher"
    assert report.verdict(-1.0, 0.0) == report.verdict(0.0, 1.0) == "within noise"  # an interval touching 0
