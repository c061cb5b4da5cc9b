"""The study's claims as a computed ledger, and its decision tables.

One function per claim, each implementing the study's own definition on a prepared run
(`kvarn.report.data.prepare`); `ledger` puts every row together. A row holds the claim in one
line, the study's figure and where it is printed (`config/study.yaml`, the one copy of the
study's numbers), our figure, the paired 95 % interval of Δ median where the claim is a
difference between two cells (`kvarn.stats.paired.compare`, B − A as named in `delta_of`), and a
verdict:

* `holds`          — our figure points the way the study's does (a difference: its interval,
                     when tokens were given, excludes 0 on that side);
* `does not hold`  — it points the other way (a difference: its interval excludes 0 on the other side);
* `not separable`  — a difference whose paired interval holds 0: this run cannot tell the two cells
                     apart, whichever way the point estimate points;
* `not measurable` — a cell the claim needs is not in this run (`missing` names it), or the
                     study's figure is not in config/study.yaml (our figure is still printed).

Signs, one convention: a gain is printed as the study prints it, (1 − KVarN / standard) · 100,
positive when KVarN damages less; a tail effect as the % change of the median from tail 0 to 128,
negative when the tail lowers it; every Δ median is the second-named cell minus the first, negative
when the second damages less. `figure_of` names the study model whose figure grades a row.

Definitions (the study's, unless a row's `origin` is `ours`):
* standard floor: the lowest median among the standard pairs at tail 128 (default options;
  the format-only rows — a standard type with KVarN's sink and F16 tail — are not standard
  pairs; their own floor is a separate row, `format_only_floor`, ours);
* same-width gain: (1 − median kvarnN at 128* / median qN_0-qN_0 at tail 128) · 100;
* tail effect: (median qN_0 at tail 128 / at tail 0 − 1) · 100;
* exactness vs format: (q4_0 median at tail 0 − at tail 128) / (q4_0 at 128 − kvarn4 at 128*);
  ours beside it: `kvarn.report.data.tail_vs_format`, the |Δln| averages over the tail sweep;
* below the floor: KVarN rows whose median is below the floor's, MiB saved = floor − row;
* cheapest standard match: per KVarN row at 128*, the cheapest standard pair at tail 128 whose
  median is at most the KVarN row's; MiB saved = that row − the KVarN row (the study's 104.00 is
  q5_0-q4_0 t128 against kvarn4: 1288 − 1184);
* equal memory: rows of one family with the same KV bytes and different K/V splits; the claim
  compares the asymmetric pair's median with the symmetric one's (ratio);
* presets (our rule, stated): for each reference q8_0, q5_0, q4_0 (symmetric, tail 128), the
  cheapest row at the matched tail whose median is at most the reference's;
* ladder: median steps q4_0 → q5_0 → q6_0 → q8_0 (symmetric, tail 128);
* tail-sweep trend: the same-width gain at the effective tails both families measured; it
  widens if the gain at the longest tail exceeds the gain at 128.

Prefill speed is not a row: the cells' tokens/s come from separate jobs under whatever else the
machine ran, so their ratio is not a measurement (bench/perf/engine.py times cells side by side).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Mapping

import polars as pl

from kvarn.report.data import (FLOOR_TAIL, figure_rows, format_only_floor, standard_floor, tail_sweep,
                               tail_vs_format)

STUDY_FILE = Path(__file__).resolve().parents[2] / "config" / "study.yaml"
DEFAULT_STUDY_MODEL = "qwen3.6-27b"
VERDICTS = ("holds", "does not hold", "not separable", "not measurable")
LADDER = (4, 5, 6, 8)
PRESET_LEVELS = (("quality", 8), ("balanced", 5), ("compact", 4))
SWEEP_TAILS = (128, 512, 1024)

#: Columns of results/claims.parquet, in order.
LEDGER_COLUMNS = ["model", "study_model", "claim_id", "claim", "origin", "section", "quoted", "study", "study_text",
                  "figure_of", "ours", "ours_text", "delta", "delta_lo", "delta_hi", "delta_of", "verdict", "missing",
                  "note"]


# ---------------------------------------------------------------- the study's figures


def load_study(path: str | Path | None = None) -> dict:
    """config/study.yaml (or `path`), checked: models, stand-ins and figures sections present."""
    import yaml

    p = Path(path) if path is not None else STUDY_FILE
    study = yaml.safe_load(p.read_text())
    for key in ("models", "figures"):
        if not isinstance(study, dict) or not isinstance(study.get(key), dict):
            raise ValueError(f"{p}: the study file needs a mapping {key!r}; see config/study.yaml")
    return study


def study_model_of(model: str, study: dict, override: Mapping[str, str] | None = None) -> str:
    """The study model a run's model is read against: the override (the config's
    `report: {study_model: ...}`), the model itself if the study measured it, its stand-in
    (config/study.yaml), else DEFAULT_STUDY_MODEL."""
    chosen = (override or {}).get(model) or (model if model in study["models"] else None) \
        or (study.get("stand_ins") or {}).get(model) or DEFAULT_STUDY_MODEL
    if chosen not in study["models"]:
        raise ValueError(f"study model {chosen!r} (for {model!r}) is not one of the study's models: "
                         f"{sorted(study['models'])}")
    return chosen


def figure(study: dict, claim: str, study_model: str):
    """The study's figure(s) of one claim for one study model, or None."""
    return (study["figures"].get(claim) or {}).get(study_model)


def figure_or_other(study: dict, claim: str, study_model: str) -> tuple[object, str, str | None]:
    """The study's figure of a claim for `study_model`, else another study model's (the claim's
    definition does not depend on the model), with a note naming whose figure it is and that model."""
    fig = figure(study, claim, study_model)
    if fig is not None:
        return fig, "", study_model
    for other in study["models"]:
        if (fig := figure(study, claim, other)) is not None:
            return fig, f"the study printed this figure for {other} only", other
    return None, "", None


def cell_key(pair: str, tail: int) -> str:
    """How config/study.yaml names a cell: `K-V tTAIL` (KVarN at 128*: its request, t0)."""
    return f"{pair} t{tail}"


# ---------------------------------------------------------------- rows of a prepared run


def _plain(prep: pl.DataFrame) -> pl.DataFrame:
    """Rows with the default options (what the study ran), KVarN duplicates of 128* dropped."""
    return figure_rows(prep).filter(pl.col("opts") == "")


def matched(prep: pl.DataFrame) -> pl.DataFrame:
    """The study's rows at its matched tail: standard pairs at tail 128 and KVarN at 128*
    (default options). The decision tables read these, as the study's did."""
    return _plain(prep).filter(((pl.col("family") == "standard") & (pl.col("tail_requested") == FLOOR_TAIL))
                               | ((pl.col("family") == "kvarn") & (pl.col("tail_eff_full") == FLOOR_TAIL)))


