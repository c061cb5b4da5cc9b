"""bench/gpu/device_run.py, the one prepared device call: `--smoke` runs every step end to end on CPU
(tiny shapes, flex eager) with polars unimportable, as on the GPU machine; a step past its
deadline is killed and what it finished is kept; the in-memory baseline gives the engine's own
numbers; the carry fits the call's 64 MiB."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from blocked_imports import blocked_env
from paths import WIKI_TEXT

from bench.gpu import device_flex, device_models, device_plan, device_record
from bench.gpu import device_run as dr

ROOT = Path(__file__).resolve().parents[1]

def _no_polars_env(tmp_path: Path) -> dict:
    """polars absent as far as imports can tell (the GPU machine has none)."""
    return blocked_env(tmp_path, ("polars",), "the device has no polars")


def _records(results: Path) -> list[dict]:
    return [json.loads(line) for line in (results / "device_run.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.skipif(not WIKI_TEXT.is_file(), reason="wiki.test.raw not available")
def test_smoke_runs_every_step_in_order_without_polars(tmp_path):
    env = _no_polars_env(tmp_path)
    blocked = subprocess.run([sys.executable, "-c", "import polars"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "blocked" in blocked.stderr  # the block is real
    results = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "bench.gpu.device_run", "--smoke", "--results", str(results),
                        "--text", str(WIKI_TEXT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = _records(results)
    # the most important answers first: Qwen 64k, Gemma 16k, flex at head dim 512, the Triton tests
    steps = [r["step"] for r in recs]
    assert [s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1]] == [
        "run", "qwen3.6-27b", "gemma4-31b", "flex", "triton", "run"]
    # no step failed, was skipped or killed (each would have a line of its own)
    assert [(r["step"], r["item"]) for r in recs if r["step"] not in ("flex", *device_plan.MODELS)] == [
        ("run", "machine"), ("triton", "KVarN Triton GPU tests"), ("run", "projection"), ("run", "done")]
    # the first line: the import check passed, with the versions imported and where they came from
    first = recs[0]
    assert first["item"] == "machine" and first["smoke"] and first["polars"] is not None
    imports = first["imports"]
    assert imports["ok"] is True and imports["problems"] == [] and not imports["carried_site"]
    import torch
    import transformers

    assert first["torch"] == torch.__version__ and first["transformers"] == transformers.__version__
    for module in ("torch", "transformers", "tokenizers", "huggingface_hub", "safetensors", "regex"):
        assert imports["packages"][module]["from"] == "image" and imports["packages"][module]["version"], module
    assert set(imports["modules"].values()) == {"ok"}
    # the model steps: Qwen, then Gemma; per run a warm-up line, then its chunk's line
    for model in device_plan.MODELS:
        runs = [r for r in recs if r["step"] == model and "kind" in r]
        assert [(r["item"], r["phase"]) for r in runs] == [
            (label, phase) for label, _, _ in device_plan.RUNS for phase in ("warm-up", "chunk")]
        chunks = runs[1::2]
        for w, r, (_, cell, _) in zip(runs[::2], chunks, device_plan.RUNS):
            assert w["status"] == "ok" and w["warmup_s"] == r["warmup_s"] > 0 and "s_per_chunk" not in w, w
            assert r["status"] == "ok" and r["s_per_chunk"] > 0, r
            k, v, tail = cell or ("bf16", "bf16", 0)
            assert r["cell"].startswith(f"{k}-{v}-t{tail}") and r["compute"] == first["compute"], r
            assert r["n_ctx"] == device_plan.SMOKE["n_ctx"] and r["graphs_compiled_in_chunk"] is not None
        # each run after the first was estimated from the last timed chunk, not from its warm-up
        assert "est_s" not in chunks[0]
        for prev, r in zip(chunks, chunks[1:]):
            want = round(device_plan.WARMUP_EST_S + device_plan.CHUNK_FACTOR * prev["wall_s"], 1)
            assert r["est_s"] == want, (prev, r)
        base = chunks[0]
        # the smoke's chunk has fewer rows than --encode-rows: every row encoded, nothing extrapolated
        assert base["encode_rows"] == device_plan.SMOKE["n_ctx"] - 1 - device_plan.SMOKE["n_ctx"] // 2
        assert base["encode_s_chunk"] == pytest.approx(base["encode_s"]) and base["kept_bytes"] > 0
    load = next(r for r in recs if r["step"] == "qwen3.6-27b" and r["item"] == "load")
    assert load["linear_attention"].endswith("chunk_gated_delta_rule")
    # flex: head dim 512 only, the TF32 case first, each timed apart from its first call; the TF32
    # case compares its output with both P rules (eager on CPU: fp32 dots, so P is not truncated)
    flex = [r for r in recs if r["step"] == "flex"]
    assert [(r["head_dim"], r["dtype"], r["keys"]) for r in flex] == [
        (512, t, k) for t in ("float32", "bfloat16") for k in device_plan.SMOKE["flex_keys"]]
    assert all(r["status"] == "ok" and r["first_call_s"] > 0 and r["per_call_s"] > 0 and r["finite"] for r in flex)
    tf32 = [r for r in flex if r.get("tf32")]
    assert len(tf32) == len(device_plan.SMOKE["flex_keys"]) and all(r["p_rule"]["closer"] == "nearest" for r in tf32)
    assert all(abs(r["p_rule"]["truncate"]["mean"]) > 10 * abs(r["p_rule"]["nearest"]["mean"]) for r in tf32)
    triton = next(r for r in recs if r["step"] == "triton")
    assert triton["status"] == "ok" and triton["failed"] == 0 and triton["passed"] + triton["skipped"] == 26
    proj = next(r for r in recs if r["item"] == "projection")
    assert set(proj["measured"]) == set(device_plan.MODELS)
    assert all(set(v) == {"baseline", "kvarn", "standard tail", "standard t0"} for v in proj["measured"].values())
    md = (results / "device_run.md").read_text()
    assert "**Smoke run**" in md and "Run finished in" in md and "Import check (" in md and ": ok. Found:" in md
    assert md.index("## 1. qwen3.6-27b") < md.index("## 2. gemma4-31b") < md.index("## 3. flex") < md.index("## 4.")
    if importlib.util.find_spec("bench.gpu.projection") is not None:  # item 2's module, filled from the numbers
        assert "error" not in proj and proj["projection"]["total_hours"] > 0
        assert sum(row["source"] == "measured" for row in proj["projection"]["rows"]) == 8
        assert "GPU-hours" in md and "| qwen3.6-27b | kvarn |" in md


def test_the_device_path_imports_without_polars_and_the_torch_engine_does_not(tmp_path):
    """kvarn.run.load and kvarn.run.forward (Context, chunk_logprobs, new_cache: what the device run times)
    import where polars does not; the torch engine, which writes a cell's parquet, needs it (the block is
    real) and the device run never imports it."""
    env = _no_polars_env(tmp_path)
    for module, ok in (("kvarn.run.load", True), ("kvarn.run.forward", True), ("kvarn.run.torch_engine", False)):
        p = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, env=env,
                           capture_output=True, text=True)
        assert (p.returncode == 0) == ok, (module, p.stderr[-2000:])
    assert "kvarn.run.torch_engine" not in dr.IMPORT_MODULES


def test_a_zero_budget_skips_every_step_and_says_so(tmp_path):
    results = tmp_path / "out"
    assert dr.main(["--smoke", "--budget-s", "0", "--results", str(results), "--text", str(__file__)]) == 0
    recs = _records(results)
    skipped = [r["step"] for r in recs if r.get("status") == "skipped"]
    assert skipped == [name for name, _ in device_plan.STEPS] == ["qwen3.6-27b", "gemma4-31b", "flex", "triton"]
    assert next(r for r in recs if r["item"] == "projection")["error"] == "nothing measured yet"
    md = (results / "device_run.md").read_text()
    assert md.count("skipped: would start") == 4 and "Not available: nothing measured yet" in md


def test_a_step_past_its_deadline_is_killed_and_keeps_what_it_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(dr, "MIN_START_S", 0.0)
    monkeypatch.setitem(device_plan.STEP_MIN_S, "flex", 0.0)
    rec = device_record.Recorder(tmp_path)
    child = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from pathlib import Path
        from bench.gpu.device_record import Recorder
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        Path({str(tmp_path / 'pids')!r}).write_text(f"{{os.getpid()}} {{grandchild.pid}}")
        Recorder(Path({str(tmp_path)!r})).add({{"step": "flex", "item": "first case", "status": "ok"}})
        time.sleep(120)
    """)
    t = time.perf_counter()
    rc = dr.run_step(rec, "flex", [sys.executable, "-c", child], time.time() + 5)
    assert rc is None and time.perf_counter() - t < 30
    recs = rec.records()
    assert [(r["item"], r["status"]) for r in recs] == [("first case", "ok"), ("step", "killed")]
    md = rec.md.read_text()
    assert "Step flex: killed: still running at the run's deadline" in md
    # the whole process group went, the step's own children too
    for pid in map(int, (tmp_path / "pids").read_text().split()):
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"process {pid} outlived its step")


