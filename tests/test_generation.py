"""kvarn.report.generation: the statistics of long free-running generation, on hand-made data
whose answer is known (a cell that never diverges, one that always diverges at step k, a KLD
ramp of known slope, identical cells, a teacher-forced run of another text), and the
generation workflow (its DAG counted by hand, its statistics and figures on a tiny run).
"""

import math
import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from kvarn.run import decode as KD
from kvarn.plan import generation as PG
from kvarn.report import generation as G


# ---------------------------------------------------------------- survival


def test_never_diverging_cell_survives_everywhere_all_censored():
    s = G.survival([10, 10, 10, 10], 10)
    assert s["t"].to_list() == list(range(11))
    assert s["survival"].to_list() == [1.0] * 11
    assert s["lo"].to_list() == [1.0] * 11 and s["hi"].to_list() == [1.0] * 11
    assert s["at_risk"].to_list() == [4] * 11


@pytest.mark.parametrize("k", [0, 3, 9])
def test_always_diverging_at_step_k(k):
    # first differing step k (0-based): the first k tokens equal the baseline's, the (k+1)-th not.
    s = G.survival([k] * 5, 10)
    assert s["survival"].to_list() == [1.0] * (k + 1) + [0.0] * (10 - k)


def test_km_without_censoring_equals_the_empirical_survival_of_summarize_decode():
    fd = [0, 2, 2, 5, 7, 7, 7, 9]
    tok = np.zeros((8, 10), dtype=int)
    for p, f in enumerate(fd):
        tok[p, f] = 1
    steps = {"token": tok.ravel(), "base_token": np.zeros(80, dtype=int), "kld": np.zeros(80),
             "same_top": (tok == 0).ravel()}
    want = KD.summarize_decode(steps, 8, 10)["survival"]
    assert G.survival(fd, 10)["survival"].to_list() == pytest.approx(want, abs=1e-15)


def test_km_band_is_the_exponential_greenwood_interval_by_hand():
    # durations 3 (event), 6 (event), 10, 10 (censored): S = 3/4 from t = 3, 1/2 from t = 6.
    s = G.survival([2, 5, 10, 10], 10, alpha=0.05)
    z = 1.959963984540054
    row = s.filter(pl.col("t") == 6).row(0, named=True)
    surv = 0.75 * (2 / 3)
    var = 1 / (4 * 3) + 1 / (3 * 2)  # Greenwood: sum d / (n (n - d))
    half = z * math.sqrt(var) / math.log(surv)
    assert row["survival"] == pytest.approx(surv, abs=1e-12)
    assert row["lo"] == pytest.approx(surv ** math.exp(-half), rel=1e-9)
    assert row["hi"] == pytest.approx(surv ** math.exp(half), rel=1e-9)
    assert s["at_risk"].to_list()[6] == 3


def test_survival_refuses_a_step_outside_the_generation():
    with pytest.raises(ValueError, match=r"first_divergence must lie in 0..10 .* got 0..11"):
        G.survival([0, 11], 10)


# ---------------------------------------------------------------- KLD curve and accumulation


def _ramp(slope=0.003, n_prompts=12, n_tokens=64, seed=1):
    """Prompt p: a_p + (slope + d_p)·s + zero-slope wiggle, the d_p summing to 0: the slope of
    the mean curve (and the mean per-prompt slope) is exactly `slope`."""
    rng = np.random.default_rng(seed)
    s = np.arange(n_tokens)
    d = rng.normal(0, slope / 2, n_prompts)
    d -= d.mean()
    wiggle = np.cos(2 * np.pi * s / n_tokens)
    wiggle -= (wiggle * (s - s.mean())).sum() / ((s - s.mean()) ** 2).sum() * (s - s.mean())  # projected off the step: slope 0
    return rng.uniform(0.01, 0.05, (n_prompts, 1)) + (slope + d)[:, None] * s + rng.uniform(0, 0.01, (n_prompts, 1)) * wiggle


def test_ramp_of_known_slope_is_recovered_and_covered():
    kld = _ramp(0.003)
    r = G.slope(kld, n_boot=500, seed=3)
    assert r["slope"] == pytest.approx(0.003, rel=1e-12)
    assert r["slope"] == pytest.approx(np.polyfit(np.arange(64), kld.mean(axis=0), 1)[0], rel=1e-12)
    assert r["slope_lo"] < 0.003 < r["slope_hi"]
    # an exact ramp, every prompt alike: every resample has the same slope, a zero-width CI
    exact = 0.02 + 0.001 * np.tile(np.arange(32), (5, 1))
    e = G.slope(exact, n_boot=200)
    assert e["slope"] == pytest.approx(0.001, rel=1e-12)
    assert e["slope_lo"] == pytest.approx(0.001, rel=1e-12) and e["slope_hi"] == pytest.approx(0.001, rel=1e-12)


