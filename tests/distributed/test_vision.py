"""Vision-language models of transformers through to_distributed on gloo processes vs one process (vision_worker.py):
images of any size and number per sample, split with their samples."""

import pytest

from tests.distributed import vision_worker
from tests.distributed.harness import assert_check, module_results

FOUR = vision_worker.FOUR_PROCESS_CHECKS
WORLDS = {4: FOUR, 2: [check for check in vision_worker.CHECKS if check not in FOUR]}
MERGED = {"vision_worker": WORLDS}  # their checks run in the session's merged launches (conftest.py)


@pytest.mark.parametrize("nproc, check", [(nproc, check) for nproc, checks in WORLDS.items() for check in checks])
def test_vision_language_models(merged_launches, nproc, check):
    assert_check(module_results(merged_launches[nproc], "vision_worker"), check, nproc=nproc)
