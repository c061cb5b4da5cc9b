"""What every workflow script shares: log redirection, kvarn on the path, atomic writes."""

import contextlib
import os
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


@contextlib.contextmanager
def atomic(path):
    """Yield a temporary path beside `path`; rename it into place only if the block succeeds."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def model_spec(snakemake):
    from kvarn.models import ModelSpec

    return ModelSpec(snakemake.wildcards.model, snakemake.params.source, snakemake.params.revision)
