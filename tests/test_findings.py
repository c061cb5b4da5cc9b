"""kvarn.report.findings: the README's plain findings, worked by hand from a hand-made answer and
ledger, and the README's block against the committed answer and ledger."""

from __future__ import annotations

import sys

import polars as pl

from kvarn.report import findings as F
from kvarn.report.advise import ANSWER_SCHEMA, FRONTIER_COLUMNS
from kvarn.report.claims.verdicts import LEDGER_COLUMNS
from paths import REPO as ROOT


def answer_rows(model="m"):
    run = {"model": model, "engine": "torch", "n_ctx": 2048, "chunks": 3, "n_tokens": 3069, "accounting": "packed",
           "max_kld": 0.001, "min_same_top": 0.99}
    cells = [("frontier", "q2_0-q2_0 t128", 1, 2.7, 0.2), ("frontier", "kvarn4-kvarn2 t128*", 2, 3.9, 0.01),
             ("frontier", "q8_0-q8_0 t128", 3, 8.6, 0.0001), ("frontier", "kvarn8-kvarn8 t128*", 3, 8.8, 0.00009),
             ("pick", "q8_0-q8_0 t128", 3, 8.6, 0.0001), ("preset:quality", "q8_0-q8_0 t128", None, 8.6, 0.0001),
             ("preset:compact", "kvarn4-kvarn2 t128*", None, 3.9, 0.01)]
    rows = [{**dict.fromkeys(FRONTIER_COLUMNS), **run, "role": role, "name": name, "cell": name, "band": band,
             "kv_mib": 2 * bits, "bits_per_value": bits, "kld_median": med, "kld_mean": 2 * med, "kld_p99": 9 * med,
             "same_top": 0.995, "ppl_ratio": 1.001} for role, name, band, bits, med in cells]
    return pl.DataFrame(rows, schema=ANSWER_SCHEMA)


def ledger_rows(model="m"):
    def r(cid, ours, verdict, lo=None, hi=None):
        return {**dict.fromkeys(LEDGER_COLUMNS), "model": model, "study_model": "qwen3.6-27b", "claim_id": cid,
                "claim": cid, "origin": "study", "study_text": "x", "ours": ours, "verdict": verdict,
                "delta": None if lo is None else (lo + hi) / 2, "delta_lo": lo, "delta_hi": hi, "missing": "", "note": ""}
    rows = [r("same_width_gain_2", 40.0, "holds", -0.3, -0.1), r("same_width_gain_4", 5.0, "not separable", -0.1, 0.1),
            r("same_width_gain_8", -20.0, "does not hold", 0.01, 0.02), r("same_width_gain_3", None, "not measurable"),
            r("tail_effect_2", -60.0, "holds", -1, -0.5), r("tail_effect_8", 2.0, "not separable", -0.1, 0.2),
            r("tail_effect_order", 58.0, "holds")]
    return pl.DataFrame(rows, schema={c: pl.Float64 if c in ("study", "ours", "delta", "delta_lo", "delta_hi")
                                      else pl.String for c in LEDGER_COLUMNS})


def test_same_width_reads_the_sign_and_the_interval():
    s = F.same_width_sentence(ledger_rows())
    assert s == ("Against the standard type of the same width at tail 128, KVarN (at its 128\\* tail) has the lower "
                 "median KLD at 2 bits (+40 %); the higher at 8 bits; no separable difference at 4 bits.")


def test_tail_sentence_gives_each_width_its_change_and_separability():
    assert F.tail_sentence(ledger_rows()) == ("A 128-token exact tail changes the median KLD: q2_0's by -60 %, "
                                              "q8_0's by +2 % (not separable).")


