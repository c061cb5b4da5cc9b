"""Unquantized cache types: f32, f16, bf16 (cast with round-to-nearest-even)."""

from __future__ import annotations

import torch

from .base import KVFormat, Packed
from .registry import register

# The float type names and their torch dtypes: the one map of kvarn (the cache's exact
# copy, the llamacpp-cpu emulation and these formats read it).
FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class FloatFormat(KVFormat):
    family = "float"

    def __init__(self, name: str, role: str = "k"):
        super().__init__(role)
        self.name = name
        self.dtype = FLOAT_DTYPES[name]
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()

    def encode(self, x: torch.Tensor) -> Packed:
        self.check_input(x)
        y = x.to(self.dtype).contiguous()
        data = y.view(torch.uint8).reshape(*x.shape[:-2], -1)
        return Packed(data, x.shape[-2], x.shape[-1], self.packed_meta())

    def decode(self, packed: Packed) -> torch.Tensor:
        self.check_packed(packed)
        y = packed.data.contiguous().view(self.dtype)
        return y.reshape(*packed.data.shape[:-1], packed.n_tokens, packed.head_dim).float()

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        return x.to(self.dtype).float()

    def nbytes(self, n_tokens: int, head_dim: int) -> int:
        return n_tokens * head_dim * self.itemsize


for _name in FLOAT_DTYPES:
    register(_name, lambda role="k", rot=True, _n=_name: FloatFormat(_n, role))
