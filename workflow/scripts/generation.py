"""Rule generation_stats: the statistics of one decode run (kvarn.report.generation.compute_run)
-> cells / paired / survival / curves parquets and generation.md, each written atomically."""

from _wf import atomic, start

start(snakemake)
from kvarn.files.atomic import write_text
from kvarn.baseline.dump import open_dump
from kvarn.report import generation as kvgen

idents = [
    open_dump(b, verify=False).header for b in snakemake.input.baselines
]  # the run identity of each cell's baseline
tables = kvgen.compute_run(
    [str(p).rsplit("/", 1)[0] for p in snakemake.input.decode],
    [str(p).rsplit("/", 1)[0] for p in snakemake.input.cells],
    idents,
    n_boot=int(snakemake.params.boot),
    seed=int(snakemake.params.seed),
)
for key in ("cells", "paired", "survival", "curves"):
    with atomic(snakemake.output[key]) as tmp:
        tables[key].write_parquet(tmp)
write_text(snakemake.output.md, kvgen.to_markdown(tables))
print(kvgen.to_markdown(tables))
