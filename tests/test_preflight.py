"""kvarn.budget.preflight: the memory estimate of a job from its config, and the stop before loading."""

import json
from pathlib import Path

import pytest

from kvarn import cli

from kvarn.budget import preflight
from kvarn.weights.sources import ModelSpec

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
QWEN = f"random:{REPO}/config/models/qwen3.6-27b.json"
GEMMA = f"random:{REPO}/config/models/gemma4-31b.json"


def test_study_estimates_printed(capsys):
    """`kvarn baseline --dry-run` on the study configs: the estimate, without weights."""
    assert cli.main(["baseline", "-m", QWEN, "-c", "65536", "-ub", "512", "--device", "cuda", "--dtype", "bfloat16",
                     "-o", "unused.kvd", "--dry-run"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "cache copies" in out and "log-prob slice" in out and not Path("unused.kvd").exists()
    q = preflight.preflight(ModelSpec("q", QWEN), 65536, 512, "cuda", "bfloat16", "unused", baseline=True,
                            dry_run=True)
    # 16 attention layers x (K + V) bf16 bodies (the baseline keeps no exact copy) x 4 KV heads
    # x 65536 x 256, by hand:
    assert q.device_parts["cache copies"] == 16 * 2 * 2 * 4 * 65536 * 256 == 4 * GIB
    assert 26.8e9 * 2 < q.device_parts["weights"] < 27.0e9 * 2  # 26.9 B parameters in bf16
    assert q.device_parts["logits"] == 512 * 248320 * 4 + 2 * 64 * 248320 * 4
    # The baseline streams a chunk to the dump a 64-row slice at a time: fp32 log-probs, the
    # writer's float64 temporaries and 16-bit codes, never the chunk (32767 x 248320 x 4 B).
    assert q.host_parts["log-prob slice"] == 64 * 248320 * (4 + 8 + 2)
    g = preflight.preflight(ModelSpec("g", GEMMA), 16384, 512, "cuda", "bfloat16", "unused", baseline=False,
                            dry_run=True)
    # 50 sliding layers (16 x 256, window 1024: 1023 + 512 rows kept) + 10 full layers (4 x 512,
    # all 16384 rows), each row K and V as an fp32 body and a 16-bit exact copy (12 bytes):
    assert g.device_parts["cache copies"] == (50 * 16 * 256 * 1535 + 10 * 4 * 512 * 16384) * 12
    assert "linear-attention state" not in g.device_parts and g.host_parts == {}
    for est in (q, g):
        assert est.device_bytes == int(sum(est.device_parts.values()) * preflight.HEADROOM)


def _tiny(tmp_path):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    return f"random:{cfg}"


def test_too_small_device_stops_before_loading(tmp_path, monkeypatch):
    from kvarn.run import torch_engine
    from kvarn.weights import models

    def no_load(*a, **k):
        raise AssertionError("weights were loaded before the preflight stopped the job")

    monkeypatch.setattr(models, "load", no_load)
    monkeypatch.setattr(preflight, "capacity", lambda device: (10 * 2**20, 2**40))  # a 10 MiB GPU
    with pytest.raises(preflight.PreflightError,
                       match=r"needs about .* GiB of device memory \(cuda\) but 0.01 GiB is free; "
                             r"the largest part is (\w|[ -])+ \(.*\): lower it with --"):
        torch_engine.run_baseline(ModelSpec("t", _tiny(tmp_path)), 4096, 1, tmp_path / "b.kvd", ubatch=512,
                            device="cuda", dtype="bfloat16")
    assert not (tmp_path / "b.kvd").exists()


def test_too_small_host_is_a_cli_error(tmp_path, monkeypatch, capsys):
    from kvarn.weights import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded weights"))
    monkeypatch.setattr(preflight, "_host_available", lambda: 2**20)  # 1 MiB of RAM
    with pytest.raises(SystemExit) as e:
        cli.main(["baseline", "-m", _tiny(tmp_path), "-c", "65536", "--device", "cpu", "-o", str(tmp_path / "b")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "of host memory (RAM) but 0.00 GiB is free" in err and "lower it with --ctx" in err


def test_knob_names_the_largest_part():
    est = preflight.Estimate("cuda", {"weights": 10, "logits": 100}, {})
    with pytest.raises(preflight.PreflightError, match="largest part is logits .* --ubatch"):
        preflight.check(est, 50, 10**9)
    preflight.check(est, 10**6, 10**9)  # fits: no error


def test_device_memory_override_counts_other_workers_holdings(tmp_path, monkeypatch):
    """KVARN_DEVICE_MEMORY: the device has that many bytes, less what the other live workers of
    the run record as held (a held file whose socket is gone is not counted, nor our own)."""
    from kvarn.files import workerfiles as worker

    d = tmp_path / "workers"
    d.mkdir()
    for name, held, live in (("a", 300, True), ("b", 50, False), ("own", 1000, True)):
        if live:
            (d / f"{name}.sock").touch()
        worker.held_path(d / f"{name}.sock").write_text(f"{held}\n")
    monkeypatch.setenv(worker.SOCKET_ENV, str(d / "own.sock"))
    monkeypatch.setenv(preflight.MEMORY_ENV, "1000")
    assert preflight.capacity("cpu") == (None, 700)
    dev, host = preflight.capacity("cuda:0")
    assert dev == 700 and host > 0
    monkeypatch.setenv(preflight.MEMORY_ENV, "1e9")
    with pytest.raises(ValueError, match=r"KVARN_DEVICE_MEMORY='1e9' .* bytes, a positive integer"):
        preflight.capacity("cpu")


def test_a_worker_records_what_it_holds(tmp_path, monkeypatch):
    from kvarn.files import workerfiles as worker

    est = preflight.Estimate("cpu", {}, {"weights": 1000})
    monkeypatch.delenv(worker.SOCKET_ENV, raising=False)
    preflight.record_held(est)  # not a worker: nothing written
    assert not list(tmp_path.glob("*"))
    monkeypatch.setenv(worker.SOCKET_ENV, str(tmp_path / "w.sock"))
    preflight.record_held(est)
    assert (tmp_path / "w.held").read_text() == f"{est.host_bytes}\n" and est.host_bytes == 1100


# ---- a context beyond the model's trained context ----------------------------------------

def _trained(tmp_path, n: int) -> str:
    """A tiny random llama whose config declares a trained context of n tokens."""
    cfg = tmp_path / "trained.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 300, "hidden_size": 256, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": n}))
    return f"random:{cfg}"


def test_a_context_beyond_the_trained_one_is_refused_naming_both_and_the_knob(tmp_path, monkeypatch, capsys):
    from kvarn.weights import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("loaded weights"))
    monkeypatch.setenv(preflight.LONG_CONTEXT_ENV, "0")  # restored afterwards, whatever the CLI sets
    m = _trained(tmp_path, 1024)
    for cmd, extras in ((["baseline", "-m", m, "-c", "2048", "-o", str(tmp_path / "b.kvd")], (["--dry-run"], [])),
                        (["run", "-m", m, "-c", "2048", "--k", "q4_0", "--v", "q4_0", "--baseline", "x",
                          "-o", str(tmp_path / "c")], (["--dry-run"],))):  # a real run: the engine's preflight, below
        for extra in extras:
            with pytest.raises(SystemExit) as e:
                cli.main(cmd + extra)
            err = capsys.readouterr().err
            assert e.value.code == 2, err
            assert ("n_ctx 2048 is beyond the model's trained context (max_position_embeddings 1024): lower --ctx "
                    "(n_ctx) to at most 1024, or pass --allow-long-context") in err, err
    # at the trained context exactly: accepted; beyond it with the override: accepted
    assert cli.main(["baseline", "-m", m, "-c", "1024", "-o", "unused", "--dry-run"]) == 0
    assert cli.main(["baseline", "-m", m, "-c", "2048", "-o", "unused", "--dry-run", "--allow-long-context"]) == 0
    assert "estimated peak memory" in capsys.readouterr().out
    assert not list(tmp_path.glob("b.kvd")) and not (tmp_path / "c").exists()


