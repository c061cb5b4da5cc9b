"""The one prepared device run (issues 42 and 54): the answers the study's matrix needs from one
GPU, most important first, every result kept the moment it is measured.

    bench/gpu/prepare.sh                                  (here: wheels + text into .gpu/)
    bash bench/gpu/device_run.sh OUTDIR                   (there, .gpu carried: <= 7 min in all)
    python -m bench.gpu.device_run --smoke --results DIR  (CPU, tiny shapes: checks this script)

Carry (bench/gpu/prepare.sh measures it; docs/notes/scale.md has the figure): the checkout plus
.gpu (the wheels transformers' import needs at our pins, gguf, fla, the text), under the 64 MiB a
call may carry; nothing is fetched on the machine, and nothing here imports polars (the machine
has none: the device run loads through kvarn.run.load and runs kvarn.run.forward, which import none; the
torch engine, which writes a cell's parquet, is not imported here).

First, the import check (`--check-imports`, its own process, `IMPORT_CHECK_S` at most): torch,
triton, transformers (whose import checks tokenizers, huggingface-hub, safetensors, regex, ...),
the Qwen 3.5 and Gemma 4 modules, kvarn.run.load and kvarn.run.forward; each package's version and whether it came
from the carried site or the image go into the first results line. If one fails, that line says
so, with every version found, and the run stops there (exit code 3): a second try can be
prepared at once.

Then the steps, in this order (`STEPS`), each a subprocess killed at the run's deadline
(`--budget-s` from the start): a step whose stated minimum (`STEP_MIN_S`) no longer fits is
skipped and the next one gets the time; `--steps` runs a subset (a second try's remainder).

The steps: 1. and 2. the two models (bench/gpu/device_models.py), 3. flex at head dim 512
(bench/gpu/device_flex.py), 4. the KVarN Triton kernels' GPU tests (bench/gpu/check.sh's pytest
line; on CPU they skip). The order, the budget and the estimates: bench/gpu/device_plan.py; the
results file and its Markdown: bench/gpu/device_record.py; the timeline and the carry:
docs/notes/scale.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import REPO as ROOT
from bench import TEXT
from bench.gpu.device_flex import step_flex
from bench.gpu.device_models import step_model
from bench.gpu.device_plan import BUDGET_S, MIN_START_S, SMOKE_BUDGET_S, STEP_MIN_S, STEPS
from bench.gpu.device_record import Recorder, json_default, projection, short_error

IMPORT_CHECK_S = 120  # the import check's own deadline
# What the run imports: (module, distribution, required on the device, required in --smoke).
IMPORTS = [("torch", "torch", True, True), ("triton", "triton", True, False),
           ("transformers", "transformers", True, True), ("tokenizers", "tokenizers", True, True),
           ("huggingface_hub", "huggingface-hub", True, True), ("safetensors", "safetensors", True, True),
           ("regex", "regex", True, True), ("numpy", "numpy", True, True), ("gguf", "gguf", False, False),
           ("fla", "flash-linear-attention", False, False)]
IMPORT_MODULES = ["transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.gemma4.modeling_gemma4",
                  "kvarn.run.load", "kvarn.run.forward", "kvarn.kvcache.flex"]
TRITON_TESTS = ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_kvarn_triton.py"]


# --- the parent: the import check, then the steps under the run's deadline ----------------

def machine() -> dict:
    """What ran, without touching the GPU (the parent holds no CUDA context)."""
    gpu = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        gpu = out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:
        commit = None
    return {"gpu": gpu, "cpus": os.cpu_count(), "python": sys.version.split()[0], "polars": _version("polars"),
            "commit": commit}


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def carried_versions(site: str | None) -> dict[str, str]:
    """{distribution: version} of the wheels device_run.sh installed into `site` (their dist-info)."""
    if not site or not Path(site).is_dir():
        return {}
    out = {}
    for d in Path(site).glob("*.dist-info"):
        name, _, version = d.name[:-len(".dist-info")].rpartition("-")
        out[name.lower().replace("_", "-")] = version
    return out


def check_imports(smoke: bool) -> dict:
    """Import what the run imports, in this process (a fresh one: `--check-imports`): per package
    its version (the module's own, else its distribution's), where it came from ("carried": the
    site device_run.sh installed .gpu/wheels into, `KVARN_CARRIED_SITE`; else "image") and the
    error if it failed; then the model modules and kvarn's engine. `ok` is False where a required
    package (`IMPORTS`) or module failed, or a carried distribution was imported at another version
    (the image's shadowing it)."""
    import importlib

    site = os.environ.get("KVARN_CARRIED_SITE")
    carried = carried_versions(site)
    pkgs, problems = {}, []
    for module, dist, on_device, on_smoke in IMPORTS:
        row = {"dist_version": _version(dist)}
        try:
            m = importlib.import_module(module)
            row["version"] = str(getattr(m, "__version__", None) or row["dist_version"])
            where = str(Path(getattr(m, "__file__", "") or "").resolve())
            row["from"] = "carried" if site and where.startswith(str(Path(site).resolve())) else "image"
            want = carried.get(dist)
            if want and row["from"] != "carried":
                problems.append(f"{module}: the carried {want} is not the one imported ({row['version']} from {where})")
        except Exception as e:  # an ImportError, or transformers' own version check failing
            row["error"] = short_error(e)
            if on_smoke if smoke else on_device:
                problems.append(f"{module}: {row['error']}")
        pkgs[module] = row
    mods = {}
    for module in IMPORT_MODULES:
        try:
            importlib.import_module(module)
            mods[module] = "ok"
        except Exception as e:
            mods[module] = short_error(e)
            problems.append(f"{module}: {mods[module]}")
    return {"ok": not problems, "problems": problems, "packages": pkgs, "modules": mods,
            "carried_site": bool(site), "carried": carried}


def run_import_check(smoke: bool) -> dict:
    """`check_imports` in its own process under `IMPORT_CHECK_S` (a hang is a failure too)."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "bench.gpu.device_run", "--check-imports"] + (["--smoke"] if smoke else [])
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=IMPORT_CHECK_S)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        out = json.loads(lines[-1]) if lines else {
            "ok": False, "problems": [f"the check printed no result (exit code {p.returncode}): "
                                      + " ".join(p.stderr.split())[-600:]]}
    except subprocess.TimeoutExpired:
        out = {"ok": False, "problems": [f"the import check was still running after {IMPORT_CHECK_S} s"]}
    out["s"] = round(time.perf_counter() - t, 1)
    return out


def run_step(rec: Recorder, name: str, cmd: list[str], deadline: float, log: Path | None = None) -> int | None:
    """Run one step's command in its own process group until `deadline` (epoch seconds): past
    it the group is killed and that is recorded. Returns the exit code (None: killed)."""
    left = deadline - time.time()
    need = max(MIN_START_S, STEP_MIN_S.get(name, 0.0))
    if left < need:
        rec.add({"step": name, "item": "step", "status": "skipped",
                 "why": f"would start {max(0.0, -left):.0f} s past the run's deadline" if left < 0
                 else f"{left:.0f} s left before the run's deadline, it needs {need:.0f}"})
        return None
    global _running
    t = time.perf_counter()
    out = open(log, "w") if log else None
    p = _running = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT if out else None,
                                    start_new_session=True)
    try:
        rc = p.wait(timeout=left)
    except subprocess.TimeoutExpired:
        _kill(p)
        rec.add({"step": name, "item": "step", "status": "killed", "s": round(time.perf_counter() - t, 1),
                 "why": f"still running at the run's deadline ({left:.0f} s after it started); the lines above "
                        "are what it finished"})
        return None
    finally:
        _running = None
        if out:
            out.close()
    if rc != 0 and name != "triton":
        rec.add({"step": name, "item": "step", "status": "error", "s": round(time.perf_counter() - t, 1),
                 "why": f"exit code {rc} (see the log)"})
    return rc


def triton_record(log: Path, rc: int | None, seconds: float) -> dict:
    """The GPU tests' outcome from pytest's -v log (read even after a kill)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    counts = {k: len(re.findall(rf"::\S+ {k.upper()}\b", text)) for k in ("passed", "failed", "skipped", "error")}
    tail = [ln for ln in text.splitlines() if ln.strip()][-1:] or [""]
    status = "killed" if rc is None else "ok" if rc == 0 else "error"
    return {"step": "triton", "item": "KVarN Triton GPU tests", "status": status, "rc": rc, "s": round(seconds, 1),
            **counts, "summary": tail[0].strip("= "), "command": "python3 " + " ".join(TRITON_TESTS)}


_running: subprocess.Popen | None = None  # the step now running (its own process group)


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def parent(args) -> int:
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    rec = Recorder(results)

    def stop(signum, frame):  # the outer `timeout`: take the running step down too, keep what is recorded
        if _running is not None:
            _kill(_running)
        rec.add({"step": "run", "item": "stopped", "status": "killed", "why": f"signal {signum} (the outer timeout?)"})
        sys.exit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        return _steps(args, rec, results)
    finally:
        signal.signal(signal.SIGTERM, before)


def _steps(args, rec: Recorder, results: Path) -> int:
    rec.jsonl.write_text("")  # a fresh run
    start = time.time()
    deadline = start + args.budget_s
    imports = run_import_check(args.smoke) if args.budget_s > 0 else {"ok": None, "problems": [], "s": 0.0}
    found = {m: row.get("version") or row.get("dist_version") for m, row in imports.get("packages", {}).items()}
    rec.add({"step": "run", "item": "machine", **machine(),
             **{k: found.get(k) for k in ("torch", "triton", "transformers")},
             "flash-linear-attention": found.get("fla"), "imports": imports,
             "status": "error" if imports["ok"] is False else "ok",
             "smoke": args.smoke, "budget_s": args.budget_s, "steps": args.steps, "compute": args.compute,
             "command": " ".join(shlex.quote(a) for a in ["python3", "-m", "bench.gpu.device_run", *args.argv])})
    if imports["ok"] is False:
        seen = {m: f"{row.get('version')} (metadata {row['dist_version']})"
                if row.get("version") and row.get("dist_version") not in (None, row["version"])
                else row.get("version") or row.get("dist_version") for m, row in imports.get("packages", {}).items()}
        print("[device_run] the import check failed, nothing else runs:\n  " + "\n  ".join(imports["problems"])
              + "\n  versions found: " + json.dumps(seen), file=sys.stderr, flush=True)
        return 3
    common = ["--results", str(results), "--text", str(args.text), "--compute", args.compute,
              "--encode-rows", str(args.encode_rows), "--deadline", f"{deadline:.1f}"] + (
                  ["--smoke"] if args.smoke else [])
    for name, _ in STEPS:
        if name not in args.steps:
            continue
        if name == "triton":
            log = results / "triton_tests.log"
            log.unlink(missing_ok=True)
            t = time.perf_counter()
            rc = run_step(rec, name, [sys.executable, *TRITON_TESTS], deadline, log)
            if log.is_file():
                rec.add(triton_record(log, rc, time.perf_counter() - t))
            continue
        run_step(rec, name, [sys.executable, "-m", "bench.gpu.device_run", "--step", name, *common], deadline)
    proj = projection(rec.records())
    rec.add({"step": "run", "item": "projection", **{k: v for k, v in proj.items() if k != "markdown"}})
    rec.add({"step": "run", "item": "done", "s": round(time.time() - start, 1)})
    return 0


# --- entry ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    from kvarn.vocab.options import ATTENTION_ROUNDING, TF32_ATTN

    # the GPU's arithmetic that kept every format's KLD (bench/perf/results/attn_rounding_tf32_truncP.md):
    # TF32 operands into flex, fp32 sums and softmax
    default_compute = TF32_ATTN
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(Path(__file__).resolve().parent / "results"),
                    help="folder of device_run.jsonl and device_run.md (default bench/gpu/results)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, flex eager: checks the script")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"seconds from the start to the run's deadline, import check included (default "
                         f"{BUDGET_S:.0f}; {SMOKE_BUDGET_S:.0f} with --smoke): a step past it is killed, one "
                         "that would not fit is skipped, and either is recorded")
    ap.add_argument("--steps", default=",".join(s for s, _ in STEPS),
                    help="the steps to run, comma-separated, always in their order (default all: "
                         + ",".join(s for s, _ in STEPS) + "); a second try runs what the first did not answer")
    ap.add_argument("--compute", default=default_compute, choices=list(ATTENTION_ROUNDING),
                    help=f"the model runs' compute path (default {default_compute})")
    ap.add_argument("--text", default=None,
                    help="wiki.test.raw (default .gpu/wiki.test.raw when carried, else $TEXT or ../shared)")
    ap.add_argument("--encode-rows", type=int, default=1024,
                    help="baseline rows encoded and kept per chunk (the rest's encoding is extrapolated)")
    ap.add_argument("--check-imports", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--step", choices=[s for s, _ in STEPS if s != "triton"], help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.check_imports:  # a process of its own (run_import_check): one JSON line
        print(json.dumps(check_imports(args.smoke), default=json_default), flush=True)
        return 0
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.budget_s is None:
        args.budget_s = SMOKE_BUDGET_S if args.smoke else BUDGET_S
    unknown = set(args.steps.split(",")) - set(STEP_MIN_S)
    if unknown:
        ap.error(f"--steps: no step {', '.join(sorted(unknown))} (steps: {', '.join(STEP_MIN_S)})")
    args.steps = [s for s, _ in STEPS if s in args.steps.split(",")]
    carried = ROOT / ".gpu" / "wiki.test.raw"
    args.text = Path(args.text or (carried if carried.is_file() else TEXT))
    if not args.text.is_file():
        ap.error(f"--text: {args.text} is not a file (the random models only read its bytes, but the engine "
                 "checks its sha256)")
    if args.encode_rows < 64 or args.encode_rows % 64:
        ap.error("--encode-rows: a multiple of 64 (the engine's log-prob slices), at least 64")
    if args.step is None:
        return parent(args)
    rec = Recorder(Path(args.results))
    if args.smoke:
        import torch

        torch.set_num_threads(1)  # tiny tensors: more threads only contend (on a shared machine above all)
    if args.step == "flex":
        step_flex(args, rec)
    else:
        step_model(args.step, args, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
