"""results/report.html (kvarn.report.page, rule report_page), built from a synthetic run
(tests/synthetic.py: the answer, the ledger and every model figure made by the functions the rules
call) and loaded in a real headless browser, Debian's chromium (`make browser` installs it; a
missing browser fails these tests, it does not skip them).

In the browser: no console message at all (the page runs no script, and its Content-Security-Policy
turns any load from outside the file into a console message), and in the DOM the answer's tables
first, each model's frontier row by row; no placeholder figure; the retrieval and per-layer
sections only where their results exist. The console check itself is shown to catch a deliberate
script error and an outside image.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path

import polars as pl
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import synthetic  # noqa: E402

from kvarn.report import page as P  # noqa: E402
from kvarn.report.page_answer import answer_html  # noqa: E402
from kvarn.report import workflow as W  # noqa: E402

# One xdist worker: the module fixtures build the synthetic run and its figures once.
pytestmark = pytest.mark.xdist_group("page")

ROOT = Path(__file__).resolve().parents[1]
MODELS = list(synthetic.MODELS)
BOOT = 200

# Headless chromium that reaches nothing on its own (no sync, updates or QUIC; as root in a container:
# no sandbox, no /dev/shm) and logs to stderr, where each console message of the page (console.*, an
# uncaught error, a Content-Security-Policy refusal) is a line `...:INFO:CONSOLE:<line>] "<message>",
# source: ...` (older releases: `CONSOLE(<line>)`) whatever its level; --dump-dom prints the DOM once
# the page has loaded.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]
CONSOLE = re.compile(r":CONSOLE[:(]\d+")


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not on PATH: `make browser` installs Debian's chromium "
                    "(apt-get install -y chromium, as root)", pytrace=False)
    return path


def load(page: Path, profile: Path) -> tuple[str, list[str]]:
    """`page` loaded in headless chromium: (the DOM after load, every console message's log line)."""
    p = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.resolve().as_uri()],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "<body" in p.stdout, f"chromium printed no DOM:\n{p.stderr[-4000:]}"
    return p.stdout, [line for line in p.stderr.splitlines() if CONSOLE.search(line)]


