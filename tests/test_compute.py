"""kvarn.llamacpp_cpu.compute (llamacpp-cpu) against a slow reference written straight from ggml-cpu's semantics.

The reference quantizes the cache with the `gguf` package (independent of
kvarn.formats.blocks), converts Q block by block, takes integer block dots and runs
ggml's key-by-key online softmax with scalar numpy float32 / float16 arithmetic.
"""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from kvarn.vocab.cell import CellSpec
from kvarn.vocab import scoring

from kvarn.llamacpp_cpu import activations, channel_order, compute, q8

from kvarn.vocab import options
from kvarn.kvcache.cache import KVarnLayer, make_format
from kvarn.formats.hadamard import rotate_blocks
from kvarn.vocab.policy import LayerPolicy
from paths import WIKI_TEXT

FIXTURE_NPZ = Path(__file__).parent / "fixtures" / "beellama" / "beellama_cpu.npz"
from ties import tie_blocks, tie_count

F32, F16 = np.float32, np.float16
GGUF = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1}
# BeeLlama's own types (no gguf quantizer): the offset its vec_dot and to_float subtract from a code
# (ggml-cpu/quants.c, ggml-quants.c v0.4.3: q6_0 - 32, q3_0 - 4, q2_0s - 2; the _1 types none)
FORK_OFFSET = {"q6_0": 32, "q3_0": 4, "q2_0": 2, "q6_1": 0, "q3_1": 0, "q2_1": 0}
QUANTIZED = (*GGUF, *FORK_OFFSET)


# --- hand-worked ----------------------------------------------------------------------------

def test_quantize_q8_hand_worked(one_thread):
    # amax 127 -> d = 1, id = 1: codes are the values rounded half to even (x86 _mm256_round_ps)
    x = torch.zeros(32)
    x[:6] = torch.tensor([2.5, 3.5, -2.5, -0.5, 1.5, 127.0])
    q, d, s = q8.quantize_q8(x, "q8_1")
    assert q[:6].tolist() == [2.0, 4.0, -2.0, -0.0, 2.0, 127.0]
    assert d.tolist() == [1.0]
    assert s.tolist() == [2 + 4 - 2 + 0 + 2 + 127]
    # d is stored fp16, the codes use the fp32 127/amax
    x = torch.full((32,), 0.1)
    q, d, s = q8.quantize_q8(x, "q8_0")
    assert s is None and (q == 127).all()
    assert d.item() == torch.tensor(0.1 / 127, dtype=torch.float32).to(torch.float16).float().item()
    q, d, _ = q8.quantize_q8(torch.zeros(64), "q8_0")
    assert (q == 0).all() and (d == 0).all()


def test_check_compute_refuses():
    with pytest.raises(ValueError, match="'fast'.*exact, llamacpp-cpu"):
        options.check_compute("fast")
    for tail in (0, 128):  # the ecosystem's caches: neither ggml's kernel nor BeeLlama's routes
        with pytest.raises(ValueError, match="K type 'quanto4' is not a llama.cpp or BeeLlama cache type"):
            options.check_compute("llamacpp-cpu", "quanto4", "quanto4", tail)
        with pytest.raises(ValueError, match="V type 'hqq2' is not a llama.cpp or BeeLlama cache type"):
            options.check_compute("llamacpp-cpu", "q4_0", "hqq2", tail)
    # BeeLlama's own block types at tail 0: ggml's one-chunk kernel with their vec_dot, not a scalar route
    for k, v in (("q6_0", "q6_0"), ("q3_0", "q4_0"), ("q2_0", "q2_1")):
        assert options.check_compute("llamacpp-cpu", k, v, 0) == "llamacpp-cpu"
        assert not options.scalar_route("llamacpp-cpu", k, v, 0)
    with pytest.raises(ValueError, match="sink 1 not accepted"):  # llama.cpp keeps no sink of its own choosing
        options.check_compute("llamacpp-cpu", "q4_1", "q4_1", 0, 1)
    with pytest.raises(ValueError, match="sink 4 not accepted"):
        options.check_compute("llamacpp-cpu", "q4_1", "q4_1", 128, 4)
    # BeeLlama's scalar routes: a standard pair with a tail (any of its types), a KVarN pair
    for k, v, tail in (("q8_0", "q8_0", 128), ("q6_0", "q3_1", 64), ("kvarn4", "kvarn4", 0), ("kvarn6", "kvarn5", 512)):
        assert options.check_compute("llamacpp-cpu", k, v, tail) == "llamacpp-cpu"
        assert options.scalar_route("llamacpp-cpu", k, v, tail) and not options.scalar_route("exact", k, v, tail)
    assert not options.scalar_route("llamacpp-cpu", "q4_0", "q4_0", 0)
    assert options.check_compute("llamacpp-cpu", "q4_1", "q4_1", 0, 0) == "llamacpp-cpu"
    assert options.check_compute("exact", "q4_1", "q4_1", 0, 1) == "exact"


def test_every_cache_type_of_llamacpp_or_beellama_has_its_vec_dot_type():
    """A llamacpp-cpu cell at tail 0 runs ggml's kernel through `VEC_DOT_TYPE`: every registered
    float or block type has its entry (ggml-cpu.c type_traits_cpu, BeeLlama v0.4.3), no other."""
    from kvarn.formats import registry
    from kvarn.vocab.facts import get

    cache = {t for t in registry.names() if get(t).family in ("float", "block")}
    assert set(options.VEC_DOT_TYPE) == cache
    assert {t for t, q in options.VEC_DOT_TYPE.items() if q == "q8_1"} == {"q6_1", "q5_1", "q4_1", "q3_1", "q2_1"}


def test_kernel_path():
    assert compute.kernel_path("f16", "f16", 64) == "tiled"
    assert compute.kernel_path("f16", "f16", 63) == "one_chunk"
    assert compute.kernel_path("bf16", "bf16", 512) == "one_chunk"
    assert compute.kernel_path("q8_0", "f16", 512) == "one_chunk"