def std_row(prep: pl.DataFrame, pair: str, tail: int) -> dict | None:
    """A standard row of default options at a requested tail."""
    r = prep.filter((pl.col("family") == "standard") & (pl.col("opts") == "") & (pl.col("pair") == pair)
                    & (pl.col("tail_requested") == tail))
    return r.row(0, named=True) if r.height else None


def kvarn_row(prep: pl.DataFrame, pair: str, tail_eff: int = 128) -> dict | None:
    """A KVarN row of default options at an effective tail (128: the request-0 cell, 128*)."""
    r = _plain(prep).filter((pl.col("family") == "kvarn") & (pl.col("pair") == pair)
                            & (pl.col("tail_eff_full") == tail_eff)).sort("tail_requested")
    return r.row(0, named=True) if r.height else None


def _mib(r: dict) -> float:
    return r["kv_total_bytes"] / float(1 << 20)


def _name(r: dict) -> str:
    return f"{r['pair']} t{r['tail_label']}"


# ---------------------------------------------------------------- paired intervals


Delta = Callable[[dict, dict], tuple]


def paired_delta(cells: Mapping | None, n_boot: int, seed: int) -> Delta:
    """(a, b) -> (Δ median = b − a, lo, hi) from `kvarn.stats.paired.compare` over the two cells'
    tokens (`cells`: cell name -> kvarn.stats.paired.CellTokens); (None, None, None) without them."""
    from kvarn.stats.paired import compare

    def delta(a: dict, b: dict):
        if not cells or a["cell"] not in cells or b["cell"] not in cells:
            return None, None, None
        s = compare(cells[a["cell"]], cells[b["cell"]], n_boot=n_boot, seed=seed)["stats"]["kld_median"]
        return s["delta"], s["lo"], s["hi"]

    return delta


def _no_delta(a, b):
    return None, None, None


def same_width_gain_pct(kvarn_median: float, standard_median: float) -> float:
    """The study's same-width gain: (1 − median kvarnN at 128* / median qN_0 at tail 128) · 100;
    above 0, KVarN is below the same-width standard row."""
    return (1 - kvarn_median / standard_median) * 100


def tail_effect_pct(t128_median: float, t0_median: float) -> float:
    """The study's tail effect: (median qN_0 at tail 128 / at tail 0 − 1) · 100; below 0, the
    exact tail lowers the median."""
    return (t128_median / t0_median - 1) * 100


def directional(sign_ok: bool, lo, hi, want: int) -> tuple[str, str]:
    """Verdict of a difference that should have sign `want` (−1: B below A): its interval when there
    is one (holding 0: not separable, whichever way the point estimate points), then `sign_ok`."""
    if lo is None:
        return ("holds" if sign_ok else "does not hold"), ""
    if lo <= 0 <= hi:
        return "not separable", "the paired interval of the difference holds 0"
    return ("holds" if sign_ok and (hi < 0 if want < 0 else lo > 0) else "does not hold"), ""


def _row(model, study_model, claim_id, claim, study_file, section_of, origin="study", **kw) -> dict:
    sec = study_file["figures"].get(section_of) or {}
    row = dict.fromkeys(LEDGER_COLUMNS)
    row.update(model=model, study_model=study_model, claim_id=claim_id, claim=claim, origin=origin,
               section=sec.get("section"), quoted=sec.get("quoted"), missing="", note="", **kw)
    if row["figure_of"] is None and row["study_text"]:
        row["figure_of"] = study_model
    if row["verdict"] not in VERDICTS:
        raise AssertionError(f"verdict {row['verdict']!r} of {claim_id} is not one of {VERDICTS}")
    return row


def _missing(**cells) -> list[str]:
    return [name for name, r in cells.items() if r is None]


# ---------------------------------------------------------------- the claims


def same_width_gain(prep, model, sm, study, delta: Delta = _no_delta) -> list[dict]:
    """Per width the study printed: KVarN's gain on the median against qN_0 at tail 128, and its sign.
    The study's gain is its printed % where it has one, else computed from its printed medians."""
    pct = figure(study, "same_width_gain", sm) or {}
    med = figure(study, "median", sm) or {}
    widths = sorted({int(w) for w in pct} | {w for w in range(2, 9)
                                             if cell_key(f"kvarn{w}-kvarn{w}", 0) in med
                                             and cell_key(f"q{w}_0-q{w}_0", 128) in med})
    rows = []
    for w in widths:
        if w in pct or str(w) in pct:
            s = float(pct.get(w, pct.get(str(w))))
        else:
            s = same_width_gain_pct(med[cell_key(f"kvarn{w}-kvarn{w}", 0)], med[cell_key(f"q{w}_0-q{w}_0", 128)])
        std, kv = std_row(prep, f"q{w}_0-q{w}_0", 128), kvarn_row(prep, f"kvarn{w}-kvarn{w}")
        claim = f"{w} bits: kvarn{w} at 128* {'beats' if s > 0 else 'loses to'} q{w}_0 at tail 128 on the median"
        base = dict(study=s, study_text=f"{s:+.1f} %", delta_of=f"kvarn{w} 128* − q{w}_0 t128")
        missing = _missing(**{f"q{w}_0-q{w}_0 t128": std, f"kvarn{w}-kvarn{w} t128*": kv})
        if missing:
            rows.append(_row(model, sm, f"same_width_gain_{w}", claim, study, "same_width_gain", verdict="not measurable",
                             **base) | {"missing": ", ".join(missing)})
            continue
        ours = same_width_gain_pct(kv["kld_median"], std["kld_median"])
        d, lo, hi = delta(std, kv)
        verdict, note = directional((ours > 0) == (s > 0), lo, hi, -1 if s > 0 else +1)
        r = _row(model, sm, f"same_width_gain_{w}", claim, study, "same_width_gain", ours=ours,
                 ours_text=f"{ours:+.1f} % ({kv['kld_median']:.6g} vs {std['kld_median']:.6g})",
                 delta=d, delta_lo=lo, delta_hi=hi, verdict=verdict, **base)
        r["note"] = note
        rows.append(r)
    return rows


