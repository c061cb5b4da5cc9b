"""bench/oracles/beellama/grid.py without a BeeLlama build or a model: the rows, the command
lines a row runs, the resume rule on a fake folder, and the tables on fake logs."""

import hashlib
import json
import re
import sys
from pathlib import Path

import polars as pl
import pytest

from bench.oracles.beellama import grid as G
from bench.oracles.beellama import memory as M
from bench.oracles.beellama import table as T


def test_row_names_parse_and_round_trip():
    assert G.parse_row("kvarn4-t0") == G.Row("kvarn4", "kvarn4", 0)
    assert G.parse_row("kvarn4-kvarn2-t0") == G.Row("kvarn4", "kvarn2", 0)
    assert G.parse_row("q4_0-t0-norot") == G.Row("q4_0", "q4_0", 0, rot=False)
    for name in ("bf16-t0", "q4_0-t128", "kvarn6-kvarn5-t0", "q2_0-t0-norot", "kvarn8-t512"):
        assert G.parse_row(name).name == name


@pytest.mark.parametrize("bad, says", [("q4_1-t0", "'q4_1'"), ("kvarn4-kvarn9-t0", "'kvarn9'"), ("kvarn4", "K-tT"),
                                       ("kvarn4-tx", "K-tT")])
def test_a_bad_row_is_refused_naming_it(bad, says):
    with pytest.raises(ValueError, match=f"row '{bad}'.*{says}"):
        G.parse_row(bad)


def test_default_rows_are_the_issues_grid_in_the_briefs_priority():
    rows = G.default_rows("gemma3-270m")
    names = [r.name for r in rows]
    assert names[:len(G.PRIORITY)] == list(G.PRIORITY)
    assert len(set(names)) == len(names)
    grid = {c.name for c in M.grid("gemma3-270m")}
    twins = {f"{t}-t0-norot" for t in M.STANDARD}
    assert set(names) == grid | twins | {"bf16-t0"}
    assert len(names) == 28 + 6 + 1
    # the rest keeps the grid's order
    rest = [n for n in names[len(G.PRIORITY):] if not n.endswith("-norot")]
    assert rest == [c.name for c in M.grid("gemma3-270m") if c.name not in G.PRIORITY]
    # every unrotated twin follows its rotated row
    for t in M.STANDARD:
        assert names.index(f"{t}-t0-norot") == names.index(f"{t}-t0") + 1


def test_smollm2_rows_skip_the_gemma_only_priorities():
    names = [r.name for r in G.default_rows("smollm2-135m")]
    assert names[:4] == ["bf16-t0", "kvarn4-t0", "q4_0-t128", "q4_0-t0"] and "kvarn2-t0" not in names


def _steps(tmp_path, *rows):
    return {s.key: s for s in G.steps_for("gemma3-270m", 4096, 4, [G.parse_row(r) for r in rows], tmp_path,
                                          Path("BUILD"), Path("wiki.test.raw"), 1)}


