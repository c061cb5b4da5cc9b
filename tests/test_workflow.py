"""The Snakemake workflow: config checks before any job, planning, incrementality, real runs.

Each test runs `snakemake` in a subprocess on a copy of the workflow in a temp directory.
Fast tests only plan (-n) or fake a finished state (empty outputs + --touch, which records
the metadata a real run would). Slow tests run a tiny matrix for real, sharing the repo's
model cache (`model_cache`) so nothing is downloaded twice.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import polars as pl
import pytest
import yaml

from kvarn.plan import matrix as kvm
from kvarn.plan import paths as kvp
from paths import WIKI_TEXT

# One xdist worker: the tiny workflow is run once per module (tiny_done, tiny_run).
pytestmark = pytest.mark.xdist_group("workflow")

ROOT = Path(__file__).resolve().parents[1]
TEXT = WIKI_TEXT
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
OURS = ("fetch_model", "wikitext", "baseline", "cell", "cell_row", "summary", "baseline_program", "cell_program")
# n_ctx 384: KVarN's sink (128) and tail (128) leave part of its body to the scored queries
# (p >= 256 read keys 128..p-128), so the KVarN cell's numbers depend on its body; at 256
# every key a scored query reads would be exact.
CTX = 384
TINY = {
    "models": [{"name": "smollm2-135m", "source": "embedded:smollm2-135m", "n_ctx": [CTX], "chunks": 1}],
    "cells": [
        {"types": ["q8_0"], "tail": 0},
        {"types": ["q4_0"], "tail": 128},
        {"types": ["kvarn4"], "tail": 0},
    ],
}


def workflow_copy(tmp: Path, config: dict, model_cache: Path | None = None) -> Path:
    """A copy of the workflow in tmp/wf with `config` as its config/matrix.yaml."""
    wd = tmp / "wf"
    wd.mkdir()
    shutil.copy(ROOT / "Snakefile", wd)
    for d in ("workflow", "config", "envs"):
        shutil.copytree(ROOT / d, wd / d)
    cfg = {"text": str(TEXT), "model_cache": str(model_cache or tmp / "models"), **config}
    (wd / "config" / "matrix.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return wd


def smk(wd: Path, *args, check=True, timeout=600) -> subprocess.CompletedProcess:
    p = subprocess.run([*SNAKEMAKE, "--directory", str(wd), "--snakefile", str(wd / "Snakefile"),
                        "--workflow-profile", "none", *args],
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def plan(wd: Path, *args) -> dict[str, int]:
    """Jobs a dry run would run, per rule (only this workflow's rules; empty if none)."""
    out = smk(wd, "-n", "--quiet", "rules", *args)
    text = out.stdout + out.stderr
    counts = dict(re.findall(r"^(\w+)\s+(\d+)\s*$", text, flags=re.M))
    return {r: int(n) for r, n in counts.items() if r in OURS}


# The jobs of a whole plan, counted by hand from the config (not with kvarn.plan.matrix.expand,
# which builds the targets under test).
TINY_CELLS = ["q8_0-q8_0-t0", "q4_0-q4_0-t128", "kvarn4-kvarn4-t0"]
TINY_JOBS = {"fetch_model": 1, "wikitext": 1, "baseline": 1, "cell": 3, "cell_row": 3, "summary": 1}


def fake_done(wd: Path):
    """Mark every planned output done without running anything: empty files + --touch."""
    lines = smk(wd, "-n", "--summary").stdout.splitlines()
    for line in lines[1:]:
        path = wd / line.split("\t")[0]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    smk(wd, "--touch", "--forceall", "--cores", "1")
    assert plan(wd) == {}


@pytest.fixture(scope="module")
def tiny_done(tmp_path_factory) -> Path:
    """The tiny matrix marked done once (`fake_done`: three snakemake runs); see `done_copy`."""
    wd = workflow_copy(tmp_path_factory.mktemp("done"), TINY)
    fake_done(wd)
    return wd


def done_copy(tiny_done: Path, tmp_path: Path) -> Path:
    """A test's own copy of the finished tiny workflow (mtimes and snakemake's records kept:
    nothing to do in it, as `fake_done` asserted of the original)."""
    wd = tmp_path / "wf"
    shutil.copytree(tiny_done, wd, symlinks=True)
    return wd


# ---- the config is refused before any job runs ------------------------------------------

@pytest.mark.parametrize("bad, field", [
    ({**TINY, "cells": [{"types": ["kvarn9"], "tail": 0}]}, "cells[0].types[0]"),  # kvarn.plan.matrix
    ({**TINY, "cells": [{"types": ["q8_0"], "tail": CTX}]}, "cells[0].tail"),  # kvarn.plan.matrix: tail < n_ctx
    # the schema (kvarn.plan.config_check): the value, where it is and what is accepted
    ({**TINY, "models": [{**TINY["models"][0], "n_ctx": [255]}]},
     "models[0].n_ctx[0]: 255 is not accepted; accepted: an integer >= 4, a multiple of 2"),
    ({**TINY, "models": [{"name": "x"}]}, "models[0]: 'source' is a required property"),
    ({**TINY, "cells": [{"types": ["q8_0"], "tail": -3}]},
     "cells[0].tail: -3 is not accepted; accepted: an integer >= 0, or a non-empty list of integers >= 0"),
    ({**TINY, "cells": [{"types": ["q8_0"], "tial": 3}]}, "cells[0]: unknown field 'tial'; accepted: types, k, v"),
    ({**TINY, "attention": "fast"}, "attention: 'fast' is not an attention path; accepted: ref, flex, auto"),
])
def test_bad_config_fails_before_any_job(tmp_path, bad, field):
    wd = workflow_copy(tmp_path, TINY)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    p = smk(wd, "-n", "--configfile", str(tmp_path / "bad.yaml"), check=False)
    assert p.returncode != 0 and field in p.stdout + p.stderr, p.stdout + p.stderr
    assert "Failed validating" not in p.stdout + p.stderr  # not the schema's dump
    assert not (wd / "results").exists()


# ---- planning and incrementality ---------------------------------------------------------

@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to tell one thread from all")
def test_model_jobs_take_every_core_the_run_is_given(tmp_path):
    # Snakemake sets OMP_NUM_THREADS from a job's threads: a model job declaring none would run
    # torch on one core whatever --cores says. Model jobs (baseline, cell) take them all; the
    # small jobs (rows, summary) stay at one.
    wd = workflow_copy(tmp_path, TINY)

    def threads(cores: str) -> dict[str, set[int]]:
        out = smk(wd, "-n", "--cores", cores).stdout
        jobs = re.findall(r"^(?:local)?rule (\w+):\n((?:    .*\n)*)", out, flags=re.M)
        got: dict[str, set[int]] = {}
        for rule, body in jobs:
            m = re.search(r"^    threads: (\d+)$", body, flags=re.M)
            got.setdefault(rule, set()).add(int(m.group(1)) if m else 1)
        return got

    two = threads("2")
    assert two["baseline"] == two["cell"] == {2} and two["cell_row"] == two["summary"] == {1}
    one = threads("1")
    assert one["baseline"] == one["cell"] == {1}


def test_default_matrix_plans_one_job_per_cell(tmp_path):
    config = yaml.safe_load((ROOT / "config" / "matrix.yaml").read_text())
    wd = workflow_copy(tmp_path, {k: config[k] for k in ("models", "cells")})
    # per model (one n_ctx, one chunk): 3 types x 2 tails + 3 KVarN + 3 with sink and f16 tail
    # + 2 types x 3 long tails + the 4 k/v pairs at tail 128 less the 2 already listed = 20
    assert plan(wd) == {"fetch_model": 2, "wikitext": 1, "baseline": 2, "cell": 40, "cell_row": 40, "summary": 1}


def test_article_matrix_plans_offline(tmp_path):
    config = yaml.safe_load((ROOT / "config" / "article.yaml").read_text())
    wd = workflow_copy(tmp_path, {k: config[k] for k in ("models", "cells")})
    # per model: 6 K x 8 V types x 2 tails + 6 KVarN widths + 9 KVarN pairs + 12 symmetric
    # types x the sweep's 2 long tails (512, 1024) = 96 + 6 + 9 + 24 = 135
    assert plan(wd) == {"fetch_model": 2, "wikitext": 1, "baseline": 2, "cell": 270, "cell_row": 270, "summary": 1}


def test_adding_a_width_or_editing_a_cell_plans_only_those_cells(tmp_path, tiny_done):
    wd = done_copy(tiny_done, tmp_path)
    # One more width at both tails: two cells (and their rows), the summary; nothing else.
    grown = {**TINY, "cells": [*TINY["cells"], {"types": ["q5_0"], "tail": [0, 128]}]}
    (tmp_path / "grown.yaml").write_text(yaml.safe_dump(grown))
    assert plan(wd, "--configfile", str(tmp_path / "grown.yaml")) == {"cell": 2, "cell_row": 2, "summary": 1}
    # Editing one cell (q4_0 at tail 128 without rotation) is a new path: only it runs.
    edited = {**TINY, "cells": [TINY["cells"][0], {"types": ["q4_0"], "tail": 128, "rot": False},
                                TINY["cells"][2]]}
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(edited))
    assert plan(wd, "--configfile", str(tmp_path / "edited.yaml")) == {"cell": 1, "cell_row": 1, "summary": 1}
    # Where the text is read from is not what it is (sha256-checked): nothing to do.
    (tmp_path / "moved.yaml").write_text(yaml.safe_dump({**TINY, "text": "/elsewhere/wiki.test.raw"}))
    assert plan(wd, "--configfile", str(tmp_path / "moved.yaml")) == {}
    # A new model revision: fetched, and everything of that model rerun, in one invocation.
    new_rev = {**TINY, "models": [{**TINY["models"][0], "revision": "v2"}]}
    (tmp_path / "rev.yaml").write_text(yaml.safe_dump(new_rev))
    want = dict(TINY_JOBS)
    del want["wikitext"]
    assert plan(wd, "--configfile", str(tmp_path / "rev.yaml")) == want


