"""A plausible synthetic result set for testing the report without running a model.

`make_results(root)` writes, under `root/results/`:
* `{model}/ctx{n_ctx}-c{chunks}/cells/{k}-{v}-t{tail}/tokens.parquet` per cell (chunk, pos,
  kld, nll, nll_base, dp, same_top — docs/CONTRACTS.md), and
* `summary.parquet`: one row per cell with the summary.json keys, the statistics computed
  from those tokens, plus what the aggregate rule adds (kvarn.plan.rows.summary_row):
  `family`, `tail_requested`, `tail_label`, `cell`, `kv_delta_bytes_vs_tail0`. Type facts and
  KV bytes (the `packed` accounting) come from kvarn.vocab.facts and kvarn.budget.memory, as in a real run.

Two models with the shipped defaults' geometry (SmolLM2-135M: 30 layers x 3 KV heads x 64;
Gemma 3 270M: 18 layers x 1 x 256, 5 of 6 layers sliding 512). KLD falls with width, a
128-token tail helps most at low width, KVarN beats the same-width standard type by a few
percent except at 2 bits on the Gemma-like model (as in DESIGN §7). Some partners are
missing on purpose (smollm2: no q3_0 at tail 128; gemma3: no kvarn5); smollm2 has a
KVarN request-128 duplicate of its 128* cell and a `-norot` q4_0 cell.
Run as a script to write a result set: `python tests/synthetic.py OUT_DIR`.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import polars as pl

from kvarn.vocab.cell import CellSpec
from kvarn.vocab import facts
from kvarn.vocab.geometry import Geometry
from kvarn.budget.memory import bits_per_value, summary_fields

MODELS = {
    # name: (layers, kv_heads, head_dim, windows per layer, median KLD at 2 / 8 bits, kvarn gain)
    "smollm2-135m": (30, 3, 64, [None] * 30, (0.45, 0.0012),
                     {2: -0.055, 3: -0.126, 4: -0.079, 5: -0.05, 6: -0.026, 8: -0.12}),
    "gemma3-270m": (18, 1, 256, [512 if (i + 1) % 6 else None for i in range(18)], (1.3, 0.0009),
                    {2: 0.57, 3: -0.1, 4: -0.27, 6: -0.04, 8: -0.1}),
}
STANDARD_PAIRS = [(f"q{w}_0", f"q{w}_0") for w in (2, 3, 4, 5, 6, 8)] + [
    ("q8_0", "q4_0"), ("q4_0", "q8_0"), ("q8_0", "q5_0")]
KVARN_PAIRS = [(f"kvarn{w}", f"kvarn{w}") for w in (2, 3, 4, 5, 6, 8)] + [("kvarn6", "kvarn5"), ("kvarn8", "kvarn4")]


def _bits(t: str) -> int:
    return facts.get(t).bits


def geometry(model: str) -> Geometry:
    L, H, D, windows, _, _ = MODELS[model]
    return Geometry.uniform(L, H, D, tuple(windows))


def exact_share(model: str, n_ctx: int, k: str, v: str, tail: int, sink: int | None = None) -> float:
    """The product's exact share (kvarn.vocab.policy) for a cell of the fixture."""
    from kvarn.vocab.policy import exact_share as share, layer_policy

    return share([layer_policy(facts.get(k), facts.get(v), tail, w, sink) for w in MODELS[model][3]], n_ctx)


def _median(model: str, k: str, v: str, tail: int) -> float:
    _, _, _, _, (m2, m8), gain = MODELS[model]
    def one(t: str) -> float:
        b = _bits(t)
        m = m2 * (m8 / m2) ** ((b - 2) / 6)
        relief = 0.6 * 0.015 ** ((b - 2) / 6)  # what a 128-token tail removes
        if t.startswith("kvarn"):
            m *= (1 - relief) * (1 + gain.get(b, -0.05))
        elif tail > 0:
            m *= 1 - relief * min(1.0, tail / 128)
        return m
    return math.exp(0.6 * math.log(one(k)) + 0.4 * math.log(one(v)))


def _stats(x: np.ndarray, prefix: str) -> dict:
    q = lambda f: float(np.quantile(x, f))  # linear at f*(n-1), as DESIGN §6
    return {
        f"{prefix}_max": float(x.max()), f"{prefix}_p99_9": q(0.999), f"{prefix}_p99": q(0.99),
        f"{prefix}_p95": q(0.95), f"{prefix}_p90": q(0.90), f"{prefix}_median": q(0.5),
        f"{prefix}_p10": q(0.10), f"{prefix}_p05": q(0.05), f"{prefix}_p01": q(0.01),
        f"{prefix}_p00_1": q(0.001), f"{prefix}_min": float(x.min()),
    }


