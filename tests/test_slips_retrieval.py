"""A user's doubts about the retrieval tables and the bits-per-value column: is the interval
Wilson's at 95 %, is McNemar's b "A right, B wrong", is a lost answer one the baseline got right,
is a needle at distance 128 in the 128 bin, is q8_0 8.5 bits per value?

Expectations worked out by hand (closed forms, binomial sums); each test seen red against the slip
docs/notes/slips.md names."""

from __future__ import annotations

import math

import polars as pl
import pytest
from scipy.stats import norm

from kvarn.retrieval import score as S


def _wilson(k, n):
    """Wilson's centre (p̂ + z²/2n)/(1 + z²/n) ± z/(1 + z²/n)·sqrt(p̂(1 − p̂)/n + z²/4n²), z = Φ⁻¹(0.975)."""
    z = norm.ppf(0.975)
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return c - h, c + h


def test_wilson_is_the_closed_form_at_95_percent():
    lo, hi = S.wilson(3, 10)
    want = _wilson(3, 10)
    assert (lo, hi) == (pytest.approx(want[0], abs=1e-12), pytest.approx(want[1], abs=1e-12))
    assert (round(lo, 4), round(hi, 4)) == (0.1078, 0.6032)


def test_mcnemar_counts_a_right_b_wrong_first_and_the_exact_two_sided_p():
    # A right & B wrong on 3 prompts, A wrong & B right on 1, 2 concordant.
    # Exact two-sided p on 4 discordant pairs, Bin(4, 1/2): P(X ≤ 1) + P(X ≥ 3) = (1 + 4 + 4 + 1)/16
    a = [1, 1, 1, 1, 0, 0]
    b = [0, 0, 0, 1, 1, 0]
    t = S.mcnemar(a, b)
    assert (t["n"], t["a_only"], t["b_only"]) == (6, 3, 1)
    assert t["p"] == pytest.approx(10 / 16, abs=1e-12)
    # 6 to 0: (1 + 1)/64
    t = S.mcnemar([1] * 6 + [0], [0] * 6 + [0])
    assert (t["a_only"], t["b_only"], t["p"]) == (6, 0, pytest.approx(2 / 64, abs=1e-12))


def _answers(rows):
    return pl.DataFrame([{"model": "m", "id": i, "cell": c, "given": g, "correct": ok} for c, i, g, ok in rows])


def test_cell_scores_lost_is_baseline_right_and_cell_wrong():
    # baseline right on 1, 2, 3, wrong on 4 and 5; the cell right on 1 and 5, wrong on 2, 3, 4
    # (on 4 with the baseline's own wrong answer): lost 2 (ids 2, 3; not 4), gained 1 (id 5),
    # agreeing answers 2 (ids 1, 4), accuracy 2/5 with Wilson's interval of 2 in 5
    base, cell = S.BASELINE_CELL, "q4_0-q4_0-t0"
    rows = [(base, 1, "11", True), (base, 2, "22", True), (base, 3, "33", True), (base, 4, "7", False),
            (base, 5, "8", False),
            (cell, 1, "11", True), (cell, 2, "9", False), (cell, 3, "8", False), (cell, 4, "7", False),
            (cell, 5, "55", True)]
    r = S.cell_scores(_answers(rows)).filter(pl.col("cell") == cell).row(0, named=True)
    assert (r["n"], r["correct"], r["lost"], r["gained"], r["agree"]) == (5, 2, 2, 1, 2)
    assert r["accuracy"] == 0.4 and r["agreement"] == 0.4
    lo, hi = _wilson(2, 5)
    assert (r["acc_lo"], r["acc_hi"]) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))


def test_distance_bins_are_closed_below_and_open_above():
    # distances 127 and 128: the first in 0–127, the second in 128–511; 512 in 512–2047
    df = pl.DataFrame({"model": ["m"] * 3, "cell": ["q4_0-q4_0-t0"] * 3, "distance": [127, 128, 512],
                       "correct": [True, False, True]})
    got = {r["bin"]: (r["n"], r["correct"]) for r in S.by_distance(df).iter_rows(named=True)}
    assert got == {"0–127": (1, 1), "128–511": (1, 0), "512–2047": (1, 1)}


def test_in_exact_tail_reads_from_the_last_answering_query():
    # kvarn4 at request 0: an effective tail of 128. 200 prompt tokens, 4 generated: the last query
    # that answers sits at 200 + 4 − 2 = 202; a needle from 75 is 127 back (in), from 74 is 128 back (out).
    assert S.in_exact_tail("kvarn4-kvarn4-t0", 75, 200, 4)
    assert not S.in_exact_tail("kvarn4-kvarn4-t0", 74, 200, 4)
    # a standard q4_0 with tail 16: 202 − 187 = 15 < 16 in, 202 − 186 = 16 out
    assert S.in_exact_tail("q4_0-q4_0-t16", 187, 200, 4)
    assert not S.in_exact_tail("q4_0-q4_0-t16", 186, 200, 4)


def test_bits_per_value_is_16_times_the_byte_ratio():
    from kvarn.budget.memory import bits_per_value

    # q8_0: 34 bytes per 32 values (32 codes and an f16 scale) against bf16's 64 → 16 · 34/64 = 8.5
    assert bits_per_value(34 * 1000, 64 * 1000) == 8.5
    # q4_0: 18 bytes per 32 values → 4.5
    assert bits_per_value(18, 64) == 4.5
