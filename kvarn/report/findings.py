"""The README's findings in plain words: per model a few generated sentences and a scoreboard, from
a run's answer (results/answer.parquet, `kvarn.report.advise.frontier_frame`) and its claims ledger
(results/claims.parquet). Nothing here is typed by hand: `tools/readme_figures.py
--readme` writes it between the README's findings markers, and a test checks the block.
"""

from __future__ import annotations

import polars as pl

from kvarn.report.claims.verdicts import is_study_claim

CAVEAT = ("These are small models at a short context: read the orderings, not the digits; as the study says, "
          "the recommendation cannot be copied between models — run `kvarn advise` on your own.")


def _md(text: str) -> str:
    return text.replace("*", "\\*")


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.2f} %"


def same_width_sentence(led: pl.DataFrame) -> str | None:
    """KVarN against the same-width standard type at tail 128, by the sign of our gain and its interval."""
    sw = led.filter(pl.col("claim_id").str.starts_with("same_width_gain_") & pl.col("ours").is_not_null())
    if sw.is_empty():
        return None
    lower = sw.filter((pl.col("ours") > 0) & (pl.col("delta_hi").is_null() | (pl.col("delta_hi") < 0)))
    higher = sw.filter((pl.col("ours") < 0) & (pl.col("delta_lo").is_null() | (pl.col("delta_lo") > 0)))
    tied = sw.filter(~pl.col("claim_id").is_in(lower["claim_id"]) & ~pl.col("claim_id").is_in(higher["claim_id"]))

    def ws(df):
        return ", ".join(str(w) for w in sorted(int(c.rsplit("_", 1)[1]) for c in df["claim_id"]))

    parts = []
    if lower.height:
        gains = ", ".join(f"{r['ours']:+.0f} %" for r in lower.sort("claim_id").iter_rows(named=True))
        parts.append(f"KVarN (at its 128\\* tail) has the lower median KLD at {ws(lower)} bits ({gains})")
    if higher.height:
        parts.append(f"the higher at {ws(higher)} bits")
    if tied.height:
        parts.append(f"no separable difference at {ws(tied)} bits")
    return "Against the standard type of the same width at tail 128, " + "; ".join(parts) + "."


def tail_sentence(led: pl.DataFrame) -> str | None:
    """What a 128-token exact tail does to the standard types' medians."""
    te = led.filter(pl.col("claim_id").str.contains(r"^tail_effect_\d+$") & pl.col("ours").is_not_null())
    if te.is_empty():
        return None
    parts = []
    for r in te.sort("claim_id").iter_rows(named=True):
        w = r["claim_id"].rsplit("_", 1)[1]
        sep = " (not separable)" if r["verdict"] == "not separable" else ""
        parts.append(f"q{w}_0's by {r['ours']:+.0f} %{sep}")
    return "A 128-token exact tail changes the median KLD: " + ", ".join(parts) + "."


def model_findings(model: str, frame: pl.DataFrame, led: pl.DataFrame) -> list[str]:
    """At most 12 lines of plain findings for one model, then its scoreboard."""
    f = frame.filter(pl.col("model") == model)
    front = f.filter(pl.col("role") == "frontier").sort("kv_mib")
    run = f.row(0, named=True)
    head = (f"**{model}** ({run['engine']} engine, n_ctx {run['n_ctx']}, {run['chunks']} chunks, {run['n_tokens']} "
            f"scored tokens, MiB under `{run['accounting']}`):")
    lines = [head, ""]
    pick = f.filter(pl.col("role") == "pick")
    tol = f"median KLD ≤ {run['max_kld']:g} and same-top ≥ {100 * run['min_same_top']:g} %"
    if pick.height:
        p = pick.row(0, named=True)
        lines.append(f"- **The pick** ({tol}): **{_md(p['name'])}**, {p['kv_mib']:.2f} MiB, {p['bits_per_value']:.2f} "
                     f"bits per value, median KLD {p['kld_median']:.3g}, same-top {_pct(p['same_top'])}.")
    else:
        lines.append(f"- No cell of this run is within {tol}.")
    bands = front["band"].n_unique()
    lines.append(f"- The frontier has {front.height} cells in {bands} band{'s' if bands != 1 else ''}, from "
                 f"{_md(front['name'][0])} ({front['bits_per_value'][0]:.2f} bits per value) to "
                 f"{_md(front['name'][-1])} ({front['bits_per_value'][-1]:.2f}); cells in one band are not "
                 "separable by the paired test, so the cheapest of a band is the one to run.")
    kv = front.filter(pl.col("name").str.starts_with("kvarn"))
    lines.append(f"- KVarN cells on the frontier: {kv.height} of {front.height}"
                 + (f" ({', '.join(_md(n) for n in kv['name'])})." if kv.height else "."))
    presets = f.filter(pl.col("role").str.starts_with("preset:"))
    if presets.height:
        lines.append("- Presets (our rule: the cheapest cell at or below q8_0 / q5_0 / q4_0 at tail 128): "
                     + "; ".join(f"{r['role'].split(':')[1]} **{_md(r['name'])}** ({r['kv_mib']:.2f} MiB)"
                                 for r in presets.iter_rows(named=True)) + ".")
    m_led = led.filter((pl.col("model") == model) & is_study_claim())
    for sentence in (same_width_sentence(m_led), tail_sentence(m_led)):
        if sentence:
            lines.append(f"- {sentence}")
    lines += ["", *scoreboard(front).splitlines()]
    return lines


def scoreboard(front: pl.DataFrame) -> str:
    """The frontier as llama.cpp's perplexity README shows a scoreboard: one row per cell."""
    out = ["| band | cell | MiB | bits/value | median KLD | mean KLD | p99 KLD | same-top | PPL ratio |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in front.iter_rows(named=True):
        ppl = "–" if r["ppl_ratio"] is None else f"{r['ppl_ratio']:.4f}"
        out.append(f"| {r['band']} | {_md(r['name'])} | {r['kv_mib']:.2f} | {r['bits_per_value']:.2f} | "
                   f"{r['kld_median']:.3g} | {r['kld_mean']:.3g} | {r['kld_p99']:.3g} | {_pct(r['same_top'])} | {ppl} |")
    return "\n".join(out)


def findings_markdown(frame: pl.DataFrame, led: pl.DataFrame) -> str:
    """The README's findings block: the caveat once, then every model's findings and scoreboard."""
    out = [CAVEAT, ""]
    for model in frame["model"].unique(maintain_order=True).to_list():
        out += model_findings(model, frame, led) + [""]
    return "\n".join(out)
