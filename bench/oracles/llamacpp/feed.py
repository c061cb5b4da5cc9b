"""kvarn's llamacpp-cpu attention fed llama.cpp's own Q, K and V, against llama.cpp's own output (issue 13).

llama.cpp runs chunk 1 of a llama-perplexity grid (the base file's tokens, the row's cache
type and rotation) and dumps, for the chosen layers, its post-RoPE Q, K, V and the flash-
attention output `kqv_out` of every ubatch (`bench/oracles/llamacpp/dump.c`). kvarn then runs the
same chunk in `llamacpp-cpu` mode with, at those layers, its Q/K/V replaced by llama.cpp's
before its own cache rounds them; its attention output (un-rotated as llama.cpp un-rotates
kqv_out) is compared with llama.cpp's, per ubatch. Where `bench/oracles/llamacpp/fa_oracle.py`
checks one ubatch of our inputs through ggml's kernel, this checks the whole chunk — later
ubatches, sliding-window and global layers, the cache as llama.cpp filled it — on llama.cpp's
inputs. Printed beside it: how far the two programs' own Q/K/V and outputs are apart in that
run (they drift through the layers: each program rounds its own cache).

    python -m bench.oracles.llamacpp.feed --model gemma3-270m --row q4_1-rot [--layers 0 5 6 11 17] [--out FILE]

Needs the llama.cpp build and runs of bench/oracles/llamacpp/perplexity.sh ($LLAMACPP_DIR); never run in CI.
"""

from __future__ import annotations

import argparse
import tempfile

from bench import REPO

from bench.oracles.llamacpp import runs as lc
from bench.oracles.llamacpp import sink  # the dumper and its build

