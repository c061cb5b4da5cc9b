"""Decode speed: transformers' own `generate` vs kvarn's cache, per generated token, in one run.

    python -m bench.perf.decode -t 1 [--model smollm2-135m] [--prompts 4]
        [--prompt-len 1000] [--tokens 128] [--blocks 1,auto] [--reps 1] [--out bench/perf/results/decode.md]

Same model (fp32 on CPU), same P prompts (the first `--prompt-len` tokens of P consecutive
Wikitext chunks, BOS first, as `kvarn decode` builds them), same batch, greedy:

1. **generate**: transformers' `model.generate(do_sample=False)` with its DynamicCache and
   attn_implementation "sdpa"; per-step time from a streamer's timestamps (the G - 1 steps
   after the one that follows the prefill);
2. **one cache**: the same greedy loop through one `KVarnCache` (the prompt via
   `kvarn.run.decode.feed` in ubatches, then one token per step, argmax of the last logits):
   bf16 tail 0 (the baseline's cache) and kvarn4 tail 0 (KVarN's sink and 128-token tail);
   per-step time = the steps' wall time / (G - 1);
3. **the job**: `kvarn.run.decode.decode` (what `kvarn decode` runs: the cell and the BF16
   baseline, two caches, plus log-softmax and metrics) for the bf16 cell and kvarn4, once per
   `--blocks` entry: 1 is the lock-step reference (the baseline one token per step), auto the
   block path (`kvarn.run.decode.block_steps`: the baseline scores B steps in one forward);
   per-step time from its own timing (steps / (G - 1)), split into the cell's steps, the
   baseline's forwards and the metrics in a second table.

Runs interleave (generate, one cache bf16, kvarn4, job bf16, kvarn4 per block) `--reps` times; each
row is the min over reps. Ratios are per-step time / generate's per-step time. The tokens
of the bf16 one-cache run are compared with generate's (bf16 K/V rounding may move a token
on a near-tie; tests/test_decode.py checks an f32 cache token for token).
Writes the Markdown table to --out atomically.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

from bench import REPO, TEXT

import kvarn.kvcache.attention as kattn  # noqa: E402
from kvarn.baseline import data
from kvarn.run import forward
from kvarn.vocab.cell import CellSpec  # noqa: E402
from kvarn.weights import models, sources  # noqa: E402
from kvarn.run import decode as kdecode  # noqa: E402
from kvarn.files.atomic import write_text  # noqa: E402

CELLS = [("bf16", "bf16", 0), ("kvarn4", "kvarn4", 0)]


class _Stamps:
    """A generate streamer that only records when each put (prompt, then each token) happens."""

    def __init__(self):
        self.t = []

    def put(self, value):
        self.t.append(time.perf_counter())

    def end(self):
        pass


@torch.inference_mode()
def run_generate(model, prompts, n):
    """(prefill + first token s, per-step s, tokens [P, n]) of transformers' greedy generate."""
    model.set_attn_implementation("sdpa")
    st = _Stamps()
    t0 = time.perf_counter()
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=0, streamer=st)
    # st.t[0]: the prompt; st.t[1]: the first token (after the prefill); st.t[-1]: token n
    return st.t[1] - t0, (st.t[-1] - st.t[1]) / (n - 1), out[:, prompts.shape[1]:]


@torch.inference_mode()
def run_one_cache(model, prompts, n, k, v, tail, ubatch):
    """(prefill s, per-step s, tokens [P, n]) of a greedy loop through one KVarnCache."""
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = forward.new_cache(model, CellSpec(k, v, tail))
    t0 = time.perf_counter()
    logits = kdecode.feed(model, prompts, cache, ubatch)
    t1 = time.perf_counter()
    toks = [logits.argmax(-1)]
    for _ in range(n - 1):
        logits = kdecode.feed(model, toks[-1][:, None], cache, 1)
        toks.append(logits.argmax(-1))
    return t1 - t0, (time.perf_counter() - t1) / (n - 1), torch.stack(toks, 1)


