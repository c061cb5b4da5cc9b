"""Faults a user causes on the command line, each refused or shown clearly (issue 41): two runs
into one output folder, a tail the format rounds, the help texts. (A context beyond the model's:
tests/test_preflight.py; a bad matrix value and a checkout that edits the scripts:
tests/test_workflow.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvarn import cli
from kvarn.cli.parser import build_parser
from kvarn.files import outlock

HOLD = """
import sys, time
from kvarn.files.outlock import hold_output
with hold_output(sys.argv[1], ["kvarn", "run", "--k", "q4_0", "-o", sys.argv[1]]):
    print("held", flush=True)
    time.sleep(60)
"""


def _tiny(tmp_path) -> str:
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 300, "hidden_size": 256, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 4096}))
    return f"random:{cfg}"


def _run_argv(tmp_path, out, k="q8_0", *more):
    base = tmp_path / "base.kvd"
    base.touch()
    return ["run", "-m", _tiny(tmp_path), "-c", "1024", "--k", k, "--v", k, "--baseline", str(base), "-o", str(out),
            *more]


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of tmp_path/cell while it runs (killed at the end)."""
    out = tmp_path / "cell"
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    yield out, p
    p.kill()
    p.wait()


def test_a_second_run_into_a_folder_being_written_is_refused_naming_the_first(tmp_path, holder, monkeypatch, capsys):
    from kvarn.run import torch_engine

    out, p = holder
    monkeypatch.setattr(torch_engine, "run_cell", lambda *a, **k: pytest.fail("the second run started"))
    with pytest.raises(SystemExit) as e:
        cli.main(_run_argv(tmp_path, out))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert f"{out} is being written by another run (pid {p.pid}: kvarn run --k q4_0 -o {out})" in err, err
    # The holder gone (killed: the kernel drops its lock), the folder is free again.
    p.kill()
    p.wait()
    with outlock.hold_output(out, ["kvarn", "run"]) as lock:
        assert lock.read_text().startswith("pid ")


def test_a_run_holds_its_folder_while_it_writes(tmp_path, monkeypatch, capsys):
    """During the engine's write the folder's lock is held (by this run, named), and released after."""
    from kvarn.run import torch_engine

    out = tmp_path / "cell"
    seen = {}

    class Stop(Exception):
        pass

    def run_cell(spec, n_ctx, chunks, cell, baseline, out_dir, **kw):
        seen["holder"] = (out_dir / outlock.LOCK_NAME).read_text()
        with pytest.raises(outlock.OutputBusy, match="being written by another run"):
            with outlock.hold_output(out_dir):
                pass
        (out_dir / "summary.json").write_text("{}")
        raise Stop

    monkeypatch.setattr(torch_engine, "run_cell", run_cell)
    with pytest.raises(Stop):
        cli.main(_run_argv(tmp_path, out))
    assert seen["holder"].startswith("pid ") and " kvarn run -m " in seen["holder"]
    with outlock.hold_output(out):  # released
        pass


def test_a_refused_run_leaves_no_folder(tmp_path, monkeypatch):
    from kvarn.run import torch_engine

    def refuse(*a, **k):
        raise ValueError("dump is truncated")

    monkeypatch.setattr(torch_engine, "run_cell", refuse)
    with pytest.raises(SystemExit):
        cli.main(_run_argv(tmp_path, tmp_path / "cell"))
    assert not (tmp_path / "cell").exists()


def test_a_tail_the_format_rounds_runs_and_prints_as_the_tail_it_runs_at(tmp_path, monkeypatch, capsys):
    from kvarn.run import torch_engine

    assert cli.main(_run_argv(tmp_path, tmp_path / "c", "kvarn4", "--tail", "500", "--dry-run")) == 0
    out = capsys.readouterr().out
    assert "run kvarn4-kvarn4-t512: tail 500 requested, runs at tail 512" in out, out
    assert cli.main(_run_argv(tmp_path, tmp_path / "c", "kvarn4", "--dry-run")) == 0
    assert "run kvarn4-kvarn4-t0: tail 0 requested, runs at tail 128 on full-attention layers (printed 128*)" \
        in capsys.readouterr().out
    assert cli.main(_run_argv(tmp_path, tmp_path / "c", "q4_0", "--tail", "500", "--dry-run")) == 0
    assert "run q4_0-q4_0-t500: tail 500 requested, runs at tail 500" in capsys.readouterr().out

    got = {}

    class Stop(Exception):
        pass

    def run_cell(spec, n_ctx, chunks, cell, *a, **k):
        got["cell"] = cell
        raise Stop

    monkeypatch.setattr(torch_engine, "run_cell", run_cell)
    with pytest.raises(Stop):
        cli.main(_run_argv(tmp_path, tmp_path / "c", "kvarn4", "--tail", "500"))
    assert got["cell"].tail == 512 and got["cell"].name == "kvarn4-kvarn4-t512"


def test_help_examples_continue_their_lines_and_fetch_has_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    lines = capsys.readouterr().out.split("examples")[1].splitlines()
    for cmd in ("kvarn run ", "kvarn memory ", "kvarn decode "):
        i = next(i for i, line in enumerate(lines) if line.lstrip().startswith(cmd))
        assert lines[i].endswith(" \\") and lines[i + 1].startswith("      --"), lines[i : i + 2]
    # every line of an example followed by one of its flags ends in a continuation
    for a, b in zip(lines, lines[1:]):
        if b.startswith("      --"):
            assert a.endswith(" \\"), (a, b)
    fetch = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "fetch")[1]
    assert fetch.description
    for action in fetch._actions:
        assert action.help, action.option_strings
