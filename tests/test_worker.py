"""kvarn.run.worker: one model load for many cells, the same numbers as in-process.

Fast: the switch, the identity (a changed file means another worker), the job script's
side imports no torch. Slow (real SmolLM2 at n_ctx 384, one chunk): the baseline, the
cells and a free-running decode through one worker equal the in-process ones bit for bit
(timing fields aside), the model loads once; a worker killed mid-cell leaves no output and the rerun succeeds; a
request of another identity is refused.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvarn.vocab.cell import CellSpec
from kvarn.run import worker
from paths import CACHE_DIR, ENGINE_TEXT as TEXT, REPO

# One xdist worker: the module fixture runs a baseline and cells in-process and through a worker.
pytestmark = pytest.mark.xdist_group("worker")

CTX = 384  # KVarN's body is read from p = 256 on (sink 128 + tail 128); at 256 it never is
TIMING = ("tokens_per_s", "wall_s")
# a block format with a tail, KVarN (its body read: asserted), and bf16 (the baseline's own cache)
CELLS = [("q4_0", "q4_0", 128), ("kvarn4", "kvarn4", 0), ("bf16", "bf16", 0)]
DECODE_TOKENS = 6  # a kvarn4 decode from a 378-token prompt: its body (sealed from p = 256 on) is read


def _spec():
    from kvarn.weights.sources import ModelSpec

    return ModelSpec("smollm2-135m", "embedded:smollm2-135m")


# --- fast --------------------------------------------------------------------------------

@pytest.mark.parametrize("value,env,want", [
    ("1", {}, True), ("0", {}, False), ("auto", {}, True), (None, {}, True),
    ("auto", {"SLURM_JOB_ID": "7"}, False), (None, {"SLURM_JOB_ID": "7"}, False), ("1", {"SLURM_JOB_ID": "7"}, True),
])
def test_switch(value, env, want):
    env = dict(env, **({worker.ENV: value} if value is not None else {}))
    assert worker.enabled(env) is want


def test_switch_refuses_other_values():
    with pytest.raises(ValueError, match=r"KVARN_WORKER='maybe'.*0, 1 or auto"):
        worker.enabled({worker.ENV: "maybe"})


def test_a_changed_file_or_argument_is_another_worker(tmp_path):
    text, marker = tmp_path / "text.raw", tmp_path / "model.fetched.json"
    text.write_text("a")
    marker.write_text("{}")
    key = worker.job_key(_spec(), CTX, 1, text, "auto", "auto", CACHE_DIR)
    first = worker.socket_path(worker.identity(key, [marker]), tmp_path)
    assert worker.socket_path(worker.identity(key, [marker]), tmp_path) == first  # stable
    others = [worker.socket_path(worker.identity(dict(key, n_ctx=512), [marker]), tmp_path),
              worker.socket_path(worker.identity(dict(key, revision="abc"), [marker]), tmp_path),
              worker.socket_path(worker.identity(dict(key, dtype="bfloat16"), [marker]), tmp_path)]
    os.utime(marker, ns=(1, 1))  # a re-fetched model: its marker's mtime changes
    others.append(worker.socket_path(worker.identity(key, [marker]), tmp_path))
    text.write_text("ab")
    others.append(worker.socket_path(worker.identity(key, []), tmp_path))
    assert len({first, *others}) == len(others) + 1


def test_the_job_script_side_imports_no_torch():
    code = ("import sys, kvarn.run.worker, kvarn.weights.sources; "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert out.strip() == "[]"


# --- slow: real runs ---------------------------------------------------------------------

def _strip(s: dict) -> dict:
    return {k: v for k, v in s.items() if k not in TIMING}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Baseline + CELLS in-process, then the same through one worker (its own socket dir)."""
    root = tmp_path_factory.mktemp("w")
    os.environ[worker.DIR_ENV] = str(root / "sock")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    idle = os.environ.get(worker.IDLE_ENV)
    os.environ[worker.IDLE_ENV] = "120"  # the fixture's worker outlives the gaps: the kill test stops it
    out = {}
    try:
        for mode, use in (("inproc", False), ("worker", True)):
            base = root / mode / "base.kvd"
            base.parent.mkdir()
            b = worker.run("baseline", _spec(), CTX, 1, text=TEXT, cache_dir=CACHE_DIR, out=base, use_worker=use)
            cells = {}
            for k, v, tail in CELLS:
                d = root / mode / f"{k}-{v}-t{tail}"
                cells[(k, v, tail)] = worker.run("cell", _spec(), CTX, 1, text=TEXT, cache_dir=CACHE_DIR,
                                                 cell=CellSpec(k, v, tail), baseline=base, out_dir=d, use_worker=use)
            # a free-running decode of the same chunk (prompts = chunks: the same worker)
            dec = worker.run("decode", _spec(), CTX, 1, tokens=DECODE_TOKENS, text=TEXT, cache_dir=CACHE_DIR,
                             cell=CellSpec("kvarn4", "kvarn4", 0), out_dir=root / mode / "decode", use_worker=use)
            out[mode] = (base, b, cells, dec)
        yield root, out
    finally:
        os.environ.pop(worker.DIR_ENV, None)
        if idle is None:
            os.environ.pop(worker.IDLE_ENV, None)
        else:
            os.environ[worker.IDLE_ENV] = idle


