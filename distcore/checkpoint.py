"""Distributed checkpoints with torch.distributed.checkpoint: save under one strategy, load under another.

`save_state` writes every rank's shards of the model and optimizer state (plus any picklable `extra`)
in parallel; `load_state` reads what the current layout needs, whatever layout wrote it: sharding
level, tensor-parallel degree or world size may change between save and load (DCP reshards), and a
plain single-process model can load a distributed checkpoint, or the reverse.

DCP records each rank's shard as one box (offset + size per dim). A packed projection split part by
part (`_StridedShard`, see tensor_parallel.py) holds several boxes per rank ([q_r; k_r; v_r]); DCP
would file it under the first offset and scramble the checkpoint. Such tensors are written and read
through a box layout (each `_StridedShard` made a plain `Shard`): one redistribution per packed tensor
at checkpoint time, and the checkpoint holds the single-device layout, loadable under any degree.

Every entry point here is collective over all ranks and first meets the other ranks in the process group's store
(`env.every_rank_calls`): called under `if rank == 0:`, as DDP scripts save, it logs why it waits after a minute
and raises at the process group's timeout, naming the ranks that never called, where its first collective would
hang or pair with those ranks' training collectives.
"""

from __future__ import annotations

import io
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from . import env
from .tensor_parallel import tied_parameter_names

# Optimizer state keyed by parameter name throughout ("param_groups.<name>.lr"), as torchtitan does:
# DCP's nested form stores each param group's list of names once, from one rank, which is wrong for a
# rank holding other parameters (another pipeline stage), so hyperparameters would not load there.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise NotImplementedError(
            "save_state/load_state: a ShardingStage1 (ZeroRedundancyOptimizer) optimizer is not supported by "
            "torch.distributed.checkpoint; use parallelize(..., {'dp_config': {'sharding_level': 1}}) instead"
        )
    return [optimizer]


def save_state(model: torch.nn.Module, optimizer=None, path: str | os.PathLike = "checkpoint", *, extra: dict | None = None) -> None:
    """Save the model's (and optimizer's) state to the directory `path`; collective over all ranks.

    `extra` (picklable: a step count, a data position) is written once, from rank 0's copy.
    """
    env.init_parallel_env()
    env.every_rank_calls("save_state")
    model_state, optim_state = get_state_dict(model, _optimizers(optimizer), options=_OPTIONS)
    _under_every_name_of_a_tie(model, optim_state)
    # `extra` travels as one pickled blob: DCP loads only keys the loader already knows, and the
    # loader does not know the user's keys in advance.
    blob = io.BytesIO(pickle.dumps(extra or {}))
    state = {"model": model_state, "optimizer": optim_state, "extra": blob}
    _to_boxes(state)
    dcp.save(state, checkpoint_id=os.fspath(path))


def _under_every_name_of_a_tie(model: torch.nn.Module, optim_state: dict) -> None:
    """A tied parameter's optimizer state and settings ("state.<name>.*", "param_groups.<name>.*") also under the
    tie's other names: get_state_dict keys them by one name, while a pipeline stage holding the tie's other module
    (the LM head on the last stage, its embedding another stage's) asks for them by that module's name. (Saved under
    pipeline stages, each stage writes its own name already.)"""
    for names in tied_parameter_names(model):
        for kind in ("state", "param_groups"):
            written = next((name for name in names if any(k.startswith(f"{kind}.{name}.") for k in optim_state)), None)
            if written is None:
                continue
            prefix = f"{kind}.{written}."
            for key in [k for k in optim_state if k.startswith(prefix)]:
                for name in names:
                    optim_state.setdefault(f"{kind}.{name}.{key[len(prefix):]}", optim_state[key])