def test_paired_difference_of_identical_cells_is_zero_and_of_shifted_ramps_is_the_shift():
    kld = _ramp(0.002)
    same = G.paired_slope(kld, kld.copy(), n_boot=300)
    assert same == {"diff": 0.0, "diff_lo": 0.0, "diff_hi": 0.0}
    # b = a + 0.0005·s: every prompt's slope differs by exactly 0.0005, so does every resample
    b = kld + 0.0005 * np.arange(64)
    d = G.paired_slope(b, kld, n_boot=300)
    assert d["diff"] == pytest.approx(0.0005, rel=1e-9)
    assert d["diff_lo"] == pytest.approx(0.0005, rel=1e-9) and d["diff_hi"] == pytest.approx(0.0005, rel=1e-9)
    with pytest.raises(ValueError, match=r"same prompts and steps .* \(12, 64\) and \(11, 64\)"):
        G.paired_slope(kld, kld[:11])


def test_kld_curve_bins_means_and_band():
    kld = np.array([[1.0, 3.0, 5.0, 7.0, 9.0], [3.0, 5.0, 7.0, 9.0, 11.0]])
    c = G.kld_curve(kld, bin_width=2, n_boot=400, seed=0)
    assert c["step_lo"].to_list() == [0, 2, 4] and c["step_hi"].to_list() == [1, 3, 4]
    assert c["kld_mean"].to_list() == pytest.approx([3.0, 7.0, 10.0])
    # two prompts: a resample's bin mean is one prompt's, the other's or their average
    assert c["lo"].to_list() == pytest.approx([2.0, 6.0, 9.0]) and c["hi"].to_list() == pytest.approx([4.0, 8.0, 11.0])
    # the band is the percentile interval of resampled bin means: here the inner quartiles of
    # 1000 draws of 3 prompts, drawn as kvarn.report.generation draws them (numpy default_rng)
    k3 = np.array([[1.0, 2.0, 0.0, 0.0], [5.0, 7.0, 1.0, 1.0], [20.0, 30.0, 3.0, 5.0]])
    q = G.kld_curve(k3, bin_width=2, n_boot=1000, seed=4, alpha=0.5)
    bins = np.array([[1.5, 0.0], [6.0, 1.0], [25.0, 4.0]])
    draws = bins[np.random.default_rng(4).integers(0, 3, size=(1000, 3))].mean(axis=1)
    assert q["lo"].to_list() == pytest.approx(np.quantile(draws, 0.25, axis=0).tolist())
    assert q["hi"].to_list() == pytest.approx(np.quantile(draws, 0.75, axis=0).tolist())
    one = G.kld_curve(kld, n_boot=50)
    assert one["kld_mean"].to_list() == pytest.approx(kld.mean(axis=0).tolist())


def test_bootstrap_is_seeded():
    kld = _ramp(0.001)
    assert G.slope(kld, n_boot=100, seed=7) == G.slope(kld, n_boot=100, seed=7)
    assert G.slope(kld, n_boot=100, seed=7) != G.slope(kld, n_boot=100, seed=8)


# ---------------------------------------------------------------- teacher-forced vs free-running


def test_tf_positions_are_the_scored_positions_of_the_decode_steps():
    # n_ctx 16, G 8: step s sits at position 7 + s; scored positions are 8..14 -> steps 1..7
    s, pos = G.tf_positions(16, 8)
    assert s.tolist() == list(range(1, 8)) and pos.tolist() == list(range(8, 15))
    s, pos = G.tf_positions(16, 4)
    assert s.tolist() == [0, 1, 2, 3] and pos.tolist() == [11, 12, 13, 14]


def test_tf_matrix_reads_chunks_and_positions_and_refuses_a_gap():
    tok = pl.DataFrame({"chunk": np.repeat([0, 1, 2], 7), "pos": np.tile(np.arange(8, 15), 3),
                        "kld": np.arange(21, dtype=float)})
    m = G.tf_matrix(tok, 2, np.array([12, 14]))
    assert m.tolist() == [[4.0, 6.0], [11.0, 13.0]]
    with pytest.raises(ValueError, match="no row for chunk 0, pos 15"):
        G.tf_matrix(tok, 2, np.array([15]))


def test_tf_vs_free_ratio():
    tf = np.full((4, 6), 0.01)
    r = G.tf_vs_free(3 * tf, tf, n_boot=200)
    assert r["ratio"] == pytest.approx(3.0) and r["ratio_lo"] == pytest.approx(3.0) and r["ratio_hi"] == pytest.approx(3.0)
    free = np.array([[1.0] * 3, [3.0] * 3])
    r = G.tf_vs_free(free, np.ones((2, 3)), n_boot=400)
    assert r["ratio"] == pytest.approx(2.0) and r["ratio_lo"] == pytest.approx(1.0) and r["ratio_hi"] == pytest.approx(3.0)


