"""`make study` on two machines (or instruction sets), side by side: every claim's verdict and every
cell's median KLD.

    .venv/bin/python -m bench.study.compare A B [--label-a L] [--label-b L] [--out bench/study/results/FILE.md]
    .venv/bin/python -m bench.study.compare A B --common-cells config/ledger.yaml [...]

A and B are two runs' results folders (each holding claims.parquet and summary.parquet from
`make study`, and optionally a provenance.json from kvarn.report.provenance.record). With
`--common-cells CONFIG`, the runs need not be finished: the ledger of each is computed here
(`kvarn.report.claims.ledger.run_claims`, the claims rule's own function) from the cells of CONFIG that
both have finished (their summary.json and tokens.parquet), and the verdicts are compared on the
rows both can measure; the rows that lack a cell are counted, not compared. Writes a
Markdown table: per (model, claim) the two verdicts and whether they are equal, then per model the
spread of the cells' medians between the runs (|B/A − 1|: median, largest, and the cell with the
largest), then every cell. Exit status 1 when a verdict differs (the comparison says which).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import polars as pl


def verdicts(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """One row per (model, claim_id, claim) of either ledger: verdict_a, verdict_b, equal."""
    keys = ["model", "claim_id", "claim"]
    j = a.select(keys + ["verdict"]).join(b.select(keys + ["verdict"]), on=keys, how="full", suffix="_b",
                                          coalesce=True)
    return j.rename({"verdict": "verdict_a"}).with_columns(
        (pl.col("verdict_a").fill_null("(absent)") == pl.col("verdict_b").fill_null("(absent)")).alias("equal"))


def medians(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """Per (model, n_ctx, chunks, cell) in both runs: median_a, median_b and rel = |b / a − 1|."""
    keys = ["model", "n_ctx", "chunks", "cell"]
    j = a.select(keys + ["kld_median"]).join(b.select(keys + ["kld_median"]), on=keys, how="inner", suffix="_b")
    return j.rename({"kld_median": "median_a", "kld_median_b": "median_b"}).with_columns(
        (pl.col("median_b") / pl.col("median_a") - 1).abs().alias("rel")).sort(keys)


def spread(m: pl.DataFrame) -> pl.DataFrame:
    """Per model: cells compared, the median and the largest |B/A − 1|, and the cell with the largest."""
    return (m.sort("rel", descending=True).group_by("model", maintain_order=True)
            .agg(pl.len().alias("cells"), pl.col("rel").median().alias("median_rel"),
                 pl.col("rel").max().alias("max_rel"), pl.col("cell").first().alias("max_cell")).sort("model"))


def finished_cells(results: Path, config: dict) -> dict[tuple[str, str], tuple[dict, Path]]:
    """(model, cell) -> (its summary row as the cell_row rule writes it, its folder) for every cell of
    `config` finished under `results` (the folder standing for `results/`)."""
    from kvarn.plan.matrix import expand
    from kvarn.plan.rows import cell_columns, summary_row

    m = expand(config)
    out = {}
    for c in m.cells:
        d = results / c.dir.removeprefix("results/")
        if (d / "summary.json").is_file() and (d / "tokens.parquet").is_file():
            row = summary_row(json.loads((d / "summary.json").read_text()),
                              cell_columns(c, m.models[c.model].memory_accounting), where=str(d / "summary.json"))
            out[(c.model, c.name)] = (row, d)
    return out


def common_ledgers(a_dir: Path, b_dir: Path, config: dict, n_boot: int = 2000) -> tuple[pl.DataFrame, ...]:
    """Both runs' ledgers and summaries over the cells both finished: (claims_a, claims_b, summary_a, summary_b)."""
    from kvarn.report.claims.ledger import run_claims

    fa, fb = finished_cells(a_dir, config), finished_cells(b_dir, config)
    common = [k for k in fa if k in fb]
    if not common:
        raise SystemExit(f"no cell of the config is finished in both {a_dir} and {b_dir}")
    out = []
    for f in (fa, fb):
        summary = pl.DataFrame([f[k][0] for k in common], infer_schema_length=None)
        ledger, _ = run_claims(summary, [str(f[k][1] / "tokens.parquet") for k in common], n_boot=n_boot)
        out.append((ledger, summary))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def _prov(folder: Path) -> str:
    p = folder / "provenance.json"
    if not p.is_file():
        return "no provenance.json"
    d = json.loads(p.read_text())
    m = d.get("machine", {})
    return (f"commit {d.get('commit', '?')[:12]}, {m.get('cpu', '?')}, SIMD {' '.join(m.get('simd', [])) or '?'}, "
            f"kernels capped by {m.get('isa_caps') or 'nothing'}, {m.get('threads', '?')} threads{', ' + d['note'] if d.get('note') else ''}; `{d.get('command', '?')}`")


