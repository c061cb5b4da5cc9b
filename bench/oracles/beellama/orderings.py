"""The study's orderings on the grid, per program (issue 21 item 3).

Two orderings, each computed by the study's own definition (`kvarn.report.claims`) from every
program's figures of the same rows, BeeLlama, kvarn `exact` and kvarn `llamacpp-cpu`:

* **KVarN below the same-width standard row at matched tail**: per width N with rows `kvarnN-t0`
  (KVarN's 128\\* tail) and `qN_0-t128`, the same-width gain `claims.same_width_gain_pct` on the
  median (the study's; above 0 KVarN is below) and, ours beside it, on the mean;
* **tail 0 → 128 gains shrinking with width**: per width N with `qN_0-t0` and `qN_0-t128` of one
  rotation (BeeLlama v0.4.3 aborts on rotated standard rows at tail 0 on CPU, so the unrotated
  pair `qN_0-t0-norot`, `qN_0-t128-norot` stands in, named), the tail effect
  `claims.tail_effect_pct`; it shrinks with width when |effect| falls strictly from each width to
  the next wider one (the study's own check, `tail_effect_order`, compares only the narrowest
  with the widest; both are shown).

An ordering is *reproduced by both programs* when BeeLlama's verdict and kvarn `llamacpp-cpu`'s
agree and hold, *shown not to hold in either* when they agree and do not hold; otherwise the
programs disagree. A pair with a missing row is named, not guessed; a pair whose two rows both sit
within FLOOR_BAND of the program's bf16-cache row is flagged as at the floor.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.oracles.beellama.table import md_lines
from bench.oracles.llamacpp.runs import parse_llama
from kvarn.report.claims.definitions import same_width_gain_pct, tail_effect_pct

PROGRAMS = ("BeeLlama", "exact", "llamacpp-cpu")  # the last two: kvarn's compute paths
JUDGE = ("BeeLlama", "llamacpp-cpu")  # the two whose verdicts must agree (the target column)
FLOOR_ROW = "bf16-t0"
# Both rows of a pair within this of the program's own bf16-cache row (the floor) are read as at
# the floor: BeeLlama's bf16-t0 median moved by 1.8 % and its mean by 3.1 % between two CPUs
# (results/beellama.md, round 8), so an ordering inside that band is the floor's noise.
FLOOR_BAND = 0.05
WIDTHS = (2, 3, 4, 5, 6, 8)
KEYS = ("kld_median", "kld_mean")


def collect(run: Path, names: list[str]) -> dict[str, dict[str, dict]]:
    """{row: {program: {kld_median, kld_mean}}} of the rows whose runs completed in `run`."""
    out: dict[str, dict[str, dict]] = {}
    for name in names:
        d = run / name
        figs = {}
        bee = parse_llama(d / "beellama.log") if (d / "beellama.log").is_file() else None
        if bee and all(bee.get(k) is not None for k in KEYS):
            figs["BeeLlama"] = {k: bee[k] for k in KEYS}
        for mode in PROGRAMS[1:]:
            f = d / mode / "summary.json"
            if f.is_file():
                s = json.loads(f.read_text())
                figs[mode] = {k: s[k] for k in KEYS}
        if figs:
            out[name] = figs
    return out


def _agree(verdicts: dict[str, bool | None]) -> str:
    a, b = (verdicts.get(p) for p in JUDGE)
    if a is None or b is None:
        return "not measurable (" + ", ".join(p for p in JUDGE if verdicts.get(p) is None) + " missing)"
    if a != b:
        return "the programs disagree"
    return "reproduced by both programs" if a else "shown not to hold in either"


def same_width(stats: dict[str, dict[str, dict]]) -> tuple[list[list[str]], list[str]]:
    """Table rows (width, program, KVarN and standard medians, gain % on the median and the mean,
    below?) and one verdict line per width."""
    rows, lines = [], []
    for w in WIDTHS:
        kv, std = f"kvarn{w}-t0", f"q{w}_0-t128"
        if kv not in stats and std not in stats:
            continue
        missing = [n for n in (kv, std) if n not in stats]
        verdicts: dict[str, bool | None] = {}
        at_floor = []
        for p in PROGRAMS:
            a, b = stats.get(kv, {}).get(p), stats.get(std, {}).get(p)
            if a is None or b is None:
                verdicts[p] = None
                continue
            gain = same_width_gain_pct(a["kld_median"], b["kld_median"])
            gain_mean = same_width_gain_pct(a["kld_mean"], b["kld_mean"])
            verdicts[p] = gain > 0
            floor = stats.get(FLOOR_ROW, {}).get(p)
            if floor and floor["kld_median"] > 0 and all(abs(x["kld_median"] / floor["kld_median"] - 1) <= FLOOR_BAND
                                                       for x in (a, b)):
                at_floor.append(p)
            rows.append([str(w), p, f"{a['kld_median']:.6f}", f"{b['kld_median']:.6f}", f"{gain:+.1f}",
                         f"{gain_mean:+.1f}", "yes" if gain > 0 else "no"])
        what = _agree(verdicts) if not missing else "not measurable (" + ", ".join(missing) + " not run)"
        if at_floor:
            what += (f"; both rows within {FLOOR_BAND:.0%} of the {FLOOR_ROW} row's median in "
                     + ", ".join(at_floor) + ": at the floor, the ordering is inside its noise")
        lines.append(f"* {w} bits, {kv} below {std} on the median: {what}")
    return rows, lines


def tail_effect(stats: dict[str, dict[str, dict]]) -> tuple[list[list[str]], list[str]]:
    """Table rows (rotation, width, program, t0 and t128 medians, effect %) and the verdict lines:
    per rotation, |effect| strictly falling with width, and narrowest vs widest."""
    rows, lines = [], []
    for suffix, rot in (("", "rotated"), ("-norot", "unrotated")):
        effects: dict[str, dict[int, float]] = {p: {} for p in PROGRAMS}
        for w in WIDTHS:
            t0, t128 = f"q{w}_0-t0{suffix}", f"q{w}_0-t128{suffix}"
            for p in PROGRAMS:
                a, b = stats.get(t0, {}).get(p), stats.get(t128, {}).get(p)
                if a is None or b is None:
                    continue
                effects[p][w] = e = tail_effect_pct(b["kld_median"], a["kld_median"])
                rows.append([rot, str(w), p, f"{a['kld_median']:.6f}", f"{b['kld_median']:.6f}", f"{e:+.1f}"])
        widths = sorted(set.intersection(*(set(effects[p]) for p in JUDGE)))
        if len(widths) < 2:
            if any(effects[p] for p in PROGRAMS):
                lines.append(f"* {rot}: not measurable (both programs need t0 and t128 rows at two widths or more; "
                             f"widths with both: {widths or 'none'})")
            continue
        shrink = {p: all(abs(effects[p][a]) > abs(effects[p][b]) for a, b in zip(widths, widths[1:])) for p in JUDGE}
        ends = {p: abs(effects[p][widths[0]]) > abs(effects[p][widths[-1]]) for p in JUDGE}
        ws = ", ".join(map(str, widths))
        lines.append(f"* {rot}, widths {ws}: |tail effect| falling from each width to the next: {_agree(shrink)}")
        lines.append(f"* {rot}: the tail helps {widths[0]} bits more than {widths[-1]} bits (the study's "
                     f"`tail_effect_order`): {_agree(ends)}")
    return rows, lines


def orderings_md(run: Path, names: list[str]) -> str:
    stats = collect(run, names)
    sw_rows, sw_lines = same_width(stats)
    te_rows, te_lines = tail_effect(stats)

    out = ["### The study's orderings, per program (bench/oracles/beellama/orderings.py)", "",
           "KVarN (128\\*) against the same-width standard row at tail 128; gain = (1 − KVarN / standard) · 100, "
           "the study's on the median, ours on the mean:", ""]
    if sw_rows:
        out += md_lines(["width", "program", "KVarN median", "standard median", "gain % (median)", "gain % (mean)",
                   "KVarN below"], sw_rows) + [""]
    out += sw_lines or ["* no width with a KVarN or standard tail-128 row"]
    out += ["", "Tail effect = (median at tail 128 / at tail 0 − 1) · 100:", ""]
    if te_rows:
        out += md_lines(["rotation", "width", "program", "median t0", "median t128", "effect %"], te_rows) + [""]
    out += te_lines or ["* no width with both tail rows"]
    return "\n".join(out) + "\n"
