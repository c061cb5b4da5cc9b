"""Figures of generated text: free-running decode (kvarn.run.decode: survival and the KLD of each
step) and long generation's statistics (kvarn.report.generation: survival, KLD along the text,
its slope, teacher-forced against free-running).
"""

from __future__ import annotations

import altair as alt
import polars as pl

from kvarn.plan import generation
from kvarn.report.figures import HEIGHT, KLD_FMT, WIDTH, cell_encodings, chart_title, family_dash, placeholder


def decode(frame: pl.DataFrame) -> alt.HConcatChart:
    """Free-running decode (kvarn.run.decode): survival curves (fraction of prompts whose
    generation still equals the BF16 baseline's after t tokens) and the mean KLD of each
    decode step along the cell's own text; dashed standard, solid KVarN, colour = width."""
    model, p, g = frame["model"][0], frame["prompts"][0], frame["tokens"][0]
    frame = frame.with_columns(pl.col("width").fill_null(0))
    color, dash = cell_encodings(frame)
    tt = [alt.Tooltip("label:N", title="cell"), alt.Tooltip("step:Q", title="tokens generated"),
          alt.Tooltip("survival:Q", title="still identical", format=".0%"),
          alt.Tooltip("first_divergence_median:Q", title="median first divergence"),
          alt.Tooltip("decode_kld_mean:Q", title="mean KLD along own text", format=KLD_FMT)]
    surv = alt.Chart(frame, name="survival").mark_line(strokeWidth=2, interpolate="step-after").encode(
        x=alt.X("step:Q", title="tokens generated", scale=alt.Scale(domain=[0, g])),
        y=alt.Y("survival:Q", title="fraction of prompts identical to the baseline", scale=alt.Scale(domain=[0, 1])),
        color=color, strokeDash=dash, detail="label:N", tooltip=tt)
    kl = frame.filter(pl.col("kld_step_mean").is_not_null()).with_columns(
        pl.col("kld_step_mean").clip(lower_bound=1e-8))
    kld = alt.Chart(kl, name="kld_per_step").mark_line(strokeWidth=1.5).encode(
        x=alt.X("step:Q", title="decode step"),
        y=alt.Y("kld_step_mean:Q", title=f"mean KLD over the {p} prompts (log)", scale=alt.Scale(type="log")),
        color=color, strokeDash=dash, detail="label:N",
        tooltip=[alt.Tooltip("label:N", title="cell"), alt.Tooltip("step:Q"),
                 alt.Tooltip("kld_step_mean:Q", title="mean KLD", format=KLD_FMT)])
    return alt.hconcat(
        surv.properties(width=WIDTH * 0.55, height=HEIGHT,
                                        title=alt.TitleParams("survival: identical to the baseline", fontSize=11)),
        kld.properties(width=WIDTH * 0.55, height=HEIGHT,
                       title=alt.TitleParams("KLD vs baseline along the cell's own text", fontSize=11)),
    ).properties(title=chart_title(model, f"free-running decode, {frame['decoding'][0]}",
                              f"{p} prompts, {g} generated tokens each, baseline re-scoring the cell's text; "
                              "a drop in survival is the first token where generation leaves the baseline"))


def _gen_title(cells: pl.DataFrame, text: str, subtitle: str) -> alt.TitleParams:
    r = cells.row(0, named=True)
    return chart_title(r["model"], text, f"n_ctx {r['n_ctx']}, {r['prompts']} prompts × {r['tokens']} generated tokens, "
                  f"{r.get('decoding', 'greedy')}; " + subtitle)


def _with_cells(frame: pl.DataFrame, cells: pl.DataFrame) -> pl.DataFrame:
    return frame.join(cells.select("cell", "label", "family", pl.col("width").fill_null(0)), on="cell", how="left")


def generation_encodings(frame: pl.DataFrame):
    """Colour per cell (two rows of one width, e.g. q4_0 t128 and its format-only row, apart), dash per family."""
    dash = family_dash(frame["family"].unique().to_list())
    scheme = "tableau10" if frame["label"].n_unique() <= 10 else "tableau20"  # a colour per cell
    return alt.Color("label:N", title="cell", scale=alt.Scale(scheme=scheme),
                     legend=alt.Legend(orient="bottom", columns=2, labelLimit=400)), dash


