"""parallelize's pipeline parallelism (alone and with dp and mp) on 4 gloo processes vs one process."""

import pytest

from tests.distributed import pipeline_worker
from tests.distributed.harness import assert_check, launch

NPROC = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("tests.distributed.pipeline_worker", nproc=NPROC, out_dir=tmp_path_factory.mktemp("pipeline"))


@pytest.mark.parametrize("check", list(pipeline_worker.CHECKS))
def test_pipeline(results, check):
    assert_check(results, check, nproc=NPROC)
