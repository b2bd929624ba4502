"""Tensor parallelism from Paddle's `mp_config={"parallelize_plan": {...}}`, on torch's parallelize_module.

Plan keys are Paddle's: a regular expression fully matching module names
(`llama.layers.*.mlp.up_proj`), or a parameter name ending in `.weight`/`.bias`, which means its owning
Linear/Embedding. Values are a style or a list of styles. A key that matches nothing is reported with
the nearest module names (a warning; an error with `mp_config["strict"] = True`): the seed's own
example names modules its model lacks.

The plan is resolved against the model once (`resolve_plan` -> TensorParallelPlan: every key matched
to real module names, each module's sequence-parallel context worked out), then applied.

Local view (Megatron's, the fast one): Linear outputs stay local (torch's default), and attention
modules whose q/k/v projections are split get their head counts divided (`num_heads`,
`num_key_value_heads`, ...), so `reshape(b, s, self.num_heads, d)` sees the local heads. Embeddings
give full (replicated) outputs, so norms are unchanged (one split on its vocabulary sums the ranks' lookups:
vocab_embedding.py). Code not written for that (a module-level
head count in a reshape) would compute wrong numbers: each decoder-block type is checked first
(block_check.py), and a block whose local view differs from one device runs in global view
(global_view.py: DTensors with global shapes, as Paddle does).

Packed projections (`qkv_proj` = [q | k | v], `gate_up_proj` = [gate | up], see _PACKED_PARTS) are split
part by part: a rank's output holds its share of q, of k and of v, so `q, k, v = qkv.chunk(3, -1)` (or
slices at the local sizes) in model code gives its local heads. Equal parts: the weight is a DTensor
`_StridedShard(0, split_factor=parts)`. Unequal parts (q/k/v with grouped-query heads): the weight is
split on its input features and a reduce-scatter forms each rank's parts (UnequalPackedColwise). Either
way its global value (state_dict, unshard_dtensor, checkpoints) stays the single-device layout.

A bare weight parameter (Paddle's LlamaLMHead `x @ weight`, the to_distributed seed's root `weight`)
under ColWiseParallel is split on its vocabulary dim; the forward runs in a global view that gives
vocabulary-parallel logits and a vocabulary-parallel cross entropy (see vocab_parallel.py).

Sequence parallel (SequenceParallelBegin/End/Disable/Enable) splits activations on the sequence dim
between its boundaries (see the section below). The split is taken at the first parameterised module
of the region to run after the Begin module (the first decoder block), so model code in between
that builds masks or positions from the embedding output (Hugging Face does) sees the whole sequence.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel, parallelize_module

from tridist.autotune.model import readable_attr
from tridist.kernels.comm_matmul import BACKENDS, _group_by_name, check_backend_available
from tridist.kernels.fuse import forward_takes

from .dtensor_region import install_dtensor_boundary, replicate_parameters
from .lora import is_lora_layer, lora_adapters, refuse_trainable_tokens
from .linear_like import TransposedColwise, TransposedRowwise, features, is_conv1d, is_linear_like, weight_out_dim
from .overlap import OverlappedRegion, apply_overlapped_entry, apply_overlapped_exit
from .packed import PackedColwiseParallel, UnequalPackedColwise, SumBothWays, check_units, packed_colwise, unit_span
from .random_state import ShardedRegionRandomState
from .sequence_layout import (SEQUENCE_DIM, first_activation, first_output, gather_sequence, map_first_activation,
                              map_output, split_sequence)
from .vocab_embedding import split_embedding_vocabulary
from .vocab_parallel import split_bare_weight

log = logging.getLogger(__name__)



@dataclass
class StyleTarget:
    """Where a style is applied in local view: the module (its name and parent), the meshes, and its
    place in the sequence-parallel region (worked out by the plan)."""

    name: str
    module: torch.nn.Module
    parent: torch.nn.Module | None
    tp_mesh: object  # the 1-D tensor-parallel DeviceMesh
    process_mesh: object  # the user's ProcessMesh (PrepareLayer* functions take it)
    in_region: bool = False  # strictly between SequenceParallelBegin and End
    # A Linear directly under a Disable module: a row-parallel one is the region's possible exit, and with
    # overlap_comm a column-parallel one is an entry fed by the region's overlapped all-gather.
    scatter_sequence: bool = False
    sequence_split: "SequenceSplit | None" = None
    overlap_comm: str | None = None  # mp_config["overlap_comm"]'s backend ("ring", "symm_mem"); None: off
    # The root's dropout stream of this rank between a column-parallel output and a row-parallel input.
    random_state: ShardedRegionRandomState | None = None


class _Style:
    """Base of Paddle's parallel styles: configuration (the plan's values) that applies itself to one
    module in local view (`apply`), as torch's ParallelStyle._apply does: a new style needs no change
    anywhere else. `global_view`: whether a block holding the style may run in global view instead (the
    block check's fallback, global_view.py); where not, `local_only` says why and what to do instead (the block
    check's refusal quotes it). `recomputable`: whether selective recompute, which re-runs the module's forward alone
    without its hooks, keeps what the style does (a repair on an attention module that does not is refused with it:
    to_distributed's `_swapped_around_recompute`)."""

    global_view = True
    local_only = ""
    recomputable = False

    def apply(self, target: StyleTarget) -> str:
        """Change `target.module` in place; returns a line for the log."""
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


@dataclass(repr=False)
class ColWiseParallel(_Style):
    """Split the output features (a Linear's columns; an Embedding's hidden dim; a bare [in, out]
    weight's columns, e.g. an LM head's vocabulary).

    `packed_parts` (a tridist extension): the projections a Linear packs along its output, each split
    separately: a count of equal parts, or each part's size (`(q, k, v)` widths with grouped-query heads,
    e.g. `(32 * 128, 8 * 128, 8 * 128)`). None infers it from the name (`qkv_proj`: q/k/v sized from the
    parent's head counts, its own or its `config`'s; `gate_up_proj`/`w13`: 2; else 1); `query_key_value`
    must say: 1 for a head-interleaved layout (GPT-NeoX's holds [q k v] per head, which a contiguous split
    keeps together), 3 for [q | k | v].

    `part_units` (with part sizes; local view): each part's count of indivisible units (heads, groups). A part with
    fewer units than the ranks, which must divide them, is computed whole on every rank and each rank keeps its
    unit, shared with tp / units ranks (a Mamba-2 mixer's B and C over n_groups where tp exceeds them).
    """

    gather_output: bool = False
    packed_parts: int | tuple[int, ...] | None = None
    part_units: tuple[int, ...] | None = None

    def torch_style(self, target: StyleTarget, *, local_output: bool = True) -> ParallelStyle:
        """torch's style for this split: local outputs (local view) or DTensors (global view)."""
        sizes = split_parts(target.name, target.module, self, target.tp_mesh.size(), parent=target.parent)
        if len(sizes) > 1:
            return packed_colwise(sizes, gather_output=self.gather_output, local_output=local_output,
                                  units=self.part_units, out_dim=weight_out_dim(target.module))
        if local_output and isinstance(target.module, torch.nn.Embedding):
            refuse_trainable_tokens(target.name, target.parent)
            return ColwiseParallel(output_layouts=Replicate())  # the hidden dim split, full embeddings out
        style = TransposedColwise if is_conv1d(target.module) else ColwiseParallel
        return style(output_layouts=Replicate() if self.gather_output else Shard(-1), use_local_output=local_output)

    def apply(self, target: StyleTarget) -> str:
        if is_lora_layer(target.module):
            return _split_lora(self, target)
        torch_style = self.torch_style(target)
        notes = [torch_style.describe()] if isinstance(torch_style, (PackedColwiseParallel, UnequalPackedColwise)) else []
        if target.overlap_comm and target.scatter_sequence:
            notes.append(apply_overlapped_entry(self, target, torch_style))
        else:
            parallelize_module(target.module, target.tp_mesh, torch_style)
        if is_linear_like(target.module):
            target.module._tridist_local_heads = not self.gather_output  # its output holds this rank's heads only
            if not self.gather_output:
                _open_sharded_region(target)
        return f"{target.name}: {self!r}" + (f" ({'; '.join(notes)})" if notes else "")


def _open_sharded_region(target: StyleTarget) -> None:
    """A column-parallel Linear's split output opens a sharded region: its dropout stream is this rank's."""
    if target.random_state is not None and target.parent is not None:
        target.module.register_forward_hook(target.random_state.enter)
        target.random_state.guard(target.parent)


@dataclass(repr=False)
class RowWiseParallel(_Style):
    """Split the input features (a Linear's rows; an Embedding's vocabulary).

    `inside_region` (a tridist extension): a projection inside its region whose whole output the region's own code
    goes on using (Mamba-1's x_proj: dt, B and C for every channel): all-reduced even in a sequence-parallel Disable
    region, whose exits reduce-scatter onto sequence shards."""

    is_input_parallel: bool = True
    inside_region: bool = False

    def _scatters(self, target: StyleTarget) -> bool:
        return target.scatter_sequence and not self.inside_region

    def torch_style(self, target: StyleTarget, *, local_output: bool = True) -> ParallelStyle:
        """torch's style for this split: local outputs (local view) or DTensors (global view)."""
        split_parts(target.name, target.module, self, target.tp_mesh.size(), parent=target.parent)
        if isinstance(target.module, torch.nn.Embedding):  # the vocabulary split: token ids in, full embeddings out
            return RowwiseParallel(input_layouts=Replicate(), use_local_output=local_output)
        # A Disable region's exit under sequence parallel: reduce-scatter straight onto sequence shards.
        style = TransposedRowwise if is_conv1d(target.module) else RowwiseParallel
        return style(input_layouts=Shard(-1) if self.is_input_parallel else Replicate(),
                     output_layouts=Shard(SEQUENCE_DIM) if self._scatters(target) else Replicate(),
                     use_local_output=local_output)

    def apply(self, target: StyleTarget) -> str:
        if is_lora_layer(target.module):
            return _split_lora(self, target)
        if isinstance(target.module, torch.nn.Embedding):  # the vocabulary split (vocab_embedding.py)
            refuse_trainable_tokens(target.name, target.parent)
            split_parts(target.name, target.module, self, target.tp_mesh.size(), parent=target.parent)
            return split_embedding_vocabulary(target.name, target.module, target.tp_mesh)
        if (target.random_state is not None and is_linear_like(target.module) and self.is_input_parallel
                and not self.inside_region):
            target.module.register_forward_pre_hook(target.random_state.leave)  # the sharded region closes
        if target.overlap_comm and self._scatters(target):
            how = apply_overlapped_exit(self, target, self.torch_style(target))
        else:
            parallelize_module(target.module, target.tp_mesh, self.torch_style(target))
            if not self._scatters(target):
                return f"{target.name}: {self!r}"
            how = "reduce-scatter onto sequence shards"
        target.module._tridist_scatters_sequence = True
        target.module.register_forward_hook(_remember_exit_output)
        return f"{target.name}: {self!r} ({how})"


def _split_lora(style: "ColWiseParallel | ReplicatedColWiseParallel | RowWiseParallel", target: StyleTarget) -> str:
    """A peft LoRA layer (lora.py) split with its projection, as Megatron-Core and NeMo split LoRA:

    - column-parallel: the base's output features and each adapter's B alike (packed parts too; key/value heads
      replicated over groups of ranks too: ReplicatedColWiseParallel), each A whole on every rank. A's output reaches
      this rank's columns of B only: B's split sums its input gradient over the tp ranks (as the base's), so A gets
      its whole gradient on every rank. The sharded region (this rank's dropout stream) opens
      after the layer: the adapters' dropout sees the input every rank holds and draws from the ranks' shared stream.
    - row-parallel: the base's and each A's input features alike, A's output summed over the tp ranks as the base's is
      (all-reduced; reduce-scattered onto sequence shards under sequence parallel: [tokens, r] more per layer), each B
      whole on every rank; under sequence parallel B runs on this rank's slice, so its gradient is summed over the tp
      ranks (ShardLocalParameters). The region closes after the layer: the dropout of this rank's features draws from
      its own stream.

    Refused: what `lora_adapters` refuses, a gathered output (a head), and an overlapped entry or exit (their rings
    compute the base's matmul fused with the sequence's all-gather or reduce-scatter)."""
    module, mesh = target.module, target.tp_mesh
    adapters = lora_adapters(target.name, module)
    column = not isinstance(style, RowWiseParallel)
    if column and getattr(style, "gather_output", False):
        raise NotImplementedError(f"parallelize: {target.name} is a LoRA layer split column-parallel with its output "
                                  "gathered (an LM head); leave the head out of the LoRA targets, or use a strategy "
                                  "without tensor parallel")
    if target.overlap_comm and target.scatter_sequence:
        raise NotImplementedError(f"parallelize: {target.name} is a LoRA layer, which overlap_comm's rings cannot feed "
                                  "(they compute its base's matmul alone); set overlap_comm off")
    # (the name kept: packed parts are read by it; the region's random state is the layer's, below)
    base = dataclasses.replace(target, module=module.base_layer, random_state=None)
    random_state = target.random_state if target.parent is not None else None
    if column:  # the base and each B as the style splits a Linear: its columns, or its replicated key/value heads
        for part in (module.base_layer, *(b for _, b in adapters)):
            style.apply(dataclasses.replace(base, module=part))
        for flag in ("_tridist_local_heads", "_tridist_head_replicas", "_tridist_chunk", "_tridist_kv_features"):
            if flag in vars(module.base_layer):  # what the attention reads of its projections
                setattr(module, flag, vars(module.base_layer)[flag])
        if random_state is not None:
            module.register_forward_pre_hook(random_state.leave)  # (a region q's output opened: k's input is shared)
            module.register_forward_hook(random_state.enter)
            random_state.guard(target.parent)
        return f"{target.name}: {style!r} (LoRA: base and B split alike, A whole)"
    scatters = style._scatters(target)
    parallelize_module(module.base_layer, mesh, style.torch_style(base))
    for a, b in adapters:
        parallelize_module(a, mesh, style.torch_style(dataclasses.replace(base, module=a)))
        if scatters:
            ShardLocalParameters().apply(dataclasses.replace(target, module=b))
    if random_state is not None and style.is_input_parallel:
        module.register_forward_hook(random_state.leave, always_call=True)
    summed = "reduce-scattered onto sequence shards" if scatters else "all-reduced"
    if scatters:
        module._tridist_scatters_sequence = True
        module.register_forward_hook(_remember_exit_output)
    return f"{target.name}: {style!r} (LoRA: base and A row-parallel, A's output {summed}, B whole)"


@dataclass(repr=False)
class PrepareLayerInput(_Style):
    """`fn(process_mesh)` returns a forward pre-hook for the layer (Paddle's semantics)."""

    fn: Callable

    def apply(self, target: StyleTarget) -> str:
        target.module.register_forward_pre_hook(self.fn(target.process_mesh))
        return f"{target.name}: input hook"


@dataclass(repr=False)
class PrepareLayerOutput(_Style):
    """`fn(process_mesh)` returns a forward hook for the layer."""

    fn: Callable

    def apply(self, target: StyleTarget) -> str:
        target.module.register_forward_hook(self.fn(target.process_mesh))
        return f"{target.name}: output hook"


@dataclass(repr=False)
class ReduceSharedOutputGradient(_Style):
    """The last `features` outputs of a module kept whole on every mp rank feed every local head unsplit
    (the rotary key of DeepSeek's latent attention: kv_a_proj_with_mqa's last qk_rope_head_dim outputs, one key
    for all heads): each rank's gradient of them covers its own heads only, so the backward sums it over the
    mp ranks (Megatron's copy-to-region, on those features alone; the others reach a column-parallel
    projection, whose input gradient is summed there). The forward is unchanged."""

    features: int

    def __post_init__(self):
        if not isinstance(self.features, int) or self.features <= 0:
            raise ValueError(f"ReduceSharedOutputGradient: features must be a positive count of trailing outputs, "
                             f"got {self.features!r}")

    def apply(self, target: StyleTarget) -> str:
        group_name, features = target.tp_mesh.get_group().group_name, self.features

        def hook(module, args, output):
            return _SumTrailingGradient.apply(output, features, group_name)

        target.module.register_forward_hook(hook)
        return f"{target.name}: gradient of its last {features} outputs summed over the mp ranks"


@dataclass(repr=False)
class SequenceSlicedRows(_Style):
    """A module whose keyword arguments hold a mask over the whole sequence (`mask`: [batch, seq]) and rows that the
    mask's positions select, one tensor or a list of them (`rows`: each [mask.sum(), features], in the mask's row-major
    order), which it adds to hidden states that sequence parallel splits: Qwen3-VL's (and Qwen3-VL-MoE's) text
    model adds its vision tower's deepstack features (`deepstack_visual_embeds`) to its first layers' outputs at
    the image and video tokens' positions (`visual_pos_masks`). On entry both become this rank's slice of the sequence
    (the contiguous part sequence parallel gives it) and the rows of its positions; each rows tensor's gradient is
    summed over the mp ranks (each rank's slice reaches its own rows), so that what computed them whole on every rank
    (the vision tower) gets the whole gradient on each. A list's entry i reaches the i-th of the module's decoder
    layers (`layers`, the attribute holding them): on a pipeline stage where those are another stage's stand-ins, whose
    zeros have the whole sequence's shape and whose sums no one uses, both stay whole. A sequence that the ranks do not
    divide is left whole too: the split itself refuses it, naming the fix."""

    mask: str
    rows: str
    layers: str

    def apply(self, target: StyleTarget) -> str:
        mesh, mask_name, rows_name, layers_name = target.tp_mesh, self.mask, self.rows, self.layers
        group_name = mesh.get_group().group_name

        def local(module, args, kwargs):
            mask, rows = kwargs.get(mask_name), kwargs.get(rows_name)
            if mask is None or rows is None or mask.shape[SEQUENCE_DIM] % mesh.size():
                return None
            if mask.dtype != torch.bool or mask.dim() != 2:  # (integers would index rows, not select positions)
                raise TypeError(f"parallelize: {target.name}'s {mask_name!r} must be a [batch, seq] bool mask for "
                                f"{self!r}, got {mask.dtype} of shape {tuple(mask.shape)}")
            reached = getattr(module, layers_name)[:len(rows) if isinstance(rows, (list, tuple)) else 1]
            if any(getattr(layer, "_tridist_stand_in", False) for layer in reached):
                return None
            part = mask.shape[SEQUENCE_DIM] // mesh.size()
            start = mesh.get_local_rank() * part
            index = (mask.flatten().cumsum(0) - 1).view_as(mask)  # each position's row among the selected ones
            mask = mask[:, start:start + part]
            taken = index[:, start:start + part][mask]

            def ours(x):
                return _SumTrailingGradient.apply(x, x.shape[-1], group_name)[taken]

            rows = [ours(x) for x in rows] if isinstance(rows, (list, tuple)) else ours(rows)
            return args, {**kwargs, mask_name: mask, rows_name: rows}

        target.module.register_forward_pre_hook(local, with_kwargs=True)
        return f"{target.name}: {self!r} (this rank's slice of the sequence; the rows' gradients summed over the mp ranks)"


class _SumTrailingGradient(torch.autograd.Function):
    """Identity forward; the backward sums the last `features` columns of the gradient over the group. It keeps
    the group's name, not the group: an output kept alive (a script's, until exit) holds its graph, and a
    graph holding the ProcessGroup keeps gloo running past destroy_process_group (the rings' teardown bug)."""

    @staticmethod
    def forward(ctx, output, features, group_name):
        ctx.features, ctx.group_name = features, group_name
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        shared = grad[..., -ctx.features:].contiguous()
        torch.distributed.all_reduce(shared, group=_group_by_name(ctx.group_name))
        grad[..., -ctx.features:] = shared
        return grad, None, None


@dataclass(repr=False)
class ShardLocalParameters(_Style):
    """A module kept whole on every mp rank that runs on this rank's shard of the activations: a per-head
    q/k RMSNorm of Qwen3-style attention normalises each local head with one weight shared by all heads.
    Its forward is right on every rank, but each rank's weight gradient covers its own heads only: the
    parameters become Replicate DTensors whose gradients are Partial (summed over the mp ranks, as
    sequence parallel's norm weights are), while the module's own code (fused kernels included) sees plain
    local tensors. The block check adds this style where a parameter's gradients summed over the mp ranks
    equal one device's and each rank's alone do not (block_check.py)."""

    def apply(self, target: StyleTarget) -> str:
        module = target.module
        replicate_parameters(module, target.tp_mesh, recurse=False)
        module.register_forward_pre_hook(_swap_in_local_parameters)
        module.register_forward_hook(_swap_back_parameters, always_call=True)
        return f"{target.name}: {self!r} (gradients summed over the mp ranks)"

    @staticmethod
    def release(module: torch.nn.Module):
        """Undo `apply` on `module` for a transformation that takes it over (expert parallel splits the experts
        of an MoE block that runs on sequence slices, and sums their gradients itself): its parameters plain
        again (their local values, the same on every mp rank), its swap hooks removed. Returns the mesh the
        gradients were to be summed over, or None where the module has not this style."""
        pre = [key for key, hook in module._forward_pre_hooks.items() if hook is _swap_in_local_parameters]
        params = dict(module.named_parameters(recurse=False))
        replicated = all(isinstance(p, DTensor) and all(q.is_replicate() for q in p.placements) for p in params.values())
        if not pre or not params or not replicated:
            return None  # not this style's (ShardHeadParameters uses the same hooks, on split rows)
        for key in pre:
            del module._forward_pre_hooks[key]
        for key in [key for key, hook in module._forward_hooks.items() if hook is _swap_back_parameters]:
            del module._forward_hooks[key]
            module._forward_hooks_always_called.pop(key, None)
        for pname, param in params.items():
            local = torch.nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
            module.register_parameter(pname, local)
        return next(iter(params.values())).device_mesh


@dataclass(repr=False)
class ShardHeadParameters(_Style):
    """Parameters with one row per query head of an attention module whose heads are split (gpt-oss's
    attention sinks: a logit per head, joined to the local heads' scores): each becomes a Shard(0) DTensor on
    the mp mesh, so a rank holds and trains its own heads' rows, and the module's code sees those rows as a
    plain tensor. The block check adds this style where a local-view run fails and the module has such
    parameters (`per_head_parameter_owners`); its next run shows whether that was the cause."""

    def apply(self, target: StyleTarget) -> str:
        module, tp = target.module, target.tp_mesh.size()
        heads = _head_count(module, _Q_HEADS)  # still the whole count: heads are localised after every style
        split = []
        for pname, param in list(module.named_parameters(recurse=False)):
            if _per_head(param, heads):
                if heads % tp:
                    raise ValueError(f"parallelize: {target.name}.{pname} has {heads} head rows, which {tp} "
                                     "tensor-parallel ranks cannot split; use a degree that divides the heads")
                rows = distribute_tensor(param.detach(), target.tp_mesh, [Shard(0)])
                module.register_parameter(pname, torch.nn.Parameter(rows, requires_grad=param.requires_grad))
                split.append(pname)
        if not split:
            raise ValueError(f"parallelize: {target.name} has no parameter with one row per query head ({heads})")
        module.register_forward_pre_hook(_swap_in_local_parameters)
        module.register_forward_hook(_swap_back_parameters, always_call=True)
        return f"{target.name}: {', '.join(split)} split by query head"


@dataclass(repr=False)
class LocalParameterRows(_Style):
    """A module whose heads mp splits through its column-parallel projections and that holds parameters with
    rows per head or per channel of them: a Gated DeltaNet mixer's depthwise convolution over its packed
    [q | k | v] channels and its per-head decay and time-step biases, which its code reads itself
    (`self.conv1d.weight`, `self.A_log`), not through a submodule's forward, or a buffer: a non-persistent one
    (Falcon-H1's mup_vector, a multiplier per input-projection output) has this rank's rows taken once, a persistent
    one (MiniMax's decays, in its checkpoints) stays whole, this rank's rows swapped in around every call. Each
    parameter named in `rows`
    (relative to the module) stays whole on every rank (a Replicate DTensor: a few values per channel); around
    every call of the module's forward (its forward hooks) its owner holds this rank's rows of each part
    (`rows[name]`: the parts' sizes, each split evenly, in order), whose gradients are summed over the mp ranks.
    `counts`: the module's integer attributes that count heads or channels (num_v_heads, key_dim, conv_dim,
    ...), or a submodule's (dotted: a Kimi Delta Attention mixer's forget gate's `forget_gate.num_heads`), which
    become this rank's share. `dims`: the dim a parameter's rows lie along where not 0 (Kimi Linear's decay A_log,
    [1, 1, heads, 1]). `units`: for a parameter whose parts are made of indivisible units (heads, groups), each
    part's count of them; a part with fewer units than the ranks gives each rank its unit (`packed.unit_span`: a
    Mamba-2 mixer's convolution over [x | B | C], B and C of n_groups groups, where tp exceeds them). `part_counts`:
    attributes counting such parts' features ({attribute: ((size, units), ...)}: Mamba-2's `conv_dim`, `n_groups`),
    which become the sum of this rank's share of each. Local view only: a global-view block has no local rows to take."""

    rows: dict[str, tuple[int, ...]]
    counts: tuple[str, ...] = ()
    dims: dict[str, int] = dataclasses.field(default_factory=dict)
    units: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    part_counts: dict[str, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    global_view = False  # block_check: no fallback to global view for a block holding this style
    local_only = ("its split takes each rank's rows of parameters its code reads; use tp=1 for this model (data and "
                  "pipeline parallel need none of it)")

    def apply(self, target: StyleTarget) -> str:
        module, tp = target.module, target.tp_mesh.size()
        rank = target.tp_mesh.get_local_rank()
        spans = {}  # (owner, parameter name) -> this rank's (start, length) in each part
        buffers = {}  # the same for non-persistent buffers: (owner, buffer name) -> (dim, spans)
        swapped = {}  # and for persistent ones, kept whole
        submodules = dict(module.named_modules())
        for name, parts in self.rows.items():
            owner_name, _, pname = name.rpartition(".")
            owner = submodules.get(owner_name)
            param = owner._parameters.get(pname) if owner is not None else None
            buffer = owner._buffers.get(pname) if owner is not None and param is None else None
            if param is None and buffer is None:
                raise ValueError(f"parallelize: {type(self).__name__} names {target.name}.{name}, which is no "
                                 f"parameter or buffer of {type(module).__name__}; name them relative to it")
            param = param if param is not None else buffer
            if isinstance(param, DTensor):
                raise ValueError(f"parallelize: {target.name}.{name} is split already ({param.placements}); "
                                 f"{type(self).__name__} takes rows of a plain parameter: give it one style")
            dim = self.dims.get(name, 0)
            units = self.units.get(name, (tp,) * len(parts))  # by default each part splits evenly
            parts_of_name = owner_name.split(".")
            lora = next((prefix for prefix in (".".join(parts_of_name[:i]) for i in range(len(parts_of_name), 0, -1))
                         if is_lora_layer(submodules.get(prefix))), None)
            if lora is not None:  # peft's adapters on a part this style takes rows of (Jamba's Mamba-1 dt_proj)
                raise NotImplementedError(
                    f"parallelize: {target.name}.{lora} is a LoRA layer on a part of {type(module).__name__} whose rows "
                    f"tensor parallel takes per rank ({type(self).__name__}); leave it out of the LoRA targets "
                    "(target_modules), or use a strategy without tensor parallel for this model")
            if param.dim() <= dim or param.shape[dim] != sum(parts):
                raise ValueError(f"parallelize: {target.name}.{name} (shape {tuple(param.shape)}) does not split as "
                                 f"rows of parts {list(parts)} along dim {dim}")
            check_units(f"{target.name}.{name}", parts, units, tp)
            starts = [sum(parts[:i]) for i in range(len(parts))]
            taken = (dim, [(start + offset, length) for start, part, count in zip(starts, parts, units)
                           for offset, length in [unit_span(part, count, tp, rank)]])
            persistent = buffer is not None and pname not in owner._non_persistent_buffers_set
            (spans if buffer is None else swapped if persistent else buffers)[owner, pname] = taken
        counted = {}  # attribute -> (owner, leaf, its whole value, this rank's)
        for attribute in [*self.counts, *self.part_counts]:
            owner_name, _, leaf = attribute.rpartition(".")
            owner = submodules.get(owner_name)
            value = getattr(owner, leaf, None) if owner is not None else None
            parts = self.part_counts.get(attribute)
            if parts is None:  # a plain count: each rank's 1/tp
                if not isinstance(value, int) or value % tp:
                    raise ValueError(f"parallelize: {target.name}.{attribute} = {value!r} cannot be split over {tp} "
                                     "tensor-parallel ranks; use a degree that divides it")
                parts = ((value, tp),)
            elif value != sum(size for size, _ in parts):
                raise ValueError(f"parallelize: {target.name}.{attribute} = {value!r} is not the {sum(s for s, _ in parts)} "
                                 f"features of parts {list(parts)} that {type(self).__name__} splits")
            else:
                check_units(f"{target.name}.{attribute}", tuple(s for s, _ in parts), tuple(u for _, u in parts), tp)
            counted[attribute] = (owner, leaf, value, sum(unit_span(size, count, tp, rank)[1] for size, count in parts))
        for owner, pname in spans:  # all checked: now change the module
            whole = distribute_tensor(owner._parameters[pname].detach(), target.tp_mesh, [Replicate()])
            owner.register_parameter(pname, torch.nn.Parameter(whole, requires_grad=owner._parameters[pname].requires_grad))
        def take_buffer_rows() -> None:  # no gradient, not saved: this rank's rows for good (a copy: the whole freed)
            for (owner, pname), (dim, taken) in list(buffers.items()):
                whole = owner._buffers[pname]
                if whole.is_meta:  # under LazyGuard: materialised later, whole; its rows taken at the first forward
                    continue
                owner.register_buffer(pname, _rows_of(whole, dim, taken).clone(), persistent=False)
                del buffers[owner, pname]

        take_buffer_rows()
        for owner, leaf, _, local in counted.values():
            setattr(owner, leaf, local)
            # _localise_head_counts leaves it alone (a Kimi Delta Attention mixer's num_heads beside its q_proj)
            owner._tridist_localised_counts = (*getattr(owner, "_tridist_localised_counts", ()), leaf)

        def take_local_rows(mixer, args) -> None:
            if buffers:
                take_buffer_rows()
            kept = vars(mixer).setdefault("_tridist_whole_buffers", {})
            for (owner, pname), (dim, taken) in swapped.items():
                whole = kept.setdefault((owner, pname), owner._buffers[pname])
                owner._buffers[pname] = _rows_of(whole, dim, taken)
            saved = vars(mixer).setdefault("_tridist_whole_parameters", {})
            for (owner, pname), (dim, taken) in spans.items():
                whole = saved.setdefault((owner, pname), owner._parameters[pname])  # another swap may have put it aside
                owner._parameters[pname] = _rows_of(_local_value(whole), dim, taken)

        def put_back(mixer, args, output) -> None:  # its own hook: ShardLocalParameters.release removes only its own
            _swap_back_parameters(mixer, args, output)
            for (owner, pname), whole in vars(mixer).pop("_tridist_whole_buffers", {}).items():
                owner._buffers[pname] = whole

        module.register_forward_pre_hook(take_local_rows)
        module.register_forward_hook(put_back, always_call=True)
        counted = "".join(f"; {attribute} {value} -> {local}" for attribute, (_, _, value, local) in counted.items())
        return f"{target.name}: this rank's rows of {', '.join(self.rows)} (gradients summed over the mp ranks){counted}"


@dataclass(repr=False)
class ReplicatedColWiseParallel(_Style):
    """Column-parallel over groups of `replicas` ranks: a Linear's output features split into tp / replicas equal
    chunks, chunk i computed by the `replicas` ranks i·replicas ... (i+1)·replicas - 1. For grouped-query attention's
    key and value projections when the tp ranks outnumber their heads (tensor_parallel_plan's
    `kv_head_replicas`): each rank computes the one key/value head its local query heads use, as vLLM does
    (Megatron-Core requires tp to divide the heads). The weight (and bias) stays whole on every rank, a Replicate
    DTensor (the key/value projections are the attention's smallest); around every forward the Linear holds this
    rank's chunk as a Shard(0) DTensor of a [tp x chunk] stand-in, so that its input enters replicated and the
    input's gradient is summed over the mp ranks as a column-parallel Linear's is, and the chunk's gradient reaches
    the whole weight as this rank's share, summed over the mp ranks (each rank's own query heads' part). The
    attention's key/value head counts become the local one (`_localise_head_counts`). Local view only; the
    overlapped edges (overlap_comm) do not feed it.

    `packed_query` (a tridist extension): the Linear packs [q | k | v], its first `packed_query` outputs the query
    heads (GPTBigCode's multi-query c_attn, Falcon's multi-query query_key_value, Phi-3's qkv_proj): the query part
    is split over every tp rank, the key and value parts (equal, after it) as above, and this rank's output is
    [q_r | k_r | v_r]. The whole packed weight, its query part too, is then on every rank (the cost model prices
    that memory and the gradient's all-reduce)."""

    replicas: int
    packed_query: int = 0
    global_view = False  # block_check: no fallback to global view for a block holding this style
    local_only = ("each rank computes its own key/value head from the whole weights; use a tp that divides the "
                  "key/value heads")

    def apply(self, target: StyleTarget) -> str:
        if is_lora_layer(target.module):
            return _split_lora(self, target)
        module, mesh = target.module, target.tp_mesh
        tp = mesh.size()
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"parallelize: {type(self).__name__} on {target.name!r}: a {type(module).__name__}, not an "
                             "nn.Linear")
        if not (isinstance(self.replicas, int) and self.replicas >= 1 and tp % self.replicas == 0):
            raise ValueError(f"parallelize: {type(self).__name__}(replicas={self.replicas!r}) on {target.name!r}: "
                             f"replicas must be a positive integer dividing the {tp} tensor-parallel ranks")
        rows, kv = self._rows(target.name, module.out_features, tp, mesh.get_local_rank())
        if target.overlap_comm and target.scatter_sequence:
            raise ValueError(f"parallelize: overlap_comm cannot feed {target.name}: its key/value heads are replicated "
                             f"over the tensor-parallel ranks ({type(self).__name__}), so it takes its input whole; "
                             "leave overlap_comm off for this model at this tp, or use a tp that divides its heads")
        names = [n for n in ("weight", "bias") if module._parameters.get(n) is not None]
        split = [n for n in names if isinstance(module._parameters[n], DTensor)]
        if split:
            raise ValueError(f"parallelize: {target.name}.{split[0]} is split already; give {target.name} one style")
        chunk = sum(length for _, length in rows)
        replicate_parameters(module, mesh, recurse=False)

        def take_chunk(linear, args):
            saved = vars(linear).setdefault("_tridist_whole_parameters", {})
            for name in names:
                whole = _local_value(saved.setdefault((linear, name), linear._parameters[name]))
                mine = torch.cat([whole.narrow(0, start, length) for start, length in rows]) if len(rows) > 1 else \
                    whole.narrow(0, *rows[0])
                linear._parameters[name] = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False)
            return (DTensor.from_local(args[0], mesh, [Replicate()], run_check=False), *args[1:])

        def put_back(linear, args, output):
            _swap_back_parameters(linear, args, output)
            return output.to_local() if isinstance(output, DTensor) else output

        module.register_forward_pre_hook(take_chunk)
        module.register_forward_hook(put_back, always_call=True)
        module._tridist_local_heads = True
        module._tridist_head_replicas = self.replicas
        module._tridist_chunk = rows[-1][1]  # the key/value features this rank computes (each part's)
        module._tridist_kv_features = kv  # of every key/value head (each part's)
        _open_sharded_region(target)
        what = " (the query part split over every rank)" if self.packed_query else ""
        return (f"{target.name}: {self!r} (this rank computes {chunk} of its {module.out_features} outputs{what}, each "
                f"key/value head on {self.replicas} ranks)")

    def _rows(self, name: str, out_features: int, tp: int, rank: int) -> tuple[list[tuple[int, int]], int]:
        """(start, length) of each block of output features this rank computes: its query chunk (packed), then its
        chunk of the key and of the value part (packed), or of the whole output; and the width of every key/value
        head together (each part's, packed)."""
        groups = tp // self.replicas
        query = self.packed_query
        parts = out_features - query
        if query and (query < 0 or query % tp or parts <= 0 or parts % 2):
            raise ValueError(f"parallelize: {type(self).__name__}(packed_query={query}) on {name!r}: the query part "
                             f"must be a positive multiple of the {tp} ranks, followed by equal key and value parts "
                             f"({out_features} outputs in all)")
        kv = parts // 2 if query else parts
        if kv % groups:
            raise ValueError(f"parallelize: {type(self).__name__} on {name!r} splits {kv} key/value features into {groups} "
                             "chunks, which does not divide them; use replicas that leave a whole number of heads per chunk")
        length, start = kv // groups, rank // self.replicas * (kv // groups)
        if not query:
            return [(start, length)], kv
        return [(rank * (query // tp), query // tp), (query + start, length), (query + kv + start, length)], kv


def per_head_parameter_owners(parallel: torch.nn.Module, whole: torch.nn.Module) -> list[str]:
    """Modules of `parallel` (a block in local view) whose query projection outputs local heads and that hold a
    plain parameter with one row per query head of their `whole` counterpart: ShardHeadParameters' candidates."""
    whole_modules = dict(whole.named_modules())
    owners = []
    for name, module in parallel.named_modules():
        heads = _head_count(whole_modules.get(name), _Q_HEADS)
        if _holds_local_query_heads(module) and any(_per_head(v, heads) for v in module._parameters.values()):
            owners.append(name)
    return owners


def _holds_local_query_heads(module: torch.nn.Module) -> bool:
    """Whether a query projection of `module` outputs this rank's heads only (split column-parallel)."""
    return any(getattr(p, "_tridist_local_heads", False) for p in _projections(module, _Q_PROJECTIONS))


def _query_head_modules(whole: torch.nn.Module):
    """(name, module, query heads) of each module of `whole` holding a query projection and a head count."""
    for name, module in whole.named_modules():
        heads = _head_count(module, _Q_HEADS)
        if heads and _projections(module, _Q_PROJECTIONS):
            yield name, module, heads


def _per_head(param: torch.Tensor | None, heads: int | None) -> bool:
    """A plain (not yet distributed) parameter with one row per query head."""
    return (bool(heads) and param is not None and not isinstance(param, DTensor) and param.dim() >= 1
            and param.shape[0] == heads)


def _swap_in_local_parameters(module, args) -> None:
    """For the forward only: each DTensor parameter as its local value (`_local_value`). FSDP2 swaps its
    unsharded parameters in the same way, around the enclosing block; this runs inside that, on whatever
    parameter is registered now."""
    whole = {(module, pname): param for pname, param in module._parameters.items() if isinstance(param, DTensor)}
    for (_, pname), param in whole.items():
        module._parameters[pname] = _local_value(param)
    # merged: what another style's swap on this module (LocalParameterRows) put aside stays, and is restored with these
    vars(module).setdefault("_tridist_whole_parameters", {}).update(whole)


def _local_value(param: DTensor) -> torch.Tensor:
    """A DTensor parameter's local value, whose gradient is Partial on the mesh dims where it is replicated
    (summed over the ranks that each computed a part of it)."""
    return param.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in param.placements])


def _rows_of(tensor: torch.Tensor, dim: int, taken: list[tuple[int, int]]) -> torch.Tensor:
    """The (start, length) spans `taken` of `tensor` along `dim`, in order: a view where one span, else joined."""
    rows = [tensor.narrow(dim, start, length) for start, length in taken]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=dim)


def _swap_back_parameters(module, args, output) -> None:
    """After the forward: the parameters a swap-in hook put aside ({(owner, name): parameter}) registered again."""
    for (owner, pname), param in vars(module).pop("_tridist_whole_parameters", {}).items():
        owner._parameters[pname] = param


@dataclass(repr=False)
class DistributedNorm(_Style):
    """A norm over a dimension that mp splits: OLMo2's q/k RMSNorms run over the whole q/k projection (every
    head's features), whose output each rank holds a column shard of. The module runs on DTensors (its
    input this rank's shard of the last dim, its parameters Replicate), so DTensor reduces its statistics
    (the mean of squares) over the mp ranks, and its output leaves as the local shard again. Any norm-like
    module's own code runs unchanged (the fused RMSNorm takes the same path). The block check adds this
    style where a module's 1-D parameters are tp times the width of its local input (block_check.py)."""

    def apply(self, target: StyleTarget) -> str:
        module = target.module
        replicate_parameters(module, target.tp_mesh, recurse=False)
        install_dtensor_boundary(module, target.tp_mesh, entry_placement=[Shard(-1)])
        return f"{target.name}: {self!r} (statistics reduced over the mp ranks)"


@dataclass(repr=False)
class UnfusedMixerForward(_Style):
    """A Mamba-2 mixer (transformers' Bamba, Granite 4.0-H, Mamba-2) or a Mamba-1 mixer (transformers' Mamba and Falcon
    Mamba) split by tensor parallel runs its own torch path in training too. Without a cache (`use_cache=False`, as HF
    Trainer with gradient checkpointing and TRL set it) the mixer hands all of itself to mamba_ssm's fused
    `mamba_split_conv1d_scan_combined` (Mamba-2) or `mamba_inner_fn` (Mamba-1) wherever mamba_ssm (or a hub kernel) is
    installed: those kernels take the weights themselves, so the split modules' hooks never run: a Mamba-2 kernel
    normalises over this rank's groups alone (SplitGroupGatedRMSNorm's sum over the ranks never runs), both multiply
    by out_proj's weight themselves (the row-parallel output is never all-reduced) and a Mamba-1 kernel by x_proj's
    (its dt, B and C never summed over the ranks). The torch path calls the split modules, and mamba_ssm's scan and
    convolution kernels on this rank's heads or channels. The mixer's `training` flag, which transformers reads only to
    pick that path, reads False during its forward and is put back after, also when the forward raises (the mixer has
    no dropout)."""

    def apply(self, target: StyleTarget) -> str:
        def unfused(mixer, args) -> None:
            vars(mixer)["_tridist_training"] = mixer.training
            mixer.training = False

        def restore(mixer, args, output) -> None:
            mixer.training = vars(mixer).pop("_tridist_training", mixer.training)

        target.module.register_forward_pre_hook(unfused)
        target.module.register_forward_hook(restore, always_call=True)
        return f"{target.name}: {self!r} (its torch path: no fused kernel past the split norm and out_proj)"


@dataclass(repr=False)
class SplitGroupNorm(_Style):
    """A Mamba-2 mixer's grouped gated RMSNorm (transformers' MambaRMSNormGated and its copies in Bamba, Granite
    4.0-H, Zamba 2, Nemotron-H, Falcon-H1: the features times SiLU(gate), normalised in groups of `group_size`, times a
    weight per feature) where the mixer's `groups` (n_groups) are fewer than the tp ranks: each group's features then
    lie on tp / groups ranks (the heads split, B and C replicated). The module becomes a `SplitGroupGatedRMSNorm`
    holding the same weight under the same name, whose per-row statistics (the sum of squares of this rank's part of
    its group) are summed over the ranks, forward and backward. Its formula is checked first against the module's own
    forward on random rows (an unequal one is refused: use a tp that divides n_groups, where each rank holds whole
    groups and the module runs as it is)."""

    groups: int

    def apply(self, target: StyleTarget) -> str:
        module, mesh = target.module, target.tp_mesh
        tp = mesh.size()
        leaf = target.name.rpartition(".")[2]
        if target.parent is None or not (self.groups < tp and tp % self.groups == 0):
            raise ValueError(f"parallelize: {target.name}: {self!r} splits each of {self.groups} groups over the "
                             f"{tp} ranks, which needs a parent module and fewer groups than ranks, dividing them")
        _check_grouped_gated_norm(target.name, module, self.groups)
        target.parent.register_module(leaf, SplitGroupGatedRMSNorm(module, groups=self.groups, mesh=mesh))
        return (f"{target.name}: {self!r} (each group's statistics summed over its {tp // self.groups} ranks, "
                "forward and backward)")


def _grouped_gated_rms_norm(hidden: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float,
                            group_size: int, sum_over_ranks=None) -> torch.Tensor:
    """Mamba-2's gated RMSNorm (norm after the gate): `hidden` x SiLU(`gate`) in fp32, normalised by the root mean
    square over each group of `group_size` features, cast back, times `weight`. With `sum_over_ranks` the last dim
    is this rank's part of one group, whose sum of squares that function completes."""
    h = hidden.float()
    if gate is not None:
        h = h * torch.nn.functional.silu(gate.float())
    if sum_over_ranks is None:
        grouped = h.unflatten(-1, (-1, group_size))
        h = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    else:
        h = h * torch.rsqrt(sum_over_ranks(h.pow(2).sum(-1, keepdim=True)) / group_size + eps)
    return weight * h.to(hidden.dtype)


def _check_grouped_gated_norm(name: str, module: torch.nn.Module, groups: int) -> None:
    """`module` computes `_grouped_gated_rms_norm` in `groups` groups: its settings, then its own forward on random
    rows against the formula (skipped for a weight not yet materialised, on the meta device)."""
    weight, eps, group_size = (getattr(module, a, None) for a in ("weight", "variance_epsilon", "group_size"))
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 1 and isinstance(group_size, int)
            and isinstance(eps, float) and group_size * groups == weight.shape[0]):
        raise ValueError(f"parallelize: {name} ({type(module).__name__}) is not a grouped gated RMSNorm of {groups} "
                         "groups (a 1-D weight, variance_epsilon, group_size): it cannot be split over more ranks than "
                         "its groups; use a tp that divides the mixer's n_groups")
    if weight.is_meta:
        return
    generator = torch.Generator(device=weight.device).manual_seed(0)
    hidden, gate = (torch.randn(3, weight.shape[0], generator=generator, device=weight.device) for _ in range(2))
    with torch.no_grad():
        local = _local_value(weight) if isinstance(weight, DTensor) else weight
        expected = _grouped_gated_rms_norm(hidden, gate, local.float(), eps, group_size)
        got = module(hidden, gate)
    # The same fp32 arithmetic in another order: a few ulps apart (a different formula, e.g. the norm before the
    # gate, is off by O(1)).
    if not torch.allclose(got.float(), expected, rtol=1e-4, atol=1e-5):
        raise ValueError(f"parallelize: {name} ({type(module).__name__}) computes otherwise than a gated RMSNorm "
                         f"normalised in {groups} groups after the gate, which tensor parallel can split over more "
                         "ranks than its groups; use a tp that divides the mixer's n_groups")


