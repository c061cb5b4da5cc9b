"""Figures of every cell of a run at once: the median KLD of each K×V pair as a heatmap, and the
cells ranked by median with their block-bootstrap intervals against the standard floor
(kvarn.report.paired_table).
"""

from __future__ import annotations

import altair as alt
import polars as pl

from kvarn.report import data
from kvarn.report.figures import FLOOR_COLOR, KLD_FMT, WIDTH, chart_title, placeholder, run_desc, series_scale


def heatmap(prep: pl.DataFrame, standard_tail: int | None = None) -> alt.HConcatChart | alt.Chart:
    """Median KLD of every measured K×V pair, one panel per family (standard, KVarN 128*).

    The standard panel shows `standard_tail`; by default the tail with the most measured
    pairs, tail 0 on a tie (the default matrix measures its K×V product at tail 128).
    """
    model = prep["model"][0]
    panels = []
    if standard_tail is None:
        standard_tail = data.heatmap_standard_tail(prep)
    sel = {"standard": (pl.col("family") == "standard") & (pl.col("tail_requested") == standard_tail),
           "kvarn": (pl.col("family") == "kvarn") & (pl.col("tail_requested") == 0)}
    sel = {k: c & (pl.col("opts") == "") for k, c in sel.items()}
    names = {"standard": f"standard, tail {standard_tail}", "kvarn": "KVarN, tail 128*"}
    allv = prep.filter(sel["standard"] | sel["kvarn"])["kld_median"]
    if allv.is_empty():
        return placeholder(model, "K×V heatmap", "no standard tail-0 or KVarN cells measured")
    # Text turns white above the geometric middle of the positive medians (the log colour scale's
    # range): a cell at the baseline can have a median of 0 or a rounding's −1e-14, whose product
    # with the maximum has a complex square root.
    pos = allv.filter(allv > 0)
    mid = float((pos.min() * pos.max()) ** 0.5) if not pos.is_empty() else 0.0
    color = alt.Color("kld_median:Q", title="median KLD", scale=alt.Scale(type="log", scheme="yelloworangered"),
                      legend=alt.Legend(format=KLD_FMT))
    for fam in ("standard", "kvarn"):
        cells = prep.filter(sel[fam])
        if cells.is_empty():
            continue
        order = sorted(set(cells["k_type"]) | set(cells["v_type"]), key=lambda t: (-(data.type_bits(t) or 0), t))
        k_order = [t for t in order if t in set(cells["k_type"])]
        v_order = [t for t in order if t in set(cells["v_type"])]
        base = alt.Chart(cells).encode(
            x=alt.X("v_type:O", sort=v_order, title="V type", axis=alt.Axis(labelAngle=-40)), y=alt.Y("k_type:O", sort=k_order, title="K type"))
        rect = base.mark_rect().properties(name=f"heatmap_{fam}").encode(color=color, tooltip=[
            alt.Tooltip("pair:N"), alt.Tooltip("tail_label:N", title="tail"),
            alt.Tooltip("kld_median:Q", title="median KLD", format=KLD_FMT),
            alt.Tooltip("kld_mean:Q", title="mean KLD", format=KLD_FMT),
            alt.Tooltip("kv_mib:Q", title=f"KV MiB ({data.accounting_of(prep)})", format=".2f")])
        text = base.mark_text(fontSize=9).encode(
            text=alt.Text("kld_median:Q", format=KLD_FMT),
            color=alt.condition(f"datum.kld_median > {mid!r}", alt.value("white"), alt.value("black")))
        side = 52
        panels.append(alt.layer(rect, text).properties(
            width=side * len(v_order), height=side * len(k_order), title=names[fam]))
    return alt.hconcat(*panels).resolve_scale(color="shared").properties(
        title=chart_title(model, "median KLD of every K×V pair", f"log colour scale shared by both panels; {run_desc(prep)}"))


def ranked(prep: pl.DataFrame, paired: pl.DataFrame) -> alt.LayerChart:
    """Cells ranked by median KLD with 95 % block-bootstrap intervals (kvarn.report.paired_table.run_table).

    Filled points: cells whose median is statistically indistinguishable from the standard
    floor (paired interval of Δ median vs the floor holds 0); the dashed rule is the floor.
    """
    model = prep["model"][0]
    rows = data.figure_rows(prep).select(["cell", "pair", "tail_label", "family", "series", "kld_median"]).join(
        paired.select(["cell", "kld_median_lo", "kld_median_hi", "band", "floor_delta", "floor_lo", "floor_hi"]),
        on="cell", how="inner")
    rows = rows.with_columns(
        (pl.col("pair") + " t" + pl.col("tail_label")).alias("label"),
        pl.when(pl.col("band") == "").then(pl.lit("differs from floor")).otherwise(pl.lit("≈ floor")).alias("vs_floor"),
        pl.col("kld_median_lo").clip(lower_bound=1e-8), pl.col("kld_median_hi").clip(lower_bound=1e-8),
        pl.col("kld_median").clip(lower_bound=1e-8)).sort("kld_median")
    order = rows["label"].to_list()
    y = alt.Y("label:N", sort=order, title=None)
    x_title = "median KLD vs BF16 cache (log), 95 % interval"
    x = alt.X("kld_median:Q", title=x_title, scale=alt.Scale(type="log"))
    series = series_scale(rows["series"].to_list())
    color = alt.Color("series:N", scale=series, title=None, legend=alt.Legend(orient="bottom"))
    tt = [alt.Tooltip("label:N", title="cell"), alt.Tooltip("kld_median:Q", title="median KLD", format=KLD_FMT),
          alt.Tooltip("kld_median_lo:Q", title="95% lo", format=KLD_FMT),
          alt.Tooltip("kld_median_hi:Q", title="95% hi", format=KLD_FMT),
          alt.Tooltip("floor_delta:Q", title="Δ median vs floor", format="+.3~g"),
          alt.Tooltip("floor_lo:Q", title="Δ 95% lo", format="+.3~g"),
          alt.Tooltip("floor_hi:Q", title="Δ 95% hi", format="+.3~g"), alt.Tooltip("vs_floor:N", title="band")]
    bars = alt.Chart(rows, name="intervals").mark_rule(strokeWidth=2).encode(
        y=y, x=alt.X("kld_median_lo:Q", scale=alt.Scale(type="log"), title=x_title), x2="kld_median_hi:Q",
        color=color)
    pts = alt.Chart(rows, name="medians").mark_point(size=60, strokeWidth=2).encode(
        y=y, x=x, color=color, tooltip=tt,
        fill=alt.condition("datum.vs_floor == '≈ floor'", alt.Color("series:N", scale=series, legend=None),
                           alt.value("white")),
        shape=alt.Shape("vs_floor:N", title="vs standard floor", legend=alt.Legend(orient="bottom"),
                        scale=alt.Scale(domain=["≈ floor", "differs from floor"], range=["circle", "diamond"])))
    layers = [bars, pts]
    floor = data.standard_floor(prep)
    if floor is not None:
        fl = pl.DataFrame({"floor_kld": [max(floor["kld_median"], 1e-8)]})
        layers.append(alt.Chart(fl, name="standard_floor").mark_rule(color=FLOOR_COLOR, strokeDash=[6, 4]).encode(
            x="floor_kld:Q"))
    return alt.layer(*layers).properties(
        width=WIDTH, height=max(160, 16 * len(order)),
        title=chart_title(model, "cells ranked by median KLD",
                     f"bars: 95 % circular block-bootstrap intervals; filled: not distinguishable from the "
                     f"standard floor (dashed); {run_desc(prep)}"))
