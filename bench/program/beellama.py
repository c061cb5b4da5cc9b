"""BeeLlama v0.4.3 through kvarn's llama.cpp engine, checked cell by cell (bench/program/README.md).

Given a workflow run of bench/program/beellama.yaml (its results/<model>/ctx<N>-c<C>/ folder), for
each cell:

  engine   the cell's summary.json: median / mean / p99 KLD, same-top, PPL(Q), the KV MiB the
           program printed, its prefill tokens/s and the cell's wall time
  printed  BeeLlama's own llama-perplexity --kl-divergence on the engine's base file, with the
           arguments the engine gave its harness (the first line of the cell's program.log), and
           whether every printed figure equals the engine's to its last printed digit
  torch    the torch engine's llamacpp-cpu cell on the same tokens (its own baseline, n_ctx and
           chunks of the run; torch at --torch-threads), the torch/engine ratio of median and mean

Steps (each skips what its output folder already holds):

    .venv/bin/python -m bench.program.beellama printed --run RUN --work WORK   # needs $KVARN_LLAMACPP_BUILD
    .venv/bin/python -m bench.program.beellama torch   --run RUN --work WORK
    .venv/bin/python -m bench.program.beellama table   --run RUN --work WORK --out bench/program/results/beellama.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import time
from pathlib import Path

from bench import REPO, TEXT
from kvarn.llamacpp_engine import runner

CONFIG = REPO / "bench" / "program" / "beellama.yaml"  # the matrix: its cells
MODEL = "gemma3-270m"  # the torch engine's name of the run's embedded model

# the figures of llama-perplexity --kl-divergence's printout the table compares (kvarn.llamacpp_engine.runner.PRINTED)
PRINTED_KEYS = ("ppl_q", "kld_mean", "kld_p99", "kld_median", "kld_max", "same_top")


ONLY: set[str] = set()  # --cells: only these cells (all when empty)


def cells(run: Path) -> list[Path]:
    return sorted(p for p in (run / "cells").iterdir() if (p / "summary.json").is_file() and (not ONLY or p.name in ONLY))


def perplexity_command(cell_dir: Path) -> tuple[list[str], dict]:
    """The command the engine ran (program.log's first line), as BeeLlama's llama-perplexity: the
    harness replaced by the build's bin/llama-perplexity, kvarn's two options dropped."""
    line = (cell_dir / "program.log").read_text().splitlines()[0].removeprefix("$ ")
    words = shlex.split(line)
    env = {}
    while "=" in words[0] and not words[0].startswith("/"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    exe = Path(words.pop(0))
    out = []
    while words:
        w = words.pop(0)
        if w in ("--kvarn-mode", "--kvarn-records"):
            words.pop(0)
            continue
        out.append(w)
    return [str(exe.parents[1] / "bin" / "llama-perplexity"), *out], env


def step_printed(run: Path, work: Path) -> None:
    for c in cells(run):
        out = work / "printed" / f"{c.name}.txt"
        if out.is_file():
            continue
        cmd, env = perplexity_command(c)
        cmd = [w if not w.endswith("baseline.llama.kld") else str(run / "baseline.llama.kld") for w in cmd]
        out.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, cwd=run.parents[2])
        text = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(cmd) + "\n" + r.stdout + r.stderr
        if r.returncode:
            raise SystemExit(f"{c.name}: llama-perplexity failed (rc {r.returncode}):\n{text[-2000:]}")
        out.write_text(text + f"\n# wall_s {time.perf_counter() - t0:.1f}\n")
        print(f"{c.name}: printed in {time.perf_counter() - t0:.0f} s", flush=True)


def step_torch(run: Path, work: Path, threads: int) -> None:
    import torch

    from kvarn.run import torch_engine
    from kvarn.vocab.cell import CellSpec
    from kvarn.weights.sources import parse_model

    torch.set_num_threads(threads)
    n_ctx = json.loads((run / "baseline.llama.kld.json").read_text())["n_ctx"]
    chunks = int(run.name.rsplit("-c", 1)[1])  # ctx<N>-c<chunks>
    cache = Path(os.environ.get("KVARN_MODEL_CACHE") or REPO / "resources" / "models")
    spec = parse_model(MODEL)
    base = work / "torch" / "base.kvd"
    if not base.is_file():
        base.parent.mkdir(parents=True, exist_ok=True)
        h = torch_engine.run_baseline(spec, n_ctx, chunks, base, text=str(TEXT), compute="llamacpp-cpu", cache_dir=str(cache))
        print(f"torch baseline in {h['wall_s']:.0f} s", flush=True)
    import yaml

    from kvarn.plan import matrix as kvm

    names = sorted({c.name for c in kvm.expand(yaml.safe_load(CONFIG.read_text())).cells} & (ONLY or {c.name for c in
                   kvm.expand(yaml.safe_load(CONFIG.read_text())).cells}))
    for name in names:
        out = work / "torch" / name
        if (out / "summary.json").is_file():
            continue
        s = CellSpec.from_name(name)
        cell = CellSpec(s.k, s.v, s.tail, rot=s.rot, compute="llamacpp-cpu")
        r = torch_engine.run_cell(spec, n_ctx, chunks, cell, base, out, text=str(TEXT), cache_dir=str(cache))
        print(f"{name}: torch in {r['wall_s']:.0f} s", flush=True)


def step_table(run: Path, work: Path, out: Path | None) -> str:
    rows, checks = [], []
    for c in cells(run):
        s = json.loads((c / "summary.json").read_text())
        # the KV buffers as the engine reads them from the program's log (kvarn.llamacpp_engine.runner)
        s["kv_program_mib"] = runner.program_figures((c / "program.log").read_text())["kv_program_mib"]
        p_file = work / "printed" / f"{c.name}.txt"
        agree = "–"
        if p_file.is_file():
            printed = runner.printed_figures(p_file.read_text(), PRINTED_KEYS)
            bad = [k for k, (v, unit) in printed.items() if abs(s[k] - v) > unit * 1.0001]
            agree = "yes" if not bad else "NO: " + ", ".join(bad)
            pm = printed
            checks.append(f"| {c.name} | {pm['kld_median'][0]:.6f} | {pm['kld_mean'][0]:.6f} | {pm['kld_p99'][0]:.6f} "
                          f"| {100 * pm['same_top'][0]:.3f} % | {pm['ppl_q'][0]:.4f} | {agree} |")
        t_file = work / "torch" / c.name / "summary.json"
        t = json.loads(t_file.read_text()) if t_file.is_file() else None
        tm = f"{t['kld_median']:.6f} | {t['kld_mean']:.6f}" if t else "– | –"
        ratio = f"{t['kld_median'] / s['kld_median']:.3f} | {t['kld_mean'] / s['kld_mean']:.3f}" if t else "– | –"
        t_wall = f"{t['wall_s']:.0f}" if t else "–"
        kv_kvarn = s["kv_total_bytes"] / 2**20
        rows.append(
            f"| {c.name} | {s['kld_median']:.6f} | {s['kld_mean']:.6f} | {s['kld_p99']:.6f} | {100 * s['same_top']:.2f} % "
            f"| {s['ppl_q']:.4f} | {s['kv_program_mib']:.2f} | {kv_kvarn:.2f} | {s['prefill_tokens_per_s']:.1f} "
            f"| {tm} | {ratio} | {s['wall_s']:.0f} | {t_wall} |")
    table = "\n".join([
        "| cell | median | mean | p99 | same top | PPL(Q) | KV MiB (program) | KV MiB (kvarn, packed) | prefill tok/s "
        "| torch median | torch mean | torch/engine median | torch/engine mean | engine wall s | torch wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows,
        "", "BeeLlama's own `llama-perplexity --kl-divergence` on the engine's base file, same arguments:", "",
        "| cell | median | mean | p99 | same top | PPL(Q) | equals the engine to the printed digit |",
        "|---|---:|---:|---:|---:|---:|---|", *checks])
    if out:
        write_table(out, table)
    return table


def write_table(out: Path, table: str) -> None:
    """`table` into the Markdown file `out` between its <!-- table --> and <!-- /table --> markers (the prose
    around them kept), or appended with the markers where the file has none."""
    text = out.read_text() if out.is_file() else ""
    start, end = "<!-- table -->", "<!-- /table -->"
    if start in text and end in text:
        text = text[:text.index(start) + len(start)] + "\n" + table + "\n" + text[text.index(end):]
    else:
        text = text + f"\n{start}\n{table}\n{end}\n"
    out.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.program.beellama", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=("printed", "torch", "table"))
    ap.add_argument("--run", type=Path, required=True, help="the workflow's results/<model>/ctx<N>-c<C> folder")
    ap.add_argument("--work", type=Path, required=True, help="scratch folder for the printouts and torch cells")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--cells", nargs="*", default=[], help="only these cells (default: every cell of the run)")
    ap.add_argument("--out", type=Path, help="table: the markdown file whose <!-- table --> block is replaced")
    a = ap.parse_args(argv)
    run, work = a.run.resolve(), a.work.resolve()
    ONLY.update(a.cells)
    if a.step == "printed":
        step_printed(run, work)
    elif a.step == "torch":
        step_torch(run, work, a.torch_threads)
    else:
        print(step_table(run, work, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