def test_tf_vs_free_draws_the_same_prompts_for_both_means():
    # Free-running KLD 3x the teacher-forced one prompt by prompt, the prompts' KLD spread over
    # three decades: every paired draw gives exactly 3 (a zero-width interval); a draw of other
    # prompts for the two means would give ratios from ~1/10 to ~30.
    tf = np.repeat(np.array([[0.001], [0.01], [0.1], [1.0], [0.003], [0.03], [0.3], [0.5]]), 5, axis=1)
    r = G.tf_vs_free(3 * tf, tf, n_boot=400)
    assert r["ratio"] == pytest.approx(3.0)
    assert r["ratio_lo"] == pytest.approx(3.0, rel=1e-12) and r["ratio_hi"] == pytest.approx(3.0, rel=1e-12)


DEC = {"model": "m", "source": "embedded:m", "revision": "r", "n_ctx": 2048, "k_type": "kvarn4", "v_type": "kvarn4",
       "tail": 0, "rot": True, "iters": 16, "sink": None, "tail_dtype": None, "n_prompts": 16,
       "text_sha256": "aa", "tokenizer_hash": "tt"}
TF = {"model": "m", "source": "embedded:m", "revision": "r", "n_ctx": 2048, "k_type": "kvarn4", "v_type": "kvarn4",
      "tail": 0, "rot": True, "iters": 16, "sink_requested": None, "tail_dtype": "f16", "chunks": 16, "compute": "exact"}
IDENT = {"text_sha256": "aa", "tokenizer_hash": "tt", "n_ctx": 2048, "n_chunks": 16}


def test_same_run_is_accepted_and_every_mismatch_refused():
    G.check_same_run(DEC, TF, IDENT)
    G.check_same_run(DEC, {**TF, "chunks": 32}, {**IDENT, "n_chunks": 32})
    for dec, tf, ident, what in [
        (DEC, TF, {**IDENT, "text_sha256": "bb"}, "text_sha256: decode 'aa', teacher-forced baseline 'bb'"),
        (DEC, {**TF, "n_ctx": 4096}, {**IDENT, "n_ctx": 4096}, "n_ctx: decode 2048, teacher-forced 4096"),
        (DEC, {**TF, "model": "g"}, IDENT, "model: decode 'm', teacher-forced 'g'"),
        (DEC, {**TF, "k_type": "q4_0"}, IDENT, "k_type: decode 'kvarn4', teacher-forced 'q4_0'"),
        (DEC, {**TF, "chunks": 8}, IDENT, "chunks: the teacher-forced cell scored 8 chunks"),
        (DEC, {**TF, "compute": "llamacpp-cpu"}, IDENT, "compute: teacher-forced 'llamacpp-cpu'"),
        ({**DEC, "tokenizer_hash": None}, TF, IDENT, "tokenizer_hash: decode None"),
        ({**DEC, "tail_dtype": "bf16"}, TF, IDENT, "tail_dtype: decode 'bf16', teacher-forced 'f16'"),
    ]:
        with pytest.raises(ValueError, match="refusing to compare them") as e:
            G.check_same_run(dec, tf, ident)
        assert what in str(e.value)


# ---------------------------------------------------------------- one run's tables, on hand-made results

N_CTX, P, GEN = 32, 3, 12  # decode step s sits at position 19 + s; scored positions 16..30: every step compared


def _write_run(root, cell, k, kld, fd, tf_kld, text="aa", prompts=P):
    """A decode result (steps from `kld` [P, G] and first divergences `fd`) and the same cell's
    teacher-forced tokens (chunks 0..P, positions 16..30, KLD `tf_kld(chunk, pos)`); P = `prompts`."""
    P = prompts
    import json

    tok = np.zeros((P, GEN), dtype=np.int64)
    for p, f in enumerate(fd):
        if f < GEN:
            tok[p, f] = 1
    steps = {"prompt": np.repeat(np.arange(P), GEN), "step": np.tile(np.arange(GEN), P), "token": tok.ravel(),
             "base_token": np.zeros(P * GEN, dtype=np.int64), "kld": kld.ravel(), "same_top": (tok == 0).ravel(),
             "nll_base": np.zeros(P * GEN)}
    cell_kw = {"model": "m", "source": "embedded:m", "revision": None, "n_ctx": N_CTX, "k_type": k, "v_type": k,
               "tail": 0 if k.startswith("kvarn") else 128, "rot": True, "iters": 16}
    dec = {**KD.summarize_decode(steps, P, GEN), **cell_kw, "sink": None, "tail_dtype": None,
           "prompt_tokens": N_CTX - GEN, "text_sha256": text, "tokenizer_hash": "tt"}
    d = root / "decode" / cell
    d.mkdir(parents=True)
    pl.DataFrame(steps).write_parquet(d / "steps.parquet")
    (d / "summary.json").write_text(json.dumps(dec))
    c = root / "cells" / cell
    c.mkdir(parents=True)
    chunk, pos = np.repeat(np.arange(P + 1), 15), np.tile(np.arange(16, 31), P + 1)
    pl.DataFrame({"chunk": chunk, "pos": pos, "kld": tf_kld(chunk, pos)}).write_parquet(c / "tokens.parquet")
    (c / "summary.json").write_text(json.dumps({**cell_kw, "sink_requested": None, "tail_dtype": "f16",
                                                "chunks": P + 1, "compute": "exact"}))
    return str(d), str(c)


