"""parallelize's tensor parallelism (and 2-D with data parallel) on 4 gloo processes vs one process."""

import pytest

from tests.distributed import tensor_parallel_worker
from tests.distributed.harness import assert_check, launch

NPROC = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("tests.distributed.tensor_parallel_worker", nproc=NPROC, out_dir=tmp_path_factory.mktemp("tensor_parallel"))


@pytest.mark.parametrize("check", list(tensor_parallel_worker.CHECKS))
def test_tensor_parallel(results, check):
    assert_check(results, check, nproc=NPROC)
