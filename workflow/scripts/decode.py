"""Rule decode: one (cell, decode) result (kvarn.run.decode.run_decode) -> steps.parquet + summary.json, atomically.

Thin: no torch here. kvarn.run.worker runs it in the worker of (model, n_ctx, prompts as chunks),
the one the same chunks' teacher-forced cells use, or in this process (KVARN_WORKER=0)."""

import json
from pathlib import Path

from _wf import model_spec, scratch, start

start(snakemake)
from kvarn.run import worker
from kvarn.vocab.cell import CellSpec
from kvarn.vocab.options import parse_sampling

w, p, out = snakemake.wildcards, snakemake.params, snakemake.output
temperature, seed = parse_sampling(w.sampling)  # "" greedy, "-T1-s0" sampled (kvarn.plan.paths.DECODE_RUN_DIR)
with scratch(out.steps, out.summary) as tmp:  # summary.json last: its presence means done
    summary = worker.run(
        "decode", model_spec(snakemake), int(w.n_ctx), int(w.prompts), tokens=int(w.tokens),
        cell=CellSpec.from_wildcards(w), out_dir=tmp, ubatch=p.ubatch, text=snakemake.input.text,
        dtype=p.dtype, temperature=temperature, seed=seed, attention=snakemake.config.get("attention", "auto"),  # no rerun trigger
        cache_dir=Path(snakemake.input.model).parent, files=[snakemake.input.model],
    )
print(json.dumps(summary, indent=1, default=str))
