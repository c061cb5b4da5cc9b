"""KVarN (DESIGN §4) as a cache type: `kvarnN` registered, its tiles packed as one LSB-first
bitstream plus fp16 scale, zero and other (`quantize_pack_ref`, `unpack_dequantize_ref`, which the
Triton kernels of kvarn/formats/kvarn_triton.py match), the bytes per tile, encode and decode. The
tile arithmetic: kvarn.formats.kvarn_tiles; the format, reproduced bit for bit from BeeLlama's CPU
store: docs/notes/kvarn.md."""

from __future__ import annotations

import math

import torch

from kvarn.vocab.facts import KVARN_DEFAULT_TAIL_DTYPE, KVARN_VERSION
from kvarn.vocab.facts import KVARN_GROUP as GROUP  # tokens per tile (G)
from kvarn.vocab.facts import KVARN_ITERS as ITERS  # normalization passes
from kvarn.vocab.facts import KVARN_SINK as SINK  # exact leading tokens on full-attention layers (DESIGN §2)
from kvarn.vocab.facts import KVARN_WIDTHS as WIDTHS
from kvarn.vocab.facts import kvarn_payload_nbytes as payload_nbytes
from kvarn.vocab.facts import kvarn_tile_nbytes as tile_nbytes
from kvarn.vocab.facts import kvarn_tile_shape as tile_shape

from .base import KVFormat, Packed, ValueRangeError, first_bad
from .kvarn_tiles import check_head_dim, dequantize_tiles_ref, from_tiles, quantize_tiles_ref, rotate, stage, to_tiles
from .registry import register


# --- dense LSB-first bit packing (DESIGN §4.6) ---------------------------------------
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] -> uint8 [..., ceil(n*bits/8)]: code i at bit offset i*bits."""
    n = codes.shape[-1]
    nbytes = math.ceil(n * bits / 8)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    stream = ((codes[..., None] >> shifts) & 1).reshape(*codes.shape[:-1], n * bits)
    stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - n * bits))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32)).to(torch.uint8)
    return (stream.reshape(*codes.shape[:-1], nbytes, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack_codes(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_codes: uint8 [..., ceil(n*bits/8)] -> uint8 codes [..., n]."""
    shifts = torch.arange(8, device=data.device, dtype=torch.uint8)
    stream = ((data[..., None] >> shifts) & 1).reshape(*data.shape[:-1], -1)[..., : n * bits]
    weights = (1 << torch.arange(bits, device=data.device, dtype=torch.int32)).to(torch.uint8)
    return (stream.reshape(*data.shape[:-1], n, bits) * weights).sum(-1, dtype=torch.uint8)


def quantize_pack_ref(tiles: torch.Tensor, bits: int, iters: int = ITERS):
    """Tiles fp32 [N, R, C] -> (payload uint8 [N, ceil(R*C*bits/8)], scale f16 [N, R],
    zero f16 [N, R], other f16 [N, C]). The Triton kernel `quantize_pack` matches it."""
    q, scale, zero, other = quantize_tiles_ref(tiles, bits, iters)
    return pack_codes(q.flatten(-2), bits), scale, zero, other


def unpack_dequantize_ref(payload, scale, zero, other, bits: int) -> torch.Tensor:
    """Inverse of quantize_pack_ref up to quantization: fp32 tiles [N, R, C]."""
    rows, cols = scale.shape[-1], other.shape[-1]
    q = unpack_codes(payload, bits, rows * cols).reshape(*payload.shape[:-1], rows, cols)
    return dequantize_tiles_ref(q, scale, zero, other)


