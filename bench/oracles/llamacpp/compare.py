"""kvarn (exact and llamacpp-cpu) beside llama-perplexity on the same tokens: bench/oracles/llamacpp/results/llamacpp.md.

Run bench/oracles/llamacpp/perplexity.sh first (it builds llama-perplexity and leaves its logs and KLD base
files under $LLAMACPP_DIR/runs/{model}/ctx{n_ctx}-c{chunks}/). This script, per model:

1. kvarn baselines in both compute modes (the llamacpp-cpu one also as a llama KLD file);
2. kvarn cells for every type the llama runs cover, rotation on and off, in both modes;
3. `--cross` (the default; `--no-cross` skips it): the two programs' bf16-cache runs scored
   against each other's baseline, in both directions, per kvarn compute mode: kvarn's bf16
   cell against llama's own base file, and llama-perplexity's bf16 cache against our
   baseline dump written in llama's format (`kvarn.llamacpp_cpu.llamakld.write_from_dump`, then
   `llama-perplexity --kl-divergence-base ours.kld --kl-divergence`). Both directions
   measure the same two programs' arithmetic difference (KL(P‖Q) and KL(Q‖P) agree to
   second order), so they should be close; a gap would point at the file format;
4. the table: llama's median / mean KLD beside ours, the ratio llamacpp-cpu / llama.

    python -m bench.oracles.llamacpp.compare [--models smollm2-135m gemma3-270m] [--chunks N] [--types T ...]
                             [--threads 1] [--llama-threads 2] [--cross | --no-cross] [--out FILE]

Every kvarn result is cached beside the llama runs (summary.json per run) and reused.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from bench import REPO, TEXT
from bench.oracles.llamacpp.runs import (BIN, CTX, fmt, kvarn_baseline, kvarn_cell, parse_llama,
                                          run_dir)

TARGET = 0.10  # issue 13: llamacpp-cpu's median and mean KLD each within 10 % of llama-perplexity's


def our_chunk_means(cell: Path) -> list[float]:
    """Each chunk's mean KLD of a kvarn cell, from its tokens.parquet."""
    import polars as pl

    t = pl.read_parquet(cell / "tokens.parquet")
    return t.group_by("chunk").agg(pl.col("kld").mean()).sort("chunk")["kld"].to_list()


def our_llama_kld(model: str, n_ctx: int, chunks: int, dump: Path, out: Path) -> Path:
    """Our baseline dump `dump` as llama-perplexity's KLD base file `out` (written once), on
    the tokens kvarn computed it on (`kvarn.run.load.Context`: the same tokenization and BOS)."""
    if not out.is_file():
        from kvarn.llamacpp_cpu import llamakld
        from kvarn.run import load
        from kvarn.weights import sources

        ctx = load.Context(sources.parse_model(model), n_ctx, chunks, text=str(TEXT),
                             cache_dir=str(REPO / "resources" / "models"), baseline=True)
        llamakld.write_from_dump(dump, ctx.chunk_ids, out)
    return out


def llama_vs_ours(d: Path, our_kld: Path, mode: str, threads: int) -> dict | None:
    """llama-perplexity's bf16 cache scored against our `mode` baseline file (log kept, reused)."""
    log = d / f"bf16-vs-kvarn-{mode}-base.log"
    if not (log.is_file() and "Same top p" in log.read_text(errors="replace")):
        gguf = next((REPO / "resources" / "models" / d.parent.name).glob("*.gguf"))
        tmp = log.with_suffix(".log.tmp")
        with open(tmp, "w") as f:
            subprocess.run(["nice", "-n", "5", str(BIN), "-m", str(gguf), "-c", str(CTX[d.parent.name]),
                            "-t", str(threads), "-nr", "-ctk", "bf16", "-ctv", "bf16",
                            "--kl-divergence-base", str(our_kld), "--kl-divergence"],
                           stdout=f, stderr=subprocess.STDOUT, check=False)
        tmp.replace(log)
    return parse_llama(log)


