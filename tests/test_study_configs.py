"""The study's two models as config files (config/models/): their per-layer geometry is
exactly the study's, and transformers builds the real model class from them at the
published size (on the meta device: no weights, no memory)."""

import json
from pathlib import Path

import pytest
import torch

from kvarn.vocab.geometry import Geometry, LayerGeometry, geometry_from_config

MODELS = Path(__file__).resolve().parents[1] / "config" / "models"


def _load(name):
    with open(MODELS / f"{name}.json") as f:
        return json.load(f)


def test_qwen36_27b_geometry():
    # 16 x (3 Gated DeltaNet + 1 full attention), 4 KV heads x 256 on the attention layers
    want = Geometry(tuple(
        LayerGeometry("full_attention", 4, 256) if i % 4 == 3 else LayerGeometry("linear_attention")
        for i in range(64)
    ))
    assert geometry_from_config(_load("qwen3.6-27b")) == want


def test_gemma4_31b_geometry():
    # 10 x (5 sliding, W 1024, 16 KV heads x 256 + 1 full, 4 KV heads x 512, K = V)
    want = Geometry(tuple(
        LayerGeometry("full_attention", 4, 512, k_eq_v=True) if i % 6 == 5
        else LayerGeometry("sliding_attention", 16, 256, window=1024)
        for i in range(60)
    ))
    assert geometry_from_config(_load("gemma4-31b")) == want


@pytest.mark.parametrize("name, cls, lo, hi", [
    # text decoder only: the published 27B / 30.7B include the vision tower (and Qwen's MTP head)
    ("qwen3.6-27b", "Qwen3_5ForCausalLM", 26.5e9, 27.5e9),
    ("gemma4-31b", "Gemma4ForCausalLM", 30.5e9, 31.0e9),
])
def test_instantiates_real_class_at_size(name, cls, lo, hi, one_thread):
    from transformers import AutoModelForCausalLM

    from kvarn.vocab.geometry import config_object

    config = config_object(_load(name))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == cls
    assert lo < sum(p.numel() for p in model.parameters()) < hi
    # the config's own architectures entry names the class it builds
    assert _load(name)["architectures"] == [cls]
