"""Checkpoints across strategies and world sizes (run by tests/distributed/test_checkpoint.py).

Save (4 processes): train 2 steps, save, then train a third step and record its loss, under each layout:
"zero3" (the seed model under ZeRO-3), "tensor-parallel" (the HF-style model under dp2 x mp2, level 2).
Load (2 processes, sharding level 1; or 1 process, no parallelism): every parameter and optimizer state
equals the saved one bit for bit (a checkpoint moves values, it computes nothing); train the third step:
the loss and the parameters equal the uninterrupted run's within rounding (equivalence.py; the third
step's gradients come from another layout).

Layout "packed-tensor-parallel": paddle-llama (packed qkv_proj/gate_up_proj split per part, a
vocabulary-parallel bare LM head) under the parallelize seed's plan on dp2 x mp2, SGD with momentum (so
optimizer states are packed too); loaded under mp4 or on one process, the next step must equal an
uninterrupted single-process run.

Layout "expert-parallel": transformers' Mixtral (tests/hf_models.py) under dp 4 with ep 2 (each rank holds
2 of every layer's 4 experts, ZeRO-1 over the 2 ranks that share them), SGD with momentum; loaded under
dp 2 with ep 2 (each rank holds 2 of 4 experts, now without ranks that share them) and on one process
(every expert whole)."""

from __future__ import annotations

import datetime
import functools
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tridist import distcore
from tridist.distcore import ProcessMesh
from tridist.bench.models import build_model
from tests.distributed import equivalence
from tests.distributed.harness import run_checks
from tests.distributed import tensor_parallel_worker
from tests.distributed.parallelize_worker import _batches, _model_and_optimizer

LAYOUTS = ("zero3", "tensor-parallel", "packed-tensor-parallel", "expert-parallel")
# The world sizes each layout is loaded under (saved under 4 processes): see the module docstring.
LOADED_UNDER = {"zero3": (2, 1), "tensor-parallel": (2, 1), "packed-tensor-parallel": (4, 1), "expert-parallel": (2, 1)}


def _directory(layout: str) -> Path:
    """Where `layout` is saved: the session's scratch directory (the larger world's launch saves, the smaller
    ones' load), or a temporary one for a developer's run of this module alone."""
    return Path(os.environ.get("TRIDIST_SCRATCH", "/tmp/tridist-checkpoint")) / f"checkpoint-{layout}"


def _model_for_layout(layout: str):
    if layout == "tensor-parallel":
        return tensor_parallel_worker._model("hf-llama")  # SGD: layouts then agree to rounding
    if layout == "packed-tensor-parallel":
        torch.manual_seed(0)
        model = build_model("paddle-llama")
        return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # momentum: optimizer state
    if layout == "expert-parallel":
        from tests.hf_models import build

        model = build("mixtral")
        return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return _model_and_optimizer()


def _parallel_model(layout: str, phase: str):
    world = dist.get_world_size()
    model, optimizer = _model_for_layout(layout)
    if world == 1:
        return model, distcore.shard_optimizer(optimizer), None
    packed = layout == "packed-tensor-parallel"
    if phase == "save" and layout == "tensor-parallel":
        mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
        config = {"dp_config": {"sharding_level": 2}, "mp_config": {"parallelize_plan": tensor_parallel_worker.HF_PLAN}}
    elif packed and phase == "save":
        mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
        config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": tensor_parallel_worker.PADDLE_SEED_PLAN}}
    elif packed:  # loaded under mp4: another tensor-parallel degree than the saving run's mp2
        mesh = ProcessMesh(list(range(world)), ["mp"])
        config = {"mp_config": {"parallelize_plan": tensor_parallel_worker.PADDLE_SEED_PLAN}}
    elif layout == "expert-parallel":
        mesh = ProcessMesh(list(range(world)), ["dp"])
        config = {"dp_config": {"sharding_level": 1}, "ep_config": {"degree": 2}}
    else:
        mesh = ProcessMesh(list(range(world)), ["dp"])
        config = {"dp_config": {"sharding_level": 3 if phase == "save" else 1}}
    model, optimizer = distcore.parallelize(model, optimizer, mesh, config)
    return model, optimizer, mesh


def _step(model, optimizer, mesh, inputs, labels) -> float:
    if mesh is not None:  # split over dp, the same on mp
        inputs, labels = equivalence.global_view_batch(mesh, inputs, labels)
    out = model(inputs, labels=labels)
    loss = out.loss if hasattr(out, "loss") else out[0]  # a transformers ModelOutput, or the seeds' tuple
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


def _save_then_continue(layout: str) -> None:
    model, optimizer, mesh = _parallel_model(layout, "save")
    batches = _batches()
    losses = [_step(model, optimizer, mesh, inputs, labels) for inputs, labels in batches[:2]]
    directory = _directory(layout)
    distcore.save_state(model, optimizer, directory / "state", extra={"step": 2})
    saved = _full_state(model, optimizer)  # collectives: every rank gathers, rank 0 writes
    losses.append(_step(model, optimizer, mesh, *batches[2]))
    continued = equivalence.parameters(model)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "saved": saved, "continued": continued}, directory / "expected.pt")


def _uninterrupted_single_process(layout: str) -> equivalence.Trace:
    """Three steps on one process, no parallelism: what a resumed run must reproduce."""
    model, optimizer = _model_for_layout(layout)
    return equivalence.train(model, optimizer, _batches())


