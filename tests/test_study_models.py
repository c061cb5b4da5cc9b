"""The study's own architectures through the cache model, on tiny random-weight models.

* Qwen 3.5/3.6 (`qwen3_5`): hybrid, 2 x (3 Gated DeltaNet `linear_attention` + 1 gated
  `full_attention`) layers. The linear layers keep transformers' own conv/recurrent
  state; only the attention layers go through the cache model.
* Gemma 4 (`gemma4`): 5 sliding layers (window 32) + 1 full layer whose head dim (128 vs
  64) and KV heads (1 vs 2) are per-layer overrides, with `attention_k_eq_v`.

Built from the real config classes, fp32, seeded; no downloads. Oracles: the model's own
forward (one pass, and its own `DynamicCache` fed in ubatches). "fp32 noise" is measured,
not assumed: the same computation with the model in float64 (the cache path itself stays
fp32), so a quantized cell's noise reference includes the rounding flips that fp32 noise
upstream of the cache causes, which is exactly what a change of ubatch causes too.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)
from transformers.cache_utils import LinearAttentionLayer

from kvarn.vocab.cell import CellSpec
import kvarn.kvcache.attention as kattn
from kvarn.vocab import scoring
from kvarn.kvcache.cache import KVarnCache, KVarnLayer
from kvarn.run.torch_engine import policy_fields
from kvarn.vocab.geometry import geometry_from_config
from paths import WIKI_TEXT

# One xdist worker: the module fixture builds each study architecture once.
pytestmark = pytest.mark.xdist_group("study_models")

REPO = Path(__file__).resolve().parents[1]
N = 512  # tokens: KVarN's 128-token sink + 128-token tail leave body keys for queries >= 256
VOCAB = 256


def qwen35_config(**kw) -> Qwen3_5TextConfig:
    args = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4,
                linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, max_position_embeddings=4096)
    args.update(kw)
    return Qwen3_5TextConfig(**args)


def gemma4_config(**kw) -> Gemma4TextConfig:
    args = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=32,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB, max_position_embeddings=4096)
    args.update(kw)
    return Gemma4TextConfig(**args)


def tiny_model(arch: str):
    torch.manual_seed(0)
    if arch == "qwen3_5":
        return Qwen3_5ForCausalLM(qwen35_config()).eval()
    model = Gemma4ForCausalLM(gemma4_config()).eval()
    # Gemma 4 scales attention logits by 1.0 after q/k RMS norms: with the all-ones norm
    # weights of a fresh model they have std sqrt(D), a near-argmax attention in which one
    # fp32 rounding flip of a quantized value moves the output visibly. D^-1/4 on both
    # norms gives unit-scale logits, as the usual 1/sqrt(D) scaling does.
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_norm.weight.fill_(attn.head_dim**-0.25)
            attn.k_norm.weight.fill_(attn.head_dim**-0.25)
    return model


ARCHS = ["qwen3_5", "gemma4"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, one_thread):
    """(fp32 model, the same weights in float64)."""
    m = tiny_model(request.param)
    return m, copy.deepcopy(m).double()


def _ids(n=N, seed=1):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


F32_UBATCHES = (N, 64, 7)


@pytest.fixture(scope="module")
def f32_runs(pair):
    """{ubatch: (log-probs, cache)} of the f32 cache with no tail on `_ids()`, fed whole, in
    64s and in 7s: computed once per architecture, read by (a) and (b)."""
    ids = _ids()
    return {ub: cache_run(pair[0], ids, ubatch=ub) for ub in F32_UBATCHES}


@torch.no_grad()
def own_logprobs(model, ids, ubatch=None):
    """The model's own forward: one pass (ubatch None), or its own DynamicCache in ubatches."""
    model.set_attn_implementation("sdpa")
    if ubatch is None:
        return model(ids).logits[0].double().log_softmax(-1)
    cache = DynamicCache(config=model.config)
    out = [model(input_ids=ids[:, s : s + ubatch], cache=cache, use_cache=True).logits[0]
           for s in range(0, ids.shape[1], ubatch)]
    return torch.cat(out).double().log_softmax(-1)


