"""shard_optimizer and the sharding stages, on torch's optimizers.

- No shard_fn: torch optimizers already keep their states like the parameters (a DTensor parameter
  sharded over a mesh gets sharded states), which is Paddle's behaviour; the optimizer only gains
  Paddle's `clear_grad`, `get_lr` and `set_lr` (it stays a torch Optimizer: schedulers work).
- ShardingStage1 (optimizer states sharded over the data-parallel ranks): torch's
  ZeroRedundancyOptimizer over the mesh dimension's process group, for plain (replicated)
  parameters whose gradients are already averaged (DataParallel / DDP).
- ShardingStage2/3 also shard gradients / parameters, which live in the model: they are applied by
  `parallelize(model, optimizer, config={"dp_config": {"sharding_level": 2 or 3}})` with FSDP2.

Optimizers parallelize was not given: parallelize (and to_distributed) replace the model's parameters by
distributed ones and rebuild the optimizer they are given in place; a second optimizer built before (Muon for the
matrices beside AdamW for the rest, a head's own) still holds the replaced ones, which no forward uses: its
steps would train nothing, silently. Each replaced parameter is marked with its replacement (`mark_replaced`),
`shard_optimizer(optimizer)` takes the replacements into such an optimizer's groups (in place, as parallelize
does; another pipeline stage's parameters leave them), and a step of an optimizer that still holds a replaced
parameter raises, naming them and that fix (a step pre-hook on every torch optimizer, registered when this
module is imported: a few attribute lookups per parameter and step). The same hook drops the gradients of
parameters no data-parallel rank used (unused_parameters.py), whichever optimizer steps them.

shard_tensor(parameter) returns a new parameter, which the caller assigns in the old one's place (Paddle's
`layer.weight = dist.shard_tensor(layer.weight, ...)`); an optimizer built before still holds the old one. The
old parameter is marked with its replacement too (`mark_resharded`), but the step refuses it only where the
backward has shown the mistake: the old parameter got no gradient and its replacement did (a caller who keeps
training the old one, the new a copy for something else, is left alone). shard_optimizer does not swap these:
only the step's evidence says which of the two the model trains.
"""

from __future__ import annotations

import inspect
import types
import weakref
from dataclasses import dataclass

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
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


def _clear_grad(self, set_to_zero: bool = True) -> None:
    """Paddle's clear_grad: zero the gradients (set_to_zero=False frees them instead)."""
    self.zero_grad(set_to_none=not set_to_zero)


def _get_lr(self) -> float:
    return self.param_groups[0]["lr"]


def _set_lr(self, value: float) -> None:
    for group in self.param_groups:
        group["lr"] = value


_PADDLE_METHODS = {"clear_grad": _clear_grad, "get_lr": _get_lr, "set_lr": _set_lr}


def with_paddle_methods(optimizer: torch.optim.Optimizer, sharding: "_ShardingStage | None" = None) -> torch.optim.Optimizer:
    """The optimizer itself, given Paddle's `clear_grad`, `get_lr` and `set_lr` (bound to it).

    It stays a torch Optimizer, so LR schedulers, GradScaler and checkpoint helpers keep working.
    """
    for name, method in _PADDLE_METHODS.items():
        setattr(optimizer, name, types.MethodType(method, optimizer))
    optimizer.sharding = sharding
    return optimizer


@dataclass(frozen=True)
class _Replaced:
    """On a parameter parallelize or shard_tensor replaced: a name for it (the model's, under parallelize) and its
    replacement (None where it lives on another pipeline stage), held weakly (the old parameter must not keep the
    model's alive)."""

    name: str
    replacement: "weakref.ref | None"
    by_shard_tensor: bool = False  # refused only once the backward shows the replacement trains instead


