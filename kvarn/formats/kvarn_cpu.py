"""KVarN's CPU encoder, compiled (numba): the variance normalization with its kept pass
(`normalize_choice`), the per-row rounding (`quantize_rows` of the scaled tile) and the
Hadamard rotation (`rotate_torch`) of kvarn.formats.kvarn_tiles, the same arithmetic value for value.

Why compiled: the torch reference issues ~60 tensor operations per pass on small tiles
(64 x 128), so at the engine's batch most of a call was dispatch, and a kvarn4 cell cost
~1.5x its baseline on CPU (bench/perf/results/forward_speed_kvarn_fast.md). Here a tile's 16 passes
are one call with no temporaries.

The arithmetic is the reference's, in its order of operations and types:

* a pass scales the tile as fp32 `x / (e^b[row] * e^a[col])` (fp32 product, fp32 division);
* a sample std is a one-pass float64 sum and sum of squares of the fp32 values, var =
  max(0, (ss - n*mean*mean)/(n - 1)), sqrt in float64, rounded to fp32. The sums run in
  sequence, as BeeLlama's loop does; the reference's torch `sum` adds in another order. The
  values are fp32 (24-bit significands) and their squares exact in float64, so both orders
  give the same float64 sum unless a row spans more than ~2^22 in magnitude, and then differ
  in the last float64 bits, far below the fp32 rounding of the std (tests/test_kvarn.py
  compares every pass's choice and log-scale bit for bit on random, real and degenerate tiles);
* exp and log in float64, rounded to fp32 (`exp32`, `log32`); the clamps, the imbalance
  (max/min of each axis's stds, min floored at 1e-8) and the `<=` keep of the best pass in
  fp32, with the constants rounded to fp32 as torch rounds a Python scalar;
* the butterfly's sums and differences in fp32, each slice's then the cross-slice scale in fp32.

Compiled on first use (~15 s of CPU on our 2-core machine), cached beside this file or in
NUMBA_CACHE_DIR; a later process pays numba's import and the cache's load (~1.6 s together).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from .kvarn_numerics import LOG_MAX, LOG_MIN, RATIO_FLOOR, STD_MAX, STD_MIN, STEP_MIN

_STD_MIN, _STD_MAX = np.float32(STD_MIN), np.float32(STD_MAX)
_LOG_MIN, _LOG_MAX = np.float32(LOG_MIN), np.float32(LOG_MAX)
_FLOOR = np.float32(RATIO_FLOOR)
_STEP_MIN = np.float32(STEP_MIN)

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def _std(s, ss, n):
    mean = s / n
    var = (ss - n * mean * mean) / (n - 1)
    if var < 0.0:
        var = 0.0
    return np.float32(math.sqrt(var))


@_jit
def _exp32(v):
    return np.float32(math.exp(np.float64(v)))


@_jit
def _log_update(log_scale, std):
    s = min(max(std, _STD_MIN), _STD_MAX)
    v = log_scale + np.float32(math.log(np.float64(s)))
    return min(max(v, _LOG_MIN), _LOG_MAX)


@_jit
def _ratio(std):
    hi, lo = std[0], std[0]
    for v in std[1:]:
        hi, lo = max(hi, v), min(lo, v)
    return hi / max(lo, _FLOOR)


@_jit
def _row_stats(xt, ea, eb, s, ss, row_std):
    """Row stds of the scaled tile from its transpose xt [C, R]: each row's sums run over the
    columns in order, and the rows side by side (a vector loop, no reassociation)."""
    cols, rows = xt.shape
    s[:] = 0.0
    ss[:] = 0.0
    for c in range(cols):
        e = ea[c]
        for r in range(rows):
            y = np.float64(xt[c, r] / (eb[r] * e))
            s[r] += y
            ss[r] += y * y
    for r in range(rows):
        row_std[r] = _std(s[r], ss[r], cols)


@_jit
def _quantize_rows(tiles, a, b, qmax, codes, lo, step):
    """`quantize_rows(scaled(tiles, a, b), bits)`: per row of the scaled tile, asymmetric
    min/max RTN, halves rounded up (BeeLlama's roundf of a non-negative value)."""
    n, rows, cols = tiles.shape
    y, ea = np.empty(cols, np.float32), np.empty(cols, np.float32)
    q32 = np.float32(qmax)
    for t in range(n):
        for c in range(cols):
            ea[c] = _exp32(a[t, c])
        for r in range(rows):
            e = _exp32(b[t, r])
            for c in range(cols):
                y[c] = tiles[t, r, c] / (e * ea[c])
            lo_r, hi_r = y[0], y[0]
            for v in y[1:]:
                lo_r, hi_r = min(lo_r, v), max(hi_r, v)
            st = max((hi_r - lo_r) / q32, _STEP_MIN)
            for c in range(cols):
                v = (y[c] - lo_r) / st
                fl = np.floor(v)
                q = fl + np.float32(1.0) if v - fl >= np.float32(0.5) else fl
                codes[t, r, c] = min(max(q, np.float32(0.0)), q32)
            lo[t, r], step[t, r] = lo_r, st


@_jit
def _normalize(tiles, iters, best_a, best_b, best_pass):
    n, rows, cols = tiles.shape
    a, b = np.zeros(cols, np.float32), np.zeros(rows, np.float32)
    ea, eb = np.ones(cols, np.float32), np.ones(rows, np.float32)
    row_std, col_std = np.empty(rows, np.float32), np.empty(cols, np.float32)
    rs, rss, cs, css = np.empty(rows), np.empty(rows), np.empty(cols), np.empty(cols)
    xt = np.empty((cols, rows), np.float32)
    for t in range(n):
        x = tiles[t]
        xt[:] = x.T
        a[:] = 0.0
        b[:] = 0.0
        ea[:] = 1.0
        eb[:] = 1.0
        _row_stats(x, eb, ea, cs, css, col_std)  # the columns' stds are the transpose's row stds
        _row_stats(xt, ea, eb, rs, rss, row_std)
        best = _ratio(col_std) + _ratio(row_std)
        best_a[t] = a
        best_b[t] = b
        best_pass[t] = 0
        for i in range(iters):
            for c in range(cols):
                a[c] = _log_update(a[c], col_std[c])
                ea[c] = _exp32(a[c])
            _row_stats(xt, ea, eb, rs, rss, row_std)
            for r in range(rows):
                b[r] = _log_update(b[r], row_std[r])
                eb[r] = _exp32(b[r])
            _row_stats(x, eb, ea, cs, css, col_std)
            _row_stats(xt, ea, eb, rs, rss, row_std)
            cur = _ratio(col_std) + _ratio(row_std)
            if cur <= best:  # ties -> the later pass (BeeLlama's `<=`)
                best = cur
                best_a[t] = a
                best_b[t] = b
                best_pass[t] = i + 1


@_jit
def _butterfly_rows(xt, first, n, unit):
    """BeeLlama's in-place Walsh-Hadamard loop over n channels, channel k being row
    first + k*unit of xt [D, M]: every pair (a, b) -> (a + b, a - b), the M tokens side by side."""
    m = xt.shape[1]
    stride = 1
    while stride < n:
        for i in range(0, n, 2 * stride):
            for j in range(i, i + stride):
                p, q = xt[first + j * unit], xt[first + (j + stride) * unit]
                for t in range(m):
                    lo, hi = p[t], q[t]
                    p[t], q[t] = lo + hi, lo - hi
        stride *= 2


@_jit
def _rotate_t(xt, ch):
    """kvarn.formats.kvarn_tiles.rotate_torch on the channels-first xt [D, M] (fp32), in place: each
    ch-channel slice by the butterfly times fp32 1/sqrt(ch), then across the D/ch slices times
    fp32 1/sqrt(D/ch)."""
    slices = xt.shape[0] // ch
    s_slice, s_cross = np.float32(1.0 / math.sqrt(ch)), np.float32(1.0 / math.sqrt(slices))
    for s in range(slices):
        _butterfly_rows(xt, s * ch, ch, 1)
    xt *= s_slice
    if slices > 1:
        for c in range(ch):
            _butterfly_rows(xt, c, slices, ch)
        xt *= s_cross


def rotate(x: torch.Tensor, ch: int) -> torch.Tensor:
    """`rotate_torch` of a float32 CPU tensor [..., D] with ch-channel slices, value for value."""
    xt = x.detach().reshape(-1, x.shape[-1]).t().contiguous()
    _rotate_t(xt.numpy(), ch)
    return xt.t().reshape(x.shape)


def _normalized(x: np.ndarray, iters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, rows, cols = x.shape
    a, b = np.empty((n, cols), np.float32), np.empty((n, rows), np.float32)
    kept = np.empty(n, np.int64)
    _normalize(x, int(iters), a, b, kept)
    return a, b, kept


def normalize_choice(tiles: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a [N, C], b [N, R], pass [N] int64) of float32 CPU tiles [N, R, C]: `normalize_choice`'s."""
    return tuple(map(torch.from_numpy, _normalized(tiles.detach().contiguous().numpy(), iters)))


def quantize(tiles: torch.Tensor, bits: int, iters: int):
    """(a, b, codes uint8 [N, R, C], lo [N, R], step [N, R]) of float32 CPU tiles [N, R, C]:
    `normalize_ref` then `quantize_rows(scaled(tiles, a, b), bits)`, value for value."""
    x = tiles.detach().contiguous().numpy()
    a, b, _ = _normalized(x, iters)
    n, rows, cols = x.shape
    codes = np.empty((n, rows, cols), np.uint8)
    lo, step = np.empty((n, rows), np.float32), np.empty((n, rows), np.float32)
    _quantize_rows(x, a, b, 2**bits - 1, codes, lo, step)
    return tuple(map(torch.from_numpy, (a, b, codes, lo, step)))
