"""kvarn.report on a synthetic result set (tests/synthetic.py): tables, figure specs, rules.

Figures are checked on their Vega-Lite JSON (marks, fields, scales, series), not pixels;
one figure is rendered to SVG and PNG to prove the offline renderer works.
"""

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import synthetic  # noqa: E402

from kvarn import report as R  # noqa: E402
from kvarn.report import compare  # noqa: E402
from kvarn.report import data as D  # noqa: E402
from kvarn.report import tokens as T  # noqa: E402

# One xdist worker: the module fixtures run a tiny matrix once.
pytestmark = pytest.mark.xdist_group("report")

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["smollm2-135m", "gemma3-270m"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    summary = synthetic.make_results(root)
    return root, summary


@pytest.fixture(scope="module")
def prep(results):
    return {m: R.prepare(results[1], m) for m in MODELS}


def units(spec):
    """Every unit spec (a dict with a mark) inside a layered/concatenated Vega-Lite spec."""
    if isinstance(spec, dict):
        if "mark" in spec:
            yield spec
        for v in spec.values():
            yield from units(v)
    elif isinstance(spec, list):
        for v in spec:
            yield from units(v)


def mark(u):
    return u["mark"]["type"] if isinstance(u["mark"], dict) else u["mark"]


def fields(u):
    return {ch: e.get("field") for ch, e in u.get("encoding", {}).items() if isinstance(e, dict)}


def dataset_values(spec, column):
    return {row[column] for rows in spec.get("datasets", {}).values() for row in rows if column in row}


# ---------------------------------------------------------------- tables


def test_table_marks_floor_and_rows_below_it(results):
    table = R.build_table(results[1], "smollm2-135m")
    floor = table.filter(pl.col("is_floor"))
    assert floor.height == 1 and floor["pair"][0] == "q8_0-q8_0" and floor["family"][0] == "standard"
    # the study's floor: the lowest median among the standard pairs at tail 128 (default options)
    std_best = table.filter((pl.col("family") == "standard") & (pl.col("tail_requested") == 128)
                            & ~pl.col("cell").str.contains("-s128"))["kld_median"].min()
    assert floor["kld_median"][0] == std_best
    below = table.filter(pl.col("below_floor"))
    assert below.height >= 1 and (below["kld_median"] < std_best).all() and "kvarn" in below["family"].to_list()
    assert table.filter(~pl.col("below_floor") & (pl.col("kld_median") < std_best)).is_empty()

    md = R.to_markdown(table)
    # kvarn4 at n_ctx 1024, 30 layers x 3 heads x D 64, `packed`: 8 groups x (4608 + 4736) bytes
    # per head, + (128 tail + 128 sink) f16 rows x 64 x 2 bytes x (K, V) per head = 12.04 MiB
    # exact %: every scored query p = 512..1022 reads 128 sink + 128 tail keys exactly out of
    # p + 1: 256 x 511 / (513 + ... + 1023) = 130816 / 392448 = 33.3 %
    assert 256 * 511 / sum(range(513, 1024)) == pytest.approx(1 / 3)
    assert "| kvarn4-kvarn4 | 128\\* | 33.3 | 12.04 |" in md  # request 0 printed 128*, escaped for Markdown
    assert "| kvarn4-kvarn4 | 128 | 33.3 | 12.04 (+0.00) |" in md  # request 128: the same cache
    assert "| K/V pair | tail | exact % | KV cache MiB, packed (Δ) |" in md  # the header names the accounting
    assert "| q4_0-q4_0 | 0 | 0.0 |" in md  # a standard tail-0 row reads nothing exactly
    assert "under the `packed` memory accounting" in md
    assert [ln for ln in md.splitlines() if ln.startswith("| q8_0-q8_0 | 128 |")][0].endswith("| *standard floor* |")
    kv8 = [ln for ln in md.splitlines() if ln.startswith("| **kvarn8-kvarn8**")]
    assert kv8 and "**below floor**" in kv8[0]  # the whole row is bold
    t128 = [ln for ln in md.splitlines() if ln.startswith("| q4_0-q4_0 | 128 |")][0]
    row = table.filter((pl.col("pair") == "q4_0-q4_0") & (pl.col("tail_requested") == 128)).row(0, named=True)
    assert f"{row['kv_mib']:.2f} ({row['delta_mib']:+.2f})" in t128 and row["delta_mib"] > 0
    t0 = [ln for ln in md.splitlines() if ln.startswith("| q4_0-q4_0 | 0 |")][0]
    assert "(+" not in t0  # a tail-0 row is its own reference
    assert "q4_0-q4_0-norot" in md  # a non-default option stays visible

    html = R.to_html(table)
    assert html.count('class="kvarn below-floor"') == below.filter(pl.col("family") == "kvarn").height
    assert html.count('class="standard floor"') == 1
    # q4_0 tail 128 over tail 0, by hand: 128 rows x 3 KV heads x 64 x 2 B (bf16) x 2 (K, V) x 30 layers
    assert 128 * 3 * 64 * 2 * 2 * 30 / 2**20 == 2.8125
    assert "<td>128*</td>" in html and "(+2.81)" in html


def test_table_parquet_round_trip(results, tmp_path):
    table = R.build_table(results[1], "gemma3-270m")
    table.write_parquet(tmp_path / "t.parquet")
    back = pl.read_parquet(tmp_path / "t.parquet")
    assert back.columns == [c for c in R.tables.TABLE_COLUMNS if c in back.columns]
    assert set(back["tail_label"]) >= {"0", "128", "128*"}


def test_unknown_model_names_the_choices(results):
    with pytest.raises(ValueError, match="no-such-model.*smollm2-135m"):
        R.prepare(results[1], "no-such-model")


# ---------------------------------------------------------------- figures from the summary


def test_pareto_spec(prep):
    spec = R.pareto(prep["smollm2-135m"]).to_dict()
    us = list(units(spec))
    points = [u for u in us if mark(u) == "point"]
    # the synthetic summary carries bits per value: x is that (MiB: test_pareto_x_bits_per_value_else_mib)
    assert points and fields(points[0])["x"] == "bits_per_value" and fields(points[0])["y"] == "kld_median"
    assert points[0]["encoding"]["x"]["title"].startswith("bits per cached K/V value, packed accounting")
    assert points[0]["encoding"]["y"]["scale"]["type"] == "log"
    series = points[0]["encoding"]["color"]["scale"]["domain"]
    assert series[:3] == [D.SERIES_STANDARD_T0, D.SERIES_STANDARD_T128, D.SERIES_KVARN]
    assert {D.SERIES_STANDARD_T0, D.SERIES_STANDARD_T128, D.SERIES_KVARN} <= dataset_values(spec, "series")
    tips = {t["field"] for t in points[0]["encoding"]["tooltip"]}
    assert {"pair", "tail_label", "tail_eff_full", "rot", "kv_mib", "body_mib", "overlay_mib", "kld_mean",
            "kld_p99", "same_top_pct"} <= tips
    frontier = [u for u in us if mark(u) == "line"]  # one per panel: median, p99
    assert len(frontier) == 2 and all(fields(f)["y"] == "frontier_kld" for f in frontier)
    assert all(f["mark"]["interpolate"] == "step-after" for f in frontier)
    # the median panel's step line is kvarn.report.data.pareto_frontier's, drawn on bits per value
    assert [r["frontier_kld"] for r in spec["datasets"][frontier[0]["data"]["name"]]] == \
        D.pareto_frontier(prep["smollm2-135m"])["frontier_kld"].to_list()
    rule = [u for u in us if mark(u) == "rule"]
    assert len(rule) == 1 and fields(rule[0])["y"] == "floor_kld"
    floor = D.standard_floor(prep["smollm2-135m"])
    assert dataset_values(spec, "floor_kld") == {floor["kld_median"]}
    # the frontier is the running minimum of the standard medians over MiB
    front = D.pareto_frontier(prep["smollm2-135m"])
    assert (front["frontier_kld"].diff().drop_nulls() <= 0).all()
    std = prep["smollm2-135m"].filter(pl.col("family") == "standard")
    assert front["frontier_kld"].min() == std["kld_median"].min() <= floor["kld_median"]


def hand_prep(series_cells: dict[str, list[tuple[str, float, float]]], bits: bool = True) -> pl.DataFrame:
    """A prepared frame by hand: per series, cells (pair, bits per value, median KLD); p99 = 20 × median,
    MiB = bits/value × 1.5 (a BF16 cache of 24 MiB)."""
    rows = []
    for series, cells in series_cells.items():
        fam = "kvarn" if series.startswith("KVarN") else "ecosystem" if series.startswith(D.SERIES_ECOSYSTEM) \
            else "standard"
        tail = int(series.rsplit(" ", 1)[1].rstrip("*"))
        fmt = series.startswith(D.SERIES_FORMAT_ONLY)
        for pair, bpv, med in cells:
            rows.append({
                "model": "hand", "n_ctx": 2048, "chunks": 1, "n_tokens": 1023, "pair": pair + (D.FORMAT_ONLY_OPTS if fmt else ""),
                "family": fam, "opts": D.FORMAT_ONLY_OPTS if fmt else "", "tail_requested": 0 if fam != "standard" else tail,
                "tail_eff_full": tail, "tail_label": f"{tail}*" if fam != "standard" else str(tail), "series": series,
                "bits_per_value": bpv if bits else None, "kv_mib": bpv * 1.5, "kv_total_bytes": int(bpv * 1.5 * 2**20),
                "kv_bf16_bytes": 24 * 2**20, "memory_accounting": "packed", "kld_median": med,
                "kld_mean": 2 * med, "kld_p99": 20 * med, "same_top": 0.99})
    return pl.DataFrame(rows, schema_overrides={"bits_per_value": pl.Float64})


HAND_SERIES = {
    D.SERIES_STANDARD_T0: [("q8_0-q8_0", 8.5, 0.002), ("q4_0-q4_0", 4.5, 0.05)],
    D.SERIES_STANDARD_T128: [("q8_0-q8_0", 8.9, 0.001), ("q4_0-q4_0", 4.9, 0.02)],
    D.SERIES_KVARN: [("kvarn4-kvarn4", 4.8, 0.012)],
    f"{D.SERIES_FORMAT_ONLY}, tail 128": [("q4_0-q4_0", 5.3, 0.015)],
}


def caption_series(caption: str) -> dict[str, str]:
    """The caption's series list: {series: 'colour marks'}."""
    m = re.search(r"(\d+) series: (.*?)\. ", caption)
    entries = dict(reversed(e.split(": ", 1)) for e in m.group(2).split("; "))
    assert int(m.group(1)) == len(entries)
    return entries


def test_pareto_caption_names_exactly_the_series_drawn(prep):
    from kvarn.report.figures import COLOR_NAMES, SHAPE_NAMES
    from kvarn.report.figures_pareto import pareto_caption

    hand = hand_prep(HAND_SERIES)
    named = caption_series(pareto_caption(hand))
    assert set(named) == set(HAND_SERIES) and "4 series: " in pareto_caption(hand)
    # each with the colour and mark the figure draws it in
    enc = [u for u in units(R.pareto(hand).to_dict()) if mark(u) == "point"][0]["encoding"]
    for s, look in named.items():
        i = enc["color"]["scale"]["domain"].index(s)
        assert look == f"{COLOR_NAMES[enc['color']['scale']['range'][i]]} {SHAPE_NAMES[enc['shape']['scale']['range'][i]]}"
    assert named[D.SERIES_STANDARD_T0] == "grey circles" and named[D.SERIES_KVARN] == "red triangles"
    assert "step line" in pareto_caption(hand).lower() and "standard floor, q8_0-q8_0 t128" in pareto_caption(hand)
    # a series not drawn is not named
    three = hand_prep({k: v for k, v in HAND_SERIES.items() if k != D.SERIES_KVARN})
    assert set(caption_series(pareto_caption(three))) == set(HAND_SERIES) - {D.SERIES_KVARN}
    assert "KVarN, tail" not in pareto_caption(three)
    # the synthetic run's eight series, every one drawn and named
    smol = prep["smollm2-135m"]
    drawn = set(D.figure_rows(smol)["series"])
    assert len(drawn) == 8 and set(caption_series(pareto_caption(smol))) == drawn


def test_pareto_legend_shows_every_label_in_full(prep):
    spec = R.pareto(prep["smollm2-135m"]).to_dict()
    points = [u for u in units(spec) if mark(u) == "point"]
    assert len(points) == 2
    for u in points:
        for channel in ("color", "shape"):
            legend = u["encoding"][channel]["legend"]
            assert legend["labelLimit"] == 0 and legend["orient"] == "bottom"  # 0: no limit; outside the plot
    assert spec["resolve"]["scale"]["color"] == spec["resolve"]["scale"]["shape"] == "shared"  # one legend


def test_pareto_x_bits_per_value_else_mib():
    from kvarn.report.figures_pareto import pareto_caption

    def xs(spec):
        return {fields(u).get("x") for u in units(spec) if "x" in fields(u)} - {None}

    spec = R.pareto(hand_prep(HAND_SERIES)).to_dict()
    assert xs(spec) == {"bits_per_value"}
    tips = [t["field"] for u in units(spec) if mark(u) == "point" for t in u["encoding"]["tooltip"]]
    assert "kv_mib" in tips and "bits_per_value" in tips  # MiB kept on hover
    assert any("MiB = bits/value × 1.5 " in line for line in spec["title"]["subtitle"])  # 24 MiB / 16
    assert "bits per cached value" in pareto_caption(hand_prep(HAND_SERIES))
    old = hand_prep(HAND_SERIES, bits=False)  # aggregated before bits per value were counted
    spec = R.pareto(old).to_dict()
    assert xs(spec) == {"kv_mib"}
    assert any("not bits per value" in line for line in spec["title"]["subtitle"])
    assert "KV cache MiB, not bits per value" in pareto_caption(old)
    tips = [t["field"] for u in units(spec) if mark(u) == "point" for t in u["encoding"]["tooltip"]]
    assert "bits_per_value" not in tips and "kv_mib" in tips
    one_null = hand_prep(HAND_SERIES).with_row_index().with_columns(
        pl.when(pl.col("index") == 0).then(None).otherwise(pl.col("bits_per_value")).alias("bits_per_value"))
    assert xs(R.pareto(one_null.drop("index")).to_dict()) == {"kv_mib"}  # a cell without one: no point lost


def test_pareto_p99_panel_beside_the_median():
    hand = hand_prep(HAND_SERIES)
    spec = R.pareto(hand).to_dict()
    assert len(spec["hconcat"]) == 2
    panels = [list(units(p)) for p in spec["hconcat"]]
    points = [[u for u in p if mark(u) == "point"][0] for p in panels]
    assert [fields(p)["y"] for p in points] == ["kld_median", "kld_p99"]
    assert points[1]["encoding"]["y"]["scale"]["type"] == "log"
    assert fields(points[0])["x"] == fields(points[1])["x"] and spec["resolve"]["scale"]["x"] == "shared"
    assert points[0]["encoding"]["color"]["scale"] == points[1]["encoding"]["color"]["scale"]
    # the p99 panel's step line: the running minimum of the standard p99 over x
    line = [u for u in panels[1] if mark(u) == "line"][0]
    drawn = [(r["bits_per_value"], r["frontier_kld"]) for r in spec["datasets"][line["data"]["name"]]]
    std = hand.filter(pl.col("family") == "standard").sort("bits_per_value")
    assert drawn == list(zip(std["bits_per_value"], std["kld_p99"].cum_min()))
    assert drawn[-1][1] == pytest.approx(20 * 0.001)
    # the floor (a median) only in the median panel
    assert [sum(mark(u) == "rule" for u in p) for p in panels] == [1, 0]


def test_same_width_pairs_matched_and_missing_skipped(prep):
    for model, missing in (("smollm2-135m", 3), ("gemma3-270m", 5)):
        sw = compare.same_width(prep[model])
        assert missing not in sw["width"].to_list() and 2 in sw["width"].to_list()
        assert (sw["pair_std"].str.contains("_0")).all() and (sw["tail_label_kvarn"] == "128*").all()
        spec = R.same_width(prep[model]).to_dict()
        bars = [u for u in units(spec) if mark(u) == "bar"]
        assert {"pct", "mib"} <= {fields(u)["y"] for u in bars}
        assert dataset_values(spec, "statistic") == {"median", "mean"}
        fams = ("standard", "KVarN") + (("standard + sink",) if model == "smollm2-135m" else ())
        assert dataset_values(spec, "component") == {f"{fam} {part}" for fam in fams
                                                     for part in ("body", "staging", "overlay")}
        mem = [u for u in bars if fields(u)["y"] == "mib"][0]
        assert mem["encoding"]["y"]["title"] == "KV cache MiB, packed accounting"
    gemma = compare.same_width(prep["gemma3-270m"]).filter(pl.col("width") == 2)
    assert gemma["pct_median"][0] > 0  # the width where KVarN loses (DESIGN §7) shows as positive


def test_same_width_without_partners_is_a_placeholder(prep):
    only_std = prep["smollm2-135m"].filter(pl.col("family") == "standard")
    spec = R.same_width(only_std).to_dict()
    assert mark(next(units(spec))) == "text"


def test_tail_effect_spec(prep):
    te = compare.tail_effect(prep["smollm2-135m"])
    assert te.filter(pl.col("width") == 2)["pct_median"][0] < -30  # the tail matters most at 2 bits
    assert 3 not in te["width"].to_list()  # q3_0 has no tail-128 partner
    spec = R.tail_effect(prep["smollm2-135m"]).to_dict()
    bars = [u for u in units(spec) if mark(u) == "bar"]
    assert fields(bars[0])["y"] == "pct_median" and fields(bars[0])["x"] == "width"


def test_heatmap_spec(prep):
    spec = R.heatmap(prep["gemma3-270m"]).to_dict()
    rects = [u for u in units(spec) if mark(u) == "rect"]
    assert len(rects) == 2  # one panel per family
    for r in rects:
        assert fields(r) == {"x": "v_type", "y": "k_type", "color": "kld_median"}
        assert r["encoding"]["color"]["scale"]["type"] == "log"
    texts = [u for u in units(spec) if mark(u) == "text"]
    assert texts and texts[0]["encoding"]["text"]["field"] == "kld_median"
    assert spec["resolve"]["scale"]["color"] == "shared"
    assert {"q8_0", "q4_0", "kvarn8"} <= dataset_values(spec, "k_type")
    # the default matrix measures its K×V product at tail 128 only: that grid is drawn
    # a median at or below 0 (a cell at the baseline: 0, or a rounding's −1e-14) is left out of the
    # text colour's geometric middle, which stays a real number between the positive medians
    p = prep["gemma3-270m"]
    kv = (pl.col("family") == "kvarn") & (pl.col("opts") == "") & (pl.col("tail_requested") == 0)
    low = p.with_columns(pl.when(kv & (pl.col("k_type") == "kvarn8") & (pl.col("v_type") == "kvarn8"))
                         .then(pl.lit(-1.77e-14)).otherwise(pl.col("kld_median")).alias("kld_median"))
    assert (low["kld_median"] < 0).sum() == 1
    for u in units(R.heatmap(low).to_dict()):
        if mark(u) == "text":
            cond = u["encoding"]["color"]["condition"]["test"]
            mid = float(cond.split(">")[1].strip(" )"))
            pos = low.filter(low["kld_median"] > 0)["kld_median"]
            assert cond.startswith("datum.kld_median > ") and pos.min() < mid < pos.max(), cond
    product_at_128 = prep["gemma3-270m"].filter(~((pl.col("k_type") != pl.col("v_type")) & (pl.col("tail_requested") == 0)))
    assert D.heatmap_standard_tail(product_at_128) == 128
    assert D.heatmap_standard_tail(prep["gemma3-270m"]) == 0  # a tie goes to tail 0


# ---------------------------------------------------------------- per-token figures


def test_token_selection_from_paths(results):
    paths = synthetic.token_paths(results[0], "smollm2-135m")
    chosen = [Path(p).parent.name for p in R.select_token_paths(paths)]
    assert sorted(chosen) == sorted(f"{t}-{t}-t{n}" for t, n in [
        ("q2_0", 128), ("q4_0", 128), ("q8_0", 128), ("kvarn2", 0), ("kvarn4", 0), ("kvarn8", 0)])
    assert [Path(p).parent.name for p in R.select_token_paths(paths, cells=["q4_0-q4_0-t0-norot"])] == [
        "q4_0-q4_0-t0-norot"]
    assert D.parse_cell_path(paths[0])["model"] == "smollm2-135m"
    with pytest.raises(ValueError, match="not a cell path"):
        D.parse_cell_path("results/x/tokens.parquet")


def test_position_and_distribution_specs(results):
    tokens = R.load_tokens(R.select_token_paths(synthetic.token_paths(results[0], "gemma3-270m")))
    spec = R.position(tokens, n_bins=16).to_dict()
    line = [u for u in units(spec) if mark(u) == "line"][0]
    assert fields(line)["x"] == "pos_mid" and fields(line)["y"] == "kld_mean"
    assert line["encoding"]["y"]["scale"]["type"] == "log"
    assert fields(line)["strokeDash"] == "family" and fields(line)["color"] == "width"
    bins = T.position_bins(tokens, n_bins=16)
    assert bins.group_by("cell").len()["len"].max() == 16 and bins["n"].sum() == tokens.height
    spec = R.distribution(tokens).to_dict()
    ecdf = [u for u in units(spec) if mark(u) == "line"][0]
    assert fields(ecdf)["x"] == "kld" and ecdf["encoding"]["x"]["scale"]["type"] == "log"
    assert fields(ecdf)["y"] == "fraction"


def test_line_style_per_family_only_for_the_families_drawn():
    """Solid KVarN, dashed standard, dotted QuantizedCache backends; the legend lists (and its title
    explains) only the families a figure draws, and an unknown family is refused by name."""
    from kvarn.report.figures import FAMILY_DASH, family_dash
    from kvarn.report.figures_generation import generation_encodings

    dash = family_dash(["ecosystem", "standard", "kvarn"]).to_dict()
    assert dash["scale"]["domain"] == ["kvarn", "standard", "ecosystem"]
    styles = [tuple(r) for r in dash["scale"]["range"]]
    assert len(set(styles)) == 3 and styles[0] == (1, 0)
    assert dash["title"] == "family (solid: KVarN; dashed: standard; dotted: QuantizedCache backends)"
    two = family_dash(["standard", "kvarn"]).to_dict()
    assert two["scale"]["domain"] == ["kvarn", "standard"] and "dotted" not in two["title"]
    with pytest.raises(ValueError, match=r"no line style for family \['float'\]; known: kvarn, standard, ecosystem"):
        family_dash(["kvarn", "float"])
    assert set(FAMILY_DASH) == {"kvarn", "standard", "ecosystem"}
    # a colour per cell: ten labels fit tableau10, an eleventh switches to tableau20
    for n, scheme in ((10, "tableau10"), (11, "tableau20")):
        frame = pl.DataFrame({"label": [f"c{i}" for i in range(n)], "family": ["kvarn"] * n})
        assert generation_encodings(frame)[0].to_dict()["scale"]["scheme"] == scheme


def test_save_chart_writes_spec_svg_png(prep, tmp_path):
    written = R.save_chart(R.tail_effect(prep["smollm2-135m"]), tmp_path / "fig" / "tail_effect")
    assert [p.name for p in written] == ["tail_effect.vl.json", "tail_effect.svg", "tail_effect.png"]
    assert json.loads(written[0].read_text())["$schema"].startswith("https://vega.github.io/schema/vega-lite/")
    assert written[1].read_text().lstrip().startswith("<svg")
    assert written[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "fig").glob(".*tmp"))  # atomic writes leave no temporaries