def files_both_ways(d: Path, dump_path: Path) -> dict:
    """KL both ways per token from the two baseline files alone (llama's base.kld and our dump),
    with llama's rule (base entries above −16 nats): checks that llama-perplexity reads our
    file as we do, and shows which tokens part the two directions' means."""
    import numpy as np
    import torch

    from kvarn.baseline import dump

    from kvarn.llamacpp_cpu import llamakld

    ll, ours = llamakld.read_llama_kld(d / "base.kld"), dump.open_dump(dump_path)
    a_tok, b_tok = [], []
    for c in range(ours.n_chunks):
        for a in range(0, ours.n_scored, 64):
            b = min(ours.n_scored, a + 64)
            p_ll, p_ours = ll.decode(c, a, b).double(), ours.decode(c, a, b).double()
            for base, q, out in ((p_ll, p_ours, a_tok), (p_ours, p_ll, b_tok)):
                out.append(torch.where(base > -16, base.exp() * (base - q), 0.0).sum(1))
    A, B = torch.cat(a_tok).numpy(), torch.cat(b_tok).numpy()
    keep = np.ones(len(A), bool)
    keep[np.argsort(-(A + B))[:5]] = False
    return {"A_median": float(np.median(A)), "A_mean": float(A.mean()), "B_median": float(np.median(B)),
            "B_mean": float(B.mean()), "A_mean_top5_out": float(A[keep].mean()), "B_mean_top5_out": float(B[keep].mean()),
            "top": [(float(A[i]), float(B[i])) for i in np.argsort(-(A + B))[:3]]}