class SplitGroupGatedRMSNorm(torch.nn.Module):
    """What SplitGroupNorm puts in place of a grouped gated RMSNorm whose groups lie on several ranks: the same
    `weight` (this rank's features of it, taken by the mixer's LocalParameterRows), `variance_epsilon` and `group_size`
    (the whole group's features), and each row's sum of squares summed over the tp ranks: in a slot per group (the
    ranks holding another group add zeros), so one all-reduce of `groups` values per row serves every group."""

    def __init__(self, norm: torch.nn.Module, *, groups: int, mesh):
        super().__init__()
        tp = mesh.size()
        self.weight = norm.weight
        self.variance_epsilon, self.group_size = norm.variance_epsilon, norm.group_size
        self.groups, self.slot = groups, mesh.get_local_rank() // (tp // groups)
        self._process_group = mesh.get_group()

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        return _grouped_gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon, self.group_size,
                                       sum_over_ranks=self._sum_over_ranks)

    def _sum_over_ranks(self, squares: torch.Tensor) -> torch.Tensor:
        if self.groups > 1:
            slots = torch.nn.functional.one_hot(torch.tensor(self.slot, device=squares.device), self.groups)
            squares = squares * slots.to(squares.dtype)
        return SumBothWays.apply(squares, self._process_group).narrow(-1, self.slot if self.groups > 1 else 0, 1)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, groups={self.groups} (this rank's: {self.slot}), eps={self.variance_epsilon}"


@dataclass(repr=False)
class ShardHeadInput(_Style):
    """An attention's keyword input that the model builds for every head outside the attention, the heads in its
    first dim ([batch x heads, ...] batch-major, or [heads, ...]): Bloom's and Falcon's ALiBi biases (`alibi`), MPT's
    (`position_bias`). In local view the attention holds this rank's heads of the model's `heads`, so the input is
    cut to them as it enters. The block check adds it where a block's local view is wrong or fails and such an input
    reaches an attention whose heads are split (block_check.py)."""

    keyword: str
    heads: int
    recomputable = True  # the input is cut before the forward, which a recomputation re-runs with

    def apply(self, target: StyleTarget) -> str:
        tp, rank = target.tp_mesh.size(), target.tp_mesh.get_local_rank()
        if self.heads % tp:
            raise ValueError(f"parallelize: {target.name}: {self!r} cannot split {self.heads} heads over {tp} ranks")
        local = self.heads // tp
        keyword, heads = self.keyword, self.heads

        def take(module, args, kwargs):
            value = kwargs.get(keyword)
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] % heads:
                return None
            mine = value.unflatten(0, (-1, heads))[:, rank * local:(rank + 1) * local].flatten(0, 1)
            return args, {**kwargs, keyword: mine}

        target.module.register_forward_pre_hook(take, with_kwargs=True)
        return f"{target.name}: {self!r} (this rank's {local} heads of its {keyword!r})"


