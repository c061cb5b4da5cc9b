"""Shaping results for tables and figures: one prepared row per cell, and per-token data.

Input is `results/summary.parquet` (one row per cell, the summary.json keys of
docs/CONTRACTS.md plus what the aggregate rule adds; older summaries brought up to date by
`kvarn.report.migrate`) and the paths of the per-cell `tokens.parquet` files (their rows are
read by `kvarn.report.tokens`). Everything here is a pure function of polars DataFrames;
nothing draws.

Conventions the report follows (and the README states):
* A pair is written `K-V` (`q4_0-q4_0`, `kvarn6-kvarn5`).
* KVarN's tail request 0 means an effective 128-token tail (DESIGN §2); it prints `128*`.
* The standard floor is the study's: the standard pair (default options) with the lowest median
  KLD at tail 128; the format-only rows have their own floor (`format_only_floor`).
* MiB are 2^20 bytes; Δ MiB is against the same pair at tail 0. They are computed under
  the run's memory accounting (`memory_accounting`, kvarn.budget.memory; `packed` when a summary
  predates it), and every table and figure names it (`accounting_of`).
* Type facts (family, bits, KVarN's tail rule) come from `kvarn.vocab.facts`, never from names.

The comparisons of prepared rows (same width, tail effect and sweep, compute split) are
`kvarn.report.compare`'s.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Sequence

import polars as pl

from kvarn.vocab import facts
from kvarn.vocab.cell import CellSpec
from kvarn.vocab.options import summary_sampling
from kvarn.plan.paths import parse_cell_dir
from kvarn.report.migrate import migrate_summary

MIB = float(1 << 20)

#: Series names of the Pareto figure, in legend order.
SERIES_STANDARD_T0 = "standard, tail 0"
SERIES_STANDARD_T128 = "standard, tail 128"
SERIES_KVARN = "KVarN, tail 128*"
# The format-only row type: a standard type with KVarN's exact tokens (sink 128 on full
# layers, tail 128, F16 exact copy), so against KVarN at 128* only the quantizer differs.
FORMAT_ONLY_OPTS = f"-td{facts.get('kvarn4').default_tail_dtype}-s{facts.KVARN_SINK}"  # the cell path's opts
SERIES_FORMAT_ONLY = "standard + KVarN's sink, F16 tail"
SERIES_ECOSYSTEM = "QuantizedCache backends"  # transformers' quanto, HQQ, KIVI layout (kvarn.formats.ecosystem)
SERIES_PER_LAYER = "per-layer types, {family}"  # a cell of an allocation (kvarn.vocab.allocation), never a frontier's



def type_bits(name: str) -> int | None:
    """Nominal bit width of a cache type (kvarn.vocab.facts): q4_0 -> 4, kvarn6 -> 6, bf16 -> 16."""
    return facts.FACTS[name].bits if name in facts.FACTS else None


def same_width_partner(kvarn_type: str) -> str | None:
    """The standard type compared with a KVarN width: kvarnN -> qN_0."""
    m = re.fullmatch(r"kvarn(\d+)", kvarn_type)
    return f"q{m.group(1)}_0" if m else None


def family_of(k_type: str) -> str:
    """'kvarn', 'ecosystem' or 'standard' for a pair whose K type is k_type (kvarn.vocab.facts)."""
    fam = facts.get(k_type).family
    return fam if fam in ("kvarn", "ecosystem") else "standard"


def accounting_of(prep: pl.DataFrame) -> str:
    """The memory accounting the MiB of these rows were computed under (several: joined by '/')."""
    if "memory_accounting" not in prep.columns:
        return "packed"
    return "/".join(sorted(set(prep["memory_accounting"].fill_null("packed").to_list()))) or "packed"


def tail_label(family: str, tail_requested: int, tail_eff: int | None) -> str:
    """`128*` for a KVarN (or ecosystem) request whose effective tail differs from the request
    (`kvarn.vocab.facts.label_tail`, read from a summary's columns); a standard request as given."""
    return facts.label_tail(tail_requested, tail_eff if family in ("kvarn", "ecosystem") else None)


def series_of(family: str, tail_requested: int, tail_eff: int | None) -> str:
    if family == "kvarn":
        return f"KVarN, tail {tail_label(family, tail_requested, tail_eff)}"
    if family == "ecosystem":
        return f"{SERIES_ECOSYSTEM}, tail {tail_label(family, tail_requested, tail_eff)}"
    return f"standard, tail {tail_requested}"


def select_run(summary: pl.DataFrame, model: str) -> pl.DataFrame:
    """The rows of one model's run; with several contexts, the largest n_ctx (then chunks)."""
    df = summary.filter(pl.col("model") == model)
    if df.is_empty():
        known = sorted(summary["model"].unique().to_list())
        raise ValueError(f"model {model!r} has no rows in the summary; models present: {known}")
    if "n_ctx" in df.columns and "chunks" in df.columns:
        best = df.select(["n_ctx", "chunks"]).unique().sort(["n_ctx", "chunks"]).row(-1)
        df = df.filter((pl.col("n_ctx") == best[0]) & (pl.col("chunks") == best[1]))
    return df


def primary_compute(df: pl.DataFrame) -> pl.DataFrame:
    """The rows the study's tables show, per model: its `exact` cells (the format alone; the other
    compute paths' rows live in `compute_split`), or, for a model none of whose cells runs exact, the
    one compute path they all run (an article run on the GPU's tf32-attn). A model whose cells mix
    compute paths without exact is refused: its rows would not compare."""
    if "compute" not in df.columns or df.is_empty():
        return df
    compute = pl.col("compute").fill_null("exact")
    by_model = "model" in df.columns
    chosen = {}
    for (model,), rows in df.group_by(["model"] if by_model else pl.lit(None), maintain_order=True):
        computes = sorted(set(rows.select(compute).to_series().to_list()))
        if "exact" not in computes and len(computes) > 1:
            raise ValueError(f"model {model!r}: cells on compute paths {computes} and none on exact; the tables "
                             "compare one compute path (run its cells on one, or add exact cells)")
        chosen[model] = "exact" if "exact" in computes else computes[0]
    if not by_model:
        return df.filter(compute == chosen[None])
    return df.filter(compute == pl.col("model").replace_strict(chosen, return_dtype=pl.String))


def prepare(summary: pl.DataFrame, model: str | None = None) -> pl.DataFrame:
    """One prepared row per cell: the summary keys plus names, bits, MiB and series.

    Columns added: pair, family (if missing), tail_requested (if missing), tail_label,
    series, alloc (an allocation's token, else null), k_bits, v_bits, width (symmetric same-type pairs only), kv_mib, body_mib,
    staging_mib, overlay_mib, delta_mib, memory_accounting (if missing), is_floor, below_floor.
    """
    df = select_run(summary, model) if model is not None else summary
    df = primary_compute(df)
    if "family" not in df.columns:
        df = df.with_columns(pl.col("k_type").map_elements(family_of, return_dtype=pl.String).alias("family"))
    if "tail_requested" not in df.columns:
        df = df.with_columns(pl.col("tail").alias("tail_requested"))
    df = migrate_summary(df)

    rows = df.to_dicts()
    for r in rows:
        spec = CellSpec.from_name(r["cell"]) if r.get("cell") else None
        r["opts"] = spec.opts if spec else ""
        r["alloc"] = getattr(spec, "alloc", None)
        r["pair"] = f"{r['k_type']}-{r['v_type']}{r['opts']}"  # a non-default option stays visible
        if not r.get("tail_label"):  # the aggregate rule writes it (kvarn.vocab.facts.tail_label)
            r["tail_label"] = tail_label(r["family"], r["tail_requested"], r["tail_eff_full"])
        r["series"] = series_of(r["family"], r["tail_requested"], r["tail_eff_full"])
        if r["family"] == "standard" and r["opts"] == FORMAT_ONLY_OPTS:
            r["series"] = f"{SERIES_FORMAT_ONLY}, tail {r['tail_requested']}"
        if r["alloc"]:
            r["series"] = SERIES_PER_LAYER.format(family="KVarN" if r["family"] == "kvarn" else r["family"])
        r["k_bits"] = type_bits(r["k_type"])
        r["v_bits"] = type_bits(r["v_type"])
        symmetric = r["k_type"] == r["v_type"] and not r["opts"] and (
            r["family"] == "kvarn" or re.fullmatch(r"q\d+_0", r["k_type"]) is not None
        )
        r["width"] = r["k_bits"] if symmetric else None
    out = pl.DataFrame(rows, infer_schema_length=None).with_columns(
        (pl.col("kv_total_bytes") / MIB).alias("kv_mib"),
        (pl.col("kv_body_bytes") / MIB).alias("body_mib"),
        (pl.col("kv_staging_bytes") / MIB).alias("staging_mib"),
        (pl.col("kv_overlay_bytes") / MIB).alias("overlay_mib"),
        (pl.col("kv_delta_bytes") / MIB).alias("delta_mib"),
        pl.col("width").cast(pl.Int64),
    )
    floor = standard_floor(out)
    fm = floor["kld_median"] if floor is not None else None
    out = out.with_columns(
        (
            (pl.col("pair") == (floor["pair"] if floor else None))
            & (pl.col("tail_requested") == (floor["tail_requested"] if floor else None))
            & (pl.col("family") == "standard")
        ).fill_null(False).alias("is_floor"),
        (pl.col("kld_median") < fm).fill_null(False).alias("below_floor")
        if fm is not None
        else pl.lit(False).alias("below_floor"),
    )
    return out.sort(["family", "k_bits", "v_bits", "k_type", "v_type", "tail_requested"],
                    descending=[True, True, True, False, False, False])


FLOOR_TAIL = 128  # the study's floor is read among the standard pairs at this tail


def standard_floor(prep: pl.DataFrame, tail: int = FLOOR_TAIL) -> dict | None:
    """The study's standard floor: the standard pair of default options at `tail` with the lowest
    median KLD (ties: the smaller cache); None without one. The format-only rows (a standard type
    with KVarN's sink and F16 tail) are not standard pairs: their floor is `format_only_floor`."""
    opts = pl.col("opts") == "" if "opts" in prep.columns else pl.lit(True)
    std = prep.filter((pl.col("family") == "standard") & opts & (pl.col("tail_requested") == tail))
    if std.is_empty():
        return None
    return std.sort(["kld_median", "kv_total_bytes"]).row(0, named=True)


def format_only_floor(prep: pl.DataFrame) -> dict | None:
    """The lowest median among the format-only rows (FORMAT_ONLY_OPTS, any tail), or None."""
    f = prep.filter((pl.col("family") == "standard") & (pl.col("opts") == FORMAT_ONLY_OPTS))
    return f.sort(["kld_median", "kv_total_bytes"]).row(0, named=True) if f.height else None


def pareto_frontier(prep: pl.DataFrame, family: str = "standard") -> pl.DataFrame:
    """Running minimum of median KLD over cache size: the best a family reaches at <= x MiB.

    Rows: every cell of the family sorted by kv_mib, with `frontier_kld` the running min.
    """
    fam = prep.filter((pl.col("family") == family) & pl.col("alloc").is_null()).sort(["kv_mib", "kld_median"])
    return fam.select(["pair", "tail_label", "kv_mib", "kld_median"]).with_columns(
        pl.col("kld_median").cum_min().alias("frontier_kld")
    )


def figure_rows(prep: pl.DataFrame) -> pl.DataFrame:
    """Cells a figure draws: KVarN requests that duplicate the request-0 cell are dropped.

    A KVarN request of 128 gives the same cache as request 0 (both an effective 128), so
    only the `128*` row is drawn when both exist.
    """
    kv0 = prep.filter((pl.col("family") == "kvarn") & (pl.col("tail_requested") == 0)).select(
        ["pair", "tail_eff_full"]
    ).with_columns(pl.lit(True).alias("_dup"))
    out = prep.join(kv0, on=["pair", "tail_eff_full"], how="left").filter(
        ~((pl.col("family") == "kvarn") & (pl.col("tail_requested") > 0) & pl.col("_dup").fill_null(False))
    )
    return out.drop("_dup")


def heatmap_standard_tail(prep: pl.DataFrame) -> int | None:
    """The standard tail whose K×V grid is fullest (ties: the shortest tail, so 0 first)."""
    std = prep.filter((pl.col("family") == "standard") & (pl.col("opts") == ""))
    if std.is_empty():
        return None
    counts = std.group_by("tail_requested").agg(pl.col("pair").n_unique().alias("n"))
    return counts.sort(["n", "tail_requested"], descending=[True, False])["tail_requested"][0]


# ---------------------------------------------------------------- per-token data


def parse_cell_path(path: str | Path) -> dict:
    """`results/{model}/ctx{n}-c{c}/cells/{k}-{v}-t{tail}{opts}/tokens.parquet` -> the cell's keys,
    read through the matrix's one results layout (`kvarn.plan.matrix.parse_cell_dir`)."""
    try:
        run, spec = parse_cell_dir(Path(path).parent.as_posix())
    except ValueError:
        raise ValueError(
            f"{str(path)!r} is not a cell path; expected results/{{model}}/ctx{{n_ctx}}-c{{chunks}}/"
            "cells/{k}-{v}-t{tail}{opts}/tokens.parquet"
        ) from None
    return {**run, "k_type": spec.k, "v_type": spec.v, "tail_requested": spec.tail, "opts": spec.opts}


def cell_name(k_type: str, v_type: str, tail_requested: int, tail_eff: int | None = None, opts: str = "") -> str:
    """How a cell is named in legends: `q4_0-q4_0 t128`, `kvarn4-kvarn4 t128*`."""
    if tail_eff is None:  # DESIGN §2 on a full-attention layer
        return f"{k_type}-{v_type}{opts} t{facts.tail_label(k_type, v_type, tail_requested)}"
    return f"{k_type}-{v_type}{opts} t{tail_label(family_of(k_type), tail_requested, tail_eff)}"


def default_cells(cells: Iterable[dict], widths: Sequence[int] = (2, 4, 8), tail: int = 128) -> list[dict]:
    """A few standard widths at `tail` plus the KVarN cells of the same widths (request 0).

    `cells` are dicts with k_type, v_type, tail_requested (from the summary or from
    parse_cell_path). Cells absent from the input are skipped. With none of `widths`
    present, the symmetric widths that exist are used instead; failing those, the first six cells.
    """
    cells = list(cells)

    def pick(ws):
        out = []
        for w in ws:
            for c in cells:
                std = c["k_type"] == c["v_type"] == f"q{w}_0" and c["tail_requested"] == tail
                kv = c["k_type"] == c["v_type"] == f"kvarn{w}" and c["tail_requested"] == 0
                if (std or kv) and not c.get("opts"):
                    out.append(c)
        return out

    chosen = pick(widths)
    if not chosen:
        present = sorted({type_bits(c["k_type"]) for c in cells if c["k_type"] == c["v_type"]} - {None})
        chosen = pick(present[:: max(1, len(present) // 3)])
    return chosen or [c for c in cells if not c.get("opts")][:6] or cells[:6]


def select_token_paths(
    paths: Iterable[str | Path], cells: Sequence[str] | None = None, widths: Sequence[int] = (2, 4, 8),
    tail: int = 128,
) -> list[str]:
    """The token parquets a position/distribution figure reads, chosen from their paths.

    `cells`: explicit `{k}-{v}-t{tail}{opts}` names (the cell directory); else
    `default_cells(widths, tail)`. Only the largest run (n_ctx, chunks) of a model is used.
    """
    parsed = [(str(p), parse_cell_path(p)) for p in paths]
    if not parsed:
        return []
    def run(d):  # chunks "all" (every chunk of the text) ranks above any count
        return d["n_ctx"], float("inf") if d["chunks"] == "all" else d["chunks"]

    best = max(run(d) for _, d in parsed)
    parsed = [(p, d) for p, d in parsed if run(d) == best]
    if cells:
        want = set(cells)
        return [p for p, _ in parsed if Path(p).parent.name in want]
    chosen = default_cells([d for _, d in parsed], widths=widths, tail=tail)
    return [p for p, d in parsed if d in chosen]


# ---------------------------------------------------------------- free-running decode


def decode_frame(summary_paths: Iterable[str | Path]) -> pl.DataFrame:
    """Long rows of (cell, step) from kvarn.run.decode summary.json files: survival S(t) (fraction
    of prompts still on the baseline's text after t tokens, t = 0..G) and the mean KLD of
    decode step t (t < G; null at t = G), plus the cell's family, width, label, P, G and decoding
    (`kvarn.vocab.options.summary_sampling`; summaries of two decodings are refused)."""
    import json

    frames = []
    for p in summary_paths:
        s = json.loads(Path(p).read_text())
        cell = Path(p).parent.name
        fam = family_of(s["k_type"])
        g = s["n_tokens"]
        width = type_bits(s["k_type"]) if s["k_type"] == s["v_type"] else None
        label = cell_name(s["k_type"], s["v_type"], s["tail"])
        frames.append(pl.DataFrame({
            "model": s["model"], "cell": cell, "label": label, "family": fam, "width": width,
            "prompts": s["n_prompts"], "tokens": g, "decoding": summary_sampling(s), "step": list(range(g + 1)),
            "survival": s["survival"],
            "kld_step_mean": [*s["decode_kld_step_mean"], None],
            "first_divergence_median": s["first_divergence_median"], "decode_kld_mean": s["decode_kld_mean"],
        }, schema_overrides={"width": pl.Int64, "kld_step_mean": pl.Float64}))
    if not frames:
        raise ValueError("no decode summaries given; the decode figure needs at least one (cell, decode) result")
    out = pl.concat(frames, how="vertical_relaxed")
    if out["decoding"].n_unique() > 1:
        raise ValueError(f"decode summaries of different decodings ({', '.join(out['decoding'].unique(maintain_order=True))}) "
                         f"in one figure; give one decoding's results")
    return out
