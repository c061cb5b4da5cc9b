"""The allocations (kvarn.vocab.allocation) as the cell jobs see them: their definitions published
where the jobs and their workers look them up (`publish_allocations`), and the versions of the
types an allocation's cell uses (`allocation_versions`: a bump reruns its cells). Torch-free.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvarn.files.atomic import write_text
from kvarn.plan.rows import format_version
from kvarn.vocab import allocation
from kvarn.vocab.cell import CellSpec


def allocation_versions(cell: CellSpec) -> dict:
    """What a cell job's `versions` param adds to its K and V types' versions: for a cell of an
    allocation {"alloc": {type: version}} of every type it uses (a bump reruns its cells); {} else."""
    if cell.alloc is None:
        return {}
    a = allocation.lookup(cell.alloc)
    return {"alloc": {t: format_version(t) for t in dict.fromkeys(a.k.types() + a.v.types())}}


def publish_allocations(allocs, directory=None) -> Path | None:
    """Write each allocation's record to `directory` (default kvarn.vocab.allocation.directory())
    as `{token}.json` and name that directory in $KVARN_ALLOCATIONS_DIR, so the job scripts this
    process starts, and the workers they start, find them (`kvarn.vocab.allocation.lookup`).
    Content-addressed: a file already there holds the same definition. None when there is none."""
    allocs = list(allocs)
    if not allocs:
        return None
    d = Path(directory or allocation.directory()).resolve()
    for a in allocs:
        allocation.define(a)
        path = d / f"{a.token}.json"
        if not path.is_file():
            write_text(path, json.dumps(a.record(), indent=1) + "\n")
    os.environ[allocation.DIR_ENV] = str(d)
    return d

