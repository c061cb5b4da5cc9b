"""Rule baseline: the BF16-cache log-prob dump of one (model, n_ctx, chunks) (kvarn.run.torch_engine.run_baseline)."""

import json
from pathlib import Path

from _wf import atomic, model_spec, start

start(snakemake)  # noqa: F821
from kvarn.run import worker  # noqa: E402  (no torch here: the worker or this process loads it)
from kvarn.plan.paths import chunks_arg  # noqa: E402

w, p = snakemake.wildcards, snakemake.params  # noqa: F821
with atomic(snakemake.output[0]) as tmp:  # noqa: F821
    info = worker.run(
        "baseline", model_spec(snakemake), int(w.n_ctx), chunks_arg(w.chunks), out=tmp, ubatch=p.ubatch,  # noqa: F821
        text=snakemake.input.text, dtype=p.dtype, compute=p.compute,  # noqa: F821
        attention=snakemake.config.get("attention", "auto"),  # noqa: F821  (not a param: no rerun trigger)
        cache_dir=Path(snakemake.input.model).parent, files=[snakemake.input.model],  # noqa: F821
    )
print(json.dumps(info, indent=1, default=str))
