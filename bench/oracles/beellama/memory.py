"""BeeLlama's own KV buffers beside `kvarn memory` (issue 21, item 4).

For every cell of the grid, start BeeLlama's llama-perplexity with `-v`, read its log
until the real context has allocated its caches (the scheduler's `sched_reserve` line
after BeeLlama's parameter-fitting probes, which build contexts that allocate nothing),
or until the process ends (a refusal), then stop it — no tokens are evaluated. The sizes it
prints (`KV buffer size`, `KV tail buffer size`, `KVarN buffer size`, `KVarN tail
buffer size`, in MiB to 2 decimals) are summed per cell and put beside `kvarn.budget.memory`'s
total for the same GGUF (`kvarn memory -m GGUF -c N -ub 512 --accounting A`).

Resumable: a cell whose log is complete (ends with this script's `# done` line) is not
run again; every log is kept under the output folder, with the GGUF's geometry
(`geometry.json`, slow to read) and the table's data (`memory.json`).

    BEELLAMA_BUILD=<build dir> python -m bench.oracles.beellama.memory --model gemma3-270m
    BEELLAMA_BUILD=<build dir> python -m bench.oracles.beellama.memory --model smollm2-135m
    python -m bench.oracles.beellama.memory --model gemma3-270m --table-only   # from the kept logs

Output folder: --out, else $BEELLAMA_MEMORY_OUT, else bench/out/beellama/memory (git-ignored).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import REPO as ROOT
from bench import TEXT, env_path
DONE = "# done"
MARKER = "sched_reserve:"  # printed after every cache of the context is allocated
CONTEXT = "llama_context: constructing llama_context"  # one per context built
FITTING = "fitting params to device memory"  # BeeLlama first sizes its probes: contexts that allocate nothing
FIT_DONE = "fitting params to free memory took"  # the probes are over; the next context is the real one

MODELS = {  # name: (GGUF under resources/models, n_ctx of the grid)
    "gemma3-270m": ("gemma3-270m/gemma-3-270m-q4_k_m.gguf", 4096),
    "smollm2-135m": ("smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf", 2048),
}
STANDARD = ("q8_0", "q6_0", "q5_0", "q4_0", "q3_0", "q2_0")
KVARN = ("kvarn2", "kvarn3", "kvarn4", "kvarn5", "kvarn6", "kvarn8")
KVARN_PAIRS = (("kvarn6", "kvarn5"), ("kvarn5", "kvarn4"), ("kvarn4", "kvarn2"), ("kvarn3", "kvarn2"))

BUFFER_RE = re.compile(r"(\S+):\s+(\S+) (KV|KV tail|KVarN|KVarN tail) buffer size =\s*([0-9.]+) MiB")
ERROR_RE = re.compile(r"^\S+ E ")  # a line BeeLlama logs at error level


@dataclass(frozen=True)
class Cell:
    k: str
    v: str
    tail: int

    @property
    def name(self) -> str:
        kv = self.k if self.k == self.v else f"{self.k}-{self.v}"
        return f"{kv}-t{self.tail}"


def grid(model: str) -> list[Cell]:
    """The issue's grid (item 3): standard rows at --kv-tail-tokens 0 and 128 on both models;
    KVarN at 0 and 512 and the asymmetric pairs on Gemma 3; SmolLM2 (head dim 64) gets one
    KVarN cell, to record the refusal."""
    cells = [Cell(t, t, n) for t in STANDARD for n in (0, 128)]
    if model == "smollm2-135m":
        return cells + [Cell("kvarn4", "kvarn4", 0)]
    return cells + [Cell(t, t, n) for t in KVARN for n in (0, 512)] + [Cell(k, v, 0) for k, v in KVARN_PAIRS]


def parse_log(text: str) -> dict:
    """The buffer sizes of one BeeLlama start: each buffer line (who, kind, MiB), their sum,
    the KVarN staging line and the standard tail plan if printed, and the first error line.

    Only the last context counts: BeeLlama first fits its parameters to the device by
    building contexts that allocate nothing (their buffers print 0.00 MiB), then builds
    the real one."""
    full = text
    cut = text.rfind(CONTEXT)
    text = text[cut:] if cut >= 0 else text
    real = FITTING not in full or FIT_DONE in full[:max(cut, 0)]
    buffers = [(m.group(1), m.group(3), float(m.group(4))) for m in BUFFER_RE.finditer(text)] if real else []
    out = {"buffers": buffers, "total_mib": round(sum(b[2] for b in buffers), 2) if buffers else None,
           "reached": real and MARKER in text}
    for key, pat in (("kvarn_stage", r"KVarN cache: (stage_groups=.*)"),
                     ("tail_plan", r"standard KV tail plan: (.*)"),
                     ("tail_alloc", r"llama_kv_cache: (tail type=.*)")):
        found = re.findall(pat, text)
        if found:
            out[key] = found
    if not out["reached"]:
        errors = [ERROR_RE.sub("", ln).strip() for ln in full.splitlines() if ERROR_RE.search(ln)]
        out["error"] = errors[0] if errors else "ended before allocating its caches"
    return out


def rounding(bee: dict) -> float:
    """How far a sum of BeeLlama's printed buffer sizes can be from the bytes: 0.005 MiB per
    non-zero line (each printed to 2 decimals), at least 0.01 MiB."""
    return max(0.01, 0.005 * sum(1 for b in bee["buffers"] if b[2])) + 1e-9


def beellama_command(build: Path, gguf: Path, text: Path, n_ctx: int, cell: Cell) -> list[str]:
    return [str(build / "bin" / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(n_ctx),
            "-ub", "512", "-t", "1", "-nr", "-v", "-ctk", cell.k, "-ctv", cell.v,
            "--kv-tail-tokens", str(cell.tail)]


def run_cell(cmd: list[str], log: Path, timeout: float = 300.0) -> None:
    """Start BeeLlama, keep its output until MARKER (or its end), stop it, write the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_ATTN_ROT_DISABLE"}
    proc = subprocess.Popen(["nice", "-n", "10", *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", env=env)
    lines, start, probes_over = [], time.monotonic(), True
    try:
        for line in proc.stdout:
            lines.append(line)
            probes_over = (probes_over and FITTING not in line) or FIT_DONE in line
            if (MARKER in line and probes_over) or time.monotonic() - start > timeout:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    tmp = log.with_suffix(".part")
    tmp.write_text("$ " + " ".join(cmd) + "\n" + "".join(lines) + f"{DONE} rc={proc.returncode}\n")
    tmp.replace(log)


@functools.cache
def gguf_geometry(gguf: Path, cache: Path | None = None):
    """The per-layer geometry `kvarn memory -m GGUF` reads from the file's metadata (slow:
    kept in `cache`, a JSON of `Geometry.to_list()`, once read)."""
    from kvarn.vocab.geometry import Geometry, geometry_from_config

    if cache is not None and cache.is_file():
        return Geometry.from_list(json.loads(cache.read_text()))
    from kvarn.budget.model_config import memory_config

    config, _ = memory_config(str(gguf), str(ROOT / "resources" / "models"))
    geom = geometry_from_config(config)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(geom.to_list()) + "\n")
    return geom


def kvarn_total(geom, n_ctx: int, cell: Cell, accounting: str) -> float | str:
    """`kvarn memory -m GGUF -c N -ub 512 --tail T --accounting A`'s total MiB (or its refusal)."""
    from kvarn.budget.memory import MIB, kv_bytes
    from kvarn.vocab.cell import CellSpec

    try:
        b = kv_bytes(geom, n_ctx, CellSpec(cell.k, cell.v, cell.tail), ubatch=512, accounting=accounting)
    except ValueError as e:
        return f"refused: {e}"
    return b.total / MIB


def table(model: str, out: Path, accountings: list[str]) -> str:
    gguf_rel, n_ctx = MODELS[model]
    gguf = ROOT / "resources" / "models" / gguf_rel
    head = ["cell", "BeeLlama buffers (MiB)", "BeeLlama total MiB"] + [f"kvarn {a}" for a in accountings] + ["equal (to the printed rounding)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    summary = {}
    geom = gguf_geometry(gguf, out / model / "geometry.json")
    for cell in grid(model):
        log = out / model / f"{cell.name}.log"
        if not log.is_file():
            rows.append(f"| {cell.name} | not run | | " + " | " * len(accountings) + " |")
            continue
        bee = parse_log(log.read_text())
        ours = {a: kvarn_total(geom, n_ctx, cell, a) for a in accountings}
        summary[cell.name] = {"beellama": bee, "kvarn": ours}
        if bee["total_mib"] is None:
            bee_cells = [bee.get("error", "?"), "—"]
        else:
            bee_cells = [" + ".join(f"{mib:.2f}" for _, _, mib in bee["buffers"]), f"{bee['total_mib']:.2f}"]
        equal = [a for a, v in ours.items() if isinstance(v, float) and bee["total_mib"] is not None
                 and abs(v - bee["total_mib"]) <= rounding(bee)]
        ours_cells = [f"{v:.2f}" if isinstance(v, float) else v for v in ours.values()]
        rows.append("| " + " | ".join([cell.name, *bee_cells, *ours_cells, ", ".join(equal) or "no"]) + " |")
    (out / model / "memory.json").write_text(json.dumps(summary, indent=1) + "\n")
    return f"### {model}, n_ctx {n_ctx}, ubatch 512\n\n" + "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--accounting", nargs="+", default=["beellama-v043", "beellama-gemma", "packed"])
    ap.add_argument("--table-only", action="store_true", help="no BeeLlama runs: the table from the kept logs")
    args = ap.parse_args(argv)
    out = args.out or Path(os.environ.get("BEELLAMA_MEMORY_OUT", ROOT / "bench" / "out" / "beellama" / "memory"))
    gguf_rel, n_ctx = MODELS[args.model]
    gguf = ROOT / "resources" / "models" / gguf_rel
    if not args.table_only:
        build = env_path("BEELLAMA_BUILD", "BeeLlama's cmake build directory, with bin/llama-perplexity")
        for cell in grid(args.model):
            log = out / args.model / f"{cell.name}.log"
            if log.is_file() and log.read_text().rstrip().splitlines()[-1].startswith(DONE):
                continue
            print(f"{args.model} {cell.name} ...", file=sys.stderr, flush=True)
            run_cell(beellama_command(build, gguf, args.text, n_ctx, cell), log)
    print(table(args.model, out, args.accounting))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