# ---------------------------------------------------------------- paired statistics


@pytest.fixture(scope="module")
def paired(results, prep):
    from kvarn.report.paired_table import run_table

    paths = synthetic.token_paths(results[0], "smollm2-135m")
    return run_table(prep["smollm2-135m"], paths, n_boot=300)


def test_paired_band_and_same_width(results, prep, paired):
    p = prep["smollm2-135m"]
    floor = D.standard_floor(p)
    row = {r["cell"]: r for r in paired.iter_rows(named=True)}
    assert set(row) == set(p["cell"])
    assert row[floor["cell"]]["band"] == "floor" and row[floor["cell"]]["floor_delta"] == 0
    for r in row.values():  # every interval holds its own estimate
        assert r["kld_median_lo"] <= r["kld_median"] <= r["kld_median_hi"]
        if r["band"] != "floor":
            assert r["floor_lo"] <= r["floor_delta"] <= r["floor_hi"]
            assert (r["band"] == "≈ floor") == (r["floor_lo"] <= 0 <= r["floor_hi"])
    # 2-bit cells are far above the 8-bit floor; some high-bit cell shares its band
    assert row["q2_0-q2_0-t0"]["band"] == "" and row["q2_0-q2_0-t0"]["floor_lo"] > 0
    assert any(r["band"] == "≈ floor" for r in row.values())
    # KVarN widths paired with qN_0 at tail 128 (q3_0 t128 is missing on purpose)
    sw = {r["cell"]: r["sw_cell"] for r in row.values() if r["sw_cell"]}
    assert sw["kvarn4-kvarn4-t0"] == "q4_0-q4_0-t128" and "kvarn3-kvarn3-t0" not in sw
    assert "kvarn4-kvarn4-t128" not in sw  # the request-128 duplicate is not compared twice

    table = R.build_table(results[1], "smollm2-135m", paired=paired)
    md = R.to_markdown(table)
    assert "| band |" in md.splitlines()[4]
    kv4 = [ln for ln in md.splitlines() if "kvarn4-kvarn4" in ln and "128\\*" in ln][0]
    assert "q4_0-q4_0 (Δ" in kv4
    assert "| band |" not in R.to_markdown(R.build_table(results[1], "smollm2-135m"))


