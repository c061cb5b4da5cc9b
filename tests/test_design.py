"""docs/DESIGN.md is the numerics contract the code cites: every "DESIGN §N" citation in the
repository names a section (or a numbered item of §4) that exists, and nothing cites the
SPEC file that used to live outside the repository."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sections() -> set[str]:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    heads = set(re.findall(r"^## (\d+[a-z]?)\. ", text, flags=re.M))
    s4 = text.split("## 4. ", 1)[1].split("\n## ", 1)[0]
    items = {f"4.{n}" for n in re.findall(r"^(\d+)\. ", s4, flags=re.M)}
    return heads | items


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in out if p.endswith((".py", ".md", ".yaml", ".smk", ".rst", ".ipynb")) or p == "Snakefile"]


def test_every_design_citation_names_a_section():
    have = sections()
    assert {"1", "2", "3", "4", "5", "6", "6b", "7", "4.3", "4.6"} <= have
    bad = []
    for p in tracked():
        for ref in re.findall(r"DESIGN §(\d+[a-z]?(?:\.\d+)?)", p.read_text(errors="replace")):
            if ref not in have:
                bad.append(f"{p.relative_to(ROOT)}: DESIGN §{ref}")
    assert not bad, bad


def test_nothing_cites_the_external_spec():
    stale = [str(p.relative_to(ROOT)) for p in tracked()
             if re.search(r"SPEC §|SPEC\.md", p.read_text(errors="replace"))
             and p.name != "test_design.py"]
    assert not stale, stale
