"""`snakemake --report` renders for a config with free-running decode jobs (config/matrix-512.yaml):
every report() output has its caption (workflow/report/{figure}.rst), the decode figure's too.
The outputs are faked (empty files + --touch, tests/test_workflow.py's `fake_done`); the
report only needs them to exist and their captions to render."""

from pathlib import Path

import pytest
import yaml

from test_workflow import fake_done, smk, workflow_copy

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_report_renders_with_decode_jobs(tmp_path):
    cfg = yaml.safe_load((ROOT / "config" / "matrix-512.yaml").read_text())
    assert any(m.get("decode") for m in cfg["models"]), "matrix-512.yaml should hold decode jobs"
    cfg = {k: v for k, v in cfg.items() if k not in ("text", "model_cache")}
    wd = workflow_copy(tmp_path, cfg)
    fake_done(wd)
    smk(wd, "--report", "report.html", timeout=900)
    html = (wd / "report.html").read_text(errors="replace")
    assert "Free-running decode (greedy, or sampled" in html and "claims, computed from this run" in html
