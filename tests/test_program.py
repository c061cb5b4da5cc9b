"""Engine llama.cpp (kvarn.llamacpp_engine): a real upstream llama.cpp build runs a small matrix through the DAG.

The build is the pinned upstream source (llama-cpp-python's vendored llama.cpp from PyPI), built
for this CPU once per machine (`python -m kvarn.llamacpp_engine.build`, which `make test` runs first; a
missing compiler or source fails here, it is never skipped). SmolLM2 at n_ctx 1024, 2 chunks:
q8_0 and q4_0 at tail 0, q4_0 with the rotation off. Checked against the program itself:

* the baseline's KLD base file is llama-perplexity's own, byte for byte;
* every cell's summary, computed by kvarn over the per-token records, prints what
  llama-perplexity --kl-divergence prints for the same cell (to its last printed digit);
* the KV buffers the program printed equal kvarn's packed accounting of the same cell;
* the torch engine's llamacpp-cpu cells on the same tokens agree within 10 % (median and mean);
* what the build cannot run (KVarN types, a tail) is refused before any work, with its own list.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import polars as pl
import pytest

from kvarn.plan import matrix as kvm
from kvarn.plan import paths as kvp
from kvarn.llamacpp_engine import build as pbuild
from kvarn.llamacpp_engine import runner
from kvarn.llamacpp_engine.settings import Settings
from kvarn.vocab.cell import CellSpec
from paths import CACHE_DIR, WIKI_TEXT
from test_workflow import ROOT, plan, smk, workflow_copy

pytestmark = pytest.mark.xdist_group("program")

CTX, CHUNKS = 1024, 2
MODEL = "smollm2-llama"
ARGS = ["--no-repack"]  # as bench/oracles/llamacpp: no AMX repacking (SIGILL on some CPUs); both runs alike
CONFIG = {
    "models": [{"name": MODEL, "source": "embedded:smollm2-135m", "n_ctx": [CTX], "chunks": CHUNKS,
                "engine": {"name": "llama.cpp", "build": "upstream", "args": ARGS}}],
    "cells": [{"types": ["q8_0", "q4_0"], "tail": 0}, {"types": ["q4_0"], "tail": 0, "rot": False}],
}
CELLS = ("q8_0-q8_0-t0", "q4_0-q4_0-t0", "q4_0-q4_0-t0-norot")
RUN = f"results/{MODEL}/ctx{CTX}-c{CHUNKS}"


@pytest.fixture(scope="module")
def upstream() -> pbuild.Build:
    return pbuild.read_build(pbuild.build_path(pbuild.UPSTREAM))  # builds it if this machine has none yet


@pytest.fixture(scope="module")
def dag(upstream, tmp_path_factory) -> Path:
    """The matrix through the whole DAG (baseline, cells, summary, claims, report) at two threads."""
    wd = workflow_copy(tmp_path_factory.mktemp("program"), CONFIG, model_cache=CACHE_DIR)
    smk(wd, "--cores", "2", "--resources", "gpu=1", timeout=900)
    return wd


def perplexity(b: pbuild.Build, *args, env=None) -> str:
    gguf = next((CACHE_DIR / "smollm2-135m").glob("*.gguf"))
    cmd = [str(b.perplexity), "-m", str(gguf), "-c", str(CTX), "-b", str(CTX), "-ub", "512", "-t", "2", "-fa", "on",
           "-ngl", "0", *ARGS, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def percentile_slack(tokens: pl.DataFrame, key: str) -> float:
    """How far llama-perplexity's percentile may sit from kvarn's besides printing: it interpolates at
    fraction·(n−1) computed in float32 (0.99f is not 0.99), kvarn in float64, so the interpolation
    weight differs by up to |f32(f) − f|·(n−1) + one float32 ulp of the position, times the gap
    between the two neighbouring values."""
    import numpy as np

    from kvarn.stats.metrics import DP_LADDER, KLD_LADDER

    col, _, name = key.partition("_")
    ladder = dict(KLD_LADDER if col == "kld" else DP_LADDER)
    if name not in ladder:
        return 0.0
    v = np.sort(tokens[col].to_numpy())
    f, n = ladder[name], len(v)
    pos = f * (n - 1)
    i = int(pos)
    gap = v[min(i + 1, n - 1)] - v[i]
    dw = abs(float(np.float32(f)) - f) * (n - 1) + float(np.spacing(np.float32(pos)))
    return dw * gap * 1.01


@pytest.mark.slow
def test_the_baseline_is_llama_perplexity_s_own_base_file(dag, upstream, tmp_path):
    ours = dag / RUN / kvp.PROGRAM_BASELINE
    perplexity(upstream, "-f", str(WIKI_TEXT), "--chunks", str(CHUNKS), "-ctk", "bf16", "-ctv", "bf16",
               "--kl-divergence-base", str(tmp_path / "ref.kld"))
    assert ours.read_bytes() == (tmp_path / "ref.kld").read_bytes()
    ident = json.loads(Path(f"{ours}.json").read_text())
    assert ident["build"] == upstream.identity() and ident["threads"] == 2 and ident["batch"] == CTX


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
def test_each_cell_prints_what_llama_perplexity_prints(dag, upstream, cell):
    spec = CellSpec.from_name(cell)
    args, env = runner.cell_args(upstream, spec)
    import os

    text = perplexity(upstream, *args, "--kl-divergence-base", str(dag / RUN / kvp.PROGRAM_BASELINE),
                      "--kl-divergence", env={**os.environ, **env})
    summary = json.loads((dag / RUN / "cells" / cell / "summary.json").read_text())
    tokens = pl.read_parquet(dag / RUN / "cells" / cell / "tokens.parquet")
    for key, (value, unit) in runner.printed_figures(text).items():
        slack = percentile_slack(tokens, key)
        assert abs(summary[key] - value) <= unit * 1.0001 + slack, (key, summary[key], value, unit, slack)
    assert summary["n_tokens"] == CHUNKS * (CTX - 1 - CTX // 2)
    assert tokens.columns == ["chunk", "pos", "kld", "nll", "nll_base", "dp", "same_top"]
    assert tokens["pos"].min() == CTX // 2 and tokens["pos"].max() == CTX - 2
    # the program's KV buffers, as printed (2 decimals), are kvarn's packed accounting of the cell
    assert abs(summary["kv_program_mib"] - summary["kv_total_bytes"] / 2**20) <= 0.005 + 1e-9
    assert summary["prefill_tokens_per_s"] > 0 and summary["engine_build"] == upstream.version
    assert summary["self_check"]["checked"] and summary["self_check"]["ok"]  # upstream: bit-identical at 1 and 2 threads


@pytest.mark.slow
def test_the_rotation_switch_reaches_the_program(dag):
    """LLAMA_ATTN_ROT_DISABLE=1 for rot false: the unrotated q4_0 cell is a different (worse) cell."""
    rows = {r["cell"]: r for r in pl.read_parquet(dag / "results" / "summary.parquet").iter_rows(named=True)}
    assert sorted(rows) == sorted(CELLS)
    assert rows["q4_0-q4_0-t0-norot"]["kld_median"] > 1.5 * rows["q4_0-q4_0-t0"]["kld_median"]
    assert rows["q8_0-q8_0-t0"]["kld_median"] < rows["q4_0-q4_0-t0"]["kld_median"]
    assert all(r["engine"] == "llama.cpp" for r in rows.values())
    assert (dag / "results" / "claims.md").is_file()  # the claims and the report take llama.cpp cells
    assert (dag / "results" / "figures" / MODEL / "pareto.png").is_file()


@pytest.mark.slow
def test_the_torch_engine_s_llamacpp_cpu_cells_agree_within_10_percent(dag, tmp_path):
    """The torch engine's emulation of llama.cpp's CPU arithmetic on the same tokens, its own baseline."""
    from kvarn.run import torch_engine
    from kvarn.weights.sources import parse_model

    spec = parse_model("smollm2-135m")
    base = torch_engine.run_baseline(spec, CTX, CHUNKS, tmp_path / "base.kvd", text=str(WIKI_TEXT),
                               compute="llamacpp-cpu", cache_dir=str(CACHE_DIR))
    assert base["n_chunks"] == CHUNKS
    for cell in CELLS:
        c = CellSpec.from_name(cell)
        torch_cell = torch_engine.run_cell(spec, CTX, CHUNKS, CellSpec(c.k, c.v, c.tail, rot=c.rot, compute="llamacpp-cpu"),
                                     tmp_path / "base.kvd", tmp_path / cell, text=str(WIKI_TEXT),
                                     cache_dir=str(CACHE_DIR))
        ours = json.loads((dag / RUN / "cells" / cell / "summary.json").read_text())
        for key in ("kld_median", "kld_mean"):
            assert abs(torch_cell[key] / ours[key] - 1) < 0.10, (cell, key, torch_cell[key], ours[key])


def test_what_upstream_cannot_run_is_refused_with_its_own_list(upstream):
    with pytest.raises(runner.Refused, match=r"does not accept --cache-type-k kvarn4; its --help allows: f32, f16"):
        runner.cell_args(upstream, CellSpec("kvarn4", "kvarn4", 0))
    with pytest.raises(runner.Refused, match=r"tail 128: .* has no --kv-tail-tokens"):
        runner.cell_args(upstream, CellSpec("q4_0", "q4_0", 128))
    with pytest.raises(runner.Refused, match="compute 'llamacpp-cpu' is an arithmetic of the torch engine"):
        runner.cell_args(upstream, CellSpec("q4_0", "q4_0", 0, compute="llamacpp-cpu"))
    args, env = runner.cell_args(upstream, CellSpec("q4_0", "q8_0", 0, rot=False))
    assert args == ["-ctk", "q4_0", "-ctv", "q8_0"] and env == {"LLAMA_ATTN_ROT_DISABLE": "1"}
    assert runner.cell_args(upstream, CellSpec("f16", "f16", 0, rot=False))[1] == {}  # never rotated anyway


def test_the_build_s_identity_is_read_from_the_build(upstream, tmp_path):
    ident = upstream.identity()
    assert ident["commit"] and ident["version"].startswith("version: ") and ident["backend"].startswith("CPU")
    assert ident["libraries"] and all(len(h) == 64 for h in ident["libraries"].values())
    assert "q4_0" in upstream.cache_types and "kvarn4" not in upstream.cache_types
    with pytest.raises(pbuild.BuildError, match="no CMakeCache.txt"):
        pbuild.read_build(tmp_path)
    assert "unavailable" in pbuild.plan_identity(str(tmp_path))
    with pytest.raises(pbuild.BuildError, match="not available when this run was planned"):
        pbuild.require({"unavailable": "x"}, upstream)


def test_a_cell_refuses_a_baseline_of_other_settings(upstream):
    s = Settings()
    a = runner.run_identity(upstream, s, 2, 512, CTX, "w", "t")
    runner.check_identity(a, a, "base")
    b = runner.run_identity(upstream, s, 1, 512, CTX, "w", "t")
    with pytest.raises(ValueError, match="threads is 2 there but 1 in this cell"):
        runner.check_identity(a, b, "base")
    c = runner.run_identity(upstream, Settings(env={"GGML_KVARN_WINDOW_CHUNK": "4"}), 2, 512, CTX, "w", "t")
    with pytest.raises(ValueError, match="env is"):
        runner.check_identity(a, c, "base")


@pytest.mark.parametrize("opt,value", [("sink", 128), ("tail_dtype", "f16"), ("compute", "llamacpp-cpu")])
def test_the_matrix_refuses_options_the_program_has_not(opt, value):
    cfg = {"models": CONFIG["models"], "cells": [{"types": ["q4_0"], "tail": 128, opt: value}]}
    with pytest.raises(kvm.MatrixError, match=rf"cells\[0\]\.{opt}: .* runs engine llama.cpp"):
        kvm.expand(cfg)
    with pytest.raises(kvm.MatrixError, match=r"models\[0\]\.engine: unknown key\(s\) \['threds'\]"):
        kvm.expand({"models": [{**CONFIG["models"][0], "engine": {"name": "llama.cpp", "threds": 2}}],
                    "cells": CONFIG["cells"]})


def test_the_study_as_it_ran_plans(tmp_path):
    """config/study-program.yaml: BeeLlama, the Q5_K_S GGUFs, 48 standard pairs at tails 0 and 128,
    15 KVarN pairs, the tail sweep; planned without the build or the weights."""
    import yaml

    cfg = yaml.safe_load((ROOT / "config" / "study-program.yaml").read_text())
    m = kvm.expand(cfg)
    per_model = 48 * 2 + 15 + 12 * 2
    assert len(m.cells) == 2 * per_model and all(c.engine == "llama.cpp" for c in m.cells)
    wd = workflow_copy(tmp_path, {k: v for k, v in cfg.items() if k not in ("text", "model_cache")})
    jobs = plan(wd, "--config", "allow_unpinned=true")
    assert jobs["cell_program"] == 2 * per_model and jobs["baseline_program"] == 2


def test_the_fit_table_adds_weights_kv_and_reserve_and_says_which_cells_fit():
    """kvarn.plan.fit on the study as it ran: the KV is the program's own accounting (beellama-qwen /
    beellama-gemma, which reproduce the study's printed MiB: tests/test_memory.py), plus the GGUF and a reserve."""
    import yaml

    from kvarn.budget import memory
    from kvarn.plan import fit
    from kvarn.vocab.geometry import config_object, geometry_from_config

    m = kvm.expand(yaml.safe_load((ROOT / "config" / "study-program.yaml").read_text()))
    geoms = {name: geometry_from_config(config_object(json.loads((ROOT / "config" / "models" / f).read_text())))
             for name, f in (("qwen3.6-27b-q5ks", "qwen3.6-27b.json"), ("gemma4-31b-q5ks", "gemma4-31b.json"))}
    weights = {name: 20 * fit.GIB for name in geoms}
    rows = fit.fit_rows(m, geoms, weights, device_bytes=24 * fit.GIB)
    assert len(rows) == len(m.cells)
    by = {(r["model"], r["cell"]): r for r in rows}
    q8 = by[("qwen3.6-27b-q5ks", "q8_0-q8_0-t0")]
    cell = next(c for c in m.cells if c.model == "qwen3.6-27b-q5ks" and c.name == "q8_0-q8_0-t0")
    assert q8["kv_bytes"] == memory.kv_bytes(geoms["qwen3.6-27b-q5ks"], 65536, cell.spec, 512, "beellama-qwen").total
    assert q8["total_bytes"] == 20 * fit.GIB + q8["kv_bytes"] + int(fit.DEFAULT_RESERVE_GIB * fit.GIB)
    edge = fit.fit_rows(m, geoms, weights, device_bytes=q8["total_bytes"])
    verdict = {(r["model"], r["cell"]): r["fits"] for r in edge}
    assert verdict[("qwen3.6-27b-q5ks", "q8_0-q8_0-t0")]  # exactly the device's memory fits
    assert not {(r["model"], r["cell"]): r["fits"] for r in fit.fit_rows(
        m, geoms, weights, device_bytes=q8["total_bytes"] - 1)}[("qwen3.6-27b-q5ks", "q8_0-q8_0-t0")]
    # a lighter cache fits where q8_0 does not
    assert by[("qwen3.6-27b-q5ks", "q2_0-q2_0-t0")]["kv_bytes"] < q8["kv_bytes"]
    with pytest.raises(ValueError, match="no weights size"):
        fit.fit_rows(m, geoms, {}, device_bytes=24 * fit.GIB)


