"""Both sides of the BeeLlama oracle (bench/oracles/beellama/quant_oracle.py) read into the same
fields: BeeLlama's block and KVarN-record bytes parsed from its ggml-common.h layouts, kvarn's
quantizers' output taken apart the same way. Tested without a build in tests/test_beellama_oracle.py,
against a committed fixture of BeeLlama-produced bytes; the oracle's notes: docs/notes/beellama.md.
"""

from __future__ import annotations

import numpy as np
import torch

from kvarn.formats import get_format
from kvarn.formats import kvarn_tiles, kvarn_type
from kvarn.formats.blocks import QK, SPECS, quantize_blocks


# --- BeeLlama's byte layouts (read from its ggml-common.h block structs) ---------------------
def beellama_block_bytes(name: str) -> int:
    spec = SPECS[name]
    return 2 * (1 + spec.has_min) + QK * spec.bits // 8


def beellama_block_fields(name: str, raw: bytes | np.ndarray):
    """BeeLlama's blocks -> (codes int64 [N, 32], d uint16 [N], m uint16 [N] or None).

    Layouts (per 32-value block, after d and, for *_1, m; all little-endian):
      q8_0  32 x int8                         q4_0/q4_1/iq4_nl  qs[16]: code j low nibble, j+16 high
      q5_0/q5_1  qh uint32 (bit j = bit 4 of code j), qs[16] as q4
      q6_0/q6_1  qh[8], qs[16]: qs as q4 (low 4 bits); qh[j % 8] bits 4*(j // 8) + 0..1 = bits 4-5
                 of code j, + 2..3 = bits 4-5 of code j + 16 (j < 16)
      q3_0/q3_1  qh uint32 (bit j = bit 2 of code j), qs[8]: qs[j % 8] bits 2*(j // 8) = bits 0-1
      q2_0s/q2_1 qs[8]: qs[j % 8] bits 2*(j // 8) = code j
    """
    spec = SPECS[name]
    a = np.frombuffer(raw, np.uint8) if isinstance(raw, (bytes, bytearray)) else np.asarray(raw, np.uint8)
    nb = beellama_block_bytes(name)
    if a.size % nb:
        raise ValueError(f"{name}: {a.size} bytes is not a whole number of {nb}-byte BeeLlama blocks")
    a = a.reshape(-1, nb)
    d = a[:, 0:2].copy().view("<u2")[:, 0]
    m = a[:, 2:4].copy().view("<u2")[:, 0] if spec.has_min else None
    body = a[:, 4 if spec.has_min else 2:].astype(np.int64)
    j = np.arange(QK)
    if spec.kind == "q8":
        q = body.astype(np.uint8).view(np.int8).astype(np.int64)
    elif spec.bits in (4, 5):
        qs = body[:, -16:]
        q = np.concatenate([qs & 0xF, qs >> 4], 1)
        if spec.bits == 5:
            qh = body[:, 0] | body[:, 1] << 8 | body[:, 2] << 16 | body[:, 3] << 24
            q |= ((qh[:, None] >> j) & 1) << 4
    elif spec.bits == 6:
        qh, qs = body[:, :8], body[:, 8:]
        q = np.concatenate([qs & 0xF, qs >> 4], 1)
        jj = j % 16
        hi = (qh[:, jj % 8] >> (4 * (jj // 8) + 2 * (j // 16))) & 3
        q |= hi << 4
    elif spec.bits == 3:
        qh = body[:, 0] | body[:, 1] << 8 | body[:, 2] << 16 | body[:, 3] << 24
        qs = body[:, 4:]
        q = ((qs[:, j % 8] >> (2 * (j // 8))) & 3) | (((qh[:, None] >> j) & 1) << 2)
    elif spec.bits == 2:
        q = (body[:, j % 8] >> (2 * (j // 8))) & 3
    else:
        raise AssertionError(name)
    return q, d, m


def kvarn_block_fields(name: str, x: np.ndarray):
    """kvarn's quantize_blocks on rows of x (float32 [N, n], no rotation) -> the same fields."""
    spec = SPECS[name]
    q, d, m = quantize_blocks(spec, torch.from_numpy(np.ascontiguousarray(x, np.float32)).reshape(-1, QK))
    f16 = lambda v: v.to(torch.float16).view(torch.int16).numpy().astype(np.uint16)[:, 0]  # noqa: E731
    return q.numpy(), f16(d), (f16(m) if m is not None else None)


# --- KVarN records -------------------------------------------------------------------------------
def record_fields(records: np.ndarray, bits: int):
    """Records uint8 [..., payload + 768] -> (payload, scale u16 [..., 128], zero, other)."""
    pb = kvarn_type.payload_nbytes(128, 128, bits)
    r = np.ascontiguousarray(records)
    if r.shape[-1] != pb + 768:
        raise ValueError(f"a {bits}-bit KVarN record is {pb + 768} bytes, got {r.shape[-1]}")
    u16 = lambda lo: r[..., lo:lo + 256].copy().view("<u2")  # noqa: E731
    return r[..., :pb], u16(pb), u16(pb + 256), u16(pb + 512)


def kvarn_records(x: np.ndarray, bits: int, role: str, iters: int = kvarn_tiles.ITERS) -> np.ndarray:
    """kvarn's encode of x [T, H, D] -> uint8 [T/128, H * D/128, tile bytes] (BeeLlama's order)."""
    t, h, d = x.shape
    fmt = get_format(f"kvarn{bits}", role=role, iters=iters, impl="ref")
    data = fmt.encode(torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))).data.numpy()
    return data.reshape(h, t // 128, d // 128, -1).transpose(1, 0, 2, 3).reshape(t // 128, h * d // 128, -1)
