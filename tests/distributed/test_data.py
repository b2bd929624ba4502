"""shard_dataloader and DataParallel on 4 gloo processes: global batches reproduced, contiguous slices per
data-parallel rank, pipeline meshes, shuffling kept in step, DDP updates equal to one process's."""

import pytest

from tests.distributed import data_worker
from tests.distributed.harness import assert_check, launch

NPROC = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("tests.distributed.data_worker", nproc=NPROC, out_dir=tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("check", list(data_worker.CHECKS))
def test_data(results, check):
    assert_check(results, check, nproc=NPROC)
