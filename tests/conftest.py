"""Test setup: the Triton kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels, i.e. before `tridist.kernels`
is imported anywhere, so it is set here at conftest import time.
"""

import gc
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# An xdist worker makes no collections while torch, transformers and the test modules import (~16% of an
# import's CPU time): its pytest_collection_finish collects once, freezes what they left and turns the
# collector back on. (xdist's controller collects nothing, so that hook never runs there.)
if "PYTEST_XDIST_WORKER" in os.environ:
    gc.disable()

import pytest  # noqa: E402

# torch and tridist are imported where used (hooks, fixtures, the tests): xdist's controller, which runs no
# test, loads this file too, and importing them there cost ~4 CPU-seconds of the suite.

# Under pytest-xdist the workers share the cores: each takes its part for torch's own threads, so that
# two workers on two cores do not run four threads that spin-wait for each other.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    """Run a test twice: on the Triton kernels (interpreted) and on the CPU PyTorch implementation."""
    from tridist.kernels import _common

    monkeypatch.setattr(_common, "TRITON_INTERPRET", request.param == "triton")
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)


def pytest_collection_finish(session):
    """Every module the tests import is loaded by now and lives until exit (tests.settle_garbage_collector)."""
    from tests import settle_garbage_collector

    settle_garbage_collector()
