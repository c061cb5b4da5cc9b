"""KVarN reference (kvarn/formats/kvarn_type.py, kvarn_tiles.py) against DESIGN §4.

Tolerances are derived from fp32/fp16 rounding of the values at hand, not picked.
"""

import math

import pytest
import torch

from kvarn.formats import get_format
from kvarn.formats import kvarn_tiles, kvarn_type
from kvarn.formats.hadamard import hadamard

F32_EPS = 2.0**-24  # unit roundoff of fp32


pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _outlier_tile(rows=128, cols=128, seed=0):
    """A rotated-frame-like tile with a few huge columns and rows, as K/V have."""
    t = torch.randn(rows, cols, generator=_gen(seed))
    t[:, 3] *= 40.0
    t[:, 17] *= 9.0
    t[5, :] *= 25.0
    t[40, :] *= 0.02
    return t


# --- Hadamard -------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_hadamard_symmetric_orthonormal(d):
    h = hadamard(d, dtype=torch.float64)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.all(h.abs() == 1 / math.sqrt(d))


# --- normalization --------------------------------------------------------------
def test_normalization_lowers_imbalance_on_outliers():
    t = _outlier_tile()
    raw = kvarn_tiles.imbalance(kvarn_tiles.sample_std(t, -2), kvarn_tiles.sample_std(t, -1))
    a, b = kvarn_tiles.normalize_ref(t, 16)
    y = kvarn_tiles.scaled(t, a, b)
    norm = kvarn_tiles.imbalance(kvarn_tiles.sample_std(y, -2), kvarn_tiles.sample_std(y, -1))
    assert raw > 100  # the data really is imbalanced
    assert norm < 0.15 * raw  # rows/cols below e^-0.3 of the rest cannot be scaled up (clamp)


def _normalize_f64(x, iters):
    """DESIGN §4.3 written out with loops in float64 (an independent oracle)."""
    rows, cols = len(x), len(x[0])

    def std(v):
        m = sum(v) / len(v)
        return math.sqrt(sum((e - m) ** 2 for e in v) / (len(v) - 1))

    def y_of(a, b):
        return [[x[i][j] / (math.exp(b[i]) * math.exp(a[j])) for j in range(cols)] for i in range(rows)]

    def col_std(y):
        return [std([y[i][j] for i in range(rows)]) for j in range(cols)]

    def row_std(y):
        return [std(y[i]) for i in range(rows)]

    def imb(sc, sr):
        return max(sc) / max(min(sc), 1e-8) + max(sr) / max(min(sr), 1e-8)

    def upd(s, sd):
        return [min(max(si + math.log(min(max(d, 1e-3), 1e3)), -0.3), 10.0) for si, d in zip(s, sd)]

    a, b = [0.0] * cols, [0.0] * rows
    sc, sr = col_std(x), row_std(x)
    best, best_ab, best_pass = imb(sc, sr), (a, b), 0
    for p in range(1, iters + 1):
        a = upd(a, sc)
        b = upd(b, row_std(y_of(a, b)))
        y = y_of(a, b)
        sc, sr = col_std(y), row_std(y)
        cur = imb(sc, sr)
        if cur <= best:
            best, best_ab, best_pass = cur, (a, b), p
    return best_ab, best_pass


@pytest.mark.parametrize("iters", [1, 3, 8])
def test_normalization_matches_float64_oracle(iters):
    t = torch.randn(5, 7, generator=_gen(3)) * torch.tensor([1, 8, 0.5, 3, 1, 20, 2.0])
    t[2] *= 6
    (a64, b64), best_pass = _normalize_f64(t.double().tolist(), iters)
    a, b = kvarn_tiles.normalize_ref(t, iters)
    # fp32 vs fp64: a few ulps of ln(std) per pass, accumulated over the passes
    tol = 64 * F32_EPS * (iters + 1) * 10
    assert torch.allclose(a.double(), torch.tensor(a64, dtype=torch.float64), atol=tol, rtol=0)
    assert torch.allclose(b.double(), torch.tensor(b64, dtype=torch.float64), atol=tol, rtol=0)
    if iters == 8:
        assert best_pass > 0  # the oracle did pick a scaled pass, so this checks something


