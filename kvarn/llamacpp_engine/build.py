"""A llama.cpp build as an engine: where it is, what it is, our harness compiled against it.

Owns the build's identity (`Build`, `read_build`: the version string and commit its own
`--version` prints, the backend from its CMakeCache, the provenance kvarn wrote when it built
it, the sha256 of its libraries), what it accepts (the cache types and options its own
`--help` lists), the pinned upstream source CI builds (`build_upstream`: llama-cpp-python's
vendored llama.cpp from PyPI, built for this CPU once per machine into a cache outside the
repository) and the harness (`harness`: kvarn_kld.cpp beside this file, compiled against the
build's headers and libraries, cached in the build's folder by the source's hash).

A build is given by a path: the matrix's `engine.build`, else the environment variable
KVARN_LLAMACPP_BUILD; `upstream` names the pinned upstream build (built on first use).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvarn.files.identity import uncached_sha256

BUILD_ENV = "KVARN_LLAMACPP_BUILD"
CACHE_ENV = "KVARN_LLAMACPP_CACHE"
UPSTREAM = "upstream"  # the build path that names the pinned upstream build
UPSTREAM_PACKAGE, UPSTREAM_VERSION = "llama-cpp-python", "0.3.36"
UPSTREAM_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
UPSTREAM_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                  "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
TARGETS = ("llama-perplexity", "llama-bench")
PROVENANCE = "kvarn-build.json"  # written into a build kvarn made: what it was built from, how
HARNESS_SRC = Path(__file__).with_name("kvarn_kld.cpp")

# Environment variables that change a build's numbers: recorded in every identity, so cells run
# under different settings never share a baseline. LLAMA_ATTN_ROT_DISABLE: the Hadamard rotation
# of quantized caches (upstream and BeeLlama); GGML_KVARN_WINDOW_CHUNK: BeeLlama's KVarN window.
NUMERICS_ENV = ("LLAMA_ATTN_ROT_DISABLE", "GGML_KVARN_WINDOW_CHUNK", "GGML_SCHED_MAX_COPIES", "GGML_CUDA_FORCE_MMQ",
                "GGML_CUDA_FORCE_CUBLAS")


class BuildError(RuntimeError):
    """A build kvarn cannot use; the message names the path and what is missing."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvarn" / "llamacpp")


def build_path(configured: str | None) -> str:
    """The build a run uses: the configured path, else $KVARN_LLAMACPP_BUILD; refused when neither."""
    path = configured or os.environ.get(BUILD_ENV)
    if not path:
        raise BuildError(f"engine llama.cpp needs a build: give engine.build in the matrix (a llama.cpp build "
                         f"folder, or '{UPSTREAM}' for the pinned upstream CPU build) or set {BUILD_ENV}")
    return path


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `path` (a build or a harness compile is done by one process at a time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_upstream(root: Path | None = None, jobs: int | None = None, log=sys.stderr) -> Path:
    """The pinned upstream llama.cpp (llama-cpp-python's vendored source, from PyPI), built for this
    CPU into `root` (default: the cache) once; later calls return it at once. A missing compiler,
    cmake or package index is an error, never a skip."""
    root = Path(root or cache_dir()) / f"upstream-{UPSTREAM_VERSION}"
    build = root / "build"
    if (build / PROVENANCE).is_file():
        return build
    with _locked(root / ".lock"):
        if (build / PROVENANCE).is_file():
            return build
        for tool in ("cmake", "c++"):
            if shutil.which(tool) is None:
                raise BuildError(f"building llama.cpp needs {tool!r} on PATH (apt-get install cmake g++)")
        t0 = time.time()
        sdist = root / f"llama_cpp_python-{UPSTREAM_VERSION}.tar.gz"
        if not sdist.is_file():
            print(f"kvarn: downloading {UPSTREAM_PACKAGE}=={UPSTREAM_VERSION} (source) from the package index", file=log)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            f"{UPSTREAM_PACKAGE}=={UPSTREAM_VERSION}", "-d", str(root)], check=True)
        digest = uncached_sha256(sdist)
        if digest != UPSTREAM_SHA256:
            raise BuildError(f"{sdist}: sha256 {digest}, pinned {UPSTREAM_SHA256}: not the pinned source")
        src_root = root / f"llama_cpp_python-{UPSTREAM_VERSION}"
        if not src_root.is_dir():
            subprocess.run(["tar", "xzf", str(sdist), "-C", str(root)], check=True)
        src = src_root / "vendor" / "llama.cpp"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        jobs = jobs or os.cpu_count() or 1
        print(f"kvarn: building llama.cpp ({', '.join(TARGETS)}) from {src} into {build}, {jobs} jobs "
              "(once per machine; a few minutes)", file=log)
        with open(root / "build.log", "w") as blog:
            subprocess.run(["cmake", "-S", str(src), "-B", str(build), *gen, *UPSTREAM_CMAKE], check=True,
                           stdout=blog, stderr=subprocess.STDOUT)
            subprocess.run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(jobs)], check=True,
                           stdout=blog, stderr=subprocess.STDOUT)
        (build / PROVENANCE).write_text(json.dumps({
            "source": f"{UPSTREAM_PACKAGE}=={UPSTREAM_VERSION} sdist, vendor/llama.cpp", "sdist_sha256": digest,
            "cmake": UPSTREAM_CMAKE, "targets": list(TARGETS), "build_s": round(time.time() - t0, 1)}, indent=1) + "\n")
        print(f"kvarn: llama.cpp built in {time.time() - t0:.0f} s", file=log)
    return build


