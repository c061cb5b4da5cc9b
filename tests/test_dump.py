"""kvarn.baseline.dump: encoding error bound, round trip, both layouts decoding to the same bits, refusal of bad or
mismatched files."""

import numpy as np
import pytest
import torch

from kvarn.baseline import dump, encoding, sparse

from kvarn.stats import metrics

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
    rows = encoding.encode_rows(lp, mass_correct=mass_correct)
    assert rows.shape == (7, 2 * 501 + 4) and encoding.row_uint16(1001) == 1006
    dec = encoding.decode_rows(rows, 1001).double()
    hdr = np.ascontiguousarray(rows[:, :4]).view(np.float32).astype(np.float64)
    scale, lo = hdr[:, :1], hdr[:, 1:2]
    x = lp.double().numpy()
    hi = x.max(1, keepdims=True)
    # range: 16 nats below the top (or the row minimum if closer), 65535 steps
    floor = np.maximum(x.min(1, keepdims=True), hi - 16)
    # the mass correction may move scale by up to SCALE_ULPS ulps (2**-23 relative each)
    np.testing.assert_allclose(scale, (hi - floor) / 65535, rtol=1e-6 + encoding.SCALE_ULPS * 2.0**-23)
    assert scale[1:].max() <= 16 / 65535 * (1 + 1e-6 + encoding.SCALE_ULPS * 2.0**-23)
    fp32 = 4 * EPS32 * (np.abs(floor) + np.abs(x))
    # llama.cpp stores the floor itself; the mass correction moves it by at most half a step,
    # plus the few ulps of lo and scale that take up lo's fp32 rounding
    ulps = encoding.LO_ULPS * np.spacing(np.float32(32)) + encoding.SCALE_ULPS * np.spacing(scale.astype(np.float32)) * 65535
    shift = 0.5 * scale + ulps if mass_correct else 0.0
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
        dec = encoding.decode_rows(encoding.encode_rows(lp, mass_correct=mc), 2000)
        bias[mc] = np.abs(metrics.token_metrics(lp, dec, t)["kld"]).mean()
    assert bias[True] < 0.2 * bias[False]


def test_lo_rounding_taken_up(monkeypatch):
    # Encoding version 3: lo's fp32 rounding leaves up to ~1e-6 nats of the mass shift undone
    # (a per-token KLD bias of that size, ~1 % of a q8_0 median KLD); a few ulps of lo and
    # scale take it up. Against version 2 (no lattice), the perfect-Q bias must drop >= 3x.
    g = torch.Generator().manual_seed(4)
    lp = torch.log_softmax(4.0 * torch.randn(48, 20000, generator=g, dtype=torch.float64), -1).float()
    t = torch.zeros(48, dtype=torch.long)

    def bias():
        rows = encoding.encode_rows(lp)
        return np.abs(metrics.token_metrics(lp, encoding.decode_rows(rows, 20000), t)["kld"]).mean(), rows

    v3, rows3 = bias()
    monkeypatch.setattr(encoding, "LO_ULPS", 0)
    monkeypatch.setattr(encoding, "SCALE_ULPS", 0)
    v2, rows2 = bias()
    print(f"mean |KLD| of a perfect Q: v2 {v2:.2e}, v3 {v3:.2e}")
    assert v3 < v2 / 3 and v2 > 2e-7  # v2's residual is the size the docstring says
    assert not np.array_equal(rows3[:, :4], rows2[:, :4]) and np.array_equal(rows3[:, 4:], rows2[:, 4:])
    h2, h3 = (np.ascontiguousarray(r[:, :4]).view(np.float32) for r in (rows2, rows3))
    # each moved by at most its lattice: |k| <= 4 ulps of lo, |j| <= 16 ulps of scale
    assert np.all(np.abs(h3[:, 1] - h2[:, 1]) <= 4 * np.spacing(np.abs(h2[:, 1])) * 1.01)
    assert np.all(np.abs(h3[:, 0] - h2[:, 0]) <= 16 * np.spacing(h2[:, 0]) * 1.01)
    assert np.all(h3[:, 1] <= -16)  # every row is clipped here: the floor stays out of the KLD sum