class Outline(HTMLParser):
    """A DOM in document order: headings, tables (attributes; per body row its attributes and cell
    texts), figures, every src/href, scripts."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.items: list[tuple] = []
        self.links: list[str] = []
        self.scripts = 0
        self._text: list[str] | None = None
        self._table = self._row = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.links += [a[k] for k in ("src", "href") if a.get(k) is not None]
        if tag == "script":
            self.scripts += 1
        elif tag in ("h1", "h2", "h3", "h4"):
            self._text = []
            self.items.append([tag, a, ""])
        elif tag == "table":
            self._table = {"attrs": a, "head": [], "rows": []}
            self.items.append(("table", self._table))
        elif tag == "tr" and self._table is not None:
            self._row = {"attrs": a, "cells": []}
        elif tag in ("td", "th") and self._row is not None:
            self._text = []
        elif tag == "figure":
            self.items.append(("figure", a))
        elif tag == "section":
            self.items.append(("section", a))

    def handle_endtag(self, tag):
        if tag in ("h1", "h2", "h3", "h4") and self._text is not None:
            self.items[-1][2] = " ".join("".join(self._text).split())
            self._text = None
        elif tag in ("td", "th") and self._row is not None and self._text is not None:
            self._row["cells"].append(" ".join("".join(self._text).split()))
            self._text = None
        elif tag == "tr" and self._row is not None:
            is_head = not self._table["head"] and not self._row["attrs"].get("data-cell") and not self._table["rows"]
            (self._table["head"].extend(self._row["cells"]) if is_head else self._table["rows"].append(self._row))
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)

    def tables(self) -> list[dict]:
        return [t for kind, *rest in self.items if kind == "table" for t in rest]

    def figures(self) -> list[dict]:
        return [a for kind, *rest in self.items if kind == "figure" for a in rest]

    def sections(self) -> list[str]:
        return [a[0].get("id") for kind, *a in self.items if kind == "section"]


# ---------------------------------------------------------------- a synthetic run's report inputs


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A synthetic run with every input of rule report_page, written by the functions the rules
    call: results/answer.md and .parquet, claims.parquet (and .md, .html), the decision tables, each
    model's paired table and its nine figures as .svg and .vl.json."""
    from kvarn.report import advise as A
    from kvarn.report.claims.ledger import run_claims
    from kvarn.report.claims.render import claims_html, claims_markdown
    from kvarn.report import figures, figures_catalog, figures_cells, figures_compare
    from kvarn.report import load_tokens, prepare, select_token_paths
    from kvarn.report.compare import compute_split
    from kvarn.report.paired_table import run_table

    root = tmp_path_factory.mktemp("page")
    summary = synthetic.make_results(root, n_ctx=256, chunks=2)
    res = root / "results"
    answers = A.advise(summary, A.token_dirs(summary, res), n_boot=BOOT)
    (res / "answer.md").write_text(A.answers_markdown(answers), encoding="utf-8")
    A.frontier_frame(answers).write_parquet(res / "answer.parquet")
    tokens = {m: synthetic.token_paths(root, m) for m in MODELS}
    ledger, decisions = run_claims(summary, [p for m in MODELS for p in tokens[m]], n_boot=BOOT)
    ledger.write_parquet(res / "claims.parquet")
    (res / "claims.md").write_text(claims_markdown(ledger, decisions), encoding="utf-8")
    (res / "claims.html").write_text(claims_html(ledger, decisions), encoding="utf-8")
    for m, md in decisions.items():
        (res / "tables" / "decisions").mkdir(parents=True, exist_ok=True)
        (res / "tables" / "decisions" / f"{m}.md").write_text(md, encoding="utf-8")
    for m in MODELS:
        prep = prepare(summary, m)
        paired = run_table(prep, tokens[m], n_boot=BOOT)
        (res / "paired").mkdir(exist_ok=True)
        paired.write_parquet(res / "paired" / f"{m}.parquet")
        toks = load_tokens(select_token_paths(tokens[m], widths=[2, 4, 8], tail=128))
        charts = {f: figures_catalog.summary_figure(f, prep) for f in W.SUMMARY_FIGURES}
        charts |= {f: figures_catalog.token_figure(f, toks) for f in W.TOKEN_FIGURES}
        charts |= {"ranked": figures_cells.ranked(prep, paired),
                   "kernel_share": figures_compare.kernel_share(compute_split(summary, m), m)}
        assert set(charts) == set(W.MODEL_FIGURES)
        for f, chart in charts.items():
            figures.save_chart(chart, res / "figures" / m / f, formats=("vl.json", "svg"))
    return {"root": root, "summary": summary, "answers": answers, "decisions": decisions}


def inputs(res: Path) -> dict:
    """write_page's inputs under a results folder, as rule report_page passes them."""
    return {"summary": res / "summary.parquet", "answer_md": res / "answer.md", "answer": res / "answer.parquet",
            "claims": res / "claims.parquet", "decisions": sorted((res / "tables" / "decisions").glob("*.md")),
            "figures": [res.parent / p for p in W.page_figures(MODELS)]}


@pytest.fixture(scope="module")
def page(run, tmp_path_factory):
    """The page of the synthetic run (no retrieval, no per-layer results) and what chromium made of it."""
    out = P.write_page(run["root"] / "results" / "report.html", **inputs(run["root"] / "results"))
    dom, console = load(out, tmp_path_factory.mktemp("profile"))
    return out, dom, console


def test_the_page_loads_with_an_empty_console(page):
    _, dom, console = page
    assert console == [], "\n".join(console)
    outline = Outline(dom)
    assert outline.scripts == 0
    # everything it shows is inside the file: images are SVG data URIs, links point inside the page
    assert outline.links and all(x.startswith(("data:image/svg+xml;base64,", "#")) for x in outline.links), \
        [x[:60] for x in outline.links if not x.startswith(("data:image/svg+xml;base64,", "#"))]
    for src in (x for x in outline.links if x.startswith("data:")):
        assert base64.b64decode(src.split(",", 1)[1])[:200].lstrip().startswith(b"<svg")


