"""bench/gpu/device_run.py's order and budget (issue 54, item 1): the steps in order of importance,
a run after the first estimated from the last timed chunk (never from a warm-up's compiles), a
warm-up's line kept where its chunk never ended, a subset of the steps for a second try. The
smoke run in tests/test_bench_gpu_device_run.py checks the same on the real steps."""

from __future__ import annotations

import pytest

from bench.gpu import device_flex as dflex
from bench.gpu import device_models as dmodels
from bench.gpu import device_plan as dplan
from bench.gpu import device_run as dr
from bench.gpu import device_record as drec


def test_the_steps_come_in_order_of_importance():
    assert [name for name, _ in dplan.STEPS] == ["qwen3.6-27b", "gemma4-31b", "flex", "triton"]
    assert [label for label, _, _ in dplan.RUNS] == ["baseline", "q4_0 t128", "kvarn4", "q8_0 t0"]
    assert list(dplan.MODELS) == ["qwen3.6-27b", "gemma4-31b"] and list(dflex.FLEX_HEADS) == [512]


def test_the_next_run_is_estimated_from_the_last_timed_chunk():
    # the first run of a step: no estimate, it starts while MIN_START_S is left
    assert dmodels.next_run(300.0, None) == (None, None)
    est, why = dmodels.next_run(dplan.MIN_START_S - 1, None)
    assert est is None and why.startswith(f"{dplan.MIN_START_S - 1:.0f} s left")
    # after a chunk of 20 s (whatever its warm-up took): warm-up allowance + 1.25 x 20 s
    want = dplan.WARMUP_EST_S + dplan.CHUNK_FACTOR * 20.0
    assert dmodels.next_run(want + 1, 20.0) == (want, None)
    est, why = dmodels.next_run(want - 1, 20.0)
    assert est == want and why == (f"estimated {want:.0f} s (warm-up {dplan.WARMUP_EST_S:.0f} + {dplan.CHUNK_FACTOR} x "
                                   f"the last timed chunk's 20.0 s), {want - 1:.0f} s left before the run's deadline")


RECS = [{"step": "run", "item": "machine", "gpu": "NVIDIA H100 80GB HBM3, 81559 MiB, 580", "smoke": False,
         "imports": {"ok": True, "s": 9.0, "problems": [],
                     "packages": {"torch": {"version": "2.11.0+cu130", "from": "image"},
                                  "transformers": {"version": "5.24.0", "from": "carried"}}}},
        {"step": "qwen3.6-27b", "item": "load", "status": "ok", "s": 31.0, "peak_device_bytes": 56 * 2**30},
        {"step": "qwen3.6-27b", "item": "baseline", "kind": "baseline", "phase": "warm-up", "status": "ok",
         "cell": "bf16-bf16-t0-tf32_attn", "warmup_s": 151.0, "peak_device_bytes": 60 * 2**30},
        {"step": "qwen3.6-27b", "item": "baseline", "kind": "baseline", "phase": "chunk", "status": "ok",
         "cell": "bf16-bf16-t0-tf32_attn", "warmup_s": 151.0, "s_per_chunk": 21.0, "wall_s": 19.0,
         "forward_s": 15.0, "tokens_per_s": 4369.0, "peak_device_bytes": 66 * 2**30},
        {"step": "qwen3.6-27b", "item": "q4_0 t128", "kind": "standard tail", "phase": "warm-up", "status": "ok",
         "cell": "q4_0-q4_0-t128-tf32_attn", "warmup_s": 38.0, "est_s": 63.8, "peak_device_bytes": 61 * 2**30},
        {"step": "qwen3.6-27b", "item": "step", "status": "killed", "s": 300.0, "why": "still running"}]


def test_a_chunk_killed_after_its_warmup_leaves_the_warmups_line():
    """The q4_0 t128 chunk was killed: its warm-up's line shows (seconds, peak), it is no measured
    chunk for the projection, and the baseline's chunk is."""
    assert drec.measured(RECS) == {"qwen3.6-27b": {"baseline": 21.0}}
    md = drec.render(RECS)
    row = next(ln for ln in md.splitlines() if ln.startswith("| q4_0 t128 |"))
    assert "| 38.00 |" in row and "61.00 (warm-up)" in row and "warm-up ok, no chunk line" in row
    base = [ln for ln in md.splitlines() if ln.startswith("| baseline |")]
    assert len(base) == 1 and "| 151.00 | 21.00 | 15.00 |" in base[0]  # one row: the chunk's
    assert "Import check (9 s): ok. Found: torch 2.11.0+cu130 (image), transformers 5.24.0 (carried)." in md
    assert "Step qwen3.6-27b: killed" in md and "Run not finished" in md


def test_a_subset_of_the_steps_for_a_second_try(tmp_path):
    results = tmp_path / "out"
    assert dr.main(["--smoke", "--budget-s", "0", "--steps", "triton,flex", "--results", str(results),
                    "--text", __file__]) == 0
    recs = drec.Recorder(results).records()
    assert recs[0]["steps"] == ["flex", "triton"]  # in the script's order, whatever the command's
    assert [r["step"] for r in recs if r.get("status") == "skipped"] == ["flex", "triton"]
    with pytest.raises(SystemExit):
        dr.main(["--smoke", "--steps", "qwen,flex", "--results", str(results), "--text", __file__])
