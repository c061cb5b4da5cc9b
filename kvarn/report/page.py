"""results/report.html: one self-contained page, the answer a user came for first.

In order: a title; **the answer** (results/answer.md and .parquet, rule `answer`,
`kvarn.report.advise`): per model the pick within the default tolerance, the pick's PPL ratio,
the presets and the frontier as a table (`<table class="answer" id="answer-MODEL">`, a
`data-cell` per row); **the claims ledger** (`kvarn.report.claims.render.ledger_markdown` of
results/claims.parquet) and each model's decision tables; **the figures** of every model with
their captions, leaving out a figure that is only a placeholder (`placeholder_reason`: the text
chart kvarn.report.figures draws where the run lacks the cells a figure compares) and naming
it with its reason instead; then **long-context retrieval** and **per-layer attention error**
where their results exist (`kvarn.report.workflow.PAGE_RETRIEVAL`, `PAGE_LAYERS_DIR`).

Self-contained: inline CSS, every figure an SVG data URI, no script. The page's
Content-Security-Policy (`CSP`) lets it load nothing but its own data URIs, so a browser
refuses — and reports on its console — anything else; tests/test_page.py loads it in headless
Chromium and asserts an empty console.

Markdown (the answer's sentences and frontier, the ledger, the decision tables, the
retrieval paragraph, and the captions of workflow/report/*.rst, whose inline markup —
``code``, **bold**, *emphasis* — CommonMark reads alike) is rendered by markdown-it-py with raw
HTML off: every name and number from the results is escaped.
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path
from typing import Iterable, Mapping

import polars as pl

from kvarn.files.atomic import write_bytes
from kvarn.report.workflow import FIGURE_TITLES, MODEL_FIGURES, PAGE_LAYERS_DIR, PAGE_RETRIEVAL

#: What the page may load: its own data-URI images and inline styles, nothing else.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
#: The figures' captions as `snakemake --report` shows them (workflow/report/{figure}.rst).
CAPTIONS_DIR = Path(__file__).resolve().parents[2] / "workflow" / "report"
TITLE = "kvarn: which KV-cache configuration, and what the study's claims come to on this run"
PPL_MEANING = "the perplexity under the cell's cache over the perplexity under the BF16 cache; 1 = unchanged"

STYLE = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#1d1d1f;margin:0 auto;max-width:1180px;
padding:0 24px 48px}
h1{font-size:1.6em;margin:28px 0 6px}h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:40px}
h3{margin-top:28px}h4{margin-top:20px}nav{font-size:.9em;color:#555;margin-bottom:8px}nav a{margin-right:14px}
table{border-collapse:collapse;font-size:13px;margin:10px 0 16px;display:block;overflow-x:auto}
td,th{padding:3px 8px;border-bottom:1px solid #e3e3e3;vertical-align:top}th{background:#f5f5f7;text-align:left}
table.answer{font-variant-numeric:tabular-nums}table.answer th{background:#e8f0fb}
table.answer tr[data-band-start] td{border-top:2px solid #9bb7dd}
.scoreboard{background:#f0f7f0;border-left:4px solid #2f7d32;padding:6px 10px}
figure{margin:18px 0 30px}figure img{max-width:100%;height:auto;display:block}
figcaption{font-size:.92em;color:#333;max-width:900px;margin-top:6px}.skipped{color:#555;font-size:.92em}
code{background:#f3f3f3;padding:0 3px;border-radius:3px}footer{margin-top:48px;color:#666;font-size:.85em}
"""


# ---------------------------------------------------------------- Markdown


def _md():
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False}).enable("table")


def _shift(tokens, shift: int) -> None:
    """Headings `shift` levels down (the page's own title is the one h1)."""
    for t in tokens:
        if t.type in ("heading_open", "heading_close"):
            t.tag = f"h{min(6, int(t.tag[1]) + shift)}"


def _classify_tables(tokens, cls: str) -> None:
    for t in tokens:
        if t.type == "table_open" and not t.attrGet("class"):
            t.attrSet("class", cls)


def markdown_html(text: str, shift: int = 0, table_class: str | None = None) -> str:
    """`text` (CommonMark with tables, raw HTML escaped) as HTML, headings `shift` levels down."""
    md = _md()
    tokens = md.parse(text)
    _shift(tokens, shift)
    if table_class:
        _classify_tables(tokens, table_class)
    return md.renderer.render(tokens, md.options, {})


def inline_html(text: str) -> str:
    """One paragraph of inline Markdown as HTML without the <p>."""
    md = _md()
    return md.renderInline(text)


