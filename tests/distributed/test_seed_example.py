"""The seeds' 8-device examples (the notes' hybrid example; parallelize's dp x mp x pp) on 8 gloo processes vs one process."""

import pytest

from tests.distributed import seed_example_worker
from tests.distributed.harness import assert_check, launch

NPROC = 8


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("tests.distributed.seed_example_worker", nproc=NPROC, out_dir=tmp_path_factory.mktemp("seed_example"))


@pytest.mark.parametrize("check", list(seed_example_worker.CHECKS))
def test_seed_example(results, check):
    assert_check(results, check, nproc=NPROC)
