"""The baseline's row encoding: full-vocabulary log-probs of one scored token as 16-bit codes.

Encoding (llama-perplexity's `log_softmax(..., uint16_t * log_prob, ...)`): per row
(one scored token) with top log-prob `hi`, the range is `lo = max(min_v lp_v, hi − 16)`
… `hi`; `scale = (hi − lo)/65535`; `code_v = round((lp_v − lo)/scale)` for `lp_v > lo`,
else 0; stored as `[scale: f32, lo: f32, code_0 … code_{V−1}: u16, pad to even]`, i.e.
`nv = 2·⌈V/2⌉ + 4` uint16 per row, the same row layout llama.cpp writes. Decoding is
`scale·code + lo`. One deliberate difference: the stored `lo` is shifted by δ (|δ| ≤
scale/2) so the decoded probabilities above −16 nats keep their true total mass, which
removes the first-order KLD bias of the rounding, and lo's fp32 rounding is taken up by a
few ulps of lo and scale (see `_mass_corrected_floor`). Every entry at or above the range
floor then decodes within `scale ≤ 16/65535 ≈ 2.44e-4` nats (plus fp32 rounding and
< 3e-5 of ulps) of its true value (`scale/2` without the shift); entries below
`hi − 16` read back as the floor (≤ −16 nats), which `kvarn.stats.metrics` leaves out of the
KLD sum exactly as llama.cpp does.

The sparse packing of these rows is `kvarn.baseline.sparse`; the file that holds them,
`kvarn.baseline.dump`.
"""

from __future__ import annotations

import numpy as np
import torch

from kvarn.stats.metrics import KLD_BASE_FLOOR

ENCODING = "llama-logprob-u16"
ENCODING_VERSION = 3  # 1: llama.cpp lo; 2: mass-corrected lo; 3: and its fp32 rounding taken up (lo, scale)
RANGE_NATS = 16.0

_ROWS = 16  # rows encoded per float64 slice