@pytest.mark.parametrize("layout", ["sparse", "dense"])
def test_round_trip_and_kld_floor(tmp_path, layout):
    blocks = [logprobs(7, 300, seed=s) for s in range(3)]  # n_ctx 16 -> 7 scored
    p = tmp_path / "base.kvd"
    written = dump.write_dump(p, header(), iter(blocks), **({} if layout == "sparse" else {"layout": layout}))
    d = dump.open_dump(p, expect=header())
    assert d.n_chunks == 3 and d.n_scored == 7 and d.vocab_size == 300
    assert d.header == written and d.header["encoding"] == "llama-logprob-u16"
    assert d.layout == layout and p.read_bytes()[8] == dump.LAYOUTS[layout]  # the preamble's file version
    for i, b in enumerate(blocks):
        c = d.chunk(i)
        assert c.dtype == torch.float32 and c.shape == (7, 300)
        np.testing.assert_array_equal(c.numpy(), encoding.decode_rows(encoding.encode_rows(b), 300).numpy())
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


@pytest.mark.parametrize("layout", ["sparse", "dense"])
def test_truncated_and_corrupt_refused(tmp_path, layout):
    p = tmp_path / "base.kvd"
    dump.write_dump(p, header(), [logprobs(7, 50, seed=s) for s in range(2)], layout=layout)
    data = p.read_bytes()
    chunk1 = 2 * 7 * 54 if layout == "dense" else int(dump.open_dump(p).offsets[7])  # where chunk 1 starts
    (tmp_path / "cut.kvd").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated"):
        dump.open_dump(tmp_path / "cut.kvd")
    (tmp_path / "tiny.kvd").write_bytes(data[:10])
    with pytest.raises(ValueError, match="truncated"):
        dump.open_dump(tmp_path / "tiny.kvd")
    flipped = bytearray(data)
    flipped[dump.PAYLOAD_OFFSET + chunk1 + 20] ^= 0xFF  # a bitmap byte or code in chunk 1
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


