"""The one prepared device run (issues 42 and 54): the answers the study's matrix needs from one
GPU, most important first, every result kept the moment it is measured.

    bench/gpu/prepare.sh                                  (here: wheels + text into .gpu/)
    bash bench/gpu/device_run.sh OUTDIR                   (there, .gpu carried: <= 7 min in all)
    python -m bench.gpu.device_run --smoke --results DIR  (CPU, tiny shapes: checks this script)

Carry (bench/gpu/prepare.sh measures it; docs/notes/scale.md has the figure): the checkout plus
.gpu (the wheels transformers' import needs at our pins, gguf, fla, the text), under the 64 MiB a
call may carry; nothing is fetched on the machine, and nothing here imports polars (the machine
has none: kvarn.run.engine imports it only where a cell writes its parquet).

First, the import check (`--check-imports`, its own process, `IMPORT_CHECK_S` at most): torch,
triton, transformers (whose import checks tokenizers, huggingface-hub, safetensors, regex, ...),
the Qwen 3.5 and Gemma 4 modules, kvarn.run.engine; each package's version and whether it came
from the carried site or the image go into the first results line. If one fails, that line says
so, with every version found, and the run stops there (exit code 3): a second try can be
prepared at once.

Then the steps, in this order (`STEPS`), each a subprocess killed at the run's deadline
(`--budget-s` from the start): a step whose stated minimum (`STEP_MIN_S`) no longer fits is
skipped and the next one gets the time; `--steps` runs a subset (a second try's remainder).

1. Qwen 3.6 27B at 65,536, then 2. Gemma 4 31B at 16,384: random weights of the study's geometry
   (`random:config/models/<name>.json`, bf16, kvarn.weights.random_model), one
   `kvarn.run.engine.Context`, then the baseline, q4_0 t128, kvarn4 and q8_0 t0 (`RUNS`, most
   needed first) on one chunk on the flex path with `--compute` (tf32-attn: TF32 dots in flex,
   fp32 accumulation). Each run is preceded by a warm-up of the same code on the chunk's first 2
   ubatches (compiles flex, the KVarN and fla Triton kernels): a line after the warm-up
   (`phase` "warm-up": its seconds and peak memory), a line after the timed chunk (`phase`
   "chunk": seconds, tokens/s, peak device and host memory, graphs dynamo still compiled in it).
   A run after the first starts only where its estimate fits before the deadline: the last timed
   chunk's seconds x `CHUNK_FACTOR` + `WARMUP_EST_S` (never the last run's whole time, whose
   warm-up compiled what the next one reuses); the estimate is kept in its line. The engine's own
   building blocks run (chunk_logprobs, the dump's encoding, kvarn.stats.metrics), not
   run_baseline / run_cell: the baseline's dump is never written (random weights: its log-probs
   mean nothing, and at 64k it is ~16 GB dense). The baseline's rows are copied to the host as the
   engine does; the first `--encode-rows` of them are encoded and packed exactly as
   kvarn.baseline.dump writes them (sha256 included) and kept in memory, and that time is
   extrapolated to the chunk's rows (`encode_s_chunk`; the disk write itself is not timed). The
   cells decode those kept rows in place of the chunk's (row r reads kept row r mod n, the same
   bytes per row at random weights) and compute the per-token metrics and the summary as
   run_cell does.
3. flex at head dim 512 (Gemma 4's global layers, 32/4 heads; `torch.compile(flex_attention,
   dynamic=True)` as kvarn.kvcache.flex compiles it) on random tensors with a causal block mask,
   a 512-query ubatch over 16,384 keys: fp32 with the TF32 dots the model runs use
   (`FLOAT32_PRECISION 'tf32'`, operands rounded by kvarn.kvcache.rounding) and bf16. Per case the
   first call's seconds (the compile), the median call after warm-up, peak device memory, or the
   error (a Triton "out of resource" is a result; a failed case is retried once with small kernel
   blocks, its own line). The fp32 case also says which P rule the kernel follows: its output
   against `rounded_attention` with P truncated and P rounded to nearest (`p_rule`).
4. The KVarN Triton kernels' GPU tests (bench/gpu/check.sh's pytest line; on CPU they skip).

Results: one JSON line per measured item appended to `DIR/device_run.jsonl` (flushed and synced)
and `DIR/device_run.md` rewritten from it after each, with the projection of config/article.yaml
(`bench.gpu.projection.project` / `markdown`, from the measured seconds per chunk) as far as the
numbers go; a kill keeps every finished line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import REPO as ROOT
from bench import TEXT
from bench.gpu.article import STUDY

MODELS = {m: STUDY[m] for m in ("qwen3.6-27b", "gemma4-31b")}  # run in this order, at the study's n_ctx
# (label, (k, v, tail) or None for the baseline, the projection's kind); most needed first
RUNS = [("baseline", None, "baseline"), ("q4_0 t128", ("q4_0", "q4_0", 128), "standard tail"),
        ("kvarn4", ("kvarn4", "kvarn4", 0), "kvarn"), ("q8_0 t0", ("q8_0", "q8_0", 0), "standard t0")]
FLEX_HEADS = {512: (32, 4)}  # head dim -> (query heads, KV heads): Gemma 4's global layers
FLEX_KEYS, FLEX_QUERIES = (16384,), 512
SMALL_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1}  # the retry of a failed flex case
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
IMPORT_CHECK_S = 120  # the import check's own deadline
# What the run imports: (module, distribution, required on the device, required in --smoke).
IMPORTS = [("torch", "torch", True, True), ("triton", "triton", True, False),
           ("transformers", "transformers", True, True), ("tokenizers", "tokenizers", True, True),
           ("huggingface_hub", "huggingface-hub", True, True), ("safetensors", "safetensors", True, True),
           ("regex", "regex", True, True), ("numpy", "numpy", True, True), ("gguf", "gguf", False, False),
           ("fla", "flash-linear-attention", False, False)]
IMPORT_MODULES = ["transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.gemma4.modeling_gemma4",
                  "kvarn.run.engine", "kvarn.kvcache.flex"]
TRITON_TESTS = ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_kvarn_triton.py"]
SMOKE = {"n_ctx": 256, "ubatch": 64, "flex_keys": (512,), "flex_queries": 64, "flex_heads": (2, 1), "repeats": 1}
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "global_head_dim": 128, "num_global_key_value_heads": 1, "sliding_window": 64,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "vocab_size": 256, "vocab_size_per_layer_input": 256}
TINY_LAYERS = 8


# --- the results file ------------------------------------------------------------------

class Recorder:
    """Appends one JSON line per item to DIR/device_run.jsonl (synced: a kill keeps it) and
    rewrites DIR/device_run.md from the whole file after each."""

    def __init__(self, results: Path):
        self.jsonl, self.md = results / "device_run.jsonl", results / "device_run.md"

    def add(self, item: dict) -> dict:
        item = {"t": round(time.time(), 1), **item}
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(item, default=_plain) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"[device_run] {_one_line(item)}", flush=True)
        self.render()
        return item

    def records(self) -> list[dict]:
        if not self.jsonl.is_file():
            return []
        return [json.loads(line) for line in self.jsonl.read_text().splitlines() if line.strip()]

    def render(self) -> None:
        try:
            text = render(self.records())
        except Exception as e:  # the JSON lines are the record; a rendering bug must not stop a step
            text = f"# The device run\n\nRendering failed ({_short(e)}); device_run.jsonl holds every result.\n"
        tmp = self.md.with_suffix(".md.tmp")
        tmp.write_text(text)
        os.replace(tmp, self.md)


def _plain(x):
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def _one_line(r: dict) -> str:
    keys = ("phase", "status", "s_per_chunk", "warmup_s", "first_call_s", "per_call_s", "s", "error", "why")
    return f"{r.get('step', '')} {r.get('item', '')}: " + ", ".join(f"{k} {r[k]}" for k in keys if k in r)


def _short(e: BaseException, n: int = 300) -> str:
    return f"{type(e).__name__}: " + " ".join(str(e).split())[:n]


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
            row["error"] = _short(e)
            if on_smoke if smoke else on_device:
                problems.append(f"{module}: {row['error']}")
        pkgs[module] = row
    mods = {}
    for module in IMPORT_MODULES:
        try:
            importlib.import_module(module)
            mods[module] = "ok"
        except Exception as e:
            mods[module] = _short(e)
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


# --- step 3: flex at head dim 512, compile and per-call time, the kernel's P rule -----------

def step_flex(args, rec: Recorder) -> None:
    import torch
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    device = "cpu" if args.smoke else "cuda"
    for limit in ("recompile_limit", "cache_size_limit"):  # dtype x head dim kernels + retries: never eager
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    kernel = flex_attention if args.smoke else torch.compile(flex_attention, dynamic=True)
    keys = SMOKE["flex_keys"] if args.smoke else FLEX_KEYS
    for dim, heads in FLEX_HEADS.items():
        for dtype in (torch.float32, torch.bfloat16):
            for n_keys in keys:
                name = "float32 (TF32 dots)" if dtype == torch.float32 else "bfloat16"
                case = {"step": "flex", "item": f"D{dim} {name} {n_keys} keys", "head_dim": dim,
                        "dtype": str(dtype)[6:], "keys": n_keys,
                        "queries": SMOKE["flex_queries"] if args.smoke else FLEX_QUERIES,
                        "heads": SMOKE["flex_heads"] if args.smoke else heads, "compiled": not args.smoke}
                if dtype == torch.float32:  # what tf32-attn runs (kvarn.kvcache.flex): rounded operands, TF32 dots
                    case["tf32"] = True
                    if not args.smoke:
                        case["kernel_options"] = {"FLOAT32_PRECISION": "'tf32'"}
                if time.time() > args.deadline:
                    rec.add({**case, "status": "skipped", "why": "past the run's deadline"})
                    continue
                r = rec.add(flex_case(kernel, case, device, dtype, SMOKE["repeats"] if args.smoke else 5))
                if r["status"] == "error" and time.time() < args.deadline:
                    rec.add(flex_case(kernel, {**case, "item": case["item"] + " small blocks", "small_blocks": True,
                                               "kernel_options": {**case.get("kernel_options", {}), **SMALL_BLOCKS}},
                                      device, dtype, 1))


def flex_case(kernel, case: dict, device: str, dtype, repeats: int = 5) -> dict:
    """One flex_attention call shape: the first call (compile included where this dtype and head
    dim have none yet), the median of `repeats` calls after two warm-up calls, peak memory; for a
    TF32 case (`case["tf32"]`: operands rounded as kvarn.kvcache.flex rounds them) also `p_rule`."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n_q, n_k, dim = case["queries"], case["keys"], case["head_dim"]
    hq, hkv = case["heads"]
    out = dict(case)
    q = k = v = None
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        g = torch.Generator(device=device).manual_seed(dim + n_k)
        q, k, v = (torch.randn(1, h, n, dim, device=device, dtype=dtype, generator=g)
                   for h, n in ((hq, n_q), (hkv, n_k), (hkv, n_k)))
        if case.get("tf32"):
            from kvarn.kvcache.rounding import round_operand

            v = v + 1.0  # a mean away from 0: P's rounding bias shows in the output (p_rule_check)
            q, k, v = (round_operand(x, "tfloat32") for x in (q, k, v))
        offset = torch.tensor(n_k - n_q, device=device)  # the last ubatch of the keys: the densest

        def causal(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        t = time.perf_counter()
        bm = create_block_mask(causal, None, None, n_q, n_k, device=device)
        sync()
        out["block_mask_s"] = time.perf_counter() - t
        opts = {"kernel_options": case["kernel_options"]} if "kernel_options" in case else {}

        def call():
            return kernel(q, k, v, block_mask=bm, scale=dim ** -0.5, enable_gqa=hq != hkv, **opts)

        graphs = _graphs()
        t = time.perf_counter()
        y = call()
        sync()
        out["first_call_s"] = time.perf_counter() - t
        out["graphs_compiled"] = None if graphs is None else _graphs() - graphs
        out["finite"] = bool(torch.isfinite(y).all())
        for _ in range(min(2, repeats)):
            call()
        sync()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - t)
        out["per_call_s"] = sorted(times)[len(times) // 2]
        out["compile_s"] = max(0.0, out["first_call_s"] - out["per_call_s"])
        if case.get("tf32"):
            out["p_rule"] = p_rule_check(q, k, v, y, n_k - n_q, dim ** -0.5)
        out["status"] = "ok"
    except Exception as e:  # a failure to compile or launch is this case's result
        out.update({"status": "error", "error": _short(e)})
    finally:
        del q, k, v
        if cuda:
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.empty_cache()
    return out


def p_rule_check(q, k, v, y, offset: int, scale: float, heads: int = 4) -> dict:
    """Which P rule the kernel's output `y` follows: against `rounded_attention` (the CPU model of
    tf32-attn, in IEEE fp32 on the same device) with P truncated and with P rounded to nearest, on
    the first `heads` query heads: per rule the mean and RMS of (y - model) over the outputs'
    magnitude. Truncation shrinks every numerator (V's mean is 1 here), so the rule the kernel
    follows leaves the smaller |mean|: `closer`. Eager flex (the CPU smoke) computes fp32 dots: its
    answer says nothing of a GPU's."""
    import torch

    from kvarn.kvcache.attention import rounded_attention

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the model's own dots in IEEE fp32
    try:
        n_q, n_k = q.shape[-2], k.shape[-2]
        rep = q.shape[1] // k.shape[1]
        h = min(heads, q.shape[1])
        kk = k.repeat_interleave(rep, dim=1)[:, :h].float()
        vv = v.repeat_interleave(rep, dim=1)[:, :h].float()
        qi = torch.arange(n_q, device=q.device)[:, None]
        kj = torch.arange(n_k, device=q.device)[None, :]
        mask = qi + offset >= kj
        got = y[:, :h].double()
        size = float(got.abs().mean())
        out = {}
        for rule in ("truncate", "nearest"):
            model = rounded_attention(q[:, :h].float(), kk, vv, mask, scale, "tfloat32", p_rule=rule).double()
            d = (got - model) / size
            out[rule] = {"mean": float(d.mean()), "rms": float(d.pow(2).mean().sqrt())}
        out["closer"] = min(("truncate", "nearest"), key=lambda r: abs(out[r]["mean"]))
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _graphs() -> int | None:
    """Graphs dynamo has compiled in this process so far (None if torch no longer counts them)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return None


# --- steps 1 and 2: one model, one chunk per run -------------------------------------------

class KeptRows:
    """The baseline rows kept in memory, read as a dump is: `decode(c, a, b, device)` gives rows
    a..b of the chunk, row r from kept row r mod n (n: the rows kept, all of them when the chunk
    had no more), decoded by kvarn.baseline.dump.Dump itself from the bytes the file would hold."""

    kind = "kvarn"

    def __init__(self, parts: list[bytes], lengths: list, vocab: int):
        import numpy as np

        from kvarn.baseline import dump

        lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        self.n = len(lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        payload = np.frombuffer(b"".join(parts), dtype=np.uint8)
        header = {"n_chunks": 1, "n_scored": self.n, "vocab_size": vocab, "layout": "sparse"}
        self.dump = dump.Dump(Path("<kept in memory>"), header, payload, verify=False, offsets=offsets)

    def decode(self, c: int, a: int, b: int, device=None):
        if b - a > self.n:
            raise ValueError(f"{b - a} rows asked, {self.n} kept")
        a2 = a % self.n
        a2 = min(a2, self.n - (b - a))
        return self.dump.decode(0, a2, a2 + (b - a), device)


def time_baseline(model, ids, cell, path: str, ubatch: int, encode_rows: int, sync) -> tuple[KeptRows, dict]:
    """One baseline chunk as kvarn.run.engine.run_baseline computes it (the log-probs a slice at a
    time, copied to the host inside the timed forward), the first `encode_rows` rows encoded,
    packed and hashed as kvarn.baseline.dump.write_dump does, nothing written."""
    from kvarn.baseline.encoding import encode_rows as encode
    from kvarn.baseline.sparse import pack_rows
    from kvarn.run import engine
    from kvarn.spec import scoring

    scored = scoring.scored_positions(int(ids.shape[0]))
    cache = engine.new_cache(model, cell, attention=path)
    timing = {"forward_s": 0.0, "encode_s": 0.0}
    parts, lengths, vocab, h = [], [], None, hashlib.sha256()
    t0 = time.perf_counter()
    rows = ((a, lp.cpu()) for a, lp in engine.chunk_logprobs(model, ids, cache, ubatch, scored))
    for a, host in engine.timed(rows, timing):
        vocab = int(host.shape[1])
        if a >= encode_rows:
            continue
        t = time.perf_counter()
        data, lens = pack_rows(encode(host), vocab)
        h.update(data)
        parts.append(data)
        lengths.append(lens)
        timing["encode_s"] += time.perf_counter() - t
    sync()
    timing["wall_s"] = time.perf_counter() - t0
    kept = KeptRows(parts, lengths, vocab)
    n = len(scored)
    timing["encode_rows"] = kept.n
    timing["encode_s_chunk"] = timing["encode_s"] * n / kept.n
    timing["s_per_chunk"] = timing["wall_s"] - timing["encode_s"] + timing["encode_s_chunk"]
    timing["kept_bytes"] = sum(len(p) for p in parts)
    return kept, timing


def time_cell(model, ids, cell, path: str, ubatch: int, base, sync) -> tuple[dict, dict]:
    """One cell chunk as kvarn.run.engine.run_cell computes it against `base`: the forward, the
    baseline's rows decoded where the log-probs are, the per-token metrics and their summary.
    Returns (timing, the per-token columns)."""
    import numpy as np

    from kvarn.run import engine
    from kvarn.spec import scoring
    from kvarn.stats import metrics

    scored = scoring.scored_positions(int(ids.shape[0]))
    cache = engine.new_cache(model, cell, path)
    targets = ids[scored.start + 1: scored.stop + 1]
    cols = {key: [] for key in metrics.PER_TOKEN_KEYS}
    timing = {"forward_s": 0.0, "metrics_s": 0.0}
    t0 = time.perf_counter()
    for a, lp in engine.timed(engine.chunk_logprobs(model, ids, cache, ubatch, scored), timing):
        t = time.perf_counter()
        b = a + lp.shape[0]
        tm = metrics.token_metrics(lp, base.decode(0, a, b, lp.device), targets[a:b])
        for key in cols:
            cols[key].append(tm[key])
        timing["metrics_s"] += time.perf_counter() - t
    cols = {key: np.concatenate(v) for key, v in cols.items()}
    t = time.perf_counter()
    metrics.summarize(cols)
    timing["summary_s"] = time.perf_counter() - t
    sync()
    timing["wall_s"] = timing["s_per_chunk"] = time.perf_counter() - t0
    return timing, cols


def next_run(left: float, chunk_s: float | None) -> tuple[float | None, str | None]:
    """Whether the next run of a model step starts with `left` seconds before the deadline:
    (its estimate, None) or (its estimate, why not). The estimate is `WARMUP_EST_S` + `CHUNK_FACTOR`
    x the last timed chunk's seconds (`chunk_s`; None before the first run, which starts whenever
    `MIN_START_S` is left): a warm-up's seconds, compiles included, never count."""
    est = None if chunk_s is None else WARMUP_EST_S + CHUNK_FACTOR * chunk_s
    if left < MIN_START_S or (est is not None and est > left):
        why = (f"estimated {est:.0f} s (warm-up {WARMUP_EST_S:.0f} + {CHUNK_FACTOR} x the last timed chunk's "
               f"{chunk_s:.1f} s), {left:.0f} s left" if est is not None else f"{left:.0f} s left")
        return est, why + " before the run's deadline"
    return est, None


