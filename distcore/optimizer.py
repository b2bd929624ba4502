"""shard_optimizer and the sharding stages, on torch's optimizers.

- No shard_fn: torch optimizers already keep their states like the parameters (a DTensor parameter
  sharded over a mesh gets sharded states), which is Paddle's behaviour; the optimizer is wrapped
  only to speak Paddle's dialect (`clear_grad`, `get_lr`, `set_lr`).
- ShardingStage1 (optimizer states sharded over the data-parallel ranks): torch's
  ZeroRedundancyOptimizer over the mesh dimension's process group, for plain (replicated)
  parameters whose gradients are already averaged (DataParallel / DDP).
- ShardingStage2/3 also shard gradients / parameters, which live in the model: they are applied by
  `parallelize(model, optimizer, config={"dp_config": {"sharding_level": 2 or 3}})` with FSDP2.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from .mesh import ProcessMesh, get_mesh


@dataclass(frozen=True)
class _ShardingStage:
    """Which mesh dimension the sharding spans (default: the mesh's first) on which mesh
    (default: the global mesh from set_mesh)."""

    sharding_mesh_dim: str | int | None = None
    mesh: ProcessMesh | None = None

    level = 0

    def dp_group(self):
        mesh = self.mesh or get_mesh()
        if mesh is None:
            raise ValueError(
                f"{type(self).__name__}: no mesh; pass mesh=ProcessMesh(...) or call distcore.set_mesh(mesh) first"
            )
        dim = self.sharding_mesh_dim if self.sharding_mesh_dim is not None else 0
        name = dim if isinstance(dim, str) else mesh.dim_names[dim]
        return mesh.device_mesh.get_group(mesh_dim=name)


class ShardingStage1(_ShardingStage):
    level = 1


class ShardingStage2(_ShardingStage):
    level = 2


class ShardingStage3(_ShardingStage):
    level = 3


class ShardOptimizer:
    """A torch optimizer speaking Paddle's dialect too; every other attribute is the optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, sharding: _ShardingStage | None = None):
        self._inner_opt = optimizer
        self.sharding = sharding

    def step(self, *args, **kwargs):
        return self._inner_opt.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True):
        self._inner_opt.zero_grad(set_to_none=set_to_none)

    def clear_grad(self, set_to_zero: bool = True):
        """Paddle's clear_grad: zero the gradients (set_to_zero=False frees them instead)."""
        self._inner_opt.zero_grad(set_to_none=not set_to_zero)

    def get_lr(self) -> float:
        return self._inner_opt.param_groups[0]["lr"]

    def set_lr(self, value: float) -> None:
        for group in self._inner_opt.param_groups:
            group["lr"] = value

    def state_dict(self):
        return self._inner_opt.state_dict()

    def load_state_dict(self, state_dict):
        return self._inner_opt.load_state_dict(state_dict)

    def __getattr__(self, name):
        return getattr(self._inner_opt, name)

    def __repr__(self) -> str:
        return f"ShardOptimizer({self._inner_opt!r}, sharding={self.sharding})"


def shard_optimizer(optimizer: torch.optim.Optimizer, shard_fn: _ShardingStage | None = None) -> ShardOptimizer:
    """Shard `optimizer`'s states as `shard_fn` says (see the module docstring)."""
    if isinstance(optimizer, ShardOptimizer):
        optimizer = optimizer._inner_opt
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"shard_optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if shard_fn is None:
        return ShardOptimizer(optimizer)
    if not isinstance(shard_fn, _ShardingStage):
        raise TypeError(f"shard_optimizer: shard_fn must be ShardingStage1/2/3(...), got {shard_fn!r}")
    if shard_fn.level > 1:
        raise ValueError(
            f"shard_optimizer: {type(shard_fn).__name__} shards gradients{' and parameters' if shard_fn.level == 3 else ''}, "
            "which belong to the model: use parallelize(model, optimizer, config={'dp_config': "
            f"{{'sharding_level': {shard_fn.level}}}}}) (FSDP2 underneath)"
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            "shard_optimizer: ShardingStage1 on tensor-parallel (DTensor) parameters is applied by "
            "parallelize(model, optimizer, config={'dp_config': {'sharding_level': 1}, ...}); torch's "
            "ZeroRedundancyOptimizer handles replicated parameters only"
        )
    return ShardOptimizer(_zero_redundancy(optimizer, shard_fn.dp_group()), sharding=shard_fn)


def _zero_redundancy(optimizer: torch.optim.Optimizer, group) -> ZeroRedundancyOptimizer:
    """The same optimizer class, hyper-parameters and param groups, each rank owning a share of the states."""
    groups = optimizer.param_groups
    # Groups carry keys their constructor does not take (AdamW's decoupled_weight_decay): keep its own.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    hyper = {k: v for k, v in groups[0].items() if k != "params" and k in accepted}
    zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=type(optimizer), process_group=group, **hyper)
    for extra in groups[1:]:
        zero.add_param_group(dict(extra))
    return zero
