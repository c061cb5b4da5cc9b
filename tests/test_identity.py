"""Baseline identity (kvarn.files.identity): every field that changes the logits is recorded in the
dump and checked by the cell; local weights are fingerprinted (cached beside each file).

Oracle for the end-to-end checks: a tiny random Llama saved as a local transformers
directory with the embedded SmolLM2 tokenizer (no download, a second per run).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from kvarn.vocab.cell import CellSpec
from kvarn.files import identity
from paths import WIKI_TEXT

# One xdist worker: the module fixture runs a tiny workflow once.
pytestmark = pytest.mark.xdist_group("identity")

REPO = Path(__file__).resolve().parents[1]
SMOL_HF = REPO / "resources" / "models" / "smollm2-135m" / "hf"
TEXT = WIKI_TEXT


# --- the weights fingerprint -------------------------------------------------------

def test_weights_id_of_a_directory_tracks_content(tmp_path, monkeypatch):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\x01" * 1000)
    calls = []
    real = identity.uncached_sha256
    monkeypatch.setattr(identity, "uncached_sha256", lambda p: calls.append(p.name) or real(p))
    a = identity.weights_id(str(d), None, False)
    assert sorted(calls) == ["config.json", "model.safetensors"]
    # cached beside each file: a second look hashes nothing and gives the same id
    assert (d / ("model.safetensors" + identity.SIDECAR_SUFFIX)).is_file()
    calls.clear()
    assert identity.weights_id(str(d), None, False) == a and calls == []
    # a changed file (same size, new mtime) is rehashed and changes the id
    (d / "model.safetensors").write_bytes(b"\x02" * 1000)
    st = (d / "model.safetensors").stat()
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    b = identity.weights_id(str(d), None, False)
    assert calls == ["model.safetensors"] and b != a and b.startswith("sha256:")


def test_weights_id_of_a_gguf_file_and_pinned_sources(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    import hashlib

    from kvarn.weights.sources import kind_of

    def wid(source, revision):  # as run_identity asks: the source's handler says whether it is content-pinned
        return identity.weights_id(source, revision, kind_of(source).content_pinned)

    assert wid(str(f), None) == "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
    assert wid("embedded:smollm2-135m", "sha256:ab") == "embedded:smollm2-135m@sha256:ab"
    assert wid("hf:org/repo", "c0ffee") == "hf:org/repo@c0ffee"
    cfg = tmp_path / "c.json"
    cfg.write_text("{}")
    assert wid(f"random:{cfg}", "random:sha256:0:seed0") == f"random:{cfg}@random:sha256:0:seed0"


def test_read_only_directory_still_hashes(tmp_path, monkeypatch):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")

    def refuse(*a, **k):
        raise PermissionError("read-only")
    monkeypatch.setattr("kvarn.files.atomic.write_text", refuse)
    import hashlib

    assert identity.file_sha256(f) == hashlib.sha256(b"abc").hexdigest()


def test_check_baseline_names_field_values_and_command():
    header = {"model": "m", "dtype": "bfloat16", "device_class": "cuda"}
    ident = {"model": "m", "dtype": "float32", "device_class": "cpu"}
    with pytest.raises(ValueError) as e:
        identity.check_baseline(header, ident, "b.kvd", "kvarn baseline --model X --out b.kvd")
    msg = str(e.value)
    assert "dtype" in msg and "'bfloat16'" in msg and "'float32'" in msg and "kvarn baseline --model X" in msg
    # an old dump without the new fields is refused as well
    with pytest.raises(ValueError, match="device_class is '<missing>'"):
        identity.check_baseline({"model": "m", "dtype": "float32"}, ident, "b.kvd", "cmd")
    identity.check_baseline(dict(ident), ident, "b.kvd", "cmd")  # equal: accepted


# --- end to end through the engine ---------------------------------------------------

def _tiny_dir(path: Path, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOL_HF / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, fetched):
    fetched("smollm2-135m")  # its tokenizer serves the tiny model
    if not TEXT.is_file():
        pytest.skip("needs wiki.test.raw")
    from kvarn.baseline import data
    from kvarn.run import torch_engine
    from kvarn.weights.sources import ModelSpec

    # 2 chunks of 32 tokens need only the head of the (verified) test split: the baseline and
    # every cell of the module tokenize it, not 1.3 MB each (its sha256 is the head's in both).
    load_text = data.load_text
    mp = pytest.MonkeyPatch()
    mp.setattr(data, "load_text", lambda *a, **k: load_text(*a, **k)[:20000])
    tmp_path = tmp_path_factory.mktemp("identity")
    text = TEXT
    d = _tiny_dir(tmp_path / "tiny", 0)
    spec = ModelSpec("tiny", str(d))
    base = tmp_path / "base.kvd"
    kw = dict(text=str(text), device="cpu", cache_dir=str(tmp_path / "cache"))
    h = torch_engine.run_baseline(spec, 32, 2, base, **kw)
    yield torch_engine, spec, base, kw, h, d, tmp_path
    mp.undo()


def _cell(torch_engine, spec, base, kw, out, **over):
    return torch_engine.run_cell(spec, 32, 2, CellSpec("q4_0", "q4_0", 0), base, out, **{**kw, **over})


def test_dump_carries_every_identity_field(tiny_run):
    from kvarn.baseline import dump

    torch_engine, spec, base, kw, h, d, tmp = tiny_run
    header = dump.open_dump(base).header
    for key in identity.FIELDS:
        assert key in header, key
    assert header["dtype"] == "float32" and header["device_class"] == "cpu"
    assert header["attn_implementation"] == "kvarn"
    assert header["torch_version"] == torch.__version__
    assert header["weights"].startswith("sha256:")
    s = _cell(torch_engine, spec, base, kw, tmp / "ok")
    assert s["n_tokens"] == 2 * (32 - 1 - 16)


def test_cell_refuses_other_dtype(tiny_run):
    torch_engine, spec, base, kw, h, d, tmp = tiny_run
    with pytest.raises(ValueError) as e:
        _cell(torch_engine, spec, base, kw, tmp / "bf", dtype="bfloat16")
    msg = str(e.value)
    assert "dtype is 'float32' in the baseline but 'bfloat16'" in msg and "kvarn baseline --model" in msg
    assert "--dtype bfloat16" in msg
    assert not (tmp / "bf").exists()


def test_cell_refuses_other_versions_and_device(tiny_run, monkeypatch):
    from kvarn.baseline import dump

    torch_engine, spec, base, kw, h, d, tmp = tiny_run
    real_open = dump.open_dump
    for key, fake in (("torch_version", "0.0.1"), ("transformers_version", "0.0.2"), ("device_class", "cuda"),
                      ("attn_implementation", "sdpa")):
        def fake_open(path, *a, _k=key, _v=fake, **k):
            d = real_open(path, *a, **k)
            d.header = {**d.header, _k: _v}
            return d
        monkeypatch.setattr(dump, "open_dump", fake_open)
        with pytest.raises(ValueError, match=rf"{key} is '{fake}' in the baseline"):
            _cell(torch_engine, spec, base, kw, tmp / key)
        assert not (tmp / key).exists()


def test_cell_refuses_changed_weights(tiny_run):
    torch_engine, spec, base, kw, h, d, tmp = tiny_run
    _tiny_dir(d, 1)  # same directory, other weights
    try:
        with pytest.raises(ValueError, match=r"weights is 'sha256:[0-9a-f]+' in the baseline but 'sha256:"):
            _cell(torch_engine, spec, base, kw, tmp / "w")
        assert not (tmp / "w").exists()
    finally:  # the fixture's weights back (seeded: the same bytes), so the module's other tests run in any order
        _tiny_dir(d, 0)


def test_the_run_s_own_fields_in_the_header_and_the_summary(tiny_run, monkeypatch):
    """run_baseline's header names the kvarn version and device, and its tokens/s is the tokens over the
    seconds timed around the forward alone (a stand-in for `timed` adding 0.25 s per slice: exactly);
    run_cell's wall time is within the call's, and a numpy scalar in its summary is written as its value."""
    import time

    import numpy as np

    import kvarn
    from kvarn.baseline import dump
    from kvarn.stats import metrics

    torch_engine, spec, base, kw, h, d, tmp = tiny_run
    header = dump.open_dump(base).header
    assert header["kvarn_version"] == h["kvarn_version"] == kvarn.__version__
    assert header["device"] == h["device"] == "cpu"
    slices = []

    def fake_timed(gen, timing, key="forward_s"):
        for item in gen:
            timing[key] += 0.25
            slices.append(item)
            yield item

    with monkeypatch.context() as m:
        m.setattr(torch_engine, "timed", fake_timed)
        h2 = torch_engine.run_baseline(spec, 32, 2, tmp / "timed.kvd", **kw)
    assert slices and h2["tokens_per_s"] == 2 * 32 / (0.25 * len(slices))

    summarize = metrics.summarize
    monkeypatch.setattr(metrics, "summarize", lambda frame: {**summarize(frame), "probe": np.float32(0.25)})
    t0 = time.perf_counter()
    s = _cell(torch_engine, spec, base, kw, tmp / "fields")
    elapsed = time.perf_counter() - t0
    assert 0 < s["wall_s"] <= elapsed
    assert json.loads((tmp / "fields" / "summary.json").read_text())["probe"] == 0.25
