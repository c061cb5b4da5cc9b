#!/usr/bin/env bash
# Prepare what bench/gpu/device_run.sh needs on the GPU machine and cannot fetch there (it has
# no network; only the checkout travels, not ../shared): run here, where pip works, then call
# the GPU machine with the folder .gpu carried beside the checkout:
#   bench/gpu/prepare.sh                      (here)
#   bash bench/gpu/device_run.sh OUTDIR       (there, with .gpu/ copied beside the checkout)
# .gpu/ (git-ignored) then holds
#   wheels/        manylinux x86_64 / pure wheels for the machine's Python 3.12, installed there
#                  with --no-deps ahead of the image's packages: transformers and gguf at our pins
#                  (pyproject.toml) with everything their import needs at the versions this
#                  checkout's environment runs (transformers 5.24 checks tokenizers, huggingface-hub,
#                  safetensors, regex, tqdm, packaging, filelock, pyyaml at import: an older image
#                  copy of any of them stops both model steps), read from the environment's own
#                  metadata, dependencies of dependencies included; not numpy (the image's torch
#                  is built against its own, and transformers asks only >= 1.17), torch, triton or
#                  nvidia-*; plus flash-linear-attention + fla-core, the Gated DeltaNet kernels
#                  transformers uses for Qwen 3.5/3.6 when `fla` imports (without them its linear
#                  layers run the slow torch reference). No polars: the device run never imports it.
#   wiki.test.raw  the text (the engine checks its sha256).
# Then it measures what a device call carries: the checkout (tracked and untracked, not
# ignored files) plus .gpu, and fails if that is 64 MiB or more (the call's limit). The device
# run's import check says, in its first results line, which copy of each package was imported.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
DST=$ROOT/.gpu
TEXT=${TEXT:-$ROOT/../shared/data/wikitext-2-raw-v1/wiki.test.raw}
LIMIT=$((64 * 1024 * 1024))
[ -f "$TEXT" ] || { echo "no text at $TEXT (TEXT=path/to/wiki.test.raw)" >&2; exit 2; }
# name==version for transformers, gguf and their import closure, as installed here, the markers
# read for the device (CPython 3.12 on x86_64 Linux); the pyproject pins must be what is installed.
wheels() { "$PY" - "$ROOT/pyproject.toml" <<'PYEOF'
import re, sys, tomllib
from importlib import metadata
from packaging.requirements import Requirement

deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
roots = ["transformers", "gguf"]
for name in roots:
    pin = [d for d in deps if re.match(rf"{name}\s*==", d)]
    if not pin:
        sys.exit(f"pyproject.toml pins no {name}")
    want = pin[0].split(";")[0].split("==")[1].strip()
    if metadata.version(name) != want:
        sys.exit(f"{name} {metadata.version(name)} installed here, {want} pinned: install the pins first")
device = {"extra": "", "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix"}
image = {"numpy", "torch", "triton"}  # the image's own, see above
seen, todo = {}, list(roots)
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen or name in image or name.startswith("nvidia-"):
        continue
    dist = metadata.distribution(name)
    seen[name] = dist.version
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate(device):
            todo.append(req.name)
print(" ".join(f"{n}=={v}" for n, v in sorted(seen.items())))
PYEOF
}
LIST=$(wheels)
rm -rf "$DST.tmp" && mkdir -p "$DST.tmp/wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DST.tmp/wheels" $LIST flash-linear-attention==0.6.0 fla-core==0.6.0
cp "$TEXT" "$DST.tmp/wiki.test.raw"
rm -rf "$DST" && mv "$DST.tmp" "$DST"
echo "wheels ($(ls "$DST/wheels" | wc -l)): $LIST flash-linear-attention==0.6.0 fla-core==0.6.0"
# The carry: every file the call copies (git's view of the checkout, ignored files aside) + .gpu.
# (a file deleted but not yet committed is listed and absent: stat skips it, hence the `|| true`)
tree=$( (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
  | xargs -0 stat -c %s 2>/dev/null || true) | awk '{s += $1} END {print s + 0}')
whl=$(find "$DST/wheels" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
gpu=$(find "$DST" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
total=$((tree + gpu))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "carry: checkout $(mib "$tree") MiB + .gpu $(mib "$gpu") MiB (wheels $(mib "$whl")) = $(mib "$total") MiB (limit 64 MiB)"
[ "$total" -lt "$LIMIT" ] || { echo "the carry is over 64 MiB: the device call would refuse it" >&2; exit 1; }