def tail_effect(prep, model, sm, study, delta: Delta = _no_delta) -> list[dict]:
    """Per width the study printed: the % change of qN_0's median from tail 0 to tail 128."""
    fig, whose, of = figure_or_other(study, "tail_effect", sm)
    fig = fig or {}
    rows = []
    for w in sorted(int(k) for k in fig):
        s = float(fig.get(w, fig.get(str(w))))
        t0, t128 = std_row(prep, f"q{w}_0-q{w}_0", 0), std_row(prep, f"q{w}_0-q{w}_0", 128)
        claim = f"{w} bits: an exact 128-token tail lowers q{w}_0's median (tail 0 → 128)"
        base = dict(study=s, study_text=f"{s:+.1f} %", delta_of=f"q{w}_0 t128 − q{w}_0 t0", figure_of=of)
        missing = _missing(**{f"q{w}_0-q{w}_0 t0": t0, f"q{w}_0-q{w}_0 t128": t128})
        if missing:
            rows.append(_row(model, sm, f"tail_effect_{w}", claim, study, "tail_effect", verdict="not measurable", **base)
                        | {"missing": ", ".join(missing)})
            continue
        ours = tail_effect_pct(t128["kld_median"], t0["kld_median"])
        d, lo, hi = delta(t0, t128)
        verdict, note = directional(ours < 0, lo, hi, -1)
        rows.append(_row(model, sm, f"tail_effect_{w}", claim, study, "tail_effect", ours=ours,
                         ours_text=f"{ours:+.1f} %", delta=d, delta_lo=lo, delta_hi=hi, verdict=verdict, **base)
                    | {"note": "; ".join(filter(None, [note, whose]))})
    if len(fig) >= 2:  # the study's ordering: the tail helps the narrowest width more than the widest
        lo_w, hi_w = min(int(k) for k in fig), max(int(k) for k in fig)
        by = {r["claim_id"]: r for r in rows}
        a, b = by[f"tail_effect_{lo_w}"], by[f"tail_effect_{hi_w}"]
        claim = f"the tail helps {lo_w} bits more than {hi_w} bits (|change| of the median)"
        base = dict(study=abs(a["study"]) - abs(b["study"]),
                    study_text=f"{abs(a['study']):.1f} % vs {abs(b['study']):.1f} %", figure_of=of)
        if a["ours"] is None or b["ours"] is None:
            rows.append(_row(model, sm, "tail_effect_order", claim, study, "tail_effect", verdict="not measurable", **base)
                        | {"missing": ", ".join(filter(None, (a["missing"], b["missing"])))})
        else:
            ours = abs(a["ours"]) - abs(b["ours"])
            rows.append(_row(model, sm, "tail_effect_order", claim, study, "tail_effect", ours=ours,
                             ours_text=f"{abs(a['ours']):.1f} % vs {abs(b['ours']):.1f} %",
                             verdict="holds" if ours > 0 else "does not hold", **base))
    return rows


def floor_claims(prep, model, sm, study, delta: Delta = _no_delta) -> list[dict]:
    """The standard floor (the study's definition) and, as ours, the format-only floor beside it."""
    fig = figure(study, "standard_floor", sm)
    floor = standard_floor(prep)
    rows = []
    if fig is not None:
        med = (figure(study, "median", sm) or {}).get(cell_key(fig["pair"], FLOOR_TAIL))
        claim = f"the standard floor (lowest median of the standard pairs at tail {FLOOR_TAIL}) is {fig['pair']}"
        base = dict(study=med, study_text=f"{fig['pair']}" + (f" {med:.6g}" if med is not None else ""))
        if floor is None:
            rows.append(_row(model, sm, "standard_floor", claim, study, "standard_floor", verdict="not measurable",
                             **base) | {"missing": f"standard pairs at tail {FLOOR_TAIL}"})
        else:
            rows.append(_row(model, sm, "standard_floor", claim, study, "standard_floor", ours=floor["kld_median"],
                             ours_text=f"{floor['pair']} {floor['kld_median']:.6g} at {_mib(floor):.2f} MiB",
                             verdict="holds" if floor["pair"] == fig["pair"] else "does not hold", **base))
    fo = format_only_floor(prep)
    claim = "ours: the format-only floor (standard types with KVarN's sink and F16 tail) against the standard floor"
    if fo is None or floor is None:
        rows.append(_row(model, sm, "format_only_floor", claim, study, "standard_floor", origin="ours",
                         verdict="not measurable")
                    | {"missing": ", ".join(_missing(**{"a format-only row": fo, "the standard floor": floor}))})
    else:
        d, lo, hi = delta(floor, fo)
        rows.append(_row(model, sm, "format_only_floor", claim, study, "standard_floor", origin="ours",
                         ours=fo["kld_median"], ours_text=f"{_name(fo)} {fo['kld_median']:.6g} at {_mib(fo):.2f} MiB",
                         delta=d, delta_lo=lo, delta_hi=hi, delta_of=f"{_name(fo)} − {_name(floor)}",
                         verdict="not measurable") | {"missing": "study figure (none printed)"})
    return rows


def below_floor_table(prep: pl.DataFrame, delta: Delta = _no_delta) -> pl.DataFrame:
    """Decision table: every KVarN row at 128* (default options) whose median is below the standard floor,
    with the MiB it saves against the floor row and the paired Δ median (row − floor)."""
    floor = standard_floor(prep)
    cols = {"pair": pl.String, "tail_label": pl.String, "kld_median": pl.Float64, "kv_mib": pl.Float64,
            "floor_pair": pl.String, "floor_median": pl.Float64, "floor_mib": pl.Float64, "mib_saved": pl.Float64,
            "delta": pl.Float64, "delta_lo": pl.Float64, "delta_hi": pl.Float64}
    if floor is None:
        return pl.DataFrame(schema=cols)
    out = []
    for r in matched(prep).filter((pl.col("family") == "kvarn") & (pl.col("kld_median") < floor["kld_median"])).iter_rows(named=True):
        d, lo, hi = delta(floor, r)
        out.append({"pair": r["pair"], "tail_label": r["tail_label"], "kld_median": r["kld_median"], "kv_mib": _mib(r),
                    "floor_pair": floor["pair"], "floor_median": floor["kld_median"], "floor_mib": _mib(floor),
                    "mib_saved": _mib(floor) - _mib(r), "delta": d, "delta_lo": lo, "delta_hi": hi})
    return pl.DataFrame(out, schema=cols).sort("mib_saved", descending=True)


