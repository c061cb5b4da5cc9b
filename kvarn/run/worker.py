"""One model load for many cells: a worker process per job identity that the workflow's
baseline, cell and decode scripts talk to over a unix socket.

Owns `run` (what a job script calls: through a worker, or in this process; this module imports
no torch at top level), the job's `identity` and `socket_path`, `release_others`, and the worker
itself (`serve`; `python -m kvarn.run.worker SOCKET IDENTITY_JSON`), which runs the same
`run_cell` / `run_baseline` / `run_decode` as a job's own process. Environment: KVARN_WORKER
(`enabled`), KVARN_WORKER_IDLE (seconds without a request before a worker exits, default 120),
KVARN_WORKER_DIR (the sockets' directory, default .snakemake/kvarn-workers).

Why (identity, killed workers, Slurm, several models on one device): docs/notes/scale.md
"kvarn.run.worker".
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import kvarn
from kvarn.files.identity import job_key
from kvarn.vocab.cell import CellSpec
from kvarn.weights.sources import DEFAULT_CACHE_DIR, ModelSpec
from kvarn.files.workerfiles import DIR_ENV, SOCKET_ENV, held_path, socket_dir

ENV, IDLE_ENV = "KVARN_WORKER", "KVARN_WORKER_IDLE"
RELEASE_TIMEOUT_S = 120.0  # waiting for a released worker to exit
IDLE_S = 120.0
SPAWN_TIMEOUT_S = 600.0  # the worker's own start (imports), not the model load
RETRY_S = 0.2  # between connection attempts, times the attempt
PROTOCOL = 1
KINDS = ("cell", "baseline", "decode")


class WorkerDied(RuntimeError):
    """The worker closed the connection after accepting the request (killed mid-job)."""


def enabled(env=None) -> bool:
    """Whether jobs use a worker (KVARN_WORKER): `1` yes, `0` run in the job's own process, unset or
    `auto`: a worker unless under Slurm (SLURM_JOB_ID set), where each job may land on another
    node and its allocation ends with the job."""
    env = os.environ if env is None else env
    value = env.get(ENV, "auto").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    if value == "auto":
        return "SLURM_JOB_ID" not in env
    raise ValueError(f"{ENV}={env.get(ENV)!r} (environment): expected 0, 1 or auto")


def _stat(path) -> list | None:
    try:
        st = Path(path).stat()
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _code_fingerprint() -> str:
    root = Path(kvarn.__file__).resolve().parent  # the whole package, not only this sub-package
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(f"{p.relative_to(root)}:{_stat(p)}\n".encode())
    return h.hexdigest()[:16]


def identity(key: dict, files=()) -> dict:
    """The worker identity of a job: `key` (job_key), the files' fingerprints, the code, the interpreter."""
    files = [key["text"], *map(str, files)] if key.get("text") else list(map(str, files))
    return {"protocol": PROTOCOL, **key, "files": {str(Path(f).resolve()): _stat(f) for f in files},
            "code": _code_fingerprint(), "python": sys.executable,
            "threads": os.environ.get("OMP_NUM_THREADS")}


def socket_path(ident: dict, directory=None) -> Path:
    directory = socket_dir(directory)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    path = directory.resolve() / f"{digest}.sock"
    if len(os.fsencode(path)) > 100:  # AF_UNIX paths hold ~107 bytes; a relative one is shorter
        path = Path(os.path.relpath(path))
        if len(os.fsencode(path)) > 100:
            raise ValueError(f"worker socket path {path} is too long for a unix socket; set {DIR_ENV} shorter")
    return path


# --- the job script's side -----------------------------------------------------------------

