"""kvarn.vocab.facts: the torch-free type table agrees with every registered format class."""

import subprocess
import sys

import pytest
import torch

from kvarn.vocab import facts
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
    code = ("import sys; import kvarn.vocab.facts, kvarn.budget.memory, kvarn.plan.matrix, kvarn.vocab.policy, kvarn.vocab.geometry; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the table against the documented facts (not against the format classes) ------------------
# bits, bytes per 32-value block and the min field: docs/notes/formats-blocks.md "Byte layouts";
# q6_0 is format version 2 (its refit order, same note); KVarN: DESIGN §2 (128-token groups, sink
# and minimum tail, F16 exact copy), docs/notes/kvarn.md (format version 2); the ecosystem types:
# docs/notes/ecosystem.md (group 128 = the residual window, q_group_size 64 / 32 for KIVI, bf16
# scale and zero, the pinned library versions).
BLOCKS = {  # name: (bits, bytes per 32 values, has an fp16 min)
    "q8_0": (8, 34, False), "q6_0": (6, 26, False), "q6_1": (6, 28, True), "q5_1": (5, 24, True),
    "q5_0": (5, 22, False), "q4_1": (4, 20, True), "q4_0": (4, 18, False), "iq4_nl": (4, 18, False),
    "q3_1": (3, 16, True), "q3_0": (3, 14, False), "q2_1": (2, 12, True), "q2_0": (2, 10, False),
}
FLOATS = {"f32": 4, "f16": 2, "bf16": 2}  # bytes per value
ECOSYSTEM = {  # name: (bits, q_group_size, library)
    "quanto4": (4, 64, "optimum-quanto==0.2.7"), "quanto2": (2, 64, "optimum-quanto==0.2.7"),
    "hqq4": (4, 64, "hqq==0.2.8.post1"), "hqq2": (2, 64, "hqq==0.2.8.post1"),
    "kivi4": (4, 32, "optimum-quanto==0.2.7"), "kivi2": (2, 32, "optimum-quanto==0.2.7"),
}


def documented_table() -> dict:
    t = {}
    for n, (bits, _, has_min) in BLOCKS.items():
        t[n] = facts.TypeFacts(name=n, family="block", bits=bits, group=1, sink=0, tail_quantum=1, min_tail=0,
                               default_tail_dtype="bf16", version=2 if n == "q6_0" else 1, itemsize=0,
                               has_min=has_min, q_group=0, meta_itemsize=0, library="")
    for n, size in FLOATS.items():
        t[n] = facts.TypeFacts(name=n, family="float", bits=8 * size, group=1, sink=0, tail_quantum=1, min_tail=0,
                               default_tail_dtype="bf16", version=1, itemsize=size, has_min=False, q_group=0,
                               meta_itemsize=0, library="")
    for b in (2, 3, 4, 5, 6, 7, 8):
        t[f"kvarn{b}"] = facts.TypeFacts(name=f"kvarn{b}", family="kvarn", bits=b, group=128, sink=128,
                                         tail_quantum=128, min_tail=128, default_tail_dtype="f16", version=2,
                                         itemsize=0, has_min=False, q_group=0, meta_itemsize=0, library="")
    for n, (bits, qg, lib) in ECOSYSTEM.items():
        t[n] = facts.TypeFacts(name=n, family="ecosystem", bits=bits, group=128, sink=0, tail_quantum=1,
                               min_tail=128, default_tail_dtype="bf16", version=1, itemsize=0, has_min=False,
                               q_group=qg, meta_itemsize=2, library=lib)
    return t


def test_table_is_the_documented_one():
    # the builder itself, field by field and in the registry's order (blocks, floats, KVarN, ecosystem)
    built = facts.build_table()
    assert list(built) == list(documented_table())
    for n, want in documented_table().items():
        assert built[n] == want, n
    assert facts.FACTS == built and facts.names() == list(built)


def test_block_bytes_against_the_docs_and_gguf():
    import gguf

    for n, (bits, nbytes, _) in BLOCKS.items():
        assert facts.get(n).block_bytes == nbytes, n
        assert facts.get(n).block_bytes * 8 / 32 == nbytes / 4, n  # stored bits per value
    # the upstream types' sizes are ggml's: (values per block, bytes per block)
    for n in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"):
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[n.upper()]] == (32, facts.get(n).block_bytes), n
    for n, size in FLOATS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[n.upper()]] == (1, size)
        assert facts.get(n).itemsize == size


