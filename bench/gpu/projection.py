"""The article's GPU-hours before the device: FLOPs and bytes per token from the models'
geometry, a stated attainable fraction of an H100 / H200, a roofline per part.

    python -m bench.gpu.projection [--device h200|h100] [--compute bf16-attn|tf32-attn] [--out FILE]

Torch-free and fast: the device script (bench/gpu/article.py's successor) imports it, passes
the seconds per chunk it measured (`project(measured=...)`) and gets the same table with
measured rows in place of modelled ones.

What is counted (per forward token of a chunk; parts that run only at the scored second half
of the chunk are scaled by n_scored / n_ctx): see bench.gpu.traffic.per_token, the traffic model,
whose constants each say where they come from. Each part is timed as a roofline,
max(FLOPs / (peak x its compute fraction), bytes / (HBM x its memory fraction)), or, for work
with a stated rate instead (the baseline's log-probs to the host and their encoding there, the
GPU waiting; the cells' dump reads; KVarN's Triton quantization, measured), bytes at that rate.
A cell kind's seconds per chunk are the mean over that kind's article cells (their tails
differ); `project` adds a fixed overhead per cell and one model load per model. The attention's
arithmetic is the article's own (its cells' `compute`, `article_compute`) unless one is given; only
bf16-attn and tf32-attn are modelled (exact, fp32 attention off the tensor cores, is not: an article
on it is projected under FALLBACK_COMPUTE, and the result says so in its `note`).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import yaml

from bench import REPO
from bench.gpu.article import STUDY_CHUNKS
from bench.gpu.traffic import (ATTENTION_COMPUTES, CELL_FIXED_S, COMPILE_S, CONCAT_BYTES_TF32, DEVICES, HOST, KINDS,
                               LOAD_DISK_Bps, NONZERO_SHARE, QUERY_BLOCK, TF32_ROUND_BYTES, UBATCH, model_load_s,
                               part_seconds, per_token)
from kvarn.plan import matrix as kvm
from kvarn.vocab import facts

ARTICLE = REPO / "config" / "article.yaml"
GOAL_HOURS = 8.0  # issue 42: the article on one H200 in at most this many hours
FIXED = "per-cell fixed overhead"  # the part name of CELL_FIXED_S in `project`'s breakdown
# What an article on an unmodelled compute (exact) is projected under: the GPU path whose own KLD is
# below every format's (bench/perf/results/attn_rounding_tf32_truncP.md, P read as the kernel reads it)
FALLBACK_COMPUTE = "tf32-attn"


# ----------------------------------------------------------------------------- the article


def kind_of(cell) -> str:
    """An article cell's kind: "kvarn" with a KVarN K or V type, else standard at tail 0 or > 0."""
    if facts.pair_family(cell.k, cell.v) == "kvarn":
        return "kvarn"
    return "standard t0" if cell.tail == 0 else "standard tail"


def article_cells(article: Path = ARTICLE) -> dict[str, dict[str, list]]:
    """model -> kind -> its cells (kvarn.plan.matrix.expand of the article config)."""
    m = kvm.expand(yaml.safe_load(Path(article).read_text()))
    out = {name: {k: [] for k in KINDS[1:]} for name in m.models}
    for c in m.cells:
        out[c.model][kind_of(c)].append(c)
    return out


def article_compute(article: Path = ARTICLE) -> str:
    """The attention arithmetic config/article.yaml's cells run (their `compute`; ValueError for a mix)."""
    computes = {c.compute for kinds in article_cells(article).values() for cells in kinds.values() for c in cells}
    if len(computes) != 1:
        raise ValueError(f"{article}: its cells run computes {sorted(computes)}; the projection takes one")
    return computes.pop()


def resolve_compute(compute: str | None, article: Path = ARTICLE) -> tuple[str, str | None]:
    """(the compute to project, a note or None): `compute` as given; None: the article's, or
    FALLBACK_COMPUTE with a note where the article runs one the projection does not model."""
    if compute is not None:
        return compute, None
    own = article_compute(article)
    if own in ATTENTION_COMPUTES:
        return own, None
    return FALLBACK_COMPUTE, (f"{Path(article).name} runs compute {own!r}, which this does not model (fp32 attention "
                              f"off the tensor cores); projected under {FALLBACK_COMPUTE}, the path its cells would "
                              "need to run on for these hours")


