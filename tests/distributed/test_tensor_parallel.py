"""parallelize's tensor parallelism (and 2-D with data parallel) on 4 gloo processes vs one process."""

import pytest

from tests.distributed import tensor_parallel_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 4


MERGED = {"tensor_parallel_worker": {NPROC: None}}  # its checks run in the session's merged launch of NPROC (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "tensor_parallel_worker")


@pytest.mark.parametrize("check", list(tensor_parallel_worker.CHECKS))
def test_tensor_parallel(results, check):
    assert_check(results, check, nproc=NPROC)
