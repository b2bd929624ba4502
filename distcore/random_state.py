"""The random state of a tensor-parallel group's ranks, kept alike from call to call.

The ranks of a tensor-parallel group hold the same replicated activations (a row-parallel linear's all-reduced
output, the residual stream): a dropout there must draw the same mask on each of them, or the replicas part,
and every later step trains on activations no two ranks agree on, with no error (the replicated parameters'
gradients then differ per rank, and so do the parameters). The ranks draw the same numbers while their
generators start each call in the same state: they run the same random ops on tensors of the same local
shapes. What breaks that is any draw one rank makes and another does not: a user seeding each rank apart
(`torch.manual_seed(seed + rank)`, for data augmentation), a rank-0-only draw in the user's code. So before
each training call of the model, the group's first rank's state (torch's CPU generator, and the device's where
it is an accelerator) is broadcast to the group: one broadcast of about 5 KB per call.

What this does not give (as with Megatron-LM's default seeds across data parallel, and unlike its tensor-
parallel RNG tracker): a dropout inside a sharded region (the attention probabilities of this rank's heads)
draws the same pattern on every rank of the group, so heads h and h + heads/tp share their masks (each mask
is still a fair draw); data-parallel replicas seeded alike draw alike for their different rows. Neither makes
a replica disagree with another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class TensorParallelRandomState:
    """A forward pre-hook of the model (prepended: before any hook that could draw): in a training call (grad
    enabled or the model in train mode: every rank of the group decides alike), this rank's generators take the
    state of the group's first rank."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device

    def __call__(self, module: torch.nn.Module, args) -> None:
        if not (torch.is_grad_enabled() or module.training):
            return
        accelerator = self.device.type == "cuda"
        states = [torch.get_rng_state(), *([torch.cuda.get_rng_state(self.device)] if accelerator else [])]
        flat = torch.cat(states).to(self.device)
        dist.broadcast(flat, group=self.group, group_src=0)
        cpu, *device_state = flat.cpu().split([state.numel() for state in states])
        torch.set_rng_state(cpu)
        if accelerator:
            torch.cuda.set_rng_state(device_state[0], self.device)


def keep_tensor_parallel_random_state_alike(model: torch.nn.Module, *, tp_group, device: torch.device) -> None:
    model.register_forward_pre_hook(TensorParallelRandomState(tp_group, device), prepend=True)
