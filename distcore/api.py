"""Distributed tensors, Paddle style: shard_tensor, reshard (also across meshes), dtensor_from_local.

Tensors are torch DTensors: a global view whose shards live on the ranks of a mesh. Within one mesh
torch's `redistribute` does the work. Between two meshes (pipeline stages) torch cannot; `reshard`
then moves the data with point-to-point transfers, differentiably (the backward sends gradients back).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, Shard

from . import env
from .mesh import ProcessMesh, as_process_mesh
from .optimizer import mark_resharded


def _check_placements(op: str, mesh: ProcessMesh, placements: Sequence[Placement], ndim: int) -> list[Placement]:
    placements = list(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"{op}: {len(placements)} placement(s) {placements} for a {mesh.ndim}-D mesh {mesh.dim_names}; "
            "give one placement per mesh dimension"
        )
    for placement in placements:
        if not isinstance(placement, Placement):
            raise TypeError(f"{op}: placements must be Shard(d), Replicate() or Partial(), got {placement!r}")
        if isinstance(placement, Shard) and not -ndim <= placement.dim < ndim:
            raise ValueError(f"{op}: {placement} on a {ndim}-D tensor; the shard dim must be in [0, {ndim})")
    return [Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements]


def shard_tensor(
    data,
    mesh: ProcessMesh,
    placements: Sequence[Placement],
    dtype: torch.dtype | None = None,
    stop_gradient: bool | None = None,
) -> DTensor:
    """A DTensor on `mesh` holding `data` (a tensor, array or list) as its global value.

    A Parameter stays a Parameter; a DTensor is resharded. Data (leaves, arrays) is taken from rank 0
    (broadcast/scattered). An activation that requires grad (Paddle's notes shard inputs inside
    forward) is sliced locally instead, so gradients flow back through it; it must hold the same value
    on every rank. `stop_gradient=False` (Paddle) means requires_grad=True. With Partial placements
    the global value is still `data`: for a sum, the first rank along each partial dimension holds it
    and the others zeros.
    """
    is_parameter = isinstance(data, torch.nn.Parameter)
    requires_grad = data.requires_grad if torch.is_tensor(data) else False
    if stop_gradient is not None:
        requires_grad = not stop_gradient
    if isinstance(data, DTensor):
        result = reshard(data.detach() if is_parameter else data, mesh, placements)
    elif torch.is_tensor(data) and data.requires_grad and data.grad_fn is not None:
        placements = _check_placements("shard_tensor", mesh, placements, data.dim())
        result = _slice_locally(data.to(env.device()), mesh, placements)
    else:
        tensor = data.detach() if torch.is_tensor(data) else torch.as_tensor(np.asarray(data))
        placements = _check_placements("shard_tensor", mesh, placements, tensor.dim())
        replicated = [Replicate() if p.is_partial() else p for p in placements]
        result = distribute_tensor(tensor.to(env.device()), mesh.device_mesh, replicated)
        if replicated != placements:
            result = _as_partial(result, placements)
    if dtype is not None:
        result = result.to(dtype)
    if is_parameter:
        parameter = torch.nn.Parameter(result.detach(), requires_grad=requires_grad)
        mark_resharded(data, parameter)  # an optimizer built before holds `data`: its step checks (optimizer.py)
        return parameter
    if result.grad_fn is None:  # a new leaf; a sliced activation keeps its graph instead
        result.requires_grad_(requires_grad)
    return result


def _slice_locally(tensor: torch.Tensor, mesh: ProcessMesh, placements: list[Placement]) -> DTensor:
    """This rank's shard of a (replicated) tensor, cut with differentiable slicing: no communication."""
    device_mesh = mesh.device_mesh
    coordinate = device_mesh.get_coordinate()
    local = tensor
    if coordinate is None:  # not in the mesh: an empty shard, as DTensor ops give such ranks
        local = tensor.new_empty(0)
    else:
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                size, offset = Shard.local_shard_size_and_offset(local.shape[placement.dim], mesh.shape[mesh_dim], coordinate[mesh_dim])
                local = local.narrow(placement.dim, offset, size)
            elif placement.is_partial() and placement.reduce_op == "sum" and coordinate[mesh_dim] != 0:
                local = local * 0  # stays in the graph
    return DTensor.from_local(
        local, device_mesh, placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def _as_partial(replicated: DTensor, placements: list[Placement]) -> DTensor:
    """Mark mesh dims Partial: for a sum the rank at coordinate 0 of the dim keeps the value and the
    others hold zeros (exact, unlike dividing by n); for avg/max/min every rank keeps it."""
    local = replicated.to_local()
    coordinate = replicated.device_mesh.get_coordinate()
    if coordinate is not None:
        for mesh_dim, placement in enumerate(placements):
            if placement.is_partial() and placement.reduce_op == "sum" and coordinate[mesh_dim] != 0:
                local = torch.zeros_like(local)
    return DTensor.from_local(
        local, replicated.device_mesh, placements, run_check=False, shape=replicated.shape, stride=replicated.stride()
    )


def dtensor_from_local(local_tensor: torch.Tensor, mesh: ProcessMesh, placements: Sequence[Placement], *, shape=None) -> DTensor:
    """A DTensor whose shard on this rank is `local_tensor` (no communication).

    Shards are assumed even (torch.chunk sizes) unless the global `shape` is given.
    """
    placements = _check_placements("dtensor_from_local", mesh, placements, local_tensor.dim())
    stride = None
    if shape is not None:
        shape = torch.Size(shape)
        stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local_tensor, mesh.device_mesh, placements, run_check=False, shape=shape, stride=stride)


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (Paddle's `_local_value()`); a plain tensor is returned as is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def unshard_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full global value of a DTensor on every rank of its mesh (a plain tensor as is)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def reshard(tensor: DTensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> DTensor:
    """`tensor` redistributed to `placements` on `mesh`, which may differ from its own mesh."""
    if not isinstance(tensor, DTensor):
        raise TypeError(f"reshard: expected a distributed tensor (from shard_tensor), got {type(tensor).__name__}")
    placements = _check_placements("reshard", mesh, placements, tensor.dim())
    source = as_process_mesh(tensor.device_mesh)
    if source.process_ids == mesh.process_ids and source.shape == mesh.shape:
        if source.dim_names != mesh.dim_names:
            # The same ranks under other dimension names: torch sees two meshes; re-label, no transfer.
            tensor = _Relabel.apply(tensor, mesh)
        return tensor.redistribute(mesh.device_mesh, placements)
    return _CrossMeshReshard.apply(tensor, source, mesh, tuple(placements))


class _Relabel(torch.autograd.Function):
    """The same shards seen on an equal mesh whose dimensions are named differently."""

    @staticmethod
    def forward(ctx, tensor: DTensor, mesh: ProcessMesh):
        ctx.source_mesh = tensor.device_mesh
        return DTensor.from_local(
            tensor.to_local(), mesh.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )

    @staticmethod
    def backward(ctx, grad: DTensor):
        return DTensor.from_local(
            grad.to_local(), ctx.source_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
        ), None


# ------------------------------------------------------------------------------------ across meshes


def _local_shape(global_shape, mesh: ProcessMesh, placements, rank: int) -> tuple[int, ...]:
    """The shape of `rank`'s shard of a tensor of `global_shape` on `mesh` (torch.chunk sizes)."""
    coordinate = mesh.coordinate(rank)
    shape = list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            shape[placement.dim], _ = Shard.local_shard_size_and_offset(
                shape[placement.dim], mesh.shape[mesh_dim], coordinate[mesh_dim]
            )
    return tuple(shape)


def _move_between_meshes(tensor: DTensor, source: ProcessMesh, target: ProcessMesh, placements) -> DTensor:
    """Send `tensor` (on `source`) to `target` with `placements`, by point-to-point transfers.

    Same mesh shape and placements (the pipeline case): rank i of the source sends its shard straight
    to rank i of the target. Otherwise the source gathers the full value (within its mesh), rank j of
    the target receives it from source rank j mod |source|, and takes its own shard locally.
    """
    rank = env.get_rank()
    global_shape, dtype = tensor.shape, tensor.dtype
    device = env.device()
    direct = source.shape == target.shape and list(tensor.placements) == list(placements)
    if not direct:
        full = [Replicate()] * source.ndim
        tensor = tensor.redistribute(source.device_mesh, full)
        send_placements = full
    else:
        send_placements = list(placements)
    src_ids, dst_ids = source.process_ids, target.process_ids
    pairs = [(src_ids[j % len(src_ids)], dst) for j, dst in enumerate(dst_ids)]
    operations, received = [], None
    for src, dst in pairs:
        if src == rank and dst == rank:
            received = tensor.to_local().clone()
        elif src == rank:
            operations.append(dist.P2POp(dist.isend, tensor.to_local().contiguous(), dst))
        elif dst == rank:
            # Direct: this rank's own shard on the target; otherwise the full value.
            shape = _local_shape(global_shape, target, placements, rank) if direct else tuple(global_shape)
            received = torch.empty(shape, dtype=dtype, device=device)
            operations.append(dist.P2POp(dist.irecv, received, src))
    if operations:
        for request in dist.batch_isend_irecv(operations):
            request.wait()
    if received is None:  # not on the target mesh: an empty shard, as DTensor ops give such ranks
        received = torch.empty(0, dtype=dtype, device=device)
    result = DTensor.from_local(
        received, target.device_mesh, send_placements, run_check=False, shape=global_shape,
        stride=torch.empty(global_shape, device="meta").stride(),
    )
    if not direct:
        result = result.redistribute(target.device_mesh, list(placements))  # local slicing / partition
    return result


class _CrossMeshReshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: DTensor, source: ProcessMesh, target: ProcessMesh, placements):
        ctx.source, ctx.target = source, target
        # Gradients flow back as plain (non-Partial) placements of the source, leaving the target in the
        # plain placements of this output. Not in the incoming gradient's own placements: on ranks outside
        # the target mesh those are not propagated (they read Replicate() where the target's ranks hold
        # Shard(0)), and sender and receiver must agree on the layout moved (a direct shard, or the full
        # value), or a receiver reads a shard as the full tensor and slices uninitialised memory.
        ctx.source_placements = [Replicate() if p.is_partial() else p for p in tensor.placements]
        ctx.target_placements = [Replicate() if p.is_partial() else p for p in placements]
        return _move_between_meshes(tensor, source, target, placements)

    @staticmethod
    def backward(ctx, grad: DTensor):
        grad = grad.redistribute(ctx.target.device_mesh, ctx.target_placements)
        return _move_between_meshes(grad, ctx.target, ctx.source, ctx.source_placements), None, None, None
