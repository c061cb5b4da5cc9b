#!/usr/bin/env bash
# Wall time of the tiny matrix (tests/cluster/matrix.yaml -> results/summary.parquet, the
# target of tests/cluster/slurm.sh) through Slurm at revision BEFORE and at this checkout,
# and locally, one after the other -> bench/perf/results/slurm.md's figures.
#
#   sudo tests/cluster/slurm.sh --hold &       # a one-node cluster; prints its SLURM_CONF
#   export SLURM_CONF=...                        # as printed
#   bench/perf/slurm_overhead.sh 6c5a27e [before] [after] [local]   # BEFORE: a revision; default: all three
#
# Each run starts from an empty working directory (the model cache and text are shared, as
# in tests/cluster/slurm.sh); the BEFORE revision is exported with git archive. Prints one
# line per run: name, seconds, Slurm jobs.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO="$PWD"
BEFORE="${1:?usage: bench/perf/slurm_overhead.sh BEFORE_REVISION [before] [after] [local]}"
shift
RUNS="${*:-before after local}"
OUT="${KVARN_BENCH_DIR:-$(mktemp -d -t kvarn-slurm-bench.XXXXXX)}"
PY="${KVARN_PYTHON:-$REPO/.venv/bin/python}"
: "${SLURM_CONF:?set SLURM_CONF to the slurm.conf of a running cluster (tests/cluster/slurm.sh --hold)}"
conf_path() {
  local v; v="$(sed -n "s/^$1: *\([^ #]*\).*/\1/p" "$REPO/config/matrix.yaml")"
  case "$v" in /*) echo "$v" ;; *) echo "$REPO/$v" ;; esac
}
CFG=(--config "text=$(conf_path text)" "model_cache=$(conf_path model_cache)")
mkdir -p "$OUT/before-src"
git archive "$BEFORE" | tar -x -C "$OUT/before-src"

run() {  # run NAME CHECKOUT ARGS...
  local name="$1" src="$2"; shift 2
  mkdir -p "$OUT/$name"; ln -sfn "$src/config" "$OUT/$name/config"
  local t0 t1 n
  t0="$(date +%s.%N)"
  case " $RUNS " in *" $name "*) ;; *) return 0 ;; esac
  (cd "$OUT/$name" && PYTHONPATH="$src" "$PY" -m snakemake results/summary.parquet -s "$src/Snakefile" \
      --configfile "$REPO/tests/cluster/matrix.yaml" "$@" "${CFG[@]}" >"$OUT/$name.log" 2>&1) \
    || { tail -n 30 "$OUT/$name.log"; echo "$name failed" >&2; exit 1; }
  t1="$(date +%s.%N)"
  n="$(sed -n 's/^SLURM run ID: //p' "$OUT/$name.log")"
  [ -n "$n" ] && n="$(sacct -X -n -a -P -o JobID --name "$n" | wc -l)" || n=0
  printf '%-8s %7.1f s  %2d Slurm jobs  (load %s)\n' "$name" "$(awk "BEGIN {print $t1 - $t0}")" "$n" "$(cut -d' ' -f1-3 /proc/loadavg)"
}
SITE=(--workflow-profile "$REPO/tests/cluster/site")
run before "$OUT/before-src" --profile "$OUT/before-src/workflow/profiles/slurm" "${SITE[@]}"
run after "$REPO" --profile "$REPO/workflow/profiles/slurm" "${SITE[@]}"
run local "$REPO" --cores 2 --resources gpu=1
