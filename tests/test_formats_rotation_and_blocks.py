"""The Hadamard rotation (kvarn/formats/hadamard.py) and the block types' checks and refusals
(kvarn/formats/blocks.py), each against a reference written here.

* `hadamard` is made on the device and in the dtype asked for; `rotate_blocks` keeps the
  input's dtype (float64 against the float64 definition, the Sylvester recursion written
  out here) and multiplies on the input's device (seen on the "meta" device); a head dim
  that is not a multiple of the block is refused by name.
* `k_rotation_block`: llama.cpp's rule (largest power of two in [64, 256] dividing the head
  dim) by hand for a table of head dims, and the refusal's whole text where none divides.
* The block quantizer's iq4_nl indexing and the dense bit packing make their tables on the
  input's device (the "meta" device shows a CPU tensor made by mistake).
* `supported_head_dims` and `check_head_dim`: each role's and rotation's accepted head dims
  and the whole refusal text.
* An fp16 scale overflow: the whole message (where: head and token for a [head, token, dim]
  input; the block and its channels; whether rotated; d and m; what the type holds) for q8_0
  after the K rotation, q4_0 unrotated and q4_1 (the `_1` types' limit), worked by hand.
* `decode` refuses a buffer of the wrong size, naming the size it expects.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvarn.formats import get_format
from kvarn.formats.base import Packed, ValueRangeError
from kvarn.formats.blocks import SPECS, pack_blocks, quantize_blocks
from kvarn.formats.hadamard import hadamard, k_rotation_block, rotate_blocks


def sylvester64(n: int) -> torch.Tensor:
    """H_n / sqrt(n) in float64 from the recursion H_2n = [[H, H], [H, -H]], H_1 = [1]."""
    h = [[1.0]]
    while len(h) < n:
        h = [row + row for row in h] + [row + [-v for v in row] for row in h]
    return torch.tensor(h, dtype=torch.float64) / n**0.5


# --- hadamard.py ------------------------------------------------------------------------
def test_hadamard_is_made_on_the_asked_device_and_dtype():
    h = hadamard(8, dtype=torch.float64, device="meta")
    assert (h.device.type, h.dtype, tuple(h.shape)) == ("meta", torch.float64, (8, 8))
    assert torch.equal(hadamard(2, dtype=torch.float64), torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) / 2**0.5)


def test_rotate_blocks_keeps_a_float64_input_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 128, dtype=torch.float64, generator=g)
    y = rotate_blocks(x, 64)
    assert y.dtype == torch.float64 and y.shape == x.shape
    h = sylvester64(64)
    want = torch.cat([x[..., :64] @ h, x[..., 64:] @ h], -1)
    # float64 sums of 64 products of |x| < 6: rounding ~1e-14; float32 anywhere would be ~1e-7
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)


class _MatmulDevices(TorchFunctionMode):
    """Records the devices of every matmul's tensor operands (torch only; kvarn runs as is)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("matmul", "__matmul__", "mm", "bmm"):
            self.seen.append(tuple(a.device.type for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


def test_rotate_blocks_multiplies_on_the_input_device():
    # meta accepts a CPU right operand in matmul silently, so the operands are watched
    # (on a GPU a CPU-made H_block fails the call)
    rec = _MatmulDevices()
    with rec:
        y = rotate_blocks(torch.empty(2, 3, 128, device="meta"), 64)
    assert y.device.type == "meta"
    assert rec.seen == [("meta", "meta")]


def test_rotate_blocks_refuses_a_head_dim_that_is_not_a_multiple_of_the_block():
    with pytest.raises(ValueError, match=r"^head dim 96 is not a multiple of the rotation block 64$"):
        rotate_blocks(torch.zeros(2, 96), 64)


@pytest.mark.parametrize("head_dim, block", [
    (64, 64), (128, 128), (192, 64), (256, 256), (320, 64), (384, 128), (512, 256), (768, 256), (1024, 256),
])  # fmt: skip
def test_k_rotation_block_is_the_largest_power_of_two_in_64_256_dividing(head_dim, block):
    assert k_rotation_block(head_dim) == block


@pytest.mark.parametrize("head_dim", [32, 48, 80, 96, 160])
def test_k_rotation_block_refuses_a_head_dim_without_one(head_dim):
    with pytest.raises(ValueError, match=(
            rf"^head dim {head_dim} has no power-of-two divisor in \[64, 256\]; "
            r"K rotation needs one \(use rot=False for this head dim\)$")):
        k_rotation_block(head_dim)


# --- blocks.py: tables made on the input's device ----------------------------------------
def test_iq4_nl_quantizer_stays_on_the_input_device():
    q, d, m = quantize_blocks(SPECS["iq4_nl"], torch.empty(4, 32, device="meta"))
    assert (q.device.type, q.dtype, tuple(q.shape)) == ("meta", torch.int64, (4, 32))
    assert (d.device.type, tuple(d.shape), m) == ("meta", (4, 1), None)


@pytest.mark.parametrize("name", ["q3_0", "q5_0"])  # the dense bitstream; q5_0's high-bit word
def test_bit_packing_stays_on_the_input_device(name):
    spec = SPECS[name]
    q = torch.empty(4, 32, dtype=torch.int64, device="meta")
    d = torch.empty(4, 1, device="meta")
    out = pack_blocks(spec, q, d, None)
    # d (2 bytes) + 32 codes of `bits` bits: 14 bytes for q3_0, 2 + 4 + 16 = 22 for q5_0
    assert (out.device.type, out.dtype, tuple(out.shape)) == ("meta", torch.uint8, (4, {"q3_0": 14, "q5_0": 22}[name]))


# --- blocks.py: head dims -----------------------------------------------------------------
K_ROT = "multiples of 32 with a power-of-two divisor in [64, 256] (K rotation)"
V_ROT = "multiples of 64 (V rotation)"


@pytest.mark.parametrize("role, rot, text", [
    ("k", True, K_ROT), ("v", True, V_ROT), ("k", False, "multiples of 32"), ("v", False, "multiples of 32"),
])  # fmt: skip
def test_supported_head_dims_per_role_and_rotation(role, rot, text):
    assert get_format("q4_0", role=role, rot=rot).supported_head_dims() == text


@pytest.mark.parametrize("role, rot, head_dim, accepted", [
    ("k", True, 96, K_ROT + "; rot=False accepts any multiple of 32"),
    ("k", True, 160, K_ROT + "; rot=False accepts any multiple of 32"),
    ("v", True, 96, V_ROT + "; rot=False accepts any multiple of 32"),
    ("k", True, 48, K_ROT + "; rot=False accepts any multiple of 32"),
    ("k", False, 48, "multiples of 32"),
    ("v", False, 0, "multiples of 32"),
])  # fmt: skip
def test_check_head_dim_refusal_text(role, rot, head_dim, accepted):
    fmt = get_format("q8_0", role=role, rot=rot)
    with pytest.raises(ValueError, match=(
            rf"^q8_0 \({role.upper()}, rot={rot}\): head dim {head_dim} not supported; accepted: {re.escape(accepted)}$")):
        fmt.check_head_dim(head_dim)


@pytest.mark.parametrize("role, rot, head_dim", [
    ("k", True, 64), ("k", True, 192), ("v", True, 192), ("k", False, 96), ("v", False, 32),
])  # fmt: skip
def test_check_head_dim_accepts(role, rot, head_dim):
    assert get_format("q8_0", role=role, rot=rot).check_head_dim(head_dim) is None


# --- blocks.py: the fp16 scale overflow message --------------------------------------------
def _q8_0_k_rotated():
    # one spike 1e8 at channel 5 of head 1, token 2; the K rotation (block 64 for head dim 64)
    # spreads it as ±1e8/8 = ±1.25e7 (exact in fp32) over all 64 channels: block 0 is the
    # first bad one, d = amax/127 = 1.25e7/127 = 98425.2
    x = torch.zeros(2, 3, 64)
    x[1, 2, 5] = 1e8
    return ("q8_0", "k", True, x, (1,), (2, 2),
            "q8_0 (K): head 1, token 2: fp16 scale overflow in block 0 (channels 0..31, after the Hadamard "
            "rotation): d = 9.843e+04, max |x| of the block 1.25e+07; q8_0 stores d as fp16, so it holds "
            "|x| <= 127·65504 = 8.32e+06")


def _q4_0_v_plain():
    # unrotated: -1e6 at channel 40 (block 1) of head 0, token 1; d = vmax/-8 = 125000
    x = torch.zeros(1, 2, 64)
    x[0, 1, 40] = -1e6
    return ("q4_0", "v", False, x, (0,), (1, 1),
            "q4_0 (V): head 0, token 1: fp16 scale overflow in block 1 (channels 32..63): d = 1.25e+05, "
            "max |x| of the block 1e+06; q4_0 stores d as fp16, so it holds |x| <= 8·65504 = 5.24e+05")


def _q4_1_k_plain():
    # unrotated: block 1 of head 2, token 1 holds -1e6 and +1e6: d = (max - min)/15 = 133333.3,
    # m = min = -1e6, both beyond fp16's 65504
    x = torch.zeros(3, 2, 64)
    x[2, 1, 32:48] = -1e6
    x[2, 1, 48:] = 1e6
    return ("q4_1", "k", False, x, (2,), (1, 1),
            "q4_1 (K): head 2, token 1: fp16 scale overflow in block 1 (channels 32..63): d = 1.333e+05, "
            "m = -1e+06, max |x| of the block 1e+06; q4_1 stores d and m as fp16, so it holds "
            "|min| <= 65504 and max - min <= 15·65504")


@pytest.mark.parametrize("case", [_q8_0_k_rotated, _q4_0_v_plain, _q4_1_k_plain], ids=lambda c: c.__name__[1:])
@pytest.mark.parametrize("path", ["roundtrip", "encode"])
def test_scale_overflow_message(case, path):
    name, role, rot, x, lead, tokens, text = case()
    fmt = get_format(name, role=role, rot=rot)
    with pytest.raises(ValueRangeError) as err:
        getattr(fmt, path)(x)
    assert str(err.value) == text
    assert (err.value.lead, err.value.tokens) == (lead, tokens)


# --- blocks.py: decode's size check --------------------------------------------------------
def test_decode_refuses_a_buffer_of_the_wrong_size():
    fmt = get_format("q4_0", role="k", rot=False)
    p = fmt.encode(torch.ones(2, 64))
    # ggml q4_0: 2 bytes of d + 16 bytes of nibbles per 32 values; 2 tokens x 2 blocks = 72
    assert p.data.shape == (72,)
    short = Packed(p.data[:71], p.n_tokens, p.head_dim, p.meta)
    with pytest.raises(ValueError, match=r"^q4_0: packed buffer has 71 bytes, expected 72 for 2x64$"):
        fmt.decode(short)
