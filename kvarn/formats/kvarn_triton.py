"""Triton kernels for KVarN tiles, beside their references in kvarn/formats/kvarn_type.py.

    quantize_pack(tiles, bits, iters)          == kvarn_type.quantize_pack_ref   (same signature)
    unpack_dequantize(payload, scale, zero, other, bits) == kvarn_type.unpack_dequantize_ref

Also `quantize_warps` (warps per tile program). One program per tile [R, C] (R, C in {64, 128}),
fp32 throughout; the Hadamard rotation stays in torch. Imported lazily (a CUDA tensor reaching
KVarNFormat, or impl="triton"), so `import kvarn` never imports Triton. On CPU the kernels only
run under TRITON_INTERPRET=1 (set before triton is imported).

Why (the packing, the precise ops, what can still differ from the reference and how
tests/test_kvarn_triton.py bounds it): docs/notes/kvarn.md "Triton kernels".
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# precise exp/log (the pattern torch inductor uses; triton >= 3.0 has extra.libdevice,
# some builds only extra.cuda.libdevice); None -> tl.exp/tl.log
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
try:
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older layouts
    try:
        from triton.language.extra.cuda import libdevice
    except ImportError:
        libdevice = None
LIBDEVICE = tl.constexpr(libdevice is not None and not _INTERPRET)

from kvarn.vocab.facts import KVARN_ITERS, kvarn_payload_nbytes

from . import kvarn_numerics as num

# the reference's constants, as compile-time constants of the kernels
STD_MIN = tl.constexpr(num.STD_MIN)
STD_MAX = tl.constexpr(num.STD_MAX)
LOG_MIN = tl.constexpr(num.LOG_MIN)
LOG_MAX = tl.constexpr(num.LOG_MAX)
RATIO_FLOOR = tl.constexpr(num.RATIO_FLOOR)
STEP_MIN = tl.constexpr(num.STEP_MIN)


@triton.jit
def _div(x, y, PRECISE: tl.constexpr):
    """x / y, correctly rounded (div.rn) unless PRECISE is off (approximate div.full)."""
    if PRECISE:
        return tl.math.div_rn(x, y)
    else:
        return x / y


@triton.jit
def _fp32_fn(x, FN: tl.constexpr, PRECISE: tl.constexpr):
    """fp32 exp or log (FN "exp" / "log"); PRECISE: in float64, rounded to fp32, as the
    reference (`kvarn.exp32` / `kvarn.log32`): libdevice's, or tl's under the interpreter."""
    if PRECISE:
        x = x.to(tl.float64)
    if PRECISE and LIBDEVICE:
        y = libdevice.exp(x) if FN == "exp" else libdevice.log(x)
    else:
        y = tl.exp(x) if FN == "exp" else tl.log(x)
    return y.to(tl.float32)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    return _fp32_fn(x, "exp", PRECISE)


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    return _fp32_fn(x, "log", PRECISE)


@triton.jit
def _std(y, axis: tl.constexpr, n: tl.constexpr):
    """Sample std (n - 1) along `axis` of a 2-D block, as the reference (`kvarn_tiles.sample_std`,
    BeeLlama's loop): one pass in float64, var = max(0, (ss - n*mean^2)/(n - 1)), sqrt in
    float64, rounded to fp32 (NVPTX's float64 div and sqrt are the correctly rounded .rn
    instructions; the approximate ones exist for fp32 only)."""
    y64 = y.to(tl.float64)
    mean = tl.sum(y64, axis=axis) / n
    var = tl.maximum((tl.sum(y64 * y64, axis=axis) - n * mean * mean) / (n - 1), 0.0)
    return tl.sqrt(var).to(tl.float32)


@triton.jit
def _imbalance(std_col, std_row, PRECISE: tl.constexpr):
    col = _div(tl.max(std_col, axis=0), tl.maximum(tl.min(std_col, axis=0), RATIO_FLOOR), PRECISE)
    row = _div(tl.max(std_row, axis=0), tl.maximum(tl.min(std_row, axis=0), RATIO_FLOOR), PRECISE)
    return col + row


@triton.jit
def _log_update(log_scale, std, PRECISE: tl.constexpr):
    s = tl.minimum(tl.maximum(std, STD_MIN), STD_MAX)
    return tl.minimum(tl.maximum(log_scale + _log(s, PRECISE), LOG_MIN), LOG_MAX)


@triton.jit
def _scaled(x, a, b, PRECISE: tl.constexpr):
    return _div(x, _exp(b, PRECISE)[:, None] * _exp(a, PRECISE)[None, :], PRECISE)


@triton.jit
def _chunk_layout(BITS: tl.constexpr):
    """Where code k of a chunk of 32 sits (docs/notes/kvarn.md "Triton kernels"): its word (k*BITS)//32, its shift
    (k*BITS)%32, and whether it spills into the next word."""
    start = tl.arange(0, 32).to(tl.int64) * BITS
    s_k = start % 32
    return start // 32, s_k, (s_k + BITS) > 32


@triton.jit
def _quantize_pack_kernel(x_ptr, words_ptr, scale_ptr, zero_ptr, other_ptr, iters,
                          R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr,
                          PRECISE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    x = tl.load(x_ptr + pid * R * C + rows[:, None] * C + cols[None, :])

    # variance normalization (DESIGN §4.3): candidate 0 is the unscaled tile, ties -> later
    a = tl.zeros([C], dtype=tl.float32)
    b = tl.zeros([R], dtype=tl.float32)
    std_col = _std(x, 0, R)
    std_row = _std(x, 1, C)
    best = _imbalance(std_col, std_row, PRECISE)
    best_a = a
    best_b = b
    for _ in range(iters):
        a = _log_update(a, std_col, PRECISE)
        std_row = _std(_scaled(x, a, b, PRECISE), 1, C)
        b = _log_update(b, std_row, PRECISE)
        y = _scaled(x, a, b, PRECISE)
        std_col = _std(y, 0, R)
        std_row = _std(y, 1, C)
        cur = _imbalance(std_col, std_row, PRECISE)
        better = cur <= best
        best = tl.where(better, cur, best)
        best_a = tl.where(better, a, best_a)
        best_b = tl.where(better, b, best_b)

    # per-row asymmetric RTN, round half away from zero (v >= 0)
    y = _scaled(x, best_a, best_b, PRECISE)
    lo = tl.min(y, axis=1)
    hi = tl.max(y, axis=1)
    step = tl.maximum(_div(hi - lo, 2**BITS - 1, PRECISE), STEP_MIN)
    v = _div(y - lo[:, None], step[:, None], PRECISE)
    fl = tl.floor(v)
    q = tl.where(v - fl >= 0.5, fl + 1.0, fl)
    q = tl.minimum(tl.maximum(q, 0.0), 2**BITS - 1).to(tl.int64)

    s_row = _exp(best_b, PRECISE)
    tl.store(scale_ptr + pid * R + rows, (s_row * step).to(tl.float16))
    tl.store(zero_ptr + pid * R + rows, (s_row * lo).to(tl.float16))
    tl.store(other_ptr + pid * C + cols, _exp(best_a, PRECISE).to(tl.float16))

    # dense LSB-first packing, 32 codes -> BITS words
    NCH: tl.constexpr = R * C // 32
    q = tl.reshape(q, [NCH, 32])
    w_k, s_k, spill = _chunk_layout(BITS)
    chunks = tl.arange(0, NCH).to(tl.int64)
    for m in tl.static_range(BITS):
        low = tl.where((w_k == m)[None, :], q << s_k[None, :], 0)
        high = tl.where(((w_k == m - 1) & spill)[None, :], q >> (32 - s_k)[None, :], 0)
        word = tl.sum(low + high, axis=1) & 0xFFFFFFFF
        word = tl.where(word >= 2**31, word - 2**32, word)  # as a two's-complement int32
        tl.store(words_ptr + pid * NCH * BITS + chunks * BITS + m, word.to(tl.int32))


@triton.jit
def _unpack_dequantize_kernel(words_ptr, scale_ptr, zero_ptr, other_ptr, out_ptr,
                              R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    NCH: tl.constexpr = R * C // 32
    w_k, s_k, spill = _chunk_layout(BITS)
    chunks = tl.arange(0, NCH).to(tl.int64)
    codes = tl.zeros([NCH, 32], dtype=tl.int64)
    for m in tl.static_range(BITS):
        word = tl.load(words_ptr + pid * NCH * BITS + chunks * BITS + m).to(tl.int64) & 0xFFFFFFFF
        low = tl.where((w_k == m)[None, :], word[:, None] >> s_k[None, :], 0)
        high = tl.where(((w_k == m - 1) & spill)[None, :], word[:, None] << (32 - s_k)[None, :], 0)
        codes += low + high  # disjoint bit ranges
    codes = tl.reshape(codes & (2**BITS - 1), [R, C])

    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    scale = tl.load(scale_ptr + pid * R + rows).to(tl.float32)
    zero = tl.load(zero_ptr + pid * R + rows).to(tl.float32)
    other = tl.load(other_ptr + pid * C + cols).to(tl.float32)
    xq = codes.to(tl.float32) * scale[:, None] + zero[:, None]
    tl.store(out_ptr + pid * R * C + rows[:, None] * C + cols[None, :], xq * other[None, :])


def _check_tiles(tiles: torch.Tensor, bits: int) -> None:
    if tiles.dim() != 3 or tiles.dtype != torch.float32:
        raise ValueError(f"expected float32 tiles [N, R, C], got {tuple(tiles.shape)} {tiles.dtype}")
    if tiles.shape[1] not in (64, 128) or tiles.shape[2] not in (64, 128):
        raise ValueError(f"tile sides must be 64 or 128, got {tuple(tiles.shape[1:])}")
    if bits not in range(2, 9):
        raise ValueError(f"bits must be in 2..8, got {bits!r}")


def quantize_warps(rows: int, cols: int) -> int:
    """Warps per tile program: 16 for 128x128 tiles, 8 for 64x128, 128x64 and 64x64.

    Registers (sm_90, triton 3.9 + ptxas, cuobjdump): 128x128 at 8 warps hits the 255
    cap and spills (432 B stack), at 16 warps 128 registers and 256 B; 64x128 needs 254
    registers at 8 warps, 125 at 16, neither spills. Measured on an H200 (triton 3.6,
    16384 tiles, 4 bits, precise ops; docs/notes/kvarn.md): 128x128 at 8/16/32 warps
    36/42/30 GB/s of fp32 input, 64x128 at 8/16 warps 45/28 GB/s. (With precise=False
    8 warps is best for both: 74 and 61 GB/s.)"""
    return 16 if rows * cols >= 128 * 128 else 8


def quantize_pack(tiles: torch.Tensor, bits: int, iters: int = KVARN_ITERS, *, num_warps: int | None = None,
                  precise: bool = True):
    """Tiles fp32 [N, R, C] -> (payload uint8 [N, R*C*bits/8], scale f16 [N, R],
    zero f16 [N, R], other f16 [N, C]); same contract as kvarn_type.quantize_pack_ref.

    num_warps: None -> quantize_warps(R, C). precise=False uses Triton's approximate
    division, sqrt, exp and log instead of the IEEE/libdevice ones: 1.6-1.8x faster on an
    H200, but its agreement with the reference is not what the GPU tests last checked."""
    _check_tiles(tiles, bits)
    n, r, c = tiles.shape
    x = tiles.contiguous()
    words = torch.empty(n, r * c * bits // 32, dtype=torch.int32, device=x.device)
    scale = torch.empty(n, r, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    other = torch.empty(n, c, dtype=torch.float16, device=x.device)
    if n:
        _quantize_pack_kernel[(n,)](x, words, scale, zero, other, iters, R=r, C=c, BITS=bits,
                                    PRECISE=precise, num_warps=num_warps or quantize_warps(r, c),
                                    enable_fp_fusion=False)
    payload = words.view(torch.uint8)  # little-endian words = the LSB-first byte stream
    assert payload.shape[-1] == kvarn_payload_nbytes(r, c, bits)
    return payload, scale, zero, other


def unpack_dequantize(payload, scale, zero, other, bits: int) -> torch.Tensor:
    """(payload, scale, zero, other) -> fp32 tiles [N, R, C]; as kvarn_type.unpack_dequantize_ref."""
    n, r = scale.shape
    c = other.shape[-1]
    words = payload.contiguous().view(torch.int32)
    out = torch.empty(n, r, c, dtype=torch.float32, device=payload.device)
    if n:
        _unpack_dequantize_kernel[(n,)](words, scale.contiguous(), zero.contiguous(), other.contiguous(), out,
                                        R=r, C=c, BITS=bits, num_warps=8)
    return out