def head_input_owners(whole: torch.nn.Module, shapes: dict[str, tuple], *, batch: int) -> dict[str, ShardHeadInput]:
    """Modules of a block (its single-device copy `whole`) that hold query heads and take a keyword input whose
    first dim is their head count, alone or times the batch (`shapes`: the block's keyword inputs' shapes, from a
    probe of `batch` rows): ShardHeadInput's candidates, {module name: the style}. The check then tells whether the
    cut is right (a probe of several rows tells [batch x heads] from [heads x batch])."""
    owners = {}
    for name, module, heads in _query_head_modules(whole):
        for keyword, shape in shapes.items():
            if len(shape) >= 2 and shape[0] in (heads, batch * heads) and forward_takes(module, keyword):
                owners[name] = ShardHeadInput(keyword, heads)
    return owners


# Attributes that attention code reads as its query heads' width (every head's features): XGLM's and GPTBigCode's
# `embed_dim` (`attn_output.reshape(b, s, self.embed_dim)`; the query's share of GPTBigCode's packed projection), the
# `split_size` of GPT-2-style code, `all_head_size`, `inner_dim`. A candidate only where it equals heads x head_dim.
_Q_WIDTHS = ("embed_dim", "split_size", "all_head_size", "inner_dim")


@dataclass(repr=False)
class LocalHeadWidths(_Style):
    """An attention module whose code reads the query heads' width from an attribute (`widths`: XGLM's and
    GPTBigCode's `embed_dim`) or its head counts from its `config` (Phi-3: `config.num_attention_heads * head_dim`,
    where its packed projection's query part ends), which local view leaves global: the attributes are divided as
    the query heads are, and the module's `config` becomes a LocalHeadConfig, the shared config with the local head
    counts (`config`; the model's config, which every module shares, is not changed). The block check adds it where
    a block's local view is wrong or fails and its attention holds such settings (block_check.py)."""

    widths: tuple[str, ...] = ()
    config: bool = False
    recomputable = True  # settings, which a recomputation reads again

    def apply(self, target: StyleTarget) -> str:
        module, tp, name = target.module, target.tp_mesh.size(), target.name
        if not _holds_local_query_heads(module):
            raise ValueError(f"parallelize: {name}: {self!r} needs its query projection split (ColWiseParallel)")
        changes = []
        for attribute in self.widths:
            value = readable_attr(module, attribute)
            if not isinstance(value, int) or isinstance(value, bool) or value % tp:
                raise ValueError(f"parallelize: {name}: {self!r} cannot split {attribute} = {value!r} over {tp} ranks")
            setattr(module, attribute, value // tp)
            changes.append(f"{attribute} {value} -> {value // tp}")
        if self.config:
            shared, counts = module.config, {}
            for attribute in _HEADS_OF:
                value = readable_attr(shared, attribute)
                if isinstance(value, int) and not isinstance(value, bool):
                    groups = _head_groups(name, module, attribute, value, tp)
                    if groups is not None:
                        counts[attribute] = value // groups
                        changes.append(f"config.{attribute} {value} -> {value // groups}")
            module.config = LocalHeadConfig(shared, counts)
        return f"{name}: {self!r} ({', '.join(changes)})"


class LocalHeadConfig:
    """One module's view of a config that every module shares: its own (local) head counts, every other attribute
    read from and written to the shared config, so that what changes there later reaches the module too
    (`model.set_attn_implementation`, which a copy would miss: an eager attention then got an SDPA mask, silently).
    The counts are the view's own attributes and the rest a plain `__getattr__`, which torch.compile traces (a block
    compiled with fullgraph=True). A view, not a subclass: `isinstance(view, PretrainedConfig)` is False."""

    def __init__(self, shared, counts: dict[str, int]):
        self.__dict__["_shared"] = shared
        for name, value in counts.items():
            self.__dict__.update(dict.fromkeys(self._names_of(name), value))

    def _names_of(self, name: str) -> set[str]:
        """`name` and its aliases in the shared config's `attribute_map` (GPT-2's n_head for num_attention_heads)."""
        pairs = (getattr(self._shared, "attribute_map", None) or {}).items()
        return {name, *(other for pair in pairs if name in pair for other in pair)}

    def __getattr__(self, name: str):  # only for what the view does not hold itself
        if name == "_shared" or name.startswith("__"):  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._shared, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self.__dict__:
            self.__dict__.update(dict.fromkeys(self._names_of(name), value))
        else:
            setattr(self._shared, name, value)

    def __repr__(self) -> str:
        counts = {name: value for name, value in self.__dict__.items() if name != "_shared"}
        return f"LocalHeadConfig({counts}, of {type(self._shared).__name__})"


def _query_width(value, heads: int, head_dim) -> bool:
    """`value` may be the query heads' width: heads x head_dim, or, the head_dim unknown, a multiple of the heads."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return False
    return value == heads * head_dim if isinstance(head_dim, int) else value % heads == 0


def head_width_owners(whole: torch.nn.Module) -> dict[str, LocalHeadWidths]:
    """Modules of a block (its single-device copy `whole`) that hold query heads and either a `config` with head
    counts or an attribute of _Q_WIDTHS equal to their heads x head_dim: LocalHeadWidths' candidates, {module name:
    the style}. The check then tells whether local settings make the block right."""
    owners = {}
    for name, module, heads in _query_head_modules(whole):
        head_dim = readable_attr(module, "head_dim")
        config = getattr(module, "config", None)
        counted = config is not None and not isinstance(config, torch.nn.Module) and any(
            isinstance(readable_attr(config, attribute), int) for attribute in _HEADS_OF)
        # Without a head_dim (GPT-1 keeps none), any such width that the heads divide: the check tells
        widths = tuple(attribute for attribute in _Q_WIDTHS
                       if _query_width(readable_attr(module, attribute), heads, head_dim))
        if counted or widths:
            owners[name] = LocalHeadWidths(widths, config=counted)
    return owners


@dataclass(repr=False)
class FreshLocalOutput(_Style):
    """A row-parallel Linear whose local output the block's code then changes in place (Falcon's parallel attention
    and MLP: `mlp_output += attention_output`). torch's DTensor.to_local returns that output as a view made inside
    an autograd Function, which autograd refuses to change in place ("Output 0 of _ToTorchTensor is a view and is
    being modified inplace"); this style hands on a copy instead (one more read and write of the output per call).
    The block check adds it to a block's row-parallel Linears where its local view fails so (block_check.py)."""

    def apply(self, target: StyleTarget) -> str:
        target.module.register_forward_hook(_copied_output)  # after the split's own hook: it sees the local output
        return f"{target.name}: {self!r} (its local output copied, which the block changes in place)"


def _copied_output(module, args, output):
    if not isinstance(output, torch.Tensor):
        return output
    copied = output.clone()
    if getattr(module, "_tridist_last_output", None) is output:  # a sequence-parallel exit: its region checks that
        module._tridist_last_output = copied  # it returns this Linear's output (_remember_exit_output), now the copy
    return copied


class _SequenceParallelBoundary(_Style):
    def apply(self, target: StyleTarget) -> str:  # see the sequence-parallel section below
        return _apply_sequence_parallel(target.name, target.module, self, tp_mesh=target.tp_mesh,
                                        in_region=target.in_region, sequence_split=target.sequence_split,
                                        overlap_comm=target.overlap_comm)


@dataclass(repr=False)
class _SequenceParallelStyle(_SequenceParallelBoundary):
    need_transpose: bool = True


class SequenceParallelBegin(_SequenceParallelStyle):
    pass


@dataclass(repr=False)
class SequenceParallelEnd(_SequenceParallelStyle):
    """The sequence is gathered at this module's input (Paddle's: the LM head, or the final norm).

    `at_output` (a tridist extension): gathered from its output instead, the module itself running on slices (the
    region ends after it): a model's last decoder layer where no final norm follows the layers, so that the model's
    own code between the layers and the head (GPT-1 reshapes the hidden states to the input's shape) sees the whole
    sequence. A boundary of the model, not of the block: a block's copy in the block check leaves it out
    (`TensorParallelPlan.within`), and on a block in global view it gathers the block's DTensor output."""

    at_output: bool = False


class SequenceParallelEnable(_SequenceParallelBoundary):
    pass


class SequenceParallelDisable(_SequenceParallelStyle):
    pass


STYLES = (ColWiseParallel, RowWiseParallel, PrepareLayerInput, PrepareLayerOutput, ShardLocalParameters, ShardHeadParameters,
          ReduceSharedOutputGradient, SequenceSlicedRows, ReplicatedColWiseParallel, LocalParameterRows,
          DistributedNorm, FreshLocalOutput, ShardHeadInput, LocalHeadWidths, UnfusedMixerForward, SplitGroupNorm,
          SequenceParallelBegin, SequenceParallelEnd, SequenceParallelEnable, SequenceParallelDisable)


@dataclass(frozen=True)
class TensorParallelPlan:
    """A Paddle `parallelize_plan` resolved against one model: each name is one of its modules (or a
    bare parameter), with the sequence-parallel context each needs; `within(block)` gives the plan of one
    block with names relative to it (what the block check applies to its copies).

    styles: module name -> styles, in plan order. bare: bare parameter name -> styles.
    sequence_span: modules registered strictly between the first SequenceParallelBegin and the last End
      (registration order is execution order in Llama-style models); a SequenceParallelEnable there
      already receives sequence slices.
    sequence_region: the span minus Begin/End/Disable subtrees: modules that run on sequence slices.
    disabled: modules marked SequenceParallelDisable (a row-parallel child is its possible exit).
    lazy_split: the region's top-most parameterised modules; whichever runs first after Begin splits the
      sequence (empty for a block's plan: its check feeds it split inputs).
    overlap_comm: the backend (kernels.comm_matmul.BACKENDS) with which each Disable region's all-gather
      runs fused with its entry projections (kernels.all_gather_matmul, one gather for all of them) and
      its exit's reduce-scatter with the exit's matmul (matmul_reduce_scatter); None: off. See overlap.py.
    """

    styles: dict
    bare: dict
    sequence_span: frozenset = frozenset()
    sequence_region: frozenset = frozenset()
    disabled: frozenset = frozenset()
    lazy_split: tuple = ()
    overlap_comm: str | None = None

    def within(self, prefix: str) -> "TensorParallelPlan":
        """The plan of the module at `prefix`, its names relative to it (what a block's copy takes), without an End
        on the block itself that gathers its output (a boundary of the model: SequenceParallelEnd.at_output)."""
        plan = self._select(lambda name: _under(name, prefix), lambda name: _strip(name, prefix), lazy_split=())
        if not _ends_at_output(plan.styles.get("", ())):
            return plan
        styles = {**plan.styles, "": [st for st in plan.styles[""] if not _ends_at_output([st])]}
        return dataclasses.replace(plan, styles={name: st for name, st in styles.items() if st})

    def excluding(self, prefixes) -> "TensorParallelPlan":
        """This plan without the subtrees at `prefixes` (blocks applied another way), but an End gathering the output of
        one of them, which applies to the block from outside (SequenceParallelEnd.at_output)."""
        kept = {p for p in prefixes if _ends_at_output(self.styles.get(p, ()))}
        plan = self._select(lambda name: name in kept or not any(_under(name, p) for p in prefixes),
                            lambda name: name, lazy_split=self.lazy_split)
        styles = {name: [st for st in styles if _ends_at_output([st])] if name in kept else styles
                  for name, styles in plan.styles.items()}
        return dataclasses.replace(plan, styles=styles)

    def with_styles(self, added: dict) -> "TensorParallelPlan":
        """This plan with more styles: {module name: [styles]} (the block check's repairs)."""
        if not added:
            return self
        styles = {name: list(st) for name, st in self.styles.items()}
        for name, extra in added.items():
            styles.setdefault(name, []).extend(extra)
        return dataclasses.replace(self, styles=styles)

    def _select(self, keep, rename, *, lazy_split: tuple) -> "TensorParallelPlan":
        def names(values):
            return frozenset(rename(n) for n in values if keep(n))

        return TensorParallelPlan(
            styles={rename(n): st for n, st in self.styles.items() if keep(n)},
            bare={rename(n): st for n, st in self.bare.items() if keep(n)},
            sequence_span=names(self.sequence_span), sequence_region=names(self.sequence_region),
            disabled=names(self.disabled), lazy_split=lazy_split, overlap_comm=self.overlap_comm,
        )

    def styles_under(self, prefix: str) -> bool:
        return any(_under(n, prefix) for n in [*self.styles, *self.bare])


def _ends_at_output(styles) -> bool:
    return any(isinstance(st, SequenceParallelEnd) and st.at_output for st in styles)


def _under(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def _strip(name: str, prefix: str) -> str:
    return name if not prefix else name[len(prefix) + 1:]


def overlap_backend(overlap_comm) -> str | None:
    """mp_config["overlap_comm"] -> the comm_matmul backend it names, or None (off): True is the default
    backend ("ring"); a backend's name picks it."""
    if overlap_comm is False or overlap_comm is None:
        return None
    if overlap_comm is True:
        return "ring"
    if overlap_comm in BACKENDS:
        return overlap_comm
    raise ValueError(f"parallelize: mp_config['overlap_comm'] must be True, False or a backend's name "
                     f"{list(BACKENDS)} (True: {BACKENDS[0]!r}), got {overlap_comm!r}")


def check_overlap_backend(plan: TensorParallelPlan, tp_mesh) -> None:
    """Refuse an overlap backend that cannot run on this tensor-parallel group's devices (symm_mem off CUDA
    or across nodes), with the reason, before anything is changed or checked."""
    if plan.overlap_comm:
        check_backend_available("parallelize: mp_config['overlap_comm']", plan.overlap_comm, tp_mesh.device_type,
                                tp_mesh.get_group())


def resolve_plan(model: torch.nn.Module, plan, *, strict: bool = False, overlap_comm=False) -> TensorParallelPlan:
    """`_resolve_plan`, with mp_config's `overlap_comm` (checked: it needs sequence-parallel regions)."""
    backend = overlap_backend(overlap_comm)
    resolved = _resolve_plan(model, plan, strict=strict)
    if backend is None:
        return resolved
    if not resolved.disabled:
        raise ValueError(
            "parallelize: mp_config['overlap_comm'] overlaps sequence parallel's all-gather and reduce-scatter with "
            "the matmuls at each region's edges, but this plan has no sequence-parallel region (SequenceParallelBegin "
            "on the embedding, SequenceParallelDisable on attention and MLP, SequenceParallelEnd); add them, or leave "
            "overlap_comm off (tensor parallel without sequence parallel all-reduces, which this does not overlap)")
    return dataclasses.replace(resolved, overlap_comm=backend)


def _resolve_plan(model: torch.nn.Module, plan, *, strict: bool = False) -> TensorParallelPlan:
    """Match every key of a Paddle plan against `model` (warning, or with strict an error, for a key
    matching nothing) and work out each module's sequence-parallel context. A TensorParallelPlan (built
    from the model's own names, as to_distributed does) has its context worked out again for `model`:
    a pipeline stage's view holds only some of the modules."""
    if isinstance(plan, TensorParallelPlan):
        return plan_from_names(model, plan.styles, plan.bare)
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize: mp_config['parallelize_plan'] must be a dict of pattern -> style(s), got {type(plan).__name__}")
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))  # every name of a tied parameter
    styles_of: dict[str, list] = {}
    bare_styles: dict[str, list] = {}  # bare parameters (not a Linear's/Embedding's) -> their styles
    for key, value in plan.items():
        styles = list(value) if isinstance(value, (list, tuple)) else [value]
        for style in styles:
            if not isinstance(style, STYLES):
                raise TypeError(
                    f"parallelize: plan key {key!r} has {style!r}; styles are {', '.join(s.__name__ for s in STYLES)}"
                )
        for name in _match(key, modules, params, strict=strict):
            (bare_styles if name in params else styles_of).setdefault(name, []).extend(styles)
    return _with_sequence_context(model, styles_of, bare_styles)


