"""kvarn.spec.facts: the torch-free type table agrees with every registered format class."""

import subprocess
import sys

import pytest
import torch

from kvarn.spec import facts
from kvarn.formats import get_format, names

ATTRS = ("family", "group", "sink", "tail_quantum", "min_tail", "default_tail_dtype", "version")


def test_same_types():
    assert facts.names() == names()


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("role", ["k", "v"])
def test_attributes_agree(name, role):
    fmt, f = get_format(name, role=role), facts.get(name)
    assert {a: getattr(fmt, a) for a in ATTRS} == {a: getattr(f, a) for a in ATTRS}
    for tail in (0, 1, 100, 128, 129, 300):
        assert fmt.effective_tail(tail) == f.effective_tail(tail)


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("rot", [True, False])
def test_head_dims_and_bytes_agree(name, rot):
    f = facts.get(name)
    for role in ("k", "v"):
        fmt = get_format(name, role=role, rot=rot)
        for d in range(16, 1025, 16):
            try:
                fmt.check_head_dim(d)
                ok = True
            except ValueError:
                ok = False
            assert f.supports(d, rot) == ok, (name, role, rot, d)
            if ok:
                for n in (f.group, 3 * f.group):
                    assert f.nbytes(n, d, role, rot) == fmt.nbytes(n, d), (name, role, d, n)
                assert f.bits_per_value(d, role, rot) == pytest.approx(fmt.bits_per_value(d))


@pytest.mark.parametrize("name", ["q4_0", "q5_1", "q3_0", "iq4_nl", "kvarn3", "kvarn6", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 256, 512])
def test_bytes_of_real_buffers(name, head_dim, one_thread):
    f = facts.get(name)
    for role in ("k", "v"):
        x = torch.randn(2, 2 * f.group if f.group > 1 else 5, head_dim, generator=torch.Generator().manual_seed(1))
        packed = get_format(name, role=role).encode(x)
        assert packed.data.shape[-1] == f.nbytes(x.shape[-2], head_dim, role)


def test_known_values_by_hand():
    # q4_0: 18 bytes per 32 values = 4.5 bits; q5_1: 24 / 32 = 6 bits; kvarn4 at D = 128:
    # (2048*4 + 768) bytes per 128 x 128 tile = 4.375 bits; at D = 64 K: (1024*4 + 512) / 8192 values
    assert facts.get("q4_0").bits_per_value(128) == 4.5
    assert facts.get("q5_1").bits_per_value(64) == 6.0
    assert facts.get("kvarn4").bits_per_value(128) == 4.375
    assert facts.get("kvarn4").bits_per_value(64, "k") == 4.5 and facts.get("kvarn4").bits_per_value(64, "v") == 4.625
    assert facts.get("bf16").bits == 16 and facts.get("kvarn6").bits == 6 and facts.get("iq4_nl").bits == 4


def test_pair_rules():
    assert facts.pair_family("kvarn6", "kvarn5") == "kvarn" and facts.pair_family("q8_0", "f16") == "standard"
    with pytest.raises(ValueError, match="mix KVarN"):
        facts.pair_family("kvarn4", "q4_0")
    assert facts.pair_default_tail_dtype("kvarn4", "kvarn4") == "f16"
    assert facts.pair_default_tail_dtype("q4_0", "bf16") == "bf16"
    assert [facts.tail_label("kvarn4", "kvarn4", t) for t in (0, 128, 129)] == ["128*", "128", "256*"]
    assert facts.tail_label("q4_0", "q4_0", 0) == "0"
    with pytest.raises(ValueError, match="unknown KV cache type .q9_0.; accepted: q8_0, q6_0"):
        facts.get("q9_0")
    with pytest.raises(ValueError, match="kvarn4: n_tokens 100 is not a multiple of the group size 128"):
        facts.get("kvarn4").nbytes(100, 128)


def test_torch_free():
    """memory, facts, matrix and the report's data shaping import without torch."""
    code = ("import sys; import kvarn.spec.facts, kvarn.budget.memory, kvarn.plan.matrix, kvarn.spec.policy, kvarn.spec.geometry; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