def below_floor(prep, model, sm, study, delta: Delta = _no_delta) -> list[dict]:
    """The study's below-floor rows: each printed row, our median against the floor and its MiB saved."""
    fig = figure(study, "below_floor", sm) or {}
    floor = standard_floor(prep)
    table = below_floor_table(prep, delta)
    rows = []
    for pair, saved in fig.items():
        claim = f"{pair} at 128* goes below the standard floor, saving MiB against the floor row"
        base = dict(study=float(saved), study_text=f"{float(saved):.2f} MiB saved", delta_of=f"{pair} 128* − floor")
        kv = kvarn_row(prep, pair)
        missing = _missing(**{f"{pair} t128*": kv, f"standard pairs at tail {FLOOR_TAIL}": floor})
        if missing:
            rows.append(_row(model, sm, f"below_floor_{pair}", claim, study, "below_floor", verdict="not measurable",
                             **base) | {"missing": ", ".join(missing)})
            continue
        hit = table.filter(pl.col("pair") == pair)
        saved_ours = _mib(floor) - _mib(kv)
        d, lo, hi = (hit["delta"][0], hit["delta_lo"][0], hit["delta_hi"][0]) if hit.height else delta(floor, kv)
        verdict, note = directional(hit.height > 0 and saved_ours > 0, lo, hi, -1)
        if not hit.height:
            note = f"median {kv['kld_median']:.6g} is not below the floor's {floor['kld_median']:.6g} ({floor['pair']})"
        elif saved_ours <= 0:
            note = "below the floor but not cheaper than it"
        rows.append(_row(model, sm, f"below_floor_{pair}", claim, study, "below_floor", ours=saved_ours,
                         ours_text=f"{saved_ours:.2f} MiB saved ({kv['kld_median']:.6g} vs {floor['pair']} "
                                   f"{floor['kld_median']:.6g})", delta=d, delta_lo=lo, delta_hi=hi,
                         verdict=verdict, **base) | {"note": note})
    return rows


def cheapest_match_table(prep: pl.DataFrame) -> pl.DataFrame:
    """Decision table: per KVarN row at 128*, the cheapest standard pair at tail 128 (the matched
    tail; default options) whose median is at most the KVarN row's, and the MiB the KVarN row
    saves against it (negative: it costs more). A KVarN row below every standard row has no match."""
    rows = matched(prep)
    std = rows.filter(pl.col("family") == "standard")
    out = []
    for r in rows.filter(pl.col("family") == "kvarn").sort("kv_total_bytes").iter_rows(named=True):
        m = std.filter(pl.col("kld_median") <= r["kld_median"]).sort(["kv_total_bytes", "kld_median"])
        match = m.row(0, named=True) if m.height else None
        out.append({"pair": r["pair"], "tail_label": r["tail_label"], "kld_median": r["kld_median"], "kv_mib": _mib(r),
                    "match": _name(match) if match else None, "match_median": match["kld_median"] if match else None,
                    "match_mib": _mib(match) if match else None,
                    "mib_saved": _mib(match) - _mib(r) if match else None})
    schema = {"pair": pl.String, "tail_label": pl.String, "kld_median": pl.Float64, "kv_mib": pl.Float64,
              "match": pl.String, "match_median": pl.Float64, "match_mib": pl.Float64, "mib_saved": pl.Float64}
    return pl.DataFrame(out, schema=schema)


def cheapest_match(prep, model, sm, study, delta: Delta = _no_delta) -> list[dict]:
    """How many KVarN rows save memory against their cheapest standard match (and the savings)."""
    fig = figure(study, "cheapest_match", sm)
    if fig is None:
        return []
    t = cheapest_match_table(prep)
    n_study = int(fig["rows_saving"])
    claim = ("KVarN rows save memory against the cheapest standard row of equal or lower median"
             if n_study else "no KVarN row saves memory against the cheapest standard row of equal or lower median")
    text = f"{n_study} rows" + (f", {float(fig['saved']):.2f} MiB" if fig.get("saved") is not None else "")
    base = dict(study=float(n_study), study_text=text)
    if t.is_empty() or t["match"].is_null().all():
        return [_row(model, sm, "cheapest_match", claim, study, "cheapest_match", verdict="not measurable", **base)
                | {"missing": "KVarN rows" if t.is_empty() else "a standard row at or below a KVarN median"}]
    saving = t.filter(pl.col("mib_saved") > 0)
    amounts = sorted({round(x, 2) for x in saving["mib_saved"].to_list()})
    ours_text = f"{saving.height} of {t.height} rows" + (f", {', '.join(f'{a:.2f}' for a in amounts)} MiB" if amounts else "")
    return [_row(model, sm, "cheapest_match", claim, study, "cheapest_match", ours=float(saving.height),
                 ours_text=ours_text, verdict="holds" if (saving.height > 0) == (n_study > 0) else "does not hold",
                 **base)]


def exactness_vs_format(prep, model, sm, study, delta: Delta = _no_delta) -> list[dict]:
    """The study's ratio (q4_0 t0 − q4_0 t128) / (q4_0 t128 − kvarn4 128*), and ours beside it."""
    fig, whose, of = figure_or_other(study, "exactness_vs_format", sm)
    rows = []
    t0, t128, kv = std_row(prep, "q4_0-q4_0", 0), std_row(prep, "q4_0-q4_0", 128), kvarn_row(prep, "kvarn4-kvarn4")
    if fig is not None:
        claim = "the exact tail moves q4_0's median more than the format does (the study's ratio > 1)"
        base = dict(study=float(fig["ratio"]), study_text=f"{fig['tail_change']:.6f} / {fig['format_change']:.6f} "
                                                          f"= {float(fig['ratio']):.1f}", figure_of=of)
        missing = _missing(**{"q4_0-q4_0 t0": t0, "q4_0-q4_0 t128": t128, "kvarn4-kvarn4 t128*": kv})
        if missing:
            rows.append(_row(model, sm, "exactness_vs_format", claim, study, "exactness_vs_format",
                             verdict="not measurable", **base) | {"missing": ", ".join(missing)})
        else:
            tail, fmt = t0["kld_median"] - t128["kld_median"], t128["kld_median"] - kv["kld_median"]
            ratio = tail / fmt if fmt else math.inf
            rows.append(_row(model, sm, "exactness_vs_format", claim, study, "exactness_vs_format", ours=ratio,
                             ours_text=f"{tail:.6f} / {fmt:.6f} = {ratio:.1f}",
                             verdict="holds" if ratio > 1 else "does not hold", **base) | {"note": whose})
    sweep = tail_vs_format(tail_sweep(prep), format_only=None)
    claim = "ours: the tail's mean |Δln median| over the sweep against the format's at equal tails"
    if sweep is None:
        rows.append(_row(model, sm, "exactness_vs_format_sweep", claim, study, "exactness_vs_format", origin="ours",
                         verdict="not measurable") | {"missing": "a tail sweep of q4_0-q4_0 and kvarn4-kvarn4"})
    else:
        rows.append(_row(model, sm, "exactness_vs_format_sweep", claim, study, "exactness_vs_format", origin="ours",
                         ours=sweep["ratio"], ours_text=f"{sweep['tail_response']:.2f} / {sweep['format_response']:.2f}"
                                                        f" = {sweep['ratio']:.1f}", verdict="not measurable")
                    | {"missing": "study figure (another statistic)"})
    return rows


def _median_ratio(higher, lower, higher_name: str, lower_name: str, delta: Delta) -> dict:
    """A claim that `higher`'s median exceeds `lower`'s: {"missing": names} when a row is
    absent, else the ratio, the paired Δ (higher − lower) with its interval and the verdict."""
    missing = _missing(**{lower_name: lower, higher_name: higher})
    if missing:
        return {"missing": ", ".join(missing)}
    ratio = higher["kld_median"] / lower["kld_median"]
    d, lo, hi = delta(lower, higher)
    verdict, note = directional(ratio > 1, lo, hi, +1)
    return {"ratio": ratio, "d": d, "lo": lo, "hi": hi, "verdict": verdict, "note": note}