# --- the format -----------------------------------------------------------------
class KVarNFormat(KVFormat):
    """kvarnN: N-bit KVarN for K (role 'k', per-channel) or V (role 'v', per-token).

    impl: "ref" (pure torch), "triton" (kernels; CUDA, or CPU under TRITON_INTERPRET=1),
    "auto" (Triton for CUDA tensors, else the reference).
    """

    family = "kvarn"
    group = GROUP
    sink = SINK
    tail_quantum = GROUP
    min_tail = GROUP
    default_tail_dtype = KVARN_DEFAULT_TAIL_DTYPE
    version = KVARN_VERSION

    def __init__(self, bits: int, role: str = "k", iters: int = ITERS, impl: str = "auto"):
        super().__init__(role)
        if bits not in WIDTHS:
            raise ValueError(f"KVarN width must be one of {WIDTHS}, got {bits!r}")
        if not isinstance(iters, int) or iters < 0:
            raise ValueError(f"kvarn{bits}: iters must be an integer >= 0, got {iters!r}")
        if impl not in ("auto", "ref", "triton"):
            raise ValueError(f"kvarn{bits}: impl must be 'auto', 'ref' or 'triton', got {impl!r}")
        self.name = f"kvarn{bits}"
        self.bits = bits
        self.iters = iters
        self.impl = impl

    def supported_head_dims(self) -> str:
        return "powers of two 64..512"

    def check_head_dim(self, head_dim: int) -> None:
        check_head_dim(head_dim, self.name)

    def check_input(self, x: torch.Tensor) -> None:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] % GROUP:
            raise ValueError(
                f"{self.name}: got {x.shape[-2]} tokens; KVarN writes whole groups of {GROUP} "
                f"tokens, so n_tokens must be a multiple of {GROUP} (an incomplete group stays "
                "exact in the F16 tail until its last token arrives)"
            )
        super().check_input(x)

    def _kernels(self, x: torch.Tensor):
        if self.impl == "triton" or (self.impl == "auto" and x.is_cuda):
            from . import kvarn_triton

            return kvarn_triton.quantize_pack, kvarn_triton.unpack_dequantize
        return quantize_pack_ref, unpack_dequantize_ref

    def _check_meta(self, x, scale, zero, other, lead):
        """A tile whose fp16 scale/zero/other overflowed is a named error (head, token range).

        scale, zero, other: [n_tiles, ·]; lead: the tiles' leading shape [..., groups, slices]."""
        bad = torch.stack([~torch.isfinite(m.float()).all(-1) for m in (scale, zero, other)]).any(0)
        if bool(bad.any()):
            i = first_bad(bad.reshape(lead))
            g = i[-2]
            raise ValueRangeError(
                f"{self.name} ({self.role.upper()})", i[:-2], (g * GROUP, g * GROUP + GROUP - 1),
                f"a tile's fp16 metadata overflowed (channel slice {i[-1]}; max |x| of the call "
                f"{x.abs().max().item():.4g}); KVarN stages the rotated values and stores scale/zero/other "
                "as fp16 (|value| <= 65504)")

    def packed_meta(self) -> dict:
        return {"format": self.name, "role": self.role, "bits": self.bits}

    def nbytes(self, n_tokens: int, head_dim: int) -> int:
        self.check_head_dim(head_dim)
        if n_tokens % GROUP:
            raise ValueError(f"{self.name}: n_tokens {n_tokens} is not a multiple of the group size {GROUP}")
        rows, cols, slices = tile_shape(self.role, head_dim)
        return n_tokens // GROUP * slices * tile_nbytes(rows, cols, self.bits)

    def encode(self, x: torch.Tensor) -> Packed:
        self.check_input(x)
        quantize_pack, _ = self._kernels(x)
        tiles = to_tiles(stage(rotate(x)), self.role)  # [..., g, s, R, C]
        lead = tiles.shape[:-2]
        payload, scale, zero, other = quantize_pack(tiles.reshape(-1, *tiles.shape[-2:]), self.bits, self.iters)
        self._check_meta(x, scale, zero, other, lead)
        parts = [payload] + [m.contiguous().view(torch.uint8) for m in (scale, zero, other)]
        data = torch.cat(parts, -1).reshape(*lead[:-2], -1)
        return Packed(data, x.shape[-2], x.shape[-1], self.packed_meta())

    def decode(self, packed: Packed) -> torch.Tensor:
        self.check_packed(packed)
        _, unpack_dequantize = self._kernels(packed.data)
        d, t = packed.head_dim, packed.n_tokens
        self.check_head_dim(d)
        rows, cols, slices = tile_shape(self.role, d)
        pb = payload_nbytes(rows, cols, self.bits)
        lead = packed.data.shape[:-1]
        tb = packed.data.reshape(-1, tile_nbytes(rows, cols, self.bits))
        cut = [pb, pb + 2 * rows, pb + 4 * rows]
        payload, scale, zero, other = (
            tb[:, lo:hi].contiguous() for lo, hi in zip([0] + cut, cut + [tb.shape[1]])
        )
        half = [m.view(torch.float16) for m in (scale, zero, other)]
        tiles = unpack_dequantize(payload, *half, self.bits)
        tiles = tiles.reshape(*lead, t // GROUP, slices, rows, cols)
        return rotate(from_tiles(tiles, self.role))

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)) bit for bit; the reference path skips the bit packing."""
        if self._kernels(x)[0] is not quantize_pack_ref:
            return self.decode(self.encode(x))
        self.check_input(x)
        tiles = to_tiles(stage(rotate(x)), self.role)  # [..., g, s, R, C], flattened as encode does
        q, scale, zero, other = quantize_tiles_ref(tiles.reshape(-1, *tiles.shape[-2:]), self.bits, self.iters)
        self._check_meta(x, scale, zero, other, tiles.shape[:-2])
        y = dequantize_tiles_ref(q, scale, zero, other).reshape(tiles.shape)
        return rotate(from_tiles(y, self.role))


for _bits in WIDTHS:
    register(
        f"kvarn{_bits}",
        lambda role="k", rot=True, _b=_bits, **params: KVarNFormat(_b, role=role, **params),
    )
