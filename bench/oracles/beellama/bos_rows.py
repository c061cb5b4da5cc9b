"""BOS's K and V rows before the cache rounds them: BeeLlama's against kvarn's (issue 21, round 5).

Every chunk starts with BOS, whose post-RoPE K and V rows depend on nothing but the BOS token, so
the two programs round the same pair of rows in every chunk. This compares them per layer:

* BeeLlama's: the `Kcur-L` / `Vcur-L` nodes of its graph (post-RoPE, before llama.cpp rotates them
  for a quantized cache) at `--position`, read by `bos_rows.c` (compiled here against
  `$BEELLAMA_SRC` / `$BEELLAMA_BUILD`) on the first `--tokens` tokens of TEXT in one ubatch;
* kvarn's: what `KVarnLayer.update` receives at that position on the same tokens, under
  `--compute llamacpp-cpu` (llama.cpp's weight arithmetic) and `exact` (fp32, the reference);

and reports per layer the relative L2 difference and, rounded as the rotated q4_0 cache rounds
them (`kvarn.formats` q4_0 with rot, the bytes BeeLlama's own quantizer writes: results
file), how many of the row's 32-value blocks and 4-bit codes differ between the two programs.
Then BOS's path through each layer's MLP (Gemma 3's: `MLP_NODES`) under llamacpp-cpu against
BeeLlama's nodes, with the codes of the down projection's q8 input that the two programs round
differently (`q8_flips`): where the two programs' BOS first part.

    BEELLAMA_SRC=... BEELLAMA_BUILD=... OMP_NUM_THREADS=1 python -m bench.oracles.beellama.bos_rows \\
        --model gemma3-270m [--tokens 512] [--position 0] [--type q4_0] [--out OUT.md]

The GGUF is the model's own (`kvarn.weights.sources.gguf_path`); TEXT defaults to bench.TEXT.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import REPO, TEXT, env_path

HERE = Path(__file__).resolve().parent


def parse_rows(text: str) -> dict[str, list[float]]:
    """bos_rows.c's output: {node name: values}; a name seen more than once keeps its last node
    (the graph names the projection, its reshape and the post-RoPE K all `Kcur-L`: the last is
    the one the cache stores)."""
    out = {}
    for line in text.splitlines():
        name, n, *vals = line.split()
        if int(n) != len(vals):
            raise ValueError(f"node {name}: {n} values announced, {len(vals)} found")
        out[name] = [float(v) for v in vals]
    return out


def build_harness(src: Path, build: Path, exe: Path) -> Path:
    lib = build / "bin"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(HERE / "bos_rows.c"), f"-I{src / 'include'}",
                    f"-I{src / 'ggml' / 'include'}", f"-L{lib}", "-lllama", "-lggml", "-lggml-base",
                    f"-Wl,-rpath,{lib}"], check=True)
    return exe


def beellama_rows(gguf: Path, n_tokens: int, position: int, cache_type: str, tail: int) -> dict[str, list[float]]:
    src, build = env_path("BEELLAMA_SRC", "a BeeLlama checkout"), env_path("BEELLAMA_BUILD", "its cmake build")
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_harness(src, build, Path(tmp) / "bos_rows")
        out = Path(tmp) / "rows.txt"
        subprocess.run([str(exe), str(gguf), str(TEXT), str(n_tokens), str(position), str(out), cache_type,
                        str(tail)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return parse_rows(out.read_text())


# BeeLlama's MLP nodes (bos_rows.c) and where kvarn's Gemma 3 decoder layer has them: (submodule of
# the layer, "out" its output | "in" its input after kvarn's activation rounding, a pre-hook)
MLP_NODES = {"ffn_norm": ("pre_feedforward_layernorm", "out"), "ffn_gate": ("mlp.gate_proj", "out"),
             "ffn_up": ("mlp.up_proj", "out"), "ffn_geglu": ("mlp.down_proj", "in"), "ffn_out": ("mlp", "out"),
             "l_out": ("", "out")}


def kvarn_rows(spec, loaded, chunk_ids, n_tokens: int, position: int, compute: str, cache_dir: str, cell):
    """What kvarn computes at `position` on the first n_tokens tokens of chunk_ids[0]
    (`kvarn.run.load.setup`), one ubatch, in the cache of `cell` (a CellSpec) under `compute`:
    {("k"|"v", layer): fp32 rows [heads, dim] KVarnLayer.update receives} and {"<node>-<layer>":
    fp32 row} for MLP_NODES (`ffn_geglu`: the down projection's input as rounded for its weight)."""
    from dataclasses import replace

    import torch

    from kvarn.kvcache.cache import KVarnLayer
    from kvarn.run import forward, load
    load.set_compute(loaded.model, spec, cache_dir, compute)
    rows = {}
    original = KVarnLayer.update

    def update(self, k, v, *args, **kwargs):
        off = self.n_tokens
        if off <= position < off + k.shape[-2]:
            for role, x in (("k", k), ("v", v)):
                rows[role, self.layer_idx] = x[0, :, position - off, :].float().clone()
        return original(self, k, v, *args, **kwargs)

    def hook(name, which):
        def keep(mod, args, out):
            x = args[0] if which == "in" else (out[0] if isinstance(out, tuple) else out)
            rows[name] = x[0, position].float().reshape(-1).clone()
        return keep

    decoder = next(m for m in loaded.model.modules() if isinstance(m, torch.nn.ModuleList))
    handles = [(layer.get_submodule(mod) if mod else layer).register_forward_hook(hook(f"{node}-{i}", which))
               for i, layer in enumerate(decoder) for node, (mod, which) in MLP_NODES.items()]
    KVarnLayer.update = update
    try:
        cache = forward.new_cache(loaded.model, replace(cell, compute=compute))
        with torch.inference_mode():
            loaded.model(input_ids=chunk_ids[0:1, :n_tokens], cache=cache, kvarn_cache=cache, use_cache=True,
                         logits_to_keep=1)
    finally:
        KVarnLayer.update = original
        for h in handles:
            h.remove()
    return rows


def q8_flips(x, rounded, kind: str) -> list[tuple[int, float]]:
    """Where `rounded` (one program's input to a weight, as llama.cpp rounds it for `kind`: q8_0,
    q8_1, q8_K) holds another code than x (the other program's value before rounding) rounded the
    same way: [(index, x / d)], d the block's step; a difference of less than d/2 (the two programs'
    d differing by fp32 noise) is not a flip."""
    from kvarn.llamacpp_cpu.activations import round_activations

    if kind not in ("q8_0", "q8_1", "q8_K"):
        raise ValueError(f"activation type {kind!r}: accepted q8_0, q8_1, q8_K")
    n = 256 if kind == "q8_K" else 32
    rx = round_activations(x[None], kind)[0]
    d = (x.reshape(-1, n).abs().amax(-1, keepdim=True) / 127).expand(-1, n).reshape(-1)
    flips = ((rx - rounded).abs() > d / 2).nonzero().flatten().tolist()
    return [(i, float(x[i] / d[i])) for i in flips]


def compare(a, b, fmt) -> dict:
    """Two rows [heads, dim] (torch fp32): relative L2 difference, max |difference|, and after the
    format's rounding (rotation included) how many blocks and codes differ, and max |difference|
    of the dequantized rows."""
    from kvarn.formats.blocks import QK, unpack_blocks

    d = (a - b).norm() / b.norm()
    x = [r[None, :, None, :] for r in (a, b)]  # [batch, heads, tokens, dim]
    packed = [fmt.encode(t).data.reshape(-1, fmt.spec.block_bytes) for t in x]
    blocks = int((packed[0] != packed[1]).any(dim=1).sum())
    q = [unpack_blocks(fmt.spec, p)[0].reshape(-1) for p in packed]
    deq = [fmt.roundtrip(t) for t in x]
    return {"rel_l2": float(d), "max_abs": float((a - b).abs().max()), "blocks": blocks,
            "n_blocks": packed[0].shape[0], "codes": int((q[0] != q[1]).sum()), "n_codes": a.numel(),
            "deq_max_abs": float((deq[0] - deq[1]).abs().max()), "qk": QK}


def table(rows_bee, rows_cpp, rows_exact, type_name: str) -> str:
    import torch

    from kvarn.kvcache.cache import make_format

    lines = [f"| layer | role | llamacpp-cpu vs BeeLlama: rel. L2 | max abs | {type_name} blocks differing | codes "
             "differing | exact vs BeeLlama: rel. L2 | blocks differing | codes differing |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (role, layer) in sorted((k for k in rows_cpp if isinstance(k, tuple)), key=lambda rl: (rl[1], rl[0])):
        name = f"{'K' if role == 'k' else 'V'}cur-{layer}"
        if name not in rows_bee:
            continue
        fmt = make_format(type_name, role, True, 0)
        ours = rows_cpp[role, layer]
        bee = torch.tensor(rows_bee[name], dtype=torch.float32).reshape(ours.shape)
        c = compare(ours, bee, fmt)
        e = compare(rows_exact[role, layer], bee, fmt)
        lines.append(f"| {layer} | {role.upper()} | {c['rel_l2']:.2e} | {c['max_abs']:.2e} | {c['blocks']} / "
                     f"{c['n_blocks']} | {c['codes']} / {c['n_codes']} | {e['rel_l2']:.2e} | {e['blocks']} / "
                     f"{e['n_blocks']} | {e['codes']} / {e['n_codes']} |")
    return "\n".join(lines) + "\n"


def mlp_table(rows_bee, rows_cpp, kinds: dict[int, str]) -> str:
    """Per layer, BOS's MLP nodes llamacpp-cpu vs BeeLlama (relative L2), and the codes of the down
    projection's rounded input that differ (`q8_flips`; kinds: layer -> its activation type), the
    first with its x/d and whether fp16(gate) (what ggml's GELU table reads) differs there."""
    import torch

    nodes = [n for n in MLP_NODES if n != "ffn_geglu"]
    lines = ["| layer | " + " | ".join(f"{n} rel. L2" for n in nodes) + " | down input codes differing | first: "
             "index, BeeLlama x/d, fp16(gate) BeeLlama / kvarn |", "|" + "---|" * (len(nodes) + 3)]
    layers = sorted({int(k.rsplit("-", 1)[1]) for k in rows_cpp if isinstance(k, str)})
    for i in layers:
        if f"l_out-{i}" not in rows_bee:
            continue
        bee = {n: torch.tensor(rows_bee[f"{n}-{i}"]) for n in MLP_NODES}
        cells = [f"{float((rows_cpp[f'{n}-{i}'] - bee[n]).norm() / bee[n].norm()):.1e}" for n in nodes]
        flips = q8_flips(bee["ffn_geglu"], rows_cpp[f"ffn_geglu-{i}"], kinds[i])
        first = "—"
        if flips:
            j, t = flips[0]
            gb, go = float(bee["ffn_gate"][j].half()), float(rows_cpp[f"ffn_gate-{i}"][j].half())
            first = f"{j}, {t:.6f}, {gb:.9g} / {go:.9g}"
        lines.append(f"| {i} | " + " | ".join(cells) + f" | {len(flips)} / {bee['ffn_geglu'].numel()} | {first} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=512, help="tokens in the one ubatch (default 512, as the runs)")
    ap.add_argument("--position", type=int, default=0)
    ap.add_argument("--type", default="q4_0", help="the cache type of both programs' run (f16, bf16, q4_0: rotated), "
                    "and the block type the rows are compared after (q4_0 for a float type)")
    ap.add_argument("--tail", type=int, default=128, help="--kv-tail-tokens / --tail of both runs")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not 0 <= args.position < args.tokens:
        ap.error(f"--position {args.position}: must be in 0..{args.tokens - 1} (--tokens {args.tokens})")
    from kvarn.run import load
    from kvarn.weights import sources

    spec = sources.parse_model(args.model)
    cache_dir = str(REPO / "resources" / "models")
    from kvarn.vocab.cell import CellSpec

    if args.type not in ("f16", "bf16", "q4_0"):
        ap.error(f"--type {args.type!r}: accepted f16, bf16, q4_0")
    cell = CellSpec(args.type, args.type, args.tail)
    bee = beellama_rows(sources.gguf_path(spec, cache_dir), args.tokens, args.position, args.type, args.tail)
    loaded, chunk_ids, _ = load.setup(spec, args.tokens, 1, str(TEXT), "cpu", "auto", cache_dir)
    cpp, exact = (kvarn_rows(spec, loaded, chunk_ids, args.tokens, args.position, c, cache_dir, cell)
                  for c in ("llamacpp-cpu", "exact"))
    text = table(bee, cpp, exact, "q4_0" if args.type in ("f16", "bf16") else args.type)
    load.set_compute(loaded.model, spec, cache_dir, "llamacpp-cpu")
    types = loaded.model._kvarn_activation_types  # kvarn.llamacpp_cpu.activations: module name -> its input's rounding
    kinds = {int(n.split("layers.")[1].split(".")[0]): k for n, k in types.items() if n.endswith("mlp.down_proj")}
    text += "\nBOS's MLP, llamacpp-cpu against BeeLlama:\n\n" + mlp_table(bee, cpp, kinds)
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
