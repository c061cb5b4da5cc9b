"""Compute bf16-attn (kvarn.vocab.options.ATTENTION_ROUNDING): the cache model's attention with
Q·K and P·V on bf16 operands, fp32 accumulation and an fp32 softmax, as a GPU's flash attention.

Oracles: `rounded_attention` against loops written out in float64 over hand-rounded operands;
every attention call of a tiny model through the cache against the dense float64 reference
(tests/attention_ref.py) rounding the same operands; the fp32 path and partly rounded variants
as the negatives the check must tell apart.
"""

from __future__ import annotations

import math


import pytest
import torch

import attention_ref as AR
import kvarn.kvcache.attention as kattn
import kvarn.kvcache.flex as kflex
from kvarn.kvcache.cache import KVarnCache
from kvarn.run import forward
from kvarn.vocab.cell import CellError, CellSpec
from kvarn.vocab.options import ATTENTION_ROUNDING, BF16_ATTN, COMPUTE_VERSION, TF32_ATTN, check_compute
from test_cache import _gemma, _ids, _llama

BF16 = torch.bfloat16
CHECK = "kvarn_rounding_check"


SIGNIFICANT = {"bfloat16": 8, "tfloat32": 11}  # significant bits a rounded operand keeps


def rnd(x: float, how: str) -> float:
    return float(AR.rounded(torch.tensor(float(x), dtype=torch.float64), how))


def loops(q, k, v, mask, scale, how, p_rule="truncate"):
    """rounded_attention's arithmetic one query and one key at a time in float64: the operands
    rounded (`how`), s_j = scale · Σ_d q_d k_jd, e_j = exp(s_j − max s), out = Σ_j r(e_j) v_j / Σ_j e_j,
    r of e_j by `p_rule` under TF32 (AR.p_rounding: the kernel's truncation, or to nearest).
    Also returns the smallest distance of any e_j to where its rounding changes (relative: a tie to
    nearest, a grid point when truncated; e_j = 1, exact in both, apart): where the float32 e_j of
    the code and this float64 one could round to different neighbours."""
    n, L, D = q.shape[0], k.shape[0], q.shape[1]
    bits = SIGNIFICANT[how]
    p_how = AR.p_rounding(how, p_rule)
    edge = 0.0 if p_how == "tfloat32-truncate" else 0.5  # where in a step the rounding of e changes
    out = torch.zeros(n, D, dtype=torch.float64)
    near = math.inf
    for i in range(n):
        s = [scale * sum(rnd(q[i, d], how) * rnd(k[j, d], how) for d in range(D)) if mask[i, j] else -math.inf
             for j in range(L)]
        m = max(s)
        e = [math.exp(x - m) for x in s]
        for j in range(L):
            if 0 < e[j] < 1:
                m_, _ = math.frexp(e[j])  # e = m_ · 2^ex, m_ in [0.5, 1): the rounding keeps `bits` bits of m_
                frac = (m_ * 2 ** bits) % 1.0  # where e sits between two neighbours (0.5: a tie)
                near = min(near, min(abs(frac - edge), abs(frac - edge - 1)) / 2 ** bits)
        den = sum(e)
        for d in range(D):
            out[i, d] = sum(rnd(e[j], p_how) * rnd(v[j, d], how) for j in range(L)) / den
    return out, near


@pytest.mark.parametrize("how,p_rule", [("bfloat16", None), ("tfloat32", None), ("tfloat32", "nearest")])
def test_rounded_attention_against_loops(how, p_rule):
    # p_rule None: the default, TF32's P truncated as the flex kernel reads it (the loops' default)
    g = torch.Generator().manual_seed(5)
    n, L, D, scale = 6, 9, 8, 8 ** -0.5
    q, k, v = (torch.randn(x, D, generator=g) * 2 for x in (n, L, L))
    mask = torch.ones(n, L, dtype=torch.bool).tril(L - n)  # causal, query i at position L - n + i
    mask[2, 0] = False  # and a hole
    want, near = loops(q, k, v, mask, scale, how, p_rule or "truncate")
    assert near > 1e-6  # no numerator within fp32 noise of a tie: the rounding is decided
    got = kattn.rounded_attention(q, k, v, mask, scale, how, p_rule)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=2e-6, atol=2e-7), (got.double() - want).abs().max()
    # the rounding is there: fp32 attention is off by ~the format's step, far beyond the tolerance
    plain = torch.softmax((q @ k.T * scale).masked_fill(~mask, -math.inf), -1) @ v
    assert (plain.double() - want).abs().max() > 20 * 2e-6 * want.abs().max()