def plan_from_names(model: torch.nn.Module, styles: dict, bare: dict | None = None) -> TensorParallelPlan:
    """A plan from exact names, no patterns: module name -> styles, and bare parameter name -> styles
    (a parameter named in `styles` stands for its owning Linear/Embedding). What to_distributed builds
    from the recognised structure. Names under a pipeline stand-in (another stage's modules) are
    dropped; any other name the model lacks is an error."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    styles_of: dict[str, list] = {}
    bare_styles = {name: list(st) for name, st in (bare or {}).items() if name in params or _elsewhere(name, modules)}
    for name, values in styles.items():
        owner = name.rpartition(".")[0]
        if name in params and _splittable(modules.get(owner)):
            name = owner
        elif name in params:
            bare_styles.setdefault(name, []).extend(values)
            continue
        if name in modules:
            styles_of.setdefault(name, []).extend(values)
        elif not _elsewhere(name, modules):
            nearest = difflib.get_close_matches(name, [n for n in modules if n], n=3, cutoff=0.4)
            raise ValueError(f"parallelize: the plan names {name!r}, which the model lacks; nearest names: {nearest}")
    return _with_sequence_context(model, styles_of, bare_styles)


def _elsewhere(name: str, modules: dict) -> bool:
    """`name` lies under a pipeline stand-in (its module lives on another stage)."""
    parts = name.split(".")
    return any(getattr(modules.get(".".join(parts[:i])), "_tridist_stand_in", False) for i in range(1, len(parts) + 1))


def _with_sequence_context(model: torch.nn.Module, styles_of: dict, bare_styles: dict) -> TensorParallelPlan:
    _check_sequence_parallel_boundaries(styles_of)
    order = list(dict(model.named_modules()))

    def marked(kind):
        return [name for name, st in styles_of.items() if any(isinstance(x, kind) for x in st)]

    begins = [order.index(n) for n in marked(SequenceParallelBegin)]
    if not begins:
        return TensorParallelPlan(styles_of, bare_styles)
    stops = [_end_stops(order, name, styles_of[name]) for name in marked(SequenceParallelEnd)]
    first = min(begins)
    last, split_last = max(stops) if stops else (len(order), len(order))
    span = frozenset(order[first + 1:last])
    boundaries = [*marked(SequenceParallelBegin), *marked(SequenceParallelDisable),
                  *(n for n in marked(SequenceParallelEnd) if not _ends_at_output(styles_of[n]))]
    region = frozenset(n for n in span if not any(_under(n, b) for b in boundaries))
    return TensorParallelPlan(
        styles_of, bare_styles, sequence_span=span, sequence_region=region,
        disabled=frozenset(marked(SequenceParallelDisable)),
        lazy_split=tuple(_split_points(model, order[first + 1:split_last])),
    )


def _end_stops(order: list[str], name: str, styles) -> tuple[int, int]:
    """Where the End module `name` ends the sequence-parallel span (exclusive, in registration `order`) and the modules
    that may take the pending split (_split_points)."""
    index = order.index(name)
    if not _ends_at_output(styles):
        return index, index + 1  # its input gathered: outside the span, but it may take the split (no layer before it)
    after = next((i for i in range(index + 1, len(order)) if not _under(order[i], name)), len(order))
    return after, after  # its output gathered: inside the span, with its submodules


def apply_local_view(root: torch.nn.Module, plan: TensorParallelPlan, *, tp_mesh, process_mesh) -> list[str]:
    """Tensor parallel on local shards (Megatron's way: model code sees this rank's heads); `root` is the
    model, or a block's copy with its `plan.within(block)`.

    Styles are applied children first: a Disable region then knows its row-parallel exit (which
    reduce-scatters straight onto sequence shards instead of all-reducing then slicing: half the bytes,
    as Megatron does).
    """
    ties = tied_splits(root, plan)
    modules = dict(root.named_modules())
    tp = tp_mesh.size()
    marks_split = any(isinstance(st, SequenceParallelBegin) for styles in plan.styles.values() for st in styles)
    sequence_split = sequence_split_of(root, tp_mesh) if marks_split else None  # only a Begin module marks one
    random_state = ShardedRegionRandomState(tp_mesh.get_local_rank(), torch.device(tp_mesh.device_type))
    root.register_forward_pre_hook(random_state.forget)
    changes: list[str] = []
    for name in reversed(list(modules)):
        parent = name.rpartition(".")[0] if name else None  # the root has none
        for style in plan.styles.get(name, []):
            module = modules[name]
            if getattr(module, "_tridist_stand_in", False):
                changes.append(f"{name}: on pipeline stage {module.tridist_stage}")
                continue
            changes.append(style.apply(StyleTarget(
                name, module, modules.get(parent), tp_mesh=tp_mesh, process_mesh=process_mesh,
                in_region=name in plan.sequence_span, sequence_split=sequence_split,
                # Only a row-parallel Linear (or a LoRA layer wrapping one) directly under a Disable module can be its
                # exit (checked at run time).
                scatter_sequence=parent in plan.disabled and (is_linear_like(module) or is_lora_layer(module)),
                overlap_comm=plan.overlap_comm, random_state=random_state,
            )))
    for name, styles in plan.bare.items():
        changes += [_apply_bare(root, name, style, tp_mesh=tp_mesh) for style in styles]
    for names in ties:  # each holder was split alike; they hold one parameter again
        kept = root.get_parameter(names[0])
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(root.get_submodule(owner), leaf, kept)
        changes.append(f"{', '.join(names)}: one tied parameter, split once")
    changes += _localise_head_counts(root, tp=tp)
    if plan.sequence_region:
        changes += _sequence_parallel_norms(root, plan.sequence_region, tp_mesh=tp_mesh)
        _check_region_parameters(root, plan.sequence_region)
    return changes


def _check_sequence_parallel_boundaries(styles_of: dict) -> None:
    kinds = {type(x) for styles in styles_of.values() for x in styles}
    if kinds & {SequenceParallelDisable, SequenceParallelEnd} and SequenceParallelBegin not in kinds:
        raise ValueError(
            "parallelize: SequenceParallelDisable/End assume activations already split by a SequenceParallelBegin "
            "(on the embedding, say); add one, or use SequenceParallelEnable alone for a self-contained module"
        )


def tied_parameter_names(model: torch.nn.Module) -> list[list[str]]:
    """Every name of each parameter registered under more than one (a tied embedding and LM head)."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    return [names for names in names_of.values() if len(names) > 1]


