"""kvarn.kvcache.rounding: an operand rounded to TF32 or bf16, and TF32's truncation, bit for bit.

Oracles: a reference written on the fp32 word with numpy, the sign set apart and the magnitude
rounded as unsigned integers (to nearest with ties away from zero for TF32, to nearest even for
bf16, truncation); torch's own bf16 cast; and values worked out by hand. Negative subnormals and
NaN payloads are the cases the word's two's-complement reading got wrong (`bits.abs()`: a negative
subnormal left unrounded, a negative NaN with a low payload turned into -inf, one with a high
payload into +0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvarn.kvcache.rounding import round_operand, round_p, truncate_tf32

SIGN, MAG, INF = 0x80000000, 0x7FFFFFFF, 0x7F800000


def reference(words: np.ndarray, dropped: int, rule: str) -> np.ndarray:
    """fp32 words (uint32) with their low `dropped` bits rounded off by `rule` ("away": to nearest,
    ties away from zero; "even": to nearest, ties to even; "truncate"), the sign apart; inf and nan
    (magnitude >= 0x7F800000) as they are. A carry into the exponent is the next binade (or inf)."""
    sign = words & SIGN
    mag = (words & MAG).astype(np.uint64)
    step, half = 1 << dropped, 1 << (dropped - 1)
    low = mag & (step - 1)
    base = mag - low
    if rule == "truncate":
        up = np.zeros_like(mag, dtype=bool)
    elif rule == "away":
        up = low >= half
    else:
        assert rule == "even", rule
        up = (low > half) | ((low == half) & (((base >> dropped) & 1) == 1))
    out = (base + up * step).astype(np.uint32) | sign
    return np.where(mag >= INF, words, out).astype(np.uint32)


def words_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy().view(np.uint32)


def floats(words) -> torch.Tensor:
    return torch.from_numpy(np.asarray(words, dtype=np.uint32).view(np.int32).copy()).view(torch.float32)


# Negative (and positive) subnormals around TF32's rounding edges, the largest subnormal, NaNs with
# low and high payloads of both signs, infinities, zeros, and the largest finite values.
EDGES = [0x00000001, 0x80000001, 0x80000FFF, 0x80001000, 0x80001001, 0x80001FFF, 0x80002000, 0x80003000,
         0x807FFFFF, 0x007FFFFF, 0x80008000, 0x80018000, 0x8000FFFF,
         0xFF800001, 0xFF801000, 0xFFC00000, 0xFFFFF000, 0xFFFFFFFF, 0x7F800001, 0x7FC00000, 0x7FFFF000,
         0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F801000, 0xBF801000]


def sample_words() -> np.ndarray:
    rng = np.random.default_rng(11)
    rand = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)  # every class, NaNs included
    sub = rng.integers(0, 0x800000, 20_000, dtype=np.uint64).astype(np.uint32)  # subnormals of both signs
    return np.concatenate([np.array(EDGES, dtype=np.uint32), rand, sub, sub | SIGN])


def test_tf32_rounding_matches_the_reference_bit_for_bit():
    w = sample_words()
    got = words_of(round_operand(floats(w), "tfloat32"))
    want = reference(w, 13, "away")
    bad = np.flatnonzero(got != want)  # NaNs included: their words, payload and sign, pass unchanged
    assert bad.size == 0, [(hex(w[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]


def test_tf32_truncation_matches_the_reference_bit_for_bit():
    w = sample_words()
    got = words_of(truncate_tf32(floats(w)))
    want = reference(w, 13, "truncate")
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(w[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]
    # truncation never grows a magnitude; it shrinks every finite value off TF32's grid
    x = floats(w)
    finite = x.isfinite()
    t = truncate_tf32(x)
    assert (t[finite].abs() <= x[finite].abs()).all()
    off_grid = finite & ((torch.from_numpy(w.view(np.int32).copy()) & 0x1FFF) != 0)
    assert (t[off_grid].abs() < x[off_grid].abs()).all()


def test_bf16_rounding_matches_torch_and_the_reference():
    w = sample_words()
    x = floats(w)
    got = round_operand(x, "bfloat16")
    nan = x.isnan()
    assert torch.equal(got[~nan], x[~nan].to(torch.bfloat16).float())  # torch's own cast
    assert got[nan].isnan().all()  # a NaN stays a NaN (its payload is the cast's business)
    want = reference(w, 16, "even")
    keep = ~nan.numpy()
    assert (words_of(got)[keep] == want[keep]).all()


@pytest.mark.parametrize("word,nearest,truncated", [
    # TF32 keeps 10 fraction bits: 1.0's step is 2^-10, and a subnormal's step is 2^13 x 2^-149 = 2^-136.
    (0x3F801000, 0x3F802000, 0x3F800000),  # 1 + 2^-11: a tie, away from zero -> 1 + 2^-10; truncated 1
    (0xBF801800, 0xBF802000, 0xBF800000),  # -(1 + 3 x 2^-12): -(1 + 2^-10) to nearest; truncated -1
    (0xBF800FFF, 0xBF800000, 0xBF800000),  # just under -(1 + 2^-11): -1 both ways
    (0x80000001, 0x80000000, 0x80000000),  # -2^-149, the smallest negative subnormal: -0 (sign kept)
    (0x80001000, 0x80002000, 0x80000000),  # -2^-137: half a subnormal step, a tie -> -2^-136; truncated -0
    (0x80001FFF, 0x80002000, 0x80000000),  # -(2^-136 - 2^-149) -> -2^-136; truncated -0
    (0x80003000, 0x80004000, 0x80002000),  # -3 x 2^-137: a tie between -2^-136 and -2^-135 -> away, -2^-135
    (0x807FFFFF, 0x80800000, 0x807FE000),  # the largest negative subnormal -> -2^-126 (carries into the
                                           # exponent); truncated -(2^-126 - 2^-136)
    (0xFF800001, 0xFF800001, 0xFF800001),  # a negative NaN with payload 1: the same NaN (was -inf)
    (0xFFFFF000, 0xFFFFF000, 0xFFFFF000),  # a negative NaN with a high payload: the same NaN (was +0)
    (0xFF800000, 0xFF800000, 0xFF800000),  # -inf
], ids=lambda w: f"{w:#010x}")
def test_tf32_by_hand(word, nearest, truncated):
    x = floats([word])
    assert words_of(round_operand(x, "tfloat32"))[0] == nearest
    assert words_of(truncate_tf32(x))[0] == truncated


def test_the_p_rule():
    x = floats([0x3F801800, 0xBF801800, 0x3F7FFFFF])  # 1 + 3 x 2^-12, its negative, 1 - 2^-24
    assert words_of(round_p(x, "tfloat32")).tolist() == [0x3F800000, 0xBF800000, 0x3F7FE000]  # the kernel's
    assert torch.equal(round_p(x, "tfloat32", "truncate"), truncate_tf32(x))
    assert torch.equal(round_p(x, "tfloat32", "nearest"), round_operand(x, "tfloat32"))
    assert torch.equal(round_p(x, "bfloat16"), round_operand(x, "bfloat16"))  # bf16: P cast to nearest even
    with pytest.raises(ValueError, match="TF32 P rule 'even'"):
        round_p(x, "tfloat32", "even")
