"""Checkpoint perlayer_search: one budget's allocations, searched on the search text only
(kvarn.perlayer.run.run_search) -> results/perlayer/{model}/search/{budget}.json, atomically."""

import json
from pathlib import Path

from _wf import model_spec, start

start(snakemake)
from kvarn.perlayer import plan, run

result = run.run_search(
    model_spec(snakemake),
    snakemake.input.text,
    plan.expand(snakemake.config),
    snakemake.wildcards.budget,
    list(snakemake.input.sensitivity),
    snakemake.output[0],
    eval_n_ctx=snakemake.params.eval_n_ctx,
    ubatch=snakemake.params.ubatch,
    accounting=snakemake.params.accounting,
    dtype=snakemake.params.dtype,
    cache_dir=Path(snakemake.input.model).parent,
    attention=snakemake.config.get("attention", "auto"),
)
print(json.dumps(result, indent=1))
