"""Sequence-parallel tensor parallel with its collectives hidden behind the matmuls (mp_config["overlap_comm"]).

Megatron-style sequence parallelism moves activations at each region's edges: a region marked
SequenceParallelDisable (attention, MLP) all-gathers its sequence-split input, and its row-parallel
exit (o_proj, down_proj) reduce-scatters its output back onto sequence shards. Without overlap, each
collective runs before or after its matmuls. Here both run as kernels' rings, computing on one chunk
while the next travels:

- entry: the region's pre-hook runs one `kernels.all_gather_matmul` over *every* column-parallel
  Linear directly under the region (q, k, v or a packed qkv; gate and up or a packed gate_up): the
  input is gathered once and each chunk feeds every projection. The module then runs its own forward on
  the gathered input (returned by the ring, so code reading `hidden_states.shape` still works), and
  each entry projection, called with that input, returns its precomputed output (+ its bias).
- exit: the row-parallel Linear computes `kernels.matmul_reduce_scatter` (+ its bias, once, after the
  reduce-scatter).

Backend: `"overlap_comm": True` runs tridist's point-to-point rings (kernels' default, backend "ring":
any process group, NCCL within and across nodes); `"overlap_comm": "symm_mem"` runs torch's
symmetric-memory fused ops instead (CUDA GPUs of one node; copy engines move the chunks, so the matmuls
keep every SM), refused with the reason when parallelize runs where they cannot (kernels.comm_matmul.
check_backend_available).

torch.compile: Dynamo cannot read version counters, so a compiled forward skips the in-place check of
the region's input; regions inside the decoder blocks were checked by parallelize's block check (an
eager forward of one block per type, overlapped; in eval mode: an in-place change made only in training,
such as an in-place dropout of the region's input, is not seen there), and a region outside them refuses
to be traced before an eager forward checked it.

Gradients: the projections' input gradients are reduce-scattered by the entry ring's backward, the exit's
by an all-gather ring; a replicated use of the gathered input by model code keeps its own rows (the ring's
`return_gathered`). Weights stay DTensors split as without overlap (checkpoints, FSDP2 on the same mesh,
the optimizer see no difference); the Linears only change class (`OverlappedEntryLinear<cls>`, as FSDP2's
`fully_shard` does) so that their forward takes the fused path: names, parameters and hooks are kept.

Contract: an entry projection must be called with the region's input itself (`self.q_proj(hidden_states)`),
unchanged in place, once per forward; the region's output must be its exit's (as without overlap); the
region must not be recomputed on its own (selective recompute wraps its forward, whose recomputation
skips the region's hooks; full recompute of the layer re-runs the region with its hooks and works). Anything else raises, naming the module.

Cost: with a batch of more than one sequence, the gathered input [B, S, H] is assembled from the ring's
source-major buffer [W, B, S/W, H] by one copy (the ring receives into contiguous slots); batch 1 is a
view. Modules built with these classes do not pickle whole (`torch.save(model)`); their state_dict does. A packed projection of unequal parts (q/k/v with grouped-query heads in one Linear) is split
on its input features and needs a reduce-scatter of its output: it cannot be an overlapped entry
(refused with the reason), nor can blocks running in global view (global_view.refuse_overlap).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_module
from torch.distributed.tensor.placement_types import _StridedShard

from tridist.kernels import all_gather_matmul, matmul_reduce_scatter

from .linear_like import is_linear_like, matmul_weight
from .sequence_layout import SEQUENCE_DIM, map_first_activation
from .packed import UnequalPackedColwise


class OverlappedEntryLinear:
    """Mixin of a column-parallel Linear at a region's entry: its output was computed by the region's ring."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._tridist_region.output_of(self, input)


