"""Rule perlayer_sensitivity: one type's one-layer probes on the search text
(kvarn.perlayer.run.run_sensitivity) -> results/perlayer/{model}/sensitivity/{type}.parquet, atomically."""

from pathlib import Path

from _wf import model_spec, start

start(snakemake)
from kvarn.perlayer import plan, run

sm = snakemake
frame = run.run_sensitivity(
    model_spec(sm), sm.input.text, plan.expand(sm.config), sm.wildcards.type, sm.output[0], ubatch=sm.params.ubatch,
    dtype=sm.params.dtype, cache_dir=Path(sm.input.model).parent, attention=sm.config.get("attention", "auto"),
)
print(frame)
