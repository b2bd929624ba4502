"""Checkpoints across strategies and world sizes (run by tests/distributed/test_checkpoint.py).

Phase "save" (4 processes, ZeRO-3): train 2 steps, save, then train a third step and record its loss.
Phase "load" (2 processes, sharding level 1; or 1 process, no parallelism): load, train the third
step: the loss and the final parameters must equal the uninterrupted run's.

Layout "packed-tensor-parallel": paddle-llama (packed qkv_proj/gate_up_proj split per part, a
vocabulary-parallel bare LM head) under the parallelize seed's plan on dp2 x mp2, SGD with momentum (so
optimizer states are packed too); loaded under mp4 or on one process, the next step must equal an
uninterrupted single-process run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tridist import distcore
from tridist.distcore import ProcessMesh, Shard
from tridist.bench.models import build_model
from tests.distributed.harness import run_checks
from tests.distributed import tensor_parallel_worker
from tests.distributed.parallelize_worker import _batches, _model_and_optimizer

PHASE = os.environ.get("CHECKPOINT_PHASE", "save")
CHECKPOINT = Path(os.environ.get("CHECKPOINT_DIR", "/tmp/tridist-checkpoint"))
# "zero3": the seed model under ZeRO-3 when saving; "tensor-parallel": the HF-style model under
# dp2 x mp2 (level 2) when saving. Loading uses data parallel level 1 (or one process) either way.
# "packed-tensor-parallel": see the module docstring (loads under mp4 or on one process).
LAYOUT = os.environ.get("CHECKPOINT_LAYOUT", "zero3")
PACKED = LAYOUT == "packed-tensor-parallel"


def _model_for_layout():
    if LAYOUT == "tensor-parallel":
        return tensor_parallel_worker._model("hf-llama")  # SGD: layouts then agree to rounding
    if PACKED:
        torch.manual_seed(0)
        model = build_model("paddle-llama")
        return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # momentum: optimizer state
    return _model_and_optimizer()


def _parallel_model():
    world = dist.get_world_size()
    model, optimizer = _model_for_layout()
    if world == 1:
        return model, distcore.shard_optimizer(optimizer), None
    if PHASE == "save" and LAYOUT == "tensor-parallel":
        mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
        config = {"dp_config": {"sharding_level": 2}, "mp_config": {"parallelize_plan": tensor_parallel_worker.HF_PLAN}}
    elif PACKED and PHASE == "save":
        mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
        config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": tensor_parallel_worker.PADDLE_SEED_PLAN}}
    elif PACKED:  # loaded under mp4: another tensor-parallel degree than the saving run's mp2
        mesh = ProcessMesh(list(range(world)), ["mp"])
        config = {"mp_config": {"parallelize_plan": tensor_parallel_worker.PADDLE_SEED_PLAN}}
    else:
        mesh = ProcessMesh(list(range(world)), ["dp"])
        config = {"dp_config": {"sharding_level": 3 if PHASE == "save" else 1}}
    model, optimizer = distcore.parallelize(model, optimizer, mesh, config)
    return model, optimizer, mesh


def _step(model, optimizer, mesh, inputs, labels) -> float:
    if mesh is not None:  # split over dp, the same on mp
        placements = [Shard(0) if name == "dp" else distcore.Replicate() for name in mesh.dim_names]
        inputs, labels = (distcore.shard_tensor(t, mesh, placements) for t in (inputs, labels))
    loss, _ = model(inputs, labels=labels)
    loss.backward()
    optimizer.step()
    optimizer.clear_grad()
    return loss.item()


def _full_parameters(model) -> dict:
    return {name: distcore.unshard_dtensor(p.detach()).tolist() for name, p in model.named_parameters()}


def check_save_then_continue():
    model, optimizer, mesh = _parallel_model()
    batches = _batches()
    for inputs, labels in batches[:2]:
        _step(model, optimizer, mesh, inputs, labels)
    distcore.save_state(model, optimizer, CHECKPOINT / "state", extra={"step": 2})
    third_loss = _step(model, optimizer, mesh, *batches[2])
    params = _full_parameters(model)  # a collective: every rank gathers, rank 0 writes
    if dist.get_rank() == 0:
        (CHECKPOINT / "expected.json").write_text(json.dumps({"loss": third_loss, "params": params}))


def _uninterrupted_single_process() -> dict:
    """Three steps on one process, no parallelism: what a resumed run must reproduce."""
    model, optimizer = _model_for_layout()
    for inputs, labels in _batches():
        loss, _ = model(inputs, labels=labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"loss": loss.item(), "params": _full_parameters(model)}


def check_load_under_another_layout_and_continue():
    model, optimizer, mesh = _parallel_model()
    extra = distcore.load_state(model, optimizer, CHECKPOINT / "state")
    assert extra == {"step": 2}, extra
    third_loss = _step(model, optimizer, mesh, *_batches()[2])
    expected = _uninterrupted_single_process() if PACKED else json.loads((CHECKPOINT / "expected.json").read_text())
    assert abs(third_loss - expected["loss"]) < 1e-5, (third_loss, expected["loss"])
    for name, values in _full_parameters(model).items():
        assert torch.allclose(torch.tensor(values), torch.tensor(expected["params"][name]), atol=2e-5), name


def check_missing_checkpoint_is_a_clear_error():
    model, optimizer, _ = _parallel_model()
    try:
        distcore.load_state(model, optimizer, CHECKPOINT / "nothing-here")
    except FileNotFoundError as error:
        assert "no checkpoint directory" in str(error)
    else:
        raise AssertionError("expected FileNotFoundError")


CHECKS = (
    {"check_save_then_continue": check_save_then_continue}
    if PHASE == "save"
    else {
        "check_load_under_another_layout_and_continue": check_load_under_another_layout_and_continue,
        "check_missing_checkpoint_is_a_clear_error": check_missing_checkpoint_is_a_clear_error,
    }
)

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)
    dist.destroy_process_group()
