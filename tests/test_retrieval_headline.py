"""kvarn.retrieval.headline: the README's retrieval sentences, on a hand-made comparisons table where
each plausible slip (the direction read from the wrong sign, the unadjusted p read, a missing p
counted, the threshold at ≤ instead of <) changes the words."""

import math

import polars as pl
import pytest

from kvarn.retrieval import headline


def _comparisons():
    # four runs of one pair, two of another; columns as kvarn.retrieval.report writes comparisons.parquet
    rows = [  # a, b, dlogprob, p_dlogprob, p_dlogprob_holm, a_only, b_only, p, p_holm
        ("kvarn4 128*", "q4_0 t128", +0.50, 0.001, 0.010, 3, 0, 0.01, 0.04),    # better on both
        ("kvarn4 128*", "q4_0 t128", +0.20, 0.001, 0.049, 0, 4, 0.001, 0.03),   # log-prob better, right/wrong worse
        ("kvarn4 128*", "q4_0 t128", -0.30, 0.001, 0.020, 2, 1, 0.001, 0.05),   # log-prob worse; p_holm = alpha: not
        ("kvarn4 128*", "q4_0 t128", +0.90, 0.001, 0.060, 5, 0, 0.02, math.nan),  # unadjusted p small, Holm not; no test
        ("q4_0 t0", "q4_0 t128", -1.00, 0.01, 0.02, 0, 0, 1.0, None),
        ("q4_0 t0", "q4_0 t128", -2.00, 0.01, 0.03, 1, 6, 0.01, 0.04),
    ]
    cols = ["a_label", "b_label", "dlogprob", "p_dlogprob", "p_dlogprob_holm", "a_only", "b_only", "p", "p_holm"]
    frame = pl.DataFrame([dict(zip(cols, r)) for r in rows], schema_overrides={"p_holm": pl.Float64})
    # two small models, two lengths: the caveat names them from the table
    return frame.with_columns(model=pl.Series(["small-a", "small-b"] * 3), context=pl.Series([256, 512] * 3))


def test_tally_counts_each_direction_after_holm():
    t = headline.tally(_comparisons())
    assert [(x["a"], x["b"], x["runs"]) for x in t] == [("kvarn4 128*", "q4_0 t128", 4), ("q4_0 t0", "q4_0 t128", 2)]
    assert t[0]["logprob"] == {"better": 2, "worse": 1} and t[0]["gain"] == (0.20, 0.50)
    assert t[0]["right"] == {"better": 1, "worse": 1}
    assert t[1]["logprob"] == {"better": 0, "worse": 2} and "gain" not in t[1]
    assert t[1]["right"] == {"better": 0, "worse": 1}


def test_the_sentences_say_it_in_words():
    text = headline.sentences(_comparisons())
    assert text == (
        "Retrieval (RULER needles at 256–512 tokens, docs/notes/retrieval.md), paired on the same prompts, "
        "significant at 5 % after Holm across each (model, length) run's tests: "
        "kvarn4 128\\* against q4_0 t128: on the answer's log-prob better in 2, worse in 1, no significant difference "
        "in 1 of 4 runs (+0.20 to +0.50 nats), on right/wrong better in 1, worse in 1, no significant difference in 2 "
        "of 4; q4_0 t0 against q4_0 t128: on the answer's log-prob worse in 2 of 2 runs, on right/wrong worse in 1, "
        "no significant difference in 1 of 2. Caveat: small-a, small-b are small models at short contexts "
        "(256, 512 tokens); a format that keeps their answers may still lose a fact at 16k–64k tokens in a 27–31B "
        "model, and the reverse (config/retrieval-gpu.yaml is the run sized for that).")


def test_one_gain_and_one_length():
    one = _comparisons().head(1)  # one run: small-a at 256 tokens
    text = headline.sentences(one)
    assert "RULER needles at 256 tokens" in text and "better in 1 of 1 runs (+0.50 nats)" in text


def test_an_empty_table_is_refused():
    with pytest.raises(ValueError, match=r"^the retrieval comparisons table is empty: run the retrieval target first "
                                         r"\(snakemake retrieval --configfile config/retrieval\.yaml\)$"):
        headline.sentences(_comparisons().head(0))


def test_a_significant_test_without_a_direction_counts_neither_way():
    """A difference of exactly zero (Δ log p 0, as many prompts only a as only b) is neither better nor worse,
    whatever its p."""
    row = _comparisons().head(1).with_columns(dlogprob=pl.lit(0.0), a_only=pl.lit(2), b_only=pl.lit(2),
                                              p_dlogprob_holm=pl.lit(0.001), p_holm=pl.lit(0.001))
    t = headline.tally(row)[0]
    assert t["logprob"] == t["right"] == {"better": 0, "worse": 0} and "gain" not in t


def test_the_level_and_the_lengths_are_the_table_s():
    """`alpha` reaches the tally (at 4.5 % the log-prob test at 0.049 no longer counts: 2 better at 5 %, 1 here), and
    the span runs from the shortest to the longest of three lengths."""
    three = _comparisons().with_columns(context=pl.Series([256, 1024, 512] * 2))
    text = headline.sentences(three, alpha=0.045)
    assert text.startswith("Retrieval (RULER needles at 256–1024 tokens, docs/notes/retrieval.md), paired on the same "
                           "prompts, significant at 4.5 % after Holm")
    assert ("on the answer's log-prob better in 1, worse in 1, no significant difference in 2 of 4 runs (+0.50 nats), "
            "on right/wrong better in 1, worse in 1, no significant difference in 2 of 4") in text
    assert "(256, 512, 1024 tokens)" in text


def test_pairs_keep_the_table_s_order():
    """The pairs are told in the order the table first lists them (the report's order), not a hash's."""
    names = [f"kvarn{i} 128*" for i in reversed(range(40))]
    rows = pl.concat([_comparisons().head(1).with_columns(a_label=pl.lit(n)) for n in names * 2])
    assert [t["a"] for t in headline.tally(rows)] == names
