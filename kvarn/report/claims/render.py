"""The ledger and the decision tables as text: Markdown (results/claims.md, the README's findings,
the glossary) and HTML (results/claims.html). How to read them: docs/notes/report.md."""

from __future__ import annotations

from typing import Mapping

import polars as pl

from kvarn.report.claims.decisions import (below_floor_table, cheapest_match_table, equal_memory_table, presets_table,
                                           row_mib, row_name)
from kvarn.report.claims.verdicts import Delta, is_study_claim, lacks_a_cell, no_delta, verdict_counts
from kvarn.report.data import FLOOR_TAIL, format_only_floor, standard_floor


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


def decisions_markdown(prep: pl.DataFrame, model: str, delta: Delta = no_delta) -> str:
    """The study's decision tables for one model, with the two floors named."""
    floor, fo = standard_floor(prep), format_only_floor(prep)
    head = [f"### {model}: decision tables", "",
            f"Standard floor (the study's: lowest median of the standard pairs at tail {FLOOR_TAIL}): "
            + (f"{row_name(floor)}, median {floor['kld_median']:.6g}, {row_mib(floor):.2f} MiB" if floor else "not measured") + ".",
            "Format-only floor (ours: standard types with KVarN's sink and F16 tail): "
            + (f"{row_name(fo)}, median {fo['kld_median']:.6g}, {row_mib(fo):.2f} MiB" if fo else "not measured") + ".",
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
