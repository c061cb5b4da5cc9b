"""The retrieval report: tables, the figure and a paragraph generated from the numbers, beside
the teacher-forced ordering of the same cells.

Owns `load_answers` (every answer file into one frame), `ordering` (per model the cells ranked
by retrieval and by median teacher-forced KLD, read from a run's results/summary.parquet when
present, and the pairs they order differently), `figure` (Altair, the house style of
`kvarn.report.figures`), `markdown`, `paragraph` and `write_report` (all of it, atomically).

Ranking by retrieval: accuracy, then agreement with the exact cache's answers, then fewer lost
prompts (higher is better); ties share a rank. By KLD: median KLD, lower is better. Two cells are
ordered differently ("disagree") when one is strictly ahead on retrieval accuracy and strictly
behind on median KLD; a tie in accuracy orders nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

import altair as alt
import polars as pl
from scipy.stats import kendalltau

from kvarn.files.atomic import atomic_path, write_text
from kvarn.report.figures import HEIGHT, WIDTH, save_chart
from kvarn.retrieval import headline, score
from kvarn.retrieval.tasks import read_tasks

ANSWER_COLUMNS = ("model", "context", "task", "id", "depth", "depth_index", "prompt_index", "cell", "answer",
                  "given", "correct", "text", "needle_start", "needle_end", "n_prompt", "gen_tokens", "distance",
                  "wall_s")


MEASURE_COLUMNS = ("logprob", "margin", "rank", "n_candidates")


def load_answers(paths) -> pl.DataFrame:
    """One row per (model, cell, prompt) from answer JSONL files (`kvarn.retrieval.run.run_cell`).
    `given` and `correct` are read again from the stored generated `text` by the current answer
    reader (`score.read_answer`): what the answer job stored is not trusted, so a changed reader
    rescores every stored answer."""
    paths = list(paths)
    rows = []
    for p in paths:
        for r in read_tasks(p):
            row = {k: r[k] for k in ANSWER_COLUMNS}
            row["given"], row["correct"] = score.grade(r["task"], r["text"], r["answer"])
            for k in MEASURE_COLUMNS:  # the continuous measure (None in answer files made before it)
                row[k] = r.get(k)
            rows.append(row)
    if not rows:
        raise ValueError(f"no retrieval answers in {len(paths)} files")
    return pl.DataFrame(rows, schema_overrides={"logprob": pl.Float64, "margin": pl.Float64, "rank": pl.Int64,
                                                "n_candidates": pl.Int64})


def _fmt(x, digits=2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _p(x: float) -> str:
    return "1" if x >= 0.9995 else f"{x:.3g}"


def _pv(x) -> str:  # a p-value that may be missing (None or NaN: no such test)
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else _p(x)


def teacher_forced_kld(path, model: str, cells) -> tuple[pl.DataFrame | None, str]:
    """(cell, kld_median) of `model`'s cells in a teacher-forced summary.parquet, and a note
    naming the run read (n_ctx, chunks) or why there is none. Of several runs the one holding the
    most of the cells is read (then the longest n_ctx, then the most chunks)."""
    if not Path(path).is_file():
        return None, f"no teacher-forced summary at {path}: run the same cells teacher-forced to compare"
    df = pl.read_parquet(path)
    need = {"model", "cell", "n_ctx", "chunks", "kld_median"}
    if not need <= set(df.columns):
        return None, f"{path} lacks the columns {sorted(need - set(df.columns))}"
    df = df.filter((pl.col("model") == model) & pl.col("cell").is_in(list(cells)))
    if df.height == 0:
        return None, f"{path} holds none of {model}'s retrieval cells"
    runs = df.group_by("n_ctx", "chunks").agg(pl.len().alias("n")).with_columns(
        pl.col("chunks").cast(pl.String)).sort(["n", "n_ctx", "chunks"], descending=True)
    n_ctx, chunks = runs["n_ctx"][0], runs["chunks"][0]
    got = df.filter((pl.col("n_ctx") == n_ctx) & (pl.col("chunks").cast(pl.String) == chunks))
    missing = sorted(set(cells) - set(got["cell"]))
    note = f"teacher-forced: {path}, n_ctx {n_ctx}, {chunks} chunk(s)" + (
        f"; not there: {', '.join(missing)}" if missing else "")
    return got.select("cell", "kld_median"), note


def _runs(frame: pl.DataFrame) -> list[tuple[str, int]]:
    """The (model, context) pairs of a frame, in order: every table and note is per pair."""
    return [(m, c) for m, c in frame.select(*score.GROUP).unique(maintain_order=True).sort(*score.GROUP).rows()]


def _of(frame: pl.DataFrame, model: str, context: int) -> pl.DataFrame:
    return frame.filter((pl.col("model") == model) & (pl.col("context") == context))


def _measure_matrix(answers: pl.DataFrame, cells: list[str]):
    """[prompts, cells] of (cell − exact cache) of the correct value's log p on the prompts every
    cell and the baseline scored (None without the measure)."""
    if "logprob" not in answers.columns or answers["logprob"].is_null().all():
        return None
    wide = answers.filter(pl.col("cell").is_in([*cells, score.BASELINE_CELL])).pivot(
        on="cell", index="id", values="logprob").drop_nulls()
    if score.BASELINE_CELL not in wide.columns or not set(cells) <= set(wide.columns) or not wide.height:
        return None
    return wide.select(cells).to_numpy() - wide[score.BASELINE_CELL].to_numpy()[:, None]


def ordering(scores: pl.DataFrame, teacher_forced, answers: pl.DataFrame | None = None,
             paired: pl.DataFrame | None = None) -> tuple[pl.DataFrame, dict[tuple[str, int], str]]:
    """Per model, context and non-baseline cell: retrieval rank and median-KLD rank (None without
    a teacher-forced row); and per (model, context) a note (which run was read, Kendall's tau, with
    `answers` its bootstrap interval over prompts (`score.tau_bootstrap`), the pairs the two
    orderings disagree on).

    The retrieval rank (issue 53) is by the paired continuous difference when `paired` has it:
    the mean (cell − exact cache) of the correct value's teacher-forced log p, higher (less lost)
    first, then accuracy; accuracy beside it. Without the measure: accuracy, then agreement, then
    fewer lost. Kendall's tau and the disagreements compare the same measure with median KLD."""
    rows, notes = [], {}
    for model, context in _runs(scores):
        s = _of(scores, model, context).filter(pl.col("cell") != score.BASELINE_CELL)
        kld, note = teacher_forced_kld(teacher_forced, model, s["cell"].to_list())
        s = s.join(kld, on="cell", how="left") if kld is not None else s.with_columns(
            pl.lit(None, dtype=pl.Float64).alias("kld_median"))
        pc = None if paired is None else _of(paired, model, context).filter(pl.col("dlogprob").is_not_nan())
        by_lp = pc is not None and pc.height == s.height
        if by_lp:
            s = s.join(pc.select("cell", "dlogprob"), on="cell", how="left")
            key = list(zip(-s["dlogprob"], -s["accuracy"]))
            measure, what = "dlogprob", "Δ log p"
        else:
            s = s.with_columns(pl.lit(None, dtype=pl.Float64).alias("dlogprob"))
            key = list(zip(-s["accuracy"], -s["agreement"], s["lost"]))
            measure, what = "accuracy", "accuracy"
        s = s.with_columns(pl.Series("retrieval_rank", [1 + sum(k2 < k for k2 in key) for k in key]),
                           pl.col("kld_median").rank("min").alias("kld_rank"),
                           pl.lit(measure).alias("ranked_by"))
        pairs = []
        recs = s.to_dicts()
        for i, a in enumerate(recs):
            for b in recs[i + 1 :]:
                if a["kld_median"] is None or b["kld_median"] is None:
                    continue
                if (a[measure] - b[measure]) * (b["kld_median"] - a["kld_median"]) < 0:
                    hi, lo = (a, b) if a[measure] > b[measure] else (b, a)
                    shown = (f"Δ log p {hi['dlogprob']:+.3f} vs {lo['dlogprob']:+.3f}" if by_lp
                             else f"{hi['correct']}/{hi['n']} vs {lo['correct']}/{lo['n']}")
                    pairs.append(f"{hi['label']} retrieves better ({shown}) "
                                 f"with the higher median KLD ({hi['kld_median']:.3g} vs {lo['kld_median']:.3g})")
        have = s.filter(pl.col("kld_median").is_not_null())
        tau = float(kendalltau(-have[measure], have["kld_median"]).statistic) if have.height > 2 else math.nan
        ci = ""
        if answers is not None and have.height > 2 and not math.isnan(tau):
            a = _of(answers, model, context)
            cells = have["cell"].to_list()
            if by_lp:
                x = _measure_matrix(a, cells)
            else:
                x = a.filter(pl.col("cell").is_in(cells)).pivot(on="cell", index="id", values="correct").drop_nulls(
                ).select(cells).to_numpy().astype(bool)
            if x is not None:
                t = score.tau_bootstrap(x, have["kld_median"].to_numpy())
                s = s.with_columns(pl.lit(t["tau"]).alias("tau"), pl.lit(t["lo"]).alias("tau_lo"),
                                   pl.lit(t["hi"]).alias("tau_hi"))
                ci = (f" [{t['lo']:+.2f}, {t['hi']:+.2f}] (95 % bootstrap over the {x.shape[0]} prompts, "
                      f"{t['defined']} of {t['resamples']} resamples with a tau)") if t["defined"] else \
                    " (no bootstrap interval: every resample ties all cells)"
        notes[(model, context)] = note + (f"; Kendall's tau ({what} vs median KLD) {tau:+.2f}{ci}" if not math.isnan(tau) else "") + (
            "; disagreements: " + "; ".join(pairs) if pairs else ("; no pair ordered differently" if kld is not None else ""))
        rows.append(s.with_columns(pl.lit(len(pairs)).alias("disagreements")))
    return pl.concat(rows, how="diagonal_relaxed").sort(*score.GROUP, "retrieval_rank"), notes