def test_a_llamacpp_cpu_cell_plans_its_own_baseline(tmp_path, tiny_done):
    wd = done_copy(tiny_done, tmp_path)
    # The same cell under llama.cpp's arithmetic: a new path and a baseline of its compute path.
    more = {**TINY, "cells": [*TINY["cells"], {"types": ["q4_0"], "tail": 0, "compute": "llamacpp-cpu"}]}
    (tmp_path / "more.yaml").write_text(yaml.safe_dump(more))
    assert plan(wd, "--configfile", str(tmp_path / "more.yaml")) == {"baseline": 1, "cell": 1, "cell_row": 1,
                                                                      "summary": 1}
    out = smk(wd, "-n", "--configfile", str(tmp_path / "more.yaml"), "-p").stdout
    assert "baseline-llamacpp_cpu.kvd" in out and "q4_0-q4_0-t0-llamacpp_cpu" in out


def test_a_fresh_checkout_over_a_filled_model_cache_plans_everything_at_once(tmp_path):
    """Workflow files newer than the shared cache's markers must not rerun fetch_model (and,
    through snakemake/snakemake#4166 with `ancient` consumers, plan nothing after it)."""
    cache = tmp_path / "models"
    cache.mkdir()
    m = TINY["models"][0]
    (cache / f"smollm2-135m.{kvp.source_key(m['source'], None)}.fetched.json").write_text("{}")
    wd = workflow_copy(tmp_path, TINY)
    later = time.time() + 60
    for f in [wd / "Snakefile", *wd.rglob("workflow/**/*")]:
        os.utime(f, (later, later))
    want = dict(TINY_JOBS)
    del want["fetch_model"]
    assert plan(wd) == want