def test_a_rows_command_lines(tmp_path):
    steps = _steps(tmp_path, "kvarn4-t0", "q4_0-t0-norot")
    base = str(tmp_path / "base.kld")
    b = steps["base"]
    assert b.cmd[:4] == [sys.executable, "-m", "kvarn.cli", "baseline"]
    assert b.cmd[b.cmd.index("--llama-kld-out") + 1] == str(tmp_path / "base-part.kld")
    assert (tmp_path / "base-part.kld", tmp_path / "base.kld") in b.outputs and b.needs == ()

    bee = steps["kvarn4-t0/beellama"]
    assert bee.cmd == ["BUILD/bin/llama-perplexity", "-m", str(G.REPO / "resources" / "models" / M.MODELS["gemma3-270m"][0]),
                       "-f", "wiki.test.raw", "-c", "4096", "--chunks", "4", "-ub", "512", "-t", "1", "-nr",
                       "-ctk", "kvarn4", "-ctv", "kvarn4", "--kv-tail-tokens", "0",
                       "--kl-divergence-base", base, "--kl-divergence"]
    assert bee.env == {"LLAMA_ATTN_ROT_DISABLE": ""}  # rotation on: the variable is removed
    assert bee.log == tmp_path / "kvarn4-t0" / "beellama.log" and bee.needs == ("base",)
    assert steps["q4_0-t0-norot/beellama"].env == {"LLAMA_ATTN_ROT_DISABLE": "1"}
    assert "LLAMA_ATTN_ROT_DISABLE=1 BUILD/bin/llama-perplexity" in G.shown(steps["q4_0-t0-norot/beellama"])

    for row, norot in (("kvarn4-t0", False), ("q4_0-t0-norot", True)):
        for mode in G.MODES:
            s = steps[f"{row}/{mode}"]
            assert s.cmd[:4] == [sys.executable, "-m", "kvarn.cli", "run"]
            assert s.cmd[s.cmd.index("--compute") + 1] == mode
            assert s.cmd[s.cmd.index("--baseline") + 1] == base  # every run scores against the one base file
            assert ("--no-rot" in s.cmd) == norot
            assert s.cmd[s.cmd.index("--chunks") + 1] == "4" and s.cmd[s.cmd.index("-t") + 1] == "1"
            assert s.outputs == [(tmp_path / row / f"{mode}.part", tmp_path / row / mode)]
            assert s.cmd[s.cmd.index("-o") + 1] == str(tmp_path / row / f"{mode}.part")
            assert s.needs == ("base", f"{row}/beellama")


def _fake(tmp_path, key, script, outputs=(), needs=()):
    """A step that appends its key to `ran` and runs `script` in sh."""
    log = tmp_path / (key + ".log")
    return G.Step(key, ["sh", "-c", f"echo {key} >> {tmp_path / 'ran'}; {script}"], log,
                  [(tmp_path / (o + ".part"), tmp_path / o) for o in outputs], needs=needs)


def test_resume_skips_done_steps_and_redoes_interrupted_ones(tmp_path):
    (tmp_path / "r").mkdir()
    done = _fake(tmp_path, "base", "true")
    done.log.write_text("$ ...\n# done rc=0\n")
    interrupted = _fake(tmp_path, "r/beellama", f"echo new >> {tmp_path / 'r' / 'out.part'}", outputs=["r/out"],
                        needs=("base",))
    interrupted.part.write_text("$ ...\nhalf a log\n")  # a run stopped midway: its .part log and output
    (tmp_path / "r" / "out.part").write_text("stale")
    failing = _fake(tmp_path, "r/exact", "exit 3", outputs=["r/exact-out"], needs=("base", "r/beellama"))
    after_failure = _fake(tmp_path, "r/llamacpp-cpu", "true", needs=("r/exact",))
    said = []
    G.run_steps([done, interrupted, failing, after_failure], jobs=2, nice=0, say=said.append, wrap=())
    assert (tmp_path / "ran").read_text().split() == ["r/beellama", "r/exact"]
    assert (tmp_path / "r" / "out").read_text() == "new\n" and not (tmp_path / "r" / "out.part").exists()
    assert not interrupted.part.exists() and "half a log" not in interrupted.log.read_text()
    assert [G.rc_of(s.log) for s in (done, interrupted, failing, after_failure)] == [0, 0, 3, None]
    assert not (tmp_path / "r" / "exact-out").exists()  # a failed step's outputs are not renamed
    assert any(m.startswith("skip r/llamacpp-cpu") for m in said)
    log = interrupted.log.read_text().splitlines()
    assert log[0].startswith("$ sh -c") and log[1].startswith("# start ") and log[-2].startswith("# end ")
    # again: everything done is left alone
    G.run_steps([done, interrupted, failing, after_failure], jobs=2, nice=0, say=said.append, wrap=())
    assert (tmp_path / "ran").read_text().split() == ["r/beellama", "r/exact"]