@pytest.fixture
def hand_run(tmp_path):
    s = np.arange(GEN)
    a = _write_run(tmp_path, "kvarn4-kvarn4-t0", "kvarn4", np.tile(0.01 + 0.002 * s, (P, 1)), [GEN, 5, 0],
                   lambda c, p: np.full(len(c), 0.01))
    b = _write_run(tmp_path, "q4_0-q4_0-t128", "q4_0", np.tile(0.02 + 0.005 * s, (P, 1)), [3, 3, 3],
                   lambda c, p: 0.01 * (1 + c) + 0.0001 * (p - 16))
    f = _write_run(tmp_path, "q4_0-q4_0-t128-tdf16-s128", "q4_0", np.tile(0.01 + 0.001 * s, (P, 1)), [GEN] * 3,
                   lambda c, p: np.full(len(c), 0.01))
    ident = {"text_sha256": "aa", "tokenizer_hash": "tt", "n_ctx": N_CTX, "n_chunks": P + 1}
    return tmp_path, [a[0], b[0], f[0]], [a[1], b[1], f[1]], [ident] * 3


def test_compute_run_on_hand_made_results(hand_run):
    _, dec, cells, idents = hand_run
    t = G.compute_run(dec, cells, idents, n_boot=200)
    c = {r["cell"]: r for r in t["cells"].iter_rows(named=True)}
    kv, q = c["kvarn4-kvarn4-t0"], c["q4_0-q4_0-t128"]
    assert kv["slope_per_1k"] == pytest.approx(2.0) and q["slope_per_1k"] == pytest.approx(5.0)
    assert (kv["n_diverged"], q["n_diverged"]) == (2, 3)
    assert kv["compared_steps"] == GEN and kv["first_compared_pos"] == N_CTX - GEN - 1
    # free-running mean 0.01 + 0.002 * 5.5 over a teacher-forced 0.01 everywhere
    assert kv["ratio"] == pytest.approx((0.01 + 0.002 * 5.5) / 0.01)
    # q4_0: teacher-forced 0.01, 0.02, 0.03 on chunks 0, 1, 2 (chunk 3 is not a prompt) plus
    # 0.0001 (pos - 16) at positions 19..30
    tf_q = 0.02 + 0.0001 * (3 + np.arange(GEN))
    assert q["tf_kld_mean"] == pytest.approx(tf_q.mean()) and q["ratio"] == pytest.approx((0.02 + 0.005 * 5.5) / tf_q.mean())
    curve = t["curves"].filter(pl.col("cell") == "q4_0-q4_0-t128")  # G = 12: bins of 1 step
    assert curve.filter(pl.col("kind") == "teacher-forced")["kld_mean"].to_list() == pytest.approx(tf_q.tolist())
    assert curve.filter(pl.col("kind") == "free-running")["kld_mean"].to_list() == pytest.approx(
        (0.02 + 0.005 * np.arange(GEN)).tolist())
    # kvarn4 against both same-width standard rows, the format-only row labelled apart
    p, f = t["paired"].rows(named=True)
    assert (p["kvarn_cell"], p["standard_cell"]) == ("kvarn4-kvarn4-t0", "q4_0-q4_0-t128")
    assert p["diff_per_1k"] == pytest.approx(-3.0) and p["diff_lo_per_1k"] == pytest.approx(-3.0)
    assert f["standard_cell"] == "q4_0-q4_0-t128-tdf16-s128" and f["diff_per_1k"] == pytest.approx(1.0)
    assert f["standard_label"] == "q4_0-q4_0 t128 + KVarN's sink, F16 tail" and p["standard_label"] == "q4_0-q4_0 t128"
    s = t["survival"].filter(pl.col("cell") == "q4_0-q4_0-t128")["survival"].to_list()
    assert s == [1.0] * 4 + [0.0] * 9
    # the cells' text: zeros but one 1 at each prompt's divergence (none, step 5, step 0); the 4-grams of
    # steps 6..11 repeat an earlier one in prompt 0 (6 of 6), prompt 1 (9, 10, 11: 3 of 6), prompt 2 (6 of 6)
    assert kv["repeat_late"] == pytest.approx(15 / 18) and kv["nll_base_late"] == 0.0
    md = G.to_markdown(t)
    assert "| kvarn4-kvarn4 t128\\* | 2/3 |" in md and "q4_0-q4_0 t128" in md
    assert "| kvarn4-kvarn4 t128\\* | 83% | 0.000 | 0.000 |" in md


