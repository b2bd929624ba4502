"""Checks of shard_optimizer on 4 gloo processes (run by tests/distributed/test_optimizer.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from tridist import distcore
from tridist.distcore import ProcessMesh, Replicate, Shard
from tridist.distcore.optimizer import ShardingStage1, ShardingStage2, ShardingStage3
from tests.distributed import equivalence
from tests.distributed.harness import run_checks

GLOBAL_BATCH, STEPS = 8, 3


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 6, generator=generator), torch.randn(GLOBAL_BATCH, 3, generator=generator)) for _ in range(STEPS)]


def _train(model, optimizer, batches, *, rank_slice=None, parameters=None) -> equivalence.Trace:
    parameters = parameters or model
    trace = equivalence.Trace()
    for x, y in batches:
        if rank_slice is not None:
            x, y = x[rank_slice], y[rank_slice]
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        trace.step(parameters, loss)  # the loss of this rank's rows (DDP shows no global mean): not compared
        optimizer.step()
        optimizer.clear_grad() if hasattr(optimizer, "clear_grad") else optimizer.zero_grad()
    return trace.end(parameters)


# AdamW, whose states ShardingStage1 shards, with eps raised from 1e-8 to 1e-3 so that its update cannot
# turn the rounding of a near-zero gradient into a ±lr step (equivalence.py).
ADAMW = {"lr": 1e-2, "eps": 1e-3}


def check_paddle_dialect():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = distcore.shard_optimizer(torch.optim.SGD([param], lr=0.5))
    param.sum().backward()
    optimizer.step()
    assert torch.equal(param.detach(), torch.full((3,), 0.5))
    optimizer.clear_grad()
    assert torch.equal(param.grad, torch.zeros(3))  # Paddle zeroes; clear_grad(set_to_zero=False) frees
    optimizer.clear_grad(set_to_zero=False)
    assert param.grad is None
    assert optimizer.get_lr() == 0.5
    optimizer.set_lr(0.1)
    assert optimizer.param_groups[0]["lr"] == 0.1


def check_stage1_matches_one_process():
    """DDP + ShardingStage1 (ZeRO-1: each rank keeps a quarter of Adam's states) == one process."""
    mesh = ProcessMesh([0, 1, 2, 3], ["dp"])
    reference = _mlp()
    ref_trace = _train(reference, torch.optim.AdamW(reference.parameters(), **ADAMW), _batches())
    model = DistributedDataParallel(_mlp())
    optimizer = distcore.shard_optimizer(torch.optim.AdamW(model.parameters(), **ADAMW), ShardingStage1("dp", mesh))
    rank = dist.get_rank()
    per_rank = GLOBAL_BATCH // 4
    trace = _train(model, optimizer, _batches(), rank_slice=slice(rank * per_rank, (rank + 1) * per_rank), parameters=model.module)
    equivalence.assert_same_training(trace, ref_trace, losses=False)
    assert isinstance(optimizer, torch.optim.Optimizer)  # LR schedulers accept it
    owned = torch.tensor([len(optimizer.optim.state)])  # parameters whose Adam states this rank keeps
    total = sum(1 for _ in model.parameters())
    assert 0 < owned.item() < total, "each rank should hold only its share of the states"
    dist.all_reduce(owned)
    assert owned.item() == total, "together the ranks hold every parameter's states exactly once"


def check_schedulers_work_on_sharded_optimizers():
    param = torch.nn.Parameter(torch.ones(4))
    for optimizer in (
        distcore.shard_optimizer(torch.optim.SGD([param], lr=1.0)),
        distcore.shard_optimizer(torch.optim.SGD([param], lr=1.0), ShardingStage1("dp", ProcessMesh([0, 1, 2, 3], ["dp"]))),
    ):
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        param.sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.clear_grad()
        assert optimizer.get_lr() == 0.5


def check_states_follow_tensor_parallel_parameters():
    mesh = ProcessMesh([0, 1, 2, 3], ["mp"])
    weight = distcore.shard_tensor(torch.nn.Parameter(torch.randn(8, 4)), mesh, [Shard(0)])
    bias = distcore.shard_tensor(torch.nn.Parameter(torch.randn(4)), mesh, [Replicate()])
    optimizer = distcore.shard_optimizer(torch.optim.AdamW([weight, bias], lr=1e-3))
    (weight.sum() + bias.sum()).backward()
    optimizer.step()
    state = optimizer.state[weight]["exp_avg"]
    assert isinstance(state, DTensor) and state.placements == (Shard(0),) and state.to_local().shape == (2, 4)


def check_errors_name_the_fix():
    mesh = ProcessMesh([0, 1, 2, 3], ["dp"])
    plain = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    for stage, level in ((ShardingStage2("dp", mesh), 2), (ShardingStage3("dp", mesh), 3)):
        try:
            distcore.shard_optimizer(plain, stage)
        except ValueError as error:
            assert f"'sharding_level': {level}" in str(error), str(error)
        else:
            raise AssertionError("expected a ValueError")
    tp = distcore.shard_tensor(torch.nn.Parameter(torch.randn(8, 4)), mesh, [Shard(0)])
    try:
        distcore.shard_optimizer(torch.optim.SGD([tp], lr=0.1), ShardingStage1("dp", mesh))
    except ValueError as error:
        assert "parallelize" in str(error)
    else:
        raise AssertionError("expected a ValueError")
    try:
        distcore.shard_optimizer(plain, "stage1")
    except TypeError as error:
        assert "ShardingStage1/2/3" in str(error)
    else:
        raise AssertionError("expected a TypeError")


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