def test_decode_speed_comes_from_the_build_s_bench_tool(upstream, tmp_path):
    gguf = next((CACHE_DIR / "smollm2-135m").glob("*.gguf"))
    s = Settings(args=tuple(ARGS), decode_depths=(0, 1), decode_tokens=4)
    speed = runner.decode_speed(upstream, s, CellSpec("q4_0", "q4_0", 0), gguf, 256, 256, 2, tmp_path / "bench.log")
    assert sorted(speed) == [0, 256] and all(ts > 0 and sd >= 0 for ts, sd in speed.values())
    assert "-ctk q4_0" in (tmp_path / "bench.log").read_text()
    assert runner.decode_speed(upstream, Settings(), CellSpec("q4_0", "q4_0", 0), gguf, 256, 256, 2,
                               tmp_path / "none.log") == {}


def test_a_context_beyond_the_trained_one_is_refused_before_the_program_runs(upstream, tmp_path, monkeypatch):
    from kvarn.budget.preflight import PreflightError
    from kvarn.weights.sources import parse_model

    monkeypatch.delenv("KVARN_ALLOW_LONG_CONTEXT", raising=False)
    engine = {"settings": Settings(build="upstream").as_param(), "build": upstream.identity()}
    with pytest.raises(PreflightError, match=r"n_ctx 16384 is beyond the model's trained context .*8192"):
        runner.baseline_job(parse_model("smollm2-135m"), CACHE_DIR, WIKI_TEXT, 16384, 1, 512, engine, 2,
                            tmp_path / "base.kld")
    assert not any(tmp_path.iterdir())  # nothing written