@dataclass(frozen=True)
class Build:
    """A llama.cpp build folder read once: its programs, its identity and what it accepts."""

    dir: Path
    source: Path
    version: str  # its --version line, e.g. "version: 7016 (ba27edad2)" or "version: 0.5.0-dev (build 1, commit 0c1e570)"
    commit: str
    backend: str  # "CPU (native)", "CUDA (sm_86)", ...
    provenance: dict
    libraries: dict  # file name -> sha256
    cache_types: tuple[str, ...]  # the -ctk values its --help accepts
    options: frozenset = field(default_factory=frozenset)  # the long options its --help lists

    @property
    def perplexity(self) -> Path:
        return self.dir / "bin" / "llama-perplexity"

    @property
    def bench(self) -> Path | None:
        p = self.dir / "bin" / "llama-bench"
        return p if p.is_file() else None

    def identity(self) -> dict:
        """What every baseline and cell of this build records and compares (with the run's settings)."""
        return {"version": self.version, "commit": self.commit, "backend": self.backend,
                "provenance": self.provenance.get("source"), "libraries": self.libraries}

    def has_option(self, opt: str) -> bool:
        return opt in self.options


def _cmake_cache(build: Path) -> dict:
    cache = build / "CMakeCache.txt"
    if not build.exists():
        raise BuildError(f"{build}: no such folder; give a llama.cpp build folder (the one cmake -B made) or "
                         f"'{UPSTREAM}'")
    if not build.is_dir():
        raise BuildError(f"{build} is a file, not a llama.cpp build folder; give the folder cmake -B made or "
                         f"'{UPSTREAM}'")
    if not cache.is_file():
        raise BuildError(f"{build} is not a llama.cpp build folder: no CMakeCache.txt (configure it with cmake "
                         f"-B {build} and build llama-perplexity)")
    out = {}
    for line in cache.read_text(errors="replace").splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+):[A-Z]+=(.*)$", line)
        if m:
            out[m[1]] = m[2]
    return out


