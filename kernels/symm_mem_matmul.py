"""torch's symmetric-memory fused ops as a backend of `all_gather_matmul` / `matmul_reduce_scatter`.

`backend="symm_mem"` runs `torch.ops.symm_mem.fused_all_gather_matmul` and
`fused_matmul_reduce_scatter` (torch.distributed._symmetric_memory, torch's async tensor parallel)
instead of tridist's point-to-point ring (`backend="ring"`, comm_matmul.py). Those ops map the peers'
buffers over NVLink and move the chunks with copy engines, so no NCCL kernel competes with the matmuls
for SMs; they need CUDA tensors on GPUs of one node that can map each other's memory.

torch gives them no autograd formula; the two are each other's backward, which is what this file adds:

- all_gather_matmul: ys[i] = A @ W_i^T with A = all_gather(x_shard) (one fused op for every weight,
  A returned). Backward: grad_x_shard = reduce_scatter(sum_i grad_ys[i] @ W_i), one
  `fused_matmul_reduce_scatter` of the concatenated output gradients with the concatenated weights
  (a copy of each, the price of one fused op instead of one per weight), plus this rank's rows of the
  returned A's gradient; grad_W_i = grad_ys[i]^T @ A, plain matmuls over the saved A.
- matmul_reduce_scatter: y_shard = reduce_scatter(x @ W^T). Backward: grad_x = all_gather(grad_y_shard) @ W,
  one `fused_all_gather_matmul` that also returns the gathered gradient; grad_W = that^T @ x.

Differences from the ring, all documented at the public functions: the partial sums of a
reduce-scatter travel in the input dtype (bf16 on the wire, then one fp32 sum of the W partials on
CUDA), where the ring sums in fp32 around the ring; `save_gathered=False` is a ring option (the
gathered input is what the weight gradients need, and these ops cannot gather it again overlapped);
grad_W is one matmul after the reduce-scatter, not chunked under it. Layout: torch's ops work with the
gathered/scattered dim outermost; with gather_dim 1 and batch > 1 ([B, S, H], distcore's layout) the
shard is re-strided and each output made contiguous (one copy each; none at batch 1 or gather_dim 0).
Which is default, and why: the ring (see comm_matmul.py's docstring).

Profiler ranges are the ring's names (`tridist.all_gather_matmul`, ... `.backward`), so traces read the
same whatever the backend; torch's kernels add their own `fused_all_gather_matmul` ranges inside.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ._common import gathered_and_outputs, no_autocast

_OPS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")
_DISPATCH_KEYS = {"cuda": "CUDA", "cpu": "CPU"}  # the devices torch's dispatcher may hold kernels of these ops for


def check_available(op: str, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """Raise unless torch has symmetric-memory kernels for `device` tensors and `group` (if given) lies in
    one node."""
    reason = _unavailable(op, "" if group is None else group.group_name, device.type)
    if reason:
        raise ValueError(reason)


@torch.compiler.assume_constant_result  # torch.compile runs it once while tracing (an error raises there)
def _unavailable(op: str, group_name: str, device_type: str) -> str:
    """Why backend='symm_mem' cannot run here (on the group named `group_name`; '': any), or ''."""
    try:
        import torch.distributed._symmetric_memory as symm_mem  # defines the symm_mem ops
    except ImportError as error:
        return (f"{op}: backend='symm_mem' needs torch.distributed._symmetric_memory, which this torch build lacks "
                f"({error}); use backend='ring'")
    # What this file relies on: the ops return the gathered input on request (`return_A`), and a process
    # group needs no symmetric-memory setup (older releases required enable_symm_mem_for_group first).
    arguments = [a.name for a in torch.ops.symm_mem.fused_all_gather_matmul.default._schema.arguments]
    setup_free = getattr(getattr(symm_mem, "enable_symm_mem_for_group", None), "__deprecated__", None) is not None
    if "return_A" not in arguments or not setup_free:
        return (f"{op}: backend='symm_mem' is written for torch's symmetric-memory ops as of torch 2.13 (return_A, "
                f"no per-group setup); this torch is {torch.__version__}. Upgrade torch, or use backend='ring'")
    key = _DISPATCH_KEYS.get(device_type)
    missing = [name for name in _OPS
               if key is None or not torch._C._dispatch_has_kernel_for_dispatch_key(f"symm_mem::{name}", key)]
    if missing:
        return (f"{op}: backend='symm_mem': torch has no kernel of symm_mem::{missing[0]} for {device_type} tensors; "
                "its fused ops run on CUDA GPUs of one node that map each other's memory. Use backend='ring' "
                "(tridist's point-to-point ring, any process group), or move the tensors to such GPUs")
    # Symmetric memory maps peers' memory within a node: a group whose ranks span nodes cannot use it
    # (torchrun numbers a node's LOCAL_WORLD_SIZE processes consecutively; without torchrun there is nothing
    # to check here, nor whether the GPUs can map each other's memory: torch's rendezvous then fails).
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if group_name and local.isdigit() and int(local) >= 1:
        ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group_name))
        nodes = sorted({rank // int(local) for rank in ranks})
        if len(nodes) > 1:
            return (f"{op}: backend='symm_mem': the group's ranks {ranks} span nodes {nodes} "
                    f"(LOCAL_WORLD_SIZE={local}); symmetric memory maps peers' memory within one node. Use "
                    "backend='ring' (NCCL across nodes), or a tensor-parallel group inside one node")
    return ""


def _own_rows(t: torch.Tensor, dim: int, rank: int, rows: int) -> torch.Tensor:
    return t.narrow(dim, rank * rows, rows)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _gather_ready(t: torch.Tensor, dim: int) -> torch.Tensor:
    """torch's fused all-gather needs the shard contiguous with `dim` outermost (a copy unless it is)."""
    from torch.distributed._symmetric_memory import restride_A_shard_for_fused_all_gather_matmul

    return restride_A_shard_for_fused_all_gather_matmul(t, dim)


