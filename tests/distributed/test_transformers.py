"""Hugging Face transformers models (tiny configs, nothing downloaded) through to_distributed on 4 gloo
processes: see transformers_worker.py."""

import pytest

pytest.importorskip("transformers")

from tests.distributed import transformers_worker  # noqa: E402
from tests.distributed.harness import assert_check, launch  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("tests.distributed.transformers_worker", nproc=4, out_dir=tmp_path_factory.mktemp("transformers"))


@pytest.mark.parametrize("check", list(transformers_worker.CHECKS))
def test_transformers_models(results, check):
    assert_check(results, check, nproc=4)
