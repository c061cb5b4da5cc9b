"""What a reader of the report's tables and figures gets, read from hand-made inputs: a tail's label,
the floor flags, the decode frame's columns, and the Vega-Lite dict of the figures (layers, data,
encodings, tooltips, titles). Each test kills survivors of the report_data mutation run
(bench/mutation/results/report_data.md names which)."""

from __future__ import annotations

import json

import polars as pl

from kvarn.report import compare
from kvarn.report import data as D
from kvarn.report import figures, figures_compare, figures_generation, figures_pareto, figures_tokens
from kvarn.vocab import facts

MIB = 1 << 20


def summary(cells, model="m") -> pl.DataFrame:
    """Summary rows, the columns kvarn.report.data.prepare and the figures read: (K-V, tail, median KLD, MiB)."""
    rows = []
    for k_v, tail, median, mib in cells:
        k, v = k_v.split("-")
        total = round(mib * MIB)
        rows.append({
            "model": model, "n_ctx": 1024, "chunks": 1, "n_tokens": 1023, "k_type": k, "v_type": v, "tail": tail,
            "tail_eff_full": facts.pair_effective_tail(k, v, tail), "cell": f"{k}-{v}-t{tail}",
            "kld_median": median, "kld_mean": None if median is None else 2 * median,
            "kld_p99": None if median is None else 10 * median, "kv_total_bytes": total, "kv_body_bytes": total,
            "kv_overlay_bytes": 0, "kv_total_bytes_tail0": total, "memory_accounting": "packed", "same_top": 0.9,
        })
    return pl.DataFrame(rows, schema_overrides={"kld_median": pl.Float64, "kld_mean": pl.Float64,
                                                "kld_p99": pl.Float64}, infer_schema_length=None)


def layers(spec: dict, name: str) -> list[dict]:
    """The layers of a (concatenated) spec whose name starts with `name` (altair numbers repeated names)."""
    out = []
    for panel in spec.get("hconcat", [spec]):
        out += [u for u in panel.get("layer", []) if (u.get("name") or "").startswith(name)]
    return out


def rows_of(spec: dict, unit: dict) -> list[dict]:
    """The rows a unit draws: its inline values or the top-level dataset it names."""
    data = unit.get("data") or {}
    return data["values"] if "values" in data else spec["datasets"][data["name"]]


# ---------------------------------------------------------------- kvarn.report.data


def test_an_ecosystem_request_raised_by_its_format_prints_the_effective_tail_starred():
    # a QuantizedCache backend keeps a 128-token residual window whatever the request: 0 reads 128*
    assert D.tail_label("ecosystem", 0, 128) == "128*"
    assert D.series_of("ecosystem", 0, 128) == f"{D.SERIES_ECOSYSTEM}, tail 128*"
    assert D.tail_label("kvarn", 0, 128) == "128*"
    assert D.tail_label("ecosystem", 128, 128) == "128"  # as requested: no star
    assert D.tail_label("standard", 0, 128) == "0"  # a standard request prints as given


def test_a_cell_without_a_median_is_neither_the_floor_nor_below_it():
    # the floor is q8_0 t128 (0.02); kvarn6's median is missing (null): it is not below the floor
    p = D.prepare(summary([("q4_0-q4_0", 128, 0.10, 4.5), ("q8_0-q8_0", 128, 0.02, 8.5),
                           ("kvarn4-kvarn4", 0, 0.01, 4.6), ("kvarn6-kvarn6", 0, None, 6.6)]), "m")
    flags = {r["cell"]: (r["is_floor"], r["below_floor"]) for r in p.iter_rows(named=True)}
    assert flags == {"q4_0-q4_0-t128": (False, False), "q8_0-q8_0-t128": (True, False),
                     "kvarn4-kvarn4-t0": (False, True), "kvarn6-kvarn6-t0": (False, False)}


def _decode_summary(tmp_path, cell, k, v, tail, survival, kld_steps, fd_median, kld_mean):
    d = tmp_path / "results" / "m" / "decode-ctx64-p4-g3" / cell
    d.mkdir(parents=True)
    s = {"model": "m", "k_type": k, "v_type": v, "tail": tail, "n_prompts": 4, "n_tokens": 3, "survival": survival,
         "decode_kld_step_mean": kld_steps, "first_divergence_median": fd_median, "decode_kld_mean": kld_mean}
    (d / "summary.json").write_text(json.dumps(s))
    return d / "summary.json"


