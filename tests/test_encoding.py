"""The baseline's row encoding (kvarn.baseline.encoding) against references written here: llama.cpp's
rule for the codes and the range, and a brute-force search of the lattice the mass-corrected floor
chooses from, scored by the decoded mass itself (float64), on rows that reach each of its branches:
normalised and unnormalised rows, confident rows whose floor sits at −16, entries exactly at the
floor, a minimum exactly 16 nats below the top, nothing above the floor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvarn.baseline import encoding
from kvarn.stats.metrics import KLD_BASE_FLOOR

V = 3000


def header(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, lo) per row, fp32 [n]."""
    h = torch.from_numpy(np.ascontiguousarray(rows[:, :4]).view(np.float32).copy())
    return h[:, 0], h[:, 1]


def llama_rows(x: torch.Tensor) -> np.ndarray:
    """llama-perplexity's encoding (mass_correct=False), written from its C: lo = max(min, hi − 16) and
    scale = (hi − lo)/65535 in double, stored as float; code = round((x − lo)·(1/scale)) in float,
    clamped to 0..65535, and 0 where x <= lo."""
    x = x.numpy().astype(np.float32)
    out = np.zeros((len(x), encoding.row_uint16(x.shape[1])), dtype=np.uint16)
    for i, row in enumerate(x):
        hi = float(row.max())
        lo = max(float(row.min()), hi - 16.0)
        scale = np.float32((hi - lo) / 65535.0)
        lo32 = np.float32(lo)
        inv = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
        codes = np.clip(np.rint((row - lo32) * inv), 0, 65535)
        out[i, 4:4 + len(row)] = np.where(row > lo32, codes, 0).astype(np.uint16)
        out[i, :4] = np.array([scale, lo32], dtype=np.float32).view(np.uint16)
    return out