def slug(text: str) -> str:
    """An HTML id from a model or figure name (letters, digits, `.`, `_`, `-`)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


# ---------------------------------------------------------------- the answer


def answer_heading(model: str, engine: str) -> str:
    """A run's heading in results/answer.md (kvarn.report.advise.answer_markdown)."""
    return model + (f" ({engine} engine)" if engine != "torch" else "")


def answer_table_id(model: str, engine: str) -> str:
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
    md = _md()
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
    _shift(out, 1)
    return md.renderer.render(out, md.options, {})


# ---------------------------------------------------------------- the ledger


def ledger_html(ledger: pl.DataFrame, decisions: Mapping[str, str]) -> str:
    """The ledger (kvarn.report.claims.render.ledger_markdown) and each model's decision tables."""
    from kvarn.report.claims.render import ledger_markdown

    parts = [markdown_html(ledger_markdown(ledger), shift=1, table_class="ledger")]
    if decisions:
        parts.append("<h3>Decision tables</h3>\n")
        parts += [markdown_html(md, shift=1, table_class="decisions") for md in decisions.values()]
    return "".join(parts)


# ---------------------------------------------------------------- figures


def placeholder_reason(spec: dict) -> str | None:
    """Why a figure is only a placeholder, or None if it draws data.

    A placeholder (kvarn.report.figures draws one where a run lacks the cells a figure compares)
    is a single text mark whose one datum is `{"why": ...}`; a spec may also say so itself in
    `usermeta: {placeholder: why}`. A figure that holds a placeholder panel beside real ones
    (the Pareto figure without p99) draws data and is kept."""
    meta = spec.get("usermeta")
    if isinstance(meta, dict) and meta.get("placeholder"):
        return str(meta["placeholder"])
    if any(k in spec for k in ("layer", "hconcat", "vconcat", "concat", "facet", "repeat")):
        return None
    mark = spec.get("mark")
    mark = mark.get("type") if isinstance(mark, dict) else mark
    values = (spec.get("data") or {}).get("values")
    if mark != "text" or not isinstance(values, list) or len(values) != 1:
        return None
    if not isinstance(values[0], dict) or set(values[0]) != {"why"}:
        return None
    text = (spec.get("encoding") or {}).get("text") or {}
    return str(values[0]["why"]) if text.get("field") == "why" else None


def _data_uri(svg: Path) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(Path(svg).read_bytes()).decode("ascii")


def _img(svg: Path, alt: str) -> str:
    return f'<img src="{_data_uri(svg)}" alt="{html.escape(alt)}">'


def figure_caption(figure: str, model: str, summary: pl.DataFrame | None, captions_dir: Path = CAPTIONS_DIR) -> str:
    """A figure's caption as HTML: the Pareto figure's generated from the cells it draws
    (kvarn.report.figures.pareto_caption), the others workflow/report/{figure}.rst with the model."""
    if figure == "pareto" and summary is not None:
        from kvarn.report.data import prepare
        from kvarn.report.figures import pareto_caption

        return html.escape(pareto_caption(prepare(summary, model)))
    rst = Path(captions_dir) / f"{figure}.rst"
    if not rst.is_file():
        return ""
    text = re.sub(r"\{\{\s*snakemake\.wildcards\.model\s*\}\}", model, rst.read_text(encoding="utf-8"))
    return inline_html(" ".join(text.split()))


def model_figures(paths: Iterable[str | Path], models: Iterable[str] = ()) -> dict[str, list[Path]]:
    """The figure SVGs among `paths` (results/figures/{model}/{figure}.svg, any other file
    ignored) by model, `models` first in their order, then the others as they come; each
    model's in MODEL_FIGURES order, then any other (decode)."""
    order = {f: i for i, f in enumerate(MODEL_FIGURES)}
    out: dict[str, list[Path]] = {m: [] for m in models}
    for p in map(Path, paths):
        if p.suffix == ".svg":
            out.setdefault(p.parent.name, []).append(p)
    return {m: sorted(v, key=lambda p: (order.get(p.stem, len(order)), p.stem)) for m, v in out.items() if v}


def _title_of(figure: str) -> str:
    t = FIGURE_TITLES.get(figure, figure.replace("_", " "))
    return t[0].upper() + t[1:]