def backend_of(cache: dict) -> str:
    """The backend a build's CMakeCache entries describe: "CUDA (<architectures>)", another GGML_<NAME>, or CPU."""
    on = lambda k: cache.get(k, "OFF").upper() in ("ON", "1", "TRUE", "YES")  # noqa: E731
    if on("GGML_CUDA"):
        return f"CUDA ({cache.get('CMAKE_CUDA_ARCHITECTURES', 'default architectures')})"
    for name in ("GGML_VULKAN", "GGML_METAL", "GGML_HIP", "GGML_SYCL"):
        if on(name):
            return name.removeprefix("GGML_")
    return "CPU (native)" if on("GGML_NATIVE") else "CPU"


_BUILDS: dict = {}


def read_build(path: str | os.PathLike) -> Build:
    """The build at `path` (or `upstream`: the pinned upstream build, built now if it is not yet);
    refused by name when its identity cannot be read."""
    if str(path) == UPSTREAM:
        path = build_upstream()
    d = Path(path).expanduser().resolve()
    exe = d / "bin" / "llama-perplexity"
    key = (d, exe.stat().st_mtime_ns if exe.exists() else 0)
    if key in _BUILDS:
        return _BUILDS[key]
    cache = _cmake_cache(d)
    if not exe.is_file():
        raise BuildError(f"{d}: no bin/llama-perplexity; build it: cmake --build {d} --target llama-perplexity")
    named = cache.get("CMAKE_HOME_DIRECTORY") or cache.get("llama.cpp_SOURCE_DIR")
    if not named:  # an empty path would be this process's folder
        raise BuildError(f"{d}: its CMakeCache.txt names no source folder (CMAKE_HOME_DIRECTORY or "
                         "llama.cpp_SOURCE_DIR); kvarn compiles its harness against the build's own source")
    source = Path(named)
    if not (source / "include" / "llama.h").is_file():
        raise BuildError(f"{d}: its source folder {source} (CMAKE_HOME_DIRECTORY) has no include/llama.h; "
                         "kvarn compiles its harness against the build's own source")
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    text = r.stdout + r.stderr
    m = re.search(r"^version: .*?(?:\(|commit )([0-9a-fA-F]{6,}|unknown)\)\s*$", text, re.M)
    if r.returncode != 0 or m is None:
        raise BuildError(f"{exe} --version did not print its version (rc {r.returncode}): {text.strip()[:300]!r}")
    provenance = {}
    if (d / PROVENANCE).is_file():
        provenance = json.loads((d / PROVENANCE).read_text())
    if m[1] == "unknown" and not provenance:
        raise BuildError(f"{exe} --version names no commit ({m[0]!r}) and kvarn did not build it: its identity "
                         "cannot be read; build it from a git checkout")
    libs = {p.name: uncached_sha256(p) for p in sorted((d / "bin").glob("lib*.so*"))
            if p.is_file() and not p.is_symlink()}
    libs = libs or {exe.name: uncached_sha256(exe)}  # a static build: the program holds the library
    h = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    help_text = h.stdout + h.stderr
    # one line upstream; wrapped over several lines (each but the last ending in a comma) in BeeLlama's help
    types = re.search(r"--cache-type-k TYPE.*?allowed values: ((?:[^\n(]*,[ \t]*\n[ \t]*)*[^\n(]+)", help_text, re.S)
    if types is None:
        raise BuildError(f"{exe} --help lists no allowed values for --cache-type-k: not a llama-perplexity kvarn reads")
    cache_types = tuple(t.strip() for t in types[1].split(",") if t.strip())
    options = frozenset(re.findall(r"(--[a-z0-9][a-z0-9-]+)", help_text))
    b = Build(d, source, m[0], m[1], backend_of(cache), provenance, libs, cache_types, options)
    _BUILDS[key] = b
    return b


def _lib_dirs(build: Build) -> list[Path]:
    return sorted({p.parent for p in build.dir.rglob("lib*.so*")} | {build.dir / "bin"})


