"""Teacher-forced KL-divergence metrics, llama-perplexity compatible (DESIGN §6).

Owns: the per-token numbers (`token_metrics`, beside its whole-vocabulary reference
`token_metrics_ref`; columns `PER_TOKEN_KEYS`), the summary with llama.cpp's ± errors and
percentiles (`summarize`, from `mean_and_uncertainty`, `covariance`, `percentile`), and the
llama-perplexity `--kl-divergence` text block (`format_llama`). Formulas follow llama.cpp
`tools/perplexity/perplexity.cpp`; all sums in float64. Percentages are stored as fractions
(0..1) and multiplied by 100 only in `format_llama`.

Each summary key and the llama-perplexity line it stands for: docs/notes/reference.md
"Statistics".
"""

from __future__ import annotations

import math

import numpy as np
import torch

# llama.cpp leaves out of the KLD sum every vocabulary entry whose base log-prob is at or
# below −16 nats: its uint16 dump only resolves the 16 nats below the top logit, and the
# entries clamped to the bottom of that range carry no information. We apply the same
# rule whether the base comes from a dump or from fp32 log-probs, so both agree.
KLD_BASE_FLOOR = -16.0

# (key suffix, fraction) in llama.cpp's print order; "median" is the 0.5 percentile.
KLD_LADDER = [
    ("p99_9", 0.999), ("p99", 0.990), ("p95", 0.950), ("p90", 0.900), ("median", 0.5),
    ("p10", 0.100), ("p05", 0.050), ("p01", 0.010), ("p00_1", 0.001),
]
DP_LADDER = [
    ("p99_9", 0.999), ("p99", 0.990), ("p95", 0.950), ("p90", 0.900), ("p75", 0.750),
    ("median", 0.5), ("p25", 0.250), ("p10", 0.100), ("p05", 0.050), ("p01", 0.010),
    ("p00_1", 0.001),
]
PER_TOKEN_KEYS = ("kld", "nll", "nll_base", "dp", "same_top")

_ROWS = 16  # rows per float64 slice in token_metrics_ref: bounds memory at large vocabularies
_FAST_ROWS = 64  # rows per slice in token_metrics (float64 only at the entries above the floor)


def _inputs_and_outputs(logp_q, logp_base, targets):
    """The checked [n, V], [n, V], [n] tensors of token_metrics(_ref), and its empty outputs."""
    logp_q = torch.as_tensor(logp_q)
    logp_base = torch.as_tensor(logp_base)
    targets = torch.as_tensor(targets, dtype=torch.long).reshape(-1)
    if logp_q.ndim != 2 or logp_q.shape != logp_base.shape or targets.numel() != logp_q.shape[0]:
        raise ValueError(
            f"shapes disagree: logp_q {tuple(logp_q.shape)}, logp_base {tuple(logp_base.shape)}, "
            f"targets {tuple(targets.shape)}; expected [n, V], [n, V], [n]"
        )
    n = logp_q.shape[0]
    out = {k: np.empty(n, dtype=np.float64) for k in PER_TOKEN_KEYS[:-1]}
    out["same_top"] = np.empty(n, dtype=bool)
    return logp_q, logp_base, targets, out


def _check_normalised(lse: torch.Tensor, first_row: int) -> None:
    """Refuse rows of logp_q whose logsumexp `lse` is not 0 within 1e-3 (raw logits, not log-probs)."""
    if not bool((lse.abs() < 1e-3).all()):
        bad = int(lse.abs().argmax()) + first_row
        raise ValueError(
            f"logp_q row {bad} is not normalised (logsumexp {float(lse.abs().max()):.3g}); "
            "pass log-probabilities (torch.log_softmax of the logits), not logits"
        )


