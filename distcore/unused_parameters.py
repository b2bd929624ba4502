"""Parameters that some data-parallel ranks use in a step and others do not.

A mixture of experts written as transformers' eager loop runs only the experts its tokens chose (LongCat-Flash's
tokens may all choose its identity experts), and other models skip branches by their data. FSDP2 (and its
`replicate`) reduces the gradients of the parameters a rank used, so ranks that used different sets enter
collectives of different sizes: gloo aborts, NCCL may hang. `reduce_scatter_unused_params` (FSDP2's counterpart of
DDP's find_unused_parameters) has a rank contribute a zero gradient for a parameter it did not use: a used
parameter's gradient is then the sum over the ranks that used it, as on one device.

A parameter that no rank used then holds a zero gradient where one device leaves None, and an optimizer with
weight decay or momentum would move it (DDP leaves such gradients alone). So each unit's gathered parameters
record, by a hook, that they received a gradient, and before each optimizer step the ranks take the union of
their records (one all-reduce of a flag per parameter) and give None to the parameters no rank used. A parameter
that no hook saw but whose gradient is not zero (a use the hooks missed) counts as used: the worst a missed hook
can do is leave FSDP2's zero, never drop a gradient.

The gathered parameters are marked too: FSDP2 registers them on the modules between a forward and the next
backward (all of a forward without backward: an evaluation), so an optimizer built then from model.parameters()
would hold them, and they never get a gradient. The step pre-hook refuses such an optimizer, naming the fix.

Which optimizer steps: any that holds a tracked parameter (`drop_unused_gradients_before_step`, called by the step
pre-hook distcore/optimizer.py registers on every torch optimizer). The parameters name their tracker, so the one
given to parallelize, one built afterwards from the model's parameters (parallelize's optimizer=None) and a second
one over part of them all reach it; once a step has run it, later steps before the next forward skip it. Before,
the hook was registered on the optimizer parallelize was given only: one built afterwards decayed the experts no
rank ran (AdamW's weight decay), silently.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist

from .api import local_value


def trackers_of(parameters) -> list["UnusedParameters"]:
    """The live trackers that `parameters` name, each once."""
    trackers = {}
    for parameter in parameters:
        reference = getattr(parameter, "_tridist_unused", None)
        tracker = reference() if reference is not None else None
        if tracker is not None:
            trackers[id(tracker)] = tracker
    return list(trackers.values())


def drop_unused_gradients_before_step(parameters) -> None:
    """Before an optimizer step over `parameters`: each tracker that one of them names drops its unused gradients."""
    for tracker in trackers_of(parameters):
        tracker.drop_unused_gradients()


class UnusedParameters:
    """Makes the data-parallel `units` (FSDP2 modules, the root last) reduce zeros for parameters a rank did not use,
    and, before the step of any optimizer holding one of them, gives None to those no rank of `dp_group` used. The parameters of
    `apart` (expert-parallel experts, reduced over their own group, each rank holding other experts) are left
    alone: their grouped GEMMs give every local expert a gradient on every rank."""

    def __init__(self, units: list[torch.nn.Module], dp_group, *, apart: list[torch.nn.Module] = ()):
        self.dp_group = dp_group
        self.used: set[tuple[int, str]] = set()  # (module, name) of the parameters that received a gradient
        # (module, name) of the parameters whose gradient the loop zeroed rather than freed since the last step
        # (Paddle's clear_grad(), zero_grad(set_to_none=False)): one device keeps those zeros, used or not
        self.kept: set[tuple[int, str]] = set()
        self.hooked: set[int] = set()  # the gathered parameters that carry the hook
        self.training = False  # a forward that may be backpropagated ran since the last optimizer step
        # (module, name) -> the parameter as the optimizer holds it (sharded, or replicated): each once, in an order
        # that is the same on every rank
        self.parameters: dict[tuple[int, str], torch.nn.Parameter] = {}
        left = {(id(module), name) for unit in apart for module in unit.modules() for name in module._parameters}
        for unit in units:  # a unit nested in another comes first: its parameters are its own
            own = []
            for module in unit.modules():
                for name, parameter in module._parameters.items():
                    key = (id(module), name)
                    if parameter is not None and parameter.requires_grad and key not in self.parameters and key not in left:
                        self.parameters[key] = parameter
                        # How an optimizer's step finds this tracker (weakly: the units' hooks keep it alive).
                        parameter._tridist_unused = weakref.ref(self)
                        own.append((module, name, key))
            # After FSDP2's own pre-forward hook, which gathers the unit's parameters
            unit.register_forward_pre_hook(functools.partial(self._before_forward, own=own))

    def _before_forward(self, unit: torch.nn.Module, args, *, own: list) -> None:
        # Zeros for unused parameters where a backward may follow only: torch's pipeline schedules run FSDP2's
        # post-backward after an evaluation too, where they would reduce zeros, and one replica may evaluate alone.
        if torch.is_grad_enabled() and not self.training:  # the first training forward since the last step
            self.kept = {key for key, parameter in self.parameters.items() if parameter.grad is not None}
        self.training |= torch.is_grad_enabled()
        unit.set_reduce_scatter_unused_params(torch.is_grad_enabled(), recurse=False)
        for module, name, key in own:
            parameter = module._parameters.get(name)
            if parameter is None or parameter is self.parameters[key] or id(parameter) in self.hooked:
                continue  # not gathered, or hooked already (FSDP2 keeps its gathered parameter from step to step)
            self.hooked.add(id(parameter))
            parameter.register_post_accumulate_grad_hook(lambda _, key=key: self.used.add(key))
            # What model.parameters() yields between a forward and the next backward: an optimizer holding it would
            # step a tensor that never gets a gradient (the step pre-hook refuses it: optimizer.py).
            parameter._tridist_gathered_copy = True

    # A call recorded apart: pipeline parallel runs a call's backward inside model(...), and its gradients count only
    # once its loss's backward comes (pipeline.py's _CallGradients), so its record waits with them.
    def begin_apart(self) -> tuple:
        """Record from here on apart; returns the record so far, for `end_apart`."""
        earlier, self.used = (self.used, self.training), set()
        return earlier

    def end_apart(self, earlier: tuple) -> set:
        """The parameters used since `begin_apart` (for `add_apart`); the record before it back in place."""
        used, (self.used, self.training) = self.used, earlier
        return used

    def add_apart(self, used: set) -> None:
        """A call recorded apart got its backward: its parameters count as used, its forward as a training one."""
        self.used |= used
        self.training = True

    def drop_unused_gradients(self) -> None:
        """Before an optimizer step: None for the gradients no rank's backward produced since the last step, except
        those the loop had zeroed rather than freed (one device steps on their zeros: weight decay, momentum). Only
        after a training forward: a step without one (torch.distributed.checkpoint's, with zero gradients, to create
        the optimizer's state before loading it) is left alone."""
        if not self.training:
            return
        self.training = False
        by_parameter: dict[int, list] = {}  # a tied parameter under several (module, name)
        for key, parameter in self.parameters.items():
            by_parameter.setdefault(id(parameter), [parameter, False])[1] |= key in self.used or key in self.kept
        entries = list(by_parameter.values())
        self.used.clear()
        self.kept = set()
        if not entries:
            return
        used = [seen or (p.grad is not None and bool(local_value(p.grad).any())) for p, seen in entries]
        flags = torch.tensor(used, dtype=torch.int32, device=local_value(entries[0][0]).device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.dp_group)
        for (parameter, _), flag in zip(entries, flags.tolist()):
            if not flag:
                parameter.grad = None
