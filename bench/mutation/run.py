"""Mutation testing of the modules where a wrong number changes a user's conclusion (mutmut).

Each group mutates its modules and runs the tests that own them, in a copy of the committed tree
(`git archive HEAD`, the model cache linked in), so the checkout is never touched. mutmut
changes one operator, constant or call at a time; a mutant the tests do not notice ("survived")
is a bug they would not notice either. Per module: mutants, killed, survived, timed out (killed by
the timeout: an endless loop is noticed), and the score killed / (killed + survived).

    python -m bench.mutation.run [GROUP ...] [--max-children N] [--out bench/mutation/results]

Writes results/<group>.md (the scores, every survivor's name, the command, machine, commit) and
results/summary.md (every group run so far). `mutmut show <name>` in the printed work folder shows a
survivor's diff. Not in CI: minutes to hours per group on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import REPO

# group -> (modules to mutate, the tests that own them)
GROUPS = {
    "metrics": (["kvarn/stats/metrics.py"], ["tests/test_metrics.py"]),
    "paired": (["kvarn/stats/paired.py"], ["tests/test_paired.py", "tests/test_properties.py"]),
    "encoding": (["kvarn/baseline/encoding.py"], ["tests/test_dump.py", "tests/test_llamakld.py"]),
    "memory": (["kvarn/budget/memory.py"], ["tests/test_memory.py"]),
    "spec": (["kvarn/spec/cell.py", "kvarn/spec/facts.py", "kvarn/spec/policy.py", "kvarn/spec/scoring.py",
              "kvarn/spec/options.py", "kvarn/spec/geometry.py"],
             ["tests/test_cell_spec.py", "tests/test_facts.py", "tests/test_matrix.py", "tests/test_memory.py"]),
    "claims": (["kvarn/report/claims.py"], ["tests/test_claims.py", "tests/test_properties.py"]),
    "generation": (["kvarn/report/generation.py"], ["tests/test_generation.py"]),
    "llamacpp": (["kvarn/llamacpp/compute.py", "kvarn/llamacpp/q8.py", "kvarn/llamacpp/llamakld.py",
                  "kvarn/llamacpp/channel_order.py", "kvarn/llamacpp/activations.py"],
                 ["tests/test_compute.py", "tests/test_llamakld.py"]),
    "formats": (["kvarn/formats/blocks.py", "kvarn/formats/kvarn.py", "kvarn/formats/hadamard.py",
                 "kvarn/formats/floats.py", "kvarn/formats/base.py"],
                ["tests/test_formats_blocks.py", "tests/test_kvarn.py", "tests/test_properties.py"]),
    "kvcache": (["kvarn/kvcache/cache.py", "kvarn/kvcache/attention.py", "kvarn/kvcache/rows.py"],
                ["tests/test_cache.py"]),
}
# Survivors read and judged equivalent (the same behaviour for every input the module accepts), with why;
# they leave the score's denominator. A name here that a run kills or no longer produces is reported.
EQUIVALENT = {
    "kvarn.stats.metrics.x_percentile__mutmut_2": "fraction < 0 for <= 0: at fraction 0 the interpolation reads v[0] with weight 0 on v[1]",
    "kvarn.stats.metrics.x_percentile__mutmut_6": "fraction > 1 for >= 1: at fraction 1 the interpolation reads v[n-1] with weight 0",
    "kvarn.stats.metrics.x_percentile__mutmut_7": "fraction >= 2 for >= 1: as above; fractions above 1 are never passed (the ladders)",
    "kvarn.stats.metrics.x__columns__mutmut_1": "hasattr(None, ...): a polars frame is then read as a mapping, which it also is (df[k], k in df)",
    "kvarn.stats.metrics.x__columns__mutmut_5": "as mutmut_1 (the attribute name misspelled)",
    "kvarn.stats.metrics.x__columns__mutmut_6": "as mutmut_1 (the attribute name upper-cased)",
    "kvarn.stats.metrics.x__columns__mutmut_20": "reshape(-2) for reshape(-1): numpy takes any negative size as the one unknown dimension",
    "kvarn.stats.metrics.x_summarize__mutmut_97": 'float("NAN") for float("nan"): the same value',
    "kvarn.stats.metrics.x__inputs_and_outputs__mutmut_28": 'np.empty(n, dtype=None) is float64, the dtype named',
    "kvarn.stats.metrics.x__inputs_and_outputs__mutmut_30": 'as mutmut_28',
    "kvarn.stats.metrics.x_token_metrics__mutmut_15": 'range(0, n) for range(0, n, 64): row by row, the same numbers (slower)',
    "kvarn.stats.metrics.x_token_metrics_ref__mutmut_15": 'as token_metrics mutmut_15 (16-row slices)',
    "kvarn.stats.metrics.x_token_metrics_ref__mutmut_17": 'b = None: each slice runs to the end and later slices rewrite the same values',
    "kvarn.stats.metrics.x_token_metrics_ref__mutmut_53": "p_base's value off the floor mask is never read (terms are masked again)",
    "kvarn.stats.metrics.x_token_metrics__mutmut_52": 'q.to(None): float32 minus float64 promotes to float64 anyway',
    "kvarn.stats.metrics.x_token_metrics__mutmut_29": 'logsumexp in float64 instead of float32 for the 1e-3 normalisation check: the same verdict (errors are ~1e-7)',
    "kvarn.stats.metrics.x_token_metrics__mutmut_30": 'as mutmut_29 (float32 for float64 input)',
    "kvarn.stats.metrics.x_token_metrics__mutmut_31": 'as mutmut_29',
    "kvarn.stats.metrics.x__check_normalised__mutmut_3": '<= 1e-3 for < 1e-3: differs only at |logsumexp| exactly 1e-3',
    "kvarn.stats.metrics.x_token_metrics__mutmut_38": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell these apart: bench/gpu)',
    "kvarn.stats.metrics.x_token_metrics__mutmut_41": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell these apart: bench/gpu)',
    "kvarn.stats.metrics.x_token_metrics__mutmut_62": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell these apart: bench/gpu)',
    "kvarn.stats.metrics.x_token_metrics__mutmut_65": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell these apart: bench/gpu)',
    "kvarn.stats.metrics.x_token_metrics_ref__mutmut_36": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell these apart: bench/gpu)',
    "kvarn.stats.metrics.x_token_metrics_ref__mutmut_38": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell these apart: bench/gpu)',
    "kvarn.stats.metrics.x_token_metrics_ref__mutmut_42": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell these apart: bench/gpu)',
    "kvarn.baseline.encoding.x__mass_corrected_floor__mutmut_92": 'float("INF") is float("inf")',
    "kvarn.baseline.encoding.x__mass_corrected_floor__mutmut_233": 'float("INF") is float("inf")',
    "kvarn.baseline.encoding.x__mass_corrected_floor__mutmut_134": 'arange without dtype is int64, promoted to float64 where it multiplies an ulp',
    "kvarn.baseline.encoding.x__mass_corrected_floor__mutmut_137": 'as mutmut_134',
    "kvarn.baseline.encoding.x__mass_corrected_floor__mutmut_154": 'as mutmut_134 (the scale lattice)',
    "kvarn.baseline.encoding.x__mass_corrected_floor__mutmut_157": 'as mutmut_134 (the scale lattice)',
    "kvarn.baseline.encoding.x__mass_corrected_floor__mutmut_129": 'k as [9, 1] broadcasts against [n, 1, 1] to the same [n, 9, 1]',
    "kvarn.baseline.encoding.x__mass_corrected_floor__mutmut_149": 'j as [1, 33] broadcasts to the same [n, 9, 33]',
    "kvarn.baseline.encoding.x__mass_corrected_floor__mutmut_150": 'as mutmut_149',
    "kvarn.baseline.encoding.x_encode_rows__mutmut_23": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell it apart)',
    "kvarn.baseline.encoding.x_encode_rows__mutmut_25": "to(float32) for to('cpu', float32): on a CPU the same",
    "kvarn.baseline.encoding.x_encode_rows__mutmut_67": 'scale >= 0: a scale of 0 is a flat row, whose every entry equals lo and is set to code 0 by the x > lo mask',
    "kvarn.baseline.encoding.x_encode_rows__mutmut_71": 'as mutmut_67 (inv 1.0 at scale 0)',
    "kvarn.baseline.encoding.x_encode_rows__mutmut_73": 'the lower clamp: x > lo entries give codes >= 0 and the others are set to 0 after',
    "kvarn.baseline.encoding.x_encode_rows__mutmut_74": 'the upper clamp: (x - lo) / scale <= 65535 + rounding < 65535.5 for x <= hi',
    "kvarn.baseline.encoding.x_encode_rows__mutmut_76": 'as mutmut_74',
    "kvarn.baseline.encoding.x_encode_rows__mutmut_80": 'as mutmut_74 (65536)',
    "kvarn.baseline.encoding.x_encode_rows__mutmut_88": 'x >= lo: an entry at lo has code 0 either way',
    "kvarn.baseline.encoding.x_encode_rows__mutmut_106": 'astype(None): float64 integral codes in [0, 65535] cast into the uint16 array unchanged',
    "kvarn.baseline.encoding.x_decode_rows__mutmut_4": 'copy=None: decode never writes the rows it reads',
    "kvarn.baseline.encoding.x_decode_rows__mutmut_7": 'as mutmut_4',
    "kvarn.baseline.encoding.x_decode_rows__mutmut_12": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell it apart)',
    "kvarn.baseline.encoding.x_decode_rows__mutmut_23": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell it apart)',
    "kvarn.baseline.encoding.x_decode_codes__mutmut_3": 'torch.empty without dtype is float32',
    "kvarn.baseline.encoding.x_decode_codes__mutmut_6": 'as mutmut_3',
    "kvarn.baseline.encoding.x_decode_codes__mutmut_4": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell it apart)',
    "kvarn.baseline.encoding.x_decode_codes__mutmut_7": 'device None: on a CPU every tensor is already on the CPU (a GPU run would tell it apart)',
    "kvarn.baseline.encoding.x_decode_codes__mutmut_14": 'range(0, n) for range(0, n, 16): row by row, the same numbers (slower)',
    "kvarn.baseline.encoding.x_decode_codes__mutmut_30": 'h[:, 1:3] of a two-column header is h[:, 1:2]',
    "kvarn.stats.metrics.x_mean_and_uncertainty__mutmut_18": "var >= 0 for var > 0: they differ only at var == 0, "
                                                              "where sqrt(0 / (n - 1)) is the same 0.0",
}
STATUS_RE = re.compile(r"^\s*(kvarn\.[\w.]+?)\.x_?\w*__mutmut_\d+: (.+)$")


def module_of(mutant: str) -> str:
    """kvarn.stats.metrics.x_token_metrics__mutmut_3 -> kvarn/stats/metrics.py"""
    m = STATUS_RE.match(f"    {mutant}: x")
    return (m[1] if m else mutant.rsplit(".", 1)[0]).replace(".", "/") + ".py"


def run_group(name: str, max_children: int, keep: Path | None) -> dict:
    modules, tests = GROUPS[name]
    work = Path(keep or tempfile.mkdtemp(prefix=f"kvarn-mutation-{name}-"))
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run(f"git -C {REPO} archive HEAD | tar -x -C {work}", shell=True, check=True)
    if (REPO / "resources").exists() and not (work / "resources").exists():
        (work / "resources").symlink_to(REPO / "resources")
    with open(work / "pyproject.toml", "a") as f:
        f.write("\n[tool.mutmut]\n"
                f"source_paths = {json.dumps(modules)}\n"
                f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
                'pytest_add_cli_args = ["-p", "no:xdist", "-q", "-p", "no:cacheprovider"]\n'
                # a mutant whose tests run 3x their clean time is a timeout (killed): mutmut's default
                # 15x spends minutes on each endless-loop mutant
                "timeout_multiplier = 3.0\n"
                'also_copy = ["tests/", "kvarn/", "config/", "resources", "workflow/", "docs/"]\n')
    t0 = time.time()
    mutmut = Path(sys.executable).with_name("mutmut")
    log = work / "mutmut-run.log"
    with open(log, "w") as f:
        # one intra-op thread: mutmut forks its workers from a process that has run the tests, and a
        # forked child of an initialized OpenMP pool deadlocks (every mutant a false "timeout")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        r = subprocess.run([str(mutmut), "run", "--max-children", str(max_children)], cwd=work, stdout=f,
                           stderr=subprocess.STDOUT, env=env)
    res = subprocess.run([str(mutmut), "results", "--all", "true"], cwd=work, capture_output=True, text=True)
    per: dict[str, dict[str, int]] = {m: {} for m in modules}
    survivors: list[str] = []
    for line in res.stdout.splitlines():
        m = re.match(r"^\s*([\w.]+__mutmut_\d+): (.+)$", line)
        if not m:
            continue
        status = m[2].strip()
        mod = module_of(m[1])
        per.setdefault(mod, {})
        per[mod][status] = per[mod].get(status, 0) + 1
        if status == "survived" and m[1] in EQUIVALENT:
            status = "equivalent"
            per[mod]["survived"] -= 1
            per[mod][status] = per[mod].get(status, 0) + 1
        if status == "survived":
            survivors.append(m[1])
    return {"group": name, "modules": per, "survivors": survivors, "wall_s": time.time() - t0, "work": str(work),
            "rc": r.returncode, "tests": tests}


def check_timeouts(res: dict) -> None:
    """A run whose mutants all time out measured nothing (a hung test process, not endless loops)."""
    for mod, counts in res["modules"].items():
        if counts.get("timeout", 0) and not counts.get("killed", 0) and not counts.get("survived", 0):
            raise SystemExit(f"{mod}: every mutant timed out ({counts['timeout']}): the tests hung, the run measured "
                             f"nothing; see {res['work']}/mutmut-run.log")


def score(counts: dict) -> tuple[int, int, int, int, float | None]:
    """(mutants, killed incl. timeouts, survived, timeouts, killed / (killed + survived)); equivalent
    mutants (EQUIVALENT) count in neither."""
    killed, survived = counts.get("killed", 0), counts.get("survived", 0)
    timeout = counts.get("timeout", 0)
    total = sum(counts.values())
    done = killed + timeout + survived
    return total, killed + timeout, survived, timeout, ((killed + timeout) / done if done else None)


def write(res: dict, out: Path, command: str) -> None:
    from kvarn.report.provenance import commit, machine

    cpu, sha = machine()["cpu"], commit(REPO)
    lines = [f"# Mutation testing: {res['group']}", "",
             f"mutmut 3.8.1 at {sha}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu} "
             f"({os.cpu_count()} cores), {res['wall_s'] / 60:.1f} min. Command: `{command}`. "
             f"Tests: {', '.join(res['tests'])}.", "",
             "| module | mutants | killed (timeouts) | survived | equivalent | other | score |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for mod, counts in res["modules"].items():
        total, killed, survived, timeout, s = score(counts)
        eq = counts.get("equivalent", 0)
        other = total - killed - survived - eq
        lines.append(f"| `{mod}` | {total} | {killed} ({timeout}) | {survived} | {eq} | {other} | "
                     f"{'–' if s is None else f'{100 * s:.1f} %'} |")
    lines += ["", f"Survivors ({len(res['survivors'])}); `mutmut show NAME` in a copy made as above shows each:", ""]
    lines += [f"- `{s}`" for s in res["survivors"]]
    eq = [(n, why) for n, why in EQUIVALENT.items() if any(n.startswith(m.removesuffix(".py").replace("/", ".") + ".")
                                                           for m in res["modules"])]
    if eq:
        lines += ["", "Equivalent mutants (read, and the same behaviour for every accepted input):", ""]
        lines += [f"- `{n}`: {why}" for n, why in eq]
    (out / f"{res['group']}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("groups", nargs="*", default=list(GROUPS), help=f"groups: {', '.join(GROUPS)} (default: all)")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "mutation" / "results")
    ap.add_argument("--keep", type=Path, help="the work folder (default: a new temporary one)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    for g in a.groups:
        if g not in GROUPS:
            raise SystemExit(f"unknown group {g!r}; groups: {', '.join(GROUPS)}")
        res = run_group(g, a.max_children, a.keep)
        check_timeouts(res)
        write(res, a.out, f"python -m bench.mutation.run {g}")
        for mod, counts in res["modules"].items():
            total, killed, survived, timeout, s = score(counts)
            print(f"{mod}: {total} mutants, {killed} killed, {survived} survived"
                  + ("" if s is None else f", score {100 * s:.1f} %") + f"  (work: {res['work']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
