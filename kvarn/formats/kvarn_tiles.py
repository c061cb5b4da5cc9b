"""KVarN's tile arithmetic, the pure-torch reference (DESIGN §4): tokens cut into tiles, the
Hadamard rotation in BeeLlama's arithmetic, the variance normalization, the per-row rounding
(half away from zero). Each compiled fast path (kvarn/formats/kvarn_cpu.py, bit for bit the same)
sits beside its reference. The arithmetic step by step, and why: docs/notes/kvarn.md."""

from __future__ import annotations

import math

import torch

# The type facts (group, slice, iters, head dims) are kvarn.vocab.facts', read here;
# the numerics constants are shared with the Triton kernels (kvarn_numerics).
from kvarn.vocab.facts import kvarn_head_dim_ok
from kvarn.vocab.facts import KVARN_GROUP as GROUP  # tokens per tile (G)
from kvarn.vocab.facts import KVARN_ITERS as ITERS  # normalization passes
from kvarn.vocab.facts import KVARN_SLICE as SLICE  # most channels in one tile

from .kvarn_numerics import LOG_MAX, LOG_MIN, RATIO_FLOOR, STD_MAX, STD_MIN, STEP_MIN


# --- geometry -------------------------------------------------------------------
def check_head_dim(head_dim: int, name: str = "kvarn") -> None:
    """KVarN tiles need a power-of-two head dim in [64, 512]."""
    if not kvarn_head_dim_ok(head_dim):
        raise ValueError(
            f"{name}: head dim {head_dim!r} is not supported; KVarN accepts a power of two "
            "in [64, 512] (64, 128, 256, 512: one tile of D channels for D <= 128, "
            "128-channel tiles otherwise)"
        )


def to_tiles(xr: torch.Tensor, role: str) -> torch.Tensor:
    """Rotated [..., T, D] -> tiles [..., T/G, slices, R, C] (K transposed: rows = channels)."""
    *lead, t, d = xr.shape
    ch = min(d, SLICE)
    y = xr.reshape(*lead, t // GROUP, GROUP, d // ch, ch).transpose(-3, -2)  # [.., g, s, G, ch]
    return (y.transpose(-2, -1) if role == "k" else y).contiguous()


def from_tiles(tiles: torch.Tensor, role: str) -> torch.Tensor:
    """Inverse of to_tiles: [..., T/G, slices, R, C] -> [..., T, D] (contiguous)."""
    y = tiles.transpose(-2, -1) if role == "k" else tiles  # [.., g, s, G, ch]
    *lead, g, s, gs, ch = y.shape
    return y.transpose(-3, -2).reshape(*lead, g * gs, s * ch)


def butterfly(y: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of the last dim (a power of two), BeeLlama's
    in-place loop: for stride 1, 2, 4, ...: (a, b) -> (a + b, a - b) at (i, i + stride).

    Each stage writes its sums and differences straight into the halves of a second buffer
    (two buffers in turn), without a stack or copy per stage: the same fp32 additions as
    `butterfly_ref`, bit for bit (tests/test_kvarn.py)."""
    n = y.shape[-1]
    src = y.reshape(-1, n).contiguous()
    bufs = [torch.empty_like(src) for _ in range(2 if n > 2 else 1)]
    stride, k = 1, 0
    while stride < n:
        dst = bufs[k % len(bufs)]
        v, o = src.view(-1, n // (2 * stride), 2, stride), dst.view(-1, n // (2 * stride), 2, stride)
        torch.add(v[:, :, 0], v[:, :, 1], out=o[:, :, 0])
        torch.sub(v[:, :, 0], v[:, :, 1], out=o[:, :, 1])
        src, stride, k = dst, stride * 2, k + 1
    return src.view(y.shape)


def butterfly_ref(y: torch.Tensor) -> torch.Tensor:
    """`butterfly` as the plain loop (a stack per stage): the reference it is tested against."""
    n, stride = y.shape[-1], 1
    while stride < n:
        v = y.reshape(*y.shape[:-1], n // (2 * stride), 2, stride)
        y = torch.stack((v[..., 0, :] + v[..., 1, :], v[..., 0, :] - v[..., 1, :]), -2).reshape(y.shape)
        stride *= 2
    return y


def _f32(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H_D over the last dim in BeeLlama's arithmetic (`rotate_torch`): on a float32 CPU
    tensor compiled (kvarn.formats.kvarn_cpu, bit for bit the same), otherwise in torch."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        from . import kvarn_cpu

        return kvarn_cpu.rotate(x, min(x.shape[-1], SLICE))
    return rotate_torch(x)


def rotate_torch(x: torch.Tensor) -> torch.Tensor:
    """x @ H_D over the last dim in BeeLlama's arithmetic (H symmetric and orthonormal, so
    this also rotates back): each min(D, 128)-channel slice by the butterfly times fp32
    1/sqrt(slice), then, for D > 128, across the D/128 slices times fp32 1/sqrt(D/128).
    Equal to `x @ hadamard(D)` up to fp32 rounding (tested); x is float32."""
    d = x.shape[-1]
    ch = min(d, SLICE)
    y = butterfly(x.reshape(*x.shape[:-1], d // ch, ch)) * _f32(1 / math.sqrt(ch), x)
    if d > ch:
        y = (butterfly(y.transpose(-1, -2)) * _f32(1 / math.sqrt(d // ch), x)).transpose(-1, -2)
    return y.reshape(x.shape)


def stage(xr: torch.Tensor) -> torch.Tensor:
    """The rotated values as BeeLlama's F16 stage holds them (fp32 -> fp16, round to nearest
    even, -> fp32): the tiles are quantized from these."""
    return xr.half().float()


# --- variance normalization (DESIGN §4.3) ----------------------------------------------
def sample_std(y: torch.Tensor, dim: int) -> torch.Tensor:
    """Sample standard deviation (n - 1) as BeeLlama computes it: one pass in float64 (sum
    and sum of squares), var = max(0, (ss - n*mean^2)/(n - 1)), sqrt in float64, rounded to
    fp32. Only the float64 sums' order differs from its sequential loop (an error of ~1e-16
    relative before the fp32 rounding)."""
    n = y.shape[dim]
    y = y.transpose(dim, -1) if dim % y.dim() != y.dim() - 1 else y
    y64 = y.to(torch.float64, memory_format=torch.contiguous_format)  # sums along a contiguous dim: faster
    mean = y64.sum(-1) / n
    var = ((y64 * y64).sum(-1) - n * mean * mean) / (n - 1)
    return torch.sqrt(var.clamp_min(0.0)).float()


def exp32(x: torch.Tensor) -> torch.Tensor:
    """fp32 exp, computed in float64 and rounded: the correctly rounded result but for the
    rare argument whose exp lies within ~1e-16 of an fp32 rounding boundary. BeeLlama calls
    glibc's expf, which is not correctly rounded everywhere (rarely an ulp away)."""
    return torch.exp(x.double()).float()


