"""kvarn.retrieval's statistics of issue 53, item 4: per cell the exact binomial test of its flips
against the exact cache with an exact interval on the flip rate, and Holm's adjustment across the
tests a (model, context) shows. Expectations from scipy (binomtest; the Clopper–Pearson interval
from the beta quantiles), from the binomial sum written out, and from Holm's definition by hand."""

from __future__ import annotations

import math

import polars as pl
import pytest
from scipy.stats import beta, binomtest

from kvarn.retrieval import score

pytestmark = pytest.mark.xdist_group("retrieval")


@pytest.mark.parametrize("lost,gained,n", [(3, 0, 9), (5, 1, 40), (0, 0, 12), (2, 2, 7), (0, 4, 10), (9, 0, 9)])
def test_flip_test_against_scipy(lost, gained, n):
    t = score.flip_test(lost, gained, n)
    f = lost + gained
    assert t["rate"] == f / n
    # Clopper-Pearson from the beta quantiles (0 and 1 at the ends)
    lo = 0.0 if f == 0 else beta.ppf(0.025, f, n - f + 1)
    hi = 1.0 if f == n else beta.ppf(0.975, f + 1, n - f)
    assert (t["lo"], t["hi"]) == pytest.approx((lo, hi), abs=1e-9)
    # two-sided exact binomial on the discordant pairs: 2 * P(X <= min(lost, gained)), capped at 1
    by_hand = 1.0 if f == 0 else min(1.0, 2 * sum(math.comb(f, k) for k in range(min(lost, gained) + 1)) / 2 ** f)
    if lost != gained:
        assert t["p"] == pytest.approx(by_hand, abs=1e-12)
    assert t["p"] == pytest.approx(1.0 if f == 0 else binomtest(lost, f, 0.5).pvalue, abs=1e-12)
    with pytest.raises(ValueError, match="lost \\+ gained must be in 0..3"):
        score.flip_test(3, 1, 3)


def _holm_by_definition(p):
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    out = [0.0] * m
    for rank, i in enumerate(order):
        out[i] = max(min(1.0, (m - j) * p[order[j]]) for j in range(rank + 1))
    return out


def test_holm_by_hand():
    assert score.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    for p in ([0.2, 0.5, 0.01], [0.001, 0.001, 0.9, 0.04, 0.3], [1.0], [0.6, 0.6]):
        assert score.holm(p) == pytest.approx(_holm_by_definition(p))
    got = score.holm([0.01, math.nan, 0.02])  # a NaN is no test: the family is the other two
    assert got[0] == pytest.approx(0.02) and math.isnan(got[1]) and got[2] == pytest.approx(0.02)


def test_the_flip_columns_and_holm_across_the_shown_tests():
    base, q4, kv, q2 = score.BASELINE_CELL, "q4_0-q4_0-t128", "kvarn4-kvarn4-t0", "q2_0-q2_0-t128"
    ids = [str(i) for i in range(8)]
    rows = [(base, i, True) for i in ids] + [(q4, i, i not in "012") for i in ids] + \
           [(kv, i, True) for i in ids] + [(q2, i, i not in "0123456") for i in ids]
    df = pl.DataFrame([{"model": "m", "context": 64, "id": i, "cell": c, "given": "1" if ok else "0",
                        "correct": ok} for c, i, ok in rows])
    s = {r["cell"]: r for r in score.cell_scores(df).iter_rows(named=True)}
    assert (s[q4]["lost"], s[q4]["flips"], s[q4]["flip_rate"]) == (3, 3, 3 / 8)
    assert s[q4]["p_flips"] == pytest.approx(binomtest(3, 3, 0.5).pvalue) == 0.25
    assert s[q2]["p_flips"] == pytest.approx(2 / 2 ** 7) and s[kv]["p_flips"] == 1.0
    comps = score.comparisons(df)  # kvarn4 vs q4_0 t128: 3 discordant, all one way
    assert comps["p"].to_list() == [pytest.approx(0.25)]
    s2, c2 = score.with_holm(score.cell_scores(df), comps)
    family = [s[kv]["p_flips"], s[q2]["p_flips"], s[q4]["p_flips"], 0.25]  # cells in the frame's order, then the pair
    want = score.holm(family)
    got = {r["cell"]: r["p_holm"] for r in s2.iter_rows(named=True)}
    assert got[base] is None
    assert [got[kv], got[q2], got[q4], c2["p_holm"][0]] == pytest.approx(want)
    assert got[q2] == pytest.approx(4 * 2 / 2 ** 7) and got[q4] == pytest.approx(0.75)


