"""Summaries written by an older kvarn, brought up to the columns the report reads.

Each column a summary lacks is filled as the run that wrote it had it: `kv_delta_bytes` (once
`kv_delta_bytes_vs_tail0`, or computed from the tail-0 total), `tail_eff_full` (the request),
`memory_accounting` (`packed`, before accountings were named), `kv_staging_bytes` (0, before
staging was counted), `exact_share`, `kv_bf16_bytes` and `bits_per_value` (null, before the columns existed). A summary that has
a column keeps it.
"""

from __future__ import annotations

import polars as pl


def migrate_summary(df: pl.DataFrame) -> pl.DataFrame:
    """`df` (summary rows with `tail_requested`) with every column above present."""
    if "kv_delta_bytes" not in df.columns and "kv_delta_bytes_vs_tail0" in df.columns:
        df = df.with_columns(pl.col("kv_delta_bytes_vs_tail0").alias("kv_delta_bytes"))
    if "kv_delta_bytes" not in df.columns:
        df = df.with_columns((pl.col("kv_total_bytes") - pl.col("kv_total_bytes_tail0")).alias("kv_delta_bytes"))
    if "tail_eff_full" not in df.columns:
        df = df.with_columns(pl.col("tail_requested").alias("tail_eff_full"))
    if "memory_accounting" not in df.columns:  # summaries written before accountings were named
        df = df.with_columns(pl.lit("packed").alias("memory_accounting"))
    if "kv_staging_bytes" not in df.columns:
        df = df.with_columns(pl.lit(0).alias("kv_staging_bytes"))
    if "exact_share" not in df.columns:  # results written before the column existed
        df = df.with_columns(pl.lit(None, dtype=pl.Float64).alias("exact_share"))
    if "kv_bf16_bytes" not in df.columns:  # summaries aggregated before bits per value were counted
        df = df.with_columns(pl.lit(None, dtype=pl.Int64).alias("kv_bf16_bytes"))
    if "bits_per_value" not in df.columns:
        df = df.with_columns(pl.lit(None, dtype=pl.Float64).alias("bits_per_value"))
    return df
