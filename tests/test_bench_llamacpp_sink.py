"""bench/oracles/llamacpp/sink.py's replacements: llama.cpp's rows are put back in transformers' channel
order for a llama-arch model (whose GGUF permutes K), and a re-drawn row is seeded."""

import torch

from bench.oracles.llamacpp import sink
from kvarn.llamacpp_cpu import channel_order



def test_llama_rows_back_in_transformers_order():
    g = torch.Generator().manual_seed(0)
    full_k, full_v = torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 64, generator=g)  # [H_kv, positions, D]
    k, v = full_k[:, 2:5], full_v[:, 2:5]  # ours: the swapped positions 2..4
    theirs_k = full_k[..., channel_order.gguf_order(64)]  # how llama.cpp holds a llama-arch K (kvarn.llamacpp_cpu.compute.k_operand)
    assert not torch.equal(theirs_k, full_k)  # the permutation is not the identity, or this tests nothing

    def dumped(x):  # llama.cpp's dump: one row per position from 0, heads side by side
        return x.transpose(0, 1).reshape(x.shape[1], -1)

    got_k, got_v = sink.from_llama([(dumped(theirs_k), dumped(full_v))])(0, slice(2, 5), k, v, True)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    got_k, _ = sink.from_llama([(dumped(full_k), dumped(full_v))])(0, slice(2, 5), k, v, False)  # no permutation
    assert torch.equal(got_k, k)


def test_rerolled_is_seeded_and_small():
    k, v = torch.randn(1, 256), torch.randn(1, 256)
    a = sink.rerolled(3, 0.01)(0, slice(0, 1), k, v, False)
    b = sink.rerolled(3, 0.01)(0, slice(0, 1), k, v, False)
    c = sink.rerolled(4, 0.01)(0, slice(0, 1), k, v, False)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    rel = float((a[0] - k).norm() / k.norm())
    assert 0.005 < rel < 0.02, rel
