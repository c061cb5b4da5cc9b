"""The study's printed figures (config/study.yaml, the one copy the code reads): loaded, checked,
and looked up per claim and study model. Why a run is read against a study model:
docs/notes/study-models.md."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

STUDY_FILE = Path(__file__).resolve().parents[3] / "config" / "study.yaml"
DEFAULT_STUDY_MODEL = "qwen3.6-27b"


def load_study(path: str | Path | None = None) -> dict:
    """config/study.yaml (or `path`), checked: models, stand-ins and figures sections present."""
    import yaml

    p = Path(path) if path is not None else STUDY_FILE
    study = yaml.safe_load(p.read_text())
    for key in ("models", "figures"):
        if not isinstance(study, dict) or not isinstance(study.get(key), dict):
            raise ValueError(f"{p}: the study file needs a mapping {key!r}; see config/study.yaml")
    return study


def study_model_of(model: str, study: dict, override: Mapping[str, str] | None = None) -> str:
    """The study model a run's model is read against: the override (the config's
    `report: {study_model: ...}`), the model itself if the study measured it, its stand-in
    (config/study.yaml), else DEFAULT_STUDY_MODEL."""
    chosen = (override or {}).get(model) or (model if model in study["models"] else None) \
        or (study.get("stand_ins") or {}).get(model) or DEFAULT_STUDY_MODEL
    if chosen not in study["models"]:
        raise ValueError(f"study model {chosen!r} (for {model!r}) is not one of the study's models: "
                         f"{sorted(study['models'])}")
    return chosen


def figure(study: dict, claim: str, study_model: str):
    """The study's figure(s) of one claim for one study model, or None."""
    return (study["figures"].get(claim) or {}).get(study_model)


def figure_or_other(study: dict, claim: str, study_model: str) -> tuple[object, str, str | None]:
    """The study's figure of a claim for `study_model`, else another study model's (the claim's
    definition does not depend on the model), with a note naming whose figure it is and that model."""
    fig = figure(study, claim, study_model)
    if fig is not None:
        return fig, "", study_model
    for other in study["models"]:
        if (fig := figure(study, claim, other)) is not None:
            return fig, f"the study printed this figure for {other} only", other
    return None, "", None


def cell_key(pair: str, tail: int) -> str:
    """How config/study.yaml names a cell: `K-V tTAIL` (KVarN at 128*: its request, t0)."""
    return f"{pair} t{tail}"
