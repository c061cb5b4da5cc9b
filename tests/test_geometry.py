"""kvarn.vocab.geometry: a model's per-layer cache geometry, read from real transformers configs.

Every expected geometry is worked by hand from the config's own numbers (hidden size / heads,
the layer pattern the config class documents), never copied from the module's output.
"""

import json
from types import SimpleNamespace

import pytest

from kvarn.vocab.geometry import (
    LAYER_TYPES,
    Geometry,
    LayerGeometry,
    check_layer_types,
    config_object,
    geometry_from_config,
    layer_types_of,
    text_config,
)

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
SUPPORTED = "supported: full_attention, sliding_attention, linear_attention"

# Qwen 3.5 / Gemma 4 text parts, small (the image-text tests of test_models.py use the same shapes)
QWEN_TEXT = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
                 linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                 layer_types=[LINEAR] * 3 + [FULL])
GEMMA4_TEXT = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                   attention_k_eq_v=True, sliding_window=8, layer_types=[SLIDING] * 3 + [FULL],
                   hidden_size_per_layer_input=0, vocab_size_per_layer_input=384, final_logit_softcapping=30.0)


def rows(g: Geometry) -> list[tuple]:
    return [(x.kind, x.n_kv_heads, x.head_dim, x.window, x.k_eq_v) for x in g.layers]


# ----------------------------------------------------------------------------- LayerGeometry


def test_layer_types_are_the_three_supported():
    assert LAYER_TYPES == {FULL: "kv", SLIDING: "kv", LINEAR: "state"}


def test_a_state_layer_has_no_cache_shape():
    x = LayerGeometry(LINEAR)
    assert (x.n_kv_heads, x.head_dim, x.window, x.k_eq_v) == (0, 0, None, False)
    assert not x.has_kv and not x.is_sliding


def test_kv_layers_and_their_smallest_shapes():
    full = LayerGeometry(FULL, 1, 1)
    assert full.has_kv and not full.is_sliding and (full.window, full.k_eq_v) == (None, False)
    sl = LayerGeometry(SLIDING, 1, 1, 1)
    assert sl.has_kv and sl.is_sliding and sl.window == 1


@pytest.mark.parametrize("kind", ["mamba", "Full_attention", "", "state", "kv"])
def test_an_unknown_layer_type_is_refused_by_name(kind):
    with pytest.raises(ValueError) as e:
        LayerGeometry(kind, 1, 64)
    assert str(e.value) == (f"layer type {kind!r} is not supported by the kvarn cache model; {SUPPORTED}")


