"""The answer a user came for: which KV-cache configuration for this model at this memory.

Per model (and engine) of a run: the frontier — each cell whose median KLD is below every
cheaper cell's — with its paired interval against the next-cheaper frontier row; **bands** of
frontier rows the paired test cannot tell from the band's cheapest row (never called better
than one another: take the cheapest); the cheapest cell within a tolerance; the study's three
presets by our rule (`kvarn.report.claims.decisions.presets_table`); and one line of what the run cannot
answer. `kvarn advise` prints it, rule `answer` writes results/answer.md. Why bands and these
defaults: docs/notes/advise.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import polars as pl

from kvarn.report import data as D
from kvarn.report.claims.decisions import PRESET_LEVELS, presets_table
from kvarn.report.claims.verdicts import paired_delta

#: The tolerance when the user gives none: median KLD at most this (nats) ...
DEFAULT_MAX_KLD = 0.001
#: ... and the quantized cache's top token the BF16 cache's on at least this fraction of tokens.
DEFAULT_MIN_SAME_TOP = 0.99

#: Columns of results/answer.parquet: per run, one row per frontier cell (role `frontier`), the pick
#: (role `pick`) and each preset (role `preset:NAME`), with the run's tolerance.
FRONTIER_COLUMNS = ["model", "engine", "n_ctx", "chunks", "n_tokens", "accounting", "role", "cell", "name", "band",
                    "kv_mib", "bits_per_value", "kld_median", "kld_mean", "kld_p99", "same_top", "ppl_ratio", "prev",
                    "delta", "delta_lo", "delta_hi", "separable", "max_kld", "min_same_top"]


ANSWER_SCHEMA = {"model": pl.String, "engine": pl.String, "n_ctx": pl.Int64, "chunks": pl.Int64, "n_tokens": pl.Int64,
                 "accounting": pl.String, "role": pl.String, "cell": pl.String, "name": pl.String, "band": pl.Int64,
                 "kv_mib": pl.Float64, "bits_per_value": pl.Float64, "kld_median": pl.Float64, "kld_mean": pl.Float64,
                 "kld_p99": pl.Float64, "same_top": pl.Float64, "ppl_ratio": pl.Float64, "prev": pl.String,
                 "delta": pl.Float64, "delta_lo": pl.Float64, "delta_hi": pl.Float64, "separable": pl.Boolean,
                 "max_kld": pl.Float64, "min_same_top": pl.Float64}


@dataclass(frozen=True)
class Tolerance:
    """What a user accepts: median KLD, same-top fraction, and a memory budget (MiB or bits per value)."""

    max_kld: float = DEFAULT_MAX_KLD
    min_same_top: float = DEFAULT_MIN_SAME_TOP
    budget_mib: float | None = None
    budget_bits: float | None = None

    def __post_init__(self):
        checks = {"max_kld": (lambda v: v > 0, "a KLD in nats > 0"),
                  "min_same_top": (lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
                  "budget_mib": (lambda v: v > 0, "MiB > 0"), "budget_bits": (lambda v: v > 0, "bits per value > 0")}
        for name, (accepted, what) in checks.items():
            v = getattr(self, name)
            if v is None and name.startswith("budget"):
                continue
            number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not number or not accepted(v):
                raise ValueError(f"{name} {v!r} is not accepted: give {what}")

    def describe(self) -> str:
        parts = [f"median KLD ≤ {self.max_kld:g}", f"same-top ≥ {100 * self.min_same_top:g} %"]
        if self.budget_mib is not None:
            parts.append(f"KV cache ≤ {self.budget_mib:g} MiB")
        if self.budget_bits is not None:
            parts.append(f"≤ {self.budget_bits:g} bits per value")
        return ", ".join(parts)


def name_of(r: dict) -> str:
    """A cell as the answer names it: `K-V tTAIL` (KVarN's own tail `128*`, options kept)."""
    return f"{r['pair']} t{r['tail_label']}"


def _with_engine(summary: pl.DataFrame) -> pl.DataFrame:
    """The summary with its `engine` column ("torch" where a torch-engine summary has none)."""
    if "engine" not in summary.columns:
        return summary.with_columns(pl.lit("torch").alias("engine"))
    return summary.with_columns(pl.col("engine").fill_null("torch"))


def runs(summary: pl.DataFrame) -> list[tuple[str, str]]:
    """The (model, engine) runs a summary holds: cells of two engines are never mixed in one answer."""
    if summary.is_empty():
        raise ValueError("the summary has no cells: run some first (`make run`, or snakemake with a config)")
    s = _with_engine(summary)
    return [tuple(r) for r in s.select(["model", "engine"]).unique(maintain_order=True).iter_rows()]


def prepared(summary: pl.DataFrame, model: str, engine: str = "torch") -> pl.DataFrame:
    """One (model, engine) run's cells as `kvarn.report.data.prepare` shapes them (its largest n_ctx,
    then chunks; format damage only), KVarN requests that repeat the 128* cell dropped."""
    s = _with_engine(summary)
    known = sorted(set(s["model"].to_list()))
    if model not in known:
        raise ValueError(f"model {model!r} has no cells in this run; models present: {', '.join(known)}")
    s = s.filter((pl.col("model") == model) & (pl.col("engine") == engine))
    if s.is_empty():
        raise ValueError(f"model {model!r} has no cells run by engine {engine!r}")
    return D.figure_rows(D.prepare(s, model)).sort(["kv_total_bytes", "kld_median"])


def frontier(prep: pl.DataFrame, cells: Mapping | None = None, n_boot: int = 2000, seed: int = 0) -> pl.DataFrame:
    """The frontier of one prepared run with bands.

    A cell is on the frontier if its median KLD is below that of every cell of fewer KV bytes
    (ties in bytes: the lower median). `delta`/`delta_lo`/`delta_hi`: the paired Δ median (this row
    − the next-cheaper frontier row, `prev`; negative: this row damages less). `band`: 1 for the
    cheapest row; a row opens a new band when its paired interval against the current band's
    cheapest row excludes 0 (`separable`), else it joins that band. Without tokens for a pair
    (`cells`: cell name -> kvarn.stats.paired.CellTokens), the rows are not compared: `separable`
    is null and the row opens a band of its own."""
    rows, best = [], math.inf
    for r in prep.iter_rows(named=True):
        if r["kld_median"] < best:
            rows.append(r)
            best = r["kld_median"]

    delta = paired_delta(cells, n_boot, seed)  # (Δ median, lo, hi), or Nones without both cells' tokens
    out, band, head = [], 0, None
    for i, r in enumerate(rows):
        prev = rows[i - 1] if i else None
        d = delta(prev, r) if prev else (None, None, None)
        if head is None:
            band, head, separable = 1, r, None
        else:
            _, lo, hi = d if head is prev else delta(head, r)
            separable = None if lo is None else not lo <= 0 <= hi
            if separable is not False:
                band, head = band + 1, r
        out.append({"cell": r["cell"], "name": name_of(r), "band": band, "kv_mib": r["kv_mib"],
                    "bits_per_value": r.get("bits_per_value"), "kld_median": r["kld_median"],
                    "kld_mean": r.get("kld_mean"), "kld_p99": r.get("kld_p99"), "same_top": r.get("same_top"),
                    "ppl_ratio": r.get("ppl_ratio"), "prev": name_of(prev) if prev else None,
                    "delta": d[0], "delta_lo": d[1], "delta_hi": d[2], "separable": separable})
    schema = {"cell": pl.String, "name": pl.String, "band": pl.Int64, "kv_mib": pl.Float64,
              "bits_per_value": pl.Float64, "kld_median": pl.Float64, "kld_mean": pl.Float64,
              "kld_p99": pl.Float64, "same_top": pl.Float64, "ppl_ratio": pl.Float64, "prev": pl.String,
              "delta": pl.Float64, "delta_lo": pl.Float64, "delta_hi": pl.Float64, "separable": pl.Boolean}
    return pl.DataFrame(out, schema=schema)


def pick(prep: pl.DataFrame, tol: Tolerance) -> dict | None:
    """The cheapest cell (fewest KV bytes; ties: the lower median) within `tol`, or None."""
    ok = prep.filter(pl.col("kld_median") <= tol.max_kld)
    if "same_top" in ok.columns:
        ok = ok.filter(pl.col("same_top") >= tol.min_same_top)
    if tol.budget_mib is not None:
        ok = ok.filter(pl.col("kv_mib") <= tol.budget_mib)
    if tol.budget_bits is not None:
        ok = ok.filter(pl.col("bits_per_value") <= tol.budget_bits)
    ok = ok.sort(["kv_total_bytes", "kld_median"])
    return ok.row(0, named=True) if ok.height else None


def check_budget(prep: pl.DataFrame, model: str, tol: Tolerance) -> None:
    """A budget below every cell of the run is refused, naming the cheapest cell."""
    cheapest = prep.sort("kv_total_bytes").row(0, named=True)
    if tol.budget_mib is not None and tol.budget_mib < cheapest["kv_mib"]:
        raise ValueError(f"budget {tol.budget_mib:g} MiB is below every cell of {model}: the cheapest, "
                         f"{name_of(cheapest)}, takes {cheapest['kv_mib']:.2f} MiB")
    bpv = cheapest.get("bits_per_value")
    if tol.budget_bits is not None:
        if bpv is None:
            raise ValueError(f"a budget in bits per value needs kv_bf16_bytes in the summary of {model}: "
                             "aggregate it again (snakemake results/summary.parquet --forcerun summary)")
        low = prep.sort("bits_per_value").row(0, named=True)
        if tol.budget_bits < low["bits_per_value"]:
            raise ValueError(f"budget {tol.budget_bits:g} bits per value is below every cell of {model}: the "
                             f"cheapest, {name_of(low)}, takes {low['bits_per_value']:.2f}")


@dataclass
class Answer:
    """One (model, engine) run's answer."""

    model: str
    engine: str
    n_ctx: int
    chunks: int
    n_tokens: int
    accounting: str
    frontier: pl.DataFrame
    cells: dict  # cell name -> its prepared row
    pick: dict | None
    pick_interval: dict | None
    presets: pl.DataFrame
    unanswered: list[str]
    tolerance: Tolerance


def answer(summary: pl.DataFrame, model: str, engine: str = "torch", tol: Tolerance = Tolerance(),
           cells: Mapping | None = None, n_boot: int = 2000, seed: int = 0) -> Answer:
    """The answer for one (model, engine) run of `summary` (see the module docstring)."""
    from kvarn.stats.paired import cell_interval

    prep = prepared(summary, model, engine)
    check_budget(prep, model, tol)
    front = frontier(prep, cells, n_boot, seed)
    chosen = pick(prep, tol)
    interval = cell_interval(cells[chosen["cell"]], n_boot, seed) if chosen and cells and chosen["cell"] in cells \
        else None
    first = prep.row(0, named=True)
    unanswered = []
    if prep.height == 1:
        unanswered.append("a frontier of one cell compares nothing: run more cells")
    elif cells is None or any(c not in cells for c in front["cell"].to_list()):
        unanswered.append("bands (the frontier rows' tokens.parquet were not all found)")
    have = set(prep.filter((pl.col("family") == "standard") & (pl.col("tail_requested") == D.FLOOR_TAIL)
                           & (pl.col("opts") == ""))["pair"].to_list())
    for name, w in PRESET_LEVELS:
        if f"q{w}_0-q{w}_0" not in have:
            unanswered.append(f"preset {name} (needs q{w}_0-q{w}_0 at tail {D.FLOOR_TAIL})")
    if chosen is None:
        unanswered.append(f"no cell is within {tol.describe()}: loosen the tolerance or run wider types")
    return Answer(model=model, engine=engine, n_ctx=int(first["n_ctx"]), chunks=int(first["chunks"]),
                  n_tokens=int(first.get("n_tokens") or 0), accounting=D.accounting_of(prep), frontier=front,
                  cells={r["cell"]: r for r in prep.iter_rows(named=True)},
                  pick=chosen, pick_interval=interval, presets=presets_table(prep), unanswered=unanswered,
                  tolerance=tol)


# ---------------------------------------------------------------- text


def _num(x, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}g}"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.2f}"


