"""config/article.yaml reproduces the study as it ran: every MiB the study prints comes out of
the planned cells (kvarn.budget.memory at config/models/*.json, no weights), the precision-tail sweep
is planned for every symmetric width, and its README/config command plans as written."""

import contextlib
import json
from pathlib import Path

import polars as pl
import pytest
import yaml

from kvarn.plan import matrix as kvm
from kvarn.vocab.cell import compute_suffix
from kvarn.vocab.geometry import geometry_from_config
from kvarn.budget.memory import MIB, kv_bytes
from kvarn.report.claims.study import load_study

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
        # the pair at its tail, no option but the run's compute path (tf32-attn: the bytes do not depend on it)
        cells = {f"{c.k}-{c.v} t{c.tail}": c for c in m.cells if c.model == model
                 and c.opts == compute_suffix(c.compute)}
        for key, mib in figures.items():
            assert key in cells, f"{model}: the study's {key} ({mib} MiB) is not planned"
            c = cells[key]
            b = kv_bytes(geom, c.n_ctx, c.spec, ubatch=spec.ubatch, accounting=spec.memory_accounting)
            assert f"{b.total / MIB:.2f}" == f"{mib:.2f}", (model, key)
            checked += 1
    assert checked == 18


def test_tail_sweep_for_every_symmetric_width_of_both_families():
    m = planned()
    for model in m.models:
        have = {(c.k, c.tail) for c in m.cells if c.model == model and c.k == c.v
                and c.opts == compute_suffix(c.compute)}
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


# ---------------------------------------------------------------- the article's DAG at toy scale

TOY_CELLS = [{"types": ["q8_0", "q4_0"], "tail": 128}, {"types": ["kvarn4"], "tail": 0}]


def toy_model_config(name: str) -> dict:
    """The study model's config.json shrunk to a tiny model of the same layer pattern (Qwen 3.6:
    3 Gated DeltaNet + 1 full attention; Gemma 4: 5 sliding + 1 full with its own head dim and
    K = V), vocabulary 256 for the byte tokenizer of `random:` sources."""
    c = json.loads((ROOT / "config" / "models" / f"{name}.json").read_text())
    c.update(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
             head_dim=64, max_position_embeddings=4096, bos_token_id=None, eos_token_id=0, pad_token_id=None)
    if c["model_type"].startswith("qwen"):
        c.update(num_hidden_layers=4, layer_types=c["layer_types"][:4], linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=1, linear_num_value_heads=2)
    else:
        c.update(num_hidden_layers=6, layer_types=c["layer_types"][:6], global_head_dim=128,
                 num_global_key_value_heads=1, sliding_window=64, vocab_size_per_layer_input=256)
    return c


def _worker_events(directory: Path) -> dict[str, dict]:
    """Per worker log: the model it served, when it loaded, when it was released (None: not)."""
    import re

    out = {}
    for log in directory.glob("*.log"):
        text = log.read_text()
        first = re.search(r"^kvarn worker pid \d+ on \S+: (\{.*\})$", text, flags=re.M)
        loaded = re.findall(r"^loaded (\S+) .* at ([\d.]+)$", text, flags=re.M)
        released = re.findall(r"^released for another worker at ([\d.]+)", text, flags=re.M)
        refused = re.findall(r"^preflight refused the load .* released workers \[([\d, ]+)\]", text, flags=re.M)
        out[log.name] = {"model": json.loads(first[1])["name"] if first else None,
                         "loaded": float(loaded[0][1]) if loaded else None,
                         "released": float(released[0]) if released else None, "refused": refused}
    return out


