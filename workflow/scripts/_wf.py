"""What every workflow script shares: log redirection, kvarn on the path, atomic writes."""

import sys
from pathlib import Path


def start(snakemake):
    """Send stdout/stderr to the rule's log and make the checkout's kvarn importable."""
    log = open(snakemake.log[0], "w", buffering=1)
    sys.stdout = sys.stderr = log
    root = Path(snakemake.scriptdir).resolve().parents[1]
    if (root / "kvarn").is_dir():
        sys.path.insert(0, str(root))  # a conda env has the stack, not kvarn itself
    return log


def atomic(path):
    """kvarn.atomic.atomic_path: a temporary path, renamed into place if the block succeeds."""
    from kvarn.atomic import atomic_path  # after start(): kvarn may only be on sys.path then

    return atomic_path(path)


def model_spec(snakemake):
    from kvarn.sources import ModelSpec

    return ModelSpec(snakemake.wildcards.model, snakemake.params.source, snakemake.params.revision)