def tied_splits(root: torch.nn.Module, plan: TensorParallelPlan) -> list[list[str]]:
    """The tied parameters the plan splits, each as its names (the first keeps the split parameter).

    A tied weight is split once, so every module holding it must split it on the same dim of the weight:
    an Embedding's RowWiseParallel (the vocabulary, dim 0 of [vocab, hidden]) with a Linear head's
    ColWiseParallel (dim 0 of [vocab, hidden] too: Megatron's vocabulary-parallel tied embedding and
    head), or an Embedding's ColWise with a Linear's RowWise (dim 1). Anything else is refused before the
    model changes: a holder left out of the plan would meet a split weight it cannot use."""
    ties = []
    for names in tied_parameter_names(root):
        owners = [name.rpartition(".")[0] for name in names]
        if not any(plan.styles.get(owner) for owner in owners) and not any(name in plan.bare for name in names):
            continue
        dims = {name: _tied_split_dim(root, name, plan) for name in names}
        if None in dims.values() or len(set(dims.values())) > 1:
            held = "; ".join(f"{name}: {_describe_split(root, name, plan)}" for name in names)
            raise NotImplementedError(
                f"parallelize: {names} are one tied parameter, split only when every module holding it splits it on "
                f"the same dim (an Embedding's RowWiseParallel with a Linear head's ColWiseParallel, as Megatron "
                f"splits a tied vocabulary); here {held}. Give each holder the matching style, or untie them"
            )
        ties.append(names)
    return ties


