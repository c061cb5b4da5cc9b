"""``random:<config.json>``: no weights at all. `kvarn.weights.random_model` builds the model of a
config kept in the repository with seeded random weights (speed and memory only)."""

from __future__ import annotations

import json
from pathlib import Path

from kvarn.vocab.geometry import check_layer_types
from kvarn.weights.sources.base import ModelSpec, SourceKind, register, sha256_file

RANDOM_SEED = 0  # random: sources draw their weights from this seed


class RandomSource(SourceKind):
    """``random:<config.json>``: the config is the model (pinned by the file itself)."""

    prefix = "random:"
    random_weights = True

    def parse(self, arg: str) -> ModelSpec:
        return ModelSpec(Path(arg[len(self.prefix):]).stem + "-random", arg)

    def resolve(self, spec: ModelSpec, cache_dir: Path) -> tuple[Path, str]:
        p = Path(spec.source[len(self.prefix):])
        if not p.is_file() or p.suffix != ".json":
            raise ValueError(f"source {spec.source!r}: expected random:<a config.json file>, e.g. "
                             "random:config/models/qwen3.6-27b.json; no such file")
        check_layer_types(json.loads(p.read_text()))
        # Random weights: the revision names the config and the seed, never a checkpoint.
        return p, f"random:sha256:{sha256_file(p)[:16]}:seed{RANDOM_SEED}"

    def config_alone(self, source: str) -> bool:
        return True

    def config_json(self, spec: ModelSpec, cache_dir: Path) -> dict:
        return json.loads(self.resolve(spec, cache_dir)[0].read_text())


register(RandomSource())
