"""The evaluation text and how it is cut into chunks (DESIGN §6).

Owns: reading Wikitext-2 raw `wiki.test.raw` (or the validation split `wiki.valid.raw`, the
per-layer search's text) byte for byte (from a file, or rebuilt from the Hugging Face
`Salesforce/wikitext` rows), tokenizing it once as a whole, cutting the
tokens into llama-perplexity chunks, and the positions whose logits are scored.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import torch

# The original `wikitext-2-raw-v1.zip` member (see shared/data/wikitext-2-raw-v1/README.md).
WIKI_TEST_BYTES = 1_290_590
WIKI_TEST_SHA256 = "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"

WIKI_VALID_BYTES = 1_146_846
WIKI_VALID_SHA256 = "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7"
# split -> (file name, bytes, sha256): the evaluation text, and the text the per-layer search reads
SPLITS = {"test": ("wiki.test.raw", WIKI_TEST_BYTES, WIKI_TEST_SHA256),
          "validation": ("wiki.valid.raw", WIKI_VALID_BYTES, WIKI_VALID_SHA256)}

HUB_DATASET = ("Salesforce/wikitext", "wikitext-2-raw-v1")


def text_sha256(text: str) -> str:
    """sha256 (hex) of the text's UTF-8 bytes: the identity of the evaluation text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def rebuild_raw(rows: Iterable[str]) -> str:
    """The raw file from the hub's `text` rows.

    The hub loader turns every blank `" \\n"` line of the original file into an empty row
    and keeps the other lines with their trailing newline, so putting `" \\n"` back for
    each empty row and concatenating restores the file exactly.
    """
    return "".join(row if row else " \n" for row in rows)


def check_wiki_test(text: str, source: str, split: str = "test") -> str:
    """Return `text` if it is the original file of `split` (wiki.test.raw, wiki.valid.raw), else raise naming `source`."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not a Wikitext-2 split kvarn reads; use one of {', '.join(SPLITS)}")
    name, size, sha = SPLITS[split]
    data = text.encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != size or digest != sha:
        raise ValueError(
            f"{source} is not the original wikitext-2-raw-v1 {name}: "
            f"{len(data):,} bytes, sha256 {digest}; expected {size:,} bytes, sha256 {sha}"
        )
    return text


def load_text(path: str | os.PathLike | None = None, *, verify: bool = True, split: str = "test") -> str:
    """wiki.test.raw (`split` "validation": wiki.valid.raw) as a str, from `path` if given, else
    from the hub via `datasets`.

    Either way the bytes are checked against the original's size and sha256 (pass
    `verify=False` to read another text file as is).
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not a Wikitext-2 split kvarn reads; use one of {', '.join(SPLITS)}")
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(
                f"text file {str(p)!r} does not exist; give the path of {SPLITS[split][0]}, "
                "or None to fetch it from the Hugging Face hub"
            )
        # newline="" keeps the bytes as they are (no universal-newline translation).
        with open(p, encoding="utf-8", newline="") as f:
            text = f.read()
        return check_wiki_test(text, str(p), split) if verify else text

    import datasets  # heavy; only needed off our machines

    ds = datasets.load_dataset(*HUB_DATASET, split=split)
    text = rebuild_raw(ds["text"])
    source = f"hub dataset {HUB_DATASET[0]}/{HUB_DATASET[1]} split {split} (rebuilt)"
    return check_wiki_test(text, source, split) if verify else text


def tokenize(tokenizer, text: str) -> torch.LongTensor:
    """The whole text as one token sequence, special tokens added as the tokenizer does
    (as llama-perplexity's `common_tokenize(ctx, text, true)`)."""
    # verbose=False: the sequence is far longer than model_max_length on purpose.
    ids = tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def make_chunks(
    tokens: torch.Tensor, n_ctx: int, chunks: int | None, bos_id: int | None
) -> torch.LongTensor:
    """Consecutive non-overlapping windows of `n_ctx` tokens, remainder dropped, at most
    `chunks` of them (None or -1: all). Position 0 of each chunk is replaced by `bos_id`
    when the model adds a BOS token (llama-perplexity does the same)."""
    if not isinstance(n_ctx, int) or n_ctx < 4:
        raise ValueError(f"n_ctx must be an integer >= 4, got {n_ctx!r}")
    tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    available = tokens.numel() // n_ctx
    if chunks is None or chunks == -1:
        n = available
    elif not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer (or None/-1 for all), got {chunks!r}")
    else:
        n = chunks
    if n < 1 or n > available:
        raise ValueError(
            f"{tokens.numel():,} tokens make {available} chunk(s) of n_ctx={n_ctx}, "
            f"but {n if n >= 1 else 'at least 1'} were requested; lower chunks or n_ctx"
        )
    out = tokens[: n * n_ctx].reshape(n, n_ctx).clone()
    if bos_id is not None:
        out[:, 0] = bos_id
    return out