def load_state(model: torch.nn.Module, optimizer=None, path: str | os.PathLike = "checkpoint") -> dict:
    """Load a checkpoint written by save_state into the (already parallelised) model and optimizer.

    Returns the `extra` dict that was saved with it (unpickled: load only checkpoints you trust, as
    with torch.load). Collective over all ranks.
    """
    env.init_parallel_env()
    env.every_rank_calls("load_state")
    path = os.fspath(path)
    # Decided together: ranks that raised while others entered dcp.load would leave those hanging
    # (node-local disks may differ).
    missing = torch.tensor([0 if os.path.isdir(path) else 1])
    torch.distributed.all_reduce(missing)
    if missing.item():
        raise FileNotFoundError(
            f"load_state: no checkpoint directory at {path!r} on {missing.item()} rank(s) (save_state writes one; "
            "on node-local disks, copy it to every node)"
        )
    optimizers = _optimizers(optimizer)
    model_state, optim_state = get_state_dict(model, optimizers, options=_OPTIONS)
    state = {"model": model_state, "optimizer": optim_state, "extra": io.BytesIO()}
    moved = _to_boxes(state)
    dcp.load(state, checkpoint_id=path)
    with torch.no_grad():
        for container, key, original in moved:  # back into the layouts set_state_dict expects
            boxed = container[key]
            original.to_local().copy_(boxed.redistribute(original.device_mesh, original.placements).to_local())
            container[key] = original
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=_OPTIONS)
    state["extra"].seek(0)
    return pickle.loads(state["extra"].read())


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state dict as one device holds it (parameters and persistent buffers, under the
    model's own names, as plain CPU tensors), gathered from every shard, tensor-parallel part, expert-parallel
    group and pipeline stage, on rank 0; the other ranks get {}. Collective over all ranks. Made for exporting
    in transformers' format, which its `save_pretrained` cannot write from DTensors (it fails on their storage);
    the parallelised model's `save_pretrained(path)` calls it (export.py), as this does:

        model.save_pretrained(path, state_dict=distcore.full_state_dict(model), is_main_process=rank == 0)

    (on every rank; the whole model passes through rank 0's CPU memory). Each rank gathers its own stage's
    tensors (one full_tensor per DTensor, in state-dict order: every rank of a stage alike); then the first
    rank of each stage sends its stage's to rank 0."""
    env.every_rank_calls("full_state_dict")
    own = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        own[name] = value.detach().to("cpu", copy=True)
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return own
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    holdings = [None] * world  # which names each rank holds: the lowest rank of each holding sends them
    torch.distributed.all_gather_object(holdings, sorted(own))
    sends = holdings.index(sorted(own)) == rank
    gathered = [None] * world if rank == 0 else None
    torch.distributed.gather_object(own if sends else {}, gathered, dst=0)
    if rank != 0:
        return {}
    merged = {}
    for part in gathered:
        merged.update(part)
    return merged


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a whole state dict as one device holds it (plain tensors under the model's own names: a
    one-device model's `state_dict()`, `safetensors.torch.load_file(...)` of a transformers checkpoint) into the
    distributed model: each rank copies its own shard of each tensor its stage holds (no communication but one
    all-reduce that checks every rank found its names). `state_dict` must be there on every rank. The twin of
    `full_state_dict`; for checkpoints written under a strategy, `load_state` reads only what each rank needs."""
    env.every_rank_calls("load_full_state_dict")
    problems = []
    with torch.no_grad():
        for name, target in model.state_dict().items():
            full = state_dict.get(name)
            if full is None:
                problems.append(f"{name} missing")
                continue
            if tuple(full.shape) != tuple(target.shape):
                problems.append(f"{name}: {tuple(full.shape)} given, {tuple(target.shape)} in the model")
                continue
            if isinstance(target, DTensor):
                mesh = target.device_mesh
                whole = DTensor.from_local(full.to(target.device, target.dtype), mesh, [Replicate()] * mesh.ndim,
                                           run_check=False)
                target.to_local().copy_(whole.redistribute(mesh, target.placements).to_local())  # slices only
            else:
                target.copy_(full)
    failed = torch.tensor([len(problems)], device=env.device())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(failed)
    if failed.item():
        raise ValueError(f"load_full_state_dict: {failed.item()} tensor(s) could not be loaded on some rank"
                         f"{(': ' + '; '.join(problems[:4])) if problems else ''} (the state dict must hold the model's "
                         "own names and shapes, as its one-device state_dict() does)")


def _to_boxes(state) -> list[tuple]:
    """Replace (in place, in nested dicts/lists) every DTensor whose shard is not one box by the same
    value in a box layout; returns (container, key, original) for each, to put the originals back."""
    moved = []

    def visit(container, keys):
        for key in keys:
            value = container[key]
            if isinstance(value, dict):
                visit(value, list(value))
            elif isinstance(value, list):
                visit(value, range(len(value)))
            elif isinstance(value, DTensor) and not _is_one_box(value):
                placements = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in value.placements]
                container[key] = value.detach().redistribute(value.device_mesh, placements)
                moved.append((container, key, value))

    visit(state, list(state))
    return moved


def _is_one_box(tensor: DTensor) -> bool:
    """Whether this rank's shard is one contiguous block of the global tensor: along every dim, the
    global indices it holds are consecutive (sharding an index tensor as DTensor shards the data)."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None or not any(isinstance(p, _StridedShard) for p in tensor.placements):
        return True  # plain Shard/Replicate/Partial layouts are always one box
    for dim in range(tensor.dim()):
        shape = [1] * tensor.dim()
        shape[dim] = tensor.shape[dim]
        index = torch.arange(tensor.shape[dim]).reshape(shape)
        for mesh_dim, placement in enumerate(tensor.placements):
            if isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim:
                shards, _ = placement._split_tensor(index, tensor.device_mesh.size(mesh_dim), with_padding=False)
                index = shards[coordinate[mesh_dim]]
        held = index.flatten()
        if held.numel() > 1 and not bool((held.diff() == 1).all()):
            return False
    return True
