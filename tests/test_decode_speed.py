"""The decode path's shortcuts give the same numbers as the general path, bit for bit.

`kvarn.kvcache.attention.single_query_spans` (a decode step's key spans from the cache policy)
against `block_spans` (from the masks) on a grid, and a short free-running decode through
KVarN, q4_0 and bf16 caches with the shortcut on and off.
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
