"""kvarn.stats.metrics against hand computations (formulas of llama.cpp perplexity.cpp)."""

import math

import numpy as np
import pytest
import torch

from kvarn.stats import metrics

# The fast path and its whole-vocabulary reference both answer the hand-worked cases.
BOTH = pytest.mark.parametrize("token_metrics", [metrics.token_metrics, metrics.token_metrics_ref],
                               ids=["fast", "ref"])


@BOTH
def test_two_tokens_by_hand(token_metrics):
    base = torch.tensor([[0.8, 0.2], [0.1, 0.9]]).log()
    q = torch.tensor([[0.6, 0.4], [0.7, 0.3]]).log()
    m = token_metrics(q, base, torch.tensor([1, 1]))
    kld = [0.8 * math.log(0.8 / 0.6) + 0.2 * math.log(0.2 / 0.4),
           0.1 * math.log(0.1 / 0.7) + 0.9 * math.log(0.9 / 0.3)]
    np.testing.assert_allclose(m["kld"], kld, rtol=1e-6)
    np.testing.assert_allclose(m["nll"], [-math.log(0.4), -math.log(0.3)], rtol=1e-6)
    np.testing.assert_allclose(m["nll_base"], [-math.log(0.2), -math.log(0.9)], rtol=1e-6)
    np.testing.assert_allclose(m["dp"], [0.4 - 0.2, 0.3 - 0.9], atol=1e-7)
    assert m["same_top"].tolist() == [True, False]
    assert m["kld"].dtype == np.float64 and m["same_top"].dtype == bool


@BOTH
def test_kld_zero_for_identical_and_nonnegative(token_metrics):
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(40, 50, generator=g)
    base = torch.log_softmax(logits, -1)
    targets = torch.randint(0, 50, (40,), generator=g)
    same = token_metrics(base, base, targets)
    assert np.all(same["kld"] == 0)
    assert same["same_top"].all() and np.all(same["dp"] == 0)
    q = torch.log_softmax(logits + 0.5 * torch.randn(40, 50, generator=g), -1)
    m = token_metrics(q, base, targets)
    assert np.all(m["kld"] >= 0) and m["kld"].max() > 0
    # Logits in place of log-probs for Q are refused.
    with pytest.raises(ValueError, match="is not normalised"):
        token_metrics(q + 3.0, base, targets)


