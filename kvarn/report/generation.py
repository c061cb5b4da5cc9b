"""Statistics of long free-running generation (kvarn.run.decode results): torch-free.

Owns `survival` (Kaplan–Meier S(t) with its Greenwood band), `kld_curve` (the binned mean
per-step KLD with a bootstrap band over prompts), `slope` / `paired_slope` (accumulation per
generated step), `tf_vs_free` (free-running against teacher-forced KLD at the same positions:
`tf_positions`, `tf_matrix`) after `check_same_run`, the cells' own text (`repeated_ngrams`,
`text_stats`), one run's tables (`compute_run`) and their Markdown (`to_markdown`). Inputs: what
`kvarn decode` writes per (cell, decode) (`load_decode`: `summary.json`, whose
`first_divergence` per prompt is the one source of the divergence step, and `steps.parquet`),
and the same cell's teacher-forced `tokens.parquet` and `summary.json` with the identity of its
baseline dump.

Why (each statistic, censoring, the pooled slope, the position mapping, what a same run is):
docs/notes/decode.md "Long generation and its statistics".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl

from kvarn.report.data import same_width_partner
from kvarn.vocab.cell import CellSpec
from kvarn.vocab.options import summary_sampling
from kvarn.vocab.scoring import scored_range

DEFAULT_BOOT = 2000
DEFAULT_SEED = 0
DEFAULT_ALPHA = 0.05
CURVE_BINS = 32  # the KLD curves are drawn in about this many bins of generated steps
REPEAT_N = 4  # repeated n-grams of the cell's own text (`repeated_ngrams`)
DECODE_MATRICES = ("kld", "token", "nll_base")  # the step columns `load_decode` returns as [P, G]
# The cache settings a decode summary and a teacher-forced summary both record, by name:
# (decode key, teacher-forced key).
SAME_CELL_KEYS = (("model", "model"), ("source", "source"), ("revision", "revision"), ("n_ctx", "n_ctx"),
                  ("k_type", "k_type"), ("v_type", "v_type"), ("tail", "tail"), ("rot", "rot"),
                  ("iters", "iters"), ("sink", "sink_requested"))
# The run identity a decode summary shares with the teacher-forced run's baseline dump header.
SAME_TEXT_KEYS = ("text_sha256", "tokenizer_hash")


# ---------------------------------------------------------------- inputs


def load_decode(directory: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(summary dict, {"kld", "token", "nll_base"}: each [P, G] in (prompt, step) order) of one
    kvarn.run.decode result directory, its steps read once."""
    d = Path(directory)
    summary = json.loads((d / "summary.json").read_text())
    steps = pl.read_parquet(d / "steps.parquet", columns=["prompt", "step", *DECODE_MATRICES])
    return summary, step_matrices(steps, summary["n_prompts"], summary["n_tokens"], DECODE_MATRICES)


