"""distcore primitives on 4 gloo processes: mesh, placements, shard_tensor, reshard (also across meshes)."""

import pytest

from tests.distributed import primitives_worker
from tests.distributed.harness import assert_check, launch

NPROC = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("tests.distributed.primitives_worker", nproc=NPROC, out_dir=tmp_path_factory.mktemp("primitives"))


@pytest.mark.parametrize("check", list(primitives_worker.CHECKS))
def test_primitive(results, check):
    assert_check(results, check, nproc=NPROC)
