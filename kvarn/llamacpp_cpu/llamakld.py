"""llama-perplexity's KLD base file (`--kl-divergence-base`), read as a baseline and written from ours.

The file (tools/perplexity/perplexity.cpp, llama-cpp-python 0.3.36), little-endian:

    "_logits_"                      8 bytes
    n_ctx                           uint32
    n_vocab, n_chunk                int32, int32
    tokens                          int32 [n_chunk · n_ctx]   (the text's tokens; llama
                                    replaces position 0 of each chunk by BOS when the
                                    model adds one, at evaluation time)
    per chunk, per scored token     uint16 [n_ctx − 1 − n_ctx/2][nv], nv = 2·⌈n_vocab/2⌉ + 4

Each row is exactly the row of our dump (kvarn.baseline.encoding): `[scale: f32, lo: f32, codes]`,
decoded `scale·code + lo`. So writing ours in llama's format copies the dump's rows
behind llama's header (our mass-corrected `lo` decodes the same way in llama-perplexity;
a sparse-layout dump gives its rows back densely, `Dump.dense_rows`), and reading llama's
file decodes its rows with `kvarn.baseline.encoding.decode_rows`. This file stays dense.

llama-perplexity's `--kl-divergence` evaluates the tokens stored in the file, never the
text, so a file we write makes it score our tokenization; a file it wrote is accepted as
our baseline only if its tokens equal ours (position 0 excepted where BOS replaces it).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import torch

from kvarn.vocab import scoring
from kvarn.files.atomic import atomic_path
from kvarn.baseline.dump import open_dump
from kvarn.baseline.encoding import decode_rows, row_uint16

MAGIC = b"_logits_"
HEADER = struct.Struct("<8sIii")


def is_llama_kld(path) -> bool:
    """True if `path` is a file starting with llama-perplexity's magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(8) == MAGIC


def write_from_dump(dump_path, chunk_ids: torch.Tensor, out) -> Path:
    """Write the baseline dump at `dump_path` as a llama-perplexity KLD base file at `out` (atomic).

    chunk_ids: LongTensor [n_chunks, n_ctx], the tokens the dump was computed on.
    """
    d = open_dump(dump_path)
    n_chunks, n_ctx = chunk_ids.shape
    if n_chunks != d.n_chunks or n_ctx != d.header["n_ctx"]:
        raise ValueError(f"dump {dump_path}: {d.n_chunks} chunks x n_ctx {d.header['n_ctx']}, "
                         f"tokens given {n_chunks} x {n_ctx}")
    out = Path(out)
    with atomic_path(out) as tmp:
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, n_ctx, d.vocab_size, n_chunks))
            f.write(chunk_ids.to(torch.int32).numpy().astype("<i4").tobytes())
            for i in range(n_chunks):  # llama.cpp's rows, a slice at a time (either dump layout)
                for a in range(0, d.n_scored, 1024):
                    f.write(np.ascontiguousarray(d.dense_rows(i, a, a + 1024)).astype("<u2", copy=False).tobytes())
            f.flush()
            os.fsync(f.fileno())
    return out


class LlamaKld:
    """A llama-perplexity KLD base file opened read-only: a `kvarn.baseline.protocol.Baseline`, as
    kvarn.baseline.dump.Dump is."""

    kind = "llama"

    def __init__(self, path: Path, n_ctx: int, vocab_size: int, n_chunks: int, tokens: np.ndarray,
                 payload: np.memmap):
        self.path, self.n_ctx, self.vocab_size, self.n_chunks = path, n_ctx, vocab_size, n_chunks
        self.tokens = tokens  # int32 [n_chunks, n_ctx]
        self._payload = payload
        self.header = {"n_ctx": n_ctx, "vocab_size": vocab_size, "n_chunks": n_chunks, "compute": "llama.cpp",
                       "source_file": str(path)}

    @property
    def n_scored(self) -> int:
        return scoring.n_scored(self.n_ctx)

    def dense_rows(self, i: int, a: int = 0, b: int | None = None) -> np.ndarray:
        if not 0 <= i < self.n_chunks:
            raise IndexError(f"chunk {i} out of range: {self.path} has {self.n_chunks} chunks")
        return self._payload[i, a:b]

    def decode(self, i: int, a: int = 0, b: int | None = None, device=None) -> torch.Tensor:
        return decode_rows(self.dense_rows(i, a, b), self.vocab_size, device)

    def chunk(self, i: int) -> torch.Tensor:
        return self.decode(i)


def read_llama_kld(path) -> LlamaKld:
    """Open a llama-perplexity --kl-divergence-base file, checking its size against its header."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no llama KLD base file at {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size or head[:8] != MAGIC:
        raise ValueError(f"{path} is not a llama-perplexity KLD base file (no '_logits_' header)")
    _, n_ctx, n_vocab, n_chunk = HEADER.unpack(head)
    if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
        raise ValueError(f"{path}: header n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk} is not a valid file")
    nv = row_uint16(n_vocab)
    n_scored = scoring.n_scored(n_ctx)
    tok_bytes = 4 * n_chunk * n_ctx
    want = HEADER.size + tok_bytes + 2 * n_chunk * n_scored * nv
    if size != want:
        raise ValueError(f"{path}: {size} bytes, its header (n_ctx {n_ctx}, n_vocab {n_vocab}, {n_chunk} chunks) "
                         f"implies {want}: truncated or not a KLD base file")
    tokens = np.fromfile(path, dtype="<i4", count=n_chunk * n_ctx, offset=HEADER.size).reshape(n_chunk, n_ctx)
    payload = np.memmap(path, dtype="<u2", mode="r", offset=HEADER.size + tok_bytes, shape=(n_chunk, n_scored, nv))
    return LlamaKld(path, n_ctx, n_vocab, n_chunk, tokens, payload)


def open_llama_kld(path, chunk_ids: torch.Tensor, n_ctx: int, vocab_size: int | None = None) -> LlamaKld:
    """A llama KLD base file as the baseline of a run on `chunk_ids` [n_chunks, n_ctx].

    Refuses (naming the field, the file's value and ours) a different n_ctx or vocabulary,
    fewer chunks than the run needs, or tokens that differ from ours anywhere but position
    0 (where the BOS replacement happens).
    """
    f = read_llama_kld(path)
    if f.n_ctx != n_ctx:
        raise ValueError(f"{path}: llama KLD base file has n_ctx {f.n_ctx}, this run uses {n_ctx}")
    if vocab_size is not None and f.vocab_size != vocab_size:
        raise ValueError(f"{path}: llama KLD base file has vocabulary {f.vocab_size}, the model has {vocab_size}")
    n = int(chunk_ids.shape[0])
    if f.n_chunks < n:
        raise ValueError(f"{path}: llama KLD base file has {f.n_chunks} chunks, this run needs {n}")
    ours = chunk_ids.numpy()
    diff = np.argwhere(f.tokens[:n, 1:] != ours[:, 1:])
    if len(diff):
        c, p = int(diff[0][0]), int(diff[0][1]) + 1
        raise ValueError(f"{path}: token {p} of chunk {c} is {int(f.tokens[c, p])} in the llama file, {int(ours[c, p])} "
                         f"in ours ({len(diff)} positions differ): the two tokenizations disagree")
    return f