def test_bf16_scores_round_q_to_bf16(one_thread):
    # one value: the score is bf16(q)·k, not q·k
    q = torch.zeros(1, 32)
    q[0, 0] = 1.00390625  # 1 + 2^-8: bf16 rounds it (half to even) to 1.0
    k = {"val": torch.ones(1, 32)}
    assert compute.scores(q, k, "bf16", "one_chunk").item() == 1.0
    assert compute.scores(q, k, "f16", "one_chunk").item() == 1.00390625
    assert compute.scores(q, k, "f16", "tiled").item() == 1.00390625


# --- the slow reference -------------------------------------------------------------------

def _rot(x, n):
    # The rotation itself is kvarn.formats.hadamard's (tested in test_formats_blocks): a
    # differently rounded fp32 rotation can flip a Q code that sits on a rounding boundary
    # (seen: 1 in ~10 random cases), which is rotation rounding, not kernel arithmetic.
    return rotate_blocks(torch.from_numpy(np.ascontiguousarray(x)), n).numpy()


def _fork_blocks(t, codes, d16, m16):
    """BeeLlama blocks (codes [N, 32], d and m as fp16 bits) -> per block: (integer operand list,
    d, m or None), as its vec_dot reads them."""
    f16 = lambda bits: float(np.array([bits], np.uint16).view(F16)[0])  # noqa: E731
    return [((c - FORK_OFFSET[t]).tolist(), f16(d), None if m16 is None else f16(m))
            for c, d, m in zip(codes, d16, d16 if m16 is None else m16)]


def _blocks(t, x):
    """gguf-quantized rows x [n, D] -> per row, per block: (integer operand list, d, m or None).
    BeeLlama's types, which gguf lacks, by kvarn's quantizer (equal to BeeLlama's CPU cache code for
    code: tests/test_beellama_oracle.py test_blocks_match_beellama)."""
    if t in FORK_OFFSET:
        from kvarn.formats.blocks import SPECS, quantize_blocks

        q, d, m = quantize_blocks(SPECS[t], torch.from_numpy(np.ascontiguousarray(x)).reshape(-1, 32))
        bits = lambda v: v.reshape(-1).to(torch.float16).view(torch.int16).numpy().astype(np.uint16)  # noqa: E731
        flat = _fork_blocks(t, q.numpy(), bits(d), None if m is None else bits(m))
        nb = x.shape[-1] // 32
        return [flat[i * nb:(i + 1) * nb] for i in range(x.shape[0])]
    raw = quantize(x, GGUF[t])
    bs = raw.shape[-1] // (x.shape[-1] // 32)
    out = []
    for row in raw:
        blocks = []
        for bb in row.reshape(-1, bs):
            bb = bytes(bb)
            d = float(np.frombuffer(bb[0:2], F16)[0])
            m, off = (float(np.frombuffer(bb[2:4], F16)[0]), 4) if t in ("q4_1", "q5_1") else (None, 2)
            if t == "q8_0":
                ints = np.frombuffer(bb[off:], np.int8).astype(int).tolist()
            else:
                qh = 0
                if t in ("q5_0", "q5_1"):
                    qh, off = int.from_bytes(bb[off:off + 4], "little"), off + 4
                nib = bb[off:off + 16]
                codes = [(nib[j] & 15) for j in range(16)] + [(nib[j] >> 4) for j in range(16)]
                codes = [c | (((qh >> j) & 1) << 4) for j, c in enumerate(codes)]
                half = {"q4_0": 8, "q5_0": 16}.get(t, 0)
                ints = [c - half for c in codes]
            blocks.append((ints, d, m))
        out.append(blocks)
    return out


def _q8_row(x, kind):
    out = []
    for blk in x.reshape(-1, 32):
        amax = F32(np.abs(blk).max())
        d = F32(amax / F32(127))
        idv = F32(F32(127) / amax) if amax else F32(0)
        q = np.rint((blk * idv).astype(F32)).astype(int)
        s = float(F16(F32(d * F32(q.sum())))) if kind == "q8_1" else None
        out.append((q.tolist(), float(F16(d)), s))
    return out


@pytest.mark.parametrize("kind", ["q8_0", "q8_1"])
def test_quantize_q8_matches_the_reference_on_ties(kind, one_thread):
    # x86 quantize_row_q8_0/q8_1 round ties to even: rows where x·id sits on k + 1/2 (tests/
    # ties.py) tell that from C's roundf, which random rows never do; random rows as well.
    ties = tie_blocks("q8_0", 64, seed=3).reshape(16, 128)
    assert tie_count("q8_0", ties) >= 64 * 31
    x = np.concatenate([ties, np.random.default_rng(3).standard_normal((4, 128)).astype(F32) * 3])
    q, d, s = q8.quantize_q8(torch.from_numpy(x), kind)
    q, d = q.reshape(-1, 32).numpy(), d.reshape(-1).numpy()
    ref = [blk for row in x for blk in _q8_row(row, kind)]
    assert np.array_equal(q, np.array([r[0] for r in ref], dtype=F32))
    assert np.array_equal(d, np.array([r[1] for r in ref], dtype=F32))
    if kind == "q8_1":
        assert np.array_equal(s.reshape(-1).numpy(), np.array([r[2] for r in ref], dtype=F32))
    else:
        assert s is None


