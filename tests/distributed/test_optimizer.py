"""shard_optimizer on 4 gloo processes: Paddle's dialect, ZeRO-1, states of tensor-parallel parameters."""

import pytest

from tests.distributed import optimizer_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 4


MERGED = {"optimizer_worker": {NPROC: None}}  # its checks run in the session's merged launch of NPROC (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "optimizer_worker")


@pytest.mark.parametrize("check", list(optimizer_worker.CHECKS))
def test_optimizer(results, check):
    assert_check(results, check, nproc=NPROC)
