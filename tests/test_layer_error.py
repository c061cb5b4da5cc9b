"""kvarn.run.layer_error on SmolLM2 (slow): an f32 cell has zero error at every layer; layer 0 (whose
inputs the cell cannot have changed) matches the attention output captured at o_proj's input
in two plain engine runs (f32 cache vs the cell); the error is split into K and V parts."""

import pytest
from kvarn.vocab.cell import CellSpec
from paths import CACHE_DIR, ENGINE_TEXT as TEXT

# One xdist worker: the module fixture loads SmolLM2 once.
pytestmark = pytest.mark.xdist_group("layer_error")

CTX = 256


@pytest.fixture(scope="module")
def smol():
    import kvarn.kvcache.attention  # noqa: F401  (registers "kvarn")
    from kvarn.baseline import data
    from kvarn.weights import models

    lm = models.load(models.ModelSpec("smollm2-135m", "embedded:smollm2-135m"), cache_dir=CACHE_DIR)
    lm.model.eval()
    lm.model.set_attn_implementation("kvarn")
    return lm, data.make_chunks(data.tokenize(lm.tokenizer, data.load_text(TEXT)), CTX, 1, lm.info.bos_id)


class _Captured(Exception):
    """Raised once the o_proj input is captured: the layers above it are not needed."""


def _o_proj_input(lm, ids, k, v, layer=0):
    from kvarn.run import forward
    from kvarn.vocab import scoring

    got = []

    def grab(module, args):
        got.append(args[0][0])
        raise _Captured

    h = lm.model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(grab)
    try:
        cache = forward.new_cache(lm.model, CellSpec(k, v, 0))
        with pytest.raises(_Captured):  # one ubatch (512 >= CTX): the whole chunk's rows
            list(forward.chunk_logprobs(lm.model, ids[0], cache, 512, scoring.scored_positions(CTX)))
    finally:
        h.remove()
    assert len(got) == 1 and got[0].shape[0] == CTX
    sc = scoring.scored_positions(CTX)
    return got[0][sc.start : sc.stop].double()


@pytest.mark.slow
def test_layer_errors(smol):
    from kvarn.run.layer_error import layer_errors

    lm, ids = smol
    zero = layer_errors(lm.model, ids, CellSpec("f32", "f32", 0))
    assert zero.height == 30 and (zero["rel_err_kv"] == 0).all() and (zero["rel_err_k"] == 0).all()
    q = layer_errors(lm.model, ids, CellSpec("q4_0", "q4_0", 0), ubatch=100)
    assert (q["n_rows"] == CTX - 1 - CTX // 2).all() and set(q["kind"]) == {"full"}
    ref, cell = _o_proj_input(lm, ids, "f32", "f32"), _o_proj_input(lm, ids, "q4_0", "q4_0")
    direct = float(((cell - ref).norm() / ref.norm()))
    assert q["rel_err_kv"][0] == pytest.approx(direct, rel=1e-4)
    assert (q["rel_err_kv"] > 0.01).all()
    # K-only and V-only errors are each smaller than both together, at every layer
    assert (q["rel_err_k"] < q["rel_err_kv"]).all() and (q["rel_err_v"] < q["rel_err_kv"]).all()
    assert lm.model.config._attn_implementation == "kvarn"  # restored
