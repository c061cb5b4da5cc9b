"""A user's doubts about the statistics, one at a time: is the KLD taken in the right direction,
in nats; is the 99th percentile llama.cpp's; is the ± error the standard error; is the paired
interval of B − A really paired, and of the median?

Each expectation is worked out here by hand or with numpy / scipy written in the test, never by
calling the code under test; each test was seen to fail against the slip docs/notes/slips.md names.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvarn.stats import metrics as M
from kvarn.stats import paired as P


def _logp(rows) -> torch.Tensor:
    return torch.log(torch.tensor(rows, dtype=torch.float64))


# ---------------------------------------------------------------- per-token numbers


@pytest.mark.parametrize("fn", [M.token_metrics, M.token_metrics_ref])
def test_kld_is_base_to_q_in_nats_and_dp_is_q_minus_base(fn):
    # base p = (0.9, 0.1), Q p = (0.4, 0.6), true token 0:
    # KL(base || Q) = 0.9 ln(0.9/0.4) + 0.1 ln(0.1/0.6); KL(Q || base) or log2 would differ
    out = fn(_logp([[0.4, 0.6]]), _logp([[0.9, 0.1]]), [0])
    want = 0.9 * math.log(0.9 / 0.4) + 0.1 * math.log(0.1 / 0.6)  # 0.550671...
    assert out["kld"][0] == pytest.approx(want, abs=1e-12)
    assert out["nll"][0] == pytest.approx(-math.log(0.4), abs=1e-12)
    assert out["nll_base"][0] == pytest.approx(-math.log(0.9), abs=1e-12)
    assert out["dp"][0] == pytest.approx(0.4 - 0.9, abs=1e-12)  # p_Q(true) − p_base(true) < 0
    assert not out["same_top"][0]  # argmax 1 against argmax 0


@pytest.mark.parametrize("fn", [M.token_metrics, M.token_metrics_ref])
def test_the_floor_leaves_out_base_entries_at_or_below_minus_16_only(fn):
    # row 0: base entry 2 exactly at -16 is left out: KLD = 2 · 0.5 ln(0.5/0.25) = ln 2
    # row 1: base entry 2 at -15.9 counts: ln 2 + e^-15.9 (-15.9 − ln 0.5)
    q = _logp([[0.25, 0.25, 0.5], [0.25, 0.25, 0.5]])
    base = torch.tensor([[math.log(0.5), math.log(0.5), -16.0], [math.log(0.5), math.log(0.5), -15.9]],
                        dtype=torch.float64)
    out = fn(q, base, [0, 0])
    assert out["kld"][0] == pytest.approx(math.log(2), abs=1e-12)
    assert out["kld"][1] == pytest.approx(math.log(2) + math.exp(-15.9) * (-15.9 - math.log(0.5)), abs=1e-12)


def test_fast_path_kld_of_many_slices_against_numpy():
    # 150 rows: three slices of the fast path (64 rows each), some base entries below the floor
    rng = np.random.default_rng(7)
    n, v = 150, 40
    lq = rng.normal(0, 3, (n, v))
    lq -= np.log(np.exp(lq).sum(1, keepdims=True))
    lb = rng.normal(0, 6, (n, v))
    lb -= np.log(np.exp(lb).sum(1, keepdims=True))
    t = rng.integers(0, v, n)
    out = M.token_metrics(torch.tensor(lq), torch.tensor(lb), torch.tensor(t))
    keep = lb > -16.0
    want = np.where(keep, np.exp(lb) * (lb - lq), 0.0).sum(1)
    assert (~keep).any() and keep.any()
    np.testing.assert_allclose(out["kld"], want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(out["dp"], np.exp(lq[np.arange(n), t]) - np.exp(lb[np.arange(n), t]), atol=1e-12)
    np.testing.assert_array_equal(out["same_top"], lq.argmax(1) == lb.argmax(1))


# ---------------------------------------------------------------- the summary


def _per_token(kld=None, dp=None, nll=None, nll_base=None, same_top=None, n=None):
    n = n or len(next(x for x in (kld, dp, nll, nll_base, same_top) if x is not None))
    z = np.zeros(n)
    return {"kld": z if kld is None else np.asarray(kld, float), "dp": z if dp is None else np.asarray(dp, float),
            "nll": z + 1 if nll is None else np.asarray(nll, float),
            "nll_base": z + 1 if nll_base is None else np.asarray(nll_base, float),
            "same_top": np.ones(n, bool) if same_top is None else np.asarray(same_top, bool)}


def test_kld_percentiles_are_llamacpps_linear_interpolation_at_f_times_n_minus_1():
    # KLD = i² for i = 0..11, given shuffled. Position f·(n − 1) = 11 f, linear between neighbours:
    # p99: 10.89 → 100 + 0.89·21; p95: 10.45 → 100 + 0.45·21; p90: 9.9 → 81 + 0.9·19;
    # median: 5.5 → (25 + 36)/2; p10: 1.1 → 1 + 0.1·3; p05: 0.55; p01: 0.11; p00_1: 0.011
    kld = np.array([i * i for i in range(12)], float)
    s = M.summarize(_per_token(kld=np.random.default_rng(0).permutation(kld)))
    want = {"kld_max": 121.0, "kld_p99_9": 100 + 0.989 * 21, "kld_p99": 118.69, "kld_p95": 109.45,
            "kld_p90": 98.1, "kld_median": 30.5, "kld_p10": 1.3, "kld_p05": 0.55, "kld_p01": 0.11,
            "kld_p00_1": 0.011, "kld_min": 0.0}
    for k, v in want.items():
        assert s[k] == pytest.approx(v, abs=1e-9), k


def test_dp_quartiles_and_tails_in_their_places():
    # Δp = i²/1000 − 0.05, i = 0..11: p75 at 8.25 → (64 + 0.25·17)/1000 − 0.05; p25 at 2.75 → (4 + 0.75·5)/1000 − 0.05
    dp = np.array([i * i / 1000 - 0.05 for i in range(12)])
    s = M.summarize(_per_token(dp=dp[::-1]))
    assert s["dp_p75"] == pytest.approx(0.06825 - 0.05, abs=1e-12)
    assert s["dp_p25"] == pytest.approx(0.00775 - 0.05, abs=1e-12)
    assert s["dp_median"] == pytest.approx(0.0305 - 0.05, abs=1e-12)
    assert s["dp_p99"] == pytest.approx(0.11869 - 0.05, abs=1e-12)
    assert s["dp_p01"] == pytest.approx(0.00011 - 0.05, abs=1e-12)
    assert (s["dp_max"], s["dp_min"]) == (pytest.approx(0.071), pytest.approx(-0.05))


def test_mean_error_is_the_standard_error_with_n_minus_1_and_none_at_10_tokens():
    # KLD 0..10: mean 5, Σx²/n − mean² = 385/11 − 25 = 10, error sqrt(10 / (11 − 1)) = 1
    s = M.summarize(_per_token(kld=np.arange(11.0)))
    assert s["kld_mean"] == pytest.approx(5.0, abs=1e-12)
    assert s["kld_mean_err"] == pytest.approx(1.0, abs=1e-12)
    # 10 tokens: llama.cpp prints no error (n > 10 needed)
    assert M.summarize(_per_token(kld=np.arange(10.0)))["kld_mean_err"] == 0.0


def test_perplexities_their_ratio_and_correlation_against_numpy():
    rng = np.random.default_rng(3)
    nllb = rng.gamma(2.0, 1.0, 400)
    nll = 0.8 * nllb + rng.gamma(1.0, 0.5, 400)  # correlated, Q worse on average
    s = M.summarize(_per_token(nll=nll, nll_base=nllb))
    n = len(nll)
    ppl_q, ppl_b = np.exp(nll.mean()), np.exp(nllb.mean())  # exp of the mean NLL, not mean of exp
    se = lambda x: x.std() / math.sqrt(n - 1)  # noqa: E731 — llama.cpp: population sd / sqrt(n − 1)
    assert s["ppl_q"] == pytest.approx(ppl_q, rel=1e-12)
    assert s["ppl_base"] == pytest.approx(ppl_b, rel=1e-12)
    assert s["ppl_q_err"] == pytest.approx(ppl_q * se(nll), rel=1e-9)
    assert s["ln_ppl_ratio"] == pytest.approx(nll.mean() - nllb.mean(), rel=1e-12)  # Q over base
    assert s["ln_ppl_ratio"] > 0
    # the ratio's error is the paired one: the standard error of the per-token difference
    assert s["ln_ppl_ratio_err"] == pytest.approx(se(nll - nllb), rel=1e-9)
    assert s["ppl_ratio"] == pytest.approx(ppl_q / ppl_b, rel=1e-12)
    assert s["ppl_ratio_err"] == pytest.approx(ppl_q / ppl_b * se(nll - nllb), rel=1e-9)
    assert s["ppl_cor"] == pytest.approx(np.corrcoef(nll, nllb)[0, 1], rel=1e-9)
    assert s["ppl_diff"] == pytest.approx(ppl_q - ppl_b, rel=1e-12)
    assert s["ppl_diff_err"] == pytest.approx(se(ppl_q * nll - ppl_b * nllb), rel=1e-9)  # delta method, paired


def test_rms_dp_is_root_mean_square_not_sd_and_same_top_error():
    # Δp with a mean far from 0: RMS ≠ SD. 15 of 20 tokens share the top: p 0.75, error sqrt(p(1 − p)/19)
    rng = np.random.default_rng(5)
    dp = 0.1 + rng.normal(0, 0.02, 20)
    top = np.array([1] * 15 + [0] * 5, bool)
    s = M.summarize(_per_token(dp=dp, same_top=rng.permutation(top)))
    assert s["dp_mean"] == pytest.approx(dp.mean(), rel=1e-12)
    assert s["dp_mean_err"] == pytest.approx(dp.std() / math.sqrt(19), rel=1e-9)
    assert s["dp_rms"] == pytest.approx(math.sqrt(np.mean(dp ** 2)), rel=1e-12)
    assert s["dp_rms_err"] == pytest.approx(0.5 / math.sqrt(np.mean(dp ** 2)) * (dp ** 2).std() / math.sqrt(19),
                                            rel=1e-9)
    assert s["same_top"] == 0.75
    assert s["same_top_err"] == pytest.approx(math.sqrt(0.75 * 0.25 / 19), rel=1e-12)


# ---------------------------------------------------------------- paired statistics


def _cell(name, kld, chunk, top=None):
    n = len(kld)
    pos = np.concatenate([np.arange((chunk == c).sum()) for c in np.unique(chunk)])
    return P.CellTokens(name, {"model": "m", "n_ctx": 64, "chunks": 2}, chunk, pos, np.asarray(kld, float),
                        np.ones(n) if top is None else np.asarray(top, float), np.zeros(n))


def _boot_by_hand(cols, chunk_sizes, block, n_boot, seed):
    """The documented circular block bootstrap, written out with loops: per chunk of m tokens,
    ceil(m / block) blocks, each from a uniform start, wrapping at the chunk's end, cut to m;
    the starts drawn per chunk as one [n_boot, blocks] array, chunk after chunk."""
    rng = np.random.default_rng(seed)
    starts = [rng.integers(0, m, size=(n_boot, -(-m // block))) for m in chunk_sizes]
    out = {k: {"median": [], "mean": []} for k in cols}
    for r in range(n_boot):
        idx, offset = [], 0
        for st, m in zip(starts, chunk_sizes):
            chunk_idx = [offset + (int(s) + t) % m for s in st[r] for t in range(block)][:m]
            idx += chunk_idx
            offset += m
        for k, x in cols.items():
            out[k]["median"].append(float(np.median(x[idx])))
            out[k]["mean"].append(float(np.mean(x[idx])))
    return {k: {s: np.array(v) for s, v in d.items()} for k, d in out.items()}


def _two_cells(seed=11):
    rng = np.random.default_rng(seed)
    sizes = (37, 50)  # unequal chunks, neither a multiple of the block
    chunk = np.repeat([0, 1], sizes)
    hard = rng.lognormal(0, 1, sum(sizes))  # per-token difficulty both cells share
    a = hard * rng.lognormal(-3, 0.3, len(hard))
    b = hard * rng.lognormal(-3.1, 0.3, len(hard))
    top_a = rng.random(len(hard)) < 0.8
    top_b = rng.random(len(hard)) < 0.9
    return _cell("A", a, chunk, top_a), _cell("B", b, chunk, top_b), sizes


def test_compare_is_b_minus_a_from_a_paired_circular_block_bootstrap_of_the_median():
    A, B, sizes = _two_cells()
    res = P.compare(A, B, n_boot=300, seed=4, level=0.9, block=6)
    bs = _boot_by_hand({"a": A.kld, "b": B.kld, "ta": A.same_top, "tb": B.same_top}, sizes, 6, 300, 4)
    want = {
        "kld_median": (np.median(A.kld), np.median(B.kld), bs["b"]["median"] - bs["a"]["median"]),
        "kld_mean": (A.kld.mean(), B.kld.mean(), bs["b"]["mean"] - bs["a"]["mean"]),
        "same_top": (A.same_top.mean(), B.same_top.mean(), bs["tb"]["mean"] - bs["ta"]["mean"]),
    }
    for name, (va, vb, d) in want.items():
        s = res["stats"][name]
        lo, hi = np.quantile(d, [0.05, 0.95])  # level 0.9: the 5th and 95th percentiles
        assert s["a"] == pytest.approx(va, abs=1e-15) and s["b"] == pytest.approx(vb, abs=1e-15), name
        assert s["delta"] == pytest.approx(vb - va, abs=1e-15), name
        assert (s["lo"], s["hi"]) == (pytest.approx(lo, abs=1e-15), pytest.approx(hi, abs=1e-15)), name
        assert s["significant"] == bool(lo > 0 or hi < 0), name
    assert (res["n_tokens"], res["n_chunks"], res["block"]) == (87, 2, 6)


def test_a_constant_shift_gives_a_point_interval_only_when_paired():
    # B = A + 0.01 on every token: each paired resample's Δ median is exactly +0.01, so the
    # interval is [0.01, 0.01]; resampling the cells apart would spread it.
    A, _, sizes = _two_cells()
    B = _cell("B", A.kld + 0.01, A.chunk, A.same_top)
    s = P.compare(A, B, n_boot=200, seed=0, block=4)["stats"]
    for name in ("kld_median", "kld_mean"):
        assert s[name]["delta"] == pytest.approx(0.01, abs=1e-12)
        assert s[name]["lo"] == pytest.approx(0.01, abs=1e-12) and s[name]["hi"] == pytest.approx(0.01, abs=1e-12)
        assert s[name]["significant"]
    assert s["same_top"]["lo"] == s["same_top"]["hi"] == 0.0 and not s["same_top"]["significant"]


def test_cell_interval_by_hand():
    A, _, sizes = _two_cells()
    got = P.cell_interval(A, n_boot=250, seed=9, level=0.8, block=5)
    bs = _boot_by_hand({"k": A.kld}, sizes, 5, 250, 9)["k"]
    mlo, mhi = np.quantile(bs["median"], [0.1, 0.9])
    alo, ahi = np.quantile(bs["mean"], [0.1, 0.9])
    assert got["kld_median"] == pytest.approx(np.median(A.kld), abs=1e-15)
    assert got["kld_median_lo"] == pytest.approx(mlo, abs=1e-15)
    assert got["kld_median_hi"] == pytest.approx(mhi, abs=1e-15)
    assert got["kld_mean"] == pytest.approx(A.kld.mean(), abs=1e-15)
    assert (got["kld_mean_lo"], got["kld_mean_hi"]) == (pytest.approx(alo, abs=1e-15), pytest.approx(ahi, abs=1e-15))


def test_ranks_give_ties_their_average():
    # an exact cell's run of zeros must not read as a ramp: ranks of (0, 0, 0, 5, 1) are (1, 1, 1, 4, 3) − 0
    np.testing.assert_array_equal(P.ranks(np.array([0.0, 0.0, 0.0, 5.0, 1.0])), [1.0, 1.0, 1.0, 4.0, 3.0])


def test_block_length_takes_the_most_dependent_series_capped_at_half_the_shortest_chunk():
    # chunks of 60 and 14 tokens: the cap is 14 // 2 = 7. A smooth ramp in each chunk is as dependent
    # as a series gets (its Politis–White length is far above 7); iid noise gives about 1.
    rng = np.random.default_rng(2)
    chunk = np.repeat([0, 1], [60, 14])
    ramp = np.concatenate([np.arange(60.0), np.arange(14.0)])
    noise = rng.normal(size=74)
    assert P.block_length([noise, ramp], chunk) == 7  # the max over the series, capped
    assert P.block_length([ramp, noise], chunk) == 7
    assert P.block_length([noise], chunk) <= 2


def test_politis_white_against_the_formula_written_out():
    # One AR(1) series (phi 0.85, 2000 tokens) in one chunk: the paper's rule with plain sums.
    # Its autocorrelations cross the threshold 2·sqrt(log10(n)/n) ≈ 0.08 a few lags later than a
    # natural-log threshold (≈ 0.12), so the lag window M, and the length, depend on the log's base.
    rng = np.random.default_rng(1)
    n = 2000
    x = np.zeros(n)
    for i in range(1, n):
        x[i] = 0.85 * x[i - 1] + rng.normal()
    y = x - x.mean()
    k_n = max(5, math.ceil(math.sqrt(math.log10(n))))
    m_max = math.ceil(math.sqrt(n)) + k_n
    R = np.array([np.sum(y[: n - k] * y[k:]) / n for k in range(m_max + k_n + 1)])
    rho = R / R[0]
    thr = 2 * math.sqrt(math.log10(n) / n)
    m_hat = next(m for m in range(m_max + 1) if all(abs(rho[j]) < thr for j in range(m + 1, m + k_n + 1)))
    M_ = min(2 * max(m_hat, 1), m_max)

    def lam(t):
        return 1.0 if abs(t) <= 0.5 else 2 * (1 - abs(t)) if abs(t) <= 1 else 0.0

    G = sum(lam(k / M_) * abs(k) * R[abs(k)] for k in range(-M_, M_ + 1))
    g0 = sum(lam(k / M_) * R[abs(k)] for k in range(-M_, M_ + 1))
    want = min((2 * G ** 2 / (4 / 3 * g0 ** 2)) ** (1 / 3) * n ** (1 / 3), math.ceil(min(3 * math.sqrt(n), n / 3)))
    assert P.politis_white(x, [(0, n)]) == pytest.approx(want, rel=1e-9)
    assert want > 3  # a dependent series: a slip in the window or the lags moves it


def test_llama_block_prints_percentiles_under_their_labels_and_dp_in_percent():
    # the KLD and Δp of the two tests above: p99 KLD 118.69 under "99.0%", p90 98.1 under "90.0%";
    # Δp max 0.071 printed as 7.100 %, p25 −0.04225 as −4.225 %, same-top 15 of 20 as 75.000 %
    kld = np.array([i * i for i in range(12)], float)
    dp = np.array([i * i / 1000 - 0.05 for i in range(12)])
    top = np.array([1] * 9 + [0] * 3, bool)
    text = M.format_llama(M.summarize(_per_token(kld=kld, dp=dp, same_top=top)))
    lines = text.splitlines()
    assert "99.0%   KLD: 118.690000" in lines and "90.0%   KLD:  98.100000" in lines
    assert "Median  KLD:  30.500000" in lines and " 1.0%   KLD:   0.110000" in lines
    assert "Maximum Δp:  7.100%" in lines and "25.0%   Δp: -4.225%" in lines
    assert any(line.startswith("Same top p: 75.000 ± ") for line in lines)
