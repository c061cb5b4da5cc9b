"""Building a causal LM in torch: the device and dtype a job runs on, an empty or seeded
model of a config, and filling its weights from named tensors.

Shared by every way a model is made (`kvarn.weights.models` from a transformers directory,
`kvarn.weights.gguf_weights` from a GGUF, `kvarn.weights.random_model` from a config file) and by the
preflight's estimate (`pick_device_dtype`). Imports only `kvarn.vocab.options`; torch and
transformers only inside the functions.
"""

from __future__ import annotations

from kvarn.vocab.options import MODEL_DTYPES


def pick_device_dtype(device: str, dtype):
    """(device, torch dtype) a job runs on: "auto" device is CUDA when present, else CPU;
    "auto" dtype bfloat16 on CUDA, float32 on CPU; a dtype name is one of `kvarn.vocab.options.MODEL_DTYPES`."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    elif isinstance(dtype, str):
        names = {n: getattr(torch, n) for n in MODEL_DTYPES}
        if dtype not in names:
            raise ValueError(f"dtype {dtype!r}: expected 'auto' or one of {sorted(names)}")
        dtype = names[dtype]
    return str(device), dtype


def build_model(config, device: str, dtype, attn_implementation: str, init: bool):
    """The causal LM for a text config, built directly on `device` in `dtype` (no fp32 host
    copy). `init`: draw random weights (seeded by the caller); else leave them empty for
    the caller to fill, as transformers' own loader does."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    ctx = contextlib.nullcontext() if init else no_init_weights()
    with ctx, torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model


def fill_weights(model, tensors, where: str) -> None:
    """Copy (name, tensor) pairs into `model`'s parameters and persistent buffers (cast to
    their dtype, on their device); every one must be given once, except an output head
    tied to the embeddings. Names not in the model are an error, naming them."""
    import torch

    own = model.state_dict(keep_vars=True)
    seen, unknown = set(), []
    with torch.no_grad():
        for name, t in tensors:
            if name not in own:
                unknown.append(name)
                continue
            dst = own[name]
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"{where}: tensor {name} has shape {tuple(t.shape)}, the model expects {tuple(dst.shape)}")
            dst.copy_(t)
            seen.add(name)
    if unknown:
        raise ValueError(f"{where}: {len(unknown)} tensors the model does not have, e.g. {sorted(unknown)[:5]}")
    tied = set()
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
        tied = {"lm_head.weight"}
    missing = sorted(set(own) - seen - tied)
    if missing:
        raise ValueError(f"{where}: {len(missing)} model tensors missing from the checkpoint, e.g. {missing[:5]}")