def test_ranked_spec(prep, paired):
    from kvarn.report.figures_cells import ranked

    spec = ranked(prep["smollm2-135m"], paired).to_dict()
    marks = {u.get("name"): u for u in units(spec)}
    assert mark(marks["intervals"]) == "rule" and fields(marks["intervals"])["x2"] == "kld_median_hi"
    assert fields(marks["medians"])["x"] == "kld_median" and "standard_floor" in marks
    labels = dataset_values(spec, "label")
    assert "kvarn4-kvarn4 t128*" in labels and "kvarn4-kvarn4 t128" not in labels


# ---------------------------------------------------------------- rules


def test_rules_plan_every_target_and_lint_clean(results, tmp_path):
    """The rule file under a minimal Snakefile providing common.smk's two functions."""
    snakemake = shutil.which("snakemake", path=str(Path(sys.executable).parent)) or "snakemake"
    shutil.copytree(results[0] / "results", tmp_path / "results")
    (tmp_path / "config").mkdir()
    shutil.copy(ROOT / "config" / "study.yaml", tmp_path / "config" / "study.yaml")  # rule claims reads it
    (tmp_path / "Snakefile").write_text(textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})


        include: "common.smk"
        include: {str(ROOT / "workflow/rules/report.smk")!r}
        include: {str(ROOT / "workflow/rules/paired.smk")!r}


        rule all:
            default_target: True
            input:
                report_targets(),
    """))
    (tmp_path / "common.smk").write_text(textwrap.dedent(f"""
        def model_names():
            return {MODELS!r}


        def token_parquets(model):
            return sorted(str(p) for p in Path("results", model).glob("ctx*-c*/cells/*/tokens.parquet"))
    """))
    dry = subprocess.run([snakemake, "-n", "-q", "rules"], cwd=tmp_path, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)\s*$", dry.stdout + dry.stderr, flags=re.M))
    # per model a table, the paired statistics and one job for all its figures; one claims job
    assert {r: int(n) for r, n in jobs.items() if r != "total"} == {
        "report_table": 2, "paired": 2, "report_figures": 2, "claims": 1, "answer": 1, "report_page": 1, "all": 1}, jobs
    lint = subprocess.run([snakemake, "--lint"], cwd=tmp_path, capture_output=True, text=True)
    for f in ("report.smk", "paired.smk"):
        assert "Lints for snakefile " + str(ROOT / "workflow/rules" / f) not in lint.stdout + lint.stderr, lint.stdout
    from kvarn.report import workflow as W

    targets = W.targets(MODELS)
    assert len(targets) == 2 * (3 + 9 * 3) + 3 + 2 + 2 + 1 and "results/figures/gemma3-270m/pareto.vl.json" in targets
    assert {"results/answer.md", "results/claims.md", "results/tables/decisions/smollm2-135m.md"} <= set(targets)
    assert "results/figures/gemma3-270m/kernel_share.vl.json" in targets


def test_report_rules_draw_the_compute_split(results, paired, tmp_path):
    """report_figures and report_table, run by snakemake on a summary holding a q4_0 cell in
    both compute paths: the kernel-share figure's bar and the table's split row carry its numbers."""
    snakemake = shutil.which("snakemake", path=str(Path(sys.executable).parent)) or "snakemake"
    summary = results[1]
    ex = summary.filter((pl.col("model") == "smollm2-135m") & (pl.col("cell") == "q4_0-q4_0-t0"))
    assert ex.height == 1
    exact_median = ex["kld_median"][0]
    cp = ex.with_columns(pl.lit("q4_0-q4_0-t0-llamacpp_cpu").alias("cell"), pl.lit("llamacpp-cpu").alias("compute"),
                         (4 * pl.col("kld_median")).alias("kld_median"), (2 * pl.col("kld_mean")).alias("kld_mean"))
    both = pl.concat([summary.with_columns(pl.lit("exact").alias("compute")), cp], how="diagonal_relaxed")
    (tmp_path / "results" / "paired").mkdir(parents=True)
    both.write_parquet(tmp_path / "results" / "summary.parquet")
    paired.write_parquet(tmp_path / "results" / "paired" / "smollm2-135m.parquet")
    (tmp_path / "Snakefile").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})


        def model_names():
            return ["smollm2-135m"]


        def token_parquets(model):
            return {synthetic.token_paths(results[0], "smollm2-135m")!r}


        include: {str(ROOT / "workflow/rules/report.smk")!r}
    """))
    fig, md = "results/figures/smollm2-135m/kernel_share.vl.json", "results/tables/smollm2-135m.md"
    done = subprocess.run([snakemake, "-c1", "-q", "--allowed-rules", "report_figures", "report_table", "--", fig, md],
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / fig).read_text())
    assert [r["pair"] for r in dataset_rows(spec, "pct")] == ["q4_0-q4_0"]
    assert dataset_rows(spec, "pct")[0]["pct"] == pytest.approx(75)  # 1 - exact / (4 exact)
    text = (tmp_path / md).read_text()
    assert "Format damage (exact) beside llama.cpp's total" in text
    assert f"| q4_0-q4_0 | 0 | {exact_median:.6f} | {4 * exact_median:.6f} | 75 % |" in text


