"""The per-model benchmark table (numbers as a DataFrame, then Markdown and HTML text).

Shaped like the study's table: K/V pair, tail (KVarN request 0 printed `128*`), KV cache
MiB with the Δ against the same pair at tail 0 in brackets (its header and the caption
name the memory accounting, kvarn.budget.memory), mean KLD ± standard error,
median, p99, p99.9, same-top % ±, tokens/s, and the exact share (how much of the row is
exactness rather than format: `kvarn.vocab.policy.exact_share`). The standard floor (the study's: the standard pair
with the lowest median KLD at tail 128, kvarn.report.data.standard_floor) is marked; rows whose median KLD is below the floor are highlighted (bold in
Markdown, class `below-floor` in HTML).
"""

from __future__ import annotations

import html

import polars as pl

from kvarn.report.data import accounting_of, prepare
from kvarn.vocab.cell import CellSpec

#: Columns of the numeric table (the parquet), in order.
TABLE_COLUMNS = [
    "model", "n_ctx", "chunks", "n_tokens", "family", "k_type", "v_type", "pair", "cell", "tail_requested",
    "tail_eff_full", "tail_label", "exact_share", "memory_accounting", "kv_mib", "delta_mib", "body_mib", "staging_mib",
    "overlay_mib", "kld_mean",
    "kld_mean_err", "kld_median", "kld_p99", "kld_p99_9", "same_top", "same_top_err", "tokens_per_s",
    "is_floor", "below_floor",
]
#: Columns joined from kvarn.report.paired_table.run_table when the paired statistics are given.
PAIRED_COLUMNS = ["kld_median_lo", "kld_median_hi", "band", "floor_delta", "floor_lo", "floor_hi", "sw_cell",
                  "sw_delta", "sw_lo", "sw_hi", "sw_significant"]

HEADERS = ["K/V pair", "tail", "exact %", "KV cache MiB (Δ)", "mean KLD ± err", "median KLD", "p99 KLD",
           "p99.9 KLD", "same top %", "tokens/s", "band", "note"]
MIB_HEADER = "KV cache MiB (Δ)"  # displayed with the accounting: `header(h, table)`
FLOOR_NOTE = "standard floor"
BELOW_NOTE = "below floor"


def build_table(summary: pl.DataFrame, model: str, paired: pl.DataFrame | None = None) -> pl.DataFrame:
    """The numeric table of one model: one row per cell, standard rows first, widest first.

    `paired`: kvarn.report.paired_table.run_table of the same run (results/paired/{model}.parquet); adds
    PAIRED_COLUMNS, joined by cell.
    """
    prep = prepare(summary, model)
    table = prep.select([c for c in TABLE_COLUMNS if c in prep.columns])
    if paired is not None:
        missing = sorted(set(table["cell"]) - set(paired["cell"]))
        if missing:
            raise ValueError(f"paired statistics lack cells {missing}; rebuild results/paired/{model}.parquet")
        table = table.join(paired.select(["cell", *PAIRED_COLUMNS]), on="cell", how="left", maintain_order="left")
    return table


def headers(table: pl.DataFrame) -> list[str]:
    """HEADERS, without `band` when the table has no paired statistics."""
    return [h for h in HEADERS if h != "band" or "band" in table.columns]


def band_text(r: dict) -> str:
    """The band column of one row: `floor` / `≈ floor`, then KVarN vs its same-width standard type."""
    parts = [r["band"]] if r.get("band") else []
    if r.get("sw_cell"):
        sign = "≈" if not r["sw_significant"] else "<" if r["sw_delta"] < 0 else ">"
        sw = CellSpec.from_name(r["sw_cell"])
        std = f"{sw.k}-{sw.v}{sw.opts}"  # the pair as the tables name it (kvarn.report.data.prepare's `pair`)
        parts.append(f"{sign} {std} (Δ {r['sw_delta']:+.2g} [{r['sw_lo']:+.2g}, {r['sw_hi']:+.2g}])")
    return "; ".join(parts)


def _fmt_kld(x: float | None) -> str:
    return "–" if x is None else f"{x:.6f}"


def _pm(x: float | None, err: float | None, scale: float = 1.0, digits: int = 6) -> str:
    """`x ± err` (a missing error prints the value alone; a missing value prints –)."""
    if x is None:
        return "–"
    return f"{scale * x:.{digits}f}" + ("" if err is None else f" ± {scale * err:.{digits}f}")


def format_rows(table: pl.DataFrame) -> list[dict]:
    """Each row as display strings keyed by HEADERS, plus the floor / below-floor flags."""
    out = []
    for r in table.iter_rows(named=True):
        mib = f"{r['kv_mib']:.2f}"
        if r["tail_requested"] != 0 and r["delta_mib"] is not None:  # a tail-0 row is its own reference
            mib += f" ({r['delta_mib']:+.2f})"
        st = _pm(r["same_top"], r.get("same_top_err"), scale=100, digits=3)
        note = FLOOR_NOTE if r["is_floor"] else BELOW_NOTE if r["below_floor"] else ""
        out.append({
            "K/V pair": r["pair"], "tail": r["tail_label"],
            "exact %": "–" if r.get("exact_share") is None else f"{100 * r['exact_share']:.1f}",
            "KV cache MiB (Δ)": mib,
            "mean KLD ± err": _pm(r["kld_mean"], r.get("kld_mean_err")),
            "median KLD": _fmt_kld(r["kld_median"]), "p99 KLD": _fmt_kld(r["kld_p99"]),
            "p99.9 KLD": _fmt_kld(r["kld_p99_9"]), "same top %": st,
            "tokens/s": "–" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}",
            "band": band_text(r), "note": note, "_floor": r["is_floor"], "_below": r["below_floor"],
        })
    return out


