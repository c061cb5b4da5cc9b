"""Rule perlayer_sensitivity: one type's one-layer probes on the search text
(kvarn.perlayer.run.run_sensitivity) -> results/perlayer/{model}/sensitivity/{type}.parquet, atomically."""

from pathlib import Path

from _wf import model_spec, start

start(snakemake)
from kvarn.perlayer import plan, run

frame = run.run_sensitivity(
    model_spec(snakemake),
    snakemake.input.text,
    plan.expand(snakemake.config),
    snakemake.wildcards.type,
    snakemake.output[0],
    ubatch=snakemake.params.ubatch,
    dtype=snakemake.params.dtype,
    cache_dir=Path(snakemake.input.model).parent,
    attention=snakemake.config.get("attention", "auto"),
)
print(frame)
