"""The run options of a cell besides its types and tail, torch-free: one list per option.

Owns the compute paths (`COMPUTES`, `check_compute`, `COMPUTE_VERSION`; the arithmetic
itself is `kvarn.llamacpp_cpu.compute`), the attention options (`ATTENTIONS`, the paths they resolve to
`ATTENTION_PATHS`; the arithmetic is `kvarn.kvcache.attention` / `kvarn.kvcache.flex`), the model dtypes
(`DTYPES`) and the llama.cpp
CPU kernels' Q types (`VEC_DOT_TYPE`, whose keys are the K/V types llamacpp-cpu accepts).
The CLI, the matrix (`snakemake -n` must not import torch), the cache and the engine all
read these lists here.
"""

from __future__ import annotations

import re

from kvarn.vocab.facts import get

EXACT = "exact"
LLAMACPP_CPU = "llamacpp-cpu"
BF16_ATTN = "bf16-attn"
TF32_ATTN = "tf32-attn"
COMPUTES = (EXACT, LLAMACPP_CPU, BF16_ATTN, TF32_ATTN)
DEFAULT_COMPUTE = EXACT

# The arithmetic each compute path emulates, versioned: a cell refuses a baseline of another
# version (kvarn.run.torch_engine.check_baseline_compute). llamacpp-cpu 2: ggml's fp16-table GELU.
COMPUTE_VERSION = {EXACT: 1, LLAMACPP_CPU: 2, BF16_ATTN: 1, TF32_ATTN: 2}  # tf32-attn 2: P truncated to TF32 as the kernel reads it (kvarn.kvcache.rounding)

# The compute paths whose attention is kvarn.kvcache.attention's (the cache model's storage, exact
# copy and one softmax, DESIGN §2), and the format their attention's operands are rounded to: None,
# fp32 throughout ("exact"); "bfloat16": Q, K, V and the softmax numerators P in bf16 for the
# products Q·K and P·V, accumulated in fp32, the softmax itself in fp32 ("bf16-attn": what a GPU's
# FlashAttention kernels do on bf16 tensor cores, flex_attention on bf16 operands included);
# "tfloat32": the same with TF32's 11 significant bits (round to nearest, ties away), fp32 storage
# ("tf32-attn": fp32 tensors on TF32 tensor cores, flex_attention's FLOAT32_PRECISION 'tf32'). Not
# in it: llamacpp-cpu, whose attention is kvarn.llamacpp_cpu.compute's.
ATTENTION_ROUNDING = {EXACT: None, BF16_ATTN: "bfloat16", TF32_ATTN: "tfloat32"}

# The arithmetic of a free-running decode result (kvarn.run.decode), recorded in its summary and
# a parameter of the workflow's decode rule (a bump reruns every decode). 1: the baseline re-scored
# the cell's text one token at a time in lock step; 2: in blocks of steps, one forward per block
# (the baseline's numbers move at fp32 noise, docs/notes/decode.md "Speed").
DECODE_VERSION = 2

# How a free-running decode picks its tokens (kvarn.run.decode): temperature 0 is greedy (argmax,
# the default), temperature T > 0 samples by the Gumbel-max rule, argmax(log p / T + g), with the
# Gumbel noise g of one seeded generator drawn step by step, so every cell and the baseline read
# the same draws (common random numbers). A sampled decode's results sit in a directory of their
# own: SAMPLING_PATTERN matches `sampling_name`'s suffix ("" greedy, "-T1-s0" sampled).
_T = r"[0-9]+(?:\.[0-9]+)?"  # a temperature as the name writes it (format "g", no exponent)
SAMPLING_PATTERN = rf"(?:-T{_T}-s[0-9]+)?"


def check_sampling(temperature, seed) -> tuple[float, int]:
    """(temperature, seed) as float and int, or ValueError naming the bad value: temperature a
    number >= 0 that format "g" writes without an exponent and without loss (it names a
    directory), seed an integer >= 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            0 <= temperature < 1e6) or not re.fullmatch(_T, format(temperature, "g")) or float(
            format(temperature, "g")) != temperature:
        raise ValueError(f"decode temperature must be a number >= 0 (0: greedy) written in at most 6 significant "
                         f"digits without an exponent, like 1 or 0.7; got {temperature!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"decode seed must be an integer >= 0, got {seed!r}")
    return float(temperature), seed


def sampling_name(temperature=0.0, seed=0) -> str:
    """The decode directory's suffix: "" for greedy (temperature 0, any seed), "-T{T:g}-s{seed}" when sampled."""
    temperature, seed = check_sampling(temperature, seed)
    return "" if temperature == 0 else f"-T{temperature:g}-s{seed}"


def sampling_label(temperature=0.0, seed=0) -> str:
    """How a decode chose its tokens, in words: "greedy", or "sampled at T = 1, seed 0"."""
    temperature, seed = check_sampling(temperature, seed)
    return "greedy" if temperature == 0 else f"sampled at T = {temperature:g}, seed {seed}"


def summary_sampling(summary: dict) -> str:
    """`sampling_label` of a decode summary.json (kvarn.run.decode); one written before sampling
    existed has no `temperature` and was greedy."""
    return sampling_label(summary.get("temperature") or 0.0, summary.get("seed") or 0)


def parse_sampling(name: str) -> tuple[float, int]:
    """(temperature, seed) of a `sampling_name` suffix ("" -> greedy (0.0, 0))."""
    if name == "":
        return 0.0, 0
    m = re.fullmatch(rf"-T({_T})-s([0-9]+)", name)
    if m is None:
        raise ValueError(f"{name!r} is not a decode sampling suffix; expected '' (greedy) or like '-T1-s0'")
    return check_sampling(float(m[1]), int(m[2]))