def step_points(frame: pl.DataFrame, by: str = "cell", t: str = "t") -> pl.DataFrame:
    """The rows of step functions (one per `by`, sorted by `t`) where any other column changes,
    plus each one's first and last: drawn with "step-after" interpolation, the same picture from
    a few rows instead of G + 1 per cell (altair embeds at most 5000 rows in a chart)."""
    cols = [c for c in frame.columns if c not in (by, t)]
    frame = frame.sort(by, t)
    changed = pl.any_horizontal([pl.col(c).ne_missing(pl.col(c).shift(1).over(by)) for c in cols])
    last = pl.col(t) == pl.col(t).max().over(by)
    return frame.filter(changed | last)


def generation_survival(tables: dict[str, pl.DataFrame]) -> alt.LayerChart:
    """Kaplan–Meier survival of the first divergence per cell, with its band."""
    cells = tables["cells"]
    s = _with_cells(step_points(tables["survival"]), cells)
    color, dash = generation_encodings(s)
    base = alt.Chart(s).encode(x=alt.X("t:Q", title="tokens generated"), color=color, detail="label:N")
    band = base.mark_area(opacity=0.12, interpolate="step-after").encode(
        y=alt.Y("lo:Q", title="fraction of prompts identical to the baseline", scale=alt.Scale(domain=[0, 1])),
        y2="hi:Q")
    line = base.mark_line(strokeWidth=2, interpolate="step-after").encode(
        y="survival:Q", strokeDash=dash,
        tooltip=[alt.Tooltip("label:N", title="cell"), alt.Tooltip("t:Q", title="tokens generated"),
                 alt.Tooltip("survival:Q", format=".2f"), alt.Tooltip("lo:Q", format=".2f"),
                 alt.Tooltip("hi:Q", format=".2f"), alt.Tooltip("at_risk:Q", title="at risk")])
    return alt.layer(band, line).properties(
        width=WIDTH, height=HEIGHT, name="generation_survival",
        title=_gen_title(cells, "survival of the baseline's text (Kaplan–Meier)",
                         "band: 95 % exponential-Greenwood interval; a prompt never diverging is censored at G"))


def generation_kld_steps(tables: dict[str, pl.DataFrame]) -> alt.LayerChart:
    """Mean per-step KLD along each cell's own text in bins of steps, with a bootstrap band over prompts."""
    cells = tables["cells"]
    c = _with_cells(tables["curves"].filter(pl.col("kind") == "free-running"), cells).with_columns(
        pl.col("kld_mean", "lo", "hi").clip(lower_bound=1e-8))
    color, dash = generation_encodings(c)
    base = alt.Chart(c).encode(x=alt.X("step_mid:Q", title="generated step (bin centre)"), color=color, detail="label:N")
    band = base.mark_area(opacity=0.12).encode(
        y=alt.Y("lo:Q", title="mean KLD vs baseline over prompts (log)", scale=alt.Scale(type="log")), y2="hi:Q")
    line = base.mark_line(strokeWidth=2).encode(
        y="kld_mean:Q", strokeDash=dash,
        tooltip=[alt.Tooltip("label:N", title="cell"), alt.Tooltip("step_lo:Q", title="from step"),
                 alt.Tooltip("step_hi:Q", title="to step"), alt.Tooltip("kld_mean:Q", format=KLD_FMT),
                 alt.Tooltip("lo:Q", format=KLD_FMT), alt.Tooltip("hi:Q", format=KLD_FMT)])
    width = int(c["step_hi"][0] - c["step_lo"][0] + 1)
    return alt.layer(band, line).properties(
        width=WIDTH, height=HEIGHT, name="generation_kld_steps",
        title=_gen_title(cells, "KLD along the cell's own text",
                         f"mean over prompts in bins of {width} steps; band: 95 % bootstrap over prompts"))


def _interval_chart(frame: pl.DataFrame, y: str, x: str, lo: str, hi: str, title: str, name: str) -> alt.LayerChart:
    base = alt.Chart(frame).encode(y=alt.Y(f"{y}:N", title=None, sort=None, axis=alt.Axis(labelLimit=420)))
    bars = base.mark_rule(strokeWidth=2, color="#555").encode(x=alt.X(f"{lo}:Q", title=title), x2=f"{hi}:Q")
    pts = base.mark_point(filled=True, size=60, color="#e45756").encode(
        x=f"{x}:Q", tooltip=[alt.Tooltip(f"{y}:N"), alt.Tooltip(f"{x}:Q", format=".3g"),
                             alt.Tooltip(f"{lo}:Q", format=".3g"), alt.Tooltip(f"{hi}:Q", format=".3g")])
    return alt.layer(bars, pts).properties(width=WIDTH * 0.5, height=max(80, 22 * frame.height), name=name)


