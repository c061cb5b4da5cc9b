"""The per-layer jobs (workflow/rules/perlayer.smk): load the model once, read the search text
(Wikitext-2 valid: `load_search_text` verifies the split; no job here opens the test text), and
write the result atomically.

* `run_sensitivity`: one type's probes on every attention layer -> parquet (sensitivity.COLUMNS plus
  the run's identity).
* `run_search`: for one budget, the knapsack's allocation in each family and the first/last form with
  N measured on the search text -> JSON (the workflow publishes each allocation's definition where cell
  jobs look it up when it reads the file: kvarn.plan.allocations.publish_allocations).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import polars as pl

from kvarn.budget import memory
from kvarn.files.atomic import atomic_path, write_text
from kvarn.kvcache import attention as kattn
from kvarn.kvcache.cache import KVarnCache
from kvarn.perlayer import search, sensitivity
from kvarn.perlayer.plan import FAMILIES, PerLayer, family_of
from kvarn.vocab import allocation as kalloc
from kvarn.weights.sources import DEFAULT_CACHE_DIR


def _load(spec, device, dtype, cache_dir, attention):
    from kvarn.weights import models

    loaded = models.load(spec, cache_dir=cache_dir, device=device, dtype=dtype)
    loaded.model.eval()
    loaded.model.set_attn_implementation(kattn.ATTN_NAME)
    return loaded, kattn.resolve_attention(attention, loaded.info.device)


def run_sensitivity(spec, text, plan: PerLayer, type_name: str, out, ubatch: int = 512, device: str = "auto",
                    dtype: str = "auto", cache_dir=DEFAULT_CACHE_DIR, attention: str = "auto") -> pl.DataFrame:
    t0 = time.perf_counter()
    loaded, path = _load(spec, device, dtype, cache_dir, attention)
    ids, sha = sensitivity.load_search_text(loaded, text, plan.n_ctx, plan.chunks)
    tail = plan.tail_of(type_name)
    frame = sensitivity.measure(loaded.model, ids, type_name, tail, ubatch, path)
    frame = frame.with_columns(model=pl.lit(spec.name), source=pl.lit(spec.source), text_sha256=pl.lit(sha),
                               n_ctx=pl.lit(plan.n_ctx), chunks=pl.lit(int(ids.shape[0])), tail=pl.lit(tail),
                               wall_s=pl.lit(time.perf_counter() - t0))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        frame.write_parquet(tmp)
    return frame


def read_sensitivities(paths, model: str, plan: PerLayer) -> dict:
    """{(layer, role, type): KLD mean} from the sensitivity files, each checked to be of `model` and of
    the plan's search context (a file of another run is refused, naming it)."""
    out = {}
    for p in paths:
        f = pl.read_parquet(p)
        got = f.select("model", "n_ctx", "chunks").unique().rows()
        if got != [(model, plan.n_ctx, plan.chunks)]:
            raise ValueError(f"{p}: sensitivities of {got}, not of ({model}, n_ctx {plan.n_ctx}, chunks {plan.chunks})")
        for r in f.iter_rows(named=True):
            out[r["layer"], r["role"], r["type"]] = r["kld_mean"]
    return out


def _valid_kld(model, ids, base_lps, alloc, tail, ubatch, path) -> dict:
    """The allocation's KLD on the search text (sensitivity.describe)."""
    kalloc.define(alloc)
    cell = search.cell_of(alloc, tail)
    return sensitivity.describe(sensitivity.chunk_klds(model, ids, lambda: KVarnCache(model.config, cell, path),
                                                       base_lps, ubatch))


def _entry(alloc, method, family, tail, total, budget, geom, **extra) -> dict:
    return {"name": alloc.name, "method": method, "family": family, "tail": tail, "record": alloc.record(),
            "cell": search.cell_of(alloc, tail).name, "bytes": total, "budget_bytes": budget,
            "budget_ratio": total / budget, "exports": kalloc.export(alloc, geom.n_layers), **extra}


def run_search(spec, text, plan: PerLayer, budget_type: str, sens_paths, out, eval_n_ctx: int, ubatch: int = 512,
               accounting: str = memory.DEFAULT_ACCOUNTING, device: str = "auto", dtype: str = "auto",
               cache_dir=DEFAULT_CACHE_DIR, attention: str = "auto") -> dict:
    t0 = time.perf_counter()
    loaded, path = _load(spec, device, dtype, cache_dir, attention)
    model, geom = loaded.model, loaded.info.geometry
    ids, sha = sensitivity.load_search_text(loaded, text, plan.n_ctx, plan.chunks)
    base_lps = sensitivity.baseline_logprobs(model, ids, ubatch, path)
    sens = read_sensitivities(sens_paths, spec.name, plan)
    budget = search.budget_bytes(geom, eval_n_ctx, budget_type, plan.tail_of(budget_type), ubatch, accounting)
    entries, notes = [], []
    for fam in FAMILIES:
        tail = plan.family_tail(fam)
        try:
            got = search.searched(geom, eval_n_ctx, sens, plan.types[fam], tail, budget,
                                  f"{'std' if fam == 'standard' else fam}_at_{budget_type}", ubatch, accounting)
        except ValueError as e:
            notes.append(f"{fam}: no allocation fits ({e})")
            continue
        alloc = got["allocation"]
        entries.append(_entry(alloc, "knapsack", fam, tail, got["bytes"], budget, geom,
                              predicted_kld_mean=got["predicted"],
                              valid=_valid_kld(model, ids, base_lps, alloc, tail, ubatch, path)))
    fam = family_of(budget_type)
    tail = plan.family_tail(fam)
    candidates = search.first_last_candidates(geom, eval_n_ctx, plan.types[fam], plan.edge[fam], budget_type, tail,
                                              budget, ubatch, accounting)
    tried = []
    for c in candidates:
        tried.append({"name": c["allocation"].name, "base": c["base"], "n": c["n"], "bytes": c["bytes"],
                      "valid": _valid_kld(model, ids, base_lps, c["allocation"], tail, ubatch, path)})
    if tried:
        best = min(range(len(tried)), key=lambda i: tried[i]["valid"]["kld_mean"])
        c = candidates[best]
        entries.append(_entry(c["allocation"], "first/last", fam, tail, c["bytes"], budget, geom,
                              base=c["base"], n=c["n"], valid=tried[best]["valid"]))
    else:
        notes.append(f"first/last: no {fam} type is cheaper than {budget_type}, so no base with "
                     f"{plan.edge[fam]} edges fits its bytes")
    result = {"model": spec.name, "budget": budget_type, "budget_bytes": budget, "eval_n_ctx": eval_n_ctx,
              "accounting": accounting, "ubatch": ubatch, "search_text_sha256": sha, "search_n_ctx": plan.n_ctx,
              "search_chunks": int(ids.shape[0]), "allocations": entries, "first_last_tried": tried, "notes": notes,
              "wall_s": time.perf_counter() - t0}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_text(out, json.dumps(result, indent=1) + "\n")
    return result