def plan(article: Path = ARTICLE, study_chunks: dict | None = None) -> dict[str, dict[str, dict]]:
    """Per model, per kind: cells, chunks per cell, n_ctx and tokens (cells x chunks x n_ctx).
    Chunk counts: `study_chunks` (default bench.gpu.article.STUDY_CHUNKS, issue 9's reading of
    the real tokenizers' counts); one baseline per model."""
    chunks = dict(STUDY_CHUNKS if study_chunks is None else study_chunks)
    out = {}
    for name, kinds in article_cells(article).items():
        n_ctx = {c.n_ctx for cells in kinds.values() for c in cells}
        if len(n_ctx) != 1:
            raise ValueError(f"{name}: the article runs one n_ctx per model, found {sorted(n_ctx)}")
        n_ctx = n_ctx.pop()
        if name not in chunks:
            raise ValueError(f"{name}: no study chunk count (known: {sorted(chunks)})")
        counts = {"baseline": 1, **{k: len(v) for k, v in kinds.items()}}
        out[name] = {k: {"cells": n, "chunks": chunks[name], "n_ctx": n_ctx, "tokens": n * chunks[name] * n_ctx}
                     for k, n in counts.items()}
    return out


def modelled_parts(model: str, kind: str, device: str = "h200", article: Path = ARTICLE,
                   compute: str | None = None) -> dict[str, float]:
    """Seconds per chunk by part for `kind` on `model`: the mean over the kind's article cells
    (cells of one tail and family cost the same here, so each distinct one is costed once and
    weighted by its count). `compute` None: the article's (`resolve_compute`)."""
    compute = resolve_compute(compute, article)[0]
    cells = article_cells(article)[model]
    n_ctx = next(c.n_ctx for kind_cells in cells.values() for c in kind_cells)
    if kind == "baseline":
        variants = Counter([None])
    else:
        # the cost depends on a cell only through its family and its policy (sink, tail)
        variants = Counter((c.k if kind == "kvarn" else "q4_0", c.v if kind == "kvarn" else "q4_0", c.tail)
                           for c in cells[kind])
    total = sum(variants.values())
    out: dict[str, float] = {}
    for cell, n in variants.items():
        for name, part in per_token(model, n_ctx, kind, cell, compute=compute).items():
            out[name] = out.get(name, 0.0) + n / total * n_ctx * part_seconds(part, device)
    return out


def modelled(model: str, kind: str, device: str = "h200", compute: str | None = None,
             article: Path = ARTICLE) -> float:
    """Seconds per chunk of one cell of `kind` on `model` (the roofline sum of `per_token`'s
    parts; `compute` None: the article's, `resolve_compute`); `project` adds CELL_FIXED_S per
    cell and the model load per model."""
    return sum(modelled_parts(model, kind, device, article, compute).values())


