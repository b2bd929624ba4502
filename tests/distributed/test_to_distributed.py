"""to_distributed end to end on 1, 2 and 4 gloo processes: losses equal one device."""

import pytest

from tests.distributed import to_distributed_worker
from tests.distributed.harness import assert_check, module_results


WORLDS = (1, 2, 4)
MERGED = {"to_distributed_worker": {nproc: None for nproc in WORLDS}}  # the session's merged launches (conftest.py)


@pytest.fixture(scope="module", params=WORLDS)
def world(request, merged_launches):
    return request.param, module_results(merged_launches[request.param], "to_distributed_worker")


@pytest.mark.parametrize("check", list(to_distributed_worker.CHECKS))
def test_to_distributed(world, check):
    nproc, results = world
    assert_check(results, check, nproc=nproc)