def decode_paths(tmp_path):
    return [
        _decode_summary(tmp_path, "q4_0-q4_0-t128", "q4_0", "q4_0", 128, [1.0, 1.0, 0.5, 0.25], [0.01, 0.02, 0.04], 2.0,
                        0.0233),
        _decode_summary(tmp_path, "kvarn4-kvarn4-t0", "kvarn4", "kvarn4", 0, [1.0, 1.0, 1.0, 0.75],
                        [0.005, 0.006, 0.01], 3.0, 0.007),
        _decode_summary(tmp_path, "kivi4-kivi4-t0", "kivi4", "kivi4", 0, [1.0, 0.5, 0.5, 0.5], [0.2, 0.3, 0.4], 1.5,
                        0.3),
    ]


def test_the_decode_frame_carries_each_cells_family_and_median_first_divergence(tmp_path):
    f = D.decode_frame(decode_paths(tmp_path))
    per_cell = f.group_by("cell").agg(pl.col("family", "label", "width", "first_divergence_median",
                                             "decode_kld_mean").first(), pl.len().alias("n"))
    got = {r["cell"]: (r["family"], r["label"], r["width"], r["first_divergence_median"], r["decode_kld_mean"], r["n"])
           for r in per_cell.iter_rows(named=True)}
    assert got == {"q4_0-q4_0-t128": ("standard", "q4_0-q4_0 t128", 4, 2.0, 0.0233, 4),
                   "kvarn4-kvarn4-t0": ("kvarn", "kvarn4-kvarn4 t128*", 4, 3.0, 0.007, 4),
                   "kivi4-kivi4-t0": ("ecosystem", "kivi4-kivi4 t128*", 4, 1.5, 0.3, 4)}
    kv = f.filter(pl.col("cell") == "kvarn4-kvarn4-t0").sort("step")
    assert kv["step"].to_list() == [0, 1, 2, 3] and kv["survival"].to_list() == [1.0, 1.0, 1.0, 0.75]
    assert kv["kld_step_mean"].to_list() == [0.005, 0.006, 0.01, None]  # no decode step at t = G


# ---------------------------------------------------------------- kvarn.report.figures


def test_the_pareto_text_labels_draw_the_cells_own_rows():
    p = D.prepare(summary([("q4_0-q4_0", 128, 0.10, 4.5), ("q8_0-q8_0", 128, 0.02, 8.5),
                           ("q4_0-q4_0", 0, 0.3, 4.4), ("kvarn4-kvarn4", 0, 0.03, 4.6)]), "m")
    spec = figures_pareto.pareto(p).to_dict()
    labels = layers(spec, "cell_labels")
    assert len(labels) == 2  # median and p99 panels
    for unit, y in zip(labels, ("kld_median", "kld_p99")):
        assert unit["encoding"]["text"]["field"] == "point_label" and unit["encoding"]["y"]["field"] == y
        drawn = {r["pair"]: r["point_label"] for r in rows_of(spec, unit)}
        # KVarN's cell is named beside its point; the standard cells carry an empty label
        assert drawn == {"kvarn4-kvarn4": "kvarn4-kvarn4", "q4_0-q4_0": "", "q8_0-q8_0": ""}
    (floor,) = layers(spec, "standard_floor_label")
    assert rows_of(spec, floor) == [{"floor_kld": 0.02, "floor_label": "standard floor: q8_0-q8_0 t128 (0.02)"}]


def test_tail_effect_without_a_tail_0_pair_says_why_in_words():
    p = D.prepare(summary([("q4_0-q4_0", 128, 0.10, 4.5), ("kvarn4-kvarn4", 0, 0.03, 4.6)]), "m")
    spec = figures_compare.tail_effect(p).to_dict()
    assert spec["data"]["values"] == [{"why": "no standard qN_0-qN_0 pair measured at tail 0 and a longer tail"}]
    assert spec["encoding"]["text"]["field"] == "why" and spec["title"]["text"] == "m: tail effect"