def figures_html(paths: Iterable[str | Path], summary: pl.DataFrame | None = None,
                 captions_dir: Path = CAPTIONS_DIR, models: Iterable[str] = ()) -> tuple[str, dict[str, list[str]]]:
    """Every model's figures (`models` first, in their order) with their captions, placeholders
    left out and named, with why, in one line under the model's figures. Returns the HTML and,
    per model, the figures left out."""
    parts, skipped = [], {}
    for model, svgs in model_figures(paths, models).items():
        parts.append(f'<h3 id="figures-{slug(model)}">{html.escape(model)}</h3>\n')
        left: list[tuple[str, str]] = []
        for svg in svgs:
            vl = svg.with_name(svg.name[: -len(".svg")] + ".vl.json")
            if not vl.is_file():
                raise FileNotFoundError(f"{vl}: the Vega-Lite spec beside {svg} (both written by rule report_figures)")
            why = placeholder_reason(json.loads(vl.read_text(encoding="utf-8")))
            title = _title_of(svg.stem)
            if why is not None:
                left.append((svg.stem, why))
                continue
            caption = figure_caption(svg.stem, model, summary, captions_dir)
            parts.append(f'<figure id="fig-{slug(model)}-{slug(svg.stem)}" data-figure="{html.escape(svg.stem)}">'
                         f"{_img(svg, f'{model}: {title}')}<figcaption><strong>{html.escape(title)}.</strong> "
                         f"{caption}</figcaption></figure>\n")
        if left:
            text = "; ".join(f"{_title_of(f).lower()} ({why})" for f, why in left)
            parts.append(f'<p class="skipped">Not drawn for this run: {html.escape(text)}.</p>\n')
        skipped[model] = [f for f, _ in left]
    return "".join(parts), skipped


