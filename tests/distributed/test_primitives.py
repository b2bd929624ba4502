"""distcore primitives on 4 gloo processes: mesh, placements, shard_tensor, reshard (also across meshes)."""

import pytest

from tests.distributed import primitives_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 4


MERGED = {"primitives_worker": {NPROC: None}}  # its checks run in the session's merged launch of NPROC (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "primitives_worker")


@pytest.mark.parametrize("check", list(primitives_worker.CHECKS))
def test_primitive(results, check):
    assert_check(results, check, nproc=NPROC)
