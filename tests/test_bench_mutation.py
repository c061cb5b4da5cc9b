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