def test_compute_run_draws_from_its_seed_and_types_an_empty_pair_table(tmp_path):
    """Prompts whose KLD differ, so every bootstrap band depends on the draw: the same seed gives
    the same tables, another seed other bands (cells, curves and the paired slopes alike)."""
    n = 12  # prompts: enough distinct draws that every band moves with the seed
    s, p = np.arange(GEN), np.arange(n)[:, None]
    a = _write_run(tmp_path, "kvarn4-kvarn4-t0", "kvarn4", 0.01 + 0.002 * s * (1 + np.sin(p)), [GEN, 5, 0] * 4,
                   lambda c, q: 0.01 * (1 + c), prompts=n)
    b = _write_run(tmp_path, "q4_0-q4_0-t128", "q4_0", 0.02 + 0.005 * s * (1 + np.cos(p) ** 2), [3, 4, 5] * 4,
                   lambda c, q: 0.01 * (1 + c) + 0.0001 * (q - 16), prompts=n)
    dec, cells = [a[0], b[0]], [a[1], b[1]]
    ident = [{"text_sha256": "aa", "tokenizer_hash": "tt", "n_ctx": N_CTX, "n_chunks": n + 1}] * 2
    one = G.compute_run(dec, cells, ident, n_boot=200, seed=5)
    again = G.compute_run(dec, cells, ident, n_boot=200, seed=5)
    other = G.compute_run(dec, cells, ident, n_boot=200, seed=6)
    for name in ("cells", "paired", "curves"):
        assert one[name].equals(again[name]), name
        assert not one[name].equals(other[name]), name
    # standard cells only: no pair, and the paired table keeps its columns' types
    alone = G.compute_run(dec[1:], cells[1:], ident[1:], n_boot=200, seed=5)["paired"]
    assert alone.height == 0 and alone.schema == one["paired"].schema


def test_the_tables_markdown_word_for_word(hand_run):
    _, dec, cells, ident = hand_run
    md = G.to_markdown(G.compute_run(dec, cells, ident, n_boot=200, seed=5), alpha=0.1).splitlines()
    assert md[0] == "### m: free-running generation, n_ctx 32, 3 prompts × 12 generated tokens, greedy"
    assert md[2].startswith("Brackets: 90 % intervals (survival: Kaplan–Meier, exponential Greenwood; the rest: ")
    assert md[4:6] == ["| cell | diverged | median first divergence | S(G) | mean KLD (free) | slope per 1k tokens "
                       "| mean KLD (teacher-forced) | free / teacher-forced |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    i = md.index("Paired difference of slopes (KVarN − same-width standard, same prompts resampled jointly), per "
                 "1000 generated tokens; below 0: KVarN accumulates more slowly.")
    assert md[i + 1:i + 4] == ["", "| KVarN | standard | slope difference per 1k tokens |", "|---|---|---:|"]
    assert md[i + 4].startswith("| kvarn4-kvarn4 t128\\* | q4_0-q4_0 t128 | -3 [-3, -3] |")


def test_bad_arguments_are_refused_by_name():
    kld = np.ones((3, 8))
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\), got 1.5"):
        G.slope(kld, alpha=1.5)
    with pytest.raises(ValueError, match=r"bootstrap resamples must be a positive integer, got 0"):
        G.slope(kld, n_boot=0)
    with pytest.raises(ValueError, match=r"kld must be a \[prompts, steps\] array, got shape \(8,\)"):
        G.kld_curve(np.ones(8))
    with pytest.raises(ValueError, match=r"must be \[prompts, positions\] of one shape, got \(0, 4\) and \(0, 4\)"):
        G.tf_vs_free(np.ones((0, 4)), np.ones((0, 4)))
    # a teacher-forced summary from before `compute` was recorded ran the exact path
    G.check_same_run(DEC, {k: v for k, v in TF.items() if k != "compute"}, IDENT)
    with pytest.raises(ValueError) as e:
        G.check_same_run(DEC, {**TF, "model": "g", "chunks": 8}, IDENT)
    assert str(e.value) == ("teacher-forced and free-running results are not of the same cell, text and chunks; "
                            "refusing to compare them: model: decode 'm', teacher-forced 'g'; chunks: the "
                            "teacher-forced cell scored 8 chunks, the decode's 16 prompts need as many")