def row_uint16(vocab_size: int) -> int:
    """uint16 per row: 4 for the f32 scale and floor, the codes, padded to even (llama.cpp)."""
    return 2 * ((vocab_size + 1) // 2) + 4


LO_ULPS, SCALE_ULPS = 4, 16  # the lattice `_mass_corrected_floor` searches (encoding version 3)


def _mass_corrected_floor(x, codes, scale, lo, hi):
    """Shift `lo` (and nudge `scale`) so the decoded probabilities of the entries the KLD
    sums (base log-prob above KLD_BASE_FLOOR) carry exactly their true mass; returns the
    stored (lo, scale).

    Rounding moves each log-prob by ε ∈ ±scale/2; with a perfect Q the KLD then reads
    ≈ Σ p·ε, a bias of ~1e-5 per token (measured: docs/notes/engine-io.md) that swamps
    the low KLD percentiles of 8-bit caches. Subtracting the p-weighted mean of ε (a
    common shift δ, |δ| ≤ scale/2) cancels it to first order (encoding version 2). Storing
    lo in fp32 then leaves up to half its ulp (~1e-6 nats at 16-32 nats) of δ undone, a
    per-row KLD bias of the same size, ~1 % of a q8_0 cell's median KLD on SmolLM2. Version
    3 takes that residual up on a lattice: lo moved by k of its ulps (|k| ≤ LO_ULPS) moves
    every entry by k·ulp_lo; scale moved by j of its ulps (|j| ≤ SCALE_ULPS) moves entry v
    by j·ulp_s·code_v, i.e. the mass by j·ulp_s·c̄ (c̄ the mass-weighted mean code): the
    pair that leaves the least of δ undone is stored (measured: a perfect Q's mean |KLD|
    drops ~5x, tests/test_dump.py; SmolLM2's q8_0 median KLD moves 0.04 % instead of
    0.96 %, bench/perf/results/baseline_size.md). The row layout and decode rule are llama.cpp's.
    x, codes: fp32 [r, V]; scale, lo, hi: fp32 [r, 1].
    """
    keep = x > KLD_BASE_FLOOR
    p = torch.where(keep, x.exp(), 0.0)
    mass = p.sum(1, keepdim=True).double()
    e = torch.where(keep, (codes * scale + lo).exp(), 0.0)
    # the excess of decoded over true mass, summed as differences (accurate in fp32)
    excess = (e - p).sum(1, keepdim=True).double()
    cbar = (e * codes).sum(1, keepdim=True).double() / e.sum(1, keepdim=True).double().clamp(min=1e-300)
    delta = torch.where(mass > 0, -torch.log1p(excess / mass.clamp(min=1e-300)), 0.0)
    shifted = lo.double() + delta
    # Entries clamped to the floor must stay out of the KLD sum (≤ −16 nats).
    clipped = x.min(dim=1, keepdim=True).values < hi - RANGE_NATS
    shifted = torch.where(clipped, shifted.clamp(max=KLD_BASE_FLOOR), shifted)
    lo32 = shifted.float()
    inf = torch.tensor(float("inf"))
    ulp_lo = (torch.nextafter(lo32, inf) - lo32).double().view(-1, 1, 1)
    ulp_s = (torch.nextafter(scale, inf) - scale).double().view(-1, 1, 1)
    k = torch.arange(-LO_ULPS, LO_ULPS + 1, dtype=torch.float64).view(1, -1, 1)
    j = torch.arange(-SCALE_ULPS, SCALE_ULPS + 1, dtype=torch.float64).view(1, 1, -1)
    undone = ((shifted - lo32.double()).view(-1, 1, 1) - k * ulp_lo - j * ulp_s * cbar.view(-1, 1, 1)).abs()
    undone = undone + 1e-30 * (k.abs() + j.abs())  # ties: the smallest move
    too_high = clipped.view(-1, 1, 1) & (lo32.double().view(-1, 1, 1) + k * ulp_lo > KLD_BASE_FLOOR)
    best = torch.where(too_high, float("inf"), undone).flatten(1).argmin(1)
    kk, jj = k.flatten()[best // j.numel()].view(-1, 1), j.flatten()[best % j.numel()].view(-1, 1)
    new_scale = torch.where(scale > 0, scale.double() + jj * ulp_s.view(-1, 1), 0.0)
    return (lo32.double() + kk * ulp_lo.view(-1, 1)).float(), new_scale.float()


def encode_rows(logp: torch.Tensor, mass_correct: bool = True) -> np.ndarray:
    """[n, V] log-probs -> [n, nv] uint16 rows (header + codes).

    Range ends in float64, stored as fp32; codes from the fp32 values with llama.cpp's
    `(x − lo)·(1/scale)` in fp32 (off by at most ~0.01 of a step from exact rounding).
    `mass_correct=False` gives llama.cpp's `lo` exactly (see `_mass_corrected_floor`)."""
    logp = torch.as_tensor(logp)
    if logp.ndim != 2:
        raise ValueError(f"expected log-probs [n_scored, vocab], got shape {tuple(logp.shape)}")
    n, V = logp.shape
    out = np.zeros((n, row_uint16(V)), dtype=np.uint16)
    for a in range(0, n, _ROWS):
        x = logp[a:a + _ROWS].to("cpu", torch.float32)
        hi = x.amax(dim=1, keepdim=True)
        if not torch.isfinite(hi).all():
            raise ValueError(f"rows {a}..{a + len(x) - 1} have a non-finite maximum log-prob")
        lo64 = torch.maximum(x.amin(dim=1, keepdim=True).double(), hi.double() - RANGE_NATS)
        scale = ((hi.double() - lo64) / 65535.0).float()
        lo = lo64.float()
        inv = torch.where(scale > 0, 1.0 / scale, 0.0)
        codes = ((x - lo) * inv).round_().clamp_(0, 65535)
        codes = torch.where(x > lo, codes, 0.0)
        if mass_correct:
            lo, scale = _mass_corrected_floor(x, codes, scale, lo, hi)
        out[a:a + len(x), 4:4 + V] = codes.numpy().astype(np.uint16)
        out[a:a + len(x), :4] = torch.cat([scale, lo], dim=1).numpy().view(np.uint16)
    return out


def decode_rows(rows: np.ndarray, vocab_size: int, device=None) -> torch.Tensor:
    """[n, nv] uint16 rows -> [n, V] float32 log-probs (`scale·code + lo`) on `device`
    (default CPU): the rows travel as 16-bit codes and are decoded where they are used.
    float64 inside (code·scale, then + lo, two roundings), one rounding to fp32 at the end:
    the same bits on every device."""
    rows = np.array(rows, dtype="<u2", copy=True)
    hdr = torch.from_numpy(np.ascontiguousarray(rows[:, :4]).view(np.float32)).to(device)  # scale, lo
    return decode_codes(torch.from_numpy(rows.view(np.int16)).to(device)[:, 4:4 + vocab_size], hdr, vocab_size)


def decode_codes(codes: torch.Tensor, hdr: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """codes [n, V] (uint16 bits in any integer dtype), hdr fp32 [n, 2] (scale, lo) -> fp32 [n, V]:
    the one decode formula of both layouts."""
    out = torch.empty((codes.shape[0], vocab_size), dtype=torch.float32, device=codes.device)
    for a in range(0, codes.shape[0], _ROWS):
        h = hdr[a:a + _ROWS].double()
        c = (codes[a:a + _ROWS].to(torch.int32) & 0xFFFF).double()  # uint16 from int16 bits
        out[a:a + _ROWS] = c.mul_(h[:, :1]).add_(h[:, 1:2])
    return out