def test_the_decode_survival_panel_runs_over_the_steps_0_to_g_at_the_kld_panels_size(tmp_path):
    spec = figures_generation.decode(D.decode_frame(decode_paths(tmp_path))).to_dict()
    surv, kld = spec["hconcat"]
    assert surv["name"].startswith("survival") and kld["name"].startswith("kld_per_step")
    x = surv["encoding"]["x"]
    assert (x["field"], x["type"], x["title"], x["scale"]["domain"]) == ("step", "quantitative", "tokens generated",
                                                                        [0, 3])
    assert surv["encoding"]["y"]["field"] == "survival"
    # side by side, the two panels are one size
    assert (surv["width"], surv["height"]) == (kld["width"], kld["height"]) == (figures.WIDTH * 0.55, figures.HEIGHT)


def _generation_cells():
    return pl.DataFrame({
        "cell": ["q4_0-q4_0-t128", "kvarn4-kvarn4-t0"], "label": ["q4_0-q4_0 t128", "kvarn4-kvarn4 t128*"],
        "family": ["standard", "kvarn"], "width": [4, 4], "model": ["m", "m"], "n_ctx": [64, 64],
        "prompts": [4, 4], "tokens": [3, 3], "decoding": ["greedy", "greedy"],
        "slope_per_1k": [0.5, 0.1], "slope_lo_per_1k": [0.2, -0.1], "slope_hi_per_1k": [0.8, 0.3]})


def test_generation_survival_draws_the_band_and_the_survival_line():
    surv = pl.DataFrame({"cell": ["q4_0-q4_0-t128"] * 3 + ["kvarn4-kvarn4-t0"] * 3, "t": [0, 2, 3] * 2,
                         "survival": [1.0, 0.5, 0.5, 1.0, 1.0, 0.75], "lo": [1.0, 0.2, 0.2, 1.0, 1.0, 0.4],
                         "hi": [1.0, 0.8, 0.8, 1.0, 1.0, 0.9], "at_risk": [4, 4, 2, 4, 4, 4]})
    spec = figures_generation.generation_survival({"cells": _generation_cells(), "survival": surv}).to_dict()
    band, line = spec["layer"]
    assert band["mark"]["type"] == "area" and (band["encoding"]["y"]["field"], band["encoding"]["y2"]["field"]) == \
        ("lo", "hi")
    assert line["mark"]["type"] == "line" and line["encoding"]["y"]["field"] == "survival"
    assert line["encoding"]["strokeDash"]["field"] == "family"
    assert [t["field"] for t in line["encoding"]["tooltip"]] == ["label", "t", "survival", "lo", "hi", "at_risk"]
    drawn = {(r["label"], r["t"], r["survival"]) for r in spec["datasets"][spec["data"]["name"]]}
    assert ("kvarn4-kvarn4 t128*", 3, 0.75) in drawn and ("q4_0-q4_0 t128", 2, 0.5) in drawn


def test_the_slope_intervals_tooltip_shows_the_estimate_and_both_bounds():
    paired = pl.DataFrame({"kvarn_label": ["kvarn4-kvarn4 t128*"], "standard_label": ["q4_0-q4_0 t128"],
                           "diff_per_1k": [-0.4], "diff_lo_per_1k": [-0.7], "diff_hi_per_1k": [-0.1]})
    spec = figures_generation.generation_slopes({"cells": _generation_cells(), "paired": paired}).to_dict()
    left, right = spec["hconcat"]
    for panel, want in ((left, ["label", "slope_per_1k", "slope_lo_per_1k", "slope_hi_per_1k"]),
                        (right, ["pair", "diff_per_1k", "diff_lo_per_1k", "diff_hi_per_1k"])):
        (chart,) = [u for u in panel["layer"] if "layer" in u]  # the zero rule, then the interval chart
        rule, pts = chart["layer"]
        assert (rule["encoding"]["x"]["field"], rule["encoding"]["x2"]["field"]) == (want[2], want[3])
        assert [t["field"] for t in pts["encoding"]["tooltip"]] == want


def test_the_layer_error_subtitle_says_what_filled_and_open_mean():
    table = pl.DataFrame({"layer": [0, 1], "kind": ["full", "sliding"], "rel_err_kv": [0.02, 0.01],
                          "rel_err_k": [0.015, 0.008], "rel_err_v": [0.01, 0.004]})
    spec = figures_tokens.layer_error(table, "g q4_0").to_dict()
    assert spec["title"]["text"] == "g q4_0: attention error by layer"
    assert spec["title"]["subtitle"] == ("relative L2 error of each attention layer's output vs an fp32 cache on the "
                                         "same inputs, scored positions; filled: full attention, open: sliding window")
    # what the subtitle says is what is drawn: full layers filled, sliding ones white
    fill = spec["layer"][1]["encoding"]["fill"]
    assert fill["condition"]["test"] == "datum.kind == 'full'" and fill["value"] == "white"


