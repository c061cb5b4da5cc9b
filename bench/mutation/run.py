"""Mutation testing of the modules where a wrong number changes a user's conclusion (mutmut).

Each group mutates its modules and runs the tests that own them, in a copy of the committed tree
(`git archive HEAD`, the model cache linked in), so the checkout is never touched. mutmut
changes one operator, constant or call at a time; a mutant the tests do not notice ("survived")
is a bug they would not notice either. Per module: mutants, killed, survived, timed out (killed by
the timeout: an endless loop is noticed), and the score killed / (killed + survived).

    python -m bench.mutation.run [GROUP ...] [--max-children N] [--sample N [--seed S]] [--out bench/mutation/results]

A group is bench/mutation/groups/<group>.yaml: its modules, the tests that own them, and the survivors
judged equivalent, each with why. Writes results/<group>.md (the scores, every survivor's name, the
command, machine, commit); `mutmut show <name>` in the printed work folder (`--keep DIR` to choose it)
shows a survivor's diff. The copy is of HEAD: commit a new test before rerunning its group. Not in CI:
minutes to hours per group on 2 cores. `--sample N` tests N mutants per module drawn at random (seed
`--seed`; all of a module with N or fewer): the score is then an estimate, printed with its 95 %
Wilson interval, and the survivors listed are the sample's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import REPO
from kvarn.retrieval.score import wilson

GROUP_DIR = Path(__file__).resolve().parent / "groups"


def load_group(name: str) -> dict:
    """groups/<name>.yaml: the modules mutated, the tests that own them, and `equivalent`: survivors read
    and judged equivalent (the same behaviour for every input the module accepts) -> why. Equivalent
    mutants leave the score's denominator."""
    import yaml

    path = GROUP_DIR / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"unknown group {name!r}; groups: {', '.join(group_names())}")
    g = yaml.safe_load(path.read_text())
    for key in ("modules", "tests"):
        if not g.get(key):
            raise SystemExit(f"{path}: needs a non-empty list {key!r}")
    g["equivalent"] = g.get("equivalent") or {}
    return g


def group_names() -> list[str]:
    return sorted(p.stem for p in GROUP_DIR.glob("*.yaml"))


STATUS_RE = re.compile(r"^\s*(kvarn\.[\w.]+?)\.x_?\w*__mutmut_\d+: (.+)$")


def module_of(mutant: str) -> str:
    """kvarn.stats.metrics.x_token_metrics__mutmut_3 -> kvarn/stats/metrics.py"""
    m = STATUS_RE.match(f"    {mutant}: x")
    return (m[1] if m else mutant.rsplit(".", 1)[0]).replace(".", "/") + ".py"


def sample_mutants(names_by_module: dict[str, list[str]], n: int, seed: int) -> list[str]:
    """`n` mutants per module drawn without replacement (every one of a module with `n` or fewer); the
    same names for the same seed and mutants, whatever order they are listed in."""
    if n < 1:
        raise SystemExit(f"--sample {n}: needs at least 1 mutant per module")
    rng = random.Random(seed)
    out: list[str] = []
    for mod in sorted(names_by_module):
        names = sorted(names_by_module[mod])
        out += names if len(names) <= n else sorted(rng.sample(names, n))
    return out


def generated_mutants(work: Path, modules: list[str]) -> dict[str, list[str]]:
    """Every mutant mutmut generated in `work`, per module (its `mutants/<module>.meta` files)."""
    out = {}
    for mod in modules:
        meta = work / "mutants" / f"{mod}.meta"
        out[mod] = sorted(json.loads(meta.read_text())["exit_code_by_key"]) if meta.exists() else []
    return out


