"""`make test` runs the suite on two pytest-xdist workers with `--dist loadgroup`, and the modules
that share an expensive fixture (a real model loaded, a snakemake run) name an `xdist_group` so
it is built on one worker only (tests/conftest.py). A pytest or xdist release that silently stops
grouping (pytest 9.2 with xdist 3.8 did: pytest-dev/pytest-xdist#1386) would build each such
fixture once per worker and slow the suite down without failing it: this fails instead."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import durlog


def test_loadgroup_keeps_a_group_on_one_worker(tmp_path):
    body = textwrap.dedent("""
        import pytest
        pytestmark = pytest.mark.xdist_group("shared")

        @pytest.mark.parametrize("i", range(4))
        def test_grouped(i):
            pass
    """)
    for name in ("test_one.py", "test_two.py"):
        (tmp_path / name).write_text(body)
    (tmp_path / "test_free.py").write_text("import pytest\n\n@pytest.mark.parametrize('i', range(6))\ndef test_free(i):\n    pass\n")
    log = tmp_path / "dur.jsonl"
    # not PYTEST_XDIST_*: run by `make test`, this test is itself on a worker, and the inner run's
    # controller must not take that worker's name
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}, "DURLOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                        "-v", "-o", "addopts=", "-o", "pythonpath=", "-p", "durlog", "--rootdir", str(tmp_path),
                        str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    ran = re.findall(r"\[(gw\d)\].*PASSED \S*(test_one|test_two|test_free)\.py", p.stdout)
    assert len(ran) == 14, p.stdout
    grouped = {gw for gw, mod in ran if mod != "test_free"}
    assert len(grouped) == 1, f"the 'shared' group ran on {sorted(grouped)}:\n{p.stdout}"
    assert {gw for gw, _ in ran} == {"gw0", "gw1"}, p.stdout  # the other tests still spread over both
    # tests/durlog.py's timeline names the worker of each test as xdist's report does
    per_worker = {gw: n for gw, n in ((gw, sum(g == gw for g, _ in ran)) for gw in ("gw0", "gw1"))}
    assert {gw: w["tests"] for gw, w in durlog.timeline(str(log)).items()} == per_worker


def test_durlog_timeline_by_hand(tmp_path):
    """Per worker: first start, last stop, busy seconds summed over phases (gw0: 1 + 4 + 0.5 + 2), tests counted by their call
    phase; the workers' own copies of the records (`by` a worker) are not counted twice."""
    recs = [("a", "setup", "gw0", 10.0, 11.0), ("a", "call", "gw0", 11.0, 15.0), ("a", "teardown", "gw0", 15.0, 15.5),
            ("b", "setup", "gw1", 10.5, 10.5), ("b", "call", "gw1", 10.5, 30.0), ("c", "call", "gw0", 16.0, 18.0)]
    log = tmp_path / "dur.jsonl"
    with open(log, "w") as f:
        for nodeid, when, gw, start, stop in recs:
            for by in ("controller", gw):
                f.write(json.dumps({"id": nodeid, "when": when, "worker": gw, "by": by, "start": start, "stop": stop}) + "\n")
        f.write(json.dumps({"module_done": "m", "t": 31.0}) + "\n")
    assert durlog.timeline(str(log)) == {"gw0": {"first": 10.0, "last": 18.0, "busy": 7.5, "tests": 2},
                                         "gw1": {"first": 10.5, "last": 30.0, "busy": 19.5, "tests": 1}}
