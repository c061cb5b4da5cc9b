"""The per-layer study's held-out table and its heatmap.

Per (model, budget), every allocation the search picked (kvarn.perlayer.search: the knapsack's in
each family, the first/last form) against the **best uniform pair at no more bytes**: among the plain
cells of the searched types (symmetric and K/V splits, each family at its tail) in the run's summary,
the one of least median KLD on the test text whose bytes do not exceed the budget. That uniform pair
is picked on the test text itself, which favours the uniform side; the allocations were picked on the
validation text only. Each row's Δ median KLD (allocation − uniform) is paired over the same tokens
with its 95 % block-bootstrap interval (kvarn.stats.paired.compare); `verdict` says "lower" or
"higher" where the interval excludes 0, else "within noise". `gain_pct` = (1 − median / uniform
median) · 100, the figure the issue's 20 % aim reads.
"""

from __future__ import annotations

from pathlib import Path

import altair as alt
import polars as pl

from kvarn.perlayer.plan import PerLayer
from kvarn.stats import paired

COLUMNS = ("model", "budget", "budget_bytes", "method", "family", "cell", "bytes", "budget_ratio", "bits_per_value",
           "kld_median", "kld_mean", "kld_p99", "same_top", "valid_kld_mean", "predicted_kld_mean", "vs",
           "delta_median", "delta_lo", "delta_hi", "gain_pct", "verdict", "k_layers", "v_layers", "ik_llama_cpp")
METHOD_WORDS = {"knapsack": "knapsack", "first/last": "first/last", "uniform": "best uniform pair"}


def uniform_names(plan: PerLayer) -> set[str]:
    """The plain cells the uniform side is chosen from: `{k}-{v}-t{tail}` of every in-family pair."""
    return {f"{k}-{v}-t{t}" for k, v, t in plan.uniform_pairs()}


def best_uniform(summary: pl.DataFrame, model: str, budget_bytes: int, plan: PerLayer) -> dict | None:
    """The summary row of the least median KLD among `model`'s uniform cells within `budget_bytes`."""
    rows = summary.filter((pl.col("model") == model) & pl.col("cell").is_in(list(uniform_names(plan)))
                          & (pl.col("kv_total_bytes") <= budget_bytes)).sort(["kld_median", "kv_total_bytes"])
    return rows.row(0, named=True) if rows.height else None


def verdict(lo: float, hi: float) -> str:
    return "lower" if hi < 0 else "higher" if lo > 0 else "within noise"


