"""Rule fetch_model: download/convert one model into the cache (kvarn.models.fetch) and verify it."""

import time
from pathlib import Path

from _wf import model_spec, start, write_json

start(snakemake)  # noqa: F821
from kvarn.models import fetch  # noqa: E402

marker = Path(snakemake.output.marker)  # noqa: F821
spec = model_spec(snakemake)  # noqa: F821
t0 = time.time()
path = Path(fetch(spec, cache_dir=marker.parent))
files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
if not files:
    raise RuntimeError(f"kvarn.models.fetch({spec}) returned {path}, which holds no files")
print(f"fetched {spec} -> {path} in {time.time() - t0:.1f}s")
write_json(marker, {
    "name": spec.name, "source": spec.source, "revision": spec.revision, "path": str(path),
    "files": {str(p.relative_to(path) if p != path else p.name): p.stat().st_size for p in files},
})
