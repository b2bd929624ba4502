"""peft's LoRA layers as tensor parallel meets them: which modules are LoRA layers, their adapters, and what of them
cannot be split (named, with the fix).

A LoRA layer (peft's `lora.Linear`, injected in place of a model's projection by `get_peft_model` or
`inject_adapter_in_model`) holds the projection as `base_layer` and, per adapter name, `lora_A[name]` (in -> r) and
`lora_B[name]` (r -> out), and returns base(x) + B(A(dropout(x))) * scaling summed over the active adapters. How
tensor parallel splits one with its projection (Megatron-Core's and NeMo's LoRA layout) is tensor_parallel.py's
`_split_lora`; this module reads the layer (duck-typed: peft is not a dependency) and guards what peft may do to the
model after it is parallelised (`guard_after_parallelize`).
"""

from __future__ import annotations

import torch

from tridist.autotune.model import is_lora_layer  # (the structure reads a LoRA layer as its projection)

__all__ = ["is_lora_layer", "lora_adapters", "has_lora_layers", "refuse_trainable_tokens", "guard_after_parallelize"]


def lora_adapters(name: str, module: torch.nn.Module) -> list[tuple[torch.nn.Linear, torch.nn.Linear]]:
    """(A, B) of each adapter of the LoRA layer `module` (every one: an adapter made active later runs split too), or
    a clear error for what tensor parallel cannot split: adapters merged into the base weight (its split would hold
    B @ A's columns of one rank while A stays whole), LoRA variants (DoRA's weight norm spans the features the split
    divides), adapters on an embedding, and A or B of another kind than nn.Linear."""
    fix = "or use a strategy without tensor parallel (dp / ZeRO / pp train LoRA layers as they are)"
    if getattr(module, "merged_adapters", None):
        raise NotImplementedError(f"parallelize: {name} holds LoRA adapters merged into its base weight "
                                  f"({module.merged_adapters}); unmerge them (`model.unmerge_adapter()`) first, {fix}")
    variants = getattr(module, "lora_variant", None) or {}
    if variants:
        raise NotImplementedError(f"parallelize: {name}'s LoRA adapters {sorted(variants)} are a variant of LoRA "
                                  f"({type(next(iter(variants.values()))).__name__}: DoRA's weight norm spans the "
                                  f"features tensor parallel splits); tensor parallel splits plain LoRA only, {fix}")
    if len(getattr(module, "lora_embedding_A", None) or {}):
        raise NotImplementedError(f"parallelize: {name} holds LoRA adapters of an embedding; tensor parallel splits "
                                  f"LoRA adapters of projections only, {fix}")
    adapters = []
    for adapter, a in module.lora_A.items():
        b = module.lora_B[adapter]
        if type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear:
            raise NotImplementedError(f"parallelize: {name}'s LoRA adapter {adapter!r} is {type(a).__name__} -> "
                                      f"{type(b).__name__}; tensor parallel splits nn.Linear adapters only, {fix}")
        adapters.append((a, b))
    return adapters


def refuse_trainable_tokens(name: str, parent: torch.nn.Module | None) -> None:
    """An error for an embedding that tensor parallel would split while peft's trainable tokens (`LoraConfig(
    trainable_token_indices=...)`: a TrainableTokensLayer holding it as `base_layer`) index it whole (before: a
    torch error inside peft's forward, "aten.index_copy.default got mixed torch.Tensor and DTensor")."""
    if parent is not None and hasattr(parent, "trainable_tokens_delta"):
        raise NotImplementedError(
            f"parallelize: {name} is the embedding under peft's trainable tokens (trainable_token_indices), which "
            "index its rows whole where tensor parallel splits them; train those tokens without tensor parallel (dp / "
            "ZeRO / pp), or leave trainable_token_indices out of the LoraConfig")


def has_lora_layers(model: torch.nn.Module) -> list[str]:
    """The names of the model's LoRA layers (none: [])."""
    return [name for name, module in model.named_modules() if is_lora_layer(module)]


def guard_after_parallelize(model: torch.nn.Module) -> None:
    """What peft can do to a model after `parallelize` / `to_distributed` that the distribution did not see, refused
    by name where it happens:

    - an adapter added (`add_adapter`, `load_adapter`): its A and B are whole, unsharded and outside the optimizer,
      beside a base split by tensor parallel or sharded by ZeRO (it failed inside torch's hooks). A forward pre-hook on
      the root compares each LoRA layer's adapters with those it had here.
    - peft's `generate`, which calls the model it wraps directly (`base_model.generate`), past the hooks parallelize put
      on the wrapper (FSDP's gathers, tensor parallel's inputs, the pipeline's schedule): where the parameters are
      distributed (DTensors) or split into stages it failed inside torch ("mixed torch.Tensor and DTensor").
    - peft's `merge_and_unload` / `merge_adapter` there (B @ A met a base on another mesh)."""
    layers = [(name, module, frozenset(module.lora_A)) for name, module in model.named_modules() if is_lora_layer(module)]
    if not layers:
        return

    def adapters_unchanged(*_):
        for name, module, adapters in layers:
            if frozenset(module.lora_A) != adapters:
                raise NotImplementedError(
                    f"{name}'s LoRA adapters are {sorted(module.lora_A)}, not {sorted(adapters)} as when the model was "
                    "parallelised: an adapter added or deleted afterwards is not split, sharded nor in the optimizer; "
                    "add every adapter (peft's add_adapter / load_adapter) before to_distributed / parallelize")

    model.register_forward_pre_hook(adapters_unchanged, prepend=True)
    base = getattr(model, "get_base_model", None)
    if not callable(base) or base() is model or not callable(getattr(model, "generate", None)):
        return
    peft_generate = model.generate

    def generate(*args, **kwargs):
        if _distributed(model):
            raise NotImplementedError(
                "generate on peft's wrapper: peft's generate runs the model it wraps directly, past the hooks that "
                "distribute it (its parameters are sharded or split into pipeline stages here); inject the adapters in "
                "place instead of wrapping (peft.inject_adapter_in_model(config, model)) before to_distributed, and "
                "generate with that model, or generate on one device from distcore.full_state_dict(model)")
        return peft_generate(*args, **kwargs)

    model.generate = generate
    for method in ("merge_and_unload", "merge_adapter"):
        if callable(getattr(model, method, None)):
            setattr(model, method, _refused_merge(model, method, getattr(model, method)))


def _refused_merge(model: torch.nn.Module, method: str, peft_merge):
    """peft's merge, refused where the parameters are distributed: B @ A would meet a base split over other meshes (it
    failed inside torch: "different meshes")."""

    def merge(*args, **kwargs):
        if _distributed(model):
            raise NotImplementedError(
                f"{method} on the distributed model: its LoRA adapters and base weights are split or sharded apart; "
                "merge on one device: load distcore.full_state_dict(model) (or a save_state checkpoint) into the "
                "unparallelised peft model and merge there")
        return peft_merge(*args, **kwargs)

    return merge


def _distributed(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are split, sharded (DTensors) or in pipeline stages."""
    from torch.distributed.tensor import DTensor

    return hasattr(model, "_tridist_pipeline") or any(isinstance(p, DTensor) for p in model.parameters())
