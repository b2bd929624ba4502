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


def packed_colwise(sizes: tuple[int, ...], *, gather_output: bool, local_output: bool = True) -> ParallelStyle:
    """torch's style for a Linear packing projections of `sizes` (see the two classes)."""
    if len(set(sizes)) == 1:
        return PackedColwiseParallel(len(sizes), gather_output=gather_output, local_output=local_output)
    return UnequalPackedColwise(sizes, gather_output=gather_output, local_output=local_output)


class PackedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a Linear packing `parts` equal projections along its output ([q | k | v]).

    The weight is `_StridedShard(0, split_factor=parts)`: each part split over the ranks, a rank's
    shard the concatenation of its share of every part, the global value the single-device layout.
    DTensor propagates it through the matmul (output `_StridedShard(-1)`), so the local output is
    [q_r | k_r | v_r]. The bias stays replicated (a slice of it is taken in the forward): FSDP2 can
    only shard a 1-D parameter on dim 0, which cannot express a per-part split.
    """

    def __init__(self, parts: int, *, gather_output: bool, local_output: bool = True):
        super().__init__(output_layouts=Replicate() if gather_output else None)
        self.parts, self.gather_output, self.local_output = parts, gather_output, local_output

    def describe(self) -> str:
        return f"{self.parts} packed projections of equal size, each split"

    def _partition_linear_fn(self, name, module, device_mesh):
        layouts = {"weight": [_StridedShard(0, split_factor=self.parts)], "bias": [Replicate()]}
        for pname, param in list(module.named_parameters(recurse=False)):
            dist_param = distribute_tensor(param, device_mesh, layouts[pname], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, torch.nn.Parameter(dist_param, requires_grad=param.requires_grad))

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
    """

    def __init__(self, sizes: tuple[int, ...], *, gather_output: bool, local_output: bool = True):
        super().__init__()
        self.sizes, self.gather_output, self.local_output = tuple(sizes), gather_output, local_output
        self._orders: dict = {}  # device -> _rank_major_columns

    def describe(self) -> str:
        return f"{len(self.sizes)} packed projections of {list(self.sizes)} outputs, each split"

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._prepare_input, self._prepare_output)

    @staticmethod
    def _partition(name, module, device_mesh) -> None:
        layouts = {"weight": [Shard(1)], "bias": [Replicate()]}
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, torch.nn.Parameter(
                distribute_tensor(param, device_mesh, layouts[pname]), requires_grad=param.requires_grad))

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
        order = self._rank_major_columns(device_mesh.size(), partial_sum.device)  # built once per device
        return DTensor.from_local(partial_sum.index_select(-1, order), device_mesh, [Partial()], run_check=False).redistribute(
            device_mesh, [Shard(-1)]).to_local()

    def _rank_major_columns(self, tp: int, device) -> torch.Tensor:
        """Column indices [part 0's chunk 0, part 1's chunk 0, ..., part 0's chunk 1, ...], made on the
        first forward on `device` and kept (the forward of every layer needs them)."""
        order = self._orders.get(device)
        if order is None:
            starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
            order = self._orders[device] = torch.cat([
                torch.arange(start + rank * size // tp, start + (rank + 1) * size // tp, device=device)
                for rank in range(tp) for start, size in zip(starts, self.sizes)])
        return order


def fsdp_shard_placement(param: torch.nn.Parameter):
    """FSDP2's shard placement for `param` (its `shard_placement_fn`): dim 1 for a packed projection's
    weight, None (FSDP's dim 0) otherwise. FSDP sharding dim 0 of a per-part split weight would describe
    it wrongly (its global value, state dict and checkpoints would be scrambled); dim 1 is independent."""
    if isinstance(param, DTensor) and param.dim() == 2 and any(isinstance(p, _StridedShard) for p in param.placements):
        return Shard(1)
    return None