def test_documented_bits_per_value():
    # docs/notes/reference.md: q8_0 ... q2_0 at 8.5 6.5 7 6 5.5 5 4.5 4.5 4 3.5 3 2.5 bits per value
    table = dict(zip(BLOCKS, (8.5, 6.5, 7, 6, 5.5, 5, 4.5, 4.5, 4, 3.5, 3, 2.5)))
    for n, bpv in table.items():
        for d in (64, 128, 256):
            for role in ("k", "v"):
                assert facts.get(n).bits_per_value(d, role) == bpv, (n, d, role)
    for b in range(2, 9):  # KVarN: b + 0.375 at head dim 128/256/512; b + 0.5 (K) / b + 0.625 (V) at 64
        f = facts.get(f"kvarn{b}")
        for d in (128, 256, 512):
            assert f.bits_per_value(d, "k") == f.bits_per_value(d, "v") == b + 0.375, (b, d)
        assert f.bits_per_value(64, "k") == b + 0.5 and f.bits_per_value(64, "v") == b + 0.625, b
    # the ecosystem's (docs/notes/ecosystem.md): b + 0.5 with q_group_size 64, b + 1 with KIVI's 32
    for n, (bits, qg, _) in ECOSYSTEM.items():
        assert facts.get(n).bits_per_value(128) == bits + (0.5 if qg == 64 else 1.0), n
    assert facts.get("f32").bits_per_value(96) == 32 and facts.get("bf16").bits_per_value(80) == 16


def test_kvarn_head_dims():
    # DESIGN §3 item 7 / docs/notes/kvarn.md: powers of two 64 .. 512, nothing else
    assert [d for d in range(-1, 2049) if facts.kvarn_head_dim_ok(d)] == [64, 128, 256, 512]
    for bad in (True, 128.0, "128", None):
        assert not facts.kvarn_head_dim_ok(bad), bad


def test_kvarn_tiles_by_hand():
    # K tiles: c channels x 128 tokens; V tiles: 128 tokens x c channels; c = min(D, 128)
    assert facts.kvarn_tile_shape("k", 64) == (64, 128, 1) and facts.kvarn_tile_shape("v", 64) == (128, 64, 1)
    assert facts.kvarn_tile_shape("k", 256) == (128, 128, 2) and facts.kvarn_tile_shape("v", 512) == (128, 128, 4)
    assert all(type(x) is int for x in facts.kvarn_tile_shape("v", 512))
    assert facts.get("kvarn4").tile_shape("k", 512) == (128, 128, 4)
    # codes as a dense bitstream: 45 3-bit codes are 135 bits, 17 bytes; + fp16 scale/zero per row, other per col
    assert facts.kvarn_payload_nbytes(9, 5, 3) == 17
    assert facts.kvarn_tile_nbytes(9, 5, 3) == 17 + 2 * (18 + 5)