def test_a_numerics_version_bump_reruns_only_the_cells_using_it(tmp_path, tiny_done):
    wd = done_copy(tiny_done, tmp_path)
    # Simulate `q4_0.version += 1` as the workflow sees it: through the format_version param.
    common = wd / "workflow" / "rules" / "common.smk"
    line = "return {role: kvrows.format_version(wildcards[role], role) for role in (\"k\", \"v\")}"
    assert line in common.read_text()  # else the patch below would change nothing
    common.write_text(common.read_text().replace(
        line, line.replace("kvrows.format_version(wildcards[role], role)",
                           "kvrows.format_version(wildcards[role], role) + (wildcards[role] == 'q4_0')")))
    assert plan(wd) == {"cell": 1, "cell_row": 1, "summary": 1}


def test_a_changed_default_option_reruns_the_cells(tmp_path, tiny_done):
    """A cell's path leaves its default options out (iters 16 is no `-i16`): changing a default
    must still rerun the cells it applies to, through the cell's fields param."""
    wd = done_copy(tiny_done, tmp_path)
    common = wd / "workflow" / "rules" / "common.smk"
    line = "return dataclasses.asdict(kvm.CellSpec.from_wildcards(wildcards))"
    assert line in common.read_text()
    common.write_text(common.read_text().replace(
        line, "f = dataclasses.asdict(kvm.CellSpec.from_wildcards(wildcards)); "
              "return {**f, 'iters': f['iters'] + (f['k'].startswith('kvarn'))}"))
    assert plan(wd) == {"cell": 1, "cell_row": 1, "summary": 1}  # TINY's one KVarN cell


