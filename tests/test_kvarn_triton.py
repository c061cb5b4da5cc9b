"""Triton KVarN kernels against the torch reference (kvarn/formats/kvarn.py).

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), at tiny shapes.

Tolerance, and why: the kernel performs the reference's fp32 operations in the same
order, except that reductions (the std sums) are summed in another order and exp/log
come from another library. So the log-scales can differ in their last bits. Allowed:
  * fp16 metadata: within one fp16 ulp, and at most 1% of the values not bit-identical
    (a last-bit difference of an fp32 value can cross an fp16 rounding boundary; under
    the interpreter 1 of 3072 values differed on these inputs, on a GPU the exp/log
    units are approximate, so more may);
  * codes: equal, or one apart where the reference's v = (y - lo)/step lies within
    2^-14 * (|y| + |lo|)/step of a half step, i.e. where a relative change of 2^-14 in
    the fp32 inputs of the rounding could move it across. (The log-scales are sums of up
    to 2*iters logs of magnitude <= 10, so their absolute error, and the relative error
    of the scales e^a, e^b, is well below 2^-14.) At most 1% of codes may move;
  * the bit packing is checked exactly: the kernel's payload must equal the reference
    packer applied to the kernel's own codes.
"""

import pytest
import torch

from kvarn.formats import get_format
from kvarn.formats import kvarn as K

triton = pytest.importorskip("triton")
T = pytest.importorskip("kvarn.formats.kvarn_triton")

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiles(n, rows, cols, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, rows, cols, generator=g) * (0.2 + 5 * torch.rand(n, 1, cols, generator=g))
    t[:, :, 1] *= 20  # an outlier column
    return t.to(device)


def _fp16_ulp(x):
    """One fp16 ulp at |x| (normal range), as float32."""
    e = torch.floor(torch.log2(x.float().abs().clamp_min(2.0**-14)))
    return torch.exp2(e - 10)


def _assert_agree(tiles, bits, fast, iters=16):
    """fast: (payload, scale, zero, other) from the kernel, any device."""
    tiles = tiles.cpu()
    payload, scale, zero, other = (t.cpu() for t in fast)
    n, rows, cols = tiles.shape
    r_payload, r_scale, r_zero, r_other = K.quantize_pack_ref(tiles, bits, iters)
    assert payload.dtype == torch.uint8 and payload.shape == r_payload.shape

    for got, ref in ((scale, r_scale), (zero, r_zero), (other, r_other)):
        assert got.dtype == torch.float16 and got.shape == ref.shape
        assert torch.all((got.float() - ref.float()).abs() <= _fp16_ulp(ref))
        assert (got != ref).float().mean() <= 0.01

    q = K.unpack_codes(payload, bits, rows * cols).reshape(n, rows, cols)
    assert torch.equal(K.pack_codes(q.flatten(-2), bits), payload)  # packing layout, exactly
    q_ref = K.unpack_codes(r_payload, bits, rows * cols).reshape(n, rows, cols)
    diff = q.int() - q_ref.int()
    if diff.any():
        a, b = K.normalize_ref(tiles, iters)
        y = K.scaled(tiles, a, b)
        _, lo, step = K.quantize_rows(y, bits)
        v = (y - lo[..., None]) / step[..., None]
        dist = (v - torch.floor(v) - 0.5).abs()
        allowed = 2.0**-14 * (y.abs() + lo.abs()[..., None]) / step[..., None]
        moved = diff != 0
        assert diff.abs().max() == 1
        assert torch.all(dist[moved] <= allowed[moved]), dist[moved]
        assert moved.float().mean() <= 0.01
    return q, q_ref


# --- interpreter (CPU) or GPU, tiny shapes ------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(64, 128), (128, 64)], ids=["K-D64", "V-D64"])
def test_quantize_pack_matches_reference(shape, bits):
    tiles = _tiles(2, *shape, seed=bits)
    fast = T.quantize_pack(tiles, bits, 16)
    _assert_agree(tiles, bits, fast)


def test_quantize_pack_128_tile_and_few_iters():
    tiles = _tiles(1, 128, 128, seed=99)
    _assert_agree(tiles, 5, T.quantize_pack(tiles, 5, 3), iters=3)


def test_half_steps_round_away_in_kernel():
    """iters=0 leaves the tile unscaled, so y = x: put values exactly on half steps."""
    bits, rows, cols = 2, 64, 128
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4, (1, rows, cols), generator=g).float()
    x[..., 0], x[..., 1] = 0.0, 3.0  # every row spans [0, 3]: lo = 0, step = 1
    x[..., 2:10] = torch.tensor([0.5, 1.5, 2.5, 0.5, 1.5, 2.5, 2.5, 1.5])
    payload, scale, zero, other = T.quantize_pack(x, bits, 0)
    q = K.unpack_codes(payload, bits, rows * cols).reshape(1, rows, cols)
    assert torch.equal(q[..., 2:10].float(), torch.tensor([1.0, 2, 3, 1, 2, 3, 3, 2]).expand(1, rows, 8))
    assert torch.equal(payload, K.quantize_pack_ref(x, bits, 0)[0])