def generation_slopes(tables: dict[str, pl.DataFrame]) -> alt.HConcatChart:
    """Accumulation: the slope of KLD against the generated step per cell, and KVarN − same-width standard."""
    cells, paired = tables["cells"], tables["paired"]
    zero = alt.Chart(pl.DataFrame({"x": [0.0]})).mark_rule(color="#999", strokeDash=[2, 2]).encode(x="x:Q")
    left = alt.layer(zero, _interval_chart(cells, "label", "slope_per_1k", "slope_lo_per_1k", "slope_hi_per_1k",
                                           "KLD slope per 1000 generated tokens", "slopes"))
    if paired.height:
        p = paired.with_columns((pl.col("kvarn_label") + " − " + pl.col("standard_label")).alias("pair"))
        right = alt.layer(zero, _interval_chart(p, "pair", "diff_per_1k", "diff_lo_per_1k", "diff_hi_per_1k",
                                                "slope difference per 1000 tokens (< 0: KVarN slower)", "paired"))
    else:
        right = placeholder(cells["model"][0], "paired slopes", "no KVarN cell with a same-width standard cell")
    return alt.hconcat(left, right).properties(
        title=_gen_title(cells, "does the error accumulate?",
                         "OLS slope of the mean per-step KLD; bars: 95 % bootstrap over prompts (paired: joint)"))


def generation_tf_vs_free(tables: dict[str, pl.DataFrame]) -> alt.VConcatChart:
    """Free-running KLD over teacher-forced KLD at the same positions per cell, and both curves."""
    cells = tables["cells"]
    one = alt.Chart(pl.DataFrame({"x": [1.0]})).mark_rule(color="#999", strokeDash=[2, 2]).encode(x="x:Q")
    ratio = alt.layer(one, _interval_chart(cells, "label", "ratio", "ratio_lo", "ratio_hi",
                                           "mean free-running KLD / mean teacher-forced KLD", "ratio"))
    c = _with_cells(tables["curves"].filter(pl.col("kind") != "free-running"), cells).with_columns(
        pl.col("kld_mean").clip(lower_bound=1e-8), (pl.col("step_mid") + cells["n_ctx"][0] - cells["tokens"][0] - 1)
        .alias("pos_mid"))
    curves = alt.Chart(c).mark_line(strokeWidth=1.5).encode(
        x=alt.X("pos_mid:Q", title="absolute position in the chunk", scale=alt.Scale(zero=False)),
        y=alt.Y("kld_mean:Q", title="mean KLD (log)", scale=alt.Scale(type="log")),
        color=alt.Color("kind:N", title=None, legend=alt.Legend(orient="bottom"),
                        scale=alt.Scale(domain=["free-running, compared steps", "teacher-forced"],
                                        range=["#e45756", "#4c78a8"])),
        tooltip=[alt.Tooltip("label:N"), alt.Tooltip("kind:N"), alt.Tooltip("pos_mid:Q"),
                 alt.Tooltip("kld_mean:Q", format=KLD_FMT)]
    ).properties(width=200, height=130).facet(facet=alt.Facet("label:N", title=None), columns=4)
    return alt.vconcat(ratio, curves).properties(
        title=_gen_title(cells, "teacher-forced vs free-running KLD at the same positions",
                         "same chunks and absolute positions; > 1: the teacher-forced table understates generation "
                         "damage; bars: 95 % bootstrap over prompts"))


# The names are kvarn.plan.generation's (its workflow targets), in its order.
GENERATION_FIGURES = dict(zip(generation.GENERATION_FIGURES, (generation_survival, generation_kld_steps, generation_slopes,
                                                       generation_tf_vs_free), strict=True))


def generation_figure(name: str, tables: dict[str, pl.DataFrame]) -> alt.TopLevelMixin:
    """A figure of one decode run's generation statistics (kvarn.report.generation.compute_run)."""
    if name not in GENERATION_FIGURES:
        raise ValueError(f"unknown generation figure {name!r}; expected one of {sorted(GENERATION_FIGURES)}")
    return GENERATION_FIGURES[name](tables)
