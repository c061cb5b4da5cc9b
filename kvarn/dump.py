"""The baseline dump: full-vocabulary log-probs of the BF16 run at every scored token.

Owns the file format, its writer (streamed chunk by chunk, atomic) and its reader
(memory-mapped, verified against what the caller expects).

Encoding (llama-perplexity's `log_softmax(..., uint16_t * log_prob, ...)`): per row
(one scored token) with top log-prob `hi`, the range is `lo = max(min_v lp_v, hi − 16)`
… `hi`; `scale = (hi − lo)/65535`; `code_v = round((lp_v − lo)/scale)` for `lp_v > lo`,
else 0; stored as `[scale: f32, lo: f32, code_0 … code_{V−1}: u16, pad to even]`, i.e.
`nv = 2·⌈V/2⌉ + 4` uint16 per row, the same row layout llama.cpp writes. Decoding is
`scale·code + lo`: within `scale/2 ≤ 16/131070 ≈ 1.22e-4` nats (plus fp32 rounding) of the
true value for every entry at or above `lo`; entries below `hi − 16` read back as `lo`
(≤ −16 nats), which `kvarn.metrics` leaves out of the KLD sum exactly as llama.cpp does.

File: a 64-byte preamble (magic, format version, offset and length of the JSON header),
the payload (chunks × rows × nv uint16, little-endian), then the JSON header. The header
is written last so it can carry the payload's per-chunk sha256; a truncated file loses
it and is refused.
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

MAGIC = b"KVARNKVD"
FILE_VERSION = 1
PREAMBLE = struct.Struct("<8sII QQ")  # magic, file version, reserved, json offset, json length
PAYLOAD_OFFSET = 64
ENCODING = "llama-logprob-u16"
ENCODING_VERSION = 1
RANGE_NATS = 16.0
REQUIRED = ("model", "revision", "tokenizer_hash", "text_sha256", "n_ctx")

_ROWS = 16  # rows encoded per float64 slice


def row_uint16(vocab_size: int) -> int:
    """uint16 per row: 4 for the f32 scale and floor, the codes, padded to even (llama.cpp)."""
    return 2 * ((vocab_size + 1) // 2) + 4


def encode_rows(logp: torch.Tensor) -> np.ndarray:
    """[n, V] log-probs -> [n, nv] uint16 rows (header + codes). Computed in float64; the
    stored scale and floor are fp32 and the codes are made against those fp32 values."""
    logp = torch.as_tensor(logp)
    if logp.ndim != 2:
        raise ValueError(f"expected log-probs [n_scored, vocab], got shape {tuple(logp.shape)}")
    n, V = logp.shape
    out = np.zeros((n, row_uint16(V)), dtype=np.uint16)
    for a in range(0, n, _ROWS):
        x = logp[a:a + _ROWS].to("cpu", torch.float64)
        if not torch.isfinite(x.max(dim=1).values).all():
            raise ValueError(f"rows {a}..{a + len(x) - 1} have a non-finite maximum log-prob")
        hi = x.max(dim=1, keepdim=True).values
        lo = torch.maximum(x.min(dim=1, keepdim=True).values, hi - RANGE_NATS)
        scale = ((hi - lo) / 65535.0).float().double()  # stored as f32
        lo = lo.float().double()
        safe = torch.where(scale > 0, scale, 1.0)
        codes = torch.where(x > lo, torch.round((x - lo) / safe), 0.0).clamp_(0, 65535)
        codes = torch.where(scale > 0, codes, 0.0)
        out[a:a + len(x), 4:4 + V] = codes.numpy().astype(np.uint16)
        hdr = torch.cat([scale, lo], dim=1).float().numpy()  # [rows, 2] f32
        out[a:a + len(x), :4] = hdr.view(np.uint16)
    return out


def decode_rows(rows: np.ndarray, vocab_size: int) -> torch.Tensor:
    """[n, nv] uint16 rows -> [n, V] float32 log-probs (`scale·code + lo`)."""
    rows = np.asarray(rows)
    hdr = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # [n, 2]: scale, lo
    codes = rows[:, 4:4 + vocab_size].astype(np.float32)
    return torch.from_numpy(codes * hdr[:, :1] + hdr[:, 1:2])


def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(a)).cast("B")).hexdigest()


def write_dump(path: str | os.PathLike, header: dict, blocks: Iterable[torch.Tensor]) -> dict:
    """Encode and stream `blocks` (fp32 log-probs [n_scored, V], one per chunk) to `path`
    atomically; return the header written. `header` must hold REQUIRED; n_chunks and
    vocab_size, if given, are checked against the blocks."""
    missing = [k for k in REQUIRED if k not in header]
    if missing:
        raise ValueError(f"dump header lacks {missing}; required: {list(REQUIRED)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    n_ctx = int(header["n_ctx"])
    n_scored = n_ctx - 1 - n_ctx // 2
    vocab = header.get("vocab_size")
    sums: list[str] = []
    try:
        with open(tmp, "wb") as f:
            f.write(b"\0" * PAYLOAD_OFFSET)
            for i, block in enumerate(blocks):
                block = torch.as_tensor(block)
                if block.ndim != 2 or block.shape[0] != n_scored:
                    raise ValueError(
                        f"chunk {i}: block shape {tuple(block.shape)}, expected "
                        f"[{n_scored}, vocab] for n_ctx={n_ctx}"
                    )
                if vocab is None:
                    vocab = int(block.shape[1])
                elif block.shape[1] != vocab:
                    raise ValueError(f"chunk {i}: vocab {block.shape[1]}, expected {vocab}")
                rows = encode_rows(block)
                sums.append(_sha256(rows))
                f.write(rows.astype("<u2", copy=False).tobytes())
            if "n_chunks" in header and header["n_chunks"] != len(sums):
                raise ValueError(f"header says n_chunks={header['n_chunks']}, got {len(sums)} blocks")
            if not sums:
                raise ValueError("no blocks to write")
            full = {
                **header,
                "n_chunks": len(sums),
                "n_scored": n_scored,
                "vocab_size": int(vocab),
                "row_uint16": row_uint16(int(vocab)),
                "encoding": ENCODING,
                "encoding_version": ENCODING_VERSION,
                "range_nats": RANGE_NATS,
                "checksum": "sha256 per chunk",
                "chunk_sha256": sums,
            }
            blob = json.dumps(full, indent=1, sort_keys=True).encode("utf-8")
            json_offset = f.tell()
            f.write(blob)
            f.seek(0)
            f.write(PREAMBLE.pack(MAGIC, FILE_VERSION, 0, json_offset, len(blob)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return full


class Dump:
    """A baseline dump opened read-only; `chunk(i)` decodes one chunk (verified lazily)."""

    def __init__(self, path: Path, header: dict, payload: np.memmap, verify: bool):
        self.path, self.header, self._payload = path, header, payload
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

    def rows(self, i: int) -> np.ndarray:
        """The raw uint16 rows [n_scored, nv] of chunk i, checksum verified once."""
        if not 0 <= i < self.n_chunks:
            raise IndexError(f"chunk {i} out of range: dump {self.path} has {self.n_chunks} chunks")
        rows = self._payload[i]
        if self._verify and i not in self._verified:
            got, want = _sha256(rows), self.header["chunk_sha256"][i]
            if got != want:
                raise ValueError(f"dump {self.path}: chunk {i} sha256 {got} does not match the header's {want}")
            self._verified.add(i)
        return rows

    def chunk(self, i: int) -> torch.Tensor:
        """Chunk i's decoded base log-probs, float32 [n_scored, vocab]."""
        return decode_rows(self.rows(i), self.vocab_size)


