"""to_distributed end to end on 1, 2 and 4 gloo processes: losses equal one device."""

import pytest

from tests.distributed import to_distributed_worker
from tests.distributed.harness import MERGED_NPROC, assert_check, launch, module_results


MERGED_WORKER = "to_distributed_worker"  # on 4 processes: in the session's merged launch (conftest.py)


@pytest.fixture(scope="module", params=[1, 2, 4])
def world(request, tmp_path_factory):
    nproc = request.param
    if nproc == MERGED_NPROC:
        return nproc, module_results(request.getfixturevalue("merged_launch"), MERGED_WORKER)
    return nproc, launch("tests.distributed.to_distributed_worker", nproc=nproc, out_dir=tmp_path_factory.mktemp(f"to_distributed{nproc}"))


@pytest.mark.parametrize("check", list(to_distributed_worker.CHECKS))
def test_to_distributed(world, check):
    nproc, results = world
    assert_check(results, check, nproc=nproc)