def dataset_rows(spec, column):
    """The rows of the Vega-Lite spec's inline datasets that have `column`."""
    return [r for rows in spec.get("datasets", {}).values() for r in rows if column in r]


def test_every_memory_view_names_its_accounting(results):
    summary = results[1].with_columns(pl.lit("beellama-qwen").alias("memory_accounting"))
    table = R.build_table(summary, "smollm2-135m")
    assert set(table["memory_accounting"]) == {"beellama-qwen"}
    md, page = R.to_markdown(table), R.to_html(table)
    assert "KV cache MiB, beellama-qwen (Δ)" in md and "`beellama-qwen` memory accounting" in md
    assert "KV cache MiB, beellama-qwen (Δ)" in page
    prep_q = R.prepare(summary, "smollm2-135m")
    x = [u for u in units(R.pareto(prep_q).to_dict()) if mark(u) == "point"][0]["encoding"]["x"]
    assert x["title"].startswith("bits per cached K/V value, beellama-qwen accounting")
    x = [u for u in units(R.pareto(prep_q.with_columns(pl.lit(None, pl.Float64).alias("bits_per_value"))).to_dict())
         if mark(u) == "point"][0]["encoding"]["x"]
    assert x["title"].startswith("KV cache MiB, beellama-qwen accounting")  # results without bits per value
    bars = [u for u in units(R.same_width(prep_q).to_dict()) if mark(u) == "bar" and fields(u)["y"] == "mib"]
    assert bars[0]["encoding"]["y"]["title"] == "KV cache MiB, beellama-qwen accounting"


