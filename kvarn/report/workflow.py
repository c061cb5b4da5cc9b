"""What workflow/rules/report.smk needs at planning time: target paths, figure outputs, token inputs.

Kept here rather than in the rule file so that file holds rules only (`snakemake --lint`
flags rules and functions mixed in one file). Imports `snakemake.io`, so only the workflow
imports this module.
"""

from __future__ import annotations

from kvarn.report.data import parse_cell_path, select_token_paths
from kvarn.plan.generation import FIGURE_DIR, GENERATION_FIGURES

SUMMARY_FIGURES = ["pareto", "same_width", "tail_effect", "tail_sweep", "heatmap"]
TOKEN_FIGURES = ["position", "distribution"]
PAIRED_FIGURES = ["ranked"]  # from results/paired/{model}.parquet (kvarn.report.paired_table.run_table)
# from the summary's rows of both compute paths (kvarn.report.compare.compute_split), not `prepare`'s
SPLIT_FIGURES = ["kernel_share"]
# Every model's figures, drawn by one job (rule report_figures): one interpreter and one Vega
# renderer for all of them, where a job per figure started both nine times.
MODEL_FIGURES = SUMMARY_FIGURES + TOKEN_FIGURES + PAIRED_FIGURES + SPLIT_FIGURES
FIGURE_FORMATS = ["svg", "png", "vl.json"]
TABLE_FORMATS = ["md", "html", "parquet"]
FIGURE_TITLES = {
    "pareto": "damage vs cache size",
    "same_width": "KVarN vs same-width standard",
    "tail_effect": "tail 0 vs tail 128",
    "tail_sweep": "median KLD vs tail (q4_0, kvarn4)",
    "heatmap": "K x V heatmap",
    "position": "KLD by position",
    "distribution": "KLD distribution",
    "ranked": "cells ranked, with intervals",
    "kernel_share": "llama.cpp kernel share",
    "decode": "free-running decode divergence",
}
# `report:` section of the config (optional; every key has a default).
DEFAULTS = {"cells": None, "widths": [2, 4, 8], "tail": 128, "position_bins": 24, "boot": 2000, "seed": 0,
            "study_model": {}}


CLAIMS_OUTPUTS = {"md": "results/claims.md", "parquet": "results/claims.parquet", "html": "results/claims.html"}
# The answer (kvarn.report.advise): the frontier with bands, the pick within the default tolerance, the presets.
ANSWER_OUTPUTS = {"md": "results/answer.md", "parquet": "results/answer.parquet"}
CLAIMS_CATEGORY = "1. the study's claims"  # the report sorts categories by name: digits first
# The landing page (kvarn.report.page, rule report_page): the answer first, then the ledger, the figures, and the
# retrieval and per-layer results found. One self-contained file; `make report` copies it to report.html.
PAGE = "results/report.html"
# Shown when present and found at planning time (`page_found`), not inputs: the retrieval report is a target of
# its own config (workflow/rules/retrieval.smk) and per-layer runs are `kvarn layers` by hand. The retrieval
# report's files the page reads (kvarn.retrieval.plan.report_files() writes them there) ...
PAGE_RETRIEVAL = {"scores": "results/retrieval/scores.parquet", "paragraph": "results/retrieval/README-paragraph.md",
                  "figure": "results/retrieval/figures/retrieval.svg"}
# ... and the per-layer results: `kvarn layers ... -o results/layers/STEM` writes STEM.parquet and STEM.svg.
PAGE_LAYERS_DIR = "results/layers"


def decision_tables(models) -> list[str]:
    """Each model's decision tables (kvarn.report.claims.render.decisions_markdown), written by rule claims."""
    return [f"results/tables/decisions/{m}.md" for m in models]


def targets(models) -> list[str]:
    """Every table and figure path of every model, the answer, the claims ledger, the decision tables
    and the landing page."""
    out = [*ANSWER_OUTPUTS.values(), *CLAIMS_OUTPUTS.values(), *decision_tables(models)]
    for m in models:
        out += [f"results/tables/{m}.{ext}" for ext in TABLE_FORMATS]
        out += [f"results/figures/{m}/{f}.{ext}" for f in MODEL_FIGURES for ext in FIGURE_FORMATS]
    return out + [PAGE]