def test_the_report_states_significance_after_holm(tmp_path):
    import json
    from pathlib import Path

    from kvarn.retrieval import plan, report

    rows = []
    for cell, right in ((score.BASELINE_CELL, 8), ("q2_0-q2_0-t128", 1), ("q4_0-q4_0-t128", 7)):
        for i in range(8):
            rows.append({"model": "m", "context": 64, "task": "passkey", "id": str(i), "depth": 0.5, "depth_index": 0,
                         "prompt_index": 0, "cell": cell, "answer": "12345", "given": "", "correct": None,
                         "text": " 12345." if i < right else " 99999.", "needle_start": 20, "needle_end": 30,
                         "n_prompt": 56, "gen_tokens": 8, "distance": 26, "wall_s": 1.0})
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outs = {k: str(tmp_path / "out" / Path(v).name) for k, v in plan.report_files().items()}
    report.write_report([path], outs, teacher_forced=str(tmp_path / "none.parquet"))
    # q2_0: 7 lost, 0 gained, p = 2/128; q4_0: 1 lost, p = 1; Holm over the two: 4/128 and 1
    text = Path(outs["paragraph"]).read_text()
    assert ("After Holm's adjustment across the 2 tests shown (each cell against the exact cache: its flips, exact "
            "binomial, and its Δ log p, Wilcoxon signed-rank; each pair of formats: McNemar and Wilcoxon), significant "
            "at 5 %: q2_0 t128 vs the exact cache, flips (lost 7, gained 0, p 0.0312). Not significant: q4_0 t128 vs "
            "the exact cache, flips (lost 1, gained 0, p 1).") in text
    assert "Caveat: m are small models at short contexts (64 tokens)" in text
    s = pl.read_parquet(outs["scores"]).filter(pl.col("cell") == "q2_0-q2_0-t128").row(0, named=True)
    assert s["p_holm"] == pytest.approx(4 / 128) and s["p_flips"] == pytest.approx(2 / 128)
    assert "| q2_0 t128 | 0.12 | " in Path(outs["md"]).read_text()


def test_kendall_tau_and_its_bootstrap_interval():
    import numpy as np
    from scipy.stats import kendalltau

    kld = [0.1, 0.2, 0.3, 0.4]
    same = [[1, 1, 0, 0]] * 6  # every prompt the same: every resample has the same accuracies
    t = score.tau_bootstrap(same, kld)
    want = kendalltau([-1, -1, 0, 0], kld).statistic
    assert (t["tau"], t["lo"], t["hi"], t["defined"]) == (pytest.approx(want), pytest.approx(want),
                                                          pytest.approx(want), score.TAU_RESAMPLES)
    # a mixed case against the bootstrap written out: the same draws, tau-b of each, percentiles
    g = np.random.default_rng(5)
    x = g.random((30, 4)) < np.array([0.9, 0.7, 0.6, 0.3])
    t = score.tau_bootstrap(x, kld, resamples=1000, seed=3)
    idx = np.random.default_rng(3).integers(0, 30, size=(1000, 30))
    taus = [kendalltau(-x[i].mean(axis=0), kld).statistic for i in idx]
    taus = np.array([v for v, i in zip(taus, idx) if np.ptp(x[i].mean(axis=0)) > 0])
    assert t["tau"] == pytest.approx(kendalltau(-x.mean(axis=0), kld).statistic)
    assert (t["lo"], t["hi"]) == pytest.approx(tuple(np.quantile(taus, [0.025, 0.975])))
    assert t["defined"] == len(taus) and t["lo"] <= t["tau"] <= t["hi"]
    assert math.isnan(score.tau_bootstrap([[1, 0]], [0.1, 0.2])["tau"])  # fewer than 3 cells


