"""Exporting a parallelised model in transformers' / peft's format: `save_pretrained` on the model itself.

transformers' and peft's `save_pretrained` read the model's `state_dict()`, whose DTensors they cannot write ("Attempted
to access the data pointer on an invalid python storage"); under pipeline stages rank 0 holds one stage. After
`parallelize` (`export_after_parallelize`), the model's own `save_pretrained(path, ...)`, called on every rank, gathers
`checkpoint.full_state_dict(model)` to rank 0, which writes it with the caller's arguments; the others write nothing
and return once it has written, raising too if it failed. Called on rank 0 alone (`if rank == 0:`, as DDP scripts
save), it raises naming the ranks that never called (`env.every_rank_calls`) instead of hanging. A given `state_dict` goes through as before (the explicit
form, `state_dict=full_state_dict(model), is_main_process=rank == 0`).

What cannot be written right is refused by name: LoRA adapters (peft's, or transformers' own `load_adapter`) under
pipeline stages, where peft picks the adapters' keys from the modules rank 0 holds (one stage: the others' adapters
were left out of the file silently), and `push_to_hub`, which saves to a folder of each calling rank and uploads it from
each. The config's `architectures` names the model's own class (FSDP2's `replicate` makes it `Replicate<class>`, which
transformers does not strip: a loader picking the class by that name, vLLM's, refused it), and a split checkpoint's index
counts the whole model's parameters (transformers counts the modules of rank 0, one stage's under pipeline stages).

Bound on the instance: the caller keeps the model object it passed in, so no wrapper module can stand in."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
from torch.distributed.fsdp import FSDPModule

from . import env
from .checkpoint import full_state_dict

__all__ = ["export_after_parallelize"]


def export_after_parallelize(model: torch.nn.Module, num_parameters: int) -> None:
    """Makes `model.save_pretrained` write what one device would, and refuses `model.push_to_hub` (module docstring).
    `num_parameters`: the whole model's, counted before it was parallelised (each parameter once, as transformers'
    `num_parameters()` counts). Nothing changes for a model without `save_pretrained` or outside a multi-process job."""
    original = getattr(model, "save_pretrained", None)
    if not callable(original) or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    architecture = next(c for c in type(model).__mro__ if not issubclass(c, (FSDPModule, ReplicateModule))).__name__

    def write(save_directory, args, kwargs, state_dict):
        result = original(save_directory, *args, state_dict=state_dict, **kwargs)
        if kwargs.get("is_main_process", True) and dist.get_rank() == 0:  # where transformers writes
            _name_the_architecture(model, save_directory, architecture)
            _count_every_stage(model, save_directory, kwargs.get("variant"), num_parameters)
        return result

    def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
        _refuse_adapters_under_pipeline_stages(model)
        if state_dict is not None:  # the explicit form: on every rank, as the caller wrote it
            return write(save_directory, args, kwargs, state_dict)
        env.every_rank_calls("save_pretrained")  # not under `if rank == 0:`, where DDP scripts call it
        state_dict = full_state_dict(model)  # collective; {} but on rank 0
        failed = None
        if dist.get_rank() == 0:
            try:
                write(save_directory, args, kwargs, state_dict)
            except BaseException as error:  # re-raised below, once the other ranks know
                failed = error
        flag = torch.tensor([failed is not None], dtype=torch.int32, device=env.device())
        dist.broadcast(flag, src=0)  # the others return once the files are written, or raise
        if failed is not None:
            raise failed
        if flag.item():
            raise RuntimeError(f"save_pretrained: rank 0 failed to write {save_directory} (its error is in its log)")

    def push_to_hub(*args, **kwargs):
        raise NotImplementedError(
            "push_to_hub on the distributed model: it saves to a folder of each rank that calls it and uploads each; "
            "call model.save_pretrained(path) on every rank (rank 0 writes the whole model), then upload that folder "
            "from rank 0 (huggingface_hub.upload_folder(repo_id=..., folder_path=path))")

    save_pretrained.__doc__ = f"{__doc__}\n\nThe model's own:\n{original.__doc__ or ''}"
    model.save_pretrained = save_pretrained
    if callable(getattr(model, "push_to_hub", None)):
        model.push_to_hub = push_to_hub


def _refuse_adapters_under_pipeline_stages(model: torch.nn.Module) -> None:
    if hasattr(model, "_tridist_pipeline") and getattr(model, "peft_config", None):
        raise NotImplementedError(
            "save_pretrained of LoRA adapters under pipeline parallel: peft picks the adapters' keys from the modules "
            "rank 0 holds, one stage's, and would leave the other stages' adapters out of the file; save with "
            "distcore.save_state(path, model, optimizer) instead, or load distcore.full_state_dict(model) on rank 0 into "
            "the unparallelised peft model (load_state_dict) and call its save_pretrained there")


def _count_every_stage(model: torch.nn.Module, save_directory, variant: str | None, num_parameters: int) -> None:
    """A split checkpoint's index (`max_shard_size`) as one device writes it: transformers puts its
    `model.num_parameters()` there, which under pipeline stages counts the stage rank 0 holds."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME  # model.safetensors.index.json

    stem, extension = SAFE_WEIGHTS_INDEX_NAME.rsplit(".", 1)
    path = os.path.join(save_directory, f"{stem}.{variant}.{extension}" if variant else SAFE_WEIGHTS_INDEX_NAME)
    if not hasattr(model, "_tridist_pipeline") or not os.path.isfile(path):
        return  # every parameter is on rank 0 (DTensors count their global shape), or one file
    with open(path) as file:
        index = json.load(file)
    if "total_parameters" not in index.get("metadata", {}):
        return  # not transformers' (peft's adapters are one file)
    index["metadata"]["total_parameters"] = num_parameters
    with open(path, "w", encoding="utf-8") as file:  # as transformers writes it
        file.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _name_the_architecture(model: torch.nn.Module, save_directory, architecture: str) -> None:
    """config.json's `architectures` as the model's own class where transformers just wrote the class FSDP2 made of it
    (it strips FSDP2's "FSDP" prefix, not `replicate`'s "Replicate")."""
    path = os.path.join(save_directory, "config.json")
    written = [type(model).__name__.removeprefix("FSDP")]
    if written == [architecture] or not os.path.isfile(path):
        return  # the class's own name, or peft's adapters (adapter_config.json only)
    with open(path) as file:
        if json.load(file).get("architectures") != written:
            return  # not this save's (a config.json of the base model beside the adapters)
    model.config.architectures = [architecture]
    model.config.save_pretrained(save_directory)
