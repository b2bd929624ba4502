"""shard_dataloader and DataParallel on 4 gloo processes: global batches reproduced, contiguous slices per
data-parallel rank, pipeline meshes, shuffling kept in step, DDP updates equal to one process's."""

import pytest

from tests.distributed import data_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 4


MERGED = {"data_worker": {NPROC: None}}  # its checks run in the session's merged launch of NPROC (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "data_worker")


@pytest.mark.parametrize("check", list(data_worker.CHECKS))
def test_data(results, check):
    assert_check(results, check, nproc=NPROC)
