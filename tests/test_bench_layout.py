"""bench/ as a package: no script edits sys.path and no test loads a bench file by its path; its
paths from the environment (bench/__init__.py): wiki.test.raw from $TEXT or the README's layout,
and a required variable that is missing stops with its name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO, WIKI_TEXT

from bench import env_path


def _text(env: dict) -> Path:
    code = "import bench; print(bench.TEXT)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def test_text_from_the_environment_else_beside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TEXT"}
    env["PYTHONPATH"] = str(REPO)
    assert _text(env).resolve() == WIKI_TEXT  # the tests' own copy of the layout
    assert _text({**env, "TEXT": str(tmp_path / "w.raw")}) == tmp_path / "w.raw"


def test_a_missing_variable_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("BEELLAMA_BUILD", str(tmp_path))
    assert env_path("BEELLAMA_BUILD", "a build") == tmp_path
    for unset in (None, ""):
        if unset is None:
            monkeypatch.delenv("BEELLAMA_BUILD")
        else:
            monkeypatch.setenv("BEELLAMA_BUILD", unset)
        with pytest.raises(SystemExit, match=r"BEELLAMA_BUILD is not set: it names BeeLlama's build"):
            env_path("BEELLAMA_BUILD", "BeeLlama's build")


def _hits(files, needle):
    return [f"{p.relative_to(REPO)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if needle in line]


def test_bench_is_imported_as_a_package():
    """bench/ imports its shared code as `bench.…` (no sys.path edits), and tests import bench
    the same way (none loads a file by its path through importlib)."""
    assert _hits(sorted((REPO / "bench").rglob("*.py")), "sys." + "path") == []
    assert _hits(sorted((REPO / "tests").glob("*.py")), "spec_from_file_" + "location") == []
    for d in {p.parent for p in (REPO / "bench").rglob("*.py")}:
        assert (d / "__init__.py").is_file(), d  # every folder of scripts is a package
