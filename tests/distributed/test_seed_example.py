"""The seeds' 8-device examples (the notes' hybrid example; parallelize's dp x mp x pp) on 8 gloo processes vs one process."""

import pytest

from tests.distributed import seed_example_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 8


MERGED_WORKER = "seed_example_worker"  # its checks run in the session's merged 4-process launch (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launch):
    return module_results(merged_launch, MERGED_WORKER)


@pytest.mark.parametrize("check", list(seed_example_worker.CHECKS))
def test_seed_example(results, check):
    assert_check(results, check, nproc=NPROC)