def repeated_ngrams(tokens, n: int = REPEAT_N) -> np.ndarray:
    """bool [P, G]: step s ends an n-gram of generated tokens that already ended at an earlier
    step of the same prompt (False for s < n − 1). A greedy generation caught in a loop repeats
    nearly every n-gram; its text is then nearly certain for the baseline too."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not isinstance(n, int) or n < 1:
        raise ValueError(f"repeated_ngrams: tokens [prompts, steps] and n >= 1, got shape {tokens.shape}, n {n!r}")
    out = np.zeros(tokens.shape, dtype=bool)
    for p, row in enumerate(tokens.tolist()):
        seen = set()
        for s in range(n - 1, len(row)):
            g = tuple(row[s - n + 1 : s + 1])
            out[p, s] = g in seen
            seen.add(g)
    return out


def early_steps(n_tokens: int) -> int:
    """The first steps of a generation whose baseline NLL `text_stats` reports: G/16, at least 1."""
    return max(1, n_tokens // 16)


def text_stats(tokens: np.ndarray, nll_base: np.ndarray) -> dict:
    """What the cell's own text is like, from its tokens and the baseline's NLL of them [P, G]: the
    share of repeated REPEAT_N-grams in the second half of the generation, and the mean NLL over
    the `early_steps` and over the second half (a loop's text costs the baseline almost nothing:
    KLD falls with it)."""
    half, early = tokens.shape[1] // 2, early_steps(tokens.shape[1])
    return {"repeat_late": float(repeated_ngrams(tokens)[:, half:].mean()),
            "nll_base_early": float(nll_base[:, :early].mean()), "nll_base_late": float(nll_base[:, half:].mean())}


def step_matrices(steps: pl.DataFrame, n_prompts: int, n_tokens: int, columns=("kld",)) -> dict[str, np.ndarray]:
    """{column: [P, G]} from (prompt, step, columns...) rows (floats as float64); refuses a table
    that is not exactly P × G."""
    if steps.height != n_prompts * n_tokens:
        raise ValueError(f"decode steps: {steps.height} rows, expected prompts × tokens = {n_prompts} × {n_tokens}")
    steps = steps.sort("prompt", "step")
    want_p = np.repeat(np.arange(n_prompts), n_tokens)
    want_s = np.tile(np.arange(n_tokens), n_prompts)
    if not (np.array_equal(steps["prompt"].to_numpy(), want_p) and np.array_equal(steps["step"].to_numpy(), want_s)):
        raise ValueError(f"decode steps: (prompt, step) is not every pair of 0..{n_prompts - 1} × 0..{n_tokens - 1}")
    out = {}
    for c in columns:
        x = steps[c].to_numpy()
        out[c] = (x.astype(np.float64) if x.dtype.kind == "f" else x).reshape(n_prompts, n_tokens)
    return out


def _check_boot(n_boot: int, alpha: float) -> None:
    if not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"bootstrap resamples must be a positive integer, got {n_boot!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")


def _resamples(n_prompts: int, n_boot: int, seed: int) -> np.ndarray:
    """int [n_boot, P]: prompt indices drawn with replacement (numpy default_rng(seed))."""
    return np.random.default_rng(seed).integers(0, n_prompts, size=(n_boot, n_prompts))


def _interval(samples: np.ndarray, alpha: float, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return (np.quantile(samples, alpha / 2, axis=axis), np.quantile(samples, 1 - alpha / 2, axis=axis))


# ---------------------------------------------------------------- survival


def survival(first_divergence, n_tokens: int, alpha: float = DEFAULT_ALPHA) -> pl.DataFrame:
    """Kaplan–Meier S(t), t = 0..n_tokens, of the first divergence (lifelines), with its
    exponential-Greenwood (1 − alpha) band: columns t, survival, lo, hi, at_risk.

    `first_divergence`: per prompt the first differing step (0-based), n_tokens = never."""
    from lifelines import KaplanMeierFitter

    fd = np.asarray(first_divergence, dtype=np.int64)
    if fd.ndim != 1 or fd.size == 0:
        raise ValueError(f"first_divergence must be a non-empty list of steps, got shape {fd.shape}")
    if fd.min() < 0 or fd.max() > n_tokens:
        raise ValueError(f"first_divergence must lie in 0..{n_tokens} (n_tokens = never diverged), "
                         f"got {fd.min()}..{fd.max()}")
    _check_boot(1, alpha)
    event = fd < n_tokens
    duration = np.where(event, fd + 1, n_tokens)
    t = np.arange(n_tokens + 1)
    km = KaplanMeierFitter(alpha=alpha).fit(duration, event, timeline=t)
    ci = km.confidence_interval_survival_function_.to_numpy()
    return pl.DataFrame({
        "t": t,
        "survival": km.survival_function_.to_numpy()[:, 0],
        "lo": ci[:, 0],
        "hi": ci[:, 1],
        "at_risk": (duration[None, :] >= t[:, None]).sum(axis=1),
    })


# ---------------------------------------------------------------- KLD along the cell's own text


def kld_curve(kld: np.ndarray, bin_width: int = 1, n_boot: int = DEFAULT_BOOT, seed: int = DEFAULT_SEED,
              alpha: float = DEFAULT_ALPHA) -> pl.DataFrame:
    """Mean KLD over prompts per bin of `bin_width` steps (the last bin may be shorter), with a
    percentile bootstrap band over prompts: columns step_lo, step_hi, step_mid, kld_mean, lo, hi."""
    kld = np.asarray(kld, dtype=np.float64)
    if kld.ndim != 2 or 0 in kld.shape:
        raise ValueError(f"kld must be a [prompts, steps] array, got shape {kld.shape}")
    if not isinstance(bin_width, int) or bin_width < 1:
        raise ValueError(f"bin_width must be a positive integer of steps, got {bin_width!r}")
    _check_boot(n_boot, alpha)
    g = kld.shape[1]
    starts = np.arange(0, g, bin_width)
    per_prompt = np.add.reduceat(kld, starts, axis=1) / np.diff(np.append(starts, g))  # [P, bins]
    boot = per_prompt[_resamples(kld.shape[0], n_boot, seed)].mean(axis=1)  # [B, bins]
    lo, hi = _interval(boot, alpha)
    ends = np.minimum(starts + bin_width, g) - 1
    return pl.DataFrame({"step_lo": starts, "step_hi": ends, "step_mid": (starts + ends) / 2,
                         "kld_mean": per_prompt.mean(axis=0), "lo": lo, "hi": hi})


# ---------------------------------------------------------------- accumulation


def _slopes(kld: np.ndarray) -> np.ndarray:
    """OLS slope of each row of kld [..., G] against steps 0..G−1."""
    x = np.arange(kld.shape[-1], dtype=np.float64)
    xc = x - x.mean()
    return (kld * xc).sum(axis=-1) / (xc * xc).sum()


def _check_slope_input(kld) -> np.ndarray:
    kld = np.asarray(kld, dtype=np.float64)
    if kld.ndim != 2 or kld.shape[0] < 1 or kld.shape[1] < 2:
        raise ValueError(f"kld must be a [prompts, steps ≥ 2] array for a slope, got shape {kld.shape}")
    return kld


def slope(kld, n_boot: int = DEFAULT_BOOT, seed: int = DEFAULT_SEED, alpha: float = DEFAULT_ALPHA) -> dict:
    """Accumulation of one cell: the OLS slope of the mean KLD curve against the generated step
    (KLD per generated token), its (1 − alpha) percentile bootstrap CI over prompts."""
    kld = _check_slope_input(kld)
    _check_boot(n_boot, alpha)
    per_prompt = _slopes(kld)
    boot = per_prompt[_resamples(kld.shape[0], n_boot, seed)].mean(axis=1)
    lo, hi = _interval(boot, alpha)
    return {"slope": float(_slopes(kld.mean(axis=0))), "slope_lo": float(lo), "slope_hi": float(hi)}


def paired_slope(kld_a, kld_b, n_boot: int = DEFAULT_BOOT, seed: int = DEFAULT_SEED,
                 alpha: float = DEFAULT_ALPHA) -> dict:
    """slope(a) − slope(b) of two cells decoded from the same prompts (row i of both is prompt
    i), with a percentile bootstrap CI resampling the prompts of both jointly."""
    a, b = _check_slope_input(kld_a), _check_slope_input(kld_b)
    if a.shape != b.shape:
        raise ValueError(f"paired slopes need the same prompts and steps in both cells, got shapes {a.shape} and {b.shape}")
    _check_boot(n_boot, alpha)
    diff = _slopes(a) - _slopes(b)
    boot = diff[_resamples(a.shape[0], n_boot, seed)].mean(axis=1)
    lo, hi = _interval(boot, alpha)
    return {"diff": float(_slopes(a.mean(axis=0)) - _slopes(b.mean(axis=0))), "diff_lo": float(lo), "diff_hi": float(hi)}


# ---------------------------------------------------------------- teacher-forced vs free-running


def check_same_run(decode_summary: dict, tf_summary: dict, tf_identity: dict) -> None:
    """Refuse (ValueError naming every differing field) a decode result and a teacher-forced
    cell that do not share model, n_ctx, cache settings, text and tokenizer, or whose chunks do
    not include the decode's prompts. `tf_identity`: the run identity of the teacher-forced
    cell's baseline dump (its header: text_sha256, tokenizer_hash, n_ctx, n_chunks)."""
    diff = [f"{dk}: decode {decode_summary.get(dk)!r}, teacher-forced {tf_summary.get(tk)!r}"
            for dk, tk in SAME_CELL_KEYS if decode_summary.get(dk) != tf_summary.get(tk)]
    if decode_summary.get("tail_dtype") is not None and decode_summary["tail_dtype"] != tf_summary.get("tail_dtype"):
        diff.append(f"tail_dtype: decode {decode_summary['tail_dtype']!r}, teacher-forced {tf_summary.get('tail_dtype')!r}")
    diff += [f"{k}: decode {decode_summary.get(k)!r}, teacher-forced baseline {tf_identity.get(k)!r}"
             for k in SAME_TEXT_KEYS if decode_summary.get(k) is None or decode_summary.get(k) != tf_identity.get(k)]
    if tf_identity.get("n_ctx") != tf_summary.get("n_ctx"):
        diff.append(f"n_ctx: teacher-forced cell {tf_summary.get('n_ctx')!r}, its baseline {tf_identity.get('n_ctx')!r}")
    if tf_summary.get("compute", "exact") != "exact":
        diff.append(f"compute: teacher-forced {tf_summary.get('compute')!r}; the decode runs the exact path only")
    if not isinstance(tf_summary.get("chunks"), int) or tf_summary["chunks"] < decode_summary.get("n_prompts", 0):
        diff.append(f"chunks: the teacher-forced cell scored {tf_summary.get('chunks')!r} chunks, the decode's "
                    f"{decode_summary.get('n_prompts')!r} prompts need as many")
    if diff:
        raise ValueError("teacher-forced and free-running results are not of the same cell, text and chunks; "
                         "refusing to compare them: " + "; ".join(diff))