@pytest.mark.slow
def test_article_dag_at_toy_scale_one_model_on_the_device_at_a_time(tmp_path):
    """config/article.yaml with both study models replaced by tiny random models of their layer
    pattern (n_ctx 256, one chunk, a cut-down cell list), through every rule to claims.md and
    report.html, with the worker on and KVARN_DEVICE_MEMORY fitting one model's load but not
    two: the other model's first job starts only after the first model's worker released the
    device (kvarn.run.worker.release_others)."""
    import os
    import shutil
    import subprocess
    import sys

    from kvarn.run import worker
    from kvarn.vocab.geometry import geometry_from_config as geom_of
    from kvarn.budget.preflight import estimate
    from paths import WIKI_TEXT

    wd = tmp_path / "wf"
    wd.mkdir()
    shutil.copy(ROOT / "Snakefile", wd)
    for d in ("workflow", "config", "envs"):
        shutil.copytree(ROOT / d, wd / d)
    cfg = {**ARTICLE, "text": str(WIKI_TEXT), "model_cache": str(tmp_path / "models"), "cells": TOY_CELLS}
    cfg["report"] = {"boot": 200}
    loads = []
    for m in cfg["models"]:
        toy = wd / "config" / "models" / f"toy-{m['name']}.json"
        toy.write_text(json.dumps(toy_model_config(m["name"]), indent=1))
        m.update(source=f"random:config/models/toy-{m['name']}.json", revision=None, n_ctx=[256], chunks=1,
                 dtype="float32")
        from transformers import AutoConfig

        c = json.loads(toy.read_text())
        conf = AutoConfig.for_model(c.pop("model_type"), **c)
        loads.append(estimate(conf, 256, m["ubatch"], "float32", "cpu", baseline=True).host_bytes)
        assert geom_of(json.loads(toy.read_text())).describe()  # the pattern is read as the study's
    memory = max(loads) + min(loads) // 2  # one model's load fits, two do not
    assert max(loads) <= memory < sum(loads)
    (wd / "config" / "matrix.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    workers = wd / ".snakemake" / "kvarn-workers"
    # A worker idles until released (the finally below releases the last): with the first model's
    # jobs prioritized, the other model's first job may come long after the first model's last
    # one (report jobs hold the cores), and a worker that had exited on idle would leave the
    # release path untaken (asserted below).
    env = {**os.environ, "KVARN_WORKER": "1", "KVARN_WORKER_IDLE": "3000", "KVARN_DEVICE_MEMORY": str(memory),
           "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "snakemake", "--directory", str(wd), "--snakefile", str(wd / "Snakefile"),
            "--workflow-profile", "none"]
    # The first model's cells first (--prioritize): the device changes hands once. Left to itself
    # the scheduler interleaved the two models' jobs (five worker loads for two models), and each
    # change of model is a released worker and a new one spawned and loaded.
    first = [f"{c.dir}/summary.json" for c in kvm.expand(cfg).cells if c.model == cfg["models"][0]["name"]]
    try:
        run = subprocess.run([*base, "--cores", "2", "--resources", "gpu=1", "--prioritize", *first], env=env,
                             capture_output=True, text=True, timeout=1500)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
        rep = subprocess.run([*base, "--report", "report.html"], env=env, capture_output=True, text=True, timeout=600)
        assert rep.returncode == 0, rep.stderr[-3000:]
    finally:
        # No worker of ours outlives the test. Its sockets are bound relative to the workflow
        # directory (kvarn.run.worker.socket_path): pytest's tmp_path can make the absolute path
        # longer than an AF_UNIX address holds, so connect from there.
        with contextlib.chdir(wd):
            worker.release_others(None, workers.relative_to(wd))
    summary_df = pl.read_parquet(wd / "results" / "summary.parquet")
    assert summary_df.height == len(kvm.expand(cfg).cells) == 6
    assert set(summary_df["memory_accounting"]) == {"beellama-qwen", "beellama-gemma"}
    claims = (wd / "results" / "claims.md").read_text()
    assert "## qwen3.6-27b (read against the study's qwen3.6-27b)" in claims
    assert "## gemma4-31b (read against the study's gemma4-31b)" in claims
    assert (wd / "report.html").stat().st_size > 0
    # Every table and figure the report rules declare was built, for both models.
    from kvarn.report import workflow as kvr

    targets = kvr.targets([m["name"] for m in cfg["models"]])
    assert "results/figures/gemma4-31b/pareto.svg" in targets and "results/claims.html" in targets
    for target in targets:
        assert (wd / target).exists(), target
    # one model on the device at a time: the second model's worker was refused, released the
    # first model's idle worker, and loaded after that worker had exited
    events = [e for e in _worker_events(workers).values() if e["loaded"] is not None]
    assert {e["model"] for e in events} == {"qwen3.6-27b", "gemma4-31b"}
    assert any(e["refused"] for e in events)  # the device changed hands through a release
    events.sort(key=lambda e: e["loaded"])
    for first, second in zip(events, events[1:]):
        if first["model"] != second["model"]:
            assert first["released"] is not None and first["released"] < second["loaded"], events
            assert second["refused"], events
