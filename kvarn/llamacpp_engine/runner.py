"""The baseline and one cell through a llama.cpp build (`engine: llama.cpp`): the program's own logits.

Both go through the harness (kvarn_kld.cpp, compiled against the build: `kvarn.llamacpp_engine.build`),
which runs llama-perplexity's KLD protocol with the build's own argument parser, model loader,
context and decode, and writes one record per scored token:

    baseline  the bf16/bf16 cache (-ctk bf16 -ctv bf16): the KLD base file llama-perplexity's
              --kl-divergence-base writes (byte for byte: tests/test_program.py), and its identity
              beside it (`<file>.json`)
    cell      the cell's -ctk/-ctv, tail (--kv-tail-tokens, where the build has it) and rotation
              switch (LLAMA_ATTN_ROT_DISABLE=1 for rot false) against that base file: tokens.parquet
              (the torch engine's columns) and summary.json (kvarn.stats.metrics.summarize over the
              records: what llama-perplexity --kl-divergence prints for the same cell)

Settings (`Settings`: the matrix's `engine` block) go on every command line: -b (capped at
n_ctx: one sequence per batch), -ub (the model's ubatch), -t, -fa, -ngl and any extra arguments.
Every setting, the build's identity and the numerics environment are the run's identity
(`run_identity`): a cell refuses a baseline of another (`check_identity`). What the build cannot
run is refused before any work, with the build's own list (`cell_args`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvarn.files.atomic import atomic_path, write_text
from kvarn.files.identity import uncached_sha256
from kvarn.llamacpp_engine import build as pbuild
from kvarn.vocab import facts, scoring
from kvarn.vocab.cell import CellSpec
from kvarn.vocab.options import DEFAULT_COMPUTE
from kvarn.llamacpp_engine.settings import ENGINE, Settings

RECORD_COLUMNS = ("chunk", "pos", "kld", "nll", "nll_base", "dp", "same_top")


class Refused(ValueError):
    """A cell this build cannot run; the message names the build, the value and what it accepts."""


# --- what a build can run --------------------------------------------------------------

def cell_args(b: pbuild.Build, cell: CellSpec) -> tuple[list[str], dict]:
    """(-ctk/-ctv/tail arguments, environment) of a cell on build `b`; Refused before any work."""
    where = f"llama.cpp build {b.dir} ({b.version})"
    if cell.compute != DEFAULT_COMPUTE:
        raise Refused(f"{cell.name}: compute {cell.compute!r} is an arithmetic of the torch engine; "
                      f"the llama.cpp engine runs the program itself (drop compute)")
    for role, t in (("k", cell.k), ("v", cell.v)):
        if t not in b.cache_types:
            raise Refused(f"{cell.name}: {where} does not accept --cache-type-{role} {t}; its --help allows: "
                          f"{', '.join(b.cache_types)}")
    if cell.sink is not None:
        raise Refused(f"{cell.name}: sink {cell.sink}: a sink for a standard type is kvarn's cache model, "
                      f"{where} has no such option")
    if cell.tail_dtype is not None:
        raise Refused(f"{cell.name}: tail dtype {cell.tail_dtype}: {where} takes the program's own tail dtype")
    if cell.iters != facts.KVARN_ITERS:
        raise Refused(f"{cell.name}: KVarN iters {cell.iters}: {where} runs its own {facts.KVARN_ITERS} passes")
    args = ["-ctk", cell.k, "-ctv", cell.v]
    if cell.tail:
        if not b.has_option("--kv-tail-tokens"):
            raise Refused(f"{cell.name}: tail {cell.tail}: {where} has no --kv-tail-tokens (upstream llama.cpp keeps "
                          f"no exact tail; BeeLlama does): run tail 0 here")
        args += ["--kv-tail-tokens", str(cell.tail)]
    quantized = any(facts.get(t).family != "float" for t in (cell.k, cell.v))
    env = {"LLAMA_ATTN_ROT_DISABLE": "1"} if (not cell.rot and quantized) else {}
    return args, env


# --- identity ---------------------------------------------------------------------------

def program_env(settings: Settings, env: dict | None = None) -> dict:
    """The numerics environment the program runs under, sorted: the NUMERICS_ENV variables set in this
    process, then the settings' env, then a cell's own (`cell_args`), a later one winning."""
    return dict(sorted({**{k: os.environ[k] for k in pbuild.NUMERICS_ENV if k in os.environ}, **settings.env,
                        **(env or {})}.items()))


def run_identity(b: pbuild.Build, settings: Settings, threads: int, ubatch: int, n_ctx: int, gguf_sha256: str,
                 text_sha256: str) -> dict:
    """What a baseline and its cells must share: the build, every setting, the numerics environment."""
    numerics = program_env(settings)
    numerics.pop("LLAMA_ATTN_ROT_DISABLE", None)  # the cell's rot, not the run's
    return {"engine": ENGINE, "build": b.identity(), "threads": threads, "batch": min(settings.batch, n_ctx),
            "ubatch": ubatch, "flash_attn": settings.flash_attn, "gpu_layers": settings.gpu_layers,
            "args": list(settings.args), "env": numerics, "n_ctx": n_ctx,
            "weights_sha256": gguf_sha256, "text_sha256": text_sha256}


def check_identity(base: dict, ours: dict, base_path) -> None:
    """Refuse a baseline made by another build or setting, naming the first difference."""
    for key in ours:
        if base.get(key) != ours[key]:
            raise ValueError(f"baseline {base_path}: {key} is {base.get(key)!r} there but {ours[key]!r} in this cell: "
                             "a cell is scored only against a baseline of the same build and settings; remake it")


# --- running the harness ----------------------------------------------------------------

def common_args(b: pbuild.Build, settings: Settings, gguf: Path, n_ctx: int, ubatch: int, threads: int) -> list[str]:
    """The options of every run: the model, -c, -b (capped at n_ctx), -ub, -t, -fa, -ngl, the settings'
    own; info-level logging where the build gates it (its KV buffer and speed lines are read back)."""
    verbosity = ["-lv", "4"] if b.has_option("--log-verbosity") else []
    return ["-m", str(gguf), "-c", str(n_ctx), "-b", str(min(settings.batch, n_ctx)), "-ub", str(ubatch),
            "-t", str(threads), "-fa", settings.flash_attn, "-ngl", str(settings.gpu_layers), *verbosity,
            *settings.args]


def run_harness(b: pbuild.Build, mode: str, args: list[str], env: dict, records: Path, log: Path) -> str:
    """Run the harness; its stderr and stdout go to `log`; returns the log's text. A failure raises
    with the log's last lines."""
    exe = pbuild.harness(b)
    cmd = [str(exe), "--kvarn-mode", mode, "--kvarn-records", str(records), *args]
    full_env = {**os.environ, **env}
    with open(log, "w") as f:
        f.write("$ " + " ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env)
    text = log.read_text(errors="replace")
    if r.returncode != 0:
        tail = "\n".join(text.splitlines()[-15:])
        raise RuntimeError(f"llama.cpp ({b.dir}) failed with rc {r.returncode}; the end of {log}:\n{tail}")
    return text


# upstream prints "KV buffer size" per cache; BeeLlama also "KV tail buffer size" (a standard type's exact
# tail) and, for a KVarN cache, "KVarN buffer size" and "KVarN tail buffer size" instead
KV_LINE = re.compile(r"(?:KV|KV tail|KVarN|KVarN tail) buffer size\s*=\s*([\d.]+) MiB")
PROMPT_LINE = re.compile(r"prompt eval time\s*=\s*([\d.]+) ms /\s*(\d+) tokens")


def program_figures(text: str) -> dict:
    """What the program printed: its KV buffers (MiB, summed over its caches) and its prompt speed."""
    kv = [float(x) for x in KV_LINE.findall(text)]
    m = PROMPT_LINE.search(text)
    out = {"kv_program_mib": sum(kv) if kv else None, "prefill_tokens_per_s": None}
    if m and float(m[1]) > 0:
        out["prefill_tokens_per_s"] = int(m[2]) / (float(m[1]) / 1000)
    return out


# What llama-perplexity --kl-divergence prints, as (summary key, pattern, scale to the summary's fractions).
PRINTED = [
    ("ppl_q", r"Mean PPL\(Q\)\s+:\s+([-\d.]+)", 1), ("ppl_base", r"Mean PPL\(base\)\s+:\s+([-\d.]+)", 1),
    ("ln_ppl_ratio", r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s+:\s+([-\d.]+)", 1),
    ("kld_mean", r"Mean    KLD:\s+([-\d.]+)", 1), ("kld_max", r"Maximum KLD:\s+([-\d.]+)", 1),
    ("kld_p99", r"99\.0%   KLD:\s+([-\d.]+)", 1), ("kld_median", r"Median  KLD:\s+([-\d.]+)", 1),
    ("kld_p10", r"10\.0%   KLD:\s+([-\d.]+)", 1), ("kld_min", r"Minimum KLD:\s+([-\d.]+)", 1),
    ("dp_mean", r"Mean    Δp:\s+([-\d.]+)", 100), ("dp_median", r"Median  Δp:\s+([-\d.]+)", 100),
    ("dp_rms", r"RMS Δp    :\s+([-\d.]+)", 100), ("same_top", r"Same top p:\s+([-\d.]+)", 100),
]


def printed_figures(text: str, keys=None) -> dict[str, tuple[float, float]]:
    """{summary key: (value, one unit of its last printed digit)} of a --kl-divergence printout, for `keys`
    (default: every key of PRINTED); a figure the text lacks raises ValueError naming it."""
    out = {}
    for key, pat, scale in PRINTED:
        if keys is not None and key not in keys:
            continue
        m = re.search(pat, text)
        if m is None:
            raise ValueError(f"{key}: no {pat!r} in the printout")
        digits = len(m[1].split(".")[1]) if "." in m[1] else 0
        out[key] = (float(m[1]) / scale, 10.0 ** -digits / scale)
    return out


def read_records(path: Path):
    """The harness's per-token TSV as a polars frame of the torch engine's columns (chunk, pos int32; floats;
    same_top bool)."""
    import polars as pl

    df = pl.read_csv(path, separator="\t", schema_overrides={"chunk": pl.Int32, "pos": pl.Int32})
    if tuple(df.columns) != RECORD_COLUMNS:
        raise ValueError(f"{path}: columns {df.columns}, expected {list(RECORD_COLUMNS)}")
    return df.with_columns(*(pl.col(c).cast(pl.Float64) for c in ("kld", "nll", "nll_base", "dp")),
                           pl.col("same_top").cast(pl.Boolean))


def run_baseline(b: pbuild.Build, settings: Settings, gguf: Path, gguf_sha256: str, text: Path, text_sha256: str,
                 n_ctx: int, chunks: int | None, ubatch: int, threads: int, out: Path) -> dict:
    """The bf16-cache base file at `out` (llama-perplexity's format) and its identity at `out`.json."""
    scoring.scored_positions(n_ctx)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ident = run_identity(b, settings, threads, ubatch, n_ctx, gguf_sha256, text_sha256)
    t0 = time.perf_counter()
    Path(f"{out}.json").unlink(missing_ok=True)  # the identity is written last: its presence means done
    with atomic_path(out) as tmp:
        args = [*common_args(b, settings, gguf, n_ctx, ubatch, threads), "-f", str(text), "-ctk", "bf16", "-ctv", "bf16",
                "--kl-divergence-base", str(tmp)] + (["--chunks", str(chunks)] if chunks else [])
        records = tmp.with_name(tmp.name + ".tsv")
        try:
            text_out = run_harness(b, "base", args, settings.env, records, out.with_name(out.name + ".log"))
        finally:
            records.unlink(missing_ok=True)
    info = {**ident, **program_figures(text_out), "wall_s": time.perf_counter() - t0}
    write_text(out.with_name(out.name + ".json"), json.dumps(info, indent=1) + "\n")
    return info


def run_cell(b: pbuild.Build, settings: Settings, cell: CellSpec, gguf: Path, gguf_sha256: str, text_sha256: str,
             n_ctx: int, ubatch: int, threads: int, baseline: Path, out_dir: Path, model_fields: dict,
             chunks: int | None = None) -> dict:
    """One cell against the base file `baseline`: out_dir/tokens.parquet, summary.json (and the program's log)."""
    from kvarn.stats import metrics

    cell_extra, env = cell_args(b, cell)  # refused before any work
    base_info = json.loads(Path(f"{baseline}.json").read_text())
    ident = run_identity(b, settings, threads, ubatch, n_ctx, gguf_sha256, text_sha256)
    check_identity(base_info, ident, baseline)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check = self_check(b, settings, cell, gguf, gguf_sha256, n_ctx, ubatch, threads, baseline, out_dir / "selfcheck")
    t0 = time.perf_counter()
    records = out_dir / "records.tsv"
    args = [*common_args(b, settings, gguf, n_ctx, ubatch, threads), *cell_extra, "--kl-divergence-base", str(baseline),
            "--kl-divergence"] + (["--chunks", str(chunks)] if chunks else [])
    text = run_harness(b, "cell", args, {**settings.env, **env}, records, out_dir / "program.log")
    frame = read_records(records)
    records.unlink()
    summary = metrics.summarize(frame)
    summary.update(model_fields)
    summary.update({
        "n_ctx": n_ctx, "chunks": int(frame["chunk"].max()) + 1, "ubatch": ubatch,
        "k_type": cell.k, "v_type": cell.v, "rot": cell.rot, "tail": cell.tail, "sink_requested": cell.sink,
        "tail_dtype": facts.pair_default_tail_dtype(cell.k, cell.v), "iters": cell.iters,
        "tail_eff": facts.pair_effective_tail(cell.k, cell.v, cell.tail),
        "compute": cell.compute, "engine": ENGINE, "engine_identity": ident, "program_env": env,
        **program_figures(text), "wall_s": time.perf_counter() - t0,
        "device": b.backend, "baseline_kind": "llama", "self_check": check,
        "engine_build": b.version, "engine_backend": b.backend, "engine_threads": threads,
    })
    summary["tokens_per_s"] = summary["prefill_tokens_per_s"]
    with atomic_path(out_dir / "tokens.parquet") as tmp:
        frame.write_parquet(tmp)
    write_text(out_dir / "summary.json", json.dumps(summary, indent=1, default=_json) + "\n")
    return summary


# --- decode speed through the build's own bench tool ----------------------------------------------

def decode_speed(b: pbuild.Build, settings: Settings, cell: CellSpec, gguf: Path, n_ctx: int, ubatch: int,
                 threads: int, log: Path) -> dict:
    """Decode tokens/s of the cell's cache at `settings.decode_depths` (fractions of n_ctx) through the
    build's llama-bench (-p 0 -n decode_tokens -d DEPTHS, 3 repetitions): {depth: (mean, std)}; {} when the
    settings ask for none. Refused where llama-bench lacks the cell's options (a tail)."""
    if not settings.decode_depths:
        return {}
    if b.bench is None:
        raise Refused(f"{b.dir} has no bin/llama-bench: build its llama-bench target, or drop decode_depths")
    cell_extra, env = cell_args(b, cell)
    if cell.tail:
        h = subprocess.run([str(b.bench), "--help"], capture_output=True, text=True, timeout=60)
        if "--kv-tail-tokens" not in h.stdout + h.stderr:
            raise Refused(f"{cell.name}: {b.bench} takes no --kv-tail-tokens; drop decode_depths for tail cells")
    depths = sorted({int(round(d * n_ctx)) for d in settings.decode_depths})
    repack = ["--repack", "0"] if {"-nr", "--no-repack"} & set(settings.args) else []
    cmd = [str(b.bench), "-m", str(gguf), "-p", "0", "-n", str(settings.decode_tokens), "-d",
           ",".join(map(str, depths)), "-ub", str(ubatch), "-b", str(min(settings.batch, n_ctx)), "-t", str(threads),
           "-fa", settings.flash_attn, "-ngl", str(settings.gpu_layers), "-r", "3", "-o", "json", *repack, *cell_extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **settings.env, **env})
    log.write_text("$ " + " ".join(cmd) + "\n" + r.stderr + r.stdout)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed with rc {r.returncode}; see {log}")
    rows = json.loads(r.stdout)
    return {int(x["n_depth"]): (float(x["avg_ts"]), float(x["stddev_ts"])) for x in rows}


# --- the workflow's jobs ----------------------------------------------------------------------

@dataclass(frozen=True)
class _Job:
    """What a baseline or cell job starts from: the build (checked against the plan), its settings, the
    GGUF and its sha256, the text's sha256, the thread count and the model's config (read once)."""

    build: pbuild.Build
    settings: Settings
    gguf: Path
    gguf_sha256: str
    text_sha256: str
    threads: int
    config: dict


def _job(spec, cache_dir, text, engine: dict, job_threads: int, n_ctx: int) -> _Job:
    """A job's inputs, n_ctx checked against the model's trained context (kvarn.budget.preflight.check_context:
    refused beyond it unless KVARN_ALLOW_LONG_CONTEXT=1) before the program runs."""
    from kvarn.budget.preflight import check_context
    from kvarn.files.identity import file_sha256, uncached_sha256
    from kvarn.weights.sources import config_json, gguf_path

    settings = Settings.from_config(engine["settings"])
    b = pbuild.read_build(pbuild.build_path(settings.build))
    pbuild.require(engine["build"], b)
    gguf = gguf_path(spec, cache_dir)
    if gguf is None:
        raise Refused(f"model {spec.name} ({spec.source}) has no GGUF file: the llama.cpp engine runs GGUF weights "
                      "(an embedded model, hf:org/repo/file.gguf or a local .gguf)")
    config = config_json(spec, cache_dir)
    check_context(config, n_ctx)
    # the text's bytes were checked against wiki.test.raw's sha256 by the workflow's wikitext rule
    return _Job(b, settings, Path(gguf), file_sha256(gguf), uncached_sha256(Path(text)),
                settings.threads or job_threads, config)


def baseline_job(spec, cache_dir, text, n_ctx: int, chunks: int | None, ubatch: int, engine: dict,
                 job_threads: int, out: Path) -> dict:
    """Rule baseline_program: the base file and its identity."""
    j = _job(spec, cache_dir, text, engine, job_threads, n_ctx)
    return run_baseline(j.build, j.settings, j.gguf, j.gguf_sha256, Path(text), j.text_sha256, n_ctx, chunks, ubatch,
                        j.threads, out)


def cell_job(spec, cache_dir, text, n_ctx: int, ubatch: int, engine: dict, job_threads: int, cell: CellSpec,
             baseline: Path, out_dir: Path, accounting: str = "packed") -> dict:
    """Rule cell_program: one cell's tokens.parquet and summary.json, with kvarn's memory accounting of the
    same cell (from the model's geometry) beside the KV buffers the program printed, and its decode speed
    where the settings ask for it (the build's own bench tool)."""
    from kvarn.budget import memory
    from kvarn.vocab.geometry import config_object, geometry_from_config

    j = _job(spec, cache_dir, text, engine, job_threads, n_ctx)
    cell_args(j.build, cell)  # refused before anything else runs
    geom = geometry_from_config(config_object(j.config))
    fields = {"model": spec.name, "source": spec.source, "revision": spec.revision,
              **memory.summary_fields(geom, n_ctx, cell, ubatch=ubatch, accounting=accounting)}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    speed = decode_speed(j.build, j.settings, cell, j.gguf, n_ctx, ubatch, j.threads,
                         Path(out_dir) / "llama-bench.log")
    for depth, (ts, sd) in speed.items():
        fields[f"decode_tokens_per_s_d{depth}"] = ts
        fields[f"decode_tokens_per_s_d{depth}_std"] = sd
    return run_cell(j.build, j.settings, cell, j.gguf, j.gguf_sha256, j.text_sha256, n_ctx, ubatch, j.threads,
                    baseline, out_dir, fields)


# --- the self-check: does the build's answer depend on its thread count? ----------------------

def self_check_key(b: pbuild.Build, settings: Settings, cell: CellSpec, gguf_sha256: str, n_ctx: int, ubatch: int,
                   threads: int, env: dict) -> dict:
    """What can change whether the program races or rounds differently, the self-check's cache key: the build
    and the harness compiled against it, the weights, n_ctx, batch, ubatch, the settings, the thread count,
    the whole cell with its effective tail and tail dtype (and whether the exact tail's ring, tail + 1 slots,
    is shorter than a ubatch: BeeLlama's race), and the numerics environment with the cell's `env`."""
    tail = facts.pair_effective_tail(cell.k, cell.v, cell.tail)
    return {"build": b.identity(), "harness_sha256": uncached_sha256(pbuild.harness(b)),
            "weights_sha256": gguf_sha256, "n_ctx": n_ctx, "batch": min(settings.batch, n_ctx), "ubatch": ubatch,
            "settings": settings.as_param(), "threads": threads, "cell": {"name": cell.name, **asdict(cell)},
            "tail_eff": tail, "tail_ring_short": 0 < tail and tail + 1 < ubatch,
            "tail_dtype": cell.tail_dtype or facts.pair_default_tail_dtype(cell.k, cell.v),
            "env": program_env(settings, env)}


def _differing(a, b) -> int:
    """Tokens whose records differ in any column (all of them when the two runs scored different tokens)."""
    if a.height != b.height:
        return max(a.height, b.height)
    return int(np.any([a[c].to_numpy() != b[c].to_numpy() for c in RECORD_COLUMNS], axis=0).sum())


def _moved(run: dict, ref: dict) -> str:
    """A run's mean / median / p99 KLD, how far each moved from `ref`'s, and the most one token's KLD moved."""
    out = []
    for k in ("mean", "median", "p99"):
        rel = f", {100 * (run[k] - ref[k]) / abs(ref[k]):+.1f} %" if ref[k] else ""
        out.append(f"{k} {run[k]:.6g} ({run[k] - ref[k]:+.3g}{rel})")
    token = run["max_token_move"]
    return ", ".join(out) + (f", one token's KLD by up to {token:.3g}" if token is not None else "")


def self_check(b: pbuild.Build, settings: Settings, cell: CellSpec, gguf: Path, gguf_sha256: str, n_ctx: int,
               ubatch: int, threads: int, baseline: Path, work: Path) -> dict:
    """One chunk of `cell` at -t 1 and twice at -t `threads`, against the baseline's first chunk; cached in the
    build's folder per `self_check_key`. A sound build writes bit-identical records at every thread count: any
    difference between the three runs' per-token records refuses the cell (Refused, naming each run's mean /
    median / p99 KLD and how far it moved). Nothing to check at one thread."""
    if threads == 1:
        return {"cell": cell.name, "threads": 1, "checked": False}
    cell_extra, env = cell_args(b, cell)
    key = self_check_key(b, settings, cell, gguf_sha256, n_ctx, ubatch, threads, env)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    cached = b.dir / "kvarn" / "selfcheck" / f"{digest[:16]}.json"
    if cached.is_file():
        result = json.loads(cached.read_text())
    else:
        work.mkdir(parents=True, exist_ok=True)
        frames = []
        for i, t in enumerate((1, threads, threads)):
            rec = work / f"selfcheck-{i}.tsv"
            args = [*common_args(b, settings, gguf, n_ctx, ubatch, t), *cell_extra, "--kl-divergence-base",
                    str(baseline), "--kl-divergence", "--chunks", "1"]
            run_harness(b, "cell", args, {**settings.env, **env}, rec, work / f"selfcheck-{i}.log")
            frames.append(read_records(rec))
        runs, ref = [], frames[0]["kld"].to_numpy()
        for t, f in zip((1, threads, threads), frames):
            kld = f["kld"].to_numpy()
            runs.append({"threads": t, "tokens": f.height, "mean": float(kld.mean()), "median": float(np.median(kld)),
                         "p99": float(np.percentile(kld, 99)),
                         "max_token_move": float(np.abs(kld - ref).max()) if len(kld) == len(ref) else None})
        differ = {"t1_run1": _differing(frames[0], frames[1]), "t1_run2": _differing(frames[0], frames[2]),
                  "run1_run2": _differing(frames[1], frames[2])}
        result = {"cell": cell.name, "threads": threads, "checked": True, "key": key, "runs": runs,
                  "differing_tokens": differ, "ok": not any(differ.values())}
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_text(cached, json.dumps(result, indent=1) + "\n")
    if not result["ok"]:
        r, d, k = result["runs"], result["differing_tokens"], result["key"]
        ring = (f" (its exact tail's ring, {k['tail_eff']} + 1 slots, is shorter than the {k['ubatch']}-token ubatch, "
                f"where BeeLlama v0.4.3 races)" if k["tail_ring_short"] else "")
        raise Refused(
            f"{cell.name}: llama.cpp build {b.dir} ({b.version}) does not write the same per-token records at -t 1 "
            f"and -t {threads}{ring}: of one chunk's {r[0]['tokens']} tokens, {d['t1_run1']} differ between -t 1 and "
            f"the first -t {threads} run, {d['t1_run2']} between -t 1 and the second, {d['run1_run2']} between the "
            f"two -t {threads} runs. KLD at -t 1: mean {r[0]['mean']:.6g}, median {r[0]['median']:.6g}, p99 "
            f"{r[0]['p99']:.6g}; -t {threads} run 1: {_moved(r[1], r[0])}; -t {threads} run 2: {_moved(r[2], r[0])}. "
            "A sound build is bit-identical at every thread count: run this model at one thread (engine.threads: 1); "
            "docs/notes/beellama-thread-race.md")
    return result


def _json(x):
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