def figure(scores: pl.DataFrame, dist: pl.DataFrame) -> alt.TopLevelMixin:
    """Per model and context: accuracy by the needle's distance from the end of the prompt, one
    line per cell, Wilson intervals as bars; beside it each cell's overall accuracy."""
    panels = []
    for model, context in _runs(scores):
        d = _of(dist, model, context)
        s = _of(scores, model, context)
        model = f"{model} ({context} tokens)"
        order = s.sort("cell")["label"].to_list()
        color = alt.Color("label:N", title="cell", sort=order)
        base = alt.Chart(d).encode(x=alt.X("bin:O", title="needle distance from the end (tokens)",
                                           sort=alt.SortField("bin_lo")), color=color)
        lines = base.mark_line(point=True).encode(
            y=alt.Y("accuracy:Q", title="accuracy (95 % Wilson)", scale=alt.Scale(domain=[0, 1])),
            tooltip=["label:N", "bin:N", "correct:Q", "n:Q", alt.Tooltip("accuracy:Q", format=".2f")])
        bars = base.mark_errorbar(opacity=0.4).encode(y=alt.Y("acc_lo:Q", title="accuracy (95 % Wilson)"), y2="acc_hi:Q")
        left = (bars + lines).properties(width=WIDTH * 0.55, height=HEIGHT * 0.8,
                                         title=alt.TitleParams(f"{model}: accuracy by distance", fontSize=11))
        pts = alt.Chart(s).encode(y=alt.Y("label:N", title=None, sort=order), color=alt.Color("label:N", sort=order,
                                                                                              legend=None))
        right = (pts.mark_rule().encode(x=alt.X("acc_lo:Q", title="accuracy, all prompts (95 % Wilson)",
                                                scale=alt.Scale(domain=[0, 1])), x2="acc_hi:Q")
                 + pts.mark_point(filled=True, size=60).encode(x="accuracy:Q")).properties(
            width=WIDTH * 0.35, height=HEIGHT * 0.8, title=alt.TitleParams(f"{model}: overall", fontSize=11))
        panels.append(alt.hconcat(left, right))
    return alt.vconcat(*panels).properties(title=alt.TitleParams(
        "Long-context retrieval through a quantized KV cache",
        subtitle="greedy answers to seeded pass-key, multi-key and key-value prompts; "
                 "bf16 (exact) = the exact cache's own answers", anchor="start"))


