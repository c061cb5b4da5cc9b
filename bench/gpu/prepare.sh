#!/usr/bin/env bash
# Prepare what bench/gpu/device_run.sh needs on the GPU machine and cannot fetch there (it has
# no network; only the checkout travels, not ../shared): run here, where pip works, then call
# the GPU machine with the folder .gpu carried beside the checkout:
#   bench/gpu/prepare.sh                      (here)
#   bash bench/gpu/device_run.sh OUTDIR       (there, with .gpu/ copied beside the checkout)
# .gpu/ (git-ignored) then holds
#   wheels/        the packages the machine's image lacks or has at another version, for its
#                  Python 3.12, no dependencies (the image has torch, triton, numpy, einops,
#                  huggingface-hub, tokenizers, safetensors, pyarrow, tqdm, pyyaml, pytest):
#                  transformers and gguf at our pins; flash-linear-attention + fla-core, the
#                  Gated DeltaNet kernels transformers uses for Qwen 3.5/3.6 when `fla` imports
#                  (without them its linear layers run the slow torch reference). No polars:
#                  the device run never imports it (bench/gpu/device_run.py).
#   wiki.test.raw  the text (the engine checks its sha256).
# Then it measures what a device call carries: the checkout (tracked and untracked, not
# ignored files) plus .gpu, and fails if that is 64 MiB or more (the call's limit).
# Measured: checkout 15.4 MiB + .gpu 15.7 MiB = 31.1 MiB (bench/gpu/README.md).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
DST=$ROOT/.gpu
TEXT=${TEXT:-$ROOT/../shared/data/wikitext-2-raw-v1/wiki.test.raw}
LIMIT=$((64 * 1024 * 1024))
[ -f "$TEXT" ] || { echo "no text at $TEXT (TEXT=path/to/wiki.test.raw)" >&2; exit 2; }
pins() { "$PY" - "$ROOT/pyproject.toml" "$@" <<'PYEOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
for name in sys.argv[2:]:
    pin = [d for d in deps if re.match(rf"{name}\s*==", d)]
    if not pin:
        sys.exit(f"pyproject.toml pins no {name}")
    print(pin[0].split(";")[0].replace(" ", ""))
PYEOF
}
PINNED=$(pins transformers gguf)
rm -rf "$DST.tmp" && mkdir -p "$DST.tmp/wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DST.tmp/wheels" $PINNED flash-linear-attention==0.6.0 fla-core==0.6.0
cp "$TEXT" "$DST.tmp/wiki.test.raw"
rm -rf "$DST" && mv "$DST.tmp" "$DST"
ls -l "$DST/wheels"
# The carry: every file the call copies (git's view of the checkout, ignored files aside) + .gpu.
# (a file deleted but not yet committed is listed and absent: stat skips it, hence the `|| true`)
tree=$( (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
  | xargs -0 stat -c %s 2>/dev/null || true) | awk '{s += $1} END {print s + 0}')
gpu=$(find "$DST" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
total=$((tree + gpu))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "carry: checkout $(mib "$tree") MiB + .gpu $(mib "$gpu") MiB = $(mib "$total") MiB (limit 64 MiB)"
[ "$total" -lt "$LIMIT" ] || { echo "the carry is over 64 MiB: the device call would refuse it" >&2; exit 1; }
