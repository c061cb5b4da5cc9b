"""The flex attention path (kvarn.kvcache.flex) against the float64 reference and the reference path.

Every attention call of a tiny random-weight model is computed three ways on the very same
inputs: the flex path (returned to the model), the reference path (`attention_ref`, sdpa
per query block) and the dense float64 reference of tests/attention_ref.py; both paths must
sit within a few times the reference's own fp32 noise (the method of tests/test_cache.py).
flex_attention runs eagerly here (`kvarn.kvcache.flex.COMPILE = False`: an unfused dense path, fast
at these sizes; compiling on CPU takes minutes); bench/perf/flex.py runs the compiled kernel.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import attention_ref as AR
from kvarn.vocab.cell import CellSpec
import kvarn.kvcache.attention as kattn
import kvarn.kvcache.flex as kflex
from kvarn.vocab import scoring
from kvarn.kvcache.cache import KVarnCache
from kvarn.formats import get_format
from kvarn.vocab.policy import layer_policy
from test_cache import _gemma, _ids, _llama

# One xdist worker: the module fixtures load SmolLM2 once.
pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.xdist_group("flex")]
BOTH = "kvarn_both"


@pytest.fixture(autouse=True)
def eager_flex(monkeypatch):
    monkeypatch.setattr(kflex, "COMPILE", False)


@contextlib.contextmanager
def both_paths(sample=None):
    """Register BOTH: each call runs flex (returned) and ref, and, on the layers `sample`
    selects (default all), the float64 reference (dense: the costly part on a real model)."""
    rec = SimpleNamespace(flex=[], ref=[], flex_ref=[], noise=[], calls=0)

    def fwd(module, query, key, value, attention_mask, scaling=None, kvarn_cache=None, **kw):
        out = {}
        for path in ("ref", "flex"):
            kvarn_cache.attention = path
            out[path], _ = kattn.kvarn_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                                         kvarn_cache=kvarn_cache, **kw)
        rec.flex_ref.append((out["flex"] - out["ref"]).abs().max().item())
        rec.calls += 1
        if sample is not None and not sample(module.layer_idx):
            return out["flex"], None
        layer = kvarn_cache.layers[module.layer_idx]
        sc = scaling if scaling is not None else query.shape[-1] ** -0.5
        ref64 = AR.reference_attention(query, layer, sc, key, value).transpose(1, 2)
        ref32 = AR.reference_attention(query, layer, sc, key, value, torch.float32).transpose(1, 2)
        rec.flex.append((out["flex"].double() - ref64).abs().max().item())
        rec.ref.append((out["ref"].double() - ref64).abs().max().item())
        rec.noise.append((ref32.double() - ref64).abs().max().item())
        return out["flex"], None

    with AR.registered(BOTH, fwd):
        yield rec


@torch.no_grad()
def both_run(model, ids, k, v, tail, ubatch, sample=None, **kw):
    before = kflex.calls
    with both_paths(sample) as rec:
        model.set_attn_implementation(BOTH)
        cache = KVarnCache(model.config, CellSpec(k, v, tail, **kw), attention="flex")
        for s in range(0, ids.shape[1], ubatch):
            model(ids[:, s : s + ubatch], cache=cache, kvarn_cache=cache, use_cache=True)
    n = model.config.num_hidden_layers * -(-ids.shape[1] // ubatch)
    assert rec.calls >= n and kflex.calls - before >= n  # the flex path really ran, every call
    return rec, cache


def assert_paths_at_fp32_noise(rec, what):
    noise = max(rec.noise)
    print(f"{what}: flex-ref64 {max(rec.flex):.3g}, ref-ref64 {max(rec.ref):.3g}, flex-ref {max(rec.flex_ref):.3g}, "
          f"fp32 noise {noise:.3g} ({rec.calls} calls)")
    assert max(rec.flex) <= 4 * noise, (what, max(rec.flex), noise)
    assert max(rec.ref) <= 4 * noise, (what, max(rec.ref), noise)
    assert max(rec.flex_ref) <= 4 * noise, (what, max(rec.flex_ref), noise)


MODELS = {"llama": _llama, "gemma3": _gemma}  # full GQA 4/2; sliding window 16 (kv_offset > 0) GQA 4/1


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.mark.parametrize("k,v,tail,kw,ubatches", [
    ("f32", "f32", 0, {}, (64, 13)),
    ("bf16", "bf16", 0, {}, (64, 13)),  # the baseline: no exact copy at all
    ("q4_0", "q4_0", 8, {}, (64, 13, 1)),  # ubatch 1: the decode regime
    ("q2_0", "q2_0", 5, {"sink": 8}, (64, 7)),  # a sink on full layers
    ("q4_0", "q8_0", 100, {}, (64,)),  # tail > L: everything exact
    ("q2_0", "q8_0", 0, {}, (64, 7)),  # tail 0: even the own key from the body
])
def test_flex_matches_reference(model, k, v, tail, kw, ubatches):
    ids = _ids(model)
    for ub in ubatches:
        rec, _ = both_run(model, ids, k, v, tail, ub, **kw)
        assert_paths_at_fp32_noise(rec, f"{type(model).__name__} {k}/{v} t{tail} {kw} ub{ub}")


def test_flex_kvarn_groups(model):
    # 300 tokens: two sealed KVarN groups and an incomplete one; ubatch 100 seals groups
    # mid-ubatch. The full layers read body keys 128..p-128.
    ids = _ids(model, 300)
    for ub in (300, 100):
        rec, cache = both_run(model, ids, "kvarn4", "kvarn4", 0, ub)
        assert_paths_at_fp32_noise(rec, f"{type(model).__name__} kvarn4 ub{ub}")
    assert all(layer.n_body == 256 for layer in cache.layers)


def test_decode_batch_on_flex():
    # kvarn.run.decode: 3 prompts as one batch, then one token at a time, both caches on flex;
    # the same greedy text as on ref (an f32 cell: continuous in its inputs).
    import numpy as np

    from kvarn.run.decode import decode

    model = _llama()
    model.set_attn_implementation(kattn.ATTN_NAME)
    prompts = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(5))
    before = kflex.calls
    a = decode(model, prompts, CellSpec("f32", "f32", 0), 6, ubatch=16, attention="flex")
    # 2 layers x (the cell: 3 prompt ubatches + 5 steps; the baseline: 3 + one forward of the block's 5 tokens)
    assert kflex.calls - before == 2 * ((3 + 5) + (3 + 1))
    b = decode(model, prompts, CellSpec("f32", "f32", 0), 6, ubatch=16, attention="ref")
    assert np.array_equal(a["token"], b["token"]) and np.array_equal(a["base_token"], b["base_token"])
    np.testing.assert_allclose(a["nll_base"], b["nll_base"], rtol=1e-5)


def test_flex_with_swapped_sources_is_caught():
    # The check must be able to fail: a mask_mod reading exact keys from the body and back.
    model = _llama()
    real = kflex.reads_exact
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kflex, "reads_exact", lambda p, j, s, t: ~real(p, j, s, t))
        rec, _ = both_run(model, _ids(model), "q2_0", "q2_0", 5, 64)
    assert max(rec.flex) > 100 * max(rec.noise) and max(rec.ref) <= 4 * max(rec.noise)


def test_flex_refuses_a_mask_it_does_not_compute(monkeypatch):
    # The model's mask is checked against the mask_mod's causal / sliding rule: a rule
    # without the window (or a model mask with padding) is refused, not silently used.
    model = _gemma()
    monkeypatch.setattr(kflex, "allowed", lambda p, j, window: j <= p)
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = KVarnCache(model.config, CellSpec("q4_0", "q4_0", 0), attention="flex")
    with pytest.raises(RuntimeError, match="sliding-window"), torch.no_grad():
        model(_ids(model), cache=cache, kvarn_cache=cache, use_cache=True)


def test_flex_refuses_an_incomplete_kvarn_group():
    # The shared KVarN check: a tail that does not cover the incomplete group is refused.
    kv = get_format("kvarn4")
    pol = layer_policy(kv, get_format("kvarn4", role="v"), 0)
    layer = SimpleNamespace(q_offset=256, kv_offset=0, n_body=128, group=128, policy=pol)
    mask = torch.ones(1, 1, 44, 300, dtype=torch.bool).tril(256)
    with pytest.raises(AssertionError, match="incomplete 128-token group"):
        kflex.check_mask(SimpleNamespace(layer_idx=0), layer, pol, mask, 44, 300)


def test_block_mask_skips_blocks():
    # A ubatch of 512 queries at 1536..2047 over 2048 body + 2048 exact rows, q4_0 tail 128:
    # the exact half is read only in the tail band. The BlockMask must be exactly the
    # blocks the dense mask_mod touches, and skip most of them.
    pol = layer_policy(get_format("q4_0"), get_format("q4_0", role="v"), 128)
    bm = kflex.block_mask(1536, 512, 0, 2048, 2048, pol, "cpu")
    p = torch.arange(1536, 2048)[:, None]
    r = torch.arange(4096)[None, :]
    j = r % 2048
    dense = (j <= p) & ((r >= 2048) == (p - j < 128))
    touched = dense.view(4, 128, 32, 128).any(3).any(1)
    assert torch.equal(bm.to_dense()[0, 0].bool(), touched)
    # Query block i (positions 1536 + 128 i ..) reads body blocks 0 .. 11 + i (j <= p - 128)
    # and two exact blocks (its tail band j in p - 127 .. p): 54 + 8 of 128 blocks.
    assert touched[:, :16].sum() == 12 + 13 + 14 + 15 and touched[:, 16:].sum() == 4 * 2
    assert bm.sparsity() == pytest.approx(100 * (1 - 62 / 128))


@pytest.mark.parametrize("make,kinds", [(_llama, 1), (_gemma, 2)])
def test_block_mask_is_built_once_per_layer_kind_and_ubatch(make, kinds):
    # Llama: 2 full layers; Gemma 3: 2 sliding and 1 full. Per ubatch one mask per layer kind, the
    # other layers of that kind reuse it; the flex path still agrees with the reference on every call.
    model, ids = make(), _ids(make(), 96)
    kflex.clear_masks()
    before = kflex.built
    rec, _ = both_run(model, ids, "q4_0", "q4_0", 8, 32)
    assert kflex.built - before == 3 * kinds
    assert_paths_at_fp32_noise(rec, f"{type(model).__name__} mask reuse")
    # a mask from the cache is the one its key would build
    pol = layer_policy(get_format("q4_0"), get_format("q4_0", role="v"), 8)
    a = kflex.block_mask(64, 32, 0, 96, 96, pol, "cpu")
    assert kflex.block_mask(64, 32, 0, 96, 96, pol, "cpu") is a
    assert torch.equal(a.to_dense(), kflex.build_block_mask(64, 32, 0, 96, 96, pol, "cpu").to_dense())
    assert kflex.block_mask(32, 32, 0, 96, 96, pol, "cpu") is not a  # another ubatch: its own


def test_attention_option_is_checked():
    with pytest.raises(ValueError, match="attention 'fast' not accepted; use one of ref, flex, auto"):
        kattn.resolve_attention("fast", "cpu")
    assert kattn.resolve_attention("auto", "cpu") == "ref" and kattn.resolve_attention("auto", "cuda:0") == "flex"
    from kvarn.run.forward import attention_path

    assert attention_path("auto", "cpu", "exact") == "ref" and attention_path("flex", "cpu", "llamacpp-cpu") is None
    with pytest.raises(ValueError, match="attention 'x' not accepted"):
        attention_path("x", "cpu", "llamacpp-cpu")
    with pytest.raises(ValueError, match="attention path 'auto' not accepted"):
        KVarnCache(_llama().config, CellSpec("q4_0", "q4_0", 0), attention="auto")


# --- end to end on the embedded SmolLM2 ------------------------------------------------------

E2E_LEN = 384  # tokens: KVarN seals a 128-group mid-ubatch and queries p >= 256 read its body
CELL_CTX = 256  # the engine's bf16 cell and baseline


@pytest.fixture(scope="module")
def smol():
    """SmolLM2 loaded once, as an load.Context at CELL_CTX (the engine runs below share
    it), and the first E2E_LEN tokens of the text's first 512-token chunk."""
    from paths import CACHE_DIR, ENGINE_TEXT

    from kvarn.baseline import data

    from kvarn.run import load
    from kvarn.weights.sources import ModelSpec

    context = load.Context(ModelSpec("smollm2-135m", "embedded:smollm2-135m"), CELL_CTX, 1, ENGINE_TEXT,
                             cache_dir=CACHE_DIR)
    lm = context.loaded
    ids = data.make_chunks(data.tokenize(lm.tokenizer, data.load_text(ENGINE_TEXT)), 512, 1, lm.info.bos_id)[0]
    return lm, ids[:E2E_LEN], context


