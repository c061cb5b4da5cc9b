#!/usr/bin/env bash
# `make run` of the same matrix at two commits of this repository, side by side in one run:
# the issue-9 goal "make run on the unchanged default matrix >= 2x faster than today".
#
#   bench/perf/make_run_revs.sh [OLD_REV [NEW_REV]]
#     OLD_REV  default 4f9b598: main when issue 9 was measured (its default matrix: n_ctx 512)
#     NEW_REV  default HEAD
#     CONFIG_OLD / CONFIG_NEW  the matrix at each commit (default config/matrix.yaml at the
#              old one, config/matrix-512.yaml at the new one: the old default, renamed);
#              the two are refused unless they parse to the same matrix (comments aside).
#     PY       the interpreter (default: this checkout's .venv); kvarn comes from each clone.
#
# Both runs start at the same moment, each pinned to its own core (taskset) with
# `snakemake --cores 1 --resources gpu=1` from a clean results directory, so the load of the
# shared machine falls on both alike and neither gets more than one core (before issue 9
# every model job ran torch on one thread anyway: Snakemake's OMP_NUM_THREADS=1). Once the
# faster run ends the slower one runs alone: the ratio is, if anything, understated.
# Each clone gets its own copy of the fetched model cache (a re-fetch in one cannot touch
# the other) and `shared/` beside it. Writes bench/perf/results/make_run_revs.md: wall times, the
# ratio, per-rule seconds, and every cell's median/mean KLD at both commits.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
OLD=$(git -C "$ROOT" rev-parse --short "${1:-4f9b598}")
NEW=$(git -C "$ROOT" rev-parse --short "${2:-HEAD}")
CONFIG_OLD=${CONFIG_OLD:-config/matrix.yaml}
CONFIG_NEW=${CONFIG_NEW:-config/matrix-512.yaml}
OUT=$ROOT/bench/perf/results/make_run_revs.md
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/kvarn-make-run-revs.XXXXXX")}
[ "$(nproc)" -ge 2 ] || { echo "needs 2 cores (one per run), this machine has $(nproc)" >&2; exit 2; }
[ -d "$ROOT/../shared/data" ] || { echo "no $ROOT/../shared/data (the text): see README set-up" >&2; exit 2; }

ln -sfn "$(cd "$ROOT/../shared" && pwd)" "$WORK/shared"
for side in old new; do
  rev=$OLD; [ $side = new ] && rev=$NEW
  git clone -q --no-checkout "$ROOT" "$WORK/$side"
  git -C "$WORK/$side" checkout -q "$rev"
  mkdir -p "$WORK/$side/resources"
  cp -r "$ROOT/resources/models" "$WORK/$side/resources/models"
done
"$PY" - "$WORK/old/$CONFIG_OLD" "$WORK/new/$CONFIG_NEW" <<'EOF'
import sys, yaml
a, b = (yaml.safe_load(open(p)) for p in sys.argv[1:3])
if a != b:
    sys.exit(f"{sys.argv[1]} and {sys.argv[2]} are different matrices: not a side-by-side of the same work")
EOF

run() {  # side core config
  local wd=$WORK/$1 t0 t1 rc=0
  t0=$(date +%s.%N)
  (cd "$wd" && PYTHONPATH=$wd KVARN_WORKER_IDLE=30 taskset -c "$2" "$PY" -m snakemake --cores 1 \
     --resources gpu=1 --configfile "$3" >"$wd/snakemake.log" 2>&1) || rc=$?
  t1=$(date +%s.%N)
  echo "$1 $t0 $t1 $rc" >>"$WORK/runs.txt"
  echo "$1: rc $rc, $(awk "BEGIN{print $t1 - $t0}") s"
}
load0=$(cut -d' ' -f1-3 /proc/loadavg)
run old 0 "$CONFIG_OLD" & run new 1 "$CONFIG_NEW" & wait
load1=$(cut -d' ' -f1-3 /proc/loadavg)