def test_format_only_rows_in_table_and_same_width(prep, results):
    # The format-only row (qN_0 + KVarN's sink 128, tail 128, F16 tail): its own series and
    # path suffix, and a second partner in the same-width comparison.
    smol = prep["smollm2-135m"]
    fo = smol.filter(pl.col("opts") == D.FORMAT_ONLY_OPTS)
    assert D.FORMAT_ONLY_OPTS == "-tdf16-s128"
    assert set(fo["pair"]) == {"q2_0-q2_0-tdf16-s128", "q4_0-q4_0-tdf16-s128"}
    assert set(fo["series"]) == {f"{D.SERIES_FORMAT_ONLY}, tail 128"}
    # the same exact tokens as kvarn4 at 128*: the same exact share, and KVarN's overlay bytes
    kv4 = smol.filter((pl.col("pair") == "kvarn4-kvarn4") & (pl.col("tail_requested") == 0)).row(0, named=True)
    q4 = fo.filter(pl.col("k_type") == "q4_0").row(0, named=True)
    assert q4["exact_share"] == kv4["exact_share"] and q4["overlay_mib"] == kv4["overlay_mib"]
    sw = compare.same_width(smol)
    w4 = sw.filter(pl.col("width") == 4).row(0, named=True)
    assert w4["pair_fmt"] == "q4_0-q4_0-tdf16-s128"
    assert w4["pct_median_fmt"] == pytest.approx((w4["kld_median_kvarn"] / w4["kld_median_fmt"] - 1) * 100)
    assert sw.filter(pl.col("width") == 8)["pct_median_fmt"].is_null().all()  # not measured: null, not dropped
    spec = R.same_width(smol).to_dict()
    assert "standard + sink body" in dataset_values(spec, "component")
    assert any("format only" in b for b in dataset_values(spec, "bar"))
    md = R.to_markdown(R.build_table(results[1], "smollm2-135m"))
    assert "| q4_0-q4_0-tdf16-s128 | 128 | 33.3 |" in md
    # gemma3 has no format-only row: the figure shows the matched partner only
    g = R.same_width(prep["gemma3-270m"]).to_dict()
    assert not any("format only" in b for b in dataset_values(g, "bar"))


