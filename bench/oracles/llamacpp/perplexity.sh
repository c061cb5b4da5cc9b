#!/usr/bin/env bash
# llama-perplexity as the oracle (issue 13): build it for CPU from the pinned
# llama-cpp-python sdist, run --kl-divergence-base (bf16 cache) and --kl-divergence for
# each cache type with rotation on and off, on the embedded models' GGUF files; then
# bench/oracles/llamacpp/compare.py runs kvarn (exact and llamacpp-cpu) on the same tokens and writes
# bench/oracles/llamacpp/results/llamacpp.md.
#
#   bench/oracles/llamacpp/perplexity.sh [smollm2-135m|gemma3-270m ...]       (default: both)
#
# Environment: LLAMACPP_DIR (default ~/.cache/kvarn-llamacpp: the sdist, its build and the runs,
# all outside the repo; never run in CI), THREADS (2), CHUNKS_smollm2_135m (2),
# CHUNKS_gemma3_270m (1), TYPES ("f16 q8_0 q5_1 q5_0 q4_1 q4_0"), TEXT (wiki.test.raw).
# Every run's log is kept and skipped when present, so an interrupted bench resumes.
#
# On this machine AMX instructions are not allowed (SIGILL in tinygemm_kernel_amx), so
# the weights are not repacked into the AMX buffer type (-nr): that changes only how the
# weight matmuls are computed, equally in the baseline and every cell.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../../.." && pwd)
LLAMACPP_DIR=${LLAMACPP_DIR:-$HOME/.cache/kvarn-llamacpp}
VERSION=0.3.36
THREADS=${THREADS:-2}
TYPES=${TYPES:-"f16 q8_0 q5_1 q5_0 q4_1 q4_0"}
TEXT=${TEXT:-$REPO/../shared/data/wikitext-2-raw-v1/wiki.test.raw}
BIN=$LLAMACPP_DIR/build/bin/llama-perplexity
RUNS=$LLAMACPP_DIR/runs
MODELS=("$@")
[ ${#MODELS[@]} -eq 0 ] && MODELS=(smollm2-135m gemma3-270m)

build() {
    [ -x "$BIN" ] && return
    mkdir -p "$LLAMACPP_DIR"
    cd "$LLAMACPP_DIR"
    if [ ! -d "llama_cpp_python-$VERSION" ]; then
        python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d . >/dev/null
        tar xzf "llama_cpp_python-$VERSION.tar.gz"
    fi
    cmake -S "llama_cpp_python-$VERSION/vendor/llama.cpp" -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF > cmake.log
    nice -n 19 cmake --build build --target llama-perplexity -j "$THREADS" > build.log
}

gguf_of() { ls "$REPO/resources/models/$1"/*.gguf | head -1; }
ctx_of() { case $1 in gemma3-270m) echo 4096 ;; *) echo 2048 ;; esac; }
chunks_of() { local v="CHUNKS_${1//-/_}"; v=${v//./_}; case $1 in gemma3-270m) echo "${!v:-1}" ;; *) echo "${!v:-2}" ;; esac; }

build
for model in "${MODELS[@]}"; do
    m=$(gguf_of "$model"); ctx=$(ctx_of "$model"); chunks=$(chunks_of "$model")
    out=$RUNS/$model/ctx$ctx-c$chunks
    mkdir -p "$out"
    common=(-m "$m" -f "$TEXT" -c "$ctx" --chunks "$chunks" -t "$THREADS" -nr)
    if [ ! -s "$out/base.log" ] || ! grep -q "Final estimate" "$out/base.log"; then
        nice -n 5 "$BIN" "${common[@]}" -ctk bf16 -ctv bf16 --kl-divergence-base "$out/base.kld" > "$out/base.log.tmp" 2>&1
        mv "$out/base.log.tmp" "$out/base.log"
    fi
    for t in $TYPES; do
        for rot in rot norot; do
            [ "$t" = f16 ] && [ $rot = norot ] && continue  # f16 is never rotated
            log=$out/$t-$rot.log
            if [ -s "$log" ] && grep -q "Same top p" "$log"; then continue; fi
            env $( [ $rot = norot ] && echo LLAMA_ATTN_ROT_DISABLE=1 ) nice -n 5 "$BIN" "${common[@]}" \
                -ctk "$t" -ctv "$t" --kl-divergence-base "$out/base.kld" --kl-divergence > "$log.tmp" 2>&1
            mv "$log.tmp" "$log"
        done
    done
done
echo "llama-perplexity runs in $RUNS; now: python -m bench.oracles.llamacpp.compare"
