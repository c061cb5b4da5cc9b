"""The device call's carry and its import check (issue 54, item 2): bench/gpu/prepare.sh lists
transformers' whole import closure at the versions this environment runs (transformers 5.x checks
tokenizers, huggingface-hub, safetensors, regex, ... at import), the device run's import check
stops the run at once with the versions it found, and device_run.sh keeps the whole call inside
its TOTAL_S."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from paths import WIKI_TEXT

from bench.gpu import device_run as dr

ROOT = Path(__file__).resolve().parents[1]
PREPARE = ROOT / "bench" / "gpu" / "prepare.sh"
# What transformers checks at import (transformers/dependency_versions_check.py) beside python,
# numpy (the image's: its torch is built against it) and accelerate (only where installed).
CHECKED = ("tqdm", "regex", "packaging", "filelock", "tokenizers", "huggingface-hub", "safetensors", "pyyaml")


def _prepare_list() -> dict[str, str]:
    """prepare.sh's `wheels` function, run alone (no download): {name: version}."""
    script = PREPARE.read_text()
    fn = re.search(r"^wheels\(\) \{.*?^\}$", script, flags=re.S | re.M)
    assert fn, "prepare.sh has no wheels() function"
    out = subprocess.run(["bash", "-c", fn.group(0) + "\nwheels"], env={**os.environ, "ROOT": str(ROOT),
                                                                       "PY": sys.executable},
                         capture_output=True, text=True, check=True).stdout.split()
    return dict(item.split("==") for item in out)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_prepare_carries_transformers_import_closure_at_our_versions():
    got = _prepare_list()
    assert got["transformers"] == metadata.version("transformers") and got["gguf"] == metadata.version("gguf")
    for name in CHECKED:
        assert got.get(name) == metadata.version(name), name
    assert not {"numpy", "torch", "triton", "polars"} & set(got)
    device = {"extra": "", "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix"}
    for name in got:  # closed: every requirement of a carried package is carried, or the image's
        for r in metadata.distribution(name).requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate(device):
                assert _norm(req.name) in got or _norm(req.name) in {"numpy", "torch", "triton"}, (name, r)


def _fake_old(site: Path, dist: str, version: str) -> None:
    d = site / f"{dist}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


@pytest.mark.skipif(not WIKI_TEXT.is_file(), reason="wiki.test.raw not available")
def test_an_old_dependency_stops_the_run_at_the_import_check_with_the_versions_found(tmp_path):
    """An image whose tokenizers is 0.20 (transformers 5.24 wants >= 0.23.1): the first line says
    so with every version found, and nothing else runs (exit code 3)."""
    old = tmp_path / "image"
    _fake_old(old, "tokenizers", "0.20.0")
    env = {**os.environ, "PYTHONPATH": f"{old}{os.pathsep}{ROOT}", "OMP_WAIT_POLICY": "PASSIVE"}
    results = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "bench.gpu.device_run", "--smoke", "--results", str(results),
                        "--text", str(WIKI_TEXT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    recs = [json.loads(ln) for ln in (results / "device_run.jsonl").read_text().splitlines()]
    assert len(recs) == 1 and recs[0]["item"] == "machine" and recs[0]["status"] == "error"
    imports = recs[0]["imports"]
    assert imports["ok"] is False
    assert any(x.startswith("transformers: ImportError: tokenizers>=0.23.1") and "found tokenizers==0.20.0" in x
               for x in imports["problems"])
    assert imports["packages"]["tokenizers"]["dist_version"] == "0.20.0"
    assert recs[0]["torch"] == imports["packages"]["torch"]["version"] and recs[0]["torch"]
    assert f'versions found: {{"torch": "{recs[0]["torch"]}"' in p.stderr
    assert f'"tokenizers": "{metadata.version("tokenizers")} (metadata 0.20.0)"' in p.stderr
    md = (results / "device_run.md").read_text()
    assert "Import check (" in md and "**failed**: transformers: ImportError: tokenizers" in md
    assert "Run stopped at the import check." in md


def test_a_carried_package_shadowed_by_the_image_is_a_failure(tmp_path, monkeypatch):
    """The carried site names regex at a version, but `import regex` finds another copy (here the
    environment's): the check says which, and fails."""
    site = tmp_path / "site"
    _fake_old(site, "regex", "1999.1.1")
    monkeypatch.setenv("KVARN_CARRIED_SITE", str(site))
    out = dr.check_imports(smoke=True)
    assert out["ok"] is False and out["carried"] == {"regex": "1999.1.1"}
    assert [p for p in out["problems"] if p.startswith("regex: the carried 1999.1.1 is not the one imported")]
    assert out["packages"]["regex"]["from"] == "image"
    monkeypatch.delenv("KVARN_CARRIED_SITE")
    assert dr.check_imports(smoke=True)["ok"] is True


@pytest.mark.skipif(not (dr.TEXT.is_file() or (ROOT / ".gpu" / "wiki.test.raw").is_file()),
                    reason="wiki.test.raw not available")
def test_device_run_sh_keeps_the_call_inside_total_s(tmp_path):
    """device_run.sh with TOTAL_S=45 gives the Python part 45 - install - 15 s; with the Triton
    tests alone and that little left, the import check runs, the tests are skipped (they need 30 s),
    and the call says its seconds and exit code. No carried wheels here (a checkout of links)."""
    work = tmp_path / "checkout"
    work.mkdir()
    for d in ("bench", "kvarn", "tests", "config"):
        (work / d).symlink_to(ROOT / d)
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a venv's python by its path
    (shim / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "TOTAL_S": "45", "STEPS": "triton",
           "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("BUDGET_S", None)
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "device_run.sh"), str(out)], cwd=work, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    recs = [json.loads(ln) for ln in (out / "device_run.jsonl").read_text().splitlines()]
    first = recs[0]
    assert 25 <= first["budget_s"] <= 30 and first["steps"] == ["triton"] and first["imports"]["ok"] is True
    assert [(r["step"], r["status"]) for r in recs if r.get("status") == "skipped"] == [("triton", "skipped")]
    said = re.search(r"device_run.sh: (\d+) s in all \(limit 45\), exit code 0", p.stdout)
    assert said and int(said[1]) <= 45, p.stdout[-1000:]
