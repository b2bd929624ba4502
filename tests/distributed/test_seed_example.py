"""The seeds' 8-device examples (the notes' hybrid example; parallelize's dp x mp x pp) on 8 gloo processes vs one process."""

import pytest

from tests.distributed import seed_example_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 8

# The session's merged launch of NPROC (conftest.py): its only module.
MERGED = {"seed_example_worker": {NPROC: None}}


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "seed_example_worker")


@pytest.mark.parametrize("check", list(seed_example_worker.CHECKS))
def test_seed_example(results, check):
    assert_check(results, check, nproc=NPROC)