@torch.no_grad()
def cache_run(model, ids, k="f32", v="f32", tail=0, ubatch=N, hidden=False):
    """(log-probs, cache[, hidden states]) through the cache model, `ubatch` tokens at a time."""
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = KVarnCache(model.config, CellSpec(k, v, tail))
    logits, hs = [], []
    for s in range(0, ids.shape[1], ubatch):
        out = model(input_ids=ids[:, s : s + ubatch], cache=cache, kvarn_cache=cache, use_cache=True,
                    output_hidden_states=hidden)
        logits.append(out.logits[0])
        hs.append(out.hidden_states)
    lp = torch.cat(logits).double().log_softmax(-1)
    if hidden:
        return lp, cache, [torch.cat([h[i] for h in hs], dim=1) for i in range(len(hs[0]))]
    return lp, cache


def maxdiff(a, b) -> float:
    return (a - b).abs().max().item()


def fp32_noise(pair, ids, cell=("f32", "f32", 0)) -> float:
    """max |Δ log-prob| of one cell between the fp32 model and the same weights in float64."""
    m32, m64 = pair
    return max(maxdiff(cache_run(m32, ids, *cell)[0], cache_run(m64, ids, *cell)[0]), 1e-6)


# --- the geometry and the layers the cache builds ------------------------------------

def test_geometry_of_tiny_models():
    q = geometry_from_config(qwen35_config())
    assert [g.kind for g in q.layers] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert q.kv_layers == (3, 7)
    assert {(g.n_kv_heads, g.head_dim, g.window) for g in q.layers if g.has_kv} == {(2, 64, None)}
    g4 = geometry_from_config(gemma4_config())
    assert [(g.kind, g.n_kv_heads, g.head_dim, g.window, g.k_eq_v) for g in g4.layers] == (
        [("sliding_attention", 2, 64, 32, False)] * 5 + [("full_attention", 1, 128, None, True)]
    )


