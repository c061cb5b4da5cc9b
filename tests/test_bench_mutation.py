"""bench/mutation/run.py: the sample of mutants it tests and the interval it prints for a sampled score."""

import math

import pytest

from bench.mutation import run as M


def test_the_sample_takes_n_per_module_the_same_for_a_seed():
    names = {"a.py": [f"a.x_f__mutmut_{i}" for i in range(1, 51)], "b.py": ["b.x_g__mutmut_1", "b.x_g__mutmut_2"]}
    s = M.sample_mutants(names, 10, seed=3)
    assert len([n for n in s if n.startswith("a.")]) == 10 and len(set(s)) == 12
    assert {n for n in s if n.startswith("b.")} == set(names["b.py"])  # a module with fewer: all of it
    # the order mutants are listed in does not change the draw; another seed does
    assert M.sample_mutants({"b.py": names["b.py"], "a.py": names["a.py"][::-1]}, 10, seed=3) == s
    assert M.sample_mutants(names, 10, seed=4) != s
    assert M.sample_mutants(names, 50, seed=3) == sorted(names["a.py"]) + sorted(names["b.py"])
    with pytest.raises(SystemExit, match="--sample 0"):
        M.sample_mutants(names, 0, seed=3)


def test_the_wilson_interval_against_hand_worked_values():
    # 90 of 100: centre (0.9 + 1.96^2/200) / (1 + 1.96^2/100) = 0.8852, half-width 0.0596
    lo, hi = M.wilson(90, 100)
    assert lo == pytest.approx(0.8256, abs=2e-4) and hi == pytest.approx(0.9448, abs=2e-4)
    # all killed: the upper end is 1, the lower n / (n + z^2)
    lo, hi = M.wilson(20, 20)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(20 / (20 + 1.959964 ** 2))
    assert all(math.isnan(x) for x in M.wilson(0, 0))  # no mutant scored: no interval


def _result(group, modules, sample=None, equivalent=None):
    return {"group": group, "commit": "0123456789abcdef", "modules": modules, "survivors": ["m.x_f__mutmut_3"],
            "equivalent": equivalent or {}, "wall_s": 60.0, "work": "/tmp/w", "rc": 0, "tests": ["tests/test_a.py"],
            "sample": sample, "seed": 0, "generated": {m: 500 for m in modules}}


def test_the_summary_reads_every_groups_file_as_run_writes_it(tmp_path):
    from bench.mutation import summary as S

    # two groups written by run's own writer: a full run (one module at 19 / 20 = 95 %) and a
    # sampled one (8 of 10 killed, 2 timeouts among them = 80 %, below the goal); a first run kept
    # as .before.md is not read
    M.write(_result("alpha", {"kvarn/a.py": {"killed": 19, "survived": 1, "equivalent": 2}}), tmp_path,
            "python -m bench.mutation.run alpha")
    M.write(_result("beta", {"kvarn/b.py": {"killed": 6, "timeout": 2, "survived": 2}}, sample=10), tmp_path,
            "python -m bench.mutation.run beta --sample 10 --seed 0")
    (tmp_path / "beta.md").write_text((tmp_path / "beta.md").read_text() + "\nNote (added by hand): read.\n")
    (tmp_path / "alpha.before.md").write_text("not read")
    text = S.summary(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows[0].startswith("| `kvarn/a.py` | alpha | 95.0 % | 22 | 19 (0) | 1 | 2 | 0123456, ")
    assert rows[0].endswith(": `python -m bench.mutation.run alpha` |  |")
    assert rows[1].startswith("| `kvarn/b.py` | beta | 80.0 % (49.0–94.3) | 10 (500) | 8 (2) | 2 | 0 | 0123456, ")
    assert rows[1].endswith("`python -m bench.mutation.run beta --sample 10 --seed 0` | yes |") and len(rows) == 2
    assert text.splitlines()[-1] == "Below 90 % at their last run: `kvarn/b.py`."
    (tmp_path / "gamma.md").write_text("# something else\n")
    with pytest.raises(ValueError, match=r"gamma\.md: no 'mutmut \.\.\. at <commit>"):
        S.summary(tmp_path)
