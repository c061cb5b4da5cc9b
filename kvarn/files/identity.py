"""What makes a baseline's logits what they are: the identity a cell must share with its baseline.

Owns the list of identity fields (`FIELDS`), how each is read (`run_identity`), the
weights fingerprint of local model directories and GGUF files (`weights_id`, cached), and
the check a cell makes against its baseline dump (`check_baseline`), and the arguments that
decide what a job loads (`job_key`).

A cell is scored against a baseline only if everything that changes the logits, apart
from the KV cache under test, is the same: the model and its weights, the tokenizer, the
text, the chunking, the compute dtype, the device class (cpu or cuda: different kernels),
the attention implementation, and the torch and transformers versions. A mismatch is an
error naming the field, both values and the command that rebuilds the baseline.

Weights: a local directory has no revision, so its weight files are hashed (sha256 of
the sorted (name, size, sha256) list of every file in it); a local .gguf file is hashed
whole. Hashing gigabytes per cell would dominate the run, so each file's sha256 is
cached beside it as `<file>.kvarn-sha256.json`, keyed by (size, mtime_ns): a changed
file is rehashed, an unchanged one costs a stat. Where the directory is read-only the
hash is recomputed each time. Embedded and hub sources are already pinned by content
(the GGUF sha256, verified at fetch; the hub commit), which then is the weights id.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvarn.files.atomic import write_text

# The dump-header keys a cell must match, in the order a mismatch is reported.
FIELDS = ("model", "revision", "weights", "tokenizer_hash", "text_sha256", "n_ctx", "n_chunks",
          "dtype", "device_class", "attn_implementation", "torch_version", "transformers_version")
SIDECAR_SUFFIX = ".kvarn-sha256.json"


def job_key(spec, n_ctx, chunks, text, device, dtype, cache_dir) -> dict:
    """The arguments that decide what a job loads: `kvarn.run.load.Context`'s key, and the
    worker identity's (`kvarn.run.worker.identity`)."""
    return {"name": spec.name, "source": spec.source, "revision": spec.revision, "n_ctx": int(n_ctx),
            "chunks": None if chunks is None else int(chunks),  # None: every chunk of the text
            "text": None if text is None else str(Path(text).resolve()),
            "device": str(device), "dtype": str(dtype), "cache_dir": str(Path(cache_dir).resolve())}


def uncached_sha256(path: Path) -> str:
    """sha256 of one file, read now (what `file_sha256` caches)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of one file, cached beside it keyed by (size, mtime_ns)."""
    path = Path(path)
    st = path.stat()
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    side = path.with_name(path.name + SIDECAR_SUFFIX)
    try:
        cached = json.loads(side.read_text())
        if {k: cached.get(k) for k in key} == key and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError):
        pass
    digest = uncached_sha256(path)
    try:
        write_text(side, json.dumps({**key, "sha256": digest}) + "\n")
    except OSError:
        pass  # read-only model directory: recompute next time
    return digest


def weights_id(source: str, revision: str | None, content_pinned: bool) -> str:
    """A string that changes whenever the weights a source loads change.

    `content_pinned` (the source's handler says, `kvarn.weights.sources.base.SourceKind`: embedded,
    hub and random sources): `source@revision`. Otherwise, a local directory: `sha256:` over its
    files' (name, size, sha256); a local file (.gguf): `sha256:` of the file."""
    p = Path(source)
    if content_pinned or not p.exists():
        return f"{source}@{revision}"
    if p.is_file():
        return f"sha256:{file_sha256(p)}"
    files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.endswith(SIDECAR_SUFFIX))
    if not files:
        raise ValueError(f"model directory {p} holds no files to identify its weights by")
    doc = [[f.relative_to(p).as_posix(), f.stat().st_size, file_sha256(f)] for f in files]
    return "sha256:" + hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


def device_class(device: str) -> str:
    """'cpu' | 'cuda' | ...: the kernel family, without the device index."""
    return str(device).split(":", 1)[0]


def run_identity(spec, info, text_sha256: str, n_ctx: int, n_chunks: int, attn_implementation: str) -> dict:
    """The FIELDS of one run (a baseline writes them, a cell compares them)."""
    import torch
    import transformers

    return {
        "model": info.name,
        "revision": info.revision,
        "weights": weights_id(spec.source, info.revision, spec.kind.content_pinned),
        "tokenizer_hash": info.tokenizer_hash,
        "text_sha256": text_sha256,
        "n_ctx": n_ctx,
        "n_chunks": n_chunks,
        "dtype": info.dtype,
        "device_class": device_class(info.device),
        "attn_implementation": attn_implementation,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }


def rebuild_command(spec, n_ctx: int, n_chunks: int, device: str, dtype: str, path) -> str:
    return (f"kvarn baseline --model {spec.source} --ctx {n_ctx} --chunks {n_chunks} "
            f"--device {device_class(device)} --dtype {dtype} --out {path}")


def check_baseline(header: dict, ident: dict, path, rebuild: str) -> None:
    """Refuse a baseline whose identity differs from this run's, naming the first field."""
    for key in FIELDS:
        if key not in ident:
            continue
        found = header.get(key, "<missing>")
        if found != ident[key]:
            raise ValueError(
                f"baseline {path}: {key} is {found!r} in the baseline but {ident[key]!r} in this run, so "
                f"the baseline's logits are not this model's; rebuild it: {rebuild}")
