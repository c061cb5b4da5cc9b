"""Rule baseline: the BF16-cache log-prob dump of one (model, n_ctx, chunks) (kvarn.run.torch_engine.run_baseline)."""

import json
from pathlib import Path

from _wf import atomic, model_spec, start

start(snakemake)
from kvarn.run import worker  # no torch here: the worker or this process loads it
from kvarn.plan.paths import chunks_arg

w, p = snakemake.wildcards, snakemake.params
with atomic(snakemake.output[0]) as tmp:
    info = worker.run(
        "baseline", model_spec(snakemake), int(w.n_ctx), chunks_arg(w.chunks), out=tmp, ubatch=p.ubatch,
        text=snakemake.input.text, dtype=p.dtype, compute=p.compute,
        attention=snakemake.config.get("attention", "auto"),  # not a param: no rerun trigger
        cache_dir=Path(snakemake.input.model).parent, files=[snakemake.input.model],
    )
print(json.dumps(info, indent=1, default=str))
