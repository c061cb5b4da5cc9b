"""The decode path's shortcuts give the same numbers as the general path, bit for bit.

`kvarn.kvcache.attention.single_query_spans` (a decode step's key spans from the cache policy)
against `block_spans` (from the masks) on a grid, and a short free-running decode through
KVarN, q4_0 and bf16 caches with the shortcut on and off. The block path of `decode` (the
baseline scores B steps in one forward) against lock step (block=1): the same text, the same
first divergences, and the baseline's numbers equal within the noise of a B-token forward.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvarn.vocab.cell import CellSpec
import kvarn.kvcache.attention as KA
from kvarn.run import decode as KD

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("sink", [0, 4, 128])
@pytest.mark.parametrize("tail", [0, 1, 128, 500])
def test_single_query_spans_match_the_masks(sink, tail):
    n = 0
    for L in (1, 5, 129, 300, 700):
        for off in (0, 3, 127, 128, 200):
            q = off + L - 1
            allowed = torch.ones(2, 1, 1, L, dtype=torch.bool)
            body, exact = KA.split_mask(allowed, q, SimpleNamespace(sink=sink, tail=tail), off)
            sink_c = min(max(sink - off, 0), L)
            want = KA.block_spans(KA.QUERY_BLOCK, (body, (0, L)), (exact, (0, sink_c)), (exact, (sink_c, L)))
            got = KA.single_query_spans(q, off, L, sink, tail)
            assert got == want[0], (L, off, got, want)
            n += sum(s is not None for s in got)
    assert n > 0


# A 264-token context, 12 generated: the prompt ends at 252 and the decode crosses position 256,
# where KVarN seals its second group (positions 128..255) while decoding (steps 4..11 read it).
CTX, STEPS, SEAL = 264, 12, 256


@pytest.fixture(scope="module")
def smol():
    from kvarn.baseline import data
    from kvarn.weights import models
    from paths import CACHE_DIR, ENGINE_TEXT

    lm = models.load(models.ModelSpec("smollm2-135m", "embedded:smollm2-135m"), cache_dir=CACHE_DIR)
    lm.model.eval()
    lm.model.set_attn_implementation(KA.ATTN_NAME)
    text = data.load_text(ENGINE_TEXT)[:50000]
    chunks = data.make_chunks(data.tokenize(lm.tokenizer, text), CTX, 2, lm.info.bos_id)
    return lm, KD.decode_prompts(chunks, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [("kvarn4", "kvarn4", 0), ("q4_0", "q4_0", 128), ("bf16", "bf16", 0)],
                         ids=["kvarn4", "q4_0-t128", "bf16"])
def test_decode_shortcut_changes_no_bit(smol, cell, monkeypatch):
    """Positions 252..263 generated: KVarN seals its second group (positions 128..255) while
    decoding; every column equal with the shortcut off."""
    lm, prompts = smol
    assert prompts.shape[1] < SEAL < prompts.shape[1] + STEPS  # the seal falls inside the decode
    calls = []
    spans = KA.single_query_spans
    monkeypatch.setattr(KA, "single_query_spans", lambda *a: calls.append(a) or spans(*a))
    fast = KD.decode(lm.model, prompts, CellSpec(*cell), STEPS, ubatch=128)
    n_fast = len(calls)  # every generating step (the prefill gave the first), every layer
    assert n_fast >= (STEPS - 1) * lm.model.config.num_hidden_layers, "the decode steps did not take the shortcut"
    monkeypatch.setattr(KA, "DECODE_SPANS", False)
    ref = KD.decode(lm.model, prompts, CellSpec(*cell), STEPS, ubatch=128)
    assert len(calls) == n_fast  # the reference never takes it
    for key in KD.STEP_KEYS:
        assert np.array_equal(fast[key], ref[key]), key


# The block path's noise, measured on this decode (2 prompts, positions 252..263, blocks of 3, 5 and
# 12 against block=1): the cell's tokens and the baseline's argmax equal; max |Δ KLD| 1.4e-5 for the
# bf16 cell (lock step: exactly 0), 7.9e-5 for kvarn4 (KLD up to 5.6e-4 here), 5.6e-4 for q2_0 t128
# (KLD 0.0015..0.52, relative 0.7 %); max |Δ nll_base| 0.012. Its source is the bf16 cache: the same
# tokens through an f32 cache as one forward or one at a time differ by KLD 7e-9 at most, through a
# bf16 cache by 1.2e-5 (a K/V value whose fp32 rounding moved crosses a bf16 rounding boundary).
# Bounds at 2.5-3x those figures; a misaligned block (another position's log-probs) moves KLD by
# O(0.1-1) and the exact columns.
KLD_ATOL, KLD_RTOL, NLL_ATOL = 2e-4, 0.02, 0.03


@pytest.mark.slow
@pytest.mark.parametrize("cell,temperature", [(("kvarn4", "kvarn4", 0), 0.0), (("q2_0", "q2_0", 128), 0.0),
                                              (("bf16", "bf16", 0), 0.0), (("q2_0", "q2_0", 128), 1.0)],
                         ids=["kvarn4", "q2_0-t128", "bf16", "q2_0-t128-sampled"])
def test_block_path_matches_lock_step(smol, cell, temperature):
    """Blocks of 5 steps (5, 5, 2: the first block's baseline forward takes 4 tokens, the prefill
    gave step 0) against lock step: every token, base token, same-top and first divergence equal;
    KLD and nll_base within the measured noise. Sampled: the noise is drawn per step, so the
    blocks do not change it."""
    lm, prompts = smol
    n_p = prompts.shape[0]
    kw = dict(ubatch=128, temperature=temperature, seed=0)
    ref = KD.decode(lm.model, prompts, CellSpec(*cell), STEPS, block=1, **kw)
    timing = {}
    got = KD.decode(lm.model, prompts, CellSpec(*cell), STEPS, block=5, timing=timing, **kw)
    assert timing["block"] == 5
    for key in ("prompt", "step", "token", "base_token", "same_top"):
        assert np.array_equal(got[key], ref[key]), key
    assert np.array_equal(KD.first_divergence(got, n_p, STEPS), KD.first_divergence(ref, n_p, STEPS))
    np.testing.assert_allclose(got["kld"], ref["kld"], rtol=KLD_RTOL, atol=KLD_ATOL)
    np.testing.assert_allclose(got["nll_base"], ref["nll_base"], rtol=0, atol=NLL_ATOL)
    if cell[0] == "q2_0":  # the effect is far above the bounds: the comparison means something
        assert ref["kld"].mean() > 100 * KLD_ATOL and (KD.first_divergence(ref, n_p, STEPS) < STEPS).any()