def _scatter_ready(t: torch.Tensor, dim: int) -> torch.Tensor:
    """torch's fused reduce-scatter reads `dim` outermost (a copy unless it is)."""
    from torch.distributed._symmetric_memory import restride_A_for_fused_matmul_reduce_scatter

    return restride_A_for_fused_matmul_reduce_scatter(t, dim)


class SymmMemAllGatherMatmul(torch.autograd.Function):
    """Outputs: the gathered input (an empty tensor unless asked for), then one y per weight.

    torch's op computes with the gathered dim outermost and returns views in the caller's dim order; a
    view whose strides differ from the plain layout (gather_dim 1 with batch > 1) is copied to it, so
    that model code sees the same contiguous tensors as from the ring."""

    @staticmethod
    def forward(ctx, x_shard, group_name, group_rank, dim, return_gathered, *weights):
        keep = return_gathered or any(ctx.needs_input_grad[5:])  # the weights' gradients read the gathered x
        with torch.profiler.record_function("tridist.all_gather_matmul"), no_autocast(x_shard.device):
            gathered, ys = torch.ops.symm_mem.fused_all_gather_matmul(
                _gather_ready(x_shard, dim), [w.t() for w in weights], dim, group_name, return_A=keep)
            ys = [y.contiguous() for y in ys]
            if keep:
                gathered = gathered.contiguous()
        ctx.group_name, ctx.group_rank, ctx.dim, ctx.return_gathered = group_name, group_rank, dim, return_gathered
        ctx.shard_shape = x_shard.shape
        ctx.set_materialize_grads(False)  # an unused output gets no zero-filled gradient
        ctx.save_for_backward(gathered if keep else None, *weights)
        return gathered_and_outputs(ctx, gathered if return_gathered else None, ys, like=x_shard)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_gathered, *grad_ys):
        gathered, *weights = ctx.saved_tensors
        used = [i for i, g in enumerate(grad_ys) if g is not None]
        need_x, need_ws = ctx.needs_input_grad[0], ctx.needs_input_grad[5:]
        dim, rows = ctx.dim, ctx.shard_shape[ctx.dim]
        grad_x = None
        with torch.profiler.record_function("tridist.all_gather_matmul.backward"), no_autocast(weights[0].device):
            if need_x and used:
                grads = torch.cat([grad_ys[i] for i in used], dim=-1) if len(used) > 1 else grad_ys[used[0]]
                stacked = torch.cat([weights[i] for i in used], dim=0) if len(used) > 1 else weights[used[0]]
                grad_x = torch.ops.symm_mem.fused_matmul_reduce_scatter(
                    _scatter_ready(grads, dim), stacked, "sum", dim, ctx.group_name).contiguous()
            if need_x and ctx.return_gathered and grad_gathered is not None:  # its use on this rank: own rows
                own = _own_rows(grad_gathered, dim, ctx.group_rank, rows).to(weights[0].dtype)
                grad_x = own.clone() if grad_x is None else grad_x.add_(own)
            if need_x and grad_x is None:
                grad_x = weights[0].new_zeros(ctx.shard_shape)
            grad_ws = [_flat(grad_ys[i]).t() @ _flat(gathered) if wanted and grad_ys[i] is not None else None
                       for i, wanted in enumerate(need_ws)]
        return (grad_x, None, None, None, None, *grad_ws)


class SymmMemMatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group_name, dim):
        with torch.profiler.record_function("tridist.matmul_reduce_scatter"), no_autocast(x.device):
            y_shard = torch.ops.symm_mem.fused_matmul_reduce_scatter(
                _scatter_ready(x, dim), weight.t(), "sum", dim, group_name).contiguous()
        ctx.group_name, ctx.dim = group_name, dim
        ctx.save_for_backward(x, weight)
        return y_shard

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y_shard):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_weight = None
        if need_x or need_w:
            with torch.profiler.record_function("tridist.matmul_reduce_scatter.backward"), no_autocast(x.device):
                grad_y, (grad_x,) = torch.ops.symm_mem.fused_all_gather_matmul(
                    _gather_ready(grad_y_shard, ctx.dim), [weight], ctx.dim, ctx.group_name, return_A=need_w)
                grad_x = grad_x.contiguous()
                if need_w:
                    grad_weight = _flat(grad_y).t() @ _flat(x)
        return (grad_x if need_x else None), grad_weight, None, None
