"""What the baseline dump's encoding costs in KLD, on real log-probs (moved out of kvarn.baseline.dump:
a measurement, not part of the package).

    python -m bench.perf.dump_error --model smollm2-135m --n-ctx 512 --chunks 1

prints the JSON of `measure_encoding_error`; `measure_q8_error` is also what
bench/perf/baseline_size.py reports as the encoding's error against the q8_0 median KLD.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench import TEXT
from kvarn.vocab import scoring
from kvarn.vocab.cell import CellSpec

from kvarn.baseline import data, dump, encoding

from kvarn.run import forward, load

from kvarn.stats import metrics

from kvarn.weights import models, sources
from kvarn.weights.sources import DEFAULT_CACHE_DIR


def measure_encoding_error(name: str = "smollm2-135m", n_ctx: int = 512, chunks: int = 1,
                           text_path: str | None = None, cache_dir: str = DEFAULT_CACHE_DIR) -> dict:
    """What the encoding costs, on real log-probs: the model's fp32 run is the exact base;
    Q is (a) the same fp32 run (a perfect Q) and (b) the model run in bfloat16 (a realistic
    small perturbation). Reports the per-token KLD error |KLD(dump) − KLD(fp32)| and bytes.
    (c) `q8_0`: the engine's own pair, the BF16-cache baseline's fp32 log-probs as the base
    and the q8_0 t0 cell as Q, with the error relative to that cell's median KLD (the
    study's smallest effect; the goal is ≤ 1 %). Both layouts are written and must decode
    to the same bits (the sparse one only drops zero codes)."""
    lm = models.load(sources.ModelSpec(name, f"embedded:{name}"), cache_dir, device="cpu")
    text = data.load_text(text_path)
    chunk_ids = data.make_chunks(data.tokenize(lm.tokenizer, text), n_ctx, chunks, lm.info.bos_id)
    pos = scoring.scored_positions(n_ctx)
    sl = slice(pos.start, pos.stop)
    exact, q_bf16, targets = [], [], []
    with torch.inference_mode():
        for ids in chunk_ids:
            logits = lm.model(ids[None]).logits[0, sl].float()
            exact.append(torch.log_softmax(logits, -1))
            targets.append(ids[pos.start + 1:pos.stop + 1])
        lm.model.to(torch.bfloat16)
        for ids in chunk_ids:
            q_bf16.append(torch.log_softmax(lm.model(ids[None]).logits[0, sl].float(), -1))
    h = {"model": name, "revision": lm.info.revision, "tokenizer_hash": lm.info.tokenizer_hash,
         "text_sha256": data.text_sha256(text), "n_ctx": n_ctx}
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in ("dense", "sparse"):
            p = Path(tmp) / f"{layout}.kvd"
            t = time.perf_counter()
            dump.write_dump(p, h, exact, layout=layout)
            t_write = time.perf_counter() - t
            sizes[layout] = p.stat().st_size
            dd = dump.open_dump(p)
            t = time.perf_counter()
            dec = [dd.chunk(i) for i in range(dd.n_chunks)]
            t_read = time.perf_counter() - t
            if layout == "dense":
                decoded_dense = dec
            elif not all(torch.equal(x, y) for x, y in zip(dec, decoded_dense)):
                raise AssertionError("the sparse layout decoded differently from the dense one")
        decoded = dec
    res: dict = {"model": name, "n_ctx": n_ctx, "chunks": len(chunk_ids), "vocab": lm.info.vocab_size}
    n_tok = sum(len(t) for t in targets)
    res["bytes_per_scored_token"] = 2 * encoding.row_uint16(lm.info.vocab_size)
    res["file_bytes_per_scored_token"] = {k: v / n_tok for k, v in sizes.items()}
    res["fp32_bytes_per_scored_token"] = 4 * lm.info.vocab_size
    res["write_s"], res["read_decode_s"] = t_write, t_read  # the sparse layout's
    llama_lo = [encoding.decode_rows(encoding.encode_rows(e, mass_correct=False), lm.info.vocab_size) for e in exact]
    for label, qs in (("perfect_q", exact), ("bf16_q", q_bf16)):
        ref = np.concatenate([metrics.token_metrics(q, e, t)["kld"] for q, e, t in zip(qs, exact, targets)])
        res[label] = {"kld_mean_fp32_base": float(ref.mean()), "kld_median_fp32_base": float(np.median(ref))}
        for enc, dec in (("dump", decoded), ("llama_lo", llama_lo)):
            got = np.concatenate([metrics.token_metrics(q, c, t)["kld"] for q, c, t in zip(qs, dec, targets)])
            err = np.abs(got - ref)
            res[label][enc] = {
                "kld_mean": float(got.mean()), "abs_err_mean": float(err.mean()),
                "abs_err_max": float(err.max()), "abs_err_p99": float(np.quantile(err, 0.99)),
                "rel_err_of_mean": float(abs(got.mean() - ref.mean()) / ref.mean()) if ref.mean() else None}
        # how much the −16-nat floor rule itself leaves out, with the exact base
        full = np.concatenate([(e.double().exp() * (e.double() - q.double())).sum(-1).numpy()
                               for q, e in zip(qs, exact)])
        res[label]["kld_mean_no_floor_rule"] = float(full.mean())
        res[label]["floor_rule_abs_diff_max"] = float(np.abs(full - ref).max())
    res["q8_0_q"] = measure_q8_error(name, n_ctx, chunks, text_path, cache_dir)
    nllb_err = np.concatenate([
        np.abs(metrics.token_metrics(e, c, t)["nll_base"] - metrics.token_metrics(e, e, t)["nll_base"])
        for e, c, t in zip(exact, decoded, targets)])
    res["nll_base_abs_err_max"] = float(nllb_err.max())
    return res


def measure_q8_error(name: str, n_ctx: int, chunks: int, text_path: str | None, cache_dir: str) -> dict:
    """The encoding's KLD error against the study's smallest effect, through the engine:
    base = the BF16-cache baseline's fp32 log-probs, Q = the q8_0 t0 cell's (both from
    `forward.chunk_logprobs`, as `run_baseline` / `run_cell` compute them). Per token,
    |KLD(Q ‖ decoded sparse dump) − KLD(Q ‖ fp32 base)|, and the shift of the median KLD,
    relative to the q8_0 median KLD (goal ≤ 1 %)."""
    ctx = load.Context(sources.ModelSpec(name, f"embedded:{name}"), n_ctx, chunks, text_path, device="cpu",
                         cache_dir=cache_dir)
    model, pos = ctx.loaded.model, scoring.scored_positions(n_ctx)

    def run(ids, cell):  # one chunk with the cell's cache, as the engine runs a cell
        with torch.inference_mode():
            cache = forward.new_cache(model, cell)
            return torch.cat([lp for _, lp in forward.chunk_logprobs(model, ids, cache, 512, pos)])

    ref, got = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for ids in ctx.chunk_ids:
            base, q = run(ids, forward.BASELINE), run(ids, CellSpec("q8_0", "q8_0", 0))
            t = ids[pos.start + 1:pos.stop + 1]
            p = Path(tmp) / "base.kvd"
            dump.write_dump(p, {**ctx.ident, "n_chunks": 1}, [base])
            ref.append(metrics.token_metrics(q, base, t)["kld"])
            got.append(metrics.token_metrics(q, dump.open_dump(p).chunk(0), t)["kld"])
    ref, got = np.concatenate(ref), np.concatenate(got)
    err, med = np.abs(got - ref), float(np.median(ref))
    return {
        "n_tokens": int(len(ref)), "kld_median_fp32_base": med, "kld_mean_fp32_base": float(ref.mean()),
        "kld_median_dump": float(np.median(got)), "abs_err_mean": float(err.mean()),
        "abs_err_p99": float(np.quantile(err, 0.99)), "abs_err_max": float(err.max()),
        "median_shift_over_median": abs(float(np.median(got)) - med) / med,
        "abs_err_mean_over_median": float(err.mean()) / med,
        "abs_err_p99_over_median": float(np.quantile(err, 0.99)) / med,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="measure the KLD error of the dump encoding on real log-probs")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--text", default=str(TEXT), help="wiki.test.raw (default $TEXT, else ../shared beside the checkout)")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    a = ap.parse_args()
    print(json.dumps(measure_encoding_error(a.model, a.n_ctx, a.chunks, a.text, a.cache_dir), indent=1))
