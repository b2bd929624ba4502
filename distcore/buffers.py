"""A model's buffers under mixed precision: in the compute dtype where the model's own load in that dtype makes them so.

FSDP2's `MixedPrecisionPolicy` casts parameters to its param_dtype for the forward, not buffers. A buffer the model
builds in the default dtype (GPT-1's causal mask, MiniMax's decay rates) then stays fp32 where the model's authors run
it in bf16, and bf16 activations meeting it are promoted to fp32 before a matmul with a bf16 weight: "expected m1 and
m2 to have the same dtype" (the model crashed under `mixed_precision="bfloat16"`). Other buffers are fp32 on purpose:
rotary tables (`inv_freq`, built with `.float()`), which a bf16 load keeps in fp32 and which bf16 would ruin at long
positions.

`cast_buffers_as_loaded(model, dtype)` tells them apart as transformers does: it builds the model's class from its config
on the meta device in `dtype`, as `from_pretrained(dtype=dtype)` initialises it (the default dtype set to it), and casts
each floating buffer of the model that comes out in `dtype` there (by name) to it; every other buffer keeps its dtype,
as do the buffers of a model that is not a transformers model (no `_from_config`: its author decides)."""

from __future__ import annotations

import copy
import logging

import torch

__all__ = ["cast_buffers_as_loaded"]

log = logging.getLogger(__name__)


def cast_buffers_as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Casts `model`'s floating buffers to `dtype` where its class, initialised in `dtype` on the meta device, makes
    them `dtype` (module docstring); returns their names. peft's wrapper is read through its base model."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(base, "config", None)
    build = getattr(type(base), "_from_config", None)
    others = {name: buffer for name, buffer in base.named_buffers()  # (a LazyGuard model's meta buffers keep theirs)
              if buffer.is_floating_point() and buffer.dtype != dtype and not buffer.is_meta}
    if not others or config is None or build is None:
        return []
    try:
        with torch.device("meta"):
            loaded = dict(build(copy.deepcopy(config), dtype=dtype).named_buffers())
    except Exception as error:  # a class whose __init__ needs more than its config: its buffers stay as they are
        log.warning("mixed precision: %s could not be built from its config on the meta device (%s: %s); its buffers "
                    "keep their dtypes (%s)", type(base).__name__, type(error).__name__, error, sorted(others)[:4])
        return []
    cast = [name for name in others if name in loaded and loaded[name].dtype == dtype]
    replaced = {id(others[name]): others[name].to(dtype) for name in cast}
    for module in base.modules():  # every module holding one (a buffer two modules share stays shared)
        for leaf, buffer in module._buffers.items():
            if buffer is not None and id(buffer) in replaced:
                module._buffers[leaf] = replaced[id(buffer)]  # (its persistence unchanged: a set of names)
    return cast
