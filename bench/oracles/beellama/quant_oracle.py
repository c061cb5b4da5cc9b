"""Bit-exactness of kvarn.formats against BeeLlama's own CPU quantizers (issue 21, item 1).

BeeLlama (the study's llama.cpp fork) is not part of this repository. Give an already-built
copy through the environment:

    BEELLAMA_SRC=<source checkout>  BEELLAMA_BUILD=<its cmake build dir, with bin/libggml*.so>
    [BEELLAMA_RUNS=<scratch dir, default $BEELLAMA_BUILD/kvarn-runs>]
    python -m bench.oracles.beellama.quant_oracle [--real] [--out bench/oracles/beellama/results/beellama.md]

It compiles our harness `bench/oracles/beellama/quant_oracle.c` against that build (cached in
BEELLAMA_RUNS), feeds it and kvarn the same float32 inputs, and compares:

* block types: fp16 d, fp16 m and every code of every 32-value block, after reading
  BeeLlama's byte layout (`beellama_block_fields`; for the upstream types the raw bytes too);
* KVarN records (`GGML_OP_KVARN_STORE` on the CPU backend): the payload bitstream and the three
  fp16 arrays (scale, zero, other) of every (group, head, 128-channel slice) tile.

The parsers (bench/oracles/beellama/quant_fields.py) are tested without a build in
tests/test_beellama_oracle.py, against a committed fixture of BeeLlama-produced bytes; the
variants a difference is checked against: bench/oracles/beellama/quant_variants.py.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from bench import TEXT, env_path
from bench.oracles.beellama.quant_fields import (beellama_block_fields, kvarn_block_fields, kvarn_records,
                                                 record_fields)
from bench.oracles.beellama.quant_variants import libm_math, pass_choice
from kvarn.formats import kvarn_tiles
from kvarn.formats.hadamard import k_rotation_block, rotate_blocks

HERE = Path(__file__).resolve().parent

# kvarn name -> BeeLlama's ggml type name. BeeLlama's `-ctk q2_0` is GGML_TYPE_Q2_0S
# ("q2_0s", 32-value blocks; its common/arg.cpp maps the cache name), not upstream Q2_0.
BLOCK_TYPES = {n: ("q2_0s" if n == "q2_0" else n) for n in
               ("q8_0", "q6_0", "q6_1", "q5_0", "q5_1", "q4_0", "q4_1", "iq4_nl", "q3_0", "q3_1", "q2_0", "q2_1")}
KVARN_BITS = (2, 3, 4, 5, 6, 8)


# --- the harness ---------------------------------------------------------------------------------
def _env():
    src = env_path("BEELLAMA_SRC", "a BeeLlama source checkout")
    build = env_path("BEELLAMA_BUILD", "BeeLlama's cmake build directory, with bin/libggml-base, libggml-cpu, libggml")
    runs = Path(os.environ.get("BEELLAMA_RUNS", build / "kvarn-runs"))
    runs.mkdir(parents=True, exist_ok=True)
    return src, build, runs


def build_harness() -> Path:
    src, build, runs = _env()
    exe, c = runs / "quant_oracle", HERE / "quant_oracle.c"
    if not exe.exists() or exe.stat().st_mtime < c.stat().st_mtime:
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-O2", "-std=c11", "-Wall", "-o", str(exe), str(c), f"-I{src}/ggml/include",
                        f"-L{build}/bin", "-lggml-cpu", "-lggml-base", "-lggml", f"-Wl,-rpath,{build}/bin"], check=True)
    return exe


def _run(args: list, x: np.ndarray, tag: str) -> np.ndarray:
    _, _, runs = _env()
    inp, out = runs / f"{tag}.f32", runs / f"{tag}.bin"
    np.ascontiguousarray(x, "<f4").tofile(inp)
    subprocess.run([str(build_harness()), *map(str, args), inp, out], check=True)
    return np.fromfile(out, np.uint8)


def beellama_blocks(name: str, x: np.ndarray) -> np.ndarray:
    """BeeLlama's CPU from_float of every row of x [N, n] -> its raw bytes."""
    return _run(["blocks", BLOCK_TYPES[name], x.shape[-1]], x.reshape(-1, x.shape[-1]), f"blocks-{name}")