def header(h: str, table: pl.DataFrame) -> str:
    """The displayed column header: the MiB column names its memory accounting."""
    return f"KV cache MiB, {accounting_of(table)} (Δ)" if h == MIB_HEADER else h


def _caption(table: pl.DataFrame) -> str:
    r = table.row(0, named=True)
    return (f"{r['model']}: n_ctx {r['n_ctx']}, {r['chunks']} chunk{'s' if r['chunks'] != 1 else ''}, {r['n_tokens']} scored tokens per cell. "
            "Tail 128\\*: KVarN's request 0 (an effective 128-token tail, DESIGN §2). "
            "Exact %: the share of (scored query, key) pairs read from the exact copy (sink and tail), "
            "averaged over attention layers; the rest is read from the quantized body. "
            f"KV cache MiB under the `{accounting_of(table)}` memory accounting (body + staging + exact overlay, "
            "kvarn.budget.memory); Δ: MiB against the same pair at tail 0. "
            f"*{FLOOR_NOTE}*: the standard pair with the lowest median KLD at tail 128 (the study's floor; "
            "format-only rows are not standard pairs); "
            f"**bold** rows ({BELOW_NOTE}): median KLD lower than the standard floor. "
            + ("Band (paired 95 % block-bootstrap intervals, kvarn.stats.paired): *≈ floor* = median not "
               "distinguishable from the floor's; for KVarN, </≈/> its same-width qN_0 at tail 128, with "
               "Δ median [interval]." if "band" in table.columns else ""))


def to_markdown(table: pl.DataFrame) -> str:
    """GitHub Markdown: a caption paragraph, then the table; below-floor rows in bold."""
    rows = format_rows(table)
    cols = headers(table)
    right = {"exact %", "KV cache MiB (Δ)", "mean KLD ± err", "median KLD", "p99 KLD", "p99.9 KLD", "same top %", "tokens/s"}
    lines = [f"### {table['model'][0]}", "", _caption(table), "",
             "| " + " | ".join(header(h, table) for h in cols) + " |",
             "|" + "|".join("---:" if h in right else "---" for h in cols) + "|"]
    for r in rows:
        cells = [r[h].replace("*", "\\*") for h in cols]  # `128*` must not open emphasis
        if r["_below"]:
            cells = [f"**{c}**" if c else c for c in cells]
        elif r["_floor"]:
            cells[-1] = f"*{cells[-1]}*"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_CSS = """
table.kvarn { border-collapse: collapse; font: 13px system-ui, sans-serif; }
table.kvarn th, table.kvarn td { padding: 3px 8px; border-bottom: 1px solid #ddd; white-space: nowrap; }
table.kvarn td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.kvarn tr.kvarn td { background: #f6f9ff; }
table.kvarn tr.floor td { border-top: 2px solid #333; border-bottom: 2px solid #333; font-style: italic; }
table.kvarn tr.below-floor td { background: #dff3e4; font-weight: bold; }
"""


def to_html(table: pl.DataFrame, standalone: bool = True) -> str:
    """An HTML table; rows carry classes `standard`/`kvarn`, `floor`, `below-floor`."""
    rows = format_rows(table)
    cols = headers(table)
    num = {"exact %", "KV cache MiB (Δ)", "mean KLD ± err", "median KLD", "p99 KLD", "p99.9 KLD", "same top %", "tokens/s"}
    fams = table["family"].to_list()
    body = []
    for r, fam in zip(rows, fams):
        cls = [fam] + (["floor"] if r["_floor"] else []) + (["below-floor"] if r["_below"] else [])
        tds = "".join(f'<td class="num">{html.escape(r[h])}</td>' if h in num else f"<td>{html.escape(r[h])}</td>"
                      for h in cols)
        body.append(f'<tr class="{" ".join(cls)}">{tds}</tr>')
    cap = html.escape(_caption(table)).replace("*", "")
    tbl = (f'<table class="kvarn">\n<caption style="caption-side: bottom; text-align: left">{cap}</caption>\n'
           "<thead><tr>" + "".join(f"<th>{html.escape(header(h, table))}</th>" for h in cols)
           + "</tr></thead>\n<tbody>\n"
           + "\n".join(body) + "\n</tbody>\n</table>\n")
    if not standalone:
        return tbl
    title = html.escape(f"kvarn: {table['model'][0]}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<style>{_CSS}</style></head>\n<body>\n<h3>{title}</h3>\n{tbl}</body></html>\n")


SPLIT_HEADERS = ["K/V pair", "tail", "format median (exact)", "total median (llamacpp-cpu)", "kernel share",
                 "format mean", "total mean", "kernel share (mean)"]


def split_markdown(split: pl.DataFrame) -> str:
    """`kvarn.report.compare.compute_split` as Markdown: format damage beside llama.cpp's total."""
    if split.is_empty():
        return "(no cell was run in both compute paths)\n"
    lines = ["| " + " | ".join(SPLIT_HEADERS) + " |", "|---|---|" + "---:|" * (len(SPLIT_HEADERS) - 2)]
    for r in split.iter_rows(named=True):
        share = lambda x: "–" if x is None else f"{100 * x:.0f} %"  # noqa: E731
        lines.append(f"| {r['pair']} | {r['tail_requested']} | {_fmt_kld(r['exact_median'])} | "
                     f"{_fmt_kld(r['total_median'])} | {share(r['kernel_share_median'])} | "
                     f"{_fmt_kld(r['exact_mean'])} | {_fmt_kld(r['total_mean'])} | {share(r['kernel_share_mean'])} |")
    return "\n".join(lines) + "\n"