def _tied_split_dim(root: torch.nn.Module, name: str, plan: TensorParallelPlan) -> int | None:
    """The dim of the weight `name` its owner's plan splits; None where a tied weight cannot be split."""
    owner, _, leaf = name.rpartition(".")
    module = root.get_submodule(owner)
    splits = [s for s in plan.styles.get(owner, []) if isinstance(s, (ColWiseParallel, RowWiseParallel))]
    if name in plan.bare or leaf != "weight" or len(splits) != 1 or not _splittable(module):
        return None
    column = isinstance(splits[0], ColWiseParallel)
    if isinstance(module, torch.nn.Embedding):
        return 1 if column else 0
    if column and _declared_parts(splits[0], owner.rpartition(".")[2]) != 1:
        return None  # a per-part split is no plain dim
    out_dim = weight_out_dim(module)
    return out_dim if column else 1 - out_dim


def _describe_split(root: torch.nn.Module, name: str, plan: TensorParallelPlan) -> str:
    owner = name.rpartition(".")[0]
    styles = plan.bare.get(name) or plan.styles.get(owner) or []
    kind = type(root.get_submodule(owner)).__name__
    return f"{kind} with {', '.join(type(s).__name__ for s in styles) or 'no style'}"


def _check_region_parameters(root: torch.nn.Module, region: frozenset) -> None:
    """Parameters that run on sequence slices must be split, sequence parallel, or inside a Disable
    region (which sees the whole sequence); anything else would get partial, unreduced gradients."""
    uncovered = [
        f"{name}.{pname}" if name else pname
        for name, module in root.named_modules() if name in region
        for pname, param in module.named_parameters(recurse=False)
        if not isinstance(param, DTensor)
    ]
    if uncovered:
        # peft's LoRA adapters, saved modules' copies and trainable tokens: no plan of ours names them
        peft = [name for name in uncovered if any(part in name for part in ("lora_", "modules_to_save", "trainable_tokens"))]
        raise ValueError(
            f"parallelize: {uncovered} run on sequence slices between SequenceParallelBegin and End but are neither "
            "split (ColWise/RowWise), sequence parallel (SequenceParallelEnable) nor inside a SequenceParallelDisable "
            "region; their gradients would only cover part of the sequence. Add them to the plan"
            + (" (peft's: use tensor parallel without sequence parallel for this model, or leave these modules out of "
               "the LoRA config)." if peft else ".")
        )


