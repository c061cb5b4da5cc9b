"""kvarn.report.advise and `kvarn advise` on hand-made summaries whose answer is worked out here:
the frontier, its bands, ties, the pick within a tolerance, a budget below every cell, an engine
mix, a model with one cell, and the refusals' texts."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from kvarn.report import advise as A
from kvarn.stats.paired import CellTokens

MIB = 1 << 20
N = 600  # tokens per hand-made cell: 3 chunks of 200


def row(cell: str, mib: float, median: float, same_top: float = 0.995, model: str = "m", engine=None, **kw) -> dict:
    """One summary row of the columns `kvarn.report.data.prepare` reads (standard family unless a kvarn type)."""
    k, v, t = cell.rsplit("-", 2)[0], cell.rsplit("-", 2)[1], int(cell.rsplit("-t", 1)[1])
    fam = "kvarn" if k.startswith("kvarn") else "standard"
    total = int(mib * MIB)
    r = {"model": model, "n_ctx": 2048, "chunks": 3, "n_tokens": N, "k_type": k, "v_type": v, "tail": t,
         "tail_requested": t, "tail_eff_full": 128 if fam == "kvarn" and t == 0 else t,
         "tail_label": "128*" if fam == "kvarn" and t == 0 else str(t), "family": fam, "cell": cell,
         "kv_total_bytes": total, "kv_body_bytes": total, "kv_staging_bytes": 0, "kv_overlay_bytes": 0,
         "kv_total_bytes_tail0": total, "kv_bf16_bytes": 16 * MIB, "bits_per_value": 16 * total / (16 * MIB),
         "memory_accounting": "packed", "kld_median": median, "kld_mean": 2 * median, "kld_p99": 20 * median,
         "same_top": same_top, "ppl_ratio": 1 + median}
    if engine is not None:
        r["engine"] = engine
    return r | kw


def tokens(cell: str, median: float, seed: int) -> CellTokens:
    """A cell's tokens whose median KLD is `median` exactly-ish, on the shared (chunk, pos) grid."""
    rng = np.random.default_rng(seed)
    kld = median * rng.lognormal(0, 0.3, N)
    kld *= median / np.median(kld)
    chunk, pos = np.repeat(np.arange(3), N // 3), np.tile(np.arange(N // 3), 3)
    return CellTokens(cell, {"model": "m", "n_ctx": 2048, "chunks": 3}, chunk, pos, kld, np.ones(N), np.ones(N))


def summary(*rows) -> pl.DataFrame:
    return pl.DataFrame(list(rows), infer_schema_length=None)


# cells: (name, MiB, median); q3 is dominated (dearer and worse than q4), q6/q8 near q5 (a band)
CELLS = [("q2_0-q2_0-t0", 2.5, 0.40), ("q4_0-q4_0-t0", 4.5, 0.050), ("q3_0-q3_0-t128", 5.0, 0.20),
         ("q5_0-q5_0-t128", 5.5, 0.0100), ("q6_0-q6_0-t128", 6.5, 0.00995), ("q8_0-q8_0-t128", 8.5, 0.0099)]


def run(cells=CELLS, paired=True, seed0=0):
    """A summary of `cells` and their tokens (independent draws per cell)."""
    s = summary(*[row(c, m, med) for c, m, med in cells])
    toks = {c: tokens(c, med, seed0 + i) for i, (c, _, med) in enumerate(cells)} if paired else None
    return s, toks


def test_frontier_keeps_each_cell_below_every_cheaper_one():
    s, toks = run()
    f = A.frontier(A.prepared(s, "m"), toks, n_boot=200)
    assert f["cell"].to_list() == ["q2_0-q2_0-t0", "q4_0-q4_0-t0", "q5_0-q5_0-t128", "q6_0-q6_0-t128",
                                   "q8_0-q8_0-t128"]
    assert f["prev"].to_list() == [None, "q2_0-q2_0 t0", "q4_0-q4_0 t0", "q5_0-q5_0 t128", "q6_0-q6_0 t128"]


def test_rows_the_paired_test_cannot_separate_are_one_band():
    s, toks = run()
    f = A.frontier(A.prepared(s, "m"), toks, n_boot=200)
    # q5/q6/q8 differ by 0.5-1 % on independent draws (a median's error here is ~2 %): no interval excludes 0
    assert f["band"].to_list() == [1, 2, 3, 3, 3]
    assert f["separable"].to_list() == [None, True, True, False, False]
    d = f.filter(pl.col("cell") == "q4_0-q4_0-t0").row(0, named=True)
    assert d["delta"] == pytest.approx(0.050 - 0.40) and d["delta_hi"] < 0  # Δ = this row − the one above


def test_a_band_is_judged_against_its_cheapest_row_not_a_chain():
    # steps of 2 % each: neither step alone is separable, but q8 against q5 (4 %) is
    cells = [("q5_0-q5_0-t128", 5.5, 0.0100), ("q6_0-q6_0-t128", 6.5, 0.0098), ("q8_0-q8_0-t128", 8.5, 0.0096)]
    s = summary(*[row(c, m, med) for c, m, med in cells])
    rng = np.random.default_rng(1)
    base = np.exp(rng.normal(0, 1.0, N))
    noise = {c: np.exp(rng.normal(0, 0.05, N)) for c, _, _ in cells}
    toks = {}
    for c, _, med in cells:
        kld = base * noise[c]
        kld *= med / np.median(kld)
        toks[c] = CellTokens(c, {}, np.repeat(np.arange(3), N // 3), np.tile(np.arange(N // 3), 3), kld, np.ones(N),
                             np.ones(N))
    f = A.frontier(A.prepared(s, "m"), toks, n_boot=400)
    assert f["band"].to_list() == [1, 1, 2]  # q8 opens a band: separable from q5, the band's cheapest
    assert f["delta_hi"][2] > 0  # ... though not from q6, the row above it


def test_a_tie_in_bytes_keeps_the_lower_median_and_a_tie_in_median_the_cheaper():
    cells = [("q4_0-q4_0-t0", 4.5, 0.05), ("kvarn4-kvarn4-t0", 4.5, 0.03), ("q5_0-q5_0-t0", 5.5, 0.03)]
    s, toks = run(cells)
    f = A.frontier(A.prepared(s, "m"), toks, n_boot=200)
    assert f["cell"].to_list() == ["kvarn4-kvarn4-t0"]  # q5 equal median, dearer: not below every cheaper one


def test_without_tokens_no_band_is_claimed():
    s, _ = run(paired=False)
    f = A.frontier(A.prepared(s, "m"), None)
    assert f["separable"].to_list() == [None] * 5 and f["band"].to_list() == [1, 2, 3, 4, 5]
    a = A.answer(s, "m")
    assert any("bands" in u for u in a.unanswered)


def test_pick_is_the_cheapest_cell_within_every_bound():
    s, toks = run()
    prep = A.prepared(s, "m")
    assert A.pick(prep, A.Tolerance(max_kld=0.0101))["cell"] == "q5_0-q5_0-t128"
    assert A.pick(prep, A.Tolerance(max_kld=0.06))["cell"] == "q4_0-q4_0-t0"
    assert A.pick(prep, A.Tolerance(max_kld=0.06, budget_mib=4.0)) is None
    assert A.pick(prep, A.Tolerance(max_kld=1.0, budget_bits=3.0))["cell"] == "q2_0-q2_0-t0"
    low_top = summary(*[row(c, m, med, same_top=0.5 if c.startswith("q4") else 0.995) for c, m, med in CELLS])
    assert A.pick(A.prepared(low_top, "m"), A.Tolerance(max_kld=0.06))["cell"] == "q5_0-q5_0-t128"


def test_the_default_tolerance_is_stated_and_used():
    assert A.Tolerance() == A.Tolerance(max_kld=0.001, min_same_top=0.99)
    s, toks = run([("q8_0-q8_0-t128", 8.5, 0.0009), ("q4_0-q4_0-t0", 4.5, 0.0011)])
    a = A.answer(s, "m", cells=toks, n_boot=200)
    assert a.pick["cell"] == "q8_0-q8_0-t128"
    assert "median KLD ≤ 0.001, same-top ≥ 99 %" in A.answers_markdown([a])


def test_a_budget_below_every_cell_is_refused_naming_the_cheapest():
    s, toks = run()
    with pytest.raises(ValueError, match=r"budget 2 MiB is below every cell of m: the cheapest, q2_0-q2_0 t0, "
                                         r"takes 2\.50 MiB"):
        A.answer(s, "m", tol=A.Tolerance(budget_mib=2))
    with pytest.raises(ValueError, match=r"budget 1 bits per value is below every cell of m"):
        A.answer(s, "m", tol=A.Tolerance(budget_bits=1))


def test_an_engine_mix_is_answered_per_engine_never_pooled():
    rows = [row("q4_0-q4_0-t0", 4.5, 0.05, engine="torch"), row("q8_0-q8_0-t0", 8.5, 0.001, engine="torch"),
            row("q4_0-q4_0-t0", 4.5, 0.07, model="m-llama", engine="llama.cpp")]
    s = summary(*rows)
    answers = A.advise(s, None)
    assert [(a.model, a.engine) for a in answers] == [("m", "torch"), ("m-llama", "llama.cpp")]
    assert answers[1].frontier["kld_median"].to_list() == [0.07]
    assert "## m-llama (llama.cpp engine)" in A.answers_markdown(answers)
    same_model = summary(row("q4_0-q4_0-t0", 4.5, 0.05, engine="torch"),
                         row("q8_0-q8_0-t0", 8.5, 0.001, engine="llama.cpp"))
    assert [a.frontier.height for a in A.advise(same_model, None)] == [1, 1]


def test_a_model_with_one_cell_says_what_it_cannot_answer():
    s = summary(row("q4_0-q4_0-t128", 4.5, 0.0005))
    a = A.answer(s, "m")
    assert a.frontier["cell"].to_list() == ["q4_0-q4_0-t128"] and a.pick["cell"] == "q4_0-q4_0-t128"
    text = A.answer_markdown(a)
    assert "a frontier of one cell compares nothing" in text
    assert "preset quality (needs q8_0-q8_0 at tail 128)" in text and "preset compact" not in text


def test_presets_are_our_results_by_the_stated_rule():
    cells = [("q4_0-q4_0-t128", 4.5, 0.02), ("kvarn4-kvarn2-t0", 3.5, 0.015), ("q5_0-q5_0-t128", 5.5, 0.01),
             ("q8_0-q8_0-t128", 8.5, 0.0001)]
    s, toks = run(cells)
    a = A.answer(s, "m", cells=toks, n_boot=200)
    got = {r["preset"]: r["pair"] for r in a.presets.iter_rows(named=True)}
    assert got == {"quality": "q8_0-q8_0", "balanced": "q5_0-q5_0", "compact": "kvarn4-kvarn2"}
    assert "compact **kvarn4-kvarn2 t128\\***" in A.presets_line(a)
    assert not any("preset" in u for u in a.unanswered)


@pytest.mark.parametrize("kw, text", [
    ({"max_kld": 0}, "max_kld 0 is not accepted: give a KLD in nats > 0"),
    ({"max_kld": float("nan")}, "max_kld nan is not accepted"),
    ({"min_same_top": 1.5}, "min_same_top 1.5 is not accepted: give a fraction in [0, 1]"),
    ({"budget_mib": -1}, "budget_mib -1 is not accepted: give MiB > 0"),
    ({"budget_bits": True}, "budget_bits True is not accepted: give bits per value > 0"),
])
def test_a_bad_tolerance_is_refused_naming_the_value(kw, text):
    with pytest.raises(ValueError) as e:
        A.Tolerance(**kw)
    assert text in str(e.value)


def test_no_cells_and_an_unknown_model_are_refused():
    with pytest.raises(ValueError, match="the summary has no cells"):
        A.advise(pl.DataFrame(schema={"model": pl.String, "cell": pl.String}), None)
    s, _ = run()
    with pytest.raises(ValueError, match=r"model 'x' has no cells in this run; models present: m"):
        A.advise(s, None, models=["x"])


def test_kvarn_advise_reads_a_results_folder(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from synthetic import make_results
    from kvarn.cli import main

    make_results(tmp_path, n_ctx=256, chunks=2)
    assert main(["advise", "--results", str(tmp_path / "results"), "-m", "gemma3-270m", "--max-kld", "0.01",
                 "--min-same-top", "90", "--boot", "200"]) == 0
    out = capsys.readouterr().out
    assert "## gemma3-270m" in out and "## smollm2-135m" not in out
    assert "**Pick:" in out and "| band | cell | MiB | bits/value |" in out
    assert "not compared" not in out  # every frontier row's tokens were found under the folder
    with pytest.raises(SystemExit) as e:
        main(["advise", "--results", str(tmp_path / "nothing")])
    assert e.value.code == 2
    assert "no " in capsys.readouterr().err


def test_token_dirs_read_each_model_s_run_only(tmp_path):
    """Two runs of one model (n_ctx 256 and 512): the cells' tokens come from the larger, never the other."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from synthetic import make_results

    small = make_results(tmp_path / "a", n_ctx=256, chunks=2)
    large = make_results(tmp_path / "b", n_ctx=512, chunks=2)
    root = tmp_path / "a" / "results"
    import shutil

    for m in ("smollm2-135m", "gemma3-270m"):
        shutil.copytree(tmp_path / "b" / "results" / m / "ctx512-c2", root / m / "ctx512-c2")
    both = pl.concat([large, small], how="diagonal_relaxed")  # the smaller run last: read last, it would win
    dirs = A.token_dirs(both, root)
    assert dirs and all(d.parent.parent.name == "ctx512-c2" for d in dirs.values())


def test_the_run_line_the_presets_line_and_the_pick_without_tokens_read_in_full():
    s, _ = run()
    a = A.answer(s, "m", tol=A.Tolerance(max_kld=0.05))  # no tokens: no interval on the pick
    md = A.answer_markdown(a)
    assert ("n_ctx 2048, 3 chunks (600 scored tokens); MiB of one sequence's KV cache under the `packed` accounting; "
            "bits per value: 16 × the cell's bytes / a BF16 cache's.") in md
    assert "Presets (the study's three, by our rule: the cheapest cell at or below the median of q8_0 / q5_0 / q4_0 " \
           "at tail 128): " in md
    assert A.pick_sentence(a).endswith(f"the cheapest cell within {a.tolerance.describe()}.")
    # every frontier row's bits per value is the summary's (here bits = MiB by construction), every frame row the run's
    assert a.frontier["bits_per_value"].to_list() == a.frontier["kv_mib"].to_list()
    frame = A.frontier_frame([a])
    assert frame["n_tokens"].to_list() == [N] * frame.height and set(frame["accounting"]) == {"packed"}