def run_job(model, prompts, n, k, v, tail, ubatch, block):
    """(prefill s of both caches, per-step s, timing, steps) of kvarn.run.decode.decode."""
    model.set_attn_implementation(kattn.ATTN_NAME)
    timing = {}
    steps = kdecode.decode(model, prompts, CellSpec(k, v, tail), n, ubatch=ubatch, timing=timing, block=block)
    return timing["prefill_s"], timing["steps_s"] / (n - 1), timing, steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--blocks", default="1,auto",
                    help="the job's blocks, comma-separated: 1 = lock step, auto = kvarn.run.decode.block_steps")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--cache-dir", default=str(REPO / sources.DEFAULT_CACHE_DIR))
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "decode.md"))
    ap.add_argument("-t", "--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tokens < 2:
        raise SystemExit(f"--tokens must be at least 2 (per-step time needs two steps), got {args.tokens}")
    blocks = [None if b == "auto" else int(b) if b.isdigit() and int(b) > 0 else SystemExit(
        f"--blocks: {b!r} is not a positive integer or auto") for b in args.blocks.split(",")]
    if bad := [b for b in blocks if isinstance(b, SystemExit)]:
        raise bad[0]

    load0 = os.getloadavg()[0]
    t_start = time.perf_counter()
    lm = models.load(sources.ModelSpec(args.model, f"embedded:{args.model}"), cache_dir=args.cache_dir)
    lm.model.eval()
    n_ctx = args.prompt_len + args.tokens
    text = data.load_text(TEXT if TEXT.is_file() else None)
    chunks = data.make_chunks(data.tokenize(lm.tokenizer, text), n_ctx, args.prompts, lm.info.bos_id)
    prompts = kdecode.decode_prompts(chunks, args.tokens)
    n = args.tokens

    rows: dict[str, list] = {}
    parts: dict[str, list] = {}
    job_steps: dict[tuple, dict] = {}
    gen_tokens = one_tokens = None
    for _ in range(args.reps):
        pre, step, gen_tokens = run_generate(lm.model, prompts, n)
        rows.setdefault("generate (transformers, DynamicCache, sdpa)", []).append((pre, step))
        print("generate", pre, step, flush=True)
        for k, v, tail in CELLS:
            pre, step, toks = run_one_cache(lm.model, prompts, n, k, v, tail, args.ubatch)
            if k == "bf16":
                one_tokens = toks
            rows.setdefault(f"one KVarnCache {k}/{v} tail {tail}", []).append((pre, step))
            print(k, "one cache", pre, step, flush=True)
        for block in blocks:
            for k, v, tail in CELLS:
                pre, step, timing, job_steps[k, block] = run_job(lm.model, prompts, n, k, v, tail, args.ubatch, block)
                how = "lock step" if timing["block"] == 1 else f"blocks of {timing['block']}"
                name = f"kvarn decode job {k}/{v} tail {tail}, baseline in {how}"
                rows.setdefault(name, []).append((pre, step))
                parts.setdefault(name, []).append(tuple(timing[x] / (n - 1) for x in ("cell_s", "base_s", "metrics_s")))
                print(k, "job", block, pre, step, timing, flush=True)
    best = {name: (min(p for p, _ in r), min(s for _, s in r)) for name, r in rows.items()}
    ref_step = next(iter(best.values()))[1]
    same = (one_tokens == gen_tokens)
    first_diff = [int(row.int().argmin()) if not row.all() else None for row in same]
    total = time.perf_counter() - t_start

    L = [
        "# Decode benchmark",
        "",
        f"`python -m bench.perf.decode {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores visible, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), model {args.model} in {lm.info.dtype} on {lm.info.device}; "
        f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (shared machine: "
        f"absolute times are noisy; runs interleave). Total bench wall time {total / 60:.1f} min.",
        "",
        f"Batch of {args.prompts} prompts x {args.prompt_len} tokens (Wikitext), {n} tokens generated greedily "
        f"(n_ctx {n_ctx}); min over {args.reps} rep(s). Per step: one token for each of the {args.prompts} "
        "prompts.",
        "",
        "| run | prefill s | per-step ms | / generate |",
        "|---|---:|---:|---:|",
    ]
    L += [f"| {name} | {p:.2f} | {1000 * s:.1f} | {s / ref_step:.2f}x |" for name, (p, s) in best.items()]
    L += ["", "bf16 one-cache tokens equal to generate's: "
          + ", ".join(f"prompt {i}: " + ("all" if d is None else f"up to step {d}") for i, d in enumerate(first_diff))]
    L += ["", "The job's step, split (ms per step, from the run of the min step time):", "",
          "| job | cell's step | baseline | metrics |", "|---|---:|---:|---:|"]
    for name, r in rows.items():
        if name in parts:
            c, b, m = parts[name][min(range(len(r)), key=lambda i: r[i][1])]
            L.append(f"| {name} | {1000 * c:.1f} | {1000 * b:.1f} | {1000 * m:.1f} |")
    if 1 in blocks and len(blocks) > 1:  # the block path against the lock-step reference, same run
        other = next(b for b in blocks if b != 1)
        L += ["", f"Block path ({other or 'auto'}) against lock step, same prompts: "]
        for k, _, _ in CELLS:
            r, g = job_steps[k, 1], job_steps[k, other]
            same = all((r[x] == g[x]).all() for x in ("token", "base_token", "same_top"))
            L.append(f"{k}: tokens, base tokens and same-top {'all equal' if same else 'DIFFER'}; "
                     f"|Δ KLD| mean {abs(r['kld'] - g['kld']).mean():.2g}, max {abs(r['kld'] - g['kld']).max():.2g} "
                     f"(KLD mean {r['kld'].mean():.3g} in lock step, {g['kld'].mean():.3g} in blocks), "
                     f"max |Δ nll_base| {abs(r['nll_base'] - g['nll_base']).max():.2g}.")
    write_text(args.out, "\n".join(L) + "\n")
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
