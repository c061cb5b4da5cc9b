"""The sparse row layout of the baseline dump (file version 2): llama.cpp's rows without their zero codes.

A zero code (the floor, and entries within half a step of it) decodes to `lo` whether it
is stored or not, so nothing is lost: a decoded row is bit-identical to the dense row's
(`kvarn.baseline.encoding`), and so are the metrics (tested). A row is either `[scale: f32,
lo: f32, bitmap, codes]`, the bitmap of V bits (bit v set iff code_v ≠ 0, little bit
order, padded to a multiple of 8 bytes: `bitmap_bytes(V)`) followed by the nonzero codes in
vocabulary order, 2 bytes each; or, when that is not shorter, the dense row verbatim (2·nv
bytes), so no row is longer than llama.cpp's. A row's length says which (sparse rows are
strictly shorter). Packing (`pack_rows`), unpacking to llama.cpp's rows (`unpack_rows`) and
decoding straight to log-probs (`decode_packed`, on the host or on an accelerator).
"""

from __future__ import annotations

import numpy as np
import torch

from kvarn.baseline.encoding import decode_codes, row_uint16


def bitmap_bytes(vocab_size: int) -> int:
    """Bytes of a sparse row's bitmap: one bit per vocabulary entry, padded to a multiple of 8."""
    return 8 * ((vocab_size + 63) // 64)


def pack_rows(rows: np.ndarray, vocab_size: int) -> tuple[bytes, np.ndarray]:
    """Dense [n, nv] uint16 rows -> (the bytes of the sparse layout, each row's length in
    bytes): `[scale, lo, bitmap, nonzero codes]`, or the dense row where that is not shorter."""
    rows = np.asarray(rows, dtype=np.uint16)
    n, nv = rows.shape
    codes = rows[:, 4:4 + vocab_size]
    nz = codes != 0
    nnz = nz.sum(1)
    dense_len, nb = 2 * nv, bitmap_bytes(vocab_size)
    sparse = 8 + nb + 2 * nnz < dense_len
    bits = np.zeros((n, nb), dtype=np.uint8)
    bits[:, :(vocab_size + 7) // 8] = np.packbits(nz, axis=1, bitorder="little")
    vals = codes[nz].astype("<u2")  # row after row, vocabulary order
    ends = np.cumsum(nnz)
    parts = []
    for r in range(n):
        if sparse[r]:
            parts += [rows[r, :4].astype("<u2").tobytes(), bits[r].tobytes(), vals[ends[r] - nnz[r]:ends[r]].tobytes()]
        else:
            parts.append(rows[r].astype("<u2").tobytes())
    return b"".join(parts), np.where(sparse, 8 + nb + 2 * nnz, dense_len).astype(np.int64)


def _parse(blob: np.ndarray, starts: np.ndarray, lengths: np.ndarray, vocab_size: int) -> dict:
    """Rows of the sparse layout, split on the host without expanding anything: hdr fp32
    [n, 2] (scale, lo); the dense rows' indices and codes uint16 [nd, V]; the sparse rows'
    indices, bitmaps uint8 [ns, nb], code counts (from their lengths) and nonzero codes
    uint16 [Σ count], row after row."""
    nb, dense_len = bitmap_bytes(vocab_size), 2 * row_uint16(vocab_size)
    dense = lengths == dense_len
    st, ln = starts[~dense], lengths[~dense]
    return {
        "hdr": blob[starts[:, None] + np.arange(8)].view(np.float32),
        "d_idx": np.flatnonzero(dense),
        "d_codes": np.stack([blob[s + 8:s + 8 + 2 * vocab_size] for s in starts[dense]]).view("<u2")
        if dense.any() else None,
        "s_idx": np.flatnonzero(~dense),
        "bitmaps": blob[st[:, None] + 8 + np.arange(nb)],
        "counts": (ln - 8 - nb) // 2,
        "vals": np.concatenate([blob[s + 8 + nb:s + k] for s, k in zip(st, ln)] or [blob[:0]]).view("<u2"),
    }


def _check_counts(got: np.ndarray, p: dict, where: str) -> None:
    if not np.array_equal(got, p["counts"]):
        r = int(np.flatnonzero(got != p["counts"])[0])
        raise ValueError(f"{where}: row {int(p['s_idx'][r])} has {int(got[r])} bits set in its bitmap but room "
                         f"for {int(p['counts'][r])} codes: the dump is corrupt")


def unpack_rows(blob: np.ndarray, starts: np.ndarray, lengths: np.ndarray, vocab_size: int,
                where: str = "sparse rows") -> np.ndarray:
    """Rows of the sparse layout (bytes `blob`, each row's start and length in it) -> the
    dense rows, llama.cpp's layout, uint16 [n, nv]. A row whose bitmap disagrees with its
    length is refused (ValueError naming `where` and the row)."""
    p = _parse(blob, starts, lengths, vocab_size)
    out = np.zeros((len(starts), row_uint16(vocab_size)), dtype=np.uint16)
    out[:, :4] = p["hdr"].view(np.uint16)
    out[p["d_idx"], 4:4 + vocab_size] = p["d_codes"] if len(p["d_idx"]) else 0
    mask = np.unpackbits(p["bitmaps"], axis=1, bitorder="little").view(bool)
    _check_counts(np.count_nonzero(mask, axis=1), p, where)
    codes = np.zeros(mask.shape, dtype=np.uint16)
    codes[mask] = p["vals"]
    out[p["s_idx"], 4:4 + vocab_size] = codes[:, :vocab_size]
    return out


def decode_packed(blob: np.ndarray, starts: np.ndarray, lengths: np.ndarray, vocab_size: int,
                  device=None, where: str = "sparse rows", host: bool | None = None) -> torch.Tensor:
    """Rows of the sparse layout -> fp32 log-probs [n, V] on `device` (default CPU), the
    same bits as `decode_rows` of the dense rows: the nonzero codes by its formula
    (`code·scale + lo` in float64, one rounding), every other entry `lo` (what `0·scale + lo`
    gives exactly). For an accelerator only the stored bytes travel and the bitmaps are
    expanded there; on the CPU numpy does it (`host`, default: device is the CPU; several
    times faster there than torch's masked_scatter)."""
    p = _parse(blob, starts, lengths, vocab_size)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    host = dev.type == "cpu" if host is None else host
    hdr = torch.from_numpy(np.ascontiguousarray(p["hdr"])).to(dev)
    out = torch.empty((len(starts), vocab_size), dtype=torch.float32, device=dev)
    if len(p["d_idx"]):
        di = torch.from_numpy(p["d_idx"]).to(dev)
        out[di] = decode_codes(torch.from_numpy(p["d_codes"].view(np.int16)).to(dev), hdr[di], vocab_size)
    if not len(p["s_idx"]):
        return out
    h = p["hdr"][p["s_idx"]]
    if host:
        mask = np.unpackbits(p["bitmaps"], axis=1, bitorder="little").view(bool)
        counts = np.count_nonzero(mask, axis=1)
        _check_counts(counts, p, where)
        h64 = h.astype(np.float64)
        x = (p["vals"].astype(np.float64) * np.repeat(h64[:, 0], counts) + np.repeat(h64[:, 1], counts))
        sparse = np.empty(mask.shape, dtype=np.float32)
        sparse[...] = h[:, 1:2]  # lo everywhere ...
        sparse[mask] = x.astype(np.float32)  # ... and the nonzero codes decoded
        sparse = torch.from_numpy(sparse).to(dev)
    else:
        bm = torch.from_numpy(p["bitmaps"]).to(dev)
        mask = ((bm.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=dev)) & 1).view(len(bm), -1).bool()
        counts = mask.sum(1)
        _check_counts(counts.cpu().numpy(), p, where)
        h = torch.from_numpy(np.ascontiguousarray(h)).to(dev)
        h64 = h.double()
        vals = torch.from_numpy(p["vals"].view(np.int16)).to(dev).to(torch.int32) & 0xFFFF
        x = vals.double().mul_(h64[:, 0].repeat_interleave(counts)).add_(h64[:, 1].repeat_interleave(counts))
        sparse = h[:, 1:2].expand(mask.shape).contiguous()
        sparse.masked_scatter_(mask, x.float())
    if len(p["d_idx"]):
        out[torch.from_numpy(p["s_idx"]).to(dev)] = sparse[:, :vocab_size]
        return out
    return sparse[:, :vocab_size]
