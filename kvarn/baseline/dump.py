"""The baseline dump: full-vocabulary log-probs of the BF16 run at every scored token.

Owns the file format, its writer (streamed chunk by chunk, atomic) and its reader
(memory-mapped, verified against what the caller expects).

Encoding (llama-perplexity's `log_softmax(..., uint16_t * log_prob, ...)`): per row
(one scored token) with top log-prob `hi`, the range is `lo = max(min_v lp_v, hi − 16)`
… `hi`; `scale = (hi − lo)/65535`; `code_v = round((lp_v − lo)/scale)` for `lp_v > lo`,
else 0; stored as `[scale: f32, lo: f32, code_0 … code_{V−1}: u16, pad to even]`, i.e.
`nv = 2·⌈V/2⌉ + 4` uint16 per row, the same row layout llama.cpp writes. Decoding is
`scale·code + lo`. One deliberate difference: the stored `lo` is shifted by δ (|δ| ≤
scale/2) so the decoded probabilities above −16 nats keep their true total mass, which
removes the first-order KLD bias of the rounding, and lo's fp32 rounding is taken up by a
few ulps of lo and scale (see `_mass_corrected_floor`). Every entry at or above the range
floor then decodes within `scale ≤ 16/65535 ≈ 2.44e-4` nats (plus fp32 rounding and
< 3e-5 of ulps) of its true value (`scale/2` without the shift); entries below
`hi − 16` read back as the floor (≤ −16 nats), which `kvarn.stats.metrics` leaves out of the
KLD sum exactly as llama.cpp does.

File: a 64-byte preamble (magic, file version, offset and length of the JSON header),
the payload, then the JSON header. The header is written last so it can carry the
payload's per-chunk sha256; a truncated file loses it and is refused. Two payload
layouts, told apart by the file version (header `layout`):

* version 1, `dense` (the former format; still read, and written on request): chunks ×
  rows × nv uint16, every row llama.cpp's row.
* version 2, `sparse` (the default): the same rows without their zero codes. A zero code
  (the floor, and entries within half a step of it) decodes to `lo` whether it is stored
  or not, so nothing is lost: a decoded row is bit-identical to the dense row's, and so
  are the metrics (tested). A row is either `[scale: f32, lo: f32, bitmap, codes]`, the
  bitmap of V bits (bit v set iff code_v ≠ 0, little bit order, padded to a multiple of
  8 bytes: `bitmap_bytes(V)`) followed by the nonzero codes in vocabulary order, 2 bytes
  each; or, when that is not shorter, the dense row verbatim (2·nv bytes), so no row is
  longer than llama.cpp's. A row's length says which (sparse rows are strictly shorter).
  Rows follow each other chunk after chunk; after the payload, a table of
  n_chunks·n_scored + 1 uint64 row offsets (relative to the payload start, sha256 in the
  header) gives random access to any row slice. At the study's scale that is ~7-8 GB per
  model instead of 65-73 GB dense (projected from measured rows: bench/perf/results/baseline_size.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from kvarn.spec import scoring
from kvarn.files.atomic import atomic_path
from kvarn.stats.metrics import KLD_BASE_FLOOR

MAGIC = b"KVARNKVD"
LAYOUTS = {"dense": 1, "sparse": 2}  # layout -> the preamble's file version; "sparse" is written by default
PREAMBLE = struct.Struct("<8sII QQ")  # magic, file version, reserved, json offset, json length
PAYLOAD_OFFSET = 64
ENCODING = "llama-logprob-u16"
ENCODING_VERSION = 3  # 1: llama.cpp lo; 2: mass-corrected lo; 3: and its fp32 rounding taken up (lo, scale)
RANGE_NATS = 16.0
REQUIRED = ("model", "revision", "tokenizer_hash", "text_sha256", "n_ctx")

_ROWS = 16  # rows encoded per float64 slice
_WRITE_ROWS = 256  # rows encoded, packed and written at a time: no encoded copy of a whole chunk


def row_uint16(vocab_size: int) -> int:
    """uint16 per row: 4 for the f32 scale and floor, the codes, padded to even (llama.cpp)."""
    return 2 * ((vocab_size + 1) // 2) + 4


def bitmap_bytes(vocab_size: int) -> int:
    """Bytes of a sparse row's bitmap: one bit per vocabulary entry, padded to a multiple of 8."""
    return 8 * ((vocab_size + 63) // 64)


LO_ULPS, SCALE_ULPS = 4, 16  # the lattice `_mass_corrected_floor` searches (encoding version 3)


def _mass_corrected_floor(x, codes, scale, lo, hi):
    """Shift `lo` (and nudge `scale`) so the decoded probabilities of the entries the KLD
    sums (base log-prob above KLD_BASE_FLOOR) carry exactly their true mass; returns the
    stored (lo, scale).

    Rounding moves each log-prob by ε ∈ ±scale/2; with a perfect Q the KLD then reads
    ≈ Σ p·ε, a bias of ~1e-5 per token (measured: docs/notes/engine-io.md) that swamps
    the low KLD percentiles of 8-bit caches. Subtracting the p-weighted mean of ε (a
    common shift δ, |δ| ≤ scale/2) cancels it to first order (encoding version 2). Storing
    lo in fp32 then leaves up to half its ulp (~1e-6 nats at 16-32 nats) of δ undone, a
    per-row KLD bias of the same size, ~1 % of a q8_0 cell's median KLD on SmolLM2. Version
    3 takes that residual up on a lattice: lo moved by k of its ulps (|k| ≤ LO_ULPS) moves
    every entry by k·ulp_lo; scale moved by j of its ulps (|j| ≤ SCALE_ULPS) moves entry v
    by j·ulp_s·code_v, i.e. the mass by j·ulp_s·c̄ (c̄ the mass-weighted mean code): the
    pair that leaves the least of δ undone is stored (measured: a perfect Q's mean |KLD|
    drops ~5x, tests/test_dump.py; SmolLM2's q8_0 median KLD moves 0.04 % instead of
    0.96 %, bench/perf/results/baseline_size.md). The row layout and decode rule are llama.cpp's.
    x, codes: fp32 [r, V]; scale, lo, hi: fp32 [r, 1].
    """
    keep = x > KLD_BASE_FLOOR
    p = torch.where(keep, x.exp(), 0.0)
    mass = p.sum(1, keepdim=True).double()
    e = torch.where(keep, (codes * scale + lo).exp(), 0.0)
    # the excess of decoded over true mass, summed as differences (accurate in fp32)
    excess = (e - p).sum(1, keepdim=True).double()
    cbar = (e * codes).sum(1, keepdim=True).double() / e.sum(1, keepdim=True).double().clamp(min=1e-300)
    delta = torch.where(mass > 0, -torch.log1p(excess / mass.clamp(min=1e-300)), 0.0)
    shifted = lo.double() + delta
    # Entries clamped to the floor must stay out of the KLD sum (≤ −16 nats).
    clipped = x.min(dim=1, keepdim=True).values < hi - RANGE_NATS
    shifted = torch.where(clipped, shifted.clamp(max=KLD_BASE_FLOOR), shifted)
    lo32 = shifted.float()
    inf = torch.tensor(float("inf"))
    ulp_lo = (torch.nextafter(lo32, inf) - lo32).double().view(-1, 1, 1)
    ulp_s = (torch.nextafter(scale, inf) - scale).double().view(-1, 1, 1)
    k = torch.arange(-LO_ULPS, LO_ULPS + 1, dtype=torch.float64).view(1, -1, 1)
    j = torch.arange(-SCALE_ULPS, SCALE_ULPS + 1, dtype=torch.float64).view(1, 1, -1)
    undone = ((shifted - lo32.double()).view(-1, 1, 1) - k * ulp_lo - j * ulp_s * cbar.view(-1, 1, 1)).abs()
    undone = undone + 1e-30 * (k.abs() + j.abs())  # ties: the smallest move
    too_high = clipped.view(-1, 1, 1) & (lo32.double().view(-1, 1, 1) + k * ulp_lo > KLD_BASE_FLOOR)
    best = torch.where(too_high, float("inf"), undone).flatten(1).argmin(1)
    kk, jj = k.flatten()[best // j.numel()].view(-1, 1), j.flatten()[best % j.numel()].view(-1, 1)
    new_scale = torch.where(scale > 0, scale.double() + jj * ulp_s.view(-1, 1), 0.0)
    return (lo32.double() + kk * ulp_lo.view(-1, 1)).float(), new_scale.float()


def encode_rows(logp: torch.Tensor, mass_correct: bool = True) -> np.ndarray:
    """[n, V] log-probs -> [n, nv] uint16 rows (header + codes).

    Range ends in float64, stored as fp32; codes from the fp32 values with llama.cpp's
    `(x − lo)·(1/scale)` in fp32 (off by at most ~0.01 of a step from exact rounding).
    `mass_correct=False` gives llama.cpp's `lo` exactly (see `_mass_corrected_floor`)."""
    logp = torch.as_tensor(logp)
    if logp.ndim != 2:
        raise ValueError(f"expected log-probs [n_scored, vocab], got shape {tuple(logp.shape)}")
    n, V = logp.shape
    out = np.zeros((n, row_uint16(V)), dtype=np.uint16)
    for a in range(0, n, _ROWS):
        x = logp[a:a + _ROWS].to("cpu", torch.float32)
        hi = x.amax(dim=1, keepdim=True)
        if not torch.isfinite(hi).all():
            raise ValueError(f"rows {a}..{a + len(x) - 1} have a non-finite maximum log-prob")
        lo64 = torch.maximum(x.amin(dim=1, keepdim=True).double(), hi.double() - RANGE_NATS)
        scale = ((hi.double() - lo64) / 65535.0).float()
        lo = lo64.float()
        inv = torch.where(scale > 0, 1.0 / scale, 0.0)
        codes = ((x - lo) * inv).round_().clamp_(0, 65535)
        codes = torch.where(x > lo, codes, 0.0)
        if mass_correct:
            lo, scale = _mass_corrected_floor(x, codes, scale, lo, hi)
        out[a:a + len(x), 4:4 + V] = codes.numpy().astype(np.uint16)
        out[a:a + len(x), :4] = torch.cat([scale, lo], dim=1).numpy().view(np.uint16)
    return out


def decode_rows(rows: np.ndarray, vocab_size: int, device=None) -> torch.Tensor:
    """[n, nv] uint16 rows -> [n, V] float32 log-probs (`scale·code + lo`) on `device`
    (default CPU): the rows travel as 16-bit codes and are decoded where they are used.
    float64 inside (code·scale, then + lo, two roundings), one rounding to fp32 at the end:
    the same bits on every device."""
    rows = np.array(rows, dtype="<u2", copy=True)
    hdr = torch.from_numpy(np.ascontiguousarray(rows[:, :4]).view(np.float32)).to(device)  # scale, lo
    return _decode_codes(torch.from_numpy(rows.view(np.int16)).to(device)[:, 4:4 + vocab_size], hdr, vocab_size)


def _decode_codes(codes: torch.Tensor, hdr: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """codes [n, V] (uint16 bits in any integer dtype), hdr fp32 [n, 2] (scale, lo) -> fp32 [n, V]:
    the one decode formula of both layouts."""
    out = torch.empty((codes.shape[0], vocab_size), dtype=torch.float32, device=codes.device)
    for a in range(0, codes.shape[0], _ROWS):
        h = hdr[a:a + _ROWS].double()
        c = (codes[a:a + _ROWS].to(torch.int32) & 0xFFFF).double()  # uint16 from int16 bits
        out[a:a + _ROWS] = c.mul_(h[:, :1]).add_(h[:, 1:2])
    return out


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
        out[di] = _decode_codes(torch.from_numpy(p["d_codes"].view(np.int16)).to(dev), hdr[di], vocab_size)
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


def array_sha256(a: np.ndarray) -> str:
    """sha256 of an array's bytes (what a header's `chunk_sha256` and `offsets_sha256` hold)."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(a)).cast("B")).hexdigest()


def write_dump(path: str | os.PathLike, header: dict, blocks: Iterable,
               layout: str = "sparse") -> dict:
    """Encode and stream `blocks` (fp32 log-probs, one block per chunk) to `path`
    atomically; return the header written. A block is a [n_scored, V] tensor, or an
    iterable of [r, V] row slices in order that add up to n_scored rows (so a baseline
    never holds a whole chunk's log-probs: at Qwen 3.6's 64k that is 32 GB). `header` must
    hold REQUIRED; n_chunks and vocab_size, if given, are checked against the blocks.
    `layout`: "sparse" (file version 2, the default) or "dense" (version 1, llama.cpp's
    rows); both decode to the same bits, whatever the slicing."""
    missing = [k for k in REQUIRED if k not in header]
    if missing:
        raise ValueError(f"dump header lacks {missing}; required: {list(REQUIRED)}")
    n_ctx = int(header["n_ctx"])
    n_scored = scoring.n_scored(n_ctx)
    vocab = header.get("vocab_size")

    def slices(i, block):
        nonlocal vocab
        whole = isinstance(block, (torch.Tensor, np.ndarray))
        rows = 0
        for part in ([block] if whole else block):
            part = torch.as_tensor(part)
            if part.ndim != 2 or (whole and part.shape[0] != n_scored) or rows + part.shape[0] > n_scored:
                raise ValueError(
                    f"chunk {i}: block shape {tuple(part.shape)}"
                    + ("" if whole else f" after {rows} rows")
                    + f", expected [{n_scored}, vocab] rows in all for n_ctx={n_ctx}"
                )
            if vocab is None:
                vocab = int(part.shape[1])
            elif part.shape[1] != vocab:
                raise ValueError(f"chunk {i}: vocab {part.shape[1]}, expected {vocab}")
            for a in range(0, part.shape[0], _WRITE_ROWS):
                yield encode_rows(part[a:a + _WRITE_ROWS]), int(vocab)
            rows += part.shape[0]
        if rows != n_scored:
            raise ValueError(f"chunk {i}: {rows} rows, expected {n_scored} for n_ctx={n_ctx}")

    def chunks():
        for i, block in enumerate(blocks):
            yield slices(i, block)

    def full_header(sums):
        if "n_chunks" in header and header["n_chunks"] != len(sums):
            raise ValueError(f"header says n_chunks={header['n_chunks']}, got {len(sums)} blocks")
        if not sums:
            raise ValueError("no blocks to write")
        return {
            **header,
            "n_chunks": len(sums),
            "n_scored": n_scored,
            "vocab_size": int(vocab),
            "row_uint16": row_uint16(int(vocab)),
            "encoding": ENCODING,
            "encoding_version": ENCODING_VERSION,
            "range_nats": RANGE_NATS,
            "checksum": "sha256 per chunk",
        }

    return _write(path, layout, chunks(), full_header)


_LAYOUT_FIELDS = ("layout", "chunk_sha256", "bitmap_bytes", "payload_bytes", "offsets_offset", "offsets_sha256")


def _write(path, layout: str, chunks, full_header) -> dict:
    """The file, atomically: preamble, the payload from `chunks` (per chunk, an iterable of
    (dense uint16 rows [r, nv], V)) in `layout`, the row offset table (sparse), then the JSON
    header `full_header(chunk sha256s)` plus the layout's fields."""
    if layout not in LAYOUTS:
        raise ValueError(f"dump layout {layout!r} is not one of {sorted(LAYOUTS)}")
    sums: list[str] = []
    offsets, pos = [np.zeros(1, dtype=np.int64)], 0
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"\0" * PAYLOAD_OFFSET)
            for parts in chunks:
                h = hashlib.sha256()
                for rows, vocab in parts:
                    if layout == "dense":
                        data = np.ascontiguousarray(rows).astype("<u2", copy=False).tobytes()
                    else:
                        data, lengths = pack_rows(rows, vocab)
                        offsets.append(pos + np.cumsum(lengths))
                    pos += len(data)
                    h.update(data)
                    f.write(data)
                sums.append(h.hexdigest())
            full = {k: v for k, v in full_header(sums).items() if k not in _LAYOUT_FIELDS}
            full.update({"layout": layout, "chunk_sha256": sums})
            if layout == "sparse":
                table = np.concatenate(offsets).astype("<u8").tobytes()
                full.update({"bitmap_bytes": bitmap_bytes(full["vocab_size"]), "payload_bytes": pos,
                             "offsets_offset": PAYLOAD_OFFSET + pos,
                             "offsets_sha256": hashlib.sha256(table).hexdigest()})
                f.write(table)
            blob = json.dumps(full, indent=1, sort_keys=True).encode("utf-8")
            json_offset = f.tell()
            f.write(blob)
            f.seek(0)
            f.write(PREAMBLE.pack(MAGIC, LAYOUTS[layout], 0, json_offset, len(blob)))
            f.flush()
            os.fsync(f.fileno())
    return full


class Dump:
    """A baseline dump opened read-only. `decode(c, a, b, device)` gives rows a..b of
    chunk c as fp32 log-probs (the cells' 64-row slices), `chunk(i)` a whole chunk,
    `dense_rows(c, a, b)` llama.cpp's uint16 rows; each chunk's sha256 is verified the
    first time it is read. `payload` (the memory-mapped codes: [chunk, row, uint16] dense,
    flat uint8 sparse) and `offsets` (sparse: row offsets into it; dense: None) are the
    file's own arrays, read-only."""

    kind = "kvarn"  # vs "llama" (kvarn.llamacpp.llamakld.LlamaKld)

    def __init__(self, path: Path, header: dict, payload: np.memmap, verify: bool,
                 offsets: np.ndarray | None = None):
        self.path, self.header, self.payload = path, header, payload
        self.offsets = offsets  # sparse layout: row offsets into the uint8 payload; dense: None
        self._verify = verify
        self._verified: set[int] = set()

    @property
    def n_chunks(self) -> int:
        return int(self.header["n_chunks"])

    @property
    def n_scored(self) -> int:
        return int(self.header["n_scored"])

    @property
    def vocab_size(self) -> int:
        return int(self.header["vocab_size"])

    @property
    def layout(self) -> str:
        return self.header.get("layout", "dense")

    def _rows_span(self, i: int, a: int, b: int | None) -> tuple[int, int]:
        if not 0 <= i < self.n_chunks:
            raise IndexError(f"chunk {i} out of range: dump {self.path} has {self.n_chunks} chunks")
        b = self.n_scored if b is None else min(b, self.n_scored)
        if not 0 <= a <= b:
            raise IndexError(f"rows {a}..{b} out of range: dump {self.path} has {self.n_scored} rows per chunk")
        if self._verify and i not in self._verified:
            if self.offsets is None:
                got = array_sha256(self.payload[i])
            else:
                r = self.offsets[i * self.n_scored:(i + 1) * self.n_scored + 1:self.n_scored]
                got = array_sha256(self.payload[r[0]:r[1]])
            want = self.header["chunk_sha256"][i]
            if got != want:
                raise ValueError(f"dump {self.path}: chunk {i} sha256 {got} does not match the header's {want}")
            self._verified.add(i)
        return a, b

    def decode(self, i: int, a: int = 0, b: int | None = None, device=None) -> torch.Tensor:
        """Rows a..b of chunk i, float32 [b − a, vocab] log-probs on `device` (default CPU)."""
        a, b = self._rows_span(i, a, b)
        if self.offsets is None:
            return decode_rows(self.payload[i, a:b], self.vocab_size, device)
        o = self.offsets[i * self.n_scored + a:i * self.n_scored + b + 1]
        return decode_packed(np.asarray(self.payload[o[0]:o[-1]]), o[:-1] - o[0], np.diff(o), self.vocab_size,
                             device, where=f"dump {self.path}, chunk {i} from row {a}")

    def chunk(self, i: int) -> torch.Tensor:
        """Chunk i's decoded base log-probs, float32 [n_scored, vocab]."""
        return self.decode(i)

    def dense_rows(self, i: int, a: int = 0, b: int | None = None) -> np.ndarray:
        """Rows a..b of chunk i in llama.cpp's layout, uint16 [b − a, nv] (what the dense layout stores)."""
        a, b = self._rows_span(i, a, b)
        if self.offsets is None:
            return np.asarray(self.payload[i, a:b])
        o = self.offsets[i * self.n_scored + a:i * self.n_scored + b + 1]
        return unpack_rows(np.asarray(self.payload[o[0]:o[-1]]), o[:-1] - o[0], np.diff(o), self.vocab_size,
                           where=f"dump {self.path}, chunk {i} from row {a}")


def _read_header(path: Path) -> tuple[dict, int, int]:
    """(header, json offset, file version), the payload's extent checked against the header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        pre = f.read(PREAMBLE.size)
        if len(pre) < PREAMBLE.size:
            raise ValueError(f"dump {path} is truncated: {size} bytes, shorter than its preamble")
        magic, version, _, json_offset, json_len = PREAMBLE.unpack(pre)
        if magic != MAGIC:
            raise ValueError(f"{path} is not a kvarn dump (magic {magic!r}, expected {MAGIC!r})")
        if version not in LAYOUTS.values():
            raise ValueError(f"dump {path} has file version {version}, this reader reads "
                             f"{sorted(LAYOUTS.values())} ({', '.join(f'{v}: {k}' for k, v in LAYOUTS.items())})")
        if json_offset == 0 or size != json_offset + json_len:
            raise ValueError(
                f"dump {path} is truncated or incomplete: {size} bytes, header says "
                f"{json_offset + json_len}" if json_offset else f"dump {path} was never finished"
            )
        f.seek(json_offset)
        header = json.loads(f.read(json_len).decode("utf-8"))
    layout = header.get("layout", "dense")
    if LAYOUTS.get(layout) != version:
        raise ValueError(f"dump {path}: header layout {layout!r} does not match file version {version}")
    if version == 1:
        expected = PAYLOAD_OFFSET + 2 * header["n_chunks"] * header["n_scored"] * header["row_uint16"]
    else:
        expected = header["offsets_offset"] + 8 * (header["n_chunks"] * header["n_scored"] + 1)
    if json_offset != expected:
        raise ValueError(f"dump {path}: payload is {json_offset - PAYLOAD_OFFSET} bytes, header implies "
                         f"{expected - PAYLOAD_OFFSET}")
    return header, json_offset, version


def _read_offsets(path: Path, header: dict, verify: bool) -> np.ndarray:
    """The sparse layout's row offset table, checked: sha256 (with `verify`), and every row
    a possible length (dense, or sparse and shorter), ending where the payload ends."""
    n = header["n_chunks"] * header["n_scored"]
    with open(path, "rb") as f:
        f.seek(header["offsets_offset"])
        raw = f.read(8 * (n + 1))
    if verify and hashlib.sha256(raw).hexdigest() != header["offsets_sha256"]:
        raise ValueError(f"dump {path}: row offset table sha256 does not match the header's {header['offsets_sha256']}")
    off = np.frombuffer(raw, dtype="<u8").astype(np.int64)
    V = header["vocab_size"]
    dense_len, nb = 2 * row_uint16(V), bitmap_bytes(V)
    lengths = np.diff(off)
    ok = (lengths == dense_len) | ((lengths >= 8 + nb) & (lengths < dense_len) & (lengths % 2 == 0))
    if off[0] != 0 or not ok.all():
        r = 0 if off[0] != 0 else int(np.flatnonzero(~ok)[0])
        c, row = divmod(r, header["n_scored"])
        got = int(off[0]) if off[0] != 0 else int(lengths[r])
        raise ValueError(
            f"dump {path}: row offset table is corrupt at chunk {c} row {row}: "
            + (f"the table starts at {got}, not 0" if off[0] != 0 else
               f"a row of {got} bytes; a row is {dense_len} bytes (dense) or 8 + {nb} + 2·k < {dense_len} (sparse)"))
    if off[-1] != header["payload_bytes"] or PAYLOAD_OFFSET + off[-1] != header["offsets_offset"]:
        raise ValueError(f"dump {path}: row offset table ends at byte {int(off[-1])}, the payload is "
                         f"{header['offsets_offset'] - PAYLOAD_OFFSET} bytes (header payload_bytes "
                         f"{header['payload_bytes']}): offset out of range")
    return off


def open_dump(path: str | os.PathLike, expect: dict | None = None, verify: bool = True) -> Dump:
    """Open a dump written by `write_dump` (either layout). Every key of `expect` must equal
    the header's (ValueError naming the field, expected and found). With `verify`, the row
    offset table's sha256 is checked now and each chunk's the first time it is read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no baseline dump at {path}; make it with `kvarn baseline`")
    header, _, version = _read_header(path)
    if header.get("encoding") != ENCODING or header.get("encoding_version") not in (1, 2, 3):
        raise ValueError(
            f"dump {path}: encoding {header.get('encoding')!r} v{header.get('encoding_version')}, "
            f"this reader decodes {ENCODING!r} v1 to v3 (one decode rule)"
        )
    for key, want in (expect or {}).items():
        found = header.get(key, "<missing>")
        if found != want:
            raise ValueError(f"dump {path}: header field {key!r} is {found!r}, expected {want!r}")
    if version == 1:
        payload = np.memmap(path, dtype="<u2", mode="r", offset=PAYLOAD_OFFSET,
                            shape=(header["n_chunks"], header["n_scored"], header["row_uint16"]))
        return Dump(path, header, payload, verify)
    offsets = _read_offsets(path, header, verify)
    payload = np.memmap(path, dtype=np.uint8, mode="r", offset=PAYLOAD_OFFSET, shape=(int(offsets[-1]),))
    return Dump(path, header, payload, verify, offsets)


def convert_dump(src: str | os.PathLike, out: str | os.PathLike, layout: str = "sparse") -> dict:
    """Rewrite the dump at `src` in `layout` at `out` (atomic), code for code (the decoded
    log-probs are bit-identical); returns the new header. For dumps written before the
    sparse layout, or a dense copy of a sparse one."""
    d = open_dump(src)
    V, ns = d.vocab_size, d.n_scored
    chunks = (((d.dense_rows(i, a, a + _WRITE_ROWS), V) for a in range(0, ns, _WRITE_ROWS))
              for i in range(d.n_chunks))
    return _write(out, layout, chunks, lambda sums: d.header)
