"""bench/perf/same_numbers.py: two results trees compared cell by cell (the make-run before/after table)."""

import json

import polars as pl

from bench.perf import same_numbers


def _tree(root, kld, wall, extra=None):
    d = root / "results" / "m" / "ctx64-c1" / "cells" / "q4_0-q4_0-t0"
    d.mkdir(parents=True)
    pl.DataFrame({"pos": [32, 33], "kld": kld}).write_parquet(d / "tokens.parquet")
    (d / "summary.json").write_text(json.dumps({"kld_median": kld[0], "wall_s": wall, **(extra or {})}))
    (root / "results" / "m" / "ctx64-c1" / "baseline.kvd").write_bytes(b"base")
    return root


def test_the_same_numbers_apart_from_timing(tmp_path):
    a = _tree(tmp_path / "a", [0.1, 0.2], 5.0)
    b = _tree(tmp_path / "b", [0.1, 0.2], 7.0)  # only a timing key differs
    rows, tally = same_numbers.compare(a, b)
    assert rows == [["m/ctx64-c1/cells/q4_0-q4_0-t0", "yes", "yes", "—", "0.1", "0.1"]]
    assert tally["same_summary"] == 1 and tally["baselines"] == [("m/ctx64-c1/baseline.kvd", True)]
    assert same_numbers.main([str(a), str(b)]) == 0


def test_a_changed_number_or_key_is_named(tmp_path):
    a = _tree(tmp_path / "a", [0.1, 0.2], 5.0)
    b = _tree(tmp_path / "b", [0.1, 0.25], 5.0, extra={"k_type": "q4_0"})
    (b / "results" / "m" / "ctx64-c1" / "baseline.kvd").write_bytes(b"other")
    rows, tally = same_numbers.compare(a, b)
    assert rows[0][1:4] == ["no", "no", "k_type"]
    assert tally["baselines"] == [("m/ctx64-c1/baseline.kvd", False)]
    out = tmp_path / "t.md"
    assert same_numbers.main([str(a), str(b), "--out", str(out)]) == 1
    assert "DIFFERENT bytes" in out.read_text() and "0 with equal summaries" in out.read_text()
