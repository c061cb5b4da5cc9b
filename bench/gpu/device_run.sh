#!/usr/bin/env bash
# The one prepared device call of issues 42 and 54, <= 7 minutes in all (TOTAL_S, default 420) so
# that a second try fits the same 15 minutes of device time: the carried wheels installed, the
# import check (its versions in the first results line; a failure ends the run at once, exit code
# 3), then, most important first, Qwen 3.6 27B at 65,536 (baseline, q4_0 t128, kvarn4, q8_0 t0),
# Gemma 4 31B at 16,384 (the same), flex at head dim 512 (fp32 with TF32 dots, bf16; which P rule
# the kernel follows), the KVarN Triton GPU tests, and the projection of config/article.yaml from
# the measured seconds: bench/gpu/device_run.py. Random weights of the study's geometry, one chunk
# per run, each run's warm-up (the compiles) timed apart, no dump written.
#   bench/gpu/prepare.sh                       (here: wheels + text into .gpu/, git-ignored;
#                                               it measures the carry, see bench/gpu/README.md)
#   bash bench/gpu/device_run.sh OUTDIR        (there, with .gpu/ copied beside the checkout)
#   STEPS=gemma4-31b,flex,triton bash bench/gpu/device_run.sh OUTDIR   (a second try: the rest)
# A line is appended to OUTDIR/device_run.jsonl (and synced) after every warm-up, chunk and case,
# and OUTDIR/device_run.md is rewritten from it, so a kill keeps what finished; copy both into
# bench/gpu/results/ to commit them. Checked on CPU with tiny shapes: `python -m
# bench.gpu.device_run --smoke` (tests/test_bench_gpu_device_run.py).
set -uo pipefail
out=${1:-bench/out}
mkdir -p "$out"
start=$(date +%s)
total=${TOTAL_S:-420}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# The packages the machine lacks or has at other versions, carried as wheels (bench/gpu/prepare.sh
# puts transformers' whole import closure at our pins in .gpu/wheels), first on the path.
if [ -d .gpu/wheels ]; then
  site=$(mktemp -d -t kvarn-site.XXXXXX)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    .gpu/wheels/*.whl || { echo "installing .gpu/wheels failed" >&2; exit 1; }
  export PYTHONPATH=$PWD:$site KVARN_CARRIED_SITE=$site
else
  echo "no .gpu/wheels (run bench/gpu/prepare.sh here and carry .gpu): using the machine's own packages" >&2
fi
# The Python part's deadline: what the 7 minutes leave after the install, less 15 s for the kill
# and the last lines; `timeout` 10 s later in case the run's own deadline does not hold.
budget=${BUDGET_S:-$(( total - ($(date +%s) - start) - 15 ))}
[ "$budget" -ge 1 ] || budget=1  # past it already: every step is recorded as skipped
timeout $((budget + 10)) python3 -m bench.gpu.device_run --results "$out" --budget-s "$budget" \
  ${STEPS:+--steps "$STEPS"} 2>&1 | tee "$out/device_run.log"
rc=${PIPESTATUS[0]}
echo "device_run.sh: $(( $(date +%s) - start )) s in all (limit $total), exit code $rc"
exit "$rc"