def run_group(name: str, max_children: int, keep: Path | None, sample: int | None = None,
              seed: int = 0) -> dict:
    group = load_group(name)
    modules, tests, equivalent = group["modules"], group["tests"], group["equivalent"]
    # `deselect`: tests that run the workflow in a subprocess, where mutmut's bookkeeping is absent
    # (the clean run fails there), or whole-model tests another group owns (seconds per mutant); the
    # group's other tests own those lines
    pytest_args = ["-p", "no:xdist", "-q", "-p", "no:cacheprovider"]
    for t in group.get("deselect") or []:
        pytest_args += ["--deselect", t]
    work = Path(keep or tempfile.mkdtemp(prefix=f"kvarn-mutation-{name}-"))
    work.mkdir(parents=True, exist_ok=True)
    # the commit copied: HEAD now (a commit made while the run goes on is not what it tested)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    subprocess.run(f"git -C {REPO} archive {head} | tar -x -C {work}", shell=True, check=True)
    # the fetched models and text (resources/ is in the archive only as its .gitkeep)
    if (REPO / "resources").is_dir():
        (work / "resources").mkdir(exist_ok=True)
        for entry in (REPO / "resources").iterdir():
            if not (work / "resources" / entry.name).exists():
                (work / "resources" / entry.name).symlink_to(entry)
    with open(work / "pyproject.toml", "a") as f:
        f.write("\n[tool.mutmut]\n"
                f"source_paths = {json.dumps(modules)}\n"
                f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
                f"pytest_add_cli_args = {json.dumps(pytest_args)}\n"
                # a mutant whose tests run 3x their clean time is a timeout (killed): mutmut's default
                # 15x spends minutes on each endless-loop mutant
                "timeout_multiplier = 3.0\n"
                # each mutant's worker forked from a server that has only collected the tests: forked
                # from mutmut's own process, which ran the suite, a worker inherits polars' and torch's
                # thread pools without their threads, and the first parallel call hangs (a false timeout)
                'process_isolation = "forkserver"\n'
                # the whole tree: tests run the workflow (Snakefile, envs/, profiles/) and read the docs
                f"also_copy = {json.dumps(sorted(p.name for p in work.iterdir() if p.name != 'mutants'))}\n")
    # the tests read the shared text beside the checkout (tests/paths.py: ../shared); mutmut runs them in
    # work/mutants, so work/shared is that place (made after also_copy is listed: not copied)
    if (REPO.parent / "shared").is_dir() and not (work / "shared").exists():
        (work / "shared").symlink_to(REPO.parent / "shared")
    t0 = time.time()
    mutmut = Path(sys.executable).with_name("mutmut")
    log = work / "mutmut-run.log"
    with open(log, "w") as f:
        # one intra-op thread per worker: --max-children workers share the cores (and a worker forked
        # from a process with a live OpenMP pool would deadlock on it)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        run = [str(mutmut), "run", "--max-children", str(max_children)]
        chosen: set[str] | None = None
        generated = 0
        if sample is not None:
            # generate the mutants and the test map only (a name that matches nothing stops mutmut
            # there), then test the sample by name
            subprocess.run([*run, "kvarn-generate-only"], cwd=work, stdout=f, stderr=subprocess.STDOUT, env=env)
            names = generated_mutants(work, modules)
            generated = {m: len(v) for m, v in names.items()}
            if not any(names.values()):
                raise SystemExit(f"{name}: mutmut generated no mutants; see {log}")
            chosen = set(sample_mutants(names, sample, seed))
            run += sorted(chosen)
        r = subprocess.run(run, cwd=work, stdout=f, stderr=subprocess.STDOUT, env=env)
    res = subprocess.run([str(mutmut), "results", "--all", "true"], cwd=work, capture_output=True, text=True)
    per: dict[str, dict[str, int]] = {m: {} for m in modules}
    survivors: list[str] = []
    for line in res.stdout.splitlines():
        m = re.match(r"^\s*(\S+__mutmut_\d+): (.+)$", line)
        if not m or (chosen is not None and m[1] not in chosen):
            continue
        status = m[2].strip()
        mod = module_of(m[1])
        per.setdefault(mod, {})
        if status == "no tests":  # no selected test reaches the mutated line: nothing would notice it
            status = "survived"
        per[mod][status] = per[mod].get(status, 0) + 1
        if status == "survived" and m[1] in equivalent:
            status = "equivalent"
            per[mod]["survived"] -= 1
            per[mod][status] = per[mod].get(status, 0) + 1
        if status == "survived":
            survivors.append(m[1])
    return {"group": name, "commit": head, "modules": per, "survivors": survivors, "equivalent": equivalent, "wall_s": time.time() - t0, "work": str(work),
            "rc": r.returncode, "tests": tests, "sample": sample, "seed": seed, "generated": generated}