def test_a_memory_accounting_change_reruns_rows_not_cells(tmp_path, tiny_done):
    """Memory is computed from the geometry each summary.json records: a new accounting
    re-derives the rows (and the report), it never reruns a cell."""
    wd = done_copy(tiny_done, tmp_path)
    acc = {**TINY, "models": [{**TINY["models"][0], "memory_accounting": "beellama-qwen"}]}
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(acc))
    assert plan(wd, "--configfile", str(tmp_path / "acc.yaml")) == {"cell_row": 3, "summary": 1}
    # The attention path moves numbers only by fp32 noise: switching it reruns nothing.
    (tmp_path / "flex.yaml").write_text(yaml.safe_dump({**TINY, "attention": "flex"}))
    assert plan(wd, "--configfile", str(tmp_path / "flex.yaml")) == {}


@pytest.mark.parametrize("profile", ["default", "local-submit", "slurm"])
def test_a_checkout_that_edits_the_scripts_reruns_nothing(tmp_path, tiny_done, profile):
    """Cells are versioned by their numerics (params, path), not by script code: after every
    workflow script changed, the shipped profiles plan nothing (the default one is what a plain
    `snakemake` and `make run` load; the others are named with --workflow-profile / --profile)."""
    wd = done_copy(tiny_done, tmp_path)
    scripts = sorted((wd / "workflow" / "scripts").glob("*.py"))
    assert len(scripts) >= 5
    for s in scripts:
        s.write_text(s.read_text() + "\n# an edit in a new checkout\n")
    assert plan(wd)["cell"] == len(TINY_CELLS)  # snakemake's own default reruns on code: the edit is seen
    assert plan(wd, "--workflow-profile", str(wd / "workflow" / "profiles" / profile)) == {}


