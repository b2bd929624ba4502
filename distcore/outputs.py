"""Where a model's loss is in what it returns, and the same output with the loss replaced.

A loss is a 0-dim floating tensor returned alone, first in a tuple or list, or under the key "loss" of
a mapping: a dict or a Hugging Face `ModelOutput` (an OrderedDict whose `.loss` is its "loss" item).
Data parallel replaces it by the global-batch mean on every rank; the pipeline rebuilds the same kind
of output on every rank from its last stage's loss. Other outputs keep their meaning (see each user).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch


def _is_loss(value) -> bool:
    return torch.is_tensor(value) and value.dim() == 0 and value.is_floating_point()


def find_loss(output) -> torch.Tensor | None:
    """The loss in `output`, or None (no loss: a call without labels, or a model that returns logits)."""
    if _is_loss(output):
        return output
    if isinstance(output, (tuple, list)) and output and _is_loss(output[0]):
        return output[0]
    if isinstance(output, Mapping) and _is_loss(output.get("loss")):
        return output["loss"]
    return None


def replace_loss(output, loss: torch.Tensor):
    """`output` with its loss (found as find_loss finds it) replaced by `loss`; the caller's object
    is not changed (a shallow copy of a mapping)."""
    if _is_loss(output):
        return loss
    if isinstance(output, (tuple, list)):
        return type(output)([loss, *output[1:]])
    new = copy.copy(output)  # a ModelOutput's copy keeps its class and attributes
    new["loss"] = loss
    return new


@dataclass(frozen=True)
class OutputForm:
    """The shape of an output without its tensors, to rebuild it on ranks that did not compute it
    (pipeline stages other than the last): a bare loss, a tuple of `arity` (loss first, the rest None),
    or a mapping of `cls` whose keys other than "loss" are None."""

    kind: str  # "loss", "tuple" or "mapping"
    arity: int = 1
    cls: type | None = None
    keys: tuple[str, ...] = ()

    @staticmethod
    def of(output) -> "OutputForm":
        if _is_loss(output):
            return OutputForm("loss")
        if isinstance(output, (tuple, list)):
            return OutputForm("tuple", arity=len(output))
        return OutputForm("mapping", cls=type(output), keys=tuple(output.keys()))

    def build(self, loss: torch.Tensor):
        if self.kind == "loss":
            return loss
        if self.kind == "tuple":
            return (loss, *[None] * (self.arity - 1))
        values = {key: None for key in self.keys if key != "loss"}
        try:
            return self.cls(loss=loss, **values)  # a ModelOutput (dataclass) or a dict subclass
        except TypeError:
            return {"loss": loss, **values}
