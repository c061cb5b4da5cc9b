"""The engine on the real models (slow: `pytest -m slow tests/test_engine.py`) and the CLI (fast).

Small context (n_ctx 256, 1 chunk), each model loaded once, one baseline shared by the
SmolLM2 cells. Oracles: the model's own plain sdpa forward (f32 cache, no tail) with a
tolerance from the eager-vs-sdpa fp32 noise, and the expected orderings of the formats.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvarn.vocab.cell import CellSpec
from kvarn.vocab import scoring

from kvarn import cli
from paths import CACHE_DIR, ENGINE_TEXT as TEXT

# One xdist worker: the session fixtures load SmolLM2 and run its baselines once (the Gemma 3
# test, which shares nothing with them, in a group of its own).
pytestmark = pytest.mark.xdist_group("engine")

CTX = 256


# --- fast: the command line ---------------------------------------------------------

def _exit_code(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["run", "-m", "smollm2-135m", "-c", "256", "--k", "q9_0", "--v", "q4_0", "--baseline", "b", "-o", "o"], "q9_0"),
    (["run", "-m", "smollm2-135m", "-c", "255", "--k", "q4_0", "--v", "q4_0", "--baseline", "b", "-o", "o"], "255"),
    (["run", "-m", "smollm2-135m", "-c", "256", "--k", "q4_0", "--v", "q4_0", "--tail", "-3", "--baseline", "b",
      "-o", "o"], "-3"),
    (["run", "-m", "smollm2-135m", "-c", "256", "--k", "kvarn4", "--v", "q4_0", "--baseline", "b", "-o", "o"],
     "kvarn4"),
    (["run", "-m", "smollm2-135m", "-c", "256", "--k", "q4_0", "--v", "q4_0", "--accounting", "beellama",
      "--baseline", "b", "-o", "o"], "invalid choice: 'beellama'"),
    (["baseline", "-m", "no-such-model", "-c", "256", "-o", "o"], "no-such-model"),
    (["baseline", "-m", "smollm2-135m", "-c", "256", "--chunks", "0", "-o", "o"], "--chunks"),
    (["baseline", "-m", "smollm2-135m", "-c", "256", "--attention", "fast", "-o", "o"],
     "invalid choice: 'fast' (choose from 'ref', 'flex', 'auto')"),
])
def test_cli_bad_values_exit_2(argv, needle, capsys):
    code, err = _exit_code(argv, capsys)
    assert code == 2
    assert needle in err


def test_cli_formats(capsys):
    assert cli.main(["formats"]) == 0
    out = capsys.readouterr().out
    for name in ("q8_0", "q4_0", "bf16", "kvarn4"):
        assert name in out


def test_cli_help_mentions_llama_terms(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    for term in ("--ctx", "--chunks", "--ubatch", "-ctk", "--tail", "--baseline"):
        assert term in out


# --- slow: real models ---------------------------------------------------------------

@pytest.fixture(scope="session")
def loaded():
    from kvarn.weights import models, sources

    out = {}

    def get(name):
        if name not in out:
            lm = models.load(sources.ModelSpec(name, f"embedded:{name}"), cache_dir=CACHE_DIR)
            out[name] = lm
        return out[name]
    return get


@pytest.fixture(scope="session")
def first_chunk(loaded):
    from kvarn.baseline import data

    text = data.load_text(TEXT)

    def get(name):
        lm = loaded(name)
        return data.make_chunks(data.tokenize(lm.tokenizer, text), CTX, 1, lm.info.bos_id)[0]
    return get


def _engine_logprobs(lm, ids, k, v, tail=0, ubatch=512):
    from kvarn.run import forward

    lm.model.set_attn_implementation("kvarn")
    cache = forward.new_cache(lm.model, CellSpec(k, v, tail))
    return torch.cat([lp for _, lp in forward.chunk_logprobs(lm.model, ids, cache, ubatch, scoring.scored_positions(CTX))])


@torch.inference_mode()
def _plain_logprobs(lm, ids, impl, sc=None):
    """The model's own single-pass forward over the whole chunk `ids`, its head applied at
    the scored positions only (`logits_to_keep`, as the engine does), or at the range `sc`."""

    lm.model.set_attn_implementation(impl)
    sc = sc or scoring.scored_positions(ids.shape[0])
    logits = lm.model(ids[None], logits_to_keep=torch.arange(sc.start, sc.stop)).logits[0]
    assert logits.shape[0] == len(sc)
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m"])  # Gemma 3: in its sliding-window test below
def test_f32_cache_equals_plain_forward(name, loaded, first_chunk):
    lm, ids = loaded(name), first_chunk(name)
    ref = _plain_logprobs(lm, ids, "sdpa")
    noise = (_plain_logprobs(lm, ids, "eager") - ref).abs().max().item()
    got = _engine_logprobs(lm, ids, "f32", "f32", ubatch=100)
    diff = (got - ref).abs().max().item()
    print(f"{name}: engine f32 vs plain sdpa max |Δlogp| {diff:.3g}; eager vs sdpa {noise:.3g}")
    assert diff <= 2 * max(noise, 1e-6)


SMOL = ("smollm2-135m", "embedded:smollm2-135m")


@pytest.fixture(scope="session")
def smol_context():
    """`smol_context(n_ctx)`: one load.Context (SmolLM2 loaded, the text tokenized) per
    n_ctx, shared by the cells and baselines below, as kvarn.run.worker shares one per job."""
    from kvarn.run import load
    from kvarn.weights import sources

    out = {}

    def get(n_ctx):
        if n_ctx not in out:
            out[n_ctx] = load.Context(sources.ModelSpec(*SMOL), n_ctx, 1, TEXT, cache_dir=CACHE_DIR)
        return out[n_ctx]
    return get


@pytest.fixture(scope="session")
def smol_baseline_run(tmp_path_factory):
    """The SmolLM2 baseline dump at CTX, made without a Context (the engine loading the
    model itself), and the row counts of the log-prob slices its writer was handed."""
    from kvarn.baseline import dump
    from kvarn.run import torch_engine
    from kvarn.weights import sources

    out = tmp_path_factory.mktemp("kvarn") / "base.kvd"
    real = dump.write_dump
    with pytest.MonkeyPatch.context() as mp:
        seen = _spy_on_dump_slices(mp)
        torch_engine.run_baseline(sources.ModelSpec(*SMOL), CTX, 1, out, text=TEXT, cache_dir=CACHE_DIR)
    assert dump.write_dump is real
    return out, seen


@pytest.fixture(scope="session")
def smol_baseline(smol_baseline_run):
    return smol_baseline_run[0]


def _spy_on_dump_slices(mp):
    """Wrap dump.write_dump (through `mp`): each block must arrive as a generator of row
    slices, never a whole tensor; returns the list the slices' row counts are added to."""
    from kvarn.baseline import dump

    real, seen = dump.write_dump, []

    def spy(path, header, blocks, **kw):
        def watched():
            for block in blocks:
                assert not isinstance(block, torch.Tensor), "a whole chunk was materialised"

                def rows(block=block):
                    for part in block:
                        seen.append(part.shape[0])
                        yield part
                yield rows()
        return real(path, header, watched(), **kw)

    mp.setattr(dump, "write_dump", spy)
    return seen


