"""kvarn's benchmarks and external oracles, by purpose (bench/README.md): perf/ (speed, memory,
sizes), gpu/ (the scripts for a lent GPU machine), oracles/ (llama.cpp, BeeLlama). Run a script
from the repository root as a module: `python -m bench.perf.forward_speed --help`.

Paths outside the repository come from the environment (bench/README.md lists them all); this
module holds the two every folder uses."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository root (bench/ is one level down)

# wiki.test.raw: $TEXT, else the README's layout (shared/ beside the checkout, as config/matrix.yaml
# and the tests have it; where it is missing, kvarn rebuilds the text from the hub).
TEXT = Path(os.environ.get("TEXT") or REPO.parent / "shared" / "data" / "wikitext-2-raw-v1" / "wiki.test.raw")


def env_path(name: str, what: str) -> Path:
    """The path in environment variable `name` (`what`: what it points at); a missing or empty
    one stops the script with an error that names the variable."""
    value = os.environ.get(name)
    if not value:
        raise SystemExit(f"environment variable {name} is not set: it names {what} (bench/README.md)")
    return Path(value)
