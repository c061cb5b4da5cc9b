"""Where kvarn workers keep their files, shared by `kvarn.run.worker` (which creates them) and
`kvarn.budget.preflight` (which reads and writes the memory record), so that neither imports the
other: the socket directory, the own-socket variable set inside a worker, and the record of
what a worker's loaded model holds."""

from __future__ import annotations

import os
from pathlib import Path

DIR_ENV = "KVARN_WORKER_DIR"  # the sockets' directory (default DEFAULT_DIR under the working directory)
SOCKET_ENV = "KVARN_WORKER_SOCKET"  # set in a worker's own process: its socket
DEFAULT_DIR = ".snakemake/kvarn-workers"


def socket_dir(directory=None) -> Path:
    """The workers' directory: `directory`, else $KVARN_WORKER_DIR, else DEFAULT_DIR."""
    return Path(directory or os.environ.get(DIR_ENV) or DEFAULT_DIR)


def held_path(sock: Path) -> Path:
    """Where a worker records the memory its loaded model holds (kvarn.budget.preflight writes it)."""
    return Path(sock).with_suffix(".held")
