"""kvarn.vocab.options (compute paths, decode sampling names) and kvarn.vocab.scoring (the scored
positions), against hand-worked values and the rules their docstrings and DESIGN state."""

import pytest

from kvarn.vocab import facts, options, scoring


def raises(call, *args) -> str:
    with pytest.raises(ValueError) as e:
        call(*args)
    return str(e.value)


# --- decode sampling ------------------------------------------------------------------------------
def test_sampling_names_and_labels_by_hand():
    assert options.sampling_name() == "" and options.sampling_label() == "greedy"
    assert options.sampling_name(0, 7) == "" and options.sampling_label(0.0, 7) == "greedy"  # greedy: any seed
    assert options.sampling_name(0.5) == "-T0.5-s0" and options.sampling_label(0.5) == "sampled at T = 0.5, seed 0"
    assert options.sampling_name(1, 0) == "-T1-s0" and options.sampling_label(1, 0) == "sampled at T = 1, seed 0"
    assert options.sampling_name(0.7, 3) == "-T0.7-s3" and options.sampling_label(0.7, 3) == "sampled at T = 0.7, seed 3"
    assert options.sampling_name(2.0, 12) == "-T2-s12"  # format "g": 2.0 is written 2
    for t, seed in ((-1, 0), (0.5, -2)):  # both check their arguments
        for f in (options.sampling_name, options.sampling_label):
            assert raises(f, t, seed).endswith(f"got {t if t < 0 else seed!r}")


def test_sampling_of_a_summary():
    # a summary written before sampling existed has neither key (or None): greedy
    assert options.summary_sampling({}) == "greedy"
    assert options.summary_sampling({"temperature": None, "seed": None}) == "greedy"
    assert options.summary_sampling({"temperature": 0.0, "seed": 5}) == "greedy"
    assert options.summary_sampling({"temperature": 0.7, "seed": 3}) == "sampled at T = 0.7, seed 3"
    assert options.summary_sampling({"temperature": 1.0}) == "sampled at T = 1, seed 0"


def test_parse_sampling_inverts_the_name():
    assert options.parse_sampling("") == (0.0, 0)
    assert options.parse_sampling("-T0.7-s3") == (0.7, 3) and options.parse_sampling("-T1-s0") == (1.0, 0)
    assert options.parse_sampling("-T12.5-s40") == (12.5, 40)
    t, seed = options.parse_sampling("-T2-s7")
    assert (t, seed) == (2.0, 7) and type(t) is float and type(seed) is int
    for bad in ("-T1", "-T1-s", "T1-s0", "-T1e-05-s0", "-T-1-s0", "-T0.7-s3x", "x"):
        assert raises(options.parse_sampling, bad) == (
            f"{bad!r} is not a decode sampling suffix; expected '' (greedy) or like '-T1-s0'")
    # the suffix's numbers are checked like an option's: 0.1234567 does not survive format "g"
    assert "got 0.1234567" in raises(options.parse_sampling, "-T0.1234567-s0")


def test_check_sampling_accepts_and_converts():
    assert options.check_sampling(0, 0) == (0.0, 0) and type(options.check_sampling(0, 0)[0]) is float
    assert options.check_sampling(1, 3) == (1.0, 3)
    assert options.check_sampling(0.7, 0) == (0.7, 0) and options.check_sampling(0.0001, 0) == (0.0001, 0)
    assert options.check_sampling(999999, 0) == (999999.0, 0)  # 6 significant digits, no exponent


@pytest.mark.parametrize("t", [-1, -0.5, float("nan"), float("inf"), 1e6, 1e-5, 1e-7, 0.1234567, 123456.5,
                               True, False, "1", None])
def test_check_sampling_refuses_temperature(t):
    # a temperature names a directory: format "g" must write it without an exponent and without loss
    assert raises(options.check_sampling, t, 0) == (
        "decode temperature must be a number >= 0 (0: greedy) written in at most 6 significant digits without "
        f"an exponent, like 1 or 0.7; got {t!r}")


@pytest.mark.parametrize("seed", [-1, 1.0, 1.5, True, "1", None])
def test_check_sampling_refuses_seed(seed):
    assert raises(options.check_sampling, 1, seed) == f"decode seed must be an integer >= 0, got {seed!r}"


# --- compute paths --------------------------------------------------------------------------------
def test_every_standard_type_has_a_llamacpp_kernel():
    # ggml's vec_dot_type: the float types keep theirs, the _0 blocks (and iq4_nl) dot with q8_0,
    # the _1 blocks with q8_1; KVarN and the ecosystem's types are not llama.cpp CPU kernel types
    standard = {n for n in facts.names() if facts.get(n).family in ("block", "float")}
    assert set(options.VEC_DOT_TYPE) == standard
    for n, q in options.VEC_DOT_TYPE.items():
        want = n if facts.get(n).family == "float" else ("q8_1" if facts.get(n).has_min else "q8_0")
        assert q == want, n