UBATCH = 512


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", choices=sorted(lc.CTX))
    ap.add_argument("--row", required=True, help="TYPE-rot or TYPE-norot")
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 5, 6, 11, 17])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the table here")
    a = ap.parse_args()
    import numpy as np
    import torch

    from kvarn.llamacpp_cpu import channel_order, compute

    from kvarn.run import forward, load

    from kvarn.vocab import options
    from kvarn.vocab.cell import CellSpec
    from kvarn.weights import sources
    from kvarn.formats.hadamard import V_ROTATION_BLOCK, rotate_blocks
    from kvarn.formats.registry import get_format

    torch.set_num_threads(a.threads)
    t, rot_s = a.row.rsplit("-", 1)
    if rot_s not in ("rot", "norot"):
        raise SystemExit(f"--row {a.row!r}: expected TYPE-rot or TYPE-norot")
    rot = rot_s == "rot"
    d = lc.run_dir(a.model, 1)
    n_ctx = lc.CTX[a.model]
    spec = sources.parse_model(a.model)
    cache_dir = str(REPO / "resources" / "models")
    ctx = load.Context(spec, n_ctx, 1, text=str(lc.TEXT), cache_dir=cache_dir, baseline=True)
    model = ctx.loaded.model
    cfg = model.config.get_text_config()
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    llama_tokens = np.fromfile(d / "base.kld", dtype=np.int32, count=5 + n_ctx)[5:]
    ids = ctx.chunk_ids[0]
    if not np.array_equal(llama_tokens[1:], ids[1:].numpy()):  # position 0 is BOS in both
        raise SystemExit(f"{d / 'base.kld'} holds other tokens than kvarn's chunk 1")

    exe = sink.build()
    with tempfile.TemporaryDirectory() as tmp:
        sink.dump_tensors(exe, sources.gguf_path(spec, cache_dir), d / "base.kld", t, rot, n_ctx, a.layers,
                          ("Qcur", "Kcur", "Vcur", "kqv_out"), a.threads, tmp)
        ll = {L: {x: sink.load_node(tmp, name, L).reshape(n_ctx, heads, D)
                  for x, name, heads in (("q", "Qcur", H), ("k", "Kcur", Hkv), ("v", "Vcur", Hkv), ("o", "kqv_out", H))}
              for L in a.layers}
    if channel_order.gguf_qk_permuted(model.config.model_type):
        raise SystemExit(f"{a.model}: llama.cpp holds its Q/K in the GGUF's permuted order; not handled here")
    if get_format(t, "v", rot=rot).family != "float" and rot:  # kqv_out is in V's rotated frame
        for L in a.layers:
            ll[L]["o"] = rotate_blocks(ll[L]["o"], V_ROTATION_BLOCK)

    load.set_compute(model, spec, cache_dir, options.LLAMACPP_CPU)
    layer_of: dict[int, int] = {}
    got = {L: {"q": [], "k": [], "v": [], "o": []} for L in a.layers}
    start = [0]
    append_kv, attention = compute.append_kv, compute.attention

    def append_fed(layer, k, v):  # [b, H_kv, n, D]
        L = layer_of.setdefault(id(layer), len(layer_of))
        if L in got:
            s, n = start[0], k.shape[2]
            got[L]["k"].append(k[0].transpose(0, 1).float().clone())
            got[L]["v"].append(v[0].transpose(0, 1).float().clone())
            k = ll[L]["k"][s:s + n].transpose(0, 1)[None].to(k.dtype)
            v = ll[L]["v"][s:s + n].transpose(0, 1)[None].to(v.dtype)
        return append_kv(layer, k, v)

    def attention_fed(module, query, layer, allowed, scaling):  # query [b, H, n, D]
        L = layer_of[id(layer)]
        if L in got:
            s, n = start[0], query.shape[2]
            got[L]["q"].append(query[0].transpose(0, 1).float().clone())
            query = ll[L]["q"][s:s + n].transpose(0, 1)[None].to(query.dtype)
        out = attention(module, query, layer, allowed, scaling)
        if L in got:
            got[L]["o"].append(out[0].float().clone())
        return out

    compute.append_kv, compute.attention = append_fed, attention_fed
    try:
        cache = forward.new_cache(model, CellSpec(t, t, 0, rot=rot, compute=options.LLAMACPP_CPU))
        cache.reserve(n_ctx)
        with torch.inference_mode():
            for s in range(0, n_ctx, UBATCH):
                start[0] = s
                model(input_ids=ids[None, s:s + UBATCH], cache=cache, kvarn_cache=cache, use_cache=True,
                      logits_to_keep=torch.arange(1))
    finally:
        compute.append_kv, compute.attention = append_kv, attention
    missing = [L for L in a.layers if not got[L]["o"]]
    if missing:
        raise SystemExit(f"layers {missing} were never fed: the model has {len(layer_of)} attention layers")

    def rel(x, y):
        return float((x - y).norm() / y.norm())

    lines = [f"### {a.model} {t} rot {'on' if rot else 'off'}, n_ctx {n_ctx}, chunk 1: kvarn's attention on llama.cpp's "
             "Q/K/V against llama.cpp's kqv_out", "",
             "| layer | fed: \\|kvarn − llama\\| / \\|llama\\|, whole chunk | worst ubatch | own runs apart: Q | K | V |",
             "|---:|---:|---:|---:|---:|---:|"]
    for L in a.layers:
        g = {x: torch.cat(v) for x, v in got[L].items()}
        per = [rel(g["o"][s:s + UBATCH], ll[L]["o"][s:s + UBATCH]) for s in range(0, n_ctx, UBATCH)]
        lines.append(f"| {L} | {rel(g['o'], ll[L]['o']):.1e} | {max(per):.1e} | "
                     + " | ".join(f"{rel(g[x], ll[L][x]):.1e}" for x in "qkv") + " |")
    lines.append("")
    lines.append("(\"own runs apart\": the Q/K/V kvarn computed at that layer in this run, before they were "
                 "replaced, against llama.cpp's: what feeding changes. Each program rounds its own cache, so the two "
                 "drift apart through the layers.)")
    print("\n".join(lines))
    if a.out:
        from kvarn.files.atomic import write_text

        write_text(a.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