# ---------------------------------------------------------------- retrieval and per-layer error


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _table(header: list[str], rows: list[list[str]], cls: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>\n" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody></table>\n'


def retrieval_html(files: Mapping[str, str | Path]) -> str:
    """The retrieval side study (kvarn.retrieval.report's outputs): its paragraph, each model's
    accuracy per cell with the 95 % Wilson interval, and its figure; "" without scores."""
    scores = files.get("scores")
    if scores is None or not Path(scores).is_file():
        return ""
    s = pl.read_parquet(scores)
    parts = ['<section id="retrieval">\n<h2>Long-context retrieval</h2>\n',
             "<p>A side study (docs/notes/retrieval.md): seeded pass-key, multi-key and key-value prompts "
             "answered greedily through each cache; accuracy with 95 % Wilson intervals, agreement with the "
             "exact cache's answers, prompts lost and gained against it.</p>\n"]
    para = files.get("paragraph")
    if para is not None and Path(para).is_file():
        parts.append(markdown_html(Path(para).read_text(encoding="utf-8")))
    for model in s["model"].unique(maintain_order=True).to_list():
        rows = [[r["label"], _f(r["accuracy"], ".2f"), f"[{_f(r['acc_lo'], '.2f')}, {_f(r['acc_hi'], '.2f')}]",
                 f"{r['correct']}/{r['n']}", _f(r["agreement"], ".2f"), r["lost"], r["gained"]]
                for r in s.filter(pl.col("model") == model).iter_rows(named=True)]
        parts += [f"<h3>{html.escape(model)}</h3>\n",
                  _table(["cell", "accuracy", "95 % CI", "correct", "agreement", "lost", "gained"], rows, "retrieval")]
    fig = files.get("figure")
    if fig is not None and Path(fig).is_file():
        parts.append(f'<figure id="fig-retrieval">{_img(Path(fig), "retrieval accuracy")}<figcaption><strong>'
                     "Retrieval accuracy.</strong> Per model: accuracy by the needle's distance from the end of "
                     "the prompt, one line per cell (the exact cache's own answers included), with 95 % Wilson "
                     "intervals; beside it each cell's accuracy over all prompts.</figcaption></figure>\n")
    return "".join(parts) + "</section>\n"


def layer_sentence(table: pl.DataFrame) -> str:
    """One per-layer table (kvarn.run.layer_error) in a sentence: layers, the median relative
    error K only / V only / both, and the layer where both err most."""
    kinds = table["kind"].value_counts(sort=True)
    count = ", ".join(f"{n} {k}" for k, n in kinds.iter_rows())
    med = {c: table[c].median() for c in ("rel_err_k", "rel_err_v", "rel_err_kv")}
    worst = table.sort("rel_err_kv", descending=True).row(0, named=True)
    return (f"{table.height} attention layers ({count}); median relative L2 error of the attention output: "
            f"K only {med['rel_err_k']:.3g}, V only {med['rel_err_v']:.3g}, K and V {med['rel_err_kv']:.3g}; "
            f"the largest, {worst['rel_err_kv']:.3g}, at layer {worst['layer']} ({worst['kind']}).")


def layers_html(parquets: Iterable[str | Path]) -> str:
    """Each per-layer result (`kvarn layers -o results/layers/STEM`: STEM.parquet and its figure
    STEM.svg) with a sentence from its table; "" without any."""
    parts = []
    for pq in sorted(map(Path, parquets)):
        stem = pq.name[: -len(".parquet")]
        svg = pq.with_name(stem + ".svg")
        text = html.escape(layer_sentence(pl.read_parquet(pq)))
        img = _img(svg, f"{stem}: attention error by layer") if svg.is_file() else ""
        parts.append(f'<figure id="fig-layers-{slug(stem)}">{img}<figcaption><strong>{html.escape(stem)}.</strong> '
                     f"{text} Filled points: full-attention layers, open: sliding-window layers.</figcaption>"
                     "</figure>\n")
    if not parts:
        return ""
    return ('<section id="layers">\n<h2>Per-layer attention error</h2>\n<p>Each attention layer\'s output error '
            "against an fp32 cache on the same inputs, with K and V quantized, K only and V only "
            "(<code>kvarn layers</code>, docs/notes/decode.md).</p>\n" + "".join(parts) + "</section>\n")


def found_extras(found: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """The retrieval files (by PAGE_RETRIEVAL's names) and per-layer parquets among `found`
    (kvarn.report.workflow.page_found's paths, relative to the working directory)."""
    found = {str(Path(p)) for p in found}
    retrieval = {k: p for k, p in PAGE_RETRIEVAL.items() if str(Path(p)) in found}
    layers = sorted(p for p in found if Path(p).parent == Path(PAGE_LAYERS_DIR) and p.endswith(".parquet"))
    return retrieval, layers


# ---------------------------------------------------------------- the page


def page_html(*, answer_md: str, answer: pl.DataFrame, ledger: pl.DataFrame, decisions: Mapping[str, str],
              figures: Iterable[str | Path], summary: pl.DataFrame | None = None,
              retrieval: Mapping[str, str | Path] | None = None, layers: Iterable[str | Path] = (),
              captions_dir: Path = CAPTIONS_DIR) -> str:
    """The whole page (see the module docstring)."""
    models = answer["model"].unique(maintain_order=True).to_list()
    answer_part = answer_html(answer_md, answer)
    figs, _ = figures_html(figures, summary, captions_dir, models)
    extra = retrieval_html(retrieval or {}) + layers_html(layers)
    nav = [("answer", "the answer"), ("ledger", "the claims ledger"), ("figures", "figures")]
    nav += [(s, t) for s, t in (("retrieval", "retrieval"), ("layers", "per-layer error")) if f'id="{s}"' in extra]
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(TITLE)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<header><h1>{html.escape(TITLE)}</h1>",
        "<nav>" + "".join(f'<a href="#{s}">{html.escape(t)}</a>' for s, t in nav) + "</nav></header>",
        f'<section id="answer">\n{answer_part}</section>',
        f'<section id="ledger">\n{ledger_html(ledger, decisions)}</section>',
        f'<section id="figures">\n<h2>Figures</h2>\n{figs}</section>',
        extra,
        "<footer>Built by kvarn.report.page from results/answer.md and .parquet, results/claims.parquet, "
        f"the decision tables, results/summary.parquet and the figures of {html.escape(', '.join(models))}"
        + (", the retrieval report" if 'id="retrieval"' in extra else "")
        + (", the per-layer results" if 'id="layers"' in extra else "")
        + ". Every figure is embedded: this file can be moved or mailed on its own.</footer>",
        "</body></html>", ""])


def write_page(out: str | Path, *, summary: str | Path, answer_md: str | Path, answer: str | Path,
               claims: str | Path, decisions: Iterable[str | Path], figures: Iterable[str | Path],
               found: Iterable[str] = (), captions_dir: Path = CAPTIONS_DIR) -> Path:
    """Rule report_page: the page from the results' files, written atomically to `out`.

    `decisions`: results/tables/decisions/{model}.md; `figures`: the figures' .svg (each with
    its .vl.json beside it; other paths are ignored); `found`: the optional results present
    (kvarn.report.workflow.page_found), relative to the working directory."""
    retrieval, layers = found_extras(found)
    text = page_html(answer_md=Path(answer_md).read_text(encoding="utf-8"), answer=pl.read_parquet(answer),
                     ledger=pl.read_parquet(claims),
                     decisions={Path(p).stem: Path(p).read_text(encoding="utf-8") for p in decisions},
                     figures=figures, summary=pl.read_parquet(summary), retrieval=retrieval, layers=layers,
                     captions_dir=captions_dir)
    write_bytes(out, text.encode("utf-8"))
    return Path(out)