def test_tail_sweep(prep):
    import math

    sw = compare.tail_sweep(prep["smollm2-135m"])
    q4 = sw.filter(pl.col("pair") == "q4_0-q4_0")
    kv = sw.filter(pl.col("pair") == "kvarn4-kvarn4")
    assert q4["tail"].to_list() == [0, 128, 256, 512]
    assert kv["tail"].to_list() == [128, 256, 512]  # requests 0 and 128 are one cache: drawn once
    assert kv["exact_share"].to_list() == sorted(kv["exact_share"].to_list())  # longer tail: more exact
    r = compare.tail_vs_format(sw)
    med = lambda s, t: s.filter(pl.col("tail") == t)["kld_median"][0]  # noqa: E731
    tail = (abs(math.log(med(q4, 0) / med(q4, 512))) + abs(math.log(med(kv, 128) / med(kv, 512)))) / 2
    fmt = sum(abs(math.log(med(q4, t) / med(kv, t))) for t in (128, 256, 512)) / 3
    assert r["shared_tails"] == [128, 256, 512]
    assert r["ratio"] == pytest.approx(tail / fmt) and r["tail_response"] == pytest.approx(tail)
    assert "ratio_format_only" not in r  # no format-only median given
    # Against the format-only row (q4_0 with KVarN's sink and F16 tail): the quantizer alone.
    fo = compare.format_only_median(prep["smollm2-135m"])
    fo_row = prep["smollm2-135m"].filter(pl.col("pair") == "q4_0-q4_0-tdf16-s128")
    assert fo == fo_row["kld_median"][0]
    r2 = compare.tail_vs_format(sw, format_only=fo)
    assert r2["format_only_response"] == pytest.approx(abs(math.log(fo / med(kv, 128))))
    assert r2["ratio_format_only"] == pytest.approx(tail / r2["format_only_response"])
    assert compare.format_only_median(prep["gemma3-270m"]) is None  # not measured there
    spec = R.tail_sweep(prep["smollm2-135m"]).to_dict()
    sub = " ".join(spec["title"]["subtitle"] if isinstance(spec["title"]["subtitle"], list)
                   else [spec["title"]["subtitle"]])
    assert "more to the tail" in sub and "quantizer alone" in sub
    assert dataset_values(spec, "pair") == {"q4_0-q4_0", "kvarn4-kvarn4"}
    # gemma3 has no sweep beyond 128 on KVarN: one point per pair is still drawn, no ratio
    g = compare.tail_sweep(prep["gemma3-270m"])
    assert compare.tail_vs_format(g) is None


