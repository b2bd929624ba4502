"""Paddle's placements, as torch DTensor placements: Shard(dim), Replicate(), Partial(reduce_type).

`Shard` and `Replicate` are torch's own classes. `Partial` is a factory returning torch's `Partial`
so that placements compare equal to those torch creates itself (its redistribution logic compares
them); use `is_partial(p)` rather than isinstance.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Partial as _TorchPartial
from torch.distributed.tensor.placement_types import Placement


class ReduceType:
    """Paddle's reduce types (`dist.ReduceType.kRedSum`, ...), as torch reduce-op names."""

    kRedSum = "sum"
    kRedAvg = "avg"
    kRedMax = "max"
    kRedMin = "min"


_REDUCE_OPS = {"sum", "avg", "max", "min"}


def Partial(reduce_type: str = ReduceType.kRedSum) -> _TorchPartial:  # noqa: N802 - Paddle's name
    """Pending reduction across a mesh dimension: the global value is the reduction of the shards."""
    if reduce_type not in _REDUCE_OPS:
        raise ValueError(f"Partial: reduce_type must be one of {sorted(_REDUCE_OPS)} (or ReduceType.kRed*), got {reduce_type!r}")
    return _TorchPartial(reduce_type)


def is_partial(placement: Placement) -> bool:
    return placement.is_partial()


__all__ = ["Partial", "Placement", "ReduceType", "Replicate", "Shard", "is_partial"]
