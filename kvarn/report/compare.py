"""The report's comparisons of prepared rows (kvarn.report.data.prepare): KVarN against the
same-width standard type (`same_width`), what a tail buys a standard cache (`tail_effect`), the tail
sweep and how much more the median responds to the tail than to the format (`tail_sweep`,
`tail_vs_format`), and the compute split, format damage beside llama.cpp's total (`compute_split`).
Pure functions of polars DataFrames; nothing draws. How to read each: docs/notes/report.md.
"""

from __future__ import annotations

from dataclasses import replace

import polars as pl

from kvarn.vocab.cell import CellSpec
from kvarn.vocab.options import DEFAULT_COMPUTE
from kvarn.report.data import FORMAT_ONLY_OPTS, figure_rows, select_run, type_bits


def compute_split(summary: pl.DataFrame, model: str) -> pl.DataFrame:
    """Cells run in both compute paths (kvarn.llamacpp_cpu.compute), side by side: format damage
    (`exact`), total as llama.cpp's CPU kernel computes it (`llamacpp-cpu`), and the share
    of the total that is the kernel's arithmetic, `1 − exact/total`, for median and mean.

    One row per (pair, tail) present in both paths; empty if none (or no `compute` column).
    """
    df = select_run(summary, model)
    cols = ["pair", "k_type", "v_type", "tail_requested", "width", "exact_median", "total_median",
            "kernel_share_median", "exact_mean", "total_mean", "kernel_share_mean"]
    if "compute" not in df.columns:
        return pl.DataFrame(schema={c: pl.Float64 for c in cols})
    rows = {}
    for r in df.to_dicts():
        # the options besides the compute path's token
        opts = replace(CellSpec.from_name(r["cell"]), compute=DEFAULT_COMPUTE).opts if r.get("cell") else ""
        key = (r["k_type"], r["v_type"], r.get("tail_requested", r.get("tail")), opts)
        rows.setdefault(key, {})[r.get("compute") or "exact"] = r
    out = []
    for (k, v, tail, opts), both in rows.items():
        if "exact" not in both or "llamacpp-cpu" not in both:
            continue
        ex, cp = both["exact"], both["llamacpp-cpu"]
        bits = type_bits(k)
        out.append({
            "pair": f"{k}-{v}{opts}", "k_type": k, "v_type": v, "tail_requested": tail,
            "width": bits if k == v and not opts else None,
            "exact_median": ex["kld_median"], "total_median": cp["kld_median"],
            "kernel_share_median": 1 - ex["kld_median"] / cp["kld_median"] if cp["kld_median"] else None,
            "exact_mean": ex["kld_mean"], "total_mean": cp["kld_mean"],
            "kernel_share_mean": 1 - ex["kld_mean"] / cp["kld_mean"] if cp["kld_mean"] else None,
        })
    if not out:
        return pl.DataFrame(schema={c: pl.Float64 for c in cols})
    return pl.DataFrame(out, infer_schema_length=None).sort(["width", "pair"], descending=[True, False],
                                                           nulls_last=True)


def same_width(prep: pl.DataFrame, tail: int = 128) -> pl.DataFrame:
    """KVarN width N (kvarnN-kvarnN at effective tail `tail`) vs qN_0-qN_0 at tail `tail`.

    One row per width that has both partners (missing partners are skipped), with the
    median and mean of each and the % change of KVarN against standard (negative: KVarN
    damages less), plus body/staging/overlay MiB of both. Where the format-only row
    (qN_0 with KVarN's sink 128, tail 128 and F16 tail: `FORMAT_ONLY_OPTS`) was measured,
    its columns (`*_fmt`) and KVarN's % change against it (`pct_median_fmt`, `pct_mean_fmt`)
    are added (null where it was not): that comparison changes nothing but the quantizer.
    Likewise for each QuantizedCache backend measured at width N (quantoN, hqqN, kiviN at
    the same effective tail): `*_quanto`, `pct_median_quanto`, ... (`same_width_backends`).
    """
    kv = figure_rows(prep).filter(
        (pl.col("family") == "kvarn") & pl.col("width").is_not_null() & (pl.col("tail_eff_full") == tail)
    )
    std = prep.filter(
        (pl.col("family") == "standard") & pl.col("width").is_not_null() & (pl.col("tail_requested") == tail)
    )
    cols = ["width", "pair", "tail_label", "kld_median", "kld_mean", "body_mib", "staging_mib", "overlay_mib", "kv_mib"]
    # the format-only partner: qN_0-qN_0 with KVarN's sink, tail and F16 tail dtype (optional)
    fmt = prep.filter(
        (pl.col("family") == "standard") & (pl.col("opts") == FORMAT_ONLY_OPTS) & (pl.col("tail_requested") == tail)
        & (pl.col("k_type") == pl.col("v_type")) & pl.col("k_type").str.contains(r"^q\d+_0$")
    ).with_columns(pl.col("k_bits").cast(pl.Int64).alias("width"))
    j = kv.select(cols).join(std.select(cols), on="width", suffix="_std")
    j = j.join(fmt.select(cols).rename({c: f"{c}_fmt" for c in cols if c != "width"}), on="width", how="left")
    # transformers' QuantizedCache backends of the same width at the same effective tail (optional):
    # one partner per backend (quanto, hqq, kivi), columns `*_{backend}`
    eco = prep.filter(
        (pl.col("family") == "ecosystem") & (pl.col("k_type") == pl.col("v_type")) & (pl.col("opts") == "")
        & (pl.col("tail_eff_full") == tail)
    ).sort("tail_requested").with_columns(pl.col("k_bits").cast(pl.Int64).alias("width"),
                                          pl.col("k_type").str.replace(r"\d+$", "").alias("backend"))
    backends = sorted(set(eco["backend"].to_list())) if eco.height else []
    for b in backends:
        part = eco.filter(pl.col("backend") == b).unique("width", keep="first", maintain_order=True).select(cols)
        j = j.join(part.rename({c: f"{c}_{b}" for c in cols if c != "width"}), on="width", how="left")
    return j.rename({c: f"{c}_kvarn" for c in cols if c != "width"}).with_columns(
        ((pl.col("kld_median_kvarn") / pl.col("kld_median_std") - 1) * 100).alias("pct_median"),
        ((pl.col("kld_mean_kvarn") / pl.col("kld_mean_std") - 1) * 100).alias("pct_mean"),
        ((pl.col("kld_median_kvarn") / pl.col("kld_median_fmt") - 1) * 100).alias("pct_median_fmt"),
        ((pl.col("kld_mean_kvarn") / pl.col("kld_mean_fmt") - 1) * 100).alias("pct_mean_fmt"),
        *[((pl.col(f"kld_{st}_kvarn") / pl.col(f"kld_{st}_{b}") - 1) * 100).alias(f"pct_{st}_{b}")
          for b in backends for st in ("median", "mean")],
    ).sort("width")