def _ref_attention(q, k, v, kt, vt, rot, scale, mask):
    """q [H, n_q, D], k/v [Hkv, L, D] fp32 numpy; mask bool [n_q, L]. ggml one-chunk semantics."""
    H, n_q, D = q.shape
    Hkv, L, _ = k.shape
    krot = rot and kt in QUANTIZED
    vrot = rot and vt in QUANTIZED
    if krot:
        q, k = _rot(q, D), _rot(k, D)  # head dim 64 here: one 64-block
    if vrot:
        v = _rot(v, 64)
    out = np.zeros((H, n_q, D), F32)
    for hk in range(Hkv):
        kb = _blocks(kt, k[hk]) if kt in QUANTIZED else None
        kf = k[hk].astype(np.float16 if kt == "f16" else F32).astype(F32) if kt in ("f16", "f32") else None
        if kt == "bf16":
            kf = torch.from_numpy(k[hk]).bfloat16().float().numpy()
        vf = (dequantize(quantize(v[hk], GGUF[vt]), GGUF[vt]).astype(F32) if vt in GGUF
              else _fork_values(_blocks(vt, v[hk])) if vt in FORK_OFFSET
              else v[hk].astype(np.float16).astype(F32) if vt == "f16"
              else torch.from_numpy(v[hk]).bfloat16().float().numpy())
        for h in range(hk * (H // Hkv), (hk + 1) * (H // Hkv)):
            for i in range(n_q):
                if kt in QUANTIZED:
                    qb = _q8_row(q[h, i], options.VEC_DOT_TYPE[kt])
                elif kt == "bf16":
                    qv = torch.from_numpy(q[h, i]).bfloat16().float().numpy()
                else:
                    qv = q[h, i].astype(np.float16).astype(F32)
                M, S = F32(-np.inf), F32(0)
                acc = np.zeros(D, F16 if vt == "f16" else F32)
                for j in range(L):
                    if not mask[i, j]:
                        continue
                    if kt in QUANTIZED:
                        sf = F32(0)
                        for (ki, dk, mk), (qi, dq, sq) in zip(kb[j], qb):
                            isum = sum(a * b for a, b in zip(ki, qi))
                            sf = F32(sf + F32(F32(dk) * F32(dq)) * F32(isum))
                            if mk is not None:
                                sf = F32(sf + F32(mk) * F32(sq))
                    else:
                        sf = F32(np.dot(qv.astype(np.float64), kf[j].astype(np.float64)))
                    s = F32(sf * F32(scale))
                    ms, vs = F32(1), F32(1)
                    if s > M:
                        ms = F32(np.exp(np.float64(M - s))) if M != -np.inf else F32(0)
                        M = s
                        acc = (acc.astype(F32) * ms).astype(acc.dtype)
                    else:
                        vs = F32(np.exp(np.float64(F32(s - M))))
                    acc = (acc.astype(np.float64) + vf[j].astype(np.float64) * vs).astype(F32).astype(acc.dtype)
                    S = F32(S * ms + vs)
                out[h, i] = acc.astype(F32) / S
    if vrot:
        out = _rot(out, 64)
    return out


def _fork_values(blocks):
    """BeeLlama's to_float (dequantize_row_q6_0 ... q2_1) of `_blocks` rows: (code - offset)·d + m."""
    return np.array([[F32(F32(c) * F32(d)) if m is None else F32(F32(F32(c) * F32(d)) + F32(m))
                      for ints, d, m in row for c in ints] for row in blocks], F32)


def _emulate(q, k, v, kt, vt, rot, scale, mask, compute_mode="llamacpp-cpu", layer=None):
    kf, vf = make_format(kt, "k", rot, CellSpec.iters), make_format(vt, "v", rot, CellSpec.iters)
    layer = layer or KVarnLayer(kf, vf, LayerPolicy(0, 0, None), torch.bfloat16, compute=compute_mode)
    kk, vv = torch.from_numpy(k)[None], torch.from_numpy(v)[None]
    layer.update(kk, vv)
    allowed = torch.from_numpy(mask)[None, None]
    if compute_mode == "exact":
        ke, ve = kf.roundtrip(kk), vf.roundtrip(vv)
        rep = q.shape[0] // k.shape[0]
        ke, ve = ke.repeat_interleave(rep, 1), ve.repeat_interleave(rep, 1)
        s = (torch.from_numpy(q)[None] @ ke.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        return (torch.softmax(s, -1) @ ve)[0].numpy()
    out = compute.attention(None, torch.from_numpy(q)[None], layer, allowed, scale)
    return out[0].transpose(0, 1).numpy(), layer.last_path


CASES = [("q8_0", "q8_0", True), ("q4_0", "q4_0", True), ("q4_1", "q4_1", False), ("q5_1", "q5_1", True),
         ("q5_0", "q4_1", False), ("bf16", "bf16", False), ("q8_0", "f16", True), ("f16", "f16", False),
         # BeeLlama's types at tail 0 (its vec_dots in ggml's one-chunk routine, rotated as upstream's)
         ("q6_0", "q6_1", True), ("q3_0", "q3_1", True), ("q2_0", "q2_1", False), ("q2_1", "q2_0", True)]


@pytest.mark.parametrize("seed", [0, 4, 5])
@pytest.mark.parametrize("kt,vt,rot", CASES)
def test_matches_ggml_reference(kt, vt, rot, seed, one_thread):
    g = np.random.default_rng(seed)
    H, Hkv, n_q, L, D = 4, 2, 5, 12, 64
    # outlier channels, as real K has: they make Q's rounding matter
    q = (g.standard_normal((H, n_q, D)) * np.where(np.arange(D) % 17 == 0, 6, 1)).astype(F32)
    k = (g.standard_normal((Hkv, L, D)) * np.where(np.arange(D) % 13 == 0, 5, 1)).astype(F32)
    v = g.standard_normal((Hkv, L, D)).astype(F32)
    mask = np.tril(np.ones((n_q, L), bool), L - n_q)
    mask[:, :2] &= np.arange(n_q)[:, None] % 2 == 0  # holes, like a sliding window
    scale = 0.125
    ref = _ref_attention(q, k, v, kt, vt, rot, scale, mask)
    got, path = _emulate(q, k, v, kt, vt, rot, scale, mask)
    assert path == "one_chunk"  # n_q < 64: even f16/f16 takes the one-chunk routine
    exact = _emulate(q, k, v, kt, vt, rot, scale, mask, "exact")
    kernel_effect = np.abs(ref - exact).max()
    err = np.abs(got - ref).max()
    assert kernel_effect > 1e-4, kernel_effect  # the kernel's arithmetic is visible at all
    assert err < kernel_effect / 50, (err, kernel_effect)
    if vt == "f16":
        # the f16 accumulator reproduced key by key: at most one f16 ulp of |out| apart
        assert err <= 2 * np.spacing(F16(np.abs(ref).max())), err


@pytest.mark.parametrize("kt", list(FORK_OFFSET))
def test_beellama_types_at_tail_0_on_beellamas_own_blocks(kt, one_thread):
    """K and V are the committed fixture's rows as BeeLlama's CPU cache wrote them
    (tests/fixtures/beellama, read back from its bytes, not from kvarn's quantizer), Q random; the
    reference is its vec_dot and to_float over those bytes in ggml's one-chunk routine."""
    from bench.oracles.beellama import quant_fields
    from bench.oracles.beellama import quant_oracle as QO

    x = QO.fixture_block_input()  # [8, 128]: 2 KV heads x 4 tokens x head dim 128
    raw = np.load(FIXTURE_NPZ)[f"block_{kt}"]
    codes, d16, m16 = quant_fields.beellama_block_fields(kt, raw)
    blocks = _fork_blocks(kt, codes, d16, m16)
    rows = [blocks[i * 4:(i + 1) * 4] for i in range(8)]
    Hkv, L, D, H, n_q = 2, 4, 128, 4, 3
    k = v = x.reshape(Hkv, L, D)
    g = np.random.default_rng(7)
    q = (g.standard_normal((H, n_q, D)) * np.where(np.arange(D) % 17 == 0, 6, 1)).astype(F32)
    mask = np.tril(np.ones((n_q, L), bool), L - n_q)
    scale = F32(0.0884)
    assert options.check_compute("llamacpp-cpu", kt, kt, 0) and not options.scalar_route("llamacpp-cpu", kt, kt, 0)
    ref = np.zeros((H, n_q, D), F32)
    vals = _fork_values(rows)
    for h in range(H):
        hk = h // (H // Hkv)
        for i in range(n_q):
            qb = _q8_row(q[h, i], options.VEC_DOT_TYPE[kt])
            M, S, acc = F32(-np.inf), F32(0), np.zeros(D, F32)
            for j in range(L):
                if not mask[i, j]:
                    continue
                sf = F32(0)
                for (ki, dk, mk), (qi, dq, sq) in zip(rows[hk * L + j], qb):
                    sf = F32(sf + F32(F32(dk) * F32(dq)) * F32(sum(a * b for a, b in zip(ki, qi))))
                    if mk is not None:
                        sf = F32(sf + F32(mk) * F32(sq))
                s = F32(sf * scale)
                ms, vs = F32(1), F32(1)
                if s > M:
                    ms = F32(np.exp(np.float64(M - s))) if M != -np.inf else F32(0)
                    M, acc = s, (acc * ms).astype(F32)
                else:
                    vs = F32(np.exp(np.float64(F32(s - M))))
                acc = (acc.astype(np.float64) + vals[hk * L + j].astype(np.float64) * vs).astype(F32)
                S = F32(S * ms + vs)
            ref[h, i] = acc / S
    got, path = _emulate(q, k, v, kt, kt, False, float(scale), mask)
    assert path == "one_chunk"
    exact = _emulate(q, k, v, kt, kt, False, float(scale), mask, "exact")
    kernel_effect = np.abs(ref - exact).max()
    assert kernel_effect > 1e-4, kernel_effect  # Q's q8 rounding is visible at all
    assert np.abs(got - ref).max() < kernel_effect / 50, (np.abs(got - ref).max(), kernel_effect)


def test_tiled_path_is_fp32_attention(one_thread):
    g = np.random.default_rng(3)
    H, Hkv, n_q, L, D = 2, 1, 64, 70, 64
    q = g.standard_normal((H, n_q, D)).astype(F32)
    k, v = g.standard_normal((2, Hkv, L, D)).astype(F32)
    mask = np.tril(np.ones((n_q, L), bool), L - n_q)
    got, path = _emulate(q, k, v, "f16", "f16", False, 0.125, mask)
    assert path == "tiled"
    exact = _emulate(q, k, v, "f16", "f16", False, 0.125, mask, "exact")
    np.testing.assert_allclose(got, exact, atol=2e-6)
    one, path = _emulate(q[:, :63], k, v, "f16", "f16", False, 0.125, mask[:63])
    assert path == "one_chunk" and np.abs(one - exact[:, :63]).max() > 1e-4


# --- llama.cpp's channel order of Q and K (llama arch) ----------------------------------------

def test_gguf_order_is_the_converters_permutation():
    # hand-worked, d = 8: GGUF position 2i+s holds HF dimension s*d/2+i
    assert channel_order.gguf_order(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    # transformers' GGUF loader undoes llama.cpp's converter permutation (LlamaTensorProcessor):
    # rows put in the GGUF order per head must come back in HF order
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    n_head, n_kv, d = 6, 2, 64
    w = np.arange(n_kv * d * 3, dtype=F32).reshape(n_kv * d, 3)  # k_proj rows, 3 inputs
    gguf_rows = torch.from_numpy(w).reshape(n_kv, d, 3)[:, channel_order.gguf_order(d)].reshape(n_kv * d, 3).numpy()
    proc = LlamaTensorProcessor(config={"num_attention_heads": n_head, "num_key_value_heads": n_kv})
    back = proc.process(gguf_rows, "blk.0.attn_k.weight").weights
    assert np.array_equal(back, w) and not np.array_equal(gguf_rows, w)
    assert channel_order.gguf_qk_permuted("llama") and not channel_order.gguf_qk_permuted("gemma3_text")
    with pytest.raises(ValueError, match="model_type 'olmo'.*not known"):
        channel_order.gguf_qk_permuted("olmo")


# On the worker of tests/test_models.py's group, which loads Gemma 3 (fetching it in a fresh clone,
# and so parsing its GGUF): these read the same GGUF, parsed once per process
# (kvarn.weights.gguf_file.reader: ~4.5 s of CPU for its 262k-token vocabulary).
GEMMA_GGUF = pytest.mark.xdist_group("models")


@pytest.mark.parametrize("model,model_type,permuted", [
    ("smollm2-135m", "llama", True),
    # a 262k-token vocabulary to parse, once per process (GEMMA_GGUF above)
    pytest.param("gemma3-270m", "gemma3_text", False, marks=[pytest.mark.slow, GEMMA_GGUF]),
])
def test_gguf_files_hold_qk_in_that_order(model, model_type, permuted, fetched):
    """The embedded GGUFs, written by llama.cpp's converter: attn_k/attn_q rows against the
    HF weights transformers' loader made of them (resources/models/<model>/hf)."""
    import json

    from safetensors import safe_open

    from kvarn.weights.gguf_file import reader, tensor

    d = fetched(model)
    hf = d / "hf" / "model.safetensors"
    ggufs = sorted(d.glob("*.gguf"))
    assert len(ggufs) == 1 and hf.is_file()
    cfg = json.loads((d / "hf" / "config.json").read_text())
    assert cfg["model_type"] == model_type and channel_order.gguf_qk_permuted(model_type) is permuted
    hd = cfg["head_dim"]
    tensors = {t.name: t for t in reader(ggufs[0]).tensors}
    with safe_open(str(hf), "pt") as f:
        for g, h in (("attn_k", "k_proj"), ("attn_q", "q_proj")):
            file_rows = tensor(tensors[f"blk.0.{g}.weight"])
            ours = f.get_tensor(f"model.layers.0.self_attn.{h}.weight").float()
            heads = ours.reshape(-1, hd, ours.shape[-1])
            gathered = heads[:, channel_order.gguf_order(hd)].reshape(ours.shape)
            assert torch.equal(file_rows, gathered if permuted else ours), (model, g)
            assert not torch.equal(file_rows, ours if permuted else gathered), (model, g)


@pytest.mark.parametrize("kt,rot", [("q4_0", False), ("q4_0", True), ("q5_1", False), ("q8_0", True)])
def test_llamacpp_cpu_quantizes_a_llama_models_k_in_gguf_order(kt, rot, one_thread):
    """A llama-arch cache: Q and K rotated and rounded in the GGUF order, as llama.cpp holds them."""
    from transformers import Gemma3TextConfig, LlamaConfig

    from kvarn.kvcache.cache import KVarnCache

    g = np.random.default_rng(7)
    H, Hkv, n_q, L, D = 4, 2, 5, 12, 64
    # real K: a few large channels, here in one half of the head (RoPE's low frequencies)
    q = (g.standard_normal((H, n_q, D)) * np.where(np.arange(D) % 32 > 26, 6, 1)).astype(F32)
    k = (g.standard_normal((Hkv, L, D)) * np.where(np.arange(D) % 32 > 26, 8, 1)).astype(F32)
    v = g.standard_normal((Hkv, L, D)).astype(F32)
    mask = np.tril(np.ones((n_q, L), bool), L - n_q)
    dims = dict(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
                num_hidden_layers=1, intermediate_size=32, vocab_size=32)
    cache = KVarnCache(LlamaConfig(**dims), CellSpec(kt, kt, 0, rot=rot, compute="llamacpp-cpu"))
    layer = cache.layers[0]
    assert layer.qk_gguf_order  # the path under test
    got, _ = _emulate(q, k, v, kt, kt, rot, 0.125, mask, layer=layer)
    idx = channel_order.gguf_order(D).numpy()
    in_gguf = _ref_attention(q[..., idx], k[..., idx], v, kt, kt, rot, 0.125, mask)
    in_hf = _ref_attention(q, k, v, kt, kt, rot, 0.125, mask)
    order_effect = np.abs(in_gguf - in_hf).max()
    assert order_effect > 1e-3, order_effect  # the order changes the result: the test can fail
    assert np.abs(got - in_gguf).max() < order_effect / 50
    # exact keeps transformers' order (DESIGN §6b's format damage); neox architectures are not permuted
    assert not KVarnCache(LlamaConfig(**dims), CellSpec(kt, kt, 0, rot=rot)).layers[0].qk_gguf_order
    gemma = KVarnCache(Gemma3TextConfig(**dims, sliding_window=8), CellSpec(kt, kt, 0, rot=rot, compute="llamacpp-cpu"))
    assert not any(getattr(la, "qk_gguf_order", True) for la in gemma.layers)


@pytest.mark.parametrize("rot", [False, True])
@pytest.mark.parametrize("kt,vt,tail", [("q4_0", "q4_0", 4), ("q8_0", "q4_1", 7), ("q3_0", "q6_0", 5)])
def test_beellama_tail_route_matches_its_reference(kt, vt, tail, rot, one_thread):
    """llamacpp-cpu with a tail is BeeLlama's `ggml_compute_forward_flash_attn_ext_tail_ref`
    (ggml/src/ggml-cpu/ops.cpp, v0.4.3): per query the body keys, then the tail's, each score a
    double-precision dot of the fp32 Q with K dequantized to fp32, one fp32 online softmax; the
    body's K rounded in the GGUF's channel order on a llama-arch model; the tail from bf16. With
    rot, llama.cpp rotates Q and K (64-blocks here, in the GGUF order) and V before the cache stores
    them (`llama-graph.cpp`), so body and tail are rounded in the rotated frame, and the output
    is rotated back."""
    from types import SimpleNamespace

    from gguf.quants import GGMLQuantizationType as QTYPE
    from transformers import LlamaConfig

    from kvarn.kvcache.attention import attention_ref
    from kvarn.kvcache.cache import KVarnCache

    g = np.random.default_rng(11)
    H, Hkv, n_q, L, D = 4, 2, 6, 14, 64
    q = (g.standard_normal((H, n_q, D)) * np.where(np.arange(D) % 32 > 26, 6, 1)).astype(F32)
    k = (g.standard_normal((Hkv, L, D)) * np.where(np.arange(D) % 32 > 26, 8, 1)).astype(F32)
    v = g.standard_normal((Hkv, L, D)).astype(F32)
    dims = dict(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
                num_hidden_layers=1, intermediate_size=32, vocab_size=32)
    cache = KVarnCache(LlamaConfig(**dims), CellSpec(kt, vt, tail, rot=rot, compute="llamacpp-cpu"))
    layer, policy = cache.layers[0], cache.policies[0]
    # the path under test: BeeLlama's scalar route, exact layers, K rounded in the GGUF order
    assert cache.scalar_route and layer.compute == "exact" and layer.qk_gguf_order and policy.tail == tail
    assert layer.exact_rotation == ({"k": 64, "v": 64} if rot else {"k": None, "v": None})
    kk, vv = torch.from_numpy(k)[None], torch.from_numpy(v)[None]
    layer.update(kk[:, :, :L - n_q], vv[:, :, :L - n_q])  # the earlier ubatch, then the queries' own
    keys, values = layer.update(kk[:, :, L - n_q:], vv[:, :, L - n_q:])
    mask = torch.from_numpy(np.tril(np.ones((n_q, L), bool), L - n_q))[None, None]
    got = attention_ref(SimpleNamespace(layer_idx=0), torch.from_numpy(q)[None], keys, values, mask, 0.125,
                        layer, policy)[0].transpose(0, 1).numpy()

    # The reference, from the C code. Rounding of the body: gguf-py's own quantizers where it has the
    # type, else kvarn's (the fork types, byte-exact to BeeLlama's: tests/test_beellama_oracle.py).
    def body(x, t):
        if hasattr(QTYPE, t.upper()):
            qt = getattr(QTYPE, t.upper())
            return dequantize(quantize(x, qt), qt).astype(F32)
        return make_format(t, "k", False, CellSpec.iters).roundtrip(torch.from_numpy(x)[None, None])[0, 0].numpy().astype(F32)

    idx = channel_order.gguf_order(D).numpy()
    ref = np.zeros((H, n_q, D), F32)
    for hk in range(Hkv):
        kg, vr = k[hk][:, idx], v[hk]  # K in the GGUF order
        if rot:
            kg, vr = _rot(kg, 64), _rot(vr, 64)
        kb, vb = body(kg, kt), body(vr, vt)
        kt16 = torch.from_numpy(kg).bfloat16().float().numpy()
        vt16 = torch.from_numpy(vr).bfloat16().float().numpy()
        for h in range(hk * (H // Hkv), (hk + 1) * (H // Hkv)):
            for i in range(n_q):
                p = L - n_q + i
                qg = _rot(q[h, i][idx][None], 64)[0] if rot else q[h, i][idx]
                order = [(kb, vb, j) for j in range(p + 1) if p - j >= tail] + \
                        [(kt16, vt16, j) for j in range(p + 1) if p - j < tail]
                M, S, acc = F32(-np.inf), F32(0), np.zeros(D, F32)
                for ks, vs, j in order:
                    s = F32(F32(np.dot(qg.astype(np.float64), ks[j].astype(np.float64))) * F32(0.125))
                    nm = max(M, s)
                    old = F32(0) if M == -np.inf else F32(np.exp(F32(M - nm)))
                    w = F32(np.exp(F32(s - nm)))
                    acc = (acc * old + vs[j] * w).astype(F32)
                    S, M = F32(S * old + w), nm
                ref[h, i] = acc / S
    if rot:
        ref = _rot(ref, 64)  # V's rotation undone on the output
    # the same route with K rounded in transformers' order (the exact path): the order is seen
    exact_cache = KVarnCache(LlamaConfig(**dims), CellSpec(kt, vt, tail, rot=rot))
    el = exact_cache.layers[0]
    el.update(kk[:, :, :L - n_q], vv[:, :, :L - n_q])
    ek, ev = el.update(kk[:, :, L - n_q:], vv[:, :, L - n_q:])
    in_hf = attention_ref(SimpleNamespace(layer_idx=0), torch.from_numpy(q)[None], ek, ev, mask, 0.125, el,
                          exact_cache.policies[0])[0].transpose(0, 1).numpy()
    order_effect = np.abs(in_hf - ref).max()
    assert order_effect > 1e-3, order_effect
    # fp32 sdpa against the C code's online softmax: summation order only (measured <= 4.3e-6)
    assert np.abs(got - ref).max() < 1e-5 < order_effect / 100, np.abs(got - ref).max()


def test_beellama_kvarn_route_refuses_what_beellama_refuses():
    from transformers import Gemma3TextConfig, LlamaConfig

    from kvarn.kvcache.cache import KVarnCache

    dims = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                intermediate_size=32, vocab_size=32)
    with pytest.raises(ValueError, match="head dim 64; BeeLlama's KVarN takes head dims 128, 256, 512 only"):
        KVarnCache(Gemma3TextConfig(**dims, head_dim=64, sliding_window=8), CellSpec("kvarn4", "kvarn4", 0,
                                                                                     compute="llamacpp-cpu"))
    with pytest.raises(ValueError, match="GGUF permutes Q/K channels"):
        KVarnCache(LlamaConfig(**dims, head_dim=128), CellSpec("kvarn4", "kvarn4", 0, compute="llamacpp-cpu"))
    ok = KVarnCache(Gemma3TextConfig(**dims, head_dim=128, sliding_window=8),
                    CellSpec("kvarn4", "kvarn4", 0, compute="llamacpp-cpu"))
    assert ok.scalar_route and {la.compute for la in ok.layers} == {"exact"}
    # kvarn's own KVarN takes head dim 64 on the exact path
    assert KVarnCache(Gemma3TextConfig(**dims, head_dim=64, sliding_window=8), CellSpec("kvarn4", "kvarn4", 0)).layers


def test_baseline_compute_must_match(tmp_path):
    from types import SimpleNamespace

    from kvarn.run.torch_engine import check_baseline_compute

    old = SimpleNamespace(header={}, path=tmp_path / "b.kvd")  # a dump from before the field: exact
    check_baseline_compute(old, "exact")
    with pytest.raises(ValueError, match="compute 'exact', this cell uses 'llamacpp-cpu'"):
        check_baseline_compute(old, "llamacpp-cpu")
    new = SimpleNamespace(header={"compute": "llamacpp-cpu", "compute_version": 2}, path=tmp_path / "b.kvd")
    with pytest.raises(ValueError, match="compute 'llamacpp-cpu', this cell uses 'exact'"):
        check_baseline_compute(new, "exact")
    check_baseline_compute(new, "llamacpp-cpu")
    # a llamacpp-cpu baseline from before the GELU table (no version: 1) is not mixed with today's cells
    stale = SimpleNamespace(header={"compute": "llamacpp-cpu"}, path=tmp_path / "b.kvd")
    with pytest.raises(ValueError, match="version 1, this kvarn emulates version 2"):
        check_baseline_compute(stale, "llamacpp-cpu")


# --- the real model (slow) ---------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_paths():
    from pathlib import Path

    from kvarn.baseline import data

    from kvarn.run import forward

    from kvarn.weights import models

    text = WIKI_TEXT
    lm = models.load(models.ModelSpec("smollm2-135m", "embedded:smollm2-135m"),
                     cache_dir=Path(__file__).resolve().parents[1] / "resources" / "models")
    lm.model.set_attn_implementation("kvarn")
    ctx = 256
    ids = data.make_chunks(data.tokenize(lm.tokenizer, data.load_text(str(text) if text.is_file() else None)),
                           ctx, 1, lm.info.bos_id)[0]

    def run(k, v, mode, ubatch=512):
        cache = forward.new_cache(lm.model, CellSpec(k, v, 0, compute=mode))
        lp = torch.cat([x for _, x in forward.chunk_logprobs(lm.model, ids, cache, ubatch, scoring.scored_positions(ctx))])
        return lp, {getattr(layer, "last_path", None) for layer in cache.layers}

    def kld(a, b):
        return (b.exp() * (b - a)).sum(-1).mean().item()

    f16_exact, _ = run("f16", "f16", "exact")
    f16_cpp, paths = run("f16", "f16", "llamacpp-cpu")
    assert paths == {"tiled"}  # ubatch 256 >= 64 rows
    bf16_exact, _ = run("bf16", "bf16", "exact")
    # the tiled path is fp32 attention: only fp32 summation order differs (measured 1.2e-7
    # mean KLD through 30 layers), far below what the f16 rounding itself costs
    assert kld(f16_cpp, f16_exact) < kld(f16_exact, bf16_exact) / 20
    bf16_cpp, paths = run("bf16", "bf16", "llamacpp-cpu")
    assert paths == {"one_chunk"}
    # Q rounded to bf16 in llama.cpp's baseline: visible, larger than the f16 rounding of K/V
    # (measured at ctx 256: mean KLD 4.8e-5 against 2.4e-5)
    assert kld(bf16_cpp, bf16_exact) > 1.5 * kld(f16_exact, bf16_exact)
    q8_cpp, paths = run("q8_0", "q8_0", "llamacpp-cpu", ubatch=128)
    assert paths == {"one_chunk"}
    q8_exact, _ = run("q8_0", "q8_0", "exact", ubatch=128)
    assert kld(q8_cpp, bf16_cpp) > kld(q8_exact, bf16_exact)


# --- activations of the weight matmuls ---------------------------------------------------

def test_round_activations_hand_worked(one_thread):
    # q8_0/q8_1: the 32-block codes times the fp16 d (values 127 and 2.5 in one block: d = 1)
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 127.0, 2.5
    assert activations.round_activations(x, "q8_1")[0, :3].tolist() == [127.0, 2.0, 0.0]
    # a block's d of 2 (254 its largest): 3.0 -> code round(1.5) = 2 -> 2 * d = 4; q8_0 rounds alike
    x[0, 0], x[0, 1] = 254.0, 3.0
    for kind in ("q8_0", "q8_1"):
        assert activations.round_activations(x, kind)[0, :3].tolist() == [254.0, 4.0, 0.0], kind
    # q8_K: 256-blocks, iscale = -127/vmax (signed), fp32 d = 1/iscale
    x = torch.zeros(1, 256)
    x[0, 0], x[0, 5] = -254.0, 3.0  # vmax -254: iscale 0.5, 3.0 -> round(1.5) = 2 -> 2/0.5 = 4
    y = activations.round_activations(x, "q8_K")
    assert y[0, 0].item() == -254.0 and y[0, 5].item() == 4.0
    assert activations.round_activations(torch.tensor([1.00390625]), "bf16").item() == 1.0
    assert activations.round_activations(x, None) is x
    with pytest.raises(ValueError, match="'q4_0'"):
        activations.round_activations(x, "q4_0")


def test_a_weight_type_llamacpp_cpu_does_not_know_is_refused_by_name(tmp_path):
    # a GGUF whose first matmul weight is IQ2_XXS (no activation rule here): the file, the tensor, its
    # type and every type that has one are named
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 66), dtype=np.uint8), raw_dtype=QT.IQ2_XXS)  # 66 bytes per 256
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32))
    known = "Q4_0, Q5_0, Q8_0, IQ4_NL, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16, BF16, F32"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: blk\.0\.attn_q\.weight has type IQ2_XXS; "
                                         rf"llamacpp-cpu knows {known}$"):
        activations.set_activation_rounding(model, path, True)


