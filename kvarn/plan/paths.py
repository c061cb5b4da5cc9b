"""The results layout: one template per output directory, read back only through the patterns here.

A cell's identity is its path,

    results/{model}/ctx{n_ctx}-c{chunks}/cells/{k}-{v}-t{tail}{opts}/

where `opts` spells only the non-default options (`-norot`, `-td{dtype}`, `-i{iters}`), so the
default cell's path is the one in docs/CONTRACTS.md and the workflow reads every per-cell parameter
back from the path (kvarn.vocab.cell.parse_opts). `chunks` is a count or "all" (every whole chunk of
the text, as llama-perplexity without --chunks; the path then reads ``-call``). Also here: the
decode runs' and the baselines' paths, the fetch marker's key, and the patterns of the workflow's
wildcards (the Snakefile's wildcard_constraints read them here). Torch-free.
"""

from __future__ import annotations

import re

from kvarn.llamacpp_engine.settings import ENGINE as LLAMACPP
from kvarn.vocab.cell import BASELINE_OPTS_PATTERN, CELL_NAME, OPTS_PATTERN, TYPE_PATTERN, CellSpec, compute_suffix  # noqa: F401 (the rules read the patterns here)
from kvarn.vocab.options import SAMPLING_PATTERN  # noqa: F401 (the rules read it here)

ALL_CHUNKS = "all"
CHUNKS_PATTERN = r"\d+|all"

# The results layout, one template per output directory: the cells (kvarn.plan.matrix) and the workflow's
# rules (workflow/rules/common.smk, decode.smk) take their paths from these.
RUN_DIR = "results/{model}/ctx{n_ctx}-c{chunks}"
CELL_DIR = RUN_DIR + "/cells/" + CELL_NAME
DECODE_RUN_DIR = "results/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}{sampling}"  # sampling: sampling_name
DECODE_DIR = DECODE_RUN_DIR + "/" + CELL_NAME

MODEL_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
# What each field of the layout matches; a run directory is read back only through these.
_RUN_DIR_RE = re.compile(r"(?:^|/)" + RUN_DIR.replace(".", r"\.").format(
    model=f"(?P<model>{MODEL_PATTERN})", n_ctx=r"(?P<n_ctx>\d+)", chunks=f"(?P<chunks>{CHUNKS_PATTERN})") + "$")


def parse_run_dir(path) -> dict:
    """model, n_ctx and chunks (a count or "all") of a run directory laid out as RUN_DIR (any
    prefix before `results/`); a path not in that layout raises ValueError naming it."""
    m = _RUN_DIR_RE.search(str(path))
    if m is None:
        raise ValueError(f"{str(path)!r} is not a run directory; expected {RUN_DIR}")
    return {"model": m["model"], "n_ctx": int(m["n_ctx"]),
            "chunks": m["chunks"] if m["chunks"] == ALL_CHUNKS else int(m["chunks"])}


def parse_cell_dir(path) -> tuple[dict, CellSpec]:
    """(parse_run_dir of its run, the cell) of a cell directory laid out as CELL_DIR."""
    p = str(path).rstrip("/")
    run, sep, name = p.rpartition("/cells/")
    if not sep:
        raise ValueError(f"{p!r} is not a cell directory; expected {CELL_DIR}")
    return parse_run_dir(run), CellSpec.from_name(name)


def decode_dir(model: str, n_ctx: int, prompts: int, tokens: int, cell: str, sampling: str = "") -> str:
    """results/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}{sampling}/{cell}: steps.parquet + summary.json."""
    return f"{DECODE_RUN_DIR.format(model=model, n_ctx=n_ctx, prompts=prompts, tokens=tokens, sampling=sampling)}/{cell}"


def baseline_path(run_dir: str, compute: str = "exact", engine: str = "torch") -> str:
    """results/{model}/ctx{n_ctx}-c{chunks}/baseline{-llamacpp_cpu}.kvd, or baseline.llama.kld (llama-perplexity's
    KLD base file, with its identity beside it in baseline.llama.kld.json) for the llama.cpp engine."""
    if engine == LLAMACPP:
        return f"{run_dir}/{PROGRAM_BASELINE}"
    return f"{run_dir}/baseline{compute_suffix(compute)}.kvd"


PROGRAM_BASELINE = "baseline.llama.kld"


def source_key(source: str, revision: str | None) -> str:
    """8 hex digits naming a model's (source, revision): the workflow's fetch marker is
    `{model_cache}/{model}.{key}.fetched.json`, so a new source is a new marker path."""
    import hashlib

    return hashlib.sha256(f"{source}@{revision}".encode()).hexdigest()[:8]


def chunks_arg(chunks: int | str) -> int | None:
    """The engine's `chunks` for a config/path value: None for "all", else the count."""
    return None if chunks == ALL_CHUNKS else int(chunks)