def test_repeated_ngrams_and_text_stats(tmp_path):
    tok = np.array([[1, 2, 3, 4, 1, 2, 3, 4], [5, 5, 5, 5, 5, 5, 5, 5]])
    r = G.repeated_ngrams(tok)
    assert r[0].tolist() == [False] * 7 + [True]            # (1, 2, 3, 4) again at step 7
    assert r[1].tolist() == [False] * 4 + [True] * 4        # (5, 5, 5, 5) first ends at step 3
    assert G.repeated_ngrams(tok, n=1)[0].tolist() == [False] * 4 + [True] * 4
    with pytest.raises(ValueError, match="repeated_ngrams"):
        G.repeated_ngrams(tok[0])
    nll = np.arange(16, dtype=float).reshape(2, 8)
    pl.DataFrame({"prompt": np.repeat([0, 1], 8), "step": np.tile(np.arange(8), 2), "token": tok.ravel(),
                  "kld": np.zeros(16), "nll_base": nll.ravel()}).sample(fraction=1.0, shuffle=True, seed=1).write_parquet(
        tmp_path / "steps.parquet")
    (tmp_path / "summary.json").write_text('{"n_prompts": 2, "n_tokens": 8}')
    _, m = G.load_decode(tmp_path)  # read back in (prompt, step) order
    assert np.array_equal(m["token"], tok) and np.array_equal(m["nll_base"], nll)
    got = G.text_stats(m["token"], m["nll_base"])  # G = 8: first 8 // 16 -> 1 step, second half steps 4..7
    assert got == {"repeat_late": 5 / 8, "nll_base_early": (0 + 8) / 2, "nll_base_late": nll[:, 4:].mean()}
    (tmp_path / "summary.json").write_text('{"n_prompts": 2, "n_tokens": 9}')
    with pytest.raises(ValueError, match="expected prompts × tokens = 2 × 9"):
        G.load_decode(tmp_path)


def test_compute_run_refuses_another_text(hand_run):
    root, dec, cells, idents = hand_run
    with pytest.raises(ValueError, match="text_sha256: decode 'aa', teacher-forced baseline 'bb'"):
        G.compute_run(dec, cells, [*idents[:2], {**idents[2], "text_sha256": "bb"}], n_boot=10)
    with pytest.raises(ValueError, match="are not the same cell"):
        G.compute_run(dec, cells[::-1], idents, n_boot=10)


def test_generation_figures_draw_every_table(hand_run):
    from kvarn.report.figures_generation import GENERATION_FIGURES, generation_figure

    _, dec, cells, idents = hand_run
    t = G.compute_run(dec, cells, idents, n_boot=50)
    assert list(GENERATION_FIGURES) == list(PG.GENERATION_FIGURES)
    for name in PG.GENERATION_FIGURES:
        spec = generation_figure(name, t).to_dict()
        assert "m: " in str(spec["title"]), name
    with pytest.raises(ValueError, match="unknown generation figure 'x'"):
        generation_figure("x", t)


def test_survival_figure_at_full_size_draws_the_step_points(hand_run):
    """At the generation config's size (7 cells × G + 1 points) the survival table exceeds altair's
    5000 embedded rows; the figure draws each step function from its change points, the same
    curve under step-after interpolation."""
    from kvarn.report.figures_generation import generation_figure, step_points

    _, dec, cells, idents = hand_run
    t = G.compute_run(dec, cells, idents, n_boot=20)
    g = 2047
    rng = np.random.default_rng(0)
    big = pl.concat([G.survival(rng.integers(0, g + 1, 16), g).with_columns(pl.lit(c).alias("cell"))
                     for c in t["cells"]["cell"]])
    assert big.height == 3 * (g + 1) > 5000
    spec = generation_figure("survival", {**t, "survival": big}).to_dict()  # no MaxRowsError
    kept = step_points(big)  # per cell: survival/band and at_risk change at (or one after) each of 16 events
    assert kept.height <= 3 * (2 * 16 + 2) and sum(len(d) for d in spec["datasets"].values()) == kept.height
    for c in t["cells"]["cell"]:  # the last kept point at or before every t carries that t's values
        full, k = big.filter(pl.col("cell") == c), kept.filter(pl.col("cell") == c)
        idx = np.searchsorted(k["t"].to_numpy(), full["t"].to_numpy(), side="right") - 1
        for col in ("survival", "lo", "hi", "at_risk"):
            assert np.array_equal(k[col].to_numpy()[idx], full[col].to_numpy(), equal_nan=True), (c, col)
        assert k["t"].max() == g


# ---------------------------------------------------------------- the workflow


def _workflow(tmp_path, config, model_cache=None):
    import yaml
    from test_workflow import workflow_copy

    if isinstance(config, Path):
        config = {k: v for k, v in yaml.safe_load(Path(config).read_text()).items() if k not in ("text", "model_cache")}
    return workflow_copy(tmp_path, config, model_cache)


def _plan(wd, *targets):
    import re

    from test_workflow import smk

    out = smk(wd, *targets, "-n", "--quiet", "rules")
    return {r: int(n) for r, n in re.findall(r"^(\w+)\s+(\d+)\s*$", out.stdout + out.stderr, flags=re.M)
            if r != "total"}


ROOT = Path(__file__).resolve().parents[1]


