"""The format interface's own behaviour (kvarn.formats.base, .registry, .floats), checked
against hand-worked cases:

* `ValueRangeError`: where a bad value is (layer, role, head, token or token range, with
  the cache's offset) and its whole message; `check_finite` and `first_bad` name the first
  non-finite element of 2-D to 5-D tensors (head = the last leading index).
* Every refusal's whole text: a role outside k/v, a non-tensor, a 1-D tensor, a token count
  that is not whole groups, a buffer another format or role wrote (including buffers whose
  meta records only one of the two), an unknown or twice-registered format name.
* The base class's defaults: role "k", head dims "any", roundtrip = decode(encode(x)).
* A float format's packed buffer: [..., nbytes] bytes equal to numpy's float16 cast, its
  token count, head dim and meta, for inputs with one leading dim (where [:2] and [:-2]
  differ).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvarn.formats import get_format
from kvarn.formats.base import KVFormat, ValueRangeError, check_finite, first_bad
from kvarn.formats.floats import FloatFormat
from kvarn.formats.registry import register
from paths import REPO


# --- where a bad value is -------------------------------------------------------------
def test_value_range_error_message_names_head_and_token():
    e = ValueRangeError("q4_0", (1, 2), (3, 3), "fp16 scale overflow")
    assert str(e) == "q4_0: head 2, token 3: fp16 scale overflow"
    assert (e.name, e.lead, e.tokens, e.detail) == ("q4_0", (1, 2), (3, 3), "fp16 scale overflow")


@pytest.mark.parametrize("lead,tokens,args,want", [
    ((1, 2), (3, 3), (), "head 2, token 3"),
    ((1, 2), (3, 3), (5, 100, "K (body, q4_0)"), "layer 5, K (body, q4_0) head 2, token 103"),
    ((0, 1), (128, 255), (2, 10, "V"), "layer 2, V head 1, tokens 138..265"),
    ((0, 1), (128, 255), (), "head 1, tokens 128..255"),
    ((), (4, 4), (), "head 0, token 4"),  # a 2-D [n_tokens, head_dim] input has no head index
    ((4, 5, 6), (0, 0), (), "head 6, token 0"),  # [a, b, head, n, D]: the head is the last
    ((1, 2), (3, 3), (0,), "layer 0, head 2, token 3"),  # layer 0 is named
    ((1, 2), (3, 3), (None, 7), "head 2, token 10"),
    ((1, 2), (3, 3), (None, 0, "K"), "K head 2, token 3"),
], ids=["default", "layer-offset-role", "token-range-offset", "token-range", "no-lead", "three-leading",
        "layer-0", "offset-only", "role-only"])
def test_where(lead, tokens, args, want):
    assert ValueRangeError("x", lead, tokens, "d").where(*args) == want


def test_first_bad_is_the_row_major_first_index():
    bad = torch.zeros(2, 3, 4, dtype=torch.bool)
    bad[1, 2, 3] = True  # flat index 23
    bad[1, 2, 1] = True  # flat index 21: this one is first
    assert first_bad(bad) == (1, 2, 1)
    bad = torch.zeros(5, 7, dtype=torch.bool)
    bad[3, 6] = True  # flat 27 = 3 * 7 + 6
    assert first_bad(bad) == (3, 6)
    assert all(type(i) is int for i in first_bad(bad))


@pytest.mark.parametrize("shape,at,value,want", [
    ((2, 3, 5, 7), (1, 2, 3, 6), float("nan"), "head 2, token 3: the value is nan at channel 6"),
    ((2, 3, 4, 5, 6), (1, 0, 2, 3, 4), float("inf"), "head 2, token 3: the value is inf at channel 4"),
    ((3, 5, 6), (2, 4, 1), float("-inf"), "head 2, token 4: the value is -inf at channel 1"),
    ((5, 6), (3, 2), float("nan"), "head 0, token 3: the value is nan at channel 2"),
], ids=["4d", "5d", "3d", "2d"])
def test_check_finite_names_the_first_non_finite_value(shape, at, value, want):
    y = torch.ones(shape)
    assert check_finite("f16", y, "the value") is y
    y[at] = value
    later = tuple(s - 1 for s in shape)  # a second bad value after the first (row-major)
    y[later] = float("inf")
    with pytest.raises(ValueRangeError) as e:
        check_finite("f16", y, "the value")
    assert str(e.value) == f"f16: {want} (non-finite)"
    assert e.value.lead == at[:-2] and e.value.tokens == (at[-2], at[-2])


# --- refusals -------------------------------------------------------------------------
def test_role_must_be_k_or_v():
    with pytest.raises(ValueError, match=r"^role must be one of \('k', 'v'\), got 'q'$"):
        get_format("f16", role="q")
    with pytest.raises(ValueError, match=r"^role must be one of \('k', 'v'\), got 'K'$"):
        KVFormat(role="K")


def test_default_role_is_k():
    assert KVFormat().role == "k"
    assert FloatFormat("f16").role == "k"
    assert get_format("bf16").role == "k"


@pytest.mark.parametrize("x,kind,want", [
    ([1.0, 2.0], TypeError, "f16: expected a torch.Tensor, got list"),
    (None, TypeError, "f16: expected a torch.Tensor, got NoneType"),
    (torch.zeros(5), ValueError, r"f16: expected \[\.\.\., n_tokens, head_dim\], got shape \(5,\)"),
    (torch.zeros(()), ValueError, r"f16: expected \[\.\.\., n_tokens, head_dim\], got shape \(\)"),
], ids=["list", "none", "1d", "0d"])
def test_check_input_refusals(x, kind, want):
    fmt = get_format("f16")
    for path in (fmt.encode, fmt.roundtrip):
        with pytest.raises(kind, match=f"^{want}$"):
            path(x)


def test_check_input_names_the_token_count_of_an_incomplete_group():
    fmt = get_format("kivi4")  # group 128, checked by the base class
    with pytest.raises(ValueError, match=r"^kivi4: 100 tokens is not a multiple of the group size 128; "
                                         r"pass whole groups$"):
        fmt.encode(torch.zeros(2, 100, 64))  # [batch, n_tokens, head_dim]: shape[2] is not n


def test_decode_refusal_names_both_formats_and_roles():
    packed = get_format("f16", role="k").encode(torch.ones(1, 2, 4))
    want = ("bf16 (V): refusing to decode a buffer written with format='f16', role='k'; "
            "this decoder is format='bf16', role='v'. Decode it with get_format('f16', role='k')")
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        get_format("bf16", role="v").decode(packed)


@pytest.mark.parametrize("meta,reader,want", [
    # a buffer that records only its role: the hint keeps the reader's format
    ({"role": "v"}, ("f16", "k"), "f16 (K): refusing to decode a buffer written with role='v'; "
                                  "this decoder is format='f16', role='k'. Decode it with get_format('f16', role='v')"),
    # one that records only its format: the hint keeps the reader's role
    ({"format": "f16"}, ("bf16", "v"), "bf16 (V): refusing to decode a buffer written with format='f16'; "
                                       "this decoder is format='bf16', role='v'. Decode it with get_format('f16', role='v')"),
], ids=["role-only", "format-only"])
def test_decode_refusal_with_partial_meta(meta, reader, want):
    packed = dataclasses.replace(get_format("f16", role="k").encode(torch.ones(1, 2, 4)), meta=meta)
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        get_format(reader[0], role=reader[1]).decode(packed)


def test_unknown_format_lists_every_name():
    want = ("unknown KV cache type 'q4'; accepted: q8_0, q6_0, q6_1, q5_1, q5_0, q4_1, q4_0, iq4_nl, "
            "q3_1, q3_0, q2_1, q2_0, f32, f16, bf16, kvarn2, kvarn3, kvarn4, kvarn5, kvarn6, kvarn7, "
            "kvarn8, quanto4, quanto2, hqq4, hqq2, kivi4, kivi2")
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        get_format("q4")


def test_register_refuses_a_name_twice():
    with pytest.raises(ValueError, match=r"^format 'f16' registered twice$"):
        register("f16", lambda role="k", rot=True: None)
    assert type(get_format("f16")) is FloatFormat  # the first registration stands


def test_register_adds_a_new_name():
    """In a fresh interpreter, so that the name does not stay in this session's registry (a mutation
    run selects a test by the calls it sees in this process: the refused registration here)."""
    with pytest.raises(ValueError, match=r"^format 'f16' registered twice$"):
        register("f16", lambda role="k", rot=True: None)
    code = ("from kvarn.formats.registry import register, get_format, names\n"
            "register('made-here', lambda role='k', rot=True, **p: ('made', role, rot, p))\n"
            "print(get_format('made-here', role='v', rot=False, iters=2), names()[-1])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stdout) == (0, "('made', 'v', False, {'iters': 2}) made-here\n"), out.stderr


# --- the base class's defaults --------------------------------------------------------
def test_head_dims_default_is_any():
    assert get_format("f16").supported_head_dims() == "any"
    assert KVFormat().supported_head_dims() == "any"


class _Packing(FloatFormat):
    """A float format that reads back through the base class's roundtrip."""

    roundtrip = KVFormat.roundtrip


