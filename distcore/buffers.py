"""A model's buffers under mixed precision: in the compute dtype where the model's own load in that dtype makes them so.

FSDP2's `MixedPrecisionPolicy` casts parameters to its param_dtype for the forward, not buffers. A buffer the model
builds in the default dtype (GPT-1's causal mask, MiniMax's decay rates) then stays fp32 where the model's authors run
it in bf16, and bf16 activations meeting it are promoted to fp32 before a matmul with a bf16 weight: "expected m1 and
m2 to have the same dtype" (the model crashed under `mixed_precision="bfloat16"`). Other buffers are fp32 on purpose:
rotary tables (`inv_freq`, built with `.float()`), which a bf16 load keeps in fp32 and which bf16 would ruin at long
positions.

`cast_buffers_as_loaded(model, dtype)` tells them apart as transformers does: it builds the model's class from its config
on the meta device in `dtype`, as `from_pretrained(dtype=dtype)` initialises it (the default dtype set to it), and casts
each floating buffer of the model that comes out in `dtype` there (by name) to it, but for a saved (persistent) one
that the class keeps in fp32 when loading (`_keep_in_fp32_modules_strict`; `_keep_in_fp32_modules` under fp16: the
load's dtype plan, matched as transformers matches it). Every other buffer keeps its dtype, as do the buffers of a
model that is not a transformers model (no `_from_config`: its author decides). A LazyGuard model's buffers are cast
once materialised (parallelize calls this again then).

A buffer the model updates in place (BatchNorm's running statistics, in a vision or audio tower) then accumulates in
bf16, as in the model loaded in bf16, and a persistent one is saved in it."""

from __future__ import annotations

import copy
import logging
import re

import torch

__all__ = ["cast_buffers_as_loaded"]

log = logging.getLogger(__name__)


def cast_buffers_as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Casts `model`'s floating buffers to `dtype` where its class, initialised in `dtype` on the meta device, makes
    them `dtype` and its load would not keep them in fp32 (module docstring); returns their names. peft's wrapper is
    read through its base model; buffers still on the meta device (LazyGuard's) are left for later."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(base, "config", None)
    build = getattr(type(base), "_from_config", None)
    candidates = {name: buffer for name, buffer in base.named_buffers()
                  if buffer.is_floating_point() and buffer.dtype != dtype and not buffer.is_meta}
    if not candidates or config is None or build is None:
        return []
    try:
        with torch.device("meta"):  # eager attention: the build needs no kernel of the hub's
            built = build(copy.deepcopy(config), dtype=dtype, attn_implementation="eager")
    except Exception as error:  # a class whose __init__ needs more than its config: its buffers stay as they are
        log.warning("mixed precision: %s could not be built from its config on the meta device (%s: %s); its buffers "
                    "keep their dtypes (%s)", type(base).__name__, type(error).__name__, error, sorted(candidates)[:4])
        return []
    made = dict(built.named_buffers())
    kept = _kept_in_fp32(built, dtype)
    cast = [name for name in candidates if name in made and made[name].dtype == dtype
            and not (kept is not None and _persistent(base, name) and kept.search(name))]
    replaced = {id(candidates[name]): candidates[name].to(dtype) for name in cast}
    for module in base.modules():  # every module holding one (a buffer two modules share stays shared)
        for leaf, buffer in module._buffers.items():
            if buffer is not None and id(buffer) in replaced:
                module._buffers[leaf] = replaced[id(buffer)]  # (its persistence unchanged: a set of names)
    return cast


def _kept_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    """What transformers' load in `dtype` keeps in fp32 among the checkpoint's keys (its dtype plan: the patterns of
    `_keep_in_fp32_modules_strict`, and of `_keep_in_fp32_modules` under fp16, `*` any characters, searched)."""
    patterns = [*(getattr(model, "_keep_in_fp32_modules_strict", None) or ())]
    if dtype == torch.float16:
        patterns += getattr(model, "_keep_in_fp32_modules", None) or ()
    return re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns)) if patterns else None


def _persistent(model: torch.nn.Module, name: str) -> bool:
    """Whether buffer `name` is saved in the state dict (the load's dtype plan reaches only what it loads)."""
    owner, _, leaf = name.rpartition(".")
    return leaf not in model.get_submodule(owner)._non_persistent_buffers_set
