"""The loss of a batch is the mean over its labelled tokens, on one device and on many.

A causal-LM loss averages over the tokens whose label is not `ignore_index` (-100: padding, prompts).
Split over data-parallel ranks (or pipeline micro-batches) that hold different numbers of labelled
tokens, the mean of the parts' means is not the batch's mean: the loss and the gradients differ from
one device (a rank with 3 labelled tokens weighs as much as one with 300).

Hugging Face models take the fix as an argument: `num_items_in_batch` makes their loss
`sum / num_items_in_batch` (the Trainer's gradient-accumulation fix). Before each training forward
the labelled tokens of the global batch are counted (one all-reduce of a scalar over dp) and each
part gets `num_items_in_batch = global count / parts`: a part's loss is then `parts * its sum / global
count`, and the mean over the parts that data parallel and the pipeline take is exactly the global
token mean (loss and gradients). Any model whose forward takes `num_items_in_batch` gets the same.
An evaluation's loss is the token mean of the batch the rank was given (no collective: one replica may
evaluate alone); under pipeline micro-batches its own labelled tokens are counted the same way.

Other models compute their own mean: where the counts differ between the parts, a warning says so
(once per model) with the fix.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.distributed as dist

from .api import local_value

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # torch's cross_entropy default and Hugging Face's label padding


def takes_num_items(model: torch.nn.Module) -> bool:
    """Whether `model(..., num_items_in_batch=n)` returns its causal-LM loss as a token sum over n with
    Hugging Face's convention (labels shifted inside: position t predicts label t + 1), which fixes
    what to count. A Hugging Face model whose `loss_function` is transformers' ForCausalLMLoss (it
    receives the forward's **kwargs)."""
    loss_function = getattr(model, "loss_function", None)
    if getattr(loss_function, "__name__", None) != "ForCausalLMLoss":
        return False
    try:
        parameters = inspect.signature(type(model).forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def install_global_token_mean(model: torch.nn.Module, *, dp_group, micro_batches: int) -> None:
    """Make the loss of every training forward the global batch's token mean (see the module's doc).
    `dp_group`: the data-parallel group (None: one replica); `micro_batches`: the pipeline's parts."""
    exact = takes_num_items(model)
    warned = [False]

    def hook(module, args, kwargs):
        labels = kwargs.get("labels")
        # An evaluation's loss is the token mean of this rank's batch (evaluation may run on one data-parallel
        # rank alone: no collective); only the pipeline's micro-batches need the count then.
        training = module.training and torch.is_grad_enabled()
        if not isinstance(labels, torch.Tensor) or not (training or micro_batches > 1):
            return None
        labels = local_value(labels)
        if exact:
            if "num_items_in_batch" in kwargs:
                return None  # the caller counted (e.g. over its own gradient-accumulation steps)
            # Hugging Face shifts inside its loss: position t predicts label t + 1, the first is never one.
            count = (labels[..., 1:] != IGNORE_INDEX).sum().to(torch.float32).reshape(1)
            parts = micro_batches
            if dp_group is not None and training:
                dist.all_reduce(count, group=dp_group)
                parts *= dist.get_world_size(dp_group)
            return args, {**kwargs, "num_items_in_batch": count[0] / parts}
        if not warned[0] and training:
            counts = torch.stack([(chunk != IGNORE_INDEX).sum() for chunk in labels.chunk(micro_batches)]).float()
            extremes = torch.stack([counts.max(), -counts.min()])
            if dp_group is not None:
                dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=dp_group)
            most, fewest = extremes[0].item(), -extremes[1].item()
            if most != fewest:
                warned[0] = True
                log.warning(
                    "parallelize: the data-parallel ranks / micro-batches hold %d to %d labelled tokens (labels other "
                    "than %d); %s computes its own mean loss, so the loss and gradients are the mean of their means, "
                    "not the global batch's token mean as on one device. Fix: give every rank and micro-batch as many "
                    "labelled tokens (pack sequences), or return the loss summed over tokens and divide by the global "
                    "count yourself (Hugging Face causal LMs get it exact: distcore passes num_items_in_batch)", fewest, most, IGNORE_INDEX, type(module).__name__,
                )
        return None

    model.register_forward_pre_hook(hook, with_kwargs=True)