def test_the_environment_of_a_step(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    on = _fake(tmp_path, "on", "echo rot=${LLAMA_ATTN_ROT_DISABLE-unset}")
    on.env = {"LLAMA_ATTN_ROT_DISABLE": ""}
    off = _fake(tmp_path, "off", "echo rot=${LLAMA_ATTN_ROT_DISABLE-unset}")
    off.env = {"LLAMA_ATTN_ROT_DISABLE": "1"}
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    G.run_steps([on, off], jobs=1, nice=0, say=lambda m: None, wrap=())
    assert "rot=unset" in on.log.read_text() and "rot=1" in off.log.read_text()
    # the log names the numerics-changing variables the step ran under, and only those
    assert on.log.read_text().splitlines()[2] == "# env ATEN_CPU_CAPABILITY=avx2"
    assert off.log.read_text().splitlines()[2] == "# env ATEN_CPU_CAPABILITY=avx2 LLAMA_ATTN_ROT_DISABLE=1"
    assert G.env_line({"PATH": "/bin"}) == ""


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="no autogroup scheduling (Linux only)")
def test_a_step_session_gets_the_nice_value(tmp_path):
    # each step is a session of its own; the scheduler shares the CPU between sessions' autogroups
    # first, so the step's own nice value does not lower it unless its autogroup's is lowered too
    wait = "for i in $(seq 50); do grep -q 'nice 7' /proc/self/autogroup && break; sleep 0.1; done"
    step = _fake(tmp_path, "s", f"{wait}; cat /proc/self/autogroup")
    G.run_steps([step], jobs=1, nice=7, say=lambda m: None, wrap=())
    assert G.rc_of(step.log) == 0
    assert re.search(r"/autogroup-\d+ nice 7$", step.log.read_text(), re.M)


def test_a_failure_is_named_without_the_build_path(tmp_path):
    log = tmp_path / "beellama.log"
    log.write_text("$ llama-perplexity ...\nload ok\n/home/u/src/beellama/ggml/src/ggml-impl.h:319: fatal error\n"
                   "# done rc=134\n")
    assert G.failure(log) == "ggml/src/ggml-impl.h:319: fatal error (rc=134)"
    # a refusal at context creation: llama.cpp's first error-level log line
    log.write_text("$ cmd\n0.00.260.426 E llama_init_from_model: cannot enable kvarn_k4v4_g128: KVarN requires "
                   "128-, 256-, or 512-dimensional key/value heads\n0.00.542.377 E llama_perplexity: failed to "
                   "create context\n# done rc=1\n")
    assert G.failure(log) == ("llama_init_from_model: cannot enable kvarn_k4v4_g128: KVarN requires 128-, 256-, or "
                              "512-dimensional key/value heads (rc=1)")


TIME_V = """\
\tCommand being timed: "llama-perplexity ..."
\tUser time (seconds): {user}
\tSystem time (seconds): 3.10
\tElapsed (wall clock) time (h:mm:ss or m:ss): {wall}
\tExit status: 0
"""


def _log(path: Path, body: str, user: float, wall: str, loads=(1.5, 4.25)):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"$ cmd\n# start 2026-12-02T06:00:00Z load {loads[0]} 1.00 1.00 nice 19\n" + body
                    + TIME_V.format(user=user, wall=wall) + f"# end 2026-12-02T06:10:00Z load {loads[1]} 2.00 2.00\n# done rc=0\n")


def test_time_v_reads_user_seconds_wall_and_load(tmp_path):
    _log(tmp_path / "a.log", "", 496.2, "1:02:03.50")
    assert T.time_v(tmp_path / "a.log") == {"user_s": 496.2, "wall_s": 3723.5, "load": [1.5, 4.25]}
    _log(tmp_path / "b.log", "", 73.53, "3:21.90")
    assert T.time_v(tmp_path / "b.log")["wall_s"] == pytest.approx(201.9)
    (tmp_path / "c.log").write_text("no report\n")
    assert T.time_v(tmp_path / "c.log") is None and T.time_v(tmp_path / "none.log") is None


