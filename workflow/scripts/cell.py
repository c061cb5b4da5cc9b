"""Rule cell: one quantized run (kvarn.run.torch_engine.run_cell) -> tokens.parquet + summary.json, atomically.

Thin: no torch here. kvarn.run.worker runs the cell in the worker that holds this model, text
and n_ctx already loaded (spawned if none), or in this process (KVARN_WORKER=0)."""

import json
from pathlib import Path

from _wf import model_spec, scratch, start

start(snakemake)
from kvarn.run import worker
from kvarn.plan.paths import chunks_arg
from kvarn.vocab.cell import CellSpec

w, p, out = snakemake.wildcards, snakemake.params, snakemake.output
with scratch(out.tokens, out.summary) as tmp:  # summary.json last: its presence means done
    summary = worker.run(
        "cell", model_spec(snakemake), int(w.n_ctx), chunks_arg(w.chunks), cell=CellSpec.from_wildcards(w),
        baseline=Path(snakemake.input.baseline), out_dir=tmp, ubatch=p.ubatch, text=snakemake.input.text,
        dtype=p.dtype, attention=snakemake.config.get("attention", "auto"),  # no rerun trigger
        cache_dir=Path(snakemake.input.model).parent, files=[snakemake.input.model],
    )
print(json.dumps(summary, indent=1, default=str))
