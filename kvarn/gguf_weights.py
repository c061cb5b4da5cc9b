"""GGUF weights as a transformers model (placeholder, filled below)."""

from __future__ import annotations

from pathlib import Path


def load(path: Path, device: str, dtype, attn_implementation: str = "sdpa"):
    """(model, tokenizer) from a .gguf file: transformers' own GGUF loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    return model, tokenizer


def config_dict(path: Path) -> dict:
    """The transformers config (a ``config.json`` dict) a GGUF's metadata describes."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