def test_conda_env_matches_pyproject_pins():
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = yaml.safe_load((ROOT / "envs" / "kvarn.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    norm = lambda s: s.replace(" ", "")  # noqa: E731
    assert sorted(map(norm, pip)) == sorted(norm(p) for p in pins if not p.startswith("snakemake"))


def test_lint_is_clean():
    p = subprocess.run([*SNAKEMAKE, "--lint", "--directory", str(ROOT)], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 0 and "Lints for" not in p.stdout + p.stderr, p.stdout + p.stderr


# ---- real runs (slow) --------------------------------------------------------------------

# Columns that measure the machine, not the numerics.
TIMING = ["tokens_per_s", "wall_s"]


def seed(ref: Path, wd: Path, cells: tuple[str, ...] = ()):
    """Give wd the reference run's text and baseline (mtimes kept), so only cells remain to run;
    and the finished outputs of `cells` (summary, tokens, row), so those do not run either."""
    run = f"results/smollm2-135m/ctx{CTX}-c1"
    rels = ["resources/data/wiki.test.raw", f"{run}/baseline.kvd"]
    rels += [f"{run}/cells/{c}/{f}" for c in cells for f in ("summary.json", "tokens.parquet", "row.parquet")]
    for rel in rels:
        (wd / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ref / rel, wd / rel)


def timing_free(path: Path) -> pl.DataFrame:
    return pl.read_parquet(path).drop(TIMING, strict=False).sort("cell")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny matrix and its summary, run with the local executor (the report rules: see
    test_tiny_matrix_end_to_end)."""
    wd = workflow_copy(tmp_path_factory.mktemp("tiny"), TINY, model_cache=ROOT / "resources" / "models")
    smk(wd, "results/summary.parquet", "results/summary.csv", "--cores", "1", "--resources", "gpu=1")
    return wd


@pytest.mark.slow
def test_tiny_matrix_end_to_end(tiny_run):
    wd = tiny_run
    df = pl.read_parquet(wd / "results" / "summary.parquet")
    assert sorted(df["cell"]) == sorted(TINY_CELLS)
    assert (wd / "results" / "summary.csv").exists()
    for col in ("kld_mean", "kld_median", "ppl_q", "ppl_base", "same_top", "dp_rms", "kv_total_bytes",
                "kv_delta_bytes_vs_tail0", "tail_label", "family", "tokens_per_s", "kvarn_version"):
        assert col in df.columns, col
    row = {r["cell"]: r for r in df.iter_rows(named=True)}
    assert row["kvarn4-kvarn4-t0"]["tail_label"] == "128*" and row["kvarn4-kvarn4-t0"]["family"] == "kvarn"
    assert row["q4_0-q4_0-t128"]["tail_label"] == "128" and row["q8_0-q8_0-t0"]["family"] == "standard"
    assert all(r["kld_mean"] >= 0 and r["n_tokens"] == CTX - 1 - CTX // 2 for r in row.values())
    assert row["kvarn4-kvarn4-t0"]["exact_share"] < 1  # its body is read: the runs below compare KVarN numerics
    assert row["q8_0-q8_0-t0"]["kv_delta_bytes_vs_tail0"] == 0
    # attention auto: ref on CPU, recorded per cell with its baseline's
    assert all((r["attention"], r["baseline_attention"]) == ("ref", "ref") for r in row.values())
    # The report rules (every table and figure built) run in tests/test_article.py's toy DAG,
    # which runs every rule for two models: here only the cells, their rows and the summary.


@pytest.mark.slow
def test_jobscript_submission_gives_the_same_numbers(tiny_run, tmp_path):
    """The local-submit profile: each job a jobscript started by submit.sh, polled by status.sh."""
    wd = workflow_copy(tmp_path, TINY, model_cache=ROOT / "resources" / "models")
    seed(tiny_run, wd)
    target = f"results/smollm2-135m/ctx{CTX}-c1/cells/kvarn4-kvarn4-t0/row.parquet"
    # The profile addresses its scripts relative to the working directory: run from wd.
    # One thread for the job, as every model job of the suite gets: left to the profile, the jobscript's
    # Snakemake takes every core (--cores all) and the cell ran 20x slower beside the other xdist worker
    # (OpenMP threads waiting on a descheduled peer).
    p = subprocess.run([*SNAKEMAKE, "--workflow-profile", "workflow/profiles/local-submit", target,
                        "--set-threads", "cell=1"],
                       cwd=wd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    # the cell; cell_row is a local rule (workflow/rules/slurm.smk) and runs in the main process
    assert len(list((wd / ".snakemake" / "local-submit").glob("*.rc"))) == 1
    assert timing_free(wd / target).equals(timing_free(tiny_run / target))


@pytest.mark.slow
def test_killed_run_resumes_with_identical_numbers(tiny_run, tmp_path):
    """Killed in the KVarN cell (the one whose numbers read a quantized body), resumed with
    --rerun-incomplete: the summary equals the uninterrupted run's. The two standard cells are
    the reference run's (seeded), so the KVarN cell is the only cell job, the one killed."""
    wd = workflow_copy(tmp_path, TINY, model_cache=ROOT / "resources" / "models")
    killed = "kvarn4-kvarn4-t0"
    seeded = [c for c in TINY_CELLS if c != killed]
    seed(tiny_run, wd, cells=tuple(seeded))
    args = [*SNAKEMAKE, "--directory", str(wd), "--snakefile", str(wd / "Snakefile"),
            "--workflow-profile", "none", "--cores", "1", "results/summary.parquet"]
    cells = wd / f"results/smollm2-135m/ctx{CTX}-c1/cells"
    stamps = {c: (cells / c / "summary.json").stat().st_mtime_ns for c in seeded}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    try:
        # Kill the whole process group once the first cell job is running, before it finishes.
        while not any(cells.glob("*/.tmp-*")) and time.time() < deadline:
            assert proc.poll() is None, "the run finished before a cell started"
            time.sleep(0.2)
        time.sleep(1.0)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (wd / "results" / "summary.parquet").exists()
    assert [p.parent.name for p in cells.glob("*/.tmp-*")] == [killed]  # killed inside the KVarN cell
    assert any((wd / ".snakemake" / "incomplete").iterdir())  # Snakemake knows a job died
    smk(wd, "--unlock")
    smk(wd, "--cores", "1", "--rerun-incomplete", "results/summary.parquet")
    assert not any(cells.glob("*/.tmp-*"))  # the killed job's scratch was cleared on rerun
    assert {c: (cells / c / "summary.json").stat().st_mtime_ns for c in seeded} == stamps  # not rerun
    got = timing_free(wd / "results" / "summary.parquet")
    assert got.equals(timing_free(tiny_run / "results" / "summary.parquet"))