def report(a_dir: Path, b_dir: Path, label_a: str, label_b: str, common_config: Path | None = None) -> tuple[str, bool]:
    scope = ""
    if common_config is not None:
        import yaml

        ca, cb, sa, sb = common_ledgers(a_dir, b_dir, yaml.safe_load(common_config.read_text()))
        from kvarn.report.claims.verdicts import lacks_a_cell

        lacking = lacks_a_cell()
        skipped = ca.filter(lacking).select(["model", "claim_id", "claim"]).vstack(
            cb.filter(lacking).select(["model", "claim_id", "claim"])).unique()
        ca, cb = (c.join(skipped, on=["model", "claim_id", "claim"], how="anti") for c in (ca, cb))
        scope = (f" Over the {sa.height} cells of {common_config.name} both runs finished; {skipped.height} ledger "
                 f"rows lack a cell in that set and are not compared.")
    else:
        ca, cb = pl.read_parquet(a_dir / "claims.parquet"), pl.read_parquet(b_dir / "claims.parquet")
        sa, sb = pl.read_parquet(a_dir / "summary.parquet"), pl.read_parquet(b_dir / "summary.parquet")
    v, m = verdicts(ca, cb), medians(sa, sb)
    same = bool(v["equal"].all())
    out = [f"# `make study` on {label_a} and {label_b}", "",
           f"- **{label_a}**: {_prov(a_dir)}", f"- **{label_b}**: {_prov(b_dir)}", "",
           f"**Every verdict equal: {'yes' if same else 'no'}** ({v['equal'].sum()} of {v.height} ledger rows).{scope}", ""]
    if not same:
        out += ["Verdicts that differ:", "", f"| model | claim | {label_a} | {label_b} |", "|---|---|---|---|"]
        out += [f"| {r['model']} | {r['claim']} | {r['verdict_a']} | {r['verdict_b']} |"
                for r in v.filter(~pl.col("equal")).iter_rows(named=True)]
        out.append("")
    out += ["Spread of the cells' median KLD between the two (|B/A − 1|):", "",
            "| model | cells | median | largest | at |", "|---|---:|---:|---:|---|"]
    out += [f"| {r['model']} | {r['cells']} | {100 * r['median_rel']:.2f} % | {100 * r['max_rel']:.2f} % | {r['max_cell']} |"
            for r in spread(m).iter_rows(named=True)]
    out += ["", "Every ledger row:", "", f"| model | claim | {label_a} | {label_b} |", "|---|---|---|---|"]
    out += [f"| {r['model']} | {r['claim']} | {r['verdict_a']} | {r['verdict_b']} |" for r in v.iter_rows(named=True)]
    out += ["", "Every cell:", "", f"| model | cell | median {label_a} | median {label_b} | |B/A − 1| |",
            "|---|---|---:|---:|---:|"]
    out += [f"| {r['model']} | {r['cell']} | {r['median_a']:.6g} | {r['median_b']:.6g} | {100 * r['rel']:.2f} % |"
            for r in m.iter_rows(named=True)]
    return "\n".join(out) + "\n", same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="the first run's results folder")
    ap.add_argument("b", type=Path, help="the second run's results folder")
    ap.add_argument("--label-a", default="A")
    ap.add_argument("--label-b", default="B")
    ap.add_argument("--out", type=Path, help="write the Markdown here (default: print it)")
    ap.add_argument("--common-cells", type=Path, metavar="CONFIG",
                    help="compare the ledgers of the cells of CONFIG both runs finished (runs need not be complete)")
    a = ap.parse_args(argv)
    for d in (a.a, a.b):
        for f in (() if a.common_cells else ("claims.parquet", "summary.parquet")):
            if not (d / f).is_file():
                raise SystemExit(f"{d / f}: missing; run `make study` there first")
    text, same = report(a.a, a.b, a.label_a, a.label_b, a.common_cells)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
