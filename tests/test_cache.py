"""The cache model (DESIGN §2) on tiny random-weight models: no downloads, seconds on a CPU.

Oracle: the model's own plain single-pass sdpa forward. Tolerances come from fp32 noise
measured on the same model (eager vs sdpa plain forwards), not from magic numbers.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface

import attention_ref as AR
from kvarn.vocab.cell import CellSpec
import kvarn.kvcache.attention as kattn
from kvarn.kvcache.cache import KVarnCache, exact_selection
from kvarn.vocab.geometry import geometry_from_config
from kvarn.formats import get_format
from kvarn.vocab.policy import layer_policy


def layer_windows(config) -> list[int | None]:
    """Per decoder layer its sliding window W, or None for full attention (the geometry's reading)."""
    return list(geometry_from_config(config).windows)


N = 64  # tokens per test sequence


def _llama(n_layers: int = 2, max_positions: int = 512):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=max_positions)
    return LlamaForCausalLM(cfg).eval()


def _gemma(max_positions: int = 512):
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=32,
                           sliding_window=16, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=max_positions)
    return Gemma3ForCausalLM(cfg).eval()


MODELS = {"llama": _llama, "gemma3": _gemma}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def _ids(model, n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, n), generator=g)


@torch.no_grad()
def plain_logits(model, ids, impl="sdpa"):
    model.set_attn_implementation(impl)
    return model(ids).logits[0]


@torch.no_grad()
def cache_logits(model, ids, k="f32", v="f32", tail=0, ubatch=512, **kw):
    """Logits through the cache model, fed `ubatch` tokens at a time."""
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = KVarnCache(model.config, CellSpec(k, v, tail, **kw))
    out = [model(ids[:, s : s + ubatch], cache=cache, kvarn_cache=cache, use_cache=True).logits[0]
           for s in range(0, ids.shape[1], ubatch)]
    return torch.cat(out)


def fp32_noise(model, ids):
    """How far two correct fp32 implementations of the same forward drift apart here."""
    d = (plain_logits(model, ids, "eager") - plain_logits(model, ids, "sdpa")).abs().max().item()
    return max(d, 1e-6)


def test_f32_cache_equals_plain_forward(model):
    ids = _ids(model)
    ref = plain_logits(model, ids)
    tol = 2 * fp32_noise(model, ids)
    for ub in (512, 16):
        diff = (cache_logits(model, ids, ubatch=ub) - ref).abs().max().item()
        print(f"{type(model).__name__} ubatch {ub}: max |Δlogit| {diff:.3g} (fp32 noise tol {tol:.3g})")
        assert diff <= tol