# ggml-cpu type_traits_cpu[type].vec_dot_type: what Q is converted to for K of that type, upstream
# llama.cpp's types and BeeLlama v0.4.3's (ggml/src/ggml-cpu/ggml-cpu.c; its cache type "q2_0" is
# GGML_TYPE_Q2_0S, 32-value blocks, `kv_cache_type_name` in common/arg.cpp). Each of BeeLlama's
# vec_dots (`ggml_vec_dot_q{6,3,2}_0{,s}_q8_0`, `ggml_vec_dot_q{6,3,2}_1_q8_1`, quants.c, the
# generic loop on x86 too) is the upstream pattern: per 32-block an integer dot of the codes (minus
# half the levels for the _0 types) with Q's, times d_K·d_Q, plus m_K·s_Q for the _1 types.
VEC_DOT_TYPE = {
    "f32": "f32", "f16": "f16", "bf16": "bf16",
    "q8_0": "q8_0", "q5_0": "q8_0", "q4_0": "q8_0", "iq4_nl": "q8_0",
    "q5_1": "q8_1", "q4_1": "q8_1",
    "q6_0": "q8_0", "q3_0": "q8_0", "q2_0": "q8_0",
    "q6_1": "q8_1", "q3_1": "q8_1", "q2_1": "q8_1",
}

# The compute dtypes a model runs in ("auto" picks one by device, `kvarn.weights.modelbuild.pick_device_dtype`).
MODEL_DTYPES = ("float32", "bfloat16", "float16")
DTYPES = ("auto", *MODEL_DTYPES)

# The attention computations of the exact compute path, and the option that picks one
# (`kvarn.kvcache.attention.resolve_attention`: "auto" is flex on CUDA, ref on CPU). Not part of
# any cell path: the paths agree at fp32 noise.
ATTENTION_PATHS = ("ref", "flex")
ATTENTIONS = (*ATTENTION_PATHS, "auto")


def attention_for(attention: str, device_type: str) -> str:
    """The attention path an option takes on a device type ("cpu", "cuda"): "auto" is flex on CUDA,
    ref elsewhere (compiled flex was not faster on a CPU at the embedded models' sizes:
    bench/perf/results/flex.md); a path is itself. The one rule, torch-free (the preflight reads it)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r} not accepted; use one of {', '.join(ATTENTIONS)}")
    if attention != "auto":
        return attention
    return "flex" if device_type == "cuda" else "ref"


# The head dims BeeLlama's KVarN accepts (`cannot enable kvarn_...: KVarN requires 128-, 256-, or
# 512-dimensional key/value heads`); kvarn's own format also takes 64.
BEELLAMA_KVARN_HEAD_DIMS = (128, 256, 512)


def scalar_route(compute: str, k: str, v: str, tail: int) -> bool:
    """Whether a llamacpp-cpu cell's attention takes BeeLlama's scalar CPU route rather than
    ggml's flash-attention kernel (kvarn.llamacpp_cpu.compute): a KVarN pair
    (`ggml_compute_forward_flash_attn_ext_kvarn`) or a standard pair with a tail
    (`ggml_compute_forward_flash_attn_ext_tail_ref`). Both read Q in fp32 and K/V dequantized to
    fp32, sum each dot product in double and run one fp32 online softmax over body and exact
    rows: the exact path's arithmetic over the rounded cache, beside llama.cpp's rounding of the
    weights' activations. Upstream llama.cpp has neither (no KVarN, no tail)."""
    return compute == LLAMACPP_CPU and (bool(tail) or "kvarn" in (get(k).family, get(v).family))


def check_compute(compute: str, k: str | None = None, v: str | None = None, tail: int = 0,
                  sink: int | None = None) -> str:
    """Validate a compute mode (and, for llamacpp-cpu, the cell it runs); return it.

    llamacpp-cpu is llama.cpp's CPU arithmetic: ggml's flash-attention kernel for a standard pair
    at tail 0 (`VEC_DOT_TYPE`: upstream's types and BeeLlama's), and BeeLlama's scalar routes
    (`scalar_route`) for a KVarN pair or a standard pair with a tail. A type that is neither
    llama.cpp's nor BeeLlama's (the ecosystem's caches) is refused by name, and so is a sink other
    than the pair's own (exact tokens llama.cpp does not keep), never dropped."""
    if compute not in COMPUTES:
        raise ValueError(f"compute {compute!r} not accepted; use one of {', '.join(COMPUTES)}")
    if compute == LLAMACPP_CPU:
        if sink:
            raise ValueError(f"compute {LLAMACPP_CPU}: sink {sink} not accepted; llama.cpp keeps no exact "
                             "sink of its own choosing (KVarN's is its format's: leave --sink unset)")
        if k is None or v is None:
            return compute
        for role, t in (("K", k), ("V", v)):
            if get(t).family == "ecosystem":
                raise ValueError(f"compute {LLAMACPP_CPU}: {role} type {t!r} is not a llama.cpp or BeeLlama "
                                 "cache type; its arithmetic is the exact path's only")
        if not scalar_route(compute, k, v, tail):
            for role, t in (("K", k), ("V", v)):
                if t not in VEC_DOT_TYPE:
                    raise ValueError(
                        f"compute {LLAMACPP_CPU}: {role} type {t!r} has no llama.cpp CPU kernel to emulate at "
                        f"tail 0; accepted: {', '.join(VEC_DOT_TYPE)} (or a KVarN pair)")
    return compute