@pytest.mark.parametrize("median, mean, base, expected", [
    (0.01099, 0.00901, 17.26, "met"),                 # +9.9 % and −9.9 %: in
    (0.0111, 0.0100, 17.26, "not met (median)"),
    (0.0100, 0.0089, 17.26, "not met (mean)"),
    (0.0100, 0.0100, 17.30, "not met (base PPL)"),    # +0.23 %
    (0.0100, 0.0100, 17.29, "met"),                   # +0.17 %
])
def test_target(median, mean, base, expected):
    bee = {"kld_median": 0.0100, "kld_mean": 0.0100, "ppl_base": 17.26}
    assert T.target(bee, {"kld_median": median, "kld_mean": mean, "ppl_base": base}) == expected
    assert T.target({}, {"kld_median": median, "kld_mean": mean, "ppl_base": base}).startswith("not met")


BEE = """\
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      17.4846 ±    1.1491       0.01293 ±    0.00423       {c1:.5f} ±    0.00051     2.975 ±  0.325 %    93.942 ±  0.527 %
   2      17.4846 ±    1.1491       0.01293 ±    0.00423       {c2:.5f} ±    0.00051     2.975 ±  0.325 %    93.942 ±  0.527 %
====== Perplexity statistics ======
Mean PPL(Q)                   :  17.484574 ±   1.149080
Mean PPL(base)                :  17.259909 ±   1.127073
====== KL divergence statistics ======
Mean    KLD:   {mean:.6f} ±   0.000513
99.0%   KLD:   0.058040
Median  KLD:   {median:.6f}
Same top p: 93.942 ± 0.527 %
"""


def _cell(d: Path, chunk_klds: list[list[float]], median: float, user: float, ppl_base=17.26):
    d.mkdir(parents=True)
    rows = [(c, k) for c, ks in enumerate(chunk_klds) for k in ks]
    pl.DataFrame({"chunk": [r[0] for r in rows], "kld": [r[1] for r in rows]}).write_parquet(d / "tokens.parquet")
    mean = sum(r[1] for r in rows) / len(rows)
    (d / "summary.json").write_text(json.dumps({"kld_median": median, "kld_mean": mean, "kld_p99": 0.05,
                                                "same_top": 0.94, "ppl_q": 17.5, "ppl_base": ppl_base,
                                                "compute": d.name}))
    _log(d.with_name(d.name + ".log"), "", user, "2:00.00")


