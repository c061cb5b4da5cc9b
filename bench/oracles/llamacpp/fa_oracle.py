"""kvarn's llamacpp-cpu attention against ggml-cpu's own flash_attn_ext, on a model's real Q/K/V.

One forward of the first ubatch (512 tokens of wiki.test.raw) in `llamacpp-cpu` mode with a
K/V type and rotation; for the chosen attention calls (layers) the post-RoPE Q, K and V are
captured with kvarn's output, rotated as llama-graph.cpp rotates them (Q and K by K's
Hadamard, V by the 64-Hadamard), handed to `bench/oracles/llamacpp/fa_oracle.c` (ggml quantizes K
and V itself and runs `ggml_flash_attn_ext` on one thread; Q is pre-scaled and the kernel
scale set to 1 with --prescale, as gemma3.cpp does), and the output rotated back. Prints
|ggml − kvarn| / |ggml| beside what the cache format and the kernel change together,
|ggml − fp32 attention over the unrounded cache| / |ggml|.

    python -m bench.oracles.llamacpp.fa_oracle --model gemma3-270m --k q4_1 [--no-rot] [--calls 0 5] [--prescale]

Needs the llama.cpp build of bench/oracles/llamacpp/perplexity.sh ($LLAMACPP_DIR); never run in CI.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from bench import REPO

from bench.oracles.llamacpp import runs as lc  # LLAMACPP_DIR, TEXT, the C build

SRC = Path(__file__).with_name("fa_oracle.c")


def build() -> Path:
    """The oracle, compiled against the llama.cpp build's ggml (once, outside the repo)."""
    return lc.build_c(SRC, lc.LLAMACPP_DIR / "fa_oracle" / "fa", ["ggml", "ggml-base", "ggml-cpu"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--k", default="q4_1", help="K and V type (a ggml type the oracle knows)")
    ap.add_argument("--no-rot", dest="rot", action="store_false")
    ap.add_argument("--calls", type=int, nargs="+", default=[0, 5], help="attention calls (layers) to compare")
    ap.add_argument("--prescale", action="store_true", help="Q pre-scaled, kernel scale 1 (llama.cpp's gemma3 graph)")
    a = ap.parse_args()
    import numpy as np
    import torch

    from kvarn.llamacpp_cpu import channel_order, compute

    from kvarn.run import forward, load

    from kvarn.vocab import options
    from kvarn.vocab.cell import CellSpec
    from kvarn.weights import sources
    from kvarn.formats.hadamard import V_ROTATION_BLOCK, k_rotation_block, rotate_blocks

    torch.set_num_threads(1)
    exe = build()
    spec = sources.parse_model(a.model)
    cache_dir = str(REPO / "resources" / "models")
    ctx = load.Context(spec, 1024, 1, text=str(lc.TEXT), cache_dir=cache_dir, baseline=True)
    model = ctx.loaded.model
    load.set_compute(model, spec, cache_dir, options.LLAMACPP_CPU)
    raw, got, n = {}, {}, [0]
    append_kv, attention = compute.append_kv, compute.attention

    def append_spy(layer, k, v):  # the cache layer's raw post-RoPE K and V of this ubatch
        raw[id(layer)] = (k.detach().clone(), v.detach().clone())
        return append_kv(layer, k, v)

    def attention_spy(module, query, layer, allowed, scaling):
        out = attention(module, query, layer, allowed, scaling)
        if n[0] in a.calls:
            got[n[0]] = (query.detach().clone(), *raw[id(layer)], allowed.detach().clone(), float(scaling), out.detach(),
                        layer.qk_gguf_order)
        n[0] += 1
        return out

    compute.append_kv, compute.attention = append_spy, attention_spy
    try:
        cache = forward.new_cache(model, CellSpec(a.k, a.k, 0, rot=a.rot, compute=options.LLAMACPP_CPU))
        with torch.inference_mode():
            model(input_ids=ctx.chunk_ids[0][None, :512], cache=cache, kvarn_cache=cache, use_cache=True,
                  logits_to_keep=torch.arange(1))
    finally:
        compute.append_kv, compute.attention = append_kv, attention
    if missing := sorted(set(a.calls) - set(got)):
        raise SystemExit(f"attention calls {missing} not reached: the model made {n[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        f = {x: str(Path(tmp) / f"{x}.bin") for x in "qkvmo"}
        for i, (q, k, v, allowed, scaling, out, gguf) in sorted(got.items()):
            _, H, nq, D = q.shape
            Hkv, L = k.shape[1], k.shape[2]
            qq, kk, vv, kscale = q.float(), k.float(), v.float(), scaling
            if a.prescale:
                qq, kscale = qq * scaling, 1.0
            if gguf:  # llama.cpp holds this architecture's Q and K in the GGUF's channel order
                qq, kk = qq[..., channel_order.gguf_order(D)], kk[..., channel_order.gguf_order(D)]
            if a.rot:
                qq, kk = rotate_blocks(qq, k_rotation_block(D)), rotate_blocks(kk, k_rotation_block(D))
                vv = rotate_blocks(vv, V_ROTATION_BLOCK)
            mask = torch.where(allowed[0, 0, -nq:, -L:], 0.0, float("-inf")).float()
            for x, t in (("q", qq[0]), ("k", kk[0]), ("v", vv[0]), ("m", mask)):
                t.contiguous().numpy().tofile(f[x])
            subprocess.run([str(exe), str(D), str(nq), str(L), str(H), str(Hkv), a.k, a.k, repr(kscale),
                            f["q"], f["k"], f["v"], f["m"], f["o"]], check=True)
            g = torch.from_numpy(np.fromfile(f["o"], dtype=np.float32).reshape(nq, H, D))
            if a.rot:
                g = rotate_blocks(g, V_ROTATION_BLOCK)
            rep = H // Hkv
            fp32 = torch.softmax(q.float() @ k.float().repeat_interleave(rep, 1).transpose(-1, -2) * scaling + mask, -1)
            fp32 = (fp32 @ v.float().repeat_interleave(rep, 1))[0].transpose(0, 1)
            ours = out[0].float()

            def rel(x, y):
                return float((x - y).norm() / y.norm())

            print(f"call {i}: {a.model} {a.k} rot={a.rot} prescale={a.prescale} D={D} n_q={nq} L={L}: "
                  f"|ggml - kvarn|/|ggml| {rel(ours, g):.2e} (max abs {float((ours - g).abs().max()):.1e}); "
                  f"format and kernel together |ggml - fp32|/|ggml| {rel(fp32, g):.2e}")


if __name__ == "__main__":
    main()