def test_the_answer_comes_first_with_each_models_frontier(page, run):
    """The title, then the answer: the first tables of the DOM are the answer's, one per model in the
    run's order, each row the Answer's frontier row (cell, name, band) with its PPL ratio."""
    outline = Outline(page[1])
    assert outline.items[0][0] == "h1" and outline.items[0][2] == P.TITLE
    assert outline.sections()[:3] == ["answer", "ledger", "figures"]
    first_section = next(i for i, x in enumerate(outline.items) if x[0] == "section")
    assert all(x[0] != "table" for x in outline.items[:first_section])  # nothing but the title before the answer
    tables = outline.tables()
    answers = run["answers"]
    assert [t["attrs"].get("class") for t in tables[:len(answers)]] == ["answer"] * len(answers)
    assert all("answer" not in (t["attrs"].get("class") or "") for t in tables[len(answers):])
    for a, t in zip(answers, tables):
        assert t["attrs"]["id"] == f"answer-{a.model}"
        head = t["head"]
        assert head[:2] == ["band", "cell"] and "PPL ratio" in head
        front = a.frontier
        assert [r["attrs"]["data-cell"] for r in t["rows"]] == front["cell"].to_list()
        assert [r["cells"][1] for r in t["rows"]] == front["name"].to_list()
        assert [int(r["attrs"]["data-band"]) for r in t["rows"]] == front["band"].to_list()
        ppl = head.index("PPL ratio")
        assert [r["cells"][ppl] for r in t["rows"]] == [f"{x:.4f}" for x in front["ppl_ratio"]]


def test_each_pick_and_its_ppl_ratio_are_on_the_landing(page, run):
    """Each model's scoreboard under its pick sentence: the pick (where the run has one) with its PPL ratio."""
    import html

    from kvarn.report.advise import name_of

    text = page[0].read_text(encoding="utf-8")
    assert text.count('class="scoreboard"') == len(run["answers"])
    for a in run["answers"]:
        if a.pick is not None:
            assert (f"Pick <strong>{html.escape(name_of(a.pick))}</strong>: PPL ratio {a.pick['ppl_ratio']:.4f}, "
                    f"median KLD {a.pick['kld_median']:.3g}") in text
    assert {a.pick is None for a in run["answers"]} == {True, False}  # one model with a pick, one without


def test_no_placeholder_figure_is_shown_and_each_is_named(page, run):
    """The synthetic run has no cell in both compute paths, so kernel_share is only a placeholder
    (kvarn.report.compare.compute_split is empty): not drawn, named with its reason; every other figure
    of each model is drawn, in MODEL_FIGURES order, with a caption."""
    from kvarn.report.compare import compute_split

    outline = Outline(page[1])
    shown = [(f["id"], f["data-figure"]) for f in outline.figures()]
    for m in MODELS:
        assert compute_split(run["summary"], m).is_empty()
        want = [f for f in W.MODEL_FIGURES if f != "kernel_share"]
        assert [fig for i, fig in shown if i.startswith(f"fig-{m}-")] == want
    text = page[0].read_text(encoding="utf-8")
    assert text.count("Not drawn for this run: llama.cpp kernel share (no qN-qN pair run in both") \
        == len(MODELS)
    assert "the standard frontier" in text  # the Pareto caption, generated from the cells drawn
    assert "Hover for every knob" not in text  # the pareto .rst is not used: its caption is generated
    # no section for results this run does not have
    assert "retrieval" not in outline.sections() and "layers" not in outline.sections()


def test_placeholder_reason_tells_a_placeholder_from_a_figure(run):
    res = run["root"] / "results" / "figures"
    specs = {f: json.loads((res / MODELS[0] / f"{f}.vl.json").read_text()) for f in W.MODEL_FIGURES}
    assert P.placeholder_reason(specs["kernel_share"]).startswith("no qN-qN pair run in both compute paths")
    assert [f for f, s in specs.items() if P.placeholder_reason(s) is not None] == ["kernel_share"]
    assert P.placeholder_reason({"usermeta": {"placeholder": "said so"}, "layer": []}) == "said so"
    # a single text mark drawing data is a figure, not a placeholder
    assert P.placeholder_reason({"mark": "text", "data": {"values": [{"why": "x", "n": 1}]},
                                 "encoding": {"text": {"field": "why"}}}) is None