def _worker_log(root: Path) -> str:
    logs = list((root / "sock").glob("*.log"))
    assert len(logs) == 1, logs
    return logs[0].read_text()


@pytest.mark.slow
def test_worker_gives_the_same_numbers_with_one_load(runs):
    import polars as pl

    from kvarn.baseline import dump

    root, out = runs
    (b0, _, c0), (b1, _, c1) = out["inproc"][:3], out["worker"][:3]
    assert dump.open_dump(b0).header["chunk_sha256"] == dump.open_dump(b1).header["chunk_sha256"]
    for cell in CELLS:
        assert _strip(c0[cell]) == _strip(c1[cell]), cell
        d0, d1 = (root / m / "{}-{}-t{}".format(*cell) / "tokens.parquet" for m in ("inproc", "worker"))
        assert pl.read_parquet(d0).equals(pl.read_parquet(d1)), cell
    assert c0[("kvarn4", "kvarn4", 0)]["exact_share"] < 1  # the KVarN cell's body is read in both modes
    # bf16 against the bf16 baseline: only the dump's encoding error, the same in both modes
    assert c1[("bf16", "bf16", 0)]["same_top"] == 1.0 and c1[("bf16", "bf16", 0)]["kld_max"] <= 1.3e-4
    log = _worker_log(root)  # the worker path was taken: one load served the baseline and every cell
    assert log.count("loaded smollm2-135m") == 1 and log.count("served cell ") == len(CELLS), log
    assert log.count("served baseline") == 1


@pytest.mark.slow
def test_decode_through_the_worker_gives_the_same_numbers(runs):
    import polars as pl

    from kvarn.run import decode as KD

    root, out = runs
    d0, d1 = out["inproc"][3], out["worker"][3]
    timing = KD.TIMING_KEYS
    assert set(timing) <= d0.keys() and d0["prefill_s"] + d0["steps_s"] <= d0["decode_s"] <= d0["wall_s"]
    assert d0["step_ms"] == pytest.approx(1000 * d0["steps_s"] / d0["n_tokens"])
    assert {k: v for k, v in d0.items() if k not in timing} == {k: v for k, v in d1.items() if k not in timing}
    assert d1["n_prompts"] == 1 and d1["n_tokens"] == DECODE_TOKENS and d1["prompt_tokens"] == CTX - DECODE_TOKENS
    steps = [pl.read_parquet(root / m / "decode" / "steps.parquet") for m in ("inproc", "worker")]
    assert steps[0].equals(steps[1]) and steps[0].height == DECODE_TOKENS
    log = _worker_log(root)  # served by the worker that had loaded the model for the cells
    assert log.count("served decode kvarn4-kvarn4-t0") == 1 and log.count("loaded smollm2-135m") == 1, log


@pytest.mark.slow
def test_identity_mismatch_is_refused(runs):
    root, _ = runs
    key = worker.job_key(_spec(), CTX, 1, TEXT, "auto", "auto", CACHE_DIR)
    ident = worker.identity(key)
    path = worker.socket_path(ident)
    assert path.exists(), "the worker of the fixture's identity should still be alive"
    other = dict(ident, dtype="bfloat16")
    req = {"kind": "cell", "identity": other, "kwargs": {}}
    with pytest.raises(ValueError, match=r"refused: this worker holds another job identity \(differs in \['dtype'\]\)"):
        worker.request_reply(path, ident, req)


