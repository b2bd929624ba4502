"""Distributed checkpoints with torch.distributed.checkpoint: save under one strategy, load under another.

`save_state` writes every rank's shards of the model and optimizer state (plus any picklable `extra`)
in parallel; `load_state` reads what the current layout needs, whatever layout wrote it: sharding
level, tensor-parallel degree or world size may change between save and load (DCP reshards), and a
plain single-process model can load a distributed checkpoint, or the reverse.
"""

from __future__ import annotations

import io
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from . import env


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
    model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
    # `extra` travels as one pickled blob: DCP loads only keys the loader already knows, and the
    # loader does not know the user's keys in advance.
    blob = io.BytesIO(pickle.dumps(extra or {}))
    dcp.save({"model": model_state, "optimizer": optim_state, "extra": blob}, checkpoint_id=os.fspath(path))


def load_state(model: torch.nn.Module, optimizer=None, path: str | os.PathLike = "checkpoint") -> dict:
    """Load a checkpoint written by save_state into the (already parallelised) model and optimizer.

    Returns the `extra` dict that was saved with it (unpickled: load only checkpoints you trust, as
    with torch.load). Collective over all ranks.
    """
    env.init_parallel_env()
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
    model_state, optim_state = get_state_dict(model, optimizers)
    state = {"model": model_state, "optimizer": optim_state, "extra": io.BytesIO()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    state["extra"].seek(0)
    return pickle.loads(state["extra"].read())
