"""Rule decode: one (cell, decode) result (kvarn.decode.run_decode) -> steps.parquet + summary.json, atomically."""

import json
import os
import shutil
import tempfile
from pathlib import Path

from _wf import model_spec, start

start(snakemake)  # noqa: F821
from kvarn.decode import run_decode  # noqa: E402

w, p, out = snakemake.wildcards, snakemake.params, snakemake.output  # noqa: F821
out_dir = Path(out.summary).parent
for stale in out_dir.glob(".tmp-*"):  # scratch of a killed earlier attempt
    shutil.rmtree(stale, ignore_errors=True)
tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir))
try:
    summary = run_decode(
        model_spec(snakemake), int(w.n_ctx), int(w.prompts), int(w.tokens), w.k, w.v, int(w.tail),  # noqa: F821
        out_dir=tmp, ubatch=p.ubatch, rot=p.rot, tail_dtype=p.tail_dtype, iters=p.iters, sink=p.sink,
        text=snakemake.input.text, dtype=p.dtype, cache_dir=Path(snakemake.input.model).parent,  # noqa: F821
    )
    os.replace(tmp / "steps.parquet", out.steps)  # summary.json last: its presence means done
    os.replace(tmp / "summary.json", out.summary)
finally:
    shutil.rmtree(tmp, ignore_errors=True)
print(json.dumps(summary, indent=1, default=str))
