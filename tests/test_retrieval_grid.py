"""Issue 53 items 2, 4 and 6 in kvarn.retrieval: the length x depth grid (and its heatmap), the
ordering by the paired continuous difference, and a CPU run's cell jobs side by side.

By hand: the grid's counts, accuracy, mean Δ log p and needle positions per (model, cell,
context, depth); the ordering's ranks by Δ log p against accuracy and its Kendall tau; the plan's
`hold_gpu` and its refusal.
"""

from __future__ import annotations

import polars as pl
import pytest
from scipy.stats import kendalltau

from kvarn.retrieval import plan, report, score

pytestmark = pytest.mark.xdist_group("retrieval")
BASE = score.BASELINE_CELL
CELLS = ["q4_0-q4_0-t128", "kvarn4-kvarn4-t0", "q2_0-q2_0-t128"]


def _answers(rows):
    return pl.DataFrame(rows, schema_overrides={"logprob": pl.Float64})


def test_ordering_ranks_by_the_paired_logprob_difference_with_accuracy_beside(tmp_path):
    # 6 prompts; exact log p -1 everywhere. q4_0 t128: 6/6 right but Δ log p -0.5; kvarn4: 5/6 right,
    # Δ -0.1; q2_0: 2/6, Δ -2. By accuracy q4_0 > kvarn4 > q2_0; by Δ log p kvarn4 > q4_0 > q2_0.
    right = {BASE: 6, CELLS[0]: 6, CELLS[1]: 5, CELLS[2]: 2}
    delta = {BASE: 0.0, CELLS[0]: -0.5, CELLS[1]: -0.1, CELLS[2]: -2.0}
    df = _answers([{"model": "m", "context": 512, "id": str(i), "cell": c, "given": "1" if i < right[c] else "0",
                    "correct": i < right[c], "logprob": -1.0 + delta[c] + 0.01 * i, "margin": None}
                   for c in right for i in range(6)])
    kld = {CELLS[0]: 0.002, CELLS[1]: 0.001, CELLS[2]: 0.05}
    pl.DataFrame({"model": ["m"] * 3, "cell": CELLS, "n_ctx": [2048] * 3, "chunks": [1] * 3,
                  "kld_median": [kld[c] for c in CELLS]}).write_parquet(tmp_path / "summary.parquet")
    s = score.cell_scores(df)
    paired = score.paired_continuous(df)
    order, notes = report.ordering(s, str(tmp_path / "summary.parquet"), df, paired)
    ranks = dict(zip(order["cell"], order["retrieval_rank"]))
    assert ranks == {CELLS[1]: 1, CELLS[0]: 2, CELLS[2]: 3}
    assert order["ranked_by"].unique().to_list() == ["dlogprob"]
    assert dict(zip(order["cell"], order["dlogprob"])) == pytest.approx({c: delta[c] for c in CELLS})
    assert dict(zip(order["cell"], order["accuracy"])) == pytest.approx({c: right[c] / 6 for c in CELLS})
    # Δ log p (higher first) against median KLD (lower first): the same order, tau +1, no disagreement
    tau = kendalltau([-delta[c] for c in CELLS], [kld[c] for c in CELLS]).statistic
    assert tau == pytest.approx(1.0)
    assert "Kendall's tau (Δ log p vs median KLD) +1.00 [+1.00, +1.00]" in notes[("m", 512)]
    assert "no pair ordered differently" in notes[("m", 512)]
    # without the continuous measure the ordering is by accuracy, as before
    order2, notes2 = report.ordering(s, str(tmp_path / "summary.parquet"), df.drop("logprob"))
    assert dict(zip(order2["cell"], order2["retrieval_rank"])) == {CELLS[0]: 1, CELLS[1]: 2, CELLS[2]: 3}
    assert "Kendall's tau (accuracy vs median KLD)" in notes2[("m", 512)]
    assert "q4_0 t128 retrieves better (6/6 vs 5/6) with the higher median KLD" in notes2[("m", 512)]


def test_the_length_by_depth_grid_by_hand():
    # two contexts x two depths, two prompts each, the exact cache and kvarn4 (sink 128, tail 128)
    rows = []
    for ctx in (512, 1024):
        for depth, start in ((0.0, 20), (0.5, ctx // 2)):
            for p in range(2):
                i = f"c{ctx}-d{depth}-p{p}"
                for cell, ok, lp in ((BASE, True, -1.0), ("kvarn4-kvarn4-t0", not (ctx == 1024 and depth == 0.5 and p == 0),
                                                          -1.0 - 0.25 * (ctx == 1024) - 0.5 * p)):
                    rows.append({"model": "m", "context": ctx, "id": i, "depth": depth, "cell": cell, "correct": ok,
                                 "logprob": lp, "needle_start": start, "needle_end": start + 10,
                                 "n_prompt": ctx - 8, "gen_tokens": 8})
    g = report.grid(_answers(rows))
    k = g.filter(pl.col("cell") == "kvarn4-kvarn4-t0").sort("context", "depth")
    assert k.select("context", "depth", "n", "correct").rows() == [(512, 0.0, 2, 2), (512, 0.5, 2, 2),
                                                                    (1024, 0.0, 2, 2), (1024, 0.5, 2, 1)]
    # mean (cell - exact) of log p: (0 + -0.5) / 2 at 512; (-0.25 + -0.75) / 2 at 1024
    assert k["dlogprob"].to_list() == pytest.approx([-0.25, -0.25, -0.5, -0.5])
    # the needle at token 20 lies in KVarN's 128-token sink; at the middle of 512 or 1024, in the body
    assert k.select("in_sink", "in_tail", "in_body").rows() == [(2, 0, 0), (0, 0, 2), (2, 0, 0), (0, 0, 2)]
    b = g.filter(pl.col("cell") == BASE)
    assert b["dlogprob"].is_null().all() and b["accuracy"].to_list() == [1.0] * 4
    spec = report.heatmap(g).to_dict()
    assert spec["vconcat"][0]["facet"]["column"]["field"] == "label"
    assert spec["vconcat"][0]["spec"]["layer"][0]["encoding"]["y"]["field"] == "context"


def test_hold_gpu_and_its_refusal():
    cfg = {"retrieval": {"cells": ["q4_0-q4_0-t128"], "models": [{"name": "m", "contexts": [512]}]}}
    assert plan.expand(cfg, ["m"]).hold_gpu is True
    assert plan.expand({"retrieval": {**cfg["retrieval"], "hold_gpu": False}}, ["m"]).hold_gpu is False
    with pytest.raises(plan.RetrievalError, match=r"retrieval.hold_gpu: must be true .* or false .*got 'no'"):
        plan.expand({"retrieval": {**cfg["retrieval"], "hold_gpu": "no"}}, ["m"])