def token_metrics(logp_q, logp_base, targets) -> dict[str, np.ndarray]:
    """Per scored token: KLD(base ‖ Q), NLL of the true token under Q and under base,
    Δp = p_Q(true) − p_base(true), and whether the two argmaxes agree.

    logp_q: [n, V] log-probabilities (log_softmax of the logits, any float dtype; rows
    that are not normalised to within 1e-3 are refused, which catches raw logits).
    logp_base: [n, V] base log-probabilities. Both are used as given: a decoded dump is
    not renormalised (as in llama.cpp), and identical inputs give 0.
    targets: [n] true next tokens. Computed on logp_q's device (the compute device in the
    engine: only the per-token numbers come back to the host).
    KLD = Σ_v p_base·(ln p_base − ln p_Q) over v with ln p_base > KLD_BASE_FLOOR.

    The fast path of `token_metrics_ref` (same formulas, tested against it): the KLD terms
    are computed in float64 only at the entries above the floor (a few % of a large
    vocabulary), gathered and summed per row; the argmax, the targets' entries and the
    normalisation check read the rows in their own dtype (widening to float64 is exact, so
    the argmax and the NLLs are the same numbers). Only the order of the float64 KLD sum
    differs from the reference.
    """
    logp_q, logp_base, targets, out = _inputs_and_outputs(logp_q, logp_base, targets)
    n = logp_q.shape[0]
    for a in range(0, n, _FAST_ROWS):
        b = min(a + _FAST_ROWS, n)
        q = logp_q[a:b]
        lse = torch.logsumexp(q.float() if q.dtype != torch.float64 else q, dim=1)
        _check_normalised(lse, a)
        base = logp_base[a:b].to(q.device)
        t = targets[a:b].to(q.device).unsqueeze(1)
        rows, cols = (base > KLD_BASE_FLOOR).nonzero(as_tuple=True)
        kb = base[rows, cols].to(torch.float64)
        terms = kb.exp() * (kb - q[rows, cols].to(torch.float64))
        kld = torch.zeros(b - a, dtype=torch.float64, device=q.device).index_add_(0, rows, terms)
        nll = -q.gather(1, t).squeeze(1).to(torch.float64)
        nll_base = -base.gather(1, t).squeeze(1).to(torch.float64)
        out["kld"][a:b] = kld.cpu().numpy()
        out["nll"][a:b] = nll.cpu().numpy()
        out["nll_base"][a:b] = nll_base.cpu().numpy()
        out["dp"][a:b] = (torch.exp(-nll) - torch.exp(-nll_base)).cpu().numpy()
        out["same_top"][a:b] = (q.argmax(dim=1) == base.argmax(dim=1)).cpu().numpy()
    return out


def token_metrics_ref(logp_q, logp_base, targets) -> dict[str, np.ndarray]:
    """The reference of `token_metrics`: the whole vocabulary in float64. Per scored token: KLD(base ‖ Q), NLL of the true token under Q and under base,
    Δp = p_Q(true) − p_base(true), and whether the two argmaxes agree.

    logp_q: [n, V] log-probabilities (log_softmax of the logits, any float dtype; rows
    that are not normalised to within 1e-3 are refused, which catches raw logits).
    logp_base: [n, V] base log-probabilities. Both are used as given, in float64: a
    decoded dump is not renormalised (as in llama.cpp), and identical inputs give 0.
    targets: [n] true next tokens. Computed on logp_q's device (the compute device in the
    engine: only the per-token numbers come back to the host).
    KLD = Σ_v p_base·(ln p_base − ln p_Q) over v with ln p_base > KLD_BASE_FLOOR.
    """
    logp_q, logp_base, targets, out = _inputs_and_outputs(logp_q, logp_base, targets)
    n = logp_q.shape[0]
    for a in range(0, n, _ROWS):
        b = min(a + _ROWS, n)
        q = logp_q[a:b].to(torch.float64)  # on the input's device: no host copy of the vocabulary
        lse = torch.logsumexp(q, dim=1)
        _check_normalised(lse, a)
        base = logp_base[a:b].to(q.device, torch.float64)
        t = targets[a:b].to(q.device).unsqueeze(1)
        keep = base > KLD_BASE_FLOOR
        p_base = torch.where(keep, base.exp(), 0.0)
        terms = torch.where(keep, p_base * (base - q), 0.0)
        nll = -q.gather(1, t).squeeze(1)
        nll_base = -base.gather(1, t).squeeze(1)
        out["kld"][a:b] = terms.sum(dim=1).cpu().numpy()
        out["nll"][a:b] = nll.cpu().numpy()
        out["nll_base"][a:b] = nll_base.cpu().numpy()
        out["dp"][a:b] = (torch.exp(-nll) - torch.exp(-nll_base)).cpu().numpy()
        out["same_top"][a:b] = (q.argmax(dim=1) == base.argmax(dim=1)).cpu().numpy()
    return out


