"""kvarn.run.decode: free-running decode (greedy or sampled) through the cache model.

Slow (real models): an f32 cache reproduces the model's own `generate(do_sample=False)` token
for token; the bf16 cell is the baseline (never diverges, KLD exactly 0 in lock step), greedy
and sampled; a 2-bit cache diverges and its KLD along its own text is positive; a sampled decode
is reproducible from its seed and leaves the greedy text. Fast: the summary on hand-made steps,
the block size from the memory budget, the token choice on hand-worked rows and the Gumbel-max
sample's frequencies against softmax(log p / T). (The block path against lock step: tests/test_decode_speed.py.)
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kvarn.vocab.cell import CellSpec
from kvarn.run import decode as KD
from paths import CACHE_DIR, ENGINE_TEXT as TEXT

# One xdist worker: the module fixture loads SmolLM2 once.
pytestmark = pytest.mark.xdist_group("decode")

# A prompt of 80 tokens is prefilled in two ubatches (64 + 16: a ubatch boundary crossed),
# then 8 single-token steps; q2_0 leaves the baseline's text within them (asserted).
CTX, PROMPTS, TOKENS, UBATCH = 88, 2, 8, 64


def test_summary_on_hand_made_steps():
    # 3 prompts x 4 steps: prompt 0 never diverges, prompt 1 at step 2, prompt 2 at step 0.
    tok = np.array([[5, 6, 7, 8], [5, 6, 9, 9], [1, 2, 3, 4]])
    base = np.array([[5, 6, 7, 8], [5, 6, 7, 9], [0, 2, 3, 4]])
    kld = np.arange(12, dtype=float).reshape(3, 4) / 10
    steps = {"token": tok.ravel(), "base_token": base.ravel(), "kld": kld.ravel(),
             "same_top": (tok == base).ravel()}
    s = KD.summarize_decode(steps, 3, 4)
    assert s["first_divergence"] == [4, 2, 0] and s["first_divergence_median"] == 2.0 and s["n_diverged"] == 2
    assert s["survival"] == pytest.approx([1.0, 2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert s["decode_kld_step_mean"] == pytest.approx([0.4, 0.5, 0.6, 0.7])
    assert s["decode_same_top"] == pytest.approx(10 / 12)


def test_block_steps_from_the_memory_budget():
    # 128 MiB / (4 B x 16 prompts x 49152) = 42.67 -> 42 (SmolLM2); x 262144 -> 8 exactly (Gemma 3)
    assert KD.BLOCK_BYTES == 128 * 2**20
    assert KD.block_steps(16, 49152, 1024, 512) == 42
    assert KD.block_steps(16, 262144, 2048, 512) == 8
    assert KD.block_steps(4, 49152, 1024, 512) == 170
    assert KD.block_steps(4, 49152, 100, 512) == 100  # never more than the steps
    assert KD.block_steps(4, 49152, 1024, 64) == 64  # nor the ubatch
    assert KD.block_steps(64, 262144, 1024, 512) == 2  # 128 MiB / 64 MiB
    assert KD.block_steps(256, 262144, 1024, 512) == 1  # 0.5 -> at least one step
    assert KD.block_steps(2, 10, 1000, 1000, budget=800) == 10  # 800 // (4 x 2 x 10)
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match=r"block_steps: n_prompts must be a positive integer, got "):
            KD.block_steps(bad, 10, 10, 10)
    with pytest.raises(ValueError, match=r"block_steps: ubatch must be a positive integer, got 0"):
        KD.block_steps(1, 10, 10, 0)


def test_choose_greedy_and_gumbel_max_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]))
    assert KD.choose(logp).tolist() == [0, 2]
    assert KD.choose(torch.zeros(1, 4)).tolist() == [0]  # ties: the lowest id
    # T = 1: log p + g = (-0.693, -1.204 + 0.6, -1.609) -> 1; row 2 (-1.609 + 1.2, -1.609, -0.511) -> 0
    noise = torch.tensor([[0.0, 0.6, 0.0], [1.2, 0.0, 0.0]])
    assert KD.choose(logp, 1.0, noise).tolist() == [1, 0]
    # T = 0.5 doubles the log-probs' weight against the noise: row 1 (-1.386, -2.408 + 0.6, -3.219) -> 0,
    # row 2 (-3.219 + 1.2, -3.219, -1.022) -> 2
    assert KD.choose(logp, 0.5, noise).tolist() == [0, 2]
    with pytest.raises(ValueError, match=r"needs Gumbel noise of the log-probs' shape \(2, 3\), got None"):
        KD.choose(logp, 1.0)
    with pytest.raises(ValueError, match=r"needs Gumbel noise of the log-probs' shape \(2, 3\), got \(2, 4\)"):
        KD.choose(logp, 1.0, torch.zeros(2, 4))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gumbel_max_samples_softmax_of_logp_over_t(temperature):
    """40 000 draws of one 4-token row: the frequencies of `choose(logp, T, gumbel)` are
    softmax(log p / T) within 5 standard errors (<= 0.0125; at T = 0.7 the tempered and the
    untempered distributions differ by up to 0.08, a noise of the wrong scale by more)."""
    n = 40_000
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logp = torch.log(p).expand(n, 4)
    g = torch.Generator().manual_seed(1)
    got = torch.bincount(KD.choose(logp, temperature, KD.gumbel(g, (n, 4))), minlength=4).double() / n
    want = torch.softmax(torch.log(p).double() / temperature, 0)
    se = torch.sqrt(want * (1 - want) / n)
    assert ((got - want).abs() < 5 * se).all(), (got, want)
    if temperature != 1.0:
        assert (want - p.double()).abs().max() > 0.05  # the test tells T from no temperature
    # the noise itself is standard Gumbel: mean = Euler's gamma 0.5772, variance pi^2 / 6 = 1.6449
    # (standard errors over 10^6 draws: 0.0013 and 0.0045)
    g = KD.gumbel(torch.Generator().manual_seed(0), (1000, 1000))
    assert g.dtype == torch.float32 and torch.isfinite(g).all()
    g = g.double()
    assert abs(g.mean().item() - 0.5772157) < 0.006 and abs(g.var().item() - math.pi**2 / 6) < 0.02


def test_sampling_names_and_bad_values():
    from kvarn.vocab.options import check_sampling, parse_sampling, sampling_label, sampling_name

    assert sampling_name() == sampling_name(0, 7) == "" and sampling_name(1, 0) == "-T1-s0"
    assert sampling_name(0.7, 3) == "-T0.7-s3" and parse_sampling("-T0.7-s3") == (0.7, 3)
    assert parse_sampling("") == (0.0, 0) and sampling_label() == "greedy"
    assert sampling_label(1, 0) == "sampled at T = 1, seed 0"
    for t in (-1, float("nan"), float("inf"), 1e-5, 0.1234567, True, "1"):
        with pytest.raises(ValueError, match="decode temperature must be a number >= 0"):
            check_sampling(t, 0)
    for seed in (-1, 1.0, True):
        with pytest.raises(ValueError, match="decode seed must be an integer >= 0"):
            check_sampling(1, seed)
    with pytest.raises(ValueError, match="is not a decode sampling suffix"):
        parse_sampling("-T1")


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "8"])
def test_decode_refuses_a_bad_block(bad):
    with pytest.raises(ValueError, match=r"decode block must be a positive integer .* or None, got "):
        KD.decode(torch.nn.Linear(1, 1), torch.zeros(1, 4, dtype=torch.long), CellSpec("bf16", "bf16", 0), 2,
                  block=bad)


def test_prompt_length_is_checked():
    ids = torch.arange(20).reshape(2, 10)
    assert KD.decode_prompts(ids, 4).shape == (2, 6)
    with pytest.raises(ValueError, match="decode tokens must be an integer in 1..8"):
        KD.decode_prompts(ids, 9)


@pytest.fixture(scope="module")
def smol_chunks():
    """SmolLM2 loaded, and PROMPTS chunks of CTX tokens of the test split (the teacher-forced run's chunks)."""
    from kvarn.baseline import data
    from kvarn.weights import models

    lm = models.load(models.ModelSpec("smollm2-135m", "embedded:smollm2-135m"), cache_dir=CACHE_DIR)
    lm.model.eval()
    # 2 chunks of CTX tokens need only the head of the (verified) test split, not all 1.3 MB.
    return lm, data.make_chunks(data.tokenize(lm.tokenizer, data.load_text(TEXT)[:20000]), CTX, PROMPTS, lm.info.bos_id)


@pytest.fixture(scope="module")
def smol(smol_chunks):
    lm, chunks = smol_chunks
    prompts = KD.decode_prompts(chunks, TOKENS)
    assert UBATCH < prompts.shape[1] < 2 * UBATCH  # the prefill crosses one ubatch boundary
    return lm, prompts


class Bar:
    """kvarn.run.torch_engine.progress's tqdm, recorded: (desc, total, unit), its updates, whether closed; each
    bar made is appended to `Bar.made` (a test sets it to its own list)."""
    made: list = []

    def __init__(self, iterable, desc, total, unit):
        self.args, self.n, self.closed = (desc, total, unit), 0, False
        Bar.made.append(self)

    def update(self):
        self.n += 1

    def close(self):
        self.closed = True


@pytest.mark.slow
def test_f32_cache_reproduces_generate(smol):
    import kvarn.kvcache.attention  # noqa: F401  (registers "kvarn")

    lm, prompts = smol
    lm.model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        ref = lm.model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                max_new_tokens=TOKENS, min_new_tokens=TOKENS, pad_token_id=0)[:, prompts.shape[1]:]
    lm.model.set_attn_implementation("kvarn")
    steps = KD.decode(lm.model, prompts, CellSpec("f32", "f32", 0), TOKENS, ubatch=UBATCH)
    got = torch.as_tensor(steps["token"]).reshape(PROMPTS, TOKENS)
    assert ref.shape == got.shape and torch.equal(got, ref), (got, ref)
    # The f32 cell is within numerics noise of the baseline: same tokens, tiny KLD.
    assert (steps["token"] == steps["base_token"]).all() and steps["kld"].max() < 1e-3


