"""kvarn.retrieval: the defects of issue 53, item 5, each pinned by a test that failed before its fix.

* the report's teacher-forced summary (results/summary.parquet) is a declared input of the report rule;
* scores are grouped by context length, never pooled across lengths;
* the needle's position accounts for KVarN's 128-token sink on full-attention layers (sink / tail / body);
* `correct` is recomputed from the stored generated text by the current answer reader at report time;
* the prompt seed comes from the (task, length, depth, prompt index) values, not from list positions.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("retrieval")
ROOT = Path(__file__).resolve().parents[1]


def _dry(target: str) -> str:
    p = subprocess.run([sys.executable, "-m", "snakemake", target, "-n", "--forceall", "--workflow-profile", "none",
                        "--configfile", "config/retrieval.yaml"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def test_the_teacher_forced_summary_is_a_declared_input_of_the_report():
    """The report reads results/summary.parquet for the median-KLD ordering: snakemake must make it
    (rule summary, from the same cells teacher-forced) before the report and rerun the report after it."""
    out = _dry("results/retrieval/retrieval.md")
    block = out[out.index("rule retrieval_report:"):]
    inputs = re.search(r"^\s+input: (.*)$", block, flags=re.M).group(1).split(", ")
    assert "results/summary.parquet" in inputs
    assert re.search(r"^summary\s+1\s*$", out, flags=re.M), out[-2000:]
