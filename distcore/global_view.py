"""Global view: a decoder block whose code is not written for local shards runs on DTensors.

Paddle's auto-parallel keeps every tensor's global view: model code written for one device runs
unchanged, `q.reshape(b, s, N_HEADS, -1)` included. For a block that fails the local-view check
(block_check.py), the block's tensors are DTensors with global shapes: its split Linears keep their
outputs as DTensors (torch's `use_local_output=False`), every other parameter is a Replicate DTensor,
and the block's inputs enter as DTensors (the hidden states Shard(1) on sequence slices, else
Replicate) and leave as local tensors again, so the rest of the model keeps its local view. DTensor
propagates the shardings through reshapes, transposes and attention; the matmuls stay split (a
global-view block costs DTensor's dispatch and, under sequence parallel, one all-gather per
projection instead of one per region).

Tensors the block's code creates (a mask, positions, `torch.arange`) are plain: the forward runs
under torch's `implicit_replication` (plain tensors count as replicated), and tensors saved for the
backward are saved as Replicate DTensors (a saved-tensor hook), because the backward runs outside
that context. CPU attention (`_scaled_dot_product_flash_attention_for_cpu`) has no DTensor sharding
rule in torch; one is registered here (batch- or head-sharded, or replicated).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication, register_sharding
from torch.distributed.tensor.parallel import parallelize_module

from .tensor_parallel import (
    _SEQUENCE_DIM,
    ColWiseParallel,
    PrepareLayerInput,
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelEnd,
    StyleTarget,
    TensorParallelPlan,
    _map_first_activation,
)

_aten = torch.ops.aten


# Attention is independent per batch row and per head ([batch, heads, seq, dim]): q, k, v (backward:
# grad, out and logsumexp too) all sharded on dim 0, all on dim 1, or all replicated. The placements list
# what the call passed, in order (torch counts them): non-tensors (dropout_p, is_causal, scale) None. An
# attention mask is a keyword argument, which DTensor's dispatch passes on as it is (it redistributes
# positional arguments only): a split is offered only where the mask, as placed, fits it (replicated and
# broadcast over the split dim, or split alike).
@register_sharding(_aten._scaled_dot_product_flash_attention_for_cpu.default)
def _cpu_attention(query, key, value, *rest, **kwargs):
    # outputs: (out, logsumexp [batch, heads, seq])
    return [([p, p], [p, p, p, *others]) for p, others in _attention_splits(query, rest, kwargs)]


@register_sharding(_aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _cpu_attention_backward(grad_out, query, key, value, out, logsumexp, *rest, **kwargs):
    # outputs: grad q, k, v
    return [([p, p, p], [p] * 6 + others) for p, others in _attention_splits(query, rest, kwargs)]


def _attention_splits(query, rest, kwargs):
    mask = kwargs.get("attn_mask")
    placed = getattr(mask, "placements", (Replicate(),))[0] if hasattr(mask, "shape") else None
    for split in (Replicate(), Shard(0), Shard(1)):
        fits = placed is None or _mask_placement(mask, query, split) == placed
        if fits:
            yield split, [None] * len(rest) + [placed if key == "attn_mask" else None for key in kwargs]


def _mask_placement(mask, query, split):
    """The mask's placement for a split of the attention: replicated where it broadcasts over the split
    dim (or nothing is split), else split alike."""
    if not isinstance(split, Shard) or len(mask.shape) != len(query.shape) or mask.shape[split.dim] == 1:
        return Replicate()
    return split


def apply_global_view(block: torch.nn.Module, plan: TensorParallelPlan, *, tp_mesh, process_mesh,
                      sequence_split: bool) -> list[str]:
    """Apply the block's part of the plan (`plan.within(block_name)`) in global view. `sequence_split`:
    the block receives (and must return) sequence slices."""
    modules = dict(block.named_modules())
    changes = []
    for name, styles in plan.styles.items():
        target = StyleTarget(name, modules[name], modules.get(name.rpartition(".")[0]) if name else None,
                             tp_mesh=tp_mesh, process_mesh=process_mesh,
                             scatter_sequence=sequence_split and name.rpartition(".")[0] in plan.disabled)
        for style in styles:
            if isinstance(style, (PrepareLayerInput, PrepareLayerOutput)):
                style.apply(target)  # hooks: the same in either view
            elif isinstance(style, (SequenceParallelBegin, SequenceParallelEnd)):
                raise NotImplementedError(
                    f"parallelize: {type(style).__name__} on {name!r} inside a block that runs in global view; put "
                    "the sequence-parallel boundaries outside the decoder blocks (on the embedding and the LM head)"
                )
            elif isinstance(style, (ColWiseParallel, RowWiseParallel)):
                parallelize_module(target.module, tp_mesh, style.torch_style(target, local_output=False))
            # SequenceParallelDisable / Enable: DTensor moves the activations between shardings itself.
        changes += [f"{name}: {style!r} (global view)" for style in styles]
    _replicate_other_parameters(block, tp_mesh)
    _install_boundary(block, tp_mesh, sequence_split=sequence_split)
    return changes


def _replicate_other_parameters(block: torch.nn.Module, tp_mesh) -> None:
    """Norm weights, biases of row-parallel layers' neighbours, ...: Replicate DTensors, whose
    gradients DTensor reduces where they were computed on slices (Partial)."""
    for module in block.modules():
        for pname, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                replicated = distribute_tensor(param.detach(), tp_mesh, [Replicate()])
                module.register_parameter(pname, torch.nn.Parameter(replicated, requires_grad=param.requires_grad))


def refuse_recompute(model: torch.nn.Module, global_view: dict[str, str]) -> None:
    """Activation recompute (to_distributed's `apply_recompute`) re-runs a block's forward in backward,
    outside the forward hooks that hold the global view's contexts (implicit replication, saved tensors
    as DTensors), so it would fail on mixed tensors there: refused, before anything changes."""
    for name in global_view:
        mode = getattr(model.get_submodule(name), "_tridist_recompute", None)
        if mode:
            raise NotImplementedError(
                f"parallelize: {name!r} runs in global view under tensor parallel ({global_view[name]}), where "
                f"activation recompute ({mode!r}) cannot run: its recomputation happens outside the global view's "
                "DTensor context. Train this model with recompute 'none' under tensor parallel, or without tensor parallel"
            )


def refuse_overlap(global_view: dict[str, str]) -> None:
    """mp_config["overlap_comm"] fuses each sequence-parallel region's collectives into its local-view
    projections (overlap.py); a block in global view computes on DTensors and has no such edges, so it
    would run without overlap: refused, naming the blocks, before anything changes."""
    if global_view:
        name, reason = next(iter(global_view.items()))
        raise NotImplementedError(
            f"parallelize: mp_config['overlap_comm'] cannot apply to blocks that run in global view under tensor "
            f"parallel ({sorted(global_view)}; {name!r}: {reason}): the overlapped rings run on local shards. Leave "
            "overlap_comm off for this model"
        )


def _install_boundary(block: torch.nn.Module, tp_mesh, *, sequence_split: bool) -> None:
    """Inputs in as DTensors, outputs out as local tensors; the contexts live for the block's forward."""
    entry_placement = [Shard(_SEQUENCE_DIM)] if sequence_split else [Replicate()]
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

        args, kwargs = _map_first_activation(args, kwargs, lambda x: wrap(x, entry_placement))
        args = tuple(torch.utils._pytree.tree_map(lambda x: wrap(x, [Replicate()]), list(args)))
        kwargs = torch.utils._pytree.tree_map(lambda x: wrap(x, [Replicate()]), kwargs)
        for context in (implicit_replication(), torch.autograd.graph.saved_tensors_hooks(save_as_dtensor, _identity)):
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

        return torch.utils._pytree.tree_map(local, output)

    block.register_forward_pre_hook(enter, with_kwargs=True)
    block.register_forward_hook(leave, always_call=True)


def _identity(tensor):
    return tensor
