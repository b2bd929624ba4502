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
WORLDS = {NPROC: FOUR, 8: EIGHT, 2: TWO}
MERGED = {"transformers_worker": WORLDS}


@pytest.mark.parametrize("nproc, check", [(nproc, check) for nproc, checks in WORLDS.items() for check in checks])
def test_transformers_models(merged_launches, nproc, check):
    assert_check(module_results(merged_launches[nproc], "transformers_worker"), check, nproc=nproc)
