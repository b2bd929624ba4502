"""mp_config["overlap_comm"]: sequence-parallel tensor parallel through the overlapped rings, on 4 gloo
processes (tp 4, dp 2 x tp 2: every check) and on 2 (tp 2: the model checks), against one process."""

import pytest

from tests.distributed import overlap_worker
from tests.distributed.harness import MERGED_NPROC, assert_check, launch, module_results

# tp 2 alone: the three models; the refusals, profiler and to_distributed checks run on 4 processes. The
# compiled model and the symmetric-memory backend run on 2 only: the same code as tp 4, at half the CPU
# time on a 2-core machine (4 processes contend for the cores, torch.compile most of all).
TWO_PROCESS_ONLY = ("check_compiled_model_trains_like_one_process", "check_symm_mem_backend_trains_like_one_process")
TWO_PROCESS_CHECKS = ("check_seed_model_overlap_on_and_off", "check_hf_style_model_with_grouped_query_heads",
                      "check_packed_qkv_and_gate_up", *TWO_PROCESS_ONLY)
FOUR_PROCESS_CHECKS = tuple(name for name in overlap_worker.CHECKS if name not in TWO_PROCESS_ONLY)


MERGED_WORKER, MERGED_CHECKS = "overlap_worker", FOUR_PROCESS_CHECKS  # in the session's merged launch (conftest.py)


@pytest.fixture(scope="module", params=[4, 2], ids=["4 processes", "2 processes"])
def results(request, tmp_path_factory):
    nproc = request.param
    if nproc == MERGED_NPROC:
        return nproc, module_results(request.getfixturevalue("merged_launch"), MERGED_WORKER)
    return nproc, launch("tests.distributed.overlap_worker", nproc=nproc, out_dir=tmp_path_factory.mktemp(f"overlap{nproc}"),
                         extra_env={"TRIDIST_CHECKS": ",".join(TWO_PROCESS_CHECKS)})


@pytest.mark.parametrize("check", list(overlap_worker.CHECKS))
def test_overlap(results, check):
    nproc, found = results
    if check not in (TWO_PROCESS_CHECKS if nproc == 2 else FOUR_PROCESS_CHECKS):
        pytest.skip(f"runs on {4 if nproc == 2 else 2} processes")
    assert_check(found, check, nproc=nproc)
