"""Which cells of a llama.cpp-engine matrix fit a GPU of a given memory, before any download.

Per cell: the GGUF's bytes (the file's size; or given, for a file not downloaded yet) + the KV
cache under the model's memory accounting (kvarn.budget.memory: `beellama-qwen` / `beellama-gemma`
are the program's own allocation, which reproduce every MiB the study printed) + a reserve for the
program's compute and output buffers (an assumption, stated in the table: llama.cpp sizes them at
context creation; 1.5 GiB by default at micro-batch 512). A cell fits when the sum is at most the
device's memory.

    python -m kvarn.plan.fit config/study-program.yaml --device-gib 24 \\
        --geometry qwen3.6-27b-q5ks=config/models/qwen3.6-27b.json gemma4-31b-q5ks=config/models/gemma4-31b.json \\
        --weights-gib qwen3.6-27b-q5ks=<GiB of the file> gemma4-31b-q5ks=<GiB of the file>

(once the GGUFs are at the config's paths, their sizes and geometries are read from the files).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GIB = 2**30
DEFAULT_RESERVE_GIB = 1.5


def fit_rows(matrix, geometries: dict, weights_bytes: dict, device_bytes: int,
             reserve_bytes: int = int(DEFAULT_RESERVE_GIB * GIB)) -> list[dict]:
    """One row per llama.cpp-engine cell of `matrix` (kvarn.plan.matrix.Matrix): weights, KV, total, fits."""
    from kvarn.budget import memory

    rows = []
    for c in matrix.cells:
        m = matrix.models[c.model]
        if m.engine != "llama.cpp":
            continue
        for need, have in (("geometry", geometries), ("weights size", weights_bytes)):
            if c.model not in have:
                raise ValueError(f"model {c.model}: no {need} (give --{'geometry' if need == 'geometry' else 'weights-gib'} "
                                 f"{c.model}=...)")
        kv = memory.kv_bytes(geometries[c.model], c.n_ctx, c.spec, m.ubatch, m.memory_accounting).total
        total = weights_bytes[c.model] + kv + reserve_bytes
        rows.append({"model": c.model, "n_ctx": c.n_ctx, "cell": c.name, "accounting": m.memory_accounting,
                     "weights_bytes": weights_bytes[c.model], "kv_bytes": kv, "reserve_bytes": reserve_bytes,
                     "total_bytes": total, "fits": total <= device_bytes})
    return rows


def _pairs(items, what) -> dict:
    out = {}
    for it in items or ():
        name, sep, value = it.partition("=")
        if not sep:
            raise SystemExit(f"--{what}: {it!r}; write MODEL=VALUE")
        out[name] = value
    return out


def main(argv=None) -> int:
    import yaml

    from kvarn.plan import matrix as kvm
    from kvarn.vocab.geometry import config_object, geometry_from_config
    from kvarn.weights.sources import ModelSpec, config_json, gguf_path

    ap = argparse.ArgumentParser(prog="python -m kvarn.plan.fit", description=__doc__.splitlines()[0])
    ap.add_argument("config", type=Path, help="a matrix with llama.cpp-engine models, e.g. config/study-program.yaml")
    ap.add_argument("--device-gib", type=float, required=True, help="the GPU's memory, GiB (a 24 GB card: 24)")
    ap.add_argument("--geometry", nargs="*", help="MODEL=config.json for a GGUF not downloaded yet")
    ap.add_argument("--weights-gib", nargs="*", help="MODEL=GiB for a GGUF not downloaded yet")
    ap.add_argument("--reserve-gib", type=float, default=DEFAULT_RESERVE_GIB,
                    help=f"compute and output buffers (default {DEFAULT_RESERVE_GIB}, an assumption)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = ap.parse_args(argv)
    cfg = yaml.safe_load(a.config.read_text())
    matrix = kvm.expand(cfg)
    geoms = {k: geometry_from_config(config_object(json.loads(Path(v).read_text())))
             for k, v in _pairs(a.geometry, "geometry").items()}
    weights = {k: int(float(v) * GIB) for k, v in _pairs(a.weights_gib, "weights-gib").items()}
    cache = cfg.get("model_cache", "resources/models")
    for name, m in matrix.models.items():  # a GGUF that is here gives its own size and geometry
        spec = ModelSpec(name, m.source, m.revision)
        gguf = gguf_path(spec, cache)
        if gguf is None or not Path(gguf).is_file():
            continue
        weights.setdefault(name, Path(gguf).stat().st_size)
        if name not in geoms:
            geoms[name] = geometry_from_config(config_object(config_json(spec, cache)))
    rows = fit_rows(matrix, geoms, weights, int(a.device_gib * GIB), int(a.reserve_gib * GIB))
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"device {a.device_gib:g} GiB; reserve {a.reserve_gib:g} GiB for compute and output buffers (assumed)")
    print("| model | n_ctx | cell | KV MiB | weights GiB | total GiB | fits |\n|---|---:|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['model']} | {r['n_ctx']} | {r['cell']} | {r['kv_bytes'] / 2**20:.2f} | "
              f"{r['weights_bytes'] / GIB:.2f} | {r['total_bytes'] / GIB:.2f} | {'yes' if r['fits'] else 'NO'} |")
    n = sum(r["fits"] for r in rows)
    print(f"\n{n} of {len(rows)} cells fit.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
