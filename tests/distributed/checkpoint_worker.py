"""Checkpoints across strategies and world sizes (run by tests/distributed/test_checkpoint.py).

Phase "save" (4 processes, ZeRO-3): train 2 steps, save, then train a third step and record its loss.
Phase "load" (2 processes, sharding level 1; or 1 process, no parallelism): load: every parameter and
optimizer state equals the saved one bit for bit (a checkpoint moves values, it computes nothing); train
the third step: the loss and the parameters equal the uninterrupted run's within rounding
(equivalence.py; the third step's gradients come from another layout).

Layout "packed-tensor-parallel": paddle-llama (packed qkv_proj/gate_up_proj split per part, a
vocabulary-parallel bare LM head) under the parallelize seed's plan on dp2 x mp2, SGD with momentum (so
optimizer states are packed too); loaded under mp4 or on one process, the next step must equal an
uninterrupted single-process run.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from tridist import distcore
from tridist.distcore import ProcessMesh, Shard
from tridist.bench.models import build_model
from tests.distributed import equivalence
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


def _full_state(model, optimizer) -> dict:
    """Every parameter and optimizer-state tensor, full (unsharded), by name; a collective."""
    state = equivalence.parameters(model)
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            state[f"{name}:{key}"] = distcore.unshard_dtensor(value).clone() if torch.is_tensor(value) else value
    return state


def check_save_then_continue():
    model, optimizer, mesh = _parallel_model()
    batches = _batches()
    losses = [_step(model, optimizer, mesh, inputs, labels) for inputs, labels in batches[:2]]
    distcore.save_state(model, optimizer, CHECKPOINT / "state", extra={"step": 2})
    saved = _full_state(model, optimizer)  # collectives: every rank gathers, rank 0 writes
    losses.append(_step(model, optimizer, mesh, *batches[2]))
    continued = equivalence.parameters(model)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "saved": saved, "continued": continued}, CHECKPOINT / "expected.pt")


def _uninterrupted_single_process() -> equivalence.Trace:
    """Three steps on one process, no parallelism: what a resumed run must reproduce."""
    model, optimizer = _model_for_layout()
    return equivalence.train(model, optimizer, _batches())


def check_load_under_another_layout_and_continue():
    model, optimizer, mesh = _parallel_model()
    extra = distcore.load_state(model, optimizer, CHECKPOINT / "state")
    assert extra == {"step": 2}, extra
    expected = torch.load(CHECKPOINT / "expected.pt")
    loaded = _full_state(model, optimizer)
    assert loaded.keys() == expected["saved"].keys(), sorted(loaded.keys() ^ expected["saved"].keys())
    unequal = [key for key, value in loaded.items() if not torch.equal(torch.as_tensor(value), torch.as_tensor(expected["saved"][key]))]
    assert not unequal, f"not the saved values: {unequal}"
    losses = expected["losses"][:2] + [_step(model, optimizer, mesh, *_batches()[2])]
    params = equivalence.parameters(model)
    if PACKED:  # against three uninterrupted single-process steps; error relative to their whole displacement
        reference = _uninterrupted_single_process()
        equivalence.assert_losses_close(losses, reference.losses)
        moved = {name: reference.parameters[name] - reference.initial[name] for name in params}
        equivalence.assert_tensors_close("parameters", params, reference.parameters, scale=moved)
    else:  # against the saving run's own third step, from the same (bitwise) state: relative to that step
        equivalence.assert_losses_close(losses[2:], expected["losses"][2:])
        moved = {name: expected["continued"][name] - expected["saved"][name] for name in params}
        equivalence.assert_tensors_close("parameters", params, expected["continued"], scale=moved)


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
    run_checks(CHECKS)  # ends the process group
