"""Two results trees of the same matrix, cell by cell: the same numbers or not.

For every cell directory both trees hold (results/{model}/ctx{N}-c{C}/cells/{cell}/): whether
tokens.parquet is the same bytes, whether the per-token columns are equal, and which
summary.json keys differ (timing keys aside: they are wall-clock). The baseline dumps are
compared as bytes. Cells in one tree only are listed. Writes a markdown table.

    python -m bench.perf.same_numbers BEFORE_DIR AFTER_DIR [--out FILE] [--label-before A --label-after B]

BEFORE_DIR / AFTER_DIR: working directories of two `make run`s (each holding results/).
"""

from __future__ import annotations

import argparse
import filecmp
import json
from pathlib import Path

import polars as pl

from kvarn.run.decode import TIMING_KEYS

# wall-clock fields of a cell's summary.json (kvarn.run.torch_engine.run_cell) and a decode's
TIMING = tuple(dict.fromkeys(("wall_s", "tokens_per_s", "forward_s") + TIMING_KEYS))


def cells(root: Path) -> dict[str, Path]:
    base = root / "results"
    return {str(p.parent.relative_to(base)): p.parent for p in sorted(base.glob("*/ctx*-c*/cells/*/summary.json"))}


def compare(before: Path, after: Path) -> tuple[list[list[str]], dict]:
    a, b = cells(before), cells(after)
    rows, tally = [], {"cells": 0, "same_bytes": 0, "same_tokens": 0, "same_summary": 0}
    for key in sorted(a.keys() & b.keys()):
        tally["cells"] += 1
        same_bytes = filecmp.cmp(a[key] / "tokens.parquet", b[key] / "tokens.parquet", shallow=False)
        same_tokens = pl.read_parquet(a[key] / "tokens.parquet").equals(pl.read_parquet(b[key] / "tokens.parquet"))
        sa, sb = (json.loads((d[key] / "summary.json").read_text()) for d in (a, b))
        diff = sorted(k for k in sa.keys() | sb.keys() if k not in TIMING and sa.get(k) != sb.get(k))
        tally["same_bytes"] += same_bytes
        tally["same_tokens"] += same_tokens
        tally["same_summary"] += not diff
        rows.append([key, "yes" if same_bytes else "no", "yes" if same_tokens else "no", ", ".join(diff) or "—",
                     f"{sa['kld_median']:.6g}", f"{sb['kld_median']:.6g}"])
    only = sorted(a.keys() ^ b.keys())
    bases = sorted({p.relative_to(before / "results") for p in (before / "results").glob("*/ctx*-c*/baseline*.kvd")}
                   & {p.relative_to(after / "results") for p in (after / "results").glob("*/ctx*-c*/baseline*.kvd")})
    tally["baselines"] = [(str(p), filecmp.cmp(before / "results" / p, after / "results" / p, shallow=False))
                          for p in bases]
    tally["only_one"] = only
    return rows, tally


def table(rows, tally, la: str, lb: str) -> str:
    out = [f"| cell | tokens.parquet same bytes | per-token columns equal | summary.json keys that differ "
           f"(timing aside) | median KLD, {la} | median KLD, {lb} |", "|---|---|---|---|---:|---:|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    out += ["", f"{tally['cells']} cells in both: {tally['same_bytes']} with the same tokens.parquet bytes, "
                f"{tally['same_tokens']} with equal per-token columns, {tally['same_summary']} with equal summaries "
                f"(timing keys {', '.join(TIMING)} aside)."]
    out += [f"Baseline {p}: {'the same bytes' if same else 'DIFFERENT bytes'}." for p, same in tally["baselines"]]
    if tally["only_one"]:
        out.append(f"In one tree only: {', '.join(tally['only_one'])}.")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--out", type=Path, help="write the table here (default: print it)")
    ap.add_argument("--label-before", default="before")
    ap.add_argument("--label-after", default="after")
    a = ap.parse_args(argv)
    rows, tally = compare(a.before, a.after)
    if not rows:
        raise SystemExit(f"no cell directory in both {a.before}/results and {a.after}/results")
    text = table(rows, tally, a.label_before, a.label_after)
    if a.out:
        a.out.write_text(text)
    else:
        print(text, end="")
    same = tally["same_summary"] == tally["cells"] and all(s for _, s in tally["baselines"])
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
