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

from kvarn.spec.cell import CellSpec
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


# A 264-token context, 20 generated: the prompt ends at 244 and the decode crosses position 256,
# where KVarN seals its second group (positions 128..255) while decoding.
CTX, STEPS, SEAL = 264, 20, 256


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
    """Positions 244..263 generated: KVarN seals its second group (positions 128..255) while
    decoding; every column equal with the shortcut off."""
    lm, prompts = smol
    assert prompts.shape[1] < SEAL < prompts.shape[1] + STEPS  # the seal falls inside the decode
    fast = KD.decode(lm.model, prompts, CellSpec(*cell), STEPS, ubatch=128)
    monkeypatch.setattr(KA, "DECODE_SPANS", False)
    ref = KD.decode(lm.model, prompts, CellSpec(*cell), STEPS, ubatch=128)
    for key in KD.STEP_KEYS:
        assert np.array_equal(fast[key], ref[key]), key


# The block path's noise, measured on this decode (2 prompts, positions 244..263, blocks of 3 and
# 20 against block=1): the cell's tokens and the baseline's argmax equal; max |Δ KLD| 1.8e-5 for
# the bf16 cell (lock step: exactly 0), 4.4e-5 for kvarn4 (KLD 1.7e-6..1e-4 here), 1.9e-3 for q2_0
# t128 (KLD 0.006..1.5, relative 2.3 %); max |Δ nll_base| 4.5e-3. Its source is the bf16 cache:
# the same tokens through an f32 cache as one forward or one at a time differ by KLD 7e-9 at
# most, through a bf16 cache by 1.2e-5 (a K/V value whose fp32 rounding moved crosses a bf16
# rounding boundary). Bounds at 2-3x those figures; per-step KLD ≥ 1e-3 (q2_0) moves ≤ 5 %.
KLD_ATOL, KLD_RTOL, NLL_ATOL = 1e-4, 0.05, 0.01


@pytest.mark.slow
@pytest.mark.parametrize("cell", [("kvarn4", "kvarn4", 0), ("q2_0", "q2_0", 128), ("bf16", "bf16", 0)],
                         ids=["kvarn4", "q2_0-t128", "bf16"])
def test_block_path_matches_lock_step(smol, cell):
    """Blocks of 7 steps (7, 7, 6: the first block's baseline forward takes 6 tokens, the prefill
    gave step 0) against lock step: every token, base token, same-top and first divergence equal;
    KLD and nll_base within the measured noise."""
    lm, prompts = smol
    n_p = prompts.shape[0]
    ref = KD.decode(lm.model, prompts, CellSpec(*cell), STEPS, ubatch=128, block=1)
    got = KD.decode(lm.model, prompts, CellSpec(*cell), STEPS, ubatch=128, block=7)
    for key in ("prompt", "step", "token", "base_token", "same_top"):
        assert np.array_equal(got[key], ref[key]), key
    assert np.array_equal(KD.first_divergence(got, n_p, STEPS), KD.first_divergence(ref, n_p, STEPS))
    np.testing.assert_allclose(got["kld"], ref["kld"], rtol=KLD_RTOL, atol=KLD_ATOL)
    np.testing.assert_allclose(got["nll_base"], ref["nll_base"], rtol=0, atol=NLL_ATOL)
    if cell[0] == "q2_0":  # the effect is far above the bounds: the comparison means something
        assert ref["kld"].mean() > 100 * KLD_ATOL and (KD.first_divergence(ref, n_p, STEPS) < STEPS).any()
