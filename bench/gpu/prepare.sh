#!/usr/bin/env bash
# Prepare what bench/gpu/article.sh needs on the GPU machine and cannot fetch there (it has no
# network; only the checkout travels, not ../shared): run here, where pip works, then call the
# GPU machine with the folder .gpu copied into the checkout:
#   bench/gpu/prepare.sh                      (here)
#   bash bench/gpu/article.sh OUTDIR          (there)
# .gpu/ (git-ignored) then holds
#   wheels/        the packages the machine's image lacks or has at another version, for its
#                  Python 3.12, no dependencies (the image has torch, triton, numpy, einops,
#                  huggingface-hub, tokenizers, safetensors, pyarrow, tqdm, pyyaml):
#                  transformers and gguf at our pins; flash-linear-attention + fla-core, the
#                  Gated DeltaNet kernels transformers uses for Qwen 3.5/3.6 when `fla` imports
#                  (without them its linear layers run the slow torch reference);
#                  polars 1.33.1 instead of our pinned 2.1.0, whose 54 MB runtime wheel does not
#                  fit the 64 MiB a call may carry beside transformers (the bench only writes
#                  and reads back per-token parquet, which both versions do alike);
#   wiki.test.raw  the text (the engine checks its sha256).
# About 56 MB in all; the device call carries at most 64 MiB with the checkout (~8 MB).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
DST=$ROOT/.gpu
TEXT=${TEXT:-$ROOT/../shared/data/wikitext-2-raw-v1/wiki.test.raw}
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
  -d "$DST.tmp/wheels" $PINNED flash-linear-attention==0.6.0 fla-core==0.6.0 polars==1.33.1
cp "$TEXT" "$DST.tmp/wiki.test.raw"
rm -rf "$DST" && mv "$DST.tmp" "$DST"
du -sh "$DST"; ls "$DST/wheels"