def test_baseline_streams_its_log_probs_to_the_dump_in_slices(smol_baseline_run):
    # The host never holds a whole chunk's log-probs (32 GB at Qwen 3.6's 64k): each chunk
    # reaches the writer as LOGIT_ROWS slices (test_dump: the file is the same either way).
    from kvarn.baseline import dump
    from kvarn.run import forward

    out, seen = smol_baseline_run
    assert len(seen) > 1 and max(seen) <= forward.LOGIT_ROWS and sum(seen) == CTX - 1 - CTX // 2
    assert dump.open_dump(out).n_chunks == 1


def test_the_forward_run_ahead_of_the_writer_writes_the_same_dump(smol_baseline_run, smol_context, tmp_path,
                                                                  monkeypatch):
    # The fixture's dump was written with the forward in a thread ahead of the writer (AHEAD 2);
    # one after the other in one thread (AHEAD 0), the file is the same bytes.
    from kvarn.run import torch_engine
    from kvarn.weights import sources

    assert torch_engine.AHEAD == 2
    monkeypatch.setattr(torch_engine, "AHEAD", 0)
    out = tmp_path / "serial.kvd"
    torch_engine.run_baseline(sources.ModelSpec(*SMOL), CTX, 1, out, text=TEXT, cache_dir=CACHE_DIR, context=smol_context(CTX))
    assert out.read_bytes() == smol_baseline_run[0].read_bytes()