def test_a_failing_flex_case_is_a_result_and_is_retried_with_small_blocks(tmp_path, monkeypatch):
    import torch

    def kernel(q, k, v, **kw):
        if q.shape[-1] == 512 and q.dtype == torch.float32 and "kernel_options" not in kw:
            raise RuntimeError("out of resource: shared memory, Required: 264192, Hardware limit: 232448")
        return q

    rec = device_record.Recorder(tmp_path)
    args = argparse.Namespace(smoke=True, deadline=time.time() + 120)
    real = device_flex.flex_case
    monkeypatch.setattr(device_flex, "flex_case", lambda _k, case, device, dtype, repeats=1:
                        real(kernel, case, device, dtype, 1))
    device_flex.step_flex(args, rec)
    recs = rec.records()
    n = len(device_plan.SMOKE["flex_keys"])
    assert len(recs) == 2 * n + n
    failed = [r for r in recs if r["status"] == "error"]
    assert [(r["head_dim"], r["dtype"]) for r in failed] == [(512, "float32")] * n
    assert all("out of resource: shared memory" in r["error"] for r in failed)
    retries = [r for r in recs if r.get("small_blocks")]
    assert [r["item"] for r in retries] == [f"D512 float32 (TF32 dots) {k} keys small blocks"
                                            for k in device_plan.SMOKE["flex_keys"]]
    assert all(r["status"] == "ok" for r in retries)
    assert "out of resource: shared memory" in rec.md.read_text()


