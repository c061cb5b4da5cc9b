"""The config.json a memory estimate reads (`kvarn memory --model`, bench/oracles/beellama/memory.py):
a study model's (config/models), an embedded model's, a directory's, a Hugging Face repo's or a
GGUF's, without weights where possible. Torch-free."""

from __future__ import annotations

from pathlib import Path

from kvarn.weights.sources import EMBEDDED, config_json, kind_of, parse_model


class ModelConfigError(ValueError):
    """A --model that names no readable config.json: the message names the value and what is accepted."""


STUDY_CONFIGS = Path(__file__).resolve().parents[2] / "config" / "models"  # the study's models, no weights


def memory_config(arg: str, cache_dir: str) -> tuple[dict, str]:
    """--model of `kvarn memory` -> (config.json dict, where it was read)."""
    import json


    if kind_of(arg).config_alone(arg):  # the config alone, no weights where possible
        return config_json(parse_model(arg), cache_dir), arg
    p = Path(arg)
    if p.is_dir():
        p = p / "config.json"
    elif not p.exists() and (STUDY_CONFIGS / f"{arg}.json").is_file():
        p = STUDY_CONFIGS / f"{arg}.json"
    elif not p.exists() and arg in EMBEDDED:
        p = Path(cache_dir) / arg / "hf" / "config.json"
        if not p.is_file():
            raise ModelConfigError(f"--model {arg!r}: embedded model not converted yet (no {p}); run `kvarn fetch -m {arg}`")
    if not p.is_file():
        raise ModelConfigError(
            f"--model {arg!r} is neither a config.json, a directory holding one, a study model of {STUDY_CONFIGS}, "
            f"an embedded model ({', '.join(EMBEDDED)}), hf:org/repo[@rev] nor a .gguf file"
        )
    try:
        with open(p) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"--model {str(p)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"--model {str(p)!r}: expected a JSON object (a transformers config.json)")
    return config, str(p)
