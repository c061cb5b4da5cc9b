"""Scores of retrieval answers (torch-free): accuracy, agreement with the exact cache, flips,
binomial intervals, exact McNemar tests, accuracy by the needle's distance, the exact-tail check.

Owns `read_answer` and `grade` (the answer a generated text gives, and whether it is right),
`wilson`, `mcnemar`, `flip_test`, `holm`, `signed_rank_p`, `bootstrap_mean`, `tau_bootstrap`, the
needle's position under a cell's policy (`needle_position`: sink, tail, body or exact), and the
tables `cell_scores`, `comparisons` (the pairs of `pairs_of`), `paired_continuous`,
`by_distance`, `exact_tail`, built from answer rows (one row per (model, cell, task prompt):
`id`, `context`, `task`, `cell`, `given`, `correct`, `answer`, `needle_start`, `n_prompt`,
`gen_tokens`, `distance`). The baseline's rows are those of `BASELINE_CELL` (bf16 K and V,
tail 0: the exact cache's own answers); every score is per `GROUP` (model, context).

Why (each score, the pairs compared, the needle's position): docs/notes/retrieval.md "Scores".
"""

from __future__ import annotations

import math
import re

import numpy as np
import polars as pl
from scipy.stats import binomtest, kendalltau, wilcoxon

from kvarn.retrieval.tasks import LEGACY_TASKS, ruler_kind
from kvarn.vocab import facts, policy
from kvarn.vocab.cell import CellSpec

BASELINE_CELL = "bf16-bf16-t0"
GROUP = ("model", "context")  # every score is per model and context length: lengths are never pooled
CONFIDENCE = 0.95
DIGITS = re.compile(r"\d+")


def read_answer(text: str) -> str:
    """The answer a generated text gives: its first run of digits, else the text stripped."""
    m = DIGITS.search(text)
    return m.group(0) if m else text.strip()


# what a RULER task's values look like in a generated text (`grade`'s `given`)
VALUE_PATTERNS = {"number": DIGITS, "uuid": re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
                  "variable": re.compile(r"\b[A-Z]{5}\b")}