@pytest.mark.skipif(not WIKI_TEXT.is_file(), reason="wiki.test.raw not available")
def test_the_kept_baseline_gives_the_engines_own_numbers(tmp_path, one_thread):
    """time_baseline + time_cell (nothing written) against kvarn.run.torch_engine.run_baseline (the dump
    on disk) + run_cell: the same packed bytes, the same per-token metrics bit for bit."""
    import numpy as np
    import polars as pl

    from kvarn.baseline import dump
    from kvarn.run import forward, load, torch_engine
    from kvarn.vocab.cell import CellSpec
    from kvarn.weights.sources import ModelSpec

    cfg = device_models.tiny_config(ROOT / "config" / "models" / "gemma4-31b.json", tmp_path / "tiny.json")
    spec, n_ctx, ubatch = ModelSpec("tiny", f"random:{cfg}"), 256, 64
    common = dict(text=str(WIKI_TEXT), device="cpu", dtype="float32", cache_dir=tmp_path / "models")
    ctx = load.Context(spec, n_ctx, 1, **common, ubatch=ubatch, baseline=True)
    cell = CellSpec("q4_0", "q4_0", 8)
    torch_engine.run_baseline(spec, n_ctx, 1, tmp_path / "base.kvd", ubatch=ubatch, **common, context=ctx, attention="ref")
    torch_engine.run_cell(spec, n_ctx, 1, cell, tmp_path / "base.kvd", tmp_path / "cell", ubatch=ubatch, **common,
                    context=ctx, attention="ref")
    want = pl.read_parquet(tmp_path / "cell" / "tokens.parquet")

    ids, model = ctx.chunk_ids[0], ctx.loaded.model
    kept, timing = device_models.time_baseline(model, ids, forward.baseline_cell(), "ref", ubatch, 1024, lambda: None)
    on_disk = dump.open_dump(tmp_path / "base.kvd")
    assert kept.n == on_disk.n_scored and timing["encode_rows"] == kept.n
    stored = np.asarray(on_disk.payload[:on_disk.header["payload_bytes"]])
    assert np.array_equal(np.asarray(kept.dump.payload), stored)
    got_timing, cols = device_models.time_cell(model, ids, cell, "ref", ubatch, kept, lambda: None)
    for key in ("kld", "nll", "nll_base", "dp", "same_top"):
        assert np.array_equal(cols[key], want[key].to_numpy()), key
    assert got_timing["s_per_chunk"] >= got_timing["forward_s"] > 0

    # fewer rows kept than the chunk has: row r reads kept row r mod n, whole slices
    few, t = device_models.time_baseline(model, ids, forward.baseline_cell(), "ref", ubatch, 64, lambda: None)
    assert few.n == 64 and t["encode_s_chunk"] == pytest.approx(t["encode_s"] * kept.n / 64)
    assert few.decode(0, 64, 128).equal(on_disk.decode(0, 0, 64))
    assert few.decode(0, 192, 255).equal(on_disk.decode(0, 0, 63))