def grid(answers: pl.DataFrame) -> pl.DataFrame:
    """Per (model, cell, context, depth): n, correct, accuracy, the mean (cell − exact cache) of the
    correct value's log p on those prompts (`dlogprob`; None for the baseline or without the
    measure), and how many of the needles lie in the cell's sink / exact tail / body
    (`score.needle_position`): the length x depth grid of RULER's and NIAH's heatmaps."""
    df = answers
    if "position" not in df.columns:
        df = score.with_position(df)
    has_lp = "logprob" in df.columns and not df["logprob"].is_null().all()
    base = df.filter(pl.col("cell") == score.BASELINE_CELL).select(
        *score.GROUP, "id", (pl.col("logprob") if has_lp else pl.lit(None, dtype=pl.Float64)).alias("base_lp"))
    df = df.join(base, on=[*score.GROUP, "id"], how="left").with_columns(pl.when(
        pl.col("cell") != score.BASELINE_CELL).then(pl.col("logprob") - pl.col("base_lp") if has_lp else None).alias("d_lp"))
    return df.group_by("model", "cell", "context", "depth").agg(
        pl.len().alias("n"), pl.col("correct").sum().alias("correct"), pl.col("d_lp").mean().alias("dlogprob"),
        *[(pl.col("position") == w).sum().alias(f"in_{w}") for w in score.POSITIONS],
    ).with_columns((pl.col("correct") / pl.col("n")).alias("accuracy"),
                   pl.col("cell").map_elements(score.cell_label, return_dtype=pl.String).alias("label"),
                   ).sort("model", "cell", "context", "depth")


