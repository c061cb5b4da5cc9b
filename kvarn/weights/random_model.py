"""Study-scale models with random weights, for speed and memory only (``random:<config.json>``).

Owns: `build` (the causal LM of a config file kept in the repository, e.g.
``config/models/qwen3.6-27b.json``, with weights drawn from a fixed seed directly on the
device in the compute dtype — no fp32 copy on the host, no download) and `byte_tokenizer`
(the stand-in tokenizer such a model is paired with).

The stand-in tokenizer is byte-level: one token per UTF-8 byte of the text, ids 0..255, no
BOS, no merges. wiki.test.raw then makes about 4x as many tokens as a real BPE tokenizer
would, which changes nothing per chunk of n_ctx tokens: time and memory per chunk depend on
n_ctx and the model, not on which ids fill it. The log-probs of random weights mean nothing:
a ``random:`` source measures tokens/s and memory at the study's scale, never KLD or PPL
figures (its revision, ``random:sha256:<config>:seed<N>``, marks every dump and summary).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvarn.weights.modelbuild import build_model
from kvarn.weights.sources import RANDOM_SEED


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what a ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer():
    """A transformers fast tokenizer mapping each UTF-8 byte to its own id (0..255)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def build(config_path: Path, device: str, dtype, attn_implementation: str = "sdpa"):
    """(model, tokenizer): the causal LM of `config_path` with seeded random weights."""
    import torch
    from transformers import AutoConfig

    raw = json.loads(Path(config_path).read_text())
    model_type = raw.get("model_type")
    if not model_type:
        raise ValueError(f"{config_path}: no model_type; cannot tell which architecture to build")
    config = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    config = config.get_text_config(decoder=True)
    if int(config.vocab_size) < 256:
        raise ValueError(f"{config_path}: vocab_size {config.vocab_size} < 256, too small for the byte-level tokenizer")
    torch.manual_seed(RANDOM_SEED)
    if str(device).startswith("cuda"):
        torch.cuda.manual_seed_all(RANDOM_SEED)
    model = build_model(config, device, dtype, attn_implementation, init=True)
    return model, byte_tokenizer()
