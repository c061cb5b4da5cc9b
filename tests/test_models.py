"""kvarn.weights.models: geometry of loaded configs, BOS detection, loading the real embedded models.

The slow tests fetch and load the two real embedded models into the repository's
default cache (resources/models), once per machine.
"""

from pathlib import Path

import pytest

from kvarn.weights import models
from kvarn.weights.sources import DEFAULT_CACHE_DIR, EMBEDDED, ModelSpec

# One xdist worker: the module fixture loads both embedded models once.
pytestmark = pytest.mark.xdist_group("models")

REPO = Path(__file__).resolve().parents[1]


def test_geometry_from_synthetic_configs():
    from transformers import Gemma3TextConfig, LlamaConfig

    from kvarn.vocab.geometry import geometry_from_config

    g = geometry_from_config(LlamaConfig(num_hidden_layers=3, num_attention_heads=8,
                                                num_key_value_heads=2, hidden_size=256))
    assert (g.n_layers, g.layers[0].n_kv_heads, g.layers[0].head_dim, g.windows) == (3, 2, 32, (None, None, None))
    g = geometry_from_config(Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=4,
                                                     num_key_value_heads=1, head_dim=256,
                                                     sliding_window=512))
    assert g.windows == (512,) * 5 + (None,) and {x.head_dim for x in g.layers} == {256}


# ---------------------------------------------------------------- image-text checkpoints, random weights

QWEN_TEXT = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
                 linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                 layer_types=["linear_attention"] * 3 + ["full_attention"])
GEMMA_TEXT = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                  attention_k_eq_v=True, sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                  hidden_size_per_layer_input=0, vocab_size_per_layer_input=384, final_logit_softcapping=30.0)


def _image_text(arch: str, out: Path):
    """A tiny random image-text checkpoint (the real classes), saved with a tokenizer."""
    import torch
    from transformers import (Gemma4Config, Gemma4ForConditionalGeneration, Qwen3_5Config,
                              Qwen3_5ForConditionalGeneration)

    from kvarn.weights.random_model import byte_tokenizer

    torch.manual_seed(0)
    if arch == "qwen3_5":
        m = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=QWEN_TEXT, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                      out_hidden_size=64)))
    else:
        m = Gemma4ForConditionalGeneration(Gemma4Config(
            text_config=GEMMA_TEXT, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=2, num_key_value_heads=2, head_dim=16),
            audio_config=None))
    m.eval().save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return m


@pytest.mark.parametrize("arch,cls,geom", [
    ("qwen3_5", "Qwen3_5ForCausalLM", "3 linear_attention; 1 full_attention (2 KV heads x 32)"),
    ("gemma4", "Gemma4ForCausalLM", "3 sliding_attention (2 KV heads x 16, W 8); 1 full_attention (1 KV heads x 32, K=V)"),
])
def test_image_text_checkpoint_loads_language_model_only(tmp_path, arch, cls, geom):
    import torch

    full = _image_text(arch, tmp_path / arch)
    lm = models.load(ModelSpec(arch, str(tmp_path / arch)), device="cpu")
    assert type(lm.model).__name__ == cls  # no vision/audio tower was built
    assert not any("visual" in n or "vision" in n or "audio" in n for n, _ in lm.model.named_parameters())
    assert lm.info.geometry.describe() == geom and lm.info.vocab_size == 384
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = full(input_ids=ids).logits, lm.model(input_ids=ids).logits
    assert torch.equal(want, got)  # the same text weights, the same forward: bit for bit


def test_image_text_missing_text_tensor_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    _image_text("qwen3_5", tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    del sd["model.language_model.norm.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing from the checkpoint.*model\.norm\.weight"):
        models.load(ModelSpec("q", str(tmp_path)), device="cpu")


def test_random_source_builds_seeded_model_in_compute_dtype(tmp_path):
    import json

    import torch

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "qwen3_5_text", **QWEN_TEXT}))
    a = models.load(ModelSpec("t", f"random:{cfg}"), device="cpu", dtype="bfloat16")
    b = models.load(ModelSpec("t", f"random:{cfg}"), device="cpu", dtype="bfloat16")
    assert {p.dtype for p in a.model.parameters()} == {torch.bfloat16}
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)  # the seed fixes the weights
    assert pa["model.layers.3.self_attn.q_proj.weight"].std() > 0  # drawn, not left empty
    assert a.info.revision.startswith("random:sha256:") and a.info.geometry.n_layers == 4
    assert (a.info.add_bos, a.info.vocab_size) == (False, 384)
    assert a.tokenizer("Valkyria é", add_special_tokens=True)["input_ids"] == list("Valkyria é".encode())


def test_random_source_study_configs_on_meta():
    """The study's text configs build at full size (meta device: shapes, no memory)."""
    a = models.load(ModelSpec("q", f"random:{REPO}/config/models/qwen3.6-27b.json"), device="meta", dtype="bfloat16")
    assert a.info.geometry.describe() == "48 linear_attention; 16 full_attention (4 KV heads x 256)"
    assert a.info.vocab_size == 248320
    g = models.load(ModelSpec("g", f"random:{REPO}/config/models/gemma4-31b.json"), device="meta", dtype="bfloat16")
    assert g.info.geometry.describe() == ("50 sliding_attention (16 KV heads x 256, W 1024); "
                                          "10 full_attention (4 KV heads x 512, K=V)")


class _Tok:
    def __init__(self, bos_id, adds):
        self.bos_token_id, self.adds = bos_id, adds

    def __call__(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens and self.adds else []) + ids}


def test_detect_add_bos_synthetic():
    assert models.detect_add_bos(_Tok(2, True)) == (True, 2)
    assert models.detect_add_bos(_Tok(1, False)) == (False, None)
    assert models.detect_add_bos(_Tok(None, False)) == (False, None)


# ---------------------------------------------------------------- real models (slow)


@pytest.fixture(scope="session")
def real_models():
    cache = REPO / DEFAULT_CACHE_DIR
    return {name: models.load(ModelSpec(name, f"embedded:{name}"), cache, device="cpu")
            for name in ("smollm2-135m", "gemma3-270m")}


@pytest.mark.slow
def test_real_smollm2(real_models):
    info = real_models["smollm2-135m"].info
    g = info.geometry
    assert (g.n_layers, g.layers[0].n_kv_heads, g.layers[0].head_dim) == (30, 3, 64)
    assert g.windows == (None,) * 30
    assert (info.add_bos, info.bos_id, info.vocab_size) == (False, None, 49152)
    assert info.dtype == "float32" and info.device == "cpu"
    assert info.revision == "sha256:" + EMBEDDED["smollm2-135m"].sha256
    assert len(info.tokenizer_hash) == 64
    assert not real_models["smollm2-135m"].model.training


@pytest.mark.slow
def test_real_gemma3(real_models):
    info = real_models["gemma3-270m"].info
    g = info.geometry
    assert (g.n_layers, g.layers[0].n_kv_heads, g.layers[0].head_dim) == (18, 1, 256)
    assert g.windows == ((512,) * 5 + (None,)) * 3
    assert (info.add_bos, info.bos_id, info.vocab_size) == (True, 2, 262144)
    assert info.tokenizer_hash != real_models["smollm2-135m"].info.tokenizer_hash
    assert real_models["gemma3-270m"].model.config._attn_implementation == "sdpa"
