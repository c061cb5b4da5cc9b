"""Rule wikitext: wiki.test.raw from the configured path, else rebuilt from the hub; sha256-verified."""

from pathlib import Path

from _wf import atomic, start

start(snakemake)  # noqa: F821
from kvarn.data import load_text, text_sha256  # noqa: E402

source = snakemake.params.source  # noqa: F821
if source is not None and not Path(source).is_file():
    print(f"text: {source!r} does not exist; rebuilding wiki.test.raw from the Hugging Face hub")
    source = None
text = load_text(source)  # raises unless the bytes are the original file's
with atomic(snakemake.output[0]) as tmp:  # noqa: F821
    tmp.write_bytes(text.encode("utf-8"))
print(f"wiki.test.raw from {source or 'the hub'}: {len(text.encode()):,} bytes, sha256 {text_sha256(text)}")
