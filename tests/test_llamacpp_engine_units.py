"""The llama.cpp engine (kvarn.llamacpp_engine) in this process: what tests/test_program.py checks through the
workflow (in subprocesses, where mutation testing sees nothing), checked here call by call.

* the baseline and cell jobs on the pinned upstream build (SmolLM2 at n_ctx 256, one chunk, one thread:
  seconds): the base file is llama-perplexity's own, the identity and the summary carry each key and value
  the run set, and the summary prints what llama-perplexity --kl-divergence prints for the same cell;
* the harness's command line, the printout's figures and their last-digit unit, the self-check's runs;
* the build: the pinned upstream source's build (cmake commands, log, provenance), the harness's compile
  command, the build's backend and source folder, the planning identity and the command line, with the
  compiler, cmake and the package index stood in for;
* the matrix's `engine` block (Settings.from_config): its defaults, conversions and whole refusals.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from kvarn.files.identity import uncached_sha256
from kvarn.llamacpp_engine import build as pbuild
from kvarn.llamacpp_engine import runner
from kvarn.llamacpp_engine.settings import ENGINE, Settings, engine_of
from kvarn.vocab import facts
from kvarn.vocab.cell import CellSpec
from kvarn.vocab.options import DEFAULT_COMPUTE
from paths import CACHE_DIR, WIKI_TEXT
from test_program import percentile_slack

pytestmark = pytest.mark.xdist_group("program")

CTX, UB = 256, 256  # one chunk of 256 tokens: 127 scored
ARGS = ("--no-repack",)  # as tests/test_program.py: no AMX repacking
MODEL = "smollm2-135m"
IDENTITY_KEYS = ["engine", "build", "threads", "batch", "ubatch", "flash_attn", "gpu_layers", "args", "env", "n_ctx",
                 "weights_sha256", "text_sha256"]


def fake_build(d: Path, source: Path | None = None) -> pbuild.Build:
    return pbuild.Build(d, source or d, "version: 1 (abc1234)", "abc1234", "CPU", {"source": "here"},
                        {"libllama.so": "0" * 64}, ("f16", "bf16", "q8_0", "q4_0"), frozenset())


# --- the jobs on the real upstream build --------------------------------------------------------------

@pytest.fixture(scope="module")
def upstream() -> pbuild.Build:
    return pbuild.read_build("upstream")


def engine_block(upstream: pbuild.Build) -> dict:
    for name in pbuild.NUMERICS_ENV:
        assert name not in os.environ, name
    return {"settings": Settings(build="upstream", args=ARGS).as_param(), "build": upstream.identity()}


def baseline(upstream: pbuild.Build, d: Path) -> tuple[Path, dict]:
    """The baseline job at one thread into `d` (each test runs its own: mutation testing picks a test by the
    calls made in its own body, and times it there)."""
    from kvarn.weights.sources import parse_model

    base = d / "base.kld"
    return base, runner.baseline_job(parse_model(MODEL), CACHE_DIR, WIKI_TEXT, CTX, 1, UB, engine_block(upstream), 1,
                                     base)


def perplexity(b: pbuild.Build, *args, env=None) -> str:
    gguf = next((CACHE_DIR / MODEL).glob("*.gguf"))
    cmd = [str(b.perplexity), "-m", str(gguf), "-c", str(CTX), "-b", str(CTX), "-ub", str(UB), "-t", "1", "-fa", "on",
           "-ngl", "0", *ARGS, "-f", str(WIKI_TEXT), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_the_baseline_job_writes_llama_perplexity_s_base_file_and_its_identity(upstream, tmp_path):
    from kvarn.budget import memory
    from kvarn.files.identity import file_sha256
    from kvarn.vocab.geometry import config_object, geometry_from_config
    from kvarn.weights.sources import config_json, parse_model

    (tmp_path / "run").mkdir()
    base, info = baseline(upstream, tmp_path / "run")
    perplexity(upstream, "--chunks", "1", "-ctk", "bf16", "-ctv", "bf16", "--kl-divergence-base",
               str(tmp_path / "ref.kld"))
    assert base.read_bytes() == (tmp_path / "ref.kld").read_bytes()
    text = Path(f"{base}.json").read_text()
    assert text == json.dumps(info, indent=1) + "\n"  # written as returned, one key a line
    assert list(info) == [*IDENTITY_KEYS, "kv_program_mib", "prefill_tokens_per_s", "wall_s"]
    gguf = next((CACHE_DIR / MODEL).glob("*.gguf"))
    assert {k: info[k] for k in IDENTITY_KEYS} == {
        "engine": ENGINE, "build": upstream.identity(), "threads": 1, "batch": CTX, "ubatch": UB, "flash_attn": "on",
        "gpu_layers": 0, "args": list(ARGS), "env": {}, "n_ctx": CTX, "weights_sha256": file_sha256(gguf),
        "text_sha256": uncached_sha256(WIKI_TEXT)}
    # the program's bf16 KV buffer, as printed (2 decimals), is kvarn's accounting of a bf16 cache
    geom = geometry_from_config(config_object(config_json(parse_model(MODEL), CACHE_DIR)))
    bf16 = memory.summary_fields(geom, CTX, CellSpec("q4_0", "q4_0", 0), ubatch=UB)["kv_bf16_bytes"]
    assert abs(info["kv_program_mib"] - bf16 / 2**20) <= 0.005 + 1e-9
    assert info["prefill_tokens_per_s"] > 0 and info["wall_s"] > 0
    log = Path(f"{base}.log").read_text().splitlines()[0]
    assert "--kvarn-mode base" in log and log.endswith(" --chunks 1")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["base.kld", "base.kld.json", "base.kld.log"]


def test_a_cell_job_s_summary_prints_what_llama_perplexity_prints_and_carries_the_run_s_keys(upstream, tmp_path):
    from kvarn.weights.sources import parse_model

    base, info = baseline(upstream, tmp_path)
    cell, out = CellSpec("q4_0", "q4_0", 0), tmp_path / "cell"
    s = runner.cell_job(parse_model(MODEL), CACHE_DIR, WIKI_TEXT, CTX, UB, engine_block(upstream), 1, cell, base, out)
    args, env = runner.cell_args(upstream, cell)
    text = perplexity(upstream, *args, "--kl-divergence-base", str(base), "--kl-divergence",
                      env={**os.environ, **env})
    tokens = pl.read_parquet(out / "tokens.parquet")
    for key, (value, unit) in runner.printed_figures(text).items():
        slack = percentile_slack(tokens, key)
        assert abs(s[key] - value) <= unit * 1.0001 + slack, (key, s[key], value, unit, slack)
    assert s["n_tokens"] == tokens.height == CTX - 1 - CTX // 2
    assert tokens.columns == list(runner.RECORD_COLUMNS)
    # the program's KV buffers, as printed (2 decimals), are kvarn's packed accounting of the cell
    assert abs(s["kv_program_mib"] - s["kv_total_bytes"] / 2**20) <= 0.005 + 1e-9
    assert json.loads((out / "summary.json").read_text()) == s
    assert sorted(p.name for p in out.iterdir()) == ["program.log", "summary.json", "tokens.parquet"]
    assert {k: s[k] for k in (
        "model", "source", "memory_accounting", "n_ctx", "chunks", "ubatch", "k_type", "v_type", "rot", "tail",
        "sink_requested", "tail_dtype", "iters", "tail_eff", "compute", "engine", "program_env", "device",
        "baseline_kind", "self_check", "engine_build", "engine_backend", "engine_threads")} == {
        "model": MODEL, "source": f"embedded:{MODEL}", "memory_accounting": "packed", "n_ctx": CTX, "chunks": 1,
        "ubatch": UB, "k_type": "q4_0", "v_type": "q4_0", "rot": True, "tail": 0, "sink_requested": None,
        "tail_dtype": facts.pair_default_tail_dtype("q4_0", "q4_0"), "iters": facts.KVARN_ITERS, "tail_eff": 0,
        "compute": DEFAULT_COMPUTE, "engine": ENGINE, "program_env": {}, "device": upstream.backend,
        "baseline_kind": "llama", "self_check": {"cell": "q4_0-q4_0-t0", "threads": 1, "checked": False},
        "engine_build": upstream.version, "engine_backend": upstream.backend, "engine_threads": 1}
    assert s["engine_identity"] == {k: info[k] for k in IDENTITY_KEYS}
    assert s["tokens_per_s"] == s["prefill_tokens_per_s"] > 0 and s["wall_s"] > 0
    log = (out / "program.log").read_text().splitlines()[0]
    assert f"--kvarn-records {out / 'records.tsv'} " in log and "--chunks" not in log


# --- the runner's parts, without the program --------------------------------------------------------

def test_the_run_identity_names_every_setting(tmp_path, monkeypatch):
    for name in pbuild.NUMERICS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GGML_SCHED_MAX_COPIES", "2")
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")  # the cell's rot: not the run's
    b = fake_build(tmp_path)
    s = Settings(batch=4096, flash_attn="off", gpu_layers=3, args=("--no-mmap",), env={"GGML_KVARN_WINDOW_CHUNK": "4"})
    assert runner.run_identity(b, s, 2, 512, 1024, "w" * 64, "t" * 64) == {
        "engine": ENGINE, "build": b.identity(), "threads": 2, "batch": 1024, "ubatch": 512, "flash_attn": "off",
        "gpu_layers": 3, "args": ["--no-mmap"], "env": {"GGML_KVARN_WINDOW_CHUNK": "4", "GGML_SCHED_MAX_COPIES": "2"},
        "n_ctx": 1024, "weights_sha256": "w" * 64, "text_sha256": "t" * 64}


def test_the_harness_runs_with_its_mode_records_and_environment(tmp_path, monkeypatch):
    exe = tmp_path / "harness"
    exe.write_text("#!/bin/sh\necho \"ran: $*\"\necho \"X=$KVARN_TEST_X\" >&2\nexit \"${KVARN_TEST_RC:-0}\"\n")
    exe.chmod(0o755)
    monkeypatch.setattr(pbuild, "harness", lambda b, log=None: exe)
    b, records, log = fake_build(tmp_path), tmp_path / "r.tsv", tmp_path / "run.log"
    text = runner.run_harness(b, "cell", ["-c", "256"], {"KVARN_TEST_X": "7"}, records, log)
    assert text == log.read_text() == (f"$ KVARN_TEST_X=7 {exe} --kvarn-mode cell --kvarn-records {records} -c 256\n"
                                       f"ran: --kvarn-mode cell --kvarn-records {records} -c 256\nX=7\n")
    with pytest.raises(RuntimeError, match=rf"^llama.cpp \({tmp_path}\) failed with rc 3; the end of {log}:\n\$ "):
        runner.run_harness(b, "base", [], {"KVARN_TEST_RC": "3"}, records, log)


def test_the_program_s_figures_are_its_kv_buffers_and_prompt_speed():
    text = ("llama_kv_cache:        CPU KV buffer size =     1.50 MiB\n"
            "llama_kv_cache: CPU KV tail buffer size =     0.25 MiB\n"
            "llama_perf_context_print: prompt eval time =     500.00 ms /   256 tokens (    1.95 ms per token)\n")
    assert runner.program_figures(text) == {"kv_program_mib": 1.75, "prefill_tokens_per_s": 512.0}
    assert runner.program_figures("prompt eval time =  0.00 ms /  256 tokens") == {
        "kv_program_mib": None, "prefill_tokens_per_s": None}


def test_a_printed_figure_s_unit_is_one_in_its_last_digit():
    text = ("Mean PPL(Q)                   :  12.345678 ±   0.1\nMean    KLD:   0.012345 ±   0.000100\n"
            "Mean    Δp: -0.123 ± 0.010 %\nSame top p: 95.1 ± 0.2 %\nMaximum KLD:   2\n")
    got = runner.printed_figures(text, keys={"ppl_q", "kld_mean", "dp_mean", "same_top", "kld_max"})
    assert list(got) == ["ppl_q", "kld_mean", "kld_max", "dp_mean", "same_top"]
    for key, (value, unit) in {"ppl_q": (12.345678, 1e-6), "kld_mean": (0.012345, 1e-6), "kld_max": (2.0, 1.0),
                               "dp_mean": (-0.00123, 1e-5), "same_top": (0.951, 1e-3)}.items():
        assert got[key] == pytest.approx((value, unit), rel=1e-12), key
    with pytest.raises(ValueError, match=r"^ppl_base: no 'Mean PPL\\\\\(base\\\\\)"):
        runner.printed_figures(text, keys={"ppl_base"})


def test_the_self_check_runs_one_chunk_at_one_thread_then_twice_at_the_job_s(tmp_path, monkeypatch):
    calls = []

    def fake(b, mode, args, env, records, log):
        calls.append((mode, args, env, records, log))
        rows = [f"0\t{128 + i}\t0.01\t2.5\t2.4\t0.001\t1" for i in range(4)]
        records.write_text("\t".join(runner.RECORD_COLUMNS) + "\n" + "\n".join(rows) + "\n")
        return ""

    monkeypatch.setattr(runner, "run_harness", fake)
    exe = tmp_path / "kvarn-kld-fake"
    exe.write_bytes(b"harness")
    monkeypatch.setattr(pbuild, "harness", lambda b, log=None: exe)
    b, s, cell = fake_build(tmp_path / "build"), Settings(args=ARGS), CellSpec("q4_0", "q8_0", 0)
    gguf, base, work = tmp_path / "m.gguf", tmp_path / "base.kld", tmp_path / "work"
    r = runner.self_check(b, s, cell, gguf, "w" * 64, CTX, UB, 2, base, work)
    assert r["ok"] and r["checked"] and r["differing_tokens"] == {"t1_run1": 0, "t1_run2": 0, "run1_run2": 0}
    assert [c[1] for c in calls] == [
        [*runner.common_args(b, s, gguf, CTX, UB, t), "-ctk", "q4_0", "-ctv", "q8_0", "--kl-divergence-base", str(base),
         "--kl-divergence", "--chunks", "1"] for t in (1, 2, 2)]
    assert [(c[0], c[3], c[4]) for c in calls] == [
        ("cell", work / f"selfcheck-{i}.tsv", work / f"selfcheck-{i}.log") for i in range(3)]
    assert runner.self_check(b, s, cell, gguf, "w" * 64, CTX, UB, 2, base, work) == r and len(calls) == 3  # cached


# --- the build ---------------------------------------------------------------------------------------

class FakeRun:
    """subprocess.run of the build's commands: records each call, does the least each command leaves behind."""

    def __init__(self, root: Path):
        self.root, self.calls = root, []

    def __call__(self, cmd, check=False, stdout=None, stderr=None, **kw):
        self.calls.append((cmd, check, getattr(stdout, "name", stdout), getattr(stdout, "mode", None), stderr))
        if "pip" in cmd:
            (self.root / f"llama_cpp_python-{pbuild.UPSTREAM_VERSION}.tar.gz").write_bytes(b"sdist")
        elif cmd[0] == "tar":
            (self.root / f"llama_cpp_python-{pbuild.UPSTREAM_VERSION}" / "vendor" / "llama.cpp").mkdir(parents=True)
        elif cmd[:2] == ["cmake", "-S"]:
            Path(cmd[cmd.index("-B") + 1]).mkdir()
            stdout.write(f"configured {len(self.calls)}\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_the_upstream_build_runs_cmake_and_writes_its_log_and_provenance(tmp_path, monkeypatch):
    root = tmp_path / f"upstream-{pbuild.UPSTREAM_VERSION}"
    root.mkdir()
    (root / "build.log").write_text("a stale log\n")
    run = FakeRun(root)
    monkeypatch.setattr(pbuild.subprocess, "run", run)
    monkeypatch.setattr(pbuild.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(pbuild, "uncached_sha256", lambda p: pbuild.UPSTREAM_SHA256)
    log = io.StringIO()
    build = root / "build"
    src = root / f"llama_cpp_python-{pbuild.UPSTREAM_VERSION}" / "vendor" / "llama.cpp"
    assert pbuild.build_upstream(tmp_path, jobs=3, log=log) == build
    blog = str(root / "build.log")
    assert run.calls == [
        ([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={pbuild.UPSTREAM_VERSION}", "-d", str(root)], True, None, None, None),
        (["tar", "xzf", str(root / f"llama_cpp_python-{pbuild.UPSTREAM_VERSION}.tar.gz"), "-C", str(root)], True,
         None, None, None),
        (["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *pbuild.UPSTREAM_CMAKE], True, blog, "w",
         subprocess.STDOUT),
        (["cmake", "--build", str(build), "--target", "llama-perplexity", "llama-bench", "-j", "3"], True, blog, "w",
         subprocess.STDOUT)]
    assert (root / "build.log").read_text() == "configured 3\n"
    text = (build / pbuild.PROVENANCE).read_text()
    prov = json.loads(text)
    assert text == json.dumps(prov, indent=1) + "\n"
    assert prov == {"source": f"llama-cpp-python=={pbuild.UPSTREAM_VERSION} sdist, vendor/llama.cpp",
                    "sdist_sha256": pbuild.UPSTREAM_SHA256, "cmake": pbuild.UPSTREAM_CMAKE,
                    "targets": ["llama-perplexity", "llama-bench"], "build_s": prov["build_s"]}
    assert log.getvalue().splitlines()[1] == (f"kvarn: building llama.cpp (llama-perplexity, llama-bench) from {src} "
                                              f"into {build}, 3 jobs (once per machine; a few minutes)")
    assert pbuild.build_upstream(tmp_path, jobs=3, log=log) == build and len(run.calls) == 4  # built: at once


def test_the_upstream_build_refuses_another_source(tmp_path, monkeypatch):
    root = tmp_path / f"upstream-{pbuild.UPSTREAM_VERSION}"
    monkeypatch.setattr(pbuild.subprocess, "run", FakeRun(root))
    monkeypatch.setattr(pbuild.shutil, "which", lambda tool: None if tool == "ninja" else f"/usr/bin/{tool}")
    sdist = root / f"llama_cpp_python-{pbuild.UPSTREAM_VERSION}.tar.gz"
    with pytest.raises(pbuild.BuildError) as e:
        pbuild.build_upstream(tmp_path, log=io.StringIO())
    assert str(e.value) == (f"{sdist}: sha256 {uncached_sha256(sdist)}, pinned {pbuild.UPSTREAM_SHA256}: "
                            "not the pinned source")


@pytest.fixture
def harness_build(tmp_path, monkeypatch):
    """A build folder with two libraries, a tool's own library, libcommon.a and a vendored archive; its
    source with four of the five include folders; the compiler stood in for."""
    src, d = tmp_path / "src", tmp_path / "build"
    for inc in ("include", "common", "ggml/include", "vendor"):
        (src / inc).mkdir(parents=True)
    for lib in ("bin/libllama.so", "bin/libggml.so", "bin/libllama-perplexity-impl.so", "common/libcommon.a",
                "vendor/x/libfoo.a"):
        (d / lib).parent.mkdir(parents=True, exist_ok=True)
        (d / lib).write_bytes(b"lib")
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"exe")
        return subprocess.CompletedProcess(cmd, getattr(run, "rc", 0), "", "the compiler's error")

    monkeypatch.setattr(pbuild.subprocess, "run", run)
    return fake_build(d, src), calls, run


def test_the_harness_is_compiled_against_the_build_s_headers_and_libraries(harness_build):
    b, calls, _ = harness_build
    exe = pbuild.harness(b, log=io.StringIO())
    assert exe.parent == b.dir / "kvarn" and exe.name.startswith("kvarn-kld-") and exe.read_bytes() == b"exe"
    src, bin_ = b.source, b.dir / "bin"
    assert calls == [[
        shutil.which("c++") or "g++", "-std=c++20", "-O2", "-o", f"{exe}.tmp{os.getpid()}",
        str(pbuild.HARNESS_SRC), f"-I{src / 'include'}", f"-I{src / 'common'}", f"-I{src / 'ggml' / 'include'}",
        f"-I{src / 'vendor'}", str(b.dir / "common" / "libcommon.a"), str(b.dir / "vendor" / "x" / "libfoo.a"),
        f"-L{bin_}", "-lggml", "-lllama", f"-Wl,-rpath,{bin_}", "-lpthread", "-ldl"]]
    assert pbuild.harness(b, log=io.StringIO()) == exe and len(calls) == 1  # cached by the source's hash


def test_a_harness_that_does_not_compile_is_refused_with_the_compiler_s_error(harness_build):
    b, calls, run = harness_build
    run.rc = 1
    with pytest.raises(pbuild.BuildError) as e:
        pbuild.harness(b, log=io.StringIO())
    assert str(e.value) == f"compiling kvarn_kld.cpp against {b.dir} failed:\nthe compiler's error"
    assert not list((b.dir / "kvarn").glob("kvarn-kld-????????????"))  # no harness where the compile failed


@pytest.mark.parametrize("cache,backend", [
    ({"GGML_NATIVE": "ON"}, "CPU (native)"), ({"GGML_NATIVE": "OFF"}, "CPU"), ({}, "CPU"),
    ({"GGML_CUDA": "1", "CMAKE_CUDA_ARCHITECTURES": "86"}, "CUDA (86)"),
    ({"GGML_CUDA": "on"}, "CUDA (default architectures)"),
    ({"GGML_VULKAN": "TRUE", "GGML_NATIVE": "ON"}, "VULKAN")])
def test_the_backend_is_read_from_the_cmake_cache(cache, backend):
    assert pbuild.backend_of(cache) == backend


def test_a_build_without_its_source_folder_is_refused_by_name(tmp_path, monkeypatch):
    d = tmp_path / "b"
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "llama-perplexity").write_bytes(b"")
    (d / "CMakeCache.txt").write_text("GGML_NATIVE:BOOL=ON\n")
    (tmp_path / "cwd" / "include").mkdir(parents=True)
    (tmp_path / "cwd" / "include" / "llama.h").write_text("")  # a stray header where the process runs
    monkeypatch.chdir(tmp_path / "cwd")
    tail = " (CMAKE_HOME_DIRECTORY) has no include/llama.h; kvarn compiles its harness against the build's own source"
    with pytest.raises(pbuild.BuildError) as e:  # no source named: refused, not read as the current folder
        pbuild.read_build(d)
    assert str(e.value) == (f"{d}: its CMakeCache.txt names no source folder (CMAKE_HOME_DIRECTORY or "
                            "llama.cpp_SOURCE_DIR); kvarn compiles its harness against the build's own source")
    (d / "CMakeCache.txt").write_text(f"llama.cpp_SOURCE_DIR:STATIC={tmp_path / 'src'}\n")
    with pytest.raises(pbuild.BuildError) as e:
        pbuild.read_build(d)
    assert str(e.value) == f"{d}: its source folder {tmp_path / 'src'}{tail}"


def test_the_planned_identity_says_why_the_build_is_unavailable(upstream, tmp_path, monkeypatch):
    monkeypatch.setenv(pbuild.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(pbuild.BUILD_ENV, raising=False)
    assert pbuild.plan_identity("upstream") == {"unavailable": (
        "the pinned upstream build is not built yet: python -m kvarn.llamacpp_engine.build "
        f"(into {tmp_path / 'cache'})")}
    assert pbuild.plan_identity(str(tmp_path / "none")) == {"unavailable": (
        f"{tmp_path / 'none'}: no such folder; give a llama.cpp build folder (the one cmake -B made) or 'upstream'")}
    monkeypatch.setenv(pbuild.BUILD_ENV, str(upstream.dir))
    assert pbuild.plan_identity(None) == upstream.identity()


def test_the_build_command_line(upstream, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        pbuild.main(["--help"])
    assert e.value.code == 0
    assert ("Build the pinned upstream llama.cpp for this CPU (once per machine, into $KVARN_LLAMACPP_CACHE or "
            "~/.cache/kvarn/llamacpp), or read a build's identity, and compile kvarn's harness against it."
            ) in " ".join(capsys.readouterr().out.split())
    calls = []
    monkeypatch.setattr(pbuild, "build_upstream", lambda **kw: calls.append(("build_upstream", kw)))
    monkeypatch.setattr(pbuild, "read_build", lambda p: calls.append(("read_build", p)) or upstream)
    monkeypatch.setattr(pbuild, "harness", lambda b: Path("/h/kvarn-kld"))
    assert pbuild.main([]) == 0
    assert calls == [("build_upstream", {"jobs": None}), ("read_build", "upstream")]
    assert json.loads(capsys.readouterr().out) == {"dir": str(upstream.dir), **upstream.identity(),
                                                   "cache_types": list(upstream.cache_types), "harness": "/h/kvarn-kld"}
    calls.clear()
    assert pbuild.main(["some/build", "-j", "2"]) == 0 and calls == [("read_build", "some/build")]


# --- the matrix's engine block -------------------------------------------------------------------------

def test_the_engine_block_s_defaults_and_conversions():
    assert Settings.from_config(None) == Settings.from_config({"name": "llama.cpp"}) == Settings()
    s = Settings.from_config({"args": ["--no-mmap", 3], "env": {"GGML_KVARN_WINDOW_CHUNK": 4},
                              "decode_depths": [0, 0.5, 1], "threads": 1, "batch": 1, "decode_tokens": 1})
    assert s == Settings(args=("--no-mmap", "3"), env={"GGML_KVARN_WINDOW_CHUNK": "4"}, decode_depths=(0, 0.5, 1),
                         threads=1, batch=1, decode_tokens=1)
    assert Settings.from_config({"threads": 2}).threads == 2


@pytest.mark.parametrize("raw,message", [
    ({"flash_attn": "yes"}, "engine.flash_attn: 'yes'; accepted: on, off, auto"),
    ({"decode_depths": [0.5, 1.5]}, "engine.decode_depths: 1.5; give fractions of n_ctx in [0, 1], e.g. [0, 0.5, 1]"),
    ({"decode_depths": [True]}, "engine.decode_depths: True; give fractions of n_ctx in [0, 1], e.g. [0, 0.5, 1]"),
    ({"threads": 0}, "engine.threads: 0 must be an integer >= 1 (or absent: the job's threads)"),
    ({"threads": 1.5}, "engine.threads: 1.5 must be an integer >= 1 (or absent: the job's threads)"),
    ({"batch": 0}, "engine.batch: 0 must be an integer >= 1"),
    ({"gpu_layers": -1}, "engine.gpu_layers: -1 must be an integer >= 0"),
    ({"threds": 2}, "engine: unknown key(s) ['threds']; accepted: name, build, threads, batch, flash_attn, "
                    "gpu_layers, args, env, decode_depths, decode_tokens")])
def test_the_engine_block_s_refusals_read_in_full(raw, message):
    with pytest.raises(ValueError) as e:
        Settings.from_config(raw)
    assert str(e.value) == message
    with pytest.raises(ValueError) as e:
        Settings.from_config(raw, "models[0].engine")
    assert str(e.value) == f"models[0].{message}"


def test_an_engine_mapping_without_a_name_is_llama_cpp():
    block = {"build": "upstream"}
    assert engine_of(block) == (ENGINE, block)
    assert engine_of(None) == ("torch", None) and engine_of("torch") == ("torch", None)
    with pytest.raises(ValueError, match=r"^engine: 'vllm' is not an engine; accepted: torch, llama.cpp$"):
        engine_of({"name": "vllm"})
