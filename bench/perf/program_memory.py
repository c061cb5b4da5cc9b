"""Host memory of a llama.cpp-engine baseline (kvarn's harness) beside llama-perplexity's own, side by side.

llama-perplexity keeps a chunk's logits on the host (n_ctx x vocab floats) when the chunk spans
several batches; the harness (kvarn/llamacpp_engine/kvarn_kld.cpp) scores each batch as it is decoded.
Both write the same KLD base file (checked here too); the peak resident set of each process is
read from the kernel (`resource.getrusage(RUSAGE_CHILDREN)` of a fresh child per run).

    python -m bench.perf.program_memory [--model smollm2-135m] [--ctx 4096 16384] [--batch 512]
        [--build upstream] [--out bench/perf/results/program_memory.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import REPO, TEXT


def peak_rss(cmd: list[str], log: Path) -> tuple[int, float]:
    """(peak RSS in bytes, wall seconds) of `cmd`, run in a child that only forks it."""
    probe = ("import resource,subprocess,sys,time; t=time.time(); "
             "r=subprocess.run(sys.argv[2:], stdout=open(sys.argv[1],'w'), stderr=subprocess.STDOUT); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.time()-t, r.returncode)")
    out = subprocess.run([sys.executable, "-c", probe, str(log), *cmd], capture_output=True, text=True, check=True)
    kib, wall, rc = out.stdout.split()
    if int(rc) != 0:
        raise SystemExit(f"{cmd[0]} failed (rc {rc}); see {log}")
    return int(kib) * 1024, float(wall)


def main(argv=None) -> int:
    from kvarn.llamacpp_engine import build as pbuild
    from kvarn.llamacpp_engine import runner
    from kvarn.llamacpp_engine.settings import Settings
    from kvarn.report.provenance import machine
    from kvarn.weights.sources import gguf_path, parse_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--build", default=pbuild.UPSTREAM)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kvarn-program-memory")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "perf" / "results" / "program_memory.md")
    a = ap.parse_args(argv)

    b = pbuild.read_build(a.build)
    exe = pbuild.harness(b)
    spec = parse_model(a.model)
    gguf = gguf_path(spec, REPO / "resources" / "models")
    if gguf is None:
        raise SystemExit(f"{a.model}: no GGUF in resources/models; fetch it first (kvarn fetch -m {a.model})")
    vocab = None
    a.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n_ctx in a.ctx:
        common = runner.common_args(b, Settings(batch=a.batch, args=("--no-repack",)), gguf, n_ctx, a.batch, a.threads)
        common += ["-f", str(TEXT), "--chunks", "1", "-ctk", "bf16", "-ctv", "bf16"]
        ref_kld, ours_kld = a.work / f"ref-{n_ctx}.kld", a.work / f"ours-{n_ctx}.kld"
        ref = peak_rss([str(b.perplexity), *common, "--kl-divergence-base", str(ref_kld)], a.work / f"ref-{n_ctx}.log")
        ours = peak_rss([str(exe), "--kvarn-mode", "base", "--kvarn-records", str(a.work / f"ours-{n_ctx}.tsv"), *common,
                         "--kl-divergence-base", str(ours_kld)], a.work / f"ours-{n_ctx}.log")
        same = subprocess.run(["cmp", "-s", str(ref_kld), str(ours_kld)]).returncode == 0
        if vocab is None:
            with open(ref_kld, "rb") as f:
                vocab = int.from_bytes(f.read(16)[12:16], "little")
        rows.append((n_ctx, ref, ours, same))
        for p in (ref_kld, ours_kld):
            p.unlink()
        print(f"n_ctx {n_ctx}: llama-perplexity {ref[0] / 2**20:.0f} MiB, harness {ours[0] / 2**20:.0f} MiB, "
              f"same file {same}", flush=True)

    cpu = machine()["cpu"]
    lines = [
        "# Host memory: the llama.cpp engine's harness beside llama-perplexity", "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu} ({os.cpu_count()} cores, "
        f"{platform.machine()}), build {b.version} ({b.backend}).",
        f"Command: `python -m bench.perf.program_memory --model {a.model} --ctx {' '.join(map(str, a.ctx))} "
        f"--batch {a.batch} --threads {a.threads}`", "",
        f"Baseline run (bf16 cache, `--kl-divergence-base`), one chunk, -b {a.batch}, vocabulary {vocab}. "
        "llama-perplexity holds the chunk's logits: n_ctx x vocab x 4 bytes (the 'logits held' column); "
        f"the harness holds one batch's outputs (the context's output buffer, {a.batch} x vocab x 4 bytes = "
        f"{a.batch * vocab * 4 / 2**20:.0f} MiB) and one batch's base rows.", "",
        "| n_ctx | logits held by llama-perplexity | llama-perplexity peak RSS | harness peak RSS | wall (llama / harness) | same base file |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for n_ctx, ref, ours, same in rows:
        lines.append(f"| {n_ctx} | {n_ctx * vocab * 4 / 2**20:.0f} MiB | {ref[0] / 2**20:.0f} MiB | {ours[0] / 2**20:.0f} MiB "
                     f"| {ref[1]:.0f} s / {ours[1]:.0f} s | {'yes' if same else 'NO'} |")
    a.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
