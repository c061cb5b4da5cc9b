"""Rule decode: one (cell, decode) result (kvarn.run.decode.run_decode) -> steps.parquet + summary.json, atomically."""

import json
from pathlib import Path

from _wf import model_spec, scratch, start

start(snakemake)  # noqa: F821
from kvarn.run.decode import run_decode  # noqa: E402
from kvarn.spec.cell import CellSpec  # noqa: E402

w, p, out = snakemake.wildcards, snakemake.params, snakemake.output  # noqa: F821
with scratch(out.steps, out.summary) as tmp:  # summary.json last: its presence means done
    summary = run_decode(
        model_spec(snakemake), int(w.n_ctx), int(w.prompts), int(w.tokens), CellSpec.from_wildcards(w),  # noqa: F821
        out_dir=tmp, ubatch=p.ubatch, text=snakemake.input.text, dtype=p.dtype, cache_dir=Path(snakemake.input.model).parent,  # noqa: F821
        attention=snakemake.config.get("attention", "auto"),  # noqa: F821  (not a param: no rerun trigger)
    )
print(json.dumps(summary, indent=1, default=str))