def test_tf32_rounding_by_hand():
    # 11 significant bits, to nearest, ties away from zero; signs kept; inf and nan untouched
    from kvarn.kvcache.rounding import round_operand

    ulp = 2.0 ** -10  # of 1.0
    x = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 1 + ulp / 2 - 2 ** -20, 1 + ulp / 4,
                      3.0, math.inf, -math.inf, 0.0])
    want = [1 + ulp, 1 + 2 * ulp, -(1 + ulp), 1.0, 1.0, 3.0, math.inf, -math.inf, 0.0]
    assert round_operand(x, "tfloat32").tolist() == want
    assert round_operand(torch.tensor([math.nan]), "tfloat32").isnan().all()
    with pytest.raises(ValueError, match="rounding 'fp8': expected bfloat16 or tfloat32"):
        round_operand(x, "fp8")


def _rounding_run(model, ids, cell: CellSpec, ubatch: int, attention="ref", how=None):
    """Per attention call: (mean |kvarn − ref64 rounded|, mean |ref64 rounded − ref64 fp32|) over
    the output's elements, the second being the rounding's own effect on that call's output; rounded as the cell's compute
    rounds (`how`, for a cell of the fp32 path)."""
    rec = []

    def fwd(module, query, key, value, attention_mask, scaling=None, kvarn_cache=None, **kw):
        out, _ = kattn.kvarn_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                               kvarn_cache=kvarn_cache, **kw)
        layer = kvarn_cache.layers[module.layer_idx]
        sc = scaling if scaling is not None else query.shape[-1] ** -0.5
        rounded = AR.reference_attention(query, layer, sc, key, value,
                                         round_to=how or kvarn_cache.attn_rounding).transpose(1, 2)
        fp32 = AR.reference_attention(query, layer, sc, key, value).transpose(1, 2)
        rec.append(((out.double() - rounded).abs().mean().item(), (rounded - fp32).abs().mean().item()))
        return out, None

    with torch.no_grad(), AR.registered(CHECK, fwd):
        model.set_attn_implementation(CHECK)
        cache = KVarnCache(model.config, cell, attention=attention)
        for s in range(0, ids.shape[1], ubatch):
            model(ids[:, s : s + ubatch], cache=cache, kvarn_cache=cache, use_cache=True)
    assert len(rec) >= model.config.num_hidden_layers * -(-ids.shape[1] // ubatch)
    return rec


# Per call, the mean |kvarn − reference| over the output's elements as a share of the rounding's own
# mean effect, averaged over the calls. Rounded right it is fp32 noise plus the rare numerator at a
# rounding tie that fp32 and float64 round to neighbours (one query row each): measured at most
# 0.0001 (bf16) and 0.0021 (TF32 with P truncated as the kernel reads it; 0.0035 when P was rounded to
# nearest: TF32's step is 8 times finer, so fp32 noise weighs more). Leaving
# out the rounding of Q, of V or of P alone measured 0.24-0.83 (test_a_partly_rounded_path_is_caught);
# the fp32 path is 1.
SHARE = 0.02


def mean_share(rec) -> float:
    return sum(d / e for d, e in rec) / len(rec)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return {"llama": _llama, "gemma3": _gemma}[request.param]()


@pytest.mark.parametrize("compute", [BF16_ATTN, TF32_ATTN])
@pytest.mark.parametrize("k,v,tail", [("bf16", "bf16", 0), ("q4_0", "q4_0", 8), ("kvarn4", "kvarn4", 0),
                                      ("q2_0", "q8_0", 5)])
def test_every_call_rounds_as_the_reference(model, k, v, tail, compute):
    ids = _ids(model)
    for ub in (64, 7):
        rec = _rounding_run(model, ids, CellSpec(k, v, tail, compute=compute), ub)
        assert mean_share(rec) <= SHARE, (k, v, tail, ub, mean_share(rec))
    # the same cell on the fp32 path is the unrounded reference: the check tells them apart
    assert mean_share(_rounding_run(model, ids, CellSpec(k, v, tail), 64, how=ATTENTION_ROUNDING[compute])) > 0.9


@pytest.mark.parametrize("compute", [BF16_ATTN, TF32_ATTN])
def test_a_partly_rounded_path_is_caught(model, compute, monkeypatch):
    from kvarn.kvcache.cache import KVarnLayer
    from kvarn.kvcache.rounding import round_operand

    monkeypatch.setattr(KVarnLayer, "narrow_body", False)  # a bf16 body would make V's rounding a no-op
    ids = _ids(model)
    cell = CellSpec("q4_0", "q4_0", 8, compute=compute)

    def partly(keep):
        def f(q, k, v, mask, scale, how):
            r = {n: (lambda x: round_operand(x, how)) if n in keep else (lambda x: x) for n in "qkvp"}
            s = (r["q"](q) @ r["k"](k).transpose(-1, -2) * scale).masked_fill(~mask, -math.inf)
            p = torch.exp(s - s.amax(-1, keepdim=True))
            return r["p"](p) @ r["v"](v) / p.sum(-1, keepdim=True)
        return f

    for left_out in "qvp":
        monkeypatch.setattr(kattn, "rounded_attention", partly(set("qkvp") - {left_out}))
        assert mean_share(_rounding_run(model, ids, cell, 7)) > 10 * SHARE, left_out


def test_flex_gets_rounded_operands(model, monkeypatch):
    # flex_attention is handed bf16 Q, K and V (its compiled kernel then sums in fp32 and rounds P,
    # as rounded_attention: the GPU's path, checked on the device). Eager flex, the only flex the
    # tests run, also rounds the scores to bf16: it is checked here for its operands and for reading
    # the right copies (its error stays at the rounding's scale, far below a quantizer's), not for
    # rounded_attention's arithmetic.
    monkeypatch.setattr(kflex, "COMPILE", False)
    seen = []

    def kernel(q, k, v, **kw):
        tf32 = all((x.view(torch.int32) & 0x1FFF == 0).all() for x in (q, k, v) if x.dtype == torch.float32)
        seen.append(({q.dtype, k.dtype, v.dtype}, bool(tf32), kw.get("kernel_options")))
        return kflex.flex_attention(q, k, v, **kw)

    monkeypatch.setattr(kflex, "_kernel", lambda: kernel)
    ids = _ids(model)
    rec = _rounding_run(model, ids, CellSpec("q4_0", "q4_0", 8, compute=BF16_ATTN), 64, attention="flex")
    assert seen and all(s[0] == {BF16} for s in seen)
    assert max(d for d, _ in rec) < 10 * max(e for _, e in rec)
    seen.clear()
    # tf32-attn: fp32 operands with TF32's 11 significant bits (eager flex: no kernel options)
    rec = _rounding_run(model, ids, CellSpec("q4_0", "q4_0", 8, compute=TF32_ATTN), 64, attention="flex")
    assert seen and all(s == ({torch.float32}, True, None) for s in seen)
    assert max(d for d, _ in rec) < 10 * max(e for _, e in rec)
    seen.clear()
    _rounding_run(model, ids, CellSpec("q4_0", "q4_0", 8), 64, attention="flex", how="bfloat16")
    assert seen and all(s[0] == {torch.float32} and not s[1] for s in seen)


def test_the_cell_and_the_cache_of_bf16_attn(model):
    cell = CellSpec("kvarn4", "kvarn4", 0, compute=BF16_ATTN)
    assert cell.name == "kvarn4-kvarn4-t0-bf16_attn" and CellSpec.from_name(cell.name) == cell
    assert CellSpec.from_name("q4_0-q4_0-t128-s4-bf16_attn") == CellSpec("q4_0", "q4_0", 128, sink=4, compute=BF16_ATTN)
    with pytest.raises(ValueError, match="the same cell is 'q4_0-q4_0-t0-bf16_attn'"):
        CellSpec.from_name("q4_0-q4_0-t0-llamacpp_cpu-bf16_attn")
    with pytest.raises(CellError, match="compute 'bf16'"):
        CellSpec("q4_0", "q4_0", 0, compute="bf16")
    cache = KVarnCache(model.config, cell)
    assert cache.attn_rounding == "bfloat16" and cache.compute == BF16_ATTN
    assert KVarnCache(model.config, CellSpec("q4_0", "q4_0", 0, compute=TF32_ATTN)).attn_rounding == "tfloat32"
    # its layers store and select as the exact path's; only the attention's operands differ
    assert {layer.compute for layer in cache.layers if hasattr(layer, "compute")} == {"exact"}
    assert KVarnCache(model.config, CellSpec("kvarn4", "kvarn4", 0)).attn_rounding is None
    assert check_compute(BF16_ATTN, "kivi2", "kivi2", 0, 4) == BF16_ATTN  # every type, any sink
    assert ATTENTION_ROUNDING[BF16_ATTN] == "bfloat16" and COMPUTE_VERSION[BF16_ATTN] == 1


def test_the_engine_runs_bf16_attn_on_the_exact_paths_attention():
    # the attention path is recorded (not None as under llamacpp-cpu), and the baseline is its own
    assert forward.attention_path("auto", "cpu", BF16_ATTN) == "ref"
    assert forward.attention_path("flex", "cpu", BF16_ATTN) == "flex"
    assert forward.attention_path("auto", "cpu", "llamacpp-cpu") is None
    assert forward.baseline_cell(BF16_ATTN) == CellSpec("bf16", "bf16", 0, compute=BF16_ATTN)


@pytest.mark.parametrize("k,v,tail", [("q4_0", "q4_0", 8), ("kvarn4", "kvarn4", 0), ("f16", "f16", 3)])
def test_the_body_stored_in_bf16_changes_no_bit(model, k, v, tail, monkeypatch):
    # Under bf16-attn the body is stored in bf16: attention rounds it to bf16 before every use, so
    # the logits are those of the same cell with its body kept in the format's own dtype, bit for bit.
    from kvarn.kvcache.cache import KVarnLayer
    from test_cache import cache_logits

    ids = _ids(model, 300 if k.startswith("kvarn") else 64)  # KVarN: two groups sealed into the body
    cell = dict(compute=BF16_ATTN)
    for ub in (64, 7):
        narrow = cache_logits(model, ids, k, v, tail, ub, **cell)
        monkeypatch.setattr(KVarnLayer, "narrow_body", False)
        wide = cache_logits(model, ids, k, v, tail, ub, **cell)
        monkeypatch.setattr(KVarnLayer, "narrow_body", True)
        assert torch.equal(narrow, wide), (k, v, tail, ub)
    cache = KVarnCache(model.config, CellSpec(k, v, tail, **cell))
    model.set_attn_implementation(kattn.ATTN_NAME)
    with torch.no_grad():
        model(ids, cache=cache, kvarn_cache=cache)
    layer = cache.layers[0]
    assert layer.keys.dtype == layer.values.dtype == BF16
    assert KVarnLayer(layer.k_fmt, layer.v_fmt, layer.policy, layer.tail_dtype)._body_dtype(layer.k_fmt) != BF16


def test_the_preflight_counts_the_path_and_the_compute():
    """Qwen 3.6 at 65,536 (its full-attention layers: 24 query heads, 4 KV heads of 256; ubatch 512), by hand."""
    from pathlib import Path

    from kvarn.budget import preflight
    from kvarn.weights.sources import ModelSpec

    repo = Path(__file__).resolve().parents[1]
    spec = ModelSpec("q", f"random:{repo}/config/models/qwen3.6-27b.json")
    u, n, H, kv, d = 512, 65536, 24, 4, 256
    masks, io = 4 * u * n, H * u * d * 4 * 2
    want = {
        ("ref", "exact"): masks + 2 * kv * n * d * 4 + 2 * H * 128 * n * 4 + io,
        ("ref", BF16_ATTN): masks + 2 * 2 * kv * n * d * 4 + 3 * H * 128 * n * 4 + io,
        # [body ; exact] K and V (2n rows) in fp32 / bf16, and the mask_mod's grid: 2 int64 + 2 bool per pair
        ("flex", "exact"): masks + 2 * kv * 2 * n * d * 4 + u * 2 * n * 18 + io,
        ("flex", BF16_ATTN): masks + 2 * kv * 2 * n * d * 2 + u * 2 * n * 18 + io,
    }
    cache = {}
    for (path, compute), bytes_ in want.items():
        est = preflight.preflight(spec, n, u, "cuda", "bfloat16", "unused", baseline=False, dry_run=True,
                                  attention=path, compute=compute)
        assert est.device_parts["attention temporaries"] == bytes_, (path, compute)
        cache[compute] = est.device_parts["cache copies"]
    # 16 full-attention layers x 4 KV heads x 65536 rows x 256: fp32 body + 16-bit exact (12 B), bf16 body (8 B)
    assert cache == {"exact": 16 * 4 * n * 256 * 12, BF16_ATTN: 16 * 4 * n * 256 * 8}
    # "auto" is flex on CUDA, ref on the CPU; llamacpp-cpu gathers as ref
    auto = preflight.preflight(spec, n, u, "cuda", "bfloat16", "unused", baseline=False, dry_run=True, compute=BF16_ATTN)
    assert auto.device_parts["attention temporaries"] == want[("flex", BF16_ATTN)]
    cpu = preflight.estimate(preflight.config_object(preflight.config_json(spec, "unused")), n, u, "float32", "cpu",
                             False, compute="llamacpp-cpu")
    assert cpu.host_parts["attention temporaries"] == want[("ref", "exact")]


def test_the_matrix_plans_bf16_attn_cells_with_their_own_baseline():
    from pathlib import Path

    import yaml

    from kvarn.plan import matrix as kvm
    from kvarn.plan import paths as kvp
    from kvarn.vocab.options import COMPUTES

    repo = Path(__file__).resolve().parents[1]
    schema = yaml.safe_load((repo / "workflow/schemas/config.schema.yaml").read_text())
    enums = []

    def walk(x):
        if isinstance(x, dict):
            if x.get("enum") and "exact" in x["enum"]:
                enums.append(x["enum"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(schema)
    assert enums == [list(COMPUTES)]  # the schema accepts every compute path, named as kvarn names them
    cell = CellSpec("q8_0", "q8_0", 0, compute=BF16_ATTN)
    assert kvp.baseline_path("results/m/ctx2048-c1", cell.compute) == "results/m/ctx2048-c1/baseline-bf16_attn.kvd"
