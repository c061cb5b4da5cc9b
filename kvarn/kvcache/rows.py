"""Preallocated storage for one cache copy of one layer: rows [b, h, ·, d] by absolute token position.

Owns `Rows`: the rows of one tensor (e.g. a layer's exact K), written a ubatch at a time
into a buffer that is allocated once at its capacity hint and grows by doubling past it,
instead of a `torch.cat` of everything per ubatch. `forget_before(pos)` drops the rows
before `pos` (a sliding-window layer's keys no future query can read): they are
reclaimed by moving the kept rows to the buffer's front when the next write would
otherwise need a larger buffer, so a sliding layer allocated for window + ubatch rows
holds no more, whatever the context length.

A view returned by `view` stays valid until the next `append` or `extend` (which may move
or reallocate the rows).
"""

from __future__ import annotations

import torch


class Rows:
    """Rows [lo, end) of one [b, h, ·, d] tensor, stored in `dtype`; row p lives at buf[..., p - base, :]."""

    def __init__(self, dtype: torch.dtype, hint: int = 0):
        self.dtype = dtype
        self.hint = hint  # the capacity to allocate at the first write (rows), when larger than needed
        self.buf: torch.Tensor | None = None
        self.base = 0  # absolute position of buf row 0
        self.lo = 0  # first kept position
        self.end = 0  # one past the last written position
        self.n_moves = 0  # compactions (kept rows moved to the front): the tests check trimming really ran

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.shape[-2]

    def _room(self, like: torch.Tensor, n: int) -> None:
        """Make room for n rows after `end` (shape and device of `like`)."""
        if self.buf is not None and self.end + n - self.base <= self.capacity:
            return
        kept = self.end - self.lo
        want = kept + n
        old = None if self.buf is None else self.buf[..., self.lo - self.base : self.end - self.base, :]
        if self.buf is not None and want <= self.capacity:
            # Forgotten rows make enough space: move the kept ones to the front (a copy of
            # the `kept` rows; on a sliding layer about window rows once per ubatch, a
            # fraction of what its attention reads anyway).
            self.buf[..., :kept, :] = old.clone()
            self.n_moves += 1
        else:
            cap = max(self.hint, 2 * want) if self.buf is not None or self.hint < want else self.hint
            buf = like.new_zeros((*like.shape[:-2], cap, like.shape[-1]), dtype=self.dtype)
            if kept:
                buf[..., :kept, :] = old
            self.buf = buf
        self.base = self.lo

    def append(self, x: torch.Tensor) -> None:
        """Write x [b, h, n, d] as rows end .. end + n - 1 (cast to the stored dtype)."""
        n = x.shape[-2]
        self._room(x, n)
        self.buf[..., self.end - self.base : self.end - self.base + n, :] = x
        self.end += n

    def extend(self, like: torch.Tensor, n: int) -> None:
        """Add n zero rows (placeholders to be written later with `write`)."""
        self._room(like, n)
        self.buf[..., self.end - self.base : self.end - self.base + n, :] = 0
        self.end += n

    def write(self, pos: int, x: torch.Tensor) -> None:
        """Overwrite the kept rows pos .. pos + n - 1 with x [b, h, n, d]."""
        n = x.shape[-2]
        if pos < self.lo or pos + n > self.end:
            raise IndexError(f"rows {pos}..{pos + n - 1} are not kept (kept: {self.lo}..{self.end - 1})")
        self.buf[..., pos - self.base : pos - self.base + n, :] = x

    def view(self, lo: int, hi: int) -> torch.Tensor:
        """The rows lo .. hi - 1 (a view of the buffer, in the stored dtype)."""
        if lo < self.lo or hi > self.end or hi < lo:
            raise IndexError(f"rows {lo}..{hi - 1} are not kept (kept: {self.lo}..{self.end - 1})")
        return self.buf[..., lo - self.base : hi - self.base, :]

    def forget_before(self, pos: int) -> None:
        """Rows before `pos` will not be read again; their space may be reused."""
        self.lo = max(self.lo, min(pos, self.end))
