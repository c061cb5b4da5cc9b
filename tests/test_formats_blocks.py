"""llama.cpp block types (kvarn/formats/blocks.py) against independent oracles.

Oracles: the gguf package's numpy quantizers (upstream types, bytes and values), blocks
worked out by hand from DESIGN §3, and a scalar per-block reference written here from the
DESIGN §3 rules (one value at a time, python-int bit packing) for the types gguf lacks.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvarn.formats import get_format, names
from kvarn.formats.hadamard import k_rotation_block, rotate_blocks
from ties import tie_blocks, tie_count

GT = gguf.GGMLQuantizationType
UPSTREAM = {"q8_0": GT.Q8_0, "q5_1": GT.Q5_1, "q5_0": GT.Q5_0, "q4_1": GT.Q4_1, "q4_0": GT.Q4_0}
BYTES_PER_32 = {
    "q8_0": 34, "q6_0": 26, "q5_1": 24, "q5_0": 22, "q4_1": 20, "q4_0": 18,
    "iq4_nl": 18, "q3_0": 14, "q2_0": 10, "q6_1": 28, "q3_1": 16, "q2_1": 12,
}  # fmt: skip
BLOCK_TYPES = list(BYTES_PER_32)
IQ4NL = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def kv_like(seed: int, shape, outliers: bool = True, ch_scale: float = 50.0) -> torch.Tensor:
    """Gaussian K/V rows with three outlier channels (×ch_scale) and a ×20 token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if outliers:
        d = shape[-1]
        ch = torch.randperm(d, generator=g)[:3]
        x[..., ch] *= ch_scale
        x[..., shape[-2] // 2, :] *= 20
    return x


def one_block(vals) -> torch.Tensor:
    """A single token of 32 values (zeros after `vals`)."""
    x = torch.zeros(1, 32)
    x[0, : len(vals)] = torch.tensor(vals, dtype=torch.float32)
    return x


def f16_bytes(v: float) -> bytes:
    return np.float16(v).tobytes()


def lsb_stream(codes, bits: int) -> bytes:
    acc = 0
    for j, c in enumerate(codes):
        acc |= int(c) << (j * bits)
    return acc.to_bytes(len(codes) * bits // 8, "little")


# --- registry and sizes ------------------------------------------------------------------
def test_all_block_types_registered_with_their_sizes():
    for name, nb in BYTES_PER_32.items():
        assert name in names()
        for role in ("k", "v"):
            fmt = get_format(name, role=role)
            assert fmt.family == "block" and fmt.group == 1 and fmt.rot is True
            assert fmt.nbytes(1, 32) == nb
            assert fmt.nbytes(7, 256) == 7 * 8 * nb
            assert fmt.bits_per_value(128) == nb * 8 / 32
    assert get_format("q4_0", rot=False).rot is False


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_roundtrip_equals_decode_encode_bit_for_bit(name):
    for role, rot in (("k", True), ("v", True), ("k", False)):
        fmt = get_format(name, role=role, rot=rot)
        for d in (64, 256):
            x = kv_like(d + rot, (2, 3, 17, d))
            p = fmt.encode(x)
            assert p.data.dtype == torch.uint8
            assert p.data.shape == (2, 3, fmt.nbytes(17, d))
            y = fmt.decode(p)
            assert y.dtype == torch.float32 and y.shape == x.shape
            assert torch.equal(fmt.roundtrip(x), y)


# --- gguf oracle (upstream types) ------------------------------------------------------
@pytest.mark.parametrize("name", list(UPSTREAM))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_upstream_bytes_and_values_match_gguf(name, head_dim):
    fmt = get_format(name, rot=False)
    for seed in range(3):
        x = kv_like(seed, (2, 24, head_dim))
        ref = gguf.quants.quantize(x.numpy().reshape(-1, head_dim), UPSTREAM[name])
        p = fmt.encode(x)
        assert np.array_equal(p.data.numpy().reshape(ref.shape), ref)
        ref_val = gguf.quants.dequantize(ref, UPSTREAM[name]).reshape(x.shape)
        assert np.array_equal(fmt.decode(p).numpy(), ref_val)
        assert np.array_equal(fmt.roundtrip(x).numpy(), ref_val)


@pytest.mark.parametrize("name", list(UPSTREAM))
def test_upstream_rounding_ties_match_gguf(name):
    # Random data never sits on a tie: here nearly every value does (tests/ties.py), so
    # rounding half to even where ggml's reference rounds half away (or truncates
    # x/d + 1/2) gives other bytes.
    x = tie_blocks(name, 96, seed=len(name))
    assert tie_count(name, x) >= 96 * 30  # the ties are there
    x = torch.from_numpy(x).reshape(24, 128)
    fmt = get_format(name, rot=False)
    ref = gguf.quants.quantize(x.numpy(), UPSTREAM[name])
    p = fmt.encode(x)
    assert np.array_equal(p.data.numpy().reshape(ref.shape), ref)
    assert np.array_equal(fmt.roundtrip(x).numpy(), gguf.quants.dequantize(ref, UPSTREAM[name]).reshape(x.shape))


@pytest.mark.parametrize("name", list(UPSTREAM) + ["iq4_nl"])
def test_decode_of_arbitrary_bytes_matches_gguf_dequantize(name):
    """Checks the unpacking layout independently of our encoder."""
    fmt = get_format(name, rot=False)
    nb = BYTES_PER_32[name]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(40, nb), dtype=np.uint8)
    scales = rng.uniform(-2, 2, size=(40, 2)).astype(np.float16)
    blocks[:, 0:2] = scales[:, :1].view(np.uint8)
    if name in ("q5_1", "q4_1"):
        blocks[:, 2:4] = scales[:, 1:].view(np.uint8)
    ref = gguf.quants.dequantize(blocks, GT[name.upper()]).reshape(10, 128)
    from kvarn.formats.base import Packed

    got = fmt.decode(Packed(torch.from_numpy(blocks.reshape(-1)), 10, 128))
    assert np.array_equal(got.numpy(), ref)


def test_iq4_nl_decode_of_own_encoding_matches_gguf():
    fmt = get_format("iq4_nl", rot=False)
    for d in (64, 128, 256):
        x = kv_like(d, (16, d))
        p = fmt.encode(x)
        ref = gguf.quants.dequantize(p.data.numpy().reshape(-1, 18), GT.IQ4_NL).reshape(x.shape)
        assert np.array_equal(fmt.decode(p).numpy(), ref)


# --- hand-worked blocks (DESIGN §3 rules, worked out on paper) ------------------------------
def test_q8_0_hand_block_rounds_half_away_from_zero():
    # amax 127 -> d = 1, id = 1; roundf: 2.5 -> 3, -2.5 -> -3, 0.49999997 -> 0 (not 1), -0.5 -> -1
    x = one_block([127.0, 2.5, -2.5, 0.49999997, -0.5, 1.5, -126.6])
    codes = [127, 3, -3, 0, -1, 2, -127] + [0] * 25
    p = get_format("q8_0", rot=False).encode(x)
    assert p.data.numpy().tobytes() == f16_bytes(1.0) + np.array(codes, np.int8).tobytes()


def test_q3_0_hand_block():
    # vmax = 4 -> d = 4/-4 = -1, id = -1; q = min(7, floor(-x + 4.5)); value (q-4)*d
    x = one_block([4.0, -2.0, 1.0, 0.5, -1.0, 3.0, -3.5, 1.5, -0.5])
    codes = [0, 6, 3, 4, 5, 1, 7, 3, 5] + [4] * 23  # -3.5 -> 8 clamps to 7; 1.5 (x/d=-1.5) -> 3
    values = [4.0, -2.0, 1.0, 0.0, -1.0, 3.0, -3.0, 1.0, -1.0] + [0.0] * 23
    fmt = get_format("q3_0", rot=False)
    p = fmt.encode(x)
    assert p.data.numpy().tobytes() == f16_bytes(-1.0) + lsb_stream(codes, 3)
    assert fmt.decode(p)[0].tolist() == values


def test_q2_0_hand_block():
    # vmax = -2 -> d = -2/-2 = 1, id = 1; q = min(3, floor(x + 2.5)); value (q-2)*d
    x = one_block([-2.0, 1.0, 1.5, 0.5, -0.5, -1.5, 0.3, -1.0])
    codes = [0, 3, 3, 3, 2, 1, 2, 1] + [2] * 24  # 1.5 -> 4 clamps to 3; ties 0.5, -0.5, -1.5 go up
    values = [-2.0, 1.0, 1.0, 1.0, 0.0, -1.0, 0.0, -1.0] + [0.0] * 24
    fmt = get_format("q2_0", rot=False)
    p = fmt.encode(x)
    assert p.data.numpy().tobytes() == f16_bytes(1.0) + lsb_stream(codes, 2)
    assert fmt.decode(p)[0].tolist() == values


def test_q6_0_hand_block_with_refit():
    # vmax = 32 -> d0 = -1, id = -1; q = min(63, floor(-x + 32.5)):
    #   32 -> 0 (l = -32); 20.4 -> floor(12.1) = 12 (l = -20), 31 times.
    # refit, w = x²: sumqx = Σ w·l·x = -(32^4 + 31·20·20.4^3) = -6312167.68
    #                sumq2 = Σ w·l²  = 32^4 + 31·20.4²·400     =  6208960
    #   d = -1.0166225…; fp16: 1 + 17/1024 (0.0166225·1024 = 17.02) -> -1.0166015625
    x = one_block([32.0] + [20.4] * 31)
    codes = [0] + [12] * 31
    d16 = -1.0166015625
    fmt = get_format("q6_0", rot=False)
    p = fmt.encode(x)
    assert p.data.numpy().tobytes() == f16_bytes(d16) + lsb_stream(codes, 6)
    assert fmt.decode(p)[0].tolist() == [-32 * d16] + [-20 * d16] * 31


def test_iq4_nl_hand_block_with_refit():
    # vmax = -127 -> d0 = 1, id = 1: x itself picks the nearest level, ties to the upper one:
    #   -127 -> 0; 7 (6 from 1, 6 from 13) -> 9 (13); 100 -> 14 (89); 0 -> 8 (1, nearer than -10)
    # refit, w = x²: sumqx = 127^4 + 49·13·7 + 10^4·89·100 = 349149100
    #                sumq2 = 127^4 + 49·169  + 10^4·7921    = 339362922
    #   d = 1.028837…; fp16: 1 + 30/1024 (0.028837·1024 = 29.53) = 1.029296875
    x = one_block([-127.0, 7.0, 100.0])
    idx = [0, 9, 14] + [8] * 29
    d16 = 1.029296875
    fmt = get_format("iq4_nl", rot=False)
    p = fmt.encode(x)
    nibbles = bytes(idx[j] | (idx[j + 16] << 4) for j in range(16))
    assert p.data.numpy().tobytes() == f16_bytes(d16) + nibbles
    assert fmt.decode(p)[0].tolist() == [IQ4NL[i] * d16 for i in idx]  # zeros read back as d·1


def test_q3_1_hand_block():
    # min -1, max 6 -> d = 7/7 = 1, m = -1; q = min(7, floor(x + 1 + 0.5))
    x = one_block([-1.0, 6.0, 0.5, 2.4, 2.6] + [1.0] * 27)
    codes = [0, 7, 2, 3, 4] + [2] * 27  # 0.5 -> 1.5+.5 = 2; 2.4 -> 3.9 -> 3; 2.6 -> 4.1 -> 4
    fmt = get_format("q3_1", rot=False)
    p = fmt.encode(x)
    assert p.data.numpy().tobytes() == f16_bytes(1.0) + f16_bytes(-1.0) + lsb_stream(codes, 3)
    assert fmt.decode(p)[0].tolist() == [c - 1.0 for c in codes]


ZERO_CODE = {"q8_0": 0, "q6_0": 32, "q5_0": 16, "q4_0": 8, "iq4_nl": 8, "q3_0": 4, "q2_0": 2}


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_zero_block_is_zero_code_and_decodes_to_exact_zero(name):
    fmt = get_format(name, rot=False)
    x = torch.zeros(3, 64)
    p = fmt.encode(x)
    zc = ZERO_CODE.get(name, 0)  # asymmetric types: d = 0, m = 0, code 0
    blocks = p.data.reshape(-1, BYTES_PER_32[name]).numpy()
    spec_bits = 4 if name == "iq4_nl" else int(name[1])
    nscale = 4 if name.endswith("_1") else 2
    assert (blocks[:, :nscale].copy().view(np.float16) == 0).all()  # ±0: ggml's d = 0.0/-8 is -0.0
    assert np.array_equal(unpack_codes(name, blocks[0], spec_bits, nscale), [zc] * 32)
    y = fmt.decode(p)
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.equal(fmt.roundtrip(x), y)


def unpack_codes(name, block: np.ndarray, bits: int, nscale: int) -> list[int]:
    body = block[nscale:].tobytes()
    if name == "q8_0":
        return list(np.frombuffer(body, np.int8))
    if name in ("q5_0", "q5_1"):
        qh = int.from_bytes(body[:4], "little")
        lo = [body[4 + j % 16] >> (4 * (j // 16)) & 15 for j in range(32)]
        return [lo[j] | ((qh >> j) & 1) << 4 for j in range(32)]
    if name in ("q4_0", "q4_1", "iq4_nl"):
        return [body[j % 16] >> (4 * (j // 16)) & 15 for j in range(32)]
    acc = int.from_bytes(body, "little")
    return [(acc >> (j * bits)) & ((1 << bits) - 1) for j in range(32)]


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_constant_block(name):
    fmt = get_format(name, rot=False)
    for c in (3.0, -0.75):
        y = fmt.roundtrip(torch.full((2, 64), c))
        if name in ("q8_0", "iq4_nl"):  # c = 127·fp16(c/127): off by at most the fp16 rounding of d
            assert torch.allclose(y, torch.full_like(y, c), rtol=2**-11, atol=0)
        else:  # symmetric: d = c/-half is exact in fp16; asymmetric: d = 0, m = c
            assert torch.equal(y, torch.full_like(y, c))


# --- scalar reference for the types gguf lacks ------------------------------------------
def ref_block(name: str, x: np.ndarray):
    """DESIGN §3, one value at a time in float32 (refit sums in float64). Returns codes, d, m."""
    f = np.float32
    bits = 4 if name == "iq4_nl" else int(name[1])
    nlev = 1 << bits
    with np.errstate(divide="ignore"):
        if name.endswith("_1"):
            mn, mx = f(x.min()), f(x.max())
            d = f(f(mx - mn) / f(nlev - 1))
            idv = f(0) if d == 0 else f(f(1) / d)
            q = [min(nlev - 1, int(np.floor(f(f(f(v - mn) * idv) + f(0.5))))) for v in x]
            return q, d, mn
        vmax = f(x[int(np.argmax(np.abs(x)))])
        if name == "iq4_nl":
            d = f(vmax / f(-127))
            idv = f(0) if d == 0 else f(f(1) / d)
            q = []
            for v in x:
                a = f(v * idv)
                dist = [abs(float(f(a - f(lv)))) for lv in IQ4NL]
                best = min(range(16), key=lambda i: (dist[i], -i))  # nearest, ties to the upper level
                q.append(best)
            lv = np.array([IQ4NL[i] for i in q], np.float64)
        else:
            half = nlev // 2
            d = f(vmax / f(-half))
            idv = f(0) if d == 0 else f(f(1) / d)
            q = [min(nlev - 1, int(np.floor(f(f(v * idv) + f(half + 0.5))))) for v in x]
            if name != "q6_0":
                return q, d, None
            lv = np.array(q, np.float64) - half
        w = x.astype(np.float64) ** 2
        sumq2 = float((w * lv * lv).sum())
        if sumq2 > 0:
            d = f(float((w * lv * x).sum()) / sumq2)
        return q, d, None


@pytest.mark.parametrize("name", ["q6_0", "q3_0", "q2_0", "q6_1", "q3_1", "q2_1", "iq4_nl"])
def test_matches_scalar_reference(name):
    fmt = get_format(name, rot=False)
    x = kv_like(7, (6, 128)).numpy()
    x[0, :32] = 0.0  # a zero block
    x[1, 32:64] = 1.25  # a constant block
    data = fmt.encode(torch.from_numpy(x)).data.numpy().reshape(-1, BYTES_PER_32[name])
    nscale = 4 if name.endswith("_1") else 2
    bits = 4 if name == "iq4_nl" else int(name[1])
    for blk, xb in zip(data, x.reshape(-1, 32)):
        q, d, m = ref_block(name, xb)
        assert unpack_codes(name, blk, bits, nscale) == q
        d_got = blk[:2].view(np.float16)[0]
        if name in ("q6_0", "iq4_nl"):  # fp32 vs float64 sums: allow one fp16 ulp on the refit d
            assert abs(int(blk[:2].view(np.int16)[0]) - int(np.float16(d).view(np.int16))) <= 1
        else:
            assert d_got == np.float16(d)
        if m is not None:
            assert blk[2:4].view(np.float16)[0] == np.float16(m)


# --- rotation -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["q8_0", "q4_0", "iq4_nl", "q3_1"])
def test_rotated_roundtrip_is_rotate_of_unrotated_roundtrip(name):
    for d in (64, 128, 256):
        x = kv_like(d, (2, 9, d))
        for role, block in (("k", k_rotation_block(d)), ("v", 64)):
            plain = get_format(name, role=role, rot=False)
            want = rotate_blocks(plain.roundtrip(rotate_blocks(x, block)), block)
            fmt = get_format(name, role=role, rot=True)
            assert torch.equal(fmt.roundtrip(x), want)
            assert torch.equal(fmt.decode(fmt.encode(x)), want)


def rel_err(fmt, x):
    return ((fmt.roundtrip(x) - x).pow(2).sum() / x.pow(2).sum()).item()


def test_error_ordering_on_gaussian_data():
    x = kv_like(3, (64, 128), outliers=False)
    for rot in (False, True):
        errs = [rel_err(get_format(n, rot=rot), x) for n in ("q8_0", "q6_0", "q5_0", "q4_0", "q3_0", "q2_0")]
        assert errs == sorted(errs) and len(set(errs)) == len(errs), errs
        assert errs[0] < 1e-4  # q8_0 is close to lossless


def test_rotation_helps_q4_0_on_outlier_channels():
    # three ×10 channels: unrotated, a block holding one gets a scale ~10× too coarse for its
    # other 31 values; the Hadamard spreads the outlier over the rotation block instead
    x = kv_like(5, (64, 128), ch_scale=10.0)
    for role in ("k", "v"):
        on, off = rel_err(get_format("q4_0", role=role), x), rel_err(get_format("q4_0", role=role, rot=False), x)
        assert on < 0.7 * off, (role, on, off)


# --- errors -----------------------------------------------------------------------------------
def test_unknown_name_is_named():
    with pytest.raises(ValueError, match="q4_2"):
        get_format("q4_2")


def test_bad_head_dims_are_named():
    with pytest.raises(ValueError, match="head dim 48"):
        get_format("q4_0", role="k").encode(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="head dim 96"):
        get_format("q4_0", role="v").encode(torch.zeros(2, 96))
    with pytest.raises(ValueError, match="head dim 40"):
        get_format("q8_0", rot=False).roundtrip(torch.zeros(2, 40))
    assert get_format("q4_0", role="v", rot=False).roundtrip(torch.zeros(2, 96)).shape == (2, 96)
    assert get_format("q4_0", role="k").roundtrip(torch.zeros(2, 192)).shape == (2, 192)  # K block 64


def test_non_finite_and_wrong_dtype_rejected():
    x = torch.zeros(2, 64)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="nan"):
        get_format("q4_0").encode(x)
    x[1, 3] = float("inf")
    with pytest.raises(ValueError, match="inf"):
        get_format("q2_0").roundtrip(x)
    with pytest.raises(TypeError, match="float16"):
        get_format("q8_0").encode(torch.zeros(2, 64, dtype=torch.float16))


def test_tied_abs_max_takes_the_first_as_ggml():
    # ggml scans `if (amax < |v|)`: of -3 and +3 the first wins, which sets the sign of d
    for vals, d in (([-3.0, 3.0, 1.0], 0.375), ([3.0, -3.0, 1.0], -0.375)):
        x = one_block(vals)
        p = get_format("q4_0", rot=False).encode(x)
        assert p.data.numpy().tobytes()[:2] == f16_bytes(d)
        assert np.array_equal(p.data.numpy().reshape(1, -1), gguf.quants.quantize(x.numpy(), GT.Q4_0))


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_subnormal_block_reads_back_zero(name):
    # |vmax| ~1e-39 makes 1/d overflow (ggml: undefined codes); we store the zero code
    fmt = get_format(name, rot=False)
    x = one_block([1e-39, -5e-40, 2e-40])
    y = fmt.roundtrip(x)
    assert torch.equal(y, fmt.decode(fmt.encode(x)))
    assert y.abs().max().item() <= 1e-39
