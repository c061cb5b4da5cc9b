"""Normalized Sylvester Walsh-Hadamard matrices and block-diagonal rotations.

H_n is symmetric and orthonormal (H @ H = I), built without random signs, as in
llama.cpp's attention rotation and the KVarN reference.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _sylvester(n: int) -> torch.Tensor:
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two >= 1, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def hadamard(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The normalized n x n Sylvester Hadamard matrix (symmetric, H @ H = I)."""
    return _sylvester(n).to(dtype=dtype, device=device)


def rotate_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Apply H_block to consecutive blocks of `block` values along the last dim.

    The rotation is its own inverse, so the same call rotates back.
    """
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"head dim {d} is not a multiple of the rotation block {block}")
    h = hadamard(block, dtype=x.dtype, device=x.device)
    y = x.reshape(*x.shape[:-1], d // block, block) @ h
    return y.reshape(x.shape)


def k_rotation_block(head_dim: int) -> int:
    """llama.cpp's K rotation block: largest power of two >= 64 dividing head_dim, at most 256."""
    best = 0
    b = 64
    while b <= min(256, head_dim):
        if head_dim % b == 0:
            best = b
        b *= 2
    if not best:
        raise ValueError(
            f"head dim {head_dim} has no power-of-two divisor in [64, 256]; "
            "K rotation needs one (use rot=False for this head dim)"
        )
    return best


V_ROTATION_BLOCK = 64
