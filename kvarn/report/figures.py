"""What every figure of the report shares, and how a chart is written (Vega-Lite JSON, SVG, PNG).

The style: each series' colour and mark, each family's line dash, the panel size and KLD format,
titles and the placeholder a figure draws where a run lacks its cells. `save_chart` writes a spec
and renders it offline with vl-convert. The figures themselves: `figures_pareto`, `figures_compare`,
`figures_cells`, `figures_tokens`, `figures_generation`; by name: `figures_catalog`.
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
from kvarn.report import data

# One colour per Pareto series; other tails (if a matrix has them) get the spare colours.
SERIES_COLORS = {data.SERIES_STANDARD_T0: "#9a9a9a", data.SERIES_STANDARD_T128: "#4c78a8",
                 data.SERIES_KVARN: "#e45756"}
SPARE_COLORS = ["#72b7b2", "#b279a2", "#f58518", "#54a24b", "#eeca3b", "#ff9da6", "#9d755d"]
# The words a generated caption uses for the series' colours and marks (pareto_caption).
COLOR_NAMES = {"#9a9a9a": "grey", "#4c78a8": "blue", "#e45756": "red", "#72b7b2": "teal", "#b279a2": "purple",
               "#f58518": "orange", "#54a24b": "green", "#eeca3b": "yellow", "#ff9da6": "pink", "#9d755d": "brown"}
# One mark per Pareto series, likewise: the three named series keep theirs, the rest take the spares.
SERIES_SHAPES = {data.SERIES_STANDARD_T0: "circle", data.SERIES_STANDARD_T128: "square",
                 data.SERIES_KVARN: "triangle-up"}
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


def chart_title(model: str, text: str, subtitle: str | list[str]) -> alt.TitleParams:
    """A figure's title, `{model}: {text}`, with its subtitle, anchored left."""
    return alt.TitleParams(f"{model}: {text}", subtitle=subtitle, anchor="start")


def run_desc(prep: pl.DataFrame) -> str:
    """The run a figure draws in words (n_ctx, chunks, scored tokens per cell), for its subtitle."""
    r = prep.row(0, named=True)
    return f"n_ctx {r['n_ctx']}, {r['chunks']} chunk{'s' if r['chunks'] != 1 else ''}, {r['n_tokens']} scored tokens per cell"


def placeholder(model: str, name: str, why: str) -> alt.Chart:
    """A chart that says why a figure is empty (a matrix without the cells it compares)."""
    return alt.Chart(alt.Data(values=[{"why": why}]), title=chart_title(model, name, "")).mark_text(
        fontSize=14, color="#555").encode(text="why:N").properties(width=WIDTH, height=80)


def _series_order(name: str) -> tuple:
    """Legend order of a series past the named three (kvarn.report.data.series_of): standard,
    format-only, KVarN, QuantizedCache backends, each by tail; a name of no known family last."""
    prefixes = [(data.SERIES_FORMAT_ONLY, 1), ("standard", 0), ("KVarN", 2), (data.SERIES_ECOSYSTEM, 3)]
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


def series_scale(series: Iterable[str]) -> alt.Scale:
    """The colour scale of the series present (series_styles)."""
    styles = series_styles(series)
    return alt.Scale(domain=[s for s, _, _ in styles], range=[c for _, c, _ in styles])


def shape_scale(series: Iterable[str]) -> alt.Scale:
    """The mark scale of the series present (series_styles)."""
    styles = series_styles(series)
    return alt.Scale(domain=[s for s, _, _ in styles], range=[m for _, _, m in styles])


def cell_encodings(tokens_like: pl.DataFrame):
    """Colour by width (viridis, widest dark) and dash by family (family_dash) of per-cell lines."""
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