@pytest.mark.slow
def test_bf16_cell_never_diverges_and_q2_does(smol, monkeypatch):
    import kvarn.kvcache.attention  # noqa: F401

    lm, prompts = smol
    lm.model.set_attn_implementation("kvarn")
    # In lock step (block=1) the baseline repeats the bf16 cell's arithmetic exactly: KLD 0.
    b = KD.decode(lm.model, prompts, CellSpec("bf16", "bf16", 0), TOKENS, ubatch=UBATCH, block=1)
    s = KD.summarize_decode(b, PROMPTS, TOKENS)
    assert s["n_diverged"] == 0 and s["survival"][-1] == 1.0 and (b["kld"] == 0).all() and b["same_top"].all()
    bars = Bar.made = []
    monkeypatch.setattr(KD, "progress", Bar)
    timing = {}
    q = KD.decode(lm.model, prompts, CellSpec("q2_0", "q2_0", 0), TOKENS, ubatch=UBATCH, timing=timing,
                  desc="q2 decode")
    # one progress bar of the generated steps, advanced once per step
    assert [(b.args, b.n, b.closed) for b in bars] == [(("q2 decode", TOKENS, "step"), TOKENS, True)]
    # the steps' time split: the cell's steps, the baseline's block forwards, the metrics
    parts = timing["cell_s"] + timing["base_s"] + timing["metrics_s"]
    assert timing["prefill_s"] > 0 and min(timing[k] for k in ("cell_s", "base_s", "metrics_s")) > 0
    assert parts <= timing["steps_s"] < parts + 0.05, timing
    sq = KD.summarize_decode(q, PROMPTS, TOKENS)
    assert sq["n_diverged"] >= 1 and sq["decode_kld_mean"] > 0.01
    # before its first divergence a prompt's tokens are the bf16 run's tokens
    for p, fd in enumerate(sq["first_divergence"]):
        assert (q["token"].reshape(PROMPTS, TOKENS)[p, :fd] == b["token"].reshape(PROMPTS, TOKENS)[p, :fd]).all()


