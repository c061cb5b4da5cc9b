"""The run options of a cell besides its types and tail, torch-free: one list per option.

Owns the compute paths (`COMPUTES`, `check_compute`, `COMPUTE_VERSION`; the arithmetic
itself is `kvarn.llamacpp.compute`), the attention options (`ATTENTIONS`, the paths they resolve to
`ATTENTION_PATHS`; the arithmetic is `kvarn.kvcache.attention` / `kvarn.kvcache.flex`), the model dtypes
(`DTYPES`) and the llama.cpp
CPU kernels' Q types (`VEC_DOT_TYPE`, whose keys are the K/V types llamacpp-cpu accepts).
The CLI, the matrix (`snakemake -n` must not import torch), the cache and the engine all
read these lists here.
"""

from __future__ import annotations

EXACT = "exact"
LLAMACPP_CPU = "llamacpp-cpu"
COMPUTES = (EXACT, LLAMACPP_CPU)
DEFAULT_COMPUTE = EXACT

# The arithmetic each compute path emulates, versioned: a cell refuses a baseline of another
# version (kvarn.run.engine.check_baseline_compute). llamacpp-cpu 2: ggml's fp16-table GELU.
COMPUTE_VERSION = {EXACT: 1, LLAMACPP_CPU: 2}

# ggml-cpu type_traits_cpu[type].vec_dot_type: what Q is converted to for K of that type.
VEC_DOT_TYPE = {
    "f32": "f32", "f16": "f16", "bf16": "bf16",
    "q8_0": "q8_0", "q5_0": "q8_0", "q4_0": "q8_0", "iq4_nl": "q8_0",
    "q5_1": "q8_1", "q4_1": "q8_1",
}

# The compute dtypes a model runs in ("auto" picks one by device, `kvarn.weights.modelbuild.pick_device_dtype`).
MODEL_DTYPES = ("float32", "bfloat16", "float16")
DTYPES = ("auto", *MODEL_DTYPES)

# The attention computations of the exact compute path, and the option that picks one
# (`kvarn.kvcache.attention.resolve_attention`: "auto" is flex on CUDA, ref on CPU). Not part of
# any cell path: the paths agree at fp32 noise.
ATTENTION_PATHS = ("ref", "flex")
ATTENTIONS = (*ATTENTION_PATHS, "auto")


def check_compute(compute: str, k: str | None = None, v: str | None = None, tail: int = 0,
                  sink: int | None = None) -> str:
    """Validate a compute mode (and, for llamacpp-cpu, the cell it runs); return it.

    llamacpp-cpu reads every key from the rounded cache, as llama.cpp does: a tail or a
    sink (exact tokens) is refused, never silently dropped."""
    if compute not in COMPUTES:
        raise ValueError(f"compute {compute!r} not accepted; use one of {', '.join(COMPUTES)}")
    if compute == LLAMACPP_CPU:
        for role, t in (("K", k), ("V", v)):
            if t is not None and t not in VEC_DOT_TYPE:
                raise ValueError(
                    f"compute {LLAMACPP_CPU}: {role} type {t!r} has no llama.cpp CPU kernel to emulate; "
                    f"accepted: {', '.join(VEC_DOT_TYPE)}")
        if tail:
            raise ValueError(f"compute {LLAMACPP_CPU}: tail {tail} not accepted; llama.cpp has no exact tail, use 0")
        if sink:
            raise ValueError(f"compute {LLAMACPP_CPU}: sink {sink} not accepted; llama.cpp has no exact sink, use 0")
    return compute
