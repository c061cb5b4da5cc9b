#!/usr/bin/env bash
# `make run` of a matrix (default: the unchanged default config/matrix.yaml) from a clean
# results directory, twice, one after the other from the same checkout:
#   before: KVARN_WORKER=0, every baseline/cell job loads its model in its own process
#           (the way every job ran before kvarn.run.worker);
#   after:  KVARN_WORKER=1, the jobs of a (model, n_ctx) talk to one worker (kvarn.run.worker).
# Writes bench/perf/results/make_run.md: wall times, ratio, per-rule seconds from Snakemake's
# benchmark files, the machine's load average before and after each run.
#
#   bench/perf/make_run.sh [CONFIG.yaml]      (PY=path/to/python to pick the interpreter)
#   ONLY_MODEL=smollm2-135m bench/perf/make_run.sh   one model of the matrix, without its decode
#                                                    jobs (not model-loading cell jobs): a shorter run
#
# Each run works in a fresh copy of the workflow (Snakefile, workflow/, config/, envs/)
# under a temporary directory, over this checkout's model cache (already fetched: the
# fetch jobs only write markers) and its kvarn (PYTHONPATH).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
CONFIG=${1:-$ROOT/config/matrix.yaml}
OUT=$ROOT/bench/perf/results/make_run.md
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/kvarn-make-run.XXXXXX")}  # WORK=<an earlier run's dir> SUMMARIZE_ONLY=1: the table again
export PYTHONPATH=$ROOT KVARN_WORKER_IDLE=30 OMP_NUM_THREADS=1

for mode in 0 1; do
  [ -n "${SUMMARIZE_ONLY:-}" ] && break
  wd=$WORK/worker$mode
  mkdir -p "$wd"
  cp -r "$ROOT/Snakefile" "$ROOT/workflow" "$ROOT/config" "$ROOT/envs" "$wd/"
  # the text and the model cache as absolute paths (the config's are relative to the checkout)
  "$PY" - "$CONFIG" "$wd/config/matrix.yaml" "$ROOT" <<'EOF'
import os, sys
from pathlib import Path
import yaml
src, dst, root = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
cfg = yaml.safe_load(open(src))
only = os.environ.get("ONLY_MODEL")
if only:
    cfg["models"] = [{k: v for k, v in m.items() if k != "decode"} for m in cfg["models"] if m["name"] == only]
    if not cfg["models"]:
        sys.exit(f"ONLY_MODEL={only!r} (environment): not a model of {src}")
for key in ("text", "model_cache"):
    if cfg.get(key) and not Path(cfg[key]).is_absolute():
        cfg[key] = str((root / cfg[key]).resolve())
dst.write_text(yaml.safe_dump(cfg, sort_keys=False))
EOF
  load0=$(cut -d' ' -f1-3 /proc/loadavg)
  t0=$(date +%s.%N)
  rc=0
  (cd "$wd" && KVARN_WORKER=$mode "$PY" -m snakemake --cores 1 --resources gpu=1 --workflow-profile none \
     >"$wd/snakemake.log" 2>&1) || rc=$?
  t1=$(date +%s.%N)
  load1=$(cut -d' ' -f1-3 /proc/loadavg)
  echo "$mode $t0 $t1 $rc $load0 $load1" >>"$WORK/runs.txt"
  echo "KVARN_WORKER=$mode: rc $rc, $(awk "BEGIN{print $t1 - $t0}") s (load $load0 -> $load1)"
done

"$PY" - "$WORK" "$OUT" "$CONFIG" <<'EOF'
import os, subprocess, sys
from pathlib import Path
import polars as pl
work, out, config = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
runs = {}
for line in (work / "runs.txt").read_text().splitlines():
    mode, t0, t1, rc, *load = line.split()
    runs[mode] = dict(wall=float(t1) - float(t0), rc=int(rc), load0=" ".join(load[:3]), load1=" ".join(load[3:]))
from bench.perf.rule_seconds import rules
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                        cwd=Path(out).parents[3]).stdout.strip()
b, a = runs["0"], runs["1"]
lines = [
    "# `make run` before and after kvarn.run.worker, side by side",
    "",
    f"Written by `bench/perf/make_run.sh` at commit {commit}, matrix `{config}`"
    + (f" restricted to {os.environ['ONLY_MODEL']} without its decode jobs (ONLY_MODEL)" if os.environ.get("ONLY_MODEL") else "")
    + ", "
    f"`snakemake --cores 1 --resources gpu=1` from a clean results directory, the two runs one after "
    "the other on the same machine. **The machine is shared** (a 2-core VM with other engineers' "
    "jobs running): the load averages (1/5/15 min) at the start and end of each run are given; "
    "wall times move with them." + (f" {os.environ['BENCH_NOTE']}" if os.environ.get("BENCH_NOTE") else ""),
    "",
    "| run | KVARN_WORKER | exit | wall s | load at start | load at end |",
    "|---|---|---:|---:|---|---|",
    f"| before (a process and a model load per job) | 0 | {b['rc']} | {b['wall']:.0f} | {b['load0']} | {b['load1']} |",
    f"| after (one worker per model and n_ctx) | 1 | {a['rc']} | {a['wall']:.0f} | {a['load0']} | {a['load1']} |",
    "",
    f"**Ratio before/after: {b['wall'] / a['wall']:.2f}x** (goal of issue 9: >= 2x).",
    "",
    "Per rule (Snakemake's benchmark files, seconds of each job's wall time):",
    "",
]
for mode, label in (("0", "before"), ("1", "after")):
    df = rules(work / f"worker{mode}")
    lines += [f"{label}:", "", "| rule | jobs | total s | mean s |", "|---|---:|---:|---:|"]
    lines += [f"| {r['rule']} | {r['jobs']} | {r['total_s']:.1f} | {r['mean_s']:.2f} |" for r in df.iter_rows(named=True)]
    lines.append("")
Path(out).parent.mkdir(parents=True, exist_ok=True)
tmp = Path(out).with_suffix(".md.tmp")
tmp.write_text("\n".join(lines) + "\n")
tmp.replace(out)
print("\n".join(lines))
EOF
