"""Shared test set-up: CPU runs Triton kernels in the interpreter; GPU tests skip without CUDA."""
import os

import torch

# The interpreter must be chosen before any @triton.jit kernel is defined, and only where there is
# no GPU: on a CUDA machine the same tests run the compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Engines in tests trace and compile as on a cold start (their stats say so) unless a test asks for
# the compile cache's graph store (tests/test_warm_start.py): a store shared across tests and runs
# would make a test's start-up depend on which tests ran before it.
os.environ.setdefault("INFER_GRAPHS_COMPILE_CACHE", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny ops on a shared 2-core machine: one intra-op thread avoids OpenMP wake-up stalls.
    Engine test modules take it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
