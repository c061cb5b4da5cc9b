"""What a run loads before its first chunk: the model with the cache model's attention, the text cut into
chunks and the identity every dump and cell carries (`setup`), kept for many cells of one job (`Context`,
held by `kvarn.run.worker`), taken from a context or loaded now after the preflight (`load_job`); and the
compute path's activation rounding switched per run (`set_compute`). No polars: the GPU device run
imports it on a machine without. Why: docs/notes/engine.md, docs/notes/scale.md.
"""

from __future__ import annotations

from pathlib import Path

import kvarn.kvcache.attention as kattn
from kvarn.baseline import data, dump
from kvarn.budget.preflight import preflight
from kvarn.files import identity
from kvarn.files.identity import job_key
from kvarn.llamacpp_cpu.activations import set_activation_rounding
from kvarn.vocab import scoring
from kvarn.vocab.options import LLAMACPP_CPU
from kvarn.weights import models, sources
from kvarn.weights.sources import DEFAULT_CACHE_DIR


def set_compute(model, spec, cache_dir, compute: str) -> None:
    """Switch the model's weight-matmul activation rounding for this run's compute path.

    With llamacpp-cpu and GGUF weights every Linear's input is rounded as llama.cpp rounds
    activations for that weight's type (`kvarn.llamacpp_cpu.activations.set_activation_rounding`); exact
    and bf16-attn (whose rounding is the attention's only) switch it off. Set at the start of every run, because a `Context` model serves many.
    """
    cpu = compute == LLAMACPP_CPU
    set_activation_rounding(model, sources.gguf_path(spec, cache_dir) if cpu else None, cpu)


def setup(spec, n_ctx, chunks, text, device, dtype, cache_dir):
    """(loaded model, chunk tensor, identity fields): what every dump and cell starts from.

    The model in eval mode with the cache model's attention (`kvarn.kvcache.attention`), the text
    tokenized and cut into chunks (`kvarn.baseline.data`), and the identity fields every dump and
    cell carries (`kvarn.files.identity`). No preflight: `Context` and the run functions make it."""
    loaded = models.load(spec, cache_dir=cache_dir, device=device, dtype=dtype)
    loaded.model.eval()
    loaded.model.set_attn_implementation(kattn.ATTN_NAME)
    raw = data.load_text(text)
    tokens = data.tokenize(loaded.tokenizer, raw)
    chunk_ids = data.make_chunks(tokens, n_ctx, chunks, loaded.info.bos_id)
    scoring.scored_positions(n_ctx)  # validates n_ctx (even, >= 4)
    ident = identity.run_identity(spec, loaded.info, data.text_sha256(raw), n_ctx, int(chunk_ids.shape[0]),
                                  kattn.ATTN_NAME)
    return loaded, chunk_ids, ident


class Context:
    """What one job loads before its first chunk, kept for many cells of the same
    (model, n_ctx, chunks, text, device, dtype): the model, the chunk tensor, the identity
    and every baseline dump opened so far (its checksums verified once, on first read).

    `kvarn.run.worker` holds one per process; `run_cell(..., context=)` and
    `run_baseline(..., context=)` use it instead of loading, after checking that it was
    made from the same arguments (a different model, text, ... is refused, never served).
    """

    def __init__(self, spec, n_ctx, chunks, text=None, device="auto", dtype="auto", cache_dir=DEFAULT_CACHE_DIR,
                 ubatch=512, baseline=False):
        self.key = job_key(spec, n_ctx, chunks, text, device, dtype, cache_dir)
        preflight(spec, n_ctx, ubatch, device, dtype, cache_dir, baseline=baseline)  # before any weights load
        self.loaded, self.chunk_ids, self.ident = setup(spec, n_ctx, chunks, text, device, dtype, cache_dir)
        self._dumps: dict = {}

    def for_job(self, spec, n_ctx, chunks, text, device, dtype, cache_dir):
        """(loaded model, chunk ids, identity) for a job of these arguments; another job's are refused."""
        want = job_key(spec, n_ctx, chunks, text, device, dtype, cache_dir)
        diff = [f"{k}: loaded {self.key[k]!r}, requested {want[k]!r}" for k in want if want[k] != self.key[k]]
        if diff:
            raise ValueError("this kvarn.run.load.Context was loaded for another job; " + "; ".join(diff))
        return self.loaded, self.chunk_ids, self.ident

    def open_dump(self, path):
        """dump.open_dump, once per (file, size, mtime): a rewritten file is opened (and verified) anew."""
        if not Path(path).is_file():
            return dump.open_dump(path)  # raises its own named error
        st = Path(path).stat()
        key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
        if key not in self._dumps:
            self._dumps[key] = dump.open_dump(path)
        return self._dumps[key]


def load_job(context, spec, n_ctx, chunks, text, device, dtype, cache_dir, ubatch, baseline, attention="auto",
            compute="exact"):
    """(loaded model, chunk ids, identity): from `context` if given (checked), else loaded now."""
    if context is None:
        preflight(spec, n_ctx, ubatch, device, dtype, cache_dir, baseline=baseline, attention=attention,
                  compute=compute)  # before any weights load
        return setup(spec, n_ctx, chunks, text, device, dtype, cache_dir)
    return context.for_job(spec, n_ctx, chunks, text, device, dtype, cache_dir)