def test_grid_tables_on_fake_logs(tmp_path):
    for name, user, (c1, c2), med in (("bf16-t0", 80.0, (0.004, 0.006), 0.004), ("kvarn4-t0", 480.0, (0.010, 0.014), 0.008)):
        d = tmp_path / name
        _log(d / "beellama.log", BEE.format(c1=c1, c2=(c1 + c2) / 2, mean=(c1 + c2) / 2, median=med), user, "10:00.00")
        _cell(d / "exact", [[c1 / 2] * 3, [c2 / 2] * 3], med / 2, user / 4)
        _cell(d / "llamacpp-cpu", [[c1] * 3, [c2 * 1.05] * 3], med * 1.02, user / 2, ppl_base=17.2599)
    (tmp_path / "q4_0-t0" ).mkdir()
    (tmp_path / "q4_0-t0" / "beellama.log").write_text("$ cmd\n/src/ggml-impl.h:319: fatal error\n# done rc=134\n")
    out = G.grid_tables(tmp_path, ["bf16-t0", "kvarn4-t0", "q4_0-t0", "q2_0-t128"])
    lines = out.splitlines()
    kv = [ln for ln in lines if ln.startswith("| kvarn4-t0 | llamacpp-cpu |")][0]  # the KLD table comes first
    # ratio of kvarn's median to BeeLlama's 1.02, mean (0.01 + 0.0147) / 2 / 0.012 = 1.03: met
    assert "| 1.02 |" in kv and "| 1.03 |" in kv and kv.endswith("| met |")
    ex = [ln for ln in lines if ln.startswith("| kvarn4-t0 | exact |")][0]
    assert "| 0.50 |" in ex and ex.endswith("|  |")  # the target is judged on llamacpp-cpu only
    assert any("q4_0-t0 | BeeLlama failed: /src/ggml-impl.h:319: fatal error (rc=134)" in ln for ln in lines)
    assert any(ln.startswith("| q2_0-t128 | not run |") for ln in lines)
    (tmp_path / "kvarn4-t0" / "exact" / "summary.json").unlink()  # BeeLlama's side alone is still shown
    only = [ln for ln in G.grid_tables(tmp_path, ["kvarn4-t0"]).splitlines() if ln.startswith("| kvarn4-t0 | exact")][0]
    assert only == "| kvarn4-t0 | exact not run | 0.008000 | — | — | 0.012000 | — | — | 0.0580 | — | 93.94 | — |  |"
    # per-chunk means: BeeLlama's from its running means (0.010, then (0.010 + 0.014) / 2), kvarn's from tokens
    ch = [ln for ln in lines if ln.startswith("| kvarn4-t0 | llamacpp-cpu | 0.010000 / 0.010000 | 0.014000 / 0.014700 |")]
    assert len(ch) == 1 and "| 17.4846 | 17.5000 | 17.2599 | 17.2599 |" in ch[0]
    head = [ln for ln in lines if ln.startswith("| row | kvarn compute | chunk 1")]
    assert len(head) == 1 and head[0].count("| chunk ") == 2 and len(head[0].split("|")) == len(ch[0].split("|"))
    # cost: each process against the bf16 row's same process: 480 / 80 = 6.00, 120 / 20, 240 / 40
    cost = [ln for ln in lines if ln.startswith("| kvarn4-t0 | 480.0 |")]
    assert cost == ["| kvarn4-t0 | 480.0 | 6.00 | 600 | 120.0 | 6.00 | 120 | 240.0 | 6.00 | 120 | 1.5–4.2 |"]
    assert any(ln.startswith("| bf16-t0 | 80.0 | 1.00 |") for ln in lines)
    assert "baseline" not in out  # no base.log here
    _log(tmp_path / "base.log", "", 294.24, "17:04.93")
    out = G.grid_tables(tmp_path, ["bf16-t0"])
    assert "\nkvarn's baseline (`exact`, fp32, written as base.kld): 294.2 user CPU s, 1025 s wall.\n" in out
    # then the orderings, which need KVarN / standard pairs this folder does not have
    assert out.index("294.2 user CPU s") < out.index("### The study's orderings") and "* no width with" in out


# ---------------------------------------------------------------- the study's orderings


def _stats(**rows):
    """{row: {program: {kld_median, kld_mean}}} from row=(BeeLlama, exact, llamacpp-cpu) medians
    (each mean twice its median)."""
    from bench.oracles.beellama import orderings as O

    return {name.replace("_t", "-t").replace("q2-", "q2_0-").replace("q4-", "q4_0-").replace("q8-", "q8_0-")
            .replace("_norot", "-norot"): {p: {"kld_median": m, "kld_mean": 2 * m} for p, m in zip(O.PROGRAMS, meds)
                                           if m is not None} for name, meds in rows.items()}


