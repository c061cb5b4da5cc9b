"""One table of every mutated module's latest score, from the groups' results files.

    python -m bench.mutation.summary [--results DIR]

Reads `results/<group>.md` as `bench.mutation.run` writes them (not the `.before.md` first runs) and
writes `results/summary.md`: per module its score (and 95 % interval where sampled), the counts, and
the commit, date and command of the run it comes from, and whether the file carries a hand note
(survivors killed or judged after the run: read it there). The goal is >= 90 % per module.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GOAL = 90.0
_HEAD = re.compile(r"^mutmut \S+ at (?P<sha>[0-9a-f]+)(?P<dirty>\+dirty)?, (?P<date>\d{4}-\d\d-\d\d \d\d:\d\d UTC), .*Command: `(?P<cmd>[^`]+)`")
_ROW = re.compile(r"^\| `(?P<module>[^`]+)` \| (?P<mutants>[^|]+) \| (?P<killed>\d+) \((?P<timeouts>\d+)\) \| "
                  r"(?P<survived>\d+) \| (?P<equivalent>\d+) \| (?P<other>\d+) \| (?P<score>[^|]+) \|$")


def read(path: Path) -> list[dict]:
    """The module rows of one results file, each with its run's commit, date and command."""
    text = path.read_text()
    head = next((m for m in map(_HEAD.match, text.splitlines()) if m), None)
    if head is None:
        raise ValueError(f"{path}: no 'mutmut ... at <commit>, <date>, ... Command: `...`' line; "
                         "not a results file of bench.mutation.run")
    rows = [m.groupdict() for m in map(_ROW.match, text.splitlines()) if m]
    if not rows:
        raise ValueError(f"{path}: no module rows")
    note = "Note (added by hand)" in text
    for r in rows:
        r.update(group=path.stem, sha=head["sha"][:7] + (head["dirty"] or ""), date=head["date"], cmd=head["cmd"], note=note)
        m = re.match(r"([\d.]+) %", r["score"].strip())
        r["value"] = float(m[1]) if m else None
    return rows


def summary(results: Path) -> str:
    files = sorted(p for p in results.glob("*.md") if not p.name.endswith(".before.md") and p.name != "summary.md")
    rows = [r for p in files for r in read(p)]
    below = [r["module"] for r in rows if r["value"] is None or r["value"] < GOAL]
    lines = ["# Mutation scores, every module", "",
             f"`python -m bench.mutation.summary` from the groups' results files (bench/mutation/results/<group>.md); "
             f"goal: >= {GOAL:.0f} % of the non-equivalent mutants killed per module. A sampled run's score is an "
             "estimate (its 95 % interval in brackets). \"hand note\": survivors killed by tests added after the "
             "run, or judged, are listed in that file's note.", "",
             "| module | group | score | mutants | killed (timeouts) | survived | equivalent | run | hand note |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| `{r['module']}` | {r['group']} | {r['score'].strip()} | {r['mutants'].strip()} | {r['killed']} "
                     f"({r['timeouts']}) | {r['survived']} | {r['equivalent']} | {r['sha']}, {r['date']}: "
                     f"`{r['cmd']}` | {'yes' if r['note'] else ''} |")
    lines += ["", f"Below {GOAL:.0f} % at their last run: " + (", ".join(f"`{m}`" for m in below) if below else "none") + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default: bench/mutation/results)")
    a = ap.parse_args(argv)
    out = a.results / "summary.md"
    out.write_text(summary(a.results))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