def run(kind: str, spec, n_ctx: int, chunks: int, *, text=None, device="auto", dtype="auto",
        cache_dir=DEFAULT_CACHE_DIR, files=(), use_worker: bool | None = None, **kwargs) -> dict:
    """kvarn.run.torch_engine.run_cell (kind "cell"), run_baseline ("baseline") or kvarn.run.decode.
    run_decode ("decode"; `chunks` is its prompts) with these arguments, through this identity's
    worker (KVARN_WORKER, see `enabled`) or in this process.
    `files`: more files whose change must mean a fresh load (the model's fetch marker)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {KINDS}")
    common = dict(text=text, device=device, dtype=dtype, cache_dir=cache_dir)
    if not (enabled() if use_worker is None else use_worker):
        return _runner(kind)(spec, n_ctx, chunks, **common, **kwargs)
    key = job_key(spec, n_ctx, chunks, text, device, dtype, cache_dir)
    ident = identity(key, files)
    # paths absolute: the worker may have been started from another working directory; a cell
    # travels as its one encoding (CellSpec.name), read back with CellSpec.from_name
    request = {"kind": kind, "identity": ident, "kwargs": {k: (str(Path(v).resolve()) if isinstance(v, Path)
                                                              else v.name if isinstance(v, CellSpec) else v)
                                                          for k, v in kwargs.items()}}
    return request_reply(socket_path(ident), ident, request)


def _runner(kind: str):
    """The function a request of `kind` runs (imported on first use: the job script's side imports no torch)."""
    if kind == "decode":
        from kvarn.run.decode import run_decode

        return run_decode
    from kvarn.run import torch_engine

    return torch_engine.run_cell if kind == "cell" else torch_engine.run_baseline


@contextlib.contextmanager
def _closing_quietly(f):
    """`f`, closed on the way out; the broken pipe of a flush on close (a dead peer) is dropped."""
    try:
        yield f
    finally:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            f.close()


def request_reply(path: Path, ident: dict, request: dict, attempts: int = 3) -> dict:
    """Send `request` to the worker at `path` (spawned if none answers) and return its result."""
    for attempt in range(attempts):
        if attempt:
            time.sleep(RETRY_S * attempt)  # a worker that just died may still hold its socket open
        conn = _connect_or_spawn(path, ident)
        # closing the file must not raise: after a broken pipe its buffer still holds the request,
        # and a failed flush on close would replace the retry (or the WorkerDied) with that error
        with conn, _closing_quietly(conn.makefile("rwb")) as f:
            try:
                f.write(json.dumps(request).encode() + b"\n")
                f.flush()
                first = f.readline()
            except (ConnectionResetError, BrokenPipeError):
                first = b""
            if not first:  # closed before accepting: an idle exit (or a kill) racing our connect; nothing started
                continue
            msg = json.loads(first)
            if msg.get("accepted"):
                print(f"kvarn.run.worker: request accepted by pid {msg.get('pid')} ({path}; log {_log(path)})",
                      flush=True)
                try:
                    line = f.readline()
                except ConnectionResetError:
                    line = b""
                if not line:
                    raise WorkerDied(f"kvarn worker {path} closed the connection mid-{request['kind']} "
                                     f"(killed?); nothing was written; log: {_log(path)}")
                msg = json.loads(line)
            if msg.get("ok"):
                return msg["result"]
            raise _error(msg)
    raise WorkerDied(f"kvarn worker {path}: the connection closed before the request was accepted, "
                     f"{attempts} times; log: {_log(path)}")


def _error(msg: dict) -> Exception:
    kinds = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "TypeError": TypeError,
             "KeyError": KeyError, "IndexError": IndexError}
    text = f"{msg.get('error')}\n(in the kvarn worker; its traceback:)\n{msg.get('traceback', '')}"
    return kinds.get(msg.get("type"), RuntimeError)(text)


def _log(path: Path) -> Path:
    return path.with_suffix(".log")