def test_the_engine_refuses_a_long_context_before_loading_unless_allowed(tmp_path, monkeypatch):
    """Any job (a workflow's cell or baseline goes through kvarn.run.torch_engine): refused before
    weights load; KVARN_ALLOW_LONG_CONTEXT=1 lets it through to the load."""
    from kvarn.run import torch_engine
    from kvarn.weights import models

    def loaded(*a, **k):
        raise RuntimeError("reached the load")

    monkeypatch.setattr(models, "load", loaded)
    spec = ModelSpec("t", _trained(tmp_path, 1024))
    monkeypatch.delenv(preflight.LONG_CONTEXT_ENV, raising=False)
    with pytest.raises(preflight.PreflightError, match=r"n_ctx 2048 is beyond .* \(max_position_embeddings 1024\)"):
        torch_engine.run_baseline(spec, 2048, 1, tmp_path / "b.kvd", device="cpu")
    monkeypatch.setenv(preflight.LONG_CONTEXT_ENV, "1")
    with pytest.raises(RuntimeError, match="reached the load"):
        torch_engine.run_baseline(spec, 2048, 1, tmp_path / "b.kvd", device="cpu")


def test_the_embedded_model_at_65536_is_refused(fetched, capsys):
    """The issue's command line: SmolLM2 was trained for 8192 tokens."""
    fetched("smollm2-135m")
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "-m", "smollm2-135m", "-c", "65536", "--k", "q4_0", "--v", "q4_0", "--baseline", "x",
                  "-o", "unused", "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "n_ctx 65536" in err and "max_position_embeddings 8192" in err, err