@pytest.mark.parametrize("field", ["n_kv_heads", "head_dim"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4", None])
@pytest.mark.parametrize("kind, window", [(FULL, None), (SLIDING, 16)])
def test_a_kv_layer_needs_positive_integer_shapes(field, bad, kind, window):
    shape = {"n_kv_heads": 2, "head_dim": 64, field: bad}
    with pytest.raises(ValueError) as e:
        LayerGeometry(kind, window=window, **shape)
    assert str(e.value) == f"{kind} layer: {field} must be a positive integer, got {bad!r}"


@pytest.mark.parametrize("kind, window", [(FULL, 16), (LINEAR, 16), (SLIDING, None)])
def test_only_sliding_layers_have_a_window(kind, window):
    shape = (0, 0) if kind == LINEAR else (2, 64)
    with pytest.raises(ValueError) as e:
        LayerGeometry(kind, *shape, window)
    assert str(e.value) == f"{kind} layer with window {window!r}: only sliding_attention layers have one"


@pytest.mark.parametrize("bad", [0, -4, True, 8.0, "8"])
def test_a_sliding_window_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError) as e:
        LayerGeometry(SLIDING, 2, 64, bad)
    assert str(e.value) == f"sliding window must be a positive integer, got {bad!r}"


def test_a_state_layer_takes_no_shape_check():
    # a state layer's KV shape is never read: 0, 0 (its default) is what it holds
    assert LayerGeometry(LINEAR, 0, 0).has_kv is False


# ----------------------------------------------------------------------------- Geometry


def test_uniform_by_hand():
    g = Geometry.uniform(3, 2, 64, (None, 100, None))
    assert rows(g) == [(FULL, 2, 64, None, False), (SLIDING, 2, 64, 100, False), (FULL, 2, 64, None, False)]
    assert g.n_layers == 3 and g.windows == (None, 100, None) and g.kv_layers == (0, 1, 2)
    assert Geometry.uniform(2, 1, 32) == Geometry((LayerGeometry(FULL, 1, 32), LayerGeometry(FULL, 1, 32)))
    assert Geometry.uniform(1, 1, 1, [7]).windows == (7,)  # any sequence of windows


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_uniform_refuses_a_bad_layer_count(bad):
    with pytest.raises(ValueError) as e:
        Geometry.uniform(bad, 2, 64)
    assert str(e.value) == f"n_layers must be a positive integer, got {bad!r}"


@pytest.mark.parametrize("windows", [(None,), (None, None, None), ()])
def test_uniform_needs_one_window_per_layer(windows):
    with pytest.raises(ValueError) as e:
        Geometry.uniform(2, 2, 64, windows)
    assert str(e.value) == (f"windows has {len(windows)} entries for 2 layers; "
                            "give one window (or None) per layer")


@pytest.mark.parametrize("layers", [(), [], None, ("full_attention",), (LayerGeometry(FULL, 1, 64), None)])
def test_geometry_needs_layer_geometries(layers):
    with pytest.raises(ValueError) as e:
        Geometry(layers)
    assert str(e.value) == "Geometry.layers must be a non-empty tuple of LayerGeometry"


def test_a_model_without_attention_is_refused():
    with pytest.raises(ValueError) as e:
        Geometry((LayerGeometry(LINEAR), LayerGeometry(LINEAR)))
    assert str(e.value) == "the model has no attention layer: there is no KV cache to measure"
    # one attention layer among state layers is enough, wherever it sits
    assert Geometry((LayerGeometry(FULL, 1, 64), LayerGeometry(LINEAR))).kv_layers == (0,)
    assert Geometry((LayerGeometry(LINEAR), LayerGeometry(FULL, 1, 64))).kv_layers == (1,)


HYBRID = Geometry((LayerGeometry(LINEAR), LayerGeometry(SLIDING, 16, 256, 1024), LayerGeometry(LINEAR),
                   LayerGeometry(FULL, 4, 512, k_eq_v=True), LayerGeometry(SLIDING, 16, 256, 1024)))


def test_hybrid_properties_by_hand():
    assert HYBRID.n_layers == 5
    assert HYBRID.windows == (None, 1024, None, None, 1024)
    assert HYBRID.kv_layers == (1, 3, 4)


def test_to_list_and_back():
    want = [[LINEAR, 0, 0, None, False], [SLIDING, 16, 256, 1024, False], [LINEAR, 0, 0, None, False],
            [FULL, 4, 512, None, True], [SLIDING, 16, 256, 1024, False]]
    assert HYBRID.to_list() == want
    assert Geometry.from_list(json.loads(json.dumps(want))) == HYBRID  # as summary.json holds it
    assert Geometry.from_list(tuple(tuple(r) for r in want)) == HYBRID  # tuples are lists too


@pytest.mark.parametrize("bad", [
    "full_attention", None, {"layers": []}, [[FULL, 1, 64, None]], [[FULL, 1, 64, None, False, 0]],
    [[FULL, 1, 64, None, False], "full_attention 1 64"], [[FULL, 1, 64, None, False], [FULL, 1, 64, None]],
])
def test_from_list_refuses_what_to_list_does_not_write(bad):
    with pytest.raises(ValueError) as e:
        Geometry.from_list(bad)
    assert str(e.value) == "a geometry list has one [kind, n_kv_heads, head_dim, window, k_eq_v] per layer"


def test_from_list_checks_each_layer():
    with pytest.raises(ValueError, match=r"^full_attention layer: head_dim must be a positive integer, got 0$"):
        Geometry.from_list([[FULL, 1, 0, None, False]])
    with pytest.raises(ValueError, match=r"^layer type 'mamba' is not supported"):
        Geometry.from_list([["mamba", 1, 64, None, False]])


def test_describe_by_hand():
    # distinct shapes in first-seen order, counted; state layers without a shape
    assert HYBRID.describe() == ("2 linear_attention; 2 sliding_attention (16 KV heads x 256, W 1024); "
                                 "1 full_attention (4 KV heads x 512, K=V)")
    assert Geometry.uniform(2, 2, 64).describe() == "2 full_attention (2 KV heads x 64)"
    assert Geometry.uniform(3, 1, 32, (8, None, 16)).describe() == (
        "1 sliding_attention (1 KV heads x 32, W 8); 1 full_attention (1 KV heads x 32); "
        "1 sliding_attention (1 KV heads x 32, W 16)")
    # same kind, different shape: two entries
    two = Geometry((LayerGeometry(FULL, 2, 64), LayerGeometry(FULL, 4, 64), LayerGeometry(FULL, 2, 64, k_eq_v=True)))
    assert two.describe() == ("1 full_attention (2 KV heads x 64); 1 full_attention (4 KV heads x 64); "
                              "1 full_attention (2 KV heads x 64, K=V)")


# ----------------------------------------------------------------------------- reading configs


def test_llama_heads_and_head_dim():
    from transformers import LlamaConfig

    # 256 / 8 heads = head dim 32; 2 KV heads (GQA); no sliding layers
    g = geometry_from_config(LlamaConfig(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                         hidden_size=256))
    assert rows(g) == [(FULL, 2, 32, None, False)] * 3


def test_head_dim_from_hidden_size_and_kv_heads_from_heads():
    from transformers import GPT2Config

    # GPT-2 states neither a head dim nor KV heads: 96 / 4 heads = 24, one KV head per head
    g = geometry_from_config(GPT2Config(n_layer=2, n_head=4, n_embd=96))
    assert rows(g) == [(FULL, 4, 24, None, False)] * 2


def test_qwen2_head_dim_and_its_window_switch():
    from transformers import Qwen2Config

    # Qwen 2 has no head_dim: 128 / 4 heads = 32. Its sliding window is off unless
    # use_sliding_window; then layers from max_window_layers on slide.
    base = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=128, sliding_window=64)
    assert rows(geometry_from_config(Qwen2Config(**base))) == [(FULL, 2, 32, None, False)] * 3
    g = geometry_from_config(Qwen2Config(**base, use_sliding_window=True, max_window_layers=1))
    assert rows(g) == [(FULL, 2, 32, None, False), (SLIDING, 2, 32, 64, False), (SLIDING, 2, 32, 64, False)]


