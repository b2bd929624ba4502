"""mp_config["overlap_comm"]: sequence-parallel tensor parallel through the overlapped rings, on 4 gloo
processes (tp 4, dp 2 x tp 2) and on 2 (tp 2), against one process."""

import pytest

from tests.distributed import overlap_worker
from tests.distributed.harness import assert_check, launch


@pytest.fixture(scope="module", params=[4, 2], ids=["4 processes", "2 processes"])
def results(request, tmp_path_factory):
    nproc = request.param
    return nproc, launch("tests.distributed.overlap_worker", nproc=nproc, out_dir=tmp_path_factory.mktemp(f"overlap{nproc}"))


@pytest.mark.parametrize("check", list(overlap_worker.CHECKS))
def test_overlap(results, check):
    nproc, found = results
    assert_check(found, check, nproc=nproc)
