"""Run one module on DTensors inside a model that otherwise computes on local tensors.

The module's inputs enter as DTensors (its hidden states with a given placement, other floating-point
tensors Replicate; integers and booleans stay plain), its parameters are DTensors already, and its
outputs leave as local tensors again: the first with the entry placement, the others Replicate. DTensor
then propagates shardings through the module's own code and inserts the collectives it needs (a mean
over a split dim becomes a partial sum and an all-reduce). Used by the global view (a whole decoder
block, global_view.py) and by the DistributedNorm style (a norm over a dim tensor parallel splits).

Tensors the module's code creates (a mask, positions, `torch.arange`) are plain: the forward runs under
torch's `implicit_replication` (plain tensors count as replicated), and tensors saved for the backward
are saved as Replicate DTensors (a saved-tensor hook), because the backward runs outside that context.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils._pytree import tree_map

from .sequence_layout import map_first_activation


def replicate_parameters(module: torch.nn.Module, tp_mesh, *, recurse: bool) -> None:
    """Every parameter of `module` (and of its submodules with `recurse`) that is not a DTensor yet becomes a
    Replicate DTensor on `tp_mesh`, whose gradient DTensor reduces where it was computed on shards (Partial)."""
    for owner in module.modules() if recurse else [module]:
        for pname, param in list(owner.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                whole = distribute_tensor(param.detach(), tp_mesh, [Replicate()])
                owner.register_parameter(pname, torch.nn.Parameter(whole, requires_grad=param.requires_grad))


def install_dtensor_boundary(module: torch.nn.Module, tp_mesh, *, entry_placement, modes: tuple = ()) -> None:
    """Inputs in as DTensors (the hidden states with `entry_placement`, a list of one placement), outputs
    out as local tensors; the contexts live for the module's forward, with one of each of `modes` (context
    factories: a TorchFunctionMode class, say) entered last."""
    contexts: list = []

    def save_as_dtensor(tensor: torch.Tensor):
        if isinstance(tensor, DTensor):
            return tensor
        return DTensor.from_local(tensor, tp_mesh, [Replicate()], run_check=False)

    def enter(module, args, kwargs):
        def wrap(x, placement):
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or not x.is_floating_point():
                return x  # integers and booleans (positions, masks) stay plain: implicitly replicated
            return DTensor.from_local(x, tp_mesh, placement, run_check=False)

        args, kwargs = map_first_activation(args, kwargs, lambda x: wrap(x, entry_placement))
        args = tuple(tree_map(lambda x: wrap(x, [Replicate()]), list(args)))
        kwargs = tree_map(lambda x: wrap(x, [Replicate()]), kwargs)
        for context in (implicit_replication(), torch.autograd.graph.saved_tensors_hooks(save_as_dtensor, _identity),
                        *(mode() for mode in modes)):
            context.__enter__()
            contexts.append(context)
        return args, kwargs

    def leave(module, args, output):
        while contexts:
            contexts.pop().__exit__(None, None, None)
        if output is None:  # the forward raised: the error goes on
            return None
        first = [True]

        def local(x):
            if not isinstance(x, DTensor):
                return x
            placement = entry_placement if first[0] else [Replicate()]
            first[0] = False
            return x.redistribute(tp_mesh, placement).to_local()

        return tree_map(local, output)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, always_call=True)


def _identity(tensor):
    return tensor


def saved_as_they_are():
    """Within the module's forward: tensors saved for the backward kept as they are (plain local tensors of a
    computation on shards), not taken for replicated DTensors."""
    return torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
