"""Checkpoint perlayer_search: one budget's allocations, searched on the search text only
(kvarn.perlayer.run.run_search) -> results/perlayer/{model}/search/{budget}.json, atomically."""

import json
from pathlib import Path

from _wf import model_spec, start

start(snakemake)
from kvarn.perlayer import plan, run

sm = snakemake
result = run.run_search(
    model_spec(sm), sm.input.text, plan.expand(sm.config), sm.wildcards.budget, list(sm.input.sensitivity),
    sm.output[0], eval_n_ctx=sm.params.eval_n_ctx, ubatch=sm.params.ubatch, accounting=sm.params.accounting,
    dtype=sm.params.dtype, cache_dir=Path(sm.input.model).parent, attention=sm.config.get("attention", "auto"),
)
print(json.dumps(result, indent=1))
