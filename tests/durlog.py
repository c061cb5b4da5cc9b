"""A pytest plugin for measuring the suite on a busy machine (bench/perf/results/suite.md).

`DURLOG=<file> pytest -p durlog --cov=kvarn ...` (with tests/ on PYTHONPATH) appends one
JSON line per test phase as it finishes (node id, phase, duration, outcome) and one per
finished test module (time, load average), and copies the cumulative coverage data to
`<file>.cov.<module>` when the next module starts: a run stopped early still leaves
per-test durations and the coverage of every module it finished, so two runs can be
compared over the modules both finished.
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


def pytest_runtest_logreport(report):
    _write({"id": report.nodeid, "when": report.when, "dur": round(report.duration, 3),
            "outcome": report.outcome, "t": round(time.time(), 1)})
