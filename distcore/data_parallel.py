"""Paddle's `DataParallel(layers, ...)`: torch DistributedDataParallel that still looks like the model.

Every rank holds the whole model; after backward the gradients are averaged over the ranks (bucketed
all-reduces overlapping the backward). Fed with each rank's contiguous slice of a global batch (see
`shard_dataloader`) and a loss that is a mean over the local batch, an update equals the
single-process update on the global batch (exactly when the slices have equal sizes).
"""

from __future__ import annotations

import inspect

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from . import env
from .mesh import ProcessMesh

# torch >= 2.9 takes one capacity per bucket; older ones only a uniform bucket_cap_mb.
_HAS_PER_BUCKET_CAPS = "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters


class _DataParallelModel(DistributedDataParallel):
    """DDP whose missing attributes fall back to the wrapped model (`model.config`, custom methods).

    `state_dict` / `load_state_dict` are the wrapped model's too (Paddle's DataParallel does the same),
    so checkpoints have the same keys with or without the wrapper; `.module` is the model itself.
    """

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


def _process_group(group):
    """Paddle's `group`: None (all ranks), a torch ProcessGroup, or a 1-D ProcessMesh (its ranks)."""
    if isinstance(group, ProcessMesh):
        if group.ndim != 1:
            raise ValueError(
                f"DataParallel: group={group} is {group.ndim}-D; pass the 1-D data-parallel group through "
                "this rank, e.g. mesh.get_submesh_with_dim('dp')"
            )
        return group.device_mesh.get_group()
    return group


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
) -> DistributedDataParallel:
    """`layers` wrapped in DistributedDataParallel, initialising the parallel environment if needed.

    comm_buffer_size: the gradient bucket size in MB. last_comm_buffer_size: the size of the bucket
    reduced first (Paddle calls it the last buffer: it holds the last layers' gradients, ready first;
    torch's "first bucket"), small so that communication starts early. strategy: accepted for Paddle
    compatibility and unused (the process group holds the settings). On a GPU the model is moved to
    this process's GPU first.
    """
    del strategy  # Paddle's ParallelStrategy: torch reads ranks and devices from the process group
    env.init_parallel_env()
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
        process_group=_process_group(group),
        **buckets,
    )