def test_the_ordering_note_carries_the_tau_interval(tmp_path):
    from kvarn.retrieval import report

    cells = ["q4_0-q4_0-t128", "kvarn4-kvarn4-t0", "q2_0-q2_0-t128"]
    pl.DataFrame({"model": ["m"] * 3, "cell": cells, "n_ctx": [2048] * 3, "chunks": [1] * 3,
                  "kld_median": [0.002, 0.001, 0.05]}).write_parquet(tmp_path / "summary.parquet")
    right = {score.BASELINE_CELL: 6, cells[0]: 5, cells[1]: 6, cells[2]: 2}
    df = pl.DataFrame([{"model": "m", "context": 64, "id": str(i), "cell": c, "given": "1" if i < k else "0",
                        "correct": i < k} for c, k in right.items() for i in range(6)])
    s = score.cell_scores(df)
    order, notes = report.ordering(s, str(tmp_path / "summary.parquet"), df)
    # accuracies 5/6, 6/6, 2/6 against KLD 0.002, 0.001, 0.05: the same order, tau +1
    assert "Kendall's tau (accuracy vs median KLD) +1.00 [" in notes[("m", 64)]
    assert "95 % bootstrap over the 6 prompts" in notes[("m", 64)]
    assert order["tau"].to_list() == [1.0] * 3 and order["tau_hi"][0] == pytest.approx(1.0)


def test_signed_rank_p_by_hand():
    # all five differences positive: of the 2^5 sign patterns only one has W- = 0; two-sided 2/32
    assert score.signed_rank_p([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 32)
    # one negative of rank 1: T = min(W+, W-) = 1; P(T <= 1) = 2/32 (W- = 0 or the rank-1 sign); two-sided 4/32
    assert score.signed_rank_p([-1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(4 / 32)
    assert score.signed_rank_p([0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 32)  # zeros do not count
    assert score.signed_rank_p([0.0, 0.0]) == 1.0
    assert math.isnan(score.signed_rank_p([]))


def test_holm_family_includes_the_continuous_tests():
    b = score.BASELINE_CELL
    scores = pl.DataFrame({"model": ["m"] * 3, "context": [64] * 3, "cell": [b, "q4_0-q4_0-t128", "kvarn4-kvarn4-t0"],
                           "p_flips": [None, 0.04, 0.5]})
    comps = pl.DataFrame({"model": ["m"], "context": [64], "p": [0.3], "p_dlogprob": [0.001]})
    paired = pl.DataFrame({"model": ["m"] * 2, "context": [64] * 2, "cell": ["q4_0-q4_0-t128", "kvarn4-kvarn4-t0"],
                           "p_dlogprob": [0.002, 0.02]})
    s, c, q = score.with_holm(scores, comps, paired)
    # six tests: sorted 0.001, 0.002, 0.02, 0.04, 0.3, 0.5 -> x6, x5, x4, x3, x2, x1, running max
    assert c["p_dlogprob_holm"][0] == pytest.approx(0.006)
    assert q["p_holm"].to_list() == pytest.approx([0.010, 0.08])
    assert s["p_holm"].to_list()[1:] == pytest.approx([0.12, 0.6])
    assert s["p_holm"][0] is None and c["p_holm"][0] == pytest.approx(0.6)
    # without the continuous tests the family is the flips and McNemar only (three tests)
    s2, c2 = score.with_holm(scores, comps)
    assert s2["p_holm"].to_list()[1:] == pytest.approx([0.12, 0.6]) and c2["p_holm"][0] == pytest.approx(0.6)
