"""Figures inside a run's cells: per-token KLD by position in the context and its distribution
(the chosen cells' tokens.parquet, kvarn.report.tokens), and the attention error of each layer
(kvarn.run.layer_error).
"""

from __future__ import annotations

import altair as alt
import polars as pl

from kvarn.report.figures import HEIGHT, KLD_FMT, WIDTH, cell_encodings, chart_title
from kvarn.report.tokens import ecdf, position_bins


def layer_error(table: pl.DataFrame, title: str = "") -> alt.Chart:
    """Relative L2 error of each attention layer's output (kvarn.run.layer_error): K and V
    quantized, K only, V only; full-attention layers as filled, sliding as open points."""
    long = table.unpivot(index=["layer", "kind"], on=["rel_err_kv", "rel_err_k", "rel_err_v"],
                         variable_name="quantized", value_name="rel_err").with_columns(
        pl.col("quantized").replace({"rel_err_kv": "K and V", "rel_err_k": "K only", "rel_err_v": "V only"}),
        pl.col("rel_err").clip(lower_bound=1e-8))
    base = alt.Chart(long, name="layer_error").encode(
        x=alt.X("layer:O", title="layer", axis=alt.Axis(labelAngle=0)),
        y=alt.Y("rel_err:Q", title="‖o − o_exact‖ / ‖o_exact‖ (log)", scale=alt.Scale(type="log")),
        color=alt.Color("quantized:N", title="quantized", scale=alt.Scale(
            domain=["K and V", "K only", "V only"], range=["#333333", "#e45756", "#4c78a8"]),
            legend=alt.Legend(orient="bottom")),
        tooltip=[alt.Tooltip("layer:O"), alt.Tooltip("kind:N"), alt.Tooltip("quantized:N"),
                 alt.Tooltip("rel_err:Q", title="relative L2 error", format=".3~g")])
    lines = base.mark_line(strokeWidth=1.2, opacity=0.6)
    pts = base.mark_point(size=40).encode(
        shape=alt.Shape("kind:N", title="layer", scale=alt.Scale(domain=["full", "sliding"], range=["circle", "square"]),
                        legend=alt.Legend(orient="bottom")),
        fill=alt.condition("datum.kind == 'full'", alt.Color("quantized:N", legend=None), alt.value("white")))
    return alt.layer(lines, pts).properties(
        width=WIDTH, height=HEIGHT,
        title=alt.TitleParams(f"{title}: attention error by layer" if title else "attention error by layer",
                              subtitle="relative L2 error of each attention layer's output vs an fp32 cache on the "
                                       "same inputs, scored positions; filled: full attention, open: sliding window",
                              anchor="start"))


def position(tokens: pl.DataFrame, n_bins: int = 24) -> alt.LayerChart:
    """Mean per-token KLD per position bin inside the context: does the error grow with depth?"""
    model = tokens["model"][0]
    bins = position_bins(tokens, n_bins=n_bins)
    color, dash = cell_encodings(bins)
    tt = [alt.Tooltip("cell:N"), alt.Tooltip("pos_lo:Q", title="from pos"), alt.Tooltip("pos_hi:Q", title="to pos"),
          alt.Tooltip("kld_mean:Q", title="mean KLD", format=KLD_FMT),
          alt.Tooltip("kld_median:Q", title="median KLD", format=KLD_FMT), alt.Tooltip("n:Q", title="tokens")]
    base = alt.Chart(bins).encode(
        x=alt.X("pos_mid:Q", title="position in the context (token)", scale=alt.Scale(zero=False)),
        y=alt.Y("kld_mean:Q", title="mean KLD in the bin (log)", scale=alt.Scale(type="log")),
        color=color, detail="cell:N")
    lines = base.mark_line(strokeWidth=2).properties(name="position_lines").encode(strokeDash=dash)
    pts = base.mark_point(filled=True, size=18).encode(tooltip=tt)
    ends = bins.filter(pl.col("bin") == pl.col("bin").max().over("cell"))
    lab = alt.Chart(ends).mark_text(align="left", dx=5, fontSize=9).encode(
        x="pos_mid:Q", y="kld_mean:Q", text="cell:N", color=color)
    return alt.layer(lines, pts, lab).properties(
        width=WIDTH, height=HEIGHT,
        title=chart_title(model, "KLD by position in the context",
                     f"mean per-token KLD in {n_bins} equal bins of the scored positions, n_ctx {tokens['n_ctx'][0]}; "
                     "a rising line is error accumulating"))


def distribution(tokens: pl.DataFrame) -> alt.LayerChart:
    """ECDF of per-token KLD (log x) per chosen cell: the whole distribution, tail included."""
    model = tokens["model"][0]
    e = ecdf(tokens)
    color, dash = cell_encodings(e)
    lines = alt.Chart(e, name="ecdf").mark_line(strokeWidth=2, interpolate="step-after").encode(
        x=alt.X("kld:Q", title="per-token KLD (log; values below 1e-8 shown at 1e-8)", scale=alt.Scale(type="log")),
        y=alt.Y("fraction:Q", title="fraction of tokens with KLD ≤ x", scale=alt.Scale(domain=[0, 1])),
        color=color, strokeDash=dash, detail="cell:N",
        tooltip=[alt.Tooltip("cell:N"), alt.Tooltip("kld:Q", title="KLD", format=KLD_FMT),
                 alt.Tooltip("fraction:Q", title="fraction ≤", format=".4f")])
    half = alt.Chart(pl.DataFrame({"median": [0.5]})).mark_rule(color="#999", strokeDash=[2, 2]).encode(y="median:Q")
    return alt.layer(half, lines).properties(
        width=WIDTH, height=HEIGHT,
        title=chart_title(model, "distribution of per-token KLD",
                     "ECDF; further left is better, the right end is the worst tokens; dotted: the median"))