@pytest.mark.slow
def test_sampled_decode_follows_the_seed(smol):
    """Sampled at T = 1, seed 0, in lock step: the bf16 cell never leaves the baseline's own
    sampled text (base_token = token, KLD exactly 0); the text is not the greedy one (the sampling
    was taken); the same seed gives the same tokens, another seed others; a q2_0 cell diverges, and
    before its first divergence a prompt's tokens are the bf16 run's sampled tokens."""
    import kvarn.kvcache.attention  # noqa: F401

    lm, prompts = smol
    lm.model.set_attn_implementation("kvarn")
    run = lambda cell, **kw: KD.decode(lm.model, prompts, CellSpec(*cell), TOKENS, ubatch=UBATCH, block=1,  # noqa: E731
                                       **kw)
    b = run(("bf16", "bf16", 0), temperature=1.0, seed=0)
    assert (b["token"] == b["base_token"]).all() and (b["kld"] == 0).all()
    assert (b["token"] != run(("bf16", "bf16", 0))["token"]).any()
    assert np.array_equal(run(("bf16", "bf16", 0), temperature=1.0, seed=0)["token"], b["token"])
    assert not np.array_equal(run(("bf16", "bf16", 0), temperature=1.0, seed=1)["token"], b["token"])
    q = run(("q2_0", "q2_0", 0), temperature=1.0, seed=0)
    fd = KD.first_divergence(q, PROMPTS, TOKENS)
    assert (fd < TOKENS).any() and q["kld"].mean() > 0.01
    for p, f in enumerate(fd):
        assert (q["token"].reshape(PROMPTS, TOKENS)[p, :f] == b["token"].reshape(PROMPTS, TOKENS)[p, :f]).all()