def test_the_attention_temporaries_by_hand():
    """ref path, exact and bf16-attn: masks 4·u·n, io heads·u·d·8, one block's K and V (fp32; under bf16-attn their
    rounded copies too), the block's scores and softmax in fp32 (bf16-attn: numerators too)."""
    u, n, heads, kv, d = 8, 64, 4, 2, 16
    qb = preflight.QUERY_BLOCK
    masks, io = 4 * u * n, heads * u * d * 8
    assert preflight.attention_temporaries("ref", None, u, n, heads, kv, d) == \
        masks + 2 * kv * n * d * 4 + 2 * heads * qb * n * 4 + io
    assert preflight.attention_temporaries("ref", "bfloat16", u, n, heads, kv, d) == \
        masks + 2 * kv * n * d * 4 * 2 + 3 * heads * qb * n * 4 + io


def test_a_config_object_s_trained_context_is_read():
    from transformers import LlamaConfig

    assert preflight.trained_context(LlamaConfig(max_position_embeddings=1234)) == 1234
    assert preflight.trained_context({"max_position_embeddings": 77}) == 77


def test_the_attention_path_is_picked_on_the_device_type_of_an_indexed_device(tmp_path, monkeypatch):
    """"auto" on "cuda:1" is flex (the device type, not the string); llamacpp-cpu gathers as ref does."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 300, "hidden_size": 128, "intermediate_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "head_dim": 64, "max_position_embeddings": 512}))
    seen = []
    real = preflight.estimate
    monkeypatch.setattr(preflight, "estimate", lambda *a, **k: seen.append(k["attention"]) or real(*a, **k))
    for compute in ("tf32-attn", "llamacpp-cpu"):
        preflight.preflight(ModelSpec("t", f"random:{cfg}"), 256, 64, "cuda:1", "bfloat16", tmp_path, baseline=False,
                            dry_run=True, compute=compute)
    assert seen == ["flex", "ref"]
