"""torch's symmetric-memory fused ops as a backend of `all_gather_matmul` / `matmul_reduce_scatter`.

`backend="symm_mem"` runs `torch.ops.symm_mem.fused_all_gather_matmul` and
`fused_matmul_reduce_scatter` (torch.distributed._symmetric_memory, torch's async tensor parallel)
instead of tridist's point-to-point ring (`backend="ring"`, comm_matmul.py). Those ops map the peers'
buffers over NVLink and move the chunks with copy engines, so no NCCL kernel competes with the matmuls
for SMs; they need CUDA tensors on GPUs of one node that can map each other's memory.

torch gives them no autograd formula; the two are each other's backward, which is what this file
computes (comm_matmul's autograd Functions and torch.library ops call these functions):

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

The autograd Functions and torch.library ops are comm_matmul's, shared by both backends (the backend
is one of their arguments), so eager and compiled traces show the same `tridist.all_gather_matmul`, ...
`.backward` ranges whatever the backend; torch's ops add their own ranges inside.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ._common import no_autocast

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


# The four functions below have the signatures of comm_matmul's ring functions, which the autograd
# Functions and torch.library ops there call for either backend (comm_matmul._backend).


def all_gather_matmul_forward(x_shard, weights, group, dim: int, keep_gathered: bool):
    """(ys, gathered or None): ys[i] = F.linear(all_gather(x_shard, dim), weights[i]), one fused op for all;
    gathered: the gathered input as a source-major view [W, *shard] (as the ring keeps it) of torch's
    plain-layout result. torch computes with `dim` outermost and returns views in the caller's dim
    order; the outputs are made contiguous (a copy only at dim 1 with batch > 1), as the ring's are."""
    with torch.profiler.record_function("tridist.all_gather_matmul"), no_autocast(x_shard.device):
        gathered, ys = torch.ops.symm_mem.fused_all_gather_matmul(
            _gather_ready(x_shard, dim), [w.t() for w in weights], dim, group.group_name, return_A=keep_gathered)
        ys = [y.contiguous() for y in ys]
        if keep_gathered:
            rows = x_shard.shape[dim]
            gathered = gathered.contiguous().unflatten(dim, (group.size(), rows)).movedim(dim, 0)
    return ys, (gathered if keep_gathered else None)


def all_gather_matmul_backward(grad_ys, grad_gathered, x_shard, gathered, weights, group, dim: int, need_x: bool,
                               need_ws):
    """(grad_x_shard or None, [grad_weight or None per weight]), as comm_matmul's ring backward: grad_x =
    reduce_scatter(sum_i grad_ys[i] @ W_i), one fused op over the concatenated gradients and weights
    (a copy of each), plus this rank's rows of the gathered input's gradient; grad_W_i = grad_ys[i]^T @ x."""
    used = [i for i, g in enumerate(grad_ys) if g is not None]
    grad_x = None
    with torch.profiler.record_function("tridist.all_gather_matmul.backward"), no_autocast(x_shard.device):
        if need_x and used:
            grads = torch.cat([grad_ys[i] for i in used], dim=-1) if len(used) > 1 else grad_ys[used[0]]
            stacked = torch.cat([weights[i] for i in used], dim=0) if len(used) > 1 else weights[used[0]]
            grad_x = torch.ops.symm_mem.fused_matmul_reduce_scatter(
                _scatter_ready(grads, dim), stacked, "sum", dim, group.group_name).contiguous()
        if need_x and grad_gathered is not None:  # the gathered input's own use on this rank: its own rows
            own = grad_gathered[dist.get_rank(group)].to(x_shard.dtype)
            grad_x = own.clone() if grad_x is None else grad_x.add_(own)
        if need_x and grad_x is None:
            grad_x = torch.zeros_like(x_shard)
        # the gathered x in its plain layout, row for row with grad_ys (one rank: the shard itself)
        x_rows = _flat(x_shard if gathered is None else gathered.movedim(0, dim).flatten(dim, dim + 1))
        grad_ws = [_flat(grad_ys[i]).t() @ x_rows if wanted and grad_ys[i] is not None else None
                   for i, wanted in enumerate(need_ws)]
    return grad_x, grad_ws


def matmul_reduce_scatter_forward(x, weight, group, dim: int):
    """reduce_scatter(F.linear(x, weight), dim): partial products summed in x's dtype, once."""
    with torch.profiler.record_function("tridist.matmul_reduce_scatter"), no_autocast(x.device):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(
            _scatter_ready(x, dim), weight.t(), "sum", dim, group.group_name).contiguous()


def matmul_reduce_scatter_backward(grad_y_shard, x, weight, group, dim: int, need_x: bool, need_w: bool):
    """grad_x = all_gather(grad_y_shard) @ weight in one fused op that also returns the gathered gradient,
    grad_weight = that^T @ x."""
    grad_x = grad_weight = None
    if need_x or need_w:
        with torch.profiler.record_function("tridist.matmul_reduce_scatter.backward"), no_autocast(x.device):
            grad_y, (grad_x,) = torch.ops.symm_mem.fused_all_gather_matmul(
                _gather_ready(grad_y_shard, dim), [weight], dim, group.group_name, return_A=need_w)
            grad_x = grad_x.contiguous() if need_x else None
            if need_w:
                grad_weight = _flat(grad_y).t() @ _flat(x)
    return grad_x, grad_weight