def beellama_records(x: np.ndarray, bits: int, role: str, iters: int = kvarn_tiles.ITERS) -> np.ndarray:
    """BeeLlama's KVarN store of x [T, H, D] -> uint8 [T/128, H * D/128, tile bytes]."""
    t, h, d = x.shape
    raw = _run(["kvarn", bits, role, d, h, iters], x, f"kvarn{bits}-{role}-{d}")
    return raw.reshape(t // 128, h * d // 128, -1)


# --- inputs --------------------------------------------------------------------------------------
def synthetic_inputs(d: int, seed: int = 0, t: int = 256, h: int = 2) -> dict[str, np.ndarray]:
    """[T, H, D] float32 inputs: random, rounding ties, constant channel, zero tile, outlier channel."""
    g = np.random.default_rng(seed + d)
    rnd = g.standard_normal((t, h, d)).astype(np.float32)
    # ties: every 32-block has |max| = 8 at its first position (d = -1 for q4_0, a power of two
    # for every symmetric type) and the rest on half-integers, so x/d lands exactly on .5
    ties = (g.integers(-16, 16, (t, h, d)) + 0.5).astype(np.float32) / 2
    ties[..., ::32] = -8.0
    const = rnd.copy()
    const[:, :, 3] = 0.75  # one channel constant over every token
    zero = rnd.copy()
    zero[:128, 0, :] = 0.0  # head 0, group 0: an all-zero tile
    outlier = rnd.copy()
    outlier[:, :, 5] *= 50.0
    return {"random": rnd, "ties": ties, "const-channel": const, "zero-tile": zero, "outlier-channel": outlier}


def fixture_input(t: int, h: int, d: int, seed: int) -> np.ndarray:
    """Deterministic float32 [T, H, D] from integer hashing alone (splitmix64; no RNG whose
    stream could change between library versions): sums of 4 uniforms, per-channel scales
    in [0.25, 4), channel 5 times 30 (an outlier), channel 3 constant 0.75."""
    def mix(z):
        z = (z + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    with np.errstate(over="ignore"):
        i = np.arange(t * h * d * 4, dtype=np.uint64) + np.uint64(seed) * np.uint64(1 << 40)
        u = (mix(i) >> np.uint64(40)).astype(np.float64) / float(1 << 24)  # [0, 1), 24 bits
        x = (u.reshape(t, h, d, 4).sum(-1) - 2.0).astype(np.float32)
        c = np.arange(d, dtype=np.uint64) + np.uint64(seed + 7) * np.uint64(1 << 41)
        scale = np.float32(0.25) * np.float32(16.0) ** ((mix(c) >> np.uint64(40)).astype(np.float32) / (1 << 24))
    x = x * scale.astype(np.float32)
    x[..., 5] *= np.float32(30.0)
    x[..., 3] = np.float32(0.75)
    return x


# the committed fixture (tests/fixtures/beellama/): (name, format, role, T, H, D, seed)
FIXTURE_KVARN = (("kvarn4_k_d256", 4, "k", 128, 1, 256, 1), ("kvarn2_v_d128", 2, "v", 128, 1, 128, 2),
                 ("kvarn6_k_d128", 6, "k", 128, 1, 128, 3))
FIXTURE_BLOCKS = (8, 1, 128, 4)  # T, H, D, seed: 32 blocks per type


def fixture_block_input() -> np.ndarray:
    """The blocks' fixture input [8, 128]: deterministic, with rows 0-1 on exact rounding ties.
    Row 0: each block starts with -8 (every symmetric type's d a power of two), the rest on
    odd multiples of 1/8; row 1: each block starts with -127/16 (q8_0's 127/amax = 16), the
    rest on odd multiples of 1/32."""
    t, h, d, seed = FIXTURE_BLOCKS
    x = fixture_input(t, h, d, seed).reshape(t, d)
    x[0] = np.round(x[0] * 4) / 4 + np.float32(0.125)
    x[0, ::32] = -8.0
    x[1] = np.clip(np.round(x[1] * 16) / 16, -7.5, 7.5) + np.float32(1 / 32)
    x[1, ::32] = -127 / 16
    return x.astype(np.float32)


def write_fixture(out: Path, src_commit: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for name, bits, role, t, h, d, seed in FIXTURE_KVARN:
        arrays[name] = beellama_records(fixture_input(t, h, d, seed), bits, role)
    xb = fixture_block_input()
    for name in BLOCK_TYPES:
        arrays[f"block_{name}"] = beellama_blocks(name, xb)
    np.savez(out / "beellama_cpu.npz", **arrays)
    import json

    (out / "provenance.json").write_text(json.dumps({
        "program": "BeeLlama (llama.cpp fork), https://github.com/Anbeeld/beellama.cpp",
        "commit": src_commit,
        "build": "cmake -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON (CPU backend, x86-64 with AVX2/AVX-512)",
        "command": "python -m bench.oracles.beellama.quant_oracle --fixture tests/fixtures/beellama",
        "harness": "bench/oracles/beellama/quant_oracle.c: ggml_kvarn_store on the CPU backend (SWA ring, eager records, "
                   "head-wide Hadamard slices) and type_traits_cpu from_float",
        "inputs": "bench/oracles/beellama/quant_oracle.py fixture_input / fixture_block_input (FIXTURE_KVARN, FIXTURE_BLOCKS)",
        "iters": kvarn_tiles.ITERS,
    }, indent=1) + "\n")




def real_kv(n_tokens: int = 384, cache_dir: str = "resources/models", text: str = str(TEXT)) -> dict[str, np.ndarray]:
    """Gemma 3 270M's post-RoPE K and V (head dim 256, 1 KV head) on Wikitext's first
    tokens (fewer than its 512-token sliding window, so every layer holds all of them), every
    layer's heads side by side: {"gemma3 K": [T, layers, 256], "gemma3 V": ...}."""
    from kvarn.weights import models
    from kvarn.weights import sources
    from kvarn.baseline.data import load_text, tokenize

    lm = models.load(sources.parse_model("gemma3-270m"), cache_dir=cache_dir, device="cpu", dtype=torch.float32)
    ids = tokenize(lm.tokenizer, load_text(text))[:n_tokens][None]
    with torch.no_grad():
        cache = lm.model(ids, use_cache=True).past_key_values
    # cache.layers[i].keys: [1, H, T, D] -> [T, H, D]; layers side by side as heads
    k = torch.cat([lay.keys[0].transpose(0, 1) for lay in cache.layers], 1)
    v = torch.cat([lay.values[0].transpose(0, 1) for lay in cache.layers], 1)
    return {"gemma3 K": k.float().contiguous().numpy(), "gemma3 V": v.float().contiguous().numpy()}


# --- comparisons ---------------------------------------------------------------------------------
def compare_blocks(name: str, x: np.ndarray) -> dict:
    bq, bd, bm = beellama_block_fields(name, beellama_blocks(name, x))
    kq, kd, km = kvarn_block_fields(name, x.reshape(-1, x.shape[-1]))
    row = {"blocks": len(bq), "d": int((bd != kd).sum()), "m": int((bm != km).sum()) if bm is not None else None,
           "codes": int((bq != kq).any(1).sum())}
    row["any"] = int(((bd != kd) | (bq != kq).any(1) | ((bm != km) if bm is not None else False)).sum())
    return row


def compare_records(bee: np.ndarray, ours: np.ndarray, bits: int) -> dict:
    b, o = record_fields(bee, bits), record_fields(ours, bits)
    diff = [(x != y).reshape(*x.shape[:2], -1).any(-1) for x, y in zip(b, o)]
    return {"tiles": diff[0].size, **{k: int(v.sum()) for k, v in zip(("payload", "scale", "zero", "other"), diff)},
            "any": int(np.logical_or.reduce(diff).sum())}


def _summary(rows, key, real, n, diff, head, unit):
    """Rows summed per rows[key]: compared / differing on the synthetic inputs and on Gemma 3."""
    acc: dict = {}
    for r in rows:
        a = acc.setdefault(r[key], [0, 0, 0, 0])
        i = 2 if real(r) else 0
        a[i] += r[n]
        a[i + 1] += r[diff]
    return _fmt_table([head, f"synthetic {unit}", "differing", f"Gemma 3 {unit}", "differing"],
                      [[k, *v] for k, v in acc.items()])


def _fmt_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join("—" if c is None else str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="add Gemma 3 270M's post-RoPE K/V (needs the model)")
    ap.add_argument("--text", default=str(TEXT), help="wiki.test.raw for --real (default $TEXT, else ../shared beside the checkout)")
    ap.add_argument("--out", help="write the markdown tables here (default: stdout only)")
    ap.add_argument("--libm", action="store_true", help="KVarN exp/log from the C library (slow; see libm_math)")
    ap.add_argument("--fixture", help="write the test fixture (BeeLlama's bytes) into this directory and stop")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.fixture:
        src = _env()[0]
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        write_fixture(Path(args.fixture), commit or os.environ.get("BEELLAMA_COMMIT", "unknown"))
        return 0
    inputs = {f"{k} D{d}": v for d in (128, 256, 512) for k, v in synthetic_inputs(d).items()}
    if args.real:
        inputs.update(real_kv(text=args.text))

    brows = []
    for label, x in inputs.items():
        d = x.shape[-1]
        xr = rotate_blocks(torch.from_numpy(x), k_rotation_block(d)).numpy()
        for rot, data in (("no", x), ("K rot", xr)):
            if rot == "K rot" and not label.startswith(("random", "gemma3")):
                continue
            for name in BLOCK_TYPES:
                r = compare_blocks(name, data)
                brows.append([name, label, rot, r["blocks"], r["any"], r["d"], r["m"], r["codes"]])
    t1 = _summary(brows, key=0, real=lambda r: r[1].startswith("gemma3"), n=3, diff=4, head="type", unit="blocks")
    t1 += "\n\nRows with a difference:\n\n" + _fmt_table(
        ["type", "input", "rotation", "blocks", "differing", "d differs", "m differs", "codes differ"],
        [r for r in brows if r[4]])

    krows = []
    for label, x in inputs.items():
        role = "v" if label.endswith(" V") else "k"
        roles = (role,) if label.startswith("gemma3") else ("k", "v")
        for role in roles:
            for bits in KVARN_BITS:
                bee = beellama_records(x, bits, role)
                if args.libm:
                    with libm_math():
                        ours = kvarn_records(x, bits, role)
                else:
                    ours = kvarn_records(x, bits, role)
                r = compare_records(bee, ours, bits)
                krows.append([f"kvarn{bits}", role.upper(), label, r["tiles"], r["any"], r["payload"], r["scale"],
                              r["zero"], r["other"]])
    t2 = _summary([[f"{r[0]} {r[1]}", *r[1:]] for r in krows], key=0, real=lambda r: r[2].startswith("gemma3"),
                  n=3, diff=4, head="format", unit="tiles")
    t2 += "\n\nRows with a difference:\n\n" + _fmt_table(
        ["format", "role", "input", "tiles", "differing", "payload", "scale", "zero", "other"], [r for r in krows if r[4]])
    prows = []
    for label, x in inputs.items() if not args.libm else ():
        if not (label.startswith(("random", "const", "outlier")) or label.startswith("gemma3")):
            continue
        roles = ("v" if label.endswith(" V") else "k",) if label.startswith("gemma3") else ("k", "v")
        for role in roles:
            r = pass_choice(x, role)
            prows.append([label, role.upper(), r["tiles"], r["v1 pass"], r["v1 values"], r["v2 pass"], r["v2 values"],
                          r["values"]])
    t3 = _fmt_table(["input", "role", "tiles", "v1: other pass", "v1: values differ", "v2: other pass",
                     "v2: values differ", "values"], prows)
    math_name = "C library expf/logf (--libm)" if args.libm else "float64, rounded to fp32 (default)"
    text = (f"### Block types (d, m, codes per 32-value block)\n\n{t1}\n\n"
            f"### KVarN records (payload, scale, zero, other per tile; kvarn exp/log: {math_name})\n\n{t2}\n")
    if prows:
        text += f"\n### KVarN normalization pass kept, against BeeLlama's arithmetic (kvarn4)\n\n{t3}\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