def grid_markdown(g: pl.DataFrame) -> str:
    """Per model the length x depth grid as a table: a row per (cell, context), a column per depth,
    correct/n (and, for a quantized cell, the mean Δ log p), then the needles' positions."""
    parts = ["", "## The length x depth grid", "",
             "Per model, cell and context, for each needle depth: correct / prompts, and for a quantized cell the "
             "mean Δ log p against the exact cache on those prompts (nats); positions: how many needles lie in the "
             "cell's exact sink / exact tail / quantized body (full-attention layers; `score.needle_position`).", ""]
    for model in sorted(g["model"].unique()):
        d = g.filter(pl.col("model") == model)
        depths = sorted(d["depth"].unique())
        rows = []
        for (label, cell, ctx), x in d.sort("cell", "context").group_by("label", "cell", "context", maintain_order=True):
            by = {r["depth"]: r for r in x.iter_rows(named=True)}
            cells = [(f"{by[z]['correct']}/{by[z]['n']}" + ("" if by[z]["dlogprob"] is None else f" ({by[z]['dlogprob']:+.2f})"))
                     if z in by else "–" for z in depths]
            rows.append([label, ctx, *cells, f"{int(x['in_sink'].sum())} / {int(x['in_tail'].sum())} / {int(x['in_body'].sum())}"])
        parts += [f"### {model}", "", _table(["cell", "context", *[f"depth {z:g}" for z in depths], "sink / tail / body"],
                                             rows), ""]
    return "\n".join(parts)


def heatmap(g: pl.DataFrame) -> alt.TopLevelMixin:
    """RULER / NIAH style: per model, one panel per cell, context length (rows) x the needle's depth
    (columns), coloured by accuracy, each square labelled correct/n."""
    rows = []
    for model in sorted(g["model"].unique()):
        d = g.filter(pl.col("model") == model).with_columns(
            pl.format("{}/{}", "correct", "n").alias("frac"), pl.col("depth").cast(pl.String).alias("d"))
        order = d.sort("cell")["label"].unique(maintain_order=True).to_list()
        base = alt.Chart(d).encode(
            x=alt.X("d:O", title="needle depth"),
            y=alt.Y("context:O", title="context (tokens)", sort="descending"))
        rect = base.mark_rect().encode(color=alt.Color("accuracy:Q", scale=alt.Scale(
            domain=[0, 1], scheme="redyellowgreen"), title="accuracy"), tooltip=["label:N", "context:Q", "depth:Q", "frac:N",
            alt.Tooltip("dlogprob:Q", format="+.3f"), "in_sink:Q", "in_tail:Q", "in_body:Q"])
        rows.append((rect + base.mark_text(fontSize=9).encode(text="frac:N")).properties(width=WIDTH * 0.16, height=HEIGHT * 0.3).facet(
            column=alt.Column("label:N", title=None, sort=order), title=model))
    return alt.vconcat(*rows).properties(title=alt.TitleParams(
        "Retrieval accuracy by context length and needle depth, per cache",
        subtitle="greedy answers; bf16 (exact) = the exact cache; squares labelled correct / prompts; needle depth 0: "
                 "right after the intro, 1: right before the question", anchor="start"))


