"""mp_config["overlap_comm"]: sequence-parallel tensor parallel through the overlapped rings, on 4 gloo
processes (tp 4, dp 2 x tp 2: every check) and on 2 (tp 2: the model checks), against one process."""

import pytest

from tests.distributed import overlap_worker
from tests.distributed.harness import assert_check, module_results

# tp 2 alone: the three models; the refusals, profiler and to_distributed checks run on 4 processes. The
# compiled model and the symmetric-memory backend run on 2 only: the same code as tp 4, at half the CPU
# time on a 2-core machine (4 processes contend for the cores, torch.compile most of all).
TWO_PROCESS_ONLY = ("check_compiled_model_trains_like_one_process", "check_symm_mem_backend_trains_like_one_process")
TWO_PROCESS_CHECKS = ("check_seed_model_overlap_on_and_off", "check_hf_style_model_with_grouped_query_heads",
                      "check_packed_qkv_and_gate_up", *TWO_PROCESS_ONLY)
FOUR_PROCESS_CHECKS = tuple(name for name in overlap_worker.CHECKS if name not in TWO_PROCESS_ONLY)


# In the session's merged launches of 4 and of 2 processes (conftest.py).
MERGED = {"overlap_worker": {4: FOUR_PROCESS_CHECKS, 2: TWO_PROCESS_CHECKS}}


@pytest.fixture(scope="module", params=[4, 2], ids=["4 processes", "2 processes"])
def results(request, merged_launches):
    return request.param, module_results(merged_launches[request.param], "overlap_worker")


@pytest.mark.parametrize("check", list(overlap_worker.CHECKS))
def test_overlap(results, check):
    nproc, found = results
    if check not in (TWO_PROCESS_CHECKS if nproc == 2 else FOUR_PROCESS_CHECKS):
        pytest.skip(f"runs on {4 if nproc == 2 else 2} processes")
    assert_check(found, check, nproc=nproc)
