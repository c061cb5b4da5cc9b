"""The baseline dump: full-vocabulary log-probs of the BF16 run at every scored token, in one file.

Owns the file container, its writer (streamed chunk by chunk, atomic) and its reader
(memory-mapped, verified against what the caller expects). The rows it holds are
`kvarn.baseline.encoding`'s (llama.cpp's row layout); the sparse layout packs them with
`kvarn.baseline.sparse`.

File: a 64-byte preamble (magic, file version, offset and length of the JSON header),
the payload, then the JSON header. The header is written last so it can carry the
payload's per-chunk sha256; a truncated file loses it and is refused. Two payload
layouts, told apart by the file version (header `layout`):

* version 1, `dense` (the former format; still read, and written on request): chunks ×
  rows × nv uint16, every row llama.cpp's row.
* version 2, `sparse` (the default): the same rows without their zero codes
  (`kvarn.baseline.sparse`), decoding to the same bits. Rows follow each other chunk after
  chunk; after the payload, a table of n_chunks·n_scored + 1 uint64 row offsets (relative
  to the payload start, sha256 in the header) gives random access to any row slice. At the
  study's scale that is ~7-8 GB per model instead of 65-73 GB dense (projected from
  measured rows: bench/perf/results/baseline_size.md).

`Dump` is one `kvarn.baseline.protocol.Baseline`; llama-perplexity's KLD base file
(`kvarn.llamacpp_cpu.llamakld.LlamaKld`) is the other.
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

from kvarn.vocab import scoring
from kvarn.files.atomic import atomic_path
from kvarn.baseline.encoding import ENCODING, ENCODING_VERSION, RANGE_NATS, decode_rows, encode_rows, row_uint16
from kvarn.baseline.sparse import bitmap_bytes, decode_packed, pack_rows, unpack_rows

MAGIC = b"KVARNKVD"
LAYOUTS = {"dense": 1, "sparse": 2}  # layout -> the preamble's file version; "sparse" is written by default
PREAMBLE = struct.Struct("<8sII QQ")  # magic, file version, reserved, json offset, json length
PAYLOAD_OFFSET = 64
REQUIRED = ("model", "revision", "tokenizer_hash", "text_sha256", "n_ctx")

_WRITE_ROWS = 256  # rows encoded, packed and written at a time: no encoded copy of a whole chunk


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

    kind = "kvarn"  # vs "llama" (kvarn.llamacpp_cpu.llamakld.LlamaKld): both are a kvarn.baseline.protocol.Baseline

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
