"""parallelize's pipeline parallelism (alone and with dp and mp) on 4 gloo processes vs one process."""

import pytest

from tests.distributed import pipeline_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 4


MERGED = {"pipeline_worker": {NPROC: None}}  # its checks run in the session's merged launch of NPROC (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "pipeline_worker")


@pytest.mark.parametrize("check", list(pipeline_worker.CHECKS))
def test_pipeline(results, check):
    assert_check(results, check, nproc=NPROC)
