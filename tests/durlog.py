"""A pytest plugin for measuring the suite on a busy machine (bench/perf/results/suite.md).

`DURLOG=<file> pytest -p durlog --cov=kvarn ...` (with tests/ on PYTHONPATH) appends one
JSON line per test phase as it finishes (node id, phase, duration, outcome) and one per
finished test module (time, load average), and copies the cumulative coverage data to
`<file>.cov.<module>` when the next module starts: a run stopped early still leaves
per-test durations and the coverage of every module it finished, so two runs can be
compared over the modules both finished.

Under pytest-xdist each test phase is logged twice, by the worker that ran it and by the
controller (`by`); every record names the worker that ran the test (`worker`) and when the
phase started and stopped. `python tests/durlog.py <file>` prints each worker's first start,
last stop and busy seconds (the controller's records), which shows whether one worker ended
long before the other.
"""

import json
import os
import shutil
import time

_state = {"config": None, "module": None}


def _out() -> str:
    return os.environ["DURLOG"]


def _write(record: dict) -> None:
    with open(_out(), "a") as f:
        f.write(json.dumps(record) + "\n")


def _save_coverage(tag: str) -> None:
    plugin = _state["config"].pluginmanager.getplugin("_cov")
    cov = getattr(getattr(plugin, "cov_controller", None), "cov", None)
    if cov is not None:
        cov.save()
        shutil.copy(cov.get_data().data_filename(), f"{_out()}.cov.{tag}")


def pytest_configure(config):
    _state["config"] = config


def pytest_runtest_logstart(nodeid, location):
    module = nodeid.split("::")[0]
    done = _state["module"]
    if done is not None and module != done:
        _save_coverage(os.path.basename(done))
        _write({"module_done": done, "t": time.time(), "load": os.getloadavg()})
    _state["module"] = module


def _worker(report) -> str:
    """The xdist worker that ran the test ('main' without xdist)."""
    node = getattr(report, "node", None)  # on the controller: the worker that sent the report
    if node is not None:
        return node.gateway.id
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def pytest_runtest_logreport(report):
    _write({"id": report.nodeid, "when": report.when, "dur": round(report.duration, 3),
            "outcome": report.outcome, "t": round(time.time(), 1), "worker": _worker(report),
            "by": os.environ.get("PYTEST_XDIST_WORKER", "controller"),
            "start": round(report.start, 2), "stop": round(report.stop, 2)})


def timeline(path: str) -> dict[str, dict]:
    """Per worker, from one process's records (the controller's under xdist): first start, last
    stop, the seconds its test phases took (busy) and how many tests it ran."""
    out: dict[str, dict] = {}
    for line in open(path):
        r = json.loads(line)
        if "start" not in r or r["by"] not in ("controller", "main"):
            continue
        w = out.setdefault(r["worker"], {"first": r["start"], "last": r["stop"], "busy": 0.0, "tests": 0})
        w["first"], w["last"] = min(w["first"], r["start"]), max(w["last"], r["stop"])
        w["busy"] += r["stop"] - r["start"]
        w["tests"] += r["when"] == "call"
    return out


if __name__ == "__main__":
    import sys

    t = timeline(sys.argv[1])
    t0 = min(w["first"] for w in t.values())
    end = max(w["last"] for w in t.values())
    for name, w in sorted(t.items()):
        print(f"{name}: {w['tests']} tests, first start {w['first'] - t0:.0f} s, last stop {w['last'] - t0:.0f} s "
              f"({end - w['last']:.0f} s before the end), busy {w['busy']:.0f} s")
