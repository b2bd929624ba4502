"""Hugging Face transformers models (tiny configs, nothing downloaded) through to_distributed on 4 gloo
processes (a few checks on 2 and on 8): see transformers_worker.py."""

import pytest

pytest.importorskip("transformers")

from tests.distributed import transformers_worker  # noqa: E402
from tests.distributed.harness import assert_check, module_results  # noqa: E402

NPROC = 4

# In the session's merged launch of NPROC (conftest.py). The fused kernels (on by default, as users get them)
# take their CPU path here, as in every check not marked `interprets_kernels` (harness.py): the same ops,
# autograd and DTensor handling around the kernels' math in PyTorch.
# The checks needing 8 processes (expert x tensor x pipeline parallel) run in the session's 8-process launch, those
# of tensor parallel alone in its 2-process launch.
EIGHT, TWO = transformers_worker.EIGHT_PROCESS_CHECKS, transformers_worker.TWO_PROCESS_CHECKS
FOUR = [c for c in transformers_worker.CHECKS if c not in EIGHT + TWO]
MERGED = {"transformers_worker": {NPROC: FOUR, 8: EIGHT, 2: TWO}}


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "transformers_worker")


@pytest.mark.parametrize("check", FOUR)
def test_transformers_models(results, check):
    assert_check(results, check, nproc=NPROC)


@pytest.mark.parametrize("check", EIGHT)
def test_transformers_models_on_eight_processes(merged_launches, check):
    assert_check(module_results(merged_launches[8], "transformers_worker"), check, nproc=8)


@pytest.mark.parametrize("check", TWO)
def test_transformers_models_on_two_processes(merged_launches, check):
    assert_check(module_results(merged_launches[2], "transformers_worker"), check, nproc=2)
