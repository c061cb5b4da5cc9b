"""kvarn.baseline.data: the text, its rebuild from hub rows, chunks and scored positions."""

import sys
import types

import pytest
import torch

from kvarn.vocab import scoring

from kvarn.baseline import data
from paths import WIKI_TEXT

WIKI = WIKI_TEXT


def hub_rows(text: str) -> list[str]:
    """What the hub loader makes of a raw file: one row per line, blank lines empty."""
    lines = text.splitlines(keepends=True)
    return ["" if line == " \n" else line for line in lines]


def test_rebuild_raw_synthetic():
    raw = " \n = Title = \n \n Body text . \n \n \n"
    rows = hub_rows(raw)
    assert rows == ["", " = Title = \n", "", " Body text . \n", "", ""]
    assert data.rebuild_raw(rows) == raw
    assert data.rebuild_raw([]) == ""


def test_check_wiki_test_names_source_and_expectation():
    with pytest.raises(ValueError, match=r"my-source.*5 bytes.*1,290,590 bytes"):
        data.check_wiki_test("hello", "my-source")


def test_text_sha256():
    assert data.text_sha256("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_load_text_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.raw"):
        data.load_text(tmp_path / "nope.raw")


def test_load_text_wrong_file(tmp_path):
    p = tmp_path / "wiki.test.raw"
    p.write_text(" \n = A = \n")
    with pytest.raises(ValueError, match="not the original"):
        data.load_text(p)
    assert data.load_text(p, verify=False) == " \n = A = \n"


@pytest.mark.skipif(not WIKI.is_file(), reason="shared wikitext copy not present")
def test_load_text_file_and_hub_rebuild(monkeypatch):
    text = data.load_text(WIKI)
    assert data.text_sha256(text) == data.WIKI_TEST_SHA256
    # The hub path, with `datasets` replaced by rows made the way the hub loader makes them.
    rows = hub_rows(text)
    assert len(rows) == 4358 and rows.count("") == 1467
    fake = types.ModuleType("datasets")
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return {"text": rows}

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert data.load_text(None) == text
    assert calls == [("Salesforce/wikitext", "wikitext-2-raw-v1", "test")]
    # Joining the rows without the rebuild is the known wrong answer, and is refused.
    fake.load_dataset = lambda *a, **k: {"text": [r for r in rows if r]}
    with pytest.raises(ValueError, match="1,287,656 bytes"):
        data.load_text(None)


def test_make_chunks_known_sequence():
    tokens = torch.arange(100, 123)  # 23 tokens
    c = data.make_chunks(tokens, 8, None, None)
    assert c.tolist() == [list(range(100, 108)), list(range(108, 116))]  # 7 dropped
    c = data.make_chunks(tokens, 8, 1, bos_id=1)
    assert c.tolist() == [[1, 101, 102, 103, 104, 105, 106, 107]]
    assert tokens[0] == 100  # input untouched
    assert data.make_chunks(tokens, 8, -1, 5)[:, 0].tolist() == [5, 5]


def test_make_chunks_errors():
    tokens = torch.arange(20)
    with pytest.raises(ValueError, match=r"20 tokens make 2 chunk\(s\) of n_ctx=8, but 3"):
        data.make_chunks(tokens, 8, 3, None)
    with pytest.raises(ValueError, match="0 chunk"):
        data.make_chunks(tokens, 32, None, None)
    with pytest.raises(ValueError, match="chunks"):
        data.make_chunks(tokens, 8, 0, None)


def test_scored_positions():
    assert scoring.scored_positions(8) == range(4, 7)
    assert len(scoring.scored_positions(512)) == 512 - 1 - 256
    for bad in (7, 2, 0, -4, 8.0):
        with pytest.raises(ValueError, match="n_ctx"):
            scoring.scored_positions(bad)


class _Tok:
    """A tokenizer stand-in: one id per character, optional BOS."""

    def __init__(self, bos):
        self.bos = bos

    def __call__(self, text, add_special_tokens=True, verbose=True):
        ids = [ord(c) for c in text]
        if add_special_tokens and self.bos is not None:
            ids = [self.bos] + ids
        return {"input_ids": ids}


def test_tokenize_adds_special_tokens_like_the_tokenizer():
    assert data.tokenize(_Tok(None), "ab").tolist() == [97, 98]
    t = data.tokenize(_Tok(2), "ab")
    assert t.tolist() == [2, 97, 98] and t.dtype == torch.long
