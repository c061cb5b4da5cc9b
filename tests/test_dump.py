"""kvarn.dump: encoding error bound, round trip, refusal of bad or mismatched files."""

import numpy as np
import pytest
import torch

from kvarn import dump, metrics

EPS32 = float(np.finfo(np.float32).eps)


def logprobs(n, V, seed=0, spread=6.0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(spread * torch.randn(n, V, generator=g), dim=-1)


def header(n_ctx=16, **kw):
    h = {"model": "m", "revision": "r1", "tokenizer_hash": "t" * 64, "text_sha256": "s" * 64, "n_ctx": n_ctx}
    h.update(kw)
    return h


@pytest.mark.parametrize("mass_correct", [False, True])
def test_error_bound_from_step(mass_correct):
    lp = logprobs(7, 1001)  # odd vocab: the row is padded to even
    lp[0] = torch.log_softmax(torch.zeros(1001), -1)  # flat row: zero range, scale 0
    rows = dump.encode_rows(lp, mass_correct=mass_correct)
    assert rows.shape == (7, 2 * 501 + 4) and dump.row_uint16(1001) == 1006
    dec = dump.decode_rows(rows, 1001).double()
    hdr = np.ascontiguousarray(rows[:, :4]).view(np.float32).astype(np.float64)
    scale, lo = hdr[:, :1], hdr[:, 1:2]
    x = lp.double().numpy()
    hi = x.max(1, keepdims=True)
    # range: 16 nats below the top (or the row minimum if closer), 65535 steps
    floor = np.maximum(x.min(1, keepdims=True), hi - 16)
    np.testing.assert_allclose(scale, (hi - floor) / 65535, rtol=1e-6)
    assert scale[1:].max() <= 16 / 65535 * (1 + 1e-6)
    fp32 = 4 * EPS32 * (np.abs(floor) + np.abs(x))
    # llama.cpp stores the floor itself; the mass correction moves it by at most half a step
    shift = 0.5 * scale if mass_correct else 0.0
    assert np.all(np.abs(lo - floor) <= shift + 4 * EPS32 * np.abs(floor))
    # so every entry in range decodes within half a step (+ the shift, + fp32 rounding)
    inside = x >= floor
    bound = np.broadcast_to(0.5 * scale + shift + fp32, x.shape)
    err = np.abs(dec.numpy() - x)
    assert np.all(err[inside] <= bound[inside])
    # below the range everything reads back as the stored floor, at or below −16 nats
    assert (~inside).any()
    assert np.all(dec.numpy()[~inside] == np.broadcast_to(lo, x.shape)[~inside])
    assert np.all(lo[1:] <= -16)
    # the zero-range row decodes to its constant
    assert scale[0, 0] == 0 and torch.allclose(dec[0], lp[0].double(), atol=1e-6)
    if mass_correct:  # decoded mass above −16 nats equals the true mass
        keep = x > -16
        np.testing.assert_allclose((np.exp(dec.numpy()) * keep).sum(1), (np.exp(x) * keep).sum(1), rtol=1e-6)


def test_mass_correction_removes_kld_bias():
    lp = logprobs(32, 2000, seed=3, spread=3.0)
    t = torch.zeros(32, dtype=torch.long)
    bias = {}
    for mc in (False, True):
        dec = dump.decode_rows(dump.encode_rows(lp, mass_correct=mc), 2000)
        bias[mc] = np.abs(metrics.token_metrics(lp, dec, t)["kld"]).mean()
    assert bias[True] < 0.2 * bias[False]


def test_round_trip_and_kld_floor(tmp_path):
    blocks = [logprobs(7, 300, seed=s) for s in range(3)]  # n_ctx 16 -> 7 scored
    p = tmp_path / "base.kvd"
    written = dump.write_dump(p, header(), iter(blocks))
    d = dump.open_dump(p, expect=header())
    assert d.n_chunks == 3 and d.n_scored == 7 and d.vocab_size == 300
    assert d.header == written and d.header["encoding"] == "llama-logprob-u16"
    for i, b in enumerate(blocks):
        c = d.chunk(i)
        assert c.dtype == torch.float32 and c.shape == (7, 300)
        np.testing.assert_array_equal(c.numpy(), dump.decode_rows(dump.encode_rows(b), 300).numpy())
        # KLD of the exact distribution against the decoded dump is at most ~half a step
        kld = metrics.token_metrics(b, c, torch.zeros(7, dtype=torch.long))["kld"]
        assert np.abs(kld).max() < 0.5 * 16 / 65535
    with pytest.raises(IndexError, match="3 chunks"):
        d.chunk(3)
    assert not [x for x in tmp_path.iterdir() if x.name != "base.kvd"]  # no temp left


def test_mismatched_header_refused(tmp_path):
    p = tmp_path / "base.kvd"
    dump.write_dump(p, header(), [logprobs(7, 50)])
    with pytest.raises(ValueError, match=r"'tokenizer_hash' is 'tttt.*expected 'other'"):
        dump.open_dump(p, expect={"tokenizer_hash": "other"})
    with pytest.raises(ValueError, match=r"'n_ctx' is 16, expected 32"):
        dump.open_dump(p, expect={"n_ctx": 32})
    with pytest.raises(ValueError, match=r"'dtype' is '<missing>'"):
        dump.open_dump(p, expect={"dtype": "bfloat16"})


def test_truncated_and_corrupt_refused(tmp_path):
    p = tmp_path / "base.kvd"
    dump.write_dump(p, header(), [logprobs(7, 50, seed=s) for s in range(2)])
    data = p.read_bytes()
    (tmp_path / "cut.kvd").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated"):
        dump.open_dump(tmp_path / "cut.kvd")
    (tmp_path / "tiny.kvd").write_bytes(data[:10])
    with pytest.raises(ValueError, match="truncated"):
        dump.open_dump(tmp_path / "tiny.kvd")
    flipped = bytearray(data)
    flipped[dump.PAYLOAD_OFFSET + 2 * (7 * 54) + 20] ^= 0xFF  # a code in chunk 1
    (tmp_path / "bad.kvd").write_bytes(bytes(flipped))
    d = dump.open_dump(tmp_path / "bad.kvd")
    d.chunk(0)
    with pytest.raises(ValueError, match="chunk 1 sha256"):
        d.chunk(1)
    (tmp_path / "other.kvd").write_bytes(b"X" * 200)
    with pytest.raises(ValueError, match="not a kvarn dump"):
        dump.open_dump(tmp_path / "other.kvd")
    with pytest.raises(FileNotFoundError, match="kvarn baseline"):
        dump.open_dump(tmp_path / "none.kvd")


def test_writer_checks_and_atomicity(tmp_path):
    p = tmp_path / "base.kvd"
    with pytest.raises(ValueError, match=r"lacks \['text_sha256'\]"):
        dump.write_dump(p, {k: v for k, v in header().items() if k != "text_sha256"}, [])
    with pytest.raises(ValueError, match=r"chunk 0: block shape \(6, 50\), expected \[7, vocab\]"):
        dump.write_dump(p, header(), [logprobs(6, 50)])
    with pytest.raises(ValueError, match="n_chunks=2, got 1"):
        dump.write_dump(p, header(n_chunks=2), [logprobs(7, 50)])

    def failing():
        yield logprobs(7, 50)
        raise RuntimeError("model crashed")

    with pytest.raises(RuntimeError, match="crashed"):
        dump.write_dump(p, header(), failing())
    assert list(tmp_path.iterdir()) == []  # neither a partial dump nor a temp file


def test_decode_rows_is_the_float64_formula_bit_for_bit_and_slices_agree():
    # decode_rows(rows, V, device): code*scale then + lo in float64, one rounding to fp32 (the
    # former numpy decode); a cell decodes 64-row slices, which must equal slices of the whole.
    torch.manual_seed(3)
    lp = torch.log_softmax(torch.randn(70, 3001, dtype=torch.float64) * 5, dim=-1).float()
    rows = dump.encode_rows(lp)
    hdr = np.ascontiguousarray(rows[:, :4]).view(np.float32).astype(np.float64)
    want = (rows[:, 4:4 + 3001] * hdr[:, :1] + hdr[:, 1:2]).astype(np.float32)
    whole = dump.decode_rows(rows, 3001)
    assert whole.dtype == torch.float32 and np.array_equal(whole.numpy(), want)
    parts = torch.cat([dump.decode_rows(rows[a:a + 64], 3001, "cpu") for a in range(0, 70, 64)])
    assert torch.equal(parts, whole)
    assert torch.equal(dump.decode_rows(np.asarray(rows[:0]), 3001), whole[:0])
