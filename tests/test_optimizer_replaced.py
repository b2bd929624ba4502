"""An optimizer built before parallelize and not given to it (distcore/optimizer.py): on one process, with the
parameters replaced by hand as parallelize replaces them (a new parameter of the same name, or none where it
lives on another pipeline stage)."""

from __future__ import annotations

import pytest
import torch

from tridist import distcore
from tridist.distcore.optimizer import mark_replaced


def _replaced_model():
    """(model with its weight replaced and its bias moved to another stage, the old weight, the old bias)."""
    model = torch.nn.Linear(2, 2)
    old_weight, old_bias = model.weight, model.bias
    before = {id(p): p for p in (old_weight, old_bias)}
    names = {id(old_weight): ["weight"], id(old_bias): ["bias"]}
    model.weight = torch.nn.Parameter(old_weight.detach().clone())
    del model.bias
    model.register_parameter("bias", None)
    mark_replaced(before, names, model)
    return model, old_weight, old_bias


def test_a_step_over_replaced_parameters_raises_naming_them_and_the_fix():
    model, old_weight, old_bias = _replaced_model()
    optimizer = torch.optim.SGD([old_weight, old_bias], lr=0.1)
    with pytest.raises(RuntimeError, match=r"holds 2 parameter\(s\) .*\['weight', 'bias'\].*shard_optimizer"):
        optimizer.step()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # an optimizer over the model's own parameters steps


def test_shard_optimizer_takes_the_replacements_in_place():
    model, old_weight, old_bias = _replaced_model()
    untouched = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([{"params": [old_weight, untouched]}, {"params": [old_bias], "lr": 0.5}], lr=0.1)
    assert distcore.shard_optimizer(optimizer) is optimizer
    assert optimizer.param_groups[0]["params"] == [model.weight, untouched]
    assert optimizer.param_groups[1]["params"] == [] and optimizer.param_groups[1]["lr"] == 0.5  # another stage's
    model.weight.grad = torch.ones_like(model.weight)
    optimizer.step()
    assert torch.equal(model.weight, old_weight - 0.1)


def test_an_optimizer_with_state_for_replaced_parameters_is_refused():
    model, old_weight, _ = _replaced_model()
    optimizer = torch.optim.SGD([old_weight], lr=0.1, momentum=0.9)
    optimizer.state[old_weight]["momentum_buffer"] = torch.zeros_like(old_weight)
    with pytest.raises(ValueError, match="already has state for parameters parallelize replaced"):
        distcore.shard_optimizer(optimizer)


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield distcore.ProcessMesh([0], ["dp"])
    finally:
        dist.destroy_process_group()


def test_an_optimizer_built_before_shard_tensor_is_refused_once_the_backward_shows_it(world_of_one):
    """Paddle's `layer.weight = dist.shard_tensor(layer.weight, ...)` after the optimizer was built: the model
    trains the new parameter, the optimizer holds the old one. Refused at the step where the old parameter got
    no gradient and the new one did (the gradients set by hand, as a backward through the model leaves them)."""
    from torch.distributed.tensor import Replicate

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight = distcore.shard_tensor(model.weight, world_of_one, [Replicate()])
    optimizer.step()  # no backward yet: nothing shows the mistake
    model.weight.grad, model.bias.grad = torch.ones_like(model.weight), torch.ones_like(model.bias)
    with pytest.raises(RuntimeError, match=r"holds 1 parameter\(s\) that shard_tensor replaced \(\['a \(2, 2\) "
                                           r"parameter passed to shard_tensor'\]\).*Build the optimizer after sharding"):
        optimizer.step()
    assert distcore.shard_optimizer(optimizer) is optimizer  # it does not swap them: the step alone knows
    assert optimizer.param_groups[0]["params"][0] is not model.weight
    before = distcore.local_value(model.weight.detach()).clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # built after sharding: steps the model's parameters
    assert torch.equal(distcore.local_value(model.weight.detach()), before - 0.1)


def test_a_parameter_still_trained_after_shard_tensor_copied_it_steps(world_of_one):
    """A copy made by shard_tensor for something else leaves the original the model's: it gets its gradient and
    the optimizer that holds it steps."""
    from torch.distributed.tensor import Replicate

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    copy = distcore.shard_tensor(model.weight, world_of_one, [Replicate()])
    before = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    copy.grad = torch.ones_like(copy)
    optimizer.step()
    assert torch.equal(model.weight.detach(), before - 0.1)
