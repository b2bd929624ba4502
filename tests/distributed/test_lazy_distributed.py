"""LazyGuard models under parallelize (FSDP2 ZeRO-3, 2-D tensor parallel) on 4 gloo processes vs one process."""

import pytest

from tests.distributed import lazy_worker
from tests.distributed.harness import assert_check, launch

NPROC = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("tests.distributed.lazy_worker", nproc=NPROC, out_dir=tmp_path_factory.mktemp("lazy"))


@pytest.mark.parametrize("check", list(lazy_worker.CHECKS))
def test_lazy_distributed(results, check):
    assert_check(results, check, nproc=NPROC)
