"""Round-trip throughput and storage cost of every registered KV-cache format.

    .venv/bin/python -m bench.perf.formats [--out bench/perf/results/formats.md] [--repeats 11] [--threads 1]

Throughput: MB/s of fp32 input (1 MB = 1e6 bytes) by the CPU time of the one compute thread
(wall time if --threads > 1), median over `--repeats` timed rounds
(each round times every cell once) after one warm-up, for `roundtrip` (the engine's path)
and for `decode(encode(x))` (real packing), at the K/V shapes of one layer of the two embedded models with a 512-token
ubatch. Storage: `fmt.bits_per_value(head_dim)`, metadata included, at head dims 64/128/256.
Formats that raise NotImplementedError (not built yet) or reject a shape are listed as such.
Writes a Markdown report atomically and prints it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from kvarn.files.atomic import write_text
from kvarn.formats import get_format, names

# (label, KV heads, tokens, head dim): one layer's K or V for one ubatch
SHAPES = [("SmolLM2-135M", 3, 512, 64), ("Gemma 3 270M", 1, 512, 256)]
HEAD_DIMS = (64, 128, 256)


def throughput_rows(repeats: int, clock=time.perf_counter) -> list[str]:
    """Time every (format, role, shape, path) cell, `repeats` rounds over all cells.

    Rounds rather than back-to-back repeats: on a shared machine a burst of load then hits
    one sample of many cells instead of every sample of one cell, and the median drops it.
    """
    cells: dict[tuple, object] = {}  # key -> fn, or a note string when it cannot run
    sizes: dict[tuple, int] = {}
    for name in names():
        for role in ("k", "v"):
            fmt = get_format(name, role=role)
            for label, h, t, d in SHAPES:
                x = torch.randn(h, t, d, generator=torch.Generator().manual_seed(0))
                for path, fn in (
                    ("rt", lambda f=fmt, x=x: f.roundtrip(x)),
                    ("enc+dec", lambda f=fmt, x=x: f.decode(f.encode(x))),
                ):
                    key = (name, role, label, path)
                    sizes[key] = x.numel() * 4
                    try:
                        fn()  # warm-up; also finds formats that cannot run this shape
                        cells[key] = fn
                    except NotImplementedError:
                        cells[key] = "not implemented"
                    except ValueError as e:
                        cells[key] = f"n/a ({str(e).split(';')[0][:60]})"
    times: dict[tuple, list[float]] = {k: [] for k, v in cells.items() if callable(v)}
    for _ in range(repeats):
        for key in times:
            t0 = clock()
            cells[key]()
            times[key].append(clock() - t0)

    header = ["format", "role"]
    for label, *_ in SHAPES:
        header += [f"{label} rt", f"{label} enc+dec"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for name in names():
        for role in ("k", "v"):
            out = [f"`{name}`", role.upper()]
            for label, *_ in SHAPES:
                for path in ("rt", "enc+dec"):
                    key = (name, role, label, path)
                    if key in times:
                        out.append(f"{sizes[key] / 1e6 / statistics.median(times[key]):,.0f}")
                    else:
                        out.append(cells[key])
            rows.append("| " + " | ".join(out) + " |")
    return rows


def bits_rows() -> list[str]:
    header = ["format"] + [f"{r} @ {d}" for d in HEAD_DIMS for r in ("K", "V")]
    rows = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for name in names():
        cells = [f"`{name}`"]
        for d in HEAD_DIMS:
            for role in ("k", "v"):
                try:
                    cells.append(f"{get_format(name, role=role).bits_per_value(d):.4g}")
                except NotImplementedError:
                    cells.append("not implemented")
                except ValueError:
                    cells.append("n/a")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "formats.md")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (default 1: steadier on a shared machine)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    # One torch thread computes inline in this thread, so its CPU time is the work done,
    # whatever else the (shared) machine is running; with more threads only wall time works.
    clock, clock_name = (
        (time.thread_time, "CPU time of the single compute thread")
        if args.threads == 1
        else (time.perf_counter, "wall time")
    )

    t0 = time.perf_counter()
    bits = bits_rows()
    thr = throughput_rows(args.repeats, clock)
    shapes = "; ".join(f"{label}: [{h} KV heads, {t} tokens, head dim {d}]" for label, h, t, d in SHAPES)
    text = "\n".join(
        [
            "# KV-cache formats: storage and round-trip throughput",
            "",
            f"Generated by `python -m bench.perf.formats --repeats {args.repeats} --threads {args.threads}` on "
            f"{platform.machine()} CPU, torch {torch.__version__}, {torch.get_num_threads()} threads "
            f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f} "
            f"on {os.cpu_count()} cores); default `rot=True`.",
            "",
            "## Bits per stored value (metadata included)",
            "",
            *bits,
            "",
            f"## Throughput, MB/s of fp32 input (median of {args.repeats} rounds, {clock_name})",
            "",
            f"Shapes (one layer, one 512-token ubatch): {shapes}. `rt` = `roundtrip(x)`, the engine's "
            "path; `enc+dec` = `decode(encode(x))` with real byte packing.",
            "",
            *thr,
            "",
            f"Wall time of this benchmark: {time.perf_counter() - t0:.1f} s. Timings on a shared "
            "machine are noisy (CPU time less so than wall time); compare factors, not percent.",
            "",
        ]
    )
    write_text(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