def make_results(root: str | Path, n_ctx: int = 1024, chunks: int = 4, seed: int = 0) -> pl.DataFrame:
    root = Path(root)
    rng = np.random.default_rng(seed)
    rows = []
    scored = np.arange(n_ctx // 2, n_ctx - 1)
    for m_index, model in enumerate(MODELS):
        # One baseline per run: every cell of a model shares the base NLL of each token (its
        # own generator, so the per-cell draws below stay as they were).
        run_nll_base = np.random.default_rng([seed, m_index]).gamma(2.0, 1.5, chunks * len(scored))
        cells = [(k, v, t, "standard") for k, v in STANDARD_PAIRS for t in (0, 128)]
        cells += [(k, v, 0, "kvarn") for k, v in KVARN_PAIRS]
        if model == "smollm2-135m":
            cells.remove(("q3_0", "q3_0", 128, "standard"))
            cells.append(("kvarn4", "kvarn4", 128, "kvarn"))
        else:
            cells = [c for c in cells if "kvarn5" not in c[:2]]
        if model == "smollm2-135m":
            cells.append(("q4_0", "q4_0", 0, "standard", "-norot"))  # a non-default option
            # the format-only rows: KVarN's sink (128), tail and F16 tail dtype on q4_0 and q2_0
            cells += [(f"q{w}_0", f"q{w}_0", 128, "standard", "-tdf16-s128") for w in (2, 4)]
            # the tail sweep (q4_0 and kvarn4 beyond 128; tails < the fixture's n_ctx 1024)
            cells += [("q4_0", "q4_0", t, "standard") for t in (256, 512)]
            cells += [("kvarn4", "kvarn4", t, "kvarn") for t in (256, 512)]
        for k, v, tail, family, *opt in cells:
            opts = opt[0] if opt else ""
            sink = 128 if "-s128" in opts else None
            med = _median(model, k, v, tail) * (0.6 if sink else 1.0)  # the sink removes part of the damage
            growth = 0.25 if family == "kvarn" else 0.8  # error accumulation across the context
            frac = (scored - scored[0]) / (scored[-1] - scored[0])
            pos = np.tile(scored, chunks)
            chunk = np.repeat(np.arange(chunks), len(scored))
            kld = med * (1 + growth * np.tile(frac, chunks)) * rng.lognormal(0.0, 1.4, len(pos)) / (1 + growth / 2)
            rng.gamma(2.0, 1.5, len(pos))  # formerly a per-cell base NLL; drawn to keep the stream
            nll_base = run_nll_base
            nll = nll_base + rng.normal(0, 1, len(pos)) * np.sqrt(kld)
            dp = -rng.normal(0, 1, len(pos)) * np.sqrt(kld) * 0.2
            same_top = rng.random(len(pos)) > np.clip(2.5 * np.sqrt(kld) * 0.3, 0, 0.9)
            cell_dir = root / "results" / model / f"ctx{n_ctx}-c{chunks}" / "cells" / f"{k}-{v}-t{tail}{opts}"
            cell_dir.mkdir(parents=True, exist_ok=True)
            pl.DataFrame({
                "chunk": chunk.astype(np.int32), "pos": pos.astype(np.int32), "kld": kld, "nll": nll,
                "nll_base": nll_base, "dp": dp, "same_top": same_top,
            }).write_parquet(cell_dir / "tokens.parquet")
            mem = summary_fields(geometry(model), n_ctx,
                                 CellSpec(k, v, tail, tail_dtype="f16" if sink else None, sink=sink))  # `packed`
            mem.pop("kv_geometry")
            n = len(kld)
            st = same_top.mean()
            ppl_q, ppl_b = math.exp(nll.mean()), math.exp(nll_base.mean())
            eff_full = facts.pair_effective_tail(k, v, tail)
            windows = MODELS[model][3]
            eff_sliding = min(eff_full, 512) if any(w is not None for w in windows) else eff_full
            rows.append({
                "model": model, "source": f"embedded:{model}", "revision": None, "n_ctx": n_ctx,
                "chunks": chunks, "ubatch": 512, "k_type": k, "v_type": v, "rot": opts != "-norot", "tail": tail,
                "tail_eff_full": eff_full, "tail_eff_sliding": eff_sliding,
                "exact_share": exact_share(model, n_ctx, k, v, tail, sink),
                "sink": sink or max(facts.get(k).sink, facts.get(v).sink), "sink_requested": sink,
                "tail_dtype": "f16" if sink else facts.pair_default_tail_dtype(k, v), "iters": 16, **mem,
                "tokens_per_s": float(rng.uniform(800, 3000) * (0.7 if family == "kvarn" else 1.0)),
                "wall_s": float(rng.uniform(5, 30)), "kvarn_version": "0.1.0", "format_version": 1,
                "device": "cpu", "dtype": "float32",
                "n_tokens": n, "ppl_q": ppl_q, "ppl_q_err": ppl_q * 0.01, "ppl_base": ppl_b,
                "ppl_base_err": ppl_b * 0.01, "ppl_ratio": ppl_q / ppl_b, "ppl_ratio_err": 1e-3,
                "ln_ppl_ratio": math.log(ppl_q / ppl_b), "ln_ppl_ratio_err": 1e-3,
                "ppl_cor": float(np.corrcoef(nll, nll_base)[0, 1]),
                "kld_mean": float(kld.mean()), "kld_mean_err": float(kld.std(ddof=1) / math.sqrt(n)),
                **_stats(kld, "kld"), "dp_mean": float(dp.mean()),
                "dp_mean_err": float(dp.std(ddof=1) / math.sqrt(n)), **_stats(dp, "dp"),
                "dp_rms": float(np.sqrt((dp**2).mean())), "dp_rms_err": 1e-4,
                "same_top": float(st), "same_top_err": float(math.sqrt(st * (1 - st) / (n - 1))),
                "family": family, "tail_requested": tail, "tail_label": facts.tail_label(k, v, tail),
                "cell": f"{k}-{v}-t{tail}{opts}",
                "kv_delta_bytes_vs_tail0": mem["kv_total_bytes"] - mem["kv_total_bytes_tail0"],
                "bits_per_value": bits_per_value(mem["kv_total_bytes"], mem["kv_bf16_bytes"]),
            })
    summary = pl.DataFrame(rows, infer_schema_length=None)
    summary.write_parquet(root / "results" / "summary.parquet")
    return summary


def token_paths(root: str | Path, model: str) -> list[str]:
    return sorted(str(p) for p in (Path(root) / "results" / model).glob("ctx*-c*/cells/*/tokens.parquet"))


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    s = make_results(out)
    print(f"wrote {len(s)} cells under {out / 'results'}")