def _match(key: str, modules: dict, params: dict, *, strict: bool) -> list[str]:
    """Names the key names: modules by full regex match; a `.weight`/`.bias` key names its owning
    Linear/Embedding, or, owned by anything else (an LM head's bare weight), the parameter itself."""
    try:
        pattern = re.compile(key)
    except re.error as error:
        raise ValueError(f"parallelize: plan key {key!r} is not a valid regular expression: {error}") from None
    if key.rpartition(".")[2] in ("weight", "bias"):
        order = {name: index for index, name in enumerate(modules)}
        named = set()
        for name in params:
            if pattern.fullmatch(name):
                owner = name.rpartition(".")[0]  # not in `modules` for a module registered twice (tied)
                named.add(owner if _splittable(modules.get(owner)) else name)
        matched = sorted(named, key=lambda n: order.get(n, order.get(n.rpartition(".")[0], len(order))))
    else:
        matched = [name for name in modules if name and pattern.fullmatch(name)]
    if not matched:
        nearest = difflib.get_close_matches(key, [n for n in modules if n], n=3, cutoff=0.4)
        message = f"parallelize: plan key {key!r} matches no module or parameter of the model" + (
            f"; nearest names: {nearest}" if nearest else ""
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=4)
    return matched


_PACKED_PARTS = {"qkv_proj": 3, "gate_up_proj": 2, "w13": 2}  # name -> packed projections
# Names packed in different layouts by different models: GPT-NeoX and Bloom hold [q k v] per head (a
# contiguous split keeps heads whole: packed_parts=1), ChatGLM holds [q | k | v] (packed_parts=3).
# Guessing wrong trains silently wrong numbers, so the plan must say which.
_AMBIGUOUS_PACKED = ("query_key_value",)


def _apply_bare(model: torch.nn.Module, name: str, style, *, tp_mesh) -> str:
    owner = model.get_submodule(name.rpartition(".")[0])
    if getattr(owner, "_tridist_stand_in", False):
        return f"{name}: on pipeline stage {owner.tridist_stage}"
    if not isinstance(style, (ColWiseParallel, RowWiseParallel)):
        raise NotImplementedError(
            f"parallelize: {type(style).__name__} names the parameter {name!r}; sequence-parallel and prepare "
            "styles apply to modules: use the module's name as the key"
        )
    return split_bare_weight(model, name, style, tp_mesh=tp_mesh)


def split_parts(name: str, module: torch.nn.Module, style, tp: int, *, parent: torch.nn.Module | None) -> tuple[int, ...]:
    """Check that ColWise/RowWise can split `module` over `tp` ranks; returns the sizes of the packed
    projections it holds (one size: a contiguous split). Shared by the local and the global view."""
    if not _splittable(module):
        raise NotImplementedError(
            f"parallelize: {type(style).__name__} on {name or 'the model'!r} ({type(module).__name__}): distcore splits "
            "nn.Linear, transformers' Conv1D and nn.Embedding modules, and bare 2-D weights named by parameter (e.g. "
            "'lm_head.weight')"
        )
    sizes = packed_sizes(name, module, style, tp, parent=parent)
    if len(sizes) == 1:
        _check_divisible(name, module, style, tp)
    return sizes


