"""Rule generation_stats: the statistics of one decode run (kvarn.report.generation.compute_run)
-> cells / paired / survival / curves parquets and generation.md, each written atomically."""

from _wf import atomic, start

start(snakemake)
from kvarn.files.atomic import write_text
from kvarn.baseline.dump import open_dump
from kvarn.report import generation as kvgen

sm = snakemake
idents = [open_dump(b, verify=False).header for b in sm.input.baselines]  # the run identity of each cell's baseline
tables = kvgen.compute_run([str(p).rsplit("/", 1)[0] for p in sm.input.decode],
                           [str(p).rsplit("/", 1)[0] for p in sm.input.cells], idents,
                           n_boot=int(sm.params.boot), seed=int(sm.params.seed))
for key in ("cells", "paired", "survival", "curves"):
    with atomic(sm.output[key]) as tmp:
        tables[key].write_parquet(tmp)
write_text(sm.output.md, kvgen.to_markdown(tables))
print(kvgen.to_markdown(tables))
