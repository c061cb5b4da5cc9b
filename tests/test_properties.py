"""Property-based tests (hypothesis): invariants over drawn inputs, where the hand-worked tests
check chosen points. A format's packed bytes and shapes, the paired interval of a known
difference, the ledger's verdict under a sign flip of its input."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvarn.formats import get_format
from kvarn.formats.registry import names
from kvarn.report.claims.definitions import same_width_gain
from kvarn.report.claims.study import load_study
from kvarn.report.claims.verdicts import directional
from kvarn.report.data import prepare
from kvarn.vocab import facts
from kvarn.stats.paired import CellTokens, compare

FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- formats ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", names())
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(role=st.sampled_from(["k", "v"]), head_dim=st.sampled_from([64, 128, 256]),
       groups=st.integers(1, 2), heads=st.integers(1, 2), seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e2))
def test_packed_bytes_are_nbytes_and_decode_restores_the_shape(name, role, head_dim, groups, heads, seed, scale):
    fmt = get_format(name, role)
    try:
        fmt.check_head_dim(head_dim)
    except ValueError:
        assume(False)
    n = groups * max(fmt.group, 1) + (0 if fmt.group > 1 else seed % 7)  # KVarN: whole groups only
    x = scale * torch.randn(1, heads, n, head_dim, generator=torch.Generator().manual_seed(seed))
    packed = fmt.encode(x)
    assert packed.data.dtype == torch.uint8
    assert packed.data.shape == (1, heads, fmt.nbytes(n, head_dim))
    assert fmt.nbytes(n, head_dim) == facts.get(name).nbytes(n, head_dim, role)  # the memory tables' bytes
    y = fmt.decode(packed)
    assert y.shape == x.shape and bool(torch.isfinite(y).all())


# ---- the paired interval ------------------------------------------------------------------

def _cell(name, kld, chunks):
    n = len(kld)
    summary = {"model": "m", "source": "s", "revision": "r", "n_ctx": 2 * n // chunks + 2, "chunks": chunks,
               "dtype": "float32"}
    chunk = np.repeat(np.arange(chunks), n // chunks)
    pos = np.tile(np.arange(n // chunks), chunks)
    return CellTokens(name, summary, chunk, pos, np.asarray(kld, dtype=np.float64), np.ones(n, dtype=bool),
                      np.zeros(n))


@FEW
@given(seed=st.integers(0, 2**16), chunks=st.integers(1, 3), per=st.integers(20, 80),
       delta=st.floats(-0.5, 0.5).filter(lambda d: abs(d) > 1e-6))
def test_the_paired_interval_of_a_known_shift_holds_it(seed, chunks, per, delta):
    """B = A + δ token by token: every paired resample's Δ median and Δ mean is δ, so both
    intervals hold δ (to float64 rounding) and are significant; an unpaired draw would not."""
    rng = np.random.default_rng(seed)
    a = rng.lognormal(-3, 2, chunks * per)
    r = compare(_cell("a", a, chunks), _cell("b", a + delta, chunks), n_boot=200, block=4)["stats"]
    for stat in ("kld_median", "kld_mean"):
        s = r[stat]
        assert s["delta"] == pytest.approx(delta, abs=1e-12)
        assert s["lo"] == pytest.approx(delta, abs=1e-12) and s["hi"] == pytest.approx(delta, abs=1e-12)
        assert s["significant"]


# ---- the ledger's verdict -----------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(lo=st.floats(-10, 10), width=st.floats(1e-6, 10), want=st.sampled_from([-1, 1]), sign_ok=st.booleans())
def test_directional_verdict_is_symmetric_under_a_sign_flip(lo, width, want, sign_ok):
    hi = lo + width
    v = directional(sign_ok, lo, hi, want)[0]
    assert directional(sign_ok, -hi, -lo, -want)[0] == v  # the same claim stated the other way round
    if lo <= 0 <= hi:
        assert v == "not separable"
    else:
        assert v == ("holds" if sign_ok and (hi < 0 if want < 0 else lo > 0) else "does not hold")


@settings(max_examples=15, deadline=None)
@given(q=st.floats(0.01, 1.0), ratio=st.floats(0.2, 5.0).filter(lambda r: abs(r - 1) > 1e-3))
def test_same_width_verdict_flips_with_the_sign_of_the_gain(q, ratio):
    """kvarn4's median below q4_0's holds the study's gain (+7.9 %); swap the two medians and it
    does not hold; with the paired interval on the same side as the point estimate, likewise."""
    def verdict(std, kv, interval):
        rows = [{"model": "m", "n_ctx": 1024, "chunks": 1, "k_type": k, "v_type": k, "tail": t,
                 "tail_eff_full": facts.pair_effective_tail(k, k, t), "cell": f"{k}-{k}-t{t}", "kld_median": med,
                 "kld_mean": 2 * med, "kv_total_bytes": mib, "kv_body_bytes": mib, "kv_overlay_bytes": 0,
                 "kv_total_bytes_tail0": mib, "memory_accounting": "packed", "same_top": 0.9, "same_top_err": 0.01,
                 "tokens_per_s": 1000.0}
                for k, t, med, mib in (("q4_0", 128, std, 10 << 20), ("kvarn4", 0, kv, 11 << 20))]
        prep = prepare(pl.DataFrame(rows), "m")
        d = kv - std
        delta = (lambda a, b: (d, d - abs(d) / 2, d + abs(d) / 2)) if interval else (lambda a, b: (None, None, None))
        (row,) = [r for r in same_width_gain(prep, "m", "qwen3.6-27b", load_study(), delta=delta)
                  if r["claim_id"] == "same_width_gain_4"]
        return row["verdict"]

    kv = q * ratio
    for interval in (False, True):
        assert verdict(q, kv, interval) == ("holds" if kv < q else "does not hold")
        assert verdict(kv, q, interval) == ("holds" if q < kv else "does not hold")
