"""The issue-21 KLD grid, both programs on the same tokens, resumable (items 3 and 5).

For one model, n_ctx and chunk count, in one folder `$BEELLAMA_RUNS/<model>-c<n_ctx>-x<chunks>/`:

1. kvarn's baseline once (`kvarn baseline ... -o base.kvd --llama-kld-out base.kld`): `base.kld`
   is the one base file every run below scores against;
2. per row, BeeLlama's `llama-perplexity --kl-divergence-base base.kld --kl-divergence`
   (`-ctk K -ctv V --kv-tail-tokens T`, `-t`, `-nr`; rotation on, or `LLAMA_ATTN_ROT_DISABLE=1`
   for a `-norot` row) -> `<row>/beellama.log`;
3. per row, the kvarn cells of the same row with `--compute exact` and `--compute
   llamacpp-cpu` (`--no-rot` for a `-norot` row) against `base.kld` -> `<row>/<compute>/`,
   log `<row>/<compute>.log`. They start once BeeLlama's run of the row has succeeded: a row
   BeeLlama refuses or aborts on has no counterpart to compare, and is recorded as such.

Every process runs under `nice -n NICE /usr/bin/time -v`; its log keeps the command, the load
average at its start and end, its output and `/usr/bin/time`'s report (user CPU seconds, wall).
Resume rule: a process writes `<log>.part` and temporary outputs, renamed to their final names
when it has ended on its own; a step whose final log exists is done (its last line
`# done rc=N`: 0 succeeded) and is not run again; a leftover `.part` is an interrupted step,
removed and redone. Delete a step's log (and outputs) to redo it. At most `--jobs` processes at
once, taken in row order.

Finally the tables (bench/oracles/beellama/table.py): KLD beside BeeLlama's with the issue's
target, per-chunk means and PPL, and the CPU cost per row relative to the bf16 row (CPU figures
under the load recorded, not the study's GPU prefill cost), and the study's orderings per program
(bench/oracles/beellama/orderings.py) -> stdout and `<folder>/table.md`.

    BEELLAMA_BUILD=<build> BEELLAMA_RUNS=<scratch> python -m bench.oracles.beellama.grid \\
        --model gemma3-270m --chunks 4 [--rows bf16-t0 kvarn4-t0 ...] [--jobs 2] [--nice 19]
    BEELLAMA_RUNS=<scratch> python -m bench.oracles.beellama.grid --model gemma3-270m --chunks 4 --table-only

A row is named `K-tT`, `K-V-tT` (K and V differ) or either with `-norot`; `bf16-t0` is the floor.
TEXT (wiki.test.raw) defaults to bench.TEXT.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import REPO, TEXT, env_path
from bench.oracles.beellama import memory, orderings, table

MODES = ("exact", "llamacpp-cpu")
FLOOR = "bf16"
TYPES = (FLOOR, *memory.STANDARD, *memory.KVARN)
# the rows that answer issue 21's open questions first (items 3 and 5)
PRIORITY = ("bf16-t0", "kvarn4-t0", "q4_0-t128", "q4_0-t0", "q4_0-t0-norot", "kvarn2-t0", "q2_0-t128",
            "kvarn8-t0", "q8_0-t128")
DONE = "# done rc="
ROW_RE = re.compile(r"^(?P<k>[a-z0-9_]+?)(?:-(?P<v>[a-z0-9_]+?))?-t(?P<tail>\d+)(?P<norot>-norot)?$")


@dataclass(frozen=True)
class Row:
    k: str
    v: str
    tail: int
    rot: bool = True

    @property
    def name(self) -> str:
        return memory.Cell(self.k, self.v, self.tail).name + ("" if self.rot else "-norot")


def parse_row(name: str) -> Row:
    m = ROW_RE.match(name)
    if not m:
        raise ValueError(f"row {name!r}: expected K-tT, K-V-tT or either with -norot (e.g. kvarn4-t0, "
                         f"kvarn4-kvarn2-t0, q4_0-t0-norot)")
    k, v = m["k"], m["v"] or m["k"]
    for t in (k, v):
        if t not in TYPES:
            raise ValueError(f"row {name!r}: cache type {t!r} is not one of {', '.join(TYPES)}")
    return Row(k, v, int(m["tail"]), rot=not m["norot"])


def default_rows(model: str) -> list[Row]:
    """The issue's grid for `model` (memory.grid), the bf16 floor first, each standard row at
    tail 0 followed by its unrotated twin (BeeLlama v0.4.3 aborts on a rotated standard cache
    at tail 0 on CPU: docs/notes/beellama.md), in PRIORITY order, then the grid's order."""
    rows = [Row(FLOOR, FLOOR, 0)]
    for c in memory.grid(model):
        rows.append(Row(c.k, c.v, c.tail))
        if c.tail == 0 and c.k in memory.STANDARD:
            rows.append(Row(c.k, c.v, c.tail, rot=False))
    first = [r for p in PRIORITY for r in rows if r.name == p]
    return first + [r for r in rows if r not in first]


