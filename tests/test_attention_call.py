"""One attention call of the cache model, called directly: its refusals (each naming the value and
the fix), its dispatch to the reference or the flex path, and what the cache stores for it.

The whole-model tests (test_cache.py, test_flex.py) run these paths through transformers, which
always passes the same keyword arguments; here the function's own defaults and each refusal's text
are checked, on one real Llama attention layer.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import kvarn.kvcache.attention as kattn
import kvarn.kvcache.flex as kflex
import kvarn.llamacpp_cpu.compute as kcompute
from kvarn.kvcache.attention import kvarn_attention_forward, resolve_attention, split_mask
from kvarn.formats.hadamard import rotate_blocks
from kvarn.kvcache.cache import KVarnCache, KVarnLayer, exact_selection
from kvarn.llamacpp_cpu.channel_order import gguf_order
from kvarn.vocab.cell import CellSpec
from kvarn.vocab.policy import LayerPolicy

H, H_KV, D = 4, 2, 128


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=H, num_key_value_heads=H_KV, head_dim=D, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def module_of(model):
    return model.model.layers[0].self_attn


def causal(n_q: int, L: int) -> torch.Tensor:
    """The boolean mask transformers passes: queries at L - n_q .. L - 1 over keys 0 .. L - 1."""
    p = torch.arange(L - n_q, L)[:, None]
    return (torch.arange(L)[None, :] <= p)[None, None]


def filled(model, cell: CellSpec, n: int, attention: str = "ref", seed: int = 0):
    """A cache for `cell` holding n random tokens on layer 0; returns (cache, query, body K, body V)."""
    g = torch.Generator().manual_seed(seed)
    cache = KVarnCache(model.config, cell, attention=attention)
    k, v = torch.randn(1, H_KV, n, D, generator=g), torch.randn(1, H_KV, n, D, generator=g)
    keys, values = cache.layers[0].update(k, v)
    return cache, torch.randn(1, H, n, D, generator=g), keys, values


def plain_sdpa(q, k, v):
    """fp32 causal attention with the KV heads repeated (transformers' sdpa path), [b, n, H, D]."""
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    return out.transpose(1, 2)


def test_a_direct_call_takes_its_defaults(llama):
    # no dropout, scaling or window passed: an f32 cell at tail 0 is plain causal attention
    cache, q, k, v = filled(llama, CellSpec("f32", "f32", 0), 12)
    out, weights = kvarn_attention_forward(module_of(llama), q, k, v, causal(12, 12), kvarn_cache=cache)
    assert weights is None and out.shape == (1, 12, H, D)
    torch.testing.assert_close(out, plain_sdpa(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compute", ["tf32-attn", "bf16-attn"])
def test_a_rounded_path_takes_the_default_scaling(llama, compute):
    # with no scaling passed, 1/sqrt(D), as if passed
    cache, q, k, v = filled(llama, CellSpec("q8_0", "q8_0", 0, compute=compute), 12)
    default, _ = kvarn_attention_forward(module_of(llama), q, k, v, causal(12, 12), kvarn_cache=cache)
    given, _ = kvarn_attention_forward(module_of(llama), q, k, v, causal(12, 12), scaling=D ** -0.5, kvarn_cache=cache)
    assert torch.equal(default, given)


def test_the_llamacpp_path_gets_the_models_scaling(llama):
    # compute llamacpp-cpu: the call goes to kvarn.llamacpp_cpu.compute with the model's scaling, 1/sqrt(D)
    # when none is passed
    cache, q, k, v = filled(llama, CellSpec("q8_0", "q8_0", 0, compute="llamacpp-cpu"), 12)
    layer, module, mask = cache.layers[0], module_of(llama), causal(12, 12)
    for scaling in (0.05, None):
        out, _ = kvarn_attention_forward(module, q, k, v, mask, scaling=scaling, kvarn_cache=cache)
        assert torch.equal(out, kcompute.attention(module, q, layer, mask, scaling or D ** -0.5))
    assert not torch.equal(out, kcompute.attention(module, q, layer, mask, 0.05))


def test_flex_and_ref_paths_agree_on_one_call(llama, monkeypatch):
    # the cache's `attention` picks the path: flex (eager here) ran, and gives the reference
    # path's numbers on a cell with both copies read (q4_0 body, an exact tail of 4), with the
    # model's scaling (Gemma's query_pre_attn_scalar makes it other than 1/sqrt(D))
    monkeypatch.setattr(kflex, "COMPILE", False)
    cell = CellSpec("q4_0", "q4_0", 4)
    out = {}
    for path in ("ref", "flex"):
        cache, q, k, v = filled(llama, cell, 12, attention=path)
        assert cache.attention == path
        before = kflex.calls
        out[path], _ = kvarn_attention_forward(module_of(llama), q, k, v, causal(12, 12), scaling=0.05,
                                               kvarn_cache=cache)
        assert kflex.calls - before == (path == "flex")
    torch.testing.assert_close(out["flex"], out["ref"], rtol=1e-5, atol=1e-6)
    # and the body and the scaling are really used: the same call on the f32 cell, or at the
    # default scaling, differs by more than that noise
    cache, q, k, v = filled(llama, CellSpec("f32", "f32", 0), 12)
    f32, _ = kvarn_attention_forward(module_of(llama), q, k, v, causal(12, 12), scaling=0.05, kvarn_cache=cache)
    assert (f32 - out["ref"]).abs().max() > 1e-3
    cache, q, k, v = filled(llama, cell, 12)
    default, _ = kvarn_attention_forward(module_of(llama), q, k, v, causal(12, 12), kvarn_cache=cache)
    assert (default - out["ref"]).abs().max() > 1e-3


def test_each_refusal_names_the_value_and_the_fix(llama, monkeypatch):
    module = module_of(llama)
    cache, q, k, v = filled(llama, CellSpec("f32", "f32", 0), 6)
    mask = causal(6, 6)

    def call(**kw):
        args = {"module": module, "query": q, "key": k, "value": v, "attention_mask": mask, "kvarn_cache": cache}
        return kvarn_attention_forward(**{**args, **kw})

    with pytest.raises(RuntimeError, match=r"needs the cache passed as a forward kwarg: model\(ids, cache=cache, "
                                           r"kvarn_cache=cache\)"):
        call(kvarn_cache=None)
    with pytest.raises(NotImplementedError, match=r"softcapping \(30\.0\) is not supported by the kvarn cache model "
                                                  r"\(Gemma 2 style\); Gemma 3 and models without it are"):
        call(softcap=30.0)
    with pytest.raises(ValueError, match=r"dropout 0\.1 in attention: put the model in eval\(\) mode"):
        call(dropout=0.1)
    for bad in (None, mask.float()):
        with pytest.raises(RuntimeError, match=r"no boolean mask: 'kvarn' must be registered with "
                                               r"masking_utils\.AttentionMaskInterface \(import kvarn\.kvcache"):
            call(attention_mask=bad)
    with pytest.raises(RuntimeError, match="model uses sliding window 16, cache policy expects None"):
        call(sliding_window=16)
    with pytest.raises(RuntimeError, match=r"layer 0: the mask covers 5 keys, the cache returned 6 \(from position 0\)"):
        call(attention_mask=mask[..., :5])
    monkeypatch.setattr(module, "is_causal", False)
    with pytest.raises(NotImplementedError, match="layer 0 attends bidirectionally .* the kvarn cache model is for "
                                                  "causal decoders"):
        call()
    monkeypatch.setattr(module, "is_causal", True)
    cache.policies[0] = None  # this test's own cache
    with pytest.raises(RuntimeError, match=r"layer 0 calls attention, but the config gives it a layer type without a "
                                           r"KV cache \(full_attention\)"):
        call()


@pytest.mark.parametrize("path", ["ref", "flex"])
def test_an_incomplete_group_read_from_the_body_is_refused(llama, path, monkeypatch):
    # KVarN seals 128-token groups: after 200 tokens rows 128.. of the body are zeros. With the
    # tail cut to 8 (a broken policy) the query at 199 would read body rows up to 191.
    monkeypatch.setattr(kflex, "COMPILE", False)
    cache, q, k, v = filled(llama, CellSpec("kvarn4", "kvarn4", 128), 200, attention=path)
    assert cache.layers[0].n_body == 128
    cache.policies[0] = dataclasses.replace(cache.policies[0], tail=8)
    with pytest.raises(AssertionError, match=r"^layer 0: a query reads body rows 128\.\.191 of an incomplete "
                                             r"128-token group; the tail \(128\) must cover them$"):
        kvarn_attention_forward(module_of(llama), q, k, v, causal(200, 200), kvarn_cache=cache)


def test_resolve_attention():
    assert resolve_attention("auto", "cuda") == "flex"
    assert resolve_attention("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_attention("auto", "cpu") == "ref"
    assert resolve_attention("flex", "cpu") == "flex"
    assert resolve_attention("ref", "cuda") == "ref"
    with pytest.raises(ValueError, match="attention 'sdpa' not accepted; use one of ref, flex, auto"):
        resolve_attention("sdpa", "cpu")


def test_the_selection_stays_on_the_masks_device():
    # built on the mask's device (a CUDA run's mask is on the GPU): here the meta device, where a
    # tensor made on the CPU by mistake cannot be combined with it
    allowed = torch.ones(1, 1, 4, 6, dtype=torch.bool, device="meta")
    body, exact = split_mask(allowed, 2, LayerPolicy(1, 2, None))
    assert body.device.type == exact.device.type == "meta" and body.shape == (1, 1, 4, 6)
    sel = exact_selection(torch.arange(2, 6, device="meta"), 6, LayerPolicy(1, 2, None))
    assert sel.device.type == "meta" and sel.shape == (4, 6)


def test_the_cache_keeps_what_it_was_built_with(llama):
    cell = CellSpec("q4_0", "q8_0", 4)
    cache = KVarnCache(llama.config, cell, attention="flex")
    assert cache.cell is cell and cache.attention == "flex"
    with pytest.raises(TypeError, match=r"KVarnCache takes a kvarn\.vocab\.cell\.CellSpec \(validated once there\), "
                                        r"got 'q4_0'"):
        KVarnCache(llama.config, "q4_0")
    with pytest.raises(ValueError, match="attention path 'auto' not accepted; use one of ref, flex"):
        KVarnCache(llama.config, cell, attention="auto")
    # BeeLlama's scalar route: llamacpp-cpu with a tail (or a KVarN pair), not at tail 0
    assert KVarnCache(llama.config, CellSpec("q8_0", "q8_0", 32, compute="llamacpp-cpu")).scalar_route
    assert not KVarnCache(llama.config, CellSpec("q8_0", "q8_0", 0, compute="llamacpp-cpu")).scalar_route
    assert not KVarnCache(llama.config, CellSpec("q8_0", "q8_0", 32)).scalar_route


def test_what_each_copy_stores(llama):
    # the exact copy holds the tail dtype's values of K and V (bf16 for standard types); the body
    # a float type's own dtype (bf16 V), fp32 for a quantized type's dequantized values (q4_0 K)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, H_KV, 5, D, generator=g), torch.randn(1, H_KV, 5, D, generator=g)
    cache = KVarnCache(llama.config, CellSpec("q4_0", "bf16", 2))
    layer = cache.layers[0]
    keys, values = layer.update(k, v)
    assert layer.exact_keys.dtype == layer.exact_values.dtype == torch.bfloat16
    assert torch.equal(layer.exact_keys, k.to(torch.bfloat16)) and torch.equal(layer.exact_values, v.to(torch.bfloat16))
    assert keys.dtype == torch.float32 and values.dtype == torch.bfloat16
    assert torch.equal(values, v.to(torch.bfloat16)) and torch.equal(keys, cache.k_fmt.roundtrip(k))


@pytest.mark.parametrize("k, v, role, value, where", [
    # KVarN stages in f16: a V of 1e6 (beyond f16's 65504)
    ("kvarn4", "kvarn4", "v", 1e6, "V (exact, float16)"),
    # q4_0's f16 scale: a K of 1e8 (bf16 holds it exactly; after the rotation its block's largest
    # value is still beyond 8 x 65504)
    ("q4_0", "q4_0", "k", 1e8, "K (body, q4_0)"),
])  # fmt: skip
def test_a_value_a_copy_cannot_hold_names_its_token(llama, k, v, role, value, where):
    # at token 3 of the second ubatch of 4, head 1
    cache = KVarnCache(llama.config, CellSpec(k, v, 128 if k.startswith("kvarn") else 0))
    layer = cache.layers[0]
    layer.update(torch.zeros(1, H_KV, 4, D), torch.zeros(1, H_KV, 4, D))
    new = {"k": torch.zeros(1, H_KV, 4, D), "v": torch.zeros(1, H_KV, 4, D)}
    new[role][0, 1, 3, 5] = value
    with pytest.raises(ValueError, match=rf"^layer 0, {re.escape(where)} head 1, token 7: "):
        layer.update(new["k"], new["v"])


def test_beellamas_scalar_route_keeps_the_exact_copy_in_the_rotated_frame(llama):
    # a rotated standard cache with a tail on a llama-arch model: llama.cpp rotates K (in the GGUF's
    # channel order) and V (in the model's) before storing them, the exact copy's bf16 included;
    # the layer keeps that rounding rotated back, in transformers' channel order
    cache = KVarnCache(llama.config, CellSpec("q4_0", "q4_0", 4, compute="llamacpp-cpu"))
    assert cache.scalar_route and cache.qk_gguf_order
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, H_KV, 5, D, generator=g), torch.randn(1, H_KV, 5, D, generator=g)
    layer = cache.layers[0]
    layer.update(k, v)
    bk, bv = cache.k_fmt.rotation_block(D), cache.v_fmt.rotation_block(D)

    def rounded(x, block):
        return rotate_blocks(rotate_blocks(x, block).to(torch.bfloat16).float(), block)

    order = gguf_order(D, k.device)
    assert torch.equal(layer.exact_values, rounded(v, bv))
    assert torch.equal(layer.exact_keys, rounded(k[..., order], bk)[..., torch.argsort(order)])
    assert not torch.equal(layer.exact_values, rounded(v[..., order], bv)[..., torch.argsort(order)])


def test_reset_empties_a_layer(llama):
    # transformers' Cache.reset: a reset layer fed the same tokens holds what a new one does
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, H_KV, 5, D, generator=g), torch.randn(1, H_KV, 5, D, generator=g)
    used = KVarnCache(llama.config, CellSpec("q4_0", "q8_0", 2)).layers[0]
    used.update(2 * k, 2 * v)
    used.reset()
    assert (used.n_tokens, used.n_body, used.q_offset, used.kv_offset, used.is_initialized) == (0, 0, 0, 0, False)
    fresh = KVarnCache(llama.config, CellSpec("q4_0", "q8_0", 2)).layers[0]
    for layer in (used, fresh):
        layer.update(k, v)
    assert used.get_seq_length() == 5 and used.get_mask_sizes(1) == fresh.get_mask_sizes(1) == (6, 0)
    for name in ("keys", "values", "exact_keys", "exact_values"):
        assert torch.equal(getattr(used, name), getattr(fresh, name)), name


def test_a_layer_without_a_kv_cache_keeps_transformers_own_state():
    # Qwen 3.5's Gated DeltaNet layers: no policy, transformers' own cache layer; the full layer a KVarnLayer
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_value_heads=4,
                            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                            layer_types=["linear_attention"] * 3 + ["full_attention"])
    cache = KVarnCache(cfg, CellSpec("q8_0", "q8_0", 0))
    assert cache.policies[:3] == [None] * 3 and cache.policies[3] == LayerPolicy(0, 0, None)
    assert [type(layer).__name__ for layer in cache.layers[:3]] == ["LinearAttentionLayer"] * 3
    assert isinstance(cache.layers[3], KVarnLayer) and cache.kv_policies == [cache.policies[3]]

