"""shard_optimizer on 4 gloo processes: Paddle's dialect, ZeRO-1, states of tensor-parallel parameters."""

import pytest

from tests.distributed import optimizer_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 4


MERGED_WORKER = "optimizer_worker"  # its checks run in the session's merged 4-process launch (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launch):
    return module_results(merged_launch, MERGED_WORKER)


@pytest.mark.parametrize("check", list(optimizer_worker.CHECKS))
def test_optimizer(results, check):
    assert_check(results, check, nproc=NPROC)