@pytest.mark.slow
def test_run_decode_writes_one_cells_result(smol_chunks, tmp_path, monkeypatch):
    """run_decode in this process (the workflow's decode jobs reach it only in a subprocess): it loads
    through `setup` with the job's arguments (or takes them from a `context`), decodes the prompts it
    cut from the chunks, and writes steps.parquet (the decode's rows, exactly) and summary.json (the
    summary it returns: the per-prompt summary, the cell, the identity, the timing split, the
    sampling); bad values are refused before any load."""
    import json

    import polars as pl

    import kvarn.kvcache.attention  # noqa: F401  (registers "kvarn")
    from kvarn.vocab.options import DECODE_VERSION, sampling_label, sampling_name

    lm, chunks = smol_chunks
    ident = {"text_sha256": "sha-of-the-text", "tokenizer_hash": "hash-of-the-tokenizer"}
    calls, bars = [], []
    Bar.made = bars

    def fake_setup(*args):  # what `setup` returns: the model on the cache model's attention
        calls.append(args)
        lm.model.set_attn_implementation("kvarn")
        return lm, chunks, ident

    monkeypatch.setattr(KD, "setup", fake_setup)
    monkeypatch.setattr(KD, "progress", Bar)
    cell = CellSpec("q2_0", "q4_0", 16)
    job = dict(ubatch=UBATCH, text="the-text", device="cpu", dtype="float32", cache_dir=CACHE_DIR, block=3)
    s = KD.run_decode("the-spec", CTX, PROMPTS, TOKENS, cell, tmp_path / "greedy", **job)
    assert calls == [("the-spec", CTX, PROMPTS, "the-text", "cpu", "float32", CACHE_DIR)]
    assert [b.args[0] for b in bars] == [f"{lm.info.name} decode q2_0/q4_0 tail 16"]
    ref = KD.decode(lm.model, KD.decode_prompts(chunks, TOKENS), cell, TOKENS, ubatch=UBATCH, attention="ref",
                    block=3)
    steps = pl.read_parquet(tmp_path / "greedy" / "steps.parquet")
    assert steps.columns == list(KD.STEP_KEYS)
    for key in KD.STEP_KEYS:
        assert np.array_equal(steps[key].to_numpy(), ref[key]), key
    assert json.loads((tmp_path / "greedy" / "summary.json").read_text()) == s
    for key, value in KD.summarize_decode(ref, PROMPTS, TOKENS).items():
        assert s[key] == value, key
    info = lm.info
    want = {"model": info.name, "source": info.source, "revision": info.revision, "n_ctx": CTX,
            "prompt_tokens": CTX - TOKENS, "k_type": "q2_0", "v_type": "q4_0", "tail": 16, "rot": cell.rot,
            "tail_dtype": cell.tail_dtype, "iters": cell.iters, "sink": cell.sink, "compute": cell.compute,
            "ubatch": UBATCH, "attention": "ref", "text_sha256": "sha-of-the-text",
            "tokenizer_hash": "hash-of-the-tokenizer", "decode_version": DECODE_VERSION, "block": 3,
            "temperature": 0.0, "seed": None, "sampling": sampling_name(0.0, 0), "device": info.device,
            "dtype": info.dtype}
    assert {k: s[k] for k in want} == want
    assert s["step_ms"] == pytest.approx(1000 * s["steps_s"] / TOKENS, rel=1e-12)
    assert s["prefill_s"] > 0 and s["cell_s"] + s["base_s"] + s["metrics_s"] <= s["steps_s"]
    assert s["prefill_s"] + s["steps_s"] <= s["decode_s"] <= s["wall_s"]

    # Sampled, from another job's loaded context: the context is asked for this job, setup is not called.
    asked = []

    class Context:
        def for_job(self, *args):
            asked.append(args)
            return lm, chunks, ident

    t = KD.run_decode("the-spec", CTX, PROMPTS, TOKENS, cell, tmp_path / "sampled", context=Context(),
                      temperature=0.5, seed=7, **job)
    assert asked == calls and len(calls) == 1
    assert bars[-1].args[0] == f"{lm.info.name} decode q2_0/q4_0 tail 16, {sampling_label(0.5, 7)}"
    assert (t["temperature"], t["seed"], t["sampling"]) == (0.5, 7, sampling_name(0.5, 7))
    sampled = KD.decode(lm.model, KD.decode_prompts(chunks, TOKENS), cell, TOKENS, ubatch=UBATCH, block=3,
                        temperature=0.5, seed=7)
    assert np.array_equal(pl.read_parquet(tmp_path / "sampled" / "steps.parquet")["token"].to_numpy(),
                          sampled["token"])

    with pytest.raises(ValueError, match=f"decode prompts 3: the text holds only 2 chunks of {CTX} tokens"):
        KD.run_decode("the-spec", CTX, 3, TOKENS, cell, tmp_path / "more", **job)
    assert not (tmp_path / "more").exists()
    with pytest.raises(TypeError, match="run_decode takes a kvarn.vocab.cell.CellSpec"):
        KD.run_decode("the-spec", CTX, PROMPTS, TOKENS, ("q2_0", "q4_0", 16), tmp_path / "x", **job)
    n = len(calls)
    with pytest.raises(ValueError, match="nope"):
        KD.run_decode("the-spec", CTX, PROMPTS, TOKENS, cell, tmp_path / "x", **{**job, "device": "cpu"},
                      attention="nope")
    with pytest.raises(ValueError, match="temperature"):
        KD.run_decode("the-spec", CTX, PROMPTS, TOKENS, cell, tmp_path / "x", temperature=-1, **job)
    assert len(calls) == n and not (tmp_path / "x").exists()


