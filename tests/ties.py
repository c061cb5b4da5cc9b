"""Block data full of exact rounding ties, for the oracle comparisons of the block quantizers.

Random data never lands on a tie, so a quantizer that rounds half to even where llama.cpp
rounds half away from zero (or the reverse) agrees with its oracle on it. Here each
32-block has one value that fixes the type's scale `d` at a power of two `s`, and every
other value sits exactly half a step between two codes (x / d = k + 1/2), so every rounding
rule that differs on ties gives other codes.
"""

from __future__ import annotations

import numpy as np

# type -> (rule, number of levels): "q8" amax/127, "sym" signed max / -(levels/2), "asym" (max - min)/(levels - 1)
RULES = {"q8_0": ("q8", 256), "q4_0": ("sym", 16), "q5_0": ("sym", 32), "q4_1": ("asym", 16), "q5_1": ("asym", 32)}


def tie_blocks(kind: str, n_blocks: int, seed: int) -> np.ndarray:
    """float32 [n_blocks, 32]: per block, the anchor(s) that make d = s = 2^e (e in -4..4)
    and 31 (or 30) values at x / d = k + 1/2, in random places."""
    if kind not in RULES:
        raise ValueError(f"no tie rule for {kind!r}; known: {sorted(RULES)}")
    rule, levels = RULES[kind]
    g = np.random.default_rng(seed)
    out = np.empty((n_blocks, 32), np.float64)
    for b in range(n_blocks):
        if rule == "q8":  # amax 127·s -> d = s; halves within (-127, 127)
            anchors = [127.0 * g.choice([-1, 1])]
            halves = g.integers(-127, 127, size=31) + 0.5
        elif rule == "sym":  # the signed max ±half·s -> d = ∓s; halves of smaller magnitude
            half = levels // 2
            anchors = [half * float(g.choice([-1, 1]))]
            halves = g.integers(-half, half, size=31) + 0.5
        else:  # min lo·s and max (lo + levels - 1)·s -> d = s; halves in between
            lo = float(g.integers(-levels, 1))
            anchors = [lo, lo + levels - 1]
            halves = lo + g.integers(0, levels - 1, size=30) + 0.5
        row = np.concatenate([anchors, halves])
        out[b] = g.permutation(row) * 2.0 ** g.integers(-4, 5)
    return out.astype(np.float32)


def tie_count(kind: str, x: np.ndarray) -> int:
    """How many values of `x` (from `tie_blocks`) sit exactly on a half step of their block's d."""
    rule, levels = RULES[kind]
    xb = x.astype(np.float64).reshape(-1, 32)
    if rule == "q8":
        d = np.abs(xb).max(1, keepdims=True) / 127
        t = xb / d
    elif rule == "sym":
        d = np.abs(xb).max(1, keepdims=True) / (levels // 2)
        t = xb / d
    else:
        d = (xb.max(1, keepdims=True) - xb.min(1, keepdims=True)) / (levels - 1)
        t = (xb - xb.min(1, keepdims=True)) / d
    return int((np.abs(t - np.floor(t) - 0.5) == 0).sum())