def log32(x: torch.Tensor) -> torch.Tensor:
    """fp32 log, computed in float64 and rounded (BeeLlama: glibc's logf; see exp32)."""
    return torch.log(x.double()).float()


def scaled(tiles: torch.Tensor, log_col: torch.Tensor, log_row: torch.Tensor) -> torch.Tensor:
    """Y = X / (e^b_row * e^a_col)."""
    return tiles / (exp32(log_row)[..., :, None] * exp32(log_col)[..., None, :])


def imbalance(std_col: torch.Tensor, std_row: torch.Tensor) -> torch.Tensor:
    """max/min std over columns + max/min std over rows (min floored at 1e-8)."""
    col = std_col.amax(-1) / std_col.amin(-1).clamp_min(RATIO_FLOOR)
    row = std_row.amax(-1) / std_row.amin(-1).clamp_min(RATIO_FLOOR)
    return col + row


def _log_update(log_scale: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return (log_scale + log32(std.clamp(STD_MIN, STD_MAX))).clamp(LOG_MIN, LOG_MAX)


def keep_better(cur, best, candidate, kept):
    """The pass-selection rule: where the new imbalance `cur` is lower than or equal to `best`
    (ties -> the later pass, BeeLlama's `<=`), take the candidate (a, b, pass) over the kept
    one. Returns (best, a, b, pass)."""
    better = cur <= best
    (a, b, n), (best_a, best_b, best_pass) = candidate, kept
    return (torch.where(better, cur, best), torch.where(better[..., None], a, best_a),
            torch.where(better[..., None], b, best_b), torch.where(better, n, best_pass))


def normalize_choice(tiles: torch.Tensor, iters: int = ITERS):
    """`normalize_ref` plus the pass it kept per tile (int64 [...], 0 = the unscaled tile)."""
    a = tiles.new_zeros(tiles.shape[:-2] + tiles.shape[-1:])
    b = tiles.new_zeros(tiles.shape[:-1])
    std_col, std_row = sample_std(tiles, -2), sample_std(tiles, -1)
    best_a, best_b, best = a, b, imbalance(std_col, std_row)
    best_pass = torch.zeros(tiles.shape[:-2], dtype=torch.int64, device=tiles.device)
    for i in range(iters):
        a = _log_update(a, std_col)
        std_row = sample_std(scaled(tiles, a, b), -1)
        b = _log_update(b, std_row)
        y = scaled(tiles, a, b)
        std_col, std_row = sample_std(y, -2), sample_std(y, -1)
        best, best_a, best_b, best_pass = keep_better(imbalance(std_col, std_row), best, (a, b, i + 1),
                                                      (best_a, best_b, best_pass))
    return best_a, best_b, best_pass


def normalize_ref(tiles: torch.Tensor, iters: int = ITERS) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-scales (a per column [..., C], b per row [..., R]) of the least imbalanced pass.

    tiles: float32 [..., R, C], normalized independently over the leading dims. The
    unscaled tile (a = b = 0) is the first candidate; a later pass replaces the best
    one when its imbalance is lower or equal (ties -> later), as BeeLlama's `<=`.
    """
    return normalize_choice(tiles, iters)[:2]


def _check_cpu_tiles(tiles: torch.Tensor, name: str) -> None:
    if tiles.dim() != 3 or tiles.dtype != torch.float32 or tiles.is_cuda:
        raise ValueError(f"{name}: tiles must be float32 CPU [N, R, C], got {tiles.dtype} "
                         f"{tuple(tiles.shape)} on {tiles.device}")


def normalize_choice_fast(tiles: torch.Tensor, iters: int = ITERS):
    """`normalize_choice`, bit for bit, as one compiled loop per tile (kvarn.formats.kvarn_cpu:
    the reference's torch operations cost more in dispatch than in arithmetic on small tiles).

    tiles: float32 CPU [N, R, C]. Tested against `normalize_choice` on random, real (post-RoPE
    SmolLM2 / Gemma 3) and degenerate tiles (tests/test_kvarn.py)."""
    _check_cpu_tiles(tiles, "normalize_choice_fast")
    from . import kvarn_cpu  # numba, compiled on first use: only where a CPU tile is encoded

    return kvarn_cpu.normalize_choice(tiles, iters)


# --- per-row asymmetric RTN (DESIGN §4.4-4.5) ----------------------------------------
def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """Round v >= 0 to the nearest integer, halves up (= away from zero for v >= 0)."""
    fl = torch.floor(v)
    return torch.where(v - fl >= 0.5, fl + 1, fl)


def quantize_rows(y: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8 [..., R, C]), lo [..., R] and step [..., R] of the normalized tile y."""
    qmax = 2**bits - 1
    lo, hi = y.amin(-1), y.amax(-1)
    step = ((hi - lo) / qmax).clamp_min(STEP_MIN)
    q = round_half_away((y - lo[..., None]) / step[..., None]).clamp(0, qmax)
    return q.to(torch.uint8), lo, step


def quantize_normalized(tiles: torch.Tensor, bits: int, iters: int = ITERS):
    """(a, b, codes, lo, step): `normalize_ref`, then `quantize_rows` of the scaled tile."""
    a, b = normalize_ref(tiles, iters)
    return a, b, *quantize_rows(scaled(tiles, a, b), bits)


def quantize_normalized_fast(tiles: torch.Tensor, bits: int, iters: int = ITERS):
    """`quantize_normalized` bit for bit, compiled for CPU tiles (kvarn.formats.kvarn_cpu): what
    the CPU encoder runs. tiles: float32 CPU [N, R, C]."""
    _check_cpu_tiles(tiles, "quantize_normalized_fast")
    from . import kvarn_cpu

    return kvarn_cpu.quantize(tiles, bits, iters)


def _quantize_tiles(tiles: torch.Tensor, bits: int, iters: int):
    # bit for bit the same; the fast one runs (and is tested) on CPU only
    a, b, q, lo, step = (quantize_normalized if tiles.is_cuda else quantize_normalized_fast)(tiles, bits, iters)
    s_row = exp32(b)
    return q, (s_row * step).half(), (s_row * lo).half(), exp32(a).half()


def quantize_tiles_ref(tiles: torch.Tensor, bits: int, iters: int = ITERS):
    """Tiles [..., R, C] -> (codes uint8 [..., R, C], scale f16 [..., R], zero f16 [..., R],
    other f16 [..., C]): normalize, quantize each row, fold the scales into fp16 metadata.
    Tiles are independent: results do not depend on how they are batched."""
    lead, (rows, cols) = tiles.shape[:-2], tiles.shape[-2:]
    q, scale, zero, other = _quantize_tiles(tiles.reshape(-1, rows, cols), bits, iters)
    return q.reshape(tiles.shape), scale.reshape(*lead, rows), zero.reshape(*lead, rows), other.reshape(*lead, cols)


def dequantize_tiles_ref(codes, scale, zero, other) -> torch.Tensor:
    """x = (q * scale[row] + zero[row]) * other[col], fp32, in the rotated frame."""
    x = codes.float() * scale.float()[..., :, None] + zero.float()[..., :, None]
    return x * other.float()[..., None, :]
