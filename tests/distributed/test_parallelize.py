"""parallelize's data parallelism (sharding levels 0-3) on 4 gloo processes: losses and parameters
equal a single-process run of the seed model on the same global batches."""

import pytest

from tests.distributed import parallelize_worker
from tests.distributed.harness import assert_check, module_results

NPROC = parallelize_worker.WORLD


MERGED = {"parallelize_worker": {NPROC: None}}  # its checks run in the session's merged launch of NPROC (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "parallelize_worker")


@pytest.mark.parametrize("check", list(parallelize_worker.CHECKS))
def test_parallelize(results, check):
    assert_check(results, check, nproc=NPROC)
