"""notebooks/kvarn.ipynb executes headless on a results folder laid out as `make run` writes it (the
synthetic results of tests/synthetic.py) and shows, in this order, the answer (kvarn.report.advise), the
headline figure, the tail sweep, the ranked figure with its paired statistics and the claims ledger,
each the library's own text or chart for the run the report shows; without results it says so and draws
nothing. The committed notebook, outputs included, stays small enough to read where it is hosted."""

import html
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

sys.path.insert(0, str(Path(__file__).parent))
import synthetic  # noqa: E402

from kvarn import report as R  # noqa: E402
from kvarn.report import advise as A  # noqa: E402
from kvarn.report.claims.ledger import run_claims  # noqa: E402
from kvarn.report.claims.render import claims_markdown  # noqa: E402
from kvarn.report.figures_cells import ranked  # noqa: E402
from kvarn.report.paired_table import run_table  # noqa: E402

pytestmark = pytest.mark.xdist_group("notebook")  # one execution of the notebook shared by the module's tests

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "kvarn.ipynb"
PARAMETERS = ["KVARN_RESULTS", "KVARN_SUMMARY", "KVARN_MODELS", "KVARN_CELLS", "KVARN_CHARTS", "KVARN_BOOT"]
BOOT = 200  # the paired statistics' resamples here, in the notebook as in the library's own results below
MAX_BYTES = 2_000_000  # the committed notebook with its outputs


def execute(results: Path) -> list[dict]:
    """The notebook's outputs, in order, after running it on `results` (its parameters' defaults otherwise)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as mp:
        for name in PARAMETERS:
            mp.delenv(name, raising=False)
        mp.setenv("KVARN_RESULTS", str(results))
        mp.setenv("KVARN_BOOT", str(BOOT))
        NotebookClient(nb, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def markdown(outputs) -> list[str]:
    return [o.get("data", {}).get("text/markdown", "") for o in outputs]


def svgs(outputs) -> list[str]:
    return [html.unescape(o.get("data", {}).get("image/svg+xml", "")) for o in outputs]


def where(texts: list[str], part: str) -> int:
    """The index of the first output holding `part` (a failure names it when none does)."""
    found = [i for i, t in enumerate(texts) if part in t]
    assert found, f"no output of the notebook holds {part[:200]!r}"
    return found[0]


def title(chart) -> str:
    return chart.to_dict()["title"]["text"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The synthetic results (two models, one run each), the notebook's outputs on them, and the library's
    own answer, paired statistics and ledger of the same run."""
    root = tmp_path_factory.mktemp("nb")
    summary = synthetic.make_results(root, n_ctx=256, chunks=2)
    results = root / "results"
    models = list(dict.fromkeys(summary["model"].to_list()))
    prep = {m: R.prepare(summary, m) for m in models}
    dirs = A.token_dirs(summary, results)
    paired = {m: run_table(prep[m], [dirs[(m, c)] / "tokens.parquet" for c in prep[m]["cell"].to_list()],
                           n_boot=BOOT) for m in models}
    return {"outputs": execute(results), "summary": summary, "models": models, "prep": prep, "paired": paired,
            "answers": A.advise(summary, dirs, n_boot=BOOT), "claims": claims_markdown(
                *run_claims(summary, [d / "tokens.parquet" for d in dirs.values()], n_boot=BOOT))}


def test_every_cell_runs_on_the_run(run):
    outputs = run["outputs"]
    assert not [o for o in outputs if o["output_type"] == "error"]
    text = "\n".join(o.get("text", "") for o in outputs)
    assert f"{run['summary'].height} cells, models {run['models']}" in text
    for m in run["models"]:
        assert f"{m}: n_ctx 256, 2 chunks, {run['prep'][m].height} cells, {run['prep'][m].height} of them with tokens" \
            in text


def test_it_opens_with_the_answer_and_its_frontier_tables(run):
    md = markdown(run["outputs"])
    first = where(md, A.answers_markdown(run["answers"]))
    assert first == min(i for i, t in enumerate(md) if t)  # the first thing the notebook shows
    for a in run["answers"]:
        assert A.frontier_markdown(a.frontier) in md[first]


def test_the_figures_and_the_ledger_come_in_order(run):
    """The answer, then every model's headline figure, tail sweep, ranked figure (each with its
    title for that model's run) and the ranked figure's paired statistics, then the ledger."""
    outputs, md, svg = run["outputs"], markdown(run["outputs"]), svgs(run["outputs"])
    answer = where(md, A.answers_markdown(run["answers"]))
    sections = {"pareto": [], "tail_sweep": [], "ranked": []}
    for m in run["models"]:
        p = run["prep"][m]
        sections["pareto"].append(where(svg, title(R.pareto(p))))
        sections["tail_sweep"].append(where(svg, title(R.tail_sweep(p))))
        figure = where(svg, title(ranked(p, run["paired"][m])))
        numbers = where(md, f"**{m}: the paired statistics of the ranked figure**")
        assert numbers == figure + 1  # right under its figure
        sections["ranked"] += [figure, numbers]
    ledger = where(md, run["claims"])
    order = [[answer], *sections.values(), [ledger]]
    for before, after in zip(order, order[1:]):
        assert max(before) < min(after), order
    assert all(outputs[i]["output_type"] == "display_data" for i in sum(order, []))


def test_the_ledger_is_the_runs_claims_with_its_decision_tables(run):
    """The text of results/claims.md for the same run: the ledger with the paired intervals (every
    cell's tokens read), then each model's decision tables."""
    md = markdown(run["outputs"])
    assert md[where(md, run["claims"])] == run["claims"]


def test_the_ranked_figure_has_its_paired_statistics_a_row_per_cell(run):
    md = markdown(run["outputs"])
    for m in run["models"]:
        table = md[where(md, f"**{m}: the paired statistics of the ranked figure**")]
        rows = [line.split(" | ") for line in table.splitlines()[4:]]  # title, blank, header, rule
        paired = run["paired"][m].sort("kld_median")
        assert len(rows) == paired.height == run["prep"][m].height
        assert [r[1] for r in rows] == [f"{r['kld_median']:.3g} [{r['kld_median_lo']:.3g}, {r['kld_median_hi']:.3g}]"
                                        for r in paired.iter_rows(named=True)]  # each cell's median and interval
        assert [r[3] for r in rows] == [b or "–" for b in paired["band"].to_list()]
        assert [r[2] for r in rows if r[3] == "floor"] == ["–"]  # the floor's Δ against itself is not printed


def test_without_results_it_says_so_and_draws_nothing(tmp_path):
    outputs = execute(tmp_path / "results")
    text = "\n".join(o.get("text", "") for o in outputs)
    assert "No summary at" in text and str(tmp_path / "results" / "summary.parquet") in text
    assert not any(svgs(outputs)) and not any(markdown(outputs))
    assert not [o for o in outputs if o["output_type"] == "error"]


def test_the_committed_notebook_is_small_and_its_charts_are_svg():
    """What is committed: under MAX_BYTES with its outputs, no error among them, and every chart an SVG
    (a chart kept as the browser's script shows nothing where the notebook is only read)."""
    assert NOTEBOOK.stat().st_size < MAX_BYTES
    nb = nbformat.read(NOTEBOOK, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert not [o for o in outputs if "<script" in o.get("data", {}).get("text/html", "")
                or any("vegalite" in k for k in o.get("data", {}))]
