"""kernels.all_gather_matmul / matmul_reduce_scatter on 4 gloo processes (world, sub-groups of 2, groups
of 1): forward and both gradients equal to the plain all-gather + F.linear / F.linear + reduce-scatter,
fp32/bf16/fp16, dims 0 and 1, non-contiguous inputs, error messages; backend="symm_mem" through torch's
ops (their reference implementations as CPU kernels: symm_mem_cpu.py). Plus torch.compile capture on 2."""

import pytest
import torch
import torch.distributed as dist

from tridist.kernels import all_gather_matmul, matmul_reduce_scatter
from tests.distributed import comm_matmul_compile_worker, comm_matmul_worker
from tests.distributed.harness import assert_check, module_results

NPROC = 4
COMPILE_NPROC = 2


# In the session's merged launches of 4 and of 2 processes (conftest.py).
MERGED = {"comm_matmul_worker": {NPROC: None}, "comm_matmul_compile_worker": {COMPILE_NPROC: None}}


@pytest.fixture(scope="module")
def results(merged_launches):
    return module_results(merged_launches[NPROC], "comm_matmul_worker")


@pytest.mark.parametrize("check", list(comm_matmul_worker.CHECKS))
def test_comm_matmul(results, check):
    assert_check(results, check, nproc=NPROC)


@pytest.fixture(scope="module")
def compile_results(merged_launches):
    return module_results(merged_launches[COMPILE_NPROC], "comm_matmul_compile_worker")


@pytest.mark.parametrize("check", list(comm_matmul_compile_worker.CHECKS))
def test_comm_matmul_compiled(compile_results, check):
    assert_check(compile_results, check, nproc=COMPILE_NPROC)


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="a process group exists in this process")
def test_uninitialized_process_group_is_a_clear_error():
    for call in (
        lambda: all_gather_matmul(torch.randn(2, 3, 8), torch.randn(4, 8), gather_dim=1),
        lambda: matmul_reduce_scatter(torch.randn(2, 4, 8), torch.randn(4, 8), scatter_dim=1),
    ):
        with pytest.raises(RuntimeError, match="not initialized.*init_process_group"):
            call()
