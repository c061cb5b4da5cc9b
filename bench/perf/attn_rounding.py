"""What the GPU's attention arithmetic (compute bf16-attn or tf32-attn) adds to a cell's KLD, against each format's own effect.

    python -m bench.perf.attn_rounding [--compute bf16-attn|tf32-attn] [--tf32-p-rule truncate|nearest]
                                       [--model smollm2-135m --model gemma3-270m]
                                       [--n-ctx 2048] [--chunks 1] [--out bench/perf/results/attn_rounding.md]

Compute bf16-attn / tf32-attn (kvarn.vocab.options.ATTENTION_ROUNDING) runs the cache model's attention
as a GPU's flash attention does: Q·K and P·V on bf16 (TF32) operands, fp32 accumulation and softmax. It is the path
that lets the article's attention run on tensor cores (issue 42); it may be used for a format only
if the KLD it adds is small beside what the format itself does. Per model and format F (every
standard type and KVarN width of config/article.yaml, symmetric, tail 0), on the same chunks, through
the engine's own forward (`kvarn.run.forward.chunk_logprobs`):

* format: the median KLD of F on the exact (fp32) path against the exact baseline: the format's effect;
* path: the median KLD of the rounded path's baseline against the exact one (the same bf16 cache, only the
  arithmetic differs): what the arithmetic alone adds; the table's verdict is path < format for every F;
* measured: F's median KLD as a rounded run measures it (against that path's baseline, as the
  workflow pairs them) and its change from `format`;
* redraw: the median KLD between F on the rounded path and F on the exact path, which a quantizer's
  discontinuity makes of F's own size whatever the path (the table's notes say why).

The model runs in fp32 on the CPU (only the attention's operands are rounded); KLD as llama.cpp's
(kvarn.stats.metrics.token_metrics). Under tf32-attn the numerators P are read as `--tf32-p-rule`
says (kvarn.kvcache.rounding.TF32_P_RULE, default the flex kernel's truncation; "nearest" is the
rule bench/perf/results/attn_rounding_tf32.md was made with).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench import REPO, TEXT
from kvarn.run import forward, load
from kvarn.vocab import scoring
from kvarn.vocab.cell import CellSpec
from kvarn.kvcache import rounding
from kvarn.vocab.options import ATTENTION_ROUNDING, BF16_ATTN, EXACT, TF32_ATTN
from kvarn.stats import metrics
from kvarn.weights import sources
from kvarn.weights.sources import DEFAULT_CACHE_DIR

STANDARD = ["q8_0", "q6_0", "q5_1", "q5_0", "q4_1", "q4_0", "q3_0", "q2_0"]  # config/article.yaml's types
KVARN = ["kvarn8", "kvarn6", "kvarn5", "kvarn4", "kvarn3", "kvarn2"]


def logprobs(ctx: load.Context, ids: torch.Tensor, cell: CellSpec, scored: range) -> torch.Tensor:
    """One chunk's fp32 log-probs with the cell's cache, as run_cell computes them."""
    cache = forward.new_cache(ctx.loaded.model, cell, attention="ref")
    return torch.cat([lp for _, lp in forward.chunk_logprobs(ctx.loaded.model, ids, cache, 512, scored)])


def median_kld(q: list[torch.Tensor], base: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    return float(np.median(np.concatenate([metrics.token_metrics(a, b, t)["kld"] for a, b, t in zip(q, base, targets)])))


def measure(name: str, n_ctx: int, chunks: int, text: str, cache_dir: str, formats: list[str],
            compute: str = BF16_ATTN) -> list[dict]:
    ctx = load.Context(sources.ModelSpec(name, f"embedded:{name}"), n_ctx, chunks, text, device="cpu",
                         cache_dir=cache_dir)
    scored = scoring.scored_positions(n_ctx)
    ids = list(ctx.chunk_ids)
    targets = [c[scored.start + 1 : scored.stop + 1] for c in ids]

    def run(cell):
        return [logprobs(ctx, c, cell, scored) for c in ids]

    base = {c: run(forward.baseline_cell(c)) for c in (EXACT, compute)}
    rows = [{"model": name, "format": "bf16 (the baseline)", "format_kld": 0.0,
             "path_kld": median_kld(base[compute], base[EXACT], targets), "measured_kld": 0.0}]
    for f in formats:
        t0 = time.perf_counter()
        fp32, rounded = run(CellSpec(f, f, 0)), run(CellSpec(f, f, 0, compute=compute))
        rows.append({"model": name, "format": f,
                     "format_kld": median_kld(fp32, base[EXACT], targets),
                     "path_kld": median_kld(rounded, fp32, targets),
                     "measured_kld": median_kld(rounded, base[compute], targets)})
        print(f"{name} {f}: format {rows[-1]['format_kld']:.4g}, path {rows[-1]['path_kld']:.4g} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict], command: str, elapsed: float, n_tokens: dict, compute: str = BF16_ATTN,
             p_rule: str | None = None) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    lines = [f"# The {compute} path's own KLD against each format's (compute {compute} vs exact)", "",
             f"`{command}` at commit {commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{platform.machine()} CPU ({os.cpu_count()} cores), torch {torch.__version__}, {elapsed / 60:.1f} min. "
             "Models in fp32; symmetric pairs at tail 0; medians over the scored tokens "
             f"({', '.join(f'{m}: {n}' for m, n in n_tokens.items())})."
             + (f" TF32's P rule: {p_rule} (kvarn.kvcache.rounding.round_p; Q, K and V to nearest)."
                if compute == TF32_ATTN and p_rule else ""), "",
             "- `format`: the format's median KLD on the exact (fp32) path against the exact baseline: its effect.",
             f"- `path / format`: the path's own KLD (the {compute} baseline against the exact one: the same bf16 "
             "cache, only the attention's arithmetic differs) over the format's effect. Below 1: the arithmetic "
             "adds less than the format does.",
             f"- `measured`, `change`: the format's median KLD on {compute} against the {compute} baseline (how a GPU "
             "run pairs them), and its change from `format`.",
             f"- `redraw`: the median KLD between the format on {compute} and on the exact path. Not the path's "
             "own effect: a quantizer is discontinuous, so the path's small changes upstream move values across "
             "rounding steps downstream and draw the format's rounding noise anew; it is of the format's own size "
             "whatever the path.", "",
             "| model | format | format | path / format | measured | change | redraw |",
             "|---|---|---:|---:|---:|---:|---:|"]
    own = {r["model"]: r["path_kld"] for r in rows if r["format_kld"] == 0}
    for r in rows:
        if r["format_kld"] == 0:
            lines.append(f"| {r['model']} | {r['format']} | 0 | path's own KLD {own[r['model']]:.3g} | – | – | – |")
            continue
        change = r["measured_kld"] / r["format_kld"] - 1
        lines.append(f"| {r['model']} | {r['format']} | {r['format_kld']:.4g} | {own[r['model']] / r['format_kld']:.4f} | "
                     f"{r['measured_kld']:.4g} | {100 * change:+.1f} % | {r['path_kld']:.3g} |")
    lines.append("")
    for m in own:
        fs = [r for r in rows if r["model"] == m and r["format_kld"]]
        tight = min(fs, key=lambda r: r["format_kld"])
        moved = max(fs, key=lambda r: abs(r["measured_kld"] / r["format_kld"] - 1))
        lines.append(f"- {m}: the path's own KLD ({own[m]:.3g}) is below the format's effect for "
                     f"{sum(own[m] < r['format_kld'] for r in fs)} of {len(fs)} formats; the tightest is "
                     f"{tight['format']} ({own[m] / tight['format_kld']:.4f} of it). Measured medians move by at "
                     f"most {100 * abs(moved['measured_kld'] / moved['format_kld'] - 1):.1f} % ({moved['format']}).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compute", default=BF16_ATTN, choices=[c for c, r in ATTENTION_ROUNDING.items() if r],
                    help="the rounded path compared with exact (default bf16-attn)")
    ap.add_argument("--tf32-p-rule", choices=rounding.TF32_P_RULES, default=rounding.TF32_P_RULE,
                    help="how tf32-attn reads P (default the flex kernel's: truncate)")
    ap.add_argument("--model", action="append", help="embedded model (repeatable; default smollm2-135m, gemma3-270m)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--format", action="append", help="a format (repeatable; default every standard type and KVarN width)")
    ap.add_argument("--text", default=str(TEXT), help="wiki.test.raw (default $TEXT, else ../shared beside the checkout)")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    ap.add_argument("--out", help="default bench/perf/results/attn_rounding.md (bf16-attn), attn_rounding_tf32_truncP.md "
                                  "(tf32-attn, P truncated), attn_rounding_tf32.md (tf32-attn, P to nearest)")
    a = ap.parse_args(argv)
    rounding.TF32_P_RULE = a.tf32_p_rule  # rounded_attention reads it at each call
    models = a.model or ["smollm2-135m", "gemma3-270m"]
    t0 = time.perf_counter()
    rows, n_tokens = [], {}
    for m in models:
        rows += measure(m, a.n_ctx, a.chunks, a.text, a.cache_dir, a.format or STANDARD + KVARN, a.compute)
        n_tokens[m] = a.chunks * len(scoring.scored_positions(a.n_ctx))
    tf32 = a.compute == TF32_ATTN
    command = "python -m bench.perf.attn_rounding " + " ".join(
        ([f"--compute {a.compute}"] if a.compute != BF16_ATTN else []) + ([f"--tf32-p-rule {a.tf32_p_rule}"] if tf32 else [])
        + [f"--model {m}" for m in models] + [f"--n-ctx {a.n_ctx}", f"--chunks {a.chunks}"]
        + [f"--format {f}" for f in a.format or []])
    text = markdown(rows, command, time.perf_counter() - t0, n_tokens, a.compute, a.tf32_p_rule if tf32 else None)
    name = ("attn_rounding.md" if not tf32 else
            "attn_rounding_tf32_truncP.md" if a.tf32_p_rule == "truncate" else "attn_rounding_tf32.md")
    out = a.out or REPO / "bench/perf/results" / name
    Path(out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
