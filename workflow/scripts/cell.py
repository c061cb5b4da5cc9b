"""Rule cell: one quantized run (kvarn.run.torch_engine.run_cell) -> tokens.parquet + summary.json, atomically.

Thin: no torch here. kvarn.run.worker runs the cell in the worker that holds this model, text
and n_ctx already loaded (spawned if none), or in this process (KVARN_WORKER=0)."""

import json
from pathlib import Path

from _wf import model_spec, scratch, start

start(snakemake)  # noqa: F821
from kvarn.run import worker  # noqa: E402
from kvarn.plan.paths import chunks_arg  # noqa: E402
from kvarn.vocab.cell import CellSpec  # noqa: E402

w, p, out = snakemake.wildcards, snakemake.params, snakemake.output  # noqa: F821
with scratch(out.tokens, out.summary) as tmp:  # summary.json last: its presence means done
    summary = worker.run(
        "cell", model_spec(snakemake), int(w.n_ctx), chunks_arg(w.chunks), cell=CellSpec.from_wildcards(w),  # noqa: F821
        baseline=Path(snakemake.input.baseline), out_dir=tmp, ubatch=p.ubatch, text=snakemake.input.text,  # noqa: F821
        dtype=p.dtype, attention=snakemake.config.get("attention", "auto"),  # noqa: F821  (no rerun trigger)
        cache_dir=Path(snakemake.input.model).parent, files=[snakemake.input.model],  # noqa: F821
    )
print(json.dumps(summary, indent=1, default=str))
