"""How far our cadence for the QuantizedCache backends is from transformers' own.

transformers' `QuantizedCache` quantizes a prefill whole, keeps a full-precision residual of
up to 128 tokens aligned to its last flush, and when it fills re-quantizes the whole cache
(dequant(old) + residual). kvarn's body formats (kvarn.formats.ecosystem) quantize each
128-token group once and read a sliding 128-token exact tail. This feeds the same tokens to
a tiny random Llama through both (a 128-token prompt, then one token at a time) and prints,
per format and depth, the mean KLD over the decode steps of each against an unquantized
cache and between the two, and their KLD at position 255, where a one-layer model's two
cadences read the same values (the setting of tests/test_ecosystem.py).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.perf.ecosystem_cadence [--steps 384] [--out FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache, QuantizedCache

import kvarn.kvcache.attention as kattn
from kvarn.vocab import facts
from kvarn.kvcache.cache import KVarnCache
from kvarn.vocab.cell import CellSpec
from kvarn.formats import get_format

G = facts.ECOSYSTEM_GROUP


def model(layers: int):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg).eval()


def calls(ids):
    yield ids[:, :G]
    for p in range(G, ids.shape[1]):
        yield ids[:, p:p + 1]


@torch.no_grad()
def run(m, ids, cache, ours=False):
    m.set_attn_implementation(kattn.ATTN_NAME if ours else "sdpa")
    extra = {"kvarn_cache": cache} if ours else {}
    return torch.cat([m(c, cache=cache, use_cache=True, **extra).logits[0] for c in calls(ids)]).log_softmax(-1)


def kld(p_log, q_log):
    """Per position KL(p || q) in nats."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3 * G, help="tokens fed one at a time after the prompt")
    ap.add_argument("--out", type=Path, help="also write the Markdown table here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(0, 128, (1, G + a.steps), generator=torch.Generator().manual_seed(3))
    lines = ["| format | layers | KLD lib vs exact | KLD ours vs exact | KLD lib vs ours | KLD lib vs ours at 255 |",
             "|---|---|---|---|---|---|"]
    for layers in (1, 2):
        m = model(layers)
        exact = run(m, ids, DynamicCache(config=m.config))
        for name, (backend, bits, ak, av, qg) in facts.ECOSYSTEM_TYPES.items():
            lib = run(m, ids, QuantizedCache(backend, m.config, nbits=bits, axis_key=ak, axis_value=av,
                                             q_group_size=qg, residual_length=G))
            cache = KVarnCache(m.config, CellSpec(name, name, G, tail_dtype="f32"))
            for layer in cache.layers:
                layer.k_fmt, layer.v_fmt = get_format(name, "k", dtype="f32"), get_format(name, "v", dtype="f32")
            ours = run(m, ids, cache, ours=True)
            scored = slice(G, None)  # the decode steps (the prompt reads everything exactly in both)
            d = kld(lib, ours)[scored]
            lines.append(f"| {name} | {layers} | {kld(exact, lib)[scored].mean():.3e} | "
                         f"{kld(exact, ours)[scored].mean():.3e} | {d.mean():.3e} | {kld(lib, ours)[2 * G - 1]:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
