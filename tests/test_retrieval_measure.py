"""kvarn.retrieval's continuous measure (issue 53, item 1) on a tiny random-weight model.

For every prompt under a cell, the cell job scores each candidate continuation (the correct value,
then the other values the prompt states) by its teacher-forced log-probability through the cell's
prefilled cache (`run.candidate_logprobs`, one copy of the cache per candidate slot). Checked
against a hand computation that shares none of that code path: the model's plain forward (no
cache model) over prompt + candidate for an f32 cache, and for quantized cells a fresh cache fed
prompt + candidate in one pass (no copy); the rank and margin from those numbers by hand; the
greedy answer unchanged by the scoring.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvarn.kvcache.attention as kattn
from kvarn.kvcache.cache import KVarnCache
from kvarn.retrieval import run
from kvarn.vocab.cell import CellSpec

pytestmark = pytest.mark.xdist_group("retrieval")
N_PROMPT = 300  # past KVarN's 128-token sink and one 128-token group: its body is read
CANDIDATES = [[[5, 6, 7]], [[1, 2], [3, 4, 5, 9], [7]], [[9, 9, 9], [10, 11, 12]]]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 128, (len(CANDIDATES), N_PROMPT), generator=g)
    return model, prompts


@torch.no_grad()
def _plain(model, ids: list[int]) -> torch.Tensor:
    model.set_attn_implementation("sdpa")
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)


@torch.no_grad()
def _fresh_cache(model, cell, ids: list[int]) -> torch.Tensor:
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = KVarnCache(model.config, CellSpec.from_name(cell))
    out = model(input_ids=torch.tensor([ids]), cache=cache, kvarn_cache=cache, use_cache=True, logits_to_keep=0)
    return torch.log_softmax(out.logits[0].double(), dim=-1)


def _by_hand(logp_of, model, cell, prompt: list[int], cand: list[int]) -> float:
    """sum_i log p(cand[i] | prompt, cand[:i]): position n − 1 + i of prompt + cand predicts cand[i]."""
    lp = logp_of(model, prompt + cand[:-1]) if cell is None else logp_of(model, cell, prompt + cand[:-1])
    n = len(prompt)
    return sum(float(lp[n - 1 + i, t]) for i, t in enumerate(cand))


def _records(prompts):
    return [{"id": f"p{i}", "task": "passkey", "input_ids": prompts[i].tolist(), "gen_tokens": 3, "answer": "x", "candidate_ids": c}
            for i, c in enumerate(CANDIDATES)]


def _loaded(model):
    model.set_attn_implementation(kattn.ATTN_NAME)
    return SimpleNamespace(model=model, tokenizer=SimpleNamespace(decode=lambda ids: " ".join(map(str, ids))))


@pytest.mark.parametrize("cell", ["f32-f32-t0", "q4_0-q4_0-t0", "q4_0-q4_0-t128", "kvarn4-kvarn4-t0", "kvarn2-kvarn2-t0"])
def test_candidate_logprobs_match_a_hand_computation(tiny, cell):
    model, prompts = tiny
    got = run.answer_records(_loaded(model), _records(prompts), CellSpec.from_name(cell), batch=3)
    for i, (rec, cands) in enumerate(zip(got, CANDIDATES)):
        prompt = prompts[i].tolist()
        if cell == "f32-f32-t0":  # the model's own plain forward, no cache model at all
            want = [_by_hand(_plain, model, None, prompt, c) for c in cands]
        else:  # a fresh cache fed prompt + candidate in one pass, no copy of a prefilled cache
            want = [_by_hand(_fresh_cache, model, cell, prompt, c) for c in cands]
        assert rec["candidate_logprobs"] == pytest.approx(want, abs=2e-4), (cell, i)
        assert rec["logprob"] == pytest.approx(want[0], abs=2e-4)
        assert rec["n_candidates"] == len(cands)
        assert rec["rank"] == 1 + sum(w >= want[0] for w in want[1:])
        if len(cands) > 1:
            assert rec["margin"] == pytest.approx(want[0] - max(want[1:]), abs=4e-4)
        else:
            assert rec["margin"] is None
    if cell != "f32-f32-t0":  # the cell matters: its numbers are not the exact cache's
        exact = run.answer_records(_loaded(model), _records(prompts), CellSpec.from_name("f32-f32-t0"), batch=3)
        assert any(abs(a["logprob"] - b["logprob"]) > 1e-3 for a, b in zip(got, exact))


def test_scoring_leaves_the_greedy_answer_untouched(tiny):
    model, prompts = tiny
    model.set_attn_implementation(kattn.ATTN_NAME)
    cell = CellSpec.from_name("kvarn4-kvarn4-t0")
    alone = run.generate(model, prompts, cell, 5)
    toks, scored = run.generate(model, prompts, cell, 5, candidates=CANDIDATES)
    assert torch.equal(alone, toks) and [len(s) for s in scored] == [1, 3, 2]


def test_candidate_scores_by_hand():
    assert run.candidate_scores([-1.0, -3.0, -0.5]) == {"logprob": -1.0, "rank": 2, "n_candidates": 3, "margin": -0.5}
    assert run.candidate_scores([-1.0, -3.0, -1.0])["rank"] == 2  # a tie counts against the correct one
    assert run.candidate_scores([-2.0]) == {"logprob": -2.0, "rank": 1, "n_candidates": 1, "margin": None}


# ---------------------------------------------------------------- the paired report of it


def test_bootstrap_interval_against_the_enumerated_bootstrap_distribution():
    """d = (0, 1, 2, 3): the 4^4 equally likely resamples give the exact bootstrap distribution of the
    mean; its 2.5 % and 97.5 % quantiles are 0.5 and 2.5 (cumulative 0.0195 < 0.025 < 0.0586 and
    0.941 < 0.975 < 0.980, enumerated here), which the sampled bootstrap must land on."""
    import itertools

    import numpy as np

    from kvarn.retrieval import score

    means = np.array(sorted(np.mean(c) for c in itertools.product([0, 1, 2, 3], repeat=4)))
    cdf = lambda x: float((means <= x + 1e-12).mean())  # noqa: E731
    lo_exact = min(m for m in means if cdf(m) >= 0.025)
    hi_exact = min(m for m in means if cdf(m) >= 0.975)
    assert (lo_exact, hi_exact) == (0.5, 2.5)
    for seed in (0, 1, 2):
        assert score.bootstrap_mean([0, 1, 2, 3], seed=seed) == (1.5, lo_exact, hi_exact)
    assert score.bootstrap_mean([0.25] * 7) == pytest.approx((0.25, 0.25, 0.25))
    assert all(x != x for x in score.bootstrap_mean([]))


def test_paired_continuous_by_hand():
    import polars as pl

    from kvarn.retrieval import score

    base, q4 = score.BASELINE_CELL, "q4_0-q4_0-t128"

    def row(cell, i, lp, margin):
        return {"model": "m", "context": 100, "id": i, "cell": cell, "given": "1", "correct": True,
                "logprob": lp, "margin": margin}

    df = pl.DataFrame([row(base, "a", -1.0, 2.0), row(base, "b", -2.0, None), row(base, "c", -0.5, -1.0),
                       row(q4, "a", -1.5, 1.0), row(q4, "b", -2.0, None), row(q4, "c", -2.0, -1.5)])
    r = score.paired_continuous(df).row(0, named=True)
    # log p differences -0.5, 0, -1.5: mean -2/3; margins (prompts a and c): -1.0, -0.5: mean -0.75
    assert (r["cell"], r["n"], r["n_margin"]) == (q4, 3, 2)
    assert r["dlogprob"] == pytest.approx(-2 / 3) and r["dmargin"] == pytest.approx(-0.75)
    assert (r["dlogprob_lo"], r["dlogprob_hi"]) == pytest.approx(score.bootstrap_mean([-0.5, 0, -1.5])[1:])
    assert r["dlogprob_lo"] <= -2 / 3 <= r["dlogprob_hi"] and r["dlogprob_hi"] == pytest.approx(0.0)
    assert (r["top1"], r["base_top1"]) == (0.5, 0.5)  # margin > 0: a only, under both caches
    assert score.paired_continuous(df.head(0)).height == 0
    kv = "kvarn4-kvarn4-t0"  # between formats: kvarn4 (A) against q4_0 t128 (B), A − B per prompt
    both = pl.concat([df, pl.DataFrame([row(kv, "a", -1.0, 1.0), row(kv, "b", -1.0, None), row(kv, "c", -1.0, -1.0)])])
    c = score.comparisons(both).row(0, named=True)
    assert (c["a"], c["b"]) == (kv, q4)  # differences 0.5, 1.0, 1.0: mean 2.5 / 3
    assert c["dlogprob"] == pytest.approx(2.5 / 3)
    assert (c["dlogprob_lo"], c["dlogprob_hi"]) == pytest.approx(score.bootstrap_mean([0.5, 1.0, 1.0])[1:])


def test_the_report_shows_the_paired_measure(tmp_path):
    import json
    from pathlib import Path

    import polars as pl

    from kvarn.retrieval import plan, report, score

    rows = []
    for cell, lps in ((score.BASELINE_CELL, (-1.0, -2.0)), ("kvarn4-kvarn4-t0", (-1.5, -2.5))):
        for i, lp in zip("ab", lps):
            rows.append({"model": "m", "context": 100, "task": "kv", "id": i, "depth": 0.5, "depth_index": 0,
                         "prompt_index": 0, "cell": cell, "answer": "12345", "given": "?", "correct": None,
                         "text": " 12345.", "needle_start": 40, "needle_end": 50, "n_prompt": 92, "gen_tokens": 8,
                         "distance": 42, "wall_s": 1.0, "logprob": lp, "margin": lp + 3, "rank": 1, "n_candidates": 8})
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outs = {k: str(tmp_path / "out" / Path(v).name) for k, v in plan.report_files().items()}
    report.write_report([path], outs, teacher_forced=str(tmp_path / "none.parquet"))
    p = pl.read_parquet(outs["paired"]).row(0, named=True)
    assert (p["cell"], p["n"], p["dlogprob"], p["dmargin"]) == ("kvarn4-kvarn4-t0", 2, -0.5, -0.5)
    md = Path(outs["md"]).read_text()
    # Wilcoxon of (-0.5, -0.5): 2 x 1/4 = 0.5; Holm with the flip test (p 1) of the section: 1
    assert "| kvarn4 128* | 2/2 | 0 | 0 | -0.500 | [-0.500, -0.500] | 0.5 | 1 | -0.500 |" in md
    assert "changes by -0.500 nats [-0.500, -0.500] (kvarn4 128*)" in Path(outs["paragraph"]).read_text()