class OverlappedExitLinear:
    """Mixin of a row-parallel Linear at a region's exit: matmul and reduce-scatter in one ring."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        mesh = self.weight.device_mesh
        weight = matmul_weight(self, self.weight.to_local())  # [out, in]: a Conv1D's transposed, a view
        out = matmul_reduce_scatter(input, weight, mesh.get_group(), scatter_dim=SEQUENCE_DIM,
                                    backend=self._tridist_overlap_backend)
        if self.bias is not None:  # once, after the sum; its gradient summed over the ranks' sequence shards
            out = (DTensor.from_local(out, mesh, [Shard(SEQUENCE_DIM)], run_check=False) + self.bias.to(out.dtype)).to_local()
        return out


@functools.lru_cache(maxsize=None)
def _with_mixin(cls: type, mixin: type) -> type:
    return type(f"{mixin.__name__[:-len('Linear')]}{cls.__name__}", (mixin, cls), {})


def _swap_class(module: torch.nn.Module, mixin: type) -> None:
    module.__class__ = _with_mixin(type(module), mixin)


def apply_overlapped_entry(style, target, torch_style) -> str:
    """A ColWiseParallel Linear directly under a Disable region, with overlap: its weight (and bias) split
    as torch_style splits them, its forward the region's precomputed output; returns how, for the log."""
    module = target.module
    if not is_linear_like(module):
        raise ValueError(f"parallelize: overlap_comm: {target.name} is a {type(module).__name__}; the entry of a "
                         "sequence-parallel region must be an nn.Linear (or transformers' Conv1D)")
    if isinstance(torch_style, UnequalPackedColwise):
        raise ValueError(
            f"parallelize: overlap_comm cannot overlap {target.name}: its packed parts have unequal sizes "
            f"({torch_style.describe()}), so it is split on its input features and reduce-scatters its output, "
            "which the all-gather ring cannot feed; leave overlap_comm off for this model, or give q, k and v "
            "separate projections")
    if style.gather_output:
        raise ValueError(f"parallelize: overlap_comm: {target.name} has ColWiseParallel(gather_output=True) inside a "
                         "sequence-parallel region; its outputs stay split there")
    distribute_module(module, target.tp_mesh, partition_fn=torch_style._partition_linear_fn)
    _swap_class(module, OverlappedEntryLinear)
    module._tridist_overlap_entry = True
    module._tridist_packed_parts = getattr(torch_style, "parts", 1)  # PackedColwiseParallel's equal parts
    return f"overlapped: fed by the region's all-gather ({target.overlap_comm})"


def apply_overlapped_exit(style, target, torch_style) -> str:
    """A RowWiseParallel Linear at a Disable region's exit, with overlap: its weight (and bias) split as
    torch_style splits them, its forward one matmul_reduce_scatter ring; returns how, for the log (the
    caller marks it as the region's exit, as without overlap)."""
    if not style.is_input_parallel:
        raise ValueError(f"parallelize: overlap_comm: {target.name} has RowWiseParallel(is_input_parallel=False) "
                         "at a sequence-parallel region's exit; its input must be the split activation")
    distribute_module(target.module, target.tp_mesh, partition_fn=torch_style._partition_linear_fn)
    _swap_class(target.module, OverlappedExitLinear)
    target.module._tridist_overlap_backend = target.overlap_comm
    return f"overlapped: matmul and reduce-scatter fused ({target.overlap_comm})"


def _local_bias(linear: torch.nn.Module) -> torch.Tensor:
    """This rank's columns of an entry's bias: split like its output (a packed projection keeps its bias
    replicated, see PackedColwiseParallel: each part's slice is taken, differentiably)."""
    bias = linear.bias
    if linear._tridist_packed_parts > 1:
        bias = bias.redistribute(bias.device_mesh, [_StridedShard(0, split_factor=linear._tridist_packed_parts)])
    return bias.to_local()


def mark_checked(model: torch.nn.Module, blocks: list[str]) -> None:
    """The regions inside `blocks` ran overlapped in parallelize's eager block check (block_check.py: one
    copy per block type, whose entries would have raised on an in-place change of the region's input):
    torch.compile may trace them without running that check itself."""
    for name, module in model.named_modules():
        region = getattr(module, "_tridist_region", None)
        if region is not None and any(name == block or name.startswith(block + ".") for block in blocks):
            region.checked = True


