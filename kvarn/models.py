"""Loading and describing a model: what `kvarn.sources` fetched, in eval mode, with its facts.

Owns: `load` (model + tokenizer + `ModelInfo`: cache geometry, BOS behaviour, vocabulary
size, tokenizer identity), `detect_add_bos` and `tokenizer_hash`. Where the weights come
from (and their verification) is `kvarn.sources`; the cache geometry is `kvarn.geometry`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from kvarn.geometry import Geometry, geometry_from_config
from kvarn.sources import DEFAULT_CACHE_DIR, ModelSpec, resolve

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


def _pick_device_dtype(device: str, dtype):
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    elif isinstance(dtype, str):
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype not in names:
            raise ValueError(f"dtype {dtype!r}: expected 'auto' or one of {sorted(names)}")
        dtype = names[dtype]
    return str(device), dtype


def load(
    spec: ModelSpec,
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    device: str = "auto",
    dtype="auto",
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Fetch if needed, then load model (eval mode) and tokenizer and describe them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, revision = resolve(spec, cache_dir)
    device, torch_dtype = _pick_device_dtype(device, dtype)
    kw: dict[str, Any] = {}
    if path.is_file():  # a local .gguf
        kw["gguf_file"] = path.name
        path = path.parent
    tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, attn_implementation=attn_implementation, **kw
    )
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