def test_scalar_route():
    # llamacpp-cpu takes BeeLlama's scalar route for a KVarN pair or any tail; ggml's kernel otherwise
    cpu = options.LLAMACPP_CPU
    assert options.scalar_route(cpu, "kvarn4", "kvarn4", 0) and options.scalar_route(cpu, "kvarn6", "kvarn5", 0)
    assert options.scalar_route(cpu, "q4_0", "q4_0", 128) and options.scalar_route(cpu, "q8_0", "f16", 1)
    assert not options.scalar_route(cpu, "q4_0", "q4_0", 0) and not options.scalar_route(cpu, "f16", "q8_0", 0)
    for args in (("kvarn4", "kvarn4", 0), ("q4_0", "q4_0", 128), ("q4_0", "q4_0", 0)):
        assert not options.scalar_route(options.EXACT, *args)  # the exact path has no routes


def test_check_compute_accepts():
    cpu = options.LLAMACPP_CPU
    assert options.check_compute("exact") == "exact" and options.check_compute(cpu) == cpu
    assert options.check_compute("exact", "quanto4", "hqq2", 0, 64) == "exact"  # the exact path takes anything
    assert options.check_compute(cpu, "q4_0") == cpu and options.check_compute(cpu, None, "q4_0") == cpu
    assert options.check_compute(cpu, "kvarn4", "kvarn4", 0) == cpu  # scalar route, no vec_dot needed
    assert options.check_compute(cpu, "kvarn4", "kvarn4", 0, 0) == cpu  # sink 0 is no sink
    for k, v in (("q4_0", "q8_0"), ("iq4_nl", "q2_1"), ("f16", "bf16")):
        for tail in (0, 128):
            assert options.check_compute(cpu, k, v, tail) == cpu


def test_check_compute_refuses():
    cpu = options.LLAMACPP_CPU
    assert raises(options.check_compute, "fast") == "compute 'fast' not accepted; use one of exact, llamacpp-cpu, bf16-attn, tf32-attn"
    assert raises(options.check_compute, cpu, "q4_0", "q4_0", 0, 4) == (
        "compute llamacpp-cpu: sink 4 not accepted; llama.cpp keeps no exact sink of its own choosing "
        "(KVarN's is its format's: leave --sink unset)")
    for k, v, role, bad in (("hqq2", "q4_0", "K", "hqq2"), ("q4_0", "kivi4", "V", "kivi4")):
        for tail in (0, 128):
            assert raises(options.check_compute, cpu, k, v, tail) == (
                f"compute llamacpp-cpu: {role} type {bad!r} is not a llama.cpp or BeeLlama cache type; "
                "its arithmetic is the exact path's only")


def test_check_compute_refuses_a_type_without_kernel(monkeypatch):
    # every standard type has a kernel today (above); a type without one runs only on the scalar
    # route (a tail), and at tail 0 is refused by name with the accepted list
    cpu = options.LLAMACPP_CPU
    monkeypatch.delitem(options.VEC_DOT_TYPE, "q2_0")
    accepted = ", ".join(options.VEC_DOT_TYPE)
    assert "q2_0" not in accepted.split(", ")
    for k, v, role in (("q2_0", "q4_0", "K"), ("q4_0", "q2_0", "V")):
        want = (f"compute llamacpp-cpu: {role} type 'q2_0' has no llama.cpp CPU kernel to emulate at tail 0; "
                f"accepted: {accepted} (or a KVarN pair)")
        assert raises(options.check_compute, cpu, k, v, 0) == want
        assert raises(options.check_compute, cpu, k, v) == want  # the default tail is 0
        assert options.check_compute(cpu, k, v, 128) == cpu


# --- scored positions (DESIGN §6: n_ctx/2 ... n_ctx-2, as llama-perplexity) -----------------------
def test_scored_positions_by_hand():
    assert scoring.scored_positions(4) == range(2, 3)
    assert scoring.scored_positions(8) == range(4, 7) and list(scoring.scored_positions(8)) == [4, 5, 6]
    assert scoring.scored_positions(2048) == range(1024, 2047)
    # the unchecked rule reads any header's size, odd ones too
    assert scoring.scored_range(9) == range(4, 8) and scoring.scored_range(3) == range(1, 2)
    assert scoring.scored_range(1) == range(0, 0)
    assert [scoring.n_scored(n) for n in (1, 2, 3, 4, 8, 9, 512)] == [0, 0, 1, 1, 3, 4, 255]


@pytest.mark.parametrize("n_ctx", [0, 2, 3, 5, 7, 4.0, 8.0, "8", None])
def test_scored_positions_refuses(n_ctx):
    assert raises(scoring.scored_positions, n_ctx) == f"n_ctx must be an even integer >= 4, got {n_ctx!r}"


@pytest.mark.parametrize("attention, device, path", [
    ("auto", "cuda", "flex"), ("auto", "cpu", "ref"), ("auto", "mps", "ref"),
    ("flex", "cpu", "flex"), ("ref", "cuda", "ref"), ("flex", "cuda", "flex"),
])  # fmt: skip
def test_attention_for_picks_flex_on_cuda_only_for_auto(attention, device, path):
    assert options.attention_for(attention, device) == path


def test_attention_for_refuses_a_path_it_does_not_know():
    with pytest.raises(ValueError, match=r"^attention 'sdpa' not accepted; use one of ref, flex, auto$"):
        options.attention_for("sdpa", "cpu")