def build(summary: pl.DataFrame, searches: list[dict], cell_dirs: dict, plan: PerLayer, n_boot: int = 2000,
          seed: int = 0) -> pl.DataFrame:
    """The table (`COLUMNS`): per search (a search JSON), the best uniform pair, then each allocation.
    `cell_dirs[(model, cell)]`: the cell's directory (its tokens.parquet)."""
    rows = []
    for s in searches:
        model, budget = s["model"], s["budget_bytes"]
        uni = best_uniform(summary, model, budget, plan)
        if uni is None:
            raise ValueError(f"{model}: no uniform cell of {', '.join(sorted(uniform_names(plan)))} within "
                             f"{budget:,} bytes in the summary; run the matrix with the perlayer config")
        base = paired.load_cell(cell_dirs[model, uni["cell"]], uni)
        out = [{"method": "uniform", "family": uni["family"], "cell": uni["cell"], "k_layers": uni["k_type"],
                "v_layers": uni["v_type"], "ik_llama_cpp": f"-ctk {uni['k_type']} -ctv {uni['v_type']}"
                if uni["family"] != "kvarn" else None, "valid_kld_mean": None, "predicted_kld_mean": None,
                "_row": uni}]
        for e in s["allocations"]:
            got = summary.filter((pl.col("model") == model) & (pl.col("cell") == e["cell"]))
            if not got.height:
                raise ValueError(f"{model}: the summary has no row of {e['cell']} ({e['name']}); run its cell")
            ex = e["exports"]
            out.append({"method": e["method"], "family": e["family"], "cell": e["cell"],
                        "k_layers": ex["ranges"]["k"], "v_layers": ex["ranges"]["v"],
                        "ik_llama_cpp": " ".join(ex["ik_llama_cpp"]) if ex["ik_llama_cpp"] else None,
                        "valid_kld_mean": e["valid"]["kld_mean"], "predicted_kld_mean": e.get("predicted_kld_mean"),
                        "_row": got.row(0, named=True)})
        for o in out:
            r = o.pop("_row")
            if o["method"] == "uniform":
                d = {"delta_median": 0.0, "delta_lo": 0.0, "delta_hi": 0.0, "gain_pct": 0.0, "verdict": None}
            else:
                st = paired.compare(base, paired.load_cell(cell_dirs[model, r["cell"]], r), n_boot=n_boot,
                                    seed=seed)["stats"]["kld_median"]
                d = {"delta_median": st["delta"], "delta_lo": st["lo"], "delta_hi": st["hi"],
                     "gain_pct": (1 - r["kld_median"] / uni["kld_median"]) * 100, "verdict": verdict(st["lo"], st["hi"])}
            rows.append({"model": model, "budget": s["budget"], "budget_bytes": budget, **o, "vs": uni["cell"],
                         "bytes": r["kv_total_bytes"], "budget_ratio": r["kv_total_bytes"] / budget,
                         "bits_per_value": r["bits_per_value"], "kld_median": r["kld_median"], "kld_mean": r["kld_mean"],
                         "kld_p99": r["kld_p99"], "same_top": r["same_top"], **d})
    return pl.DataFrame(rows, infer_schema_length=None).select(COLUMNS)


def gain_text(gain_pct: float | None) -> str:
    """The gain as a table prints it: a percentage, or for a loss past 100 % the multiple of the uniform median."""
    if gain_pct is None:
        return ""
    return f"{gain_pct:+.1f} %" if gain_pct > -100 else f"{1 - gain_pct / 100:.1f}× the uniform median"


