"""Vision-language models of transformers through to_distributed on 2 gloo processes vs one process
(vision_worker.py): images of any size and number per sample, split with their samples."""

import pytest

from tests.distributed import vision_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 2
MERGED = {"vision_worker": {NPROC: None}}  # its checks run in the session's merged launch of NPROC (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "vision_worker")


@pytest.mark.parametrize("check", list(vision_worker.CHECKS))
def test_vision_language_models(results, check):
    assert_check(results, check, nproc=NPROC)