def _logprobs(lm, ids, k, v, tail, attention, ubatch=512):
    from kvarn.run import forward

    lm.model.set_attn_implementation(kattn.ATTN_NAME)
    cache = forward.new_cache(lm.model, CellSpec(k, v, tail), attention=attention)
    sc = scoring.scored_positions(ids.shape[0])
    return torch.cat([lp for _, lp in forward.chunk_logprobs(lm.model, ids, cache, ubatch, sc)])


@torch.inference_mode()
def _plain(lm, ids, impl):
    """The model's own single pass, its head applied at the scored positions only."""

    lm.model.set_attn_implementation(impl)
    sc = scoring.scored_positions(ids.shape[0])
    logits = lm.model(ids[None], logits_to_keep=torch.arange(sc.start, sc.stop)).logits[0]
    assert logits.shape[0] == len(sc)
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.slow
def test_smollm2_flex_matches_ref(smol):
    # f32: the per-token log-probs of the scored half, flex vs ref, within the model's own
    # fp32 noise (eager vs sdpa plain forwards: the tolerance of tests/test_engine.py).
    lm, ids, _ = smol
    noise = max((_plain(lm, ids, "eager") - _plain(lm, ids, "sdpa")).abs().max().item(), 1e-6)
    before = kflex.calls
    flex = _logprobs(lm, ids, "f32", "f32", 0, "flex", ubatch=150)
    assert kflex.calls - before == 30 * 3  # 30 layers, 3 ubatches: every call on the flex path
    diff = (flex - _logprobs(lm, ids, "f32", "f32", 0, "ref")).abs().max().item()
    print(f"smollm2 f32: flex vs ref max |dlogp| {diff:.3g} (eager vs sdpa {noise:.3g})")
    assert diff <= 2 * noise
    # Quantized cells are not continuous in their inputs: fp32 noise in a K flips a rounding
    # decision of q4_0 / KVarN, so two correct paths (or the ref path at two ubatches) end
    # 0.1-1 nats apart in a few log-probs (bench/perf/results/flex.md). What must hold is every
    # attention call at fp32 noise on the same inputs: flex vs ref on all 30 layers, and
    # both vs the float64 reference on layers 0 and 15 (the dense reference is the slow part).
    # 384 tokens in ubatches of 192: KVarN seals a group mid-ubatch and queries p >= 256 read
    # its body keys 128 .. p - 128.
    for k, tail in (("q4_0", 128), ("kvarn4", 0)):
        rec, cache = both_run(lm.model, ids[None], k, k, tail, 192, sample=lambda i: i % 15 == 0)
        assert_paths_at_fp32_noise(rec, f"smollm2 {k} t{tail}")
        assert len(rec.noise) == 2 * 2 and rec.calls == 30 * 2
        if k == "kvarn4":
            assert cache.layers[0].n_body == 384


