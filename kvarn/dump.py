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
removes the first-order KLD bias of the rounding (see `_mass_corrected_floor`). Every
entry at or above the range floor then decodes within `scale ≤ 16/65535 ≈ 2.44e-4` nats
(plus fp32 rounding) of its true value (`scale/2` without the shift); entries below
`hi − 16` read back as the floor (≤ −16 nats), which `kvarn.metrics` leaves out of the
KLD sum exactly as llama.cpp does.

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

from kvarn.atomic import atomic_path

MAGIC = b"KVARNKVD"
FILE_VERSION = 1
PREAMBLE = struct.Struct("<8sII QQ")  # magic, file version, reserved, json offset, json length
PAYLOAD_OFFSET = 64
ENCODING = "llama-logprob-u16"
ENCODING_VERSION = 2  # 1: llama.cpp lo; 2: mass-corrected lo
RANGE_NATS = 16.0
REQUIRED = ("model", "revision", "tokenizer_hash", "text_sha256", "n_ctx")

_ROWS = 16  # rows encoded per float64 slice


def row_uint16(vocab_size: int) -> int:
    """uint16 per row: 4 for the f32 scale and floor, the codes, padded to even (llama.cpp)."""
    return 2 * ((vocab_size + 1) // 2) + 4


def _mass_corrected_floor(x, codes, scale, lo, hi):
    """Shift `lo` so the decoded probabilities of the entries the KLD sums (base log-prob
    above KLD_BASE_FLOOR) carry exactly their true mass.

    Rounding moves each log-prob by ε ∈ ±scale/2; with a perfect Q the KLD then reads
    ≈ Σ p·ε, a bias of ~1e-5 per token (measured: docs/notes/engine-io.md) that swamps
    the low KLD percentiles of 8-bit caches. Subtracting the p-weighted mean of ε (a
    common shift δ, |δ| ≤ scale/2) cancels it to first order. The row layout and the
    decode rule are llama.cpp's; only the stored `lo` differs. x, codes: fp32 [r, V];
    scale, lo, hi: fp32 [r, 1].
    """
    from kvarn.metrics import KLD_BASE_FLOOR

    keep = x > KLD_BASE_FLOOR
    p = x.exp()
    mass = torch.where(keep, p, 0.0).sum(1, keepdim=True).double()
    # the excess of decoded over true mass, summed as differences (accurate in fp32)
    excess = torch.where(keep, (codes * scale + lo).exp() - p, 0.0).sum(1, keepdim=True).double()
    delta = torch.where(mass > 0, -torch.log1p(excess / mass.clamp(min=1e-300)), 0.0)
    shifted = lo.double() + delta
    # Entries clamped to the floor must stay out of the KLD sum (≤ −16 nats).
    clipped = x.min(dim=1, keepdim=True).values < hi - RANGE_NATS
    shifted = torch.where(clipped, shifted.clamp(max=KLD_BASE_FLOOR), shifted)
    return shifted.float()


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
            lo = _mass_corrected_floor(x, codes, scale, lo, hi)
        out[a:a + len(x), 4:4 + V] = codes.numpy().astype(np.uint16)
        out[a:a + len(x), :4] = torch.cat([scale, lo], dim=1).numpy().view(np.uint16)
    return out


def decode_rows(rows: np.ndarray, vocab_size: int, device=None) -> torch.Tensor:
    """[n, nv] uint16 rows -> [n, V] float32 log-probs (`scale·code + lo`) on `device`
    (default CPU): the rows travel as 16-bit codes and are decoded where they are used.
    float64 inside (code·scale, then + lo, two roundings), one rounding to fp32 at the end:
    the same bits on every device."""
    rows = torch.from_numpy(np.array(rows, dtype="<u2", copy=True).view(np.int16)).to(device)
    out = torch.empty((rows.shape[0], vocab_size), dtype=torch.float32, device=rows.device)
    for a in range(0, rows.shape[0], _ROWS):
        r = rows[a:a + _ROWS]
        hdr = r[:, :4].contiguous().view(torch.float32).double()  # scale, lo
        codes = r[:, 4:4 + vocab_size].to(torch.int32).bitwise_and_(0xFFFF).double()  # uint16 from int16 bits
        out[a:a + _ROWS] = codes.mul_(hdr[:, :1]).add_(hdr[:, 1:2])
    return out


def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(a)).cast("B")).hexdigest()


def write_dump(path: str | os.PathLike, header: dict, blocks: Iterable[torch.Tensor]) -> dict:
    """Encode and stream `blocks` (fp32 log-probs [n_scored, V], one per chunk) to `path`
    atomically; return the header written. `header` must hold REQUIRED; n_chunks and
    vocab_size, if given, are checked against the blocks."""
    missing = [k for k in REQUIRED if k not in header]
    if missing:
        raise ValueError(f"dump header lacks {missing}; required: {list(REQUIRED)}")
    n_ctx = int(header["n_ctx"])
    n_scored = n_ctx - 1 - n_ctx // 2
    vocab = header.get("vocab_size")
    sums: list[str] = []
    with atomic_path(path) as tmp:
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
    return full