def test_same_width_gain_is_the_studys_per_program():
    from bench.oracles.beellama import orderings as O

    st = _stats(kvarn4_t0=(0.007, 0.004, 0.007), q4_t128=(0.016, 0.020, 0.018),   # below in all three
                kvarn8_t0=(0.0002, 0.0001, 0.0003), q8_t128=(0.0001, 0.0001, 0.0002),  # above in both judges
                kvarn2_t0=(0.50, 0.50, 0.60), q2_t128=(0.55, 0.45, 0.55))  # BeeLlama below, llamacpp-cpu not
    rows, lines = O.same_width(st)
    r4 = [r for r in rows if r[0] == "4"]
    # (1 − 0.007 / 0.016) · 100 = 56.25 on the median; the mean (twice each) gives the same
    assert r4[0] == ["4", "BeeLlama", "0.007000", "0.016000", "+56.2", "+56.2", "yes"]
    assert [r[1] for r in r4] == list(O.PROGRAMS) and r4[2][4] == "+61.1"  # 1 − 0.007 / 0.018
    assert lines == ["* 2 bits, kvarn2-t0 below q2_0-t128 on the median: the programs disagree",
                     "* 4 bits, kvarn4-t0 below q4_0-t128 on the median: reproduced by both programs",
                     "* 8 bits, kvarn8-t0 below q8_0-t128 on the median: shown not to hold in either"]
    # at the floor: both 8-bit rows within 5 % of bf16-t0's median in BeeLlama (0.1 vs 0.104, 0.096), not in exact
    st |= _stats(bf16_t0=(0.1, 0.0, 0.1), kvarn8_t0=(0.096, 0.0001, 0.12), q8_t128=(0.104, 0.0002, 0.13))
    assert O.same_width(st)[1][-1] == (
        "* 8 bits, kvarn8-t0 below q8_0-t128 on the median: reproduced by both programs; both rows within 5% of the "
        "bf16-t0 row's median in BeeLlama: at the floor, the ordering is inside its noise")
    st = _stats(kvarn4_t0=(0.007, 0.004, None), q4_t128=(0.016, 0.020, 0.018), kvarn8_t0=(1, 1, 1))
    assert O.same_width(st)[1] == [
        "* 4 bits, kvarn4-t0 below q4_0-t128 on the median: not measurable (llamacpp-cpu missing)",
        "* 8 bits, kvarn8-t0 below q8_0-t128 on the median: not measurable (q8_0-t128 not run)"]


def test_tail_effect_ordering_per_rotation():
    from bench.oracles.beellama import orderings as O

    # unrotated: |effect| 2 bits 50 %, 4 bits 20 %, 8 bits 10 % in BeeLlama (falling); llamacpp-cpu 8 bits 30 %
    st = _stats(q2_t0_norot=(1.0, 1.0, 1.0), q2_t128_norot=(0.5, 0.5, 0.5),
                q4_t0_norot=(0.10, 0.10, 0.10), q4_t128_norot=(0.08, 0.08, 0.08),
                q8_t0_norot=(0.010, 0.010, 0.010), q8_t128_norot=(0.009, 0.009, 0.007),
                q4_t128=(0.02, 0.02, 0.02))  # rotated: no t0 row (BeeLlama aborts there): nothing judged
    rows, lines = O.tail_effect(st)
    assert ["unrotated", "2", "BeeLlama", "1.000000", "0.500000", "-50.0"] in rows
    assert ["unrotated", "8", "llamacpp-cpu", "0.010000", "0.007000", "-30.0"] in rows
    assert not [r for r in rows if r[0] == "rotated"]
    assert lines == [
        "* unrotated, widths 2, 4, 8: |tail effect| falling from each width to the next: the programs disagree",
        "* unrotated: the tail helps 2 bits more than 8 bits (the study's `tail_effect_order`): "
        "reproduced by both programs"]
    one = _stats(q4_t0=(0.1, 0.1, 0.1), q4_t128=(0.05, 0.05, 0.05))
    assert O.tail_effect(one)[1] == ["* rotated: not measurable (both programs need t0 and t128 rows at two widths "
                                     "or more; widths with both: [4])"]


