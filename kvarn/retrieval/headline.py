"""The README's retrieval sentences, computed from the comparisons table (comparisons.parquet): per
pair of formats, in how many (model, length) runs the pair differs after Holm, and which way, on the
answer's paired log-probability (Wilcoxon) and on right/wrong (exact McNemar); then the small-model
caveat. `tools/readme_figures.py --readme` writes it between the README's retrieval markers.
"""

from __future__ import annotations

import polars as pl

ALPHA = 0.05  # the level every retrieval test is read at, after Holm's adjustment


def caveat(models, contexts) -> str:
    """The small-model caveat for these models and context lengths (tokens)."""
    return (f"{', '.join(sorted(models))} are small models at short contexts "
            f"({', '.join(str(c) for c in sorted(contexts))} tokens); a format that keeps their answers may still "
            "lose a fact at 16k–64k tokens in a 27–31B model, and the reverse (config/retrieval-gpu.yaml is the run "
            "sized for that)")


def tally(comparisons: pl.DataFrame, alpha: float = ALPHA) -> list[dict]:
    """Per pair of formats (a_label vs b_label, in the table's order): its runs, and per measure the
    runs where a is significantly better, significantly worse, or neither, after Holm at `alpha`.
    log-prob: the sign of the paired mean Δ log p (a − b), its p `p_dlogprob_holm`; right/wrong: the
    sign of a_only − b_only (prompts only a, or only b, answers), its p `p_holm`. A missing p (no such
    test) counts as no difference."""
    out = []
    for (a, b), rows in comparisons.group_by(["a_label", "b_label"], maintain_order=True):
        t = {"a": a, "b": b, "runs": rows.height}
        for measure, p_col, sign in (("logprob", "p_dlogprob_holm", pl.col("dlogprob")),
                                     ("right", "p_holm", pl.col("a_only") - pl.col("b_only"))):
            sig = rows.filter(pl.col(p_col).is_not_null() & ~pl.col(p_col).is_nan() & (pl.col(p_col) < alpha))
            better = sig.filter(sign > 0)
            t[measure] = {"better": better.height, "worse": sig.filter(sign < 0).height}
            if measure == "logprob" and better.height:
                t["gain"] = (float(better["dlogprob"].min()), float(better["dlogprob"].max()))
        out.append(t)
    return out


def _counts(c: dict, runs: int) -> str:
    parts = [f"{word} in {c[key]}" for key, word in (("better", "better"), ("worse", "worse")) if c[key]]
    rest = runs - c["better"] - c["worse"]
    if rest:
        parts.append(f"no significant difference in {rest}")
    return ", ".join(parts) + f" of {runs}"


def sentences(comparisons: pl.DataFrame, alpha: float = ALPHA) -> str:
    """The README's retrieval paragraph (Markdown): what each format pair's tests say after Holm, and the caveat
    for the table's models and context lengths."""
    if comparisons.height == 0:
        raise ValueError("the retrieval comparisons table is empty: run the retrieval target first "
                         "(snakemake retrieval --configfile config/retrieval.yaml)")
    pairs = []
    for t in tally(comparisons, alpha):
        gain = (f" ({t['gain'][0]:+.2f} to {t['gain'][1]:+.2f} nats)" if t["gain"][0] != t["gain"][1]
                else f" ({t['gain'][0]:+.2f} nats)") if "gain" in t else ""
        pairs.append(f"{t['a']} against {t['b']}: on the answer's log-prob {_counts(t['logprob'], t['runs'])} runs"
                     f"{gain}, on right/wrong {_counts(t['right'], t['runs'])}")
    models, lengths = comparisons["model"].unique(), sorted(comparisons["context"].unique())
    span = f"{lengths[0]}–{lengths[-1]}" if len(lengths) > 1 else str(lengths[0])
    return (f"Retrieval (RULER needles at {span} tokens, docs/notes/retrieval.md), paired on the same prompts, "
            f"significant at {alpha * 100:g} % after Holm across each (model, length) run's tests: " + "; ".join(pairs)
            + f". Caveat: {caveat(models, lengths)}.").replace("*", "\\*")  # Markdown: `128*` opens no emphasis
