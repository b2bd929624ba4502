"""Test setup: the Triton kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels, i.e. before `tridist.kernels`
is imported anywhere, so it is set here at conftest import time.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tridist.kernels import _common  # noqa: E402


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    """Run a test twice: on the Triton kernels (interpreted) and on the CPU PyTorch implementation."""
    monkeypatch.setattr(_common, "TRITON_INTERPRET", request.param == "triton")
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