def step_model(name: str, args, rec: Recorder) -> None:
    import torch

    import kvarn.kvcache.flex
    from kvarn.run import engine
    from kvarn.spec.cell import CellSpec
    from kvarn.weights.sources import ModelSpec

    smoke = args.smoke
    kvarn.kvcache.flex.COMPILE = not smoke  # compiling on a CPU takes minutes; this process only
    device, dtype = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n_ctx = SMOKE["n_ctx"] if smoke else MODELS[name]
    ubatch = SMOKE["ubatch"] if smoke else 512
    warm_ctx = 2 * ubatch
    work = Path(tempfile.mkdtemp(prefix="kvarn-device-run-"))
    cfg = ROOT / "config" / "models" / f"{name}.json"
    if smoke:
        cfg = tiny_config(cfg, work / f"{name}-tiny.json")
    spec = ModelSpec(name, f"random:{cfg}")
    base_rec = {"step": name, "n_ctx": n_ctx, "ubatch": ubatch, "compute": args.compute}
    t = time.perf_counter()
    try:
        ctx = engine.Context(spec, n_ctx, 1, text=str(args.text), device=device, dtype=dtype,
                             cache_dir=work / "models", ubatch=ubatch, baseline=True)
    except Exception as e:  # a preflight refusal or an out-of-memory: recorded, the runs with it
        rec.add({**base_rec, "item": "load", "status": "error", "error": _short(e)})
        for label, _, kind in RUNS:
            rec.add({**base_rec, "item": label, "kind": kind, "phase": "chunk", "status": "skipped",
                     "why": "the model did not load"})
        return
    model = ctx.loaded.model
    sync()
    load = {**base_rec, "item": "load", "status": "ok", "s": time.perf_counter() - t,
            "source": spec.source if smoke else f"random:config/models/{name}.json",
            "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    if "linear_attention" in json.loads(cfg.read_text()).get("layer_types", []):
        load["linear_attention"] = linear_attention_kernel()
    rec.add(load)
    engine.set_compute(model, spec, work / "models", args.compute)
    path = engine.attention_path("flex", device, args.compute) or "ref"
    ids = ctx.chunk_ids[0]
    base, chunk_s = None, None  # the kept baseline rows; the last timed chunk's seconds
    for label, cell_args, kind in RUNS:
        r = {**base_rec, "item": label, "kind": kind, "attention": path}
        if cell_args is not None and base is None:
            rec.add({**r, "phase": "chunk", "status": "skipped", "why": "no baseline"})
            continue
        est, why = next_run(args.deadline - time.time(), chunk_s)
        if why:
            rec.add({**r, "phase": "chunk", "status": "skipped", "why": why})
            continue
        if est is not None:
            r["est_s"] = round(est, 1)
        phase = "warm-up"
        try:
            cell = engine.baseline_cell(args.compute) if cell_args is None else CellSpec(*cell_args,
                                                                                        compute=args.compute)
            r["cell"] = cell.name

            def once(chunk):
                if cell_args is None:
                    return time_baseline(model, chunk, cell, path, ubatch, args.encode_rows, sync)
                return time_cell(model, chunk, cell, path, ubatch, base, sync)

            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            once(ids[:warm_ctx])  # compiles what this run compiles: not in the chunk's time
            sync()
            r.update({"warmup_s": time.perf_counter() - t, "warmup_ctx": warm_ctx})
            rec.add({**r, "phase": "warm-up", "status": "ok",
                     "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None})
            phase = "chunk"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            graphs = _graphs()
            with PeakRSS() as rss:
                got = once(ids)
            kept, timing = got if cell_args is None else (None, got[0])
            r.update({"phase": "chunk", "status": "ok", **timing, "tokens_per_s": n_ctx / timing["forward_s"],
                      "graphs_compiled_in_chunk": None if graphs is None else _graphs() - graphs,
                      "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                      "peak_host_bytes": rss.peak})
            chunk_s = timing["wall_s"]
            if kept is not None:
                base = kept
        except Exception as e:  # e.g. out of device memory: recorded with the peak reached; the next run goes on
            r.update({"phase": phase, "status": "error", "error": _short(e),
                      "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None})
            if cuda:
                torch.cuda.empty_cache()
        rec.add(r)


def tiny_config(study_json: Path, out: Path) -> Path:
    """The study config shrunk (same architecture and layer-type pattern, 8 layers, small dims)."""
    cfg = json.loads(study_json.read_text())
    cfg.update({k: v for k, v in TINY.items() if k in cfg})
    cfg["num_hidden_layers"] = TINY_LAYERS
    types = cfg["layer_types"]
    cfg["layer_types"] = types[:TINY_LAYERS - 1] + [types[-1]]  # keep a last layer of the final type
    out.write_text(json.dumps(cfg, indent=1))
    return out


def linear_attention_kernel() -> str:
    """The chunked gated-delta-rule function transformers' Qwen 3.5/3.6 linear layers call:
    flash-linear-attention's Triton kernel when `fla` imports, else transformers' torch
    reference (read from the closure of transformers' kernel-or-fallback wrapper)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    f = m.torch_chunk_gated_delta_rule
    free = dict(zip(f.__code__.co_freevars, (c.cell_contents for c in f.__closure__ or ())))
    impl = free.get("implementation")
    if impl is None:
        return "unknown (transformers' wrapper changed; see the run's log)"
    return f"{impl.__module__}.{impl.__qualname__}"


class PeakRSS:
    """The process's peak resident memory while the block runs (sampled from /proc every 20 ms)."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# --- the projection and the Markdown ------------------------------------------------------

def measured(records: list[dict]) -> dict[str, dict[str, float]]:
    """measured[model][kind] = seconds per chunk, from the model steps' finished runs."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if r.get("step") in MODELS and r.get("kind") and r.get("phase") != "warm-up" and r.get("status") == "ok":
            out.setdefault(r["step"], {})[r["kind"]] = r["s_per_chunk"]
    return out


def projection(records: list[dict]) -> dict:
    """bench.gpu.projection's projection from what is measured so far: {"device", "measured",
    "projection" (its dict) and "markdown"}, or {"error"} where it cannot be made."""
    m = measured(records)
    gpu = next((r.get("gpu") or "" for r in records if r.get("item") == "machine"), "")
    device = "h100" if "H100" in gpu else "h200"
    out = {"device": device, "measured": m}
    if not m:
        return {**out, "error": "nothing measured yet"}
    try:
        from bench.gpu import projection as pj
    except Exception as e:  # absent, or being written
        return {**out, "error": f"bench/gpu/projection.py not importable ({_short(e, 120)})"}
    try:
        compute = next((r["compute"] for r in records if r.get("compute") in pj.ATTENTION_COMPUTES), "bf16-attn")
        proj = pj.project(device=device, measured=m, compute=compute)
        return {**out, "projection": proj, "markdown": pj.markdown(proj)}
    except Exception as e:
        return {**out, "error": f"bench.gpu.projection failed: {_short(e)}"}


def _f(x, digits=2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _gib(b) -> str:
    return "" if b is None else f"{b / 2**30:.2f}"


def _status(r: dict) -> str:
    s = r.get("status", "")
    why = r.get("error") or r.get("why")
    return (f"{s}: {why}" if why else s).replace("|", "/")


def _imports_line(imp: dict) -> str:
    if not imp or imp.get("ok") is None:
        return "Import check: not run."
    pkgs = ", ".join(f"{m} {row.get('version') or row.get('dist_version') or 'absent'}"
                     + (f" ({row['from']})" if row.get("from") else "") for m, row in imp.get("packages", {}).items())
    head = "ok" if imp.get("ok") else "**failed**: " + "; ".join(imp.get("problems", []))
    return f"Import check ({imp.get('s', 0):.0f} s): {head}. Found: {pkgs}.".replace("|", "/")


def render(records: list[dict]) -> str:
    """The Markdown of a results file (any prefix of one: a killed run renders what it has)."""
    mach = next((r for r in records if r.get("item") == "machine"), {})
    smoke = mach.get("smoke")
    L = ["# The device run: the study's cell types at its n_ctx, flex at head dim 512, the Triton tests, the "
         "projection", "",
         f"Written by `bench/gpu/device_run.py` from `device_run.jsonl`. Machine: {mach.get('gpu') or 'no GPU (CPU)'}, "
         f"{mach.get('cpus')} CPUs; torch {mach.get('torch')}, triton {mach.get('triton')}, transformers "
         f"{mach.get('transformers')}, flash-linear-attention {mach.get('flash-linear-attention')}; commit "
         f"{mach.get('commit')}; compute {mach.get('compute')}; budget {mach.get('budget_s')} s.", "",
         _imports_line(mach.get("imports", {})), "",
         f"Command: `{mach.get('command', '')}`", ""]
    if smoke:
        L += ["**Smoke run** (tiny shapes on CPU, flex eager): checks the script, measures nothing of the study.", ""]
    for name, n_ctx in MODELS.items():
        L += ["", f"## {1 + list(MODELS).index(name)}. {name} at {n_ctx} (random weights, one chunk per run)", ""]
        load = next((r for r in records if r.get("step") == name and r.get("item") == "load"), None)
        if load:
            ok = load.get("status") == "ok"
            line = f"Model load: {_status(load)}"
            if ok:
                line += f", {load['s']:.1f} s, peak device {_gib(load.get('peak_device_bytes'))} GiB"
            if load.get("linear_attention"):
                line += f"; Gated DeltaNet layers call `{load['linear_attention']}`"
            L += [line + ".", ""]
        L += ["s/chunk: one timed chunk after its warm-up (the warm-up's seconds, compilation included, apart). "
              "Baseline: forward + log-probs to the host + their encoding as the dump's (timed on the first rows, "
              "extrapolated to the chunk's), no disk write. Cells: forward + the kept baseline rows decoded + the "
              "per-token metrics and their summary. A run whose chunk line is missing shows its warm-up's line.", "",
              "| run | cell | warm-up s (compile) | s/chunk | forward s | encode or metrics s | tokens/s | "
              "graphs compiled in chunk | peak device GiB | peak host GiB | status |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        rows = [r for r in records if r.get("step") == name and r.get("kind")]
        for r in rows:
            if r.get("phase") == "warm-up":
                if any(o.get("item") == r["item"] and o.get("phase") != "warm-up" for o in rows):
                    continue  # the chunk's line has the warm-up's seconds too
                L.append(f"| {r['item']} | {r.get('cell', '')} | {_f(r.get('warmup_s'))} | | | | | | "
                         f"{_gib(r.get('peak_device_bytes'))} (warm-up) | | warm-up {_status(r)}, no chunk line |")
                continue
            other = r.get("encode_s_chunk", r.get("metrics_s"))
            note = (f" (encode timed on {r['encode_rows']} rows)" if "encode_rows" in r else "")
            L.append(f"| {r['item']} | {r.get('cell', '')} | {_f(r.get('warmup_s'))} | "
                     f"{_f(r.get('s_per_chunk'))} | {_f(r.get('forward_s'))} | {_f(other)}{note} | "
                     f"{_f(r.get('tokens_per_s'), 0)} | "
                     f"{r.get('graphs_compiled_in_chunk', '')} | {_gib(r.get('peak_device_bytes'))} | "
                     f"{_gib(r.get('peak_host_bytes'))} | {_status(r)} |")
        L += _step_notes(records, name)
    L += ["", "## 3. flex_attention at head dim 512, compiled (`torch.compile(flex_attention, dynamic=True)`)", "",
          "Random Q/K/V, causal block mask, the last ubatch of the keys. First call: compile + one call. fp32: "
          "operands rounded to TF32 and the kernel's dots in TF32 (`FLOAT32_PRECISION 'tf32'`), as tf32-attn "
          "runs. P rule: the output against `rounded_attention` with P truncated / to nearest (mean and RMS of "
          "the difference over the output's magnitude).", "",
          "| head dim | dtype | keys | queries | heads q/kv | first call s | per call ms | compile s | peak GiB "
          "| P rule | status |",
          "|---:|---|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for r in records:
        if r.get("step") == "flex" and r.get("item") != "step":
            opts = " (small blocks)" if r.get("small_blocks") else ""
            heads = "/".join(str(h) for h in r.get("heads", ()))
            pr = r.get("p_rule")
            rule = (f"{pr['closer']} (truncate {pr['truncate']['mean']:.1e} / {pr['truncate']['rms']:.1e}; "
                    f"nearest {pr['nearest']['mean']:.1e} / {pr['nearest']['rms']:.1e})" if pr else "")
            dtype = "float32 (TF32)" if r.get("tf32") else r.get("dtype", "")
            L.append(f"| {r.get('head_dim', '')} | {dtype}{opts} | {r.get('keys', '')} | "
                     f"{r.get('queries', '')} | {heads} | "
                     f"{_f(r.get('first_call_s'))} | {_f(r['per_call_s'] * 1e3 if 'per_call_s' in r else None, 1)} | "
                     f"{_f(r.get('compile_s'))} | {_gib(r.get('peak_device_bytes'))} | {rule} | {_status(r)} |")
    L += _step_notes(records, "flex")
    L += ["", "## 4. The KVarN Triton kernels' GPU tests", ""]
    t = [r for r in records if r.get("step") == "triton"]
    for r in t:
        if r.get("item") == "step":
            L.append(f"* {_status(r)}")
        else:
            L.append(f"* `{r['command']}`: {r['status']} (rc {r['rc']}), {r['passed']} passed, {r['failed']} "
                     f"failed, {r['skipped']} skipped, {r['error']} errors in {r['s']:.0f} s; `{r['summary']}`")
    if not t:
        L.append("* not run yet")
    L += ["", "## 5. Projection (bench/gpu/projection.py, from the seconds per chunk above)", ""]
    proj = projection(records)
    if "markdown" in proj:
        L.append(proj["markdown"].rstrip())
    else:
        L.append(f"Not available: {proj['error']}.")
    L += ["", f"Measured seconds per chunk it reads: `{json.dumps(proj['measured'])}`"
          + (" (tiny smoke models: checks the arithmetic only)" if smoke else "")]
    done = next((r for r in records if r.get("item") == "done"), None)
    stopped = next((r for r in records if r.get("item") == "stopped"), None)
    L += ["", f"Run finished in {done['s']:.0f} s." if done else f"Run stopped: {_status(stopped)}." if stopped
          else "Run stopped at the import check." if mach.get("imports", {}).get("ok") is False
          else "Run not finished (killed, or still running)."]
    return "\n".join(L) + "\n"


def _step_notes(records, step) -> list[str]:
    return [f"\nStep {step}: {_status(r)}." for r in records if r.get("step") == step and r.get("item") == "step"]


# --- entry ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    from kvarn.spec.options import ATTENTION_ROUNDING, TF32_ATTN

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
        print(json.dumps(check_imports(args.smoke), default=_plain), flush=True)
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