# The four below kill mutants the first run counted killed by a timeout (a loaded machine), which the
# rerun, on a quieter one, found alive.


def test_the_same_width_bars_tooltip_shows_the_percent_change_it_draws():
    p = D.prepare(summary([("q4_0-q4_0", 128, 0.10, 4.5), ("kvarn4-kvarn4", 0, 0.08, 4.6)]), "m")
    spec = figures_compare.same_width(p).to_dict()
    (bars,) = layers(spec, "pct_change")
    assert bars["encoding"]["y"]["field"] == "pct"
    tips = {t["field"]: t.get("title") for t in bars["encoding"]["tooltip"]}
    assert tips == {"comparison": None, "statistic": None, "kvarn": "KVarN KLD", "standard": "standard KLD",
                    "pct": "% change"}
    drawn = {(r["statistic"], round(r["pct"], 6)) for r in rows_of(spec, bars)}
    assert drawn == {("median", -20.0), ("mean", -20.0)}  # kvarn4 0.08 vs q4_0 0.10: 20 % less


def test_the_tail_sweep_tooltip_shows_the_median_it_draws():
    p = D.prepare(summary([("q4_0-q4_0", 0, 0.30, 4.4), ("q4_0-q4_0", 128, 0.10, 4.5),
                           ("kvarn4-kvarn4", 0, 0.08, 4.6)]), "m")
    spec = figures_compare.tail_sweep(p).to_dict()
    (sweep,) = spec["layer"]
    assert sweep["encoding"]["y"]["field"] == "kld_median"
    assert [(t["field"], t.get("title")) for t in sweep["encoding"]["tooltip"]] == [
        ("pair", None), ("tail_label", "tail"), ("kld_median", "median KLD"), ("kld_mean", "mean KLD"),
        ("exact_share", "exact share")]


def test_the_position_figure_names_its_axes_and_its_width_legend():
    tokens = pl.DataFrame({"model": "m", "n_ctx": 64, "cell": ["q4_0-q4_0-t128"] * 4 + ["kvarn4-kvarn4-t0"] * 4,
                           "family": ["standard"] * 4 + ["kvarn"] * 4, "width": 4, "pos": [0, 1, 2, 3] * 2,
                           "kld": [0.1, 0.2, 0.3, 0.4, 0.01, 0.02, 0.03, 0.04]})
    spec = figures_tokens.position(tokens, n_bins=2).to_dict()
    enc = spec["encoding"] if "encoding" in spec else spec["layer"][0]["encoding"]
    assert enc["x"]["title"] == "position in the context (token)"
    assert (enc["y"]["field"], enc["y"]["title"]) == ("kld_mean", "mean KLD in the bin (log)")
    assert (enc["color"]["field"], enc["color"]["title"]) == ("width", "width (bits)")


def test_the_decode_figure_colours_by_width_titled_in_bits(tmp_path):
    spec = figures_generation.decode(D.decode_frame(decode_paths(tmp_path))).to_dict()
    for panel in spec["hconcat"]:
        color = panel["encoding"]["color"]
        assert (color["field"], color["title"], color["scale"]["domain"]) == ("width", "width (bits)", [4])


def test_same_width_adds_each_quantizedcache_backend_of_the_width_as_a_partner():
    # kvarn4 0.08 vs q4_0 t128 0.10 (-20 %), vs kivi4 and quanto4 at their 128-token window 0.16 and 0.04
    p = D.prepare(summary([("q4_0-q4_0", 128, 0.10, 4.5), ("kvarn4-kvarn4", 0, 0.08, 4.6),
                           ("kivi4-kivi4", 0, 0.16, 4.7), ("quanto4-quanto4", 0, 0.04, 4.8)]), "m")
    sw = compare.same_width(p)
    assert compare.same_width_backends(sw) == ["kivi", "quanto"]
    (r,) = sw.iter_rows(named=True)
    assert (r["width"], r["pair_kivi"], r["tail_label_kivi"], r["pair_quanto"]) == (4, "kivi4-kivi4", "128*",
                                                                                 "quanto4-quanto4")
    assert [round(r[c], 6) for c in ("pct_median", "pct_median_kivi", "pct_median_quanto")] == [-20.0, -50.0, 100.0]
