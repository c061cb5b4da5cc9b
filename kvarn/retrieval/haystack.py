"""What a retrieval prompt's haystack and needles are made of (torch-free): the filler sentences, the
Wikitext-2 validation sentences (checked against their size and sha256), the needles' keys and values
drawn from a prompt's generator, and the haystack's tokenized units and their boundaries after the
cut. The task families' templates and prompt assembly are `kvarn.retrieval.tasks`'.

The Wikitext haystack: the split's paragraphs cut into sentences (units), taken in order from a
seeded random sentence, cut at the front like the filler.
"""

from __future__ import annotations

import functools
import hashlib
import re
import uuid
from pathlib import Path

import numpy as np

FILLER = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.",
          " There and back again.")
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")
ADJECTIVES = ("amber", "bold", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
              "lunar", "misty", "noble", "olive", "proud", "quiet", "rapid", "silver", "tidy", "urban", "vivid",
              "wild", "young", "zesty", "brisk", "cosy", "deep", "early", "fresh")
NOUNS = ("falcon", "river", "maple", "harbor", "lantern", "meadow", "pebble", "canyon", "violin", "garden",
         "comet", "forest", "island", "saddle", "tunnel", "willow", "anchor", "barrel", "candle", "dragon",
         "engine", "feather", "glacier", "hammer", "jacket", "kettle", "ladder", "mirror", "needle", "orchard")

# the haystack of each RULER task: "noise" (FILLER repeated) or "wiki" (Wikitext-2 validation sentences)
HAYSTACK = {"niah_single_1": "noise", "vt": "noise"}
# Wikitext-2 validation (wiki.valid.raw), read torch-free here; the same bytes and sha256 as
# kvarn.baseline.data's verified loader checks (a test holds the two equal)
WIKI_PATH = "../shared/data/wikitext-2-raw-v1/wiki.valid.raw"
WIKI_BYTES = 1_146_846
WIKI_SHA256 = "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7"


@functools.lru_cache(maxsize=2)
def wiki_sentences(path: str = WIKI_PATH) -> tuple[str, ...]:
    """The sentences of Wikitext-2 validation's paragraphs (headings and blank lines dropped), each
    " sentence ." as the raw file spells it; the file is checked against its size and sha256."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"retrieval haystack {path!r} does not exist: the Wikitext-2 tasks read "
                                f"wiki.valid.raw from ../shared/data/wikitext-2-raw-v1 (README)")
    data = p.read_bytes()
    if len(data) != WIKI_BYTES or hashlib.sha256(data).hexdigest() != WIKI_SHA256:
        raise ValueError(f"{path} is not the original wikitext-2-raw-v1 wiki.valid.raw ({len(data):,} bytes; "
                         f"expected {WIKI_BYTES:,} bytes, sha256 {WIKI_SHA256})")
    out = []
    for line in data.decode("utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        out += [" " + x.strip() for x in re.split(r"(?<= \.) ", line) if x.strip()]
    return tuple(out)


def _uuid(rng) -> str:
    return str(uuid.UUID(bytes=bytes(int(b) for b in rng.integers(0, 256, size=16)), version=4))


def words(rng, n: int) -> list[str]:
    """n distinct two-word keys (`amber-falcon`, ADJECTIVES x NOUNS) drawn from `rng`."""
    pairs = rng.choice(len(ADJECTIVES) * len(NOUNS), size=n, replace=False)
    return [f"{ADJECTIVES[q // len(NOUNS)]}-{NOUNS[q % len(NOUNS)]}" for q in pairs]


def draw_values(rng, kind: str, n: int) -> list[str]:
    """n distinct needle values from `rng`: UUIDs, or 7-digit numbers (1,000,000 .. 9,999,999)."""
    if kind == "uuid":
        return [_uuid(rng) for _ in range(n)]
    return [str(v) for v in rng.choice(np.arange(1_000_000, 10_000_000), size=n, replace=False)]


def haystack_units(enc, task: str, rng, need: int) -> list[list[int]]:
    """Tokenized haystack units, at least `need` tokens: the filler from a seeded sentence, or
    Wikitext-2 sentences in order from a seeded sentence (wrapping around)."""
    units: list[list[int]] = []
    total = 0
    if HAYSTACK.get(task, "wiki") == "noise":
        i = int(rng.integers(len(FILLER)))
        source = lambda j: FILLER[j % len(FILLER)]  # noqa: E731
    else:
        sentences = wiki_sentences()
        i = int(rng.integers(len(sentences)))
        source = lambda j: sentences[j % len(sentences)]  # noqa: E731
    while total < need:
        units.append(enc(source(i)))
        i += 1
        total += len(units[-1])
    return units


def boundaries(units: list[list[int]], cut: int) -> list[int]:
    """Unit boundaries of the stream cut by `cut` tokens at its front, as offsets into the cut stream."""
    out, pos = [0], 0
    for u in units:
        pos += len(u)
        if pos - cut > 0:
            out.append(pos - cut)
    return out

