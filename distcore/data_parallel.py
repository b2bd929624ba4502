"""Paddle's `DataParallel(layers, ...)`: torch DistributedDataParallel that still looks like the model.

Every rank holds the whole model; after backward the gradients are averaged over the ranks (bucketed
all-reduces overlapping the backward). Fed with each rank's contiguous slice of a global batch (see
`shard_dataloader`) and a loss that is a mean over the local batch, an update equals the
single-process update on the global batch (exactly when the slices have equal sizes: see the caveats in
`distcore.dataloader`). shard_dataloader's batches go in as they are, `model(batch)` as in Paddle's
loops: DTensor inputs (nested in lists, tuples, dicts) are replaced by this rank's local shard.

The averaging group (`group=`): None (every rank), a torch ProcessGroup, a 1-D ProcessMesh that every
rank builds alike (e.g. `ProcessMesh([0, 1, 2, 3], ["dp"])`), or one dimension of a bigger mesh:
`group=(mesh, "dp")` or `group=mesh, dim_name="dp"`, whose group through this rank comes from the
mesh's DeviceMesh (`mesh.device_mesh.get_group(mesh_dim="dp")`). Always pass the whole mesh, the same
on every rank: process groups are created collectively, and a mesh that differs per rank (a per-rank
view of one dimension) would wire them to the wrong ranks.
"""

from __future__ import annotations

import inspect

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map

from . import env
from .api import local_value
from .mesh import ProcessMesh, as_process_mesh

# torch >= 2.9 takes one capacity per bucket; older ones only a uniform bucket_cap_mb.
_HAS_PER_BUCKET_CAPS = "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters


class _DataParallelModel(DistributedDataParallel):
    """DDP whose missing attributes fall back to the wrapped model (`model.config`, custom methods).

    `state_dict` / `load_state_dict` are the wrapped model's too (Paddle's DataParallel does the same),
    so checkpoints have the same keys with or without the wrapper; `.module` is the model itself.
    """

    def forward(self, *inputs, **kwargs):
        """DTensor inputs (shard_dataloader's batches) become this rank's local shards, then DDP's forward."""
        inputs, kwargs = tree_map(local_value, (inputs, kwargs))
        return super().forward(*inputs, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name == "module":  # still being built: nothing to fall back to
                raise
            return getattr(module, name)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _process_group(group, dim_name: str | None = None):
    """Paddle's `group` as a torch ProcessGroup (None: every rank).

    group: None, a torch ProcessGroup, a 1-D ProcessMesh (or DeviceMesh), or a mesh with `dim_name`
    (also given as `group=(mesh, dim_name)`): the group through this rank along that dimension, taken
    from the mesh's DeviceMesh, which every rank creates alike.
    """
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], (ProcessMesh, DeviceMesh)):
        if dim_name is not None and dim_name != group[1]:
            raise ValueError(f"DataParallel: group={group!r} names dim {group[1]!r} but dim_name={dim_name!r}")
        group, dim_name = group
    if isinstance(group, DeviceMesh):
        group = as_process_mesh(group)  # the same DeviceMesh backs it
    if not isinstance(group, ProcessMesh):
        if dim_name is not None:
            raise TypeError(
                f"DataParallel: dim_name={dim_name!r} needs group=<the mesh it names a dim of>, got group={group!r}"
            )
        return group
    if dim_name is None:
        if group.ndim != 1:
            raise ValueError(
                f"DataParallel: group={group} is {group.ndim}-D; name its data-parallel dimension: "
                f"group=(mesh, {group.dim_names[0]!r}) or dim_name={group.dim_names[0]!r}, passing the whole mesh "
                "(the same on every rank)"
            )
        mesh_dim = 0
    elif isinstance(dim_name, str) and dim_name in group.dim_names:
        mesh_dim = dim_name
    else:
        raise ValueError(f"DataParallel: dim_name={dim_name!r} is not a dim of {group}; its dims are {group.dim_names}")
    device_mesh = group.device_mesh  # collective on creation: every rank builds the same mesh now
    rank = env.get_rank()
    if rank not in group:
        raise ValueError(f"DataParallel: this rank ({rank}) is not in group={group}, the mesh whose ranks average gradients")
    return device_mesh.get_group(mesh_dim=mesh_dim)


def _check_plain_parameters(model: torch.nn.Module) -> None:
    """DDP all-reduces plain tensors; it does not support DTensor parameters (tensor parallel)."""
    distributed = [name for name, parameter in model.named_parameters() if isinstance(parameter, DTensor)]
    if distributed:
        raise TypeError(
            f"DataParallel: parameters {distributed[:3]}{'...' if len(distributed) > 3 else ''} are distributed "
            "tensors (tensor parallel), which DDP cannot average; combine data and tensor parallel with "
            "parallelize(model, optimizer, mesh, config={'dp_config': {'sharding_level': 0..3}, 'mp_config': ...})"
        )


def DataParallel(  # noqa: N802 - Paddle's name
    layers: torch.nn.Module,
    strategy=None,
    comm_buffer_size: float = 25,
    last_comm_buffer_size: float = 1,
    find_unused_parameters: bool = False,
    group=None,
    *,
    dim_name: str | None = None,
) -> DistributedDataParallel:
    """`layers` wrapped in DistributedDataParallel, initialising the parallel environment if needed.

    comm_buffer_size: the gradient bucket size in MB. last_comm_buffer_size: the size of the bucket
    reduced first (Paddle calls it the last buffer: it holds the last layers' gradients, ready first;
    torch's "first bucket"), small so that communication starts early. strategy: accepted for Paddle
    compatibility and unused (the process group holds the settings). On a GPU the model is moved to
    this process's GPU first. group / dim_name: the ranks that average gradients (see the module
    docstring): None (all), a ProcessGroup, a 1-D ProcessMesh, or `(mesh, "dp")` / `mesh, dim_name="dp"`.
    Calling the model replaces DTensor inputs (shard_dataloader's batches) by their local shards.
    """
    del strategy  # Paddle's ParallelStrategy: torch reads ranks and devices from the process group
    env.init_parallel_env()
    process_group = _process_group(group, dim_name)
    _check_plain_parameters(layers)
    device = env.device()
    layers = layers.to(device)
    buckets = (
        {"bucket_cap_mb_list": [last_comm_buffer_size, comm_buffer_size]}
        if _HAS_PER_BUCKET_CAPS
        else {"bucket_cap_mb": comm_buffer_size}
    )
    return _DataParallelModel(
        layers,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
        process_group=process_group,
        **buckets,
    )
