"""The KV-cache format interface every format implements, and its input checks.

A format turns float32 K or V rows of one head, shaped [..., n_tokens, head_dim], into
a real packed byte buffer (`encode`), back (`decode`), or both at once (`roundtrip`,
which must equal decode(encode(x)) bit for bit). `nbytes` is the size of that buffer
and is what the memory accounting uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ROLES = ("k", "v")


@dataclass
class Packed:
    """A packed cache buffer: `data` is uint8 [..., nbytes(n_tokens, head_dim)].

    `meta` records what wrote it (`KVFormat.packed_meta`: format name, role, ...);
    `decode` refuses a buffer whose meta names another format, width or role."""

    data: torch.Tensor
    n_tokens: int
    head_dim: int
    meta: dict = field(default_factory=dict)


class ValueRangeError(ValueError):
    """A value a format cannot store (an fp16 scale overflow) or a non-finite result.

    `lead`: the leading indices of the first bad element ([batch, head] for a cache layer's
    [b, H, n, D] tensor), `tokens`: its token (or first, last token of a group) counted from
    the call's first token, `detail`: what is wrong. `kvarn.kvcache.cache` re-raises it with the
    layer and absolute positions."""

    def __init__(self, name: str, lead: tuple, tokens: tuple[int, int], detail: str):
        self.name, self.lead, self.tokens, self.detail = name, tuple(lead), tokens, detail
        super().__init__(f"{name}: {self.where()}: {detail}")

    def where(self, layer: int | None = None, offset: int = 0, role: str = "") -> str:
        lo, hi = self.tokens[0] + offset, self.tokens[1] + offset
        tok = f"token {lo}" if lo == hi else f"tokens {lo}..{hi}"
        head = f"head {self.lead[-1]}" if self.lead else "head 0"
        lay = f"layer {layer}, " if layer is not None else ""
        return f"{lay}{role + ' ' if role else ''}{head}, {tok}"


def first_bad(bad: torch.Tensor) -> tuple[int, ...]:
    """The index (as a tuple) of the first True of a boolean tensor."""
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    idx = []
    for size in reversed(bad.shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def check_finite(name: str, y: torch.Tensor, what: str) -> torch.Tensor:
    """Raise ValueRangeError at the first non-finite value of y [..., n_tokens, head_dim]."""
    ok = torch.isfinite(y)
    if not bool(ok.all()):
        i = first_bad(~ok)
        raise ValueRangeError(name, i[:-2], (i[-2], i[-2]),
                              f"{what} is {y[i].item()} at channel {i[-1]} (non-finite)")
    return y


class KVFormat:
    """Base class: subclasses set the class attributes and implement encode/decode/nbytes."""

    name: str = ""
    family: str = ""  # "float" | "block" | "kvarn"
    group: int = 1  # tokens that must arrive before the body can be written
    sink: int = 0  # exact leading tokens on full-attention layers (DESIGN §2)
    tail_quantum: int = 1  # effective tail = max(min_tail, roundup(tail, tail_quantum))
    min_tail: int = 0
    default_tail_dtype: str = "bf16"
    version: int = 1  # bump when the numerics change: the workflow reruns cells using it

    def __init__(self, role: str = "k"):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, role={self.role!r})"

    # --- checks -----------------------------------------------------------------
    def supported_head_dims(self) -> str:
        return "any"

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError naming head_dim if this format cannot store it."""

    def check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"{self.name}: expected [..., n_tokens, head_dim], got shape {tuple(x.shape)}")
        if x.dtype != torch.float32:
            raise TypeError(f"{self.name}: expected float32 input, got {x.dtype}")
        self.check_head_dim(x.shape[-1])
        if x.shape[-2] % self.group:
            raise ValueError(
                f"{self.name}: {x.shape[-2]} tokens is not a multiple of the group size "
                f"{self.group}; pass whole groups"
            )
        if not torch.isfinite(x).all():
            bad = x[~torch.isfinite(x)].flatten()[0].item()
            raise ValueError(f"{self.name}: input contains a non-finite value ({bad}); K/V must be finite")

    def packed_meta(self) -> dict:
        """What a buffer written by this format records, and decode insists on."""
        return {"format": self.name, "role": self.role}

    def check_packed(self, packed: Packed) -> None:
        """Refuse a buffer another format, width, role or rotation wrote (names both)."""
        want = self.packed_meta()
        got = {k: packed.meta[k] for k in want if k in packed.meta}
        if got != {k: want[k] for k in got}:
            fmt = ", ".join(f"{k}={v!r}" for k, v in want.items())
            raise ValueError(
                f"{self.name} ({self.role.upper()}): refusing to decode a buffer written with "
                + ", ".join(f"{k}={v!r}" for k, v in got.items())
                + f"; this decoder is {fmt}. Decode it with "
                f"get_format({got.get('format', self.name)!r}, role={got.get('role', self.role)!r})")

    # --- the interface ----------------------------------------------------------
    def encode(self, x: torch.Tensor) -> Packed:
        raise NotImplementedError

    def decode(self, packed: Packed) -> torch.Tensor:
        raise NotImplementedError

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What attention reads back after storing x: decode(encode(x))."""
        return self.decode(self.encode(x))

    def nbytes(self, n_tokens: int, head_dim: int) -> int:
        raise NotImplementedError

    def bits_per_value(self, head_dim: int) -> float:
        """Stored bits per K or V value, metadata included, over one whole group."""
        n = self.group if self.group > 1 else 1
        return 8 * self.nbytes(n, head_dim) / (n * head_dim)

    def effective_tail(self, tail: int) -> int:
        return max(self.min_tail, self.tail_quantum * math.ceil(tail / self.tail_quantum))
