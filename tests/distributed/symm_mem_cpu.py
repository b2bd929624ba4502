"""torch's symmetric-memory fused ops on CPU tensors, for the tests of backend="symm_mem".

torch registers `symm_mem::fused_all_gather_matmul` / `fused_matmul_reduce_scatter` for CUDA (and Meta)
only. Their reference implementations, `_fused_all_gather_matmul_fallback` and
`_fused_matmul_reduce_scatter_fallback` (functional collectives + matmul), are what torch's CUDA kernels
themselves run in its `_test_mode` and what its fake tensors compute shapes with; they run on gloo.
`symm_mem_on_cpu()` registers them as the ops' CPU kernels for the duration of a block, so that
tridist's backend goes through the real `torch.ops.symm_mem` dispatch with torch's own semantics
(argument order, B's [K, N] layout, gather_dim handling, the returned A), and the registration is
removed afterwards (a CPU call outside the block is refused, as on a machine without such GPUs).

The fallbacks are more lenient than torch's CUDA kernels, so the registered kernels first assert what
those require (torch/distributed/_symmetric_memory: `_fused_all_gather_matmul_impl` and
`_pipelined_multi_all_gather_and_consume`, `_fused_matmul_reduce_scatter_impl`): a non-negative dim, B
a matrix, and the shard contiguous once its gathered dim is moved outermost and the rest flattened.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed._symmetric_memory as symm_mem


def _all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A=True):
    assert 0 <= gather_dim < A_shard.dim(), f"CUDA kernel: invalid gather_dim {gather_dim}"
    assert all(B.dim() == 2 for B in Bs), "CUDA kernel: B must be a matrix"
    assert A_shard.movedim(gather_dim, 0).flatten(0, -2).is_contiguous(), (
        f"CUDA kernel: the shard (shape {tuple(A_shard.shape)}, strides {A_shard.stride()}) is not contiguous with "
        f"dim {gather_dim} outermost")
    return symm_mem._fused_all_gather_matmul_fallback(A_shard, Bs, gather_dim, group_name, return_A=return_A)


def _matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
    assert 0 <= scatter_dim < A.dim(), f"CUDA kernel: invalid scatter_dim {scatter_dim}"
    assert B.dim() == 2 and reduce_op in ("sum", "avg"), "CUDA kernel: B must be a matrix, reduce_op sum or avg"
    return symm_mem._fused_matmul_reduce_scatter_fallback(A, B, reduce_op, scatter_dim, group_name)


@contextlib.contextmanager
def symm_mem_on_cpu():
    library = torch.library.Library("symm_mem", "IMPL")
    try:
        library.impl("fused_all_gather_matmul", _all_gather_matmul, "CPU")
        library.impl("fused_matmul_reduce_scatter", _matmul_reduce_scatter, "CPU")
        yield
    finally:
        library._destroy()
