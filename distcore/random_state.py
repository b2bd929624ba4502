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

A dropout inside a sharded region (the attention probabilities of this rank's heads) draws from this rank's
own stream instead (ShardedRegionRandomState, as Megatron-LM's tensor-parallel RNG tracker): heads h and
h + heads/tp get masks of their own. What this does not give (as with Megatron-LM's default seeds across data
parallel): data-parallel replicas seeded alike draw alike for their different rows, and under sequence parallel
a dropout of the sequence slices between blocks draws the same pattern on each rank's slice. Neither makes a
replica disagree with another.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def _generator_states(device: torch.device) -> list[torch.Tensor]:
    """torch's CPU generator's state, and the device's where it is an accelerator."""
    return [torch.get_rng_state(), *([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])]


def _set_generator_states(states, device: torch.device) -> None:
    """The generators back to `states` (`_generator_states`')."""
    cpu, *device_state = states
    torch.set_rng_state(cpu)
    if device_state:
        torch.cuda.set_rng_state(device_state[0], device)


class TensorParallelRandomState:
    """A forward pre-hook of the model (prepended: before any hook that could draw): in a training call (grad
    enabled or the model in train mode: every rank of the group decides alike), this rank's generators take the
    state of the group's first rank."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device

    def __call__(self, module: torch.nn.Module, args) -> None:
        if not (torch.is_grad_enabled() or module.training):
            return
        states = _generator_states(self.device)
        flat = torch.cat(states).to(self.device)
        dist.broadcast(flat, group=self.group, group_src=0)
        _set_generator_states(flat.cpu().split([state.numel() for state in states]), self.device)


def keep_tensor_parallel_random_state_alike(model: torch.nn.Module, *, tp_group, device: torch.device) -> None:
    model.register_forward_pre_hook(TensorParallelRandomState(tp_group, device), prepend=True)


_GOLDEN = 0x9E3779B97F4A7C15  # odd: multiplying by it modulo 2^63 keeps distinct draws distinct


class ShardedRegionRandomState:
    """Dropout inside a tensor-parallel sharded region (from a column-parallel linear's output to the row-parallel
    linear's input: this rank's attention heads, its share of the MLP's features) draws from this rank's own
    stream, as Megatron-LM's tensor-parallel RNG tracker gives it; elsewhere the ranks share one stream
    (TensorParallelRandomState). With one stream, heads h and h + heads/tp drew the same mask.

    The fork holds no generator of its own: entering a region draws one number from the shared CPU stream (every
    rank alike), keeps the shared states, and seeds the generators (torch's CPU one, and the device's) from that
    number and this rank's index; leaving restores the shared states. Activation recompute (torch's checkpoint
    restores the generators to their state at the recomputed module's start) replays the same regions from the
    same shared states: the same seeds, the same masks. About 6 us per region on a CPU core, in training calls
    only (eval mode draws nothing). A region left open closes when the column-parallel linear's parent module
    returns (`guard`: a column-parallel output with no row-parallel input after it, a forward stopped by an
    error), or, left open by checkpoint's early stop of a recomputation, at the next call (`forget`).

    Not forked: under torch.compile (the shared stream, as before 2026-11-28: the generator calls would split the
    graph, and DTensor's vocabulary-parallel embedding then fails across the graphs, "Mixing fake modes"); and a
    dropout of the sequence slices between blocks under sequence parallel, because a recomputed decoder layer
    would begin inside such a region, from its forked state, with the shared state to restore lost."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self._shared: list[torch.Tensor] | None = None  # the shared generators' states while a region is open

    def enter(self, module: torch.nn.Module | None = None, *_) -> None:
        """Open a region (a forward hook of a column-parallel linear, in training); within one (q, k and v), or in
        eval mode, nothing."""
        training = module is None or module.training
        if self._shared is not None or not training or torch.compiler.is_compiling():
            return
        drawn = int(torch.randint(1 << 62, (1,)))  # the shared stream moves on: the next region seeds apart
        self._shared = _generator_states(self.device)
        seed = (drawn * _GOLDEN + self.rank + 1) % (1 << 63)  # ranks apart (generators take seeds below 2^63)
        torch.random.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index if self.device.index is not None
                                          else torch.cuda.current_device()].manual_seed(seed)

    def leave(self, *_) -> None:
        """Close the open region (a forward pre-hook of a row-parallel linear, and `guard`'s hook); else nothing."""
        if self._shared is None or torch.compiler.is_compiling():
            return
        shared, self._shared = self._shared, None
        _set_generator_states(shared, self.device)

    def forget(self, *_) -> None:
        """Drop a region a recomputation left open (checkpoint's early stop ends it inside a region, and restores
        the generators itself): a forward pre-hook of the root, before any region of the call."""
        self._shared = None

    def guard(self, module: torch.nn.Module) -> None:
        """Close any region still open when `module` returns or raises (once per module)."""
        if not getattr(module, "_tridist_region_guard", False):
            module.register_forward_hook(self.leave, always_call=True)
            module._tridist_region_guard = True

    @contextlib.contextmanager
    def region(self):
        """A region as a context (attention on this rank's heads in global view)."""
        self.enter()
        try:
            yield
        finally:
            self.leave()