def test_nbytes_by_hand():
    cases = [  # (type, n tokens, head dim, role, rot, bytes worked out by the module docstring's formulas)
        ("q4_0", 3, 128, "k", True, 3 * 4 * 18),
        ("q4_0", 1, 96, "k", False, 3 * 18),  # 96 = 3 blocks; without the rotation a multiple of 32 is enough
        ("q5_1", 2, 64, "v", True, 2 * 2 * 24),
        ("f16", 5, 96, "k", True, 5 * 96 * 2),
        ("f32", 5, 7, "v", True, 5 * 7 * 4),
        ("kvarn4", 256, 128, "k", True, 2 * (128 * 128 * 4 // 8 + 2 * (2 * 128 + 128))),
        ("kvarn3", 128, 256, "v", True, 2 * (128 * 128 * 3 // 8 + 2 * (2 * 128 + 128))),
        ("kvarn4", 128, 64, "k", True, 64 * 128 * 4 // 8 + 2 * (2 * 64 + 128)),
        ("kvarn4", 128, 64, "v", True, 128 * 64 * 4 // 8 + 2 * (2 * 128 + 64)),
        ("quanto4", 128, 128, "k", True, 128 * 128 * 4 // 8 + 2 * 2 * (128 * 128 // 64)),
        ("kivi2", 256, 96, "v", True, 256 * 96 * 2 // 8 + 2 * 2 * (256 * 96 // 32)),
    ]
    for name, n, d, role, rot, want in cases:
        got = facts.get(name).nbytes(n, d, role, rot)
        assert got == want and type(got) is int, (name, n, d, role, rot, got)
    for name in ("q4_0", "f16", "kvarn4", "quanto4"):  # no tokens, no bytes
        assert facts.get(name).nbytes(0, 128) == 0


def test_head_dim_checks_and_messages():
    q4, f16, k4, quanto, kivi = (facts.get(n) for n in ("q4_0", "f16", "kvarn4", "quanto4", "kivi4"))
    # rotation (the default): K and V need a multiple of 64; without it a multiple of 32
    assert q4.supports(128) and not q4.supports(96) and q4.supports(96, rot=False) and not q4.supports(80, False)
    for bad in (0, -64, True, 64.0, "64", None):
        assert not q4.supports(bad) and not f16.supports(bad), bad
    assert f16.supports(1) and f16.supports(7)  # the float types take any head dim
    assert quanto.supports(192) and not quanto.supports(96) and kivi.supports(96) and not kivi.supports(80)
    assert [k4.supported_head_dims(), k4.supported_head_dims(False)] == ["powers of two 64..512"] * 2
    assert q4.supported_head_dims() == "multiples of 64 (Hadamard pre-rotation)"
    assert q4.supported_head_dims(rot=False) == "multiples of 32"
    assert quanto.supported_head_dims() == "multiples of 64" and kivi.supported_head_dims() == "multiples of 32"
    assert f16.supported_head_dims() == "any"
    for f, d, kw, accepted in [
        (q4, 96, {}, "multiples of 64 (Hadamard pre-rotation)"),
        (q4, 40, {"rot": False}, "multiples of 32"),
        (k4, 96, {}, "powers of two 64..512"),
        (kivi, 48, {}, "multiples of 32"),
        (f16, 0, {}, "any"),
    ]:
        want = f"{f.name}: head dim {d} not supported; accepted: {accepted}"
        for call in (lambda: f.check_head_dim(d, **kw), lambda: f.nbytes(f.group, d, **kw),
                     lambda: f.bits_per_value(d, **kw)):
            with pytest.raises(ValueError) as e:
                call()
            assert str(e.value) == want
    q4.check_head_dim(96, rot=False)  # accepted: no error
    assert q4.bits_per_value(96, rot=False) == 4.5


def test_nbytes_refuses_bad_arguments():
    q4, k4 = facts.get("q4_0"), facts.get("kvarn4")
    with pytest.raises(ValueError) as e:
        q4.nbytes(1, 128, role="q")
    assert str(e.value) == "role must be 'k' or 'v', got 'q'"
    for bad in (-1, 2.0, "3"):
        with pytest.raises(ValueError) as e:
            q4.nbytes(bad, 128)
        assert str(e.value) == f"q4_0: n_tokens must be an integer >= 0, got {bad!r}"
    with pytest.raises(ValueError) as e:  # a negative whole group is refused too
        k4.nbytes(-128, 128)
    assert str(e.value) == "kvarn4: n_tokens must be an integer >= 0, got -128"


def test_a_new_library_pin_is_a_new_version(monkeypatch):
    # docs/notes/ecosystem.md "Versions": the newest pin's key is the ecosystem formats' version, so a
    # new pin reruns their cells; the other families keep theirs
    monkeypatch.setattr(facts, "ECOSYSTEM_VERSION", 2)
    monkeypatch.setattr(facts, "ECOSYSTEM_LIBRARIES", {"quanto": ("optimum-quanto", "0.3.0"), "hqq": ("hqq", "0.3.1")})
    built = facts.build_table()
    for n, (_, _, lib) in ECOSYSTEM.items():
        assert built[n].version == 2, n
        assert built[n].library == lib.replace("0.2.7", "0.3.0").replace("0.2.8.post1", "0.3.1"), n
    assert built["q4_0"].version == 1 and built["kvarn4"].version == 2 and built["q6_0"].version == 2


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_ecosystem_metadata_bytes_follow_the_library_dtype(monkeypatch, dtype):
    # a scale and a zero per q_group values, each the size of the library's dtype (gguf's sizes)
    import gguf

    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[dtype.upper()]][1]
    monkeypatch.setattr(facts, "ECOSYSTEM_META_DTYPE", dtype)
    built = facts.build_table()
    for n, (bits, qg, _) in ECOSYSTEM.items():
        assert built[n].meta_itemsize == size, n
        assert built[n].bits_per_value(128) == bits + 2 * 8 * size / qg, n  # f32, q_group 64: b + 1