def harness(build: Build, log=sys.stderr) -> Path:
    """kvarn_kld.cpp compiled against `build` (once per source hash, in the build folder)."""
    src = HARNESS_SRC.read_bytes()
    tag = hashlib.sha256(src + str(build.dir).encode()).hexdigest()[:12]
    exe = build.dir / "kvarn" / f"kvarn-kld-{tag}"
    if exe.is_file():
        return exe
    common = [p for p in build.dir.rglob("lib*common.*") if re.fullmatch(r"lib(llama-)?common\.(a|so)", p.name)]
    if not common:
        raise BuildError(f"{build.dir}: no libcommon / libllama-common library (build the llama-perplexity target)")
    static = [p for p in common if p.suffix == ".a"][:1] + [p for p in build.dir.glob("vendor/**/*.a")]
    inc = [build.source / "include", build.source / "common", build.source / "ggml" / "include", build.source / "vendor",
           build.source / "tools" / "mtmd"]
    lib_dirs = _lib_dirs(build)
    libs = sorted({re.sub(r"^lib|\.so.*$", "", p.name) for d in lib_dirs for p in d.glob("lib*.so")
                   if not p.name.endswith("-impl.so")})  # a tool's own code (llama-perplexity-impl) is not linked
    with _locked(build.dir / "kvarn" / ".lock"):
        if exe.is_file():
            return exe
        tmp = exe.with_name(exe.name + f".tmp{os.getpid()}")
        cmd = [shutil.which("c++") or "g++", "-std=c++20", "-O2", "-o", str(tmp), str(HARNESS_SRC),
               *(f"-I{p}" for p in inc if p.is_dir()), *map(str, static),
               *(f"-L{d}" for d in lib_dirs), *(f"-l{x}" for x in libs),
               *(f"-Wl,-rpath,{d}" for d in lib_dirs), "-lpthread", "-ldl"]
        print(f"kvarn: compiling the harness against {build.dir}", file=log)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"compiling {HARNESS_SRC.name} against {build.dir} failed:\n{r.stderr[-3000:]}")
        os.replace(tmp, exe)
    return exe


def plan_identity(configured: str | None) -> dict:
    """The build's identity as planning sees it (a workflow param: a changed build reruns its cells),
    without building anything: {"unavailable": why} when the build is not there (yet); a job
    given that refuses to run (`require`)."""
    try:
        path = build_path(configured)
        if path == UPSTREAM and not (cache_dir() / f"upstream-{UPSTREAM_VERSION}" / "build" / PROVENANCE).is_file():
            raise BuildError(f"the pinned upstream build is not built yet: python -m kvarn.llamacpp_engine.build "
                             f"(into {cache_dir()})")
        return read_build(path).identity()
    except (BuildError, OSError, subprocess.SubprocessError) as e:
        return {"unavailable": str(e)}


def require(planned: dict, b: Build) -> None:
    """Refuse a job whose DAG was planned without the build, or with another build at the same path."""
    if "unavailable" in planned:
        raise BuildError(f"the llama.cpp build was not available when this run was planned ({planned['unavailable']}); "
                         "build it, then run snakemake again")
    if planned != b.identity():
        raise BuildError(f"the llama.cpp build at {b.dir} changed since this run was planned ({planned.get('version')} "
                         f"-> {b.version}); run snakemake again")


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvarn.llamacpp_engine.build",
                                 description="Build the pinned upstream llama.cpp for this CPU (once per machine, "
                                             f"into ${CACHE_ENV} or ~/.cache/kvarn/llamacpp), or read a build's "
                                             "identity, and compile kvarn's harness against it.")
    ap.add_argument("build", nargs="?", default=UPSTREAM, help=f"a llama.cpp build folder, or '{UPSTREAM}' (default)")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")
    a = ap.parse_args(argv)
    if a.build == UPSTREAM:
        t0 = time.time()
        build_upstream(jobs=a.jobs)
        print(f"kvarn: upstream llama.cpp ready ({time.time() - t0:.0f} s)", file=sys.stderr)
    try:
        b = read_build(a.build)
        exe = harness(b)
    except BuildError as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    print(json.dumps({"dir": str(b.dir), **b.identity(), "cache_types": list(b.cache_types), "harness": str(exe)},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