def test_compute_split_side_by_side():
    from kvarn.report import figures_compare
    from kvarn.report import tables as T

    base = {"model": "m", "n_ctx": 512, "chunks": 1, "k_type": "q8_0", "v_type": "q8_0", "tail": 0,
            "tail_requested": 0, "kld_median": 0.001, "kld_mean": 0.002}
    rows = [{**base, "cell": "q8_0-q8_0-t0", "compute": "exact"},
            {**base, "cell": "q8_0-q8_0-t0-llamacpp_cpu", "compute": "llamacpp-cpu", "kld_median": 0.004,
             "kld_mean": 0.004},
            {**base, "k_type": "q4_0", "v_type": "q4_0", "cell": "q4_0-q4_0-t0", "compute": "exact"}]  # one path only
    split = compare.compute_split(pl.DataFrame(rows), "m")
    assert split["pair"].to_list() == ["q8_0-q8_0"]
    r = split.row(0, named=True)
    assert (r["exact_median"], r["total_median"], r["width"]) == (0.001, 0.004, 8)
    assert r["kernel_share_median"] == pytest.approx(0.75) and r["kernel_share_mean"] == pytest.approx(0.5)
    assert "| q8_0-q8_0 | 0 | 0.001000 | 0.004000 | 75 % |" in T.split_markdown(split)
    spec = figures_compare.kernel_share(split, "m").to_dict()
    assert any(u.get("name") == "kernel_share" or "kernel_share" in json.dumps(u) for u in [spec])
    assert compare.compute_split(pl.DataFrame(rows[:1]), "m").is_empty()


