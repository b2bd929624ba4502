"""Gradient clipping by the whole model's norm, under any strategy distcore applies.

`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` is right for one device and for FSDP2 alone.
On a model distcore distributed it is not: under pipeline parallel a rank holds its own stages' parameters
only, so it clips by its stages' norm (silently: every stage scales by another factor), and where parameters
live on several device meshes (dp x tp: the norms on the dp mesh, the projections on dp x tp; expert parallel's
experts on their own mesh) torch stacks DTensors of different meshes and fails.

`clip_grad_norm_(model, max_norm)` computes what one device computes: each gradient's contribution from its
local values, summed (the maximum for the inf-norm) over the mesh dimensions that shard it, then over the
pipeline's stages, with a weight tied across stages (an embedding and its LM head) counted once. Collectives:
one per distinct (mesh, sharded dimensions) pair and mesh dimension, then one over the pipeline group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from .api import local_value

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


def clip_grad_norm_(model: torch.nn.Module, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of `model` (in place) so that their total `norm_type`-norm is at most `max_norm`,
    the norm taken over the whole model as on one device; returns that norm (a plain fp32 tensor, equal on
    every rank). `model`: the model `parallelize` or `to_distributed` returned (the pipeline's stages and its
    tied copies are found from it); a model on one device works as well."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"clip_grad_norm_: pass the model (its pipeline stages and tied weights are found from it), "
                        f"not {type(model).__name__}; torch.nn.utils.clip_grad_norm_ takes parameters")
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
    runner = getattr(model, "_tridist_pipeline", None)
    counted_elsewhere = runner.tied.copies_counted_elsewhere if runner is not None else set()
    # Every parameter that trains, with a gradient or not (a rank's unused parameter must still take part in its
    # mesh's reduction: the ranks of one mesh run the same collectives, in parameter order)
    params = [p for name, p in model.named_parameters() if p.requires_grad and name not in counted_elsewhere]
    device = local_value(params[0]).device if params else torch.device("cpu")
    inf = math.isinf(norm_type)
    combine = torch.maximum if inf else torch.add  # the contributions of two sets of elements
    total = torch.zeros((), dtype=torch.float32, device=device)
    by_reduction: dict[tuple, torch.Tensor] = {}  # (mesh, sharded mesh dims) -> their local contributions
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):  # pending sums
            grad = grad.redistribute(placements=[Replicate() if isinstance(p, Partial) else p for p in grad.placements])
        part = (torch.zeros((), dtype=torch.float32, device=device) if grad is None
                else torch.linalg.vector_norm(local_value(grad), norm_type, dtype=torch.float32))
        part = part if inf else part ** norm_type
        if isinstance(param, DTensor):
            # (_StridedShard, FSDP2's placement over a tp split, is no Shard to is_shard())
            sharded = tuple(dim for dim, p in enumerate(param.placements) if not p.is_replicate())
            if sharded:
                key = (param.device_mesh, sharded)
                kept = by_reduction.get(key)
                by_reduction[key] = part if kept is None else combine(kept, part)
                continue
        total = combine(total, part)  # replicated: every rank holds all of it
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    for (mesh, dims), part in by_reduction.items():  # the same order on the ranks of one mesh (parameter order)
        for dim in dims:
            dist.all_reduce(part, op=op, group=mesh.get_group(dim))
        total = combine(total, part)
    if runner is not None and dist.get_world_size(runner.pp_group) > 1:  # every stage's parameters
        dist.all_reduce(total, op=op, group=runner.pp_group)
    norm = total if inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is {norm.item()}; "
                           "pass error_if_nonfinite=False to clip anyway")
    coefficient = torch.clamp(max_norm / (norm + _EPS), max=1.0)
    with torch.no_grad():
        locals_ = [local_value(p.grad) for p in model.parameters() if p.grad is not None]  # tied copies too
        if locals_:
            torch._foreach_mul_(locals_, coefficient.to(locals_[0].device))
    return norm
