"""Bad inputs are refused before any work, naming the field, and write nothing (issue 12 item 8).

One list of cases over the four kinds of input: command-line values, baseline dumps,
model sources and matrix configs. "Before any work": downloading, converting, hashing
or loading a model is replaced by a trap that fails the test if reached; "nothing
written": the output path does not exist afterwards (and the scratch directory holds
only what the case itself put there).
"""

from __future__ import annotations

import copy
import struct

import pytest

from kvarn import cli

from kvarn.baseline import dump
from kvarn.plan import matrix as kvm

MODEL = "smollm2-135m"
CONFIG = {
    "models": [{"name": MODEL, "source": f"embedded:{MODEL}", "n_ctx": [512], "chunks": 2}],
    "cells": [{"types": ["q8_0", "q4_0"], "tail": [0, 128]}, {"types": ["kvarn4"], "tail": 0}],
}


def _config(path, value):
    cfg = copy.deepcopy(CONFIG)
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return cfg


def _run(*pairs):
    """`kvarn run` argv with (flag, value) pairs overriding a valid command line."""
    args = {"-m": MODEL, "-c": "64", "--k": "q4_0", "--v": "q4_0", "--baseline": "{base}", "-o": "{out}"}
    args.update(zip(pairs[::2], pairs[1::2]))
    return ["run"] + [x for kv in args.items() for x in kv]


# Baselines the dump cases point at (built in the scratch directory by `_make_dump`).
def _make_dump(kind, path):
    if kind == "valid":
        import torch

        header = {"model": MODEL, "revision": "r", "tokenizer_hash": "t", "text_sha256": "s", "n_ctx": 8}
        dump.write_dump(path, header, [torch.log_softmax(torch.randn(3, 10), -1)])
    elif kind == "garbage":
        path.write_bytes(b"definitely not a dump" * 10)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        _make_dump("valid", path)
        path.write_bytes(path.read_bytes()[:-40])
    elif kind == "version":
        _make_dump("valid", path)
        raw = bytearray(path.read_bytes())
        raw[8:12] = struct.pack("<I", 99)
        path.write_bytes(bytes(raw))


# (id, kind, input, what the message must name)
CASES = [
    # command-line values
    ("unknown K type", "cli", _run("--k", "q9_0"), "q9_0"),
    ("odd ctx", "cli", _run("-c", "255"), "--ctx"),
    ("ctx not a number", "cli", _run("-c", "abc"), "--ctx"),
    ("negative tail", "cli", _run("--tail", "-3"), "--tail"),
    ("tail >= ctx", "cli", _run("--tail", "64"), "--tail 64"),
    ("KVarN mixed", "cli", _run("--k", "kvarn4"), "kvarn4"),
    ("zero chunks", "cli", _run("--chunks", "0"), "--chunks"),
    ("negative chunks", "cli", _run("--chunks", "-5"), "--chunks"),
    ("zero ubatch", "cli", _run("--ubatch", "0"), "--ubatch"),
    ("zero iters", "cli", _run("--iters", "0"), "--iters"),
    ("tail dtype", "cli", _run("--tail-dtype", "f8"), "--tail-dtype"),
    ("compute dtype", "cli", _run("--dtype", "float8"), "--dtype"),
    ("device", "cli", _run("--device", "tpu"), "--device"),
    ("threads", "cli", _run("--threads", "0"), "--threads"),
    ("sink on KVarN", "cli", _run("--k", "kvarn4", "--v", "kvarn4", "--sink", "0"), "--sink 0"),
    ("negative sink", "cli", _run("--sink", "-1"), "--sink"),
    # baseline dumps
    ("missing dump", "dump:none", _run(), "--baseline"),
    ("not a dump", "dump:garbage", _run(), "not a kvarn dump"),
    ("empty dump", "dump:empty", _run(), "truncated"),
    ("truncated dump", "dump:truncated", _run(), "truncated"),
    ("dump file version", "dump:version", _run(), "file version 99"),
    # model sources
    ("unknown model name", "cli", ["baseline", "-m", "no-such-model", "-c", "64", "-o", "{out}"], "no-such-model"),
    ("hub source without org", "cli", ["fetch", "-m", "hf:justname"], "hf:justname"),
    ("unknown embedded", "cli", ["fetch", "-m", "embedded:nope"], "nope"),
    ("directory without config.json", "model:dir", ["fetch", "-m", "{tmp}/emptymodel"], "emptymodel"),
    # matrix configs
    ("config unknown type", "config", _config(("cells", 0, "types"), ["q8_0", "q9_9"]), "cells[0].types[1]"),
    ("config odd n_ctx", "config", _config(("models", 0, "n_ctx"), [511]), "models[0].n_ctx"),
    ("config tail >= n_ctx", "config", _config(("cells", 0, "tail"), 512), "cells[0].tail"),
    ("config tail dtype", "config", _config(("cells", 0, "tail_dtype"), "f8"), "cells[0].tail_dtype"),
    ("config chunks 0", "config", _config(("models", 0, "chunks"), 0), "models[0].chunks"),
    ("config dtype", "config", _config(("models", 0, "dtype"), "float8"), "models[0].dtype"),
    ("config rot", "config", _config(("cells", 0, "rot"), "yes"), "cells[0].rot"),
    ("config iters", "config", _config(("cells", 1, "iters"), 0), "cells[1].iters"),
    ("config KVarN sink", "config", _config(("cells", 1, "sink"), 64), "cells[1].sink"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Any download, conversion, weight hashing or model load fails the test."""
    from kvarn.files import identity
    from kvarn.weights import models
    from kvarn.weights.sources import embedded, hub

    def trap(*a, **k):
        raise AssertionError("work started before the bad input was refused")
    monkeypatch.setattr(models, "load", trap)
    monkeypatch.setattr(embedded, "_fetch_embedded", trap)
    monkeypatch.setattr(hub, "_fetch_hf", trap)
    monkeypatch.setattr(identity, "weights_id", trap)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_any_work(case, tmp_path, no_work, capsys):
    name, kind, given, needle = case
    out = tmp_path / "out"
    if kind == "config":
        with pytest.raises(kvm.MatrixError) as e:
            kvm.expand(given)
        msg = str(e.value)
        assert msg.startswith(needle), msg
    else:
        base = tmp_path / "base.kvd"
        if kind.startswith("dump:") and kind != "dump:none":
            _make_dump(kind.split(":")[1], base)
        if kind == "model:dir":
            (tmp_path / "emptymodel").mkdir()
        argv = [a.format(base=base, out=out, tmp=tmp_path) for a in given]
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        msg = capsys.readouterr().err
        assert e.value.code == 2, msg
        assert needle in msg, msg
    assert not out.exists()
    leftovers = {p.name for p in tmp_path.iterdir()} - {"base.kvd", "emptymodel"}
    assert not leftovers, leftovers


def test_the_list_is_long_enough():
    kinds = {c[1].split(":")[0] for c in CASES}
    assert len(CASES) >= 20 and kinds == {"cli", "dump", "model", "config"}