def grade(task: str, text: str, answer: str) -> tuple[str, bool]:
    """(given, correct) of a generated text for a prompt of `task` whose `answer` is its values
    joined by ", " (`kvarn.retrieval.tasks`).

    The first tasks (passkey, multikey, kv): `given` is the first run of digits (`read_answer`),
    right when it equals the answer. RULER's tasks: RULER's `string_match_all`, strict — right
    when every value of the answer appears in the text (case-insensitive substring), so three of a
    multi-value prompt's four values are wrong (RULER's own score would give 0.75); `given` is the
    first as many value-like strings in the text (7-digit runs, UUIDs, five capitals) as the answer
    has values, joined by ", " (else the text stripped), for agreement between caches."""
    if task in LEGACY_TASKS:
        given = read_answer(text)
        return given, given == answer
    answers = answer.split(", ")
    low = text.lower()
    found = VALUE_PATTERNS[ruler_kind(task)].findall(text)
    given = ", ".join(found[: len(answers)]) or text.strip()
    return given, all(a.lower() in low for a in answers)


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson interval of k successes in n trials (NaNs for n = 0)."""
    if n == 0:
        return math.nan, math.nan
    if not 0 <= k <= n:
        raise ValueError(f"wilson: successes must be in 0..{n}, got {k}")
    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def mcnemar(a_correct, b_correct) -> dict:
    """Exact McNemar test of two paired correctness lists: b (A right, B wrong), c (A wrong,
    B right), the two-sided exact binomial p on the b + c discordant pairs (1 when none)."""
    a, b_ = list(map(bool, a_correct)), list(map(bool, b_correct))
    if len(a) != len(b_):
        raise ValueError(f"mcnemar: the paired lists differ in length ({len(a)} and {len(b_)})")
    b = sum(x and not y for x, y in zip(a, b_))
    c = sum(y and not x for x, y in zip(a, b_))
    p = 1.0 if b + c == 0 else float(binomtest(b, b + c, 0.5, alternative="two-sided").pvalue)
    return {"n": len(a), "a_only": b, "b_only": c, "p": p}


def _ctx(answers: pl.DataFrame) -> pl.DataFrame:
    """The answers with a `context` column: a frame without one (rows of a single, unnamed length)
    gets context 0, so that grouping by length never pools two lengths and never fails."""
    return answers if "context" in answers.columns else answers.with_columns(pl.lit(0, dtype=pl.Int64).alias("context"))


def _with_baseline(answers: pl.DataFrame) -> pl.DataFrame:
    answers = _ctx(answers)
    extra = [pl.col(c).alias(f"base_{c}") for c in ("logprob", "margin") if c in answers.columns]
    base = answers.filter(pl.col("cell") == BASELINE_CELL).select(
        *GROUP, "id", pl.col("given").alias("base_given"), pl.col("correct").alias("base_correct"), *extra)
    if base.height == 0:
        raise ValueError(f"retrieval answers hold no baseline rows (cell {BASELINE_CELL}); every score is "
                         "counted against the exact cache's own answers")
    missing = answers.join(base, on=[*GROUP, "id"], how="anti")
    if missing.height:
        raise ValueError(f"retrieval answers without a baseline answer to the same prompt: "
                         f"{missing['model'][0]} {missing['id'][0]} (and {missing.height - 1} more)")
    return answers.join(base, on=[*GROUP, "id"])


def flip_test(lost: int, gained: int, n: int, confidence: float = CONFIDENCE) -> dict:
    """The flips of a cell against the exact cache on n paired prompts: the flip rate
    (lost + gained) / n with its exact (Clopper–Pearson) interval, and the exact two-sided binomial
    test of lost against gained (`binomtest(lost, lost + gained, 0.5)`, p = 1 without flips): is
    the cell more often wrong where the exact cache is right than the reverse?"""
    f = lost + gained
    if not 0 <= f <= n:
        raise ValueError(f"flip_test: lost + gained must be in 0..{n}, got {lost} + {gained}")
    if n == 0:
        return {"rate": math.nan, "lo": math.nan, "hi": math.nan, "p": math.nan}
    ci = binomtest(f, n).proportion_ci(confidence_level=confidence, method="exact")
    p = 1.0 if f == 0 else float(binomtest(lost, f, 0.5, alternative="two-sided").pvalue)
    return {"rate": f / n, "lo": float(ci.low), "hi": float(ci.high), "p": p}


def holm(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: the i-th smallest of m gets
    max over j <= i of min(1, (m − j + 1) · p_(j)). NaNs are left out of the family and stay NaN."""
    p = [float(x) for x in pvalues]
    idx = sorted((i for i in range(len(p)) if not math.isnan(p[i])), key=lambda i: p[i])
    m, out, run = len(idx), [math.nan] * len(p), 0.0
    for j, i in enumerate(idx):
        run = max(run, min(1.0, (m - j) * p[i]))
        out[i] = run
    return out


def signed_rank_p(d) -> float:
    """Two-sided Wilcoxon signed-rank test of paired differences `d` (`scipy.stats.wilcoxon`,
    zero differences dropped: zero_method "wilcox"; exact below 50 nonzero differences without
    ties, else its normal approximation): the test of a paired continuous difference (Δ log p).
    1 when no difference is nonzero, NaN without differences."""
    d = np.asarray(d, dtype=np.float64)
    d = d[~np.isnan(d)]
    if not len(d):
        return math.nan
    if not np.any(d != 0):
        return 1.0
    return float(wilcoxon(d, zero_method="wilcox", alternative="two-sided").pvalue)


