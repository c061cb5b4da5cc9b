"""How far a model's exact cache still retrieves: the baseline cell (bf16 K and V, tail 0) over
seeded tasks at given contexts, accuracy per (context, task) printed (issue 53, item 2).

    python -m kvarn.retrieval.probe smollm2-135m --contexts 2048,4096,8192 --tasks niah_single_2 \
        --depths 0.1,0.5,0.9 --prompts 1

The prompts are `kvarn.retrieval.tasks.make_tasks`' (seed 0), answered by `run.answer_records`
through the cache model with the baseline cell, one torch thread unless `--threads`; the model is
an embedded one (`embedded:<name>`) from resources/models. Nothing is written: a line per
(context, task) with correct/n and the first generated texts, and the wall time per context.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvarn.retrieval import run, tasks
from kvarn.retrieval.score import BASELINE_CELL
from kvarn.vocab.cell import CellSpec
from kvarn.weights.sources import ModelSpec


def probe(name: str, contexts, task_names, depths, prompts: int, cache_dir="resources/models", batch: int = 8):
    """[(context, task, correct, n, texts, wall_s)] of the exact cache on the tasks."""
    spec = ModelSpec(name, f"embedded:{name}")
    tok, bos = run.load_tokenizer(spec, cache_dir)
    loaded = run.load_model(spec, cache_dir)
    out = []
    for ctx in contexts:
        recs = [r for t in task_names for r in tasks.make_tasks(tok, bos, t, ctx, depths, prompts, seed=0, gen_tokens=8)]
        t0 = time.perf_counter()
        ans = run.answer_records(loaded, recs, CellSpec.from_name(BASELINE_CELL), ubatch=512, batch=batch, attention="ref")
        wall = time.perf_counter() - t0
        for t in task_names:
            a = [x for x in ans if x["task"] == t]
            out.append((ctx, t, sum(x["correct"] for x in a), len(a), [x["text"] for x in a], wall))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvarn.retrieval.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="an embedded model: smollm2-135m or gemma3-270m")
    ap.add_argument("--contexts", required=True, help="comma-separated context lengths")
    ap.add_argument("--tasks", default="niah_single_2", help=f"comma-separated, of {', '.join(tasks.TASKS)}")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = probe(a.model, [int(c) for c in a.contexts.split(",")], a.tasks.split(","),
                 [float(d) for d in a.depths.split(",")], a.prompts)
    for ctx, t, k, n, texts, wall in rows:
        print(f"{a.model} {ctx} {t} {k}/{n} ({wall:.0f} s for the context) {texts[:2]!r}", flush=True)


if __name__ == "__main__":
    main()
