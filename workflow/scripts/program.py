"""Rules baseline_program and cell_program: a model of the llama.cpp engine (kvarn.llamacpp_engine.runner).

The build runs the model; this process reads its records and sums them (kvarn.stats.metrics)."""

import json
from pathlib import Path

from _wf import model_spec, scratch, start

start(snakemake)
from kvarn.plan.paths import chunks_arg
from kvarn.llamacpp_engine import runner
from kvarn.vocab.cell import CellSpec

w, p, out = snakemake.wildcards, snakemake.params, snakemake.output
common = dict(spec=model_spec(snakemake), cache_dir=Path(snakemake.input.model).parent,
              text=snakemake.input.text, n_ctx=int(w.n_ctx), ubatch=p.ubatch, engine=p.engine,
              job_threads=snakemake.threads)
if snakemake.rule == "baseline_program":
    # the base file is written atomically, then its identity (out.identity) beside it, and the program's log
    info = runner.baseline_job(**common, chunks=chunks_arg(w.chunks), out=Path(out.base))
else:
    with scratch(out.tokens, out.summary) as tmp:  # summary.json last: its presence means done
        info = runner.cell_job(**common, cell=CellSpec.from_wildcards(w), baseline=Path(snakemake.input.baseline),
                               out_dir=tmp)
        Path(tmp / "program.log").replace(Path(out.summary).with_name("program.log"))
print(json.dumps(info, indent=1, default=str))
