"""Multi-node launch: two torchrun agents (simulated nodes) with a c10d rendezvous, 2 processes each."""

import pytest

from tests.distributed import multinode_worker
from tests.distributed.harness import assert_check, launch


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("tests.distributed.multinode_worker", nproc=2, nnodes=2, out_dir=tmp_path_factory.mktemp("multinode"))


@pytest.mark.parametrize("check", list(multinode_worker.CHECKS))
def test_multinode(results, check):
    assert_check(results, check, nproc=4)