def test_generation_config_plans_its_jobs_counted_by_hand(tmp_path):
    # 2 models x 13 cells (7 KVarN / standard, 6 QuantizedCache backends): a teacher-forced cell and a
    # decode each; per model one baseline, one statistics job and one job for its 4 figures; both
    # models fetched into the empty model cache.
    wd = _workflow(tmp_path, ROOT / "config" / "generation.yaml")
    assert _plan(wd, "generation") == {"fetch_model": 2, "wikitext": 1, "baseline": 2, "cell": 26, "decode": 26,
                                       "generation_stats": 2, "report_generation": 2, "generation": 1}


def test_default_run_has_no_decode_or_generation_job(tmp_path):
    import yaml

    assert all("decode" not in m for m in yaml.safe_load((ROOT / "config" / "matrix.yaml").read_text())["models"])
    wd = _workflow(tmp_path, ROOT / "config" / "matrix.yaml")
    jobs = _plan(wd)
    assert jobs["cell"] > 0 and not {"decode", "generation_stats", "report_generation", "generation"} & set(jobs)


def test_generation_refuses_fewer_chunks_than_prompts(tmp_path):
    from test_workflow import smk

    cfg = {"models": [{"name": "smollm2-135m", "source": "embedded:smollm2-135m", "n_ctx": [96], "chunks": 1,
                       "decode": {"prompts": 2, "tokens": 40}}], "cells": [{"types": ["q2_0"], "tail": 0}]}
    p = smk(_workflow(tmp_path, cfg), "-n", "generation", check=False)
    assert p.returncode and "chunks 1 < decode prompts 2" in p.stdout + p.stderr


def test_generation_plan_of_the_shipped_config():
    """kvarn.plan.generation in this process (the rules call it in snakemake's): config/generation.yaml
    has one decode run per model with its thirteen cells (seven of KVarN and standard types, six of
    transformers' QuantizedCache backends); each run's inputs are the decode, steps,
    teacher-forced and baseline files of those cells; the targets are each run's tables and
    figures; a run the matrix does not have, or cells that score fewer chunks than the decode has
    prompts, are refused by name."""
    import yaml

    from kvarn.plan import matrix, paths

    cfg = yaml.safe_load((ROOT / "config" / "generation.yaml").read_text())
    m = matrix.expand(cfg)
    plan = PG.runs(m)
    assert sorted(plan) == [("gemma3-270m", 4096, 16, 2048, ""), ("smollm2-135m", 2048, 16, 1024, "")]
    r = plan[("smollm2-135m", 2048, 16, 1024, "")]
    assert len(r["decode"]) == len(r["cells"]) == len(r["baselines"]) == 13 and r["chunks"] == 16
    eco = {c.name for c in m.cells if c.family == "ecosystem"}
    assert eco == {f"{t}-{t}-t0" for t in ("quanto4", "quanto2", "hqq4", "hqq2", "kivi4", "kivi2")}
    assert sum(d.rsplit("/", 1)[1] in eco for d in r["decode"]) == 6
    assert r["decode"][0] == paths.decode_dir("smollm2-135m", 2048, 16, 1024, m.cells[0].name)
    got = PG.run_inputs(m, "smollm2-135m", "2048", "16", "1024")  # wildcards arrive as strings
    assert got == {"decode": [f"{d}/summary.json" for d in r["decode"]], "steps": [f"{d}/steps.parquet" for d in r["decode"]],
                   "cells": [f"{d}/summary.json" for d in r["cells"]], "tokens": [f"{d}/tokens.parquet" for d in r["cells"]],
                   "baselines": r["baselines"]}
    targets = PG.targets(m)
    per_run = len(PG.GENERATION_TABLES) + 3 * len(PG.GENERATION_FIGURES)
    assert len(targets) == len(set(targets)) == 2 * per_run
    assert f"{PG.run_dir('smollm2-135m', 2048, 16, 1024)}/generation.md" in targets
    assert "results/figures/gemma3-270m/decode-ctx4096-p16-g2048/survival.png" in targets
    with pytest.raises(ValueError, match="not a decode run of this matrix"):
        PG.run_inputs(m, "smollm2-135m", 2048, 8, 1024)
    few = {**cfg, "models": [{**cfg["models"][0], "chunks": 4}]}
    with pytest.raises(ValueError, match="chunks 4 < decode prompts 16"):
        PG.run_inputs(matrix.expand(few), "smollm2-135m", 2048, 16, 1024)


