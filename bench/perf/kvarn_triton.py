"""KVarN throughput: torch reference vs Triton kernels; writes bench/perf/results/kvarn.md.

    .venv/bin/python -m bench.perf.kvarn_triton [--quick]

MB/s counts the fp32 input (4 bytes per K or V value) per second. Without CUDA the
Triton kernels run under TRITON_INTERPRET=1 (numpy, one tile at a time): that number
says only that the interpreter is slow, not how fast the kernel is. With CUDA the
kernel's quantize throughput is also given as a fraction of the device memory
bandwidth, measured by a large device-to-device copy.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from kvarn.files.atomic import write_text  # noqa: E402
from kvarn.formats import get_format  # noqa: E402
from kvarn.formats import kvarn_tiles, kvarn_type  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "kvarn.md"


def _time(fn, min_s=0.3, max_reps=30):
    fn()  # warm-up (and Triton compile)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        sync()
        dt = time.perf_counter() - t0
        if dt >= min_s or reps >= max_reps:
            return dt / reps


def bench_reference(shapes, widths, nt):
    torch.set_num_threads(nt)
    rows = []
    for shape in shapes:
        x = torch.randn(*shape)
        mb = x.numel() * 4 / 1e6
        for bits in widths:
            for role in "kv":
                fmt = get_format(f"kvarn{bits}", role=role, impl="ref")
                t_rt = _time(lambda: fmt.roundtrip(x))
                packed = fmt.encode(x)
                t_enc = _time(lambda: fmt.encode(x))
                t_dec = _time(lambda: fmt.decode(packed))
                rows.append((nt, shape, bits, role, mb / t_rt, mb / t_enc, mb / t_dec))
    return rows


def bench_triton_interpreted(widths):
    from kvarn.formats import kvarn_triton as T

    rows = []
    for rc in ((64, 128), (128, 128)):
        tiles = torch.randn(2, *rc)
        mb = tiles.numel() * 4 / 1e6
        for bits in widths:
            t_q = _time(lambda: T.quantize_pack(tiles, bits, 16), min_s=0.2, max_reps=3)
            out = T.quantize_pack(tiles, bits, 16)
            t_d = _time(lambda: T.unpack_dequantize(*out, bits), min_s=0.2, max_reps=3)
            t_ref = _time(lambda: kvarn_type.quantize_pack_ref(tiles, bits, 16), min_s=0.2)
            rows.append((rc, bits, mb / t_q, mb / t_d, mb / t_ref))
    return rows


def bench_triton_cuda(widths):
    from kvarn.formats import kvarn_triton as T

    big = torch.empty(2**28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(big)
    t_copy = _time(lambda: dst.copy_(big))
    bw = 2 * big.numel() * 4 / t_copy / 1e9  # GB/s, read + write
    rows = []
    for rc in ((64, 128), (128, 128)):
        tiles = torch.randn(16384, *rc, device="cuda")
        mb = tiles.numel() * 4 / 1e6
        for bits in widths:
            t_q = _time(lambda: T.quantize_pack(tiles, bits, 16))
            out = T.quantize_pack(tiles, bits, 16)
            t_d = _time(lambda: T.unpack_dequantize(*out, bits))
            moved = tiles.numel() * 4 + sum(o.numel() * o.element_size() for o in out)  # bytes read + written
            rows.append((rc, bits, mb / t_q, mb / t_d, moved / t_q / 1e9 / bw))
    return bw, rows


def bits_table():
    lines = ["| width | D=64 K | D=64 V | D=128 | D=256 | D=512 |", "|---|---:|---:|---:|---:|---:|"]
    for bits in range(2, 9):
        k, v = get_format(f"kvarn{bits}", role="k"), get_format(f"kvarn{bits}", role="v")
        cells = [k.bits_per_value(64), v.bits_per_value(64), k.bits_per_value(128), k.bits_per_value(256), k.bits_per_value(512)]
        lines.append(f"| kvarn{bits} | " + " | ".join(f"{c:g}" for c in cells) + " |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and widths")
    args = ap.parse_args()
    widths = (2, 4) if args.quick else (2, 4, 8)
    shapes = [(3, 1024, 64), (8, 1024, 128), (1, 1024, 256)]
    if args.quick:
        shapes = shapes[:1]
    cpu_threads = torch.get_num_threads()

    lines = [
        "# KVarN throughput",
        "",
        f"Written by `bench/perf/kvarn_triton.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs (torch default {cpu_threads} threads), "
        f"CUDA: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}.",
        f"MB/s = fp32 input bytes (4 per K or V value) per second. G = {kvarn_tiles.GROUP} tokens, "
        f"iters = {kvarn_tiles.ITERS}.",
        "",
        "## Torch reference (CPU)",
        "",
        "`roundtrip` skips the bit packing; `encode` = rotate + normalize + quantize + pack; "
        "`decode` = unpack + dequantize + rotate back. The machine was shared with other jobs "
        "(load well above its core count), so treat these as lower bounds. One intra-op "
        "thread throughout, except the last rows (torch's default thread count): on a loaded "
        "machine extra threads mostly wait for each other.",
        "",
        "| threads | x shape [heads, tokens, D] | width | role | roundtrip MB/s | encode MB/s | decode MB/s |",
        "|---:|---|---:|---|---:|---:|---:|",
    ]
    rows = bench_reference(shapes, widths, 1)
    if cpu_threads > 1:
        rows += bench_reference(shapes[:1], (4,), cpu_threads)
    for nt, shape, bits, role, rt, enc, dec in rows:
        lines.append(f"| {nt} | {list(shape)} | {bits} | {role.upper()} | {rt:.1f} | {enc:.1f} | {dec:.1f} |")
    torch.set_num_threads(1)

    lines += ["", "## Triton kernels", ""]
    if torch.cuda.is_available():
        bw, rows = bench_triton_cuda(widths)
        lines += [
            f"Device copy bandwidth (1 GiB device-to-device, read + write): {bw:.0f} GB/s.",
            "",
            "| tile R x C | width | quantize+pack MB/s | unpack+dequantize MB/s | quantize bytes moved / copy bandwidth |",
            "|---|---:|---:|---:|---:|",
        ]
        for rc, bits, q, d, frac in rows:
            lines.append(f"| {rc[0]}x{rc[1]} | {bits} | {q:.0f} | {d:.0f} | {frac:.2f} |")
    else:
        lines += [
            "No CUDA here: the kernels ran under `TRITON_INTERPRET=1` (numpy, one program per "
            "tile, 2 tiles). These numbers measure the interpreter, not the kernel; on a GPU "
            "rerun this script for real figures.",
            "",
            "| tile R x C | width | quantize+pack MB/s (interpreted) | unpack+dequantize MB/s (interpreted) | reference quantize+pack MB/s, same tiles |",
            "|---|---:|---:|---:|---:|",
        ]
        for rc, bits, q, d, ref in bench_triton_interpreted(widths):
            lines.append(f"| {rc[0]}x{rc[1]} | {bits} | {q:.3f} | {d:.2f} | {ref:.1f} |")

    torch.set_num_threads(cpu_threads)
    lines += ["", "## Stored bits per value (metadata included, G = 128)", ""] + bits_table() + [""]

    write_text(OUT, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
