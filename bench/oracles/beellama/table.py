"""BeeLlama's llama-perplexity --kl-divergence beside kvarn cells on the same tokens.

BeeLlama scores against kvarn's own baseline written in llama's format (`kvarn baseline
--llama-kld-out base.kld`; then `llama-perplexity ... --kl-divergence-base base.kld
--kl-divergence`), so both programs' KLD is over the same tokens and the same reference
distribution. The kvarn column is the cell's own compute path (its summary's `compute`:
`exact`, or `llamacpp-cpu`, llama.cpp's arithmetic with BeeLlama's scalar route for KVarN and
tails); the ratio is kvarn over BeeLlama. The log parser is bench/oracles/llamacpp/runs.py's (BeeLlama prints upstream's summary).

    python -m bench.oracles.beellama.table ROW:BEELLAMA_LOG:KVARN_CELL_DIR [...]

The grid runner (grid.py) adds what a 4-chunk row needs beside `row`: each chunk's mean
(`chunk_cells`), the issue's target (`target`) and each process's CPU cost from its
`/usr/bin/time -v` report (`time_v`, `cost_cells`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from bench.oracles.llamacpp.compare import our_chunk_means
from bench.oracles.llamacpp.runs import fmt, parse_llama

TARGET = 0.10  # issue 21 item 3: llamacpp-cpu's median and mean each within 10 % of BeeLlama's
BASE_PPL = 0.002  # and the base PPL both programs read within 0.2 %


def ratio(a, b, nd: int = 2) -> str:
    """a / b to `nd` decimals, "—" where either is missing or b is 0."""
    return "—" if a is None or b in (None, 0) else f"{a / b:.{nd}f}"


def row(label: str, bee_log: Path, cell: Path) -> list:
    bee = parse_llama(bee_log) or {}
    ours = json.loads((cell / "summary.json").read_text())
    return [label, ours.get("compute", "exact"), fmt(bee.get("kld_median")), fmt(ours["kld_median"]), ratio(ours["kld_median"], bee.get("kld_median")),
            fmt(bee.get("kld_mean")), fmt(ours["kld_mean"]), ratio(ours["kld_mean"], bee.get("kld_mean")),
            fmt(bee.get("kld_p99"), 4), fmt(ours["kld_p99"], 4),
            fmt(100 * bee["same_top"], 2) if "same_top" in bee else "—", fmt(100 * ours["same_top"], 2)]


HEADER = ["row", "kvarn compute", "BeeLlama median", "kvarn median", "ratio", "BeeLlama mean", "kvarn mean", "ratio",
          "BeeLlama p99", "kvarn p99", "BeeLlama same top %", "kvarn same top %"]


def target(bee: dict, ours: dict) -> str:
    """The issue's target for one kvarn cell against BeeLlama's row: "met" when the median and
    the mean KLD are each within TARGET of BeeLlama's and the base PPL within BASE_PPL, else
    "not met" with what missed."""
    missed = []
    for key in ("kld_median", "kld_mean"):
        b, o = bee.get(key), ours.get(key)
        if b is None or o is None or abs(o / b - 1) > TARGET:
            missed.append(key[4:])
    b, o = bee.get("ppl_base"), ours.get("ppl_base")
    if b is None or o is None or abs(o / b - 1) > BASE_PPL:
        missed.append("base PPL")
    return "met" if not missed else "not met (" + ", ".join(missed) + ")"


def chunk_cells(bee: dict, cell: Path) -> list[str]:
    """BeeLlama's and kvarn's per-chunk mean KLD, side by side ("a / b" per chunk)."""
    ours = our_chunk_means(cell)
    theirs = bee.get("kld_chunk_means") or []
    n = max(len(ours), len(theirs))
    pick = lambda xs, i: fmt(xs[i]) if i < len(xs) else "—"  # noqa: E731
    return [f"{pick(theirs, i)} / {pick(ours, i)}" for i in range(n)]


TIME_RE = {"user_s": re.compile(r"User time \(seconds\): ([\d.]+)"),
           "wall": re.compile(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)")}
LOAD_RE = re.compile(r"^# (?:start|end) \S+ load ([\d.]+) ([\d.]+) ([\d.]+)", re.M)


def time_v(log: Path) -> dict | None:
    """A process's `/usr/bin/time -v` report in its log: user CPU seconds, wall seconds, and the
    1-minute load averages the grid runner wrote at its start and end."""
    if not log.is_file():
        return None
    text = log.read_text(errors="replace")
    user, wall = TIME_RE["user_s"].search(text), TIME_RE["wall"].search(text)
    if not user or not wall:
        return None
    secs = 0.0
    for part in wall.group(1).split(":"):
        secs = 60 * secs + float(part)
    return {"user_s": float(user.group(1)), "wall_s": secs, "load": [float(m[0]) for m in LOAD_RE.findall(text)]}


def cost_cells(t: dict | None, floor: dict | None) -> list[str]:
    """User CPU seconds, their ratio to the bf16 row's (same program and compute), wall."""
    if t is None:
        return ["—", "—", "—"]
    ratio = f"{t['user_s'] / floor['user_s']:.2f}" if floor else "—"
    return [f"{t['user_s']:.1f}", ratio, f"{t['wall_s']:.0f}"]


def md_lines(head: list[str], rows: list[list[str]]) -> list[str]:
    """A GitHub Markdown table's lines: the header, its rule, one line per row."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def table(specs: list[str]) -> str:
    rows = []
    for spec in specs:
        label, log, cell = spec.split(":")
        rows.append(row(label, Path(log), Path(cell)))
    return "\n".join(md_lines(HEADER, rows))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(table(sys.argv[1:]))
