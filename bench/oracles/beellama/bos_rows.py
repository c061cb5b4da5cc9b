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


def kvarn_rows(spec, loaded, chunk_ids, n_tokens: int, position: int, compute: str, cache_dir: str, cell):
    """{("k"|"v", layer): fp32 rows [heads, dim]} that KVarnLayer.update receives at `position` on
    the first n_tokens tokens of chunk_ids[0] (`kvarn.run.engine.setup`), one ubatch, in the cache of
    `cell` (a CellSpec) under `compute`."""
    from dataclasses import replace

    import torch

    from kvarn.kvcache.cache import KVarnLayer
    from kvarn.run import engine
    engine.set_compute(loaded.model, spec, cache_dir, compute)
    rows = {}
    original = KVarnLayer.update

    def update(self, k, v, *args, **kwargs):
        off = self.n_tokens
        if off <= position < off + k.shape[-2]:
            for role, x in (("k", k), ("v", v)):
                rows[role, self.layer_idx] = x[0, :, position - off, :].float().clone()
        return original(self, k, v, *args, **kwargs)

    KVarnLayer.update = update
    try:
        cache = engine.new_cache(loaded.model, replace(cell, compute=compute))
        with torch.inference_mode():
            loaded.model(input_ids=chunk_ids[0:1, :n_tokens], cache=cache, kvarn_cache=cache, use_cache=True,
                         logits_to_keep=1)
    finally:
        KVarnLayer.update = original
    return rows


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
    for (role, layer) in sorted(rows_cpp, key=lambda rl: (rl[1], rl[0])):
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
    from kvarn.run import engine
    from kvarn.weights import sources

    spec = sources.parse_model(args.model)
    cache_dir = str(REPO / "resources" / "models")
    from kvarn.spec.cell import CellSpec

    if args.type not in ("f16", "bf16", "q4_0"):
        ap.error(f"--type {args.type!r}: accepted f16, bf16, q4_0")
    cell = CellSpec(args.type, args.type, args.tail)
    bee = beellama_rows(sources.gguf_path(spec, cache_dir), args.tokens, args.position, args.type, args.tail)
    loaded, chunk_ids, _ = engine.setup(spec, args.tokens, 1, str(TEXT), "cpu", "auto", cache_dir)
    cpp, exact = (kvarn_rows(spec, loaded, chunk_ids, args.tokens, args.position, c, cache_dir, cell)
                  for c in ("llamacpp-cpu", "exact"))
    text = table(bee, cpp, exact, "q4_0" if args.type in ("f16", "bf16") else args.type)
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
