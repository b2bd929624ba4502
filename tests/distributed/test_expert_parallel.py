"""ExpertParallelExperts on 2 gloo processes: dispatch, combine and gradients equal one process, also for a
rank that receives no tokens. Whole MoE models under expert parallel: transformers_worker.py."""

import pytest

from tests.distributed import expert_parallel_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 2


MERGED = {"expert_parallel_worker": {NPROC: None}}  # its checks run in the session's merged launch of NPROC (conftest.py)


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "expert_parallel_worker")


@pytest.mark.parametrize("check", list(expert_parallel_worker.CHECKS))
def test_expert_parallel_experts(results, check):
    assert_check(results, check, nproc=NPROC)