def test_bf16_cell_is_deterministic(model):
    # The bf16 cell and the bf16 baseline run the same computation: identical logits, KLD 0.
    ids = _ids(model)
    a = cache_logits(model, ids, "bf16", "bf16", 0)
    b = cache_logits(model, ids, "bf16", "bf16", 0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("k,v,tail", [("f32", "f32", 0), ("q4_0", "q4_0", 8), ("q2_0", "q8_0", 0)])
def test_causal(model, k, v, tail):
    # A change of the last token must not change any earlier logit through the cache attention.
    ids = _ids(model)
    ids2 = ids.clone()
    ids2[0, -1] = (ids[0, -1] + 1) % model.config.vocab_size
    a = cache_logits(model, ids, k, v, tail)
    b = cache_logits(model, ids2, k, v, tail)
    assert torch.equal(a[:-1], b[:-1])
    assert not torch.equal(a[-1], b[-1])


def test_mask_registration_is_required(model):
    # Without the AttentionMaskInterface entry transformers passes no mask (no causality):
    # the attention refuses to run rather than silently attending to the future.
    saved = AttentionMaskInterface._global_mapping.pop(kattn.ATTN_NAME)
    try:
        with pytest.raises(RuntimeError, match="no boolean mask"):
            cache_logits(model, _ids(model, 8))
    finally:
        AttentionMaskInterface._global_mapping[kattn.ATTN_NAME] = saved


@torch.no_grad()
def checked_run(model, ids, k, v, tail, ubatch, **kw):
    """Feed ids through the cache model with every attention call checked against the
    float64 reference (tests/attention_ref.py) on the same inputs; returns the Recorder."""
    with AR.checking() as rec:
        model.set_attn_implementation(AR.CHECK_NAME)
        cache = KVarnCache(model.config, CellSpec(k, v, tail, **kw))
        for s in range(0, ids.shape[1], ubatch):
            model(ids[:, s : s + ubatch], cache=cache, kvarn_cache=cache, use_cache=True)
    assert rec.calls >= model.config.num_hidden_layers * -(-ids.shape[1] // ubatch)  # the checked path ran
    return rec


def assert_at_fp32_noise(rec, what):
    # kvarn's blocked sdpa vs the dense float64 reference on identical inputs: within a few
    # times the reference's own fp32 rounding (measured: at most 2.5x per call).
    worst, noise = max(rec.diffs), max(rec.noise)
    print(f"{what}: max |kvarn - ref64| {worst:.3g}, fp32 noise {noise:.3g} ({rec.calls} calls)")
    assert worst <= 4 * noise, (what, worst, noise)


@pytest.mark.parametrize("k,v,tail", [("f32", "f32", 0), ("bf16", "bf16", 0), ("q4_0", "q4_0", 8),
                                      ("q8_0", "q4_0", 0), ("q2_0", "q2_0", 5)])
def test_ubatch_independence(model, k, v, tail):
    # Two halves, each exact at its own scale:
    # 1. at every ubatch, each attention call returns what DESIGN §2 prescribes for the
    #    stored copies (the float64 reference on the same inputs) at fp32 noise. A tail or
    #    sink off by one reads a body key as exact or back: a quantization error, orders
    #    of magnitude above that noise (test_reference_check_catches_a_tail_off_by_one);
    # 2. the stored copies do not depend on how the tokens were split
    #    (test_storage_is_ubatch_independent: bit for bit).
    # End to end, ubatch only moves the f32 cache by fp32 noise (test_f32_cache_equals_plain_forward).
    ids = _ids(model)
    for ub in (512, 64, 7, 1):
        assert_at_fp32_noise(checked_run(model, ids, k, v, tail, ub), f"{type(model).__name__} {k}/{v} t{tail} ub{ub}")


@pytest.mark.parametrize("k,v,tail,tdt", [("q4_0", "q4_0", 8, torch.bfloat16), ("q2_0", "q8_0", 0, torch.bfloat16),
                                          ("kvarn4", "kvarn4", 0, torch.float16), ("f16", "bf16", 3, torch.float32)])
def test_storage_is_ubatch_independent(k, v, tail, tdt):
    # The same K/V fed in different splits leave bit-identical exact and body copies.
    from kvarn.kvcache.cache import KVarnLayer, make_format

    g = torch.Generator().manual_seed(3)
    K, V = torch.randn(1, 2, 300, 64, generator=g), torch.randn(1, 2, 300, 64, generator=g)
    kf, vf = make_format(k, "k", True, CellSpec.iters), make_format(v, "v", True, CellSpec.iters)
    stored = []
    for ub in (300, 100, 7, 1):
        layer = KVarnLayer(kf, vf, layer_policy(kf, vf, tail), tdt)
        for s in range(0, 300, ub):
            layer.update(K[..., s : s + ub, :], V[..., s : s + ub, :])
        stored.append((layer.keys, layer.values, layer.exact_keys, layer.exact_values))
    for other in stored[1:]:
        for a, b in zip(stored[0], other):
            assert torch.equal(a, b)
    assert not torch.equal(stored[0][0][..., :256, :], K[..., :256, :])  # the body really is quantized


def test_reference_check_catches_a_tail_off_by_one(monkeypatch):
    # The check above must be able to fail: an attention that reads one tail key too few
    # from the exact copy is far outside fp32 noise.
    model = _llama()
    ids = _ids(model)
    real = kattn.exact_selection

    def off_by_one(q_pos, kv_len, policy, kv_offset=0):
        from kvarn.vocab.policy import LayerPolicy

        return real(q_pos, kv_len, LayerPolicy(policy.sink, max(policy.tail - 1, 0), policy.window), kv_offset)
    monkeypatch.setattr(kattn, "exact_selection", off_by_one)
    rec = checked_run(model, ids, "q2_0", "q2_0", 5, 7)
    assert max(rec.diffs) > 100 * max(rec.noise)


def test_tail0_reads_own_key_from_body(model):
    # Standard tail 0: the body is read for every key, the query's own included, so the
    # result differs from tail 1 (own key exact) and from the f32 cache.
    ids = _ids(model, 16)
    t0 = cache_logits(model, ids, "q2_0", "q2_0", 0)
    t1 = cache_logits(model, ids, "q2_0", "q2_0", 1)
    tall = cache_logits(model, ids, "q2_0", "q2_0", 16, tail_dtype="f32")
    assert not torch.equal(t0, t1)
    assert (tall - cache_logits(model, ids)).abs().max() <= 2 * fp32_noise(model, ids)


def test_full_tail_bf16_equals_bf16_body(model):
    # A tail covering everything with a bf16 exact copy reads exactly what a bf16 body reads.
    ids = _ids(model)
    a = cache_logits(model, ids, "q4_0", "q4_0", N, tail_dtype="bf16")
    b = cache_logits(model, ids, "bf16", "bf16", 0)
    assert (a - b).abs().max() <= 2 * fp32_noise(model, ids)


# --- the selection: which keys each query reads exactly -------------------------------

def _expected(p, j, sink, tail, window):
    allowed = j <= p and (window is None or p - j < window)
    return allowed and (j < sink or p - j < tail)


def _check_split(policy, L=400, q_offset=0):
    n_q = L - q_offset
    p = torch.arange(q_offset, L)[:, None]
    j = torch.arange(L)[None, :]
    allowed = j <= p
    if policy.window is not None:
        allowed = allowed & (p - j < policy.window)
    body, exact = kattn.split_mask(allowed[None, None], q_offset, policy)
    body, exact = body[0, 0], exact[0, 0]
    assert not (body & exact).any()
    assert torch.equal(body | exact, allowed)
    for qi in range(0, n_q, 37):
        pq = q_offset + qi
        want = torch.tensor([_expected(pq, jj, policy.sink, policy.tail, policy.window) for jj in range(L)])
        assert torch.equal(exact[qi], want), (policy, pq)
    return body, exact


def test_selection_standard_tail0():
    q4 = get_format("q4_0")
    pol = layer_policy(q4, q4, 0)
    assert (pol.sink, pol.tail) == (0, 0)
    body, exact = _check_split(pol)
    assert not exact.any()


def test_selection_standard_tail_n():
    q4 = get_format("q4_0")
    pol = layer_policy(q4, q4, 100)
    assert (pol.sink, pol.tail) == (0, 100)
    _, exact = _check_split(pol, q_offset=50)
    assert torch.equal(exact.sum(-1), torch.clamp(torch.arange(50, 400) + 1, max=100))


def test_selection_kvarn_tail0_full_layer():
    kv = get_format("kvarn4")
    pol = layer_policy(kv, get_format("kvarn4", role="v"), 0)
    assert (pol.sink, pol.tail) == (128, 128)
    _, exact = _check_split(pol)
    # query 399 reads keys 0..127 (sink) and 272..399 (tail) exactly
    want = torch.zeros(400, dtype=torch.bool)
    want[:128] = True
    want[272:] = True
    assert torch.equal(exact[-1], want)


def test_selection_kvarn_sliding_layer():
    kv = get_format("kvarn4")
    pol = layer_policy(kv, get_format("kvarn4", role="v"), 300, window=200)
    assert (pol.sink, pol.tail, pol.window) == (0, 200, 200)
    body, exact = _check_split(pol)
    assert not body.any()  # the tail covers the whole window


def test_layer_windows():
    assert layer_windows(_gemma().config) == [16, 16, None]
    assert layer_windows(_llama().config) == [None, None]


def test_exact_selection_shape():
    pol = layer_policy(get_format("q8_0"), get_format("q8_0"), 3)
    sel = exact_selection(torch.tensor([5]), 6, pol)
    assert sel.tolist() == [[False, False, False, True, True, True]]


def test_kvarn_groups_and_ubatch(model):
    # 300 tokens: groups 0..127 and 128..255 are quantized, 256..299 is an incomplete group
    # (body rows zero, never read: kvarn.kvcache.attention asserts it). Queries at p >= 256 read
    # body keys 128..p-128 (sink 128 + tail 128 on full layers): KVarN numerics are used.
    # ubatch 100 completes groups in the middle of a ubatch; every attention call must
    # still be DESIGN §2 at fp32 noise.
    ids = _ids(model, 300)
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = KVarnCache(model.config, CellSpec("kvarn4", "kvarn4", 0))
    with torch.no_grad():
        model(ids, cache=cache, kvarn_cache=cache)
    for layer in cache.layers:
        assert (layer.n_tokens, layer.n_body) == (300, 256)
        assert (layer.keys[..., 256:, :] == 0).all()
        assert not torch.equal(layer.keys[..., :256, :], layer.exact_keys[..., :256, :])
    from kvarn.vocab.policy import exact_share

    assert exact_share(cache.policies, 300) < 1  # some scored read comes from the body
    for ub in (300, 100, 1):
        assert_at_fp32_noise(checked_run(model, ids, "kvarn4", "kvarn4", 0, ub), f"kvarn4 ub{ub}")



@pytest.mark.parametrize("name", ["kvarn4", "kivi2"])
def test_cache_builds_k_and_v_in_their_roles(model, name):
    # KVarnCache's own construction from a CellSpec (not formats set on its layers by hand): the
    # body K is the format's K roundtrip of the stored exact K (KVarN per channel, KIVI per channel),
    # the body V its V roundtrip (per token), and never the other role's, which differs here.
    ids = _ids(model, 128)  # one whole KVarN group, sealed into the body
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = KVarnCache(model.config, CellSpec(name, name, 128, tail_dtype="f32"))
    with torch.no_grad():
        model(ids, cache=cache, kvarn_cache=cache)
    own = {r: get_format(name, r) for r in ("k", "v")}
    for layer in cache.layers:
        for role, other, body, exact in (("k", "v", layer.keys, layer.exact_keys),
                                         ("v", "k", layer.values, layer.exact_values)):
            x = exact[..., :128, :].float().contiguous()
            assert torch.equal(body[..., :128, :], own[role].roundtrip(x)), (name, role)
            assert not torch.equal(body[..., :128, :], own[other].roundtrip(x)), (name, role)

def test_attention_softcap_is_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=16,
                       attn_logit_softcapping=50.0)
    with pytest.raises(NotImplementedError, match="softcapping"):
        cache_logits(Gemma2ForCausalLM(cfg).eval(), torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("k,v,tail", [("f32", "f32", 0), ("q4_0", "q4_0", 8), ("q8_0", "q8_0", 0)])
def test_query_blocks(model, k, v, tail, monkeypatch):
    # Blocking the queries only changes which masked-out keys are skipped: with blocks of
    # 5 queries every call is still DESIGN §2 at fp32 noise.
    ids = _ids(model)
    monkeypatch.setattr(kattn, "QUERY_BLOCK", 5)
    assert_at_fp32_noise(checked_run(model, ids, k, v, tail, 512), f"{k} query blocks of 5")
    if k == "f32":
        assert (cache_logits(model, ids) - plain_logits(model, ids)).abs().max() <= 2 * fp32_noise(model, ids)


# --- the exact share: what fraction of the scored reads a policy serves exactly ------------

@pytest.mark.parametrize("sink,tail,window,n_ctx", [
    (0, 0, None, 64), (0, 128, None, 512), (128, 128, None, 512), (128, 256, None, 2048),
    (0, 128, 200, 600), (3, 5, 16, 40), (0, 7, 4, 30), (128, 128, None, 256),
])
def test_exact_share_counts_the_selection(sink, tail, window, n_ctx):
    # Oracle: count the (scored query, key) pairs that attention's own selection
    # (exact_selection) marks exact among the causal / sliding-window allowed keys.
    from kvarn.vocab.policy import LayerPolicy, exact_pairs, exact_share

    pol = LayerPolicy(sink, tail, window)
    p = torch.arange(n_ctx // 2, n_ctx - 1)
    j = torch.arange(n_ctx)[None, :]
    allowed = (j <= p[:, None]) & ((p[:, None] - j < window) if window else True)
    sel = exact_selection(p, n_ctx, pol)
    want = (int((sel & allowed).sum()), int(allowed.sum()))
    assert exact_pairs(pol, n_ctx) == want
    assert exact_share([pol, pol], n_ctx) == want[0] / want[1]


def test_exact_share_of_kvarn_by_hand():
    # KVarN at n_ctx 512 (sink 128, tail 128) on a full layer: query p reads p + 1 keys, of
    # which 128 sink + 128 tail are exact, every scored p >= 256 => exact = 256 per query.
    from kvarn.vocab.policy import exact_share

    kv = get_format("kvarn4")
    pol = layer_policy(kv, get_format("kvarn4", role="v"), 0)
    reads = sum(p + 1 for p in range(256, 511))
    assert exact_share([pol], 512) == 256 * 255 / reads  # = 0.667: two thirds is exactness
    # at n_ctx 256 nothing is read from the body: the old end-to-end context tested no KVarN numerics
    assert exact_share([pol], 256) == 1.0
    # a standard type at tail 0 reads everything from the body
    assert exact_share([layer_policy(get_format("q4_0"), get_format("q4_0", role="v"), 0)], 2048) == 0.0


def test_standard_sink_is_read_exactly(model):
    # A standard type with a sink: the first `sink` keys are read from the exact copy on
    # full-attention layers (none on sliding ones), checked call by call against the
    # reference; and it differs from the same cell without a sink.
    ids = _ids(model)
    cache = KVarnCache(model.config, CellSpec("q2_0", "q2_0", 4, sink=8))
    for pol, w in zip(cache.kv_policies, layer_windows(model.config)):
        assert pol.sink == (8 if w is None else 0) and pol.tail == 4
    for ub in (64, 5):
        assert_at_fp32_noise(checked_run(model, ids, "q2_0", "q2_0", 4, ub, sink=8), f"q2_0 sink 8 ub{ub}")
    assert not torch.equal(cache_logits(model, ids, "q2_0", "q2_0", 4, sink=8), cache_logits(model, ids, "q2_0", "q2_0", 4))
    with pytest.raises(ValueError, match="KVarN's sink is fixed at 128"):
        CellSpec("kvarn4", "kvarn4", 0, sink=0)


def test_a_sink_of_one_keeps_an_exact_copy(model):
    # the smallest sink, with no tail and a per-token type: the one key read exactly is the only
    # reason the layer keeps an exact copy at all
    cache = KVarnCache(model.config, CellSpec("q2_0", "q2_0", 0, sink=1))
    assert [layer.keep_exact for layer in cache.layers] == [pol.sink == 1 for pol in cache.kv_policies]
    assert_at_fp32_noise(checked_run(model, _ids(model), "q2_0", "q2_0", 0, 64, sink=1), "q2_0 sink 1")
