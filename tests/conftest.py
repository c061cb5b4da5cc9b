"""Shared test set-up.

Triton reads TRITON_INTERPRET when it is first imported: without a GPU its kernels can
only run under the interpreter, so set it before any test module imports triton.

`make test` runs the suite on pytest-xdist workers (`-n 2 --dist loadgroup`): each worker
takes its share of the cores for torch's intra-op threads, a module whose tests share an
expensive module- or session-scoped fixture (a real model loaded, a workflow run) names an
`xdist_group` so that fixture is built on one worker only. xdist hands out work units (a group,
or one ungrouped test) by their number of tests, most first (pytest-xdist 3.8's default
`--loadscope-reorder`; units of one test keep their collection order): the groups of several tests
first, then the rest in collection order, which `pytest_collection_modifyitems` below sorts so
that the modules with a test marked `slow` (a real model loaded, a snakemake run) come first and
the run ends on short tests that fill both workers.
`python tests/durlog.py <log>` shows how the two workers' ends fell in a run (tests/durlog.py).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Workers spawned by the workflow tests (kvarn.run.worker) outlive their snakemake run until
# they have been idle this long: short, so a finished test run leaves none behind for
# long, yet longer than the gap between two jobs of one run.
os.environ.setdefault("KVARN_WORKER_IDLE", "30")

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # One worker per share of the cores: intra-op threads beyond it only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    """The modules holding a test marked `slow` first, each kept whole (a module fixture is
    built once), the order otherwise unchanged: xdist hands out the ungrouped tests in this
    order (after the groups), the long ones early, which keeps the workers' ends close."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)


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
    from kvarn.weights import sources
    from paths import CACHE_DIR

    def get(name: str):
        sources.fetch(sources.ModelSpec(name, f"embedded:{name}"), CACHE_DIR)
        return CACHE_DIR / name

    return get