@pytest.mark.slow
def test_activation_rounding_follows_the_gguf_types():
    from collections import Counter
    from pathlib import Path

    from kvarn.weights import models

    root = Path(__file__).resolve().parents[1] / "resources" / "models"
    lm = models.load(models.ModelSpec("smollm2-135m", "embedded:smollm2-135m"), cache_dir=root)
    gguf = next((root / "smollm2-135m").glob("*.gguf"))
    # off, or without GGUF weights: nothing installed
    assert activations.set_activation_rounding(lm.model, gguf, False) is None
    assert activations.set_activation_rounding(lm.model, None, True) is None
    hooked = activations.set_activation_rounding(lm.model, gguf, True)  # installs the hooks, once
    # 30 layers x 7 Q4_1 matmuls (q8_1 activations) + the tied Q8_0 token_embd as lm_head (q8_0)
    assert Counter(hooked.values()) == {"q8_1": 210, "q8_0": 1} and hooked["lm_head"] == "q8_0"
    lin = lm.model.model.layers[0].self_attn.q_proj
    n_hooks = len(lin._forward_pre_hooks)
    assert activations.set_activation_rounding(lm.model, gguf, True) is hooked and len(lin._forward_pre_hooks) == n_hooks
    seen = []
    lin.register_forward_pre_hook(lambda m, a: seen.append(a[0]))  # runs after the rounding hook
    x = torch.randn(1, 3, lin.in_features)
    lin(x)
    assert torch.equal(seen[0], activations.round_activations(x, "q8_1")) and not torch.equal(seen[0], x)
    # switched off for an exact run on the same (shared) model, on again for llamacpp-cpu
    activations.set_activation_rounding(lm.model, None, False)
    lin(x)
    assert torch.equal(seen[1], x)
    activations.set_activation_rounding(lm.model, next((root / "smollm2-135m").glob("*.gguf")), True)
    lin(x)
    assert torch.equal(seen[2], seen[0])