def _load_under_another_layout_and_continue(layout: str) -> None:
    assert dist.get_world_size() in LOADED_UNDER[layout], (layout, dist.get_world_size())
    model, optimizer, mesh = _parallel_model(layout, "load")
    directory = _directory(layout)
    extra = distcore.load_state(model, optimizer, directory / "state")
    assert extra == {"step": 2}, extra
    expected = torch.load(directory / "expected.pt")
    loaded = _full_state(model, optimizer)
    assert loaded.keys() == expected["saved"].keys(), sorted(loaded.keys() ^ expected["saved"].keys())
    unequal = [key for key, value in loaded.items() if not torch.equal(torch.as_tensor(value), torch.as_tensor(expected["saved"][key]))]
    assert not unequal, f"not the saved values: {unequal}"
    losses = expected["losses"][:2] + [_step(model, optimizer, mesh, *_batches()[2])]
    params = equivalence.parameters(model)
    if layout == "packed-tensor-parallel":  # against three uninterrupted single-process steps; error relative to their whole displacement
        reference = _uninterrupted_single_process(layout)
        equivalence.assert_losses_close(losses, reference.losses)
        moved = {name: reference.parameters[name] - reference.initial[name] for name in params}
        equivalence.assert_tensors_close("parameters", params, reference.parameters, scale=moved)
    else:  # against the saving run's own third step, from the same (bitwise) state: relative to that step
        equivalence.assert_losses_close(losses[2:], expected["losses"][2:])
        moved = {name: expected["continued"][name] - expected["saved"][name] for name in params}
        equivalence.assert_tensors_close("parameters", params, expected["continued"], scale=moved)


def check_missing_checkpoint_is_a_clear_error():
    """Under each layout this world loads."""
    for layout in (layout for layout in LAYOUTS if dist.get_world_size() in LOADED_UNDER[layout]):
        model, optimizer, _ = _parallel_model(layout, "load")
        try:
            distcore.load_state(model, optimizer, _directory(layout) / "nothing-here")
        except FileNotFoundError as error:
            assert "no checkpoint directory" in str(error)
        else:
            raise AssertionError(f"{layout}: expected FileNotFoundError")


def check_a_checkpoint_on_rank_0_alone_is_a_clear_error():
    """`if rank == 0: model.save_pretrained(path)` (or full_state_dict, save_state, load_state,
    load_full_state_dict), as DDP scripts save: rank 0 raises naming the rank that never called, at the process
    group's timeout (shortened here), after logging why (ARRIVAL_LOG_S, shortened); no collective was entered, so
    both ranks carry on, and the same calls on both ranks then work (rank 0's failed calls left the counts in step).
    Before, rank 0 waited in its first collective, or paired it with the other rank's next collective."""
    import logging
    import tempfile

    from tridist.distcore import env

    from tests.hf_models import build

    model = build("llama")  # transformers' own, under dp 2 with ZeRO-3
    model, optimizer = distcore.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                            ProcessMesh([0, 1], ["dp"]), {"dp_config": {"sharding_level": 3}})
    store, saved = env._default_store(), (env._default_store().timeout, env.ARRIVAL_LOG_S)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    env.log.addHandler(handler)
    folder = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    calls = {"save_pretrained": lambda: model.save_pretrained(folder),
             "full_state_dict": lambda: distcore.full_state_dict(model),
             "save_state": lambda: distcore.save_state(model, optimizer, folder),
             "load_state": lambda: distcore.load_state(model, optimizer, folder),
             "load_full_state_dict": lambda: distcore.load_full_state_dict(model, {})}
    try:
        store.set_timeout(datetime.timedelta(seconds=0.5))
        env.ARRIVAL_LOG_S = 0.2
        if dist.get_rank() == 0:
            for what, call in calls.items():
                records.clear()
                try:
                    call()
                except RuntimeError as error:
                    assert f"{what}: rank 0 waited" in str(error) and "rank(s) [1] to do the same" in str(error), error
                    assert "call it on every rank, not under `if rank == 0:`" in str(error), error
                else:
                    raise AssertionError(f"{what} on rank 0 alone: expected a RuntimeError")
                assert [r.getMessage() for r in records if f"{what}: rank 0 has waited" in r.getMessage()
                        and "for rank(s) [1]" in r.getMessage()], [r.getMessage() for r in records]
    finally:
        store.set_timeout(saved[0])
        env.ARRIVAL_LOG_S = saved[1]
        env.log.removeHandler(handler)
    dist.barrier()
    state = distcore.full_state_dict(model)  # on both ranks: works, rank 0 gets the whole model
    assert (len(state) > 0) == (dist.get_rank() == 0), len(state)


def save_check(layout: str) -> str:
    return f"check_save_{layout.replace('-', '_')}_then_continue"


def load_check(layout: str) -> str:
    return f"check_load_{layout.replace('-', '_')}_and_continue"


# The saves run on 4 processes; the loads on each world size of LOADED_UNDER (tests/distributed/test_checkpoint.py
# asks each launch for its own). A world's checks run in this order: saves before the loads that read them.
CHECKS = {
    **{save_check(layout): functools.partial(_save_then_continue, layout) for layout in LAYOUTS},
    **{load_check(layout): functools.partial(_load_under_another_layout_and_continue, layout) for layout in LAYOUTS},
    "check_missing_checkpoint_is_a_clear_error": check_missing_checkpoint_is_a_clear_error,
    "check_a_checkpoint_on_rank_0_alone_is_a_clear_error": check_a_checkpoint_on_rank_0_alone_is_a_clear_error,
}

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