def same_width_backends(sw: pl.DataFrame) -> list[str]:
    """The QuantizedCache backends (quanto, hqq, kivi) `same_width` found partners for."""
    return [c.removeprefix("kld_median_") for c in sw.columns
            if c.startswith("kld_median_") and c.removeprefix("kld_median_") not in ("kvarn", "std", "fmt")]


def tail_effect(prep: pl.DataFrame) -> pl.DataFrame:
    """% change of the median (and mean) from tail 0 to each longer tail, per standard width."""
    std = prep.filter((pl.col("family") == "standard") & pl.col("width").is_not_null())
    t0 = std.filter(pl.col("tail_requested") == 0).select(
        "width", "pair", pl.col("kld_median").alias("median_t0"), pl.col("kld_mean").alias("mean_t0")
    )
    tn = std.filter(pl.col("tail_requested") > 0).select(
        "width", pl.col("tail_requested").alias("tail"),
        pl.col("kld_median").alias("median_tail"), pl.col("kld_mean").alias("mean_tail"),
    )
    return t0.join(tn, on="width").with_columns(
        ((pl.col("median_tail") / pl.col("median_t0") - 1) * 100).alias("pct_median"),
        ((pl.col("mean_tail") / pl.col("mean_t0") - 1) * 100).alias("pct_mean"),
    ).sort(["width", "tail"])


def tail_sweep(prep: pl.DataFrame, pairs=("q4_0-q4_0", "kvarn4-kvarn4")) -> pl.DataFrame:
    """Median (and mean) KLD against the effective tail, one row per (pair, effective tail).

    KVarN's requests 0 and 128 are one cache (effective 128): kept once. The exact share of
    each row rides along, so a reader sees how much of the row is read exactly."""
    rows = figure_rows(prep).filter(pl.col("pair").is_in(list(pairs)))
    return rows.select(
        "pair", "family", pl.col("tail_eff_full").alias("tail"), "tail_label", "exact_share",
        "kld_median", "kld_mean",
    ).unique(subset=["pair", "tail"], keep="first").sort(["pair", "tail"])


def tail_vs_format(sweep: pl.DataFrame, standard: str = "q4_0-q4_0", kvarn: str = "kvarn4-kvarn4",
                   format_only: float | None = None) -> dict | None:
    """How much more the median responds to which tokens are exact than to the format.

    tail response: |ln(median at the shortest / at the longest tail)|, averaged over the two
    pairs (each over its own tails); format response: |ln(median standard / median KVarN)|
    averaged over the effective tails both measured. ratio = tail / format response (the
    study's "nearly seven times"). None when a pair or a shared tail is missing.

    The standard pair at an equal tail still lacks KVarN's 128-token sink and F16 tail, so
    its format response counts them as format. `format_only` (the median of the
    format-only row: `format_only_median`) adds `format_only_response` = |ln(format_only /
    median KVarN at 128)| and `ratio_format_only` = tail / that: the quantizer alone."""
    import math

    resp = []
    by = {}
    for pair in (standard, kvarn):
        s = sweep.filter(pl.col("pair") == pair).sort("tail")
        if s.height < 2:
            return None
        resp.append(abs(math.log(s["kld_median"][0] / s["kld_median"][-1])))
        by[pair] = dict(zip(s["tail"].to_list(), s["kld_median"].to_list()))
    shared = sorted(set(by[standard]) & set(by[kvarn]))
    if not shared:
        return None
    fmt = sum(abs(math.log(by[standard][t] / by[kvarn][t])) for t in shared) / len(shared)
    tail = sum(resp) / len(resp)
    out = {"tail_response": tail, "format_response": fmt, "ratio": tail / fmt if fmt else float("inf"),
           "shared_tails": shared}
    kv128 = by[kvarn].get(128)
    if format_only is not None and kv128 is not None:
        f = abs(math.log(format_only / kv128))
        out.update(format_only_response=f, ratio_format_only=tail / f if f else float("inf"))
    return out


def format_only_median(prep: pl.DataFrame, width: int = 4, tail: int = 128) -> float | None:
    """Median KLD of the format-only row qN_0-qN_0 (KVarN's sink, tail `tail`, F16 tail), if measured."""
    pair = f"q{width}_0-q{width}_0{FORMAT_ONLY_OPTS}"
    r = prep.filter((pl.col("pair") == pair) & (pl.col("tail_requested") == tail))
    return float(r["kld_median"][0]) if r.height else None