def test_answer_md_and_parquet_are_checked_against_each_other(run):
    """The page reads the answer's sentences from answer.md and its rows from answer.parquet: a
    row or a pick that differs between them (files of two different runs) fails the build."""
    from kvarn.report.advise import name_of

    res = run["root"] / "results"
    md, answer = (res / "answer.md").read_text(encoding="utf-8"), pl.read_parquet(res / "answer.parquet")
    assert 'id="answer-gemma3-270m"' in answer_html(md, answer)
    last_row = [line for line in md.splitlines() if line.startswith("| ")][-1]
    with pytest.raises(ValueError, match="answer.md's frontier of gemma3-270m has .* rows, answer.parquet"):
        answer_html(md.replace(last_row + "\n", ""), answer)
    picked = next(a for a in run["answers"] if a.pick is not None)
    renamed = answer.with_columns(pl.when(pl.col("role") == "pick").then(pl.lit("q2_0-q2_0 t0"))
                                  .otherwise(pl.col("name")).alias("name"))
    with pytest.raises(ValueError, match=re.escape(f"answer.md picks {name_of(picked.pick)} for {picked.model}, "
                                                   "answer.parquet ['q2_0-q2_0 t0']")):
        answer_html(md, renamed)
    with pytest.raises(ValueError, match="no frontier table for"):
        answer_html(md.split("## gemma3-270m")[0], answer.filter(pl.col("model") != "x"))


def test_the_ledger_follows_the_answer(page, run):
    outline = Outline(page[1])
    heads = [(x[0], x[2]) for x in outline.items if x[0] in ("h2", "h3")]
    h2 = [t for k, t in heads if k == "h2"]
    assert h2[:3] == ["Which KV-cache configuration: the answer of this run", "The study's claims, computed",
                      "Figures"]
    tables = outline.tables()
    assert any(t["attrs"].get("class") == "ledger" for t in tables)
    assert sum(t["attrs"].get("class") == "decisions" for t in tables) >= len(MODELS)


# ---------------------------------------------------------------- retrieval and per-layer results


def retrieval_results(root: Path, summary_path: Path) -> dict[str, Path]:
    """kvarn.retrieval.report's outputs for made-up answers of two cells and the exact cache (the report reads
    each answer again from its generated text)."""
    from kvarn.retrieval import plan, report
    from kvarn.retrieval.tasks import write_tasks

    cells = {"bf16-bf16-t0": [1, 1, 1, 1, 0, 1], "q4_0-q4_0-t128": [1, 0, 1, 0, 0, 1],
             "kvarn4-kvarn4-t0": [1, 1, 1, 0, 0, 1]}
    paths = []
    for cell, right in cells.items():
        recs = [{"model": MODELS[0], "context": 256, "task": "passkey", "id": f"p{i}", "depth": 0.5, "depth_index": 0,
                 "prompt_index": i, "cell": cell, "answer": str(1000 + i), "given": str(1000 + i if ok else 7),
                 "correct": bool(ok), "text": f" {1000 + i if ok else 7}.", "needle_start": 40 + 20 * i, "needle_end": 50 + 20 * i,
                 "n_prompt": 248, "gen_tokens": 8, "distance": 198 - 20 * i, "wall_s": 0.1}
                for i, ok in enumerate(right)]
        path = root / plan.ANSWER_FILE.format(model=MODELS[0], n_ctx=256, task="passkey", k=cell.split("-")[0],
                                              v=cell.split("-")[1], tail=cell.rsplit("-t", 1)[1], opts="")
        write_tasks(path, recs)
        paths.append(path)
    outputs = {k: root / p for k, p in plan.report_files().items()}
    report.write_report(paths, outputs, teacher_forced=summary_path)
    assert set(W.PAGE_RETRIEVAL.values()) <= set(plan.report_files().values())  # the page reads where it writes
    return {k: root / p for k, p in W.PAGE_RETRIEVAL.items()}