def _table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(out)


def markdown(answers, scores, by_task, comps, dist, tail, order, notes, paired) -> str:
    parts = ["# Retrieval through a quantized KV cache", "",
             f"{answers.height} answers: {', '.join(sorted(answers['task'].unique()))} tasks, contexts "
             f"{', '.join(map(str, sorted(answers['context'].unique())))}; accuracy with 95 % Wilson intervals; "
             "agreement = same answer as the exact (bf16, tail 0) cache; lost / gained = prompts the exact cache "
             "answers right and the cell wrong / the reverse.", ""]
    for model, context in _runs(scores):
        s = _of(scores, model, context)
        parts += [f"## {model}, context {context}", "", _table(
            ["cell", "accuracy", "95 % CI", "correct", "agreement", "lost", "gained", "flip rate [95 % exact CI]",
             "p (flips)", "p (Holm)"],
            [[r["label"], _fmt(r["accuracy"]), f"[{_fmt(r['acc_lo'])}, {_fmt(r['acc_hi'])}]", f"{r['correct']}/{r['n']}",
              _fmt(r["agreement"]), r["lost"], r["gained"],
              f"{_fmt(r['flip_rate'])} [{_fmt(r['flip_lo'])}, {_fmt(r['flip_hi'])}]" if r["cell"] != score.BASELINE_CELL
              else "–", _p(r["p_flips"]) if r["cell"] != score.BASELINE_CELL else "–",
              "–" if r.get("p_holm") is None else _p(r["p_holm"])] for r in s.iter_rows(named=True)]), "",
                  "p (flips): exact two-sided binomial test of lost against gained (the exact McNemar test of the "
                  "cell against the exact cache); p (Holm): adjusted across every test of this section (the "
                  "flip tests, the Wilcoxon signed-rank tests of Δ log p against the exact cache and the paired "
                  "comparisons below, McNemar and Wilcoxon).", ""]
        t = _of(by_task, model, context)
        tasks = sorted(t["task"].unique())
        parts += ["Accuracy per task:", "", _table(["cell", *tasks], [
            [lab, *[(lambda x: f"{x['correct'][0]}/{x['n'][0]}" if x.height else "–")(
                t.filter((pl.col("label") == lab) & (pl.col("task") == k))) for k in tasks]]
            for lab in s["label"]]), ""]
        c = _of(comps, model, context)
        if c.height:
            parts += ["Paired comparisons (exact McNemar on the same prompts):", "", _table(
                ["A", "B", "prompts", "accuracy A", "accuracy B", "A only right", "B only right", "p (two-sided)",
                 "p (Holm)", "Δ log p (A − B) [95 % CI]", "p (Wilcoxon)", "p (Holm)"],
                [[r["a_label"], r["b_label"], r["n"], _fmt(r["acc_a"]), _fmt(r["acc_b"]), r["a_only"], r["b_only"],
                  _p(r["p"]), "–" if r.get("p_holm") is None else _p(r["p_holm"]),
                  f"{_fmt(r['dlogprob'], 3)} [{_fmt(r['dlogprob_lo'], 3)}, {_fmt(r['dlogprob_hi'], 3)}]",
                  _pv(r.get("p_dlogprob")), _pv(r.get("p_dlogprob_holm"))]
                 for r in c.iter_rows(named=True)]), ""]
        pc = _of(paired, model, context)
        if pc.height:
            sc = {r["cell"]: r for r in s.iter_rows(named=True)}
            parts += ["Against the exact cache, paired on the same prompts: accuracy and flips, and the mean "
                      "difference (cell − exact) of the correct value's teacher-forced log-probability "
                      "(nats, summed over its tokens) and of its margin over the best distractor value in the "
                      "prompt (prompts with distractors), with 95 % paired bootstrap intervals; top-1 = the "
                      "correct value ranks first among the prompt's values (cell / exact):", "", _table(
                ["cell", "correct", "lost", "gained", "Δ log p", "95 % CI", "p (Wilcoxon)", "p (Holm)", "Δ margin",
                 "95 % CI", "top-1"],
                [[r["label"], f"{sc[r['cell']]['correct']}/{sc[r['cell']]['n']}", sc[r["cell"]]["lost"],
                  sc[r["cell"]]["gained"], _fmt(r["dlogprob"], 3), f"[{_fmt(r['dlogprob_lo'], 3)}, {_fmt(r['dlogprob_hi'], 3)}]",
                  _pv(r.get("p_dlogprob")), _pv(r.get("p_holm")),
                  _fmt(r["dmargin"], 3), f"[{_fmt(r['dmargin_lo'], 3)}, {_fmt(r['dmargin_hi'], 3)}] (n {r['n_margin']})",
                  f"{_fmt(r['top1'])} / {_fmt(r['base_top1'])}"] for r in pc.iter_rows(named=True)]), ""]
        d = _of(dist, model, context)
        bins = d.sort("bin_lo")["bin"].unique(maintain_order=True).to_list()
        parts += ["Accuracy by the needle's distance from the end of the prompt (tokens):", "", _table(
            ["cell", *bins], [[lab, *[(lambda x: f"{x['correct'][0]}/{x['n'][0]}" if x.height else "–")(
                d.filter((pl.col("label") == lab) & (pl.col("bin") == b))) for b in bins]] for lab in s["label"]]), ""]
        e = _of(tail, model, context)
        if e.height:
            parts += ["By where a full-attention layer reads the needle from (sink: all of it in the cell's exact "
                      "leading tokens, KVarN's 128; tail: all of it within every answering query's exact tail; "
                      "body: some of it from the quantized body):", "", _table(
                ["cell", "needle in", "prompts", "exact cache right", "cell right", "lost", "answer differs"],
                [[r["label"], r["position"], r["n"], r["base_correct"], r["correct"], r["lost"], r["differ"]]
                 for r in e.iter_rows(named=True)]), ""]
        o = _of(order, model, context)
        parts += ["Ordering: retrieval (ranked by the paired Δ log p against the exact cache, higher first; accuracy "
                  "beside it) next to the teacher-forced median KLD of the same cells:", "", _table(
            ["cell", "retrieval rank", "Δ log p", "accuracy", "median KLD", "KLD rank"],
            [[r["label"], r["retrieval_rank"], _fmt(r.get("dlogprob"), 3), _fmt(r["accuracy"]),
              "–" if r["kld_median"] is None else f"{r['kld_median']:.4g}",
              "–" if r["kld_rank"] is None else int(r["kld_rank"])] for r in o.iter_rows(named=True)]), "",
                  notes[(model, context)] + ".", ""]
    return "\n".join(parts)