def tf_positions(n_ctx: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(decode steps, absolute positions) where a teacher-forced run scored the position a
    decode step's distribution sits at: position n_ctx − G − 1 + s ∈ [n_ctx/2, n_ctx − 2]."""
    s = np.arange(n_tokens)
    pos = n_ctx - n_tokens - 1 + s
    keep = pos >= scored_range(n_ctx).start
    if not keep.any():
        raise ValueError(f"no decode step of G = {n_tokens} at n_ctx {n_ctx} lies on a teacher-forced scored position")
    return s[keep], pos[keep]


def tf_matrix(tokens: pl.DataFrame, n_prompts: int, positions: np.ndarray) -> np.ndarray:
    """Teacher-forced KLD [P, len(positions)] of chunks 0..P−1 at `positions`, from a cell's
    tokens.parquet rows (chunk, pos, kld); refuses a missing (chunk, pos)."""
    want = pl.DataFrame({"chunk": np.repeat(np.arange(n_prompts, dtype=np.int32), len(positions)),
                         "pos": np.tile(np.asarray(positions, dtype=np.int32), n_prompts)})
    got = want.join(tokens.select("chunk", "pos", "kld").with_columns(pl.col("chunk", "pos").cast(pl.Int32)),
                    on=["chunk", "pos"], how="left", maintain_order="left")
    if got["kld"].null_count():
        miss = got.filter(pl.col("kld").is_null()).row(0, named=True)
        raise ValueError(f"teacher-forced tokens: no row for chunk {miss['chunk']}, pos {miss['pos']} "
                         f"({got['kld'].null_count()} of {got.height} missing)")
    return got["kld"].to_numpy().astype(np.float64).reshape(n_prompts, len(positions))


def tf_vs_free(free: np.ndarray, tf: np.ndarray, n_boot: int = DEFAULT_BOOT, seed: int = DEFAULT_SEED,
               alpha: float = DEFAULT_ALPHA) -> dict:
    """ratio = mean free-running KLD / mean teacher-forced KLD over the same [P, S] (prompt,
    position) pairs, with a percentile bootstrap CI over prompts (both means on the same draw)."""
    free, tf = np.asarray(free, dtype=np.float64), np.asarray(tf, dtype=np.float64)
    if free.shape != tf.shape or free.ndim != 2 or 0 in free.shape:
        raise ValueError(f"free-running and teacher-forced KLD must be [prompts, positions] of one shape, "
                         f"got {free.shape} and {tf.shape}")
    _check_boot(n_boot, alpha)
    if tf.mean() <= 0:
        raise ValueError("the teacher-forced KLD is 0 at every compared position: no ratio")
    idx = _resamples(free.shape[0], n_boot, seed)
    fp, tp = free.mean(axis=1), tf.mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        boot = fp[idx].mean(axis=1) / tp[idx].mean(axis=1)
    lo, hi = _interval(boot, alpha)
    return {"free_kld_mean": float(free.mean()), "tf_kld_mean": float(tf.mean()),
            "ratio": float(free.mean() / tf.mean()), "ratio_lo": float(lo), "ratio_hi": float(hi)}


# ---------------------------------------------------------------- the pairs a run compares

def pairs(cells: dict[str, dict]) -> list[tuple[str, str]]:
    """(KVarN cell, standard cell) of the same width to compare, from {cell name: decode summary}:
    every kvarnN-kvarnN cell against every qN_0-qN_0 cell (any tail, sink or tail dtype), the
    partner of kvarn.report.data.same_width_partner."""
    return [(a, b) for a, sa in cells.items() if sa["k_type"] == sa["v_type"]
            for b, sb in cells.items()
            if sb["k_type"] == sb["v_type"] and sb["k_type"] == same_width_partner(sa["k_type"])]


# ---------------------------------------------------------------- one run's tables

PER_1K = 1000.0  # slopes are reported as KLD per 1000 generated tokens


def _label(cell: str, label: str) -> str:
    """The figure label (kvarn.report.data.decode_frame) told apart by the cell's options: the
    q4_0 format-only row and q4_0 at tail 128 share "q4_0-q4_0 t128" there."""
    from kvarn.report.data import FORMAT_ONLY_OPTS

    opts = CellSpec.from_name(cell).opts
    return label + (" + KVarN's sink, F16 tail" if opts == FORMAT_ONLY_OPTS else f" {opts}" if opts else "")


def compute_run(decode_dirs, cell_dirs, baseline_identities, n_boot: int = DEFAULT_BOOT, seed: int = DEFAULT_SEED,
                alpha: float = DEFAULT_ALPHA) -> dict[str, pl.DataFrame]:
    """The generation statistics of one decode run: {"cells", "paired", "survival", "curves"}.

    decode_dirs[i] is the kvarn.run.decode result of the cell whose teacher-forced result is
    cell_dirs[i] (summary.json, tokens.parquet) scored against a baseline of header
    baseline_identities[i]; every pair is checked (`check_same_run`) before it is read."""
    from kvarn.report.data import decode_frame

    if not (len(decode_dirs) == len(cell_dirs) == len(baseline_identities)) or not decode_dirs:
        raise ValueError(f"one teacher-forced cell and baseline per decode result, got {len(decode_dirs)} decode, "
                         f"{len(cell_dirs)} cells, {len(baseline_identities)} baselines")
    meta = decode_frame([Path(d) / "summary.json" for d in decode_dirs]).unique("cell", keep="first", maintain_order=True)
    labels = {c: _label(c, lab) for c, lab in zip(meta["cell"], meta["label"])}
    cell_kind = {r["cell"]: {"family": r["family"], "width": r["width"]} for r in meta.iter_rows(named=True)}
    rows, surv, curves, klds, summaries = [], [], [], {}, {}
    run = None
    for ddir, cdir, ident in zip(decode_dirs, cell_dirs, baseline_identities):
        ds, mats = load_decode(ddir)
        kld = mats["kld"]
        this = (ds["model"], ds["n_ctx"], ds["n_prompts"], ds["n_tokens"], ds["prompt_tokens"], ds.get("text_sha256"),
                summary_sampling(ds))
        if run is not None and this != run:
            raise ValueError(f"{ddir}: decode run {this} differs from the others' {run}; one run's cells only")
        run = this
        name = Path(ddir).name
        if Path(cdir).name != name:
            raise ValueError(f"decode result {ddir} and teacher-forced cell {cdir} are not the same cell")
        ts = json.loads((Path(cdir) / "summary.json").read_text())
        check_same_run(ds, ts, ident)
        p, g, n_ctx = ds["n_prompts"], ds["n_tokens"], ds["n_ctx"]
        steps, pos = tf_positions(n_ctx, g)
        tf = tf_matrix(pl.read_parquet(Path(cdir) / "tokens.parquet", columns=["chunk", "pos", "kld"]), p, pos)
        free = kld[:, steps]
        bin_width = max(1, g // CURVE_BINS)
        klds[name], summaries[name] = kld, ds
        km = survival(ds["first_divergence"], g, alpha)
        surv.append(km.select(pl.lit(name).alias("cell"), pl.all()))
        for kind, m, offset in (("free-running", kld, 0), ("free-running, compared steps", free, int(steps[0])),
                                ("teacher-forced", tf, int(steps[0]))):
            c = kld_curve(m, bin_width, n_boot, seed, alpha).with_columns(
                pl.col("step_lo", "step_hi", "step_mid") + offset)
            curves.append(c.select(pl.lit(name).alias("cell"), pl.lit(kind).alias("kind"), pl.all()))
        sl = slope(kld, n_boot, seed, alpha)
        rt = tf_vs_free(free, tf, n_boot, seed, alpha)
        rows.append({"cell": name, "label": labels[name], **cell_kind[name], "model": ds["model"], "n_ctx": n_ctx, "prompts": p,
                     "tokens": g, "decoding": summary_sampling(ds), "n_diverged": ds["n_diverged"],
                     "first_divergence_median": float(np.median(ds["first_divergence"])),
                     "survival_end": float(km["survival"][-1]), "survival_end_lo": float(km["lo"][-1]),
                     "survival_end_hi": float(km["hi"][-1]), "decode_kld_mean": float(kld.mean()),
                     **{f"{k}_per_1k": v * PER_1K for k, v in sl.items()},
                     "compared_steps": len(steps), "first_compared_pos": int(pos[0]), **rt,
                     **text_stats(mats["token"], mats["nll_base"])})
    paired = []
    for a, b in pairs(summaries):
        d = paired_slope(klds[a], klds[b], n_boot, seed, alpha)
        paired.append({"kvarn_cell": a, "standard_cell": b, "kvarn_label": labels[a], "standard_label": labels[b],
                       **{f"{k}_per_1k": v * PER_1K for k, v in d.items()}})
    paired_schema = {"kvarn_cell": pl.String, "standard_cell": pl.String, "kvarn_label": pl.String,
                     "standard_label": pl.String, "diff_per_1k": pl.Float64, "diff_lo_per_1k": pl.Float64,
                     "diff_hi_per_1k": pl.Float64}
    return {"cells": pl.DataFrame(rows), "paired": pl.DataFrame(paired, schema=paired_schema),
            "survival": pl.concat(surv), "curves": pl.concat(curves)}


def to_markdown(tables: dict[str, pl.DataFrame], alpha: float = DEFAULT_ALPHA) -> str:
    """The run's tables as GitHub Markdown: per cell, then the paired slope differences."""
    c = tables["cells"]
    r = c.row(0, named=True)
    pct = f"{100 * (1 - alpha):g} %"
    f = lambda x: f"{x:.3g}"  # noqa: E731
    ci = lambda v, lo, hi: f"{f(v)} [{f(lo)}, {f(hi)}]"  # noqa: E731
    lines = [f"### {r['model']}: free-running generation, n_ctx {r['n_ctx']}, {r['prompts']} prompts × {r['tokens']} "
             f"generated tokens, {r['decoding']}", "",
             f"Brackets: {pct} intervals (survival: Kaplan–Meier, exponential Greenwood; the rest: percentile bootstrap "
             f"over prompts). Slope: OLS of the mean per-step KLD against the generated step, per 1000 tokens. "
             f"free / teacher-forced: mean KLD along the cell's own text over mean teacher-forced KLD at the same "
             f"absolute positions ({r['first_compared_pos']}..{r['n_ctx'] - 2}) of the same chunks.", "",
             "| cell | diverged | median first divergence | S(G) | mean KLD (free) | slope per 1k tokens | "
             "mean KLD (teacher-forced) | free / teacher-forced |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in c.iter_rows(named=True):
        lines.append(f"| {r['label']} | {r['n_diverged']}/{r['prompts']} | {r['first_divergence_median']:g} | "
                     f"{ci(r['survival_end'], r['survival_end_lo'], r['survival_end_hi'])} | {f(r['decode_kld_mean'])} | "
                     f"{ci(r['slope_per_1k'], r['slope_lo_per_1k'], r['slope_hi_per_1k'])} | {f(r['tf_kld_mean'])} | "
                     f"{ci(r['ratio'], r['ratio_lo'], r['ratio_hi'])} |")
    lines += ["", f"The cells' own text: share of generated {REPEAT_N}-grams that repeat an earlier one of the same "
              f"prompt in the second half of the generation, and the baseline's NLL (nats per token) of the cell's "
              f"tokens over the first {early_steps(r['tokens'])} steps and over the second half.", "",
              f"| cell | repeated {REPEAT_N}-grams, second half | baseline NLL, first steps | baseline NLL, second half |",
              "|---|---:|---:|---:|"]
    lines += [f"| {r['label']} | {r['repeat_late']:.0%} | {r['nll_base_early']:.3f} | {r['nll_base_late']:.3f} |"
              for r in c.iter_rows(named=True)]
    p = tables["paired"]
    if p.height:
        lines += ["", "Paired difference of slopes (KVarN − same-width standard, same prompts resampled jointly), "
                  "per 1000 generated tokens; below 0: KVarN accumulates more slowly.", "",
                  "| KVarN | standard | slope difference per 1k tokens |", "|---|---|---:|"]
        for r in p.iter_rows(named=True):
            lines.append(f"| {r['kvarn_label']} | {r['standard_label']} | "
                         f"{ci(r['diff_per_1k'], r['diff_lo_per_1k'], r['diff_hi_per_1k'])} |")
    return "\n".join(lines).replace("*", "\\*") + "\n"
