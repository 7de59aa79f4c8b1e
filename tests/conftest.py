"""Test setup: Triton runs in its interpreter when no GPU is present (must be set before any kernel
module is imported), a `gpu` marker that skips cleanly without CUDA, and a fixed seed per test."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# One intra-op thread: the tests run tiny models whose ops are overhead-bound; with 2 OpenMP threads a
# small matmul on a loaded 2-core machine was measured ~60x slower (18 ms vs 0.3 ms), and CI has 2 cores.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
