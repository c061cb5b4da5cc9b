"""``hf:org/repo[@revision]`` and ``hf:org/repo/file.gguf[@revision]``: the Hugging Face hub.

A repository: ``config.json`` first, so a layer type kvarn does not support is refused
(`kvarn.vocab.geometry.check_layer_types`) before any weights; then the tokenizer and, for an
image-text checkpoint (a ``text_config``), only the safetensors shards its index lists for
language-model tensors (`is_text_weight`). Gated repositories read a token from the
environment (``HF_TOKEN``), never from a file. One GGUF file: the spec's revision
``sha256:<hex>`` pins its content. Downloads are kept under ``cache_dir/hf-hub``.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvarn.vocab.geometry import check_layer_types
from kvarn.weights.sources.base import HEX40, ModelSpec, SourceKind, check_sha, gguf_unpinned, register


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


def _fetch_hf_gguf(spec: ModelSpec, repo: str, filename: str, rev: str | None, cache_dir: Path):
    try:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(repo_id=repo, filename=filename, revision=rev,
                                    cache_dir=str(cache_dir / "hf-hub")))
    except Exception as e:
        raise _hub_error(repo, rev, filename, e) from e
    return path, check_sha(path, spec.revision, spec.source)


class HubSource(SourceKind):
    """``hf:org/repo[@revision]`` (a transformers checkpoint) or ``hf:org/repo/file.gguf[@revision]``."""

    prefix = "hf:"

    def parse(self, arg: str) -> ModelSpec:
        repo, _, rev = arg[len(self.prefix):].partition("@")
        parts = repo.split("/")
        if len(parts) == 2 and all(parts):
            return ModelSpec(parts[1], f"{self.prefix}{repo}", rev or None)
        if len(parts) > 2 and all(parts[:2]) and repo.endswith(".gguf"):
            return ModelSpec(Path(repo).stem, arg)
        raise ValueError(f"--model {arg!r}: expected hf:org/repo[@revision] or hf:org/repo/file.gguf[@revision]")

    def resolve(self, spec: ModelSpec, cache_dir: Path) -> tuple[Path, str | None]:
        return _fetch_hf(spec, cache_dir)

    def config_alone(self, source: str) -> bool:
        return True

    def config_json(self, spec: ModelSpec, cache_dir: Path) -> dict:
        """A repository serves config.json alone; a GGUF file is fetched and its metadata read."""
        repo, gguf, rev = _parse_hf(spec.source, spec.revision)
        if gguf is not None:
            return super().config_json(spec, cache_dir)
        from huggingface_hub import hf_hub_download

        try:
            f = hf_hub_download(repo_id=repo, filename="config.json", revision=rev,
                                cache_dir=str(Path(cache_dir) / "hf-hub"))
        except Exception as e:
            raise _hub_error(repo, rev, "config.json", e) from e
        return json.loads(Path(f).read_text())

    def unpinned(self, source: str, revision: str | None) -> str | None:
        """Pinned: a repository at a 40-hex commit; a GGUF file by revision sha256:<hex>."""
        base, _, at = source.partition("@")
        if base.endswith(".gguf"):
            return gguf_unpinned(revision)
        commit = at or revision
        if commit and HEX40.match(commit):
            return None
        return (f"hub revision {commit!r} is not a 40-hex commit (a branch or tag can move)" if commit
                else "no hub revision (the main branch can move)")


register(HubSource())
