#!/usr/bin/env bash
# The Slurm profile against a live one-node Slurm cluster (README "On a cluster").
#
#   sudo tests/cluster/slurm.sh            # from the checkout's root, as root; CI: .ci/run
#   sudo tests/cluster/slurm.sh --hold     # only start the cluster, until Ctrl-C
#
# As root on a Debian/Ubuntu machine without systemd (a CI container): installs slurm-wlm,
# slurmdbd, mariadb-server and munge when missing, writes slurm.conf / slurmdbd.conf /
# gres.conf for one node (this machine's CPUs and memory, one fake GPU made with mknod,
# partitions `cpu` and `gpu`), starts MariaDB, munged, slurmdbd, slurmctld and slurmd as
# plain background processes on 127.0.0.1, and then:
#   1. an oversized request (cell: cpus_per_task above the node's CPUs) stops before any
#      submission with the error naming the rule, the request and the largest node;
#   2. a tiny matrix (tests/cluster/matrix.yaml: one baseline, a standard and a KVarN cell
#      whose body is read, their rows and the summary) runs through workflow/profiles/slurm
#      and the site override tests/cluster/site/; sacct must show every model job (baseline,
#      cell) as a COMPLETED Slurm job on partition gpu;
#   3. the same config runs locally (--cores), and the two summaries must be identical.
# Only the daemons this script started are stopped (by PID, on exit). Everything lives in
# $KVARN_SLURM_DIR (default: a new temporary directory; removed at the end unless
# KVARN_SLURM_KEEP=1).
#
# Exit status: 0 passed; 1 failed; 77 could not run here (not root, no apt-get, packages
# not installable), with a banner saying why.
# Environment: KVARN_PYTHON (default .venv/bin/python), KVARN_SLURM_PORT (first of three
# ports, default 16817), KVARN_SLURM_DIR, KVARN_SLURM_KEEP.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO="$PWD"
HERE="$REPO/tests/cluster"

cannot_run() {
  printf '\n%s\n!! SLURM CLUSTER TEST NOT RUN: %s\n%s\n\n' \
    '!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!' "$*" \
    '!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!' >&2
  exit 77
}
fail() { echo "slurm test FAILED: $*" >&2; exit 1; }
step() { printf '== [%3ds] %s\n' "$SECONDS" "$*"; }

[ "$(id -u)" = 0 ] || cannot_run "needs root (it installs packages and starts slurmctld/slurmd/slurmdbd/munged/mariadbd)"
PY="${KVARN_PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || cannot_run "no Python at $PY (run make setup, or set KVARN_PYTHON)"

# --- packages ---------------------------------------------------------------------------
PKGS=(slurm-wlm slurmdbd mariadb-server munge)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
  command -v apt-get >/dev/null || cannot_run "packages ${missing[*]} missing and no apt-get"
  step "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    apt-get update >/dev/null 2>&1 || true
    apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null \
      || cannot_run "apt-get install ${missing[*]} failed (no package access?)"
  fi
fi

# --- the cluster's files ----------------------------------------------------------------
D="${KVARN_SLURM_DIR:-$(mktemp -d -t kvarn-slurm.XXXXXX)}"
mkdir -p "$D"/{etc,state,spool,run,log,munge,dev,mysql,db}
chmod 711 "$D/munge"
HOST="$(hostname -s)"
PORT="${KVARN_SLURM_PORT:-16817}"
CPUS="$(nproc)"
MEM_MB="$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')"
MEM_MB=$((MEM_MB - 512))  # a margin: a node with less memory than configured is drained
[ -e "$D/dev/fakegpu0" ] || mknod "$D/dev/fakegpu0" c 195 0
fill() {
  sed -e "s|@DIR@|$D|g" -e "s|@HOST@|$HOST|g" -e "s|@CPUS@|$CPUS|g" -e "s|@MEM_MB@|$MEM_MB|g" \
      -e "s|@CTLD_PORT@|$PORT|g" -e "s|@SLURMD_PORT@|$((PORT + 1))|g" -e "s|@DBD_PORT@|$((PORT + 2))|g" \
      "$HERE/$1.in" > "$D/etc/$1"
}
fill slurm.conf; fill slurmdbd.conf; fill gres.conf
chmod 600 "$D/etc/slurmdbd.conf"
export SLURM_CONF="$D/etc/slurm.conf"   # every Slurm command and daemon reads it (and its siblings)
export MYSQL_UNIX_PORT="$D/db/mysqld.sock"

# The plugin's job step (snakemake-executor-plugin-slurm-jobstep 0.6.1) starts its inner
# srun without SLURM_* variables, SLURM_CONF included: srun then reads the default path.
# A link there, made only where no Slurm config exists and removed on exit.
ETC_CONF=/etc/slurm/slurm.conf
if [ -e "$ETC_CONF" ] || [ -L "$ETC_CONF" ]; then
  [ "$(readlink "$ETC_CONF")" = "$SLURM_CONF" ] || cannot_run "$ETC_CONF exists: this machine has a Slurm configuration, which this test would shadow"
