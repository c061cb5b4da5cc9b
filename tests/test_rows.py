"""kvarn.kvcache.rows and the cache's storage: preallocated buffers, sliding layers that forget, 16-bit exact copies."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from kvarn.vocab.cell import CellSpec
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


def test_rows_by_hand_capacity_moves_zeros_and_bounds():
    x = _rand(16, 2)
    one = Rows(torch.float32)  # no hint: the first write of 1 row allocates 2 x 1
    one.append(x[..., :1, :])
    assert one.capacity == 2
    r = Rows(torch.float32, hint=6)
    r.append(x[..., :6, :])  # exactly the hint: allocated at it, not doubled
    assert r.capacity == 6 and r.n_moves == 0
    r.forget_before(4)
    r.append(x[..., 6:8, :])  # 2 kept + 2 new fit the 6: the kept rows move to the front (base 4)
    assert (r.capacity, r.n_moves, r.base) == (6, 1, 4)
    r.append(x[..., 8:9, :])  # rows 4..8 at buf 0..4: fits without a move
    assert r.n_moves == 1
    r.forget_before(7)
    r.append(x[..., 9:11, :])  # kept 7, 8 + 2 new: the second move (base 7)
    assert (r.capacity, r.n_moves, r.base) == (6, 2, 7)
    assert torch.equal(r.view(7, 11), x[..., 7:11, :])
    # buf rows 4 and 5 still hold what was there (row 8 before the move): extend zeroes them
    assert r.buf[..., 4, :].abs().sum() > 0
    r.extend(x, 2)
    assert torch.equal(r.view(11, 13), torch.zeros_like(x[..., :2, :])) and r.capacity == 6
    r.append(x[..., 13:14, :])  # past the 6 rows with nothing forgotten: a new buffer of 2 x 7
    assert (r.capacity, r.n_moves) == (14, 2) and torch.equal(r.view(7, 11), x[..., 7:11, :])
    assert r.view(9, 9).shape[-2] == 0  # an empty range is a view, not an error
    with pytest.raises(IndexError, match=r"^rows 7\.\.14 are not kept \(kept: 7\.\.13\)$"):
        r.view(7, 15)
    with pytest.raises(IndexError, match=r"^rows 13\.\.14 are not kept \(kept: 7\.\.13\)$"):
        r.write(13, x[..., :2, :])


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