def equal_memory_table(prep: pl.DataFrame) -> pl.DataFrame:
    """Decision table: rows at the matched tail (`matched`) of one family that share their KV
    bytes exactly but split them differently between K and V, best median first in each group."""
    rows = matched(prep)  # kv_mib as kvarn.report.data.prepare computes it
    groups = rows.group_by(["family", "kv_total_bytes"]).agg(pl.col("pair").n_unique().alias("n")).filter(pl.col("n") > 1)
    out = rows.join(groups.select(["family", "kv_total_bytes"]), on=["family", "kv_total_bytes"])
    out = out.with_columns((pl.col("k_type") == pl.col("v_type")).alias("symmetric"))
    return out.select(["family", "kv_mib", "pair", "tail_label", "symmetric", "k_bits", "v_bits", "kld_median"]) \
        .sort(["family", "kv_mib", "kld_median"])


def equal_memory(prep, model, sm, study, delta: Delta = _no_delta) -> list[dict]:
    """The study's asymmetric-vs-symmetric pair at equal memory: median ratio asym / sym."""
    fig, whose, of = figure_or_other(study, "equal_memory", sm)
    if fig is None:
        return []
    a_pair, s_pair = fig["asymmetric"], fig["symmetric"]
    claim = f"at equal memory {a_pair} has a higher median than {s_pair} (ratio asymmetric / symmetric)"
    base = dict(study=float(fig["ratio"]), study_text=f"about {float(fig['ratio']):g}x at {float(fig['mib']):.2f} MiB",
                delta_of=f"{a_pair} − {s_pair}", figure_of=of)
    a, s = kvarn_row(prep, a_pair), kvarn_row(prep, s_pair)
    got = _median_ratio(a, s, f"{a_pair} t128*", f"{s_pair} t128*", delta)
    if "missing" in got:
        return [_row(model, sm, "equal_memory", claim, study, "equal_memory", verdict="not measurable", **base) | got]
    ratio, d, lo, hi, verdict, note = (got[c] for c in ("ratio", "d", "lo", "hi", "verdict", "note"))
    if a["kv_total_bytes"] != s["kv_total_bytes"]:
        note = "; ".join(filter(None, [note, f"not equal memory here: {_mib(a):.2f} vs {_mib(s):.2f} MiB "
                                              f"({a['memory_accounting']})"]))
    note = "; ".join(filter(None, [note, whose]))
    return [_row(model, sm, "equal_memory", claim, study, "equal_memory", ours=ratio,
                 ours_text=f"{ratio:.2f}x ({a['kld_median']:.6g} vs {s['kld_median']:.6g})", delta=d, delta_lo=lo,
                 delta_hi=hi, verdict=verdict, **base) | {"note": note}]


def presets_table(prep: pl.DataFrame) -> pl.DataFrame:
    """Decision table, our stated rule: for each reference qN_0-qN_0 at tail 128 (quality q8_0,
    balanced q5_0, compact q4_0), the cheapest row at the matched tail (`matched`: standard at
    128, KVarN at 128*) whose median is at most the reference's. No reference, no preset."""
    rows = matched(prep)
    out = []
    for name, w in PRESET_LEVELS:
        ref = std_row(prep, f"q{w}_0-q{w}_0", FLOOR_TAIL)
        if ref is None:
            continue
        m = rows.filter(pl.col("kld_median") <= ref["kld_median"]).sort(["kv_total_bytes", "kld_median"]).row(0, named=True)
        out.append({"preset": name, "reference": _name(ref), "reference_median": ref["kld_median"],
                    "reference_mib": _mib(ref), "pair": m["pair"], "tail_label": m["tail_label"], "family": m["family"],
                    "kld_median": m["kld_median"], "kv_mib": _mib(m), "mib_saved": _mib(ref) - _mib(m)})
    schema = {"preset": pl.String, "reference": pl.String, "reference_median": pl.Float64, "reference_mib": pl.Float64,
              "pair": pl.String, "tail_label": pl.String, "family": pl.String, "kld_median": pl.Float64,
              "kv_mib": pl.Float64, "mib_saved": pl.Float64}
    return pl.DataFrame(out, schema=schema)


def presets(prep, model, sm, study, delta: Delta = _no_delta) -> list[dict]:
    """The three presets by our rule (`presets_table`); the study's own are not in config/study.yaml."""
    t = presets_table(prep)
    rows = []
    for name, w in PRESET_LEVELS:
        claim = f"preset {name}: the cheapest row at or below q{w}_0-q{w}_0 t128's median (our rule)"
        hit = t.filter(pl.col("preset") == name)
        if not hit.height:
            rows.append(_row(model, sm, f"preset_{name}", claim, study, "presets", origin="ours",
                             verdict="not measurable") | {"missing": f"q{w}_0-q{w}_0 t{FLOOR_TAIL}"})
            continue
        r = hit.row(0, named=True)
        rows.append(_row(model, sm, f"preset_{name}", claim, study, "presets", origin="ours", ours=r["kv_mib"],
                         ours_text=f"{r['pair']} t{r['tail_label']} at {r['kv_mib']:.2f} MiB "
                                   f"({r['mib_saved']:+.2f} MiB against {r['reference']})",
                         verdict="not measurable") | {"missing": "study figure (presets not in config/study.yaml)"})
    return rows


def ladder(prep, model, sm, study, delta: Delta = _no_delta) -> list[dict]:
    """The standard ladder's median steps q4_0 → q5_0 → q6_0 → q8_0 (symmetric, tail 128)."""
    rows = []
    for lo_w, hi_w in zip(LADDER, LADDER[1:]):
        a, b = std_row(prep, f"q{lo_w}_0-q{lo_w}_0", FLOOR_TAIL), std_row(prep, f"q{hi_w}_0-q{hi_w}_0", FLOOR_TAIL)
        claim = f"ladder step q{lo_w}_0 → q{hi_w}_0 (tail {FLOOR_TAIL}): Δ median"
        missing = _missing(**{f"q{lo_w}_0-q{lo_w}_0 t{FLOOR_TAIL}": a, f"q{hi_w}_0-q{hi_w}_0 t{FLOOR_TAIL}": b})
        if missing:
            rows.append(_row(model, sm, f"ladder_{lo_w}_{hi_w}", claim, study, "ladder", verdict="not measurable")
                        | {"missing": ", ".join(missing)})
            continue
        d, dlo, dhi = delta(a, b)
        step = b["kld_median"] - a["kld_median"]
        rows.append(_row(model, sm, f"ladder_{lo_w}_{hi_w}", claim, study, "ladder", ours=step,
                         ours_text=f"{step:+.6g} ({a['kld_median']:.6g} → {b['kld_median']:.6g})", delta=d,
                         delta_lo=dlo, delta_hi=dhi, delta_of=f"q{hi_w}_0 − q{lo_w}_0", verdict="not measurable")
                    | {"missing": "study figure (not in config/study.yaml)"})
    return rows


