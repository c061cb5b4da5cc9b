"""bench/gpu/article.py --smoke: the prepared GPU script's Python part runs end to end on CPU
(tiny configs derived from the study's, one chunk), so it is known to work before a GPU is lent."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from paths import WIKI_TEXT

from bench.gpu import article

ROOT = Path(__file__).resolve().parents[1]
TEXT = WIKI_TEXT



@pytest.mark.skipif(not TEXT.is_file(), reason="wiki.test.raw not available")
def test_smoke_writes_every_run_and_the_projection(tmp_path, one_thread):
    out = tmp_path / "gpu_article.md"
    assert article.main(["--smoke", "--out", str(out), "--text", str(TEXT)]) == 0
    md = out.read_text()
    for model in ("gemma4-31b", "qwen3.6-27b"):
        for run in ("baseline", "q8_0 t0", "q4_0 t128", "kvarn4", "kvarn2"):
            # flex (the projected path) and ref beside it, each against its own baseline
            row = re.search(rf"^\| {re.escape(model)} \| 512 \| {re.escape(run)} \| ([0-9.]+) \| ([0-9.]+) \|",
                            md, re.M)
            assert row and float(row.group(1)) > 0 and float(row.group(2)) > 0, (model, run)
        # 135 article cells per model, each mapped to a measured type (the tail sweep's standard
        # cells at 512 and 1024 counted with the t128 ones, its KVarN cells with KVarN)
        assert re.search(rf"^\| {re.escape(model)} \| 135 \(48 t0, 60 t128, 27 KVarN\) \| \d+ \| \d+ \| [0-9.]+ \|$",
                         md, re.M), md
    assert "Projected total: " in md and "device-hours** (of the tiny smoke models" in md
    # which Gated DeltaNet kernel ran is part of the report (here, without fla: the torch reference)
    assert "layers call `transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule`" in md


def test_a_budget_skips_runs_and_says_so(tmp_path, one_thread):
    if not TEXT.is_file():
        pytest.skip("wiki.test.raw not available")
    out = tmp_path / "gpu_article.md"
    assert article.main(["--smoke", "--models", "gemma4-31b", "--budget-s", "0", "--out", str(out),
                          "--text", str(TEXT)]) == 0
    md = out.read_text()
    assert md.count("skipped (budget)") == 5 and "beside ref (s/chunk only)" in md
    assert "not projected: baseline" in md and "not available" in md


def test_tiny_config_keeps_the_layer_pattern(tmp_path):
    import json

    for name in ("gemma4-31b", "qwen3.6-27b"):
        study = json.loads((ROOT / "config" / "models" / f"{name}.json").read_text())
        tiny = json.loads(article.tiny_config(ROOT / "config" / "models" / f"{name}.json", tmp_path / "t.json")
                          .read_text())
        assert tiny["model_type"] == study["model_type"] and tiny["num_hidden_layers"] == 8
        assert set(tiny["layer_types"]) == set(study["layer_types"]) and len(tiny["layer_types"]) == 8


def test_a_model_that_cannot_load_is_recorded_and_the_script_goes_on(tmp_path, monkeypatch):
    if not TEXT.is_file():
        pytest.skip("wiki.test.raw not available")
    from kvarn.run import engine
    from kvarn.budget.preflight import PreflightError

    def refuse(*a, **k):
        raise PreflightError("estimate 170 GiB > capacity 141 GiB | lower --ctx")

    monkeypatch.setattr(engine, "Context", refuse)
    out = tmp_path / "gpu_article.md"
    assert article.main(["--smoke", "--models", "gemma4-31b", "--out", str(out), "--text", str(TEXT)]) == 0
    md = out.read_text()
    assert md.count("load failed: PreflightError: estimate 170 GiB > capacity 141 GiB / lower --ctx") == 5
    assert "not available" in md


def test_the_linear_attention_kernel_is_read_from_transformers():
    """Without flash-linear-attention (CPU here) transformers' Qwen 3.5 layers fall back to its torch
    reference; the report names what was actually bound, not what is installed."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    name = article.linear_attention_kernel()
    if importlib.util.find_spec("fla") is None:
        assert name == "transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule"
    else:
        assert name.startswith("fla."), name
    assert m.torch_chunk_gated_delta_rule.__code__.co_freevars  # the wrapper whose closure is read


def test_the_kernel_named_is_the_one_transformers_bound(tmp_path):
    """With an `fla` package importable (a stand-in here: flash-linear-attention's layout, no
    kernels), transformers binds Qwen 3.5's chunked gated delta rule to it, and the report names
    that function, not transformers' torch reference. Fresh interpreter: the binding is made at
    import time."""
    import os
    import subprocess
    import sys

    pkg = tmp_path / "fla" / "ops" / "gated_delta_rule"
    pkg.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text('__version__ = "0.6.0"\n')
    (tmp_path / "fla" / "ops" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("def chunk_gated_delta_rule(q, k, v, g=None, beta=None, **kw):\n"
                                     "    raise NotImplementedError\n")
    code = "from bench.gpu import article\nprint(article.linear_attention_kernel())\n"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "fla.ops.gated_delta_rule.chunk_gated_delta_rule", out.stderr
