"""GGUF weights as a transformers model: the study's architectures (qwen35, gemma4) and the rest.

Owns: `load` (model + tokenizer from one ``.gguf``, tensors dequantized with the `gguf`
package and cast to the compute dtype), `tokenizer`, and for ``gemma4`` the name mapping
(`hf_to_gguf_names`) and the model (`gemma4_model`). The file itself (the parsed reader, its
metadata, `gemma4_config`, `config_dict`) is `kvarn.weights.gguf_file`.

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

The oracle for all of this is llama.cpp's converter (`bench/oracles/llamacpp/gguf_roundtrip.py` converts
tiny random qwen3_5 and gemma4 models with it and reloads them here); CI checks the
mapping against the `gguf` package's tables and a GGUF written in-test.
"""

from __future__ import annotations

from pathlib import Path

from kvarn.weights.gguf_file import field, gemma4_config, reader, tensor
from kvarn.weights.modelbuild import build_model, fill_weights

# ----------------------------------------------------------------------------- gemma4


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


def gemma4_model(path: Path, reader, device: str, dtype, attn_implementation: str):
    from transformers import AutoConfig

    raw = gemma4_config(reader)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    model = build_model(config, device, dtype, attn_implementation, init=False)
    names = hf_to_gguf_names(model, "gemma4")
    by_gguf = {v: k for k, v in names.items()}
    if model.config.tie_word_embeddings:
        by_gguf.pop("output.weight", None)
    tensors = {t.name: t for t in reader.tensors}
    extra = sorted(set(tensors) - set(by_gguf) - {"rope_freqs.weight"})
    if extra:
        raise ValueError(f"{path}: GGUF tensors with no place in Gemma4ForCausalLM: {extra[:5]}")
    fill_weights(model, ((by_gguf[name], tensor(t)) for name, t in tensors.items() if name in by_gguf), str(path))
    return model


# ----------------------------------------------------------------------------- entry points


def tokenizer(path: Path):
    """The GGUF's own tokenizer (its vocabulary, merges and special tokens), adding BOS when
    the GGUF says so (``tokenizer.ggml.add_bos_token``), as llama.cpp does."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    r = reader(path)
    if field(r, "tokenizer.ggml.add_bos_token", False):
        bos_id = int(field(r, "tokenizer.ggml.bos_token_id"))
        bos = tok.convert_ids_to_tokens(bos_id)
        if tok("a", add_special_tokens=True)["input_ids"][:1] != [bos_id]:
            tok._tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
            tok.bos_token = bos
    return tok


def load(path: Path, device: str, dtype, attn_implementation: str = "sdpa"):
    """(model, tokenizer) from a .gguf file, weights dequantized to `dtype` on `device`."""
    r = reader(path)
    arch = field(r, "general.architecture")
    if arch == "gemma4":
        return gemma4_model(path, r, device, dtype, attn_implementation), tokenizer(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    return model, tok
