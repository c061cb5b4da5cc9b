"""The package's structure: its layers (import-linter contracts in pyproject.toml), no private
name used across modules, and the modules that claim to be torch-free staying so at run time."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from blocked_imports import blocked_env

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _no_torch_env(tmp_path: Path) -> dict:
    """A process in which torch, transformers and triton are not installed, as far as imports can tell."""
    return blocked_env(tmp_path, ("torch", "transformers", "triton"), "this process must stay torch-free",
                       OMP_NUM_THREADS="1")


def test_import_contracts_hold():
    """`lint-imports`: the layers of pyproject.toml (no cycle, no upward import, function-level
    imports included) and the torch-free contract."""
    p = subprocess.run([str(BIN / "lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout, p.stdout


def _private_uses(path: Path, kvarn_modules: set[str]) -> list[str]:
    """`from kvarn.x import _name` and `<kvarn module>._name` in one file."""
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    aliases: dict[str, str] = {}  # local name -> kvarn module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "kvarn":
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "kvarn"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kvarn":
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{where}:{node.lineno}: from {node.module} import {a.name}")
                elif f"{node.module}.{a.name}" in kvarn_modules:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            # a chain of names ending in a kvarn module: kvarn.run.torch_engine._x, torch_engine._x, kattn._x
            chain, v = [], node.value
            while isinstance(v, ast.Attribute):
                chain.append(v.attr)
                v = v.value
            if isinstance(v, ast.Name) and v.id in aliases:
                mod = ".".join([aliases[v.id], *reversed(chain)]) if chain else aliases[v.id]
                if mod in kvarn_modules:
                    found.append(f"{where}:{node.lineno}: {mod}.{node.attr}")
    return found


# Known and left for now: KVarN's normalization (kvarn/formats/kvarn_tiles.py) is being changed in
# parallel; its `_log_update` is made public with that change, and this entry removed.
ALLOWED = {"kvarn.formats.kvarn_tiles._log_update"}


def test_no_private_name_is_used_across_modules():
    """A module's `_names` are its own: no other module, bench script, workflow script or test
    reaches them (a name another module needs is public, with a docstring)."""
    pkg = ROOT / "kvarn"
    kvarn_modules = {"kvarn"} | {
        "kvarn." + ".".join(p.relative_to(pkg).with_suffix("").parts).removesuffix(".__init__")
        for p in pkg.rglob("*.py")}
    files = [p for d in ("kvarn", "bench", "tests", "workflow") for p in (ROOT / d).rglob("*.py")]
    found = [hit for p in files for hit in _private_uses(p, kvarn_modules)
             if hit.rsplit(": ", 1)[1] not in ALLOWED]
    assert found == [], "\n".join(found)


def test_private_use_is_seen(tmp_path):
    """The scan above finds each form it looks for (so an empty result means something)."""
    mods = {"kvarn", "kvarn.run.torch_engine", "kvarn.kvcache.attention"}
    f = tmp_path / "probe.py"
    f.write_text("import kvarn.kvcache.attention as kattn\nfrom kvarn.run import torch_engine\n"
                 "from kvarn.run.torch_engine import _x\n"
                 "import kvarn\nkattn._a\ntorch_engine._b\nkvarn.run.torch_engine._c\ntorch_engine.ok\n")
    assert [h.split(": ", 1)[1] for h in _private_uses(f, mods)] == [
        "from kvarn.run.torch_engine import _x", "kvarn.kvcache.attention._a", "kvarn.run.torch_engine._b", "kvarn.run.torch_engine._c"]


def test_torch_free_modules_run_without_torch(tmp_path):
    """What claims to be torch-free works where torch cannot be imported: the type facts, the
    memory accounting, the run options, the matrix expanded from config/matrix.yaml, the
    generation plan of config/generation.yaml, the worker's client side and the report's
    workflow lists."""
    code = textwrap.dedent('''
        import json, yaml
        from kvarn.budget import memory
        from kvarn.plan import allocations, generation, matrix, paths, rows
        from kvarn.run import worker
        from kvarn.vocab import facts, options
        from kvarn.report import workflow
        m = matrix.expand(yaml.safe_load(open("config/matrix.yaml")))
        g = generation.targets(matrix.expand(yaml.safe_load(open("config/generation.yaml"))))
        geo = json.load(open("config/models/qwen3.6-27b.json"))
        options.check_compute("llamacpp-cpu", "q8_0", "q8_0", 0)
        out = {"cells": len(m.cells), "generation": len(g), "kvarn4_bits": facts.get("kvarn4").bits_per_value(128),
               "label": facts.tail_label("kvarn4", "kvarn4", 0), "accountings": sorted(memory.ACCOUNTINGS),
               "torch": [k for k in __import__("sys").modules if k.split(".")[0] in ("torch", "transformers")]}
        print(json.dumps(out))
    ''')
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=_no_torch_env(tmp_path))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["cells"] > 0 and out["generation"] > 0 and out["torch"] == []
    assert out["label"] == "128*" and out["kvarn4_bits"] == 4.375  # (2048*4 + 768) * 8 / (128 * 128)


def test_blocked_torch_is_really_blocked(tmp_path):
    """The harness itself: in that process `import torch` fails."""
    p = subprocess.run([sys.executable, "-c", "import torch"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=_no_torch_env(tmp_path))
    assert p.returncode != 0 and "blocked" in p.stderr, p.stderr


def test_snakefile_parses_without_torch(tmp_path):
    """`snakemake -n` of the default matrix (every Snakemake invocation parses the Snakefile
    and plans from matrix.expand) in a process where torch cannot be imported."""
    p = subprocess.run([str(BIN / "snakemake"), "-n", "--cores", "1", "--directory", str(ROOT)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=_no_torch_env(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