def test_cache_layers_follow_the_layer_types(pair):
    model = pair[0]
    ids = _ids(200)
    _, cache = cache_run(model, ids, "q4_0", "q4_0", 128)
    geom = geometry_from_config(model.config)
    for i, (g, layer) in enumerate(zip(geom.layers, cache.layers)):
        if g.has_kv:
            # (e) per-layer shapes: the layer's own KV heads and head dim (Gemma 4 full: 1 x 128)
            assert isinstance(layer, KVarnLayer), i
            want = (1, g.n_kv_heads, 200, g.head_dim)
            assert tuple(layer.keys.shape) == tuple(layer.values.shape) == want, i
            assert tuple(layer.exact_keys.shape) == tuple(layer.exact_values.shape) == want, i
            assert cache.policies[i].window == g.window
        else:
            # transformers' own state layer, holding the model's conv and recurrent state
            assert type(layer) is LinearAttentionLayer and cache.policies[i] is None, i
            c = model.config
            conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
            assert tuple(layer.conv_states[0].shape) == (1, conv_dim, c.linear_conv_kernel_dim)
            assert tuple(layer.recurrent_states[0].shape) == (
                1, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
            assert layer.has_previous_state[0] and layer.recurrent_states[0].abs().max() > 0
    if isinstance(model, Gemma4ForCausalLM):
        assert {tuple(cache.layers[i].keys.shape[1:4:2]) for i in range(5)} == {(2, 64)}
        assert tuple(cache.layers[5].keys.shape[1:4:2]) == (1, 128)


def test_summary_policy_fields():
    # No policy on linear layers; sliding layers cap the KVarN tail at their window.
    q = KVarnCache(qwen35_config(), CellSpec("kvarn4", "kvarn4", 0))
    assert policy_fields(q) == {"tail_eff_full": 128, "tail_eff_sliding": None, "sink": 128}
    assert policy_fields(KVarnCache(qwen35_config(), CellSpec("q4_0", "q4_0", 128))) == {
        "tail_eff_full": 128, "tail_eff_sliding": None, "sink": 0}
    g = KVarnCache(gemma4_config(), CellSpec("kvarn4", "kvarn4", 0))
    assert policy_fields(g) == {"tail_eff_full": 128, "tail_eff_sliding": 32, "sink": 128}


@pytest.mark.parametrize("name,want", [
    ("qwen3.6-27b", ({"LinearAttentionLayer": 48, "KVarnLayer": 16}, None, {(4, 256)})),
    ("gemma4-31b", ({"KVarnLayer": 60}, 128, {(16, 256), (4, 512)})),
])
def test_study_scale_configs_build_the_cache(name, want):
    # The study's own text configs (config/models), as config.json dicts: the cache's layer
    # classes and summary fields, without weights. kvarn4's tail 128 fits Gemma's W 1024.
    from collections import Counter

    from kvarn.vocab.geometry import config_object

    layers, tail_sliding, shapes = want
    cfg = config_object(json.loads((REPO / "config" / "models" / f"{name}.json").read_text()))
    for k, tail in (("kvarn4", 0), ("q4_0", 128)):
        cache = KVarnCache(cfg, CellSpec(k, k, tail))
        assert dict(Counter(type(x).__name__ for x in cache.layers)) == layers
        assert policy_fields(cache)["tail_eff_sliding"] == tail_sliding
        assert {(g.n_kv_heads, g.head_dim) for g in cache.geometry.layers if g.has_kv} == shapes


def test_image_text_configs_use_their_text_config():
    from transformers import Gemma4Config, Qwen3_5Config

    q = KVarnCache(Qwen3_5Config(text_config=qwen35_config().to_dict()), CellSpec("q4_0", "q4_0", 0))
    assert [type(x).__name__ for x in q.layers] == (["LinearAttentionLayer"] * 3 + ["KVarnLayer"]) * 2
    g = KVarnCache(Gemma4Config(text_config=gemma4_config().to_dict()), CellSpec("q4_0", "q4_0", 0))
    assert [p.window for p in g.policies] == [32] * 5 + [None]


def test_head_dim_the_format_refuses_names_the_layer():
    with pytest.raises(ValueError, match=r"layer 5 \(full_attention\) has head dim 96"):
        KVarnCache(gemma4_config(global_head_dim=96), CellSpec("kvarn4", "kvarn4", 0))


# --- (a) an f32 cache with no tail is the model's own forward -------------------------

def test_f32_cache_reproduces_own_forward(pair, f32_runs):
    model = pair[0]
    ids = _ids()
    ref = own_logprobs(model, ids)
    tol = 2 * fp32_noise(pair, ids)
    name = model.config.model_type
    own_ub = maxdiff(own_logprobs(model, ids, ubatch=64), ref)
    assert own_ub <= tol  # the tolerance admits the model's own cached forward
    for ub in F32_UBATCHES:
        d = maxdiff(f32_runs[ub][0], ref)
        print(f"{name} f32 cache ubatch {ub}: max |Δ log-prob| vs own single pass {d:.3g} "
              f"(own DynamicCache ubatch 64: {own_ub:.3g}; tol 2 x f32-vs-f64 {tol:.3g})")
        assert d <= tol


# --- (b) ubatch independence of quantized cells --------------------------------------

def input_noise(f32_runs, ubatches) -> float:
    """What a change of ubatch does to the cache's input: the max relative difference of the
    K and V an f32 cache stores (`f32_runs`), fed in `ubatches` vs whole."""
    whole = f32_runs[N][1]
    out = 0.0
    for ub in ubatches:
        c = f32_runs[ub][1]
        for a, b in zip(whole.layers, c.layers):
            if isinstance(a, KVarnLayer):
                for x, y in ((a.keys, b.keys), (a.values, b.values)):
                    m = min(x.shape[-2], y.shape[-2])  # a sliding layer keeps the last rows: align them
                    x, y = x[..., -m:, :], y[..., -m:, :]
                    out = max(out, ((x - y).abs().max() / x.abs().max()).item())
    return out


@torch.no_grad()
def perturbed_logprobs(model, ids, cell, eps: float, seed: int):
    """One whole-sequence pass of `cell` with every K and V multiplied by 1 + eps * U(-1, 1)
    before the cache stores it: the cell's response to input noise of relative size eps."""
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = KVarnCache(model.config, CellSpec(*cell))
    g = torch.Generator().manual_seed(seed)

    def noisy(x):
        return x * (1 + eps * (2 * torch.rand(x.shape, generator=g, dtype=x.dtype) - 1))

    for layer in cache.layers:
        if isinstance(layer, KVarnLayer):
            layer.update = lambda k, v, *a, _update=layer.update, **kw: _update(noisy(k), noisy(v), *a, **kw)
    return model(input_ids=ids, cache=cache, kvarn_cache=cache).logits[0].double().log_softmax(-1)


@pytest.mark.parametrize("cell", [("q4_0", "q4_0", 128), ("q4_0", "q4_0", 0), ("kvarn4", "kvarn4", 0)],
                         ids=lambda c: f"{c[0]}-t{c[2]}")
def test_ubatch_independence(pair, f32_runs, cell):
    # A ubatch change perturbs the K/V the cache receives by fp32 noise (delta, measured),
    # which a quantizer can turn into a flip of a stored code. The reference: the same cell
    # with its K/V inputs perturbed at random by 4 x delta; a cache that really depended
    # on the ubatch (group timing, selection offsets, lost linear state) moves the output
    # by the size of the format's own effect, which the reference must stay well below.
    model = pair[0]
    ids = _ids()
    ref = cache_run(model, ids, *cell)[0]
    delta = input_noise(f32_runs, (64, 7))
    assert 0 < delta < 1e-5
    tol = 2 * max(maxdiff(ref, perturbed_logprobs(model, ids, cell, 4 * delta, seed)) for seed in (0, 1))
    effect = maxdiff(ref, f32_runs[N][0])
    assert tol < 0.5 * effect, (tol, effect)
    for ub in (64, 7):
        d = maxdiff(cache_run(model, ids, *cell, ubatch=ub)[0], ref)
        print(f"{model.config.model_type} {cell} ubatch {ub}: max |Δ log-prob| {d:.3g} "
              f"(tol {tol:.3g} from K/V noise {delta:.2g}; format effect {effect:.3g})")
        assert d <= tol


def test_kvarn_body_is_read_where_the_spec_says(pair):
    # Queries < 256 read only the sink (128) and tail (128): the exact F16 copy, so they
    # match an all-F16 cache at fp32 noise. Later queries on full layers read quantized
    # groups; sliding layers (window 32 <= tail) never do.
    model = pair[0]
    ids = _ids()
    lp, cache = cache_run(model, ids, "kvarn4", "kvarn4", 0)
    f16 = cache_run(model, ids, "f16", "f16", 0)[0]
    tol = 2 * fp32_noise(pair, ids, ("f16", "f16", 0))
    early, late = maxdiff(lp[:256], f16[:256]), maxdiff(lp[256:], f16[256:])
    print(f"{model.config.model_type} kvarn4 vs f16 cache: queries < 256 {early:.3g}, >= 256 {late:.3g} (tol {tol:.3g})")
    assert early <= tol
    assert late > 10 * tol
    for i, layer in enumerate(cache.layers):
        pol = cache.policies[i]
        if pol is None:
            continue
        assert (layer.n_tokens, layer.n_body) == (N, N)
        assert not torch.equal(layer.keys, layer.exact_keys)  # quantized bodies
        if pol.window is None:
            assert (pol.sink, pol.tail) == (128, 128)
        else:
            assert (pol.sink, pol.tail) == (0, pol.window)


# --- (c) causality --------------------------------------------------------------------

@pytest.mark.parametrize("cell", [("f32", "f32", 0), ("q4_0", "q4_0", 128), ("kvarn4", "kvarn4", 0)],
                         ids=lambda c: f"{c[0]}-t{c[2]}")
def test_causal(pair, cell):
    model = pair[0]
    ids = _ids()
    ids2 = ids.clone()
    t = 300
    ids2[0, t] = (ids[0, t] + 1) % VOCAB
    a = cache_run(model, ids, *cell, ubatch=64)[0]
    b = cache_run(model, ids2, *cell, ubatch=64)[0]
    assert torch.equal(a[:t], b[:t])
    assert not torch.equal(a[t], b[t])


# --- (d) a quantized cell acts only through the attention layers -----------------------

def test_cell_changes_only_attention_layers(pair):
    model = pair[0]
    ids = _ids()
    geom = geometry_from_config(model.config)
    base_lp, base, base_hs = cache_run(model, ids, "bf16", "bf16", 0, ubatch=64, hidden=True)
    cell_lp, cell, cell_hs = cache_run(model, ids, "q4_0", "q4_0", 128, ubatch=64, hidden=True)
    # hidden_states[i] is the input of layer i (0: embeddings).
    first_kv = geom.kv_layers[0]
    for i in range(first_kv + 1):
        assert torch.equal(base_hs[i], cell_hs[i]), i
    for i, g in enumerate(geom.layers):
        if g.has_kv:
            assert isinstance(cell.layers[i], KVarnLayer)
            assert not torch.equal(cell.layers[i].keys, cell.layers[i].exact_keys), i  # q4_0 bodies
            assert base.layers[i].keys.dtype == torch.bfloat16, i  # bf16 bodies, stored as such
        else:
            a, b = base.layers[i], cell.layers[i]
            assert type(a) is type(b) is LinearAttentionLayer
            same = torch.equal(a.recurrent_states[0], b.recurrent_states[0]) and torch.equal(a.conv_states[0], b.conv_states[0])
            # Before the first attention layer the state is the baseline's, bit for bit; after it, it differs.
            assert same == (i < first_kv), i
    if isinstance(model, Gemma4ForCausalLM):
        # Sliding layers (window 32 <= tail 128) read only exact bf16 rows, the same values
        # as the baseline's bf16 body: only the full layer (5) changes the output.
        for i in range(1, 6):
            assert maxdiff(base_hs[i], cell_hs[i]) <= 1e-5 * base_hs[i].abs().max().item(), i
        assert maxdiff(base_hs[6], cell_hs[6]) > 1e-3 * base_hs[6].abs().max().item()
    else:
        assert not torch.equal(base_hs[first_kv + 1], cell_hs[first_kv + 1])
    assert maxdiff(base_lp, cell_lp) > 0


def test_reset_clears_the_linear_state(pair):
    model = pair[0]
    ids = _ids(100)
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = KVarnCache(model.config, CellSpec("q4_0", "q4_0", 8))
    with torch.no_grad():
        a = model(input_ids=ids, cache=cache, kvarn_cache=cache).logits
        cache.reset()
        if isinstance(model, Qwen3_5ForCausalLM):
            assert not cache.has_previous_state(0)
        b = model(input_ids=ids, cache=cache, kvarn_cache=cache).logits
    assert torch.equal(a, b)


# --- end to end: `kvarn baseline` + `kvarn run` on local directories -------------------

SMOL_HF = REPO / "resources" / "models" / "smollm2-135m" / "hf"
TEXT = WIKI_TEXT
SMOL_VOCAB = 49152
CTX = 512  # scored queries 256..510 read KVarN body groups on full-attention layers


def save_tiny(arch: str, path: Path) -> Path:
    """A tiny random `arch` model saved as a transformers directory with SmolLM2's tokenizer."""
    torch.manual_seed(0)
    kw = dict(vocab_size=SMOL_VOCAB, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    if arch == "qwen3_5":
        model = Qwen3_5ForCausalLM(qwen35_config(**kw))
    else:
        model = Gemma4ForCausalLM(gemma4_config(vocab_size_per_layer_input=SMOL_VOCAB, **kw))
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOL_HF / name, path / name)
    return path


@pytest.mark.parametrize("arch", ARCHS)
def test_cli_baseline_and_run(arch, tmp_path, capsys, monkeypatch, one_thread, fetched):
    fetched("smollm2-135m")  # its tokenizer serves the tiny model
    if not TEXT.is_file():
        pytest.skip("needs wiki.test.raw")
    from kvarn import cli
    from kvarn.baseline import dump
    from kvarn.run import forward
    from kvarn.weights.models import load
    from kvarn.weights.sources import ModelSpec

    from kvarn.baseline import data

    # 2 chunks need only the head of the (verified) test split: not 4 tokenizations of 1.3 MB.
    load_text = data.load_text
    monkeypatch.setattr(data, "load_text", lambda *a, **kw: load_text(*a, **kw)[:20000])
    d = save_tiny(arch, tmp_path / f"tiny-{arch}")
    common = ["-m", str(d), "-c", str(CTX), "--chunks", "2", "-f", str(TEXT), "--device", "cpu",
              "--cache-dir", str(tmp_path / "cache")]
    base = tmp_path / "base.kvd"
    assert cli.main(["baseline", *common, "-o", str(base)]) == 0
    printed = [capsys.readouterr().out]
    assert "baseline: 2 chunks x 512 tokens" in printed[0]
    kvl = geometry_from_config(json.loads((d / "config.json").read_text())).kv_layers
    want = {"q4_0": {"tail_eff_full": 128, "sink": 0}, "kvarn4": {"tail_eff_full": 128, "sink": 128}}
    for k, tail in (("q4_0", 128), ("kvarn4", 0)):
        cell = tmp_path / f"{k}-t{tail}"
        assert cli.main(["run", *common, "-ctk", k, "-ctv", k, "--tail", str(tail), "--baseline", str(base),
                         "-o", str(cell)]) == 0
        printed.append(capsys.readouterr().out)
        s = json.loads((cell / "summary.json").read_text())
        assert s["n_tokens"] == 2 * (CTX - 1 - CTX // 2)
        assert {key: s[key] for key in want[k]} == want[k]
        assert s["tail_eff_sliding"] == (None if arch == "qwen3_5" else 32)
        assert 0 < s["kld_median"] < s["kld_max"] and s["same_top"] < 1
        assert "KV cache (packed accounting):" in printed[-1]

    # The engine's fresh cache per chunk resets the linear-attention state too: chunk 1 of
    # the dump is chunk 1 computed alone, not after chunk 0.
    loaded = load(ModelSpec(arch, str(d)), device="cpu", dtype="float32")
    model = loaded.model
    model.set_attn_implementation(kattn.ATTN_NAME)
    ids = data.make_chunks(data.tokenize(loaded.tokenizer, data.load_text(str(TEXT))), CTX, 2, loaded.info.bos_id)
    scored = scoring.scored_positions(CTX)

    def logprobs(cache, c):
        return torch.cat([lp for _, lp in forward.chunk_logprobs(model, ids[c], cache, 512, scored)])

    fresh = logprobs(forward.new_cache(model, CellSpec("bf16", "bf16", 0)), 1)
    stale_cache = forward.new_cache(model, CellSpec("bf16", "bf16", 0))
    logprobs(stale_cache, 0)
    for layer in stale_cache.layers:  # carry only the state layers over: the KV layers restart
        if isinstance(layer, KVarnLayer):
            layer.reset()
    stale = logprobs(stale_cache, 1)
    stored = dump.open_dump(base).chunk(1)
    top = fresh >= fresh.max(-1, keepdim=True).values - 16  # the range the dump encodes
    err = (stored - fresh)[top].abs().max().item()
    assert err <= 16 / 65535 + 1e-5, err
    if arch == "qwen3_5":
        assert (stale - fresh)[top].abs().max().item() > 100 * err
    assert kvl  # the model has attention layers the cells quantized
    with capsys.disabled():
        print("\n".join(printed))
