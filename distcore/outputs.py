"""Where a model's loss and logits are in what it returns, and the same output with the loss replaced.

A loss is a 0-dim floating tensor returned alone, first in a tuple or list, or under the key "loss" of
a mapping: a dict or a Hugging Face `ModelOutput` (an OrderedDict whose `.loss` is its "loss" item).
The logits are the tensor returned alone (not a loss), the tuple's element after its first (where that
is the loss, or None: `(loss, logits)` called without labels) or else its first, or a mapping's "logits". Data parallel replaces the loss by the global-batch mean on every
rank; the pipeline rebuilds the same kind of output on every rank from its last stage's loss and logits.
Other outputs keep their meaning (see each user). `CACHE_ARGUMENTS`: the names a Hugging Face key/value cache is
passed in by.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .sequence_layout import with_first

# The names transformers gives a model's key/value cache argument: `cache` since 5.24, `past_key_values` before (5.24
# still accepts it, renamed by its `deprecate_kwarg`), `past_key_value` in older layers' signatures.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")


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


def find_logits(output) -> torch.Tensor | None:
    """The logits in `output` (see the module's doc), or None."""
    if torch.is_tensor(output):
        return None if _is_loss(output) else output
    if isinstance(output, (tuple, list)):
        index = _tuple_logits_index(output)
        value = output[index] if index is not None else None
    elif isinstance(output, Mapping):
        value = output.get("logits")
    else:
        return None
    return value if torch.is_tensor(value) else None


def _tuple_logits_index(output) -> int | None:
    index = 1 if output and (output[0] is None or _is_loss(output[0])) else 0
    return index if len(output) > index else None


def replace_loss(output, loss: torch.Tensor):
    """`output` with its loss (found as find_loss finds it) replaced by `loss`; the caller's object
    is not changed (a shallow copy of a mapping)."""
    if _is_loss(output):
        return loss
    if isinstance(output, (tuple, list)):
        return with_first(output, loss)
    new = copy.copy(output)  # a ModelOutput's copy keeps its class and attributes
    new["loss"] = loss
    return new


@dataclass(frozen=True)
class OutputForm:
    """The shape of an output without its tensors, to rebuild it on ranks that did not compute it
    (pipeline stages other than the last): a bare loss, bare logits, a tuple of `arity` (the loss first
    where `has_loss`, the logits at `logits_at`; the rest None), or a mapping of `cls` whose keys other than
    "loss" and "logits" are None."""

    kind: str  # "loss", "logits", "tuple" or "mapping"
    has_loss: bool = True
    arity: int = 1
    logits_at: int | None = None
    cls: type | None = None
    keys: tuple[str, ...] = ()

    @staticmethod
    def of(output) -> "OutputForm":
        has_loss = find_loss(output) is not None
        if torch.is_tensor(output):
            return OutputForm("loss" if has_loss else "logits", has_loss=has_loss)
        if isinstance(output, (tuple, list)):
            return OutputForm("tuple", has_loss=has_loss, arity=len(output), logits_at=_tuple_logits_index(output))
        return OutputForm("mapping", has_loss=has_loss, cls=type(output), keys=tuple(output.keys()))

    def build(self, loss: torch.Tensor | None, logits: torch.Tensor | None = None):
        if self.kind == "loss":
            return loss
        if self.kind == "logits":
            return logits
        if self.kind == "tuple":
            items = [None] * self.arity
            if self.has_loss:
                items[0] = loss
            if self.logits_at is not None:
                items[self.logits_at] = logits
            return tuple(items)
        values = {key: None for key in self.keys if key not in ("loss", "logits")}
        if "logits" in self.keys or logits is not None:
            values["logits"] = logits
        if self.has_loss:
            values = {"loss": loss, **values}
        try:
            return self.cls(**values)  # a ModelOutput (dataclass) or a dict subclass
        except TypeError:
            return values