@BOTH
def test_base_entries_at_or_below_floor_left_out(token_metrics):
    # Entry 2's base log-prob is -20 (< -16): llama.cpp leaves it out of the sum.
    base = torch.tensor([[math.log(0.5), math.log(0.5), -20.0]], dtype=torch.float64)
    q = torch.tensor([[math.log(0.25), math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    m = token_metrics(q, base, torch.tensor([0]))
    assert m["kld"][0] == pytest.approx(0.5 * math.log(2.0), rel=1e-12)


@BOTH
def test_base_entry_exactly_at_floor_left_out_just_above_counted(token_metrics):
    # The floor is strict (ln p_base > −16): an entry at exactly −16.0 is left out, one a float64
    # ulp above counts. Both have Q's log-prob −40, so each would add e^−16·24 ≈ 2.7e-6 nats, and
    # the rest of the row adds ~e^−40: the KLD is that one term, never two.
    above = math.nextafter(metrics.KLD_BASE_FLOOR, 0.0)
    base = torch.tensor([[math.log(0.5), math.log(0.5), metrics.KLD_BASE_FLOOR, above]], dtype=torch.float64)
    q0 = math.log(0.5 - 2 * math.exp(-40.0))
    q = torch.tensor([[q0, math.log(0.5), -40.0, -40.0]], dtype=torch.float64)
    m = token_metrics(q, base, torch.tensor([0]))
    want = 0.5 * (math.log(0.5) - q0) + math.exp(above) * (above + 40.0)
    assert m["kld"][0] == pytest.approx(want, rel=1e-9)


def test_shape_mismatch():
    with pytest.raises(ValueError, match="shapes disagree"):
        metrics.token_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_path_matches_reference(dtype):
    """token_metrics (float64 only above the floor) against token_metrics_ref (the whole
    vocabulary in float64) on rows like a large model's: most of the vocabulary below the
    −16-nat floor, a few thousand entries above it, targets both likely and unlikely."""
    g = torch.Generator().manual_seed(3)
    n, V = 70, 30000  # 70 rows: more than one 64-row slice
    logits = 6 * torch.randn(n, V, generator=g, dtype=torch.float64)
    base = torch.log_softmax(logits, -1).float()
    q = torch.log_softmax(logits + 0.3 * torch.randn(n, V, generator=g, dtype=torch.float64), -1).to(dtype)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[::2] = base[::2].argmax(1)
    kept = (base > metrics.KLD_BASE_FLOOR).sum(1)
    assert 0 < int(kept.min()) and int(kept.max()) < V  # the floor filter is exercised
    fast, ref = metrics.token_metrics(q, base, targets), metrics.token_metrics_ref(q, base, targets)
    # Only the order of the float64 KLD sum differs: float64 noise, far below any KLD here.
    assert ref["kld"].min() > 1e-3
    np.testing.assert_allclose(fast["kld"], ref["kld"], rtol=1e-13, atol=0)
    for key in ("nll", "nll_base", "dp", "same_top"):
        assert np.array_equal(fast[key], ref[key]), key
    assert not fast["same_top"].all() and fast["same_top"].any()


def test_percentile_linear_interpolation():
    v = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    assert metrics.percentile(v, 0.9) == pytest.approx(0.4 * 4 + 0.6 * 10)  # at 3.6
    assert metrics.percentile(v, 0.5) == 3.0
    assert metrics.percentile(v, 0.1) == pytest.approx(1.4)  # at 0.4
    assert metrics.percentile(v, 0.0) == 1.0 and metrics.percentile(v, 1.0) == 10.0
    assert metrics.percentile(np.array([1.0, 2.0, 3.0, 4.0]), 0.5) == 2.5  # llama's even median


def _hand_vector():
    n = 12
    return {
        "nll": np.array([1.0, 3.0] * 6),
        "nll_base": np.array([1.0, 2.0] * 6),
        "kld": np.array([0.0, 1.0] * 6),
        "dp": np.array([0.1, -0.1, 0.3, -0.3] * 3),
        "same_top": np.array([True, True, True, False] * 3),
    }, n


def test_summarize_errors_by_hand():
    pt, n = _hand_vector()
    s = metrics.summarize(pt)
    r11 = math.sqrt(n - 1)
    assert s["n_tokens"] == 12
    # ln PPL(Q): mean 2, variance E[x²]−mean² = 5−4 = 1, error sqrt(1/11).
    assert s["ppl_q"] == pytest.approx(math.exp(2))
    assert s["ppl_q_err"] == pytest.approx(math.exp(2) / r11)
    # ln PPL(base): mean 1.5, variance 2.5−2.25 = 0.25.
    assert s["ppl_base"] == pytest.approx(math.exp(1.5))
    assert s["ppl_base_err"] == pytest.approx(math.exp(1.5) * 0.5 / r11)
    # cov of the means: (E[ab] − E[a]E[b])/(n−1) = (3.5 − 3)/11; correlation 1.
    cov = 0.5 / 11
    assert s["ppl_cor"] == pytest.approx(1.0)
    ln_err = math.sqrt(1 / 11 + 0.25 / 11 - 2 * cov)
    assert s["ln_ppl_ratio"] == pytest.approx(0.5)
    assert s["ln_ppl_ratio_err"] == pytest.approx(ln_err)
    assert s["ppl_ratio"] == pytest.approx(math.exp(0.5))
    assert s["ppl_ratio_err"] == pytest.approx(math.exp(0.5) * ln_err)
    pq, pb = math.exp(2), math.exp(1.5)
    assert s["ppl_diff"] == pytest.approx(pq - pb)
    assert s["ppl_diff_err"] == pytest.approx(
        math.sqrt((pq / r11) ** 2 + (pb * 0.5 / r11) ** 2 - 2 * pq * pb * cov))
    # KLD: mean 0.5, variance 0.25.
    assert s["kld_mean"] == pytest.approx(0.5)
    assert s["kld_mean_err"] == pytest.approx(0.5 / r11)
    assert (s["kld_max"], s["kld_min"], s["kld_median"]) == (1.0, 0.0, 0.5)
    assert s["kld_p90"] == 1.0 and s["kld_p10"] == 0.0
    # Δp: mean 0, variance (0.01+0.09)/2 = 0.05; sorted [-.3×3, -.1×3, .1×3, .3×3].
    assert s["dp_mean"] == pytest.approx(0.0, abs=1e-15)
    assert s["dp_mean_err"] == pytest.approx(math.sqrt(0.05 / 11))
    assert s["dp_median"] == pytest.approx(0.0, abs=1e-15)
    assert s["dp_p25"] == pytest.approx(0.25 * -0.3 + 0.75 * -0.1)  # at 2.75
    assert s["dp_p75"] == pytest.approx(0.75 * 0.1 + 0.25 * 0.3)  # at 8.25
    assert s["dp_max"] == 0.3 and s["dp_min"] == -0.3
    # RMS Δp: MSE 0.05; its error from Δp⁴: E = (1e-4 + 81e-4)/2 = 41e-4, var 16e-4.
    assert s["dp_rms"] == pytest.approx(math.sqrt(0.05))
    assert s["dp_rms_err"] == pytest.approx(0.5 / math.sqrt(0.05) * 0.04 / r11)
    # Same top: 9 of 12.
    assert s["same_top"] == 0.75
    assert s["same_top_err"] == pytest.approx(math.sqrt(0.75 * 0.25 / 11))


def test_summarize_small_n_has_no_error_and_contract_keys():
    pt, _ = _hand_vector()
    s = metrics.summarize({k: v[:8] for k, v in pt.items()})  # llama.cpp: no error at n <= 10
    assert s["kld_mean_err"] == 0.0 and s["ppl_q_err"] == 0.0
    keys = ("n_tokens ppl_q ppl_q_err ppl_base ppl_base_err ppl_ratio ppl_ratio_err ln_ppl_ratio "
            "ln_ppl_ratio_err ppl_cor kld_mean kld_mean_err kld_max kld_p99_9 kld_p99 kld_p95 "
            "kld_p90 kld_median kld_p10 kld_p05 kld_p01 kld_p00_1 kld_min dp_mean dp_mean_err "
            "dp_max dp_p99_9 dp_p99 dp_p95 dp_p90 dp_median dp_p10 dp_p05 dp_p01 dp_p00_1 dp_min "
            "dp_rms dp_rms_err same_top same_top_err").split()
    assert set(keys) <= set(s)


def test_summarize_polars_and_format_llama():
    import polars as pl  # pinned: a failing import fails the test
    pt, _ = _hand_vector()
    s = metrics.summarize(pl.DataFrame(pt))
    assert s == metrics.summarize(pt)
    text = metrics.format_llama(s)
    lines = text.splitlines()
    assert "====== KL divergence statistics ======" in lines
    assert f"Mean    KLD: {0.5:10.6f} ± {0.5 / math.sqrt(11):10.6f}" in lines
    assert "99.9%   KLD:   1.000000" in lines
    assert "Median  KLD:   0.500000" in lines
    assert " 0.1%   KLD:   0.000000" in lines
    assert "Cor(ln(PPL(Q)), ln(PPL(base))): 100.00%" in lines
    assert "Same top p: 75.000 ± 13.056 %" in lines
    assert "75.0%   Δp: 15.000%" in lines


def test_summarize_rejects_missing_columns():
    with pytest.raises(ValueError, match="same_top"):
        metrics.summarize({"kld": [1.0], "nll": [1.0], "nll_base": [1.0], "dp": [0.0]})


# ---------------------------------------------------------------- boundaries a mutation run found untested


def _distinct():
    """11 tokens whose extremes are unique (max/min read from the wrong end of the sort are seen),
    with small spreads (so every ± error is well below 1)."""
    return {
        "nll": np.array([1.00, 1.02, 1.04, 1.06, 1.08, 1.10, 1.12, 1.14, 1.16, 1.18, 1.20]),
        "nll_base": np.array([1.00, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08, 1.09, 1.11]),
        "kld": np.array([0.5, 0.0, 0.1, 0.2, 0.3, 0.4, 0.05, 0.15, 0.25, 0.35, 0.45]),
        "dp": np.array([0.02, -0.04, 0.01, -0.01, 0.0, 0.03, -0.02, 0.005, -0.005, 0.015, -0.015]),
        "same_top": np.array([True] * 8 + [False] * 3),
    }


def test_summarize_reads_the_unique_extremes_and_small_errors():
    pt = _distinct()
    s = metrics.summarize(pt)
    assert (s["kld_max"], s["kld_min"]) == (0.5, 0.0)
    assert (s["dp_max"], s["dp_min"]) == (0.03, -0.04)
    # PPL(Q) − PPL(base) and its error, from llama.cpp's formula by hand (every term < 1 here)
    a, b, n = pt["nll"], pt["nll_base"], 11
    mq, mb = a.mean(), b.mean()
    eq, eb = math.sqrt(a.var() / (n - 1)), math.sqrt(b.var() / (n - 1))
    cov = ((a * b).mean() - mq * mb) / (n - 1)
    pq, pb = math.exp(mq), math.exp(mb)
    want = math.sqrt(max((pq * eq) ** 2 + (pb * eb) ** 2 - 2 * pq * pb * cov, 0.0))
    assert want < 0.1 and s["ppl_diff_err"] == pytest.approx(want, rel=1e-9)


def test_mean_and_uncertainty_boundaries():
    mu = metrics.mean_and_uncertainty
    assert mu(0.0, 0.0, 0) == (0.0, 0.0)
    assert mu(2.0, 4.0, 1) == (2.0, 0.0)  # one value: its mean, no error
    x = np.arange(10.0)
    assert mu(x.sum(), (x * x).sum(), 10) == (4.5, 0.0)  # llama.cpp: no error at n <= 10
    x = np.arange(11.0)
    f, e = mu(x.sum(), (x * x).sum(), 11)
    assert f == 5.0 and e == pytest.approx(math.sqrt(x.var() / 10))


def test_covariance_starts_at_ten_values():
    a = np.arange(10.0)
    assert metrics.covariance(a.sum(), a.sum(), (a * a).sum(), 10) == pytest.approx((28.5 - 4.5 * 4.5) / 9)
    a = np.arange(9.0)
    assert metrics.covariance(a.sum(), a.sum(), (a * a).sum(), 9) == 0.0


def test_same_top_and_rms_errors_at_their_edges():
    one = {k: v[:1] for k, v in _distinct().items()}
    s = metrics.summarize(one)  # one token: no error anywhere, no division by n − 1
    assert s["same_top_err"] == 0.0 and s["same_top"] == 1.0
    two = {k: v[:2] for k, v in _distinct().items()}
    two["same_top"] = np.array([True, False])
    assert metrics.summarize(two)["same_top_err"] == pytest.approx(0.5)  # sqrt(0.5 · 0.5 / 1)
    flat = {**_distinct(), "dp": np.zeros(11)}
    s = metrics.summarize(flat)
    assert s["dp_rms"] == 0.0 and s["dp_rms_err"] == 0.0


def test_columns_are_read_in_float64_and_of_one_length():
    import polars as pl

    pt = _distinct()
    f32 = pl.DataFrame({k: (v.astype(np.float32) if v.dtype != bool else v) for k, v in pt.items()})
    as64 = {k: (v.astype(np.float32).astype(np.float64) if v.dtype != bool else v) for k, v in pt.items()}
    assert metrics.summarize(f32) == metrics.summarize(as64)  # float32 columns summed in float64
    with pytest.raises(ValueError, match=r"one length, got \[10, 11\]"):
        metrics.summarize({**pt, "dp": pt["dp"][:10]})
    with pytest.raises(ValueError, match=r"non-empty and of one length, got \[0\]"):
        metrics.summarize({k: v[:0] for k, v in pt.items()})


def test_format_llama_prints_llama_perplexity_s_own_format_strings():
    """Every line of the block, against the printf formats of tools/perplexity/perplexity.cpp
    (llama-cpp-python 0.3.36), applied here with Python's % operator to the same numbers."""
    s = metrics.summarize(_distinct())
    want = [
        "====== Perplexity statistics ======",
        "Mean PPL(Q)                   : %10.6f ± %10.6f" % (s["ppl_q"], s["ppl_q_err"]),
        "Mean PPL(base)                : %10.6f ± %10.6f" % (s["ppl_base"], s["ppl_base_err"]),
        "Cor(ln(PPL(Q)), ln(PPL(base))): %6.2f%%" % (100.0 * s["ppl_cor"]),
        "Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f" % (s["ln_ppl_ratio"], s["ln_ppl_ratio_err"]),
        "Mean PPL(Q)/PPL(base)         : %10.6f ± %10.6f" % (s["ppl_ratio"], s["ppl_ratio_err"]),
        "Mean PPL(Q)-PPL(base)         : %10.6f ± %10.6f" % (s["ppl_diff"], s["ppl_diff_err"]),
        "",
        "====== KL divergence statistics ======",
        "Mean    KLD: %10.6f ± %10.6f" % (s["kld_mean"], s["kld_mean_err"]),
        "Maximum KLD: %10.6f" % s["kld_max"],
        "99.9%%   KLD: %10.6f" % s["kld_p99_9"], "99.0%%   KLD: %10.6f" % s["kld_p99"],
        "95.0%%   KLD: %10.6f" % s["kld_p95"], "90.0%%   KLD: %10.6f" % s["kld_p90"],
        "Median  KLD: %10.6f" % s["kld_median"], "10.0%%   KLD: %10.6f" % s["kld_p10"],
        " 5.0%%   KLD: %10.6f" % s["kld_p05"], " 1.0%%   KLD: %10.6f" % s["kld_p01"],
        " 0.1%%   KLD: %10.6f" % s["kld_p00_1"], "Minimum KLD: %10.6f" % s["kld_min"],
        "",
        "====== Token probability statistics ======",
        "Mean    Δp: %6.3f ± %5.3f %%" % (100.0 * s["dp_mean"], 100.0 * s["dp_mean_err"]),
        "Maximum Δp: %6.3f%%" % (100.0 * s["dp_max"]),
        "99.9%%   Δp: %6.3f%%" % (100.0 * s["dp_p99_9"]), "99.0%%   Δp: %6.3f%%" % (100.0 * s["dp_p99"]),
        "95.0%%   Δp: %6.3f%%" % (100.0 * s["dp_p95"]), "90.0%%   Δp: %6.3f%%" % (100.0 * s["dp_p90"]),
        "75.0%%   Δp: %6.3f%%" % (100.0 * s["dp_p75"]), "Median  Δp: %6.3f%%" % (100.0 * s["dp_median"]),
        "25.0%%   Δp: %6.3f%%" % (100.0 * s["dp_p25"]), "10.0%%   Δp: %6.3f%%" % (100.0 * s["dp_p10"]),
        " 5.0%%   Δp: %6.3f%%" % (100.0 * s["dp_p05"]), " 1.0%%   Δp: %6.3f%%" % (100.0 * s["dp_p01"]),
        " 0.1%%   Δp: %6.3f%%" % (100.0 * s["dp_p00_1"]), "Minimum Δp: %6.3f%%" % (100.0 * s["dp_min"]),
        "RMS Δp    : %6.3f ± %5.3f %%" % (100.0 * s["dp_rms"], 100.0 * s["dp_rms_err"]),
        "Same top p: %6.3f ± %5.3f %%" % (100.0 * s["same_top"], 100.0 * s["same_top_err"]),
    ]
    assert metrics.format_llama(s).splitlines() == want
    no_diff = {k: v for k, v in s.items() if k not in ("ppl_diff", "ppl_diff_err")}
    assert metrics.format_llama(no_diff).splitlines() == want[:6] + want[7:]  # the line is an extra of ours


def test_rounding_below_zero_variance_gives_no_error():
    """Eleven equal values whose Σx²/n − mean² rounds below zero (0.7 in binary): error 0, not a math error."""
    x = np.full(11, 0.7)
    s, s2 = float(x.sum()), float((x * x).sum())
    assert s2 / 11 - (s / 11) ** 2 < 0  # the case under test
    assert metrics.mean_and_uncertainty(s, s2, 11)[1] == 0.0


def test_columns_of_shape_n_by_1_are_flattened():
    pt = _distinct()
    col = {k: v.reshape(-1, 1) for k, v in pt.items()}
    assert metrics.summarize(col) == metrics.summarize(pt)


def test_format_llama_of_a_summary_without_the_extra_quartiles():
    """Summaries written before dp_p75/dp_p25 existed print every other line of the block."""
    s = metrics.summarize(_distinct())
    old = {k: v for k, v in s.items() if k not in ("dp_p75", "dp_p25")}
    lines = metrics.format_llama(old).splitlines()
    assert not any(ln.startswith(("75.0%   Δp", "25.0%   Δp")) for ln in lines)
    for label in ("Median  Δp", "10.0%   Δp", " 0.1%   Δp", "Minimum Δp", "Same top p"):
        assert any(ln.startswith(label) for ln in lines), label


@BOTH
def test_unnormalised_rows_are_refused_naming_the_row(token_metrics):
    """A row of logits (logsumexp 0.5, not 0) past the first slice is named by its own index."""
    torch.manual_seed(0)
    q = torch.log_softmax(torch.randn(70, 5), dim=-1)
    q[66] += 0.5
    base = torch.log_softmax(torch.randn(70, 5), dim=-1)
    with pytest.raises(ValueError, match=r"^logp_q row 66 is not normalised \(logsumexp 0\.5\); pass log-probabilities "
                                         r"\(torch\.log_softmax of the logits\), not logits$"):
        token_metrics(q, base, torch.zeros(70, dtype=torch.long))


@BOTH
def test_targets_of_any_integer_dtype_and_more_rows_than_vocabulary(token_metrics):
    torch.manual_seed(1)
    q = torch.log_softmax(torch.randn(40, 8), dim=-1)
    base = torch.log_softmax(torch.randn(40, 8), dim=-1)
    t64 = torch.randint(0, 8, (40,))
    ref = metrics.token_metrics_ref(q.double(), base.double(), t64)
    # int32, uint8 (a small vocabulary's ids as stored) and int16 targets; 40 rows > 8 entries
    for dtype in (np.int32, np.uint8, np.int16):
        got = token_metrics(q, base, t64.numpy().astype(dtype))
        for k in ("nll", "nll_base", "dp"):
            assert np.allclose(got[k], ref[k], rtol=1e-6, atol=1e-7), (k, dtype)
        assert np.allclose(got["kld"], ref["kld"], rtol=1e-5, atol=1e-7)
        assert (got["same_top"] == ref["same_top"]).all()
