"""transformers' `QuantizedCache` backends as body formats: quantoN, hqqN, kiviN (N = 2, 4).

Owns `EcosystemFormat` (the values quantized and dequantized by the libraries' own code,
through transformers' own cache layers, never re-implemented here; what it adds is our cache
model's cadence, DESIGN §2: a group of 128 tokens, `kvarn.vocab.facts.ECOSYSTEM_GROUP`, sealed
once its last token arrives, the >= 128-token exact tail as the residual window; `nbytes`: the
library's packed codes + one scale and one zero per q_group_size values), the version pin
(`check_library`: a format refuses another installed version than
`kvarn.vocab.facts.ECOSYSTEM_LIBRARIES`) and `use_quanto_python_unpack` (quanto's own Python
`unpack` kernel where its C++ extension is not loaded: the same bits). The variants are
`kvarn.vocab.facts.ECOSYSTEM_TYPES`.

Why (the two cadences and where they differ, the variants' axes, no HQQ axis 0, the bytes, the
pin): docs/notes/ecosystem.md.
"""

from __future__ import annotations

import importlib.metadata
import types

import torch

from kvarn.vocab.facts import (ECOSYSTEM_GROUP, ECOSYSTEM_LIBRARIES, ECOSYSTEM_META_DTYPE, ECOSYSTEM_TYPES,
                         ECOSYSTEM_VERSION)

from .base import KVFormat, Packed
from .floats import FLOAT_DTYPES
from .registry import register

META_DTYPES = ("bf16", "f16", "f32")


def check_library(backend: str) -> str:
    """The pinned "dist==version" of a backend's library; ValueError when the installed
    version is another (results of two library versions are never mixed)."""
    dist, pinned = ECOSYSTEM_LIBRARIES[backend]
    try:
        installed = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"{backend} formats need {dist}=={pinned}, which is not installed "
                         f"(pip install {dist}=={pinned})") from None
    if installed != pinned:
        raise ValueError(f"{backend} formats are pinned to {dist}=={pinned} but {dist}=={installed} is installed; "
                         f"install {dist}=={pinned} (results of another version would be mixed with these)")
    return f"{dist}=={pinned}"


def use_quanto_python_unpack() -> None:
    """Route quanto's CPU unpack to its Python kernel unless the C++ one is already loaded.

    The C++ kernel is compiled (torch.utils.cpp_extension, about a minute of CPU) on its first
    use in a fresh environment; both unpack the same bits to the same integers (compared on
    every byte value at 2 and 4 bits, optimum-quanto 0.2.7: identical)."""
    from optimum.quanto.library.extensions import get_extension, is_extension_available

    if is_extension_available("quanto_cpp"):
        ext = get_extension("quanto_cpp")
        if ext._lib is None:
            keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
            op = torch.ops.quanto.unpack.default
            ext._lib = types.SimpleNamespace(unpack=lambda t, bits: op.redispatch(keys, t, bits))


def _library_layer(backend: str, bits: int, axis_k: int, axis_v: int, q_group: int):
    """transformers' own quantized cache layer for the backend (its `_quantize` / `_dequantize`)."""
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    cls = QuantoQuantizedLayer if backend == "quanto" else HQQQuantizedLayer
    if backend == "quanto":
        use_quanto_python_unpack()
    return cls(nbits=bits, axis_key=axis_k, axis_value=axis_v, q_group_size=q_group,
               residual_length=ECOSYSTEM_GROUP)