def test_constant_tile_ties_in_kernel():
    """Every pass ties (imbalance 0): the kernel must also keep the last one (scales e^-0.3)."""
    tiles = torch.full((1, 64, 128), 2.5)
    payload, scale, zero, other = T.quantize_pack(tiles, 4, 4)
    assert torch.equal(other, torch.exp(torch.full((1, 128), -0.3)).half())
    assert torch.equal(payload, torch.zeros_like(payload))


def test_agreement_check_rejects_a_wrong_code():
    """The tolerance above must not be vacuous: a code moved away from a half step fails."""
    tiles = _tiles(1, 64, 128, seed=3)
    payload, scale, zero, other = K.quantize_pack_ref(tiles, 4)
    _assert_agree(tiles, 4, (payload, scale, zero, other))
    q = K.unpack_codes(payload, 4, 64 * 128)
    a, b = K.normalize_ref(tiles)
    y = K.scaled(tiles, a, b)
    _, lo, step = K.quantize_rows(y, 4)
    v = ((y - lo[..., None]) / step[..., None]).flatten()
    i = int(((v - v.floor() - 0.5).abs() > 0.3).nonzero()[0])
    q[..., i] = q[..., i] + 1 if q[..., i] < 15 else q[..., i] - 1
    with pytest.raises(AssertionError):
        _assert_agree(tiles, 4, (K.pack_codes(q, 4), scale, zero, other))


@pytest.mark.parametrize("bits", range(2, 9))
def test_unpack_every_width(bits):
    """Random codes packed by the reference, unpacked by the kernel with unit metadata."""
    n, rows, cols = 1, 64, 128
    codes = torch.randint(0, 2**bits, (n, rows * cols), generator=torch.Generator().manual_seed(bits))
    payload = K.pack_codes(codes.to(torch.uint8), bits)
    ones_r = torch.ones(n, rows, dtype=torch.float16)
    out = T.unpack_dequantize(payload, ones_r, torch.zeros_like(ones_r), torch.ones(n, cols, dtype=torch.float16), bits)
    assert torch.equal(out, codes.reshape(n, rows, cols).float())


@pytest.mark.parametrize("bits", [3, 8])
def test_unpack_dequantize_matches_reference(bits):
    tiles = _tiles(2, 128, 64, seed=40 + bits)
    payload, scale, zero, other = K.quantize_pack_ref(tiles, bits)
    ref = K.unpack_dequantize_ref(payload, scale, zero, other, bits)
    got = T.unpack_dequantize(payload, scale, zero, other, bits)
    # same fp32 operations in the same order: bit for bit (no FMA contraction in numpy)
    assert torch.equal(got, ref)


def test_format_with_triton_impl():
    x = torch.randn(1, 128, 64, generator=torch.Generator().manual_seed(5))
    for role in "kv":
        fast = get_format("kvarn4", role=role, impl="triton")
        ref = get_format("kvarn4", role=role, impl="ref")
        packed = fast.encode(x)
        assert packed.data.shape[-1] == ref.nbytes(128, 64)
        y = fast.decode(packed)
        assert torch.equal(y, fast.roundtrip(x))
        y_ref = ref.roundtrip(x)
        qerr = (y_ref - x).pow(2).mean().sqrt()
        assert (y - y_ref).pow(2).mean().sqrt() <= 0.1 * qerr


def test_bad_tiles():
    with pytest.raises(ValueError, match="tile sides"):
        T.quantize_pack(torch.zeros(1, 32, 128), 4)
    with pytest.raises(ValueError, match="bits"):
        T.quantize_pack(torch.zeros(1, 64, 128), 9)


# --- GPU only: full shapes ------------------------------------------------------------
@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("shape", [(128, 128), (64, 128), (128, 64)])
def test_gpu_quantize_pack_full(shape, bits):
    tiles = _tiles(64, *shape, seed=bits, device="cuda")
    _assert_agree(tiles, bits, T.quantize_pack(tiles, bits, 16))


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_gpu_unpack_dequantize_full(bits):
    tiles = _tiles(64, 128, 128, seed=bits)
    payload, scale, zero, other = K.quantize_pack_ref(tiles, bits)
    ref = K.unpack_dequantize_ref(payload, scale, zero, other, bits)
    got = T.unpack_dequantize(*(t.cuda() for t in (payload, scale, zero, other)), bits).cpu()
    # the GPU may fuse q*scale + zero into one FMA: one rounding fewer, <= 1 ulp of each product
    q = K.unpack_codes(payload, bits, 128 * 128).reshape(ref.shape).float()
    bound = 2.0**-23 * ((q * scale.float()[..., None]).abs() + zero.float().abs()[..., None]) * other.float()[:, None, :]
    assert torch.all((got - ref).abs() <= 2 * bound)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_format_roundtrip():
    x = torch.randn(4, 1024, 256, device="cuda")
    fmt = get_format("kvarn4", role="k")  # auto -> Triton on CUDA
    y = fmt.roundtrip(x)
    assert torch.equal(y, fmt.decode(fmt.encode(x)))
    y_ref = get_format("kvarn4", role="k", impl="ref").roundtrip(x.cpu())
    qerr = (y_ref - x.cpu()).pow(2).mean().sqrt()
    assert (y.cpu() - y_ref).pow(2).mean().sqrt() <= 0.1 * qerr