def _try_connect(path: Path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(os.fspath(path))
        return s
    except (FileNotFoundError, ConnectionRefusedError):
        s.close()
        return None


def _connect_or_spawn(path: Path, ident: dict) -> socket.socket:
    conn = _try_connect(path)
    if conn is not None:
        return conn
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one spawner per identity; the others then connect
        conn = _try_connect(path)
        if conn is not None:
            return conn
        env = dict(os.environ)
        root = str(Path(kvarn.__file__).resolve().parents[1])  # this kvarn, whatever the worker's cwd
        env["PYTHONPATH"] = root + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else root
        with open(_log(path), "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "kvarn.run.worker", os.fspath(path), json.dumps(ident)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                    start_new_session=True)
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while time.monotonic() < deadline:
            conn = _try_connect(path)
            if conn is not None:
                return conn
            if proc.poll() is not None:
                tail = _log(path).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"kvarn worker for {path} exited with {proc.returncode} before listening; "
                                   f"log {_log(path)}:\n{tail}")
            time.sleep(0.05)
        proc.kill()
        raise RuntimeError(f"kvarn worker for {path} did not listen within {SPAWN_TIMEOUT_S:.0f}s; log {_log(path)}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds no memory
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def release_others(own: Path | None, directory=None, timeout_s: float = RELEASE_TIMEOUT_S) -> list[int]:
    """Ask every other live worker of `own`'s directory (or `directory`) to exit, and wait until
    each has: a worker answers after its current request, unlinks its socket and exits, which
    frees its model's memory. Returns the pids that exited."""
    d = Path(directory) if directory is not None else Path(own).parent
    released = []
    for sock in sorted(d.glob("*.sock")):
        if own is not None and sock.resolve() == Path(own).resolve():
            continue
        conn = _try_connect(sock)
        if conn is None:
            continue
        with conn, conn.makefile("rwb") as f:
            try:
                f.write(json.dumps({"kind": "release"}).encode() + b"\n")
                f.flush()
                line = f.readline()
            except (ConnectionResetError, BrokenPipeError):
                line = b""
        pid = json.loads(line).get("released") if line else None
        if not pid:
            continue
        deadline = time.monotonic() + timeout_s
        while _alive(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvarn worker pid {pid} ({sock}) did not exit within {timeout_s:.0f}s of its release")
            time.sleep(0.05)
        released.append(pid)
    return released


class _Released(Exception):
    """A release request was answered: the serve loop exits."""


def _load_context(args, common, ubatch):
    """load.Context, releasing the other workers of this directory once if the preflight
    refuses the load (the device is held by another model's idle worker)."""
    from kvarn.budget.preflight import PreflightError
    from kvarn.run import load

    try:
        return load.Context(*args, **common, ubatch=ubatch, baseline=True)
    except PreflightError as e:
        own = os.environ.get(SOCKET_ENV)
        pids = release_others(Path(own)) if own else []
        if not pids:
            raise
        print(f"preflight refused the load ({str(e).splitlines()[0]}); released workers {pids} "
              f"at {time.time():.3f}; checking again", flush=True)
        return load.Context(*args, **common, ubatch=ubatch, baseline=True)


# --- the worker's side -------------------------------------------------------------------------

def _json_default(x):
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def serve(path: Path, ident: dict, idle_s: float | None = None) -> None:
    """Listen on `path`; serve requests of identity `ident` one at a time; exit when idle."""
    idle_s = float(os.environ.get(IDLE_ENV, IDLE_S)) if idle_s is None else idle_s
    path = Path(path)
    if path.exists() or path.is_symlink():
        path.unlink()  # a dead worker's socket: we were spawned under the lock because it refused
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(os.fspath(path))
    inode = path.stat().st_ino
    srv.listen(64)
    srv.settimeout(idle_s)
    os.environ[SOCKET_ENV] = os.fspath(path)
    print(f"kvarn worker pid {os.getpid()} on {path}: {json.dumps(ident)}", flush=True)
    context = None
    try:
        while True:
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                print(f"idle for {idle_s:.0f}s: exiting", flush=True)
                return
            conn.settimeout(None)
            with conn, conn.makefile("rwb") as f:
                try:
                    context = _handle(conn, f, ident, context)
                except (BrokenPipeError, ConnectionResetError):
                    print("the job script went away before the reply", flush=True)
                except _Released:
                    print(f"released for another worker at {time.time():.3f}: exiting", flush=True)
                    return
    finally:
        try:
            if path.stat().st_ino == inode:  # still ours: unlink before closing, so new clients spawn anew
                path.unlink()
                held_path(path).unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        srv.close()


def _peer_gone(conn: socket.socket) -> bool:
    """The job script closed its end (it sends nothing after the request, so readable = closed)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _discard(kwargs: dict) -> None:
    """Remove what a request wrote for a job script that is gone (killed): its scratch path,
    unique to that attempt, which a later attempt has already cleared and will not read."""
    import shutil

    for key in ("out_dir", "out"):
        p = kwargs.get(key)
        if p and Path(p).is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p and Path(p).exists():
            Path(p).unlink()


def _handle(conn, f, ident: dict, context):
    import traceback

    line = f.readline()
    if not line:
        return context
    req = json.loads(line)
    if req.get("kind") == "release":  # another worker needs the device: answer, then exit
        f.write(json.dumps({"released": os.getpid()}).encode() + b"\n")
        f.flush()
        raise _Released
    if _peer_gone(conn):  # queued behind another request while its job was killed
        print("the job script went away while queued: skipped", flush=True)
        return context
    f.write(json.dumps({"accepted": True, "pid": os.getpid()}).encode() + b"\n")
    f.flush()
    try:
        if req.get("identity") != ident:
            theirs = req.get("identity") or {}
            diff = sorted(k for k in set(ident) | set(theirs) if ident.get(k) != theirs.get(k))
            raise ValueError(f"refused: this worker holds another job identity (differs in {diff}); "
                             f"nothing was run")
        if req.get("kind") not in KINDS:
            raise ValueError(f"request kind {req.get('kind')!r}: expected one of {KINDS}")

        k = ident
        spec = ModelSpec(k["name"], k["source"], k["revision"])
        args = (spec, k["n_ctx"], k["chunks"])
        common = dict(text=k["text"], device=k["device"], dtype=k["dtype"], cache_dir=k["cache_dir"])
        kwargs = dict(req["kwargs"])
        if "cell" in kwargs:
            kwargs["cell"] = CellSpec.from_name(kwargs["cell"])
        if context is None:
            t0 = time.perf_counter()
            context = _load_context(args, common, kwargs.get("ubatch", 512))
            print(f"loaded {spec.name} ({spec.source}@{spec.revision}) in {time.perf_counter() - t0:.1f}s "
                  f"at {time.time():.3f}", flush=True)
        t0 = time.perf_counter()
        result = _runner(req["kind"])(*args, **common, context=context, **kwargs)
        what = kwargs["cell"].name if "cell" in kwargs else ""
        print(f"served {req['kind']} {what} in {time.perf_counter() - t0:.1f}s", flush=True)
        reply = {"ok": True, "result": result}
    except Exception as e:  # the job script raises it; the worker stays up for the next request
        traceback.print_exc()
        reply = {"ok": False, "type": type(e).__name__, "error": str(e), "traceback": traceback.format_exc()}
    if _peer_gone(conn):
        print("the job script went away during the request: its outputs are discarded", flush=True)
        _discard(req.get("kwargs", {}))
        return context
    f.write(json.dumps(reply, default=_json_default).encode() + b"\n")
    f.flush()
    return context


if __name__ == "__main__":
    serve(Path(sys.argv[1]), json.loads(sys.argv[2]))