def packed_sizes(name: str, module: torch.nn.Module, style, tp: int, *, parent: torch.nn.Module | None) -> tuple[int, ...]:
    """The sizes of the projections a column-parallel Linear packs along its output (one: an ordinary
    contiguous split), each checked to split over `tp` ranks."""
    if not isinstance(style, ColWiseParallel):
        return (_out_size(module),)
    leaf = name.rpartition(".")[2]
    if style.packed_parts is None and leaf in _AMBIGUOUS_PACKED:
        raise ValueError(
            f"parallelize: ColWiseParallel on {name!r}: a packed '{leaf}' projection comes in two layouts; say which "
            "with ColWiseParallel(packed_parts=1) for q/k/v packed per head (GPT-NeoX, Bloom) or packed_parts=3 "
            "for [q | k | v] (ChatGLM)"
        )
    declared = _declared_parts(style, leaf)
    if declared == 1:
        return (_out_size(module),)
    if not is_linear_like(module):
        raise NotImplementedError(f"parallelize: packed projections ({name!r}) must be nn.Linear or Conv1D modules")
    in_features, out = features(module)
    if isinstance(declared, tuple):
        sizes = tuple(int(n) for n in declared)
        if sum(sizes) != out or min(sizes) <= 0:
            raise ValueError(
                f"parallelize: ColWiseParallel(packed_parts={declared}) on {name!r}: the part sizes must be positive "
                f"and add up to its {out} outputs"
            )
    else:
        sizes = _qkv_sizes(parent, out) if declared == 3 else None
        if sizes is None:
            if out % declared:
                raise ValueError(
                    f"parallelize: ColWiseParallel on {name!r} packs {declared} equal projections, which do not divide "
                    f"its {out} outputs; give each part's size: ColWiseParallel(packed_parts=(q, k, v))"
                )
            sizes = (out // declared,) * declared
    if style.part_units is not None:
        check_units(name, sizes, style.part_units, tp)
    elif any(size % tp for size in sizes):
        raise ValueError(
            f"parallelize: ColWiseParallel on {name!r} splits each of its packed projections (sizes {list(sizes)}) "
            f"over {tp} ranks, which does not divide them; use a tensor-parallel degree that divides each "
            "projection's size (or packed_parts=1 for a layout packed per head)"
        )
    if (len(set(sizes)) > 1 or style.part_units is not None) and in_features % tp:
        raise ValueError(
            f"parallelize: ColWiseParallel on {name!r} packs projections of unequal sizes {list(sizes)}, split through "
            f"its input features ({in_features}), which {tp} ranks do not divide; use a degree that divides them"
        )
    return sizes


def _declared_parts(style: ColWiseParallel, leaf: str):
    """The plan's `packed_parts` (a count or the sizes), else what the module's name implies."""
    return style.packed_parts if style.packed_parts is not None else _PACKED_PARTS.get(leaf, 1)


def _splittable(module: torch.nn.Module | None) -> bool:
    """A module ColWise/RowWiseParallel split: Linear-like (linear_like.py) or an Embedding."""
    return is_linear_like(module) or isinstance(module, torch.nn.Embedding)


def _out_size(module: torch.nn.Module) -> int:
    return features(module)[1] if is_linear_like(module) else module.embedding_dim


def _qkv_sizes(parent: torch.nn.Module | None, out: int) -> tuple[int, int, int] | None:
    """[q | k | v] sizes from the attention's head counts (its own attributes, else its `config`'s):
    unequal with grouped-query heads. None where the counts are unknown (equal thirds then)."""
    query_heads, kv_heads = _head_count(parent, _Q_HEADS), _head_count(parent, _KV_HEADS)
    if not query_heads or not kv_heads or out % (query_heads + 2 * kv_heads):
        return None
    head_dim = out // (query_heads + 2 * kv_heads)
    return (query_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)


def _remember_exit_output(module, args, output):
    module._tridist_last_output = output  # the Disable region checks its own output is this tensor


def _check_divisible(name: str, module: torch.nn.Module, style, tp: int) -> None:
    if is_linear_like(module):
        in_features, out_features = features(module)
        dim, size = ("out_features", out_features) if isinstance(style, ColWiseParallel) else ("in_features", in_features)
    else:
        dim, size = ("embedding_dim", module.embedding_dim) if isinstance(style, ColWiseParallel) else ("num_embeddings", module.num_embeddings)
    if size % tp:
        raise ValueError(
            f"parallelize: {type(style).__name__} on {name!r} splits {dim}={size} over {tp} ranks, which does not "
            f"divide it; use a tensor-parallel degree that divides {size}"
        )


_Q_HEADS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def _head_count(module: torch.nn.Module | None, attributes: tuple[str, ...]) -> int | None:
    """A head count from the module's attributes, else from its `config` (Hugging Face's Phi-3 keeps only
    the key/value count on the module)."""
    for holder in (module, getattr(module, "config", None)):
        for attribute in attributes:
            value = readable_attr(holder, attribute)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _projections(module: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Module]:
    """`module`'s children of these names (its projections among _Q_PROJECTIONS or _KV_PROJECTIONS)."""
    return [getattr(module, name) for name in names if isinstance(getattr(module, name, None), torch.nn.Module)]


_Q_PROJECTIONS = ("q_proj", "wq", "qkv_proj", "query_key_value", "Wqkv", "c_attn")
_KV_PROJECTIONS = ("k_proj", "v_proj", "wk", "wv", "qkv_proj", "query_key_value", "Wqkv", "c_attn")
_HEADS_OF = {  # head-count attribute -> the projections whose local output holds those heads
    "num_heads": _Q_PROJECTIONS, "num_attention_heads": _Q_PROJECTIONS, "n_heads": _Q_PROJECTIONS,
    "n_head": _Q_PROJECTIONS,  # GPT-1's
    "num_key_value_heads": _KV_PROJECTIONS, "num_kv_heads": _KV_PROJECTIONS, "n_kv_heads": _KV_PROJECTIONS,
}


def _localise_head_counts(model: torch.nn.Module, *, tp: int) -> list[str]:
    """Divide a head count when the projections producing those heads output local (split) heads.

    Each count follows its own projections (q for query heads, k/v for key-value heads), so a GQA model
    with replicated k/v keeps its kv-head count; a gathered output (gather_output=True) keeps all heads.
    """
    changes = []
    for name, module in model.named_modules():
        for attribute in _HEADS_OF:
            value = getattr(module, attribute, None)
            if not isinstance(value, int) or isinstance(value, bool) or attribute in getattr(
                    module, "_tridist_localised_counts", ()):  # divided by its LocalParameterRows already
                continue
            groups = _head_groups(name, module, attribute, value, tp)
            if groups is not None:
                setattr(module, attribute, value // groups)
                changes.append(f"{name}.{attribute}: {value} -> {value // groups} (local heads)")
        changes += _localise_head_groups(name, module)
    return changes


def _head_groups(name: str, module: torch.nn.Module, attribute: str, value: int, tp: int) -> int | None:
    """Over how many groups of tensor-parallel ranks the `value` heads that `module`'s `attribute` counts (a name of
    _HEADS_OF) are split: tp for query heads, tp / replicas for key/value heads that ReplicatedColWiseParallel
    computes on `replicas` ranks each; None where the projections producing them keep them whole (or there are
    none). Raises where those projections are split unalike or the heads do not divide into the groups."""
    projections = _HEADS_OF[attribute]
    present = _projections(module, projections)
    local = [getattr(p, "_tridist_local_heads", False) for p in present]
    if not any(local):
        return None
    # A packed projection's replicas are its key/value heads' (its query heads are split over every rank).
    replicas = {getattr(p, "_tridist_head_replicas", 1) if attribute in _KV_HEADS else 1 for p in present}
    if not all(local) or len(replicas) > 1:
        raise ValueError(
            f"parallelize: {name}: {projections} must be split alike (all column-parallel with local outputs, or none)"
        )
    groups = tp // replicas.pop()  # the ranks holding different heads (replicated heads: fewer than tp)
    if value % groups:
        hint = (f", or ReplicatedColWiseParallel(replicas={tp // value}) on its key/value projections (each "
                "head then computed on that many ranks)" if attribute in _KV_HEADS and tp % value == 0 else "")
        raise ValueError(
            f"parallelize: {name}.{attribute} = {value} heads cannot be split over {groups} groups of "
            f"tensor-parallel ranks; use a degree that divides the number of heads{hint}"
        )
    return groups


def _localise_head_groups(name: str, module: torch.nn.Module) -> list[str]:
    """Where an attention module's key/value heads are replicated over `r` ranks (ReplicatedColWiseParallel), each
    rank's query heads share its one key/value head: transformers' `num_key_value_groups` (query heads per key/value
    head, what repeat_kv repeats by) becomes 1/r of itself; an even split leaves that ratio as it is."""
    kv = _projections(module, _KV_PROJECTIONS)
    replicas = {getattr(p, "_tridist_head_replicas", 1) for p in kv}
    if replicas == {1} or not replicas:
        return []
    if len(replicas) > 1:
        raise ValueError(f"parallelize: {name}'s key/value projections are split differently (replicas "
                         f"{sorted(replicas)}); give k and v the same style")
    replicas = replicas.pop()
    head_dim = readable_attr(module, "head_dim")
    # The value heads' own width where the attention has one (MiMo-V2-Flash's v_head_dim): its value projection's
    # chunk is one value head
    value_dim = readable_attr(module, "v_head_dim")
    width = {p: value_dim if isinstance(value_dim, int) and p is getattr(module, "v_proj", None) else head_dim for p in kv}
    wrong = [p for p in kv if isinstance(width[p], int) and p._tridist_chunk != width[p]]
    if wrong:  # each rank must compute the one head its queries use
        out, chunk, head = wrong[0]._tridist_kv_features, wrong[0]._tridist_chunk, width[wrong[0]]
        heads, tp = out // head, replicas * (out // chunk)
        right = ("ColWiseParallel()" if heads % tp == 0 else f"ReplicatedColWiseParallel(replicas={tp // heads})"
                 if tp % heads == 0 else "a tensor-parallel degree that divides the heads or that they divide")
        raise ValueError(f"parallelize: {name}: ReplicatedColWiseParallel(replicas={replicas}) has each of the {tp} "
                         f"ranks compute {chunk} key/value features, not the one head of {head} its query heads "
                         f"use ({heads} heads); use {right} on its key/value projections")
    groups = getattr(module, "num_key_value_groups", None)
    if not isinstance(groups, int) or isinstance(groups, bool):
        return []
    if groups % replicas:
        raise ValueError(f"parallelize: {name}.num_key_value_groups = {groups} query heads per key/value head cannot "
                         f"be shared by {replicas} ranks each; use a tensor-parallel degree that divides the query heads")
    module.num_key_value_groups = groups // replicas
    return [f"{name}.num_key_value_groups: {groups} -> {groups // replicas} (each rank's query heads share one "
            "key/value head)"]


# ------------------------------------------------------------------------------------ sequence parallel
#
# Between SequenceParallelBegin and SequenceParallelEnd, activations [batch, seq, hidden] are split on
# the sequence dim across the tensor-parallel ranks: norms and residual adds work on S / tp tokens.
# Regions marked SequenceParallelDisable (attention, MLP: their tensor-parallel linears need the whole
# sequence) gather their input and split their output again. The two moves are differentiable DTensor
# redistributions: gather = all-gather forward / own slice backward (the column-parallel linears
# already all-reduce their input gradients); split = own slice forward / all-gather backward.
# Parameters of modules that see only S / tp tokens (norm weights) get partial gradients: torch's
# SequenceParallel style makes them Replicate DTensors whose gradients are reduced over the ranks.

def _apply_sequence_parallel(name: str, module: torch.nn.Module, style, *, tp_mesh, in_region: bool,
                             sequence_split: SequenceSplit, overlap_comm: str | None = None) -> str:
    def gather_input(_, args, kwargs):
        return map_first_activation(args, kwargs, lambda x: gather_sequence(x, tp_mesh))

    def split_input(_, args, kwargs):
        return map_first_activation(args, kwargs, lambda x: split_sequence(x, tp_mesh))

    def split_output(_, args, output):
        return map_output(output, lambda x: split_sequence(x, tp_mesh))

    def gather_output(_, args, output):
        return map_output(output, lambda x: gather_sequence(x, tp_mesh))

    def gather_block_output(_, args, output):  # a block in global view gives DTensors with global shapes
        def whole(x):
            if isinstance(x, DTensor):
                return x.redistribute(tp_mesh, [Replicate()]).to_local(grad_placements=[Replicate()])
            return gather_sequence(x, tp_mesh)

        return map_output(output, whole)

    if isinstance(style, SequenceParallelBegin):
        module.register_forward_hook(sequence_split.mark)
    # Boundary hooks run before a module's own tensor-parallel input conversion (prepend=True).
    elif isinstance(style, SequenceParallelEnd) and style.at_output:
        module.register_forward_hook(gather_block_output)
    elif isinstance(style, SequenceParallelEnd):
        module.register_forward_pre_hook(gather_input, with_kwargs=True, prepend=True)
    elif isinstance(style, SequenceParallelDisable):
        if overlap_comm:
            OverlappedRegion.install(name, module, tp_mesh, overlap_comm)  # gathers once, fused with the entries
        else:
            module.register_forward_pre_hook(gather_input, with_kwargs=True, prepend=True)
        exits = [child for child in module.children() if getattr(child, "_tridist_scatters_sequence", False)]
        if exits:
            module.register_forward_hook(_check_exit(name, exits))
        else:
            module.register_forward_hook(split_output)  # no row-parallel exit: split the full output
    else:  # SequenceParallelEnable: the module runs on sequence slices; its parameters are shared
        _replicate_over_sequence_slices(module, tp_mesh)
        if not in_region:  # Paddle's self-contained form: split on entry, gather on exit
            module.register_forward_pre_hook(split_input, with_kwargs=True, prepend=True)
            module.register_forward_hook(gather_output)
    module._tridist_sequence_parallel = type(style).__name__
    return f"{name}: {type(style).__name__}"


class SequenceSplit:
    """The sequence split of one model (pipeline stage), pending from its Begin module's output until the
    first parameterised module of the region runs and splits its input. Splitting there rather than at
    the Begin output lets model code between the two (masks and positions built from the embedding
    output, as Hugging Face does) see the whole sequence. One per model: two models (or stages) in one
    process never take each other's split."""

    def __init__(self, tp_mesh):
        # `lengths`: (whole, slice) sequence lengths of this forward's split once taken (None: not split in it)
        self.tp_mesh, self.pending, self.lengths = tp_mesh, False, None

    def mark(self, module, args, output) -> None:
        self.pending, self.lengths = True, None

    def take(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.pending:
            return hidden
        self.pending = False
        whole = hidden.shape[SEQUENCE_DIM]
        self.lengths = (whole, whole // self.tp_mesh.size())
        return split_sequence(hidden, self.tp_mesh)

    def forget(self, *_) -> None:
        """At the model's entry: a forward that raised midway leaves no split behind."""
        self.pending, self.lengths = False, None

    def refuse_on_slices(self, name: str, module, args, kwargs) -> None:
        """A module outside the sequence-parallel span, whose parameters the plan leaves whole and unreduced (the span
        is read in registration order), given a slice of the split sequence (its hidden states this forward's slice
        length, not the whole's): its gradients would cover this rank's slice only, silently. Its input, not the
        state of the forward, decides: inside a Disable region (attention, MLP) the sequence is whole again."""
        if self.lengths is None:
            return
        hidden = first_activation(args, kwargs)
        whole, piece = self.lengths
        if hidden is not None and hidden.dim() >= 2 and hidden.shape[SEQUENCE_DIM] == piece != whole:
            raise ValueError(
                f"parallelize: {name!r} ({type(module).__name__}) runs on a slice of the sequence ({piece} of its {whole} "
                "tokens) under sequence parallel, but it is registered outside the region between the embedding and "
                "the final norm (modules are read in registration order), so the plan leaves its parameters whole and "
                "their gradients would cover this rank's slice only; register it between the decoder layers' list and "
                "the final norm (or among the layers), or use tp without sequence parallel")

    def take_at_entry(self, module, args, kwargs):
        if not self.pending:
            return None
        return map_first_activation(args, kwargs, self.take)


def sequence_split_of(model: torch.nn.Module, tp_mesh) -> SequenceSplit:
    split = vars(model).get("_tridist_sequence_split")
    if split is None:
        split = model._tridist_sequence_split = SequenceSplit(tp_mesh)
    return split


def take_pending_split(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A pipeline stage ends with a split still pending (its last layer was the Begin): the next stage's
    first module would have taken it, on other ranks, so the activation leaves this stage split."""
    split = vars(model).get("_tridist_sequence_split")
    return hidden if split is None else split.take(hidden)


def guard_outside_span(model: torch.nn.Module, plan: "TensorParallelPlan") -> None:
    """Modules outside the sequence-parallel span with trainable parameters of their own raise if a slice of the
    split sequence reaches them (`SequenceSplit.refuse_on_slices`): the span is read in registration order, which a
    model may not follow (a projection registered after the LM head, or before the embedding, but applied between the
    last layer and the final norm trained with its gradients from one slice of the sequence, silently, before this
    guard). Installed where the model holds its Begin and its End modules (not on pipeline stages that hold one of
    them only: there a forward's split is not seen whole)."""
    split = vars(model).get("_tridist_sequence_split")
    modules = dict(model.named_modules())
    boundaries = {name: kind for name, styles in plan.styles.items() for st in styles
                  for kind in (SequenceParallelBegin, SequenceParallelEnd) if isinstance(st, kind)}
    if split is None or set(boundaries.values()) != {SequenceParallelBegin, SequenceParallelEnd} or any(
            name not in modules or getattr(modules[name], "_tridist_stand_in", False) for name in boundaries):
        return
    model.register_forward_pre_hook(split.forget)
    for name, module in modules.items():
        if name and name not in plan.sequence_span and any(p.requires_grad for p in module.parameters(recurse=False)):
            module.register_forward_pre_hook(functools.partial(split.refuse_on_slices, name), with_kwargs=True)


def _split_points(model: torch.nn.Module, names: list[str]) -> list[str]:
    """The top-most parameterised modules among `names` (decoder blocks, a final norm, Disable and End
    modules; not ModuleLists): whichever runs first after Begin takes the pending split."""
    modules = dict(model.named_modules())
    chosen: list[str] = []
    for name in names:
        module = modules[name]
        if any(name.startswith(c + ".") for c in chosen) or isinstance(module, torch.nn.ModuleList):
            continue
        if next(module.parameters(), None) is None:
            continue  # parameter-free helpers (a rotary table builder) only read the activation's dtype
        chosen.append(name)
    return chosen


def install_lazy_split(model: torch.nn.Module, names: tuple[str, ...], *, tp_mesh) -> None:
    """The sequence split taken by whichever of `names` runs first after the Begin module (none: nothing)."""
    if not names:
        return
    split = sequence_split_of(model, tp_mesh)
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(split.take_at_entry, with_kwargs=True, prepend=True)


def _check_exit(name: str, exits: list[torch.nn.Module]):
    """The region's output must be its row-parallel exit's (already reduce-scattered) output, or a dropout of it
    (Starcoder2's and Seed-OSS's residual dropout after o_proj, inside the attention): elementwise on the rank's
    sequence slice, as one device applies it to the whole sequence."""

    def hook(module, args, output):
        first = first_output(output)
        if not any(first is e_out or _dropout_of(first, e_out) for e_out in
                   (getattr(e, "_tridist_last_output", None) for e in exits) if e_out is not None):
            raise RuntimeError(
                f"parallelize: the output of SequenceParallelDisable region {name!r} is not the output of its "
                "row-parallel linear (something runs after it inside the region, e.g. a residual add); put the "
                "Disable style on the module whose output is that linear's, or (with to_distributed) choose a "
                "strategy without sequence_parallel"
            )
        for e in exits:
            e._tridist_last_output = None
        return output

    return hook


def _dropout_of(tensor, source: torch.Tensor) -> bool:
    """Whether autograd made `tensor` from `source` by a dropout (training mode): one product with a mask that needs
    no gradient (the CPU's dropout), or the fused dropout op (CUDA's), of `source`'s shape. A product with anything
    built from the gathered sequence could not keep the slice's shape; anything else is refused."""
    node = getattr(tensor, "grad_fn", None)
    if node is None or source.grad_fn is None or tensor.shape != source.shape:
        return False
    inputs = [fn for fn, _ in node.next_functions if fn is not None]
    return node.name() in ("MulBackward0", "NativeDropoutBackward0") and inputs == [source.grad_fn]


def _replicate_over_sequence_slices(module: torch.nn.Module, tp_mesh) -> None:
    """torch's SequenceParallel style on `module` (its parameters Replicate DTensors, their gradients reduced over
    the tp ranks), each parameter keeping its requires_grad: the style makes every parameter it replicates
    trainable, so a frozen norm would get a gradient and move under an optimizer given all parameters."""
    frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
    parallelize_module(module, tp_mesh, SequenceParallel(sequence_dim=SEQUENCE_DIM, use_local_output=True))
    for name, param in module.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def _sequence_parallel_norms(root: torch.nn.Module, region: frozenset, *, tp_mesh) -> list[str]:
    """Norm-like modules (only 1-D parameters, none split, and no children with parameters) inside the
    sequence-parallel region that the plan did not mark: they run on sequence slices, so their parameters need
    SequenceParallel too (Paddle applies this implicitly; its example marks only the boundaries). A norm before
    Begin or after End runs on the whole sequence and is left alone: making it sequence parallel would reduce its
    full-sequence gradients over the ranks (tp times too large). A module with 1-D parameters of its own and
    children with more (Falcon-H1's Mamba mixer: A_log, D, dt_bias beside its projections and convolution) is no
    norm: _check_region_parameters refuses it, naming its parameters.
    """
    changes = []
    for name, module in [(n, m) for n, m in root.named_modules() if n in region]:
        params = list(module.parameters(recurse=False))
        if (
            getattr(module, "_tridist_sequence_parallel", None)
            or not params
            or any(p.dim() != 1 or isinstance(p, DTensor) for p in params)
            or len(params) != sum(1 for _ in module.parameters())
        ):
            continue
        _replicate_over_sequence_slices(module, tp_mesh)
        module._tridist_sequence_parallel = "SequenceParallelEnable"
        changes.append(f"{name}: SequenceParallelEnable (implicit: runs on sequence slices)")
    return changes
