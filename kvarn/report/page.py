"""results/report.html: one self-contained page, the answer a user came for first
(`kvarn.report.page_answer`), then the claims ledger, the figures, and retrieval and per-layer
results where they exist. Its order, its Content-Security-Policy (`CSP`: nothing loaded but its own
data URIs) and its test in headless Chromium: docs/notes/report.md ("The landing page")."""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path
from typing import Iterable, Mapping

import polars as pl

from kvarn.files.atomic import write_bytes
from kvarn.report.page_answer import answer_html
from kvarn.report.page_markdown import inline_html, markdown_html, slug
from kvarn.report.workflow import FIGURE_TITLES, MODEL_FIGURES, PAGE_LAYERS_DIR, PAGE_RETRIEVAL

#: What the page may load: its own data-URI images and inline styles, nothing else.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
#: The figures' captions as `snakemake --report` shows them (workflow/report/{figure}.rst).
CAPTIONS_DIR = Path(__file__).resolve().parents[2] / "workflow" / "report"
TITLE = "kvarn: which KV-cache configuration, and what the study's claims come to on this run"

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


def ledger_html(ledger: pl.DataFrame, decisions: Mapping[str, str]) -> str:
    """The ledger (kvarn.report.claims.render.ledger_markdown) and each model's decision tables."""
    from kvarn.report.claims.render import ledger_markdown

    parts = [markdown_html(ledger_markdown(ledger), shift=1, table_class="ledger")]
    if decisions:
        parts.append("<h3>Decision tables</h3>\n")
        parts += [markdown_html(md, shift=1, table_class="decisions") for md in decisions.values()]
    return "".join(parts)


def placeholder_reason(spec: dict) -> str | None:
    """Why a figure is only a placeholder, or None if it draws data.

    A placeholder (kvarn.report.figures.placeholder draws one where a run lacks the cells a figure compares)
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
    (kvarn.report.figures_pareto.pareto_caption), the others workflow/report/{figure}.rst with the model."""
    if figure == "pareto" and summary is not None:
        from kvarn.report.data import prepare
        from kvarn.report.figures_pareto import pareto_caption

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
