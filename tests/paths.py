"""Where the tests find the repository's files and the shared Wikitext copy (one place)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO / "resources" / "models"
# The README's layout: shared/ beside the checkout (as CI lays it), not a machine-specific path.
WIKI_TEXT = (REPO / ".." / "shared" / "data" / "wikitext-2-raw-v1" / "wiki.test.raw").resolve()
