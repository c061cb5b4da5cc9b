"""The Pareto figure: median and 99th-percentile KLD against cache size (bits per value, or MiB for
older results), one series per family and tail, with the standard frontier and floor, and the caption
that names what it draws (`pareto_caption`). How to read it: docs/notes/report.md.
"""

from __future__ import annotations

import altair as alt
import polars as pl

from kvarn.report import data
from kvarn.report.figures import (COLOR_NAMES, FLOOR_COLOR, HEIGHT, KLD_FMT, SERIES_COLORS, SHAPE_NAMES, WIDTH,
                                  chart_title, placeholder, run_desc, series_scale, series_styles, shape_scale)


def pareto_x(prep: pl.DataFrame) -> str:
    """The Pareto figure's x: `bits_per_value` when every cell drawn has one (comparable across
    models), else `kv_mib` (results aggregated before bits per value were counted)."""
    rows = data.figure_rows(prep)
    if "bits_per_value" in rows.columns and rows.height and rows["bits_per_value"].null_count() == 0:
        return "bits_per_value"
    return "kv_mib"


def _mib_per_bit(prep: pl.DataFrame) -> float | None:
    """MiB per bit per value (a BF16 cache's MiB / 16) when every row has the one BF16 size, else None."""
    if "kv_bf16_bytes" not in prep.columns or prep["kv_bf16_bytes"].null_count():
        return None
    sizes = prep["kv_bf16_bytes"].unique()
    return float(sizes[0]) / data.MIB / 16 if sizes.len() == 1 else None


def _pareto_x_text(prep: pl.DataFrame, x: str) -> tuple[str, str]:
    """The x axis title, and what x is (the subtitle's and the caption's words)."""
    acc = data.accounting_of(prep)
    if x == "bits_per_value":
        per = _mib_per_bit(prep)
        return (f"bits per cached K/V value, {acc} accounting (16 × KV bytes / a BF16 cache's)",
                "bits per cached value, 16 × the cell's KV bytes / a BF16 cache's on the same geometry, so two "
                "models' figures compare" + (f"; MiB = bits/value × {per:.4g}" if per else "")
                + " (each cell's MiB in its tooltip)")
    return (f"KV cache MiB, {acc} accounting (body + staging + exact overlay)",
            "KV cache MiB, not bits per value: these results were aggregated before bits per value were "
            "counted (aggregate them again for an x that compares across models)")


def _pareto_lines_text(prep: pl.DataFrame) -> list[str]:
    """What the step line and the dashed line are (subtitle and caption), for those drawn."""
    out = []
    if (prep["family"] == "standard").any():
        out.append("step line: the standard frontier, the lowest KLD a standard cell reaches at or below that size "
                   "(a point under it beats every standard cell of its size)")
    floor = data.standard_floor(prep)
    if floor is not None:
        out.append(f"dashed green line (median panel): the standard floor, {floor['pair']} t{floor['tail_label']}, "
                   f"the lowest median of the standard pairs at tail {data.FLOOR_TAIL}")
    return out


def pareto_caption(prep: pl.DataFrame) -> str:
    """The Pareto figure's caption, built from the cells it draws: what x and y are, every series
    with its colour and mark (none that is not drawn), the step line and the floor."""
    rows = data.figure_rows(prep)
    styles = series_styles(rows["series"].to_list())
    p99 = "kld_p99" in rows.columns and not rows["kld_p99"].is_null().all()
    panels = ("drawn twice: median KLD against the BF16 cache (left) and 99th-percentile KLD, the worst 1 % of "
              "tokens (right), both log" if p99 else "median KLD against the BF16 cache (log; no p99 in these results)")
    x_words = _pareto_x_text(prep, pareto_x(prep))[1]
    parts = [f"Each point a cell, {panels}; lower left is better. The x axis: {x_words}.",
             f"{len(styles)} series: "
             + "; ".join(f"{COLOR_NAMES.get(c, c)} {SHAPE_NAMES.get(m, m)}: {s}" for s, c, m in styles) + "."]
    parts += [f"{line[0].upper()}{line[1:]}." for line in _pareto_lines_text(prep)]
    labelled = [name for fam, name in (("kvarn", "KVarN"), ("ecosystem", "QuantizedCache"))
                if (rows["family"] == fam).any()]
    if labelled:
        parts.append(f"Text labels name the {' and '.join(labelled)} cells.")
    return " ".join(parts)


def _pareto_frontier(rows: pl.DataFrame, x: str, y: str) -> pl.DataFrame:
    """kvarn.report.data.pareto_frontier on any x and KLD column: the standard cells sorted by x,
    `frontier_kld` the running minimum of y."""
    own = pl.col("alloc").is_null() if "alloc" in rows.columns else pl.lit(True)  # no per-layer cell
    std = rows.filter((pl.col("family") == "standard") & own).drop_nulls([x, y]).sort([x, y])
    return std.select("pair", "tail_label", *dict.fromkeys([x, "kv_mib"]), y,
                      pl.col(y).cum_min().alias("frontier_kld"))


# The Pareto figure's panels, side by side: (KLD column, what it is), the median first.
PARETO_PANELS = (("kld_median", "median"), ("kld_p99", "99th-percentile"))


