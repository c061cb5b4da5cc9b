"""kvarn.vocab.policy: which keys a query reads exactly (DESIGN §2) and the exact share.

References: hand-worked sinks and tails from DESIGN §2's rules, and a brute-force count over
every (scored query, key) pair of the read rule "j < sink or p - j < tail" for the share.
"""

import itertools

import pytest

from kvarn.vocab.facts import TypeFacts, get
from kvarn.vocab.policy import (
    LayerPolicy,
    default_sink,
    default_tail_dtype,
    exact_pairs,
    exact_share,
    layer_policy,
    pair_family,
)


def brute_force(sink: int, tail: int, window: int | None, n_ctx: int) -> tuple[int, int]:
    """(exact, read) pairs over the scored queries p = n_ctx/2 .. n_ctx-2, key by key."""
    exact = read = 0
    for p in range(n_ctx // 2, n_ctx - 1):
        for j in range(p + 1):
            if window is not None and p - j >= window:
                continue
            read += 1
            exact += j < sink or p - j < tail
    return exact, read


# ----------------------------------------------------------------------------- pair rules


@pytest.mark.parametrize("k, v, want", [
    ("q4_0", "q8_0", "standard"), ("f16", "q4_0", "standard"), ("bf16", "bf16", "standard"),
    ("kvarn4", "kvarn2", "kvarn"), ("kvarn8", "kvarn8", "kvarn"),
    ("quanto4", "hqq2", "ecosystem"), ("kivi2", "kivi2", "ecosystem"),
])
def test_pair_family(k, v, want):
    assert pair_family(get(k), get(v)) == want


@pytest.mark.parametrize("k, v", [("kvarn4", "q4_0"), ("q4_0", "kvarn4"), ("kvarn2", "quanto4"), ("hqq4", "kvarn3")])
def test_kvarn_mixed_with_another_family_is_refused(k, v):
    with pytest.raises(ValueError) as e:
        pair_family(get(k), get(v))
    assert str(e.value) == (f"K type {k!r} and V type {v!r} mix KVarN with a standard type; "
                            "use kvarnN for both K and V, or standard types for both")


@pytest.mark.parametrize("k, v", [("quanto4", "q4_0"), ("f16", "hqq2"), ("kivi4", "bf16")])
def test_an_ecosystem_type_mixed_with_a_standard_one_is_refused(k, v):
    with pytest.raises(ValueError) as e:
        pair_family(get(k), get(v))
    assert str(e.value) == (f"K type {k!r} and V type {v!r} mix a QuantizedCache backend type with another "
                            "family; use quantoN, hqqN or kiviN for both K and V")


def test_default_sink_is_the_larger_of_the_pair():
    assert default_sink(get("q4_0"), get("q8_0")) == 0
    assert default_sink(get("kvarn4"), get("kvarn2")) == 128
    assert default_sink(get("quanto4"), get("hqq4")) == 0
    a, b = TypeFacts("a", "block", 4, sink=3), TypeFacts("b", "block", 4, sink=5)
    assert default_sink(a, b) == 5 and default_sink(b, a) == 5


@pytest.mark.parametrize("k, v, want", [
    ("q4_0", "q8_0", "bf16"), ("f32", "f32", "bf16"), ("kvarn4", "kvarn6", "f16"), ("quanto2", "kivi4", "bf16"),
])
def test_default_tail_dtype_of_a_pair(k, v, want):
    assert default_tail_dtype(get(k), get(v)) == want


def test_default_tail_dtype_refuses_a_mixed_pair():
    with pytest.raises(ValueError, match=r"^K type 'kvarn4' and V type 'q4_0' mix KVarN with a standard type"):
        default_tail_dtype(get("kvarn4"), get("q4_0"))


def test_default_tail_dtype_is_the_k_types():
    # both members of a valid pair share it; were they to differ, K's is the one read
    a = TypeFacts("a", "block", 4, default_tail_dtype="f32")
    b = TypeFacts("b", "block", 4, default_tail_dtype="f16")
    assert default_tail_dtype(a, b) == "f32" and default_tail_dtype(b, a) == "f16"


# ----------------------------------------------------------------------------- layer policy


@pytest.mark.parametrize("k, v, tail, window, sink, want", [
    # standard: sink 0 (or as asked), the tail as requested; a window caps the tail, drops the sink
    ("q4_0", "q4_0", 0, None, None, (0, 0, None)),
    ("q4_0", "q8_0", 100, None, None, (0, 100, None)),
    ("q4_0", "q4_0", 100, None, 4, (4, 100, None)),
    ("q4_0", "q4_0", 100, 50, 4, (0, 50, 50)),
    ("q4_0", "q4_0", 100, 200, None, (0, 100, 200)),
    ("q4_0", "q4_0", 100, 100, None, (0, 100, 100)),
    ("q4_0", "q4_0", 0, 16, None, (0, 0, 16)),
    # KVarN: sink 128, tail max(128, roundup(tail, 128)), capped at the window, no sink on sliding layers
    ("kvarn4", "kvarn4", 0, None, None, (128, 128, None)),
    ("kvarn4", "kvarn2", 128, None, None, (128, 128, None)),
    ("kvarn4", "kvarn4", 129, None, None, (128, 256, None)),
    ("kvarn4", "kvarn4", 500, None, None, (128, 512, None)),
    ("kvarn4", "kvarn4", 300, 200, None, (0, 200, 200)),
    ("kvarn4", "kvarn4", 0, 1024, None, (0, 128, 1024)),
    ("kvarn4", "kvarn4", 0, None, 128, (128, 128, None)),
    # ecosystem: tail at least 128 (the residual window), not rounded
    ("quanto4", "quanto4", 0, None, None, (0, 128, None)),
    ("hqq4", "hqq4", 130, None, None, (0, 130, None)),
])
def test_layer_policy_by_hand(k, v, tail, window, sink, want):
    assert layer_policy(get(k), get(v), tail, window, sink) == LayerPolicy(*want)


def test_layer_policy_takes_the_larger_effective_tail_of_k_and_v():
    small = TypeFacts("small", "block", 4)  # the tail as requested
    big = TypeFacts("big", "block", 4, tail_quantum=64, min_tail=64)  # whole 64s, at least 64
    for k, v in ((small, big), (big, small)):
        assert layer_policy(k, v, 10) == LayerPolicy(0, 64, None)
        assert layer_policy(k, v, 65) == LayerPolicy(0, 128, None)
        assert layer_policy(k, v, 65, window=100) == LayerPolicy(0, 100, 100)
        assert layer_policy(k, v, 65, window=128) == LayerPolicy(0, 128, 128)


def test_layer_policy_defaults():
    # no window, no sink asked: a full-attention layer with the pair's own sink
    assert layer_policy(get("kvarn4"), get("kvarn4"), 0) == LayerPolicy(128, 128, None)
    assert layer_policy(get("q8_0"), get("q8_0"), 7) == LayerPolicy(0, 7, None)


# ----------------------------------------------------------------------------- exact share


CASES = [
    # (sink, tail, window, n_ctx)
    (0, 0, None, 64), (0, 128, None, 512), (128, 128, None, 512), (128, 256, None, 2048),
    (0, 128, 200, 600), (3, 5, 16, 40), (0, 7, 4, 30), (128, 128, None, 256),
    (0, 1, None, 10), (1, 0, None, 10), (4, 4, None, 10), (9, 0, None, 10), (20, 0, None, 10),
    (0, 20, None, 10), (2, 3, 3, 12), (5, 2, 4, 12), (12, 0, 3, 12), (0, 3, 1, 12), (1, 1, 1, 8),
    (3, 0, 2, 4), (0, 0, None, 4), (2, 2, None, 5), (1, 2, 3, 7), (0, 0, 5, 20),
]


@pytest.mark.parametrize("sink, tail, window, n_ctx", CASES)
def test_exact_pairs_count_every_pair(sink, tail, window, n_ctx):
    assert exact_pairs(LayerPolicy(sink, tail, window), n_ctx) == brute_force(sink, tail, window, n_ctx)


def test_exact_pairs_exhaustively_on_small_chunks():
    for sink, tail, window, n_ctx in itertools.product(range(5), range(5), (None, 1, 2, 3, 5), range(2, 11)):
        assert exact_pairs(LayerPolicy(sink, tail, window), n_ctx) == brute_force(sink, tail, window, n_ctx), (
            sink, tail, window, n_ctx)


def test_exact_pairs_by_hand():
    # n_ctx 8: queries 4, 5, 6 read 5 + 6 + 7 = 18 keys on a full layer
    assert exact_pairs(LayerPolicy(0, 0, None), 8) == (0, 18)
    # sink 1, tail 2: query p reads key 0 and keys p-1, p exactly: 3 each
    assert exact_pairs(LayerPolicy(1, 2, None), 8) == (9, 18)
    # window 3: 3 keys per query; tail 1: the query's own key
    assert exact_pairs(LayerPolicy(0, 1, 3), 8) == (3, 9)
    # a sink past the window reads nothing extra: keys 0..1 are outside every window
    assert exact_pairs(LayerPolicy(2, 0, 3), 8) == (0, 9)
    # a tail longer than the context: everything
    assert exact_pairs(LayerPolicy(0, 100, None), 8) == (18, 18)


def test_exact_share_averages_layers_equally():
    # two layers: (9 / 18) and (3 / 9) -> (1/2 + 1/3) / 2, whatever their read counts
    a, b = LayerPolicy(1, 2, None), LayerPolicy(0, 1, 3)
    assert exact_share([a, b], 8) == pytest.approx((1 / 2 + 1 / 3) / 2, abs=1e-15)
    assert exact_share([a], 8) == 0.5
    assert exact_share([b, b, b], 8) == pytest.approx(1 / 3, abs=1e-15)
    # a repeated policy weighs once per layer: 2 x 1/2 + 1 x 1/3 over 3
    assert exact_share([a, b, a], 8) == pytest.approx((2 * 0.5 + 1 / 3) / 3, abs=1e-15)
    assert exact_share([b, a, a], 8) == pytest.approx((2 * 0.5 + 1 / 3) / 3, abs=1e-15)


@pytest.mark.parametrize("n_ctx", [8, 64, 513])
def test_exact_share_against_brute_force(n_ctx):
    pols = [LayerPolicy(s, t, w) for s, t, w in ((0, 0, None), (3, 5, None), (0, 4, 6), (2, 2, 3), (3, 5, None))]
    want = sum(e / r for e, r in (brute_force(p.sink, p.tail, p.window, n_ctx) for p in pols)) / len(pols)
    assert exact_share(pols, n_ctx) == pytest.approx(want, abs=1e-15)


def test_exact_share_of_kvarn_by_hand():
    # KVarN at n_ctx 512 on a full layer: each scored query p >= 256 reads 128 sink + 128 tail keys exactly
    pol = layer_policy(get("kvarn4"), get("kvarn4"), 0)
    reads = sum(p + 1 for p in range(256, 511))
    assert exact_share([pol], 512) == 256 * 255 / reads
    assert exact_share([pol], 256) == 1.0  # nothing read from the body
    assert exact_share([layer_policy(get("q4_0"), get("q4_0"), 0)], 2048) == 0.0