def test_ties_go_to_the_later_pass():
    """A constant tile has imbalance 0 in every pass (all stds 0): the last pass wins,
    whose log-scales sit at the -0.3 clamp; with 'strictly lower wins' they would be 0."""
    t = torch.full((64, 128), 2.5)
    a, b = kvarn_tiles.normalize_ref(t, 4)
    assert torch.equal(a, torch.full((128,), -0.3)) and torch.equal(b, torch.full((64,), -0.3))


def test_normalization_zero_iters_is_identity():
    t = _outlier_tile(64, 128)
    a, b = kvarn_tiles.normalize_ref(t, 0)
    assert torch.equal(a, torch.zeros(128)) and torch.equal(b, torch.zeros(64))


# --- RTN error bounds -------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_rtn_error_within_half_step(bits):
    t = _outlier_tile(seed=bits)
    a, b = kvarn_tiles.normalize_ref(t)
    y = kvarn_tiles.scaled(t, a, b)
    q, lo, step = kvarn_tiles.quantize_rows(y, bits)
    yhat = q.double() * step.double()[:, None] + lo.double()[:, None]
    err = (y.double() - yhat).abs()
    # v = fl(fl(y - lo) / step) carries <= 2 roundings relative to v <= 2^b - 1,
    # i.e. <= (hi - lo) * 2 * eps in y units.
    slack = (y.amax(-1) - y.amin(-1)).double() * 2 * F32_EPS
    assert torch.all(err <= (step.double() / 2 + slack)[:, None])
    assert q.min() == 0 and q.max() == 2**bits - 1


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_decode_error_with_fp16_metadata_slack(bits):
    """Rotated-frame decode error <= step/2 (scaled back) + the fp16 metadata rounding,
    the latter computed from the stored metadata against the fp32 values it rounds."""
    t = _outlier_tile(seed=10 + bits)
    a, b = kvarn_tiles.normalize_ref(t)
    y = kvarn_tiles.scaled(t, a, b)
    q, lo, step = kvarn_tiles.quantize_rows(y, bits)
    q2, scale, zero, other = kvarn_tiles.quantize_tiles_ref(t, bits)
    assert torch.equal(q, q2)
    xhat = kvarn_tiles.dequantize_tiles_ref(q2, scale, zero, other).double()
    s_r, s_c = torch.exp(b).double()[:, None], torch.exp(a).double()[None, :]
    exact_meta = (q.double() * step.double()[:, None] + lo.double()[:, None]) * s_r * s_c
    fp16_slack = (xhat - exact_meta).abs()  # what storing fp16 metadata cost, per element
    rtn = (step.double()[:, None] / 2 + (y.amax(-1) - y.amin(-1)).double()[:, None] * 2 * F32_EPS) * s_r * s_c
    fp32_slack = 8 * F32_EPS * t.double().abs()  # forming Y = X/(e^b e^a) and the decode products
    assert torch.all((t.double() - xhat).abs() <= rtn + fp16_slack + fp32_slack)
    # and the fp16 slack is what fp16 rounding allows: scale, zero, other each <= 2^-11 relative
    bound = (q.double() * scale.double()[:, None]).abs() * 2**-11 + zero.double().abs()[:, None] * 2**-11
    bound = bound * other.double()[None, :] + (xhat.abs() * 2**-11) + 4 * F32_EPS * xhat.abs()
    assert torch.all(fp16_slack <= bound * (1 + 2**-10))
    # the decode formula itself, against float64 on the same stored values
    ref64 = (q.double() * scale.double()[:, None] + zero.double()[:, None]) * other.double()[None, :]
    scale_of = (q.double() * scale.double()[:, None]).abs() + zero.double().abs()[:, None]
    assert torch.all((xhat - ref64).abs() <= 3 * F32_EPS * scale_of * other.double()[None, :])


