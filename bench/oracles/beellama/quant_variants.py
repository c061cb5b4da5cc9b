"""The KVarN arithmetic variants a difference from BeeLlama is checked against (the BeeLlama
oracle, bench/oracles/beellama/quant_oracle.py): glibc's expf / logf in place of float64-and-round
(`libm_math`), kvarn's version-1 normalization (`v1_math`), and which pass each keeps
(`pass_choice`). Why the versions differ: docs/notes/beellama.md.
"""

from __future__ import annotations

import numpy as np
import torch

from kvarn.formats import kvarn_tiles


# --- glibc's expf / logf, for the check that nothing but their last bit differs ----------------
def _libm_fn(name: str):
    import ctypes
    import ctypes.util

    f = getattr(ctypes.CDLL(ctypes.util.find_library("m")), name)
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]

    def call(t: torch.Tensor) -> torch.Tensor:
        flat = t.float().reshape(-1).tolist()
        return torch.tensor([f(v) for v in flat], dtype=torch.float32).reshape(t.shape)

    return call


class libm_math:
    """Within this context kvarn's KVarN takes exp and log from the C library's expf/logf
    (what BeeLlama's CPU code calls) instead of float64-and-round: slow, for checks only."""

    def __enter__(self):
        self.saved = kvarn_tiles.exp32, kvarn_tiles.log32
        kvarn_tiles.exp32, kvarn_tiles.log32 = _libm_fn("expf"), _libm_fn("logf")

    def __exit__(self, *exc):
        kvarn_tiles.exp32, kvarn_tiles.log32 = self.saved


def _v1_sample_std(y: torch.Tensor, dim: int) -> torch.Tensor:
    """kvarn's sample std before format version 2: two-pass fp32 in torch's sum order."""
    n = y.shape[dim]
    dev = y - y.sum(dim, keepdim=True) / n
    return torch.sqrt((dev * dev).sum(dim) / (n - 1))


class v1_math:
    """Within this context KVarN's normalization uses kvarn's version-1 arithmetic (two-pass
    fp32 stds, torch's fp32 exp/log): for the before/after counts only."""

    def __enter__(self):
        self.saved = kvarn_tiles.sample_std, kvarn_tiles.exp32, kvarn_tiles.log32
        kvarn_tiles.sample_std, kvarn_tiles.exp32, kvarn_tiles.log32 = _v1_sample_std, torch.exp, torch.log

    def __exit__(self, *exc):
        kvarn_tiles.sample_std, kvarn_tiles.exp32, kvarn_tiles.log32 = self.saved


def pass_choice(x: np.ndarray, role: str, bits: int = 4) -> dict:
    """On BeeLlama's own tiles of x [T, H, D] (butterfly rotation, F16 stage): how many tiles
    keep another normalization pass than BeeLlama's arithmetic (libm_math, byte-exact) under
    kvarn's version-1 and version-2 arithmetic, and how many dequantized values differ."""
    xt = torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))
    tiles = kvarn_tiles.to_tiles(kvarn_tiles.stage(kvarn_tiles.rotate(xt)), role)
    tiles = tiles.reshape(-1, *tiles.shape[-2:])
    out = {}
    for name, ctx in (("bee", libm_math), ("v1", v1_math), ("v2", None)):
        with ctx() if ctx else _null():
            p = kvarn_tiles.normalize_choice(tiles)[2]
            deq = kvarn_tiles.dequantize_tiles_ref(*kvarn_tiles.quantize_tiles_ref(tiles, bits))
        out[name] = (p, deq)
    pb, db = out["bee"]
    res = {"tiles": len(tiles)}
    for name in ("v1", "v2"):
        p, d = out[name]
        res[f"{name} pass"] = int((p != pb).sum())
        res[f"{name} values"] = int((d != db).sum())
    res["values"] = db.numel()
    return res


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None
