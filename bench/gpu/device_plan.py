"""The device run's plan (bench/gpu/device_run.py): the models and runs in the order they are
measured, the steps with the seconds each needs at least, the run's budget and the estimates its
deadline is planned with (stated in docs/notes/scale.md's timeline), and the smoke run's shapes.
"""

from __future__ import annotations

from bench.gpu.article import STUDY

MODELS = {m: STUDY[m] for m in ("qwen3.6-27b", "gemma4-31b")}  # run in this order, at the study's n_ctx
# (label, (k, v, tail) or None for the baseline, the projection's kind); most needed first
RUNS = [("baseline", None, "baseline"), ("q4_0 t128", ("q4_0", "q4_0", 128), "standard tail"),
        ("kvarn4", ("kvarn4", "kvarn4", 0), "kvarn"), ("q8_0 t0", ("q8_0", "q8_0", 0), "standard t0")]
# The steps in order of importance, each with the seconds it needs at least to answer anything
# (start, imports, load or compile, one run): with less left before the run's deadline it is
# skipped and the next one gets the time. Estimates, stated in docs/notes/scale.md's timeline.
STEPS = [("qwen3.6-27b", 150.0), ("gemma4-31b", 120.0), ("flex", 40.0), ("triton", 30.0)]
STEP_MIN_S = dict(STEPS)
BUDGET_S = 380.0  # the run's seconds by default: device_run.sh passes what its 7 minutes leave after the install
SMOKE_BUDGET_S = 1200.0  # --smoke on a shared CPU: its tiny steps are quick, its compiles and imports are not
MIN_START_S = 10.0  # a step (or run) with less than this left before the deadline is skipped
WARMUP_EST_S = 40.0  # a cell's warm-up after the baseline's: its own kernels and flex mask (estimate)
CHUNK_FACTOR = 1.25  # a cell's chunk against the last timed one: decode + metrics on top (estimate)
SMOKE = {"n_ctx": 256, "ubatch": 64, "flex_keys": (512,), "flex_queries": 64, "flex_heads": (2, 1), "repeats": 1}