def test_triton_record_reads_the_log_even_after_a_kill(tmp_path):
    log = tmp_path / "t.log"
    log.write_text("tests/test_kvarn_triton.py::test_gpu_quantize_pack_full[2-shape0] PASSED [  3%]\n"
                   "tests/test_kvarn_triton.py::test_gpu_quantize_pack_full[3-shape0] FAILED [  7%]\n"
                   "tests/test_kvarn_triton.py::test_gpu_quantize_pack_full[4-shape0] PASSED [ 11%]\n")
    r = dr.triton_record(log, None, 12.0)
    assert (r["status"], r["passed"], r["failed"], r["skipped"]) == ("killed", 2, 1, 0)
    assert dr.triton_record(log, 1, 3.0)["status"] == "error"


def test_without_the_projection_module_the_rest_still_renders(monkeypatch):
    import bench.gpu

    monkeypatch.setitem(sys.modules, "bench.gpu.projection", None)  # import fails as for a missing module
    # and the package forgets the submodule another test may have imported (else `from bench.gpu
    # import projection` finds it there and never asks sys.modules)
    monkeypatch.delattr(bench.gpu, "projection", raising=False)
    recs = [{"step": "run", "item": "machine", "gpu": "NVIDIA H100 80GB HBM3, 81559 MiB, 580"},
            {"step": "qwen3.6-27b", "item": "baseline", "kind": "baseline", "status": "ok", "s_per_chunk": 42.0}]
    proj = device_record.projection(recs)
    assert proj["device"] == "h100" and proj["measured"] == {"qwen3.6-27b": {"baseline": 42.0}}
    assert proj["error"].startswith("bench/gpu/projection.py not importable")
    md = device_record.render(recs)
    assert "Not available: bench/gpu/projection.py not importable" in md and "| baseline |" in md


def test_the_carry_fits_the_call(tmp_path):
    """What a device call copies (the checkout as git sees it, ignored files aside) plus .gpu
    (bench/gpu/prepare.sh's; where it was not prepared here, the 32.0 MiB it measured) stays
    under the call's 64 MiB, and prepare.sh fetches no polars."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())
    gpu_dir = ROOT / ".gpu"
    gpu = (sum(p.stat().st_size for p in gpu_dir.rglob("*") if p.is_file()) if gpu_dir.is_dir()
           else int(32.0 * 2**20))
    assert tree + gpu < 64 * 2**20, (tree / 2**20, gpu / 2**20)
    assert "polars" not in (ROOT / "bench" / "gpu" / "prepare.sh").read_text().split("pip download")[1].split("\n")[2]
    if gpu_dir.is_dir():
        assert not list(gpu_dir.glob("wheels/polars*"))
    ignored = subprocess.run(["git", "check-ignore", "-q", ".gpu/wheels/x.whl"], cwd=ROOT)
    assert ignored.returncode == 0  # .gpu stays out of git


def test_tiny_config_keeps_the_layer_pattern(tmp_path):
    for name in device_plan.MODELS:
        study = json.loads((ROOT / "config" / "models" / f"{name}.json").read_text())
        tiny = json.loads(device_models.tiny_config(ROOT / "config" / "models" / f"{name}.json", tmp_path / "t.json")
                          .read_text())
        assert tiny["model_type"] == study["model_type"] and tiny["num_hidden_layers"] == 8
        assert set(tiny["layer_types"]) == set(study["layer_types"]) and len(tiny["layer_types"]) == 8


def test_the_linear_attention_kernel_is_read_from_transformers():
    """Without flash-linear-attention (CPU here) transformers' Qwen 3.5 layers fall back to its torch
    reference; the report names what was actually bound, not what is installed."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    name = device_models.linear_attention_kernel()
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
    pkg = tmp_path / "fla" / "ops" / "gated_delta_rule"
    pkg.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text('__version__ = "0.6.0"\n')
    (tmp_path / "fla" / "ops" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("def chunk_gated_delta_rule(q, k, v, g=None, beta=None, **kw):\n"
                                     "    raise NotImplementedError\n")
    code = "from bench.gpu import device_models\nprint(device_models.linear_attention_kernel())\n"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "fla.ops.gated_delta_rule.chunk_gated_delta_rule", out.stderr
