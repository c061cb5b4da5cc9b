"""llama.cpp's channel order of Q and K (`gguf_qk_permuted`, `gguf_order`).

transformers rotates the two halves of a head (`rotate_half`: channel i with i + d/2) for
every architecture below. llama.cpp rotates adjacent pairs (2i, 2i+1) where its RoPE type
(src/llama-model.cpp `llama_model_rope_type`) is NORM, so its converter reorders those
architectures' q_proj/k_proj rows per head (conversion/llama.py `LlamaModel.permute`: GGUF
position 2i+s holds HF dimension s*d/2+i) and transformers' GGUF loader
(`LlamaTensorProcessor`) reorders them back. NEOX/IMROPE architectures rotate the halves,
as transformers does, and are stored unpermuted. The value: whether llama.cpp's Q and K
channels are in the GGUF (interleaved) order rather than transformers' order.
"""

from __future__ import annotations

import torch

from kvarn.vocab.options import LLAMACPP_CPU

GGUF_QK_PERMUTED = {
    "llama": True, "mistral": True, "mixtral": True,  # LLM_ARCH_LLAMA: NORM
    "gemma3": False, "gemma3_text": False, "gemma4": False, "gemma4_text": False,  # NEOX
    "qwen2": False, "qwen3": False,  # NEOX
    "qwen3_5": False, "qwen3_5_text": False,  # IMROPE (neox halves, interleaved sections)
}


def gguf_qk_permuted(model_type: str) -> bool:
    """Whether llama.cpp holds this architecture's Q/K head channels in the GGUF's interleaved order."""
    if model_type not in GGUF_QK_PERMUTED:
        raise ValueError(
            f"compute {LLAMACPP_CPU}: model_type {model_type!r}: llama.cpp's channel order of Q and K "
            f"(whether its GGUF permutes q_proj/k_proj) is not known for it; known: {', '.join(GGUF_QK_PERMUTED)}")
    return GGUF_QK_PERMUTED[model_type]


def gguf_order(d: int, device=None) -> torch.Tensor:
    """Gather index of one head of width d: x[..., gguf_order(d)] is x in the GGUF order
    (position 2i+s holds transformers' dimension s*d/2+i)."""
    if d % 2:
        raise ValueError(f"head dim {d} is odd; the GGUF Q/K order pairs channels i and i + d/2")
    return torch.arange(d, device=device).view(2, d // 2).t().reshape(-1)