def test_mistral_slides_every_layer():
    from transformers import MistralConfig

    # Mistral has no layer_types: a sliding_window slides every layer; head_dim is its own (48, not 256 / 4)
    cfg = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, hidden_size=256, head_dim=48)
    assert rows(geometry_from_config(MistralConfig(**cfg, sliding_window=4096))) == [(SLIDING, 1, 48, 4096, False)] * 2
    assert rows(geometry_from_config(MistralConfig(**cfg, sliding_window=None))) == [(FULL, 1, 48, None, False)] * 2


def test_gemma3_pattern():
    from transformers import Gemma3Config, Gemma3TextConfig

    # Gemma 3: five sliding layers, then one full, repeating
    text = dict(num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)
    want = [(SLIDING, 1, 256, 512, False)] * 5 + [(FULL, 1, 256, None, False)] + [(SLIDING, 1, 256, 512, False)]
    assert rows(geometry_from_config(Gemma3TextConfig(**text))) == want
    # the image-text checkpoint: its text part
    assert rows(geometry_from_config(Gemma3Config(text_config=text))) == want


def test_gemma3_config_json_with_a_text_config():
    from transformers import Gemma3Config

    text = dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=32)
    d = json.loads(json.dumps(Gemma3Config(text_config=text).to_dict()))  # a config.json
    want = [(SLIDING, 2, 64, 32, False)] * 5 + [(FULL, 2, 64, None, False)]
    assert rows(geometry_from_config(d)) == want
    assert layer_types_of(d) == [SLIDING] * 5 + [FULL]