def mean_and_uncertainty(s: float, s2: float, n: int) -> tuple[float, float]:
    """llama.cpp: mean of x from Σx, Σx², and its standard error sqrt(var/(n−1)), with
    var = Σx²/n − mean²; the error is 0 when var ≤ 0 or n ≤ 10."""
    if n < 1:
        return 0.0, 0.0
    f = s / n
    var = s2 / n - f * f
    return f, (math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


def covariance(sa: float, sb: float, sab: float, n: int) -> float:
    """llama.cpp: covariance of the two means, (Σab/n − mean_a·mean_b)/(n−1); 0 if n < 10."""
    if n < 10:
        return 0.0
    return (sab / n - (sa / n) * (sb / n)) / (n - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """Linear interpolation at fraction·(n−1) over sorted values (llama.cpp `percentile`)."""
    v = sorted_values
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    pos = fraction * (len(v) - 1)
    i = int(pos)
    w = pos - i
    return float((1 - w) * v[i] + w * v[min(i + 1, len(v) - 1)])


def _columns(per_token) -> dict[str, np.ndarray]:
    if hasattr(per_token, "get_column"):  # polars.DataFrame
        per_token = {k: per_token.get_column(k).to_numpy() for k in PER_TOKEN_KEYS}
    missing = [k for k in PER_TOKEN_KEYS if k not in per_token]
    if missing:
        raise ValueError(f"per-token data lacks {missing}; expected columns {list(PER_TOKEN_KEYS)}")
    cols = {k: np.asarray(per_token[k], dtype=np.float64).reshape(-1) for k in PER_TOKEN_KEYS}
    n = {len(c) for c in cols.values()}
    if len(n) != 1 or 0 in n:
        raise ValueError(f"per-token columns must be non-empty and of one length, got {sorted(n)}")
    return cols


def summarize(per_token) -> dict:
    """The summary keys of docs/CONTRACTS.md (plus ppl_diff, ppl_diff_err, dp_p75, dp_p25)
    from per-token metrics (a dict of arrays or a polars DataFrame)."""
    c = _columns(per_token)
    n = len(c["kld"])
    nll, nllb, kld, dp = c["nll"], c["nll_base"], c["kld"], c["dp"]
    dp2 = dp * dp

    ln_q, ln_q_err = mean_and_uncertainty(nll.sum(), (nll * nll).sum(), n)
    ln_b, ln_b_err = mean_and_uncertainty(nllb.sum(), (nllb * nllb).sum(), n)
    cov = covariance(nll.sum(), nllb.sum(), (nll * nllb).sum(), n)
    ppl_q, ppl_b = math.exp(ln_q), math.exp(ln_b)
    ln_ratio = ln_q - ln_b
    ln_ratio_err = math.sqrt(max(ln_q_err**2 + ln_b_err**2 - 2.0 * cov, 0.0))
    ppl_q_err, ppl_b_err = ppl_q * ln_q_err, ppl_b * ln_b_err
    denom = ln_q_err * ln_b_err
    s = {
        "n_tokens": n,
        "ppl_q": ppl_q,
        "ppl_q_err": ppl_q_err,
        "ppl_base": ppl_b,
        "ppl_base_err": ppl_b_err,
        "ppl_ratio": math.exp(ln_ratio),
        "ppl_ratio_err": math.exp(ln_ratio) * ln_ratio_err,
        "ln_ppl_ratio": ln_ratio,
        "ln_ppl_ratio_err": ln_ratio_err,
        "ppl_cor": cov / denom if denom > 0 else float("nan"),
        "ppl_diff": ppl_q - ppl_b,
        "ppl_diff_err": math.sqrt(
            max(ppl_q_err**2 + ppl_b_err**2 - 2.0 * ppl_q * ppl_b * cov, 0.0)
        ),
    }

    s["kld_mean"], s["kld_mean_err"] = mean_and_uncertainty(kld.sum(), (kld * kld).sum(), n)
    ks = np.sort(kld)
    s["kld_max"] = float(ks[-1])
    for name, f in KLD_LADDER:
        s[f"kld_{name}"] = percentile(ks, f)
    s["kld_min"] = float(ks[0])

    s["dp_mean"], s["dp_mean_err"] = mean_and_uncertainty(dp.sum(), dp2.sum(), n)
    ds = np.sort(dp)
    s["dp_max"] = float(ds[-1])
    for name, f in DP_LADDER:
        s[f"dp_{name}"] = percentile(ds, f)
    s["dp_min"] = float(ds[0])
    mse, mse_err = mean_and_uncertainty(dp2.sum(), (dp2 * dp2).sum(), n)
    s["dp_rms"] = math.sqrt(mse)
    s["dp_rms_err"] = 0.5 / s["dp_rms"] * mse_err if s["dp_rms"] > 0 else 0.0

    p = float(c["same_top"].sum()) / n
    s["same_top"] = p
    s["same_top_err"] = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0
    return s


_PCT_LABEL = {
    "p99_9": "99.9%  ", "p99": "99.0%  ", "p95": "95.0%  ", "p90": "90.0%  ", "p75": "75.0%  ",
    "median": "Median ", "p25": "25.0%  ", "p10": "10.0%  ", "p05": " 5.0%  ", "p01": " 1.0%  ",
    "p00_1": " 0.1%  ",
}


def format_llama(summary: dict) -> str:
    """The `====== … statistics ======` block llama-perplexity --kl-divergence prints."""
    s = summary
    L = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s['ppl_q']:10.6f} ± {s['ppl_q_err']:10.6f}",
        f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_err']:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['ppl_cor']:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± {s['ln_ppl_ratio_err']:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_err']:10.6f}",
    ]
    if "ppl_diff" in s:
        L.append(f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_err']:10.6f}")
    L += ["", "====== KL divergence statistics ======",
          f"Mean    KLD: {s['kld_mean']:10.6f} ± {s['kld_mean_err']:10.6f}",
          f"Maximum KLD: {s['kld_max']:10.6f}"]
    for name, _ in KLD_LADDER:
        L.append(f"{_PCT_LABEL[name]} KLD: {s[f'kld_{name}']:10.6f}")
    L += [f"Minimum KLD: {s['kld_min']:10.6f}", "",
          "====== Token probability statistics ======",
          f"Mean    Δp: {100 * s['dp_mean']:6.3f} ± {100 * s['dp_mean_err']:5.3f} %",
          f"Maximum Δp: {100 * s['dp_max']:6.3f}%"]
    for name, _ in DP_LADDER:
        if f"dp_{name}" not in s:
            continue
        L.append(f"{_PCT_LABEL[name]} Δp: {100 * s[f'dp_{name}']:6.3f}%")
    L += [f"Minimum Δp: {100 * s['dp_min']:6.3f}%",
          f"RMS Δp    : {100 * s['dp_rms']:6.3f} ± {100 * s['dp_rms_err']:5.3f} %",
          f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_err']:5.3f} %"]
    return "\n".join(L) + "\n"
