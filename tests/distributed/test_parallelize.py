"""parallelize's data parallelism (sharding levels 0-3) on 4 gloo processes: losses and parameters
equal a single-process run of the seed model on the same global batches."""

import pytest

from tests.distributed import parallelize_worker
from tests.distributed.harness import assert_check, launch

NPROC = parallelize_worker.WORLD


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("tests.distributed.parallelize_worker", nproc=NPROC, out_dir=tmp_path_factory.mktemp("parallelize"))


@pytest.mark.parametrize("check", list(parallelize_worker.CHECKS))
def test_parallelize(results, check):
    assert_check(results, check, nproc=NPROC)
