"""bench/perf/forward_speed.py's cell arguments (the benchmark itself is run by hand: a timing, not a test)."""

import argparse
import re

import pytest

from bench.perf import forward_speed as E
from kvarn.vocab.cell import CellSpec


def test_a_cell_is_k_v_tail_or_a_cell_name():
    assert E.cell_arg("kvarn4/kvarn4/0") == CellSpec("kvarn4", "kvarn4", 0)
    fmt_only = E.cell_arg("q4_0-q4_0-t128-tdf16-s128")
    assert fmt_only == CellSpec("q4_0", "q4_0", 128, sink=128, tail_dtype="f16")
    assert E.label(fmt_only) == "q4_0/q4_0 tail 128 (q4_0-q4_0-t128-tdf16-s128)"
    assert E.label(E.cell_arg("q8_0/q8_0/0")) == "q8_0/q8_0 tail 0"


@pytest.mark.parametrize("bad", ["x/y", "q4_0/q4_0/-1", "q4_0-q4_0", "nope/nope/0"])
def test_a_bad_cell_is_named(bad):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
        E.cell_arg(bad)
