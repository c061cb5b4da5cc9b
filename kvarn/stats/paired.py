"""Paired statistics between two cells of one run: Δ median KLD, Δ mean KLD, Δ same-top, with
95 % confidence intervals from a block bootstrap over contiguous scored tokens.

Owns: pairing two cells' per-token rows (`pair_cells`), the block length rule
(`block_length`), the resampling (`block_indices`), the paired comparison (`compare`), one
cell's own interval (`cell_interval`) and the text `kvarn compare` prints (`format_compare`).
The per-run table behind the report's `band` column and ranked figure is
`kvarn.report.paired_table.run_table`.

Why paired, why blocks within chunks, the block length on ranks, the coverage measured:
docs/notes/paired.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

N_BOOT = 2000
LEVEL = 0.95
SEED = 0
MAX_ELEMENTS = 1 << 22  # resampled values held at once (per cell): ~32 MiB of float64

# Fields of summary.json that must agree for two cells to share a baseline: the baseline
# dump is one per (model, source, revision, n_ctx, chunks), computed at one dtype.
IDENTITY = ("model", "source", "revision", "n_ctx", "chunks", "dtype")


@dataclass(frozen=True)
class CellTokens:
    """One cell: its directory name, summary.json and per-token columns sorted by (chunk, pos)."""

    name: str
    summary: dict
    chunk: np.ndarray
    pos: np.ndarray
    kld: np.ndarray
    same_top: np.ndarray
    nll_base: np.ndarray


def load_cell(path: str | Path, summary: dict | None = None) -> CellTokens:
    """A cell directory (summary.json + tokens.parquet), or the path of either file in it.

    `summary`: the cell's summary keys when the caller has them (a summary.parquet row);
    then summary.json is not read.
    """
    import polars as pl

    d = Path(path)
    if d.is_file():
        d = d.parent
    s_path, t_path = d / "summary.json", d / "tokens.parquet"
    for p in (t_path,) if summary is not None else (s_path, t_path):
        if not p.is_file():
            raise FileNotFoundError(f"{str(path)!r} is not a cell directory: {p} is missing "
                                    "(a cell holds summary.json and tokens.parquet; see `kvarn run`)")
    if summary is None:
        summary = json.loads(s_path.read_text())
    t = pl.read_parquet(t_path, columns=["chunk", "pos", "kld", "same_top", "nll_base"]).sort(["chunk", "pos"])
    return CellTokens(d.name, summary, t["chunk"].to_numpy(), t["pos"].to_numpy(), t["kld"].to_numpy(),
                      t["same_top"].to_numpy().astype(np.float64), t["nll_base"].to_numpy())


def pair_cells(a: CellTokens, b: CellTokens) -> None:
    """Refuse two cells that were not scored on the same tokens against the same baseline.

    Checks the identity fields of summary.json, then that both hold the same (chunk, pos)
    rows, then that the baseline's NLL of every true token agrees (it comes from the dump,
    so a different baseline shows there even when the names match).
    """
    for key in IDENTITY:
        va, vb = a.summary.get(key), b.summary.get(key)
        if va != vb:
            raise ValueError(f"cells {a.name!r} and {b.name!r} are not on the same baseline: {key} is {va!r} vs {vb!r}; "
                             f"compare cells of one run (same {', '.join(IDENTITY)})")
    if len(a.chunk) != len(b.chunk) or not (np.array_equal(a.chunk, b.chunk) and np.array_equal(a.pos, b.pos)):
        raise ValueError(f"cells {a.name!r} and {b.name!r} score different tokens ({len(a.chunk)} vs {len(b.chunk)} "
                         "rows, or other (chunk, pos)); they must come from one run")
    if not np.allclose(a.nll_base, b.nll_base, rtol=0, atol=1e-9):
        i = int(np.argmax(np.abs(a.nll_base - b.nll_base)))
        raise ValueError(f"cells {a.name!r} and {b.name!r} were scored against different baselines: base NLL of "
                         f"chunk {a.chunk[i]} pos {a.pos[i]} is {a.nll_base[i]:.6f} vs {b.nll_base[i]:.6f}")


# ---------------------------------------------------------------- block length


def chunk_bounds(chunk: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of equal chunk ids in a (chunk, pos)-sorted column."""
    if len(chunk) == 0:
        return []
    cut = np.flatnonzero(np.diff(chunk)) + 1
    starts = np.concatenate([[0], cut])
    stops = np.concatenate([cut, [len(chunk)]])
    return list(zip(starts.tolist(), stops.tolist()))


def pooled_autocov(x: np.ndarray, bounds, max_lag: int) -> np.ndarray:
    """Autocovariance at lags 0..max_lag, each chunk demeaned on its own, summed over chunks / n."""
    acc = np.zeros(max_lag + 1)
    for s, e in bounds:
        y = x[s:e] - x[s:e].mean()
        m = len(y)
        nfft = 1 << int(math.ceil(math.log2(2 * m)))
        f = np.fft.rfft(y, nfft)
        r = np.fft.irfft(f * np.conj(f), nfft)[: min(max_lag, m - 1) + 1]
        acc[: len(r)] += r
    return acc / len(x)