def q8_0_same_top(prep, model, sm, study, delta: Delta = _no_delta) -> list[dict]:
    """q8_0-q8_0's same-top % at tail 128 (± its error)."""
    r = std_row(prep, "q8_0-q8_0", FLOOR_TAIL)
    claim = f"q8_0-q8_0 at tail {FLOOR_TAIL}: same-top %"
    if r is None or r.get("same_top") is None:
        return [_row(model, sm, "q8_0_same_top", claim, study, "q8_0_same_top", verdict="not measurable")
                | {"missing": f"q8_0-q8_0 t{FLOOR_TAIL}"}]
    err = r.get("same_top_err")
    return [_row(model, sm, "q8_0_same_top", claim, study, "q8_0_same_top", ours=100 * r["same_top"],
                 ours_text=f"{100 * r['same_top']:.3f}" + (f" ± {100 * err:.3f} %" if err is not None else " %"),
                 verdict="not measurable") | {"missing": "study figure (not in config/study.yaml)"}]


def tail_sweep_trend(prep, model, sm, study, delta: Delta = _no_delta) -> list[dict]:
    """Per width the study described: does KVarN's same-width gain widen or narrow from tail 128 to
    the longest tail both families measured (SWEEP_TAILS)?"""
    fig, whose, of = figure_or_other(study, "tail_sweep_trend", sm)
    fig = fig or {}
    rows = []
    for w in sorted(int(k) for k in fig):
        s = fig.get(w, fig.get(str(w)))
        claim = f"{w} bits: KVarN's gain over q{w}_0 {s} from tail 128 to the longest tail of the sweep"
        gains = {}
        for t in SWEEP_TAILS:
            std, kv = std_row(prep, f"q{w}_0-q{w}_0", t), kvarn_row(prep, f"kvarn{w}-kvarn{w}", t)
            if std is not None and kv is not None:
                gains[t] = same_width_gain_pct(kv["kld_median"], std["kld_median"])
        base = dict(study_text=s, figure_of=of)
        if FLOOR_TAIL not in gains or len(gains) < 2:
            need = [f"q{w}_0-q{w}_0 and kvarn{w}-kvarn{w} at tail {t}" for t in SWEEP_TAILS if t not in gains]
            rows.append(_row(model, sm, f"tail_sweep_trend_{w}", claim, study, "tail_sweep_trend",
                             verdict="not measurable", **base) | {"missing": "; ".join(need)})
            continue
        longest = max(gains)
        ours = "widens" if gains[longest] > gains[FLOOR_TAIL] else "narrows"
        rows.append(_row(model, sm, f"tail_sweep_trend_{w}", claim, study, "tail_sweep_trend",
                         ours=gains[longest] - gains[FLOOR_TAIL],
                         ours_text=f"{ours}: " + ", ".join(f"t{t} {g:+.1f} %" for t, g in sorted(gains.items())),
                         verdict="holds" if ours == s else "does not hold", **base) | {"note": whose})
    return rows


#: Every claim function, in ledger order.
CLAIMS = [exactness_vs_format, same_width_gain, tail_effect, floor_claims, below_floor, cheapest_match, ladder,
          equal_memory, presets, q8_0_same_top, tail_sweep_trend]


def ledger(prep: pl.DataFrame, model: str, study: dict | None = None, cells: Mapping | None = None,
           study_model: str | None = None, n_boot: int = 2000, seed: int = 0) -> pl.DataFrame:
    """Every claim's rows for one model's prepared run (LEDGER_COLUMNS). `cells`: cell name ->
    kvarn.stats.paired.CellTokens for the paired intervals (none: the interval columns stay empty)."""
    study = study if study is not None else load_study()
    sm = study_model or study_model_of(model, study)
    delta = paired_delta(cells, n_boot, seed) if cells else _no_delta
    rows = [r for f in CLAIMS for r in f(prep, model, sm, study, delta)]
    for r in rows:  # a misspelt field would be dropped below without a word
        if set(r) != set(LEDGER_COLUMNS):
            raise AssertionError(f"ledger row {r.get('claim_id')!r} has fields {sorted(set(r) ^ set(LEDGER_COLUMNS))} "
                                 f"outside or missing from LEDGER_COLUMNS")
    schema = {c: pl.String for c in LEDGER_COLUMNS} | {c: pl.Float64 for c in ("study", "ours", "delta", "delta_lo",
                                                                                 "delta_hi")}
    return pl.DataFrame([{c: r[c] for c in LEDGER_COLUMNS} for r in rows], schema=schema)


# ---------------------------------------------------------------- text


def _g(x) -> str:
    return "–" if x is None else f"{x:+.2g}"


def _cell(text: str) -> str:
    """A table cell's text as Markdown: a | would end the cell (escaped \\|), a * starts emphasis."""
    return text.replace("|", "\\|").replace("*", "\\*")


#: Every term the ledger, the answer and the README use, defined once (Markdown).
GLOSSARY = """\
* **KLD**: per token, the KL divergence of the quantized cache's next-token distribution from the
  BF16 cache's (nats), as `llama-perplexity --kl-divergence` computes it; **median / mean / p99**
  over the scored tokens. **Same-top**: the share of tokens where both caches rank the same token
  first. **PPL ratio**: the quantized cache's perplexity over the BF16 cache's.
* **Cell** `K-V tN`: K and V cache types with an exact (unquantized) tail of the last N tokens.
  **128\\***: KVarN's own exact tokens at tail request 0 (a 128-token tail and a 128-token sink on
  full-attention layers). **`-tdf16-s128`**: a standard type given KVarN's exact tokens (sink 128,
  F16 tail), so against KVarN at 128\\* only the quantizer differs (the *format-only* rows).
* **Standard floor**: the lowest median among the standard pairs at tail 128 (the study's);
  **format-only floor**: the lowest median among the format-only rows (ours).
* **MiB**: one sequence's KV cache under the run's memory accounting; **bits per value**: 16 × a
  cell's KV bytes / a BF16 cache's on the same geometry (comparable across models).
* **Signs**: a gain is (1 − KVarN / standard) · 100, positive when KVarN damages less; a tail
  effect is the % change of the median from tail 0 to 128, negative when the tail lowers it; a
  **Δ median** is the second-named cell minus the first, negative when the second damages less,
  with its paired 95 % block-bootstrap interval.
* **Verdicts**: *holds* (our figure points the study's way; a difference's interval excludes 0),
  *does not hold* (it points the other way), *not separable* (the interval holds 0: this run
  cannot tell the cells apart), *not measurable* (a cell is missing; named).
* **Frontier** (`kvarn advise`): each cell whose median is below every cheaper cell's; **band**:
  frontier rows the paired test cannot separate from the band's cheapest row, none better than
  another.
"""