def pareto(prep: pl.DataFrame) -> alt.HConcatChart:
    """Median KLD and p99 KLD (log) vs bits per value (MiB for older results), one series per
    family/tail, the standard frontier and the floor; pareto_caption says what is drawn."""
    model = prep["model"][0]
    rows = data.figure_rows(prep)
    if "alloc" not in rows.columns:  # a summary prepared before per-layer cells existed
        rows = rows.with_columns(pl.lit(None, dtype=pl.String).alias("alloc"))
    rows = rows.with_columns(
        pl.col("same_top").mul(100).alias("same_top_pct"),
        pl.when(pl.col("alloc").is_not_null()).then(pl.col("alloc").str.split(".").list.first())
        .when(pl.col("family").is_in(["kvarn", "ecosystem"])).then(pl.col("pair")).otherwise(pl.lit(""))
        .alias("point_label"),
    )
    x_field = pareto_x(prep)
    tooltip = [
        alt.Tooltip("pair:N", title="K-V pair"), alt.Tooltip("tail_label:N", title="tail"),
        alt.Tooltip("tail_eff_full:Q", title="tail eff (full layers)"),
        alt.Tooltip("tail_eff_sliding:Q", title="tail eff (sliding layers)"),
        alt.Tooltip("sink:Q", title="sink"), alt.Tooltip("rot:N", title="rot"),
        alt.Tooltip("bits_per_value:Q", title="bits per value", format=".3f"),
        alt.Tooltip("kv_mib:Q", title="KV MiB total", format=".2f"),
        alt.Tooltip("body_mib:Q", title="MiB body", format=".2f"),
        alt.Tooltip("staging_mib:Q", title="MiB staging", format=".2f"),
        alt.Tooltip("overlay_mib:Q", title="MiB overlay", format=".2f"),
        alt.Tooltip("memory_accounting:N", title="memory accounting"),
        alt.Tooltip("kld_median:Q", title="median KLD", format=KLD_FMT),
        alt.Tooltip("kld_mean:Q", title="mean KLD", format=KLD_FMT),
        alt.Tooltip("kld_p99:Q", title="p99 KLD", format=KLD_FMT),
        alt.Tooltip("same_top_pct:Q", title="same top %", format=".2f"),
    ]
    tooltip = [t for t in tooltip if t.to_dict()["field"] in rows.columns
               and (t.to_dict()["field"] != "bits_per_value" or x_field == "bits_per_value")]
    x_title, x_sentence = _pareto_x_text(prep, x_field)
    x = alt.X(f"{x_field}:Q", title=x_title, scale=alt.Scale(zero=False))
    series = rows["series"].to_list()
    # one legend under both panels, every label in full (labelLimit 0: no limit)
    legend = alt.Legend(orient="bottom", columns=3, labelLimit=0, symbolLimit=0)
    color = alt.Color("series:N", scale=series_scale(series), title=None, legend=legend)
    shape = alt.Shape("series:N", scale=shape_scale(series), title=None, legend=legend)
    floor = data.standard_floor(prep)
    panels = []
    for y_field, stat in PARETO_PANELS:
        suffix = "" if y_field == "kld_median" else f"_{y_field.removeprefix('kld_')}"
        if y_field not in rows.columns or rows[y_field].is_null().all():
            panels.append(placeholder(model, f"{stat} KLD", f"these results have no {y_field} column"))
            continue
        y = alt.Y(f"{y_field}:Q", title=f"{stat} KLD vs BF16 cache (log)", scale=alt.Scale(type="log"))
        layers = [
            alt.Chart(rows, name=f"cells{suffix}").mark_point(filled=True, size=70, opacity=0.9).encode(
                x=x, y=y, color=color, shape=shape, tooltip=tooltip),
            alt.Chart(rows, name=f"cell_labels{suffix}").mark_text(
                align="left", dx=7, fontSize=9, color=SERIES_COLORS[data.SERIES_KVARN]).encode(
                x=f"{x_field}:Q", y=f"{y_field}:Q", text="point_label:N"),
        ]
        front = _pareto_frontier(rows, x_field, y_field)
        if not front.is_empty():
            layers.insert(0, alt.Chart(front, name=f"standard_frontier{suffix}").mark_line(
                interpolate="step-after", color=SERIES_COLORS[data.SERIES_STANDARD_T128], strokeWidth=1.5, opacity=0.6,
            ).encode(x=f"{x_field}:Q", y="frontier_kld:Q", tooltip=[
                alt.Tooltip("frontier_kld:Q", title=f"best standard {stat} at ≤ this size", format=KLD_FMT),
                alt.Tooltip(f"{x_field}:Q", title="bits per value" if x_field == "bits_per_value" else "MiB",
                            format=".3f" if x_field == "bits_per_value" else ".2f")]))
        if floor is not None and y_field == "kld_median":  # the floor is the study's, a median
            fl = pl.DataFrame({"floor_kld": [floor["kld_median"]],
                               "floor_label": [f"standard floor: {floor['pair']} t{floor['tail_label']} "
                                               f"({floor['kld_median']:.3g})"]})
            layers += [alt.Chart(fl, name="standard_floor").mark_rule(color=FLOOR_COLOR, strokeDash=[6, 4]
                                                                      ).encode(y="floor_kld:Q"),
                       alt.Chart(fl, name="standard_floor_label").mark_text(
                           align="left", baseline="bottom", dy=-3, x=4, color=FLOOR_COLOR, fontSize=10
                       ).encode(y="floor_kld:Q", text="floor_label:N")]
        panels.append(alt.layer(*layers).properties(
            width=WIDTH, height=HEIGHT, title=alt.TitleParams(f"{stat} KLD", fontSize=12, anchor="start")))
    subtitle = [f"{run_desc(prep)}; lower left is better; left: median KLD, right: 99th percentile "
                "(the worst 1 % of tokens)", f"x: {x_sentence}", *_pareto_lines_text(prep)]
    return alt.hconcat(*panels).resolve_scale(x="shared", y="independent", color="shared", shape="shared").properties(
        title=chart_title(model, "damage vs cache size", subtitle))