class Dump:
    """A baseline dump opened read-only; `chunk(i)` decodes one chunk (verified lazily)."""

    kind = "kvarn"  # vs "llama" (kvarn.llamakld.LlamaKld)

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
    if header.get("encoding") != ENCODING or header.get("encoding_version") not in (1, 2):
        raise ValueError(
            f"dump {path}: encoding {header.get('encoding')!r} v{header.get('encoding_version')}, "
            f"this reader decodes {ENCODING!r} v1 and v2"
        )
    for key, want in (expect or {}).items():
        found = header.get(key, "<missing>")
        if found != want:
            raise ValueError(f"dump {path}: header field {key!r} is {found!r}, expected {want!r}")
    payload = np.memmap(path, dtype="<u2", mode="r", offset=PAYLOAD_OFFSET,
                        shape=(header["n_chunks"], header["n_scored"], header["row_uint16"]))
    return Dump(path, header, payload, verify)


def measure_encoding_error(name: str = "smollm2-135m", n_ctx: int = 512, chunks: int = 1,
                           text_path: str | None = None, cache_dir: str = "resources/models") -> dict:
    """What the encoding costs, on real log-probs: the model's fp32 run is the exact base;
    Q is (a) the same fp32 run (a perfect Q) and (b) the model run in bfloat16 (a realistic
    small perturbation). Reports the per-token KLD error |KLD(dump) − KLD(fp32)| and bytes."""
    import tempfile
    import time

    from kvarn import data, metrics, models, sources

    lm = models.load(sources.ModelSpec(name, f"embedded:{name}"), cache_dir, device="cpu")
    text = data.load_text(text_path)
    chunk_ids = data.make_chunks(data.tokenize(lm.tokenizer, text), n_ctx, chunks, lm.info.bos_id)
    pos = data.scored_positions(n_ctx)
    sl = slice(pos.start, pos.stop)
    exact, q_bf16, targets = [], [], []
    with torch.inference_mode():
        for ids in chunk_ids:
            logits = lm.model(ids[None]).logits[0, sl].float()
            exact.append(torch.log_softmax(logits, -1))
            targets.append(ids[pos.start + 1:pos.stop + 1])
        lm.model.to(torch.bfloat16)
        for ids in chunk_ids:
            q_bf16.append(torch.log_softmax(lm.model(ids[None]).logits[0, sl].float(), -1))
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "base.kvd"
        h = {"model": name, "revision": lm.info.revision, "tokenizer_hash": lm.info.tokenizer_hash,
             "text_sha256": data.text_sha256(text), "n_ctx": n_ctx}
        t = time.perf_counter()
        write_dump(p, h, exact)
        t_write = time.perf_counter() - t
        size = p.stat().st_size
        d = open_dump(p)
        t = time.perf_counter()
        decoded = [d.chunk(i) for i in range(d.n_chunks)]
        t_read = time.perf_counter() - t
    res: dict = {"model": name, "n_ctx": n_ctx, "chunks": len(chunk_ids), "vocab": lm.info.vocab_size}
    n_tok = sum(len(t) for t in targets)
    res["bytes_per_scored_token"] = 2 * row_uint16(lm.info.vocab_size)
    res["file_bytes_per_scored_token"] = size / n_tok
    res["fp32_bytes_per_scored_token"] = 4 * lm.info.vocab_size
    res["write_s"], res["read_decode_s"] = t_write, t_read
    llama_lo = [decode_rows(encode_rows(e, mass_correct=False), lm.info.vocab_size) for e in exact]
    for label, qs in (("perfect_q", exact), ("bf16_q", q_bf16)):
        ref = np.concatenate([metrics.token_metrics(q, e, t)["kld"] for q, e, t in zip(qs, exact, targets)])
        res[label] = {"kld_mean_fp32_base": float(ref.mean()), "kld_median_fp32_base": float(np.median(ref))}
        for enc, dec in (("dump", decoded), ("llama_lo", llama_lo)):
            got = np.concatenate([metrics.token_metrics(q, c, t)["kld"] for q, c, t in zip(qs, dec, targets)])
            err = np.abs(got - ref)
            res[label][enc] = {
                "kld_mean": float(got.mean()), "abs_err_mean": float(err.mean()),
                "abs_err_max": float(err.max()), "abs_err_p99": float(np.quantile(err, 0.99)),
                "rel_err_of_mean": float(abs(got.mean() - ref.mean()) / ref.mean()) if ref.mean() else None}
        # how much the −16-nat floor rule itself leaves out, with the exact base
        full = np.concatenate([(e.double().exp() * (e.double() - q.double())).sum(-1).numpy()
                               for q, e in zip(qs, exact)])
        res[label]["kld_mean_no_floor_rule"] = float(full.mean())
        res[label]["floor_rule_abs_diff_max"] = float(np.abs(full - ref).max())
    nllb_err = np.concatenate([
        np.abs(metrics.token_metrics(e, c, t)["nll_base"] - metrics.token_metrics(e, e, t)["nll_base"])
        for e, c, t in zip(exact, decoded, targets)])
    res["nll_base_abs_err_max"] = float(nllb_err.max())
    return res


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="measure the KLD error of the dump encoding on real log-probs")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw-v1/wiki.test.raw"))
    ap.add_argument("--cache-dir", default="resources/models")
    a = ap.parse_args()
    print(json.dumps(measure_encoding_error(a.model, a.n_ctx, a.chunks, a.text, a.cache_dir), indent=1))
