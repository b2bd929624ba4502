"""shard_optimizer on 4 gloo processes: Paddle's dialect, ZeRO-1, states of tensor-parallel parameters."""

import pytest

from tests.distributed import optimizer_worker
from tests.distributed.harness import assert_check, launch

NPROC = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("tests.distributed.optimizer_worker", nproc=NPROC, out_dir=tmp_path_factory.mktemp("optimizer"))


@pytest.mark.parametrize("check", list(optimizer_worker.CHECKS))
def test_optimizer(results, check):
    assert_check(results, check, nproc=NPROC)
