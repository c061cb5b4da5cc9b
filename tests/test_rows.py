"""kvarn.kvcache.rows and the cache's storage: preallocated buffers, sliding layers that forget, 16-bit exact copies."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from kvarn.spec.cell import CellSpec
import kvarn.kvcache.attention as kattn
from kvarn.kvcache.cache import KVarnCache, KVarnLayer
from kvarn.kvcache.rows import Rows

W = 16  # the tiny Gemma 3's sliding window


def _rand(n, seed):
    return torch.randn(1, 2, n, 4, generator=torch.Generator().manual_seed(seed))


def test_rows_keep_what_was_written_through_growth_and_moves():
    # Rows written in pieces, the oldest forgotten as a sliding layer does: every kept row
    # reads back what was written (bit for bit, through reallocations and moves to the
    # front), the buffer never outgrows window + piece, and forgotten rows are refused.
    ref = _rand(400, 0)
    rows = Rows(torch.float32, hint=W - 1 + 7)
    for s in range(0, 400, 7):
        rows.forget_before(max(0, s - W + 1))
        rows.append(ref[..., s : s + 7, :])
        lo = max(0, s - W + 1)
        assert torch.equal(rows.view(lo, rows.end), ref[..., lo : rows.end, :])
        assert rows.capacity == W - 1 + 7
    assert rows.n_moves > 0
    with pytest.raises(IndexError, match=r"rows 0\.\.9 are not kept \(kept: 384\.\.399\)"):
        rows.view(0, 10)


def test_rows_grow_by_doubling_without_a_hint():
    ref = _rand(300, 1)
    rows = Rows(torch.bfloat16)
    caps = set()
    for s in range(0, 300, 50):
        rows.append(ref[..., s : s + 50, :])
        caps.add(rows.capacity)
    assert caps == {100, 300} and rows.n_moves == 0  # twice what is needed at each growth
    assert torch.equal(rows.view(0, 300), ref.bfloat16())  # stored in its dtype, values kept
    rows.extend(ref, 5)
    assert (rows.view(300, 305) == 0).all()
    rows.write(302, ref[..., :2, :])
    assert torch.equal(rows.view(302, 304), ref[..., :2, :].bfloat16())
    with pytest.raises(IndexError):
        rows.write(304, ref[..., :2, :])  # past the end


def _gemma():
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=32,
                           sliding_window=W, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=512)
    return Gemma3ForCausalLM(cfg).eval()


@torch.no_grad()
def _run(model, ids, cell, ubatch):
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = KVarnCache(model.config, CellSpec(*cell))
    cache.reserve(ids.shape[1])
    out = [model(input_ids=ids[:, s : s + ubatch], cache=cache, kvarn_cache=cache, use_cache=True).logits[0]
           for s in range(0, ids.shape[1], ubatch)]
    return torch.cat(out), cache


CELLS = [("f32", "f32", 0), ("bf16", "bf16", 0), ("q4_0", "q4_0", 8), ("kvarn4", "kvarn4", 0)]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c[0]}-t{c[2]}")
def test_sliding_layers_forget_and_nothing_moves(cell, monkeypatch):
    # 300 tokens in ubatches of 7 through a model with window 16: the sliding layers hold
    # at most W - 1 + 7 rows (and really dropped some), the full layer all 300; the logits
    # equal, bit for bit, those of the same cache keeping every row.
    model = _gemma()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(2))
    got, cache = _run(model, ids, cell, 7)
    for layer in cache.layers:
        assert layer.n_tokens == 300
        if layer.is_sliding:
            # (KVarN also keeps its incomplete group: up to 127 rows, more than W - 1 here)
            assert layer.stored_rows() <= max(W, layer.group) - 1 + 7
            assert all(b.n_moves > 0 for b in layer.rows.values())
            assert layer.kv_offset == 294 - W + 1 and layer.keys.shape[-2] == 300 - layer.kv_offset
        else:
            assert layer.stored_rows() == 300 and layer.kv_offset == 0 and layer.keys.shape[-2] == 300
        # The exact copy is stored in the tail dtype; the body in fp32 or its float type's dtype.
        if layer.keep_exact:
            assert layer.exact_keys.dtype == layer.tail_dtype == {"kvarn4": torch.float16}.get(cell[0], torch.bfloat16)
        assert layer.keys.dtype == {"bf16": torch.bfloat16}.get(cell[0], torch.float32)
    monkeypatch.setattr(KVarnLayer, "trim", False)
    ref, full = _run(model, ids, cell, 7)
    assert all(layer.stored_rows() >= 300 and layer.kv_offset == 0 for layer in full.layers)
    assert torch.equal(got, ref)
