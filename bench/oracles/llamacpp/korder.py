"""Experiment (issue 13): K quantized in llama.cpp's channel order instead of transformers'.

llama.cpp's converter permutes a llama-arch model's q_proj/k_proj rows so that RoPE pairs are
adjacent (GGUF position 2i+s holds HF dimension s*d/2+i, interleaved "norm" RoPE), and
transformers' GGUF loader permutes them back (rotate_half). The K values are the same, but
the 32-wide quantization blocks group different channels. This runs one `exact` cell with
K's roundtrip done in the GGUF order (then permuted back), against an exact baseline:

    python -m bench.oracles.llamacpp.korder q4_0 norot BASELINE.kvd OUT_DIR [n_ctx] [chunks]

A monkeypatch of kvarn.kvcache.cache.make_format, on purpose: an experiment, not a compute path
(`exact` keeps transformers' order; `llamacpp-cpu` uses the GGUF order by itself, through
the same `kvarn.llamacpp_cpu.channel_order.gguf_order`).
"""

import json
import sys

import torch

from bench import TEXT
from kvarn.kvcache import cache

from kvarn.llamacpp_cpu import channel_order

from kvarn.run import torch_engine
from kvarn.weights import sources
from kvarn.vocab.cell import CellSpec
from kvarn.weights.sources import DEFAULT_CACHE_DIR



def gguf_order(fmt):
    """`fmt` whose roundtrip quantizes each head's channels in llama.cpp's interleaved order."""
    rt = fmt.roundtrip

    def roundtrip(x):
        idx = channel_order.gguf_order(x.shape[-1])  # [0, d/2, 1, d/2+1, ...]
        return rt(x[..., idx].contiguous())[..., torch.argsort(idx)]

    fmt.roundtrip = roundtrip
    return fmt


def main():
    k_type, rot, base, out = sys.argv[1], sys.argv[2] == "rot", sys.argv[3], sys.argv[4]
    n_ctx = int(sys.argv[5]) if len(sys.argv) > 5 else 2048
    chunks = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    torch.set_num_threads(1)
    orig = cache.make_format
    cache.make_format = lambda name, role, rot, iters: (
        gguf_order(orig(name, role, rot, iters)) if role == "k" else orig(name, role, rot, iters))
    torch_engine.run_cell(sources.parse_model("smollm2-135m"), n_ctx, chunks, CellSpec(k_type, k_type, 0, rot=rot), base, out,
                    text=str(TEXT), cache_dir=DEFAULT_CACHE_DIR)
    s = json.load(open(f"{out}/summary.json"))
    print(f"{k_type} rot={rot}: median {s['kld_median']:.6f} mean {s['kld_mean']:.6f}")


if __name__ == "__main__":
    main()