def with_holm(scores: pl.DataFrame, comps: pl.DataFrame, paired: pl.DataFrame | None = None):
    """`p_holm` on the tests the report shows, Holm-adjusted within each (model, context): every
    non-baseline cell's flip test against the exact cache (`p_flips`) and every paired McNemar test
    between formats (`comparisons`' p); with `paired` (`paired_continuous`) also every Wilcoxon
    test of Δ log p, each cell against the exact cache (`paired`' `p_dlogprob`, adjusted into its
    `p_holm`) and each pair of formats (`comparisons`' `p_dlogprob`, into `p_dlogprob_holm`), in the
    same family. The baseline's row gets none. Returns (scores, comps), or with `paired` (scores,
    comps, paired)."""
    s = scores.with_row_index("_i")
    c = comps.with_row_index("_i")
    q = paired.with_row_index("_i") if paired is not None else None
    ps, pc = [math.nan] * s.height, [math.nan] * c.height
    pq, pcl = [math.nan] * (q.height if q is not None else 0), [math.nan] * c.height
    for model, context in s.select(*GROUP).unique(maintain_order=True).rows():
        si = s.filter((pl.col("model") == model) & (pl.col("context") == context) & (pl.col("cell") != BASELINE_CELL))
        ci = c.filter((pl.col("model") == model) & (pl.col("context") == context))
        fam = [(ps, i, p) for i, p in zip(si["_i"], si["p_flips"])] + [(pc, i, p) for i, p in zip(ci["_i"], ci["p"])]
        if q is not None:
            qi = q.filter((pl.col("model") == model) & (pl.col("context") == context))
            fam += [(pq, i, p) for i, p in zip(qi["_i"], qi["p_dlogprob"])]
            fam += [(pcl, i, p) for i, p in zip(ci["_i"], ci["p_dlogprob"])]
        adj = holm([p if p is not None else math.nan for _, _, p in fam])
        for (out, i, _), a in zip(fam, adj):
            out[i] = a
    ser = lambda name, xs: pl.Series(name, xs, dtype=pl.Float64).fill_nan(None)  # noqa: E731
    scores = scores.with_columns(ser("p_holm", ps))
    comps = comps.with_columns(ser("p_holm", pc))
    if paired is None:
        return scores, comps
    return scores, comps.with_columns(ser("p_dlogprob_holm", pcl)), paired.with_columns(ser("p_holm", pq))


def cell_label(name: str) -> str:
    """A cell as tables print it: `q4_0 t128`, `kvarn4 128*`, `bf16 (exact)`."""
    if name == BASELINE_CELL:
        return "bf16 (exact)"
    c = CellSpec.from_name(name)
    pair = c.k if c.k == c.v else f"{c.k}/{c.v}"
    tail = facts.tail_label(c.k, c.v, c.tail)
    return f"{pair} {'t' if not tail.endswith('*') else ''}{tail}{c.opts}"


def _by(by) -> list[str]:
    """The grouping columns: model and context first (never pooled across lengths), then `by`'s others."""
    return list(dict.fromkeys([*GROUP, *by]))


def cell_scores(answers: pl.DataFrame, by=GROUP) -> pl.DataFrame:
    """Per (model, context, by…, cell): n, correct, accuracy and its Wilson interval, agreement
    with the baseline's answer, lost and gained (the flips)."""
    by = _by(by)
    df = _with_baseline(answers)
    g = df.group_by([*by, "cell"], maintain_order=True).agg(
        pl.len().alias("n"), pl.col("correct").sum().alias("correct"),
        (pl.col("given") == pl.col("base_given")).sum().alias("agree"),
        (pl.col("base_correct") & ~pl.col("correct")).sum().alias("lost"),
        (~pl.col("base_correct") & pl.col("correct")).sum().alias("gained"))
    ci = [wilson(k, n) for k, n in zip(g["correct"], g["n"])]
    flips = [flip_test(lo, ga, n) for lo, ga, n in zip(g["lost"], g["gained"], g["n"])]
    return g.with_columns(
        (pl.col("correct") / pl.col("n")).alias("accuracy"),
        pl.Series("acc_lo", [c[0] for c in ci]), pl.Series("acc_hi", [c[1] for c in ci]),
        (pl.col("agree") / pl.col("n")).alias("agreement"),
        (pl.col("lost") + pl.col("gained")).alias("flips"),
        pl.Series("flip_rate", [f["rate"] for f in flips], dtype=pl.Float64),
        pl.Series("flip_lo", [f["lo"] for f in flips], dtype=pl.Float64),
        pl.Series("flip_hi", [f["hi"] for f in flips], dtype=pl.Float64),
        pl.Series("p_flips", [f["p"] for f in flips], dtype=pl.Float64),
        pl.col("cell").map_elements(cell_label, return_dtype=pl.String).alias("label"),
    ).sort([*by, "cell"])


