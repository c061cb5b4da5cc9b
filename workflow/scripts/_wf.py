"""What every workflow script shares: log redirection, kvarn on the path, atomic writes."""

import contextlib
import os
import shutil
import sys
import tempfile
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
    """kvarn.files.atomic.atomic_path: a temporary path, renamed into place if the block succeeds."""
    from kvarn.files.atomic import atomic_path  # after start(): kvarn may only be on sys.path then

    return atomic_path(path)


def model_spec(snakemake):
    from kvarn.weights.sources import ModelSpec

    return ModelSpec(snakemake.wildcards.model, snakemake.params.source, snakemake.params.revision)


@contextlib.contextmanager
def scratch(*outputs):
    """A fresh scratch directory beside `outputs` (paths in one directory) for a run to write
    into; on success each output is moved into place in the order given (put the one whose
    presence means "done" last). A killed earlier attempt's scratch is removed first."""
    out_dir = Path(outputs[0]).parent
    for stale in out_dir.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir))
    try:
        yield tmp
        for out in outputs:
            os.replace(tmp / Path(out).name, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
