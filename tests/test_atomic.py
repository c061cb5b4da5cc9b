"""kvarn.files.atomic: a write either completes or leaves the old file and no temporary behind."""

import pytest

from kvarn.files.atomic import atomic_path, write_text


def test_write_creates_parents_and_replaces(tmp_path):
    target = tmp_path / "a" / "b.txt"
    write_text(target, "one")
    write_text(target, "two")
    assert target.read_text() == "two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["b.txt"]


def test_failed_write_keeps_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.txt"
    write_text(target, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