def page_figures(models, decode_paths=()) -> list[str]:
    """rule report_page's figures: each model's MODEL_FIGURES as .svg and .vl.json (the spec tells a
    placeholder), then its free-running decode figure where `decode_paths` (common.smk's
    decode_targets()) hold one."""
    decode = {str(p) for p in decode_paths}
    out = []
    for m in models:
        figures = MODEL_FIGURES + (["decode"] if f"results/figures/{m}/decode.svg" in decode else [])
        out += [f"results/figures/{m}/{f}.{ext}" for f in figures for ext in ("svg", "vl.json")]
    return out


def page_found(root=".") -> dict[str, int]:
    """The optional results the page shows that exist under `root` now (PAGE_RETRIEVAL's files,
    PAGE_LAYERS_DIR's STEM.parquet and STEM.svg), each with its modification time in ns: rule
    report_page's param, so the page is built again when one appears or changes."""
    from pathlib import Path

    base = Path(root)
    paths = list(PAGE_RETRIEVAL.values())
    layers = base / PAGE_LAYERS_DIR
    if layers.is_dir():
        paths += [str(p.relative_to(base)) for p in sorted(layers.glob("*.parquet"))]
        paths += [str(p.relative_to(base)) for p in sorted(layers.glob("*.svg"))]
    return {p: (base / p).stat().st_mtime_ns for p in sorted(paths) if (base / p).is_file()}


def option(config: dict, key: str):
    return (config.get("report") or {}).get(key, DEFAULTS[key])


def figure_tokens(token_paths, config: dict) -> list[str]:
    """The tokens.parquet of the cells the position/distribution figures draw, chosen by path."""
    return select_token_paths(token_paths, cells=option(config, "cells"), widths=option(config, "widths"),
                              tail=option(config, "tail"))


def report_run_tokens(token_paths) -> list[str]:
    """The tokens.parquet of every cell of the run the tables show (kvarn.report.data.select_run:
    the largest n_ctx, then chunks), for the paired statistics."""
    parsed = [(str(p), parse_cell_path(p)) for p in token_paths]
    if not parsed:
        return []
    best = max((d["n_ctx"], d["chunks"]) for _, d in parsed)
    return [p for p, d in parsed if (d["n_ctx"], d["chunks"]) == best]


def figure_outputs(figures) -> dict:
    """The named outputs of a job drawing `figures`: per figure `{figure}_svg` (in `snakemake
    --report`, with workflow/report/{figure}.rst), `{figure}_png` and `{figure}_vl` (Vega-Lite)."""
    out = {}
    for figure in figures:
        out.update(_figure_files(figure, f"results/figures/{{model}}/{figure}", caption=f"../report/{figure}.rst",
                                 subcategory=FIGURE_TITLES[figure], label=FIGURE_TITLES[figure]))
    return out


def generation_figure_outputs() -> dict:
    """rule report_generation's outputs: per figure of a decode run (`GENERATION_FIGURES`)
    `{figure}_svg` (in the report, with workflow/report/generation.rst), `{figure}_png`, `{figure}_vl`."""
    out = {}
    for figure in GENERATION_FIGURES:
        out.update(_figure_files(figure, f"{FIGURE_DIR}/{figure}", caption="../report/generation.rst",
                                 subcategory="long generation",
                                 label=f"generation {figure}, n_ctx {{n_ctx}}, G {{tokens}}"))
    return out


def _figure_files(figure: str, stem: str, caption: str, subcategory: str, label: str) -> dict:
    """One figure's three named outputs: the svg flagged for the report, the png, the Vega-Lite spec."""
    from snakemake.io import report

    return {f"{figure}_svg": report(f"{stem}.svg", caption=caption, category="{model}", subcategory=subcategory,
                                    labels={"model": "{model}", "figure": label}),
            f"{figure}_png": f"{stem}.png",
            f"{figure}_vl": f"{stem}.vl.json"}


def figure_options(config: dict) -> dict:
    """Each model figure's options from the config's `report:` section (the rest take none)."""
    return {f: {"same_width": {"tail": option(config, "tail")},
                "position": {"n_bins": option(config, "position_bins")}}.get(f, {}) for f in MODEL_FIGURES}