def markdown(table: pl.DataFrame, searches: list[dict]) -> str:
    """The table per model, each budget's plain sentence, the engines' spellings and the search's notes."""
    out = ["# Which layers deserve the bits: per-layer KV types at equal memory", "",
           "Searched on Wikitext-2 valid, judged here on test. Δ median is the allocation's median KLD minus the "
           "best uniform pair's at no more bytes (picked on test, which favours it), with its paired 95 % "
           "interval; gain = 1 − median / uniform median. kvarn/perlayer/report.py says how.", ""]
    notes = {(s["model"], s["budget"]): s["notes"] for s in searches}
    for model in table["model"].unique(maintain_order=True):
        t = table.filter(pl.col("model") == model)
        out += [f"## {model}", "",
                "| budget | method | cell | bits/value | bytes / budget | median KLD | mean KLD | p99 KLD | same-top "
                "| valid mean (sum of probes) | Δ median [95 %] | gain | verdict |",
                "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
        for r in t.iter_rows(named=True):
            valid = "" if r["valid_kld_mean"] is None else (
                f"{r['valid_kld_mean']:.2e}" + (f" ({r['predicted_kld_mean']:.2e})" if r["predicted_kld_mean"] is not None else ""))
            delta = "" if r["verdict"] is None else f"{r['delta_median']:+.2e} [{r['delta_lo']:+.2e}, {r['delta_hi']:+.2e}]"
            out.append(f"| {r['budget']} | {METHOD_WORDS[r['method']]} | `{r['cell']}` | {r['bits_per_value']:.2f} "
                       f"| {r['budget_ratio']:.3f} | {r['kld_median']:.2e} | {r['kld_mean']:.2e} | {r['kld_p99']:.2e} "
                       f"| {100 * r['same_top']:.2f} % | {valid} | {delta} | {gain_text(r['gain_pct'])} "
                       f"| {r['verdict'] or 'reference'} |")
        out.append("")
        for budget in t["budget"].unique(maintain_order=True):
            b = t.filter(pl.col("budget") == budget)
            uni = b.filter(pl.col("method") == "uniform").row(0, named=True)
            alloc = b.filter(pl.col("method") != "uniform").sort("kld_median")
            if not alloc.height:
                continue
            best = alloc.row(0, named=True)
            fl = b.filter(pl.col("method") == "first/last")
            words = {"lower": "a real gain", "higher": "worse, beyond noise", "within noise": "within noise"}[best["verdict"]]
            line = (f"* At {budget}'s bytes: the best allocation ({METHOD_WORDS[best['method']]}, {best['family']}) has "
                    f"median KLD {best['kld_median']:.2e} against {uni['kld_median']:.2e} for the best uniform pair "
                    f"`{uni['cell']}`: {best['gain_pct']:+.1f} %, {words}")
            line += "; the 20 % aim is met." if best["verdict"] == "lower" and best["gain_pct"] >= 20 else "; the 20 % aim is not met."
            if fl.height:
                f = fl.row(0, named=True)
                share = "captures it" if f["kld_median"] <= best["kld_median"] else (
                    f"does not capture it (median {f['kld_median']:.2e}, {gain_text(f['gain_pct'])} against the uniform pair)")
                line += f" The first/last form `{f['cell']}` {share}."
            for n in notes.get((model, budget), []):
                line += f" Note: {n}."
            out.append(line)
        out += ["", "Engines' spellings (ranges as SGLang's and TensorRT-LLM's range strings take them; ik_llama.cpp's "
                "flags where its first/last form expresses the map):", ""]
        for r in t.filter(pl.col("method") != "uniform").iter_rows(named=True):
            ik = f"; ik_llama.cpp `{r['ik_llama_cpp']}`" if r["ik_llama_cpp"] else ""
            out.append(f"* `{r['cell']}`: K `{r['k_layers']}`, V `{r['v_layers']}`{ik}")
        out.append("")
    return "\n".join(out)


def heatmap(sens: pl.DataFrame, model: str) -> alt.Chart:
    """Layer × type, K and V side by side: the KLD one layer's probe added (log colour scale)."""
    d = sens.select("layer", "kind", "role", "type", "kld_mean").with_columns(
        role=pl.col("role").str.to_uppercase(), kld_mean=pl.max_horizontal(pl.col("kld_mean"), pl.lit(1e-9)))
    order = list(dict.fromkeys(d.sort("type")["type"].to_list()))
    full = sorted(set(d.filter(pl.col("kind") == "full_attention")["layer"].to_list()))
    kinds = (f"full attention at {', '.join(map(str, full))}, the rest sliding" if full and d["kind"].n_unique() > 1
             else "all " + d["kind"][0].replace("_", " "))
    return alt.Chart(d).mark_rect().encode(
        x=alt.X("layer:O", title="decoder layer"),
        y=alt.Y("type:N", sort=order, title=None),
        color=alt.Color("kld_mean:Q", scale=alt.Scale(type="log", scheme="viridis"), title="mean KLD added",
                        legend=alt.Legend(format=".0e")),
        tooltip=["layer", "kind", "role", "type", alt.Tooltip("kld_mean:Q", format=".2e")],
    ).properties(width=alt.Step(14), height=alt.Step(16)).facet(
        row=alt.Row("role:N", title=None)).properties(
        title=[f"{model}: KLD added by quantizing one layer's K or V alone (search text)",
               f"layers by kind: {kinds}; values at or below 1e-9 drawn at 1e-9"])


def sensitivity_frame(paths) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(p) for p in paths], how="diagonal_relaxed")


def cell_dir_map(token_paths) -> dict:
    """(model, cell) -> directory from tokens.parquet paths results/{model}/ctx.../cells/{cell}/tokens.parquet."""
    return {(Path(p).parents[3].name, Path(p).parent.name): Path(p).parent for p in token_paths}
