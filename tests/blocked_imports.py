"""An environment for a child Python in which some packages are not installed, as far as imports
can tell: a sitecustomize puts a meta-path finder ahead of all others that answers "no such
module" for them (a ModuleNotFoundError, as for a missing package, so optional-dependency probes
such as polars' see them absent instead of crashing). tests/test_structure.py keeps processes
torch-free with it; tests/test_bench_gpu_device_run.py runs the device script without polars."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FINDER = '''
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {packages!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: {why})")
        return None

sys.meta_path.insert(0, Blocked())
'''


def blocked_env(tmp_path: Path, packages: tuple[str, ...], why: str, **env) -> dict:
    """os.environ plus `env`, with PYTHONPATH = a fresh folder under `tmp_path` holding the
    sitecustomize that blocks `packages` (the error names `why`), then the repository root."""
    site = tmp_path / ("no_" + "_".join(packages))
    site.mkdir()
    (site / "sitecustomize.py").write_text(FINDER.format(packages=tuple(packages), why=why))
    return dict(os.environ, **env, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