# ---------------------------------------------------------------- the steps


@dataclass
class Step:
    key: str                      # "base", "<row>/beellama", "<row>/<compute>"
    cmd: list[str]
    log: Path                     # the final log; `<log>.part` while it runs
    outputs: list[tuple[Path, Path]] = field(default_factory=list)  # (temporary, final), renamed on success
    env: dict[str, str] = field(default_factory=dict)  # set (value) or removed (""), over os.environ
    needs: tuple[str, ...] = ()

    @property
    def part(self) -> Path:
        return self.log.with_name(self.log.name + ".part")


def rc_of(log: Path) -> int | None:
    """A finished step's exit status (its log's `# done rc=N`); None if the log is not final."""
    if not log.is_file():
        return None
    lines = log.read_text(errors="replace").rstrip().splitlines()
    return int(lines[-1][len(DONE):]) if lines and lines[-1].startswith(DONE) else None


def kvarn_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvarn.cli", *args]


def steps_for(model: str, n_ctx: int, chunks: int, rows: list[Row], run: Path, build: Path | None,
              text: Path, threads: int) -> list[Step]:
    gguf = REPO / "resources" / "models" / memory.MODELS[model][0]
    common = ["-m", model, "-c", str(n_ctx), "--chunks", str(chunks), "-f", str(text), "-t", str(threads),
              "--device", "cpu"]
    base = run / "base.kld"
    steps = [Step("base", kvarn_cmd("baseline", *common, "-o", str(run / "base-part.kvd"),
                                    "--llama-kld-out", str(run / "base-part.kld")),
                  run / "base.log", [(run / "base-part.kvd", run / "base.kvd"), (run / "base-part.kld", base)])]
    bee = str((build or Path("$BEELLAMA_BUILD")) / "bin" / "llama-perplexity")
    for row in rows:
        d = run / row.name
        steps.append(Step(f"{row.name}/beellama",
                          [bee, "-m", str(gguf), "-f", str(text), "-c", str(n_ctx), "--chunks", str(chunks),
                           "-ub", "512", "-t", str(threads), "-nr", "-ctk", row.k, "-ctv", row.v,
                           "--kv-tail-tokens", str(row.tail), "--kl-divergence-base", str(base), "--kl-divergence"],
                          d / "beellama.log", env={"LLAMA_ATTN_ROT_DISABLE": "" if row.rot else "1"}, needs=("base",)))
        for mode in MODES:
            steps.append(Step(f"{row.name}/{mode}",
                              kvarn_cmd("run", *common, "-ctk", row.k, "-ctv", row.v, "--tail", str(row.tail),
                                        *([] if row.rot else ["--no-rot"]), "--compute", mode,
                                        "--baseline", str(base), "-o", str(d / f"{mode}.part")),
                              d / f"{mode}.log", [(d / f"{mode}.part", d / mode)],
                              needs=("base", f"{row.name}/beellama")))
    return steps


def shown(step: Step) -> str:
    env = " ".join(f"{k}={v}" for k, v in step.env.items() if v)
    return (env + " " if env else "") + " ".join(step.cmd)


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


TIME_V = ("/usr/bin/time", "-v")  # GNU time: the user CPU seconds and wall of each process
# The environment that changes a process's numbers (SIMD level of torch, MKL and oneDNN; threads;
# BeeLlama's rotation switch): written into each log when set, so a log says what it ran under.
NUMERIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS",
               "LLAMA_ATTN_ROT_DISABLE")


def env_line(env: dict) -> str:
    """`# env K=V ...` of the NUMERIC_ENV variables set in `env` ("" when none is)."""
    set_ = [f"{k}={env[k]}" for k in NUMERIC_ENV if env.get(k)]
    return f"# env {' '.join(set_)}\n" if set_ else ""