def has_study_figure() -> pl.Expr:
    """Ledger rows for which the study printed a figure (config/study.yaml): those a reader can check."""
    return pl.col("study_text").fill_null("") != ""


def lacks_a_cell() -> pl.Expr:
    """Ledger rows "not measurable" because the run lacks a cell they read (not for want of a study figure)."""
    return (pl.col("verdict") == "not measurable") & ~pl.col("missing").fill_null("").str.starts_with("study figure")


def is_study_claim() -> pl.Expr:
    """The study's claims: rows of origin `study` whose figure the study printed."""
    return (pl.col("origin") == "study") & has_study_figure()


def verdict_counts(table: pl.DataFrame, model: str) -> dict[str, int]:
    """Per verdict, how many of a model's study claims (`is_study_claim`) have it."""
    rows = table.filter((pl.col("model") == model) & is_study_claim())
    return {v: rows.filter(pl.col("verdict") == v).height for v in VERDICTS}


def conclusion_markdown(table: pl.DataFrame) -> str:
    """One generated sentence per model: how many of the study's claims hold, do not hold, cannot be
    separated, or lack a cell in this run."""
    out = []
    for m in table["model"].unique(maintain_order=True).to_list():
        c = verdict_counts(table, m)
        n = sum(c.values())
        sm = table.filter(pl.col("model") == m)["study_model"][0]
        rest = [f"{c['does not hold']} {'does' if c['does not hold'] == 1 else 'do'} not"]
        if c["not separable"]:
            rest.append(f"{c['not separable']} {'is' if c['not separable'] == 1 else 'are'} not separable")
        if c["not measurable"]:
            rest.append(f"{c['not measurable']} lack a cell of this run")
        out.append(f"On **{m}** (read against the study's {sm}), {c['holds']} of the {n} claims the study printed "
                   f"a figure for **hold**, " + ", ".join(rest) + ".")
    return " ".join(out) + "\n"


def _ci(r: dict) -> str:
    return "–" if r["delta"] is None else f"{_g(r['delta'])} [{_g(r['delta_lo'])}, {_g(r['delta_hi'])}]"


def _study_text(r: dict) -> str:
    """The study's figure, naming the study model whose it is when that is not the row's own."""
    whose = f" ({r['figure_of']})" if r["figure_of"] and r["figure_of"] != r["study_model"] else ""
    return (r["study_text"] or "–") + whose


def _lacking_line(rows: pl.DataFrame) -> str:
    """One line naming the claims this run lacks a cell for, and what runs them."""
    if rows.is_empty():
        return ""
    names = [c.removeprefix("ours: ") for c in rows["claim"].unique(maintain_order=True).to_list()]
    return (f"This run lacks a cell for {len(names)} more claim{'s' if len(names) != 1 else ''} (`make study` runs "
            "every cell the ledger reads): " + "; ".join(_cell(n) for n in names) + ".\n")


def ledger_markdown(table: pl.DataFrame) -> str:
    """The ledger as Markdown: the study's claims per model (rows this run answers; one line for the
    rest), then our own statistics, then the glossary."""
    out = ["# The study's claims, computed", "",
           "The study's claims, each computed by the study's own definition (kvarn/report/claims.py) on this run's "
           "cells and graded against the study's printed figure (config/study.yaml); then, separately, our own "
           "statistics. Terms and signs: the glossary at the end.", "",
           conclusion_markdown(table) if table.height else ""]
    models = table["model"].unique(maintain_order=True).to_list()
    out += ["## The study's claims", ""]
    for model in models:
        t = table.filter((pl.col("model") == model) & is_study_claim())
        shown = t.filter(~lacks_a_cell())
        out += [f"### {model} (read against the study's {table.filter(pl.col('model') == model)['study_model'][0]})",
                "", "| claim | study | ours | Δ median [95 % CI] | verdict |", "|---|---|---|---|---|"]
        for r in shown.iter_rows(named=True):
            ci = _ci(r) + (f" ({r['delta_of']})" if r["delta"] is not None else "")
            verdict = f"**{r['verdict']}**" + (f" — {r['note']}" if r["note"] else "")
            out.append("| " + " | ".join(_cell(x) for x in [r["claim"], _study_text(r), r["ours_text"] or "–", ci])
                       + " | " + _cell(verdict).replace("\\*\\*", "**") + " |")
        out += ["", _lacking_line(t.filter(lacks_a_cell()))]
    out += ["## Our statistics", "",
            "Not the study's claims (it printed no figure for them): our reading of the same cells.", ""]
    for model in models:
        t = table.filter((pl.col("model") == model) & ~is_study_claim())
        shown = t.filter(pl.col("ours_text").fill_null("") != "")
        out += [f"### {model}", "", "| statistic | ours | Δ median [95 % CI] |", "|---|---|---|"]
        for r in shown.iter_rows(named=True):
            ci = _ci(r) + (f" ({r['delta_of']})" if r["delta"] is not None else "")
            out.append("| " + " | ".join(_cell(x) for x in [r["claim"].removeprefix("ours: "), r["ours_text"], ci])
                       + " |")
        rest = t.filter(pl.col("ours_text").fill_null("") == "")
        out += ["", _lacking_line(rest)]
    out += ["## Glossary", "", GLOSSARY]
    return "\n".join(out)