def test_qwen3_5_hybrid():
    from transformers import Qwen3_5Config, Qwen3_5TextConfig

    want = [(LINEAR, 0, 0, None, False)] * 3 + [(FULL, 2, 32, None, False)]
    assert rows(geometry_from_config(Qwen3_5TextConfig(**QWEN_TEXT))) == want
    assert rows(geometry_from_config(Qwen3_5Config(text_config=QWEN_TEXT))) == want
    assert rows(geometry_from_config({"model_type": "qwen3_5_text", **QWEN_TEXT})) == want
    assert geometry_from_config(Qwen3_5TextConfig(**QWEN_TEXT)).kv_layers == (3,)


def test_gemma4_per_layer_shapes_and_k_eq_v():
    from transformers import Gemma4Config, Gemma4TextConfig

    # sliding layers: 2 KV heads x 16, window 8; the full layer: the global 1 KV head x 32, K = V
    # (attention_k_eq_v holds on full layers only)
    want = [(SLIDING, 2, 16, 8, False)] * 3 + [(FULL, 1, 32, None, True)]
    assert rows(geometry_from_config(Gemma4TextConfig(**GEMMA4_TEXT))) == want
    assert rows(geometry_from_config(Gemma4Config(text_config=GEMMA4_TEXT))) == want
    assert rows(geometry_from_config({"model_type": "gemma4_text", **GEMMA4_TEXT})) == want
    no_keqv = rows(geometry_from_config(Gemma4TextConfig(**{**GEMMA4_TEXT, "attention_k_eq_v": False})))
    assert no_keqv == [(SLIDING, 2, 16, 8, False)] * 3 + [(FULL, 2, 32, None, False)]


def test_gemma4_kv_sharing_is_refused():
    from transformers import Gemma4TextConfig

    cfg = Gemma4TextConfig(**{**GEMMA4_TEXT, "num_kv_shared_layers": 2})
    with pytest.raises(ValueError) as e:
        geometry_from_config(cfg)
    assert str(e.value) == ("num_kv_shared_layers = 2: layers that reuse another layer's KV cache are not "
                            "supported by the kvarn cache model")


# --- plain config.json dicts and objects (what the readers accept besides transformers objects)


def test_text_config_of_each_form():
    from transformers import Gemma4Config, Gemma4TextConfig

    outer = Gemma4Config(text_config=GEMMA4_TEXT)
    assert isinstance(text_config(outer), Gemma4TextConfig)
    inner = Gemma4TextConfig(**GEMMA4_TEXT)
    assert text_config(inner) is inner
    plain = SimpleNamespace(num_hidden_layers=1)  # no get_text_config: itself
    assert text_config(plain) is plain
    d = {"model_type": "x", "text_config": {"num_hidden_layers": 2}}
    assert text_config(d) is d["text_config"]
    flat = {"model_type": "x", "num_hidden_layers": 2}
    assert text_config(flat) is flat
    assert text_config({"text_config": None, "num_hidden_layers": 2}) == {"text_config": None, "num_hidden_layers": 2}


