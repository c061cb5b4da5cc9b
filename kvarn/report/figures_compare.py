"""The figures of the report's comparisons (kvarn.report.compare): KVarN against the same-width
standard type, what a tail buys a standard cache, the tail sweep, and the share of llama.cpp's
KLD that is its kernel's arithmetic.
"""

from __future__ import annotations

import altair as alt
import polars as pl

from kvarn.report import compare, data
from kvarn.report.figures import (ECO_SHADES, HEIGHT, KLD_FMT, SERIES_COLORS, WIDTH, chart_title, placeholder,
                                  run_desc)


def same_width(prep: pl.DataFrame, tail: int = 128) -> alt.HConcatChart | alt.Chart:
    """KVarN vs the same-width standard type at matched tail: % change of median and mean, and MiB.

    Two partners per width where measured: the study's matched row (qN_0 at tail `tail`)
    and the format-only row (qN_0 with KVarN's sink, tail and F16 tail dtype), against
    which only the quantizer differs."""
    model = prep["model"][0]
    sw = compare.same_width(prep, tail=tail)
    if sw.is_empty():
        return placeholder(model, "same-width comparison", f"no width has both kvarnN-kvarnN and qN_0-qN_0 at tail {tail}")
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
        y=alt.Y("mib:Q", title=f"KV cache MiB, {data.accounting_of(prep)} accounting", stack="zero"),
        color=alt.Color("component:N", scale=comp, title="memory", legend=alt.Legend(orient="bottom")),
        order=alt.Order("part_order:Q"),
        tooltip=[alt.Tooltip("pair:N"), alt.Tooltip("component:N"), alt.Tooltip("mib:Q", title="MiB", format=".2f")],
    ).properties(width=WIDTH * 0.45, height=HEIGHT,
                 title=alt.TitleParams("cache size: quantized body + staging + exact overlay", fontSize=11))
    return alt.hconcat(left, right).resolve_scale(color="independent").properties(
        title=chart_title(model, "KVarN vs the same-width standard type",
                     f"kvarnN-kvarnN (tail 128*) vs qN_0-qN_0 (tail {tail}; format only: + sink 128, F16 tail)"
                     + (f" and vs {', '.join(b + 'N' for b in backends)} (transformers' QuantizedCache, {tail}*)"
                        if backends else "") + f"; {run_desc(prep)}"))


def tail_effect(prep: pl.DataFrame) -> alt.LayerChart | alt.Chart:
    """% change of the median KLD from tail 0 to tail N, per standard width."""
    model = prep["model"][0]
    te = compare.tail_effect(prep)
    if te.is_empty():
        return placeholder(model, "tail effect", "no standard qN_0-qN_0 pair measured at tail 0 and a longer tail")
    te = te.with_columns(pl.format("tail 0 → {}", pl.col("tail")).alias("change"))
    xw = alt.X("width:O", title="standard width (qN_0-qN_0, bits)", axis=alt.Axis(labelAngle=0))
    tails = sorted(te["change"].unique().to_list(), key=lambda s: int(s.split()[-1]))
    tt = [alt.Tooltip("pair:N"), alt.Tooltip("change:N"),
          alt.Tooltip("median_t0:Q", title="median KLD at tail 0", format=KLD_FMT),
          alt.Tooltip("median_tail:Q", title="median KLD with the tail", format=KLD_FMT),
          alt.Tooltip("pct_median:Q", title="% change of median", format="+.1f"),
          alt.Tooltip("pct_mean:Q", title="% change of mean", format="+.1f")]
    bars = alt.Chart(te, name="tail_change").mark_bar(color=SERIES_COLORS[data.SERIES_STANDARD_T128]).encode(
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
        title=chart_title(model, "what an exact recent tail buys a standard cache",
                     f"median KLD, tail 0 → tail N, same pair; below 0: the tail helps. {run_desc(prep)}"))


