"""GGUF weights as a transformers model: the study's architectures (qwen35, gemma4) and the rest.

Owns: `reader` (one parsed `gguf.GGUFReader` per file and process), `load` (model + tokenizer
from one ``.gguf``, tensors dequantized with the `gguf` package and cast to the compute
dtype), `config_dict` (the transformers ``config.json`` a GGUF's metadata describes) and, for
``gemma4``, the name and layout mapping (`gemma4_config`, `hf_to_gguf_names`).

* ``qwen35`` (Qwen 3.5 / 3.6): transformers 5.24's own GGUF loader, which maps it (norms
  shifted back by 1, ``ssm_a`` = -exp(A_log) inverted, the V heads of the linear-attention
  projections reordered from llama.cpp's tiled order back to HF's grouped one).
* ``gemma4``: transformers 5.24 reads its per-layer KV-head array as one integer and
  fails, so this module builds the config from the metadata itself (per-layer KV heads
  and head dims, sliding pattern, K = V on full layers when they carry no ``attn_v``,
  proportional RoPE's rotated fraction from ``rope_freqs``) and maps tensor names with the
  `gguf` package's own table (`gguf.get_tensor_name_map`), the table llama.cpp's converter
  writes them with; Gemma 4 stores its norms unshifted and needs no other layout change.
* any other architecture: transformers' GGUF loader as it stands.

The oracle for all of this is llama.cpp's converter (`bench/gguf_roundtrip.py` converts
tiny random qwen3_5 and gemma4 models with it and reloads them here); CI checks the
mapping against the `gguf` package's tables and a GGUF written in-test.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

# rope_freqs holds 1.0 for rotated and this for unrotated frequency pairs (llama.cpp's
# encoding of Gemma 4's "proportional" RoPE on full-attention layers).
UNROTATED = 1e29


def reader(path: Path):
    """The file's `gguf.GGUFReader`, parsed once per process: gguf-py parses every metadata
    field eagerly, ~18 s for Gemma 3's 262k-token vocabulary on a 2-core machine, and loading,
    the tokenizer and llamacpp-cpu's weight types each read the same file. Keyed on the
    file's size and mtime as well, so a rewritten file is parsed again. Read-only (a memmap)."""
    st = os.stat(path)
    return _reader(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _reader(path: str, size: int, mtime_ns: int):
    from gguf import GGUFReader

    return GGUFReader(path)


def architecture(path: Path) -> str:
    return _field(reader(path), "general.architecture")


def _field(reader, key: str, default: Any = KeyError):
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise ValueError(f"GGUF has no metadata key {key!r}")
        return default
    return f.contents()


def _tensor(t, dtype=None):
    """A reader tensor, dequantized, in torch (row-major, HF) order."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, dequantize

    shape = tuple(reversed([int(x) for x in t.shape]))
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        a = np.asarray(t.data)
    else:
        a = dequantize(t.data, t.tensor_type)
    out = torch.from_numpy(np.array(a, dtype=np.float32).reshape(shape))  # a copy: the reader memory-maps the file
    return out if dtype is None else out.to(dtype)


# ----------------------------------------------------------------------------- gemma4


def gemma4_config(reader) -> dict:
    """The ``gemma4_text`` config.json of a gemma4 GGUF, from its metadata and tensor list."""
    a = "gemma4"
    g = lambda k, d=KeyError: _field(reader, f"{a}.{k}", d)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    n = int(g("block_count"))
    sliding = [bool(x) for x in g("attention.sliding_window_pattern")]
    if len(sliding) != n:
        raise ValueError(f"gemma4 GGUF: sliding_window_pattern has {len(sliding)} entries for {n} layers")
    kv = g("attention.head_count_kv")
    kv = [int(x) for x in kv] if isinstance(kv, list) else [int(kv)] * n
    kv_swa = {kv[i] for i in range(n) if sliding[i]}
    kv_full = {kv[i] for i in range(n) if not sliding[i]}
    if len(kv_swa) > 1 or len(kv_full) > 1:
        raise ValueError(f"gemma4 GGUF: KV heads per layer {kv} vary within sliding or full layers")
    ff = g("feed_forward_length")
    if isinstance(ff, list) or g("expert_count", 0) or g("embedding_length_per_layer_input", 0):
        raise ValueError("gemma4 GGUF with double-wide MLP, experts or per-layer input embeddings: "
                         "not supported (the study's Gemma 4 31B has none)")
    head_full, head_swa = int(g("attention.key_length")), int(g("attention.key_length_swa"))
    full_layers = [i for i in range(n) if not sliding[i]]
    k_eq_v = bool(full_layers) and all(f"blk.{i}.attn_v.weight" not in tensors for i in full_layers)
    rope_full = {"rope_type": "proportional", "rope_theta": float(g("rope.freq_base")), "partial_rotary_factor": 1.0}
    if "rope_freqs.weight" in tensors:
        freqs = _tensor(tensors["rope_freqs.weight"])
        rope_full["partial_rotary_factor"] = 2 * int((freqs < UNROTATED).sum()) / head_full
    vocab = int(tensors["token_embd.weight"].shape[-1])
    cfg = {
        "model_type": "gemma4_text",
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "hidden_size_per_layer_input": 0,
        "hidden_size": int(g("embedding_length")),
        "intermediate_size": int(ff),
        "num_hidden_layers": n,
        "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": kv_swa.pop() if kv_swa else kv[0],
        "head_dim": head_swa,
        "global_head_dim": head_full,
        "attention_k_eq_v": k_eq_v,
        "sliding_window": int(g("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "final_logit_softcapping": g("final_logit_softcapping", None),
        "max_position_embeddings": int(g("context_length")),
        "num_kv_shared_layers": int(g("attention.shared_kv_layers", 0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_parameters": {
            "full_attention": rope_full,
            "sliding_attention": {"rope_type": "default", "rope_theta": float(g("rope.freq_base_swa"))},
        },
    }
    if kv_full:
        cfg["num_global_key_value_heads"] = kv_full.pop()
    for key, tok in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        v = _field(reader, f"tokenizer.ggml.{tok}_token_id", None)
        if v is not None:
            cfg[key] = int(v)
    return cfg


def hf_to_gguf_names(model, arch: str = "gemma4", strict: bool = True) -> dict[str, str]:
    """HF state-dict key -> GGUF tensor name, by the `gguf` package's table for `arch`
    (`strict`: every key must have a name)."""
    import gguf

    n_blocks = model.config.get_text_config().num_hidden_layers
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_blocks)
    out, unmapped = {}, []
    for key in model.state_dict():
        # llama.cpp's converter names Gemma 4's suffix-less tensors (layer_scalar) "<name>.weight"
        lookup = key + ".weight" if arch == "gemma4" and not key.endswith((".weight", ".bias")) else key
        name = table.get_name(lookup, try_suffixes=(".weight", ".bias"))
        if name is None:
            unmapped.append(key)
        else:
            out[key] = name
    if unmapped and strict:
        raise ValueError(f"{arch}: the gguf package's tensor-name table has no name for {unmapped[:5]}")
    return out


def _gemma4_model(path: Path, reader, device: str, dtype, attn_implementation: str):
    from transformers import AutoConfig

    from kvarn.models import _build, fill_weights

    raw = gemma4_config(reader)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    model = _build(config, device, dtype, attn_implementation, init=False)
    names = hf_to_gguf_names(model, "gemma4")
    by_gguf = {v: k for k, v in names.items()}
    if model.config.tie_word_embeddings:
        by_gguf.pop("output.weight", None)
    tensors = {t.name: t for t in reader.tensors}
    extra = sorted(set(tensors) - set(by_gguf) - {"rope_freqs.weight"})
    if extra:
        raise ValueError(f"{path}: GGUF tensors with no place in Gemma4ForCausalLM: {extra[:5]}")
    fill_weights(model, ((by_gguf[name], _tensor(t)) for name, t in tensors.items() if name in by_gguf), str(path))
    return model


# ----------------------------------------------------------------------------- entry points


def tokenizer(path: Path):
    """The GGUF's own tokenizer (its vocabulary, merges and special tokens), adding BOS when
    the GGUF says so (``tokenizer.ggml.add_bos_token``), as llama.cpp does."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    r = reader(path)
    if _field(r, "tokenizer.ggml.add_bos_token", False):
        bos_id = int(_field(r, "tokenizer.ggml.bos_token_id"))
        bos = tok.convert_ids_to_tokens(bos_id)
        if tok("a", add_special_tokens=True)["input_ids"][:1] != [bos_id]:
            tok._tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
            tok.bos_token = bos
    return tok


def config_dict(path: Path) -> dict:
    """The transformers config (a ``config.json`` dict) a GGUF's metadata describes."""
    r = reader(path)
    if _field(r, "general.architecture") == "gemma4":
        return gemma4_config(r)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])


def load(path: Path, device: str, dtype, attn_implementation: str = "sdpa"):
    """(model, tokenizer) from a .gguf file, weights dequantized to `dtype` on `device`."""
    r = reader(path)
    arch = _field(r, "general.architecture")
    if arch == "gemma4":
        return _gemma4_model(path, r, device, dtype, attn_implementation), tokenizer(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    return model, tok
