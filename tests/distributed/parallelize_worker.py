"""Checks of parallelize's data parallelism on 4 gloo processes: every sharding level trains the seed
model exactly like one process does on the global batches."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tridist import distcore
from tridist.bench.models import build_model
from tridist.distcore import ProcessMesh, Shard
from tests.distributed.harness import run_checks

WORLD, GLOBAL_BATCH, SEQ_LEN, STEPS, VOCAB = 4, 8, 12, 3, 128


def _batches():
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator),
         torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator))
        for _ in range(STEPS)
    ]


def _model_and_optimizer():
    torch.manual_seed(0)
    model = build_model("seed-llama")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _reference():
    model, optimizer = _model_and_optimizer()
    losses = []
    for inputs, labels in _batches():
        loss, _ = model(inputs, labels=labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


REFERENCE = None


def _check_level(level: int, **dp_extra):
    global REFERENCE
    REFERENCE = REFERENCE or _reference()
    ref_losses, ref_params = REFERENCE
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    model, optimizer = _model_and_optimizer()
    model, optimizer = distcore.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": level, **dp_extra}})
    losses = []
    for inputs, labels in _batches():
        # Global-view inputs, as shard_dataloader yields them; parallelize unwraps this rank's rows.
        inputs = distcore.shard_tensor(inputs, mesh, [Shard(0)])
        labels = distcore.shard_tensor(labels, mesh, [Shard(0)])
        loss, _ = model(inputs, labels=labels)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(loss.item())
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for name, param in model.named_parameters():
        full = distcore.unshard_dtensor(param.detach())
        assert torch.allclose(full, ref_params[name].detach(), atol=2e-5), (name, (full - ref_params[name]).abs().max())


def check_level_0_replicated():
    _check_level(0)


def check_level_1():
    _check_level(1)


def check_level_2():
    _check_level(2)


def check_level_3_parameters_sharded():
    _check_level(3)


def check_mixed_precision_policy():
    """bf16 compute with fp32 gradient reduction (FSDP2's policy): fp32 master weights, close losses."""
    ref_losses, _ = REFERENCE or _reference()
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    model, optimizer = _model_and_optimizer()
    config = {"dp_config": {"sharding_level": 2, "param_dtype": "bfloat16", "reduce_dtype": "float32"}}
    model, optimizer = distcore.parallelize(model, optimizer, mesh, config)
    losses = []
    for inputs, labels in _batches():
        loss, logits = model(distcore.shard_tensor(inputs, mesh, [Shard(0)]), labels=distcore.shard_tensor(labels, mesh, [Shard(0)]))
        assert logits.dtype == torch.bfloat16
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # sharded master weights stay fp32
    assert all(abs(a - b) < 0.05 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)


def check_parameters_are_sharded_at_level_3():
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    model, optimizer = _model_and_optimizer()
    model, optimizer = distcore.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 3}})
    embed = model.embed_tokens.weight
    assert embed.to_local().shape[0] == VOCAB // WORLD
    optimized = {id(q) for group in optimizer.param_groups for q in group["params"]}
    assert all(id(p) in optimized for p in model.parameters())  # the optimizer updates the sharded params


def check_config_errors():
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    cases = [
        ({"dp_config": {"sharding_level": 4}}, ValueError, "must be 0, 1, 2 or 3"),
        ({"dp_cfg": {}}, ValueError, "unknown config key"),
        ({"dp_config": {"stage": 1}}, ValueError, "unknown dp_config key"),
        ({"pp_config": {"split_spec": "layers"}}, ValueError, "needs a mesh dimension named 'pp'"),
    ]
    for config, error_type, message in cases:
        model, optimizer = _model_and_optimizer()
        try:
            distcore.parallelize(model, optimizer, mesh, config)
        except error_type as error:
            assert message in str(error), str(error)
        else:
            raise AssertionError(f"expected {error_type.__name__} for {config}")
    model, optimizer = _model_and_optimizer()
    assert distcore.parallelize(model, optimizer, None, {"dp_config": {}}) == (model, optimizer)  # no mesh: unchanged
    from tridist.distcore import ShardingStage1

    model, optimizer = _model_and_optimizer()
    zero = distcore.shard_optimizer(optimizer, ShardingStage1("dp", mesh))
    try:
        distcore.parallelize(model, zero, mesh, {"dp_config": {"sharding_level": 1}})
    except ValueError as error:
        assert "pass the plain optimizer" in str(error)
    else:
        raise AssertionError("expected a ValueError for a ZeRO-1 optimizer")


def check_evaluation_on_one_rank_and_schedulers():
    """model.eval() forward on rank 0 alone must not wait for a collective; schedulers accept the optimizer."""
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    model, optimizer = _model_and_optimizer()
    model, optimizer = distcore.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    inputs, labels = _batches()[0]
    loss, _ = model(distcore.shard_tensor(inputs, mesh, [Shard(0)]), labels=distcore.shard_tensor(labels, mesh, [Shard(0)]))
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.clear_grad()
    assert optimizer.get_lr() == 0.5e-2
    if dist.get_rank() == 0:
        model.eval()
        with torch.no_grad():
            eval_loss, _ = model(inputs[:2], labels=labels[:2])
        assert torch.isfinite(eval_loss)
    dist.barrier()


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)
    dist.destroy_process_group()