def _read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        pre = f.read(PREAMBLE.size)
        if len(pre) < PREAMBLE.size:
            raise ValueError(f"dump {path} is truncated: {size} bytes, shorter than its preamble")
        magic, version, _, json_offset, json_len = PREAMBLE.unpack(pre)
        if magic != MAGIC:
            raise ValueError(f"{path} is not a kvarn dump (magic {magic!r}, expected {MAGIC!r})")
        if version != FILE_VERSION:
            raise ValueError(f"dump {path} has file version {version}, this reader reads {FILE_VERSION}")
        if json_offset == 0 or size != json_offset + json_len:
            raise ValueError(
                f"dump {path} is truncated or incomplete: {size} bytes, header says "
                f"{json_offset + json_len}" if json_offset else f"dump {path} was never finished"
            )
        f.seek(json_offset)
        header = json.loads(f.read(json_len).decode("utf-8"))
    expected = PAYLOAD_OFFSET + 2 * header["n_chunks"] * header["n_scored"] * header["row_uint16"]
    if json_offset != expected:
        raise ValueError(f"dump {path}: payload is {json_offset - PAYLOAD_OFFSET} bytes, header implies "
                         f"{expected - PAYLOAD_OFFSET}")
    return header, json_offset


def open_dump(path: str | os.PathLike, expect: dict | None = None, verify: bool = True) -> Dump:
    """Open a dump written by `write_dump`. Every key of `expect` must equal the header's
    (ValueError naming the field, expected and found). With `verify`, each chunk's
    sha256 is checked the first time it is read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no baseline dump at {path}; make it with `kvarn baseline`")
    header, _ = _read_header(path)
    if header.get("encoding") != ENCODING or header.get("encoding_version") != ENCODING_VERSION:
        raise ValueError(
            f"dump {path}: encoding {header.get('encoding')!r} v{header.get('encoding_version')}, "
            f"this reader decodes {ENCODING!r} v{ENCODING_VERSION}"
        )
    for key, want in (expect or {}).items():
        found = header.get(key, "<missing>")
        if found != want:
            raise ValueError(f"dump {path}: header field {key!r} is {found!r}, expected {want!r}")
    payload = np.memmap(path, dtype="<u2", mode="r", offset=PAYLOAD_OFFSET,
                        shape=(header["n_chunks"], header["n_scored"], header["row_uint16"]))
    return Dump(path, header, payload, verify)
