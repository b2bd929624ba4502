"""LazyGuard models under parallelize (FSDP2 ZeRO-3, 2-D tensor parallel) on 4 gloo processes vs one process."""

import pytest

from tests.distributed import lazy_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 4


MERGED = {"lazy_worker": {NPROC: None}}  # its checks run in the session's merged launch of NPROC (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "lazy_worker")


@pytest.mark.parametrize("check", list(lazy_worker.CHECKS))
def test_lazy_distributed(results, check):
    assert_check(results, check, nproc=NPROC)
