"""A user's doubts about defaults: a cell that names no option gets the pair's own; a cell that
names one gets that one. Checked on the cache model itself (kvarn.kvcache.cache.KVarnCache built
from a tiny config, no weights), on the cell's fields and its name's parser, and on the option
lists (kvarn.vocab.options), so a slip in how the cache picks a default fails here, not only in a
slow end-to-end run. Expectations from DESIGN §2 and the facts table, written out by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig

from kvarn.kvcache.cache import KVarnCache
from kvarn.vocab import options as O
from kvarn.vocab.cell import CellSpec, parse_opts


def _llama():
    return LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)


def _gemma():
    return Gemma3TextConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=32,
                            sliding_window=16, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                            max_position_embeddings=512)


def _layers(cache):
    return [layer for layer, p in zip(cache.layers, cache.policies) if p is not None]


@pytest.mark.parametrize("k, tail_dtype, want_name, want", [
    ("kvarn4", None, "f16", torch.float16),  # KVarN's own: F16 (DESIGN §2)
    ("q4_0", None, "bf16", torch.bfloat16),  # a standard type's own: BF16
    ("kvarn4", "bf16", "bf16", torch.bfloat16),  # asked for: kept
    ("q4_0", "f16", "f16", torch.float16),
    ("q8_0", "f32", "f32", torch.float32),
])
def test_the_cache_keeps_its_exact_copy_in_the_pairs_dtype_unless_asked(k, tail_dtype, want_name, want):
    cache = KVarnCache(_llama(), CellSpec(k, k, 128, tail_dtype=tail_dtype))
    assert cache.tail_dtype_name == want_name
    assert all(layer.tail_dtype == want for layer in _layers(cache))


@pytest.mark.parametrize("k, tail, sink, want_sink, want_tail", [
    ("q4_0", 0, None, 0, 0),  # a standard pair: no sink, the tail as asked
    ("q4_0", 100, None, 0, 100),
    ("q4_0", 0, 4, 4, 0),  # a sink asked for: kept
    ("kvarn4", 0, None, 128, 128),  # KVarN: sink 128, tail max(128, roundup(tail, 128))
    ("kvarn4", 129, None, 128, 256),
])
def test_the_cache_policies_take_the_pairs_sink_and_tail(k, tail, sink, want_sink, want_tail):
    cache = KVarnCache(_llama(), CellSpec(k, k, tail, sink=sink))
    assert [(p.sink, p.tail, p.window) for p in cache.kv_policies] == [(want_sink, want_tail, None)] * 2


def test_sliding_layers_drop_the_sink_and_cap_the_tail_at_the_window():
    # Gemma-like: layers 0, 1 sliding (window 16), layer 2 full
    cache = KVarnCache(_gemma(), CellSpec("kvarn4", "kvarn4", 0))
    assert [(p.sink, p.tail, p.window) for p in cache.kv_policies] == [(0, 16, 16), (0, 16, 16), (128, 128, None)]


def test_the_cache_formats_take_the_cells_rotation_and_passes():
    on = KVarnCache(_llama(), CellSpec("q4_0", "q4_0", 0))
    off = KVarnCache(_llama(), CellSpec("q4_0", "q4_0", 0, rot=False))
    assert (on.k_fmt.rot, on.v_fmt.rot, off.k_fmt.rot, off.v_fmt.rot) == (True, True, False, False)
    assert KVarnCache(_llama(), CellSpec("kvarn4", "kvarn4", 0)).k_fmt.iters == 16  # KVarN's 16 passes
    three = KVarnCache(_llama(), CellSpec("kvarn4", "kvarn4", 0, iters=3))
    assert (three.k_fmt.iters, three.v_fmt.iters) == (3, 3)


def test_a_cells_defaults_and_its_names_parser_agree():
    c = CellSpec("q4_0", "q4_0", 0)
    assert (c.rot, c.tail_dtype, c.iters, c.sink, c.compute) == (True, None, 16, None, "exact")
    assert parse_opts("") == {"rot": True, "tail_dtype": None, "iters": 16, "sink": None, "compute": "exact"}
    assert parse_opts("-norot-tdf16-i3-s4") == {"rot": False, "tail_dtype": "f16", "iters": 3, "sink": 4,
                                               "compute": "exact"}
    assert c.name == "q4_0-q4_0-t0"  # the defaults write nothing
    assert CellSpec.from_name("q4_0-q4_0-t0-norot").rot is False


def test_the_option_lists_defaults():
    assert O.DEFAULT_COMPUTE == "exact"
    assert O.attention_for("auto", "cuda") == "flex" and O.attention_for("auto", "cpu") == "ref"
    assert O.attention_for("ref", "cuda") == "ref" and O.attention_for("flex", "cpu") == "flex"
    assert O.sampling_name() == "" and O.sampling_label() == "greedy"  # greedy when nothing is asked
    assert O.summary_sampling({}) == "greedy"
