"""The plan of long free-running generation: for each decode run of a matrix (model, n_ctx,
prompts, tokens, sampling), its decode and teacher-forced cell directories, where its statistics and
figures go, and the inputs of the rule that computes them (kvarn.report.generation). Torch-free
and polars-free: the Snakefile imports it while it plans."""

from __future__ import annotations

from kvarn.plan.paths import DECODE_RUN_DIR, decode_dir

GENERATION_DIR = "generation"  # inside the decode run's directory (kvarn.plan.paths.DECODE_RUN_DIR)
GENERATION_TABLES = ("cells.parquet", "paired.parquet", "survival.parquet", "curves.parquet", "generation.md")
GENERATION_FIGURES = ("survival", "kld_steps", "slopes", "tf_vs_free")
FIGURE_DIR = "results/figures/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}{sampling}"


def runs(matrix) -> dict[tuple[str, int, int, int, str], dict]:
    """Each decode run (model, n_ctx, prompts, tokens, sampling suffix) of a `kvarn.plan.matrix.Matrix` -> {"decode":
    [decode dirs], "cells": [teacher-forced cell dirs], "baselines": [their baseline dumps],
    "chunks": the cells' chunks}, one entry per decoded cell, in matrix order."""
    out: dict[tuple[str, int, int, int, str], dict] = {}
    for c in matrix.cells:
        d = matrix.models[c.model].decode
        if d is None or (d.cells is not None and c.name not in d.cells):
            continue
        r = out.setdefault((c.model, c.n_ctx, d.prompts, d.tokens, d.sampling),
                           {"decode": [], "cells": [], "baselines": [], "chunks": c.chunks})
        r["decode"].append(decode_dir(c.model, c.n_ctx, d.prompts, d.tokens, c.name, d.sampling))
        r["cells"].append(c.dir)
        r["baselines"].append(c.baseline)
    return out


def run_dir(model: str, n_ctx, prompts, tokens, sampling: str = "") -> str:
    """results/{model}/decode-ctx{n_ctx}-p{prompts}-g{tokens}{sampling}/generation: the run's statistics."""
    run = DECODE_RUN_DIR.format(model=model, n_ctx=n_ctx, prompts=prompts, tokens=tokens, sampling=sampling)
    return f"{run}/{GENERATION_DIR}"


def run_inputs(matrix, model: str, n_ctx, prompts, tokens, sampling: str = "") -> dict[str, list[str]]:
    """The generation statistics' inputs of one decode run; refuses a run whose teacher-forced
    cells score fewer chunks than the decode has prompts (their positions would be missing)."""
    key = (model, int(n_ctx), int(prompts), int(tokens), sampling)
    plan = runs(matrix)
    if key not in plan:
        raise ValueError(f"{run_dir(*key)}: not a decode run of this matrix; its runs: "
                         f"{', '.join(run_dir(*k) for k in plan) or 'none'}")
    r = plan[key]
    if r["chunks"] != "all" and r["chunks"] < key[2]:
        raise ValueError(f"models.{model}: chunks {r['chunks']} < decode prompts {key[2]}: the teacher-forced "
                         f"cells must score every chunk the decode prompts come from (set chunks >= prompts)")
    return {"decode": [f"{d}/summary.json" for d in r["decode"]], "steps": [f"{d}/steps.parquet" for d in r["decode"]],
            "cells": [f"{d}/summary.json" for d in r["cells"]], "tokens": [f"{d}/tokens.parquet" for d in r["cells"]],
            "baselines": list(r["baselines"])}


def targets(matrix, formats=("svg", "png", "vl.json")) -> list[str]:
    """Every generation table and figure of the matrix's decode runs (rule generation's input)."""
    out = []
    for key in runs(matrix):
        out += [f"{run_dir(*key)}/{t}" for t in GENERATION_TABLES]
        fig = FIGURE_DIR.format(model=key[0], n_ctx=key[1], prompts=key[2], tokens=key[3], sampling=key[4])
        out += [f"{fig}/{f}.{ext}" for f in GENERATION_FIGURES for ext in formats]
    return out
