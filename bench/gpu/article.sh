#!/usr/bin/env bash
# The one prepared GPU script of issue 9 (<= 8 min of device time in one call): seconds per
# chunk, tokens/s, peak device and host memory of the baseline and the q8_0 t0, q4_0 t128,
# kvarn4 and kvarn2 cells on random-weight models of the study's exact geometry at the
# study's n_ctx (Gemma 4 31B at 16,384 first, then Qwen 3.6 27B at 65,536), and the
# projected device-hours of config/article.yaml -> bench/gpu/results/article.md. Each run on
# the flex attention path (projected) and, where the budget allows, on ref beside it
# (ATTENTION=flex skips ref).
#   bench/gpu/prepare.sh                    (here: wheels + text into .gpu/, git-ignored)
#   bash bench/gpu/article.sh [OUTDIR]      (there, with .gpu carried; TEXT=path/to/wiki.test.raw overrides)
# Runs that would start after BUDGET_S seconds (default 360) are skipped and marked, so the
# whole call stays under the device limit; its Python part is checked on CPU by
# `python -m bench.gpu.article --smoke` (tests/test_bench_gpu_article.py).
set -uo pipefail
out=${1:-bench/out}
mkdir -p "$out"
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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"
python3 -c "import fla; print('flash-linear-attention', fla.__version__)" 2>/dev/null | tee -a "$out/gpu.txt" \
  || echo "flash-linear-attention: not installed (Qwen's linear layers run transformers' reference path)" | tee -a "$out/gpu.txt"
text=${TEXT:-../shared/data/wikitext-2-raw-v1/wiki.test.raw}
[ -z "${TEXT:-}" ] && [ -f .gpu/wiki.test.raw ] && text=.gpu/wiki.test.raw  # ../shared does not travel
timeout 460 python3 -m bench.gpu.article --budget-s "${BUDGET_S:-360}" --text "$text" --attention "${ATTENTION:-flex,ref}" \
  --out bench/gpu/results/article.md 2>&1 | tee "$out/gpu_article.log"
cp bench/gpu/results/article.md "$out/" 2>/dev/null || true
