"""kvarn.retrieval: long-context retrieval through the cache model (docs/notes/retrieval.md).

Fast: the scorer's arithmetic against hand-worked cases (Wilson intervals, exact McNemar, flips,
the exact-tail rule, the pairs compared), the plan's checks and its job count. With the embedded
SmolLM2 tokenizer: the generator is seeded and puts the needle's tokens at the requested depth.
Slow (the embedded SmolLM2 at 320 tokens): a cache whose body holds nothing (every row outside the
exact tail read back as zeros) loses a needle outside its tail, which the exact cache finds. A dry
run of config/retrieval.yaml plans the expected jobs.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from kvarn.retrieval import plan, score, tasks
from paths import CACHE_DIR

pytestmark = pytest.mark.xdist_group("retrieval")
ROOT = Path(__file__).resolve().parents[1]
SMOL = ("smollm2-135m", "embedded:smollm2-135m")


# ---------------------------------------------------------------- the scorer, by hand


def test_read_answer():
    assert score.read_answer(" 82484. Remember") == "82484"
    assert score.read_answer(" the pass key is 1 2") == "1"
    assert score.read_answer(" no digits\n") == "no digits"


def test_wilson_by_hand():
    # k = 5 of n = 10, z = 1.959964: (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)
    z = 1.959963984540054
    p, n = 0.5, 10
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo, hi = score.wilson(5, 10)
    assert (lo, hi) == pytest.approx((centre - half, centre + half), abs=1e-12)
    assert (lo, hi) == pytest.approx((0.2365931, 0.7634069), abs=1e-6)
    lo, hi = score.wilson(0, 5)  # all wrong: 0 and z²/(n + z²) = 3.8415/8.8415
    assert lo == pytest.approx(0, abs=1e-12) and hi == pytest.approx(0.4344825, abs=1e-6)
    assert all(math.isnan(x) for x in score.wilson(0, 0))
    with pytest.raises(ValueError, match="successes must be in 0..3, got 4"):
        score.wilson(4, 3)


def test_mcnemar_exact_by_hand():
    # 0/5 discordant pairs the other way: p = 2 * 0.5^5 = 0.0625
    t = score.mcnemar([1] * 5 + [1, 1, 0], [0] * 5 + [1, 1, 0])
    assert (t["n"], t["a_only"], t["b_only"]) == (8, 5, 0) and t["p"] == pytest.approx(0.0625, abs=1e-12)
    # 1 vs 5: p = 2 * P(X <= 1 | 6, 1/2) = 2 * 7/64
    t = score.mcnemar([1, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1])
    assert (t["a_only"], t["b_only"]) == (1, 5) and t["p"] == pytest.approx(14 / 64, abs=1e-12)
    # 3 vs 3: p = 1 (capped); no discordant pair: p = 1
    assert score.mcnemar([1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1])["p"] == pytest.approx(1.0)
    assert score.mcnemar([1, 0], [1, 0])["p"] == 1.0
    with pytest.raises(ValueError, match="differ in length"):
        score.mcnemar([1], [1, 0])


def _answers(rows):
    """Answer rows of one model, context 100, gen 8: (cell, id, given, answer, needle_start)."""
    return pl.DataFrame([{"model": "m", "context": 100, "task": "passkey", "id": i, "cell": c, "given": g,
                          "answer": a, "correct": g == a, "needle_start": s, "needle_end": s + 10, "n_prompt": 92, "gen_tokens": 8,
                          "distance": 92 - s - 10} for c, i, g, a, s in rows])


def test_cell_scores_flips_and_agreement_by_hand():
    base, q4, kv = "bf16-bf16-t0", "q4_0-q4_0-t128", "kvarn4-kvarn4-t0"
    rows = [(base, "a", "1", "1", 10), (base, "b", "2", "2", 10), (base, "c", "9", "3", 10), (base, "d", "9", "4", 10),
            (q4, "a", "1", "1", 10), (q4, "b", "7", "2", 10), (q4, "c", "3", "3", 10), (q4, "d", "9", "4", 10),
            (kv, "a", "1", "1", 10), (kv, "b", "2", "2", 10), (kv, "c", "9", "3", 10), (kv, "d", "8", "4", 10)]
    s = {r["cell"]: r for r in score.cell_scores(_answers(rows)).iter_rows(named=True)}
    assert (s[base]["correct"], s[base]["agree"], s[base]["lost"], s[base]["gained"]) == (2, 4, 0, 0)
    # q4_0: right on a and c; b lost (base right), c gained (base wrong); agrees on a and d
    assert (s[q4]["correct"], s[q4]["accuracy"], s[q4]["agree"], s[q4]["lost"], s[q4]["gained"]) == (2, 0.5, 2, 1, 1)
    # kvarn4: the same correctness as the base, but d answered differently (both wrong): agreement 3/4
    assert (s[kv]["correct"], s[kv]["agreement"], s[kv]["lost"], s[kv]["gained"]) == (2, 0.75, 0, 0)
    assert (s[q4]["acc_lo"], s[q4]["acc_hi"]) == pytest.approx(score.wilson(2, 4))
    assert s[kv]["label"] == "kvarn4 128*" and s[q4]["label"] == "q4_0 t128" and s[base]["label"] == "bf16 (exact)"
    c = score.comparisons(_answers(rows)).row(0, named=True)
    assert (c["a"], c["b"], c["kind"], c["a_only"], c["b_only"]) == (kv, q4, "kvarn vs standard", 1, 1)
    assert c["p"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no baseline rows"):
        score.cell_scores(_answers(rows[4:]))
    with pytest.raises(ValueError, match="without a baseline answer to the same prompt: m d"):
        score.cell_scores(_answers(rows[:3] + rows[4:]))


def test_pairs_compared():
    cells = ["bf16-bf16-t0", "q4_0-q4_0-t0", "q4_0-q4_0-t128", "kvarn4-kvarn4-t0", "kvarn2-kvarn2-t0",
             "q2_0-q2_0-t128", "q8_0-q8_0-t0"]
    assert score.pairs_of(cells) == [("kvarn2-kvarn2-t0", "q2_0-q2_0-t128", "kvarn vs standard"),
                                     ("kvarn4-kvarn4-t0", "q4_0-q4_0-t128", "kvarn vs standard"),
                                     ("q4_0-q4_0-t0", "q4_0-q4_0-t128", "tail 0 vs 128")]


def test_exact_tail_rule_by_hand():
    # the last answering query sits at n_prompt + gen_tokens - 2 = 98; tail 128 covers keys > 98 - 128
    assert score.in_exact_tail("q4_0-q4_0-t128", 0, 92, 8)
    assert not score.in_exact_tail("q4_0-q4_0-t0", 90, 92, 8)  # tail 0: nothing is exact
    # n_prompt 992, gen 8: the last query at 998 reads key 871 at distance 127 (exact), 870 at 128 (body)
    assert score.in_exact_tail("q4_0-q4_0-t128", 871, 992, 8)
    assert not score.in_exact_tail("q4_0-q4_0-t128", 870, 992, 8)
    assert score.in_exact_tail("kvarn4-kvarn4-t0", 871, 992, 8)  # 128*
    assert not score.in_exact_tail("kvarn4-kvarn4-t0", 870, 992, 8)
    assert score.in_exact_tail("kvarn4-kvarn4-t200", 743, 992, 8)  # 200 -> 256 exact: 998 - 743 = 255
    assert not score.in_exact_tail("kvarn4-kvarn4-t200", 742, 992, 8)
    assert score.in_exact_tail("bf16-bf16-t0", 0, 992, 8)  # a float cache has no body to lose
    base, q4 = "bf16-bf16-t0", "q4_0-q4_0-t128"
    rows = [(base, "a", "1", "1", 10), (base, "b", "2", "2", 85), (q4, "a", "5", "1", 10), (q4, "b", "3", "2", 85)]
    t = score.exact_tail(_answers(rows)).row(0, named=True)
    assert (t["cell"], t["position"], t["n"], t["base_correct"], t["correct"], t["lost"]) == (q4, "tail", 2, 2, 0, 2)


def test_by_distance_bins():
    base = "bf16-bf16-t0"
    # distances 92 - start - 10: 2, 72, and 50 (a bin's lower edge is in the bin), 49
    rows = [(base, "a", "1", "1", 80), (base, "b", "0", "2", 10), (base, "c", "3", "3", 32), (base, "d", "4", "4", 33)]
    d = score.by_distance(_answers(rows), edges=(0, 50, 100))
    assert d.select("bin", "n", "correct").rows() == [("0–49", 2, 2), ("50–99", 2, 1)]
    assert d["mean_distance"].to_list() == [25.5, 61.0] and d["accuracy"].to_list() == [1.0, 0.5]


# ---------------------------------------------------------------- the generator


@pytest.fixture(scope="module")
def smol_tokenizer():
    from kvarn.retrieval.run import load_tokenizer
    from kvarn.weights.sources import ModelSpec

    return load_tokenizer(ModelSpec(*SMOL), CACHE_DIR)


@pytest.mark.parametrize("task", tasks.LEGACY_TASKS)  # RULER's: tests/test_retrieval_ruler.py
def test_tasks_are_seeded_and_the_needle_sits_at_its_depth(smol_tokenizer, task):
    tok, bos = smol_tokenizer
    depths = [0.0, 0.5, 1.0]
    recs = tasks.make_tasks(tok, bos, task, 600, depths, 2, seed=3, gen_tokens=8)
    again = tasks.make_tasks(tok, bos, task, 600, depths, 2, seed=3, gen_tokens=8)
    other = tasks.make_tasks(tok, bos, task, 600, depths, 2, seed=4, gen_tokens=8)
    assert recs == again
    assert [r["answer"] for r in recs] != [r["answer"] for r in other]
    assert len({r["answer"] for r in recs}) == len(recs)  # every prompt its own key
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prefix = len(enc(tasks.INTRO[task]))
    for r in recs:
        ids = r["input_ids"]
        assert len(ids) == r["n_prompt"] == 592
        needle = enc(tasks.needle_text(task, r["key"], r["answer"]))
        assert ids[r["needle_start"] : r["needle_end"]] == needle  # the span holds the asked needle's tokens
        assert r["answer"] in tok.decode(needle) and r["distance"] == 592 - r["needle_end"]
        # the candidates of the continuous measure: the asked value first, then every other value stated
        assert r["candidates"][0] == r["answer"] and len(set(r["candidates"])) == len(r["candidates"]) == r["n_keys"]
        assert all(v in r["prompt"] for v in r["candidates"])
        assert r["candidate_ids"] == [enc(" " + v) for v in r["candidates"]]
        question = enc(tasks.question_text(task, r["key"]))
        assert ids[-len(question):] == question
        hay = 592 - prefix - len(question)
        # the needle starts within one filler unit (<= 8 tokens) of depth x (haystack - needle)
        # for the single key; with distractors, within one unit plus the needles before it
        slack = 8 + (0 if task == "passkey" else sum(
            len(enc(tasks.needle_text(task, "x" * 12, "00000"))) for _ in range(r["n_keys"] - 1)))
        assert abs(r["needle_start"] - prefix - r["depth"] * (hay - len(needle))) <= slack, r["id"]
        if task == "passkey" and r["depth"] == 0.0:
            assert r["needle_start"] == prefix
        if r["depth"] == 1.0:
            assert r["needle_end"] == 592 - len(question)  # right before the question
    if task != "passkey":  # the other keys are there too, each once, none the asked one's value
        for r in recs:
            text = tok.decode(r["input_ids"])
            values = re.findall(r"\b\d{5}\b", text)  # a multikey needle states its value twice, a record once
            assert len(values) == (2 if task == "multikey" else 1) * r["n_keys"] and values.count(r["answer"]) == len(values) // r["n_keys"]
    with pytest.raises(ValueError, match="retrieval depths must be a non-empty list of numbers in \\[0, 1\\], got \\[1.5\\]"):
        tasks.make_tasks(tok, bos, task, 600, [1.5], 1)
    with pytest.raises(ValueError, match="retrieval task 'needle' is unknown; accepted: passkey, multikey, kv, niah_single_1, "):
        tasks.make_tasks(tok, bos, "needle", 600, [0.5], 1)
    with pytest.raises(ValueError, match="use a larger context"):
        tasks.make_tasks(tok, bos, task, 72, [0.5], 1)


# ---------------------------------------------------------------- a cache that drops the needle


@pytest.mark.slow
def test_a_cache_whose_body_is_empty_loses_the_needle_the_exact_cache_finds(smol_tokenizer, monkeypatch):
    """Every body row read back as zeros (the cell's exact tail and nothing else survives): the
    needle at depth 0 (≈ 270 tokens before the question) is in no exact copy, so its digits are
    nowhere in what attention reads and cannot be answered (but by a 1-in-10^5 guess); the exact
    cache answers the same prompts."""
    import kvarn.kvcache.cache as C
    from kvarn.retrieval import run
    from kvarn.vocab.cell import CellSpec
    from kvarn.weights.sources import ModelSpec

    tok, bos = smol_tokenizer
    # seed 2: prompts the exact cache answers (task version 2; at seed 0 it misses the multi-key one)
    recs = [r for t in ("passkey", "multikey") for r in tasks.make_tasks(tok, bos, t, 320, [0.0], 1, seed=2)]
    lm = run.load_model(ModelSpec(*SMOL), CACHE_DIR)
    exact = run.answer_records(lm, recs, CellSpec.from_name(score.BASELINE_CELL))
    assert all(a["correct"] for a in exact), [a["text"] for a in exact]
    cell = CellSpec.from_name("q4_0-q4_0-t128")
    assert not any(score.in_exact_tail(cell.name, r["needle_start"], r["n_prompt"], r["gen_tokens"]) for r in recs)
    kept = run.answer_records(lm, recs, cell)

    real = C.make_format

    class Emptied:  # the format, but its body rows come back as zeros
        def __init__(self, fmt):
            self._fmt = fmt

        def __getattr__(self, name):  # not for _fmt or dunders: copy.deepcopy (the candidates' cache copies)
            if name == "_fmt" or name.startswith("__"):
                raise AttributeError(name)
            return getattr(self._fmt, name)

        def roundtrip(self, x):
            return x * 0

    monkeypatch.setattr(C, "make_format", lambda *a, **k: Emptied(real(*a, **k)))
    dropped = run.answer_records(lm, recs, cell)
    assert not any(a["correct"] for a in dropped), [a["text"] for a in dropped]
    assert all(a["given"] not in r["prompt"] for a, r in zip(dropped, recs) if a["given"].isdigit() and len(a["given"]) == 5)
    # the q4_0 body itself (not emptied) still holds the needle on these short prompts
    assert all(a["correct"] for a in kept), [a["text"] for a in kept]


# ---------------------------------------------------------------- the plan


def _config():
    return yaml.safe_load((ROOT / "config" / "retrieval.yaml").read_text())


def test_plan_of_the_default_config_and_its_checks():
    cfg = _config()
    r = plan.expand(cfg, ["smollm2-135m", "gemma3-270m"])
    m = r.models["smollm2-135m"]
    assert m.cells[0] == score.BASELINE_CELL and len(m.cells) == 6 and m.contexts == (256, 512)
    assert len(r.task_files()) == 2 * 2 * 2 and len(r.answer_files()) == 2 * 2 * 6 * 2
    assert r.answer_files("gemma3-270m", 512, "kvarn4-kvarn4-t0") == [
        f"results/retrieval/gemma3-270m/ctx512/{t}/kvarn4-kvarn4-t0.jsonl" for t in ("niah_single_2", "niah_single_3")]
    assert r.n_jobs() == 8 + 24 + 2
    assert r.threads == 1 and r.hold_gpu is False  # a CPU run: one-thread cell jobs side by side
    assert plan.expand({}, []) is None
    assert plan.targets(r) == list(plan.report_files().values())
    with pytest.raises(plan.RetrievalError, match="this config has no `retrieval:` key; run it with --configfile"):
        plan.targets(None)
    bad = [({"cells": ["q4_0-q4_0-t7x"]}, r"retrieval.cells\[0\]: 'q4_0-q4_0-t7x' is not a cell name"),
           ({"depths": [0.5, 2]}, r"retrieval.depths\[1\]: a depth must be a number in \[0, 1\] .*got 2"),
           ({"tasks": ["haystack"]}, r"retrieval.tasks\[0\]: unknown task 'haystack'; accepted: passkey, multikey, kv"),
           ({"models": [{"name": "qwen", "contexts": [1024]}]}, r"retrieval.models\[0\].name: 'qwen' is not a model"),
           ({"models": [{"name": "smollm2-135m", "contexts": [10]}]}, r"retrieval.models\[0\].contexts\[0\]: must be an integer >= 72"),
           ({"prompt": 3}, r"retrieval.prompt: unknown key; accepted: "),
           ({"distance_bins": [5, 10]}, r"retrieval.distance_bins: must be increasing integers starting at 0")]
    for change, msg in bad:
        with pytest.raises(plan.RetrievalError, match=msg):
            plan.expand({"retrieval": {**cfg["retrieval"], **change}}, ["smollm2-135m", "gemma3-270m"])


def _dry(configfile: str, target: str) -> str:
    p = subprocess.run([sys.executable, "-m", "snakemake", target, "-n", "--forceall", "--workflow-profile", "none",
                        "--configfile", configfile], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def _counts(text: str) -> dict[str, int]:
    return {r: int(n) for r, n in re.findall(r"^(retrieval\w*)\s+(\d+)\s*$", text, flags=re.M)}


@pytest.mark.slow
def test_dry_run_plans_the_default_retrieval_run():
    """snakemake -n retrieval (everything forced): 8 task files (2 models x 2 contexts x 2 tasks),
    24 cell jobs (2 models x 2 contexts x (baseline + 5 cells)), the report and the target; the
    cell jobs hold no `gpu` (retrieval.hold_gpu false), so --cores 2 runs two at once."""
    out = _dry("config/retrieval.yaml", "retrieval")
    assert _counts(out) == {"retrieval_tasks": 8, "retrieval_cell": 24, "retrieval_report": 1, "retrieval": 1}
    cell_jobs = re.findall(r"^rule retrieval_cell:.*?^\s+resources: (.*?)$", out, flags=re.M | re.S)
    assert len(cell_jobs) == 24 and all(r.endswith("gpu=0") for r in cell_jobs), cell_jobs