def test_rotation_back_preserves_per_token_error():
    """H is orthonormal: each token's L2 error is the same in the rotated and original frames."""
    x = torch.randn(2, 256, 128, generator=_gen(31))
    for role in "kv":
        fmt = get_format("kvarn3", role=role)
        err = fmt.roundtrip(x) - x
        xr = kvarn_tiles.rotate(x)
        tiles = kvarn_tiles.to_tiles(kvarn_tiles.stage(xr), role)  # quantized from the F16 stage, error against xr
        q, scale, zero, other = kvarn_tiles.quantize_tiles_ref(tiles, 3)
        err_rot = kvarn_tiles.from_tiles(kvarn_tiles.dequantize_tiles_ref(q, scale, zero, other), role) - xr
        assert torch.allclose(err.norm(dim=-1), err_rot.norm(dim=-1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [2, 4, 64, 128])
def test_butterfly_bitwise_equals_the_stacked_loop(n):
    """`butterfly` (two buffers written in turn) against `butterfly_ref` (a stack per stage),
    bit for bit: random values over many magnitudes, a strided (transposed) input, a constant
    row, a zero row and one outlier; the input is left untouched."""
    g = _gen(n)
    x = torch.randn(3, 5, n, generator=g) * torch.exp(4 * torch.randn(3, 5, 1, generator=g))
    x[0, 0] = 1.5
    x[0, 1] = 0.0
    x[1, 2, n // 2] = 3e7
    before = x.clone()
    assert torch.equal(kvarn_tiles.butterfly(x), kvarn_tiles.butterfly_ref(x))
    assert torch.equal(x, before)
    xt = x.transpose(0, 1)  # [5, 3, n], not contiguous
    assert torch.equal(kvarn_tiles.butterfly(xt), kvarn_tiles.butterfly_ref(xt))
    # and it is the unnormalized Walsh-Hadamard transform (Sylvester order) up to fp32 rounding
    h = hadamard(n, dtype=torch.float64) * math.sqrt(n)
    ref = x.double() @ h
    assert torch.allclose(kvarn_tiles.butterfly(x).double(), ref, rtol=0, atol=n * F32_EPS * float(x.abs().max()) * 4)


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_compiled_rotation_bitwise_equals_torch(d, monkeypatch):
    """`rotate` on fp32 CPU tensors runs the compiled loop (kvarn_cpu.rotate): bit for bit
    `rotate_torch`, on a strided input with a zero row, a constant row and an outlier."""
    from kvarn.formats import kvarn_cpu

    g = _gen(d)
    x = torch.randn(5, 2, 3, d, generator=g) * torch.exp(4 * torch.randn(5, 2, 3, 1, generator=g))
    x[0, 0, 0] = 0.0
    x[0, 0, 1] = 1.5
    x[1, 1, 2, d // 3] = 3e7
    x = x.transpose(0, 1)  # not contiguous
    calls = []
    compiled = kvarn_cpu.rotate
    monkeypatch.setattr(kvarn_cpu, "rotate", lambda *a: calls.append(1) or compiled(*a))
    got = kvarn_tiles.rotate(x)
    assert calls and got.shape == x.shape
    assert torch.equal(got, kvarn_tiles.rotate_torch(x))
    assert torch.equal(kvarn_tiles.rotate(got), kvarn_tiles.rotate_torch(kvarn_tiles.rotate_torch(x)))  # back
    assert torch.equal(kvarn_tiles.rotate(x.double()), kvarn_tiles.rotate_torch(x.double()))  # float64: torch's
    assert len(calls) == 2


def test_log_update_clamps():
    big, tiny = torch.tensor([8.0]), torch.tensor([1e-5])
    assert torch.allclose(kvarn_tiles._log_update(big, tiny), 8.0 + torch.log(torch.tensor([1e-3])))
    assert torch.equal(kvarn_tiles._log_update(torch.zeros(1), torch.tensor([1e6])), torch.log(torch.tensor([1e3])))
    assert torch.equal(kvarn_tiles._log_update(torch.tensor([9.5]), torch.tensor([1e2])), torch.tensor([10.0]))
    assert torch.equal(kvarn_tiles._log_update(torch.zeros(1), tiny), torch.tensor([-0.3]))


def test_round_half_away():
    v = torch.tensor([0.0, 0.49999997, 0.5, 1.5, 2.5, 2.4999998, 3.0])
    assert kvarn_tiles.round_half_away(v).tolist() == [0, 0, 1, 2, 3, 2, 3]


# --- packing --------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(2, 9))
def test_pack_roundtrip_every_width(bits):
    for n in (1, 7, 64 * 128, 128 * 128 + 3):
        codes = torch.randint(0, 2**bits, (2, n), generator=_gen(n + bits), dtype=torch.int32).to(torch.uint8)
        data = kvarn_type.pack_codes(codes, bits)
        assert data.dtype == torch.uint8 and data.shape == (2, math.ceil(n * bits / 8))
        assert torch.equal(kvarn_type.unpack_codes(data, bits, n), codes)


def test_pack_layout_lsb_first_by_hand():
    # 3-bit codes 1, 2, 7 -> bits (LSB first) 100 010 111 -> byte0 = 1+16+64+128, byte1 = 1
    data = kvarn_type.pack_codes(torch.tensor([1, 2, 7], dtype=torch.uint8), 3)
    assert data.tolist() == [209, 1]
    # 5-bit: 31, 0, 1 -> bits 0-4 set, bit 10 set
    assert kvarn_type.pack_codes(torch.tensor([31, 0, 1], dtype=torch.uint8), 5).tolist() == [31, 4]


@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("role", ["k", "v"])
def test_nbytes_formula_and_real_buffer(d, role):
    for bits in range(2, 9):
        fmt = get_format(f"kvarn{bits}", role=role)
        ch = min(d, 128)
        rows, cols = (ch, 128) if role == "k" else (128, ch)
        per_group = d // ch * (math.ceil(rows * cols * bits / 8) + 2 * (2 * rows + cols))
        assert fmt.nbytes(256, d) == 2 * per_group
        if d >= 128:
            assert per_group == d // 128 * (2048 * bits + 768)
            assert fmt.bits_per_value(d) == bits + 0.375
    fmt = get_format("kvarn3", role=role)
    x = torch.randn(2, 256, d, generator=_gen(d))
    packed = fmt.encode(x)
    assert packed.data.dtype == torch.uint8
    assert packed.data.shape == (2, fmt.nbytes(256, d))


def test_bits_per_value_head_dim_64():
    assert get_format("kvarn4", role="k").bits_per_value(64) == 4.5
    assert get_format("kvarn4", role="v").bits_per_value(64) == 4.625


# --- the format -----------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("role", ["k", "v"])
def test_roundtrip_equals_decode_encode_bitwise(d, role):
    x = torch.randn(2, 128 * (1 + (d < 256)), d, generator=_gen(d + 1)) * 2
    for bits in range(2, 9):
        fmt = get_format(f"kvarn{bits}", role=role)
        assert torch.equal(fmt.roundtrip(x), fmt.decode(fmt.encode(x)))


def test_batch_invariance():
    """A head/group gives the same bits whether it is quantized alone or in a batch."""
    x = torch.randn(3, 2, 384, 128, generator=_gen(7))
    for role in "kv":
        fmt = get_format("kvarn4", role=role)
        y = fmt.roundtrip(x)
        assert torch.equal(y[1, 0], fmt.roundtrip(x[1, 0].clone()))
        assert torch.equal(y[:, :, 128:256], fmt.roundtrip(x[:, :, 128:256].contiguous()))


def test_error_decreases_with_width():
    x = torch.randn(4, 256, 128, generator=_gen(11))
    x[..., 5] *= 10  # an outlier channel, as post-RoPE keys have
    for role in "kv":
        errs = []
        for bits in range(2, 9):
            y = get_format(f"kvarn{bits}", role=role).roundtrip(x)
            errs.append(((y - x) ** 2).mean().item() / (x**2).mean().item())
        assert all(e1 < 0.5 * e0 for e0, e1 in zip(errs, errs[1:])), errs
        assert errs[-1] < 1e-4


def test_k_per_channel_v_per_token():
    """K rows are channels (each channel's codes span 0..qmax over the group's tokens);
    V rows are tokens. Checked on the stored codes of one 128x128 group."""
    x = torch.randn(128, 128, generator=_gen(5))
    x[:, 9] *= 30
    bits, qmax = 3, 7
    xr = kvarn_tiles.stage(kvarn_tiles.rotate(x))  # the tiles are cut from the F16 stage
    tk, tv = kvarn_tiles.to_tiles(xr, "k"), kvarn_tiles.to_tiles(xr, "v")
    assert torch.equal(tk[0, 0], xr.T) and torch.equal(tv[0, 0], xr)
    for role, tile in (("k", tk), ("v", tv)):
        fmt = get_format(f"kvarn{bits}", role=role)
        data = fmt.encode(x).data
        assert data.shape == (2048 * bits + 768,)
        codes = kvarn_type.unpack_codes(data[: 2048 * bits], bits, 128 * 128).reshape(128, 128)
        assert torch.equal(codes, kvarn_tiles.quantize_tiles_ref(tile.reshape(1, 128, 128), bits)[0][0])
        # tile rows: every row spans the full code range (asymmetric min/max per row)
        assert torch.all(codes.amin(1) == 0) and torch.all(codes.amax(1) == qmax)
        # the other axis is not quantized as a unit: some columns miss 0 or qmax
        assert not (torch.all(codes.amin(0) == 0) and torch.all(codes.amax(0) == qmax))
        # in (token, channel) terms: K's rows are channels, V's rows are tokens
        per_token = codes.T if role == "k" else codes
        assert torch.all(per_token.amin(1) == 0) == (role == "v")


def test_scale_equivariance():
    """Exact where the maths allows, approximate where it cannot be exact.

    Given the normalization scales, the RTN + fp16 metadata stage is exactly
    equivariant under x -> c*x for a power of two c (every op is then exact scaling).
    The whole format is not: the log-scales go through ln/exp (not exactly shifted by
    ln c) and the clamps a, b >= -0.3 and std in [1e-3, 1e3] depend on absolute scale.
    """
    t = _outlier_tile(seed=21)
    a, b = kvarn_tiles.normalize_ref(t)
    for c in (2.0, 0.25, 1024.0):
        q1, lo1, st1 = kvarn_tiles.quantize_rows(kvarn_tiles.scaled(t, a, b), 4)
        q2, lo2, st2 = kvarn_tiles.quantize_rows(kvarn_tiles.scaled(t * c, a, b), 4)
        assert torch.equal(q1, q2) and torch.equal(lo1 * c, lo2) and torch.equal(st1 * c, st2)
        s_row = torch.exp(b)
        assert torch.equal((s_row * st1).half() * c, (s_row * st2).half())
    # whole format, c = 2: the scales shift by ln 2 up to rounding, so only a few codes
    # on a rounding boundary may move: the difference is far below the quantization error
    x = torch.randn(2, 256, 128, generator=_gen(22)) * 3
    fmt = get_format("kvarn4", role="k")
    y1, y2 = fmt.roundtrip(x), fmt.roundtrip(x * 2)
    qerr = ((y1 - x) ** 2).mean().sqrt()
    assert ((y2 - 2 * y1) ** 2).mean().sqrt() / 2 < 0.05 * qerr


def test_constant_and_zero_groups():
    for role in "kv":
        fmt = get_format("kvarn4", role=role)
        z = torch.zeros(2, 128, 64)
        assert torch.equal(fmt.roundtrip(z), z)
        c = torch.full((2, 128, 64), 0.3)
        y = fmt.roundtrip(c)
        assert torch.isfinite(y).all()
        # rotated, the group is one constant channel; rows stay constant (code 0), so the
        # only error is fp16 metadata (zero, other: 2^-11 relative each) plus fp32 rotations
        tol = 0.3 * 8 * (2 * 2**-11 + 64 * 4 * F32_EPS)
        assert (y - c).abs().max() <= tol


# --- errors ---------------------------------------------------------------------
def test_bad_head_dim():
    with pytest.raises(ValueError, match="head dim 96"):
        get_format("kvarn4").roundtrip(torch.randn(128, 96))
    with pytest.raises(ValueError, match="1024"):
        get_format("kvarn4").encode(torch.randn(128, 1024))


def test_bad_token_count():
    with pytest.raises(ValueError, match=r"100 tokens.*multiple of 128"):
        get_format("kvarn4", role="v").roundtrip(torch.randn(100, 64))
    with pytest.raises(ValueError, match="multiple of"):
        get_format("kvarn4").nbytes(100, 64)


def test_non_finite_input():
    x = torch.randn(128, 64)
    x[3, 4] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        get_format("kvarn4").roundtrip(x)


def test_metadata_overflow_raises():
    with pytest.raises(ValueError, match="fp16 metadata overflowed"):
        get_format("kvarn4").roundtrip(torch.full((128, 64), 1e10))


@pytest.mark.parametrize("name", ["kvarn1", "kvarn9", "kvarn0", "kvarn"])
def test_unregistered_widths(name):
    with pytest.raises(ValueError, match=rf"unknown KV cache type '{name}'.*kvarn2"):
        get_format(name)


def test_registered_attributes():
    for bits in range(2, 9):
        fmt = get_format(f"kvarn{bits}", role="v", iters=8)
        assert (fmt.family, fmt.group, fmt.sink, fmt.tail_quantum, fmt.min_tail) == ("kvarn", 128, 128, 128, 128)
        assert fmt.default_tail_dtype == "f16" and fmt.iters == 8 and fmt.bits == bits
        assert fmt.effective_tail(0) == 128 and fmt.effective_tail(129) == 256


def test_import_kvarn_does_not_import_triton():
    """Neither compiler is imported until a KVarN tile is encoded (Triton: a CUDA one, numba: a CPU one)."""
    import subprocess
    import sys

    code = ("import sys, kvarn, kvarn.formats, kvarn.budget.memory; "
            "sys.exit(int('triton' in sys.modules) + 2 * int('numba' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- the fast CPU normalization (normalize_choice_fast) against the reference, bit for bit ---
def _same_choice(tiles, iters=kvarn_tiles.ITERS):
    ra, rb, rp = kvarn_tiles.normalize_choice(tiles, iters)
    fa, fb, fp = kvarn_tiles.normalize_choice_fast(tiles, iters)
    assert torch.equal(fp, rp), (fp, rp)
    assert torch.equal(fa, ra) and torch.equal(fb, rb)
    return rp


@pytest.mark.parametrize("rows, cols", [(64, 128), (128, 64), (128, 128)])
@pytest.mark.parametrize("iters", [0, 1, 5, 16])
def test_fast_normalization_bitwise_on_random_tiles(rows, cols, iters):
    g = _gen(rows + cols + iters)
    n = 40
    # column and row scales spanning ~7 orders of magnitude, as rotated K/V tiles do not quite
    t = torch.randn(n, rows, cols, generator=g) * torch.exp(3 * torch.randn(n, 1, cols, generator=g))
    t = t * torch.exp(2 * torch.randn(n, rows, 1, generator=g))
    p = _same_choice(t, iters)
    if iters >= 5:
        assert len(set(p.tolist())) > 1  # tiles keep different passes: the choice is exercised


def test_fast_normalization_bitwise_on_degenerate_tiles():
    rows, cols = 64, 128
    t = torch.randn(9, rows, cols, generator=_gen(5))
    t[0] = 0.0  # zero tile: every std 0, every pass ties
    t[1] = 2.5  # constant tile: the same, at another value
    t[2, :, 7] = 1.25  # one constant column (std 0 -> the 1e-3 clamp)
    t[3, 11, :] = -3.0  # one constant row
    t[4] = _outlier_tile(rows, cols, seed=6)
    t[5, 2, 3] = 1e4  # a single outlier value
    t[6] *= 1e-5  # stds below STD_MIN everywhere
    t[7] = torch.outer(torch.linspace(0.1, 4.0, rows), torch.linspace(-2.0, 3.0, cols))  # rank one
    t[8] = torch.randn(rows, 1, generator=_gen(7)) * torch.ones(1, cols)  # constant along every row
    p = _same_choice(t)
    # zero and constant tiles: imbalance 0 in every pass, ties -> the last pass is kept
    assert p[0] == kvarn_tiles.ITERS and p[1] == kvarn_tiles.ITERS
    for i in range(len(t)):  # each tile alone: no dependence on its batch neighbours
        assert torch.equal(kvarn_tiles.normalize_choice_fast(t[i : i + 1])[2], p[i : i + 1])


def test_fast_normalization_ties_in_the_kept_pass():
    """A rank-one tile: from pass 2 on every pass has exactly the same (non-zero) imbalance,
    so `<=` keeps the last pass (with `<` it would keep pass 2)."""
    t = torch.outer(torch.linspace(0.5, 2.0, 64), torch.linspace(1.0, 3.0, 128))[None]

    def imb(iters):
        a, b = kvarn_tiles.normalize_ref(t, iters)
        y = kvarn_tiles.scaled(t, a, b)
        return kvarn_tiles.imbalance(kvarn_tiles.sample_std(y, -2), kvarn_tiles.sample_std(y, -1))

    assert torch.equal(imb(2), imb(kvarn_tiles.ITERS)) and imb(2) > 1 and imb(1) > imb(2)  # a real tie
    assert _same_choice(t).item() == kvarn_tiles.ITERS
    assert kvarn_tiles.normalize_choice_fast(t, 5)[2].item() == 5


def test_fast_normalization_is_what_the_encoder_runs(monkeypatch):
    """quantize_tiles_ref on CPU normalizes and rounds with the compiled path; swapping in the
    torch reference changes no bit of the codes or metadata."""
    x = torch.randn(2, 384, 64, generator=_gen(31)) * torch.exp(torch.randn(1, 1, 64, generator=_gen(32)))
    tiles = kvarn_tiles.to_tiles(kvarn_tiles.stage(kvarn_tiles.rotate(x)), "k").reshape(-1, 64, 128)
    calls = []
    fast = kvarn_tiles.quantize_normalized_fast
    monkeypatch.setattr(kvarn_tiles, "quantize_normalized_fast", lambda *a: calls.append(1) or fast(*a))
    got = kvarn_tiles.quantize_tiles_ref(tiles, 4)
    assert calls
    monkeypatch.setattr(kvarn_tiles, "quantize_normalized_fast", kvarn_tiles.quantize_normalized)
    want = kvarn_tiles.quantize_tiles_ref(tiles, 4)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def _same_quantization(tiles, bits, iters=kvarn_tiles.ITERS):
    want = kvarn_tiles.quantize_normalized(tiles, bits, iters)
    got = kvarn_tiles.quantize_normalized_fast(tiles, bits, iters)
    for name, g, w in zip(("a", "b", "codes", "lo", "step"), got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{name}: {int((g != w).sum())} values differ"
    return got[2]


@pytest.mark.parametrize("bits", kvarn_type.WIDTHS)
def test_fast_quantization_bitwise_on_random_and_degenerate_tiles(bits):
    g = _gen(100 + bits)
    t = torch.randn(12, 64, 128, generator=g) * torch.exp(3 * torch.randn(12, 1, 128, generator=g))
    t = t * torch.exp(2 * torch.randn(12, 64, 1, generator=g))
    t[0] = 0.0  # every row constant: code 0, step at its floor
    t[1, :, 7] = 1.25
    t[2, 11, :] = -3.0
    t[3] = _outlier_tile(64, 128, seed=bits)
    t[4, 2, 3] = 1e4
    t[5] *= 1e-5
    codes = _same_quantization(t, bits)
    assert int(codes.max()) == 2**bits - 1 and int(codes[0].max()) == 0  # the full code range, and a constant row
    v = t.transpose(-1, -2).contiguous()  # V-shaped tiles [128, 64]
    _same_quantization(v, bits, iters=5)


def test_fast_quantization_rounds_halves_up():
    """A row whose scaled values sit at exact halves of the step: round_half_away's rule."""
    t = torch.zeros(1, 64, 128)
    t[0, :, :] = torch.tensor([0.0, 0.5, 1.0, 1.5] * 32)  # 2 bits, no normalization: step 0.5, v = 0, 1, 2, 3
    assert _same_quantization(t, 2, iters=0)[0, 0, :4].tolist() == [0, 1, 2, 3]
    t[0, :, :] = torch.tensor([0.0, 0.25, 0.75, 1.5] * 32)  # v = 0, 0.5, 1.5, 3: halves go up
    assert _same_quantization(t, 2, iters=0)[0, 0, :4].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("fast", [kvarn_tiles.normalize_choice_fast,
                                  lambda t: kvarn_tiles.quantize_normalized_fast(t, 4)])
def test_fast_normalization_bad_input(fast):
    with pytest.raises(ValueError, match=r"float32 CPU \[N, R, C\], got torch.float64"):
        fast(torch.zeros(1, 64, 128, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(64, 128\)"):
        fast(torch.zeros(64, 128))


def _real_kv(name: str, n_tokens: int = 256):
    """A model's post-RoPE K and V on Wikitext's first tokens: [layers, kv heads, T, D] each."""
    from kvarn.baseline import data
    from kvarn.weights import models
    from paths import CACHE_DIR, ENGINE_TEXT

    lm = models.load(models.ModelSpec(name, f"embedded:{name}"), cache_dir=CACHE_DIR, device="cpu",
                     dtype=torch.float32)
    ids = data.tokenize(lm.tokenizer, data.load_text(ENGINE_TEXT)[:20000])[:n_tokens][None]  # the text's start
    with torch.inference_mode():
        cache = lm.model(ids, use_cache=True).past_key_values
    k = torch.cat([lay.keys for lay in cache.layers]).float()
    v = torch.cat([lay.values for lay in cache.layers]).float()
    return k, v


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_fast_normalization_bitwise_on_real_tiles(name):
    k, v = _real_kv(name)
    for role, x in (("k", k), ("v", v)):
        tiles = kvarn_tiles.to_tiles(kvarn_tiles.stage(kvarn_tiles.rotate(x)), role)
        p = _same_choice(tiles.reshape(-1, *tiles.shape[-2:]))
        assert len(set(p.tolist())) > 1
        _same_quantization(tiles.reshape(-1, *tiles.shape[-2:]), 4)


def test_codes_unpack_to_uint8_on_the_device_they_were_packed_on():
    # the dequantizer indexes with uint8 codes; a tensor made on the CPU by mistake shows on "meta"
    codes = torch.tensor([[1, 2, 7]], dtype=torch.uint8)
    assert kvarn_type.unpack_codes(kvarn_type.pack_codes(codes, 3), 3, 3).dtype == torch.uint8
    for bits in (2, 5, 8):
        packed = kvarn_type.pack_codes(torch.zeros(2, 128, dtype=torch.uint8, device="meta"), bits)
        assert packed.device.type == "meta" and packed.dtype == torch.uint8 and packed.shape == (2, 16 * bits)
        back = kvarn_type.unpack_codes(packed, bits, 128)
        assert back.device.type == "meta" and back.dtype == torch.uint8 and back.shape == (2, 128)


def test_iters_zero_is_plain_rtn_and_the_knobs_are_checked():
    # iters 0: no normalization pass (an ablation), accepted and different from the default's passes
    x = torch.randn(2, 128, 128, generator=_gen(5)) * torch.linspace(0.1, 8, 128)
    plain = get_format("kvarn4", iters=0)
    assert plain.iters == 0 and not torch.equal(plain.roundtrip(x), get_format("kvarn4").roundtrip(x))
    with pytest.raises(ValueError, match=r"^kvarn4: iters must be an integer >= 0, got -1$"):
        get_format("kvarn4", iters=-1)
    with pytest.raises(ValueError, match=r"^kvarn4: impl must be 'auto', 'ref' or 'triton', got 'cuda'$"):
        get_format("kvarn4", impl="cuda")
    with pytest.raises(ValueError, match=r"^kvarn4: got 100 tokens; KVarN writes whole groups of 128 tokens, so "
                                         r"n_tokens must be a multiple of 128 \(an incomplete group stays exact in "
                                         r"the F16 tail until its last token arrives\)$"):
        plain.roundtrip(torch.zeros(100, 128))
