"""What produced a committed figure, table or ledger: the code's commit, its numerics versions, the
machine and the command (`record`), and the check that committed figures are current (`stale`).

Numerics versions are every version that changes a number kvarn prints: each KV type's
(`kvarn.vocab.facts`), each compute path's (`COMPUTE_VERSION`), the free-running decode's
(`DECODE_VERSION`), the baseline encoding's (`ENCODING_VERSION`) and KVarN's passes. A committed
ledger whose versions differ from the code's was produced by other arithmetic: tests/test_claims.py
fails until the figures are regenerated (make run, then tools/readme_figures.py --readme).
The machine matters too (one chunk's medians move by a few % between CPUs: docs/notes/performance.md),
so it is recorded, but it is not checked: a reader's machine is not the one that made the figures.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

# What caps the SIMD level of the kernels a run uses: PyTorch's own, MKL's and oneDNN's matmuls, numba's
# compiled KVarN encoder (NUMBA_CPU_NAME, e.g. haswell for AVX2)
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "NUMBA_CPU_NAME")
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def numerics_versions() -> dict:
    from kvarn.baseline.encoding import ENCODING_VERSION
    from kvarn.vocab import facts
    from kvarn.vocab.options import COMPUTE_VERSION, DECODE_VERSION

    return {"types": {n: facts.get(n).version for n in facts.names()}, "compute": dict(COMPUTE_VERSION),
            "decode": DECODE_VERSION, "baseline_encoding": ENCODING_VERSION, "kvarn_iters": facts.KVARN_ITERS}


def machine() -> dict:
    """CPU model, the SIMD levels that change rounding draws, the caps on the kernels' level, cores, and the threads
    torch would use."""
    cpu, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": cpu or platform.processor() or "?", "simd": [f for f in SIMD_FLAGS if f in flags], "cores": os.cpu_count(),
            "threads": int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1), "system": platform.platform(),
            # the kernels' SIMD level: the highest the CPU has unless one of these caps it
            "isa_caps": {k: os.environ[k] for k in ISA_CAPS if os.environ.get(k)}}


def commit(repo: Path | None = None) -> str:
    """The checkout's commit, with "+dirty" when it has uncommitted changes; "unknown" outside git."""
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(command: str, **extra) -> dict:
    return {"commit": commit(), "numerics": numerics_versions(), "machine": machine(), "command": command, **extra}


def stale(recorded: dict) -> list[str]:
    """The numerics versions a recorded provenance has that the code no longer has ('' when current)."""
    now, then = numerics_versions(), recorded.get("numerics") or {}
    out = []
    for key, value in now.items():
        if key == "types":
            for t, v in value.items():
                if (then.get("types") or {}).get(t) != v:
                    out.append(f"{t}: {(then.get('types') or {}).get(t)} recorded, {v} in the code")
        elif key == "compute" and isinstance(then.get(key), dict):
            # per compute path the figures were made on: a path added since moves none of them
            for c, v in then[key].items():
                if value.get(c) != v:
                    out.append(f"compute {c}: {v} recorded, {value.get(c)} in the code")
        elif then.get(key) != value:
            out.append(f"{key}: {then.get(key)!r} recorded, {value!r} in the code")
    return out