def test_cli_refuses_bad_decode_values(capsys):
    from kvarn.cli import main

    for argv, needle in [
        (["--tokens", "600"], "--tokens 600 leaves no prompt in --ctx 512"),
        (["--k", "kvarn4", "--v", "q4_0"], "kvarn4"),
        (["--prompts", "0"], "--prompts must be a positive integer"),
        (["--block", "0"], "--block must be a positive integer"),
        (["--temperature", "-1"], "decode temperature must be a number >= 0"),
        (["--temperature", "warm"], "--temperature must be a number >= 0 (0: greedy), got 'warm'"),
        (["--seed", "-3"], "--seed must be"),
    ]:
        base = {"--k": "q4_0", "--v": "q4_0"}
        args = ["decode", "-m", "smollm2-135m", "-c", "512", "-o", "/tmp/never"]
        extra = dict(zip(argv[::2], argv[1::2]))
        for k, v in {**base, **extra}.items():
            args += [k, v]
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err


def test_cli_block_reaches_the_decode(tmp_path, monkeypatch, fetched):
    """`kvarn decode --block B` is the steps per baseline forward of `decode` (default: None,
    `block_steps` decides); `--temperature T --seed S` its sampling (default greedy, seed 0)."""
    from kvarn.baseline import data
    from kvarn.cli import main
    from paths import WIKI_TEXT

    fetched("smollm2-135m")
    load_text = data.load_text  # (verified) one chunk needs only the head of the test split
    monkeypatch.setattr(data, "load_text", lambda *a, **kw: load_text(*a, **kw)[:4000])
    seen = []

    class Stop(Exception):
        pass

    def fake(model, p_ids, cell, tokens, **kw):
        seen.append((kw["block"], kw["temperature"], kw["seed"]))
        raise Stop

    monkeypatch.setattr(KD, "decode", fake)
    args = ["decode", "-m", "smollm2-135m", "-c", "64", "--prompts", "1", "--tokens", "8", "-f", str(WIKI_TEXT),
            "--k", "q4_0", "--v", "q4_0", "-o", str(tmp_path / "d")]
    for extra in (["--block", "3"], [], ["--temperature", "0.7", "--seed", "5"]):
        with pytest.raises(Stop):
            main(args + extra)
    assert seen == [(3, 0.0, 0), (None, 0.0, 0), (None, 0.7, 5)]