def test_generation_plan_of_the_sampled_config():
    """config/generation-sampled.yaml: the same teacher-forced cells as config/generation.yaml's
    (shared cached targets), its decodes in their own directories (suffix -T1-s0), its eleven cells
    (five of KVarN and standard types, the six QuantizedCache backends at 4 and 2 bits);
    the greedy run is not one of its runs."""
    import yaml

    from kvarn.plan import matrix

    m = matrix.expand(yaml.safe_load((ROOT / "config" / "generation-sampled.yaml").read_text()))
    greedy = matrix.expand(yaml.safe_load((ROOT / "config" / "generation.yaml").read_text()))
    plan = PG.runs(m)
    assert sorted(plan) == [("gemma3-270m", 4096, 16, 2048, "-T1-s0"), ("smollm2-135m", 2048, 16, 1024, "-T1-s0")]
    r = plan[("smollm2-135m", 2048, 16, 1024, "-T1-s0")]
    assert len(r["decode"]) == 11 and set(r["cells"]) <= {c.dir for c in greedy.cells}
    assert r["decode"][0] == f"results/smollm2-135m/decode-ctx2048-p16-g1024-T1-s0/{m.cells[0].name}"
    assert m.decode_dirs("smollm2-135m") == r["decode"]
    assert PG.run_inputs(m, "smollm2-135m", "2048", "16", "1024", "-T1-s0")["decode"] == [
        f"{d}/summary.json" for d in r["decode"]]
    assert "results/figures/smollm2-135m/decode-ctx2048-p16-g1024-T1-s0/survival.png" in PG.targets(m)
    with pytest.raises(ValueError, match="not a decode run of this matrix"):
        PG.run_inputs(m, "smollm2-135m", 2048, 16, 1024)


@pytest.mark.parametrize("decode,needle", [
    ({"temperature": -1}, "decode temperature must be a number >= 0"),
    ({"temperature": 1e-7}, "decode temperature must be a number >= 0"),
    ({"temperature": 1, "seed": -1}, "decode seed must be an integer >= 0"),
    ({"temperature": 1, "top_k": 5}, "expected a mapping of prompts, tokens and (optionally) cells, temperature"),
])
def test_matrix_refuses_bad_sampling(decode, needle):
    import yaml

    from kvarn.plan import matrix

    cfg = yaml.safe_load((ROOT / "config" / "generation-sampled.yaml").read_text())
    cfg["models"] = [{**cfg["models"][0], "decode": {"prompts": 16, "tokens": 1024, **decode}}]
    with pytest.raises(matrix.MatrixError, match=r"^models\[0\]\.decode: .*" + re.escape(needle)):
        matrix.expand(cfg)


TINY_GEN = {"models": [{"name": "smollm2-135m", "source": "embedded:smollm2-135m", "n_ctx": [96], "chunks": 2,
                        "decode": {"prompts": 2, "tokens": 40, "temperature": 1, "seed": 0}}],
            "cells": [{"types": ["q2_0"], "tail": 0}, {"types": ["kvarn2"], "tail": 0}]}


@pytest.mark.slow
def test_generation_runs_on_a_tiny_matrix(tmp_path):
    """The whole generation target on SmolLM2 at n_ctx 96 (2 prompts, 40 tokens sampled at T = 1,
    seed 0, q2_0 vs kvarn2): the rules' scripts, the sampled decode's directory (its wildcard
    reaches the decode), the tables and the four figures, numbers checked against the results.
    (The greedy decode's plan: tests/test_decode.py, test_matrix_decode_axis_plans_decode_jobs.)"""
    import json

    from paths import CACHE_DIR
    from test_workflow import smk

    wd = _workflow(tmp_path, TINY_GEN, CACHE_DIR)
    smk(wd, "generation", "--cores", "1", "--resources", "gpu=1")
    run = wd / "results/smollm2-135m/decode-ctx96-p2-g40-T1-s0"
    cells = pl.read_parquet(run / "generation/cells.parquet")
    assert sorted(cells["cell"]) == ["kvarn2-kvarn2-t0", "q2_0-q2_0-t0"]
    for r in cells.iter_rows(named=True):
        dec = json.loads((run / r["cell"] / "summary.json").read_text())
        assert r["decode_kld_mean"] == pytest.approx(dec["decode_kld_mean"], rel=1e-12)
        assert r["n_diverged"] == dec["n_diverged"] and r["compared_steps"] == 40
        assert (dec["temperature"], dec["seed"], dec["sampling"]) == (1.0, 0, "-T1-s0")
        assert r["decoding"] == "sampled at T = 1, seed 0"
        tf = pl.read_parquet(wd / f"results/smollm2-135m/ctx96-c2/cells/{r['cell']}/tokens.parquet")
        assert r["tf_kld_mean"] == pytest.approx(tf.filter(pl.col("pos") >= 55)["kld"].mean(), rel=1e-12)
    assert pl.read_parquet(run / "generation/paired.parquet").height == 1
    md = (run / "generation/generation.md").read_text()
    assert "free / teacher-forced" in md and "generated tokens, sampled at T = 1, seed 0" in md
    for f in PG.GENERATION_FIGURES:
        for ext in ("svg", "png", "vl.json"):
            assert (wd / f"results/figures/smollm2-135m/decode-ctx96-p2-g40-T1-s0/{f}.{ext}").stat().st_size > 0