def findings_markdown(table: pl.DataFrame) -> str:
    """The study's claims side by side for the README: the generated conclusion (`conclusion_markdown`),
    then one line per claim sentence this run answers for at least one model, per model its verdict,
    ours, the study's figure (naming whose, when not the column's study model) and the paired
    interval; then one line naming the claims no model has a cell for. A claim whose sentence differs
    between models (its direction follows each study model's figure) gets a line per sentence."""
    t = table.filter(is_study_claim())
    models = table["model"].unique(maintain_order=True).to_list()
    head = ["claim"] + [f"{m} (study: {table.filter(pl.col('model') == m)['study_model'][0]})" for m in models]
    out = [conclusion_markdown(table), "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    answered = t.filter(~lacks_a_cell())["claim"].unique().to_list()
    for cid, claim in t.select(["claim_id", "claim"]).unique(maintain_order=True).iter_rows():
        if claim not in answered:
            continue
        rows = {r["model"]: r for r in t.filter((pl.col("claim_id") == cid) & (pl.col("claim") == claim))
                .iter_rows(named=True)}
        cells = [_cell(claim)]
        for m in models:
            r = rows.get(m)
            if r is None:
                cells.append("–")
                continue
            if r["verdict"] == "not measurable":
                cells.append(f"**not measurable** (missing: {_cell(r['missing'])})")
                continue
            ci = "" if r["delta"] is None else f"; Δ median {_ci(r)}"
            cells.append(f"**{r['verdict']}**: ours {_cell(r['ours_text'] or '–')}; "
                         f"study {_cell(_study_text(r))}{ci}")
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    lacking = t.filter(lacks_a_cell() & ~pl.col("claim").is_in(answered))
    if lacking.height:
        out.append(_lacking_line(lacking).rstrip("\n"))
    return "\n".join(out).rstrip("\n") + "\n"


def table_markdown(df: pl.DataFrame, title: str, empty: str) -> str:
    """A decision table as Markdown (floats to 6 significant digits, MiB to 2 decimals)."""
    if df.is_empty():
        return f"**{title}**: {empty}\n"
    def fmt(c, v):
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.2f}" if "mib" in c else f"{v:.6g}"
        return str(v).replace("*", "\\*")
    lines = [f"**{title}**", "", "| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(c, v) for c, v in zip(df.columns, row)) + " |" for row in df.iter_rows()]
    return "\n".join(lines) + "\n"


def decisions_markdown(prep: pl.DataFrame, model: str, delta: Delta = _no_delta) -> str:
    """The study's decision tables for one model, with the two floors named."""
    floor, fo = standard_floor(prep), format_only_floor(prep)
    head = [f"### {model}: decision tables", "",
            f"Standard floor (the study's: lowest median of the standard pairs at tail {FLOOR_TAIL}): "
            + (f"{_name(floor)}, median {floor['kld_median']:.6g}, {_mib(floor):.2f} MiB" if floor else "not measured") + ".",
            "Format-only floor (ours: standard types with KVarN's sink and F16 tail): "
            + (f"{_name(fo)}, median {fo['kld_median']:.6g}, {_mib(fo):.2f} MiB" if fo else "not measured") + ".",
            f"MiB under the `{prep['memory_accounting'][0]}` accounting; rows at the matched tail (standard 128, "
            "KVarN 128*).", "", ""]
    parts = [
        table_markdown(below_floor_table(prep, delta), "KVarN rows below the standard floor (MiB saved against it)",
                       "none"),
        table_markdown(cheapest_match_table(prep), "Cheapest standard match per KVarN row (MiB saved; negative: costs more)",
                       "no KVarN rows"),
        table_markdown(equal_memory_table(prep), "Equal-memory K/V splits (same KV bytes, different split)", "none"),
        table_markdown(presets_table(prep), "Presets (our rule: cheapest row at or below q8_0 / q5_0 / q4_0 at tail 128)",
                       "no reference row measured"),
    ]
    return "\n".join(head) + "\n".join(parts)


# ---------------------------------------------------------------- a whole run (the `claims` rule)


def run_claims(summary: pl.DataFrame, token_paths=(), study: dict | None = None,
               study_models: Mapping[str, str] | None = None, n_boot: int = 2000, seed: int = 0):
    """The ledger of every model of a run and each model's decision tables (Markdown).

    `token_paths`: the tokens.parquet of the cells each model's tables show (the paired
    intervals are computed for the cells found among them). Returns (ledger, {model: md})."""
    from kvarn.stats.paired import load_cell
    from kvarn.report.data import prepare

    study = study if study is not None else load_study()
    by_name: dict[tuple[str, str], Path] = {}
    for p in token_paths:
        d = Path(p).parent
        by_name[(d.parent.parent.parent.name, d.name)] = d  # results/{model}/ctx.../cells/{cell}
    ledgers, decisions = [], {}
    for model in summary["model"].unique(maintain_order=True).to_list():
        prep = prepare(summary, model)
        cells = {r["cell"]: load_cell(by_name[(model, r["cell"])], summary=r)
                 for r in prep.iter_rows(named=True) if (model, r["cell"]) in by_name}
        sm = study_model_of(model, study, study_models)
        ledgers.append(ledger(prep, model, study, cells, sm, n_boot, seed))
        decisions[model] = decisions_markdown(prep, model, paired_delta(cells, n_boot, seed) if cells else _no_delta)
    return pl.concat(ledgers), decisions


def claims_markdown(table: pl.DataFrame, decisions: Mapping[str, str]) -> str:
    """results/claims.md: the ledger, then every model's decision tables."""
    return ledger_markdown(table) + "\n## Decision tables\n\n" + "\n".join(decisions.values())


def _html_table(df: pl.DataFrame) -> str:
    import html

    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    body = "\n".join("<tr>" + "".join(f"<td>{html.escape('–' if v is None else str(v))}</td>" for v in row) + "</tr>"
                     for row in df.iter_rows())
    return f'<table class="kvarn">\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody>\n</table>\n'


def claims_html(table: pl.DataFrame, decisions: Mapping[str, str]) -> str:
    """results/claims.html (the report's first page): the ledger per model, the decision tables
    as preformatted Markdown."""
    import html

    parts = ["<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>kvarn: the study's claims</title>"
             "<style>table.kvarn{border-collapse:collapse;font:13px system-ui,sans-serif}"
             "table.kvarn td,table.kvarn th{padding:3px 8px;border-bottom:1px solid #ddd;vertical-align:top}"
             "</style></head><body>", "<h2>The study's claims, computed</h2>",
             "<p>Study figures: config/study.yaml; definitions: kvarn/report/claims.py; verdicts: holds / does "
             "not hold / not measurable. Δ median: paired 95 % block-bootstrap interval (kvarn.stats.paired).</p>"]
    for model in table["model"].unique(maintain_order=True).to_list():
        t = table.filter(pl.col("model") == model)
        shown = t.select(
            "claim", pl.col("study_text").alias("study"), pl.col("section").alias("where"),
            pl.col("ours_text").alias("ours"),
            pl.when(pl.col("delta").is_not_null()).then(pl.format(
                "{} [{}, {}] ({})", pl.col("delta").round_sig_figs(2), pl.col("delta_lo").round_sig_figs(2),
                pl.col("delta_hi").round_sig_figs(2), pl.col("delta_of"))).alias("Δ median [95 % CI]"),
            pl.concat_str([pl.col(c).replace("", None) for c in ("verdict", "missing", "note")], separator=" — ",
                          ignore_nulls=True).alias("verdict"))
        parts += [f"<h3>{html.escape(model)} (read against the study's {html.escape(t['study_model'][0])})</h3>",
                  _html_table(shown)]
    parts += ["<h2>Decision tables</h2>"] + [f"<pre>{html.escape(md)}</pre>" for md in decisions.values()]
    return "\n".join(parts + ["</body></html>\n"])