def _fake_summary(tmp_path, cell, k, v, tail, fd, g=8):
    import json

    d = tmp_path / "results" / "m" / f"decode-ctx64-p{len(fd)}-g{g}" / cell
    d.mkdir(parents=True)
    steps = {"token": np.zeros(len(fd) * g, int), "base_token": np.zeros(len(fd) * g, int),
             "kld": np.full(len(fd) * g, 0.01), "same_top": np.ones(len(fd) * g, bool)}
    for p, f in enumerate(fd):
        steps["base_token"][p * g + f: (p + 1) * g] = 1  # differs from step f on
    s = KD.summarize_decode(steps, len(fd), g)
    assert s["first_divergence"] == [min(f, g) for f in fd]
    s.update(model="m", k_type=k, v_type=v, tail=tail)
    (d / "summary.json").write_text(json.dumps(s))
    return d / "summary.json"


def test_decode_figure_spec(tmp_path):
    from kvarn.report.data import decode_frame
    from kvarn.report.figures_generation import decode as decode_fig

    paths = [_fake_summary(tmp_path, "q4_0-q4_0-t128", "q4_0", "q4_0", 128, [2, 3, 8]),
             _fake_summary(tmp_path, "kvarn4-kvarn4-t0", "kvarn4", "kvarn4", 0, [5, 8, 8]),
             _fake_summary(tmp_path, "kvarn2-kvarn2-t200", "kvarn2", "kvarn2", 200, [1, 1, 1]),
             _fake_summary(tmp_path, "kivi4-kivi4-t0", "kivi4", "kivi4", 0, [8, 8, 8])]
    f = decode_frame(paths)
    # the printed tail is the effective one where the format raised the request: KVarN to whole
    # 128-token groups, an ecosystem type to its 128-token residual window (kvarn.vocab.facts)
    assert set(f["label"]) == {"q4_0-q4_0 t128", "kvarn4-kvarn4 t128*", "kvarn2-kvarn2 t256*",
                               "kivi4-kivi4 t128*"} and f.height == 4 * 9
    kv = f.filter(f["cell"] == "kvarn4-kvarn4-t0").sort("step")
    assert kv["survival"].to_list() == pytest.approx([1, 1, 1, 1, 1, 1, 2 / 3, 2 / 3, 2 / 3])
    spec = decode_fig(f).to_dict()
    names = {spec["hconcat"][0].get("name"), spec["hconcat"][1].get("name")}
    assert any(n and n.startswith("survival") for n in names) and "kld_per_step" in names


def test_matrix_decode_axis_plans_decode_jobs(tmp_path):
    import sys

    import yaml

    sys.path.insert(0, str(Path(__file__).parent))
    import test_workflow
    from test_workflow import TINY, plan, workflow_copy

    cfg = {**TINY, "models": [{**TINY["models"][0], "decode": {"prompts": 2, "tokens": 16,
                                                              "cells": ["q4_0-q4_0-t128", "kvarn4-kvarn4-t0"]}}]}
    wd = workflow_copy(tmp_path, cfg)
    old = test_workflow.OURS
    try:
        test_workflow.OURS = (*old, "decode", "report_decode")
        jobs = plan(wd)
    finally:
        test_workflow.OURS = old
    assert jobs["decode"] == 2 and jobs["report_decode"] == 1
    assert yaml.safe_load((wd / "config" / "matrix.yaml").read_text())["models"][0]["decode"]["tokens"] == 16
