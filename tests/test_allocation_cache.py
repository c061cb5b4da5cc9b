"""Per-layer types in the cache model and the engine (kvarn.kvcache.cache, kvarn.run.torch_engine) on tiny
random-weight models: each layer stores with its own types, and an allocation of one type on every
layer is its plain cell bit for bit (logits, stored rows, tokens.parquet and the summary's KLD)."""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch

import kvarn.kvcache.attention as kattn
from kvarn.kvcache.cache import KVarnCache, KVarnLayer
from kvarn.vocab.allocation import Allocation, AllocationError, define
from kvarn.vocab.cell import CellSpec, cell_spec
import test_cache
from paths import ENGINE_TEXT


def _llama():  # three layers, so an allocation has a middle one
    return test_cache._llama(n_layers=3, max_positions=1024)


def _gemma():
    return test_cache._gemma(max_positions=1024)


MODELS = {"llama": _llama, "gemma3": _gemma}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.fixture(scope="module")
def llama():
    return _llama()


def alloc_cell(raw: dict, tail: int = 0, name: str = "t", **opts):
    """The cell of an allocation, defined in this process."""
    a = define(Allocation.parse(name, raw))
    return cell_spec(*a.base, tail, alloc=a.token, **opts)


@torch.no_grad()
def run(model, cell, n=64, ubatch=512):
    """(logits, cache) of `cell` over n random tokens fed `ubatch` at a time."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = KVarnCache(model.config, cell)
    out = [model(ids[:, s: s + ubatch], cache=cache, kvarn_cache=cache, use_cache=True).logits[0]
           for s in range(0, n, ubatch)]
    return torch.cat(out), cache


def stored(cache, i):
    layer = cache.layers[i]
    return [t for t in (layer.keys, layer.values, layer.exact_keys, layer.exact_values) if t is not None]


def test_each_layer_stores_with_its_own_types(llama):
    cell = alloc_cell({"k": "0:q8_0,1:q4_0,2:q2_0", "v": "0:q5_1,1:q4_0,2:q8_0"}, tail=16)
    cache = KVarnCache(llama.config, cell)
    assert [(la.k_fmt.name, la.v_fmt.name) for la in cache.layers] == cache.layer_types == [
        ("q8_0", "q5_1"), ("q4_0", "q4_0"), ("q2_0", "q8_0")]
    assert cache.kv_policies == KVarnCache(llama.config, CellSpec("q4_0", "q4_0", 16)).kv_policies
    # the name's (main) types: of the most layers, ties to the first
    assert (cache.k_fmt.name, cache.v_fmt.name) == (cell.k, cell.v) == ("q8_0", "q5_1")


@pytest.mark.parametrize("pair, tail, n, opts", [("q4_0", 0, 64, {}), ("q4_0", 16, 64, {"rot": False}),
                                                ("q8_0", 0, 64, {"tail_dtype": "f16", "sink": 4}),
                                                ("kvarn4", 128, 320, {"iters": 8})])
@pytest.mark.parametrize("form", ["ranges", "first_last"])
def test_a_uniform_allocation_is_its_plain_cell_bit_for_bit(model, pair, tail, n, opts, form, one_thread):
    raw = {"k": f"0-2:{pair}", "v": f"0-2:{pair}"} if form == "ranges" else {"k": pair, "v": pair}
    cell = alloc_cell(raw, tail, name=form, **opts)
    for ubatch in (512, 48):
        got, gcache = run(model, cell, n, ubatch)
        want, wcache = run(model, CellSpec(pair, pair, tail, **opts), n, ubatch)
        assert torch.equal(got, want), (pair, tail, ubatch)
        for i in range(3):
            assert all(torch.equal(a, b) for a, b in zip(stored(gcache, i), stored(wcache, i), strict=True))


def test_a_layer_is_its_types_plain_cell_until_the_types_differ(llama, one_thread):
    # the inputs of layer 0 are the same whatever the cache: its rows are the plain cell's of its types
    upgraded, _ = run(llama, CellSpec("q4_0", "q4_0", 0))
    for raw, same_as, first_diff in ((("0:q8_0,1-2:q4_0"), "q8_0", 1), (("0-1:q4_0,2:q8_0"), "q4_0", 2)):
        got, cache = run(llama, alloc_cell({"k": raw, "v": raw}, name="mixed"))
        _, plain = run(llama, CellSpec(same_as, same_as, 0))
        for i in range(3):
            same = all(torch.equal(a, b) for a, b in zip(stored(cache, i), stored(plain, i), strict=True))
            assert same == (i < first_diff), (raw, i)
    assert not torch.equal(got, upgraded)


def test_kvarn_widths_per_layer(llama, one_thread):
    cell = alloc_cell({"k": "kvarn4", "v": "kvarn4", "k_first": "kvarn8,1", "v_last": "kvarn3,1"}, tail=0)
    got, cache = run(llama, cell, n=320)
    assert cache.layer_types == [("kvarn8", "kvarn4"), ("kvarn4", "kvarn4"), ("kvarn4", "kvarn3")]
    assert [la.policy for la in cache.layers] == [la.policy for la in run(llama, CellSpec("kvarn4", "kvarn4", 0),
                                                                             n=8)[1].layers]
    _, plain = run(llama, CellSpec("kvarn8", "kvarn4", 0), n=320)
    assert all(torch.equal(a, b) for a, b in zip(stored(cache, 0), stored(plain, 0), strict=True))
    assert torch.isfinite(got).all()


def test_a_hybrid_models_recurrent_layers_count_but_take_no_cache():
    # decoder-layer indices count the Gated DeltaNet layers, as llama.cpp's `il` does: "first 1" is
    # layer 0, a recurrent layer here, so every attention layer keeps the base type
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_value_heads=4,
                            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                            layer_types=["linear_attention", "full_attention"] * 2)
    cache = KVarnCache(cfg, alloc_cell({"k": "0-1:q8_0,2-3:q4_0", "v": "q4_0"}, name="hybrid"))
    assert [type(la).__name__ for la in cache.layers[::2]] == ["LinearAttentionLayer"] * 2
    assert [(la.k_fmt.name, la.v_fmt.name) for la in cache.layers[1::2]] == [("q8_0", "q4_0"), ("q4_0", "q4_0")]
    first = KVarnCache(cfg, alloc_cell({"k": "q4_0", "v": "q4_0", "k_first": "q8_0,1"}, name="hybrid_first"))
    assert [la.k_fmt.name for la in first.layers if isinstance(la, KVarnLayer)] == ["q4_0", "q4_0"]


def test_a_layer_past_the_model_is_refused_when_the_cache_is_built(llama):
    with pytest.raises(AllocationError) as e:
        KVarnCache(llama.config, alloc_cell({"k": "0-3:q4_0", "v": "q4_0"}, name="four"))
    assert str(e.value) == ("allocations.four.k: layer 3 is past the model, which has 3 decoder layers (0-2); the "
                            "ranges '0-3:q4_0' name layers 0-3")


@pytest.mark.skipif(ENGINE_TEXT is None, reason="needs the shared wiki.test.raw")
def test_the_engine_scores_a_uniform_allocation_as_its_plain_cell(tmp_path, one_thread):
    """run_cell end to end on a random-weight model: the same tokens.parquet and KLD, the summary
    records the allocation and its per-layer types."""
    from kvarn.run import torch_engine
    from kvarn.weights.sources import ModelSpec

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 300, "hidden_size": 128, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "head_dim": 64, "max_position_embeddings": 512}))
    spec = ModelSpec("tiny", f"random:{cfg}")
    common = dict(text=ENGINE_TEXT, device="cpu", dtype="float32", cache_dir=tmp_path / "models", ubatch=64)
    base = tmp_path / "baseline.kvd"
    torch_engine.run_baseline(spec, 256, 1, base, **common)
    uniform = alloc_cell({"k": "0-1:q4_0", "v": "q4_0"}, tail=32, name="engine_uniform")
    sums = {}
    for cell in (CellSpec("q4_0", "q4_0", 32), uniform):
        out = tmp_path / cell.name
        sums[cell.name] = torch_engine.run_cell(spec, 256, 1, cell, base, out, **common)
    frames = [pl.read_parquet(tmp_path / name / "tokens.parquet") for name in sums]
    assert frames[0].equals(frames[1])
    plain, alloc = sums.values()
    assert alloc["kv_alloc_k"] == alloc["kv_alloc_v"] == ["q4_0", "q4_0"] and "kv_alloc" not in plain
    for key in ("kld_median", "kld_mean", "kv_total_bytes"):
        assert plain[key] == alloc[key], key
