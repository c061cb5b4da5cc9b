"""What the engine reads a baseline through: `Baseline`, a typing Protocol.

Two files satisfy it: our dump (`kvarn.baseline.dump.Dump`) and llama-perplexity's KLD base
file (`kvarn.llamacpp_cpu.llamakld.LlamaKld`); a cell scores against either the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Baseline(Protocol):
    """A baseline opened read-only: the BF16 run's log-probs at every scored token of every chunk."""

    kind: Literal["kvarn", "llama"]  # our dump, or llama-perplexity's KLD base file
    path: Path
    header: dict  # the run identity it was computed with (n_ctx, vocab_size, n_chunks, compute, ...)

    @property
    def n_chunks(self) -> int: ...

    @property
    def n_scored(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def decode(self, i: int, a: int = 0, b: int | None = None, device=None) -> torch.Tensor:
        """Rows a..b of chunk i as float32 log-probs [b − a, vocab_size] on `device` (default CPU)."""
        ...

    def chunk(self, i: int) -> torch.Tensor:
        """Chunk i's log-probs, float32 [n_scored, vocab_size]."""
        ...

    def dense_rows(self, i: int, a: int = 0, b: int | None = None) -> np.ndarray:
        """Rows a..b of chunk i in llama.cpp's row layout, uint16 [b − a, nv]."""
        ...
