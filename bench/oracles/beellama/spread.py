"""How far a row's KLD moves with the SIMD level alone, per program (issue 21: tracing a row).

Two grid folders (grid.py) of one model, n_ctx and chunk count that score against one base file
(checked: the same file, or the same size and sha256): A run by the builds native to the machine
(BeeLlama with `-DGGML_NATIVE=ON`, torch at the CPU's own capability), B by another SIMD level
on the same machine and tokens (e.g. BeeLlama built with `-DGGML_NATIVE=OFF -DGGML_AVX2=ON`, and
kvarn's cells with `ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`
in the environment). Nothing else differs, so B / A of one program is the spread its own
rounding draws give a row, to set beside the issue's 10 % target on llamacpp-cpu / BeeLlama.

Per row and program: median and mean KLD in A and in B and B / A; per row and folder:
llamacpp-cpu / BeeLlama (the target's ratio) in A, in B, and across (A's kvarn over B's
BeeLlama, B's over A's).

    python -m bench.oracles.beellama.spread --model gemma3-270m --chunks 4 \\
        --a RUNS_NATIVE --b RUNS_AVX2 --rows bf16-t0 kvarn2-t0
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from bench.oracles.beellama import memory
from bench.oracles.beellama.grid import parse_row, run_dir
from bench.oracles.beellama.orderings import KEYS, PROGRAMS, collect
from bench.oracles.beellama.table import md_lines, ratio
from bench.oracles.llamacpp.runs import fmt

BASE = "base.kld"


def sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_same_base(a: Path, b: Path) -> str:
    """How A's and B's base files were found equal ("one file", "sha256 <hex>"); ValueError when
    either is missing or they differ: the two folders' KLDs would not be over one reference."""
    fa, fb = a / BASE, b / BASE
    for f in (fa, fb):
        if not f.is_file():
            raise ValueError(f"{f}: no base file; both folders must score against one base.kld")
    if fa.samefile(fb):
        return "one file (hard link)"
    if fa.stat().st_size != fb.stat().st_size:
        raise ValueError(f"{fa} and {fb} differ in size: not one base file")
    ha, hb = sha256(fa), sha256(fb)
    if ha != hb:
        raise ValueError(f"{fa} and {fb} differ (sha256 {ha[:12]}… vs {hb[:12]}…): not one base file")
    return f"sha256 {ha}"


def spread_tables(a: Path, b: Path, names: list[str]) -> str:
    """The two tables (module doc) of the rows `names` whose runs exist in A or B."""
    how = check_same_base(a, b)
    sa, sb = collect(a, names), collect(b, names)
    get = lambda s, row, prog, key: s.get(row, {}).get(prog, {}).get(key)  # noqa: E731
    rows = []
    for name in names:
        for prog in PROGRAMS:
            if get(sa, name, prog, KEYS[0]) is None and get(sb, name, prog, KEYS[0]) is None:
                continue
            cells = [name, prog]
            for key in KEYS:
                x, y = get(sa, name, prog, key), get(sb, name, prog, key)
                cells += [fmt(x), fmt(y), ratio(y, x, 3)]
            rows.append(cells)
    head = ["row", "program", "A median", "B median", "B / A", "A mean", "B mean", "B / A"]
    cross = []
    for name in names:
        for key in KEYS:
            k = lambda s: get(s, name, "llamacpp-cpu", key)  # noqa: E731
            bee = lambda s: get(s, name, "BeeLlama", key)  # noqa: E731
            vals = [ratio(k(sa), bee(sa), 3), ratio(k(sb), bee(sb), 3), ratio(k(sa), bee(sb), 3), ratio(k(sb), bee(sa), 3)]
            if any(v != "—" for v in vals):
                cross.append([name, key[4:], *vals])
    chead = ["row", "KLD", "A: llamacpp-cpu / BeeLlama", "B: llamacpp-cpu / BeeLlama",
             "A's llamacpp-cpu / B's BeeLlama", "B's llamacpp-cpu / A's BeeLlama"]
    lines = [f"A: `{a}`; B: `{b}`; base file: {how}.", "",
             "#### Each program's KLD under the two SIMD levels", "", *md_lines(head, rows), "",
             "#### The target's ratio within and across the two", "", *md_lines(chead, cross)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--a", type=Path, required=True, metavar="RUNS", help="BEELLAMA_RUNS of the native builds")
    ap.add_argument("--b", type=Path, required=True, metavar="RUNS", help="BEELLAMA_RUNS of the other SIMD level")
    ap.add_argument("--model", choices=sorted(memory.MODELS), required=True)
    ap.add_argument("-c", "--ctx", type=int, default=None, help="n_ctx (default: the grid's for the model)")
    ap.add_argument("--chunks", type=int, required=True)
    ap.add_argument("--rows", nargs="+", required=True, metavar="ROW")
    args = ap.parse_args(argv)
    for name in args.rows:
        try:
            parse_row(name)
        except ValueError as e:
            ap.error(str(e))
    ctx = args.ctx or memory.MODELS[args.model][1]
    try:
        out = spread_tables(run_dir(args.a, args.model, ctx, args.chunks), run_dir(args.b, args.model, ctx, args.chunks),
                            args.rows)
    except ValueError as e:
        print(f"spread: {e}", file=sys.stderr)
        return 2
    print(out, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
