"""A build path that is not a build is refused naming the path and what is accepted, by the library
and by `python -m kvarn.llamacpp_engine.build` (an exit status 2 and one line, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvarn.llamacpp_engine import build as pbuild


@pytest.mark.parametrize("kind, text", [
    ("missing", "{p}: no such folder; give a llama.cpp build folder (the one cmake -B made) or 'upstream'"),
    ("file", "{p} is a file, not a llama.cpp build folder; give the folder cmake -B made or 'upstream'"),
    ("empty", "{p} is not a llama.cpp build folder: no CMakeCache.txt (configure it with cmake -B {p} and build "
              "llama-perplexity)"),
])
def test_a_path_that_is_not_a_build_is_refused_by_name(tmp_path, kind, text):
    p = tmp_path / "b"
    if kind == "file":
        p.write_text("x")
    elif kind == "empty":
        p.mkdir()
    with pytest.raises(pbuild.BuildError) as e:
        pbuild.read_build(p)
    assert str(e.value) == text.format(p=p.resolve())
    done = subprocess.run([sys.executable, "-m", "kvarn.llamacpp_engine.build", str(p)], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"python -m kvarn.llamacpp_engine.build: error: {text.format(p=p.resolve())}"