def _cell(base, k, v, tail, tmp_path_factory, context):
    from kvarn.run import torch_engine
    from kvarn.weights import sources

    out = tmp_path_factory.mktemp(f"{k}-{v}-t{tail}")
    s = torch_engine.run_cell(sources.ModelSpec(*SMOL), CTX, 1, CellSpec(k, v, tail), base, out, text=TEXT,
                        cache_dir=CACHE_DIR, context=context)
    assert json.loads((out / "summary.json").read_text())["kld_median"] == s["kld_median"]
    # the memory keys: `packed` by default, with the geometry they came from (kvarn.budget.memory)
    from kvarn.vocab.geometry import Geometry
    from kvarn.budget.memory import kv_bytes

    smol = Geometry.uniform(30, 3, 64)
    assert s["memory_accounting"] == "packed" and Geometry.from_list(s["kv_geometry"]) == smol
    assert s["kv_total_bytes"] == kv_bytes(smol, CTX, CellSpec(k, v, tail)).total and s["kv_staging_bytes"] == 0
    import polars as pl

    t = pl.read_parquet(out / "tokens.parquet")
    assert t.columns == ["chunk", "pos", "kld", "nll", "nll_base", "dp", "same_top"]
    assert t.height == CTX - 1 - CTX // 2
    return s, t


