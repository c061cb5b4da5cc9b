"""Will a job fit? Peak device and host memory of a baseline or a cell, before any weights load.

Owns: `estimate` (the parts of one job's peak memory, from the model's config alone: weights,
cache copies, `attention_temporaries`, activations, logits, the baseline's host log-prob slice),
`capacity` (free device memory, `torch.cuda.mem_get_info`; available host memory, psutil or
/proc/meminfo), `check` (stop with a `PreflightError` naming the estimate, the capacity and the
knob that lowers the largest part), `check_context` (n_ctx beyond the trained context) and
`preflight` (all of it for one job). An estimate of the large terms, not a measurement:
`HEADROOM` covers the rest. KVARN_DEVICE_MEMORY (bytes) replaces what the device reports free,
less what the other live kvarn workers record as held (`record_held`).

What is counted, and why: docs/notes/memory.md "A job's peak memory (`kvarn.budget.preflight`)".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvarn.vocab.geometry import Geometry, config_object, geometry_from_config, text_config
from kvarn.vocab.options import ATTENTION_ROUNDING, attention_for
from kvarn.weights.modelbuild import pick_device_dtype
from kvarn.weights.sources import config_json
from kvarn.files.workerfiles import SOCKET_ENV, held_path, socket_dir

HEADROOM = 1.10  # 10 % on top of the estimate for what is not modelled
MEMORY_ENV = "KVARN_DEVICE_MEMORY"  # the capacity override (bytes), see the module doc
# Bytes per cached row and channel (K and V together), kvarn.kvcache.cache.KVarnLayer's storage:
CELL_ROW_BYTES = 2 * (4 + 2)  # fp32 body + tail-dtype (16-bit) exact copy, K and V
ROUNDED_CELL_ROW_BYTES = 2 * (2 + 2)  # compute bf16-attn: the body in bf16 (kvarn.kvcache.cache.KVarnLayer)
# (tf32-attn keeps the fp32 body: CELL_ROW_BYTES; only bf16-attn narrows it, KVarnLayer.narrow_body)
# kvarn.kvcache.rounding's TF32 rounding (round_operand, truncate_tf32) of an fp32 tensor holds, per
# element beyond its input, at most a bool mask (1 B) and two int32 words (the word plus half a step,
# then masked; or the masked word and the fp32 result): 9 bytes, the result's 4 of them staying.
TF32_ROUNDING_BYTES = 1 + 4 + 4
BASELINE_ROW_BYTES = 2 * 2  # the bf16/bf16 tail-0 baseline: bf16 bodies only
QUERY_BLOCK = 128  # kvarn.kvcache.attention.QUERY_BLOCK (not imported: it pulls in torch and transformers)
LOGIT_ROWS = 64  # kvarn.run.forward.LOGIT_ROWS
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# The knob that lowers each part, for the error message.
KNOBS = {
    "weights": "--dtype bfloat16 (if not already), or a device with more memory",
    "cache copies": "--ctx (a full-attention layer holds every position of a chunk)",
    "linear-attention state": "nothing: it does not grow with the context",
    "attention temporaries": "--ctx (a 128-query block reads every earlier key)",
    "activations": "--ubatch (tokens per forward)",
    "logits": "--ubatch (rows of logits per forward)",
    "log-prob slice": "nothing: 64 rows x vocab on their way to the dump, whatever the context",
}


class PreflightError(RuntimeError):
    """The job would not fit (or its context is beyond the model's): the message names the
    numbers and the knob."""


LONG_CONTEXT_FLAG = "--allow-long-context"  # kvarn run / baseline: measure beyond the trained context
LONG_CONTEXT_ENV = "KVARN_ALLOW_LONG_CONTEXT"  # the same for any job (a workflow's): 1 allows it


def trained_context(config: Any) -> int | None:
    """The context a model was trained for, as its config declares it (`max_position_embeddings`
    of the decoder), or None where the config does not say."""
    c = text_config(config)
    v = c.get("max_position_embeddings") if isinstance(c, Mapping) else getattr(c, "max_position_embeddings", None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def check_context(config: Any, n_ctx: int, allow: bool | None = None) -> None:
    """Refuse (PreflightError) an n_ctx beyond the model's trained context unless `allow` (None:
    the environment's KVARN_ALLOW_LONG_CONTEXT=1): positions it never saw measure extrapolation,
    not the cache, and the job would spend its time before anyone noticed."""
    if allow is None:
        allow = os.environ.get(LONG_CONTEXT_ENV, "").strip() not in ("", "0")
    trained = trained_context(config)
    if trained is not None and n_ctx > trained and not allow:
        raise PreflightError(
            f"n_ctx {n_ctx} is beyond the model's trained context (max_position_embeddings {trained}): lower "
            f"--ctx (n_ctx) to at most {trained}, or pass {LONG_CONTEXT_FLAG} (for any job: "
            f"{LONG_CONTEXT_ENV}=1) to measure it anyway"
        )


@dataclass
class Estimate:
    device: str
    device_parts: dict[str, int] = field(default_factory=dict)
    host_parts: dict[str, int] = field(default_factory=dict)

    @property
    def device_bytes(self) -> int:
        return int(sum(self.device_parts.values()) * HEADROOM)

    @property
    def host_bytes(self) -> int:
        return int(sum(self.host_parts.values()) * HEADROOM)

    def describe(self) -> str:
        lines = []
        for where, parts, total in (("device", self.device_parts, self.device_bytes),
                                    ("host", self.host_parts, self.host_bytes)):
            if not parts:
                continue
            lines.append(f"{where} ({self.device if where == 'device' else 'RAM'}): {_gib(total)} "
                         f"(incl. {round((HEADROOM - 1) * 100)} % headroom)")
            lines += [f"  {name:<24} {_gib(b)}" for name, b in parts.items()]
        return "\n".join(lines)


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def param_count(config: Any) -> int:
    """Parameters of the causal LM of `config` (a transformers config object), built on meta."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def cached_rows(window: int | None, n_ctx: int, ubatch: int) -> int:
    """Rows one attention layer stores (kvarn.kvcache.cache.KVarnLayer): the whole chunk on a full
    layer; on a sliding layer the W - 1 rows before a ubatch and the ubatch's own."""
    return n_ctx if window is None else min(n_ctx, window - 1 + ubatch)


def _linear_state_bytes(c: Any) -> int:
    """Conv + recurrent state of one Gated DeltaNet layer (transformers' linear-attention cache), fp32."""
    k_heads, v_heads = int(c.linear_num_key_heads), int(c.linear_num_value_heads)
    k_dim, v_dim = int(c.linear_key_head_dim), int(c.linear_value_head_dim)
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    return 4 * (conv_dim * int(c.linear_conv_kernel_dim) + v_heads * k_dim * v_dim)


def attention_temporaries(path: str, rounding: str | None, u: int, n_ctx: int, n_heads: int, kv_max: int,
                          d_max: int) -> int:
    """Bytes one attention call of the path ("ref" | "flex") holds at its peak, for a ubatch of u
    queries over n_ctx keys (the largest layer: kv_max KV heads of head dim d_max). `rounding`:
    kvarn.vocab.options.ATTENTION_ROUNDING's value for the compute: None (exact), "bfloat16"
    (bf16-attn: bf16 operands) or "tfloat32" (tf32-attn: fp32 operands rounded by
    kvarn.kvcache.rounding, TF32_ROUNDING_BYTES of temporaries per element while one is rounded)."""
    if rounding not in (None, "bfloat16", "tfloat32"):
        raise ValueError(f"rounding {rounding!r}: expected None, bfloat16 or tfloat32")
    masks = 4 * u * n_ctx  # the model's mask and the body / exact / selection masks (bool)
    io = n_heads * u * d_max * 4 * 2  # the fp32 queries and output (under tf32: the query and its rounded copy)
    if path == "ref":
        kv_elems = kv_max * n_ctx * d_max  # one block's K (as many V)
        score_elems = n_heads * QUERY_BLOCK * n_ctx
        if rounding == "tfloat32":
            # rounded_attention: rounding P (scores and numerators alive, P's rounding temporaries;
            # K and V, their rounded copies freed after Q·K) or, later, V (scores, numerators and
            # rounded P alive; V's temporaries): the larger of the two
            return masks + io + max(kv_elems * 8 + score_elems * (4 + 4 + TF32_ROUNDING_BYTES),
                                    kv_elems * (8 + TF32_ROUNDING_BYTES) + score_elems * 4 * 3)
        rounded = rounding == "bfloat16"
        block = 2 * kv_elems * 4 * (2 if rounded else 1)  # one block's K and V (and their rounded copies)
        scores = (3 if rounded else 2) * score_elems * 4  # scores, softmax (and numerators), fp32
        return masks + block + scores + io
    if path == "flex":
        rows = 2 * n_ctx  # [body ; exact]
        kv_elems = kv_max * rows * d_max  # K (as many V) concatenated
        grid = u * rows * (2 * 8 + 2)  # the mask_mod over every (query, row): two int64 and two bool grids
        if rounding == "tfloat32":
            # kvarn.kvcache.flex rounds Q, K and V (fp32) before it builds the BlockMask: at the
            # rounding of V, K before and after (4 + 4), V (4) and its temporaries (9), 21 bytes per
            # element pair; then the rounded K and V (8) beside the grid. The larger holds.
            return masks + io + max(kv_elems * (4 + 4 + 4 + TF32_ROUNDING_BYTES), kv_elems * 8 + grid)
        operands = 2 * kv_elems * (2 if rounding == "bfloat16" else 4)  # K and V concatenated, in the operands' dtype
        return masks + operands + grid + io
    raise ValueError(f"attention path {path!r}: expected ref or flex")


def estimate(config: Any, n_ctx: int, ubatch: int, dtype: str, device: str, baseline: bool,
             n_params: int | None = None, attention: str = "ref", compute: str = "exact") -> Estimate:
    """Peak memory of one job of the model of `config` (a transformers config object), on the
    attention path `attention` ("ref" | "flex") under `compute`."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPE_BYTES)}")
    geom: Geometry = geometry_from_config(config)
    c = text_config(config)
    wb = DTYPE_BYTES[dtype]
    vocab, hidden = int(c.vocab_size), int(c.hidden_size)
    n_heads = int(c.num_attention_heads)
    u = min(ubatch, n_ctx)
    kv = [layer for layer in geom.layers if layer.has_kv]
    n_linear = sum(1 for layer in geom.layers if not layer.has_kv)
    d_max = max(layer.head_dim for layer in kv)
    kv_max = max(layer.n_kv_heads for layer in kv)
    rounding = ATTENTION_ROUNDING.get(compute)
    # only bf16-attn narrows the body (kvarn.kvcache.cache.KVarnLayer.narrow_body); tf32-attn keeps fp32
    row_bytes = BASELINE_ROW_BYTES if baseline else ROUNDED_CELL_ROW_BYTES if rounding == "bfloat16" else CELL_ROW_BYTES
    parts = {
        "weights": (n_params if n_params is not None else param_count(config)) * wb,
        "cache copies": sum(layer.n_kv_heads * cached_rows(layer.window, n_ctx, u) * layer.head_dim * row_bytes
                            for layer in kv),
    }
    if n_linear:
        parts["linear-attention state"] = n_linear * _linear_state_bytes(c)
    parts["attention temporaries"] = attention_temporaries(attention, rounding, u, n_ctx, n_heads, kv_max, d_max)
    inter = int(getattr(c, "intermediate_size", 4 * hidden) or 4 * hidden)
    parts["activations"] = u * (3 * inter + 6 * hidden) * wb
    parts["logits"] = u * vocab * 4 + 2 * LOGIT_ROWS * vocab * 4
    host = {"log-prob slice": LOGIT_ROWS * vocab * (4 + 8 + 2)} if baseline else {}
    if not str(device).startswith("cuda"):  # the device is the host
        host = {**parts, **host}
        return Estimate(str(device), {}, host)
    return Estimate(str(device), parts, host)


def _host_available() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with open("/proc/meminfo") as f:
            info = {ln.split(":")[0]: ln.split()[1] for ln in f}
        return int(info["MemAvailable"]) * 1024


def _override() -> int | None:
    raw = os.environ.get(MEMORY_ENV)
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{MEMORY_ENV}={raw!r} (environment): expected the device's memory in bytes, a positive integer")
    return int(raw)


def held_by_other_workers() -> int:
    """Bytes the other live kvarn workers of this run record as held (their socket still exists)."""
    own = os.environ.get(SOCKET_ENV)
    directory = Path(own).parent if own else socket_dir()
    total = 0
    for held in directory.glob("*.held"):
        sock = held.with_suffix(".sock")
        if (own and sock.resolve() == Path(own).resolve()) or not sock.exists():
            continue
        try:
            total += int(held.read_text())
        except (FileNotFoundError, ValueError):
            continue  # exiting, or being written
    return total


def capacity(device: str) -> tuple[int | None, int]:
    """(free bytes on the CUDA device or None for a CPU job, available host bytes); under
    KVARN_DEVICE_MEMORY the job's device has that many bytes less what other workers hold."""
    override = _override()
    if override is not None:
        free = override - held_by_other_workers()
        return (free, _host_available()) if str(device).startswith("cuda") else (None, free)
    dev = None
    if str(device).startswith("cuda"):
        import torch

        dev = int(torch.cuda.mem_get_info(torch.device(device))[0])
    return dev, _host_available()


def check(est: Estimate, device_free: int | None, host_free: int) -> None:
    """Raise PreflightError when `est` exceeds a capacity, naming the largest part's knob."""
    for where, need, have, parts in (("device", est.device_bytes, device_free, est.device_parts),
                                     ("host", est.host_bytes, host_free, est.host_parts)):
        if have is None or not parts or need <= have:
            continue
        big = max(parts, key=parts.get)
        raise PreflightError(
            f"this job needs about {_gib(need)} of {where} memory ({est.device if where == 'device' else 'RAM'}) "
            f"but {_gib(have)} is free; the largest part is {big} ({_gib(parts[big])}): lower it with "
            f"{KNOBS[big]}.\n{est.describe()}"
        )


def preflight(spec, n_ctx: int, ubatch: int, device: str, dtype, cache_dir, baseline: bool,
              dry_run: bool = False, allow_long_context: bool | None = None, attention: str = "auto",
              compute: str = "exact") -> Estimate:
    """Estimate a job from its config; stop (PreflightError) if its n_ctx is beyond the model's
    trained context (`check_context`, dry run included) or it cannot fit; return the estimate.
    `dry_run`: no capacity check, for `kvarn run/baseline --dry-run`. `attention`: the option
    (`kvarn.vocab.options.attention_for` picks the path on the device), `compute` the cell's."""
    raw = config_json(spec, cache_dir)
    check_context(raw, n_ctx, allow_long_context)
    device, torch_dtype = pick_device_dtype(device, dtype)
    est = estimate(config_object(raw), n_ctx, ubatch, str(torch_dtype).removeprefix("torch."),
                   device, baseline, compute=compute,
                   # llamacpp-cpu's attention (kvarn.llamacpp_cpu.compute) gathers as ref does
                   attention=attention_for(attention, str(device).split(":")[0]) if compute in ATTENTION_ROUNDING else "ref")
    if not dry_run:
        check(est, *capacity(device))
        record_held(est)
    return est


def record_held(est: Estimate) -> None:
    """In a kvarn worker (its socket in the environment): record what its loaded model holds."""
    own = os.environ.get(SOCKET_ENV)
    if own:
        held = est.device_bytes if est.device_parts else est.host_bytes
        held_path(Path(own)).write_text(f"{held}\n")