def check_timeouts(res: dict) -> None:
    """A run whose mutants all time out measured nothing (a hung test process, not endless loops), and
    neither did one that tested no mutant (the clean tests failed: mutmut stops before mutating)."""
    if res["modules"] and not any(c.get(s) for c in res["modules"].values() for s in ("killed", "survived", "timeout")):
        raise SystemExit(f"{res['group']}: no mutant was tested (rc {res['rc']}); the tests fail on the unmutated "
                         f"copy? see {res['work']}/mutmut-run.log")
    for mod, counts in res["modules"].items():
        if counts.get("timeout", 0) and not counts.get("killed", 0) and not counts.get("survived", 0):
            raise SystemExit(f"{mod}: every mutant timed out ({counts['timeout']}): the tests hung, the run measured "
                             f"nothing; see {res['work']}/mutmut-run.log")


def score(counts: dict) -> tuple[int, int, int, int, float | None]:
    """(mutants, killed incl. timeouts, survived, timeouts, killed / (killed + survived)); equivalent
    mutants (the group's `equivalent`) count in neither."""
    killed, survived = counts.get("killed", 0), counts.get("survived", 0)
    timeout = counts.get("timeout", 0)
    total = sum(counts.values())
    done = killed + timeout + survived
    return total, killed + timeout, survived, timeout, ((killed + timeout) / done if done else None)


def write(res: dict, out: Path, command: str) -> None:
    from kvarn.report.provenance import machine

    cpu, sha = machine()["cpu"], res["commit"]
    lines = [f"# Mutation testing: {res['group']}", "",
             f"mutmut 3.8.1 at {sha}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu} "
             f"({os.cpu_count()} cores), {res['wall_s'] / 60:.1f} min. Command: `{command}`. "
             f"Tests: {', '.join(res['tests'])}.", ""]
    sampled = res.get("sample") is not None
    if sampled:
        lines += [f"A random sample of {res['sample']} mutants per module (seed {res['seed']}; every mutant of a "
                  "module with fewer): `mutants` is the sample and, in brackets, all mutmut generated; the score "
                  "is an estimate, with its 95 % Wilson interval.", ""]
    lines += ["| module | mutants | killed (timeouts) | survived | equivalent | other | score |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for mod, counts in res["modules"].items():
        total, killed, survived, timeout, s = score(counts)
        eq = counts.get("equivalent", 0)
        other = total - killed - survived - eq
        shown = "–" if s is None else f"{100 * s:.1f} %"
        if sampled and s is not None:
            lo, hi = wilson(killed, killed + survived)
            shown += f" ({100 * lo:.1f}–{100 * hi:.1f})"
        n = f"{total} ({res['generated'].get(mod, 0)})" if sampled else f"{total}"
        lines.append(f"| `{mod}` | {n} | {killed} ({timeout}) | {survived} | {eq} | {other} | {shown} |")
    lines += ["", f"Survivors ({len(res['survivors'])}); `mutmut show NAME` in a copy made as above shows each:", ""]
    lines += [f"- `{s}`" for s in res["survivors"]]
    eq = list(res["equivalent"].items())
    if eq:
        lines += ["", "Equivalent mutants (read, and the same behaviour for every accepted input):", ""]
        lines += [f"- `{n}`: {why}" for n, why in eq]
    (out / f"{res['group']}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("groups", nargs="*", default=group_names(),
                    help=f"groups (bench/mutation/groups/*.yaml): {', '.join(group_names())} (default: all)")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "mutation" / "results")
    ap.add_argument("--keep", type=Path, help="the work folder (default: a new temporary one)")
    ap.add_argument("--sample", type=int, metavar="N",
                    help="test N mutants per module drawn at random (default: every mutant)")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    for g in a.groups:
        load_group(g)  # an unknown name stops before any work
        res = run_group(g, a.max_children, a.keep, a.sample, a.seed)
        check_timeouts(res)
        opts = "" if a.sample is None else f" --sample {a.sample} --seed {a.seed}"
        write(res, a.out, f"python -m bench.mutation.run {g}{opts}")
        for mod, counts in res["modules"].items():
            total, killed, survived, timeout, s = score(counts)
            print(f"{mod}: {total} mutants, {killed} killed, {survived} survived"
                  + ("" if s is None else f", score {100 * s:.1f} %") + f"  (work: {res['work']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
