"""A local transformers directory (with ``config.json``) or a local ``.gguf`` file (revision
``sha256:<hex>`` pins it): every source without a registered prefix."""

from __future__ import annotations

import json
from pathlib import Path

from kvarn.vocab.geometry import check_layer_types
from kvarn.weights.sources.base import REGISTRY, ModelSpec, SourceKind, check_sha, gguf_unpinned, register


class LocalSource(SourceKind):
    """A path on this machine; its weights are identified by their content (`content_pinned` False)."""

    prefix = None
    content_pinned = False

    def parse_bare(self, arg: str) -> ModelSpec | None:
        p = Path(arg)
        if p.exists():
            return ModelSpec(p.stem if p.is_file() else p.resolve().name, str(p))
        return None

    def resolve(self, spec: ModelSpec, cache_dir: Path) -> tuple[Path, str | None]:
        p = Path(spec.source)
        if p.is_dir() and (p / "config.json").is_file():
            check_layer_types(json.loads((p / "config.json").read_text()))
            return p, spec.revision
        if p.is_file() and p.suffix == ".gguf":
            return p, check_sha(p, spec.revision, spec.source)
        prefixed = ", ".join(sorted(k for k in REGISTRY if k is not None))
        raise ValueError(
            f"model source {spec.source!r} is neither a source with a known prefix ({prefixed}: e.g. "
            "embedded:<name>, hf:org/repo[@rev], hf:org/repo/file.gguf[@rev], random:<config.json>), "
            "a transformers directory with config.json, nor a .gguf file"
        )

    def config_alone(self, source: str) -> bool:
        return source.endswith(".gguf")

    def unpinned(self, source: str, revision: str | None) -> str | None:
        """A local GGUF is pinned by revision sha256:<hex>; a directory is fingerprinted by the dump
        instead (kvarn.files.identity)."""
        return gguf_unpinned(revision) if source.partition("@")[0].endswith(".gguf") else None

    def gguf_path(self, spec: ModelSpec, cache_dir) -> Path | None:
        p = Path(spec.source)
        return p if p.suffix == ".gguf" and p.is_file() else None


register(LocalSource())
