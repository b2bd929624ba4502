"""Evaluations on some ranks only, of a model whose forward needs every rank.

DDP scripts evaluate on rank 0 alone (`if rank == 0: evaluate(model)`, `model.generate(...)` for a sample): each rank
holds the whole model, so its forward needs no other rank. Parallelised with sharded parameters (FSDP2 at sharding
level 1 to 3) or with tensor, expert or pipeline parallel, the forward gathers or exchanges them with every rank:
rank 0 alone would wait in its first collective for ranks that never come, or pair it with their next training
collectives (a hang, or mixed-up parameters). So each evaluation's first forward (the first under no_grad after a
forward under grad mode, or ever; generate's many forwards meet once) first meets the other ranks in the process
group's store (`env.every_rank_calls`), where no collective can pair with it: a rank left alone logs why after a
minute and raises at the process group's timeout, naming the absent ranks. The ranks met are those of the forward:
one replica's (its tensor-parallel ranks, its pipeline stages) where data parallel keeps replicas (sharding level 0),
so that one replica may evaluate alone, as under DDP; a model whose forward needs no other rank (replicas alone) is
left as it is.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from . import env

__all__ = ["guard_evaluations", "ranks_of_the_forward"]

_FIX = ("the model's forward needs these ranks (its parameters are sharded over them, or split by tensor, expert or "
        "pipeline parallel): evaluate on every rank (each replica its own share of the batches), not under "
        "`if rank == 0:`; with sharding_level 0 and no ep, one replica (its tp ranks and pipeline stages) may "
        "evaluate alone")


def ranks_of_the_forward(model: torch.nn.Module, mesh, *, pipeline: bool, expert_parallel: bool,
                         replicated_dp: bool) -> list[int] | None:
    """The ranks the parallelised model's forward communicates with (this rank's replica of the mesh where data
    parallel keeps replicas, else the whole mesh), or None where it communicates with none: no pipeline stages,
    no experts spread over ranks and no parameter sharded over more than one rank (FSDP2's shards, tensor
    parallel's splits)."""
    if not (pipeline or expert_parallel or any(
            isinstance(p, DTensor) and any(placement.is_shard() and p.device_mesh.size(dim) > 1
                                           for dim, placement in enumerate(p.placements))
            for p in model.parameters())):
        return None
    if replicated_dp and not expert_parallel and "dp" in mesh.dim_names:
        return sorted(mesh.get_mesh_with_dim("dp", mesh.coordinate()[mesh.dim_index("dp")]).process_ids)
    return sorted(mesh.process_ids)


def guard_evaluations(model: torch.nn.Module, ranks: list[int]) -> None:
    """Makes each evaluation's first forward meet `ranks` first (module docstring; `ranks_of_the_forward`): a
    forward pre-hook on the model, run before the others, which keeps whether its last forward ran under no_grad."""
    state = {"evaluating": False}

    def meet_at_each_evaluation(module, args):
        if torch.compiler.is_compiling():
            return None
        evaluating = not torch.is_grad_enabled()
        if evaluating and not state["evaluating"]:
            env.every_rank_calls("a forward under no_grad (an evaluation)", ranks=ranks, fix=_FIX)
        state["evaluating"] = evaluating
        return None

    # prepend: ahead of FSDP2's own pre-forward hook, whose all-gather is the first collective
    model.register_forward_pre_hook(meet_at_each_evaluation, prepend=True)