def start(step: Step, nice: int, wrap: tuple[str, ...] = TIME_V) -> subprocess.Popen:
    for tmp, _ in step.outputs:  # an interrupted run's leftovers
        remove(tmp)
    step.log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    for k, v in step.env.items():
        env.pop(k, None)
        if v:
            env[k] = v
    with open(step.part, "w") as f:
        f.write(f"$ {shown(step)}\n# start {stamp()} load {loadavg()} nice {nice}\n{env_line(env)}")
        f.flush()
        p = subprocess.Popen(["nice", "-n", str(nice), *wrap, *step.cmd], stdout=f,
                             stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    lower_session(p.pid, nice)
    return p


def lower_session(pid: int, nice: int) -> bool:
    """Give the new session's autogroup the same nice value (Linux): the scheduler shares the
    CPU between sessions first, so `nice` alone leaves a step in a session of its own an equal
    share beside an interactive shell (docs/notes/beellama.md). False where there is none."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
        return True
    except OSError:
        return False


def finish(step: Step, rc: int) -> None:
    with open(step.part, "a") as f:
        f.write(f"# end {stamp()} load {loadavg()}\n{DONE}{rc}\n")
    if rc == 0:
        for tmp, final in step.outputs:
            tmp.replace(final)
    else:
        for tmp, _ in step.outputs:
            remove(tmp)
    step.part.replace(step.log)


def run_steps(steps: list[Step], jobs: int, nice: int, say=print, wrap: tuple[str, ...] = TIME_V) -> None:
    """Run the steps not yet done, at most `jobs` at once, in order, each once its `needs` have
    succeeded; one whose need failed is skipped (said, not run)."""
    by_key = {s.key: s for s in steps}
    pending = [s for s in steps if rc_of(s.log) is None]
    for s in pending:
        remove(s.part)
    running: dict[str, tuple[Step, subprocess.Popen]] = {}

    def stop(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    try:
        while pending or running:
            for s in list(pending):
                if len(running) >= jobs:
                    break
                rcs = [rc_of(by_key[k].log) for k in s.needs]
                if any(rc not in (None, 0) for rc in rcs):
                    pending.remove(s)
                    say(f"skip {s.key}: {s.needs[rcs.index(next(r for r in rcs if r not in (None, 0)))]} failed")
                elif all(rc == 0 for rc in rcs):
                    pending.remove(s)
                    running[s.key] = (s, start(s, nice, wrap))
                    say(f"{stamp()} start {s.key}")
            if not running:
                break  # what is left waits on a step that cannot run
            time.sleep(2)
            for key, (s, p) in list(running.items()):
                if p.poll() is not None:
                    finish(s, p.returncode)
                    del running[key]
                    say(f"{stamp()} end {key} rc={p.returncode}")
    finally:
        signal.signal(signal.SIGTERM, old)
        for s, p in running.values():  # interrupted: stop the process group, leave .part to be redone
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait()


# ---------------------------------------------------------------- the tables

FAIL_RE = re.compile(r"^.*(?:fatal error|error:|GGML_ASSERT|Command terminated by signal).*$", re.M | re.I)
LOG_ERROR_RE = re.compile(r"^[\d.]+ E (.*)$", re.M)  # llama.cpp's error-level log line ("0.00.260 E msg")


SOURCE_RE = re.compile(r"(?<![\w.])/\S*?/(?=ggml/src/|src/llama|tools/|common/)")  # a source dir, up to the tree's top


def failure(log: Path) -> str:
    """What a failed step's log says: its first error line, else its first error-level log line
    (a refusal: "cannot enable kvarn_..."), else only its exit status; with the source directory
    of the build cut from file names (the table is committed)."""
    text = log.read_text(errors="replace")
    m, e = FAIL_RE.search(text), LOG_ERROR_RE.search(text)
    said = m.group(0).strip() if m else e.group(1).strip() if e else ""
    return SOURCE_RE.sub("", said) + f" (rc={rc_of(log)})"


def grid_tables(run: Path, names: list[str]) -> str:
    """Three tables over the rows `names` of one grid folder: KLD beside BeeLlama's with the
    issue's target (for `llamacpp-cpu`), per-chunk means and PPL, and CPU cost relative to
    the bf16 row's; then the study's orderings per program (orderings.py)."""
    kld = ["| " + " | ".join(table.HEADER + ["target (llamacpp-cpu)"]) + " |", "|" + "---|" * (len(table.HEADER) + 1)]
    chunks, cost, floor = [], [], {}
    for name in names:
        d = run / name
        rc = rc_of(d / "beellama.log")
        if rc is None or rc != 0:
            what = "not run" if rc is None else "BeeLlama failed: " + failure(d / "beellama.log")
            kld.append(f"| {name} | {what} |" + " |" * (len(table.HEADER) - 1))
            continue
        bee = table.parse_llama(d / "beellama.log") or {}
        times = {"beellama": table.time_v(d / "beellama.log")}
        for mode in MODES:
            cell = d / mode
            times[mode] = table.time_v(d / f"{mode}.log")
            if not (cell / "summary.json").is_file():
                note = "failed: " + failure(d / f"{mode}.log") if rc_of(d / f"{mode}.log") else "not run"
                pct = table.fmt(100 * bee["same_top"], 2) if "same_top" in bee else "—"
                kld.append("| " + " | ".join([name, f"{mode} {note}", table.fmt(bee.get("kld_median")), "—", "—",
                                              table.fmt(bee.get("kld_mean")), "—", "—", table.fmt(bee.get("kld_p99"), 4),
                                              "—", pct, "—", ""]) + " |")
                continue
            ours = json.loads((cell / "summary.json").read_text())
            kld.append("| " + " | ".join(table.row(name, d / "beellama.log", cell)
                                         + [table.target(bee, ours) if mode == "llamacpp-cpu" else ""]) + " |")
            chunks.append([name, mode, *table.chunk_cells(bee, cell), table.fmt(bee.get("ppl_q"), 4),
                           table.fmt(ours.get("ppl_q"), 4), table.fmt(bee.get("ppl_base"), 4),
                           table.fmt(ours.get("ppl_base"), 4)])
        if name == f"{FLOOR}-t0":
            floor = times
        loads = [x for t in times.values() if t for x in t["load"]]
        cost.append([name, *(c for k in ("beellama", *MODES) for c in table.cost_cells(times[k], floor.get(k))),
                     f"{min(loads):.1f}–{max(loads):.1f}" if loads else "—"])
    n = max((len(r) - 6 for r in chunks), default=0)  # name, compute, the chunks, 4 PPLs
    chunk_head = ["row", "kvarn compute", *(f"chunk {i + 1} mean KLD BeeLlama / kvarn" for i in range(n)),
                  "BeeLlama PPL(Q)", "kvarn PPL(Q)", "BeeLlama base PPL", "kvarn base PPL"]
    cost_head = ["row", "BeeLlama user CPU s", "× bf16", "wall s", "kvarn exact user CPU s", "× bf16", "wall s",
                 "kvarn llamacpp-cpu user CPU s", "× bf16", "wall s", "load (1-min, at starts and ends)"]

    def md(head, rows):
        return "\n".join(table.md_lines(head, rows))
    return (f"### KLD against the same base file ({run.name})\n\n" + "\n".join(kld)
            + "\n\n### Per-chunk mean KLD and PPL\n\n" + md(chunk_head, chunks)
            + "\n\n### CPU cost per row relative to the bf16 row (CPU figures, 1 thread, under the load shown)\n\n"
            + md(cost_head, cost) + "\n" + baseline_cost(run) + "\n" + orderings.orderings_md(run, names))


def baseline_cost(run: Path) -> str:
    t = table.time_v(run / "base.log")
    return "" if t is None else (f"\nkvarn's baseline (`exact`, fp32, written as base.kld): {t['user_s']:.1f} user CPU s, "
                                 f"{t['wall_s']:.0f} s wall.\n")


# ---------------------------------------------------------------- main


def run_dir(runs: Path, model: str, n_ctx: int, chunks: int) -> Path:
    return runs / f"{model}-c{n_ctx}-x{chunks}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(memory.MODELS), required=True)
    ap.add_argument("-c", "--ctx", type=int, default=None, help="n_ctx (default: the issue's for the model)")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                    help="rows in the order to run (default: the issue's grid, in PRIORITY order)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="threads per process")
    ap.add_argument("--jobs", type=int, default=2, help="processes at once")
    ap.add_argument("--nice", type=int, default=19)
    ap.add_argument("--table-only", action="store_true", help="run nothing: the tables from the kept logs")
    args = ap.parse_args(argv)
    n_ctx = args.ctx or memory.MODELS[args.model][1]
    try:
        rows = [parse_row(r) for r in args.rows] if args.rows else default_rows(args.model)
    except ValueError as e:
        ap.error(str(e))
    runs = env_path("BEELLAMA_RUNS", "the folder the grid's runs and logs go to")
    run = run_dir(runs, args.model, n_ctx, args.chunks)
    if not args.table_only:
        build = env_path("BEELLAMA_BUILD", "BeeLlama's cmake build directory, with bin/llama-perplexity")
        if not (build / "bin" / "llama-perplexity").is_file():
            raise SystemExit(f"BEELLAMA_BUILD={build}: no bin/llama-perplexity there (build it: bench/oracles/beellama/README.md)")
        if not TEXT.is_file():
            raise SystemExit(f"TEXT={TEXT}: no such file (wiki.test.raw; bench/README.md)")
        run.mkdir(parents=True, exist_ok=True)
        steps = steps_for(args.model, n_ctx, args.chunks, rows, run, build, TEXT, args.threads)
        run_steps(steps, args.jobs, args.nice, say=lambda m: print(m, file=sys.stderr, flush=True))
    out = grid_tables(run, [r.name for r in rows])
    (run / "table.md").write_text(out)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