@pytest.mark.parametrize("cfg, want", [
    ({"num_hidden_layers": 2}, [FULL, FULL]),
    ({"num_hidden_layers": 2, "sliding_window": 64}, [SLIDING, SLIDING]),  # no switch: on
    ({"num_hidden_layers": 2, "sliding_window": 64, "use_sliding_window": True}, [SLIDING, SLIDING]),
    ({"num_hidden_layers": 2, "sliding_window": 64, "use_sliding_window": False}, [FULL, FULL]),
    ({"num_hidden_layers": 2, "sliding_window": None, "use_sliding_window": True}, [FULL, FULL]),
    ({"num_hidden_layers": 2, "sliding_window": 0}, [FULL, FULL]),
    ({"num_hidden_layers": "3", "layer_types": [LINEAR, FULL, SLIDING], "sliding_window": 8}, [LINEAR, FULL, SLIDING]),
    ({"num_hidden_layers": 2, "layer_types": [], "sliding_window": 8}, [SLIDING, SLIDING]),  # empty: as absent
    ({"text_config": {"num_hidden_layers": 1, "layer_types": (LINEAR,)}, "num_hidden_layers": 5}, [LINEAR]),
])
def test_layer_types_of_a_config_json(cfg, want):
    assert layer_types_of(cfg) == want


def test_layer_types_must_match_the_layer_count():
    with pytest.raises(ValueError) as e:
        layer_types_of({"num_hidden_layers": 3, "layer_types": [FULL, SLIDING]})
    assert str(e.value) == "config has 2 layer_types for 3 layers"


def test_layer_types_of_an_object_reads_its_attributes():
    from transformers import Qwen3_5TextConfig

    assert layer_types_of(Qwen3_5TextConfig(**QWEN_TEXT)) == [LINEAR] * 3 + [FULL]
    assert layer_types_of(SimpleNamespace(num_hidden_layers=2, sliding_window=5)) == [SLIDING, SLIDING]


def test_an_unsupported_layer_type_is_refused_before_any_download():
    cfg = {"model_type": "x", "num_hidden_layers": 5,
           "layer_types": ["mamba", FULL, "moe", "mamba", LINEAR]}
    with pytest.raises(ValueError) as e:
        check_layer_types(cfg)
    assert str(e.value) == ("layer types ['mamba', 'moe'] (layers {'mamba': [0, 3], 'moe': [2]}) are not supported "
                            f"by the kvarn cache model; {SUPPORTED}")
    with pytest.raises(ValueError, match=r"^layer types \['mamba', 'moe'\] \(layers"):
        geometry_from_config(cfg)  # before model_type is even looked at


@pytest.mark.parametrize("shared", [1, 20])
def test_kv_sharing_of_a_config_json_is_refused(shared):
    cfg = {"num_hidden_layers": 2, "num_kv_shared_layers": shared}
    with pytest.raises(ValueError) as e:
        check_layer_types(cfg)
    assert str(e.value) == (f"num_kv_shared_layers = {shared}: layers that reuse another layer's KV cache are not "
                            "supported by the kvarn cache model")
    # in the text part of an image-text config.json too
    with pytest.raises(ValueError, match=rf"^num_kv_shared_layers = {shared}:"):
        check_layer_types({"text_config": cfg})


@pytest.mark.parametrize("shared", [0, None])
def test_no_kv_sharing_passes(shared):
    assert check_layer_types({"num_hidden_layers": 2, "num_kv_shared_layers": shared}) is None
    assert check_layer_types({"num_hidden_layers": 2}) is None


def test_config_object_of_a_config_json():
    from transformers import LlamaConfig

    obj = config_object({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                         "num_attention_heads": 4, "num_key_value_heads": 1})
    assert isinstance(obj, LlamaConfig)
    assert (obj.num_hidden_layers, obj.hidden_size, obj.num_attention_heads, obj.num_key_value_heads) == (2, 64, 4, 1)
    already = LlamaConfig()
    assert config_object(already) is already


@pytest.mark.parametrize("cfg", [{"num_hidden_layers": 2}, {"model_type": "", "num_hidden_layers": 2},
                                 {"model_type": None}])
def test_a_config_json_without_model_type_is_refused(cfg):
    with pytest.raises(ValueError) as e:
        config_object(cfg)
    assert str(e.value) == "config.json has no model_type: cannot tell which architecture it describes"


