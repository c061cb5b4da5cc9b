"""One cell's greedy answers to retrieval tasks, through the cache model of every cell.

Owns `generate` (a batch of equal-length prompts: prefill in ubatches, then greedy single-token
steps, through one `KVarnCache` built by `kvarn.run.engine.new_cache` and fed by
`kvarn.run.decode.feed`, so a KVarN group seals when its last token arrives, as in a decode),
`load_model` (the model as a decode job loads it: `kvarn.weights.models.load`, eval mode, the
cache model's attention, the cell's compute path) and `run_cell` (a cell over one or more task
files, one answer file per task file).

The baseline is the same function with the baseline's cell (`kvarn.run.engine.baseline_cell`,
bf16 K and V at tail 0): its answers are the exact cache's own, against which flips are counted.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import kvarn
import kvarn.kvcache.attention as kattn
from kvarn.retrieval import score
from kvarn.retrieval.tasks import read_tasks, write_tasks
from kvarn.run.decode import choose, feed
from kvarn.run.engine import attention_path, new_cache, set_compute
from kvarn.spec.cell import CellSpec
from kvarn.weights import models
from kvarn.weights.sources import DEFAULT_CACHE_DIR


@torch.inference_mode()
def generate(model, prompts: torch.Tensor, cell: CellSpec, n_tokens: int, ubatch: int = 512,
             attention: str = "ref") -> torch.Tensor:
    """LongTensor [P, n_tokens]: the greedy continuation of each prompt (prompts [P, n], equal
    lengths) through a fresh cache of `cell`. `model` uses attn_implementation "kvarn"."""
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 1:
        raise ValueError(f"retrieval gen_tokens must be a positive integer, got {n_tokens!r}")
    device = next(model.parameters()).device
    prompts = prompts.to(device)
    cache = new_cache(model, cell, attention=attention)
    cache.reserve(prompts.shape[1] + n_tokens)
    logits = feed(model, prompts, cache, ubatch)
    out = []
    for s in range(n_tokens):
        out.append(choose(logits))
        if s + 1 < n_tokens:
            logits = feed(model, out[-1][:, None], cache, 1)
    return torch.stack(out, dim=1).cpu()


def model_window(model) -> int | None:
    """The longest context the model's config declares (max_position_embeddings), None if it declares none."""
    cfg = model.config.get_text_config()
    return getattr(cfg, "max_position_embeddings", None)


def load_model(spec, cache_dir=DEFAULT_CACHE_DIR, device="auto", dtype="auto"):
    """The model as a decode job has it (kvarn.run.engine.setup without the text): loaded, eval
    mode, the cache model's attention."""
    loaded = models.load(spec, cache_dir=cache_dir, device=device, dtype=dtype)
    loaded.model.eval()
    loaded.model.set_attn_implementation(kattn.ATTN_NAME)
    return loaded


def answer_records(loaded, records: list[dict], cell: CellSpec, ubatch: int = 512, batch: int = 8,
                   attention: str = "ref") -> list[dict]:
    """Each task record's answer under `cell`: the record less its prompt, plus the generated
    tokens and text, the answer read from it (`score.read_answer`) and whether it is right."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"retrieval batch must be a positive integer, got {batch!r}")
    out = []
    for a in range(0, len(records), batch):
        group = records[a : a + batch]
        lengths = {len(r["input_ids"]) for r in group}
        gens = {r["gen_tokens"] for r in group}
        if len(lengths) != 1 or len(gens) != 1:
            raise ValueError(f"retrieval prompts of one batch must share a length and gen_tokens, got lengths "
                             f"{sorted(lengths)} and gen_tokens {sorted(gens)}")
        ids = torch.tensor([r["input_ids"] for r in group], dtype=torch.long)
        gen = generate(loaded.model, ids, cell, gens.pop(), ubatch=ubatch, attention=attention)
        for r, toks in zip(group, gen.tolist()):
            text = loaded.tokenizer.decode(toks)
            given = score.read_answer(text)
            row = {k: v for k, v in r.items() if k not in ("input_ids", "prompt")}
            out.append({**row, "cell": cell.name, "tokens": toks, "text": text, "given": given,
                        "correct": given == r["answer"]})
    return out


def run_cell(spec, task_paths, out_paths, cell: CellSpec, ubatch=512, batch=8, device="auto", dtype="auto",
             cache_dir=DEFAULT_CACHE_DIR, attention="auto") -> dict:
    """One cell over task files (all of one model and context): out_paths[i] gets the answers
    to task_paths[i] (JSONL, atomically). Returns a summary (model, cell, counts, wall time)."""
    if not isinstance(cell, CellSpec):
        raise TypeError(f"run_cell takes a kvarn.spec.cell.CellSpec, got {cell!r}")
    if len(task_paths) != len(out_paths):
        raise ValueError(f"run_cell: {len(task_paths)} task files but {len(out_paths)} answer files")
    t0 = time.perf_counter()
    sets = [read_tasks(p) for p in task_paths]
    contexts = {r["context"] for s in sets for r in s}
    loaded = load_model(spec, cache_dir, device, dtype)
    window = model_window(loaded.model)
    if window is not None and max(contexts) > window:
        raise ValueError(f"retrieval context {max(contexts)} is longer than {spec.name}'s window "
                         f"(max_position_embeddings {window}); use contexts up to {window}")
    set_compute(loaded.model, spec, cache_dir, cell.compute)
    path = attention_path(attention, loaded.info.device, cell.compute) or "ref"
    records = [r for s in sets for r in s]  # every task's prompts of a context share a length: one batch stream
    answers = answer_records(loaded, records, cell, ubatch=ubatch, batch=batch, attention=path)
    wall = time.perf_counter() - t0
    by_id = {a["id"]: a for a in answers}
    for s, out in zip(sets, out_paths):
        rows = [{**by_id[r["id"]], "model": spec.name, "wall_s": wall, "kvarn_version": kvarn.__version__,
                 "device": loaded.info.device, "dtype": loaded.info.dtype, "attention": path} for r in s]
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_tasks(out, rows)
    return {"model": spec.name, "cell": cell.name, "prompts": len(records),
            "correct": sum(a["correct"] for a in answers), "wall_s": wall, "threads": torch.get_num_threads()}


def load_tokenizer(spec, cache_dir=DEFAULT_CACHE_DIR):
    """(tokenizer, BOS id or None) of a model, without its weights where the source is a
    transformers directory (else from the loaded model)."""
    from transformers import AutoTokenizer

    from kvarn.weights.sources import resolve

    path, _ = resolve(spec, cache_dir)
    if path.is_dir() and not spec.kind.random_weights:
        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        tokenizer = models.load(spec, cache_dir=cache_dir).tokenizer
    return tokenizer, models.detect_add_bos(tokenizer)[1]