class EcosystemFormat(KVFormat):
    """One of `kvarn.vocab.facts.ECOSYSTEM_TYPES` for K (role 'k') or V ('v').

    dtype: the library's compute dtype (that of the model's K/V in a transformers run), in
    which each group is quantized and its scales and zeros are stored."""

    family = "ecosystem"
    group = ECOSYSTEM_GROUP
    min_tail = ECOSYSTEM_GROUP
    version = ECOSYSTEM_VERSION

    def __init__(self, name: str, role: str = "k", dtype: str = ECOSYSTEM_META_DTYPE):
        super().__init__(role)
        if name not in ECOSYSTEM_TYPES:
            raise ValueError(f"unknown ecosystem format {name!r}; accepted: {', '.join(ECOSYSTEM_TYPES)}")
        if dtype not in META_DTYPES:
            raise ValueError(f"{name}: dtype must be one of {', '.join(META_DTYPES)}, got {dtype!r}")
        self.name = name
        self.backend, self.bits, axis_k, axis_v, self.q_group = ECOSYSTEM_TYPES[name]
        self.axis = axis_k if role == "k" else axis_v
        self.dtype_name, self.dtype = dtype, FLOAT_DTYPES[dtype]
        self.library = check_library(self.backend)
        self.layer = _library_layer(self.backend, self.bits, axis_k, axis_v, self.q_group)

    def supported_head_dims(self) -> str:
        return f"multiples of {self.q_group}"

    def check_head_dim(self, head_dim: int) -> None:
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1 or head_dim % self.q_group:
            raise ValueError(f"{self.name}: head dim {head_dim!r} not supported; accepted: {self.supported_head_dims()}")

    def packed_meta(self) -> dict:
        return {"format": self.name, "role": self.role, "library": self.library, "dtype": self.dtype_name}

    # --- sizes -------------------------------------------------------------------
    def _meta_itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def _group_nbytes(self, head_dim: int) -> tuple[int, int]:
        """(codes bytes, scale-or-zero bytes) of one head's 128-token group."""
        values = ECOSYSTEM_GROUP * head_dim
        return values * self.bits // 8, values // self.q_group * self._meta_itemsize()

    def nbytes(self, n_tokens: int, head_dim: int) -> int:
        self.check_head_dim(head_dim)
        if n_tokens % ECOSYSTEM_GROUP:
            raise ValueError(f"{self.name}: n_tokens {n_tokens} is not a multiple of the group size {ECOSYSTEM_GROUP}")
        codes, meta = self._group_nbytes(head_dim)
        return n_tokens // ECOSYSTEM_GROUP * (codes + 2 * meta)

    # --- the library calls ---------------------------------------------------------
    def _units(self, x: torch.Tensor):
        """x [..., n, D] -> [units, 1, 1, 128, D] in the library dtype: one library call per
        (leading index, group), in the order encode lays them out."""
        d = x.shape[-1]
        return x.reshape(-1, ECOSYSTEM_GROUP, d).to(self.dtype).reshape(-1, 1, 1, ECOSYSTEM_GROUP, d)

    def quantize(self, t: torch.Tensor):
        """The library's quantized object for one [1, 1, 128, D] tensor (transformers' `_quantize`)."""
        self.layer.keys = t.new_empty(0)  # HQQ reads its device and compute dtype from the layer's keys
        return self.layer._quantize(t.contiguous(), axis=self.axis)

    def dequantize(self, q) -> torch.Tensor:
        return self.layer._dequantize(q)

    def to_bytes(self, q) -> torch.Tensor:
        """uint8 [codes | scales | zeros] of one library object (quanto: packed data, scale,
        shift; HQQ: packed W_q, scale, zero), scales and zeros at the library dtype."""
        if self.backend == "quanto":
            parts = (q._data._data, q._scale, q._shift)
        else:
            w_q, meta = q
            parts = (w_q, meta["scale"], meta["zero"])
        return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])

    def from_bytes(self, buf: torch.Tensor, head_dim: int):
        """The library object `to_bytes` serialized (its shapes and constants re-derived)."""
        codes, meta = self._group_nbytes(head_dim)
        raw = (buf[:codes], buf[codes:codes + meta], buf[codes + meta:codes + 2 * meta])
        size = torch.Size((1, 1, ECOSYSTEM_GROUP, head_dim))
        n_groups = ECOSYSTEM_GROUP * head_dim // self.q_group
        scale, zero = (r.contiguous().view(self.dtype) for r in raw[1:])
        if self.backend == "quanto":
            from optimum.quanto import qint2, qint4
            from optimum.quanto.tensor.packed import PackedTensor
            from optimum.quanto.tensor.weights.qbits import WeightQBitsTensor

            grouped = (n_groups, self.q_group) if self.axis == 0 else (self.q_group, n_groups)
            meta_shape = (n_groups, 1) if self.axis == 0 else (1, n_groups)
            rows = -(-grouped[0] // (8 // self.bits))
            data = PackedTensor(raw[0].reshape(rows, grouped[1]).contiguous(), self.bits, torch.Size(grouped),
                                (grouped[1], 1))
            return WeightQBitsTensor(qint4 if self.bits == 4 else qint2, self.axis, self.q_group, size,
                                     (ECOSYSTEM_GROUP * head_dim, ECOSYSTEM_GROUP * head_dim, head_dim, 1),
                                     data, scale.reshape(meta_shape), zero.reshape(meta_shape))
        from hqq.core.quantize import Quantizer

        packing = Quantizer.bit_to_packing[self.bits]
        meta = {"nbits": self.bits, "group_size": self.q_group, "shape": size,
                "scale": scale.reshape(n_groups, 1), "zero": zero.reshape(n_groups, 1), "axis": self.axis,
                "packing": packing, "unpack_view_dtype": Quantizer.unpack_view_dtype[packing],
                "view_as_float": False, "compute_dtype": self.dtype}
        return raw[0].reshape(-1, self.q_group).contiguous(), meta

    # --- the interface ----------------------------------------------------------
    def encode(self, x: torch.Tensor) -> Packed:
        self.check_input(x)
        units = self._units(x)
        data = torch.stack([self.to_bytes(self.quantize(u)) for u in units])
        return Packed(data.reshape(*x.shape[:-2], -1), x.shape[-2], x.shape[-1], self.packed_meta())

    def decode(self, packed: Packed) -> torch.Tensor:
        self.check_packed(packed)
        d, n = packed.head_dim, packed.n_tokens
        self.check_head_dim(d)
        per = self.nbytes(ECOSYSTEM_GROUP, d)
        lead = packed.data.shape[:-1]
        bufs = packed.data.reshape(-1, per)
        y = torch.stack([self.dequantize(self.from_bytes(b, d)) for b in bufs])
        return y.float().reshape(*lead, n, d)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)) bit for bit, without the serialization."""
        self.check_input(x)
        y = torch.stack([self.dequantize(self.quantize(u)) for u in self._units(x)])
        return y.float().reshape(x.shape)


for _name in ECOSYSTEM_TYPES:
    register(_name, lambda role="k", rot=True, _n=_name, **params: EcosystemFormat(_n, role=role, **params))
