#!/usr/bin/env bash
# The device checks, in one call (a lent GPU machine runs its own python3 with torch + triton):
# KVarN Triton kernels vs the reference at full shapes, then the KVarN throughput bench
# (quantize throughput as a fraction of the measured device copy bandwidth).
#   bash bench/gpu/check.sh OUTDIR
set -uo pipefail
out=${1:-bench/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kvarn_triton.py 2>&1 | tee "$out/gpu_tests.log"
timeout 240 python3 -m bench.perf.kvarn_triton --quick 2>&1 | tee "$out/bench_kvarn.log"
cp bench/perf/results/kvarn.md "$out/kvarn_gpu.md"
