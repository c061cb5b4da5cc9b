"""The llama.cpp engine's self-check (kvarn.llamacpp_engine.runner.self_check) against a fake program.

The fake harness writes one chunk's per-token records; like BeeLlama v0.4.3, it races at more than
one thread only where the cell's exact tail ring (effective tail + 1 slots) is shorter than a ubatch
(docs/notes/beellama-thread-race.md): q4_0 with tail 128 at -ub 512 races, with tail 1024 it does not.
Checked: a cell is refused on its own records, never on another cell's cached pass; every record is
compared exactly; each thing that changes the numbers has its own cache entry; an identical cell
reuses its entry; the refusal names the runs' mean / median / p99 and how far they moved.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvarn.llamacpp_engine import build as pbuild
from kvarn.llamacpp_engine import runner
from kvarn.llamacpp_engine.settings import Settings
from kvarn.vocab import facts
from kvarn.vocab.cell import CellSpec

CTX, UB, TOKENS = 1024, 512, 200


class FakeProgram:
    """Stands in for the compiled harness: counts its runs and writes records that depend on the cell."""

    def __init__(self):
        self.calls = []
        self.nudge = False  # at -t > 1, move one token's KLD by one unit in its last digit

    def __call__(self, b, mode, args, env, records, log):
        opt = dict(zip(args[::2], args[1::2]))
        threads, ubatch = int(opt["-t"]), int(opt["-ub"])
        tail = facts.pair_effective_tail(opt["-ctk"], opt["-ctv"], int(opt.get("--kv-tail-tokens", 0)))
        self.calls.append((threads, tail, dict(env)))
        kld = np.array([0.01 * (1 + i % 7) * (1 + facts.get(opt["-ctk"]).bits / 100) for i in range(TOKENS)])
        if threads > 1 and 0 < tail and tail + 1 < ubatch:  # a slot written twice in one ubatch: run to run
            kld[::10] *= 2 + len(self.calls)
        if threads > 1 and self.nudge:
            kld[5] = np.nextafter(kld[5], np.inf)
        rows = [f"0\t{CTX // 2 + i}\t{float(x)!r}\t2.5\t2.4\t0.001\t1" for i, x in enumerate(kld)]
        records.write_text("\t".join(runner.RECORD_COLUMNS) + "\n" + "\n".join(rows) + "\n")
        log.write_text("fake harness\n")
        return ""


@pytest.fixture
def program(tmp_path, monkeypatch):
    fake = FakeProgram()
    monkeypatch.setattr(runner, "run_harness", fake)
    exe = tmp_path / "build" / "kvarn" / "kvarn-kld-fake"
    exe.parent.mkdir(parents=True)
    exe.write_bytes(b"harness 1")
    monkeypatch.setattr(pbuild, "harness", lambda b, log=None: exe)
    for name in pbuild.NUMERICS_ENV:
        monkeypatch.delenv(name, raising=False)
    fake.build = pbuild.Build(tmp_path / "build", tmp_path, "version: 1 (abc1234)", "abc1234", "CPU", {},
                              {"libllama.so": "0" * 64}, ("f16", "bf16", "q8_0", "q4_0", "kvarn4"),
                              frozenset({"--kv-tail-tokens"}))
    fake.harness, fake.tmp = exe, tmp_path
    return fake


def check(p: FakeProgram, cell: str, settings: Settings = Settings(), threads: int = 2, ubatch: int = UB) -> dict:
    return runner.self_check(p.build, settings, CellSpec.from_name(cell), p.tmp / "m.gguf", "w" * 64, CTX, ubatch,
                             threads, p.tmp / "base.kld", p.tmp / "work" / cell)


def entries(p: FakeProgram) -> list:
    return sorted((p.build.dir / "kvarn" / "selfcheck").glob("*.json"))


def test_a_wide_tail_s_pass_does_not_vouch_for_a_racing_narrow_one(program):
    assert check(program, "q4_0-q4_0-t1024")["ok"]  # 1025 ring slots against a 512-token ubatch: no race
    with pytest.raises(runner.Refused, match=r"^q4_0-q4_0-t128: .*ring, 128 \+ 1 slots, is shorter than the 512"):
        check(program, "q4_0-q4_0-t128")
    assert len(program.calls) == 6 and len(entries(program)) == 2


def test_one_token_s_last_digit_refuses(program):
    program.nudge = True
    with pytest.raises(runner.Refused, match=r"of one chunk's 200 tokens, 1 differ between -t 1 and the first -t 2 "
                                             r"run, 1 between -t 1 and the second, 0 between the two -t 2 runs"):
        check(program, "q8_0-q8_0-t0")
    with pytest.raises(runner.Refused, match=r"-t 2 run 2: mean .*, one token's KLD by up to \d(\.\d+)?e-1\d\. "):
        check(program, "q8_0-q8_0-t0")  # the same refusal, from the cache


@pytest.mark.parametrize("change", ["process env", "settings env", "rotation", "K type", "V type", "tail", "harness",
                                    "threads", "ubatch"])
def test_each_thing_that_changes_the_numbers_has_its_own_entry(program, monkeypatch, change):
    cell, settings, threads, ubatch = "q4_0-q4_0-t1024", Settings(), 2, UB
    check(program, cell)
    if change == "process env":
        monkeypatch.setenv("GGML_KVARN_WINDOW_CHUNK", "4")
    elif change == "settings env":
        settings = Settings(env={"GGML_SCHED_MAX_COPIES": "1"})
    elif change == "harness":
        program.harness.write_bytes(b"harness 2")
    elif change == "threads":
        threads = 4
    elif change == "ubatch":
        ubatch = 256
    else:
        cell = {"rotation": "q4_0-q4_0-t1024-norot", "K type": "q8_0-q4_0-t1024", "V type": "q4_0-q8_0-t1024",
                "tail": "q4_0-q4_0-t2048"}[change]
    assert check(program, cell, settings, threads, ubatch)["ok"]
    assert len(program.calls) == 6 and len(entries(program)) == 2


def test_the_same_cell_reuses_its_entry(program, monkeypatch):
    first = check(program, "q4_0-q4_0-t1024")
    monkeypatch.setenv("KVARN_UNRELATED", "1")  # not a numerics variable
    assert check(program, "q4_0-q4_0-t1024") == first and len(program.calls) == 3
    assert first["key"]["tail_eff"] == 1024 and not first["key"]["tail_ring_short"]
    assert first["differing_tokens"] == {"t1_run1": 0, "t1_run2": 0, "run1_run2": 0}


def test_the_refusal_names_the_runs_and_how_far_they_moved(program):
    with pytest.raises(runner.Refused) as e:
        check(program, "q4_0-q4_0-t128")
    text = str(e.value)
    assert text.startswith(f"q4_0-q4_0-t128: llama.cpp build {program.build.dir} (version: 1 (abc1234)) does not "
                           "write the same per-token records at -t 1 and -t 2")
    assert re.search(r"KLD at -t 1: mean [\d.]+, median [\d.]+, p99 [\d.]+; ", text)
    pct = r"\([-+][\d.e-]+(, [-+][\d.]+ %)?\)"
    move = rf"mean [\d.]+ {pct}, median [\d.]+ {pct}, p99 [\d.]+ {pct}, one token's KLD by up to [\d.e-]+"
    assert re.search(rf"-t 2 run 1: {move}.*; -t 2 run 2: {move}", text)
    assert text.endswith("run this model at one thread (engine.threads: 1); docs/notes/beellama-thread-race.md")
    with pytest.raises(runner.Refused, match="does not write the same per-token records"):
        check(program, "q4_0-q4_0-t128")  # the cached refusal, without a rerun
    assert len(program.calls) == 3


def test_one_thread_checks_nothing(program):
    assert check(program, "q4_0-q4_0-t128", threads=1) == {"cell": "q4_0-q4_0-t128", "threads": 1, "checked": False}
    assert program.calls == []
