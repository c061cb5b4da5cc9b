"""llama.cpp / BeeLlama block types (DESIGN §3): q8_0 … q2_0, q*_1, iq4_nl.

Each token's head_dim values are cut into blocks of 32; a block stores an fp16 scale `d`
(and an fp16 min `m` for the `_1` types) and one code per value. Codes are computed with
the fp32 `d`, every x/d as ggml does it, `x * id` with `id = 1/d` in fp32 (0 when d == 0),
one fp32 rounding per operation (no fused multiply-add), so the upstream types agree bit
for bit with ggml's reference quantizers and with the `gguf` package's numpy copies.

Byte layout, per token: head_dim/32 consecutive blocks.
  q8_0   d | 32 x int8
  q4_0   d | 16 bytes: low nibble = code j, high nibble = code j+16        (ggml)
  q4_1   d | m | nibbles as q4_0                                            (ggml)
  q5_0   d | qh: uint32 LE, bit j = bit 4 of code j | nibbles of the low 4 bits (ggml)
  q5_1   d | m | qh | nibbles                                               (ggml)
  iq4_nl d | nibbles of the table index                                     (ggml)
  q6_0, q3_0, q2_0, q6_1, q3_1, q2_1 (BeeLlama / not in gguf; our layout):
         d [| m] | the 32 b-bit codes as one LSB-first bitstream (code j at bit j*b), 4*b bytes
All fp16 fields are little-endian.

`rot=True` (default, as llama.cpp since April 2026): K is rotated per token by the
block-diagonal Hadamard of block `k_rotation_block(head_dim)`, V by 64-blocks, before
quantizing; decode rotates back, so callers always see the original frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvarn.vocab import facts

from .base import KVFormat, Packed, ValueRangeError, first_bad
from .hadamard import V_ROTATION_BLOCK, k_rotation_block, rotate_blocks
from .registry import register

QK = 32  # values per block

# iq4_nl's non-linear levels (ggml kvalues_iq4nl)
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class BlockSpec:
    name: str
    bits: int
    kind: str  # "q8" | "sym" | "asym" | "iq4nl"
    layout: str  # "ggml" (gguf-upstream byte layout) | "dense" (LSB-first bitstream)
    refit: bool = False  # sym only: x²-weighted least-squares refit of d (q6_0)

    @property
    def has_min(self) -> bool:
        return self.kind == "asym"

    @property
    def block_bytes(self) -> int:
        return 2 * (1 + self.has_min) + QK * self.bits // 8


SPECS = {
    s.name: s
    for s in (
        BlockSpec("q8_0", 8, "q8", "ggml"),
        BlockSpec("q6_0", 6, "sym", "dense", refit=True),
        BlockSpec("q6_1", 6, "asym", "dense"),
        BlockSpec("q5_1", 5, "asym", "ggml"),
        BlockSpec("q5_0", 5, "sym", "ggml"),
        BlockSpec("q4_1", 4, "asym", "ggml"),
        BlockSpec("q4_0", 4, "sym", "ggml"),
        BlockSpec("iq4_nl", 4, "iq4nl", "ggml"),
        BlockSpec("q3_1", 3, "asym", "dense"),
        BlockSpec("q3_0", 3, "sym", "dense"),
        BlockSpec("q2_1", 2, "asym", "dense"),
        BlockSpec("q2_0", 2, "sym", "dense"),
    )
}


# --- the per-block reference maths (blocks: fp32 [N, 32], already rotated) -------------------
def _inv(d: torch.Tensor) -> torch.Tensor:
    """ggml's `id = d ? 1.0f/d : 0.0f` in fp32.

    One deliberate difference: a subnormal d (|vmax| < ~1e-37) makes 1/d overflow to inf and
    ggml's codes undefined (NaN cast to int); we use id = 0 there, i.e. the zero code. Such a
    d is 0 in fp16 anyway, so the block reads back as 0 either way.
    """
    inv = 1.0 / torch.where(d == 0, torch.ones_like(d), d)
    return torch.where((d == 0) | torch.isinf(inv), torch.zeros_like(d), inv)


def _vmax(xb: torch.Tensor) -> torch.Tensor:
    """The signed value of largest magnitude; ties -> the first, as ggml's `amax < |v|` scan."""
    return xb.gather(-1, xb.abs().argmax(-1, keepdim=True))


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C roundf, exactly: floor(|v| + 0.5) in fp32 can round up 0.49999997; this cannot."""
    a = v.abs()
    f = a.floor()
    return torch.sign(v) * (f + (2 * (a - f)).floor())


# _IQ4NL_LO[i + 128] = how many of levels[1..14] are <= i, for integer i in [-128, 127]
_IQ4NL_LO = torch.tensor([sum(v <= i for v in IQ4NL_VALUES[1:15]) for i in range(-128, 128)])


def _iq4nl_index(al: torch.Tensor) -> torch.Tensor:
    """ggml best_index_int8 over IQ4NL_VALUES: nearest level, ties to the upper one.

    Its binary search ends at lo with levels[lo] <= al < levels[lo+1] (lo clamped to 0..14),
    then picks lo iff `al - levels[lo] < levels[lo+1] - al` in fp32. The levels are
    integers, so `al >= level` iff `floor(al) >= level`: a 256-entry table gives lo.
    """
    lut = _IQ4NL_LO.to(al.device)
    vals = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=al.device)
    lo = lut.take(al.floor().clamp_(-128, 127).long().add_(128))
    below = al - vals.take(lo)
    above = vals.take(lo + 1) - al
    return torch.where(below < above, lo, lo + 1)


def _refit_sums_q6_0(xb: torch.Tensor, l: torch.Tensor):
    """Σ w·l·x and Σ w·l² (w = x²) in fp32 in BeeLlama's quantize_row_q6_0_ref order: for
    j = 0..15, sum += w_j·l_j·x_j + w_{j+16}·l_{j+16}·x_{j+16} (each product left to
    right, no FMA), so the refit d matches it bit for bit (bench/oracles/beellama/quant_oracle.py)."""
    w = xb * xb
    tx, t2 = w * l * xb, w * l * l
    h = QK // 2
    pair_x, pair_2 = tx[..., :h] + tx[..., h:], t2[..., :h] + t2[..., h:]
    sumqx, sumq2 = torch.zeros_like(xb[..., :1]), torch.zeros_like(xb[..., :1])
    for j in range(h):
        sumqx = sumqx + pair_x[..., j : j + 1]
        sumq2 = sumq2 + pair_2[..., j : j + 1]
    return sumqx, sumq2


def quantize_blocks(spec: BlockSpec, xb: torch.Tensor):
    """Codes (int64 [N, 32]), d (fp32 [N, 1], to be stored as fp16) and m (fp32 [N, 1] or None)."""
    nlev = 1 << spec.bits
    if spec.kind == "q8":
        d = xb.abs().amax(-1, keepdim=True) / 127
        q = _round_half_away(xb * _inv(d)).clamp(-128, 127)
        return q.long(), d, None
    if spec.kind == "asym":
        mn = xb.amin(-1, keepdim=True)
        d = (xb.amax(-1, keepdim=True) - mn) / (nlev - 1)
        q = ((xb - mn) * _inv(d) + 0.5).floor().clamp(0, nlev - 1)
        return q.long(), d, mn
    if spec.kind == "sym":
        half = nlev // 2
        d = _vmax(xb) / -half
        q = (xb * _inv(d) + (half + 0.5)).floor().clamp(0, nlev - 1)
        if spec.refit:
            sumqx, sumq2 = _refit_sums_q6_0(xb, q - half)
            d = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2)), d)
        return q.long(), d, None
    if spec.kind == "iq4nl":
        d = _vmax(xb) / IQ4NL_VALUES[0]
        q = _iq4nl_index(xb * _inv(d))
        v = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=xb.device).take(q)
        w = xb * xb
        sumqx = (w * v * xb).sum(-1, keepdim=True)
        sumq2 = (w * v * v).sum(-1, keepdim=True)
        d = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2)), d)
        return q, d, None
    raise AssertionError(spec.kind)


def dequantize_blocks(spec: BlockSpec, q: torch.Tensor, d16: torch.Tensor, m16: torch.Tensor | None) -> torch.Tensor:
    """Values from codes and the fp16 d (and m) widened to fp32: what attention reads."""
    if spec.kind == "q8":
        return q.float() * d16
    if spec.kind == "asym":
        return q.float() * d16 + m16
    if spec.kind == "sym":
        return (q - (1 << spec.bits) // 2).float() * d16
    vals = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=q.device)
    return vals.take(q) * d16


# --- byte packing --------------------------------------------------------------------------
def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, n] int64 codes < 2**bits -> uint8 [N, n*bits/8], LSB-first (code j at bit j*bits).

    Eight codes fill exactly `bits` bytes: gather them in one int64, then split it into bytes.
    """
    dev = codes.device
    acc = (codes.reshape(codes.shape[0], -1, 8) << (torch.arange(8, device=dev) * bits)).sum(-1, keepdim=True)
    return ((acc >> (torch.arange(bits, device=dev) * 8)) & 255).to(torch.uint8).reshape(codes.shape[0], -1)


