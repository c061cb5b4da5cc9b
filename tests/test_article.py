"""config/article.yaml reproduces the study as it ran: every MiB the study prints comes out of
the planned cells (kvarn.memory at config/models/*.json, no weights), the precision-tail sweep
is planned for every symmetric width, and its README/config command plans as written."""

import json
from pathlib import Path

import yaml

from kvarn import matrix as kvm
from kvarn.geometry import geometry_from_config
from kvarn.memory import MIB, kv_bytes
from kvarn.report.claims import load_study

ROOT = Path(__file__).resolve().parents[1]
ARTICLE = yaml.safe_load((ROOT / "config" / "article.yaml").read_text())
STUDY = load_study()


def planned():
    return kvm.expand(ARTICLE)


def test_every_study_mib_comes_out_of_the_planned_cells():
    m = planned()
    checked = 0
    for model, figures in STUDY["figures"]["memory"].items():
        if model in ("section", "quoted"):
            continue
        spec = m.models[model]
        assert spec.memory_accounting == STUDY["models"][model]["memory_accounting"]
        geom = geometry_from_config(json.loads((ROOT / "config" / "models" / f"{model}.json").read_text()))
        cells = {f"{c.k}-{c.v} t{c.tail}": c for c in m.cells if c.model == model and c.compute == "exact"
                 and not c.opts}
        for key, mib in figures.items():
            assert key in cells, f"{model}: the study's {key} ({mib} MiB) is not planned"
            c = cells[key]
            b = kv_bytes(geom, c.n_ctx, c.k, c.v, c.tail, ubatch=spec.ubatch, accounting=spec.memory_accounting)
            assert f"{b.total / MIB:.2f}" == f"{mib:.2f}", (model, key)
            checked += 1
    assert checked == 18


def test_tail_sweep_for_every_symmetric_width_of_both_families():
    m = planned()
    for model in m.models:
        have = {(c.k, c.tail) for c in m.cells if c.model == model and c.k == c.v and not c.opts}
        for w in (2, 3, 4, 5, 6, 8):
            for t in (0, 128, 512, 1024):
                assert (f"q{w}_0", t) in have, (model, w, t)
            for t in (0, 512, 1024):  # KVarN's request 0 is its effective 128 (128*)
                assert (f"kvarn{w}", t) in have, (model, w, t)


def test_the_article_command_plans_as_written():
    """Every article command of the config header and the README names allow_unpinned (without it
    fetch_model refuses the unpinned models), and the header's dry run plans every cell and the
    claims ledger as written: `--config allow_unpinned=true` reaches the workflow as a string,
    which the Snakefile reads as the boolean."""
    import shlex
    import subprocess
    import sys

    cmds = []
    for f in ("config/article.yaml", "README.md"):
        lines = [ln.strip("#` ").strip() for ln in (ROOT / f).read_text().splitlines()
                 if "snakemake" in ln and "--configfile config/article.yaml" in ln]
        assert lines, f
        cmds += lines
    assert all("--config allow_unpinned=true" in c for c in cmds), cmds
    dry = next(c for c in cmds if c.split()[:2] == ["snakemake", "-n"])
    snakemake = str(Path(sys.executable).parent / "snakemake")
    done = subprocess.run([snakemake, *shlex.split(dry)[1:], "--quiet", "rules"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = dict(ln.split() for ln in done.stdout.splitlines() if len(ln.split()) == 2 and ln.split()[1].isdigit())
    assert counts["cell"] == str(len(planned().cells)) and counts["claims"] == "1"
