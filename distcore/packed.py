"""torch parallel styles for a Linear that packs several projections along its output ([q | k | v],
[gate | up]), each split over the tensor-parallel ranks part by part; and FSDP2's shard placement for
their weights. Used by the ColWiseParallel style (tensor_parallel.py) and by overlap.py; imports neither.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard


def packed_colwise(sizes: tuple[int, ...], *, gather_output: bool, local_output: bool = True,
                   units: tuple[int, ...] | None = None, out_dim: int = 0) -> ParallelStyle:
    """torch's style for a Linear packing projections of `sizes` (see the two classes); `units`: each part's count
    of indivisible units (UnequalPackedColwise), where some part has fewer than the ranks; `out_dim`: the weight's
    dim of the output features (0: nn.Linear's [out, in]; 1: transformers' Conv1D, linear_like.py)."""
    if len(set(sizes)) == 1 and units is None:
        return PackedColwiseParallel(len(sizes), gather_output=gather_output, local_output=local_output, out_dim=out_dim)
    return UnequalPackedColwise(sizes, gather_output=gather_output, local_output=local_output, units=units,
                                out_dim=out_dim)


def distribute_parameters(module: torch.nn.Module, device_mesh, layouts: dict, src_data_rank: int | None = 0) -> None:
    """Each parameter of `module` itself (not its children's) made a DTensor of its placements in `layouts`
    ({name: [placement]}), registered in its place: a style's partition function."""
    for pname, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, torch.nn.Parameter(
            distribute_tensor(param, device_mesh, layouts[pname], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


def unit_span(size: int, units: int, tp: int, rank: int) -> tuple[int, int]:
    """(start, length) within a part of `size` features made of `units` indivisible units (heads, groups) of the
    features rank `rank` of `tp` computes: its 1/tp where tp divides the units, else (tp a multiple of them) the one
    unit it shares with tp / units ranks (as grouped-query attention's key/value heads are replicated)."""
    if units >= tp:
        return rank * (size // tp), size // tp
    unit = rank // (tp // units)
    return unit * (size // units), size // units


def check_units(name: str, sizes: tuple[int, ...], units: tuple[int, ...], tp: int) -> None:
    """Each part of `sizes` made of its `units` splits over `tp` ranks (unit_span): tp divides the units or they
    divide tp, and the units divide the part."""
    if len(units) != len(sizes):
        raise ValueError(f"parallelize: {name!r}: {len(units)} unit counts for {len(sizes)} packed parts")
    for size, count in zip(sizes, units):
        if count <= 0 or size % count or (count % tp if count >= tp else tp % count):
            raise ValueError(f"parallelize: {name!r} packs a part of {size} features in {count} units (heads or groups), "
                             f"which {tp} tensor-parallel ranks neither divide nor are a multiple of; use a degree that "
                             "divides every part's units or that they divide")


class PackedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a Linear packing `parts` equal projections along its output ([q | k | v]).

    The weight is `_StridedShard(0, split_factor=parts)` (a Conv1D's: on its dim 1, `out_dim`): each part split over
    the ranks, a rank's shard the concatenation of its share of every part, the global value the single-device layout.
    DTensor propagates it through the matmul (output `_StridedShard(-1)`), so the local output is
    [q_r | k_r | v_r]. The bias stays replicated (a slice of it is taken in the forward): FSDP2 can
    only shard a 1-D parameter on dim 0, which cannot express a per-part split.
    """

    def __init__(self, parts: int, *, gather_output: bool, local_output: bool = True, out_dim: int = 0):
        super().__init__(output_layouts=Replicate() if gather_output else None)
        self.parts, self.gather_output, self.local_output, self.out_dim = parts, gather_output, local_output, out_dim

    def describe(self) -> str:
        return f"{self.parts} packed projections of equal size, each split"

    def _partition_linear_fn(self, name, module, device_mesh):
        distribute_parameters(module, device_mesh, {"weight": [_StridedShard(self.out_dim, split_factor=self.parts)],
                                                    "bias": [Replicate()]}, self.src_data_rank)

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts), self._prepare_packed_output,
        )

    def _prepare_packed_output(self, module, output: DTensor, device_mesh) -> torch.Tensor:
        target = Replicate() if self.gather_output else _StridedShard(output.dim() - 1, split_factor=self.parts)
        if output.placements != (target,):
            output = output.redistribute(device_mesh, [target])
        return output.to_local() if self.local_output else output


class UnequalPackedColwise(ParallelStyle):
    """ColWise for a Linear packing projections of unequal sizes ([q | k | v] with grouped-query heads):
    as with equal parts, rank r's output is [q_r | k_r | v_r], its share of every part.

    DTensor has no placement for "each of several unequal parts split" (`_StridedShard` needs equal
    parts), so the weight is split on its input features instead (Shard(1): a plain block, so FSDP2,
    checkpoints and the global value keep the single-device layout) and the bias stays replicated. Each
    rank multiplies its slice of the input features into a partial sum of the whole output (a Partial
    DTensor), orders its columns rank by rank ([q_0 k_0 v_0 | q_1 k_1 v_1 | ...]) and a reduce-scatter
    leaves it the sum of its own chunk: the output all-reduce that Megatron's column split avoids, as a
    reduce-scatter (1 / tp of an all-reduce's bytes per rank, activations of the packed width); the
    backward all-gathers the output gradient and the input gradient. In global view (`local_output`
    False) the output is the DTensor of the single-device layout, split on its features.

    `units` (local view only): each part's count of indivisible units (heads, groups). A part with fewer units than
    the ranks (a Mamba-2 mixer's B and C, of n_groups state groups, where tp exceeds them) is computed whole on every
    rank: its partial sums all-reduced (`SumBothWays`: each rank then uses its own unit for its own heads, so their
    gradients are summed back), and each rank keeps its unit (`unit_span`). A small part: Mamba-2's B and C are
    n_groups x d_state wide.
    """

    def __init__(self, sizes: tuple[int, ...], *, gather_output: bool, local_output: bool = True,
                 units: tuple[int, ...] | None = None, out_dim: int = 0):
        super().__init__()
        self.sizes, self.gather_output, self.local_output = tuple(sizes), gather_output, local_output
        self.in_dim = 1 - out_dim  # the weight's dim of the input features (a Conv1D's is 0)
        self.units = tuple(units) if units is not None else None
        self._orders: dict = {}  # (device, parts) -> _rank_major_columns

    def describe(self) -> str:
        whole = f", those of {list(self.units)} units fewer than the ranks whole on every rank" if self.units else ""
        return f"{len(self.sizes)} packed projections of {list(self.sizes)} outputs, each split{whole}"

    def _replicated(self, tp: int) -> tuple[bool, ...]:
        """Per part: whether it has fewer units than the `tp` ranks (computed whole on every rank)."""
        return tuple(units < tp for units in self.units) if self.units else (False,) * len(self.sizes)

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._prepare_input, self._prepare_output)

    def _partition(self, name, module, device_mesh) -> None:
        distribute_parameters(module, device_mesh, {"weight": [Shard(self.in_dim)], "bias": [Replicate()]})

    @staticmethod
    def _prepare_input(module, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
        return x.redistribute(device_mesh, [Shard(-1)])  # this rank's input features: a local slice

    def _prepare_output(self, module, output: DTensor, device_mesh):
        if output.placements != (Partial(),):
            raise RuntimeError(f"parallelize: expected partial sums from a Linear split on its input, got {output.placements}")
        if self.gather_output or not self.local_output:
            target = Replicate() if self.gather_output else Shard(-1)
            output = output.redistribute(device_mesh, [target])
            return output.to_local() if self.local_output else output
        # The gradient of a partial sum is the gradient of the sum: the same on every rank.
        partial_sum = output.to_local(grad_placements=[Replicate()])
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        replicated = self._replicated(tp)
        split = [i for i, whole in enumerate(replicated) if not whole]
        order = self._rank_major_columns(tp, partial_sum.device, tuple(split))  # built once per device
        mine = DTensor.from_local(partial_sum.index_select(-1, order), device_mesh, [Partial()], run_check=False).redistribute(
            device_mesh, [Shard(-1)]).to_local()
        if not any(replicated):
            return mine
        # The parts with fewer units than ranks: all-reduced whole (small), each rank's unit kept; then every part's
        # features in the single-device order of parts, as the module's code splits them.
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        whole_columns = torch.cat([partial_sum.narrow(-1, starts[i], self.sizes[i])
                                   for i, whole in enumerate(replicated) if whole], dim=-1)
        summed = SumBothWays.apply(whole_columns, device_mesh.get_group())
        pieces, at_split, at_whole = [], 0, 0
        for i, whole in enumerate(replicated):
            start, length = unit_span(self.sizes[i], self.units[i], tp, rank)
            if whole:
                pieces.append(summed.narrow(-1, at_whole + start, length))
                at_whole += self.sizes[i]
            else:
                pieces.append(mine.narrow(-1, at_split, length))
                at_split += length
        return torch.cat(pieces, dim=-1)

    def _rank_major_columns(self, tp: int, device, parts: tuple[int, ...] | None = None) -> torch.Tensor:
        """Column indices [part 0's chunk 0, part 1's chunk 0, ..., part 0's chunk 1, ...] of the `parts` (default:
        all), made on the first forward on `device` and kept (the forward of every layer needs them)."""
        parts = tuple(range(len(self.sizes))) if parts is None else parts
        order = self._orders.get((device, parts))
        if order is None:
            starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
            order = self._orders[device, parts] = torch.cat([
                torch.arange(starts[i] + rank * self.sizes[i] // tp, starts[i] + (rank + 1) * self.sizes[i] // tp,
                             device=device)
                for rank in range(tp) for i in parts])
        return order


class SumBothWays(torch.autograd.Function):
    """An all-reduce (sum) whose backward is an all-reduce (sum) too: for a value that every rank then uses for its
    own part of the model (its own heads), so each rank's gradient of it is a share of the whole gradient. (DTensor's
    Partial -> Replicate takes the gradient as the same on every rank, which it is not here.)"""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        summed = tensor.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(summed, group=ctx.group)
        return summed, None


def fsdp_shard_placement(param: torch.nn.Parameter):
    """FSDP2's shard placement for `param` (its `shard_placement_fn`): for a packed projection's weight, the dim its
    per-part split is not on (dim 1 of a Linear's, 0 of a Conv1D's), else None (FSDP's dim 0). FSDP sharding the
    dim of a per-part split would describe it wrongly (its global value, state dict and checkpoints would be
    scrambled); the other dim is independent."""
    if isinstance(param, DTensor) and param.dim() == 2:
        strided = [p.dim for p in param.placements if isinstance(p, _StridedShard)]
        if strided:
            return Shard(1 - strided[0])
    return None
