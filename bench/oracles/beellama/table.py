"""BeeLlama's llama-perplexity --kl-divergence beside kvarn cells on the same tokens.

BeeLlama scores against kvarn's own baseline written in llama's format (`kvarn baseline
--llama-kld-out base.kld`; then `llama-perplexity ... --kl-divergence-base base.kld
--kl-divergence`), so both programs' KLD is over the same tokens and the same reference
distribution. The kvarn column is the cell's own compute path (its summary's `compute`:
`exact`, or `llamacpp-cpu`, llama.cpp's arithmetic with BeeLlama's scalar route for KVarN and
tails); the ratio is kvarn over BeeLlama. The log parser is bench/oracles/llamacpp/runs.py's (BeeLlama prints upstream's summary).

    python -m bench.oracles.beellama.table ROW:BEELLAMA_LOG:KVARN_CELL_DIR [...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.oracles.llamacpp.runs import fmt, parse_llama


def row(label: str, bee_log: Path, cell: Path) -> list:
    bee = parse_llama(bee_log) or {}
    ours = json.loads((cell / "summary.json").read_text())

    def ratio(a, b):
        return "—" if a is None or b in (None, 0) else f"{a / b:.2f}"

    return [label, ours.get("compute", "exact"), fmt(bee.get("kld_median")), fmt(ours["kld_median"]), ratio(ours["kld_median"], bee.get("kld_median")),
            fmt(bee.get("kld_mean")), fmt(ours["kld_mean"]), ratio(ours["kld_mean"], bee.get("kld_mean")),
            fmt(bee.get("kld_p99"), 4), fmt(ours["kld_p99"], 4),
            fmt(100 * bee["same_top"], 2) if "same_top" in bee else "—", fmt(100 * ours["same_top"], 2)]


HEADER = ["row", "kvarn compute", "BeeLlama median", "kvarn median", "ratio", "BeeLlama mean", "kvarn mean", "ratio",
          "BeeLlama p99", "kvarn p99", "BeeLlama same top %", "kvarn same top %"]


def table(specs: list[str]) -> str:
    rows = []
    for spec in specs:
        label, log, cell = spec.split(":")
        rows.append(row(label, Path(log), Path(cell)))
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(table(sys.argv[1:]))