@pytest.mark.slow
def test_killed_worker_leaves_nothing_and_the_rerun_succeeds(runs, tmp_path, monkeypatch):
    root, out = runs
    base = out["worker"][0]
    key = worker.job_key(_spec(), CTX, 1, TEXT, "auto", "auto", CACHE_DIR)
    log = worker.socket_path(worker.identity(key)).with_suffix(".log")
    monkeypatch.setenv(worker.IDLE_ENV, "60")
    cell = dict(text=TEXT, cache_dir=CACHE_DIR, cell=CellSpec("kvarn4", "kvarn4", 0), baseline=base)
    result = {}

    def job():
        try:
            result["ok"] = worker.run("cell", _spec(), CTX, 1, out_dir=tmp_path / "a", use_worker=True, **cell)
        except Exception as e:  # noqa: BLE001
            result["error"] = e

    n0 = log.read_text().count("served cell ")
    started = "smollm2-135m kvarn4/kvarn4 tail 0"  # the cell's chunk loop has begun (its progress bar)
    s0 = log.read_text().count(started)
    t = threading.Thread(target=job)
    t.start()
    deadline, killed = time.time() + 300, None
    while time.time() < deadline:  # kill the worker (the fixture's, loaded) once it is inside the cell
        text = log.read_text()
        if text.count(started) > s0:
            killed = int(text.rsplit("kvarn worker pid ", 1)[1].split()[0])
            os.kill(killed, signal.SIGKILL)
            break
        time.sleep(0.005)
    t.join(300)
    assert killed is not None, "the cell never started"
    assert text.count("loaded smollm2-135m") == 1, "the fixture's worker (loaded once) should have taken the cell"
    assert log.read_text().count("served cell ") == n0, "the cell finished before the kill: nothing was tested"
    assert isinstance(result.get("error"), worker.WorkerDied), result
    assert not (tmp_path / "a" / "summary.json").exists() and not (tmp_path / "a" / "tokens.parquet").exists()
    loads = log.read_text().count("loaded smollm2-135m")
    again = worker.run("cell", _spec(), CTX, 1, out_dir=tmp_path / "b", use_worker=True, **cell)
    text = log.read_text()  # the rerun was served by a fresh worker, which loaded the model
    assert text.count("loaded smollm2-135m") == loads + 1 and text.count("served cell ") == n0 + 1
    assert int(text.rsplit("kvarn worker pid ", 1)[1].split()[0]) != killed
    assert _strip(again) == _strip(out["inproc"][2][("kvarn4", "kvarn4", 0)])
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["kld_median"] == again["kld_median"]


def test_release_others_makes_each_other_worker_exit(tmp_path):
    """kvarn.run.worker.release_others: every other live worker of the directory answers, exits
    (waited for), and leaves neither socket nor held file; the asking worker's own is spared."""
    import json as _json
    import subprocess
    import sys as _sys
    import time as _time

    procs = {}
    for name in ("a", "b", "own"):
        sock = tmp_path / f"{name}.sock"
        procs[name] = subprocess.Popen([_sys.executable, "-m", "kvarn.run.worker", str(sock), _json.dumps({"name": name})],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        worker.held_path(sock).write_text("100\n")
    try:
        deadline = _time.monotonic() + 60
        while not all((tmp_path / f"{n}.sock").exists() for n in procs) and _time.monotonic() < deadline:
            _time.sleep(0.05)
        released = worker.release_others(tmp_path / "own.sock")
        assert sorted(released) == sorted([procs["a"].pid, procs["b"].pid])
        assert procs["a"].wait(5) == 0 and procs["b"].wait(5) == 0 and procs["own"].poll() is None
        assert sorted(p.name for p in tmp_path.iterdir()) == ["own.held", "own.sock"]
    finally:
        worker.release_others(None, tmp_path)
        procs["own"].wait(30)


def test_a_dead_peer_before_acceptance_is_retried(monkeypatch):
    """A worker killed (or exiting idle) just as a client connects: the request cannot even be
    written (broken pipe). The client must try again — here the second connection is a live
    worker that accepts and answers — not fail on the unsent bytes when the file closes."""
    dead, gone = socket.socketpair()
    gone.close()  # writing to `dead` now fails with EPIPE, as to a worker that died after connect
    live, server = socket.socketpair()

    def serve():
        with server, server.makefile("rwb") as f:
            req = json.loads(f.readline())
            f.write(json.dumps({"accepted": True, "pid": 0}).encode() + b"\n")
            f.write(json.dumps({"ok": True, "result": {"kind": req["kind"]}}).encode() + b"\n")
            f.flush()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    conns = [dead, live]
    monkeypatch.setattr(worker, "_connect_or_spawn", lambda path, ident: conns.pop(0))
    monkeypatch.setattr(worker, "RETRY_S", 0.0)
    assert worker.request_reply(Path("w.sock"), {}, {"kind": "cell"}) == {"kind": "cell"}
    t.join(10)
    assert conns == []  # both connections were used: the dead one, then the live one
