"""What the llama.cpp oracle scripts share (compare, fa_oracle, feed, sink; beellama/table reads
its logs with `parse_llama`): where llama.cpp's build and runs are, the C build of a bench
harness against it, llama-perplexity's log reader, and kvarn runs on the same tokens.

Environment (bench/oracles/llamacpp/README.md):
  LLAMACPP_DIR  the sdist, its build and the runs of perplexity.sh (default ~/.cache/kvarn-llamacpp,
                the same as perplexity.sh's)
  TEXT          wiki.test.raw (bench.TEXT)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from bench import REPO, TEXT

# Outside the repository (bench/oracles/llamacpp/perplexity.sh): the sdist, its build and the runs.
LLAMACPP_DIR = Path(os.environ.get("LLAMACPP_DIR", Path.home() / ".cache" / "kvarn-llamacpp"))
BIN = LLAMACPP_DIR / "build" / "bin" / "llama-perplexity"
CTX = {"smollm2-135m": 2048, "gemma3-270m": 4096}
PAT = {
    "kld_mean": r"Mean    KLD:\s+([-\d.]+)", "kld_mean_err": r"Mean    KLD:\s+[-\d.]+\s+±\s+([-\d.]+)",
    "kld_median": r"Median  KLD:\s+([-\d.]+)",
    "ppl_q": r"Mean PPL\(Q\)\s+:\s+([\d.]+)", "ppl_base": r"Mean PPL\(base\)\s+:\s+([\d.]+)",
    "same_top": r"Same top p:\s+([\d.]+)", "kld_p99": r"99\.0%   KLD:\s+([-\d.]+)",
}


def build_c(src: Path, exe: Path, libs: list[str]) -> Path:
    """Compile a bench C tool against the llama.cpp build's headers and `libs` (e.g. ["llama",
    "ggml"]), once: again only when `src` is newer than `exe` (outside the repo)."""
    if exe.is_file() and exe.stat().st_mtime >= src.stat().st_mtime:
        return exe
    root = next(LLAMACPP_DIR.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if root is None:
        raise SystemExit(f"no llama.cpp sources under LLAMACPP_DIR={LLAMACPP_DIR}: run "
                         "bench/oracles/llamacpp/perplexity.sh first, or set LLAMACPP_DIR to its folder")
    exe.parent.mkdir(parents=True, exist_ok=True)
    lib = LLAMACPP_DIR / "build" / "bin"
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(src), f"-I{root / 'include'}", f"-I{root / 'ggml' / 'include'}",
                    f"-L{lib}", *(f"-l{x}" for x in libs), "-lm", f"-Wl,-rpath,{lib}"], check=True)
    return exe


def parse_llama(log: Path) -> dict | None:
    if not log.is_file():
        return None
    text = log.read_text(errors="replace")
    out = {}
    for key, pat in PAT.items():
        m = re.search(pat, text)
        if m:
            out[key] = float(m.group(1)) / (100 if key == "same_top" else 1)
    m = re.search(r"Final estimate: PPL = ([\d.]+)", text)
    if m:
        out["ppl_base"] = float(m.group(1))
    running = [float(x) for x in CHUNK_LINE.findall(text)]
    if running:
        out["kld_chunk_means"] = chunk_means(running)
    return out or None


# a --kl-divergence chunk line: chunk, PPL(Q) ±, ln(PPL(Q)/PPL(base)) ±, KLD ±, Δp RMS ± %, same top ± %;
# its KLD is the running mean over the chunks so far
CHUNK_LINE = re.compile(r"^\s*\d+\s+[-\d.]+ ±\s+[-\d.]+\s+[-\d.]+ ±\s+[-\d.]+\s+([-\d.]+) ±", re.M)


def chunk_means(running: list[float]) -> list[float]:
    """Each chunk's own mean from llama-perplexity's running means (every chunk scores the same
    number of tokens): chunk i's is i·r_i − (i−1)·r_(i−1). The log prints 5 decimals, so a
    derived mean is good to ~(2i−1)·5e-6."""
    return [(i + 1) * r - i * (running[i - 1] if i else 0.0) for i, r in enumerate(running)]


def run_dir(model: str, chunks: int | None = None) -> Path:
    pat = f"ctx{CTX[model]}-c{chunks}" if chunks else f"ctx{CTX[model]}-c*"
    hits = sorted((LLAMACPP_DIR / "runs" / model).glob(pat), key=lambda p: int(p.name.split("-c")[-1]))
    if not hits:
        raise SystemExit(f"no llama-perplexity runs for {model} under {LLAMACPP_DIR}/runs: run bench/oracles/llamacpp/perplexity.sh {model}")
    return hits[-1]


def kvarn_baseline(model, n_ctx, chunks, mode, out: Path, llama_out: Path | None):
    from kvarn.run import torch_engine
    from kvarn.weights.sources import parse_model

    if not out.is_file():
        torch_engine.run_baseline(parse_model(model), n_ctx, chunks, out, text=str(TEXT), compute=mode,
                            cache_dir=str(REPO / "resources" / "models"), llama_kld_out=llama_out)
    return out


def kvarn_cell(model, n_ctx, chunks, k, rot, mode, baseline: Path, out: Path) -> dict:
    from kvarn.run import torch_engine
    from kvarn.vocab.cell import CellSpec
    from kvarn.weights.sources import parse_model

    if not (out / "summary.json").is_file():
        torch_engine.run_cell(parse_model(model), n_ctx, chunks, CellSpec(k, k, 0, rot=rot, compute=mode), baseline, out,
                        text=str(TEXT), cache_dir=str(REPO / "resources" / "models"))
    return json.loads((out / "summary.json").read_text())


def fmt(x, nd=6):
    return "—" if x is None else f"{x:.{nd}f}"
