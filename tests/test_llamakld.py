"""kvarn.llamacpp_cpu.llamakld: llama-perplexity's --kl-divergence-base file, written from our dump and read back."""

import struct

import numpy as np
import pytest
import torch

from kvarn.baseline import dump
from kvarn.baseline.protocol import Baseline

from kvarn.llamacpp_cpu import llamakld

N_CTX, V, CHUNKS = 16, 11, 2
N_SCORED = N_CTX - 1 - N_CTX // 2


@pytest.fixture()
def files(tmp_path):
    g = torch.Generator().manual_seed(0)
    blocks = [torch.log_softmax(torch.randn(N_SCORED, V, generator=g) * 3, -1) for _ in range(CHUNKS)]
    ids = torch.randint(0, V, (CHUNKS, N_CTX), generator=g)
    kvd = tmp_path / "base.kvd"
    dump.write_dump(kvd, {"model": "m", "revision": "r", "tokenizer_hash": "t", "text_sha256": "s",
                          "n_ctx": N_CTX}, blocks)
    kld = llamakld.write_from_dump(kvd, ids, tmp_path / "base.kld")
    return kvd, kld, ids, blocks


def test_layout_is_llama_perplexity(files):
    # header, tokens, rows exactly where tools/perplexity reads them
    kvd, kld, ids, _ = files
    raw = kld.read_bytes()
    assert raw[:8] == b"_logits_"
    assert struct.unpack("<Iii", raw[8:20]) == (N_CTX, V, CHUNKS)
    nv = 2 * ((V + 1) // 2) + 4
    assert len(raw) == 20 + 4 * CHUNKS * N_CTX + 2 * CHUNKS * N_SCORED * nv
    assert np.array_equal(np.frombuffer(raw[20:20 + 4 * CHUNKS * N_CTX], "<i4").reshape(CHUNKS, N_CTX), ids.numpy())
    row0 = np.frombuffer(raw[20 + 4 * CHUNKS * N_CTX:][:2 * nv], "<u2")
    scale, lo = row0[:4].view("<f4")
    d = dump.open_dump(kvd)
    # llama's decode (scale*code + lo in fp32) of the first row = our decode (float64, rounded
    # once): equal up to fp32 rounding, far inside one code step (16/65535 nats)
    np.testing.assert_allclose(np.float32(scale) * row0[4:4 + V].astype(np.float32) + np.float32(lo),
                               d.chunk(0)[0].numpy(), rtol=0, atol=4e-6)


def test_round_trip(files):
    kvd, kld, ids, blocks = files
    f = llamakld.open_llama_kld(kld, ids, N_CTX, V)
    assert llamakld.is_llama_kld(kld) and not llamakld.is_llama_kld(kvd)
    assert f.kind == "llama" and f.n_chunks == CHUNKS and f.n_scored == N_SCORED
    d = dump.open_dump(kvd)
    for c in range(CHUNKS):
        assert torch.equal(f.chunk(c), d.chunk(c))
        assert (f.chunk(c) - blocks[c]).abs().max() < 16 / 65535  # within one code step of the truth
    # fewer chunks than the file holds: accepted
    assert llamakld.open_llama_kld(kld, ids[:1], N_CTX).n_chunks == CHUNKS


def test_both_files_are_one_baseline(files):
    """Our dump and llama's base file are each a `Baseline`: every member the protocol names,
    each method with the protocol's signature, and the same rows read through either."""
    import inspect

    kvd, kld, ids, _ = files
    members = [m for m in vars(Baseline) if not m.startswith("_")] + list(Baseline.__annotations__)
    assert set(members) >= {"kind", "path", "header", "n_chunks", "n_scored", "vocab_size", "decode", "chunk",
                            "dense_rows"}
    for base in (dump.open_dump(kvd), llamakld.open_llama_kld(kld, ids, N_CTX, V)):
        assert isinstance(base, Baseline), type(base)
        for m in members:
            assert hasattr(base, m), (type(base).__name__, m)
            want = vars(Baseline)[m] if m in vars(Baseline) else None
            if inspect.isfunction(want):
                assert inspect.signature(getattr(type(base), m)) == inspect.signature(want), (type(base).__name__, m)
        assert base.kind in ("kvarn", "llama") and base.n_scored == N_SCORED and base.vocab_size == V
        assert torch.equal(base.decode(1, 2, 5), dump.open_dump(kvd).decode(1, 2, 5))
        assert np.array_equal(base.dense_rows(1, 2, 5), dump.open_dump(kvd).dense_rows(1, 2, 5))


def test_refusals(files, tmp_path):
    kvd, kld, ids, _ = files
    with pytest.raises(ValueError, match="n_ctx 16, this run uses 32"):
        llamakld.open_llama_kld(kld, ids, 32)
    with pytest.raises(ValueError, match="vocabulary 11, the model has 12"):
        llamakld.open_llama_kld(kld, ids, N_CTX, 12)
    more = torch.cat([ids, ids])
    with pytest.raises(ValueError, match="has 2 chunks, this run needs 4"):
        llamakld.open_llama_kld(kld, more, N_CTX)
    other = ids.clone()
    other[1, 5] = (other[1, 5] + 1) % V
    with pytest.raises(ValueError, match="token 5 of chunk 1"):
        llamakld.open_llama_kld(kld, other, N_CTX)
    other = ids.clone()
    other[:, 0] = 0  # position 0 is BOS-replaced by llama at evaluation: not compared
    llamakld.open_llama_kld(kld, other, N_CTX)
    cut = tmp_path / "cut.kld"
    cut.write_bytes(kld.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated"):
        llamakld.read_llama_kld(cut)
    with pytest.raises(ValueError, match="not a llama-perplexity KLD base file"):
        llamakld.read_llama_kld(kvd)


def test_the_file_names_itself_and_its_chunks(files):
    kvd, kld, ids, _ = files
    f = llamakld.read_llama_kld(kld)
    assert f.path == kld and f.header == {"n_ctx": N_CTX, "vocab_size": V, "n_chunks": CHUNKS,
                                          "compute": "llama.cpp", "source_file": str(kld)}
    for i in (CHUNKS, -1):
        with pytest.raises(IndexError, match=rf"chunk {i} out of range: .*base.kld has {CHUNKS} chunks"):
            f.dense_rows(i)
    with pytest.raises(ValueError, match=rf"dump .*base.kvd: {CHUNKS} chunks x n_ctx {N_CTX}, tokens given 1 x {N_CTX}"):
        llamakld.write_from_dump(kvd, ids[:1], kld.parent / "other.kld")


@pytest.mark.parametrize("n_ctx, n_vocab, n_chunk, ok", [(16, 1, 1, True), (16, 0, 1, False), (16, 1, 0, False),
                                                          (3, 1, 1, False)])
def test_a_header_is_read_at_its_limits(tmp_path, n_ctx, n_vocab, n_chunk, ok):
    """One token of vocabulary and one chunk is a file; none of either, or a context under 4, is not
    (each file the size its header implies, so only the header can refuse it)."""
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_scored = n_ctx - 1 - n_ctx // 2
    p = tmp_path / "h.kld"
    p.write_bytes(b"_logits_" + struct.pack("<Iii", n_ctx, n_vocab, n_chunk)
                  + bytes(4 * n_chunk * n_ctx + 2 * n_chunk * n_scored * nv))
    if ok:
        assert llamakld.read_llama_kld(p).n_chunks == n_chunk
    else:
        with pytest.raises(ValueError, match=rf"header n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk} is not a valid"):
            llamakld.read_llama_kld(p)


def test_a_chunk_of_more_than_1024_scored_rows_round_trips(tmp_path):
    """write_from_dump writes a chunk's rows 1024 at a time: 1049 rows cross that seam once."""
    n_ctx = 2100
    n_scored = n_ctx - 1 - n_ctx // 2
    g = torch.Generator().manual_seed(1)
    blocks = [torch.log_softmax(torch.randn(n_scored, V, generator=g), -1)]
    ids = torch.randint(0, V, (1, n_ctx), generator=g)
    kvd = tmp_path / "long.kvd"
    dump.write_dump(kvd, {"model": "m", "revision": "r", "tokenizer_hash": "t", "text_sha256": "s", "n_ctx": n_ctx},
                    blocks)
    f = llamakld.open_llama_kld(llamakld.write_from_dump(kvd, ids, tmp_path / "long.kld"), ids, n_ctx, V)
    assert f.n_scored == n_scored > 1024 and torch.equal(f.chunk(0), dump.open_dump(kvd).chunk(0))
    with pytest.raises(FileNotFoundError, match=r"^no llama KLD base file at .*absent.kld$"):
        llamakld.read_llama_kld(tmp_path / "absent.kld")