PYTHONPATH=$ROOT "$PY" - "$WORK" "$OUT" "$OLD" "$NEW" "$CONFIG_OLD" "$CONFIG_NEW" "$load0" "$load1" <<'EOF'
import os, sys
from pathlib import Path
import polars as pl
work, out, old, new, cfg_old, cfg_new, load0, load1 = sys.argv[1:]
work = Path(work)
runs = {}
for line in (work / "runs.txt").read_text().splitlines():
    side, t0, t1, rc = line.split()
    runs[side] = dict(wall=float(t1) - float(t0), rc=int(rc))
from bench.perf.rule_seconds import rules
o, n = runs["old"], runs["new"]
lines = [
    "# `make run` at two commits, side by side (issue 9: >= 2x on the unchanged default matrix)",
    "",
    f"Written by `bench/perf/make_run_revs.sh {old} {new}`: the same matrix (`{cfg_old}` at {old}, "
    f"`{cfg_new}` at {new}: parsed equal), `snakemake --cores 1 --resources gpu=1` from a clean "
    "results directory in a fresh clone of each commit, both started together, each pinned to its "
    "own core. The machine is a shared 2-core VM; other work on it ran at nice 19. "
    f"Load (1/5/15 min) at the start {load0}, at the end {load1}."
    + (f" {os.environ['BENCH_NOTE']}" if os.environ.get("BENCH_NOTE") else ""),
    "",
    "| run | commit | exit | wall s |",
    "|---|---|---:|---:|",
    f"| before | {old} | {o['rc']} | {o['wall']:.0f} |",
    f"| after | {new} | {n['rc']} | {n['wall']:.0f} |",
    "",
    f"**Ratio before/after: {o['wall'] / n['wall']:.2f}x** (goal: >= 2x).",
    "",
    "Per rule (Snakemake's benchmark files, seconds of each job's wall time):",
    "",
]
for side in ("old", "new"):
    df = rules(work / side)
    lines += [f"{'before' if side == 'old' else 'after'} ({old if side == 'old' else new}):", "",
              "| rule | jobs | total s | mean s |", "|---|---:|---:|---:|"]
    lines += [f"| {r['rule']} | {r['jobs']} | {r['total_s']:.1f} | {r['mean_s']:.2f} |" for r in df.iter_rows(named=True)]
    lines.append("")
if o["rc"] == 0 and n["rc"] == 0:
    keys = ["model", "cell"]
    a = pl.read_parquet(work / "old/results/summary.parquet").select(keys + ["kld_median", "kld_mean"])
    b = pl.read_parquet(work / "new/results/summary.parquet").select(keys + ["kld_median", "kld_mean"])
    j = a.join(b, on=keys, how="full", suffix="_new", coalesce=True).sort(keys)
    j = j.with_columns(((pl.col("kld_median_new") / pl.col("kld_median") - 1) * 100).alias("d_median_pct"),
                       ((pl.col("kld_mean_new") / pl.col("kld_mean") - 1) * 100).alias("d_mean_pct"))
    lines += ["The numbers did not move: every cell's KLD at both commits (% change, new vs old):", "",
              "| model | cell | median before | median after | Δ % | mean before | mean after | Δ % |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    f = lambda x, p=6: "—" if x is None else f"{x:.{p}f}"
    for r in j.iter_rows(named=True):
        lines.append(f"| {r['model']} | {r['cell']} | {f(r['kld_median'])} | {f(r['kld_median_new'])} | "
                     f"{f(r['d_median_pct'], 2)} | {f(r['kld_mean'])} | {f(r['kld_mean_new'])} | {f(r['d_mean_pct'], 2)} |")
    lines.append("")
tmp = Path(out).with_suffix(".md.tmp")
tmp.write_text("\n".join(lines) + "\n")
tmp.replace(out)
print("\n".join(lines))
EOF
