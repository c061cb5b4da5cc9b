"""One function per claim of the study, each its own definition on a prepared run
(`kvarn.report.data.prepare`), returning ledger rows; `CLAIMS` lists them in ledger order. The
definitions and signs: docs/notes/report.md ("The claims ledger")."""

from __future__ import annotations

import math

import polars as pl

from kvarn.report.claims.decisions import (PRESET_LEVELS, below_floor_table, cheapest_match_table, kvarn_row,
                                           presets_table, row_mib, row_name, std_row)
from kvarn.report.claims.study import cell_key, figure, figure_or_other
from kvarn.report.claims.verdicts import LEDGER_COLUMNS, VERDICTS, Delta, directional, no_delta
from kvarn.report.compare import tail_sweep, tail_vs_format
from kvarn.report.data import FLOOR_TAIL, format_only_floor, standard_floor

LADDER = (4, 5, 6, 8)
SWEEP_TAILS = (128, 512, 1024)


def same_width_gain_pct(kvarn_median: float, standard_median: float) -> float:
    """The study's same-width gain: (1 − median kvarnN at 128* / median qN_0 at tail 128) · 100;
    above 0, KVarN is below the same-width standard row."""
    return (1 - kvarn_median / standard_median) * 100


def tail_effect_pct(t128_median: float, t0_median: float) -> float:
    """The study's tail effect: (median qN_0 at tail 128 / at tail 0 − 1) · 100; below 0, the
    exact tail lowers the median."""
    return (t128_median / t0_median - 1) * 100


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


def same_width_gain(prep, model, sm, study, delta: Delta = no_delta) -> list[dict]:
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


def tail_effect(prep, model, sm, study, delta: Delta = no_delta) -> list[dict]:
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


def floor_claims(prep, model, sm, study, delta: Delta = no_delta) -> list[dict]:
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
                             ours_text=f"{floor['pair']} {floor['kld_median']:.6g} at {row_mib(floor):.2f} MiB",
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
                         ours=fo["kld_median"], ours_text=f"{row_name(fo)} {fo['kld_median']:.6g} at {row_mib(fo):.2f} MiB",
                         delta=d, delta_lo=lo, delta_hi=hi, delta_of=f"{row_name(fo)} − {row_name(floor)}",
                         verdict="not measurable") | {"missing": "study figure (none printed)"})
    return rows


def below_floor(prep, model, sm, study, delta: Delta = no_delta) -> list[dict]:
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
        saved_ours = row_mib(floor) - row_mib(kv)
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


def cheapest_match(prep, model, sm, study, delta: Delta = no_delta) -> list[dict]:
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


def exactness_vs_format(prep, model, sm, study, delta: Delta = no_delta) -> list[dict]:
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


def equal_memory(prep, model, sm, study, delta: Delta = no_delta) -> list[dict]:
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
        note = "; ".join(filter(None, [note, f"not equal memory here: {row_mib(a):.2f} vs {row_mib(s):.2f} MiB "
                                              f"({a['memory_accounting']})"]))
    note = "; ".join(filter(None, [note, whose]))
    return [_row(model, sm, "equal_memory", claim, study, "equal_memory", ours=ratio,
                 ours_text=f"{ratio:.2f}x ({a['kld_median']:.6g} vs {s['kld_median']:.6g})", delta=d, delta_lo=lo,
                 delta_hi=hi, verdict=verdict, **base) | {"note": note}]


def presets(prep, model, sm, study, delta: Delta = no_delta) -> list[dict]:
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


def ladder(prep, model, sm, study, delta: Delta = no_delta) -> list[dict]:
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


def q8_0_same_top(prep, model, sm, study, delta: Delta = no_delta) -> list[dict]:
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


def tail_sweep_trend(prep, model, sm, study, delta: Delta = no_delta) -> list[dict]:
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