def _unpack_bits(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    dev = data.device
    acc = (data.long().reshape(data.shape[0], -1, bits) << (torch.arange(bits, device=dev) * 8)).sum(-1, keepdim=True)
    return ((acc >> (torch.arange(8, device=dev) * bits)) & ((1 << bits) - 1)).reshape(data.shape[0], n)


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).contiguous().view(torch.uint8)  # [N, 1] -> [N, 2], little-endian


def _f16_from(data: torch.Tensor) -> torch.Tensor:
    return data.contiguous().view(torch.float16).float()  # [N, 2] -> [N, 1]


def pack_blocks(spec: BlockSpec, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    parts = [_f16_bytes(d)]
    if m is not None:
        parts.append(_f16_bytes(m))
    if spec.kind == "q8":
        parts.append(q.to(torch.int8).view(torch.uint8))
    elif spec.layout == "dense":
        parts.append(_pack_bits(q, spec.bits))
    else:  # ggml nibbles (+ q5's high-bit word)
        if spec.bits == 5:
            parts.append(_pack_bits((q >> 4) & 1, 1))
        lo = q & 0xF
        parts.append((lo[:, : QK // 2] | (lo[:, QK // 2 :] << 4)).to(torch.uint8))
    return torch.cat(parts, -1)


def unpack_blocks(spec: BlockSpec, data: torch.Tensor):
    d16 = _f16_from(data[:, 0:2])
    off = 2
    m16 = None
    if spec.has_min:
        m16 = _f16_from(data[:, 2:4])
        off = 4
    body = data[:, off:]
    if spec.kind == "q8":
        q = body.contiguous().view(torch.int8).long()
    elif spec.layout == "dense":
        q = _unpack_bits(body, spec.bits, QK)
    else:
        qh = None
        if spec.bits == 5:
            qh, body = _unpack_bits(body[:, :4], 1, QK), body[:, 4:]
        nib = body.long()
        q = torch.cat([nib & 0xF, nib >> 4], -1)
        if qh is not None:
            q = q | (qh << 4)
    return q, d16, m16


# --- the format ----------------------------------------------------------------------------
class BlockFormat(KVFormat):
    """One llama.cpp block type for K or V, with or without the Hadamard pre-rotation."""

    family = "block"
    group = 1

    def __init__(self, name: str, role: str = "k", rot: bool = True):
        super().__init__(role)
        self.name = name
        self.spec = SPECS[name]
        self.rot = bool(rot)
        self.version = facts.get(name).version  # kvarn.vocab.facts holds it (q6_0 2: the refit sums in BeeLlama's order)

    def __repr__(self) -> str:
        return f"BlockFormat({self.name!r}, role={self.role!r}, rot={self.rot})"

    def supported_head_dims(self) -> str:
        if not self.rot:
            return f"multiples of {QK}"
        if self.role == "k":
            return f"multiples of {QK} with a power-of-two divisor in [64, 256] (K rotation)"
        return f"multiples of {V_ROTATION_BLOCK} (V rotation)"

    def check_head_dim(self, head_dim: int) -> None:
        bad = head_dim <= 0 or head_dim % QK
        if not bad and self.rot:
            if self.role == "k":
                bad = head_dim % 64 != 0  # k_rotation_block needs a power of two >= 64 dividing it
            else:
                bad = head_dim % V_ROTATION_BLOCK != 0
        if bad:
            raise ValueError(
                f"{self.name} ({self.role.upper()}, rot={self.rot}): head dim {head_dim} not supported; "
                f"accepted: {self.supported_head_dims()}"
                + ("; rot=False accepts any multiple of 32" if self.rot else "")
            )

    def rotation_block(self, head_dim: int) -> int:
        """The Hadamard block llama.cpp rotates this role by (K: `k_rotation_block`, V: 64)."""
        return k_rotation_block(head_dim) if self.role == "k" else V_ROTATION_BLOCK

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        return rotate_blocks(x, self.rotation_block(x.shape[-1])) if self.rot else x

    def nbytes(self, n_tokens: int, head_dim: int) -> int:
        return n_tokens * (head_dim // QK) * self.spec.block_bytes

    def packed_meta(self) -> dict:
        return {"format": self.name, "role": self.role, "rot": self.rot}

    def _limit(self) -> str:
        """The largest values whose fp16 scale (and min) fit, in words."""
        k = self.spec
        if k.kind == "asym":
            return f"|min| <= 65504 and max - min <= {(1 << k.bits) - 1}·65504"
        top = {"q8": 127, "iq4nl": 127, "sym": 1 << (k.bits - 1)}[k.kind]
        return f"|x| <= {top}·65504 = {top * 65504.0:.3g}"

    def _quantize(self, x: torch.Tensor):
        """Codes, d and m of x's blocks; a d or m that overflows fp16 is a named error."""
        xb = self._rotate(x).reshape(-1, QK)
        q, d, m = quantize_blocks(self.spec, xb)
        bad = ~torch.isfinite(d.to(torch.float16))
        if m is not None:
            bad |= ~torch.isfinite(m.to(torch.float16))
        if bool(bad.any()):
            i = first_bad(bad.reshape(*x.shape[:-1], x.shape[-1] // QK))
            flat = first_bad(bad)[0]
            blk = i[-1]
            vals = f"d = {d[flat, 0].item():.4g}" + ("" if m is None else f", m = {m[flat, 0].item():.4g}")
            raise ValueRangeError(
                f"{self.name} ({self.role.upper()})", i[:-2], (i[-2], i[-2]),
                f"fp16 scale overflow in block {blk} (channels {QK * blk}..{QK * blk + QK - 1}"
                f"{', after the Hadamard rotation' if self.rot else ''}): {vals}, max |x| of the block "
                f"{xb[flat].abs().max().item():.4g}; {self.name} stores d{'' if m is None else ' and m'} as fp16, "
                f"so it holds {self._limit()}")
        return q, d, m

    def encode(self, x: torch.Tensor) -> Packed:
        self.check_input(x)
        *batch, t, dim = x.shape
        q, d, m = self._quantize(x)
        data = pack_blocks(self.spec, q, d, m)
        return Packed(data.reshape(*batch, self.nbytes(t, dim)), t, dim, self.packed_meta())

    def decode(self, packed: Packed) -> torch.Tensor:
        self.check_packed(packed)
        *batch, nb = packed.data.shape
        t, dim = packed.n_tokens, packed.head_dim
        if nb != self.nbytes(t, dim):
            raise ValueError(f"{self.name}: packed buffer has {nb} bytes, expected {self.nbytes(t, dim)} for {t}x{dim}")
        q, d16, m16 = unpack_blocks(self.spec, packed.data.reshape(-1, self.spec.block_bytes))
        y = dequantize_blocks(self.spec, q, d16, m16).reshape(*batch, t, dim)
        return self._rotate(y)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)) without packing the bytes (the fp16 casts are kept)."""
        self.check_input(x)
        q, d, m = self._quantize(x)
        d16 = d.to(torch.float16).float()
        m16 = None if m is None else m.to(torch.float16).float()
        return self._rotate(dequantize_blocks(self.spec, q, d16, m16).reshape(x.shape))


for _name in SPECS:
    register(_name, lambda role="k", rot=True, _n=_name: BlockFormat(_n, role, rot))