def test_a_model_s_findings_are_at_most_twelve_lines_then_its_scoreboard():
    lines = F.model_findings("m", answer_rows(), ledger_rows())
    table = lines.index("| band | cell | MiB | bits/value | median KLD | mean KLD | p99 KLD | same-top | PPL ratio |")
    assert table <= 12
    assert lines[0].startswith("**m** (torch engine, n_ctx 2048, 3 chunks, 3069 scored tokens")
    assert "- **The pick** (median KLD ≤ 0.001 and same-top ≥ 99 %): **q8_0-q8_0 t128**, 17.20 MiB" in lines[2]
    assert "4 cells in 3 bands" in lines[3] and "KVarN cells on the frontier: 2 of 4" in lines[4]
    assert "quality **q8_0-q8_0 t128** (17.20 MiB); compact **kvarn4-kvarn2 t128\\*** (7.80 MiB)" in lines[5]
    rows = [ln for ln in lines[table + 2:] if ln.startswith("| ")]
    assert [ln.split(" | ")[1] for ln in rows] == ["q2_0-q2_0 t128", "kvarn4-kvarn2 t128\\*", "q8_0-q8_0 t128",
                                                   "kvarn8-kvarn8 t128\\*"]


def test_no_pick_is_said_plainly():
    a = answer_rows().filter(pl.col("role") != "pick")
    assert "- No cell of this run is within median KLD ≤ 0.001 and same-top ≥ 99 %." in F.model_findings(
        "m", a, ledger_rows())


def test_the_readme_findings_block_is_the_committed_answer_and_ledger():
    """The README's plain findings are docs/figures/answer.parquet and claims.parquet rendered."""
    sys.path.insert(0, str(ROOT / "tools"))
    import readme_figures as R

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split(R.FINDINGS_BEGIN)[1].split(R.FINDINGS_END)[0]
    frame = pl.read_parquet(ROOT / "docs" / "figures" / "answer.parquet")
    ledger = pl.read_parquet(ROOT / "docs" / "figures" / "claims.parquet")
    assert block == "\n" + F.findings_markdown(frame, ledger)
    assert set(frame["model"]) == {"smollm2-135m", "gemma3-270m"}
    assert len(readme.splitlines()) <= 300


def test_a_gain_without_an_interval_counts_by_its_sign_and_zero_is_no_difference():
    # no tokens, no interval: a positive gain is KVarN's, a gain of exactly 0 is neither side's
    def r(cid, ours):
        return {**dict.fromkeys(LEDGER_COLUMNS), "model": "m", "claim_id": cid, "claim": cid, "ours": ours,
                "verdict": "holds", "missing": "", "note": ""}
    led = pl.concat([ledger_rows(), pl.DataFrame([r("same_width_gain_6", 10.0), r("same_width_gain_5", 0.0)],
                                                 schema=ledger_rows().schema)])
    assert F.same_width_sentence(led) == (
        "Against the standard type of the same width at tail 128, KVarN (at its 128\\* tail) has the lower median "
        "KLD at 2, 6 bits (+40 %, +10 %); the higher at 8 bits; no separable difference at 4, 5 bits.")


def test_a_frontier_without_kvarn_says_none_and_lists_nothing():
    a = answer_rows().filter(~pl.col("name").str.starts_with("kvarn"))
    lines = F.model_findings("m", a, ledger_rows())
    assert "- KVarN cells on the frontier: 0 of 2." in lines


def test_the_readme_retrieval_block_is_the_committed_retrieval_study():
    """The README's retrieval paragraph is docs/figures/retrieval/comparisons.parquet rendered
    (kvarn.retrieval.headline), not typed."""
    sys.path.insert(0, str(ROOT / "tools"))
    import readme_figures as R

    from kvarn.retrieval import headline

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split(R.RETRIEVAL_BEGIN)[1].split(R.RETRIEVAL_END)[0]
    comparisons = pl.read_parquet(ROOT / "docs" / "figures" / "retrieval" / "comparisons.parquet")
    assert set(comparisons["model"]) == {"smollm2-135m", "gemma3-270m"}
    assert block == "\n" + headline.sentences(comparisons) + "\n"
    assert "after Holm" in block and "Caveat:" in block and "small models" in block
