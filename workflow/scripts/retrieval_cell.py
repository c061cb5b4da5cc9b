"""Rule retrieval_cell: one cell's greedy answers to every task of a (model, context)
(kvarn.retrieval.run.run_cell) -> one answer JSONL per task, each written atomically."""

import json
from pathlib import Path

from _wf import model_spec, start

start(snakemake)
from kvarn.retrieval import run
from kvarn.vocab.cell import CellSpec

p, cfg = snakemake.params, snakemake.config
summary = run.run_cell(
    model_spec(snakemake), list(snakemake.input.tasks), list(snakemake.output.answers),
    CellSpec.from_wildcards(snakemake.wildcards), ubatch=p.ubatch, dtype=p.dtype,
    batch=cfg["retrieval"].get("batch", 8), attention=cfg.get("attention", "auto"),  # no rerun trigger
    cache_dir=Path(snakemake.input.model).parent,
)
print(json.dumps(summary, indent=1))