def test_an_unknown_model_type_is_refused_by_name():
    with pytest.raises(ValueError) as e:
        geometry_from_config({"model_type": "no_such_arch", "num_hidden_layers": 2})
    msg = str(e.value)
    assert msg.startswith("model_type 'no_such_arch' is not known to this transformers version: ")
    assert "no_such_arch" in msg[len("model_type 'no_such_arch' is not known"):]  # transformers' own words follow
    assert isinstance(e.value.__cause__, ValueError)


def test_a_llama_config_json():
    # 64 / 4 heads = 16; 1 KV head
    g = geometry_from_config({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                              "num_attention_heads": 4, "num_key_value_heads": 1})
    assert rows(g) == [(FULL, 1, 16, None, False)] * 2


def test_sliding_layers_without_a_window_are_refused():
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**{**QWEN_TEXT, "layer_types": [LINEAR, SLIDING, LINEAR, FULL]})
    assert getattr(cfg, "sliding_window", None) is None
    with pytest.raises(ValueError) as e:
        geometry_from_config(cfg)
    assert str(e.value) == "config declares sliding-attention layers but no sliding_window"


def test_an_object_whose_attribute_raises_reads_the_default():
    # transformers raises on an ambiguous global per-layer attribute (Gemma 4's head_dim): the
    # reader then falls back to the per-layer value, never to the error
    class Raising(SimpleNamespace):
        def __getattr__(self, name):
            if name in ("per_layer_config", "get_text_config") or name.startswith("__"):
                raise AttributeError(name)
            raise RuntimeError(f"ambiguous {name}")

    cfg = Raising(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    assert layer_types_of(cfg) == [FULL, FULL]  # layer_types, sliding_window: default None
    assert rows(geometry_from_config(cfg)) == [(FULL, 4, 16, None, False)] * 2  # head_dim 64 / 4


def test_a_config_object_without_per_layer_config_reads_the_global_shape():
    # a config object as transformers before per_layer_config presented it: its attributes only.
    # Llama's own numbers: 2 KV heads of its stated head dim 48 (not 8 heads, nor 256 / 8 = 32)
    from transformers import LlamaConfig

    d = LlamaConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, hidden_size=256,
                    head_dim=48).to_dict()
    assert "per_layer_config" not in d
    assert rows(geometry_from_config(SimpleNamespace(**d))) == [(FULL, 2, 48, None, False)] * 2


def test_per_layer_values_override_the_global_ones():
    # a per_layer_config entry without a value (None) falls back to the config's global one
    plc = [SimpleNamespace(num_key_value_heads=None, head_dim=None), SimpleNamespace(num_key_value_heads=1, head_dim=128)]
    cfg = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          hidden_size=512, per_layer_config=plc)
    assert rows(geometry_from_config(cfg)) == [(FULL, 2, 64, None, False), (FULL, 1, 128, None, False)]
    # an entry that lacks the attribute altogether: the global one too
    cfg.per_layer_config = [SimpleNamespace(), SimpleNamespace(head_dim=32)]
    assert rows(geometry_from_config(cfg)) == [(FULL, 2, 64, None, False), (FULL, 2, 32, None, False)]


def test_a_config_with_a_text_encoder_reads_its_decoder():
    # MusicGen: a T5 text encoder (6 layers, 8 heads x 64) and a decoder of 3 layers, 4 heads,
    # 64 / 4 = head dim 16. The decoder's cache is the one measured, not an ambiguity.
    from transformers import EncodecConfig, MusicgenConfig, MusicgenDecoderConfig, T5Config

    dec = MusicgenDecoderConfig(num_hidden_layers=3, num_attention_heads=4, hidden_size=64)
    cfg = MusicgenConfig(text_encoder=T5Config().to_dict(), audio_encoder=EncodecConfig().to_dict(),
                         decoder=dec.to_dict())
    assert rows(geometry_from_config(cfg)) == [(FULL, 4, 16, None, False)] * 3
