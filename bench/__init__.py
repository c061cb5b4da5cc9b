"""kvarn's benchmarks and external oracles, by purpose (bench/README.md): perf/ (speed, memory,
sizes), gpu/ (the scripts for a lent GPU machine), oracles/ (llama.cpp, BeeLlama). Run a script
from the repository root as a module: `python -m bench.perf.engine --help`."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository root (bench/ is one level down)
