"""bench.study.compare: the two-machine comparison of `make study` reads verdict flips and median
spreads right, on hand-made ledgers and summaries."""

import polars as pl
import pytest

from bench.study import compare as S


def _ledger(verdicts):
    return pl.DataFrame([{"model": m, "claim_id": c, "claim": f"claim {c}", "verdict": v} for m, c, v in verdicts])


def _summary(rows):
    return pl.DataFrame([{"model": m, "n_ctx": 2048, "chunks": 3, "cell": c, "kld_median": x} for m, c, x in rows])


def test_verdicts_equal_and_a_flip():
    a = _ledger([("m", "x", "holds"), ("m", "y", "holds"), ("n", "x", "does not hold")])
    b = _ledger([("m", "x", "holds"), ("m", "y", "does not hold"), ("n", "x", "does not hold")])
    v = S.verdicts(a, b).sort(["model", "claim_id"])
    assert v["equal"].to_list() == [True, False, True]
    # a row in one ledger only is not equal
    v2 = S.verdicts(a, a.filter(pl.col("claim_id") == "x"))
    assert v2.filter(pl.col("claim_id") == "y")["equal"].to_list() == [False]


def test_median_spread_by_hand():
    a = _summary([("m", "q4_0-q4_0-t0", 0.10), ("m", "q8_0-q8_0-t0", 0.010), ("m", "only-a", 1.0),
                  ("n", "q4_0-q4_0-t0", 0.20)])
    b = _summary([("m", "q4_0-q4_0-t0", 0.11), ("m", "q8_0-q8_0-t0", 0.0095), ("n", "q4_0-q4_0-t0", 0.20)])
    m = S.medians(a, b)
    assert m.height == 3  # only-a is in one run only
    s = {r["model"]: r for r in S.spread(m).iter_rows(named=True)}
    assert s["m"]["cells"] == 2 and s["m"]["max_rel"] == pytest.approx(0.10) and s["m"]["max_cell"] == "q4_0-q4_0-t0"
    assert s["m"]["median_rel"] == pytest.approx((0.10 + 0.05) / 2)
    assert s["n"]["max_rel"] == 0.0


def test_report_and_exit_status(tmp_path):
    for name, verdict, med in (("a", "holds", 0.1), ("b", "does not hold", 0.12)):
        d = tmp_path / name
        d.mkdir()
        _ledger([("m", "x", verdict)]).write_parquet(d / "claims.parquet")
        _summary([("m", "c", med)]).write_parquet(d / "summary.parquet")
    assert S.main([str(tmp_path / "a"), str(tmp_path / "a"), "--out", str(tmp_path / "same.md")]) == 0
    assert "Every verdict equal: yes" in (tmp_path / "same.md").read_text()
    assert S.main([str(tmp_path / "a"), str(tmp_path / "b"), "--label-a", "AVX-512", "--label-b", "AVX2",
                   "--out", str(tmp_path / "diff.md")]) == 1
    text = (tmp_path / "diff.md").read_text()
    assert "Every verdict equal: no" in text and "| m | claim x | holds | does not hold |" in text
    assert "| m | 1 | 20.00 % | 20.00 % | c |" in text
    with pytest.raises(SystemExit, match="claims.parquet: missing"):
        S.main([str(tmp_path / "a"), str(tmp_path / "nowhere")])