def project(device: str = "h200", measured: dict[str, dict[str, float]] | None = None,
            study_chunks: dict | None = None, article: Path = ARTICLE, compute: str | None = None) -> dict:
    """The article's device-hours on `device` under `compute` (None: the article's own, or
    FALLBACK_COMPUTE with a `note` where it is not modelled, `resolve_compute`): one row per
    (model, kind) with cells, chunks,
    s_per_chunk (`measured[model][kind]` where given, else `modelled`), its source, fixed_s (per
    cell) and gpu_hours = cells x (chunks x s_per_chunk + fixed_s) / 3600; one "model load" row
    per model; the total; and the dominant (model, kind, part): the part with the most hours
    (a measured row's seconds shared among its parts as the model shares them)."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: expected one of {sorted(DEVICES)}")
    compute, note = resolve_compute(compute, article)
    measured = measured or {}
    rows, part_hours, device_hours = [], {}, 0.0
    for model, kinds in plan(article, study_chunks).items():
        for kind, p in kinds.items():
            parts = modelled_parts(model, kind, device, article, compute)
            rated = {name for name, part in per_token(model, p["n_ctx"], kind, compute=compute).items()
                     if part["unit"] == "rate"}
            model_s = sum(parts.values())
            got = measured.get(model, {}).get(kind)
            s = float(got) if got is not None else model_s
            hours = p["cells"] * (p["chunks"] * s + CELL_FIXED_S) / 3600
            rows.append({"model": model, "kind": kind, "cells": p["cells"], "chunks": p["chunks"],
                         "n_ctx": p["n_ctx"], "tokens": p["tokens"], "s_per_chunk": s,
                         "source": "measured" if got is not None else "model", "fixed_s": CELL_FIXED_S,
                         "gpu_hours": hours})
            for name, t in parts.items():
                part_hours[(model, kind, name)] = p["cells"] * p["chunks"] * t * (s / model_s) / 3600
                if name not in rated:
                    device_hours += part_hours[(model, kind, name)]
            part_hours[(model, kind, FIXED)] = p["cells"] * CELL_FIXED_S / 3600
        load = model_load_s(model)
        rows.append({"model": model, "kind": "model load", "cells": 0, "chunks": 0, "n_ctx": None, "tokens": 0,
                     "s_per_chunk": None, "source": "model", "fixed_s": load, "gpu_hours": load / 3600})
        part_hours[(model, "model load", "model load")] = load / 3600
    total = sum(r["gpu_hours"] for r in rows)
    top = max(part_hours, key=part_hours.get)
    by_part = Counter()
    for (_, _, name), hrs in part_hours.items():
        by_part[name] += hrs
    rest = total - device_hours
    return {"device": device, "compute": compute, "note": note, "rows": rows, "total_hours": total, "goal_hours": GOAL_HOURS,
            "tokens": sum(r["tokens"] for r in rows),
            "dominant": {"model": top[0], "kind": top[1], "part": top[2], "gpu_hours": part_hours[top]},
            "by_part": dict(by_part.most_common()),
            "part_hours": [{"model": m, "kind": k, "part": n, "gpu_hours": h} for (m, k, n), h in part_hours.items()],
            # the goal holds while the device reaches at least this share of every assumed
            # fraction (roofline parts scale as 1/x; rated, fixed and load hours stay): x = device / (goal - rest)
            "break_even": device_hours / (GOAL_HOURS - rest) if rest < GOAL_HOURS else None,
            "device_hours": device_hours,
            "study_chunks": dict(STUDY_CHUNKS if study_chunks is None else study_chunks)}


# ----------------------------------------------------------------------------- the report


def markdown(proj: dict) -> str:
    """The table, the total against the goal, what dominates and the assumptions, in Markdown."""
    dev = DEVICES[proj["device"]]
    L = [f"Projected device-hours of config/article.yaml on one {dev['name']} "
         f"({dev['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16, {dev['hbm_Bps'] / 1e12:.2f} TB/s HBM), "
         "`python -m bench.gpu.projection"
         + ("" if proj["device"] == "h200" else f" --device {proj['device']}")
         + f" --compute {proj['compute']}"
         + f"` (attention: compute {proj.get('compute', 'bf16-attn')}):", "",
         "| model | kind | cells | chunks | n_ctx | tokens | s/chunk | source | GPU-hours |",
         "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in proj["rows"]:
        if r["kind"] == "model load":
            L.append(f"| {r['model']} | model load (once) | | | | | | {r['source']} | {r['gpu_hours']:.2f} |")
            continue
        L.append(f"| {r['model']} | {r['kind']} | {r['cells']} | {r['chunks']} | {r['n_ctx']:,} | {r['tokens']:,} | "
                 f"{r['s_per_chunk']:.1f} | {r['source']} | {r['gpu_hours']:.2f} |")
    total, goal = proj["total_hours"], proj["goal_hours"]
    verdict = "within" if total <= goal else "over"
    L += ["", f"**Total: {total:.2f} GPU-hours for {proj['tokens']:,} tokens, {verdict} the goal of "
          f"≤ {goal:g} H200-hours** ({proj['tokens'] / (total * 3600):,.0f} tokens/s on average; the goal needs "
          f"{proj['tokens'] / (goal * 3600):,.0f}).", ""]
    if proj.get("note"):
        L += [f"Note: {proj['note']}.", ""]
    d = proj["dominant"]
    share = d["gpu_hours"] / total
    L.append(f"Dominant: **{d['part']}** of {d['model']} {d['kind']} cells, {d['gpu_hours']:.2f} h "
             f"({share:.0%} of the total). By part over all rows (GPU-hours):")
    L.append("")
    L.append("| part | GPU-hours | share |")
    L.append("|---|---:|---:|")
    for name, hrs in proj["by_part"].items():
        L.append(f"| {name} | {hrs:.2f} | {hrs / total:.0%} |")
    be = proj["break_even"]
    L += ["", f"Roofline parts {proj['device_hours']:.2f} h; parts at stated rates, per-cell fixed and model load "
          f"{total - proj['device_hours']:.2f} h: "
          + (f"the goal holds while the device reaches at least {be:.0%} of every assumed fraction below "
             f"(compute and bandwidth alike)." if be is not None else
             "the rated, fixed and load hours alone exceed the goal.")]
    f = dev["fraction"]
    L += ["", "Assumptions (bench/gpu/projection.py states where each comes from):", "",
          f"* attainable fractions of peak: GEMMs {f['gemm']:.0%} (eager elementwise kernels included), flex "
          f"attention {f['attention']:.0%} (head dim ≤ 256) and {f['attention_d512']:.0%} (512), Gated DeltaNet "
          f"{f['linear']:.0%}; HBM {f['hbm']:.0%} for streaming ops; each part max(compute, memory) time",
          f"* host: log-probs to the host {HOST['d2h_Bps'] / 1e9:g} GB/s, baseline encoding "
          f"{HOST['encode_Bps'] / 1e9:g} GB/s of fp32 log-probs, dump reads {HOST['read_Bps'] / 1e9:g} GB/s, "
          f"KVarN's Triton quantize {HOST['kvarn_Bps'] / 1e9:g} GB/s of fp32 K/V (measured on an H200)",
          f"* study chunk counts: {proj['study_chunks']} (bench.gpu.article.STUDY_CHUNKS: issue 9's reading; "
          "the real tokenizers' counts are not computable offline)",
          f"* per cell {CELL_FIXED_S:g} s fixed; per model the weights at {LOAD_DISK_Bps / 1e9:g} GB/s and "
          f"{COMPILE_S:g} s of flex compilation per head dim; flex tiles of {QUERY_BLOCK}, ubatch {UBATCH}, "
          f"baseline entries above the floor {NONZERO_SHARE:.1%} of the vocabulary (Gemma 3 270M's mean)"]
    if proj.get("compute") == "tf32-attn":
        L.append(f"* tf32-attn: the attention at half those fractions of the bf16 peak (TF32's dense rate), K/V tiles "
                 f"of 4 bytes, the fp32 [body ; exact] rows staged ({CONCAT_BYTES_TF32['body+exact']} B per body row "
                 f"element with an exact copy) and Q, K and V rounded to TF32 every call ({TF32_ROUND_BYTES} B per "
                 "element, kvarn.kvcache.rounding)")
    sources = Counter(r["source"] for r in proj["rows"] if r["kind"] != "model load")
    L.append(f"* rows measured on the device: {sources.get('measured', 0)}, modelled: {sources.get('model', 0)}")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="h200", choices=sorted(DEVICES))
    ap.add_argument("--compute", default=None, choices=ATTENTION_COMPUTES,
                    help=f"the attention's arithmetic (default config/article.yaml's, or {FALLBACK_COMPUTE} where "
                         "the projection does not model it)")
    ap.add_argument("--out", default=None, help="write the Markdown here too")
    args = ap.parse_args(argv)
    try:
        md = markdown(project(args.device, compute=args.compute))
    except ValueError as e:  # an article whose cells mix computes
        print(f"bench.gpu.projection: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
