"""torch's symmetric-memory fused ops on CPU tensors, for the tests of backend="symm_mem".

torch registers `symm_mem::fused_all_gather_matmul` / `fused_matmul_reduce_scatter` for CUDA (and Meta)
only. Their reference implementations, `_fused_all_gather_matmul_fallback` and
`_fused_matmul_reduce_scatter_fallback` (functional collectives + matmul), are what torch's CUDA kernels
themselves run in its `_test_mode` and what its fake tensors compute shapes with; they run on gloo.
`symm_mem_on_cpu()` registers them as the ops' CPU kernels for the duration of a block, so that
tridist's backend goes through the real `torch.ops.symm_mem` dispatch with torch's own semantics
(argument order, B's [K, N] layout, gather_dim handling, the returned A), and the registration is
removed afterwards (a CPU call outside the block is refused, as on a machine without such GPUs).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed._symmetric_memory as symm_mem


@contextlib.contextmanager
def symm_mem_on_cpu():
    library = torch.library.Library("symm_mem", "IMPL")
    try:
        library.impl("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback, "CPU")
        library.impl("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback, "CPU")
        yield
    finally:
        library._destroy()
