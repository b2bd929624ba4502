"""Hugging Face transformers models (tiny configs, nothing downloaded) through to_distributed on 4 gloo
processes: see transformers_worker.py."""

import pytest

pytest.importorskip("transformers")

from tests.distributed import transformers_worker  # noqa: E402
from tests.distributed.harness import assert_check, launch  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # The fused kernels (on by default, as users get them) take their CPU path here: the same ops, autograd
    # and DTensor handling around the kernels' math in PyTorch. The Triton kernels themselves are checked in
    # the interpreter by tests/test_*.py; interpreting them in every training step of this matrix would
    # multiply its time without checking more of distcore.
    return launch("tests.distributed.transformers_worker", nproc=4, out_dir=tmp_path_factory.mktemp("transformers"),
                  extra_env={"TRITON_INTERPRET": "0"}, timeout_s=900)  # every family x strategy: minutes, not a hang


@pytest.mark.parametrize("check", list(transformers_worker.CHECKS))
def test_transformers_models(results, check):
    assert_check(results, check, nproc=4)