def log_probs(seed: int, n: int) -> torch.Tensor:
    """Normalised rows from flat to peaked (logit scale 0.5 .. 6): most clipped at hi − 16."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.5, 6.0, n, dtype=torch.float64)[:, None]
    return torch.log_softmax(t * torch.randn(n, V, generator=g, dtype=torch.float64), -1).float()


def confident(seed: int, n: int) -> torch.Tensor:
    """Rows whose top token has p from ~0.4 to ~1 − 1e-15: hi from −1 to 0, lo within ulps of −16."""
    g = torch.Generator().manual_seed(seed)
    lg = 2.0 * torch.randn(n, V, generator=g, dtype=torch.float64)
    lg[:, 0] += torch.linspace(14.0, 40.0, n, dtype=torch.float64)
    return torch.log_softmax(lg, -1).float()


def clipped(x: torch.Tensor) -> torch.Tensor:
    """Per row: entries below hi − 16 exist (clamped to the floor, which must then stay <= −16)."""
    return x.min(1).values < x.max(1).values - 16.0


def mass_error(x: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """Per row, (decoded − true) mass of the entries above the floor, relative, in float64."""
    keep = x > KLD_BASE_FLOOR
    p = torch.where(keep, x.double().exp(), 0.0).sum(1)
    d = encoding.decode_rows(rows, x.shape[1]).double()
    e = torch.where(keep, d.exp(), 0.0).sum(1)
    return torch.where(p > 0, (e - p) / p.clamp(min=1e-300), 0.0)


def lattice_best(x: torch.Tensor, rows_v2: np.ndarray) -> torch.Tensor:
    """The least |mass_error| over every (lo + k ulps, scale + j ulps), |k| <= LO_ULPS, |j| <= SCALE_ULPS,
    around the version-2 floor (no lattice), keeping a clipped row's floor at or below −16 (its clamped
    entries stay out of the KLD sum). Brute force, one candidate header at a time."""
    scale0, lo0 = header(rows_v2)
    inf = torch.tensor(float("inf"))
    ulp_lo, ulp_s = (torch.nextafter(lo0, inf) - lo0).double(), (torch.nextafter(scale0, inf) - scale0).double()
    is_clipped = clipped(x)
    best = torch.full((len(x),), float("inf"), dtype=torch.float64)
    for k in range(-encoding.LO_ULPS, encoding.LO_ULPS + 1):
        for j in range(-encoding.SCALE_ULPS, encoding.SCALE_ULPS + 1):
            lo, scale = (lo0.double() + k * ulp_lo).float(), (scale0.double() + j * ulp_s).float()
            cand = rows_v2.copy()
            cand[:, :4] = torch.stack([scale, lo], 1).numpy().view(np.uint16)
            err = mass_error(x, cand).abs()
            ok = ~(is_clipped & (lo > KLD_BASE_FLOOR))
            best = torch.where(ok & (err < best), err, best)
    return best


def encoded(x: torch.Tensor, monkeypatch, lattice: bool = True) -> np.ndarray:
    if not lattice:
        monkeypatch.setattr(encoding, "LO_ULPS", 0)
        monkeypatch.setattr(encoding, "SCALE_ULPS", 0)
    rows = encoding.encode_rows(x)
    monkeypatch.undo()
    return rows


def test_codes_and_range_are_llama_cpps():
    x = log_probs(0, 32)
    # an entry a third of a step above the floor (code 0, not 1) and one exactly at it
    hi, lo = x[0].max(), x[0].min()
    step = (hi.double() - lo.double()) / 65535.0
    x[0, 1] = float(lo.double() + step / 3)
    x[0, 2] = lo
    ours = encoding.encode_rows(x, mass_correct=False)
    assert np.array_equal(ours, llama_rows(x))
    assert ours[0, 4 + 1] == 0 and ours[0, 4 + 2] == 0
    # the mass correction moves only the header
    assert np.array_equal(encoding.encode_rows(x)[:, 4:], ours[:, 4:])


@pytest.mark.parametrize("kind", ["log_probs", "confident", "unnormalised"])
def test_the_floor_takes_the_best_lattice_point(kind, monkeypatch):
    # The stored (lo, scale) leaves at most the brute-force best of its lattice undone, within 2.5e-7
    # of the mass: its own estimate decodes and sums in fp32 (measured here at most 1.8e-7 over the
    # best; a mass or mean code computed wrong leaves 2.5e-5 and more).
    x = {"log_probs": lambda: log_probs(1, 48), "confident": lambda: confident(2, 24),
         "unnormalised": lambda: log_probs(3, 24) - 3.0}[kind]()
    v3, v2 = encoded(x, monkeypatch), encoded(x, monkeypatch, lattice=False)
    best = lattice_best(x, v2)
    got = mass_error(x, v3).abs()
    print(f"{kind}: worst over the best {(got - best).max():.2e}; v2 {mass_error(x, v2).abs().max():.2e}")
    assert (got <= best + 2.5e-7).all(), (got - best).max()
    # a clipped row's floor stays at or below −16; the header moved within its lattice
    is_clipped = clipped(x)
    (s3, lo3), (s2, lo2) = header(v3), header(v2)
    assert (lo3[is_clipped] <= KLD_BASE_FLOOR).all()
    steps_lo = (lo3.double() - lo2.double()) / (torch.nextafter(lo2, torch.tensor(np.inf)) - lo2).double()
    steps_s = (s3.double() - s2.double()) / (torch.nextafter(s2, torch.tensor(np.inf)) - s2).double()
    assert (steps_lo.abs() <= encoding.LO_ULPS + 1e-6).all() and (steps_s.abs() <= encoding.SCALE_ULPS + 1e-6).all()
    if kind == "log_probs":
        # the lattice is searched both ways: lo and scale each move down in some rows and up in others,
        # a clipped row's lo up too (while it stays at or below −16)
        assert (steps_lo < 0).any() and (steps_lo > 0).any() and (steps_s < 0).any() and (steps_s > 0).any()
        assert (steps_lo[is_clipped] > 0).any()
    if kind == "confident":
        # a floor exactly at −16 is allowed (the entries it decodes stay out of the KLD sum, which
        # takes log-probs strictly above −16): the confident rows' shift is clamped right there
        assert (lo3[is_clipped] == KLD_BASE_FLOOR).any()


def test_without_a_lattice_the_floor_is_the_shift_rounded_and_the_scale_untouched(monkeypatch):
    # LO_ULPS = SCALE_ULPS = 0: lo is fp32(lo + δ), δ = −log1p(excess / mass) (float64 here), scale as llama.cpp's
    x = log_probs(4, 16)
    v2, plain = encoded(x, monkeypatch, lattice=False), llama_rows(x)
    (s2, lo2), (s0, lo0) = header(v2), header(plain)
    assert torch.equal(s2, s0)
    delta = -torch.log1p(mass_error(x, plain))  # −log1p(excess / mass) of llama.cpp's header
    want = (lo0.double() + delta).float()
    want = torch.where(clipped(x), want.clamp(max=KLD_BASE_FLOOR), want)
    # fp32 sums inside: at most one ulp of lo from the float64 shift
    assert ((lo2.double() - want.double()).abs() <= (torch.nextafter(want, torch.tensor(np.inf)) - want).double()).all()


def test_entries_exactly_at_the_floor_are_outside_the_mass():
    # The KLD sums base log-probs strictly above −16: moving entries from −17 to exactly −16 changes
    # their codes but not the mass the floor corrects, so the header is the same. Rows where that
    # would show: little mass above the floor (500 entries in −15.9..−14), 2,000 entries at −17 or
    # −16, a minimum of −20 (the range −20..−14, unclipped)
    g = torch.Generator().manual_seed(5)
    a = torch.full((8, V), -20.0)
    a[:, :500] = -15.9 + 1.9 * torch.rand(8, 500, generator=g)
    a[:, 0] = -14.0
    a[:, 500:2500] = -17.0
    b = a.clone()
    b[:, 500:2500] = KLD_BASE_FLOOR
    ra, rb = encoding.encode_rows(a), encoding.encode_rows(b)
    assert not np.array_equal(ra[:, 4:], rb[:, 4:])
    assert np.array_equal(ra[:, :4], rb[:, :4])


def test_a_minimum_exactly_16_nats_down_is_not_clipped(monkeypatch):
    # hi = 0 and min = −16 exactly (confident rows, shifted to a top of 0, everything below −16 raised
    # to it, one entry set to it): the range holds the whole row, so nothing is clamped, and the floor
    # rises above −16 where the mass shift is upward (a clipped row's could not)
    g = torch.Generator().manual_seed(6)
    lg = 2.0 * torch.randn(16, V, generator=g, dtype=torch.float64)
    lg[:, 0] += torch.linspace(8.0, 16.0, 16, dtype=torch.float64)
    x = torch.log_softmax(lg, -1).float()
    x = (x - x.amax(1, keepdim=True)).clamp(min=KLD_BASE_FLOOR)
    x[:, 7] = KLD_BASE_FLOOR
    assert (x.amin(1) == KLD_BASE_FLOOR).all() and (x.amax(1) == 0).all()
    _, lo3 = header(encoding.encode_rows(x))
    # measured: 7 of the 16 floors rise (by 1 to 11 ulps); clipped, none could
    assert (lo3 > KLD_BASE_FLOOR).sum() >= 4


def test_nothing_above_the_floor_leaves_the_header_as_llama_cpps():
    # no entry the KLD sums: no mass to correct, no move on the lattice (every j ties: the smallest)
    g = torch.Generator().manual_seed(7)
    x = KLD_BASE_FLOOR - torch.rand(4, V, generator=g)
    assert np.array_equal(encoding.encode_rows(x), llama_rows(x))
