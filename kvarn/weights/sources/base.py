"""What every model source shares: `ModelSpec` (a name and a source), `SourceKind` (the handler
of one kind of source), the registry that finds a source's handler by its prefix (`kind_of`),
and the verified hashing the handlers check files with."""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvarn.weights.gguf_file import config_dict
from kvarn.files.identity import file_sha256, uncached_sha256  # file_sha256: cached beside the file

DEFAULT_CACHE_DIR = "resources/models"
HEX40 = re.compile(r"^[0-9a-f]{40}$")
SHA256_PIN = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    revision: str | None = None

    @property
    def kind(self) -> SourceKind:
        """The handler of this spec's source (`kind_of`)."""
        return kind_of(self.source)


class SourceKind:
    """One kind of model source. A subclass names its `prefix` (None: a local path, what a source
    without a registered prefix is) and answers, for a source of its kind, every question the
    package asks of one: naming a ``--model`` argument (`parse`, `parse_bare`), fetching
    (`resolve`), the config without the weights (`config_json`, `config_alone`), whether the
    revision pins the bytes (`unpinned`, `content_pinned`) and which GGUF holds the weights
    (`gguf_path`)."""

    prefix: str | None = None
    random_weights = False  # the model is built from a config with seeded random weights (kvarn.weights.random_model)
    content_pinned = True  # `source@revision` identifies the weights (kvarn.files.identity.weights_id); else their hash

    def parse(self, arg: str) -> ModelSpec:
        """A ``--model`` argument with this kind's prefix -> the spec (its name derived from it)."""
        raise NotImplementedError

    def parse_bare(self, arg: str) -> ModelSpec | None:
        """A ``--model`` argument without a prefix that this kind claims, as a spec; None if it does not."""
        return None

    def resolve(self, spec: ModelSpec, cache_dir: Path) -> tuple[Path, str | None]:
        """(path `kvarn.weights.models.load` reads, revision); downloads/converts as needed."""
        raise NotImplementedError

    def config_alone(self, source: str) -> bool:
        """Whether `config_json` reads this source's config without fetching its weights."""
        return False

    def config_json(self, spec: ModelSpec, cache_dir: Path) -> dict:
        """The spec's ``config.json`` as a dict: by default from what `resolve` fetched (a GGUF's
        metadata turned into one by `kvarn.weights.gguf_file.config_dict`)."""
        path, _ = self.resolve(spec, cache_dir)
        if path.is_file():
            return config_dict(path)
        return json.loads((path / "config.json").read_text())

    def unpinned(self, source: str, revision: str | None) -> str | None:
        """Why this source's weights are not pinned to exact bytes, or None when they are."""
        return None

    def gguf_path(self, spec: ModelSpec, cache_dir: str | os.PathLike) -> Path | None:
        """The GGUF file the weights come from, else None."""
        return None


REGISTRY: dict[str | None, SourceKind] = {}  # prefix -> handler; None: the local path


def register(kind: SourceKind) -> SourceKind:
    """Add a handler to the registry under its prefix (one handler per prefix)."""
    if kind.prefix in REGISTRY:
        raise ValueError(f"source prefix {kind.prefix!r} is registered twice")
    REGISTRY[kind.prefix] = kind
    return kind


def kind_of(source: str) -> SourceKind:
    """The handler of `source`: the one whose prefix it starts with, else the local path's."""
    for prefix, kind in REGISTRY.items():
        if prefix is not None and source.startswith(prefix):
            return kind
    return REGISTRY[None]


def sha256_file(path: Path) -> str:
    """hex sha256 of a file, hashed once per file version in this process: keyed on the
    resolved path, size, mtime and inode (as `kvarn.weights.gguf_weights.reader` keys its parse),
    so re-verifying a cached model costs a stat per file, and a rewritten or replaced file
    is hashed again. (A rewrite of the same size within one tick of the file system's
    clock, in place, would not be seen: the verification guards downloads and
    conversions, which replace files.)"""
    return _sha256_version(*_file_version(path))


def known_sha256(path: Path, digest: str) -> None:
    """Tell `sha256_file` the sha256 of `path` as it is now, from a caller that hashed exactly
    these bytes (while writing them, or under another name before renaming the file): its next
    call on this version of the file returns `digest` without reading the file again."""
    _KNOWN[_file_version(path)] = digest


_KNOWN: dict[tuple, str] = {}  # file version -> sha256, until `_sha256_version` first asks


def forget_hashes() -> None:
    """Drop every digest this process holds (hashed or told by `known_sha256`): the next
    `sha256_file` of each file reads it, as another process would."""
    _KNOWN.clear()
    _sha256_version.cache_clear()


def _file_version(path: Path) -> tuple[str, int, int, int]:
    st = Path(path).stat()
    return str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino


@functools.lru_cache(maxsize=256)
def _sha256_version(path: str, size: int, mtime_ns: int, ino: int) -> str:
    known = _KNOWN.pop((path, size, mtime_ns, ino), None)
    return known if known is not None else uncached_sha256(Path(path))


def check_sha(path: Path, pinned: str | None, where: str) -> str:
    """'sha256:<hex>' of a GGUF file, checked against a pinned 'sha256:<hex>' revision."""
    got = f"sha256:{file_sha256(path)}"
    if pinned is not None:
        if not pinned.startswith("sha256:") or len(pinned) != 71:
            raise ValueError(f"{where}: a GGUF is pinned by revision 'sha256:<64 hex digits>', got {pinned!r}")
        if got != pinned:
            raise ValueError(f"{where}: {path} has {got}, pinned {pinned}")
    return got


def gguf_unpinned(revision: str | None) -> str | None:
    """A GGUF (hub or local) is pinned by revision sha256:<hex>."""
    return None if revision and SHA256_PIN.match(revision) else "a GGUF needs revision: sha256:<64 hex digits>"
