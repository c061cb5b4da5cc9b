"""Loading and describing a model: what `kvarn.weights.sources` fetched, in eval mode, with its facts.

Owns: `load` (model + tokenizer + `ModelInfo`: cache geometry, BOS behaviour, vocabulary
size, tokenizer identity), `detect_add_bos` and `tokenizer_hash`. Where the weights come
from (and their verification) is `kvarn.weights.sources`; the cache geometry is `kvarn.vocab.geometry`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvarn.weights import gguf_weights, random_model
from kvarn.vocab.geometry import Geometry, geometry_from_config
from kvarn.weights.modelbuild import build_model, fill_weights, pick_device_dtype
from kvarn.weights.sources import DEFAULT_CACHE_DIR, ModelSpec, is_text_weight, resolve

@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str
    revision: str | None  # embedded/.gguf: "sha256:<gguf>"; hf: the resolved commit
    geometry: Geometry
    add_bos: bool  # the tokenizer prepends BOS when encoding with special tokens
    bos_id: int | None  # the BOS id if add_bos, else None (what make_chunks expects)
    vocab_size: int  # logits width
    tokenizer_hash: str
    dtype: str
    device: str


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    info: ModelInfo = field(repr=False)


# ----------------------------------------------------------------------------- load


def detect_add_bos(tokenizer) -> tuple[bool, int | None]:
    """Whether encoding with special tokens prepends BOS (by encoding a probe string)."""
    probe = " = Robert Boulter = \n"
    with_sp = tokenizer(probe, add_special_tokens=True)["input_ids"]
    without = tokenizer(probe, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    add = bos is not None and len(with_sp) > len(without) and with_sp[0] == bos and with_sp[1:][: len(without)] == without
    return add, (bos if add else None)


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary, special tokens and behaviour on a probe text:
    stable across library versions, different whenever tokenization would differ."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    probe = " = Valkyria Chronicles III = \n Senjō no Valkyria 3 : <unk> Chronicles ( Japanese : 戦場のヴァルキュリア3 ) , 1 @,@ 000 \n"
    doc = {
        "vocab": vocab,
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "probe": tokenizer(probe, add_special_tokens=True)["input_ids"],
    }
    return hashlib.sha256(json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def _text_only(path: Path, device: str, dtype, attn_implementation: str):
    """The language model of an image-text checkpoint (Qwen3_5ForConditionalGeneration,
    Gemma4ForConditionalGeneration): its text config's causal-LM class, filled from the
    ``model.language_model.*`` and ``lm_head.*`` tensors only (renamed to ``model.*``), so the
    vision/audio towers are never read — nor downloaded (`kvarn.weights.sources` fetches only the
    shards that hold text tensors)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).get_text_config(decoder=True)
    model = build_model(config, device, dtype, attn_implementation, init=False)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        keys_by_file: dict[str, list[str]] = {}
        for k, f in weight_map.items():
            if is_text_weight(k, True):
                keys_by_file.setdefault(f, []).append(k)
    else:
        keys_by_file = {"model.safetensors": None}

    def tensors():
        for fname, keys in keys_by_file.items():
            with safe_open(path / fname, framework="pt", device="cpu") as f:
                for k in keys if keys is not None else f.keys():
                    if is_text_weight(k, True):
                        yield k.replace("model.language_model.", "model.", 1), f.get_tensor(k)

    fill_weights(model, tensors(), f"{path} (language model of an image-text checkpoint)")
    return model


def load(
    spec: ModelSpec,
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    device: str = "auto",
    dtype="auto",
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Fetch if needed, then load model (eval mode) and tokenizer and describe them.

    A transformers directory loads with `from_pretrained`, an image-text one as its
    language model only; a ``.gguf`` through `kvarn.weights.gguf_weights` (qwen35, gemma4) or
    transformers' GGUF loader; ``random:<config.json>`` builds the model with seeded random
    weights and the byte-level stand-in tokenizer (`kvarn.weights.random_model`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, revision = resolve(spec, cache_dir)
    device, torch_dtype = pick_device_dtype(device, dtype)
    if spec.kind.random_weights:
        model, tokenizer = random_model.build(path, device, torch_dtype, attn_implementation)
    elif path.is_file():  # a .gguf
        model, tokenizer = gguf_weights.load(path, device, torch_dtype, attn_implementation)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if "text_config" in json.loads((path / "config.json").read_text()):
            model = _text_only(path, device, torch_dtype, attn_implementation)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype,
                                                         attn_implementation=attn_implementation)
    model.to(device).eval()
    add_bos, bos_id = detect_add_bos(tokenizer)
    cfg = model.config.get_text_config()
    info = ModelInfo(
        name=spec.name,
        source=spec.source,
        revision=revision,
        geometry=geometry_from_config(model.config),
        add_bos=add_bos,
        bos_id=bos_id,
        vocab_size=int(cfg.vocab_size),
        tokenizer_hash=tokenizer_hash(tokenizer),
        dtype=str(torch_dtype).removeprefix("torch."),
        device=device,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)