fi

# --- daemons: started here, stopped here by PID -----------------------------------------
PIDS=()
LINKED=0
stop_daemons() {
  local rc=$?
  local pid
  # the runs' kvarn workers (kvarn.run.worker) would wait out their idle timeout: released now
  for w in "$D"/*/.snakemake/kvarn-workers; do
    [ -d "$w" ] && "$PY" -c 'import sys; from kvarn.run.worker import release_others; release_others(None, sys.argv[1])' "$w" || true
  done
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do  # the reverse of the start order
    pid="${PIDS[i]}"
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  done
  if [ "$LINKED" = 1 ] && [ "$(readlink "$ETC_CONF")" = "$SLURM_CONF" ]; then rm -f "$ETC_CONF"; fi
  if [ "$rc" != 0 ]; then
    for f in "$D"/log/*.log "$D"/log/*.out; do echo "--- tail of $f"; tail -n 15 "$f"; done >&2 || true
  fi
  if [ "${KVARN_SLURM_KEEP:-0}" = 1 ]; then echo "kept $D"; else rm -rf "$D"; fi
  exit "$rc"
}
trap stop_daemons EXIT
trap 'exit 130' INT TERM
wait_for() {  # wait_for SECONDS WHAT COMMAND...
  local t="$1" what="$2"; shift 2
  for _ in $(seq $((t * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  fail "$what did not come up within ${t}s"
}

step "MariaDB"
mariadb-install-db --no-defaults --datadir="$D/mysql" --user=root --skip-test-db >"$D/log/mariadb-install.log" 2>&1 \
  || fail "mariadb-install-db (log: $D/log/mariadb-install.log)"
mariadbd --no-defaults --datadir="$D/mysql" --socket="$MYSQL_UNIX_PORT" --pid-file="$D/run/mariadb.pid" \
  --skip-networking --skip-grant-tables --user=root --log-error="$D/log/mariadb.log" >"$D/log/mariadb.out" 2>&1 &
PIDS+=($!)
step "munged"
dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$D/munge/munge.key"
munged -F --force --socket="$D/munge/munge.socket" --key-file="$D/munge/munge.key" \
  --log-file="$D/log/munged.log" --pid-file="$D/run/munged.pid" --seed-file="$D/munge/seed" >"$D/log/munged.out" 2>&1 &
PIDS+=($!)
wait_for 30 munged munge --socket="$D/munge/munge.socket" -n
wait_for 60 MariaDB mariadb-admin --no-defaults --socket="$MYSQL_UNIX_PORT" ping
step "slurmdbd"
slurmdbd -D >"$D/log/slurmdbd.out" 2>&1 &
PIDS+=($!)
wait_for 30 slurmdbd sacctmgr -n list cluster
sacctmgr -i add cluster kvarnci >/dev/null
sacctmgr -i add account kvarn Cluster=kvarnci Description=kvarn-ci Organization=kvarn >/dev/null
sacctmgr -i add user root Account=kvarn Cluster=kvarnci >/dev/null
mkdir -p "$(dirname "$ETC_CONF")"
[ -L "$ETC_CONF" ] || { ln -s "$SLURM_CONF" "$ETC_CONF"; LINKED=1; }
step "slurmctld, slurmd"
slurmctld -D -i >"$D/log/slurmctld.out" 2>&1 &
PIDS+=($!)
slurmd -D >"$D/log/slurmd.out" 2>&1 &
PIDS+=($!)
node_idle() { [ "$(sinfo -h -n "$HOST" -p gpu -o %t)" = idle ]; }
wait_for 60 "node $HOST (idle in sinfo)" node_idle
sinfo -N -o '%P %N %c %m %G %t'
step "cluster up"
if [ "${1:-}" = --hold ]; then  # a cluster to try things on: no tests; Ctrl-C (or kill) stops it
  echo "holding the cluster; in another shell: export SLURM_CONF=$SLURM_CONF (account kvarn, partitions cpu and gpu)"
  while :; do sleep 3600 & PIDS+=($!); wait $!; done  # wait: a signal interrupts it at once
fi

# --- the workflow -----------------------------------------------------------------------
# Each run in its own directory (results/, logs/, .snakemake/), the checkout's config/ linked
# in; text and model cache are the default matrix's, as absolute paths.
conf_path() {
  local v; v="$(sed -n "s/^$1: *\([^ #]*\).*/\1/p" "$REPO/config/matrix.yaml")"
  case "$v" in /*) echo "$v" ;; *) echo "$REPO/$v" ;; esac
}
CFG=(--config "text=$(conf_path text)" "model_cache=$(conf_path model_cache)")
SMK=("$PY" -m snakemake results/summary.parquet -s "$REPO/Snakefile" --configfile "$HERE/matrix.yaml")
ON_SLURM=(--profile "$REPO/workflow/profiles/slurm" --workflow-profile "$HERE/site")
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
for run in oversized slurm local; do mkdir -p "$D/$run"; ln -sfn "$REPO/config" "$D/$run/config"; done
jobs_in_sacct() { sacct -X -n -P -a -o JobID | wc -l; }

step "1. an oversized request (cell: 64 CPUs) must stop before any submission"
before="$(jobs_in_sacct)"; t0=$SECONDS
# Without the check this run would wait for a PENDING job forever: a time limit turns that into a failure.
if (cd "$D/oversized" && timeout 300 "${SMK[@]}" "${ON_SLURM[@]}" --set-resources cell:slurm_partition=gpu \
      cell:cpus_per_task=64 "${CFG[@]}" >"$D/log/oversized.log" 2>&1); then
  fail "the oversized request ran (log: $D/log/oversized.log)"
fi
grep -F "rule cell (cpus_per_task=64" "$D/log/oversized.log" \
  || { tail -n 30 "$D/log/oversized.log"; fail "no error naming rule cell and its request"; }
grep -qF "its largest node is $HOST with $CPUS CPUs" "$D/log/oversized.log" || fail "the error does not name node $HOST"
[ "$(jobs_in_sacct)" = "$before" ] || fail "jobs were submitted despite the oversized request"
echo "stopped after $((SECONDS - t0)) s, nothing submitted"

step "2. the tiny matrix through workflow/profiles/slurm + tests/cluster/site"
t0=$SECONDS
(cd "$D/slurm" && "${SMK[@]}" "${ON_SLURM[@]}" "${CFG[@]}" >"$D/log/slurm-run.log" 2>&1) \
  || { tail -n 40 "$D/log/slurm-run.log"; fail "the Slurm run failed (log above)"; }
slurm_s=$((SECONDS - t0))
run_id="$(sed -n 's/^SLURM run ID: //p' "$D/log/slurm-run.log")"
[ -n "$run_id" ] || fail "no SLURM run ID in the Snakemake log"
echo "done in ${slurm_s} s; sacct of run $run_id (job name = run ID, comment = rule):"
sacct -X -a -P -o JobID,Comment,Partition,Account,AllocTRES,State --name "$run_id" | tee "$D/sacct.txt"
"$PY" - "$D/sacct.txt" <<'PYEOF' || fail "sacct does not show every model job as a completed job on partition gpu"
import sys, collections
rows = [dict(zip(("id", "comment", "partition", "account", "tres", "state"), l.rstrip("\n").split("|")))
        for l in open(sys.argv[1]).readlines()[1:]]
rule = lambda r: r["comment"].split("_wildcards_")[0].removeprefix("rule_")  # rule_<name>_wildcards_...
rules = collections.Counter(map(rule, rows))
model = [r for r in rows if rule(r) in ("baseline", "cell")]
bad = [r for r in model if r["partition"] != "gpu" or r["state"] != "COMPLETED" or "gres/gpu=1" not in r["tres"]]
print(f"Slurm jobs by rule: {dict(rules)}")
assert rules["baseline"] == 1 and rules["cell"] == 2, "expected 1 baseline and 2 cell jobs"
assert not bad, f"model jobs not COMPLETED on gpu with one GPU: {bad}"
assert set(rules) <= {"baseline", "cell", "fetch_model"}, "a small rule went to the queue"
PYEOF

step "3. the same matrix locally, and the two summaries"
t0=$SECONDS
(cd "$D/local" && "${SMK[@]}" --cores 2 --resources gpu=1 "${CFG[@]}" >"$D/log/local-run.log" 2>&1) \
  || { tail -n 40 "$D/log/local-run.log"; fail "the local run failed"; }
local_s=$((SECONDS - t0))
echo "done in ${local_s} s"
"$PY" - "$D/slurm" "$D/local" <<'PYEOF' || fail "the Slurm and local summaries differ"
import json, sys
from pathlib import Path
import pandas as pd
slurm, local = (Path(d) for d in sys.argv[1:])
a, b = (pd.read_parquet(d / "results/summary.parquet") for d in (slurm, local))
# the numbers of every cell; timings and the host differ from run to run by nature
timing = [c for c in a.columns if c.endswith("_s")]  # wall_s, tokens_per_s
pd.testing.assert_frame_equal(a.drop(columns=timing), b.drop(columns=timing), check_exact=True)
cells = sorted(slurm.glob("results/*/*/cells/*/summary.json"))
assert len(cells) == 2, cells
for c in cells:
    s = json.loads(c.read_text())
    print(f"{c.parent.name}: exact_share {s['exact_share']:.4f}")
kvarn = json.loads(next(c for c in cells if c.parent.name.startswith("kvarn")).read_text())
assert 0 < kvarn["exact_share"] < 1, "the KVarN cell reads no key from its body"
print(f"summary.parquet: {len(a)} rows x {a.shape[1] - len(timing)} columns identical (not compared: {timing})")
PYEOF
step "passed: Slurm run ${slurm_s} s, local run ${local_s} s"