def tail_sweep(prep: pl.DataFrame) -> alt.LayerChart | alt.Chart:
    """Median KLD against the effective tail for q4_0 and kvarn4 (log y), with the ratio of
    how strongly the median responds to the tail and to the format."""
    model = prep["model"][0]
    sw = compare.tail_sweep(prep)
    if sw["pair"].n_unique() < 1 or sw.height < 2:
        return placeholder(model, "tail sweep", "q4_0-q4_0 / kvarn4-kvarn4 measured at fewer than two tails")
    tvf = compare.tail_vs_format(sw, format_only=compare.format_only_median(prep))
    colors = alt.Scale(domain=["q4_0-q4_0", "kvarn4-kvarn4"], range=[SERIES_COLORS[data.SERIES_STANDARD_T128],
                                                                     SERIES_COLORS[data.SERIES_KVARN]])
    tt = [alt.Tooltip("pair:N"), alt.Tooltip("tail_label:N", title="tail"),
          alt.Tooltip("kld_median:Q", title="median KLD", format=KLD_FMT),
          alt.Tooltip("kld_mean:Q", title="mean KLD", format=KLD_FMT),
          alt.Tooltip("exact_share:Q", title="exact share", format=".1%")]
    base = alt.Chart(sw, name="sweep").encode(
        x=alt.X("tail:Q", title="effective exact tail (tokens)",
                axis=alt.Axis(values=sorted(set(sw["tail"].to_list())), labelAngle=0)),
        y=alt.Y("kld_median:Q", title="median KLD", scale=alt.Scale(type="log")),
        color=alt.Color("pair:N", scale=colors, title=None, legend=alt.Legend(orient="top-right")), tooltip=tt)
    sub = ["x: the effective tail (KVarN: at least 128, plus its 128-token sink). " + run_desc(prep)]
    if tvf is not None:
        sub.append(f"The median responds {tvf['ratio']:.1f}x more to the tail (|Δln| {tvf['tail_response']:.2f}) "
                   f"than to the format at equal tail (|Δln| {tvf['format_response']:.2f}),")
        if "ratio_format_only" in tvf:
            sub.append(f"{tvf['ratio_format_only']:.1f}x more than to the quantizer alone (kvarn4 vs q4_0 with "
                       f"KVarN's sink and F16 tail, |Δln| {tvf['format_only_response']:.2f}).")
    return alt.layer(base.mark_line(point=True)).properties(
        width=WIDTH * 0.8, height=HEIGHT,
        title=chart_title(model, "which tokens are exact vs which format compresses the rest", sub))


def kernel_share(split: pl.DataFrame, model: str) -> alt.LayerChart | alt.Chart:
    """Per width: how much of llama.cpp's median KLD is its kernel's arithmetic (`compare.compute_split`)."""
    sw = split.filter(pl.col("width").is_not_null()) if not split.is_empty() else split
    if sw.is_empty():
        return placeholder(model, "kernel share", "no qN-qN pair run in both compute paths (exact and llamacpp-cpu)")
    sw = sw.with_columns((100 * pl.col("kernel_share_median")).alias("pct"))
    tt = [alt.Tooltip("pair:N"), alt.Tooltip("exact_median:Q", title="format (exact) median", format=KLD_FMT),
          alt.Tooltip("total_median:Q", title="llamacpp-cpu median", format=KLD_FMT),
          alt.Tooltip("pct:Q", title="kernel share %", format=".0f")]
    bars = alt.Chart(sw, name="kernel_share").mark_bar(color=SERIES_COLORS[data.SERIES_STANDARD_T128]).encode(
        x=alt.X("pair:N", title="K/V pair (widest first)", sort=None, axis=alt.Axis(labelAngle=0)),
        y=alt.Y("pct:Q", title="% of llama.cpp's median KLD from the kernel", scale=alt.Scale(domain=[0, 100])),
        tooltip=tt)
    text = alt.Chart(sw).mark_text(dy=-6, fontSize=10).encode(x=alt.X("pair:N", sort=None), y="pct:Q",
                                                              text=alt.Text("pct:Q", format=".0f"))
    return alt.layer(bars, text).properties(
        width=WIDTH * 0.8, height=HEIGHT,
        title=chart_title(model, "how much of llama.cpp's KLD is its kernel's arithmetic",
                     "1 − median(exact) / median(llamacpp-cpu), same cell, tail 0"))