class OverlappedRegion:
    """One Disable region's entry: on entry, the ring computes every entry projection and returns the
    gathered input; the projections take their outputs; on exit, nothing is left behind."""

    def __init__(self, name: str, entries: list[tuple[str, torch.nn.Module]], tp_mesh, backend: str):
        self.name, self.entries, self.tp_mesh, self.backend = name, entries, tp_mesh, backend
        self.gathered: torch.Tensor | None = None
        self.version = 0  # the gathered input's version counter when the ring made it
        self.outputs: dict[int, torch.Tensor] = {}
        self.checked = False  # an eager forward read the entries without an in-place change of the input

    @classmethod
    def install(cls, name: str, module: torch.nn.Module, tp_mesh, backend: str) -> "OverlappedRegion":
        entries = [(child_name, child) for child_name, child in module.named_children()
                   if getattr(child, "_tridist_overlap_entry", False)]
        if not entries:
            raise ValueError(
                f"parallelize: overlap_comm: the sequence-parallel region {name!r} has no column-parallel Linear "
                "directly under it to feed from its all-gather; mark the projections ColWiseParallel (or leave "
                "overlap_comm off)")
        if getattr(module, "_tridist_recompute_wrapper", None):
            raise ValueError(
                f"parallelize: overlap_comm: {name}'s forward is wrapped for activation recompute on its own "
                "(selective recompute): its recomputation in backward would run without the region's overlapped "
                "gather. Recompute whole layers ('full') or leave overlap_comm off")
        region = cls(name, entries, tp_mesh, backend)
        for _, child in entries:
            child._tridist_region = region
        module.register_forward_pre_hook(region.enter, with_kwargs=True, prepend=True)
        module.register_forward_hook(region.leave, always_call=True)
        return region

    def enter(self, module, args, kwargs):
        return map_first_activation(args, kwargs, self._gather_and_project)

    def _gather_and_project(self, x_shard: torch.Tensor) -> torch.Tensor:
        weights = [matmul_weight(child, child.weight.to_local()) for _, child in self.entries]
        gathered, outputs = all_gather_matmul(x_shard, weights, self.tp_mesh.get_group(), gather_dim=SEQUENCE_DIM,
                                              return_gathered=True, backend=self.backend)
        self.gathered = gathered
        self.version = 0 if torch.compiler.is_compiling() else gathered._version
        self.outputs = {id(child): y for (_, child), y in zip(self.entries, outputs)}
        return gathered

    def output_of(self, linear: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
        child = next(n for n, c in self.entries if c is linear)
        if input is not self.gathered:
            raise RuntimeError(
                f"parallelize: overlap_comm: {self.name}.{child} was called with a tensor other than its region's "
                "input; an overlapped entry projection must read the region's input itself (its output was computed "
                "by the region's all-gather ring). Leave overlap_comm off for this model")
        if torch.compiler.is_compiling():
            # torch.compile cannot read version counters (a graph break that drops the whole forward back to
            # eager): the in-place check must have run eagerly, in parallelize's block check or a forward.
            if not self.checked:
                raise RuntimeError(
                    f"parallelize: overlap_comm: {self.name} is traced by torch.compile before its in-place check ran "
                    "(parallelize checks decoder blocks in a layer list eagerly; this region is outside them): run one "
                    "forward without torch.compile first, then compile")
        elif input._version != self.version:
            raise RuntimeError(
                f"parallelize: overlap_comm: the input of {self.name} was changed in place before {child} read it; "
                "its output was computed by the region's all-gather ring from the values before the change. Leave "
                "overlap_comm off for this model (or change a copy)")
        else:
            self.checked = True
        output = self.outputs.pop(id(linear), None)
        if output is None:
            raise RuntimeError(f"parallelize: overlap_comm: {self.name}.{child} was called twice in one forward; an "
                               "overlapped entry projection runs once per forward of its region")
        if linear.bias is not None:  # in the output's dtype, as F.linear adds it (under autocast too)
            output = output + _local_bias(linear).to(output.dtype)
        return output

    def leave(self, module, args, output):
        self.gathered, self.outputs = None, {}
        return output
