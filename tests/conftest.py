"""Shared test set-up.

Triton reads TRITON_INTERPRET when it is first imported: without a GPU its kernels can
only run under the interpreter, so set it before any test module imports triton.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Workers spawned by the workflow tests (kvarn.worker) outlive their snakemake run until
# they have been idle this long: short, so a finished test run leaves none behind for
# long, yet longer than the gap between two jobs of one run.
os.environ.setdefault("KVARN_WORKER_IDLE", "30")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add contention on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def fetched():
    """`fetched(name)`: the embedded model `name` fetched (verified, converted once) into the
    repository's model cache; returns its folder there (the GGUF and hf/). Tests that read
    those files take it rather than skip when no earlier test happened to fetch them."""
    from kvarn import sources
    from paths import CACHE_DIR

    def get(name: str):
        sources.fetch(sources.ModelSpec(name, f"embedded:{name}"), CACHE_DIR)
        return CACHE_DIR / name

    return get
