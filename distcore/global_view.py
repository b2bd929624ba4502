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

The boundary (inputs in as DTensors, outputs out as local tensors, plain tensors the code creates taken
as replicated) is dtensor_region.install_dtensor_boundary. CPU attention
(`_scaled_dot_product_flash_attention_for_cpu`) has no DTensor sharding rule in torch; one is
registered here (batch- or head-sharded, or replicated). Attention with dropout takes torch's math path,
which DTensor cannot run (it builds a causal mask as a plain tensor and fails on the mix, or on a view):
`_LocalAttention` runs such a call on each rank's own heads or batch rows, as local view does.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.parallel import parallelize_module
from torch.overrides import TorchFunctionMode

from .dtensor_region import install_dtensor_boundary, replicate_parameters, saved_as_they_are
from .lora import is_lora_layer
from .random_state import ShardedRegionRandomState
from .sequence_layout import SEQUENCE_DIM
from .tensor_parallel import (
    ColWiseParallel,
    PrepareLayerInput,
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelEnd,
    StyleTarget,
    TensorParallelPlan,
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


class _LocalAttention(TorchFunctionMode):
    """Within a block in global view: `F.scaled_dot_product_attention` with dropout runs on each rank's local
    shards (`attention_on_local_shards`, its dropout on split heads or rows from `random_state`'s stream of this
    rank); every other call, and attention without dropout, as DTensor runs it."""

    def __init__(self, random_state: ShardedRegionRandomState | None = None):
        super().__init__()
        self.random_state = random_state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is F.scaled_dot_product_attention and _dropout_p(args, kwargs) > 0.0
                and any(isinstance(t, DTensor) for t in args[:3])):
            return attention_on_local_shards(*args, **kwargs, random_state=self.random_state)
        return func(*args, **kwargs)


def _dropout_p(args, kwargs) -> float:
    return float(args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0))


def attention_on_local_shards(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, *, random_state: ShardedRegionRandomState | None = None):
    """`F.scaled_dot_product_attention` of DTensors on one 1-D mesh (plain tensors among them count as replicated),
    computed by each rank on its own batch rows or heads ([batch, heads, seq, dim]: attention is independent per
    each) and returned as a DTensor split alike. The split is the query's where it splits the batch or the heads
    and every input divides evenly over the ranks on that dim (key and value then move to it), else nothing is
    split (each rank computes the whole). A mask takes the split's slice where it does not broadcast over it.
    Dropout draws from this rank's generator: the tensor-parallel ranks' generators are kept alike
    (random_state.py), so replicated attention draws one mask on every rank; split attention draws from
    `random_state`'s stream of this rank where given (its heads' masks of their own, as in local view)."""
    mesh = next(t for t in (query, key, value) if isinstance(t, DTensor)).device_mesh
    split = _attention_split(query, key, value, mesh.size())

    def local_part(t):
        placed = t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        return placed.redistribute(mesh, [split]).to_local()

    q, k, v = (local_part(t) for t in (query, key, value))
    mask = _mask_slice(attn_mask, query.dim(), split, mesh)
    own_stream = random_state.region() if random_state is not None and isinstance(split, Shard) else nullcontext()
    with saved_as_they_are(), own_stream:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale, enable_gqa=enable_gqa)
    return DTensor.from_local(out, mesh, [split], run_check=False)


def _attention_split(query, key, value, ranks: int):
    placement = query.placements[0] if isinstance(query, DTensor) else Replicate()
    if not (isinstance(placement, Shard) and placement.dim in (0, 1) and query.dim() == 4):
        return Replicate()
    dim = placement.dim
    if all(t.dim() == 4 and t.shape[dim] % ranks == 0 for t in (query, key, value)):
        return placement
    return Replicate()


def _mask_slice(mask, dims: int, split, mesh):
    """This rank's part of an attention mask (a plain tensor: the whole mask) for `split`: the mask itself where
    nothing is split or it broadcasts over the split dim (its dims align with the query's from the right)."""
    if isinstance(mask, DTensor):
        mask = mask.full_tensor()
    if mask is None or not isinstance(split, Shard):
        return mask
    mask_dim = split.dim - (dims - mask.dim())
    if mask_dim < 0 or mask.shape[mask_dim] == 1:
        return mask
    size = mask.shape[mask_dim] // mesh.size()
    return mask.narrow(mask_dim, mesh.get_local_rank() * size, size)


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
                if is_lora_layer(target.module):
                    raise NotImplementedError(
                        f"parallelize: {name!r} is a LoRA layer inside a block that runs in global view; LoRA layers run "
                        "in local view only (DTensor's split does not reach their adapters): use a strategy without "
                        "tensor parallel for this model")
                parallelize_module(target.module, tp_mesh, style.torch_style(target, local_output=False))
            # SequenceParallelDisable / Enable: DTensor moves the activations between shardings itself.
        changes += [f"{name}: {style!r} (global view)" for style in styles]
    replicate_parameters(block, tp_mesh, recurse=True)  # norm weights, biases: gradients reduced where computed on shards
    block.register_forward_pre_hook(functools.partial(_caches_take_whole_tensors, tp_mesh=tp_mesh), with_kwargs=True)
    install_dtensor_boundary(block, tp_mesh, entry_placement=[Shard(SEQUENCE_DIM)] if sequence_split else [Replicate()],
                             modes=(functools.partial(_LocalAttention, ShardedRegionRandomState(
                                 tp_mesh.get_local_rank(), torch.device(tp_mesh.device_type))),))
    return changes


def _caches_take_whole_tensors(module, args, kwargs, *, tp_mesh):
    """A key/value cache passed to the block (transformers' Cache: `past_key_values`, which Hugging Face
    models fill in training too) meets DTensors in global view, and its plain tensors cannot join them
    (`torch.cat` of its empty start with a DTensor fails): the block gets a view of the cache that stores
    whole (gathered) keys and values, as one device's cache holds them, and returns Replicate DTensors."""
    if not any(_is_cache(value) for value in kwargs.values()):
        return None
    return args, {key: _GatheringCache(value, tp_mesh) if _is_cache(value) else value for key, value in kwargs.items()}


def _is_cache(value) -> bool:
    return callable(getattr(value, "update", None)) and type(value).__name__.endswith("Cache")


class _GatheringCache:
    """A cache seen from a block in global view: `update` stores and returns whole tensors; everything else
    is the cache's own."""

    def __init__(self, cache, tp_mesh):
        self._cache, self._tp_mesh = cache, tp_mesh

    def update(self, key_states, value_states, *args, **kwargs):
        whole = [t.full_tensor() if isinstance(t, DTensor) else t for t in (key_states, value_states)]
        keys, values = self._cache.update(*whole, *args, **kwargs)
        return tuple(DTensor.from_local(t, self._tp_mesh, [Replicate()], run_check=False) for t in (keys, values))

    def __getattr__(self, name):
        return getattr(self._cache, name)


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
