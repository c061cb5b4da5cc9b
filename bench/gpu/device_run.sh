#!/usr/bin/env bash
# The one prepared device call of issue 42 (<= 9 min wall in all): flex compile at head dims 256
# and 512 (fp32, bf16; 16k and 64k keys), then Qwen 3.6 27B at 65,536 and Gemma 4 31B at 16,384
# on random weights of the study's geometry (baseline, kvarn4, q4_0 t128, q8_0 t0; one chunk
# each, compile timed apart, no dump written), the KVarN Triton GPU tests, and the projection of
# config/article.yaml from the measured seconds: bench/gpu/device_run.py.
#   bench/gpu/prepare.sh                       (here: wheels + text into .gpu/, git-ignored;
#                                               it measures the carry: 31.1 MiB of 64)
#   bash bench/gpu/device_run.sh OUTDIR        (there, with .gpu/ copied beside the checkout)
# Every result is appended to OUTDIR/device_run.jsonl the moment it is measured and
# OUTDIR/device_run.md is rewritten from it, so a kill keeps what finished; copy both into
# bench/gpu/results/ to commit them. BUDGET_S (default 480) is the Python part's time, the
# steps get shares of it; the whole call stays under 9 minutes. Checked on CPU with tiny
# shapes: `python -m bench.gpu.device_run --smoke` (tests/test_bench_gpu_device_run.py).
set -uo pipefail
out=${1:-bench/out}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# The packages the machine lacks, carried as wheels (bench/gpu/prepare.sh puts them in .gpu/).
if [ -d .gpu/wheels ]; then
  site=$(mktemp -d -t kvarn-site.XXXXXX)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    .gpu/wheels/*.whl || { echo "installing .gpu/wheels failed" >&2; exit 1; }
  export PYTHONPATH=$PWD:$site
else
  echo "no .gpu/wheels (run bench/gpu/prepare.sh here and carry .gpu): using the machine's own packages" >&2
fi
budget=${BUDGET_S:-480}
timeout $((budget + 25)) python3 -m bench.gpu.device_run --results "$out" --budget-s "$budget" 2>&1 \
  | tee "$out/device_run.log"
echo "device_run.sh: $(( $(date +%s) - start )) s in all"
