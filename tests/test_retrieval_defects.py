"""kvarn.retrieval: the defects of issue 53, item 5, each pinned by a test that failed before its fix.

* the report's teacher-forced summary (results/summary.parquet) is a declared input of the report rule;
* scores are grouped by context length, never pooled across lengths;
* the needle's position accounts for KVarN's 128-token sink on full-attention layers (sink / tail / body);
* `correct` is recomputed from the stored generated text by the current answer reader at report time;
* the prompt seed comes from the (task, length, depth, prompt index) values, not from list positions.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("retrieval")
ROOT = Path(__file__).resolve().parents[1]


def _dry(target: str) -> str:
    p = subprocess.run([sys.executable, "-m", "snakemake", target, "-n", "--forceall", "--workflow-profile", "none",
                        "--configfile", "config/retrieval.yaml"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def test_the_teacher_forced_summary_is_a_declared_input_of_the_report():
    """The report reads results/summary.parquet for the median-KLD ordering: snakemake must make it
    (rule summary, from the same cells teacher-forced) before the report and rerun the report after it."""
    out = _dry("results/retrieval/retrieval.md")
    block = out[out.index("rule retrieval_report:"):]
    inputs = re.search(r"^\s+input: (.*)$", block, flags=re.M).group(1).split(", ")
    assert "results/summary.parquet" in inputs
    assert re.search(r"^summary\s+1\s*$", out, flags=re.M), out[-2000:]


# ---------------------------------------------------------------- scores per context length


def _rows(rows, context=100, n_prompt=92):
    """Answer rows of model m: (cell, id, given, answer, needle_start) at one context."""
    return [{"model": "m", "context": context, "task": "passkey", "id": i, "cell": c, "given": g, "answer": a,
             "correct": g == a, "text": f" {g}.", "needle_start": s, "needle_end": s + 10, "n_prompt": n_prompt,
             "gen_tokens": 8, "distance": n_prompt - s - 10} for c, i, g, a, s in rows]


def test_scores_are_grouped_by_context_never_pooled():
    """Two contexts of one model: the long one loses both prompts, the short one none. Pooled, the
    cell would read 2/4 with 2 lost; per context it is 2/2 (lost 0) and 0/2 (lost 2)."""
    import polars as pl

    from kvarn.retrieval import score

    base, q4, kv = "bf16-bf16-t0", "q4_0-q4_0-t128", "kvarn4-kvarn4-t0"
    short = [(base, "a", "1", "1", 10), (base, "b", "2", "2", 10), (q4, "a", "1", "1", 10), (q4, "b", "2", "2", 10),
             (kv, "a", "1", "1", 10), (kv, "b", "2", "2", 10)]
    long = [(base, "a", "1", "1", 172), (base, "b", "2", "2", 172), (q4, "a", "7", "1", 172),
            (q4, "b", "7", "2", 172), (kv, "a", "1", "1", 172), (kv, "b", "2", "2", 172)]  # needles in the tail
    df = pl.DataFrame(_rows(short, 100, 92) + _rows(long, 200, 192))  # the same ids at both lengths
    s = score.cell_scores(df).filter(pl.col("cell") == q4)
    assert s.select("context", "n", "correct", "lost").rows() == [(100, 2, 2, 0), (200, 2, 0, 2)]
    t = score.cell_scores(df, by=("model", "task")).filter(pl.col("cell") == q4)
    assert t.select("context", "n", "correct").rows() == [(100, 2, 2), (200, 2, 0)]
    c = score.comparisons(df)
    assert c.select("context", "a", "n", "a_only", "b_only").rows() == [(100, kv, 2, 0, 0), (200, kv, 2, 2, 0)]
    d = score.by_distance(df, edges=(0, 1000)).filter(pl.col("cell") == q4)
    assert d.select("context", "n", "correct").rows() == [(100, 2, 2), (200, 2, 0)]
    e = score.exact_tail(df).filter(pl.col("cell") == q4)
    assert e.select("context", "n", "lost").rows() == [(100, 2, 0), (200, 2, 2)]


def _write_answers(tmp_path, rows) -> list[Path]:
    """Answer JSONL files (one per (context, cell)) holding `rows` with every column the report reads."""
    import json

    out = {}
    for r in rows:
        full = {"depth": 0.5, "depth_index": 0, "prompt_index": 0, "wall_s": 1.0, **r}
        out.setdefault(tmp_path / f"ctx{r['context']}" / f"{r['cell']}.jsonl", []).append(full)
    for p, rs in out.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(json.dumps(x) + "\n" for x in rs))
    return sorted(out)


def _outputs(tmp_path) -> dict:
    from kvarn.retrieval import plan

    return {k: str(tmp_path / "out" / Path(v).name) for k, v in plan.report_files().items()}


def test_the_report_has_a_section_per_context(tmp_path):
    import polars as pl

    from kvarn.retrieval import report

    base, q4 = "bf16-bf16-t0", "q4_0-q4_0-t128"
    rows = _rows([(base, "a", "1", "1", 10), (q4, "a", "1", "1", 10)], 100, 92) + _rows(
        [(base, "a", "1", "1", 10), (q4, "a", "5", "1", 10)], 200, 192)
    outs = _outputs(tmp_path)
    report.write_report(_write_answers(tmp_path, rows), outs, teacher_forced=str(tmp_path / "none.parquet"))
    md = Path(outs["md"]).read_text()
    assert "## m, context 100" in md and "## m, context 200" in md
    s = pl.read_parquet(outs["scores"]).filter(pl.col("cell") == q4)
    assert s.select("context", "correct", "lost").rows() == [(100, 1, 0), (200, 0, 1)]


# ---------------------------------------------------------------- sink, tail, body


def test_the_needle_position_counts_kvarns_sink():
    """n_prompt 992, gen 8: the last answering query is at 998. KVarN keeps its first 128 tokens exact
    on full-attention layers (kvarn.vocab.policy), a standard type none unless its cell asks (-s<n>)."""
    import polars as pl

    from kvarn.retrieval import score

    pos = score.needle_position
    assert pos("kvarn4-kvarn4-t0", 20, 60, 992, 8) == "sink"
    assert pos("kvarn4-kvarn4-t0", 100, 128, 992, 8) == "sink"  # its last token is 127
    assert pos("kvarn4-kvarn4-t0", 100, 129, 992, 8) == "body"  # token 128 is in the body
    assert pos("q4_0-q4_0-t128", 20, 60, 992, 8) == "body"  # no sink
    assert pos("q4_0-q4_0-t128-s64", 20, 60, 992, 8) == "sink" and pos("q4_0-q4_0-t128-s64", 20, 65, 992, 8) == "body"
    assert pos("kvarn4-kvarn4-t0", 871, 890, 992, 8) == "tail" and pos("kvarn4-kvarn4-t0", 870, 890, 992, 8) == "body"
    assert pos("q4_0-q4_0-t0", 980, 990, 992, 8) == "body"  # tail 0: nothing exact
    assert pos("bf16-bf16-t0", 20, 60, 992, 8) == "exact"  # a float cache has no body
    # a short prompt whose needle runs from the sink into the tail is read exactly throughout: "sink"
    assert pos("kvarn2-kvarn2-t0", 100, 140, 242, 8) == "sink"  # 100..127 sink, 128..139 tail (248 - 128 < 128)
    assert pos("kvarn2-kvarn2-t0", 100, 140, 262, 8) == "body"  # 268 - 128 >= 128: token 128 from the body
    # the table: per (model, context, cell, position), a KVarN needle in the sink counted as such
    base, kv, q4 = "bf16-bf16-t0", "kvarn4-kvarn4-t0", "q4_0-q4_0-t128"
    rows = _rows([(base, "a", "1", "1", 20), (kv, "a", "1", "1", 20), (q4, "a", "9", "1", 20),
                  (base, "b", "2", "2", 900), (kv, "b", "2", "2", 900), (q4, "b", "2", "2", 900)], 1000, 992)
    t = score.exact_tail(pl.DataFrame(rows))
    assert t.select("cell", "position", "n", "lost").rows() == [(kv, "sink", 1, 0), (kv, "tail", 1, 0),
                                                                 (q4, "body", 1, 1), (q4, "tail", 1, 0)]


# ---------------------------------------------------------------- answers rescored at report time


def test_stored_answers_are_rescored_by_the_current_reader(tmp_path, monkeypatch):
    """`given` and `correct` come from the stored generated text through score.read_answer when the
    report loads the answers, not from what the answer job wrote: a stale stored verdict is ignored
    and a changed reader rescores every stored answer."""
    from kvarn.retrieval import report, score

    rows = _rows([("bf16-bf16-t0", "a", "1", "12345", 10)])
    rows[0].update(text=" 12345. Remember 54321", given="stale", correct=False)
    paths = _write_answers(tmp_path, rows)
    got = report.load_answers(paths).row(0, named=True)
    assert (got["given"], got["correct"]) == ("12345", True)
    monkeypatch.setattr(score, "read_answer", lambda text: text.split()[-1])  # another reader: the last word
    got = report.load_answers(paths).row(0, named=True)
    assert (got["given"], got["correct"]) == ("54321", False)


def test_the_report_reruns_when_the_reader_changes(monkeypatch):
    """The report rule's params carry a digest of the answer reader's code, so that snakemake reruns
    the report (and only it) when the reader changes."""
    from kvarn.retrieval import score

    text = (ROOT / "workflow" / "rules" / "retrieval.smk").read_text()
    report_rule = text[text.index("rule retrieval_report:"):]
    assert "reader=kvret.reader_digest()" in report_rule
    from kvarn.retrieval import plan

    d = plan.reader_digest()
    assert len(d) == 16 and d == plan.reader_digest()
    monkeypatch.setattr(score, "DIGITS", __import__("re").compile(r"\d{5}"))
    assert plan.reader_digest() != d


# ---------------------------------------------------------------- seeds from values


def test_inserting_a_depth_or_reordering_the_tasks_changes_no_other_prompt(monkeypatch):
    """The seed of a prompt is drawn from its (task, context, depth, prompt index) values: a depth
    inserted between two others, or the task list reordered, leaves every other prompt (its tokens,
    its key, its id) as it was."""
    from kvarn.retrieval import tasks
    from kvarn.retrieval.run import load_tokenizer
    from kvarn.weights.sources import ModelSpec
    from paths import CACHE_DIR

    tok, bos = load_tokenizer(ModelSpec("smollm2-135m", "embedded:smollm2-135m"), CACHE_DIR)
    for task in tasks.TASKS:
        n = 400 if task in tasks.LEGACY_TASKS else 700  # four UUID needles need more room
        two = tasks.make_tasks(tok, bos, task, n, [0.25, 1.0], 2, seed=1)
        three = tasks.make_tasks(tok, bos, task, n, [0.25, 0.6, 1.0], 2, seed=1)
        keep = lambda rs: {r["id"]: (r["input_ids"], r["answer"], r["key"]) for r in rs if r["depth"] != 0.6}  # noqa: E731
        assert keep(two) == keep(three) and len(keep(two)) == 4
        assert all(r["task_version"] == tasks.TASK_VERSION >= 2 for r in three)
    before = tasks.make_tasks(tok, bos, "kv", 400, [0.5], 1, seed=1)
    monkeypatch.setattr(tasks, "TASKS", ("kv", "multikey", "passkey"))
    assert tasks.make_tasks(tok, bos, "kv", 400, [0.5], 1, seed=1) == before
