#!/usr/bin/env bash
# `make run` as a new user meets it: a fresh clone of this checkout's HEAD beside a link to the
# shared data, its own .venv, the default matrix, timed by phase: the venv (`make setup`), then the
# Snakemake run (`make run` with the venv in place), with seconds per rule from its benchmark files.
# Writes bench/perf/results/make_run_fresh.md (the machine, its load before and after, the commit).
#
#   bench/perf/fresh_make_run.sh            (KEEP=1 keeps the clone; its path is printed)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=$ROOT/bench/perf/results/make_run_fresh.md
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvarn-fresh.XXXXXX")
git clone -q "$ROOT" "$WORK/kvarn"
[ -d "$ROOT/../shared" ] && ln -s "$(cd "$ROOT/../shared" && pwd)" "$WORK/shared"
cd "$WORK/kvarn"
commit=$(git rev-parse --short HEAD)
load0=$(cut -d' ' -f1-3 /proc/loadavg)
t0=$(date +%s)
make setup > "$WORK/setup.log" 2>&1
t1=$(date +%s)
make run > "$WORK/run.log" 2>&1 && rc=0 || rc=$?
t2=$(date +%s)
load1=$(cut -d' ' -f1-3 /proc/loadavg)
{
  echo "# \`make run\` from a fresh clone, by phase"
  echo
  echo "Written by \`bench/perf/fresh_make_run.sh\` at commit $commit on $(date -u +%Y-%m-%d), $(nproc) cores"
  echo "($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')). Load (1/5/15 min) at the start $load0, at the end $load1."
  echo
  echo "| phase | s |"
  echo "|---|---:|"
  echo "| venv (\`make setup\`: pip install of the pinned stack) | $((t1 - t0)) |"
  echo "| Snakemake (\`make run\` with the venv in place; exit $rc) | $((t2 - t1)) |"
  echo "| **total** | **$((t2 - t0))** |"
  echo
  echo "Per rule (Snakemake's benchmark files; rules without one, e.g. the report's, are in the run's remainder):"
  echo
  "$WORK/kvarn/.venv/bin/python" - "$WORK/kvarn" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from bench.perf.rule_seconds import rules
t = rules(Path(sys.argv[1]))
print("| rule | jobs | total s | mean s |\n|---|---:|---:|---:|")
for r in t.iter_rows(named=True):
    print(f"| {r['rule']} | {r['jobs']} | {r['total_s']:.1f} | {r['mean_s']:.2f} |")
print(f"\nSum of the benchmarked jobs: {t['total_s'].sum():.0f} s.")
PY
} > "$OUT"
cat "$OUT"
if [ -z "${KEEP:-}" ]; then rm -rf "$WORK"; else echo "kept: $WORK"; fi
exit "$rc"