def test_q8_blocks_and_channel_order_at_their_edges():
    # a block whose largest |x| is exactly 1: id = 127, codes round(127 x)
    x = torch.zeros(32)
    x[0], x[1], x[2] = 1.0, -0.5, 0.25
    q, d, _ = q8.quantize_q8(x, "q8_0")
    assert q[:3].tolist() == [127.0, -64.0, 32.0] and d.tolist() == [torch.tensor(1 / 127).half().item()]
    with pytest.raises(ValueError, match=r"^Q block type 'q4_0'; accepted: q8_0, q8_1$"):
        q8.quantize_q8(x, "q4_0")
    assert channel_order.gguf_order(6).tolist() == [0, 3, 1, 4, 2, 5]
    with pytest.raises(ValueError, match=r"^head dim 5 is odd; the GGUF Q/K order pairs channels i and i \+ d/2$"):
        channel_order.gguf_order(5)
    with pytest.raises(ValueError, match="is not known for it; known: " + ", ".join(channel_order.GGUF_QK_PERMUTED) + "$"):
        channel_order.gguf_qk_permuted("phi3")


def test_ggml_gelu_f16_hand_worked():
    # x = 1: fp16(1) = 1, gelu_tanh(1) = 0.8411920..., the fp16 table holds 1723 * 2^-11
    assert activations.ggml_gelu_f16(torch.tensor([1.0])).item() == 1723 * 2.0**-11
    # the input is rounded to fp16 first: 0.1 and 0.09999 share the entry of fp16 0.0999755859375 (ulp 2^-14)
    a, b, c = activations.ggml_gelu_f16(torch.tensor([0.1, 0.09999, 0.10003])).tolist()
    assert a == b and c != a
    # the clamps: 0 at or below -10, x itself at or above 10 (not rounded)
    assert activations.ggml_gelu_f16(torch.tensor([-10.0, -12.0, 10.5, 12.345])).tolist() == \
        [0.0, 0.0, 10.5, pytest.approx(12.345, abs=0, rel=1e-7)]