def paragraph(scores, comps, tail, order, notes, paired) -> str:
    """The findings in prose, every number read from the tables."""
    out = []
    for model, context in _runs(scores):
        s = _of(scores, model, context)
        base = s.filter(pl.col("cell") == score.BASELINE_CELL).row(0, named=True)
        cells = s.filter(pl.col("cell") != score.BASELINE_CELL).sort("accuracy", descending=True)
        acc = ", ".join(f"{r['label']} {r['correct']}/{r['n']} (lost {r['lost']})" for r in cells.iter_rows(named=True))
        text = (f"**{model}**, {context}-token prompts: the exact cache answers {base['correct']}/{base['n']} prompts; the quantized cells {acc}.")
        c = _of(comps, model, context)
        if c.height:
            text += " Paired on the same prompts (exact McNemar): " + "; ".join(
                f"{r['a_label']} alone right on {r['a_only']}, {r['b_label']} alone on {r['b_only']} of {r['n']} "
                f"(p = {_p(r['p'])})" for r in c.iter_rows(named=True)) + "."

        pc = _of(paired, model, context)
        tests = holm_tests(s, c, pc)
        if tests:
            sig = [t for t, p in tests if p < headline.ALPHA]
            not_sig = [t for t, p in tests if p >= headline.ALPHA]
            text += (f" After Holm's adjustment across the {len(tests)} tests shown (each cell against the exact cache: "
                     "its flips, exact binomial, and its Δ log p, Wilcoxon signed-rank; each pair of formats: McNemar "
                     "and Wilcoxon), significant at 5 %: " + ("; ".join(sig) if sig else "none") +
                     ". Not significant: " + ("; ".join(not_sig) if not_sig else "none") + ".")
        e = _of(tail, model, context)
        for where, what in (("tail", "exact tail"), ("sink", "exact sink (KVarN's first 128 tokens)")):
            w = e.filter(pl.col("position") == where)
            if w.height:
                lost, n = int(w["lost"].sum()), int(w["n"].sum())
                text += (f" Of the {n} (cell, prompt) pairs whose needle lies inside the cell's {what}, "
                         f"{lost} {'is' if lost == 1 else 'are'} lost against the exact cache"
                         + (" — the needle itself is read exactly there, so such a loss comes from the quantized "
                            "rest of the context." if lost else ": such a needle was never lost."))
        if pc.height:
            text += " Paired against the exact cache on the same prompts, the correct value's log-probability " \
                    "changes by " + "; ".join(
                        f"{r['dlogprob']:+.3f} nats [{r['dlogprob_lo']:+.3f}, {r['dlogprob_hi']:+.3f}] ({r['label']})"
                        for r in pc.iter_rows(named=True)) + " (mean, 95 % paired bootstrap)."
        note = notes[(model, context)]
        text += " " + note[0].upper() + note[1:] + "."
        out.append(text)
    models = sorted(scores["model"].unique())
    out.append(f"Caveat: {headline.caveat(models, scores['context'].unique())}.")
    return "\n\n".join(out) + "\n"