def cross_lines(model: str, d: Path, n_ctx: int, chunks: int, base: dict, kv: Path, llama_threads: int) -> list[str]:
    """The two programs' bf16-cache runs scored against each other's baseline, both directions."""
    lines = ["", "Baseline against baseline, both directions (bf16 cache in both programs; "
                 "A: kvarn's bf16 cell scored against llama-perplexity's base file; "
                 "B: llama-perplexity's bf16 cache scored against our baseline written in llama's format):", "",
             "| kvarn mode | A median | B median | B/A | A mean | B mean | B/A | A same top | B same top |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in ("exact", "llamacpp-cpu"):
        a = kvarn_cell(model, n_ctx, chunks, "bf16", True, mode, d / "base.kld", kv / mode / "bf16-vs-llama-base")
        ours = our_llama_kld(model, n_ctx, chunks, base[mode], base[mode].with_suffix(".kld"))
        b = llama_vs_ours(d, ours, mode, llama_threads) or {}
        bm, bmean = b.get("kld_median"), b.get("kld_mean")
        lines.append(
            f"| {mode} | {fmt(a['kld_median'])} | {fmt(bm)} | {fmt(bm and bm / a['kld_median'], 3)} | "
            f"{fmt(a['kld_mean'])} | {fmt(bmean)} | {fmt(bmean and bmean / a['kld_mean'], 3)} | "
            f"{100 * a['same_top']:.2f} % | {fmt(b.get('same_top') and 100 * b['same_top'], 2)} % |")
    lines += ["", "The same two directions computed from the two baseline files alone (`files_both_ways`: "
                  "llama's base.kld against our dump, llama's −16-nat rule), and without the 5 tokens where "
                  "the programs disagree most:", "",
              "| kvarn mode | A median | B median | A mean | B mean | A mean, top 5 out | B mean, top 5 out | "
              "largest tokens (A, B) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for mode in ("exact", "llamacpp-cpu"):
        f = files_both_ways(d, base[mode])
        lines.append(f"| {mode} | {fmt(f['A_median'])} | {fmt(f['B_median'])} | {fmt(f['A_mean'])} | "
                     f"{fmt(f['B_mean'])} | {fmt(f['A_mean_top5_out'])} | {fmt(f['B_mean_top5_out'])} | "
                     + ", ".join(f"({x:.3f}, {y:.3f})" for x, y in f["top"]) + " |")
    s = kvarn_cell(model, n_ctx, chunks, "bf16", True, "exact", base["llamacpp-cpu"].with_suffix(".kld"),
                   kv / "exact" / "bf16-vs-cpu-base")
    lines += ["", f"Within kvarn, exact's bf16 cell scored against the llamacpp-cpu baseline (the attention "
                  f"kernel and activation rounding alone): median {fmt(s['kld_median'])}, mean {fmt(s['kld_mean'])}."]
    return lines


def model_section(model: str, llama_threads: int, cross: bool, types=None, chunks=None) -> tuple[list[str], list[dict]]:
    d = run_dir(model, chunks)
    n_ctx, chunks = CTX[model], int(d.name.split("-c")[-1])
    kv = d / "kvarn"
    base = {mode: kvarn_baseline(model, n_ctx, chunks, mode, kv / mode / "base.kvd",
                                 kv / mode / "base.kld" if mode == "llamacpp-cpu" else None)
            for mode in ("exact", "llamacpp-cpu")}
    lbase = parse_llama(d / "base.log") or {}
    rows = []
    for log in sorted(d.glob("*-*rot.log")):
        t, rot = log.stem.rsplit("-", 1)
        ll = parse_llama(log)
        if not ll or "kld_median" not in ll or (types is not None and t not in types):
            continue
        rec = {"model": model, "type": t, "rot": rot == "rot", "llama": ll, "cell": log.stem}
        for mode in ("exact", "llamacpp-cpu"):
            rec[mode] = kvarn_cell(model, n_ctx, chunks, t, rot == "rot", mode, base[mode], kv / mode / log.stem)
        rows.append(rec)
    order = {t: i for i, t in enumerate(["f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"])}
    rows.sort(key=lambda r: (order.get(r["type"], 99), not r["rot"]))
    lines = [f"### {model}, n_ctx {n_ctx}, {chunks} chunk(s) of wiki.test.raw ({d})", ""]
    lines += ["| cache | rot | llama median | exact median | llamacpp-cpu median | cpu/llama | "
              "llama mean ± (its own) | exact mean | llamacpp-cpu mean ± | cpu/llama | target (±10 %) |", "|---|---|" + "---:|" * 8 + "---|"]
    for r in rows:
        ll, ex, cp = r["llama"], r["exact"], r["llamacpp-cpu"]
        ratios = [cp[key] / ll[key] for key in ("kld_median", "kld_mean")]
        r["pass"] = all(abs(x - 1) <= TARGET for x in ratios)
        lines.append(
            f"| {r['type']} | {'on' if r['rot'] else 'off'} | {fmt(ll['kld_median'])} | {fmt(ex['kld_median'])} | "
            f"{fmt(cp['kld_median'])} | {ratios[0]:.3f} | {fmt(ll['kld_mean'])} ± {fmt(ll.get('kld_mean_err'))} | "
            f"{fmt(ex['kld_mean'])} | {fmt(cp['kld_mean'])} ± {fmt(cp.get('kld_mean_err'))} | {ratios[1]:.3f} | {'pass' if r['pass'] else '**fail**'} |")
    if chunks > 1:
        lines += ["", "Each chunk's own mean KLD (llama's from its log's running means), llamacpp-cpu / llama:", "",
                  "| cache | rot | " + " | ".join(f"chunk {i + 1}" for i in range(chunks)) + " |",
                  "|---|---|" + "---:|" * chunks]
        for r in rows:
            ll, ours = r["llama"].get("kld_chunk_means"), our_chunk_means(kv / "llamacpp-cpu" / r["cell"])
            if ll and len(ll) == len(ours) == chunks:
                lines.append(f"| {r['type']} | {'on' if r['rot'] else 'off'} | "
                             + " | ".join(f"{o / x:.3f}" for o, x in zip(ours, ll)) + " |")
    any_cell = rows[0] if rows else None
    lines += ["", "| base PPL | llama-perplexity | kvarn exact | kvarn llamacpp-cpu |", "|---|---:|---:|---:|"]
    if any_cell:
        # the cells' "Mean PPL(base)" is over the scored rows, as ours; base.log's "Final estimate" is not
        lines.append(f"| bf16 cache | {fmt(any_cell['llama'].get('ppl_base') or lbase.get('ppl_base'), 4)} | "
                     f"{fmt(any_cell['exact']['ppl_base'], 4)} | {fmt(any_cell['llamacpp-cpu']['ppl_base'], 4)} |")
    if cross:
        lines += cross_lines(model, d, n_ctx, chunks, base, kv, llama_threads)
    return lines + [""], rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads for kvarn (default 1)")
    ap.add_argument("--cross", action=argparse.BooleanOptionalAction, default=True,
                    help="score the two programs' bf16 baselines against each other, both directions "
                         "(runs llama-perplexity against our baseline file; default on)")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-perplexity -t for the cross runs (default 2)")
    ap.add_argument("--types", nargs="+", default=None, help="only these cache types (default: every llama run)")
    ap.add_argument("--chunks", type=int, default=None,
                    help="the runs over this many chunks (runs/{model}/ctx{n_ctx}-c{chunks}; default: the most chunks)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "llamacpp.md"))
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    from kvarn.files.atomic import write_text

    lines = ["# kvarn against llama-perplexity (issue 13)", "",
             "Produced by `bench/oracles/llamacpp/perplexity.sh` then `python -m bench.oracles.llamacpp.compare`; llama-perplexity built for CPU "
             "from the llama-cpp-python 0.3.36 sdist (flash attention auto = on, ubatch 512, -nr), "
             "bf16-cache baseline in each program, the same tokens (checked).", ""]
    every = []
    for model in a.models:
        sec, rows = model_section(model, a.llama_threads, a.cross, a.types, a.chunks)
        lines += sec
        every += rows
    write_text(a.out, "\n".join(lines) + "\n")
    write_text(Path(a.out).with_suffix(".json"), json.dumps(every, indent=1, default=float) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
