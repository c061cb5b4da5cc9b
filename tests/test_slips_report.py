"""A user's doubts about the report's tables, the claims ledger and the advice: is "<" in the band
column "KVarN damages less", is the floor the lowest standard median at tail 128 and "below" strictly
below it, is a gain positive when KVarN wins, is Δ the second-named cell minus the first, is the
cheapest match the cheapest one, is a tolerance's bound inclusive, what are the defaults?

Hand-made summaries whose answers are worked out in the comments; token columns built so that a
paired Δ is known exactly (a constant shift gives a point interval). Each test seen red against the
slip docs/notes/slips.md names."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from kvarn.report import advise as A
from kvarn.report.claims.decisions import below_floor_table, cheapest_match_table, presets_table
from kvarn.report.claims.definitions import (equal_memory, exactness_vs_format, ladder, same_width_gain,
                                             same_width_gain_pct, tail_effect, tail_effect_pct)
from kvarn.report.claims.study import load_study
from kvarn.report.claims.verdicts import directional, paired_delta
from kvarn.report import tables as T
from kvarn.report.data import prepare
from kvarn.report.paired_table import run_table
from kvarn.vocab import facts
from kvarn.stats.paired import CellTokens
from test_advise import row as advise_row

MIB = 1 << 20
STUDY = load_study()
SM = "qwen3.6-27b"


def summary(cells, model="m"):
    """Summary rows: (K-V, tail, median KLD, MiB[, MiB at tail 0]); the columns kvarn.report.data.prepare reads."""
    rows = []
    for k_v, tail, median, mib, *rest in cells:
        k, v = k_v.split("-")
        total = round(mib * MIB)
        rows.append({
            "model": model, "n_ctx": 1024, "chunks": 1, "k_type": k, "v_type": v, "tail": tail,
            "tail_eff_full": facts.pair_effective_tail(k, v, tail), "cell": f"{k}-{v}-t{tail}",
            "kld_median": median, "kld_mean": 2 * median, "kld_mean_err": 0.001, "kld_p99": 10 * median,
            "kld_p99_9": 20 * median, "kv_total_bytes": total, "kv_body_bytes": total,
            "kv_overlay_bytes": 0, "kv_total_bytes_tail0": round(rest[0] * MIB) if rest else total,
            "memory_accounting": "packed", "same_top": 0.9, "same_top_err": 0.01, "tokens_per_s": 1000.0,
        })
    return pl.DataFrame(rows, infer_schema_length=None)


def prep_of(cells):
    return prepare(summary(cells), "m")


# ---------------------------------------------------------------- the per-model table


def test_band_text_reads_the_sign_of_kvarn_minus_standard():
    r = {"band": "", "sw_cell": "q4_0-q4_0-t128", "sw_delta": -0.0021, "sw_lo": -0.003, "sw_hi": -0.001,
         "sw_significant": True}
    assert T.band_text(r) == "< q4_0-q4_0 (Δ -0.0021 [-0.003, -0.001])"  # KVarN − standard < 0: KVarN damages less
    assert T.band_text(r | {"sw_delta": 0.0021, "sw_lo": 0.001, "sw_hi": 0.003}).startswith("> q4_0-q4_0")
    assert T.band_text(r | {"sw_significant": False, "band": "≈ floor"}).startswith("≈ floor; ≈ q4_0-q4_0")


def test_floor_is_the_lowest_standard_median_at_tail_128_and_below_is_strict():
    # standard at 128: q4_0 0.10, q8_0 0.02 → the floor is q8_0 t128 (q5_0 at tail 0 is lower but not at 128);
    # kvarn4 at 128* equals the floor (not below), kvarn6 is below, q5_0 t0 is below
    p = prep_of([("q4_0-q4_0", 128, 0.10, 4.5), ("q8_0-q8_0", 128, 0.02, 8.5), ("q5_0-q5_0", 0, 0.01, 5.0),
                 ("kvarn4-kvarn4", 0, 0.02, 4.6), ("kvarn6-kvarn6", 0, 0.019, 6.6)])
    flags = {r["cell"]: (r["is_floor"], r["below_floor"]) for r in p.iter_rows(named=True)}
    assert flags == {"q4_0-q4_0-t128": (False, False), "q8_0-q8_0-t128": (True, False),
                     "q5_0-q5_0-t0": (False, True), "kvarn4-kvarn4-t0": (False, False),
                     "kvarn6-kvarn6-t0": (False, True)}


def test_table_cells_print_the_delta_against_tail_0_and_percent_scales():
    # q4_0 at 128: 4.75 MiB against 4.50 at tail 0 → "4.75 (+0.25)"; the tail-0 row prints no Δ.
    # same-top 0.9 ± 0.01 prints 90.000 ± 1.000 (percent)
    t = T.build_table(summary([("q4_0-q4_0", 128, 0.10, 4.75, 4.5), ("q4_0-q4_0", 0, 0.3, 4.5)]), "m")
    rows = {(r["K/V pair"], r["tail"]): r for r in T.format_rows(t)}
    assert rows[("q4_0-q4_0", "128")]["KV cache MiB (Δ)"] == "4.75 (+0.25)"
    assert rows[("q4_0-q4_0", "0")]["KV cache MiB (Δ)"] == "4.50"
    assert rows[("q4_0-q4_0", "128")]["same top %"] == "90.000 ± 1.000"
    assert rows[("q4_0-q4_0", "128")]["mean KLD ± err"] == "0.200000 ± 0.001000"
    assert (rows[("q4_0-q4_0", "128")]["median KLD"], rows[("q4_0-q4_0", "128")]["p99 KLD"],
            rows[("q4_0-q4_0", "128")]["p99.9 KLD"]) == ("0.100000", "1.000000", "2.000000")


# ---------------------------------------------------------------- paired table


N = 90  # tokens per hand-made cell, 2 chunks of 45


def _write_cell(root, name, kld):
    d = root / name
    d.mkdir(parents=True)
    pl.DataFrame({"chunk": np.repeat([0, 1], N // 2), "pos": np.tile(np.arange(N // 2), 2), "kld": kld,
                  "same_top": np.ones(N, bool), "nll_base": np.zeros(N)}).write_parquet(d / "tokens.parquet")
    return str(d / "tokens.parquet")


def test_run_table_delta_is_cell_minus_floor_and_kvarn_minus_standard(tmp_path):
    # floor q8_0 t128; q4_0 t128 = floor + 0.05 on every token → Δ +0.05 with a point interval (not ≈ floor);
    # q5_0 t128 = the floor's tokens → Δ 0, interval [0, 0] holds 0 → "≈ floor";
    # kvarn4 128* = q4_0's − 0.01 → KVarN − q4_0 = −0.01, significant
    rng = np.random.default_rng(0)
    base = rng.lognormal(-4, 1, N)
    toks = {"q8_0-q8_0-t128": base, "q4_0-q4_0-t128": base + 0.05, "q5_0-q5_0-t128": base.copy(),
            "kvarn4-kvarn4-t0": base + 0.04}
    med = {c: float(np.median(k)) for c, k in toks.items()}
    med["q5_0-q5_0-t128"] += 1e-6  # the summary's median a hair above the floor's: q8_0 stays the floor
    prep = prep_of([("q8_0-q8_0", 128, med["q8_0-q8_0-t128"], 8.5), ("q4_0-q4_0", 128, med["q4_0-q4_0-t128"], 4.5),
                    ("q5_0-q5_0", 128, med["q5_0-q5_0-t128"], 5.5), ("kvarn4-kvarn4", 0, med["kvarn4-kvarn4-t0"], 4.6)])
    paths = [_write_cell(tmp_path, c, k) for c, k in toks.items()]
    t = {r["cell"]: r for r in run_table(prep, paths, n_boot=200).iter_rows(named=True)}
    assert t["q8_0-q8_0-t128"]["band"] == "floor"
    q4 = t["q4_0-q4_0-t128"]
    assert (q4["floor_delta"], q4["floor_lo"], q4["floor_hi"]) == tuple(pytest.approx(0.05, abs=1e-12) for _ in "abc")
    assert q4["band"] == ""
    q5 = t["q5_0-q5_0-t128"]
    assert (q5["floor_delta"], q5["floor_lo"], q5["floor_hi"], q5["band"]) == (0.0, 0.0, 0.0, "≈ floor")
    kv = t["kvarn4-kvarn4-t0"]
    assert kv["sw_cell"] == "q4_0-q4_0-t128"
    assert (kv["sw_delta"], kv["sw_lo"], kv["sw_hi"]) == tuple(pytest.approx(-0.01, abs=1e-12) for _ in "abc")
    assert kv["sw_significant"] is True


# ---------------------------------------------------------------- the ledger


def test_gain_and_tail_effect_point_the_studys_way():
    # kvarn4 at 128* 0.09 against q4_0 at 128 0.10: gain (1 − 0.09/0.10)·100 = +10 (KVarN wins);
    # q8_0 from tail 0 (0.02) to 128 (0.015): (0.015/0.02 − 1)·100 = −25 (the tail lowers it)
    p = prep_of([("q4_0-q4_0", 128, 0.10, 4.5), ("kvarn4-kvarn4", 0, 0.09, 4.6),
                 ("q8_0-q8_0", 0, 0.02, 8.5), ("q8_0-q8_0", 128, 0.015, 8.75)])
    g = {r["claim_id"]: r for r in same_width_gain(p, "m", SM, STUDY)}["same_width_gain_4"]
    assert g["ours"] == pytest.approx(10.0, abs=1e-9) and g["verdict"] == "holds"  # the study's +7.9
    e = {r["claim_id"]: r for r in tail_effect(p, "m", SM, STUDY)}["tail_effect_8"]
    assert e["ours"] == pytest.approx(-25.0, abs=1e-9) and e["verdict"] == "holds"
    assert same_width_gain_pct(0.09, 0.10) == pytest.approx(10.0)
    assert tail_effect_pct(0.015, 0.02) == pytest.approx(-25.0)


def test_ladder_step_and_exactness_ratio_by_hand():
    # ladder q4_0 → q5_0 at 128: 0.04 − 0.10 = −0.06 (wider damages less);
    # exactness vs format: (q4_0 t0 − q4_0 t128) / (q4_0 t128 − kvarn4 128*) = (0.30 − 0.10)/(0.10 − 0.04) = 3.33
    p = prep_of([("q4_0-q4_0", 0, 0.30, 4.5), ("q4_0-q4_0", 128, 0.10, 4.75), ("q5_0-q5_0", 128, 0.04, 5.5),
                 ("kvarn4-kvarn4", 0, 0.04, 4.6)])
    lad = {r["claim_id"]: r for r in ladder(p, "m", SM, STUDY)}["ladder_4_5"]
    assert lad["ours"] == pytest.approx(-0.06, abs=1e-12) and lad["delta_of"] == "q5_0 − q4_0"
    ex = {r["claim_id"]: r for r in exactness_vs_format(p, "m", SM, STUDY)}["exactness_vs_format"]
    assert ex["ours"] == pytest.approx(0.2 / 0.06, rel=1e-9) and ex["verdict"] == "holds"


def test_equal_memory_ratio_is_asymmetric_over_symmetric():
    # kvarn4-kvarn2 0.06 and kvarn3-kvarn3 0.03 at 3.0 MiB each: ratio 2.0, the asymmetric one higher
    p = prep_of([("kvarn4-kvarn2", 0, 0.06, 3.0), ("kvarn3-kvarn3", 0, 0.03, 3.0)])
    r = equal_memory(p, "m", SM, STUDY)[0]
    assert r["ours"] == pytest.approx(2.0) and r["verdict"] == "holds"


def test_paired_delta_is_the_second_cell_minus_the_first():
    rng = np.random.default_rng(4)
    kld = rng.lognormal(-4, 1, N)
    chunk, pos = np.repeat([0, 1], N // 2), np.tile(np.arange(N // 2), 2)
    cells = {c: CellTokens(c, {}, chunk, pos, k, np.ones(N), np.zeros(N))
             for c, k in (("a", kld), ("b", kld + 0.01))}
    d, lo, hi = paired_delta(cells, 200, 0)({"cell": "a"}, {"cell": "b"})
    assert (d, lo, hi) == tuple(pytest.approx(0.01, abs=1e-12) for _ in "abc")


@pytest.mark.parametrize("sign_ok, lo, hi, want, verdict", [
    (True, -0.3, -0.1, -1, "holds"),
    (True, 0.0, 0.2, -1, "not separable"),  # an interval that touches 0 holds it
    (True, -0.2, 0.0, +1, "not separable"),
    (True, 0.1, 0.3, -1, "does not hold"),  # excludes 0 on the other side
    (False, None, None, -1, "does not hold"),
    (True, 0.1, 0.3, +1, "holds"),
])
def test_directional_verdicts(sign_ok, lo, hi, want, verdict):
    assert directional(sign_ok, lo, hi, want)[0] == verdict


def test_decision_tables_cheapest_match_presets_and_below_floor():
    # matched rows: standard at 128 q4_0 (4.5 MiB, 0.10), q5_0 (5.5, 0.04), q8_0 (8.5, 0.02 the floor);
    # KVarN at 128*: kvarn3 (3.6, 0.10), kvarn4 (4.6, 0.04), kvarn5 (5.6, 0.02: the floor's, not below it),
    # kvarn6 (6.6, 0.019)
    p = prep_of([("q4_0-q4_0", 128, 0.10, 4.5), ("q5_0-q5_0", 128, 0.04, 5.5), ("q8_0-q8_0", 128, 0.02, 8.5),
                 ("kvarn3-kvarn3", 0, 0.10, 3.6), ("kvarn4-kvarn4", 0, 0.04, 4.6), ("kvarn5-kvarn5", 0, 0.02, 5.6),
                 ("kvarn6-kvarn6", 0, 0.019, 6.6)])
    # cheapest standard row with a median at most KVarN's (equal counts): kvarn4 → q5_0, saving 0.9 MiB
    cm = {r["pair"]: r for r in cheapest_match_table(p).iter_rows(named=True)}
    assert cm["kvarn4-kvarn4"]["match"] == "q5_0-q5_0 t128"
    assert cm["kvarn4-kvarn4"]["mib_saved"] == pytest.approx(5.5 - 4.6, abs=1e-6)
    assert cm["kvarn3-kvarn3"]["match"] == "q4_0-q4_0 t128"
    assert cm["kvarn5-kvarn5"]["match"] == "q8_0-q8_0 t128"
    assert cm["kvarn6-kvarn6"]["match"] is None  # below every standard row
    # presets: the cheapest matched row at or below the reference's median
    pr = {r["preset"]: (r["pair"], r["mib_saved"]) for r in presets_table(p).iter_rows(named=True)}
    assert pr == {"quality": ("kvarn5-kvarn5", pytest.approx(8.5 - 5.6, abs=1e-6)),
                  "balanced": ("kvarn4-kvarn4", pytest.approx(5.5 - 4.6, abs=1e-6)),
                  "compact": ("kvarn3-kvarn3", pytest.approx(4.5 - 3.6, abs=1e-6))}
    # strictly below the floor (0.02): kvarn6 only (kvarn5 equals it), saving 8.5 − 6.6 MiB
    bf = below_floor_table(p)
    assert bf["pair"].to_list() == ["kvarn6-kvarn6"]
    assert bf["mib_saved"][0] == pytest.approx(1.9, abs=1e-6) and bf["floor_pair"][0] == "q8_0-q8_0"


# ---------------------------------------------------------------- the advice


def arow(cell, mib, median, same_top=0.995):
    """test_advise's summary row, on this file's two chunks of N tokens."""
    return advise_row(cell, mib, median, same_top, chunks=2, n_tokens=N)


def test_the_default_tolerance_and_its_inclusive_bounds():
    assert (A.Tolerance().max_kld, A.Tolerance().min_same_top) == (0.001, 0.99)
    # q2 too damaged; q3 cheap and within median but same-top 0.985 < 0.99; q4 exactly on both bounds
    # (median 0.001, same-top 0.99) → the pick; q5 and q6 within but dearer
    s = pl.DataFrame([arow("q2_0-q2_0-t0", 2.5, 0.02), arow("q3_0-q3_0-t0", 3.5, 0.0005, 0.985),
                      arow("q4_0-q4_0-t0", 4.5, 0.001, 0.99), arow("q5_0-q5_0-t0", 5.5, 0.0004),
                      arow("q6_0-q6_0-t0", 6.5, 0.0001)])
    p = A.prepared(s, "m")
    assert A.pick(p, A.Tolerance())["cell"] == "q4_0-q4_0-t0"
    assert A.pick(p, A.Tolerance(max_kld=0.03))["cell"] == "q2_0-q2_0-t0"
    assert A.pick(p, A.Tolerance(max_kld=0.0005, min_same_top=0.98))["cell"] == "q3_0-q3_0-t0"
    assert A.pick(p, A.Tolerance(max_kld=0.0005, budget_mib=5.0)) is None  # q3 misses same-top, q5 the budget
    assert A.pick(p, A.Tolerance(max_kld=0.0005, budget_bits=5.5))["cell"] == "q5_0-q5_0-t0"  # 16·5.5/16 = 5.5 bits


def test_a_tie_in_bytes_picks_the_lower_median():
    s = pl.DataFrame([arow("q4_0-q4_0-t0", 4.5, 0.0008), arow("q4_1-q4_1-t0", 4.5, 0.0005)])
    assert A.pick(A.prepared(s, "m"), A.Tolerance())["cell"] == "q4_1-q4_1-t0"


def test_frontier_is_strictly_below_every_cheaper_cell_and_delta_is_this_minus_previous():
    # q2 0.4 at 2 MiB; q3 0.4 at 3 MiB (equal, not below: off); q4 0.1 at 4; q5 0.2 at 5 (off); q6 0.09 at 6
    rng = np.random.default_rng(8)
    base = rng.lognormal(-2, 0.5, N)
    chunk, pos = np.repeat([0, 1], N // 2), np.tile(np.arange(N // 2), 2)
    kld = {"q2_0-q2_0-t0": base + 0.3, "q3_0-q3_0-t0": base + 0.3, "q4_0-q4_0-t0": base,
           "q5_0-q5_0-t0": base + 0.1, "q6_0-q6_0-t0": base.copy()}
    mib = {"q2_0-q2_0-t0": 2, "q3_0-q3_0-t0": 3, "q4_0-q4_0-t0": 4, "q5_0-q5_0-t0": 5, "q6_0-q6_0-t0": 6}
    med = {"q2_0-q2_0-t0": 0.4, "q3_0-q3_0-t0": 0.4, "q4_0-q4_0-t0": 0.1, "q5_0-q5_0-t0": 0.2, "q6_0-q6_0-t0": 0.09}
    p = A.prepared(pl.DataFrame([arow(c, mib[c], med[c]) for c in kld]), "m")
    cells = {c: CellTokens(c, {}, chunk, pos, k, np.ones(N), np.zeros(N)) for c, k in kld.items()}
    f = A.frontier(p, cells, n_boot=200)
    assert f["cell"].to_list() == ["q2_0-q2_0-t0", "q4_0-q4_0-t0", "q6_0-q6_0-t0"]
    r = {x["cell"]: x for x in f.iter_rows(named=True)}
    # q4 − q2 = −0.3 on every token: a point interval, separable → band 2
    assert (r["q4_0-q4_0-t0"]["delta"], r["q4_0-q4_0-t0"]["delta_lo"]) == (pytest.approx(-0.3, abs=1e-12),
                                                                           pytest.approx(-0.3, abs=1e-12))
    assert (r["q4_0-q4_0-t0"]["band"], r["q4_0-q4_0-t0"]["separable"]) == (2, True)
    # q6's tokens are q4's: Δ 0, interval [0, 0] holds 0 → same band as q4
    assert (r["q6_0-q6_0-t0"]["delta"], r["q6_0-q6_0-t0"]["band"], r["q6_0-q6_0-t0"]["separable"]) == (0.0, 2, False)
