"""mp_config["overlap_comm"]: sequence-parallel tensor parallel through the overlapped rings, on 4 gloo
processes (tp 4, dp 2 x tp 2: every check) and on 2 (tp 2: the model checks), against one process."""

import pytest

from tests.distributed import overlap_worker
from tests.distributed.harness import assert_check, launch

# tp 2 alone: the three models; the refusals, profiler and to_distributed checks run on 4 processes.
TWO_PROCESS_CHECKS = ("check_seed_model_overlap_on_and_off", "check_hf_style_model_with_grouped_query_heads",
                      "check_packed_qkv_and_gate_up")


@pytest.fixture(scope="module", params=[4, 2], ids=["4 processes", "2 processes"])
def results(request, tmp_path_factory):
    nproc = request.param
    env = {"TRIDIST_CHECKS": ",".join(TWO_PROCESS_CHECKS)} if nproc == 2 else None
    return nproc, launch("tests.distributed.overlap_worker", nproc=nproc, out_dir=tmp_path_factory.mktemp(f"overlap{nproc}"),
                         extra_env=env)


@pytest.mark.parametrize("check", list(overlap_worker.CHECKS))
def test_overlap(results, check):
    nproc, found = results
    if nproc == 2 and check not in TWO_PROCESS_CHECKS:
        pytest.skip("runs on 4 processes")
    assert_check(found, check, nproc=nproc)
