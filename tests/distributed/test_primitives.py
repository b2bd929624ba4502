"""distcore primitives on 4 gloo processes: mesh, placements, shard_tensor, reshard (also across meshes)."""

import pytest

from tests.distributed import primitives_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 4


MERGED_WORKER = "primitives_worker"  # its checks run in the session's merged 4-process launch (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launch):
    return module_results(merged_launch, MERGED_WORKER)


@pytest.mark.parametrize("check", list(primitives_worker.CHECKS))
def test_primitive(results, check):
    assert_check(results, check, nproc=NPROC)