def mark_resharded(old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
    """shard_tensor made `new` from the parameter `old` (see the module docstring)."""
    old._tridist_replaced = _Replaced(f"a {tuple(old.shape)} parameter passed to shard_tensor", weakref.ref(new),
                                      by_shard_tensor=True)


def _left_behind(param: torch.nn.Parameter) -> bool:
    """Whether the backward trained shard_tensor's replacement of this parameter instead of it: it got no
    gradient, and its replacement did."""
    replacement = param._tridist_replaced.replacement()
    return param.grad is None and replacement is not None and replacement.grad is not None


def mark_replaced(params_before: dict[int, torch.nn.Parameter], names_before: dict[int, list[str]],
                  model: torch.nn.Module) -> None:
    """Mark each parameter of `params_before` (id -> parameter, before parallelize) that `model` no longer holds
    with its replacement (the parameter of its name now), for shard_optimizer and the step check below."""
    now = dict(model.named_parameters(remove_duplicate=False))
    kept = {id(param) for param in now.values()}
    for key, param in params_before.items():
        if key in kept:
            continue
        names = names_before[key]
        replacement = next((now[name] for name in names if name in now), None)
        param._tridist_replaced = _Replaced(names[0], weakref.ref(replacement) if replacement is not None else None)


def _take_replacements(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's groups hold the replacements of parameters parallelize replaced (another stage's leave)."""
    if not any(hasattr(p, "_tridist_replaced") and not p._tridist_replaced.by_shard_tensor
               for group in optimizer.param_groups for p in group["params"]):
        return
    if len(optimizer.state):
        raise ValueError("shard_optimizer: the optimizer already has state for parameters parallelize replaced; "
                         "build it from the distributed model's parameters instead")
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            replaced = getattr(param, "_tridist_replaced", None)
            if replaced is None or replaced.by_shard_tensor:
                params.append(param)
            elif replaced.replacement is not None and replaced.replacement() is not None:
                params.append(replaced.replacement())
        group["params"] = params


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Every torch optimizer's step pre-hook: refuse replaced parameters, then drop the gradients of parameters
    no data-parallel rank used (unused_parameters.py)."""
    from .unused_parameters import drop_unused_gradients_before_step  # (it imports api, which imports this module)

    params = [p for group in optimizer.param_groups for p in group["params"]]
    _refuse_replaced_parameters(params, optimizer)
    _refuse_gathered_copies(params, optimizer)
    drop_unused_gradients_before_step(params)


def _refuse_gathered_copies(params: list, optimizer: torch.optim.Optimizer) -> None:
    gathered = sum(1 for p in params if getattr(p, "_tridist_gathered_copy", False))
    if gathered:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): this optimizer holds {gathered} parameter(s) that are FSDP2's gathered "
            "compute copies, not the sharded parameters data parallel trains: model.parameters() yields them between a "
            "forward and the next backward (after an evaluation, until a training step), and they never get a "
            "gradient, so its steps would train nothing. Build the optimizer before evaluating, or reshard first: "
            "for m in model.modules(): getattr(m, 'reshard', lambda: None)()")


def _refuse_replaced_parameters(params: list, optimizer: torch.optim.Optimizer) -> None:
    held = [p for p in params if hasattr(p, "_tridist_replaced")]
    resharded = [p._tridist_replaced.name for p in held if p._tridist_replaced.by_shard_tensor and _left_behind(p)]
    if resharded:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): this optimizer holds {len(resharded)} parameter(s) that shard_tensor "
            f"replaced ({resharded[:4]}{' ...' if len(resharded) > 4 else ''}): they got no gradient and their "
            "replacements did, so its steps would train nothing. Build the optimizer after sharding the model's "
            "parameters (from model.parameters() then)")
    replaced = [p._tridist_replaced.name for p in held if not p._tridist_replaced.by_shard_tensor]
    if replaced:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): this optimizer holds {len(replaced)} parameter(s) that parallelize "
            f"(to_distributed) replaced by the distributed model's own ({replaced[:4]}{' ...' if len(replaced) > 4 else ''}): "
            "no forward uses them, so its steps would train nothing. Pass each optimizer built before through "
            "distcore.shard_optimizer(optimizer) after parallelizing (it takes the replacements in place), or build "
            "it afterwards from the returned model's parameters")


register_optimizer_step_pre_hook(_before_step)


def shard_optimizer(optimizer: torch.optim.Optimizer, shard_fn: _ShardingStage | None = None) -> torch.optim.Optimizer:
    """Shard `optimizer`'s states as `shard_fn` says (see the module docstring).

    Without shard_fn the same optimizer comes back (with Paddle's methods added). ShardingStage1
    returns a new ZeroRedundancyOptimizer: build LR schedulers on the returned optimizer. Parameters that
    parallelize replaced (an optimizer it was not given) are replaced in its groups first.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"shard_optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _take_replacements(optimizer)
    if shard_fn is None:
        return with_paddle_methods(optimizer)
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
    if len(optimizer.state):
        raise ValueError("shard_optimizer: the optimizer already has state; shard it before the first step")
    return with_paddle_methods(_zero_redundancy(optimizer, shard_fn.dp_group()), sharding=shard_fn)


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
