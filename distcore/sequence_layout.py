"""Where a block's activations keep their sequence, and the two differentiable moves between whole and
split sequences; the bottom of distcore's tensor-parallel modules (it imports none of them).

Activations are [batch, seq, hidden] (the seed's and Hugging Face's layout). gather = all-gather forward,
own slice backward; split = own slice forward, all-gather backward (DTensor redistributions).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

SEQUENCE_DIM = 1  # [batch, seq, hidden], the layout of the seed and Hugging Face models


def gather_sequence(x: torch.Tensor, tp_mesh) -> torch.Tensor:
    return DTensor.from_local(x, tp_mesh, [Shard(SEQUENCE_DIM)], run_check=False).redistribute(
        tp_mesh, [Replicate()]
    ).to_local(grad_placements=[Replicate()])


def split_sequence(x: torch.Tensor, tp_mesh) -> torch.Tensor:
    if x.shape[SEQUENCE_DIM] % tp_mesh.size():
        raise ValueError(
            f"parallelize: sequence parallel splits the sequence ({x.shape[SEQUENCE_DIM]} tokens) over "
            f"{tp_mesh.size()} ranks, which does not divide it; use a sequence length divisible by the mp degree "
            f"(evaluation and generation too: pad the inputs to a multiple of {tp_mesh.size()}; a generation step "
            "with a key/value cache feeds one token, so generate on a model without sequence parallel, e.g. one "
            "device's loaded from distcore.full_state_dict(model))"
        )
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(SEQUENCE_DIM)]).to_local()


_ACTIVATION_KEYWORDS = ("hidden_states", "x", "input")  # the hidden states passed by keyword


def first_activation(args, kwargs) -> torch.Tensor | None:
    """The module's hidden states: the first positional argument, else `hidden_states` (None: neither)."""
    if args and torch.is_tensor(args[0]):
        return args[0]
    return next((kwargs[key] for key in _ACTIVATION_KEYWORDS if torch.is_tensor(kwargs.get(key))), None)


def map_first_activation(args, kwargs, fn):
    """Apply fn to the module's hidden states (`first_activation`)."""
    if args and torch.is_tensor(args[0]):
        return (fn(args[0]), *args[1:]), kwargs
    for key in _ACTIVATION_KEYWORDS:
        if torch.is_tensor(kwargs.get(key)):
            return args, {**kwargs, key: fn(kwargs[key])}
    raise ValueError("parallelize: a sequence-parallel boundary found no hidden-states tensor in the module's inputs")


def first_output(output):
    """A module's hidden states: its output, or the first of a tuple or list of outputs (GPT-1's blocks and attention
    return lists)."""
    return output[0] if isinstance(output, (tuple, list)) and output else output


def with_first(output: tuple | list, value):
    """A tuple or list `output` with its first entry `value`, of the same kind: a list, a namedtuple (whose constructor
    takes the fields as arguments, not one iterable) or, for any other tuple, a plain tuple."""
    if isinstance(output, list):
        return [value, *output[1:]]
    values = (value, *output[1:])
    return type(output)._make(values) if hasattr(type(output), "_make") else values


def map_output(output, fn):
    """Apply fn to a module's hidden states (`first_output`)."""
    if isinstance(output, (tuple, list)) and output:
        return with_first(output, fn(output[0]))
    return fn(output)
