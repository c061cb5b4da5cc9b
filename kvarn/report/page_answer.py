"""The page's first section, the answer (results/answer.md and .parquet, rule `answer`,
`kvarn.report.advise`): each run's frontier table marked and checked row by row against the
parquet, and after each pick its scoreboard. What the page shows: docs/notes/report.md."""

from __future__ import annotations

import html
import re

import polars as pl

from kvarn.report.page_markdown import markdown_parser, shift_headings, slug

PPL_MEANING = "the perplexity under the cell's cache over the perplexity under the BF16 cache; 1 = unchanged"


def answer_heading(model: str, engine: str) -> str:
    """A run's heading in results/answer.md (kvarn.report.advise.answer_markdown)."""
    return model + (f" ({engine} engine)" if engine != "torch" else "")


def answer_table_id(model: str, engine: str) -> str:
    """The HTML id of a run's answer table: `answer-MODEL` (`-ENGINE` for an engine other than torch)."""
    return "answer-" + slug(model + ("" if engine == "torch" else f"-{engine}"))


def _unescape(md_text: str) -> str:
    return re.sub(r"\\(.)", r"\1", md_text)


def _html_token(content: str):
    from markdown_it.token import Token

    t = Token("html_block", "", 0)
    t.content = content
    return t


def roles(answer: pl.DataFrame, role: str) -> pl.DataFrame:
    """answer.parquet's rows of one role (`frontier`, `pick`, `preset:NAME`; a role prefix ending in
    ":" takes every such role). A parquet without roles holds the frontier only."""
    if "role" not in answer.columns:
        return answer if role == "frontier" else answer.clear()
    col = pl.col("role")
    return answer.filter(col.str.starts_with(role) if role.endswith(":") else col == role)


def _ppl(x) -> str:
    return "–" if x is None else f"{x:.4f}"


def scoreboard(answer: pl.DataFrame, model: str, engine: str) -> str:
    """One run's pick and presets with their PPL ratios and medians (HTML, one paragraph)."""
    run = answer.filter((pl.col("model") == model) & (pl.col("engine") == engine))
    parts = [f"Pick <strong>{html.escape(r['name'])}</strong>: PPL ratio {_ppl(r['ppl_ratio'])}, median KLD "
             f"{r['kld_median']:.3g}, {r['kv_mib']:.2f} MiB." for r in roles(run, "pick").iter_rows(named=True)]
    presets = [f"{html.escape(r['role'].split(':', 1)[1])} {html.escape(r['name'])} {_ppl(r['ppl_ratio'])}"
               for r in roles(run, "preset:").iter_rows(named=True)]
    if presets:
        parts.append("PPL ratio of the presets: " + "; ".join(presets) + ".")
    if not parts:
        return ""
    return (f'<p class="scoreboard">{" ".join(parts)} (PPL ratio: {PPL_MEANING}; the frontier below gives it '
            "for every row.)</p>\n")


def answer_html(answer_md: str, answer: pl.DataFrame) -> str:
    """results/answer.md as HTML, each run's frontier table marked as the answer's: class `answer`,
    id `answer-MODEL` (`answer_table_id`), each row's `data-cell` and `data-band` from
    results/answer.parquet, checked against the Markdown row's cell name; after each run's pick
    sentence its `scoreboard` (the pick's and the presets' PPL ratios). A run of the parquet with
    no section in the Markdown, or rows that differ, is an error: both come from one `answer` job."""
    frontier = roles(answer, "frontier")
    runs = list(frontier.select("model", "engine").unique(maintain_order=True).iter_rows())
    by_heading = {answer_heading(m, e): (m, e) for m, e in runs}
    md = markdown_parser()
    tokens = md.parse(answer_md)
    out, run, seen, rows, row_i, in_body, in_answer = [], None, set(), [], 0, False, False
    i = 0
    while i < len(tokens):
        t = tokens[i]
        out.append(t)
        if t.type == "heading_open":
            text = tokens[i + 1].content
            run = by_heading.get(text) if t.tag == "h2" else run
            if t.tag == "h2" and run is None:
                raise ValueError(f"answer.md has a section {text!r} that answer.parquet lacks: run rule answer again")
        elif t.type == "table_open":
            in_answer = run is not None
            if in_answer:
                if run in seen:
                    raise ValueError(f"answer.md has two tables for {answer_heading(*run)}")
                seen.add(run)
                t.attrSet("class", "answer")
                t.attrSet("id", answer_table_id(*run))
                rows = frontier.filter((pl.col("model") == run[0]) & (pl.col("engine") == run[1])).to_dicts()
                row_i = 0
        elif t.type == "tbody_open":
            in_body = in_answer
        elif t.type == "tbody_close" and in_body:
            in_body = False
            if row_i != len(rows):
                raise ValueError(f"answer.md's frontier of {answer_heading(*run)} has {row_i} rows, answer.parquet "
                                 f"{len(rows)}: run rule answer again")
        elif t.type == "th_open" and in_answer and tokens[i + 1].content.startswith("PPL ratio"):
            t.attrSet("title", f"PPL ratio: {PPL_MEANING}")
        elif t.type == "tr_open" and in_body:
            if row_i >= len(rows):
                raise ValueError(f"answer.md's frontier of {answer_heading(*run)} has more rows than answer.parquet")
            r = rows[row_i]
            end = next(j for j in range(i, len(tokens)) if tokens[j].type == "tr_close")
            cells = [x.content for x in tokens[i:end] if x.type == "inline"]
            if len(cells) < 2 or _unescape(cells[1]) != r["name"]:
                raise ValueError(f"answer.md's frontier of {answer_heading(*run)} row {row_i + 1} is "
                                 f"{_unescape(cells[1]) if len(cells) > 1 else '?'!r}, answer.parquet's "
                                 f"{r['name']!r}: run rule answer again")
            t.attrSet("data-cell", r["cell"])
            t.attrSet("data-band", str(r["band"]))
            if row_i and rows[row_i - 1]["band"] != r["band"]:
                t.attrSet("data-band-start", "")
            row_i += 1
        elif t.type == "paragraph_close" and run is not None and tokens[i - 1].content.startswith("**"):
            said = tokens[i - 1].content
            pick = roles(answer.filter((pl.col("model") == run[0]) & (pl.col("engine") == run[1])), "pick")
            m = re.match(r"\*\*Pick: ((?:\\\*|[^*])+)\*\*", said)  # the name may end in an escaped \* (128*)
            name = _unescape(m[1]) if m else None
            if said.startswith(("**Pick: ", "**No cell")) and pick["name"].to_list() != ([name] if name else []):
                raise ValueError(f"answer.md picks {name or 'nothing'} for {answer_heading(*run)}, answer.parquet "
                                 f"{pick['name'].to_list() or 'nothing'}: run rule answer again")
            if said.startswith(("**Pick: ", "**No cell")):
                out.append(_html_token(scoreboard(answer, *run)))
        i += 1
    missing = [answer_heading(*r) for r in runs if r not in seen]
    if missing:
        raise ValueError(f"answer.md has no frontier table for {', '.join(missing)}: run rule answer again")
    shift_headings(out, 1)
    return md.renderer.render(out, md.options, {})
