"""kernels.linear_cross_entropy vocabulary-parallel on 2 gloo processes (a DTensor head split on its rows):
loss and gradients equal to the single-device op, in the kernels and the CPU path; layouts it cannot use
are errors. Its use by to_distributed under tp: transformers_worker.py's matrix (fused kernels on)."""

import pytest

from tests.distributed import linear_cross_entropy_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 2


MERGED = {"linear_cross_entropy_worker": {NPROC: None}}  # its checks run in the session's merged launch of NPROC (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "linear_cross_entropy_worker")


@pytest.mark.parametrize("check", list(linear_cross_entropy_worker.CHECKS))
def test_linear_cross_entropy_vocabulary_parallel(results, check):
    assert_check(results, check, nproc=NPROC)