@pytest.fixture(scope="session")
def smol_bf16_cell(loaded, first_chunk):
    """The bf16/bf16 cell's own log-probs on the baseline's chunk, with the baseline's ubatch
    and attention path, through a cache built here (not the engine's baseline constants)."""
    from kvarn.run import forward

    lm, ids = loaded("smollm2-135m"), first_chunk("smollm2-135m")
    lm.model.set_attn_implementation("kvarn")
    path = forward.attention_path("auto", lm.info.device, "exact")
    cache = forward.new_cache(lm.model, CellSpec("bf16", "bf16", 0), attention=path)
    lp = torch.cat([x.cpu() for _, x in forward.chunk_logprobs(lm.model, ids, cache, 512, scoring.scored_positions(CTX))])
    return lp, ids[CTX // 2 + 1 : CTX]


@pytest.mark.slow
def test_bf16_cell_is_the_baseline_bit_for_bit(smol_baseline, smol_bf16_cell):
    # The baseline is the bf16 cell: its dump holds exactly the encoding of the bf16 cell's
    # own log-probs (a baseline with another cache type, e.g. an f16 V, changes codes), so
    # the two are the same distributions, KLD exactly 0, before the encoding; scored
    # against the dump, the cell and its own encoding give the same numbers bit for bit.
    import numpy as np

    from kvarn.baseline import dump, encoding

    from kvarn.stats import metrics

    lp, targets = smol_bf16_cell
    base = dump.open_dump(smol_baseline)
    rows = encoding.encode_rows(lp)
    assert np.array_equal(base.dense_rows(0), rows)
    assert torch.equal(encoding.decode_rows(rows, base.vocab_size), base.decode(0))
    own, got = (metrics.token_metrics(lp, b, targets) for b in (encoding.decode_rows(rows, base.vocab_size), base.decode(0)))
    assert all(np.array_equal(own[k], got[k]) for k in own) and own["same_top"].all()


@pytest.mark.slow
def test_bf16_cell_against_baseline_dump(smol_baseline, smol_bf16_cell, tmp_path_factory, smol_context):
    # Through the uint16 dump the only difference left is its encoding error: the cell's
    # per-token KLD is, bit for bit, that of its own log-probs against their encoding.
    import numpy as np

    from kvarn.baseline import dump

    from kvarn.stats import metrics

    lp, targets = smol_bf16_cell
    s, t = _cell(smol_baseline, "bf16", "bf16", 0, tmp_path_factory, smol_context(CTX))
    print(f"bf16 vs bf16 baseline through the dump: mean KLD {s['kld_mean']:.3g}, max {s['kld_max']:.3g}")
    want = metrics.token_metrics(lp, dump.open_dump(smol_baseline).decode(0), targets)["kld"]
    assert np.array_equal(t["kld"].to_numpy(), want) and want.max() > 0
    assert abs(s["kld_max"]) <= 1.3e-4 and abs(s["kld_min"]) <= 1.3e-4
    assert s["same_top"] == 1.0


@pytest.mark.slow
def test_cell_identical_from_sparse_and_dense_dump(smol_baseline, tmp_path_factory, smol_context):
    # The default (sparse) dump stores only the nonzero codes; a dense copy of it must give
    # the same cell, per-token metrics bit for bit, through the engine's slice decoding.
    import polars as pl

    from kvarn.baseline import dump

    from kvarn.run import torch_engine

    from kvarn.weights import sources

    dense = tmp_path_factory.mktemp("dense") / "base.kvd"
    dump.convert_dump(smol_baseline, dense, layout="dense")
    assert dump.open_dump(smol_baseline).layout == "sparse" and dump.open_dump(dense).layout == "dense"
    assert smol_baseline.stat().st_size < dense.stat().st_size
    got = {}
    for name, base in (("sparse", smol_baseline), ("dense", dense)):
        out = tmp_path_factory.mktemp(f"q8-{name}")
        s = torch_engine.run_cell(sources.ModelSpec(*SMOL), CTX, 1, CellSpec("q8_0", "q8_0", 0), base, out,
                            text=TEXT, cache_dir=CACHE_DIR, context=smol_context(CTX))
        got[name] = (pl.read_parquet(out / "tokens.parquet"), s)
    assert got["sparse"][0].equals(got["dense"][0]) and got["sparse"][0]["kld"].max() > 0
    from kvarn.stats import metrics

    keys = list(metrics.summarize(got["dense"][0]))  # every summary statistic
    assert [got["sparse"][1][k] for k in keys] == [got["dense"][1][k] for k in keys]


@pytest.mark.slow
def test_smollm2_orderings(smol_baseline, tmp_path_factory, smol_context):
    med = {}
    for k, tail in (("q8_0", 0), ("q4_0", 0), ("q4_0", 128), ("q2_0", 0)):
        med[(k, tail)] = _cell(smol_baseline, k, k, tail, tmp_path_factory, smol_context(CTX))[0]["kld_median"]
    print("median KLD:", med)
    assert med[("q8_0", 0)] < med[("q4_0", 0)] < med[("q2_0", 0)]
    assert med[("q4_0", 128)] < med[("q4_0", 0)]


# --- KVarN end to end where its body is read ---------------------------------------------

@pytest.fixture(scope="session")
def smol_baseline_512(tmp_path_factory, smol_context):
    from kvarn.run import torch_engine
    from kvarn.weights.sources import ModelSpec

    out = tmp_path_factory.mktemp("kvarn512") / "base.kvd"
    torch_engine.run_baseline(ModelSpec(*SMOL), 512, 1, out, text=TEXT, cache_dir=CACHE_DIR, context=smol_context(512))
    return out


@pytest.mark.slow
def test_kvarn_end_to_end_reads_the_body(smol_baseline_512, tmp_path_factory, smol_context):
    # At n_ctx 256 a scored query (p >= 128) reads nothing from KVarN's body (sink 128 +
    # tail 128 cover p + 1 <= 256 keys): such a test exercises no KVarN numerics. At 512
    # a third of the reads come from the body, so the width must show in the KLD.
    from kvarn.run import torch_engine
    from kvarn.weights.sources import ModelSpec

    spec = ModelSpec(*SMOL)
    s = {}
    for k in ("kvarn2", "kvarn8"):
        s[k] = torch_engine.run_cell(spec, 512, 1, CellSpec(k, k, 0), smol_baseline_512, tmp_path_factory.mktemp(k),
                               text=TEXT, cache_dir=CACHE_DIR, context=smol_context(512))
    for k, r in s.items():
        assert 0 < 1 - r["exact_share"] and r["exact_share"] == pytest.approx(2 / 3)  # body share 1/3
        print(f"{k}: median KLD {r['kld_median']:.3g}, mean {r['kld_mean']:.3g}, exact share {r['exact_share']:.3f}")
    # The body is read: 2-bit KVarN must do clearly worse than 8-bit (identical if no body key were read).
    assert s["kvarn2"]["kld_median"] > 4 * s["kvarn8"]["kld_median"]
    assert s["kvarn8"]["kld_max"] > 0


# --- sliding layers that forget: n_ctx beyond window + ubatch ------------------------------

SLIDE_CTX, SLIDE_UB = 640, 64  # the smallest multiple of the ubatch past window 512 + ubatch 64


@pytest.mark.slow
@pytest.mark.xdist_group("gemma")  # group "engine_gemma": the only Gemma 3 test here, on a worker of its own
def test_gemma3_sliding_layers_forget_and_reproduce_the_forward(loaded, monkeypatch):
    # n_ctx 640 > window 512 + ubatch 64: Gemma 3's sliding layers keep only the 511 + 64
    # rows a ubatch can read (the rest really dropped, before scored queries read the
    # window), yet the f32 cache is the model's own single pass at fp32 noise (the claim of
    # test_f32_cache_equals_plain_forward, for Gemma 3 made here), and a q4_0 tail-128 cell
    # is bit for bit the same cache keeping every row.
    from kvarn.baseline import data
    from kvarn.run import forward
    from kvarn.kvcache.cache import KVarnLayer

    lm, n, ub = loaded("gemma3-270m"), SLIDE_CTX, SLIDE_UB
    window = lm.model.config.sliding_window
    assert window + ub < n and n % ub == 0
    ids = data.make_chunks(data.tokenize(lm.tokenizer, data.load_text(TEXT)), n, 1, lm.info.bos_id)[0]
    # Compared: the last ubatch (queries n - ub .. n - 1), whose sliding layers read a cache that
    # has dropped rows (asserted below: its first readable key is n - ub - window + 1, not 0). The
    # head over Gemma 3's 262k-token vocabulary at the scored half (320 positions, 2 * 168M * 320
    # multiply-adds) would cost about what the pass through the layers does (2 * 100M * 640).
    sc = range(n - ub, n)
    assert n - ub - window + 1 > 0

    def run(k, v, tail):
        lm.model.set_attn_implementation("kvarn")
        cache = forward.new_cache(lm.model, CellSpec(k, v, tail))
        return torch.cat([lp for _, lp in forward.chunk_logprobs(lm.model, ids, cache, ub, sc)]), cache

    plain = {impl: _plain_logprobs(lm, ids, impl, sc) for impl in ("sdpa", "eager")}
    noise = (plain["eager"] - plain["sdpa"]).abs().max().item()
    got, cache = run("f32", "f32", 0)
    diff = (got - plain["sdpa"]).abs().max().item()
    print(f"gemma3 n_ctx {n}: f32 cache vs plain sdpa max |Δlogp| {diff:.3g}; eager vs sdpa {noise:.3g}")
    assert diff <= 2 * max(noise, 1e-6)
    layers = [layer for layer in cache.layers if isinstance(layer, KVarnLayer)]
    assert {layer.is_sliding for layer in layers} == {True, False}
    for layer in layers:
        if layer.is_sliding:
            assert layer.stored_rows() == window - 1 + ub and layer.keys.shape[-2] == window - 1 + ub
            assert all(b.n_moves > 0 and b.lo > 0 for b in layer.rows.values())  # rows were dropped
            assert layer.kv_offset == n - ub - window + 1  # the last ubatch's first readable key
        else:
            assert layer.stored_rows() == n and layer.keys.shape[-2] == n
    q4, _ = run("q4_0", "q4_0", 128)
    monkeypatch.setattr(KVarnLayer, "trim", False)
    q4_all, full = run("q4_0", "q4_0", 128)
    assert all(layer.stored_rows() == n for layer in full.layers if isinstance(layer, KVarnLayer))
    assert torch.equal(q4, q4_all)


def test_json_default_writes_scalars_and_refuses_the_rest():
    """A summary's numpy or torch scalar is written as its Python value (json.dumps' `default`); anything
    else is refused by name, never written as its repr."""
    import numpy as np

    from kvarn.run.torch_engine import json_default

    got = json.loads(json.dumps({"a": np.float32(1.5), "b": np.int64(7), "c": torch.tensor(2.25)},
                                default=json_default))
    assert got == {"a": 1.5, "b": 7, "c": 2.25} and type(got["b"]) is int
    with pytest.raises(TypeError, match="not JSON serializable: object"):
        json_default(object())


def test_timed_counts_only_the_producer_s_time(monkeypatch):
    """forward.timed adds to timing[key] the seconds spent producing each item (a clock that steps 1 s per
    reading: 3 items and the end each take one step), never the consumer's time between items."""
    from kvarn.run import forward

    ticks = iter(range(100))
    monkeypatch.setattr(forward.time, "perf_counter", lambda: float(next(ticks)))
    timing = {"forward_s": 10.0, "other": 0.0}
    got = []
    for x in forward.timed(iter("abc"), timing):
        got.append(x)
        next(ticks), next(ticks)  # the consumer's own time: two steps per item, not counted
    assert got == ["a", "b", "c"] and timing == {"forward_s": 14.0, "other": 0.0}
    timing = {"forward_s": 0.0, "other": 0.5}
    assert list(forward.timed(iter([1]), timing, "other")) == [1] and timing == {"forward_s": 0.0, "other": 2.5}


def test_the_baseline_cell_is_bf16_at_tail_0_on_the_exact_path_by_default():
    from kvarn.run import forward

    assert forward.baseline_cell() == forward.BASELINE == CellSpec("bf16", "bf16", 0)
    assert forward.baseline_cell().compute == "exact"
    assert forward.baseline_cell("tf32-attn") == CellSpec("bf16", "bf16", 0, compute="tf32-attn")


def test_set_compute_rounds_activations_only_on_the_llamacpp_cpu_path(monkeypatch):
    """load.set_compute: under llamacpp-cpu every Linear's input is rounded as llama.cpp rounds it for the
    weights of the model's own GGUF (its path from the spec and cache); any other path switches it off."""
    from kvarn.run import load

    calls = []
    monkeypatch.setattr(load.sources, "gguf_path", lambda spec, cache_dir: f"{cache_dir}/{spec}.gguf")
    monkeypatch.setattr(load, "set_activation_rounding", lambda model, gguf, on: calls.append((model, gguf, on)))
    load.set_compute("model", "smol", "/cache", "llamacpp-cpu")
    for compute in ("exact", "bf16-attn", "tf32-attn"):
        load.set_compute("model", "smol", "/cache", compute)
    assert calls == [("model", "/cache/smol.gguf", True)] + [("model", None, False)] * 3
