"""One cell's greedy answers to retrieval tasks, through the cache model of every cell.

Owns `generate` (a batch of equal-length prompts: prefill in ubatches, then greedy single-token
steps, through one `KVarnCache` built by `kvarn.run.forward.new_cache` and fed by
`kvarn.run.decode.feed`, so a KVarN group seals when its last token arrives, as in a decode),
`load_model` (the model as a decode job loads it: `kvarn.weights.models.load`, eval mode, the
cache model's attention, the cell's compute path) and `run_cell` (a cell over one or more task
files, one answer file per task file).

The baseline is the same function with the baseline's cell (`kvarn.run.forward.baseline_cell`,
bf16 K and V at tail 0): its answers are the exact cache's own, against which flips are counted.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

import kvarn
import kvarn.kvcache.attention as kattn
from kvarn.retrieval import score
from kvarn.retrieval.tasks import read_tasks, write_tasks
from kvarn.run.decode import choose, feed
from kvarn.run.forward import attention_path, new_cache
from kvarn.run.load import set_compute
from kvarn.vocab.cell import CellSpec
from kvarn.weights import models
from kvarn.weights.sources import DEFAULT_CACHE_DIR


@torch.inference_mode()
def candidate_logprobs(model, cache, logits: torch.Tensor, candidates) -> list[list[float]]:
    """Per prompt, the teacher-forced log-probability of each candidate continuation given the
    prompt, through the cell's cache: sum over the candidate's tokens t_0 … t_{L−1} of
    log p(t_i | prompt, t_0 … t_{i−1}). `logits` [P, V]: the prefill's last position (it scores
    t_0); `candidates[p]`: prompt p's candidates as token-id lists. Each candidate slot is fed
    (teacher-forced, one forward of its tokens but the last) into its own copy of the prefilled
    cache, so the cache the greedy answer continues from is untouched and every candidate reads
    the prompt exactly as the answer does (the cell's sink, tail and body)."""
    device = logits.device
    first = torch.log_softmax(logits.float(), dim=-1)  # [P, V]
    out: list[list[float]] = [[] for _ in candidates]
    for c in range(max(len(cs) for cs in candidates)):
        seqs = [cs[c] if c < len(cs) else cs[0] for cs in candidates]  # a prompt with fewer: ignored
        if any(len(q) == 0 for q in seqs):
            raise ValueError("retrieval candidates must be non-empty token lists")
        n = max(map(len, seqs))
        ids = torch.tensor([q + [q[-1]] * (n - len(q)) for q in seqs], dtype=torch.long, device=device)  # right-padded
        total = first.gather(1, ids[:, :1])[:, 0].double()
        if n > 1:
            fork = copy.deepcopy(cache)
            rest = model(input_ids=ids[:, :-1], cache=fork, kvarn_cache=fork, use_cache=True, logits_to_keep=0)
            lp = torch.log_softmax(rest.logits.float(), dim=-1).gather(2, ids[:, 1:, None])[..., 0]  # [P, n-1]
            del fork, rest
            real = torch.arange(1, n, device=device)[None, :] < torch.tensor([len(q) for q in seqs], device=device)[:, None]
            total = total + (lp.double() * real).sum(dim=1)  # causal: padding after a candidate changes nothing of it
        for p, cs in enumerate(candidates):
            if c < len(cs):
                out[p].append(float(total[p]))
    return out


def candidate_scores(logprobs: list[float]) -> dict:
    """The correct candidate's (the first's) log-probability, its rank among all candidates (1 =
    the most likely; ties counted against it) and its margin over the best distractor (None
    without distractors: a `passkey` prompt states no other value)."""
    lp, rest = logprobs[0], logprobs[1:]
    return {"logprob": lp, "rank": 1 + sum(x >= lp for x in rest), "n_candidates": len(logprobs),
            "margin": lp - max(rest) if rest else None}


@torch.inference_mode()
def generate(model, prompts: torch.Tensor, cell: CellSpec, n_tokens: int, ubatch: int = 512,
             attention: str = "ref", candidates=None):
    """LongTensor [P, n_tokens]: the greedy continuation of each prompt (prompts [P, n], equal
    lengths) through a fresh cache of `cell`. `model` uses attn_implementation "kvarn". With
    `candidates` (per prompt, a list of token-id lists): (tokens, `candidate_logprobs` of the same
    prefilled cache)."""
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 1:
        raise ValueError(f"retrieval gen_tokens must be a positive integer, got {n_tokens!r}")
    device = next(model.parameters()).device
    prompts = prompts.to(device)
    cache = new_cache(model, cell, attention=attention)
    cache.reserve(prompts.shape[1] + n_tokens)
    logits = feed(model, prompts, cache, ubatch)
    scored = None if candidates is None else candidate_logprobs(model, cache, logits, candidates)
    out = []
    for s in range(n_tokens):
        out.append(choose(logits))
        if s + 1 < n_tokens:
            logits = feed(model, out[-1][:, None], cache, 1)
    tokens = torch.stack(out, dim=1).cpu()
    return tokens if candidates is None else (tokens, scored)


def model_window(model) -> int | None:
    """The longest context the model's config declares (max_position_embeddings), None if it declares none."""
    cfg = model.config.get_text_config()
    return getattr(cfg, "max_position_embeddings", None)


def load_model(spec, cache_dir=DEFAULT_CACHE_DIR, device="auto", dtype="auto"):
    """The model as a decode job has it (kvarn.run.load.setup without the text): loaded, eval
    mode, the cache model's attention."""
    loaded = models.load(spec, cache_dir=cache_dir, device=device, dtype=dtype)
    loaded.model.eval()
    loaded.model.set_attn_implementation(kattn.ATTN_NAME)
    return loaded


def answer_records(loaded, records: list[dict], cell: CellSpec, ubatch: int = 512, batch: int = 8,
                   attention: str = "ref") -> list[dict]:
    """Each task record's answer under `cell`: the record less its prompt, plus the generated
    tokens and text, the answer read from it (`score.read_answer`) and whether it is right, and
    the continuous measure from the same prefilled cache (`candidate_logprobs`): every candidate's
    teacher-forced log-probability, the correct one's (`logprob`), its `rank` and `margin` over
    the best distractor (`candidate_scores`)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"retrieval batch must be a positive integer, got {batch!r}")
    out = []
    streams: dict[tuple[int, int], list[dict]] = {}  # prompts of one length and answer length batch together
    for r in records:
        streams.setdefault((len(r["input_ids"]), r["gen_tokens"]), []).append(r)
    groups = [s[a : a + batch] for s in streams.values() for a in range(0, len(s), batch)]
    for group in groups:
        lengths = {len(r["input_ids"]) for r in group}
        gens = {r["gen_tokens"] for r in group}
        if len(lengths) != 1 or len(gens) != 1:
            raise ValueError(f"retrieval prompts of one batch must share a length and gen_tokens, got lengths "
                             f"{sorted(lengths)} and gen_tokens {sorted(gens)}")
        ids = torch.tensor([r["input_ids"] for r in group], dtype=torch.long)
        gen, scored = generate(loaded.model, ids, cell, gens.pop(), ubatch=ubatch, attention=attention,
                               candidates=[r["candidate_ids"] for r in group])
        for r, toks, lps in zip(group, gen.tolist(), scored):
            text = loaded.tokenizer.decode(toks)
            given, correct = score.grade(r["task"], text, r["answer"])
            row = {k: v for k, v in r.items() if k not in ("input_ids", "prompt")}
            out.append({**row, "cell": cell.name, "tokens": toks, "text": text, "given": given,
                        "correct": correct, "candidate_logprobs": lps, **candidate_scores(lps)})
    return out


def run_cell(spec, task_paths, out_paths, cell: CellSpec, ubatch=512, batch=8, device="auto", dtype="auto",
             cache_dir=DEFAULT_CACHE_DIR, attention="auto") -> dict:
    """One cell over task files (all of one model and context): out_paths[i] gets the answers
    to task_paths[i] (JSONL, atomically). Returns a summary (model, cell, counts, wall time)."""
    if not isinstance(cell, CellSpec):
        raise TypeError(f"run_cell takes a kvarn.vocab.cell.CellSpec, got {cell!r}")
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
