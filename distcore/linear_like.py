"""Linear-like modules: nn.Linear and transformers' Conv1D (GPT-2, GPT-1, GPT-SW3), a Linear whose weight is stored
transposed, [in_features, out_features], and applied as `addmm(bias, x, weight)`.

The parallel styles split either kind: this module says where each keeps its output features (`weight_out_dim`) and
holds torch's column- and row-parallel styles for the transposed layout. A split Conv1D stays a Conv1D: its parameters
keep their names, shapes and global values (state_dict, checkpoints and transformers' from_pretrained see GPT-2's
layout), and its own forward runs on DTensor parameters, as torch's styles run nn.Linear's.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tridist.autotune.model import is_conv1d

from .packed import distribute_parameters


def is_linear_like(module: torch.nn.Module | None) -> bool:
    return isinstance(module, torch.nn.Linear) or is_conv1d(module)


def weight_out_dim(module: torch.nn.Module) -> int:
    """The dim of the module's weight that holds its output features: 0 for nn.Linear ([out, in]), 1 for Conv1D."""
    return 1 if is_conv1d(module) else 0


def features(module: torch.nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear-like module."""
    if is_conv1d(module):
        return int(module.nx), int(module.nf)
    return module.in_features, module.out_features


def matmul_weight(module: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """`weight` (the module's, or this rank's part of it) in nn.Linear's [out, in] layout: a view, no copy."""
    return weight.t() if is_conv1d(module) else weight


class TransposedColwise(ColwiseParallel):
    """torch's ColwiseParallel for a Conv1D: the output features are its weight's dim 1 (Shard(1)) and its bias's dim
    0; `addmm(bias, x, weight)` then gives the output split on its last dim, as F.linear's does for a Linear."""

    def _partition_linear_fn(self, name, module, device_mesh):
        distribute_parameters(module, device_mesh, {"weight": [Shard(1)], "bias": [Shard(0)]}, self.src_data_rank)

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class TransposedRowwise(RowwiseParallel):
    """torch's RowwiseParallel for a Conv1D: the input features are its weight's dim 0 (Shard(0)); the bias whole,
    added once to the partial sums' total, as torch adds a row-parallel Linear's."""

    def _partition_linear_fn(self, name, module, device_mesh):
        distribute_parameters(module, device_mesh, {"weight": [Shard(0)], "bias": [Replicate()]}, self.src_data_rank)

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        self.desired_input_layouts = (Shard(-1),)  # the input's features split as the weight's rows
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))