@pytest.mark.parametrize("layout", ["sparse", "dense"])
def test_a_chunk_streamed_in_row_slices_writes_the_same_file(tmp_path, layout):
    # run_baseline hands each chunk over as its log-prob slices (no whole chunk on the host):
    # the file is byte for byte the one written from whole blocks.
    blocks = [logprobs(7, 300, seed=s) for s in range(2)]
    whole, sliced = tmp_path / "whole.kvd", tmp_path / "sliced.kvd"
    dump.write_dump(whole, header(), blocks, layout=layout)
    dump.write_dump(sliced, header(), [iter([b[:3], b[3:4], b[4:]]) for b in blocks], layout=layout)
    assert sliced.read_bytes() == whole.read_bytes()
    # Slices adding up to the wrong number of rows are refused, and nothing is left behind.
    with pytest.raises(ValueError, match=r"chunk 0: 6 rows, expected 7"):
        dump.write_dump(tmp_path / "short.kvd", header(), [iter([blocks[0][:6]])], layout=layout)
    with pytest.raises(ValueError, match=r"chunk 1: block shape \(5, 300\) after 3 rows"):
        dump.write_dump(tmp_path / "long.kvd", header(), [blocks[0], iter([blocks[1][:3], blocks[1][2:]])],
                        layout=layout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sliced.kvd", "whole.kvd"]


def test_decode_rows_is_the_float64_formula_bit_for_bit_and_slices_agree():
    # decode_rows(rows, V, device): code*scale then + lo in float64, one rounding to fp32 (the
    # former numpy decode); a cell decodes 64-row slices, which must equal slices of the whole.
    torch.manual_seed(3)
    lp = torch.log_softmax(torch.randn(70, 3001, dtype=torch.float64) * 5, dim=-1).float()
    rows = encoding.encode_rows(lp)
    hdr = np.ascontiguousarray(rows[:, :4]).view(np.float32).astype(np.float64)
    want = (rows[:, 4:4 + 3001] * hdr[:, :1] + hdr[:, 1:2]).astype(np.float32)
    whole = encoding.decode_rows(rows, 3001)
    assert whole.dtype == torch.float32 and np.array_equal(whole.numpy(), want)
    parts = torch.cat([encoding.decode_rows(rows[a:a + 64], 3001, "cpu") for a in range(0, 70, 64)])
    assert torch.equal(parts, whole)
    assert torch.equal(encoding.decode_rows(np.asarray(rows[:0]), 3001), whole[:0])


def _mixed_rows(n=150, V=1001, seed=5):
    """Log-probs whose rows take every path: peaked rows (few entries above the floor:
    sparse), flat rows (every code nonzero: the dense fallback), a constant row (scale 0,
    every code 0), an odd vocabulary (padding)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.3, 9.0, n).unsqueeze(1)
    lp = torch.log_softmax(spread * torch.randn(n, V, generator=g), -1)
    lp[n // 2] = torch.log_softmax(torch.zeros(V), -1)
    return lp


def test_sparse_layout_decodes_and_scores_bit_identically_to_dense(tmp_path):
    # Storing only the nonzero codes loses nothing: every decoded row (floor entries
    # included) and every metric equal the dense layout's bit for bit, also by 64-row slices.
    V, n_ctx = 1001, 300  # 149 scored rows per chunk
    blocks = [_mixed_rows(149, V, seed=s) for s in range(2)]
    q = [torch.log_softmax(b + 0.05 * torch.randn(b.shape, generator=torch.Generator().manual_seed(9)), -1)
         for b in blocks]
    t = torch.randint(0, V, (149,), generator=torch.Generator().manual_seed(1))
    sp, de = tmp_path / "sparse.kvd", tmp_path / "dense.kvd"
    dump.write_dump(sp, header(n_ctx), blocks)
    dump.write_dump(de, header(n_ctx), blocks, layout="dense")
    s, d = dump.open_dump(sp), dump.open_dump(de)
    assert (s.layout, d.layout) == ("sparse", "dense") and sp.stat().st_size < de.stat().st_size
    # both row kinds were written: sparse (shorter) rows and dense fallbacks
    lengths = np.diff(s.offsets)
    dense_len = 2 * encoding.row_uint16(V)
    assert (lengths == dense_len).sum() >= 50 and (lengths < dense_len).sum() >= 50
    assert lengths.min() == 8 + sparse.bitmap_bytes(V)  # the constant row: no code stored at all
    for c in range(2):
        whole = d.chunk(c)
        assert torch.equal(s.chunk(c), whole)
        slices = torch.cat([s.decode(c, a, min(a + 64, 149)) for a in range(0, 149, 64)])
        assert torch.equal(slices, whole)
        assert np.array_equal(s.dense_rows(c), d.dense_rows(c))  # code for code, llama.cpp's rows
        # both expansions: numpy's (the CPU default) and torch's (what an accelerator runs)
        o = s.offsets[c * 149:(c + 1) * 149 + 1]
        blob = np.asarray(s.payload[o[0]:o[-1]])
        for host in (True, False):
            assert torch.equal(sparse.decode_packed(blob, o[:-1] - o[0], np.diff(o), V, host=host), whole)
        floor = (whole == whole.min(1, keepdim=True).values) & (whole <= -16)  # entries read as a clipped floor
        assert floor.sum() > 10000  # the floor was exercised
        ms, md = (metrics.token_metrics(q[c], base.chunk(c), t) for base in (s, d))
        for key in metrics.PER_TOKEN_KEYS:
            assert np.array_equal(ms[key], md[key]), key


def test_convert_dump_between_layouts(tmp_path):
    blocks = [_mixed_rows(7, 300, seed=s) for s in range(2)]
    dense = tmp_path / "dense.kvd"
    h = dump.write_dump(dense, header(), blocks, layout="dense")
    sp = dump.convert_dump(dense, tmp_path / "sparse.kvd")
    back = dump.convert_dump(tmp_path / "sparse.kvd", tmp_path / "back.kvd", layout="dense")
    assert sp["layout"] == "sparse" and sp["chunk_sha256"] != h["chunk_sha256"]
    assert back == h and (tmp_path / "back.kvd").read_bytes() == dense.read_bytes()  # the same file again
    for c in range(2):
        assert torch.equal(dump.open_dump(tmp_path / "sparse.kvd").chunk(c), dump.open_dump(dense).chunk(c))
    with pytest.raises(ValueError, match=r"layout 'zip' is not one of \['dense', 'sparse'\]"):
        dump.convert_dump(dense, tmp_path / "x.kvd", layout="zip")
    assert not (tmp_path / "x.kvd").exists()


def test_sparse_layout_corruption_named(tmp_path):
    p = tmp_path / "base.kvd"
    h = dump.write_dump(p, header(), [_mixed_rows(7, 300, seed=s) for s in range(2)])
    data = bytearray(p.read_bytes())
    table = h["offsets_offset"]

    def variant(name, edit, verify=True):
        b = bytearray(data)
        edit(b)
        (tmp_path / name).write_bytes(bytes(b))
        return tmp_path / name

    def set_offset(b, i, v):
        b[table + 8 * i:table + 8 * i + 8] = int(v).to_bytes(8, "little")

    off = dump.open_dump(p).offsets
    # the offset table is checksummed
    bad = variant("t.kvd", lambda b: set_offset(b, 3, off[3] + 2))
    with pytest.raises(ValueError, match="row offset table sha256"):
        dump.open_dump(bad)
    # and checked for shape even unverified: a row length no row can have ...
    with pytest.raises(ValueError, match=r"corrupt at chunk 0 row 2: a row of \d+ bytes; a row is 608 bytes "
                                         r"\(dense\) or 8 \+ 40 \+ 2·k < 608"):
        dump.open_dump(variant("t2.kvd", lambda b: set_offset(b, 3, off[3] + 1)), verify=False)
    # ... an index that does not start at 0 or runs past the payload
    with pytest.raises(ValueError, match="table starts at 8, not 0"):
        dump.open_dump(variant("t3.kvd", lambda b: set_offset(b, 0, 8)), verify=False)
    with pytest.raises(ValueError, match="offset out of range"):
        dump.open_dump(variant("t4.kvd", lambda b: set_offset(b, 14, off[14] + 2)), verify=False)
    # a bitmap that disagrees with its row's length (caught by the chunk sha256 when verifying)
    r = int(np.flatnonzero(np.diff(off) < 608)[0])
    start = dump.PAYLOAD_OFFSET + int(off[r]) + 8
    row0 = bytearray(data[start:start + 40])
    bit = next(i for i in range(300) if not row0[i // 8] >> (i % 8) & 1)  # an unset bit
    flip = variant("b.kvd", lambda b: b.__setitem__(start + bit // 8, b[start + bit // 8] | 1 << (bit % 8)))
    with pytest.raises(ValueError, match="chunk 0 sha256"):
        dump.open_dump(flip).chunk(0)
    msg = rf"chunk 0 from row 0: row {r} has \d+ bits set in its bitmap but room for \d+ codes"
    with pytest.raises(ValueError, match=msg):
        dump.open_dump(flip, verify=False).chunk(0)
    with pytest.raises(ValueError, match=msg):
        dump.open_dump(flip, verify=False).dense_rows(0)
    o = off[:8]
    blob = np.frombuffer(flip.read_bytes()[dump.PAYLOAD_OFFSET:dump.PAYLOAD_OFFSET + int(o[-1])], np.uint8)
    with pytest.raises(ValueError, match=f"torch path: row {r} has"):
        sparse.decode_packed(blob, o[:-1], np.diff(o), 300, host=False, where="torch path")
    # an unknown file version, and a header that disagrees with the version
    with pytest.raises(ValueError, match=r"file version 3, this reader reads \[1, 2\]"):
        dump.open_dump(variant("v.kvd", lambda b: b.__setitem__(8, 3)))
    with pytest.raises(ValueError, match="header layout 'sparse' does not match file version 1"):
        dump.open_dump(variant("v1.kvd", lambda b: b.__setitem__(8, 1)))
    with pytest.raises(IndexError, match="rows 5..3 out of range"):
        dump.open_dump(p).decode(0, 5, 3)
    with pytest.raises(ValueError, match=r"layout 'zip' is not one of"):
        dump.write_dump(tmp_path / "z.kvd", header(), [_mixed_rows(7, 300)], layout="zip")
    assert not (tmp_path / "z.kvd").exists()


def test_write_streams_slices_without_a_whole_chunk_encoding(tmp_path, monkeypatch):
    # a chunk is encoded and packed _WRITE_ROWS rows at a time (no encoded copy of a whole
    # chunk: 16 GB at Qwen 3.6 64k), and the per-chunk sha256 is that of the whole chunk's bytes
    monkeypatch.setattr(dump, "_WRITE_ROWS", 3)
    seen = []
    real = encoding.encode_rows
    monkeypatch.setattr(dump, "encode_rows", lambda x, **k: seen.append(len(x)) or real(x, **k))
    b = _mixed_rows(7, 300)
    h = dump.write_dump(tmp_path / "d.kvd", header(), [b], layout="dense")
    assert seen == [3, 3, 1]
    assert h["chunk_sha256"] == [dump.array_sha256(real(b))]
    s = dump.write_dump(tmp_path / "s.kvd", header(), [b])
    assert torch.equal(dump.open_dump(tmp_path / "s.kvd").chunk(0), encoding.decode_rows(real(b), 300))
    assert s["payload_bytes"] == len(sparse.pack_rows(real(b), 300)[0])


# ---------------------------------------------------------------- edges a mutation run found untested


def test_encode_rows_names_a_bad_shape_and_a_non_finite_row():
    with pytest.raises(ValueError, match=r"expected log-probs \[n_scored, vocab\], got shape \(5,\)"):
        encoding.encode_rows(torch.zeros(5))
    lp = torch.log_softmax(torch.randn(20, 7), dim=-1)
    lp[17] = float("nan")
    with pytest.raises(ValueError, match=r"rows 16\.\.19 have a non-finite maximum log-prob"):
        encoding.encode_rows(lp)


def test_a_flat_row_encodes_to_zero_codes_and_decodes_to_its_value():
    """Every entry equal (scale 0): all codes 0, the row decodes to its log-prob exactly."""
    V = 8
    lp = torch.full((3, V), -float(np.log(V)))
    rows = encoding.encode_rows(lp)
    assert (rows[:, 4:4 + V] == 0).all()
    assert torch.equal(encoding.decode_rows(rows, V), lp)


def test_decode_rows_reads_the_bits_as_uint16_whatever_the_input_dtype():
    lp = torch.log_softmax(torch.randn(4, 9) * 5, dim=-1)
    rows = encoding.encode_rows(lp)
    ref = encoding.decode_rows(rows, 9)
    assert torch.equal(encoding.decode_rows(rows.astype(np.int64), 9), ref)  # same values, another dtype
    assert torch.equal(encoding.decode_rows(rows.tolist(), 9), ref)
    before = rows.copy()
    encoding.decode_rows(rows, 9)
    assert np.array_equal(rows, before)  # the caller's rows are not touched


def test_decode_rows_with_more_rows_than_vocabulary_entries():
    """Rows are decoded in slices of rows (not of vocabulary entries): 40 rows of 8 entries."""
    torch.manual_seed(0)
    lp = torch.log_softmax(torch.randn(40, 8), dim=-1)  # every entry within 16 nats of its row's top
    assert (lp.max(1).values - lp.min(1).values).max() < 16
    rows = encoding.encode_rows(lp)
    got = encoding.decode_rows(rows, 8)
    assert got.shape == (40, 8) and torch.isfinite(got).all()
    assert (got - lp).abs().max() < 3e-4  # within one code step (16 nats / 65535) and fp32 rounding


def test_encode_rows_encodes_the_float32_values_whatever_the_input_dtype():
    """llama.cpp encodes fp32 logits: float64 log-probs are rounded to fp32 first, the same rows."""
    torch.manual_seed(2)
    lp = torch.log_softmax(torch.randn(5, 11, dtype=torch.float64) * 3, dim=-1)
    assert np.array_equal(encoding.encode_rows(lp), encoding.encode_rows(lp.float()))