def test_base_roundtrip_is_decode_of_encode():
    # bf16 keeps 8 significant bits: 1 + 2^-8 is a tie to even (1.0), 1 + 3 * 2^-8 rounds up to 1 + 2^-6
    x = torch.tensor([[1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5]])
    want = torch.tensor([[1.0, 1.0, 1 + 2**-6, -2.5]])
    assert torch.equal(_Packing("bf16", role="v").roundtrip(x), want)


# --- a float format's buffer ----------------------------------------------------------
def test_float_buffer_with_one_leading_dim():
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) / 8 - 1  # [batch, 3 tokens, dim 4], exact in f16
    fmt = get_format("f16", role="v")
    packed = fmt.encode(x)
    assert packed.data.dtype == torch.uint8 and tuple(packed.data.shape) == (2, 3 * 4 * 2)
    assert (packed.n_tokens, packed.head_dim, packed.meta) == (3, 4, {"format": "f16", "role": "v"})
    assert packed.data.numpy().tobytes() == x.numpy().astype(np.float16).tobytes()
    assert torch.equal(fmt.decode(packed), x)


def test_float_buffer_of_one_row_set():
    x = torch.tensor([[0.5, -3.0], [65504.0, 2**-24]])  # [2 tokens, dim 2]: f16's max and smallest subnormal
    packed = get_format("f16", role="k").encode(x)
    assert tuple(packed.data.shape) == (8,) and (packed.n_tokens, packed.head_dim) == (2, 2)
    assert packed.meta == {"format": "f16", "role": "k"}
    assert packed.data.numpy().tobytes() == x.numpy().astype(np.float16).tobytes()
