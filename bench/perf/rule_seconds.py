"""Seconds per rule from a Snakemake run's benchmark files (bench/perf/make_run.sh and
bench/perf/make_run_revs.sh): one row per rule, its job count, total and mean wall seconds."""

from pathlib import Path

import polars as pl


def rules(wd: Path) -> pl.DataFrame:
    """Benchmark .tsv files under wd/benchmarks, labelled by rule (cells, their rows, report
    jobs by name, everything else by its file name)."""
    rows = []
    for f in (wd / "benchmarks").rglob("*.tsv"):
        name, rel = f.name[: -len(".tsv")], f.relative_to(wd / "benchmarks")
        rule = ("baseline" if name == "baseline" else "cell_row" if name.endswith(".row")
                else "cell" if f.parent.name == "cells" else f"report ({name})" if rel.parts[0] == "report"
                else name)
        rows.append({"rule": rule, "s": pl.read_csv(f, separator="\t")["s"][0]})
    return pl.DataFrame(rows).group_by("rule").agg(
        pl.len().alias("jobs"), pl.col("s").sum().alias("total_s"), pl.col("s").mean().alias("mean_s")).sort("rule")