def flat_top(t: np.ndarray) -> np.ndarray:
    """The flat-top lag window of Politis & White: 1 up to |t| = 1/2, falling linearly to 0 at |t| = 1."""
    a = np.abs(t)
    return np.where(a <= 0.5, 1.0, np.where(a <= 1.0, 2.0 * (1.0 - a), 0.0))


def politis_white(x: np.ndarray, bounds) -> float:
    """Optimal circular-bootstrap block length of one series (Politis & White 2004, corrected
    by Patton, Politis & White 2009), as a real number >= 1.

    m̂ = the smallest lag after which K_N consecutive autocorrelations are insignificant
    (|ρ| < 2·sqrt(log10(n)/n)); M = min(2·m̂, m_max); with the flat-top window λ,
    G = Σ λ(k/M)|k|R(k), g = Σ λ(k/M)R(k), b = (2G²/((4/3)g²))^(1/3) n^(1/3), capped at
    ceil(min(3√n, n/3)). Agrees with `arch.bootstrap.optimal_block_length` ("circular") up
    to arch's search starting one lag later (it tests lags m..m+K−1, the paper m+1..m+K).
    """
    n = len(x)
    k_n = max(5, int(math.ceil(math.sqrt(math.log10(max(n, 10))))))
    m_max = int(math.ceil(math.sqrt(n))) + k_n
    r = pooled_autocov(x.astype(np.float64), bounds, m_max + k_n)
    if r[0] <= 0:
        return 1.0  # a constant series: nothing to preserve
    rho = r / r[0]
    thr = 2.0 * math.sqrt(math.log10(max(n, 10)) / n)
    insig = np.abs(rho[1:]) < thr  # insig[j] is lag j + 1
    m_hat = m_max
    for m in range(0, m_max + 1):
        if insig[m : m + k_n].all():
            m_hat = m
            break
    big_m = min(2 * max(m_hat, 1), m_max)
    k = np.arange(-big_m, big_m + 1)
    lam = flat_top(k / big_m)
    rk = r[np.abs(k)]
    g_sum = float(np.sum(lam * np.abs(k) * rk))
    g0 = float(np.sum(lam * rk))
    if g0 <= 0 or g_sum == 0:
        return 1.0
    d_cb = (4.0 / 3.0) * g0 * g0
    b_max = math.ceil(min(3.0 * math.sqrt(n), n / 3.0))
    return min(max(1.0, (2.0 * g_sum * g_sum / d_cb) ** (1.0 / 3.0) * n ** (1.0 / 3.0)), b_max)


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n−1, ties given their average rank: ties broken by position would turn a run of
    equal values (an exact cell's zeros) into a ramp, which reads as strong autocorrelation."""
    from scipy.stats import rankdata

    return rankdata(x, method="average") - 1.0


def block_length(series: list[np.ndarray], chunk: np.ndarray) -> int:
    """The module's rule: max over the rank-transformed series of the Politis–White length,
    rounded up, clamped to [1, shortest chunk // 2]."""
    bounds = chunk_bounds(chunk)
    shortest = min(e - s for s, e in bounds)
    b = max(politis_white(ranks(x), bounds) for x in series)
    return int(min(max(1, math.ceil(b)), max(1, shortest // 2)))


# ---------------------------------------------------------------- resampling


def block_starts(rng: np.random.Generator, bounds, block: int, n_boot: int) -> list[np.ndarray]:
    """Per chunk, int64 [n_boot, ceil(m/block)]: the random start of every block of every resample.

    Drawn once for all resamples, so batching the resamples (`MAX_ELEMENTS`) cannot change them.
    """
    return [rng.integers(0, e - s, size=(n_boot, -(-(e - s) // block))) for s, e in bounds]


def block_indices(starts: list[np.ndarray], bounds, block: int, rows=slice(None)) -> np.ndarray:
    """int64 [resamples, n]: circular block bootstrap indices (each chunk resampled within itself,
    a block wrapping around its chunk's end) of the resamples `rows` of `block_starts`."""
    parts = []
    for st, (s, e) in zip(starts, bounds):
        m = e - s
        st = st[rows]
        idx = (st[:, :, None] + np.arange(block)[None, None, :]) % m
        parts.append(s + idx.reshape(st.shape[0], -1)[:, :m])
    return np.concatenate(parts, axis=1)


def _resampled_stats(columns: dict[str, np.ndarray], bounds, block: int, n_boot: int, seed: int,
                     medians=None) -> dict:
    """Per resample, the mean of each `columns` entry and the median of those in `medians`
    (default: all), the same indices for every column."""
    medians = set(columns if medians is None else medians)
    starts = block_starts(np.random.default_rng(seed), bounds, block, n_boot)
    n = len(next(iter(columns.values())))
    batch = max(1, MAX_ELEMENTS // max(n, 1))
    out = {k: {"median": [], "mean": []} for k in columns}
    done = 0
    while done < n_boot:
        b = min(batch, n_boot - done)
        idx = block_indices(starts, bounds, block, slice(done, done + b))
        for k, x in columns.items():
            xs = x[idx]
            if k in medians:
                out[k]["median"].append(np.median(xs, axis=1))
            out[k]["mean"].append(xs.mean(axis=1))
        done += b
    return {k: {s: np.concatenate(v) for s, v in d.items() if v} for k, d in out.items()}


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(samples, [a, 1.0 - a])
    return float(lo), float(hi)


def compare(a: CellTokens, b: CellTokens, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL,
            block: int | None = None) -> dict:
    """Δ = B − A of median KLD, mean KLD and same-top fraction, each with its interval.

    Returns {"a", "b", "n_tokens", "n_chunks", "block", "block_rule", "n_boot", "seed",
    "level", "stats": {name: {"a", "b", "delta", "lo", "hi", "significant"}}}; `significant`
    means the interval excludes 0.
    """
    pair_cells(a, b)
    _check_boot(n_boot, level)
    bounds = chunk_bounds(a.chunk)
    rule = "given"
    if block is None:
        block = block_length([a.kld, b.kld, b.kld - a.kld], a.chunk)
        rule = "Politis-White (ranks of KLD A, B, B-A; max)"
    elif block < 1:
        raise ValueError(f"block length must be a positive integer, got {block!r}")
    cols = {"kld_a": a.kld, "kld_b": b.kld, "top_a": a.same_top, "top_b": b.same_top}
    bs = _resampled_stats(cols, bounds, block, n_boot, seed, medians=("kld_a", "kld_b"))
    defs = {
        "kld_median": (np.median(a.kld), np.median(b.kld), bs["kld_b"]["median"] - bs["kld_a"]["median"]),
        "kld_mean": (a.kld.mean(), b.kld.mean(), bs["kld_b"]["mean"] - bs["kld_a"]["mean"]),
        "same_top": (a.same_top.mean(), b.same_top.mean(), bs["top_b"]["mean"] - bs["top_a"]["mean"]),
    }
    stats = {}
    for name, (va, vb, samples) in defs.items():
        lo, hi = _interval(samples, level)
        stats[name] = {"a": float(va), "b": float(vb), "delta": float(vb - va), "lo": lo, "hi": hi,
                       "significant": bool(lo > 0 or hi < 0)}
    return {"a": a.name, "b": b.name, "n_tokens": len(a.kld), "n_chunks": len(bounds), "block": int(block),
            "block_rule": rule, "n_boot": n_boot, "seed": seed, "level": level, "stats": stats}


def cell_interval(c: CellTokens, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL,
                  block: int | None = None) -> dict:
    """One cell's median and mean KLD with block-bootstrap intervals (for the ranked figure)."""
    _check_boot(n_boot, level)
    bounds = chunk_bounds(c.chunk)
    if block is None:
        block = block_length([c.kld], c.chunk)
    bs = _resampled_stats({"kld": c.kld}, bounds, block, n_boot, seed)
    mlo, mhi = _interval(bs["kld"]["median"], level)
    alo, ahi = _interval(bs["kld"]["mean"], level)
    return {"kld_median": float(np.median(c.kld)), "kld_median_lo": mlo, "kld_median_hi": mhi,
            "kld_mean": float(c.kld.mean()), "kld_mean_lo": alo, "kld_mean_hi": ahi, "block": int(block)}


def _check_boot(n_boot, level):
    if not isinstance(n_boot, int) or n_boot < 100:
        raise ValueError(f"resamples must be an integer >= 100, got {n_boot!r}")
    if not 0.5 <= level < 1:
        raise ValueError(f"confidence level must be in [0.5, 1), got {level!r}")


# ---------------------------------------------------------------- text


_LABELS = {"kld_median": ("median KLD", 1.0, 6), "kld_mean": ("mean KLD", 1.0, 6), "same_top": ("same top %", 100.0, 3)}


def format_compare(res: dict) -> str:
    """The table `kvarn compare` prints."""
    pct = round(100 * res["level"])
    lines = [
        f"A = {res['a']}",
        f"B = {res['b']}",
        f"{res['n_tokens']} paired tokens in {res['n_chunks']} chunk(s); circular block bootstrap within chunks, "
        f"block {res['block']} tokens ({res['block_rule']}), {res['n_boot']} resamples, seed {res['seed']}",
        "",
        f"{'':<12} {'A':>12} {'B':>12} {'Δ = B − A':>12}   {pct}% CI",
    ]
    for key, (label, scale, dig) in _LABELS.items():
        s = res["stats"][key]
        ci = f"[{scale * s['lo']:+.{dig}f}, {scale * s['hi']:+.{dig}f}]"
        lines.append(f"{label:<12} {scale * s['a']:>12.{dig}f} {scale * s['b']:>12.{dig}f} "
                     f"{scale * s['delta']:>+12.{dig}f}   {ci}{'  *' if s['significant'] else ''}")
    lines += ["", f"*: the {pct}% interval excludes 0 (the difference is significant)"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- one run, for the report