def _md(text: str) -> str:
    """A cell name in Markdown: KVarN's `128*` would start emphasis."""
    return text.replace("*", "\\*")


def _bits(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def pick_sentence(a: Answer) -> str:
    """The answer in one sentence (Markdown)."""
    tol = a.tolerance.describe()
    if a.pick is None:
        return f"**No cell of this run is within {tol}.**"
    p = a.pick
    sure = ""
    if a.pick_interval is not None:
        hi = a.pick_interval["kld_median_hi"]
        sure = (f"; its median's 95 % interval [{_num(a.pick_interval['kld_median_lo'])}, {_num(hi)}] "
                + ("stays within the tolerance" if hi <= a.tolerance.max_kld else "reaches past the tolerance"))
    band = a.frontier.filter(pl.col("cell") == p["cell"])
    where = f" (frontier band {band['band'][0]})" if band.height else " (not on the frontier: a cheaper cell damages less " \
                                                                      "but misses the same-top or budget bound)"
    return (f"**Pick: {_md(name_of(p))}** — {p['kv_mib']:.2f} MiB, {_bits(p.get('bits_per_value'))} bits per value, "
            f"median KLD {_num(p['kld_median'])}, same-top {_pct(p.get('same_top'))} %{where}: the cheapest cell "
            f"within {tol}{sure}.")


def frontier_markdown(front: pl.DataFrame) -> str:
    head = ("| band | cell | MiB | bits/value | median KLD | mean KLD | p99 KLD | same-top % | PPL ratio | "
            "Δ median vs the row above [95 % CI] |")
    lines = [head, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in front.iter_rows(named=True):
        if r["delta"] is None:
            d = "–" if r["prev"] is None else "not compared (no tokens)"
        else:
            d = f"{r['delta']:+.2g} [{r['delta_lo']:+.2g}, {r['delta_hi']:+.2g}]"
            d += "" if r["separable"] is not False else " — same band: not separable"
        ppl = "–" if r["ppl_ratio"] is None else f"{r['ppl_ratio']:.4f}"
        lines.append(f"| {r['band']} | {_md(r['name'])} | {r['kv_mib']:.2f} | "
                     f"{_bits(r['bits_per_value'])} | {_num(r['kld_median'])} | {_num(r['kld_mean'])} | "
                     f"{_num(r['kld_p99'])} | {_pct(r['same_top'])} | {ppl} | {d} |")
    return "\n".join(lines) + "\n"


def presets_line(a: Answer) -> str:
    if a.presets.is_empty():
        return "Presets (our rule): none answerable by this run."
    parts = [f"{r['preset']} **{_md(r['pair'] + ' t' + r['tail_label'])}** ({r['kv_mib']:.2f} MiB, median "
             f"{_num(r['kld_median'])})" for r in a.presets.iter_rows(named=True)]
    return ("Presets (the study's three, by our rule: the cheapest cell at or below the median of q8_0 / q5_0 / "
            "q4_0 at tail 128): " + "; ".join(parts) + ".")


def answer_markdown(a: Answer) -> str:
    """One run's answer as Markdown: the pick, the presets, the frontier with bands, what is unanswered."""
    title = f"## {a.model}" + (f" ({a.engine} engine)" if a.engine != "torch" else "")
    out = [title, "",
           f"n_ctx {a.n_ctx}, {a.chunks} chunk{'s' if a.chunks != 1 else ''} ({a.n_tokens} scored tokens); "
           f"MiB of one sequence's KV cache under the `{a.accounting}` accounting; bits per value: 16 × the "
           "cell's bytes / a BF16 cache's.", "", pick_sentence(a), "", presets_line(a), "",
           "Frontier: each row has a lower median KLD than every cheaper cell. Rows of one band are not separable "
           "from the band's cheapest row by the paired test (95 % block bootstrap), so none of them is better: "
           "take the band's cheapest.", "", frontier_markdown(a.frontier)]
    if a.unanswered:
        out += ["Not answered by this run: " + "; ".join(a.unanswered)
                + ". `make study` runs every cell the ledger and presets read.", ""]
    return "\n".join(out)


def answers_markdown(answers: list[Answer]) -> str:
    """results/answer.md: every run's answer, the tolerance said once."""
    tol = answers[0].tolerance if answers else Tolerance()
    head = ["# Which KV-cache configuration: the answer of this run", "",
            f"Tolerance: {tol.describe()} (`kvarn advise --max-kld --min-same-top --budget-mib --budget-bits`; "
            f"defaults median KLD ≤ {DEFAULT_MAX_KLD:g}, same-top ≥ {100 * DEFAULT_MIN_SAME_TOP:g} %). "
            "KLD: per-token KL divergence of the quantized cache's next-token distribution from the BF16 cache's, "
            "in nats; same-top: how often both caches rank the same token first; Δ: the later row minus the "
            "earlier, negative = less damage.", ""]
    return "\n".join(head + [answer_markdown(a) for a in answers])


def _cell_row(src: dict) -> dict:
    """A prepared row (the pick, a preset) shaped as a frontier row, without band or Δ."""
    return {"cell": src["cell"], "name": name_of(src), "band": None, "kv_mib": src["kv_mib"],
            "bits_per_value": src.get("bits_per_value"), "kld_median": src["kld_median"],
            "kld_mean": src.get("kld_mean"), "kld_p99": src.get("kld_p99"), "same_top": src.get("same_top"),
            "ppl_ratio": src.get("ppl_ratio"), "prev": None, "delta": None, "delta_lo": None, "delta_hi": None,
            "separable": None}


def frontier_frame(answers: list[Answer]) -> pl.DataFrame:
    """Every run's frontier, pick and presets, one frame (results/answer.parquet, FRONTIER_COLUMNS)."""
    frames = []
    for a in answers:
        rows = [{**r, "role": "frontier"} for r in a.frontier.iter_rows(named=True)]
        if a.pick is not None:
            band = a.frontier.filter(pl.col("cell") == a.pick["cell"])["band"]
            rows.append({**_cell_row(a.pick), "band": band[0] if band.len() else None, "role": "pick"})
        by_name = {name_of(r): r for r in a.cells.values()}
        for p in a.presets.iter_rows(named=True):
            rows.append({**_cell_row(by_name[f"{p['pair']} t{p['tail_label']}"]), "role": f"preset:{p['preset']}"})
        run = {"model": a.model, "engine": a.engine, "n_ctx": a.n_ctx, "chunks": a.chunks, "n_tokens": a.n_tokens,
               "accounting": a.accounting, "max_kld": a.tolerance.max_kld, "min_same_top": a.tolerance.min_same_top}
        frames.append(pl.DataFrame([{**run, **r} for r in rows], schema=ANSWER_SCHEMA).select(FRONTIER_COLUMNS))
    return pl.concat(frames)


# ---------------------------------------------------------------- a whole results folder


def token_dirs(summary: pl.DataFrame, root: str | Path) -> dict[tuple[str, str], Path]:
    """(model, cell) -> the cell directory under `root` (RUN_DIR/cells/CELL) of every row of each
    model's run (`kvarn.report.data.select_run`: its largest n_ctx, then chunks) whose tokens.parquet
    exists."""
    from kvarn.plan.paths import ALL_CHUNKS, RUN_DIR

    out = {}
    runs_ = pl.concat([D.select_run(summary, m) for m in summary["model"].unique(maintain_order=True)],
                      how="diagonal_relaxed")
    for r in runs_.select(["model", "n_ctx", "chunks", "cell"]).iter_rows(named=True):
        run = Path(root) / Path(RUN_DIR.format(model=r["model"], n_ctx=r["n_ctx"], chunks=r["chunks"])).relative_to(
            "results")
        found = [run / "cells" / r["cell"]] + sorted(run.parent.glob(f"ctx{r['n_ctx']}-c{ALL_CHUNKS}/cells/{r['cell']}"))
        for d in found:
            if (d / "tokens.parquet").is_file():
                out[(r["model"], r["cell"])] = d
                break
    return out


def advise(summary: pl.DataFrame, dirs: Mapping[tuple[str, str], Path] | None = None, models=None,
           tol: Tolerance = Tolerance(), n_boot: int = 2000, seed: int = 0) -> list[Answer]:
    """The answer of every (model, engine) run in `summary` (or of `models`), the paired statistics
    from the cell directories `dirs` ((model, cell) -> directory)."""
    from kvarn.stats.paired import load_cell

    todo = runs(summary)
    if models:
        present = sorted({m for m, _ in todo})
        unknown = [m for m in models if m not in present]
        if unknown:
            raise ValueError(f"model {unknown[0]!r} has no cells in this run; models present: {', '.join(present)}")
        todo = [(m, e) for m, e in todo if m in models]
    out = []
    for model, engine in todo:
        prep = prepared(summary, model, engine)
        rows = {r["cell"]: r for r in prep.iter_rows(named=True)}
        cells = {c: load_cell(dirs[(model, c)], summary=r) for c, r in rows.items() if dirs and (model, c) in dirs}
        out.append(answer(summary, model, engine, tol, cells or None, n_boot, seed))
    return out