def holm_tests(s: pl.DataFrame, c: pl.DataFrame, pc: pl.DataFrame) -> list[tuple[str, float]]:
    """Every Holm-adjusted test of one (model, context) as (what it compares, p after Holm): each
    cell's flips and Δ log p against the exact cache, each pair's McNemar and Δ log p."""
    out = []
    for r in s.filter(pl.col("cell") != score.BASELINE_CELL).iter_rows(named=True):
        if r.get("p_holm") is not None:
            out.append((f"{r['label']} vs the exact cache, flips (lost {r['lost']}, gained {r['gained']}, "
                        f"p {_p(r['p_holm'])})", r["p_holm"]))
    for r in pc.iter_rows(named=True):
        if r.get("p_holm") is not None:
            out.append((f"{r['label']} vs the exact cache, Δ log p {r['dlogprob']:+.3f} (p {_p(r['p_holm'])})", r["p_holm"]))
    for r in c.iter_rows(named=True):
        if r.get("p_holm") is not None:
            out.append((f"{r['a_label']} vs {r['b_label']}, McNemar ({r['a_only']} vs {r['b_only']}, "
                        f"p {_p(r['p_holm'])})", r["p_holm"]))
        if r.get("p_dlogprob_holm") is not None:
            out.append((f"{r['a_label']} vs {r['b_label']}, Δ log p {r['dlogprob']:+.3f} (p {_p(r['p_dlogprob_holm'])})",
                        r["p_dlogprob_holm"]))
    return out


def write_report(answer_paths, outputs: dict, teacher_forced="results/summary.parquet", bins=None) -> list[Path]:
    """Every output of `kvarn.retrieval.plan.report_files` from the answer files, atomically."""
    answers = score.with_position(load_answers(answer_paths))
    scores = score.cell_scores(answers)
    by_task = score.cell_scores(answers, by=("model", "task"))
    paired = score.paired_continuous(answers.filter(pl.col("logprob").is_not_null()))
    scores, comps, paired = score.with_holm(scores, score.comparisons(answers), paired)
    dist = score.by_distance(answers, **({"edges": tuple(bins)} if bins else {}))
    tail = score.exact_tail(answers)
    order, notes = ordering(scores, teacher_forced, answers, paired)
    cells_grid = grid(answers)
    for key, frame in (("scores", scores), ("comparisons", comps), ("by_distance", dist), ("exact_tail", tail),
                       ("ordering", order), ("answers", answers), ("paired", paired), ("grid", cells_grid)):
        Path(outputs[key]).parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(outputs[key]) as tmp:
            frame.write_parquet(tmp)
    write_text(outputs["md"], markdown(answers, scores, by_task, comps, dist, tail, order, notes, paired)
               + grid_markdown(cells_grid))
    write_text(outputs["paragraph"], paragraph(scores, comps, tail, order, notes, paired))
    stem = Path(outputs["figure_png"]).with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    written = save_chart(figure(scores, dist), stem)
    written += save_chart(heatmap(cells_grid), Path(outputs["heatmap_png"]).with_suffix(""))
    return [Path(p) for k, p in outputs.items() if not k.startswith(("figure_", "heatmap_"))] + written