def pairs_of(cells) -> list[tuple[str, str, str]]:
    """(A, B, kind) for every comparison the cells allow: KVarN at 128* vs the standard type of
    its width at tail 128 ("kvarn vs standard"), and standard at tail 0 vs tail 128 ("tail 0 vs 128")."""
    have = set(cells)
    out = []
    for name in sorted(have - {BASELINE_CELL}):
        c = CellSpec.from_name(name)
        if c.family == "kvarn" and c.tail == 0 and c.k == c.v and not c.opts:
            partner = CellSpec(f"q{facts.get(c.k).bits}_0", f"q{facts.get(c.k).bits}_0", 128).name
            if partner in have:
                out.append((name, partner, "kvarn vs standard"))
        elif c.family == "standard" and c.tail == 0 and not c.opts:
            partner = CellSpec(c.k, c.v, 128).name
            if partner in have:
                out.append((name, partner, "tail 0 vs 128"))
    return out


def comparisons(answers: pl.DataFrame) -> pl.DataFrame:
    """Per model, context and pair (`pairs_of`): accuracies of A and B on the same prompts, the
    exact McNemar test (a_only: A right and B wrong; b_only: the reverse) and, where the answers
    carry the continuous measure, the paired mean difference A − B of the correct value's
    log-probability with its bootstrap interval (`bootstrap_mean`; NaN without it)."""
    rows = []
    answers = _ctx(answers)
    lp = pl.col("logprob") if "logprob" in answers.columns else pl.lit(None, dtype=pl.Float64)
    for (model, context), m in answers.sort(*GROUP).group_by(GROUP, maintain_order=True):
        for a, b, kind in pairs_of(m["cell"].unique()):
            j = m.filter(pl.col("cell") == a).select("id", pl.col("correct").alias("ca"), lp.alias("la")).join(
                m.filter(pl.col("cell") == b).select("id", pl.col("correct").alias("cb"), lp.alias("lb")), on="id")
            t = mcnemar(j["ca"], j["cb"])
            diff = (j["la"] - j["lb"]).drop_nulls().to_numpy()
            d, d_lo, d_hi = bootstrap_mean(diff)
            rows.append({"model": model, "context": context, "kind": kind, "a": a, "b": b, "a_label": cell_label(a),
                         "b_label": cell_label(b), "n": t["n"], "acc_a": float(j["ca"].mean()) if t["n"] else math.nan,
                         "acc_b": float(j["cb"].mean()) if t["n"] else math.nan, "a_only": t["a_only"],
                         "b_only": t["b_only"], "p": t["p"], "dlogprob": d, "dlogprob_lo": d_lo,
                         "dlogprob_hi": d_hi, "p_dlogprob": signed_rank_p(diff)})
    schema = {"model": pl.String, "context": pl.Int64, "kind": pl.String, "a": pl.String, "b": pl.String, "a_label": pl.String,
              "b_label": pl.String, "n": pl.Int64, "acc_a": pl.Float64, "acc_b": pl.Float64, "a_only": pl.Int64,
              "b_only": pl.Int64, "p": pl.Float64, "dlogprob": pl.Float64, "dlogprob_lo": pl.Float64,
              "dlogprob_hi": pl.Float64, "p_dlogprob": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def by_distance(answers: pl.DataFrame, edges=(0, 128, 512, 2048, 8192, 32768)) -> pl.DataFrame:
    """Accuracy per (model, context, cell, bin of the needle's distance from the end of the prompt):
    bins [edges[i], edges[i+1]), the last open-ended; with Wilson intervals."""
    edges = sorted(edges)
    labels = [f"{a}–{b - 1}" for a, b in zip(edges, edges[1:])] + [f"≥{edges[-1]}"]

    def bin_of(d):
        return labels[max(i for i, e in enumerate(edges) if d >= e)]

    df = _ctx(answers).with_columns(pl.col("distance").map_elements(bin_of, return_dtype=pl.String).alias("bin"),
                              pl.col("distance").map_elements(lambda d: max(e for e in edges if d >= e),
                                                              return_dtype=pl.Int64).alias("bin_lo"))
    g = df.group_by(*GROUP, "cell", "bin", "bin_lo").agg(
        pl.len().alias("n"), pl.col("correct").sum().alias("correct"),
        pl.col("distance").mean().alias("mean_distance")).sort(*GROUP, "cell", "bin_lo")
    ci = [wilson(k, n) for k, n in zip(g["correct"], g["n"])]
    return g.with_columns((pl.col("correct") / pl.col("n")).alias("accuracy"),
                          pl.Series("acc_lo", [c[0] for c in ci]), pl.Series("acc_hi", [c[1] for c in ci]),
                          pl.col("cell").map_elements(cell_label, return_dtype=pl.String).alias("label"))


POSITIONS = ("sink", "tail", "body")


def full_layer_policy(cell: str) -> policy.LayerPolicy | None:
    """The cell's sink and effective tail on a full-attention layer; None for a float cache (no body)."""
    c = CellSpec.from_name(cell)
    if c.family not in ("kvarn", "standard") or facts.get(c.k).bits >= 16:
        return None
    return policy.layer_policy(facts.get(c.k), facts.get(c.v), c.tail, window=None, sink=c.sink)


def needle_position(cell: str, needle_start: int, needle_end: int, n_prompt: int, gen_tokens: int) -> str:
    """Where a full-attention layer of the cell reads the needle [needle_start, needle_end) from for
    every answering query (n_prompt − 1 … n_prompt + gen_tokens − 2): "sink" (all of it in the sink),
    "tail" (all of it within the effective tail of the last query), "body" (some token from the
    quantized body for some query), "exact" (a float cache). A needle read exactly throughout but
    partly in the sink and partly in the tail (prompts shorter than sink + tail) counts as "sink"."""
    pol = full_layer_policy(cell)
    if pol is None:
        return "exact"
    last = n_prompt + gen_tokens - 2
    if needle_end <= pol.sink:
        return "sink"
    if last - needle_start < pol.tail:
        return "tail"
    if needle_start < pol.sink and last - pol.sink < pol.tail:  # tokens >= sink all in the tail
        return "sink"
    return "body"


def in_exact_tail(cell: str, needle_start: int, n_prompt: int, gen_tokens: int) -> bool:
    """Whether every answering query reads the whole needle from the exact copy: the farthest
    (last query n_prompt + gen_tokens − 2, first needle token) is within the effective tail."""
    c = CellSpec.from_name(cell)
    if c.family not in ("kvarn", "standard") or facts.get(c.k).bits >= 16:
        return True  # a float cache has no body to lose
    return (n_prompt + gen_tokens - 2) - needle_start < facts.pair_effective_tail(c.k, c.v, c.tail)


def with_position(answers: pl.DataFrame) -> pl.DataFrame:
    """The answers with a `position` column (`needle_position` of each row's cell and needle)."""
    pos = [needle_position(c, s, e, n, g) for c, s, e, n, g in
           zip(answers["cell"], answers["needle_start"], answers["needle_end"], answers["n_prompt"],
               answers["gen_tokens"])]
    return answers.with_columns(pl.Series("position", pos, dtype=pl.String))


def exact_tail(answers: pl.DataFrame) -> pl.DataFrame:
    """Per (model, context, cell, needle position: sink / tail / body, `needle_position`): the
    prompts, how many the baseline answers right, the cell answers right, the cell loses (baseline
    right, cell wrong), and how many answers differ from the baseline's."""
    df = with_position(_with_baseline(answers).filter(pl.col("cell") != BASELINE_CELL))
    return df.group_by(*GROUP, "cell", "position", maintain_order=True).agg(
        pl.len().alias("n"), pl.col("base_correct").sum().alias("base_correct"),
        pl.col("correct").sum().alias("correct"),
        (pl.col("base_correct") & ~pl.col("correct")).sum().alias("lost"),
        (pl.col("given") != pl.col("base_given")).sum().alias("differ"),
    ).sort(*GROUP, "cell", "position").with_columns(
        pl.col("cell").map_elements(cell_label, return_dtype=pl.String).alias("label"))


BOOTSTRAP = 10_000  # resamples of the paired bootstrap
BOOTSTRAP_SEED = 0


def bootstrap_mean(d, resamples: int = BOOTSTRAP, seed: int = BOOTSTRAP_SEED,
                   confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of paired differences `d` and its percentile bootstrap interval
    (prompts drawn with replacement, `resamples` times, from numpy's default_rng(seed)); NaNs for
    no differences."""
    d = np.asarray(d, dtype=np.float64)
    n = len(d)
    if n == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = np.concatenate([d[rng.integers(0, n, size=(min(1000, resamples - a), n))].mean(axis=1)
                            for a in range(0, resamples, 1000)])
    lo, hi = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(d.mean()), float(lo), float(hi)


def paired_continuous(answers: pl.DataFrame, resamples: int = BOOTSTRAP, seed: int = BOOTSTRAP_SEED) -> pl.DataFrame:
    """Per (model, context, cell other than the baseline), on the same prompts as the baseline:
    n, the mean difference cell − exact cache of the correct value's teacher-forced log-probability
    (`dlogprob`, with its paired bootstrap interval `dlogprob_lo`, `dlogprob_hi`), the same of the
    margin over the best distractor on the prompts that state distractors (`n_margin`, `dmargin…`),
    and the share of those prompts whose correct value ranks first among the candidates under the
    cell and under the exact cache (`top1`, `base_top1`)."""
    rows = []
    df = _with_baseline(answers).filter(pl.col("cell") != BASELINE_CELL) if answers.height else answers
    for (model, context, cell), g in ([] if not answers.height else df.sort(*GROUP, "cell").group_by([*GROUP, "cell"], maintain_order=True)):
        d = (g["logprob"] - g["base_logprob"]).drop_nulls().to_numpy()
        m = g.filter(pl.col("margin").is_not_null() & pl.col("base_margin").is_not_null())
        dm = (m["margin"] - m["base_margin"]).to_numpy()
        lp, lp_lo, lp_hi = bootstrap_mean(d, resamples, seed)
        mg, mg_lo, mg_hi = bootstrap_mean(dm, resamples, seed)
        rows.append({"model": model, "context": context, "cell": cell, "label": cell_label(cell), "n": len(d),
                     "dlogprob": lp, "dlogprob_lo": lp_lo, "dlogprob_hi": lp_hi, "p_dlogprob": signed_rank_p(d),
                     "n_margin": len(dm),
                     "dmargin": mg, "dmargin_lo": mg_lo, "dmargin_hi": mg_hi,
                     "top1": float((m["margin"] > 0).mean()) if m.height else math.nan,
                     "base_top1": float((m["base_margin"] > 0).mean()) if m.height else math.nan})
    schema = {"model": pl.String, "context": pl.Int64, "cell": pl.String, "label": pl.String, "n": pl.Int64,
              "dlogprob": pl.Float64, "dlogprob_lo": pl.Float64, "dlogprob_hi": pl.Float64, "p_dlogprob": pl.Float64,
              "n_margin": pl.Int64,
              "dmargin": pl.Float64, "dmargin_lo": pl.Float64, "dmargin_hi": pl.Float64, "top1": pl.Float64,
              "base_top1": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


TAU_RESAMPLES = 2000


def tau_bootstrap(correct, kld, resamples: int = TAU_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                  confidence: float = CONFIDENCE) -> dict:
    """Kendall's tau-b between the cells' retrieval accuracy (higher first) and their median KLD
    (lower first), so +1 when the two orderings agree, with a percentile bootstrap interval over
    prompts. `correct` [prompts, cells] (bool; the same prompts for every cell, paired; or any
    per-prompt score, higher better, such as the paired Δ log p), `kld` [cells]. Every resample draws prompts with replacement (the same draw for all cells, from
    numpy's default_rng(seed)) and recomputes the accuracies; a resample whose accuracies are all
    tied has no tau and is left out (`defined` counts the others). NaNs for fewer than 3 cells."""
    x = np.asarray(correct, dtype=np.float64)
    kld = np.asarray(kld, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(kld):
        raise ValueError(f"tau_bootstrap: correct must be [prompts, {len(kld)} cells], got {x.shape}")
    nan = {"tau": math.nan, "lo": math.nan, "hi": math.nan, "defined": 0, "resamples": resamples}
    if len(kld) < 3 or x.shape[0] == 0:
        return nan
    tau = float(kendalltau(-x.mean(axis=0), kld).statistic)
    rng = np.random.default_rng(seed)
    taus = []
    for a in range(0, resamples, 500):
        acc = x[rng.integers(0, x.shape[0], size=(min(500, resamples - a), x.shape[0]))].mean(axis=1)
        taus += [float(kendalltau(-row, kld).statistic) if np.ptp(row) > 0 else math.nan for row in acc]
    taus = np.asarray(taus)
    ok = taus[~np.isnan(taus)]
    if not len(ok):
        return {**nan, "tau": tau}
    lo, hi = np.quantile(ok, [(1 - confidence) / 2, (1 + confidence) / 2])
    return {"tau": tau, "lo": float(lo), "hi": float(hi), "defined": int(len(ok)), "resamples": resamples}
