"""One GGUF file read without loading a model: its parsed reader, metadata and config.

Owns `reader` (one parsed `gguf.GGUFReader` per file and process), `field` (a metadata
value), `architecture`, `tensor` (a tensor dequantized to torch), `gemma4_config` and
`config_dict` (the transformers ``config.json`` a GGUF's metadata describes). Nothing here
imports torch, transformers or gguf at module import: `kvarn.weights.sources` (the config of a
model before any weights load), `kvarn.llamacpp_cpu.compute` (llamacpp-cpu's weight types) and
`kvarn.weights.gguf_weights` (the model itself) all read GGUFs through this module.
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
    """The file's `gguf.GGUFReader` (an `array_reader`), parsed once per process: gguf-py parses
    every metadata field eagerly (Gemma 3's 262k-token vocabulary) and loading, the tokenizer
    and llamacpp-cpu's weight types each read the same file. Keyed on the file's size and mtime
    as well, so a rewritten file is parsed again. Read-only (a memory map)."""
    st = os.stat(path)
    return _reader(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _reader(path: str, size: int, mtime_ns: int):
    return array_reader(path)


def array_reader(path, mode: str = "r"):
    """gguf-py's own `GGUFReader` of `path`, its parse run over a plain ndarray view of the file's
    memory map instead of the `np.memmap` itself: the parse slices the map once or twice per value
    (Gemma 3's vocabulary: about a million slices), and every slice of an `np.memmap` runs its
    Python-level `__getitem__` and `__array_finalize__`, most of the parse's time. The same code
    reads the same bytes: the fields and tensors hold equal values (tests/test_sources.py), as
    views of the same read-only map."""
    from gguf.gguf_reader import GGUFReader  # the class itself: `gguf.GGUFReader` may be swapped (parsed_once)

    return _array_reader_class(GGUFReader)(path, mode)


@functools.lru_cache(maxsize=None)
def _array_reader_class(base):
    import numpy as np

    class ArrayReader(base):
        @property
        def data(self):
            return self._array

        @data.setter
        def data(self, mapped):  # GGUFReader.__init__ assigns its np.memmap here before parsing
            self._array = mapped.view(np.ndarray)

    return ArrayReader


def architecture(path: Path) -> str:
    return field(reader(path), "general.architecture")


def field(reader, key: str, default: Any = KeyError):
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise ValueError(f"GGUF has no metadata key {key!r}")
        return default
    return f.contents()


def tensor(t, dtype=None):
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


def gemma4_config(reader) -> dict:
    """The ``gemma4_text`` config.json of a gemma4 GGUF, from its metadata and tensor list."""
    a = "gemma4"
    g = lambda k, d=KeyError: field(reader, f"{a}.{k}", d)  # noqa: E731
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
        freqs = tensor(tensors["rope_freqs.weight"])
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
        v = field(reader, f"tokenizer.ggml.{tok}_token_id", None)
        if v is not None:
            cfg[key] = int(v)
    return cfg


def config_dict(path: Path) -> dict:
    """The transformers config (a ``config.json`` dict) a GGUF's metadata describes."""
    r = reader(path)
    if field(r, "general.architecture") == "gemma4":
        return gemma4_config(r)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