def test_prepare_keeps_llamacpp_rows_out_of_the_study_tables(results):
    summary = results[1]
    extra = summary.head(1).with_columns(pl.lit("llamacpp-cpu").alias("compute"),
                                         (pl.col("cell") + "-llamacpp_cpu").alias("cell"),
                                         pl.lit(9.9).alias("kld_median"))
    both = pl.concat([summary.with_columns(pl.lit("exact").alias("compute")), extra], how="diagonal_relaxed")
    model = summary["model"][0]
    assert len(R.prepare(both, model)) == len(R.prepare(summary, model))


# ---------------------------------------------------------------- the package's lazy names


def test_every_report_name_is_its_defining_modules():
    """kvarn.report's names resolve on first use (PEP 562) to the object their module defines."""
    import importlib

    import kvarn.report

    assert kvarn.report.__all__ and set(kvarn.report.__all__) <= set(dir(kvarn.report))
    for name in kvarn.report.__all__:
        obj = getattr(kvarn.report, name)
        homes = [m for m in ("data", "tokens", "figures", "figures_catalog", "figures_cells", "figures_compare",
                             "figures_pareto", "figures_tokens", "tables")
                 if getattr(importlib.import_module(f"kvarn.report.{m}"), name, None) is obj]
        assert homes, name
    with pytest.raises(AttributeError, match="kvarn.report' has no attribute 'nope'"):
        kvarn.report.nope  # noqa: B018


def test_the_workflow_side_of_the_report_imports_no_altair():
    """Every Snakefile parse imports kvarn.report.workflow (workflow/rules/report.smk): it must not
    pay for Altair and the figures, which only the figure jobs need."""
    code = ("import sys, kvarn.report.workflow\n"
            "print(sorted(m for m in ('altair', 'kvarn.report.figures') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_migrate_fills_what_an_old_summary_lacks():
    """A summary from before the columns existed: each is filled as that run had it (hand-worked);
    a summary that has them keeps its own values."""
    from kvarn.report.migrate import migrate_summary

    old = pl.DataFrame({"tail_requested": [0, 128], "kv_total_bytes": [1000, 1500],
                        "kv_total_bytes_tail0": [1000, 1000]})
    got = migrate_summary(old)
    assert got["kv_delta_bytes"].to_list() == [0, 500]
    assert got["tail_eff_full"].to_list() == [0, 128]
    assert got["memory_accounting"].to_list() == ["packed", "packed"]
    assert got["kv_staging_bytes"].to_list() == [0, 0]
    assert got["exact_share"].to_list() == [None, None] and got["exact_share"].dtype == pl.Float64
    renamed = migrate_summary(old.with_columns(pl.Series("kv_delta_bytes_vs_tail0", [7, 9])))
    assert renamed["kv_delta_bytes"].to_list() == [7, 9]  # the old name of the column, not recomputed
    new = got.with_columns(pl.Series("kv_delta_bytes", [1, 2]), pl.Series("tail_eff_full", [128, 128]),
                           pl.Series("memory_accounting", ["llama.cpp", "llama.cpp"]),
                           pl.Series("kv_staging_bytes", [3, 4]), pl.Series("exact_share", [0.5, 0.25]))
    assert migrate_summary(new).equals(new)


def test_a_per_layer_cell_is_its_own_series_and_never_the_standard_frontier(results):
    """A cell of an allocation (kvarn.perlayer) is drawn, labelled by its name, in a series of its own; the
    standard frontier and the floor stay the uniform cells' even where it is lower than all of them."""
    summary = results[1].filter(pl.col("model") == "smollm2-135m")
    row = summary.filter(pl.col("cell") == "q4_0-q4_0-t128")
    alloc = row.with_columns(pl.lit("q4_0-q4_0-t128-aedges.1234abcd").alias("cell"),
                             (pl.col("kld_median") / 1000).alias("kld_median"))
    prep = R.prepare(pl.concat([summary, alloc], how="diagonal_relaxed"), "smollm2-135m")
    mine = prep.filter(pl.col("alloc") == "edges.1234abcd")
    assert mine["series"].to_list() == [D.SERIES_PER_LAYER.format(family="standard")]
    assert mine["kld_median"][0] < prep.filter(pl.col("alloc").is_null())["kld_median"].min()
    assert D.pareto_frontier(prep)["frontier_kld"].min() > mine["kld_median"][0]
    assert D.standard_floor(prep)["cell"] != mine["cell"][0]
    spec = R.pareto(prep).to_dict()
    line = [u for u in units(spec) if mark(u) == "line"][0]
    assert min(r["frontier_kld"] for r in spec["datasets"][line["data"]["name"]]) > mine["kld_median"][0]
    assert "edges" in dataset_values(spec, "point_label")