def test_ggml_gelu_f16_against_float64():
    # independent: torch's tanh GELU in float64 on the fp16-rounded input, rounded to fp16
    x = torch.linspace(-9.99, 9.99, 20001)
    ref = torch.nn.functional.gelu(x.half().double(), approximate="tanh").half().float()
    got = activations.ggml_gelu_f16(x)
    normal = ref.abs() >= 2.0**-14  # where fp16 has full precision
    ulp = (ref.half().view(torch.int16).int() - got.half().view(torch.int16).int()).abs()
    # one ulp at most, on ~1 % of points: fp32's 1 + tanh cancels on the left tail, float64's does not
    assert int(ulp[normal].max()) <= 1 and float((got != ref)[normal].float().mean()) < 0.02
    # far left (x < -5.3) fp32's tanh is exactly -1, float64's is not: both are 0 to 2e-7
    assert float((got - ref)[~normal].abs().max()) <= 2e-7 and int((~normal).sum()) > 0
    assert not torch.equal(got, torch.nn.functional.gelu(x, approximate="tanh"))  # it does round


@pytest.mark.slow
@GEMMA_GGUF
def test_gemma_gelu_follows_ggml():
    from pathlib import Path

    from kvarn.weights import models

    root = Path(__file__).resolve().parents[1] / "resources" / "models"
    lm = models.load(models.ModelSpec("gemma3-270m", "embedded:gemma3-270m"), cache_dir=root)
    gguf_path = next((root / "gemma3-270m").glob("*.gguf"))
    hooked = activations.install_activation_rounding(lm.model, gguf_path)
    n_layers = lm.model.config.get_text_config().num_hidden_layers
    gelus = [name for name, kind in hooked.items() if kind == "gelu_f16"]
    assert len(gelus) == n_layers  # one GEGLU per layer's MLP
    act = lm.model.model.layers[0].mlp.act_fn
    x = torch.randn(2, 5, 64) * 3
    assert torch.equal(act(x), activations.ggml_gelu_f16(x))
    activations.set_activation_rounding(lm.model, None, False)  # exact: transformers' GELU again
    assert torch.equal(act(x), torch.nn.functional.gelu(x, approximate="tanh"))