def layer_results(root: Path) -> Path:
    """A per-layer result as `kvarn layers -o results/layers/STEM` writes it: STEM.parquet and the figure."""
    from kvarn.report.figures import save_chart
    from kvarn.report.figures_tokens import layer_error

    table = pl.DataFrame({"layer": [0, 1, 2, 3], "kind": ["sliding", "sliding", "full", "sliding"],
                          "window": [512, 512, None, 512], "rel_err_kv": [0.02, 0.03, 0.31, 0.05],
                          "rel_err_k": [0.018, 0.025, 0.30, 0.04], "rel_err_v": [0.01, 0.012, 0.03, 0.02],
                          "n_rows": [254] * 4})
    stem = root / W.PAGE_LAYERS_DIR / "gemma3-270m-q4_0-t128"
    stem.parent.mkdir(parents=True, exist_ok=True)
    table.write_parquet(stem.with_name(stem.name + ".parquet"))
    save_chart(layer_error(table, "gemma3-270m q4_0-q4_0 tail 128"), stem, formats=("vl.json", "svg"))
    return stem.with_name(stem.name + ".parquet")


def test_retrieval_and_per_layer_sections_where_their_results_exist(run, tmp_path):
    res = run["root"] / "results"
    retrieval = retrieval_results(tmp_path, res / "summary.parquet")
    layers = layer_results(tmp_path)
    args = inputs(res)
    text = P.page_html(answer_md=args["answer_md"].read_text(), answer=pl.read_parquet(args["answer"]),
                       ledger=pl.read_parquet(args["claims"]), decisions=run["decisions"], figures=args["figures"],
                       summary=run["summary"], retrieval=retrieval, layers=[layers])
    out = tmp_path / "report.html"
    out.write_text(text, encoding="utf-8")
    dom, console = load(out, tmp_path / "profile")
    assert console == [], "\n".join(console)
    outline = Outline(dom)
    assert outline.sections() == ["answer", "ledger", "figures", "retrieval", "layers"]
    figs = [f["id"] for f in outline.figures()]
    assert figs[-2:] == ["fig-retrieval", "fig-layers-gemma3-270m-q4_0-t128"]
    acc = next(t for t in outline.tables() if t["attrs"].get("class") == "retrieval")
    assert acc["head"][:3] == ["cell", "accuracy", "95 % CI"]
    assert {r["cells"][0]: r["cells"][3] for r in acc["rows"]} == {
        "bf16 (exact)": "5/6", "kvarn4 128*": "4/6", "q4_0 t128": "3/6"}
    assert "4 attention layers (3 sliding, 1 full)" in text and "at layer 2 (full)" in text
    assert "the exact cache answers 5/6 prompts" in text  # the retrieval paragraph, rendered


def test_page_found_and_page_figures_plan_the_rule(tmp_path):
    """The rule's planning side: the optional results present (path -> mtime), found by
    kvarn.report.page.found_extras; each model's figures (and a decoding model's decode figure)."""
    assert W.page_found(tmp_path) == {}
    layers = layer_results(tmp_path)
    (tmp_path / "results" / "retrieval").mkdir(parents=True)
    (tmp_path / W.PAGE_RETRIEVAL["scores"]).write_bytes(b"")
    found = W.page_found(tmp_path)
    rel = str(layers.relative_to(tmp_path))
    assert set(found) == {W.PAGE_RETRIEVAL["scores"], rel, rel[: -len(".parquet")] + ".svg"}
    assert found[rel] == layers.stat().st_mtime_ns
    retrieval, parquets = P.found_extras(found)
    assert retrieval == {"scores": W.PAGE_RETRIEVAL["scores"]} and parquets == [rel]
    figs = W.page_figures(["a", "b"], ["results/figures/b/decode.svg", "results/figures/b/decode.png"])
    assert len(figs) == 2 * 2 * len(W.MODEL_FIGURES) + 2 and figs[-2:] == ["results/figures/b/decode.svg",
                                                                          "results/figures/b/decode.vl.json"]
    assert W.PAGE in W.targets(["a"])


