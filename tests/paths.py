"""Where the tests find the repository's files and the shared Wikitext copy (one place)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO / "resources" / "models"
# The README's layout: shared/ beside the checkout (as CI lays it), not a machine-specific path.
WIKI_TEXT = (REPO / ".." / "shared" / "data" / "wikitext-2-raw-v1" / "wiki.test.raw").resolve()
# The engine's `text` argument: the shared copy when it is there, else None (kvarn rebuilds
# wiki.test.raw from the hub and checks its sha256).
ENGINE_TEXT = str(WIKI_TEXT) if WIKI_TEXT.is_file() else None
# The per-layer search's text (Wikitext-2 valid), beside it.
VALID_TEXT = WIKI_TEXT.with_name("wiki.valid.raw")
