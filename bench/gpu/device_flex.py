"""Step 3 of the device run (bench/gpu/device_run.py): flex at head dim 512 (Gemma 4's global
layers, 32/4 heads; `torch.compile(flex_attention, dynamic=True)` as kvarn.kvcache.flex compiles it)
on random tensors with a causal block mask, a 512-query ubatch over 16,384 keys: fp32 with the TF32
dots the model runs use (`FLOAT32_PRECISION 'tf32'`, operands rounded by kvarn.kvcache.rounding) and
bf16. Per case the first call's seconds (the compile), the median call after warm-up, peak device
memory, or the error (a Triton "out of resource" is a result; a failed case is retried once with
small kernel blocks, its own line). The fp32 case also says which P rule the kernel follows: its
output against `rounded_attention` with P truncated and P rounded to nearest (`p_rule`).
"""

from __future__ import annotations

import time

from bench.gpu.device_plan import SMOKE
from bench.gpu.device_record import Recorder, compiled_graphs, short_error

FLEX_HEADS = {512: (32, 4)}  # head dim -> (query heads, KV heads): Gemma 4's global layers
FLEX_KEYS, FLEX_QUERIES = (16384,), 512
SMALL_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1}  # the retry of a failed flex case


# --- step 3: flex at head dim 512, compile and per-call time, the kernel's P rule -----------

def step_flex(args, rec: Recorder) -> None:
    import torch
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    device = "cpu" if args.smoke else "cuda"
    for limit in ("recompile_limit", "cache_size_limit"):  # dtype x head dim kernels + retries: never eager
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    kernel = flex_attention if args.smoke else torch.compile(flex_attention, dynamic=True)
    keys = SMOKE["flex_keys"] if args.smoke else FLEX_KEYS
    for dim, heads in FLEX_HEADS.items():
        for dtype in (torch.float32, torch.bfloat16):
            for n_keys in keys:
                name = "float32 (TF32 dots)" if dtype == torch.float32 else "bfloat16"
                case = {"step": "flex", "item": f"D{dim} {name} {n_keys} keys", "head_dim": dim,
                        "dtype": str(dtype)[6:], "keys": n_keys,
                        "queries": SMOKE["flex_queries"] if args.smoke else FLEX_QUERIES,
                        "heads": SMOKE["flex_heads"] if args.smoke else heads, "compiled": not args.smoke}
                if dtype == torch.float32:  # what tf32-attn runs (kvarn.kvcache.flex): rounded operands, TF32 dots
                    case["tf32"] = True
                    if not args.smoke:
                        case["kernel_options"] = {"FLOAT32_PRECISION": "'tf32'"}
                if time.time() > args.deadline:
                    rec.add({**case, "status": "skipped", "why": "past the run's deadline"})
                    continue
                r = rec.add(flex_case(kernel, case, device, dtype, SMOKE["repeats"] if args.smoke else 5))
                if r["status"] == "error" and time.time() < args.deadline:
                    rec.add(flex_case(kernel, {**case, "item": case["item"] + " small blocks", "small_blocks": True,
                                               "kernel_options": {**case.get("kernel_options", {}), **SMALL_BLOCKS}},
                                      device, dtype, 1))


def flex_case(kernel, case: dict, device: str, dtype, repeats: int = 5) -> dict:
    """One flex_attention call shape: the first call (compile included where this dtype and head
    dim have none yet), the median of `repeats` calls after two warm-up calls, peak memory; for a
    TF32 case (`case["tf32"]`: operands rounded as kvarn.kvcache.flex rounds them) also `p_rule`."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n_q, n_k, dim = case["queries"], case["keys"], case["head_dim"]
    hq, hkv = case["heads"]
    out = dict(case)
    q = k = v = None
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        g = torch.Generator(device=device).manual_seed(dim + n_k)
        q, k, v = (torch.randn(1, h, n, dim, device=device, dtype=dtype, generator=g)
                   for h, n in ((hq, n_q), (hkv, n_k), (hkv, n_k)))
        if case.get("tf32"):
            from kvarn.kvcache.rounding import round_operand

            v = v + 1.0  # a mean away from 0: P's rounding bias shows in the output (p_rule_check)
            q, k, v = (round_operand(x, "tfloat32") for x in (q, k, v))
        offset = torch.tensor(n_k - n_q, device=device)  # the last ubatch of the keys: the densest

        def causal(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        t = time.perf_counter()
        bm = create_block_mask(causal, None, None, n_q, n_k, device=device)
        sync()
        out["block_mask_s"] = time.perf_counter() - t
        opts = {"kernel_options": case["kernel_options"]} if "kernel_options" in case else {}

        def call():
            return kernel(q, k, v, block_mask=bm, scale=dim ** -0.5, enable_gqa=hq != hkv, **opts)

        graphs = compiled_graphs()
        t = time.perf_counter()
        y = call()
        sync()
        out["first_call_s"] = time.perf_counter() - t
        out["graphs_compiled"] = None if graphs is None else compiled_graphs() - graphs
        out["finite"] = bool(torch.isfinite(y).all())
        for _ in range(min(2, repeats)):
            call()
        sync()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - t)
        out["per_call_s"] = sorted(times)[len(times) // 2]
        out["compile_s"] = max(0.0, out["first_call_s"] - out["per_call_s"])
        if case.get("tf32"):
            out["p_rule"] = p_rule_check(q, k, v, y, n_k - n_q, dim ** -0.5)
        out["status"] = "ok"
    except Exception as e:  # a failure to compile or launch is this case's result
        out.update({"status": "error", "error": short_error(e)})
    finally:
        del q, k, v
        if cuda:
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.empty_cache()
    return out


def p_rule_check(q, k, v, y, offset: int, scale: float, heads: int = 4) -> dict:
    """Which P rule the kernel's output `y` follows: against `rounded_attention` (the CPU model of
    tf32-attn, in IEEE fp32 on the same device) with P truncated and with P rounded to nearest, on
    the first `heads` query heads: per rule the mean and RMS of (y - model) over the outputs'
    magnitude. Truncation shrinks every numerator (V's mean is 1 here), so the rule the kernel
    follows leaves the smaller |mean|: `closer`. Eager flex (the CPU smoke) computes fp32 dots: its
    answer says nothing of a GPU's."""
    import torch

    from kvarn.kvcache.attention import rounded_attention

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the model's own dots in IEEE fp32
    try:
        n_q, n_k = q.shape[-2], k.shape[-2]
        rep = q.shape[1] // k.shape[1]
        h = min(heads, q.shape[1])
        kk = k.repeat_interleave(rep, dim=1)[:, :h].float()
        vv = v.repeat_interleave(rep, dim=1)[:, :h].float()
        qi = torch.arange(n_q, device=q.device)[:, None]
        kj = torch.arange(n_k, device=q.device)[None, :]
        mask = qi + offset >= kj
        got = y[:, :h].double()
        size = float(got.abs().mean())
        out = {}
        for rule in ("truncate", "nearest"):
            model = rounded_attention(q[:, :h].float(), kk, vv, mask, scale, "tfloat32", p_rule=rule).double()
            d = (got - model) / size
            out[rule] = {"mean": float(d.mean()), "rms": float(d.pow(2).mean().sqrt())}
        out["closer"] = min(("truncate", "nearest"), key=lambda r: abs(out[r]["mean"]))
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
