"""The engine's self-check on a real build: a cell that cannot race passes first, then one that races.

On a llama.cpp build given by path (BeeLlama v0.4.3 is the one that races: docs/notes/beellama-thread-race.md),
one model at one n_ctx: the bf16 base file (one chunk), then `kvarn.llamacpp_engine.runner.self_check` at
`--threads` on each `--cells` cell in the order given. The default order is the issue's scenario: q4_0 with a
1024-token tail (1025 ring slots against a 512-token ubatch: no slot written twice, so a sound pass), then q4_0
with a 128-token tail (129 slots: raced on BeeLlama v0.4.3), which must be checked on its own records and
refused, not accepted from the first cell's cached pass. No pass from
an earlier run is read when `--fresh` empties the build's self-check cache first.

    .venv/bin/python -m bench.program.raced_cell --build $KVARN_LLAMACPP_BUILD --work /tmp/raced --fresh \\
        --out bench/program/results/raced-cell.md
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench import REPO, TEXT
from bench.program.beellama import write_table
from kvarn.files.identity import file_sha256, uncached_sha256
from kvarn.llamacpp_engine import build as pbuild
from kvarn.llamacpp_engine import runner
from kvarn.llamacpp_engine.settings import Settings
from kvarn.report.provenance import machine
from kvarn.vocab.cell import CellSpec
from kvarn.weights.sources import ModelSpec, gguf_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.environ.get(pbuild.BUILD_ENV), help="the llama.cpp build folder")
    ap.add_argument("--model", default="smollm2-135m", help="an embedded model (default smollm2-135m)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cells", nargs="+", default=["q4_0-q4_0-t1024", "q4_0-q4_0-t128"])
    ap.add_argument("--args", nargs="*", default=["--no-repack"], help="extra program arguments (as the engine's)")
    ap.add_argument("--work", type=Path, required=True, help="a scratch folder (base file, records)")
    ap.add_argument("--out", type=Path, help="write the outcome as Markdown here (between its <!-- table --> markers)")
    ap.add_argument("--fresh", action="store_true", help="empty the build's self-check cache (<build>/kvarn/selfcheck) first")
    a = ap.parse_args(argv)
    if not a.build:
        ap.error(f"give --build or set ${pbuild.BUILD_ENV}")
    b = pbuild.read_build(a.build)
    settings = Settings(args=tuple(a.args), threads=a.threads)
    spec = ModelSpec(a.model, f"embedded:{a.model}")
    gguf = gguf_path(spec, REPO / "resources" / "models")
    a.work.mkdir(parents=True, exist_ok=True)
    base = a.work / "base.kld"
    if not Path(f"{base}.json").is_file():
        runner.run_baseline(b, Settings(args=tuple(a.args)), gguf, file_sha256(gguf), TEXT, uncached_sha256(TEXT),
                            a.n_ctx, 1, a.ubatch, 1, base)
    cache = b.dir / "kvarn" / "selfcheck"
    if a.fresh:
        for p in cache.glob("*.json"):
            p.unlink()
    rows = []
    for name in a.cells:
        cell = CellSpec.from_name(name)
        t0 = time.perf_counter()
        try:
            r = runner.self_check(b, settings, cell, gguf, file_sha256(gguf), a.n_ctx, a.ubatch, a.threads, base,
                                  a.work / f"selfcheck-{name}")
            rows.append((name, "passed", r["differing_tokens"], time.perf_counter() - t0, ""))
        except runner.Refused as e:
            cached = max(cache.glob("*.json"), key=lambda p: p.stat().st_mtime)
            rows.append((name, "refused", json.loads(cached.read_text())["differing_tokens"],
                         time.perf_counter() - t0, str(e)))
        print(rows[-1][:4], flush=True)
    lines = [f"Build: `${pbuild.BUILD_ENV}` = {b.version}, {b.backend}; model {a.model}, n_ctx {a.n_ctx}, one chunk, "
             f"-ub {a.ubatch}, -t {a.threads} against -t 1; machine: {machine()['cpu']}, {os.cpu_count()} cores.", "",
             "| order | cell | self-check | tokens differing (t1 vs run 1, t1 vs run 2, run 1 vs run 2) | wall s |",
             "|---:|---|---|---|---:|"]
    for i, (name, verdict, d, wall, _) in enumerate(rows, 1):
        lines.append(f"| {i} | {name} | {verdict} | {d['t1_run1']}, {d['t1_run2']}, {d['run1_run2']} | {wall:.0f} |")
    lines += [""] + [f"Refusal of {name}: {msg.replace(str(b.dir), '$' + pbuild.BUILD_ENV)}"
                     for name, verdict, _, _, msg in rows if verdict == "refused"]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        write_table(a.out, text.rstrip("\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