@pytest.mark.slow
def test_smollm2_bf16_cell_is_the_baseline_on_flex(smol, tmp_path):
    # Same computation on the flex path => bit-identical log-probs => KLD exactly 0; through
    # the engine the dump and the summary record the path taken.
    import json

    from paths import CACHE_DIR, ENGINE_TEXT

    from kvarn.baseline import dump

    from kvarn.run import torch_engine

    from kvarn.stats import metrics
    from kvarn.weights.sources import ModelSpec

    lm, ids, context = smol
    ids = ids[:CELL_CTX]
    a = _logprobs(lm, ids, "bf16", "bf16", 0, "flex")
    b = _logprobs(lm, ids, "bf16", "bf16", 0, "flex")
    assert torch.equal(a, b)
    tm = metrics.token_metrics(a, b, ids[129:256])
    assert (tm["kld"] == 0).all() and tm["same_top"].all()

    spec, ctx = ModelSpec("smollm2-135m", "embedded:smollm2-135m"), CELL_CTX
    assert torch.equal(context.chunk_ids[0], ids)  # the engine's chunk is the one scored above
    base = torch_engine.run_baseline(spec, ctx, 1, tmp_path / "base.kvd", text=ENGINE_TEXT, cache_dir=CACHE_DIR,
                               attention="flex", context=context)
    assert base["attention"] == "flex" and dump.open_dump(tmp_path / "base.kvd").header["attention"] == "flex"
    before = kflex.calls
    s = torch_engine.run_cell(spec, ctx, 1, CellSpec("bf16", "bf16", 0), tmp_path / "base.kvd", tmp_path / "cell",
                        text=ENGINE_TEXT, cache_dir=CACHE_DIR, attention="flex", context=context)
    assert kflex.calls - before == 30
    assert (s["attention"], s["baseline_attention"]) == ("flex", "flex")
    assert json.loads((tmp_path / "cell" / "summary.json").read_text())["attention"] == "flex"
    assert abs(s["kld_max"]) <= 1.3e-4 and s["same_top"] == 1.0  # the dump's encoding error only