def test_orderings_read_the_grid_folder(tmp_path):
    from bench.oracles.beellama import orderings as O

    for name, med in (("kvarn4-t0", 0.008), ("q4_0-t128", 0.016)):
        d = tmp_path / name
        _log(d / "beellama.log", BEE.format(c1=0.01, c2=0.01, mean=2 * med, median=med), 10.0, "1:00.00")
        _cell(d / "llamacpp-cpu", [[med * 2] * 3], med * 1.1, 5.0)
    (tmp_path / "q4_0-t0").mkdir()
    (tmp_path / "q4_0-t0" / "beellama.log").write_text("$ cmd\n/src/ggml-impl.h:319: fatal error\n# done rc=134\n")
    names = ["kvarn4-t0", "q4_0-t128", "q4_0-t0"]
    st = O.collect(tmp_path, names)
    assert st == {"kvarn4-t0": {"BeeLlama": {"kld_median": 0.008, "kld_mean": 0.016},
                                "llamacpp-cpu": {"kld_median": 0.0088, "kld_mean": 0.016}},
                  "q4_0-t128": {"BeeLlama": {"kld_median": 0.016, "kld_mean": 0.032},
                                "llamacpp-cpu": {"kld_median": 0.0176, "kld_mean": 0.032}}}
    out = G.grid_tables(tmp_path, names)
    assert "* 4 bits, kvarn4-t0 below q4_0-t128 on the median: reproduced by both programs" in out
    assert "| 4 | BeeLlama | 0.008000 | 0.016000 | +50.0 | +50.0 | yes |" in out


# ---------------------------------------------------------------- the SIMD spread of a row


def _spread_folder(d: Path, base: bytes, rows: dict):
    """A grid folder with a base file and, per row, BeeLlama's median / mean and llamacpp-cpu's."""
    d.mkdir(parents=True)
    (d / "base.kld").write_bytes(base)
    for name, ((bmed, bmean), (kmed, kmean)) in rows.items():
        _log(d / name / "beellama.log", BEE.format(c1=bmean, c2=bmean, mean=bmean, median=bmed), 10.0, "1:00.00")
        _cell(d / name / "llamacpp-cpu", [[kmean] * 3], kmed, 5.0)


def test_spread_of_a_row_between_two_simd_levels(tmp_path):
    from bench.oracles.beellama import spread as S

    a, b = tmp_path / "a", tmp_path / "b"
    _spread_folder(a, b"base", {"kvarn2-t0": ((0.50, 0.60), (0.55, 0.63))})
    _spread_folder(b, b"base", {"kvarn2-t0": ((0.46, 0.57), (0.54, 0.62))})
    out = S.spread_tables(a, b, ["kvarn2-t0", "kvarn4-t0"])
    assert "base file: sha256 " + hashlib.sha256(b"base").hexdigest() in out
    lines = out.splitlines()
    # B / A per program: BeeLlama 0.46 / 0.50, 0.57 / 0.60; llamacpp-cpu 0.54 / 0.55, 0.62 / 0.63
    assert "| kvarn2-t0 | BeeLlama | 0.500000 | 0.460000 | 0.920 | 0.600000 | 0.570000 | 0.950 |" in lines
    assert "| kvarn2-t0 | llamacpp-cpu | 0.550000 | 0.540000 | 0.982 | 0.630000 | 0.620000 | 0.984 |" in lines
    # the target's ratio: A 0.55 / 0.50, B 0.54 / 0.46, across 0.55 / 0.46 and 0.54 / 0.50
    assert "| kvarn2-t0 | median | 1.100 | 1.174 | 1.196 | 1.080 |" in lines
    assert not any("kvarn4-t0" in ln for ln in lines)  # not run in either folder: no row
    # one reference or nothing: a hard link is one file, another base file is refused
    (b / "base.kld").unlink()
    (b / "base.kld").hardlink_to(a / "base.kld")
    assert S.check_same_base(a, b) == "one file (hard link)"
    (b / "base.kld").unlink()
    (b / "base.kld").write_bytes(b"BASE")
    with pytest.raises(ValueError, match=r"differ \(sha256 .*not one base file"):
        S.spread_tables(a, b, ["kvarn2-t0"])
    (b / "base.kld").write_bytes(b"longer")
    with pytest.raises(ValueError, match="differ in size"):
        S.check_same_base(a, b)
    (b / "base.kld").unlink()
    with pytest.raises(ValueError, match="no base file"):
        S.check_same_base(a, b)
    assert S.main(["--model", "gemma3-270m", "--chunks", "4", "--a", str(a), "--b", str(b), "--rows", "kvarn2-t0"]) == 2
