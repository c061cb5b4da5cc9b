"""The report's figures as Altair charts, and how they are written (Vega-Lite JSON, SVG, PNG).

Every builder is a pure function of prepared DataFrames (kvarn.report.data) returning an
`alt.TopLevelMixin`; `save_chart` writes the spec and renders it offline with vl-convert.
Damage is median (or mean; the Pareto figure adds the 99th percentile) per-token KLD against the
BF16-cache baseline; lower is better, and KLD axes are logarithmic because widths differ by orders
of magnitude.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import altair as alt
import polars as pl

from kvarn.files.atomic import write_bytes
from kvarn.report import compare
from kvarn.report import data as D
from kvarn.plan import generation as GEN
from kvarn.report import tokens as T

# One colour per Pareto series; other tails (if a matrix has them) get the spare colours.
SERIES_COLORS = {D.SERIES_STANDARD_T0: "#9a9a9a", D.SERIES_STANDARD_T128: "#4c78a8", D.SERIES_KVARN: "#e45756"}
SPARE_COLORS = ["#72b7b2", "#b279a2", "#f58518", "#54a24b", "#eeca3b", "#ff9da6", "#9d755d"]
# The words a generated caption uses for the series' colours and marks (pareto_caption).
COLOR_NAMES = {"#9a9a9a": "grey", "#4c78a8": "blue", "#e45756": "red", "#72b7b2": "teal", "#b279a2": "purple",
               "#f58518": "orange", "#54a24b": "green", "#eeca3b": "yellow", "#ff9da6": "pink", "#9d755d": "brown"}
# One mark per Pareto series, likewise: the three named series keep theirs, the rest take the spares.
SERIES_SHAPES = {D.SERIES_STANDARD_T0: "circle", D.SERIES_STANDARD_T128: "square", D.SERIES_KVARN: "triangle-up"}
SPARE_SHAPES = ["diamond", "cross", "triangle-down", "triangle-right", "triangle-left", "wedge", "arrow"]
SHAPE_NAMES = {"circle": "circles", "square": "squares", "triangle-up": "triangles", "diamond": "diamonds",
               "cross": "crosses", "triangle-down": "down triangles", "triangle-right": "right triangles",
               "triangle-left": "left triangles", "wedge": "wedges", "arrow": "arrows"}
# Line style per family (kvarn.report.data.family_of): solid KVarN, dashed standard, dotted for
# transformers' QuantizedCache backends; a figure's legend lists the families it draws.
FAMILY_DASH = {"kvarn": ([1, 0], "solid: KVarN"), "standard": ([5, 3], "dashed: standard"),
               "ecosystem": ([1, 3], "dotted: QuantizedCache backends")}
FLOOR_COLOR = "#2f7d32"
ECO_SHADES = [("#b279a2", "#d6b3cb"), ("#f58518", "#f9bd84"), ("#72b7b2", "#b3dbd8")]  # QuantizedCache partners
WIDTH, HEIGHT = 520, 320
KLD_FMT = ".3~g"

FIGURES = ("pareto", "same_width", "tail_effect", "tail_sweep", "heatmap", "position", "distribution", "ranked", "decode")


def _title(model: str, text: str, subtitle: str | list[str]) -> alt.TitleParams:
    return alt.TitleParams(f"{model}: {text}", subtitle=subtitle, anchor="start")


def _run_desc(prep: pl.DataFrame) -> str:
    r = prep.row(0, named=True)
    return f"n_ctx {r['n_ctx']}, {r['chunks']} chunk{'s' if r['chunks'] != 1 else ''}, {r['n_tokens']} scored tokens per cell"


def _placeholder(model: str, name: str, why: str) -> alt.Chart:
    """A chart that says why a figure is empty (a matrix without the cells it compares)."""
    return alt.Chart(alt.Data(values=[{"why": why}]), title=_title(model, name, "")).mark_text(
        fontSize=14, color="#555").encode(text="why:N").properties(width=WIDTH, height=80)


def _series_order(name: str) -> tuple:
    """Legend order of a series past the named three (kvarn.report.data.series_of): standard,
    format-only, KVarN, QuantizedCache backends, each by tail; a name of no known family last."""
    prefixes = [(D.SERIES_FORMAT_ONLY, 1), ("standard", 0), ("KVarN", 2), (D.SERIES_ECOSYSTEM, 3)]
    rank = next((r for p, r in prefixes if name.startswith(p)), len(prefixes))
    tail = re.search(r"tail (\d+)\*?$", name)
    return rank, int(tail.group(1)) if tail else 1 << 30, name


def series_styles(series: Iterable[str]) -> list[tuple[str, str, str]]:
    """(series, colour, shape) of each series present, in legend order: the colour and mark a
    figure draws it with (SERIES_COLORS / SERIES_SHAPES, else the next spare)."""
    present = {s for s in series if s is not None}
    domain = [s for s in SERIES_COLORS if s in present] + sorted(present - set(SERIES_COLORS), key=_series_order)
    colors, shapes = iter(SPARE_COLORS * 4), iter(SPARE_SHAPES * 4)
    return [(s, SERIES_COLORS.get(s) or next(colors), SERIES_SHAPES.get(s) or next(shapes)) for s in domain]


def _series_scale(series: Iterable[str]) -> alt.Scale:
    styles = series_styles(series)
    return alt.Scale(domain=[s for s, _, _ in styles], range=[c for _, c, _ in styles])


def _shape_scale(series: Iterable[str]) -> alt.Scale:
    styles = series_styles(series)
    return alt.Scale(domain=[s for s, _, _ in styles], range=[m for _, _, m in styles])


# ---------------------------------------------------------------- figures from the summary


def pareto_x(prep: pl.DataFrame) -> str:
    """The Pareto figure's x: `bits_per_value` when every cell drawn has one (comparable across
    models), else `kv_mib` (results aggregated before bits per value were counted)."""
    rows = D.figure_rows(prep)
    if "bits_per_value" in rows.columns and rows.height and rows["bits_per_value"].null_count() == 0:
        return "bits_per_value"
    return "kv_mib"


def _mib_per_bit(prep: pl.DataFrame) -> float | None:
    """MiB per bit per value (a BF16 cache's MiB / 16) when every row has the one BF16 size, else None."""
    if "kv_bf16_bytes" not in prep.columns or prep["kv_bf16_bytes"].null_count():
        return None
    sizes = prep["kv_bf16_bytes"].unique()
    return float(sizes[0]) / D.MIB / 16 if sizes.len() == 1 else None


def _pareto_x_text(prep: pl.DataFrame, x: str) -> tuple[str, str]:
    """The x axis title, and what x is (the subtitle's and the caption's words)."""
    acc = D.accounting_of(prep)
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
    floor = D.standard_floor(prep)
    if floor is not None:
        out.append(f"dashed green line (median panel): the standard floor, {floor['pair']} t{floor['tail_label']}, "
                   f"the lowest median of the standard pairs at tail {D.FLOOR_TAIL}")
    return out


def pareto_caption(prep: pl.DataFrame) -> str:
    """The Pareto figure's caption, built from the cells it draws: what x and y are, every series
    with its colour and mark (none that is not drawn), the step line and the floor."""
    rows = D.figure_rows(prep)
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
    rows = D.figure_rows(prep)
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
    color = alt.Color("series:N", scale=_series_scale(series), title=None, legend=legend)
    shape = alt.Shape("series:N", scale=_shape_scale(series), title=None, legend=legend)
    floor = D.standard_floor(prep)
    panels = []
    for y_field, stat in PARETO_PANELS:
        suffix = "" if y_field == "kld_median" else f"_{y_field.removeprefix('kld_')}"
        if y_field not in rows.columns or rows[y_field].is_null().all():
            panels.append(_placeholder(model, f"{stat} KLD", f"these results have no {y_field} column"))
            continue
        y = alt.Y(f"{y_field}:Q", title=f"{stat} KLD vs BF16 cache (log)", scale=alt.Scale(type="log"))
        layers = [
            alt.Chart(rows, name=f"cells{suffix}").mark_point(filled=True, size=70, opacity=0.9).encode(
                x=x, y=y, color=color, shape=shape, tooltip=tooltip),
            alt.Chart(rows, name=f"cell_labels{suffix}").mark_text(
                align="left", dx=7, fontSize=9, color=SERIES_COLORS[D.SERIES_KVARN]).encode(
                x=f"{x_field}:Q", y=f"{y_field}:Q", text="point_label:N"),
        ]
        front = _pareto_frontier(rows, x_field, y_field)
        if not front.is_empty():
            layers.insert(0, alt.Chart(front, name=f"standard_frontier{suffix}").mark_line(
                interpolate="step-after", color=SERIES_COLORS[D.SERIES_STANDARD_T128], strokeWidth=1.5, opacity=0.6,
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
    subtitle = [f"{_run_desc(prep)}; lower left is better; left: median KLD, right: 99th percentile "
                "(the worst 1 % of tokens)", f"x: {x_sentence}", *_pareto_lines_text(prep)]
    return alt.hconcat(*panels).resolve_scale(x="shared", y="independent", color="shared", shape="shared").properties(
        title=_title(model, "damage vs cache size", subtitle))


def same_width(prep: pl.DataFrame, tail: int = 128) -> alt.HConcatChart | alt.Chart:
    """KVarN vs the same-width standard type at matched tail: % change of median and mean, and MiB.

    Two partners per width where measured: the study's matched row (qN_0 at tail `tail`)
    and the format-only row (qN_0 with KVarN's sink, tail and F16 tail dtype), against
    which only the quantizer differs."""
    model = prep["model"][0]
    sw = compare.same_width(prep, tail=tail)
    if sw.is_empty():
        return _placeholder(model, "same-width comparison", f"no width has both kvarnN-kvarnN and qN_0-qN_0 at tail {tail}")
    backends = compare.same_width_backends(sw)
    partners = [("std", "vs standard t%d" % tail), ("fmt", "vs standard + sink, F16 tail (format only)")]
    partners += [(b, f"vs {b}N t{tail}* (QuantizedCache)") for b in backends]
    parts = []
    for suf, partner in partners:
        if sw[f"pct_median{'' if suf == 'std' else '_' + suf}"].is_null().all():
            continue
        for stat in ("median", "mean"):
            pct = f"pct_{stat}" + ("" if suf == "std" else f"_{suf}")
            parts.append(sw.filter(pl.col(pct).is_not_null()).select(
                "width", pl.lit(partner).alias("partner"), pl.lit(stat).alias("statistic"),
                pl.lit(f"{partner}: {stat}").alias("bar"),
                (pl.col("pair_kvarn") + " t" + pl.col("tail_label_kvarn") + " vs " + pl.col(f"pair_{suf}") + " t"
                 + pl.col(f"tail_label_{suf}")).alias("comparison"),
                pl.col(pct).alias("pct"), pl.col(f"kld_{stat}_kvarn").alias("kvarn"),
                pl.col(f"kld_{stat}_{suf}").alias("standard")))
    long = pl.concat(parts)
    bars_domain = [f"{p}: {st}" for _, p in partners for st in ("median", "mean") if f"{p}: {st}" in set(long["bar"])]
    palette = {f"{partners[0][1]}: median": "#e45756", f"{partners[0][1]}: mean": "#f2a5a4",
               f"{partners[1][1]}: median": "#54a24b", f"{partners[1][1]}: mean": "#a8d5a2"}
    for (_, partner), (dark, light) in zip(partners[2:], ECO_SHADES):
        palette.update({f"{partner}: median": dark, f"{partner}: mean": light})
    xw = alt.X("width:O", title="width (bits)", axis=alt.Axis(labelAngle=0))
    off = alt.XOffset("bar:N", scale=alt.Scale(domain=bars_domain))
    tt = [alt.Tooltip("comparison:N"), alt.Tooltip("statistic:N"),
          alt.Tooltip("kvarn:Q", title="KVarN KLD", format=KLD_FMT),
          alt.Tooltip("standard:Q", title="standard KLD", format=KLD_FMT),
          alt.Tooltip("pct:Q", title="% change", format="+.1f")]
    bars = alt.Chart(long, name="pct_change").mark_bar().encode(
        x=xw, xOffset=off,
        y=alt.Y("pct:Q", title="KVarN vs same-width standard, % change of KLD", scale=alt.Scale(padding=16)),
        color=alt.Color("bar:N", scale=alt.Scale(domain=bars_domain, range=[palette[b] for b in bars_domain]),
                        title="KLD statistic, partner", legend=alt.Legend(orient="bottom", columns=2)),
        tooltip=tt)
    text = alt.Chart(long.filter(pl.col("statistic") == "median")).mark_text(fontSize=9, dy=alt.ExprRef("datum.pct < 0 ? 8 : -6")).encode(
        x=xw, xOffset=off, y="pct:Q", text=alt.Text("pct:Q", format="+.1f"))
    zero = alt.Chart(pl.DataFrame({"zero": [0.0]})).mark_rule(color="#333").encode(y="zero:Q")
    left = alt.layer(bars, zero, text).properties(
        width=WIDTH * 0.55, height=HEIGHT,
        title=alt.TitleParams("below 0: KVarN damages less (labels: median)", fontSize=11))

    fams = [("std", "standard"), ("kvarn", "KVarN")]
    if not sw["kv_mib_fmt"].is_null().all():
        fams.insert(1, ("fmt", "standard + sink"))
    fams += [(b, b) for b in backends if not sw[f"kv_mib_{b}"].is_null().all()]
    mem = pl.concat([
        sw.filter(pl.col(f"kv_mib_{fam}").is_not_null()).select(
            "width", pl.col(f"pair_{fam}").alias("pair"), pl.lit(label).alias("family"),
            pl.lit(part).alias("part"), pl.lit(f"{label} {part}").alias("component"),
            pl.lit(order).cast(pl.Int8).alias("part_order"), pl.col(f"{part}_mib_{fam}").alias("mib"))
        for fam, label in fams
        for order, part in enumerate(("body", "staging", "overlay"))
    ])
    shades = {"standard": ["#4c78a8", "#7fa3c8", "#a6c3e0"], "standard + sink": ["#54a24b", "#88c580", "#b9dcb3"],
              "KVarN": ["#e45756", "#ee8a89", "#f5b7b6"]}
    shades.update({b: [dark, light, light] for b, (dark, light) in zip(backends, ECO_SHADES)})
    comp = alt.Scale(domain=[f"{label} {part}" for _, label in fams for part in ("body", "staging", "overlay")],
                     range=[c for _, label in fams for c in shades[label]])
    right = alt.Chart(mem, name="memory").mark_bar().encode(
        x=xw, xOffset=alt.XOffset("family:N", scale=alt.Scale(domain=[label for _, label in fams])),
        y=alt.Y("mib:Q", title=f"KV cache MiB, {D.accounting_of(prep)} accounting", stack="zero"),
        color=alt.Color("component:N", scale=comp, title="memory", legend=alt.Legend(orient="bottom")),
        order=alt.Order("part_order:Q"),
        tooltip=[alt.Tooltip("pair:N"), alt.Tooltip("component:N"), alt.Tooltip("mib:Q", title="MiB", format=".2f")],
    ).properties(width=WIDTH * 0.45, height=HEIGHT,
                 title=alt.TitleParams("cache size: quantized body + staging + exact overlay", fontSize=11))
    return alt.hconcat(left, right).resolve_scale(color="independent").properties(
        title=_title(model, "KVarN vs the same-width standard type",
                     f"kvarnN-kvarnN (tail 128*) vs qN_0-qN_0 (tail {tail}; format only: + sink 128, F16 tail)"
                     + (f" and vs {', '.join(b + 'N' for b in backends)} (transformers' QuantizedCache, {tail}*)"
                        if backends else "") + f"; {_run_desc(prep)}"))


def tail_effect(prep: pl.DataFrame) -> alt.LayerChart | alt.Chart:
    """% change of the median KLD from tail 0 to tail N, per standard width."""
    model = prep["model"][0]
    te = compare.tail_effect(prep)
    if te.is_empty():
        return _placeholder(model, "tail effect", "no standard qN_0-qN_0 pair measured at tail 0 and a longer tail")
    te = te.with_columns(pl.format("tail 0 → {}", pl.col("tail")).alias("change"))
    xw = alt.X("width:O", title="standard width (qN_0-qN_0, bits)", axis=alt.Axis(labelAngle=0))
    tails = sorted(te["change"].unique().to_list(), key=lambda s: int(s.split()[-1]))
    tt = [alt.Tooltip("pair:N"), alt.Tooltip("change:N"),
          alt.Tooltip("median_t0:Q", title="median KLD at tail 0", format=KLD_FMT),
          alt.Tooltip("median_tail:Q", title="median KLD with the tail", format=KLD_FMT),
          alt.Tooltip("pct_median:Q", title="% change of median", format="+.1f"),
          alt.Tooltip("pct_mean:Q", title="% change of mean", format="+.1f")]
    bars = alt.Chart(te, name="tail_change").mark_bar(color=SERIES_COLORS[D.SERIES_STANDARD_T128]).encode(
        x=xw, xOffset=alt.XOffset("change:N", sort=tails),
        y=alt.Y("pct_median:Q", title="% change of median KLD", scale=alt.Scale(padding=16)),
        color=alt.Color("change:N", sort=tails, title=None, scale=alt.Scale(scheme="blues"),
                        legend=alt.Legend(orient="bottom") if len(tails) > 1 else None),
        tooltip=tt)
    text = alt.Chart(te).mark_text(fontSize=10, dy=alt.ExprRef("datum.pct_median < 0 ? 9 : -6")).encode(
        x=xw, xOffset=alt.XOffset("change:N", sort=tails), y="pct_median:Q",
        text=alt.Text("pct_median:Q", format="+.1f"))
    zero = alt.Chart(pl.DataFrame({"zero": [0.0]})).mark_rule(color="#333").encode(y="zero:Q")
    return alt.layer(bars, zero, text).properties(
        width=WIDTH * 0.8, height=HEIGHT,
        title=_title(model, "what an exact recent tail buys a standard cache",
                     f"median KLD, tail 0 → tail N, same pair; below 0: the tail helps. {_run_desc(prep)}"))


def tail_sweep(prep: pl.DataFrame) -> alt.LayerChart | alt.Chart:
    """Median KLD against the effective tail for q4_0 and kvarn4 (log y), with the ratio of
    how strongly the median responds to the tail and to the format."""
    model = prep["model"][0]
    sw = compare.tail_sweep(prep)
    if sw["pair"].n_unique() < 1 or sw.height < 2:
        return _placeholder(model, "tail sweep", "q4_0-q4_0 / kvarn4-kvarn4 measured at fewer than two tails")
    tvf = compare.tail_vs_format(sw, format_only=compare.format_only_median(prep))
    colors = alt.Scale(domain=["q4_0-q4_0", "kvarn4-kvarn4"], range=[SERIES_COLORS[D.SERIES_STANDARD_T128],
                                                                     SERIES_COLORS[D.SERIES_KVARN]])
    tt = [alt.Tooltip("pair:N"), alt.Tooltip("tail_label:N", title="tail"),
          alt.Tooltip("kld_median:Q", title="median KLD", format=KLD_FMT),
          alt.Tooltip("kld_mean:Q", title="mean KLD", format=KLD_FMT),
          alt.Tooltip("exact_share:Q", title="exact share", format=".1%")]
    base = alt.Chart(sw, name="sweep").encode(
        x=alt.X("tail:Q", title="effective exact tail (tokens)",
                axis=alt.Axis(values=sorted(set(sw["tail"].to_list())), labelAngle=0)),
        y=alt.Y("kld_median:Q", title="median KLD", scale=alt.Scale(type="log")),
        color=alt.Color("pair:N", scale=colors, title=None, legend=alt.Legend(orient="top-right")), tooltip=tt)
    sub = ["x: the effective tail (KVarN: at least 128, plus its 128-token sink). " + _run_desc(prep)]
    if tvf is not None:
        sub.append(f"The median responds {tvf['ratio']:.1f}x more to the tail (|Δln| {tvf['tail_response']:.2f}) "
                   f"than to the format at equal tail (|Δln| {tvf['format_response']:.2f}),")
        if "ratio_format_only" in tvf:
            sub.append(f"{tvf['ratio_format_only']:.1f}x more than to the quantizer alone (kvarn4 vs q4_0 with "
                       f"KVarN's sink and F16 tail, |Δln| {tvf['format_only_response']:.2f}).")
    return alt.layer(base.mark_line(point=True)).properties(
        width=WIDTH * 0.8, height=HEIGHT,
        title=_title(model, "which tokens are exact vs which format compresses the rest", sub))


def kernel_share(split: pl.DataFrame, model: str) -> alt.LayerChart | alt.Chart:
    """Per width: how much of llama.cpp's median KLD is its kernel's arithmetic (`compare.compute_split`)."""
    sw = split.filter(pl.col("width").is_not_null()) if not split.is_empty() else split
    if sw.is_empty():
        return _placeholder(model, "kernel share", "no qN-qN pair run in both compute paths (exact and llamacpp-cpu)")
    sw = sw.with_columns((100 * pl.col("kernel_share_median")).alias("pct"))
    tt = [alt.Tooltip("pair:N"), alt.Tooltip("exact_median:Q", title="format (exact) median", format=KLD_FMT),
          alt.Tooltip("total_median:Q", title="llamacpp-cpu median", format=KLD_FMT),
          alt.Tooltip("pct:Q", title="kernel share %", format=".0f")]
    bars = alt.Chart(sw, name="kernel_share").mark_bar(color=SERIES_COLORS[D.SERIES_STANDARD_T128]).encode(
        x=alt.X("pair:N", title="K/V pair (widest first)", sort=None, axis=alt.Axis(labelAngle=0)),
        y=alt.Y("pct:Q", title="% of llama.cpp's median KLD from the kernel", scale=alt.Scale(domain=[0, 100])),
        tooltip=tt)
    text = alt.Chart(sw).mark_text(dy=-6, fontSize=10).encode(x=alt.X("pair:N", sort=None), y="pct:Q",
                                                              text=alt.Text("pct:Q", format=".0f"))
    return alt.layer(bars, text).properties(
        width=WIDTH * 0.8, height=HEIGHT,
        title=_title(model, "how much of llama.cpp's KLD is its kernel's arithmetic",
                     "1 − median(exact) / median(llamacpp-cpu), same cell, tail 0"))


def heatmap(prep: pl.DataFrame, standard_tail: int | None = None) -> alt.HConcatChart | alt.Chart:
    """Median KLD of every measured K×V pair, one panel per family (standard, KVarN 128*).

    The standard panel shows `standard_tail`; by default the tail with the most measured
    pairs, tail 0 on a tie (the default matrix measures its K×V product at tail 128).
    """
    model = prep["model"][0]
    panels = []
    if standard_tail is None:
        standard_tail = D.heatmap_standard_tail(prep)
    sel = {"standard": (pl.col("family") == "standard") & (pl.col("tail_requested") == standard_tail),
           "kvarn": (pl.col("family") == "kvarn") & (pl.col("tail_requested") == 0)}
    sel = {k: c & (pl.col("opts") == "") for k, c in sel.items()}
    names = {"standard": f"standard, tail {standard_tail}", "kvarn": "KVarN, tail 128*"}
    allv = prep.filter(sel["standard"] | sel["kvarn"])["kld_median"]
    if allv.is_empty():
        return _placeholder(model, "K×V heatmap", "no standard tail-0 or KVarN cells measured")
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
        order = sorted(set(cells["k_type"]) | set(cells["v_type"]), key=lambda t: (-(D.type_bits(t) or 0), t))
        k_order = [t for t in order if t in set(cells["k_type"])]
        v_order = [t for t in order if t in set(cells["v_type"])]
        base = alt.Chart(cells).encode(
            x=alt.X("v_type:O", sort=v_order, title="V type", axis=alt.Axis(labelAngle=-40)), y=alt.Y("k_type:O", sort=k_order, title="K type"))
        rect = base.mark_rect().properties(name=f"heatmap_{fam}").encode(color=color, tooltip=[
            alt.Tooltip("pair:N"), alt.Tooltip("tail_label:N", title="tail"),
            alt.Tooltip("kld_median:Q", title="median KLD", format=KLD_FMT),
            alt.Tooltip("kld_mean:Q", title="mean KLD", format=KLD_FMT),
            alt.Tooltip("kv_mib:Q", title=f"KV MiB ({D.accounting_of(prep)})", format=".2f")])
        text = base.mark_text(fontSize=9).encode(
            text=alt.Text("kld_median:Q", format=KLD_FMT),
            color=alt.condition(f"datum.kld_median > {mid!r}", alt.value("white"), alt.value("black")))
        side = 52
        panels.append(alt.layer(rect, text).properties(
            width=side * len(v_order), height=side * len(k_order), title=names[fam]))
    return alt.hconcat(*panels).resolve_scale(color="shared").properties(
        title=_title(model, "median KLD of every K×V pair", f"log colour scale shared by both panels; {_run_desc(prep)}"))


# ---------------------------------------------------------------- figures from paired statistics


def ranked(prep: pl.DataFrame, paired: pl.DataFrame) -> alt.LayerChart:
    """Cells ranked by median KLD with 95 % block-bootstrap intervals (kvarn.report.paired_table.run_table).

    Filled points: cells whose median is statistically indistinguishable from the standard
    floor (paired interval of Δ median vs the floor holds 0); the dashed rule is the floor.
    """
    model = prep["model"][0]
    rows = D.figure_rows(prep).select(["cell", "pair", "tail_label", "family", "series", "kld_median"]).join(
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
    series = _series_scale(rows["series"].to_list())
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
    floor = D.standard_floor(prep)
    if floor is not None:
        fl = pl.DataFrame({"floor_kld": [max(floor["kld_median"], 1e-8)]})
        layers.append(alt.Chart(fl, name="standard_floor").mark_rule(color=FLOOR_COLOR, strokeDash=[6, 4]).encode(
            x="floor_kld:Q"))
    return alt.layer(*layers).properties(
        width=WIDTH, height=max(160, 16 * len(order)),
        title=_title(model, "cells ranked by median KLD",
                     f"bars: 95 % circular block-bootstrap intervals; filled: not distinguishable from the "
                     f"standard floor (dashed); {_run_desc(prep)}"))


# ---------------------------------------------------------------- free-running decode


def decode(frame: pl.DataFrame) -> alt.HConcatChart:
    """Free-running decode (kvarn.run.decode): survival curves (fraction of prompts whose
    generation still equals the BF16 baseline's after t tokens) and the mean KLD of each
    decode step along the cell's own text; dashed standard, solid KVarN, colour = width."""
    model, p, g = frame["model"][0], frame["prompts"][0], frame["tokens"][0]
    frame = frame.with_columns(pl.col("width").fill_null(0))
    color, dash = _cell_encodings(frame)
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
    ).properties(title=_title(model, f"free-running decode, {frame['decoding'][0]}",
                              f"{p} prompts, {g} generated tokens each, baseline re-scoring the cell's text; "
                              "a drop in survival is the first token where generation leaves the baseline"))


# ---------------------------------------------------------------- long generation (kvarn.report.generation)


def _gen_title(cells: pl.DataFrame, text: str, subtitle: str) -> alt.TitleParams:
    r = cells.row(0, named=True)
    return _title(r["model"], text, f"n_ctx {r['n_ctx']}, {r['prompts']} prompts × {r['tokens']} generated tokens, "
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
        right = _placeholder(cells["model"][0], "paired slopes", "no KVarN cell with a same-width standard cell")
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


# The names are kvarn.report.generation's (its workflow targets), in its order.
GENERATION_FIGURES = dict(zip(GEN.GENERATION_FIGURES, (generation_survival, generation_kld_steps, generation_slopes,
                                                       generation_tf_vs_free), strict=True))


def generation_figure(name: str, tables: dict[str, pl.DataFrame]) -> alt.TopLevelMixin:
    """A figure of one decode run's generation statistics (kvarn.report.generation.compute_run)."""
    if name not in GENERATION_FIGURES:
        raise ValueError(f"unknown generation figure {name!r}; expected one of {sorted(GENERATION_FIGURES)}")
    return GENERATION_FIGURES[name](tables)


# ---------------------------------------------------------------- per-layer attention error


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


# ---------------------------------------------------------------- figures from per-token data


def _cell_encodings(tokens_like: pl.DataFrame):
    widths = sorted(tokens_like["width"].unique().to_list())
    color = alt.Color("width:O", title="width (bits)", legend=alt.Legend(orient="bottom"),
                      scale=alt.Scale(scheme="viridis", domain=widths, reverse=True))
    return color, family_dash(tokens_like["family"].unique().to_list())


def family_dash(families) -> alt.StrokeDash:
    """The stroke dash of the families drawn (FAMILY_DASH's order), titled by what each style means."""
    drawn = [f for f in FAMILY_DASH if f in set(families)]
    unknown = sorted(set(families) - set(FAMILY_DASH), key=str)
    if unknown:
        raise ValueError(f"no line style for family {unknown}; known: {', '.join(FAMILY_DASH)}")
    return alt.StrokeDash("family:N", scale=alt.Scale(domain=drawn, range=[FAMILY_DASH[f][0] for f in drawn]),
                          title=f"family ({'; '.join(FAMILY_DASH[f][1] for f in drawn)})",
                          legend=alt.Legend(orient="bottom", titleLimit=0))  # 0: the whole title


def position(tokens: pl.DataFrame, n_bins: int = 24) -> alt.LayerChart:
    """Mean per-token KLD per position bin inside the context: does the error grow with depth?"""
    model = tokens["model"][0]
    bins = T.position_bins(tokens, n_bins=n_bins)
    color, dash = _cell_encodings(bins)
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
        title=_title(model, "KLD by position in the context",
                     f"mean per-token KLD in {n_bins} equal bins of the scored positions, n_ctx {tokens['n_ctx'][0]}; "
                     "a rising line is error accumulating"))


def distribution(tokens: pl.DataFrame) -> alt.LayerChart:
    """ECDF of per-token KLD (log x) per chosen cell: the whole distribution, tail included."""
    model = tokens["model"][0]
    e = T.ecdf(tokens)
    color, dash = _cell_encodings(e)
    lines = alt.Chart(e, name="ecdf").mark_line(strokeWidth=2, interpolate="step-after").encode(
        x=alt.X("kld:Q", title="per-token KLD (log; values below 1e-8 shown at 1e-8)", scale=alt.Scale(type="log")),
        y=alt.Y("fraction:Q", title="fraction of tokens with KLD ≤ x", scale=alt.Scale(domain=[0, 1])),
        color=color, strokeDash=dash, detail="cell:N",
        tooltip=[alt.Tooltip("cell:N"), alt.Tooltip("kld:Q", title="KLD", format=KLD_FMT),
                 alt.Tooltip("fraction:Q", title="fraction ≤", format=".4f")])
    half = alt.Chart(pl.DataFrame({"median": [0.5]})).mark_rule(color="#999", strokeDash=[2, 2]).encode(y="median:Q")
    return alt.layer(half, lines).properties(
        width=WIDTH, height=HEIGHT,
        title=_title(model, "distribution of per-token KLD",
                     "ECDF; further left is better, the right end is the worst tokens; dotted: the median"))


# ---------------------------------------------------------------- writing


SUMMARY_FIGURES = {"pareto": pareto, "same_width": same_width, "tail_effect": tail_effect, "tail_sweep": tail_sweep,
                   "heatmap": heatmap}
TOKEN_FIGURES = {"position": position, "distribution": distribution}


def summary_figure(name: str, prep: pl.DataFrame, **options) -> alt.TopLevelMixin:
    """A figure drawn from the prepared summary rows of one model (`options`: the builder's keywords)."""
    if name not in SUMMARY_FIGURES:
        raise ValueError(f"unknown summary figure {name!r}; expected one of {sorted(SUMMARY_FIGURES)}")
    return SUMMARY_FIGURES[name](prep, **options)


def token_figure(name: str, tokens: pl.DataFrame, **options) -> alt.TopLevelMixin:
    """A figure drawn from per-token rows (kvarn.report.tokens.load_tokens)."""
    if name not in TOKEN_FIGURES:
        raise ValueError(f"unknown per-token figure {name!r}; expected one of {sorted(TOKEN_FIGURES)}")
    return TOKEN_FIGURES[name](tokens, **options)


def save_chart(chart: alt.TopLevelMixin, stem: str | Path, formats=("vl.json", "svg", "png"), scale: float = 2.0) -> list[Path]:
    """Write `stem.vl.json` (the Vega-Lite spec), `stem.svg`, `stem.png`, each atomically.

    Rendering is offline (vl-convert); PNG at `scale`× for a sharp README image.
    """
    import vl_convert as vlc

    stem = Path(stem)
    spec = chart.to_dict()
    vl_version = alt.SCHEMA_VERSION.lstrip("v").rsplit(".", 1)[0]  # "6.4"
    written = []
    for fmt in formats:
        path = stem.with_name(f"{stem.name}.{fmt}")
        if fmt == "vl.json":
            payload = chart.to_json(indent=1).encode()
        elif fmt == "svg":
            payload = vlc.vegalite_to_svg(spec, vl_version=vl_version).encode()
        elif fmt == "png":
            payload = vlc.vegalite_to_png(spec, vl_version=vl_version, scale=scale)
        else:
            raise ValueError(f"unknown figure format {fmt!r}; expected vl.json, svg or png")
        write_bytes(path, payload)
        written.append(path)
    return written