# ---------------------------------------------------------------- the rule


def test_rule_report_page_builds_the_page(run, tmp_path):
    """Rule report_page, run by snakemake on the synthetic run's files: results/report.html loads
    with an empty console; a per-layer result that appears later is found at planning time (a
    changed param), so the page is built again, now with its section."""
    snakemake = shutil.which("snakemake", path=str(Path(sys.executable).parent)) or "snakemake"
    shutil.copytree(run["root"] / "results", tmp_path / "results")
    (tmp_path / "results" / "report.html").unlink(missing_ok=True)
    (tmp_path / "config").mkdir()
    shutil.copy2(ROOT / "config" / "study.yaml", tmp_path / "config" / "study.yaml")  # rule claims's input
    for m in MODELS:  # the figures' PNGs, which the page does not read: the figure jobs' other outputs
        for f in W.MODEL_FIGURES:
            (tmp_path / "results" / "figures" / m / f"{f}.png").touch()
    (tmp_path / "Snakefile").write_text(textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})


        def model_names():
            return {MODELS!r}


        def token_parquets(model):
            return sorted(str(p) for p in Path("results", model).glob("ctx*-c*/cells/*/tokens.parquet"))


        include: {str(ROOT / "workflow/rules/report.smk")!r}
    """))

    def smk(*args):
        p = subprocess.run([snakemake, "-c1", "--allowed-rules", "report_page", *args, "--", W.PAGE],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stdout + p.stderr

    def sections():
        dom, console = load(tmp_path / W.PAGE, tmp_path / "profile")
        assert console == [], "\n".join(console)
        outline = Outline(dom)
        assert [t["attrs"]["id"] for t in outline.tables()[:len(MODELS)]] == [f"answer-{m}" for m in MODELS]
        return outline.sections()

    smk("-q")
    assert sections() == ["answer", "ledger", "figures"]
    assert "Nothing to be done" in smk("-n")
    layer_results(tmp_path)
    plan = smk("-n")
    assert "report_page" in plan and "params" in plan.lower(), plan
    smk("-q")
    assert sections() == ["answer", "ledger", "figures", "layers"]


# ---------------------------------------------------------------- the console check itself


def test_the_console_check_catches_a_script_error(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><title>t</title></head><body><h1>t</h1>"
                   "<script>console.error('deliberate console error'); no_such_function();</script></body></html>")
    _, console = load(bad, tmp_path / "profile")
    assert len(console) == 2, console
    assert "deliberate console error" in console[0] and "Uncaught ReferenceError" in console[1]


def test_the_console_check_catches_an_outside_load(page, tmp_path):
    """The page's own policy at work: the real page with one image from elsewhere is refused, on the console."""
    text = page[0].read_text(encoding="utf-8").replace(
        "</footer>", '</footer><img src="https://example.invalid/x.png" alt="outside">', 1)
    bad = tmp_path / "outside.html"
    bad.write_text(text, encoding="utf-8")
    _, console = load(bad, tmp_path / "profile")
    assert len(console) == 1 and "Content Security Policy" in console[0], console


def test_a_missing_chromium_fails_naming_make_browser(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match="make browser"):
        chromium()


def test_a_kvarn_pick_named_with_its_128_star_reads_back(run):
    """KVarN's own tail prints 128* (escaped \\* in Markdown): a pick ending in it is read whole, not
    cut at the star (the study's Gemma 3 picks kvarn6-kvarn6 t128*)."""
    from kvarn.report import advise as A

    summary = run["summary"].filter(pl.col("k_type").str.starts_with("kvarn"))  # only KVarN cells: a KVarN pick
    res = run["root"] / "results"
    answers = A.advise(summary, A.token_dirs(summary, res), models=["gemma3-270m"], n_boot=BOOT,
                       tol=A.Tolerance(max_kld=1.0, min_same_top=0.0))
    assert answers[0].pick is not None and A.name_of(answers[0].pick).endswith("t128*")
    html = answer_html(A.answers_markdown(answers), A.frontier_frame(answers))
    assert 'id="answer-gemma3-270m"' in html
