"""notebooks/kvarn.ipynb executes headless, against the synthetic results and without any."""

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

sys.path.insert(0, str(Path(__file__).parent))
import synthetic  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "kvarn.ipynb"


def run(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
                   ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    charts = sum("vega" in o.get("data", {}).get("text/html", "") for o in outputs)
    return "\n".join(o.get("text", "") for o in outputs), charts


@pytest.mark.parametrize("present", [True, False], ids=["synthetic", "absent"])
def test_notebook_executes(tmp_path, monkeypatch, present):
    if present:
        synthetic.make_results(tmp_path)
    monkeypatch.setenv("KVARN_SUMMARY", str(tmp_path / "results" / "summary.parquet"))
    text, charts = run(tmp_path)
    if present:
        n = synthetic.make_results(tmp_path / "again").height  # the fixture's cell count
        assert f"{n} cells" in text and charts == 2 * 6  # six figures per model
    else:
        assert "No summary at" in text and charts == 0
