"""kvarn.models: geometry of loaded configs, BOS detection, loading the real embedded models.

The slow tests fetch and load the two real embedded models into the repository's
default cache (resources/models), once per machine.
"""

from pathlib import Path

import pytest

from kvarn import models
from kvarn.sources import DEFAULT_CACHE_DIR, EMBEDDED, ModelSpec

REPO = Path(__file__).resolve().parents[1]


def test_geometry_from_synthetic_configs():
    from transformers import Gemma3TextConfig, LlamaConfig

    from kvarn.geometry import geometry_from_config

    g = geometry_from_config(LlamaConfig(num_hidden_layers=3, num_attention_heads=8,
                                                num_key_value_heads=2, hidden_size=256))
    assert (g.n_layers, g.layers[0].n_kv_heads, g.layers[0].head_dim, g.windows) == (3, 2, 32, (None, None, None))
    g = geometry_from_config(Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=4,
                                                     num_key_value_heads=1, head_dim=256,
                                                     sliding_window=512))
    assert g.windows == (512,) * 5 + (None,) and {x.head_dim for x in g.layers} == {256}


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
