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
An evaluation's loss (under no_grad) is the token mean of the batch the rank was given (no collective: one
replica may evaluate alone); under pipeline micro-batches its own labelled tokens are counted the same way. A
forward under grad mode counts as training whatever the model's mode (one left in eval mode trains so).

Other models compute their own mean. Under data parallel alone, the first training forward finds which
positions that mean covers: the gradient of the returned loss with respect to the returned logits is
non-zero exactly there, and those must be the labelled positions unshifted (the logits at t against label
t: the seed model, CPM-Ant) or shifted (against label t + 1), with the loss their cross-entropy mean. Then
each rank's loss is scaled by `ranks * its count / global count`, which makes data parallel's mean the
global token mean (loss and gradients) as above. Where the counts differ and that cannot be found (no
logits returned, another loss, DTensor logits), or under pipeline micro-batches (whose losses the schedule
averages), the forward raises an error naming the fix: no numbers that differ from one device's.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..kernels.fuse import forward_argument
from .api import local_value
from .outputs import find_logits, find_loss, replace_loss

IGNORE_INDEX = -100  # torch's cross_entropy default and Hugging Face's label padding


def takes_num_items(model: torch.nn.Module) -> bool:
    """Whether `model(..., num_items_in_batch=n)` returns its causal-LM loss as a token sum over n with
    Hugging Face's convention (labels shifted inside: position t predicts label t + 1), which fixes
    what to count. A Hugging Face model whose `loss_function` is transformers' ForCausalLMLoss (it
    receives the forward's **kwargs) and that its forward calls: every transformers model inherits
    `loss_function`, and some compute their own cross entropy beside it (CPM-Ant, BART's and Marian's
    decoders, XLM), which would ignore the count. A peft model (`get_peft_model`'s wrapper, whose forward passes its
    keywords to the model it wraps) where the model it wraps does."""
    try:
        forward = inspect.unwrap(type(model).forward)  # under transformers' decorators
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return False
    names = getattr(getattr(forward, "__code__", None), "co_names", ())
    keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    base = getattr(model, "get_base_model", None)
    if callable(base) and keywords and {"base_model", "get_base_model"} & set(names):  # peft's PeftModel: its keywords
        # reach the model it wraps
        inner = base()
        return inner is not model and takes_num_items(inner)
    loss_function = getattr(model, "loss_function", None)
    if getattr(loss_function, "__name__", None) != "ForCausalLMLoss":
        return False
    return "loss_function" in names and keywords


def install_global_token_mean(model: torch.nn.Module, *, dp_group, micro_batches: int) -> None:
    """Make the loss of every training forward the global batch's token mean (see the module's doc).
    `dp_group`: the data-parallel group (None: one replica); `micro_batches`: the pipeline's parts."""
    if takes_num_items(model):
        model.register_forward_pre_hook(
            functools.partial(_pass_num_items, dp_group=dp_group, micro_batches=micro_batches), with_kwargs=True)
        return
    own = _OwnMean(model, dp_group=dp_group, micro_batches=micro_batches)
    model.register_forward_pre_hook(own.count, with_kwargs=True)
    # Before data parallel's hook that reports the ranks' mean loss (registered earlier): it averages the scaled losses.
    model.register_forward_hook(own.scale, prepend=True)


def _training(module, micro_batches: int) -> bool:
    """A forward that may be backpropagated: under grad mode, in train mode or not (from_pretrained returns a
    model in eval mode, which trains so on one device: deciding by the mode trained it on per-rank means); with
    micro-batches, in train mode only (the pipeline's eval-mode call runs the forward alone and refuses a
    backward)."""
    return torch.is_grad_enabled() and (module.training or micro_batches == 1)


def _labels(module: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The forward's `labels`, passed by keyword or by position, in local view; None where not given."""
    labels = forward_argument(module, "labels", args, kwargs)
    return local_value(labels) if isinstance(labels, torch.Tensor) else None


def _pass_num_items(module, args, kwargs, *, dp_group, micro_batches: int):
    labels = _labels(module, args, kwargs)
    # An evaluation's loss is the token mean of this rank's batch (evaluation may run on one data-parallel
    # rank alone: no collective); only the pipeline's micro-batches need the count then.
    training = _training(module, micro_batches)
    if labels is None or not (training or micro_batches > 1) or "num_items_in_batch" in kwargs:
        return None  # with num_items_in_batch, the caller counted (e.g. over its own gradient-accumulation steps)
    # Hugging Face shifts inside its loss: position t predicts label t + 1, the first is never one.
    count = (labels[..., 1:] != IGNORE_INDEX).sum().to(torch.float32).reshape(1)
    parts = micro_batches
    if dp_group is not None and training:
        dist.all_reduce(count, group=dp_group)
        parts *= dist.get_world_size(dp_group)
    return args, {**kwargs, "num_items_in_batch": count[0] / parts}


def _unshifted(labels: torch.Tensor) -> torch.Tensor:
    return labels


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    return torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], IGNORE_INDEX)], dim=-1)


# The targets a causal-LM loss can average over, by the logits' position: label t, or label t + 1 (Hugging Face's
# shift; the last position predicts nothing).
TARGETS = {"unshifted": _unshifted, "shifted": _shifted}
_UNKNOWN = "not a cross-entropy mean over the labelled positions"


class _OwnMean:
    """Global token mean for a model that computes its own mean loss (see the module's doc): `count` (a forward
    pre-hook) counts each part's labelled positions both ways, `scale` (a forward hook) scales this rank's loss."""

    def __init__(self, model: torch.nn.Module, *, dp_group, micro_batches: int):
        self.dp_group, self.micro_batches = dp_group, micro_batches
        self.name = type(model).__name__
        self.averaged = None  # which TARGETS the loss averages over (or _UNKNOWN): found on the first training call
        self.pending = None  # this call's (labels, [part, way] counts of every part), for `scale`

    def count(self, module, args, kwargs):
        self.pending = None
        labels = _labels(module, args, kwargs)
        training = _training(module, self.micro_batches)
        if labels is None or not (training or self.micro_batches > 1) or len(labels) % self.micro_batches:
            return None  # (a batch the micro-batches do not divide: the pipeline's own error says so)
        counts = torch.stack([torch.stack([(way(part) != IGNORE_INDEX).sum() for way in TARGETS.values()])
                              for part in labels.chunk(self.micro_batches)]).to(torch.float32)
        if training and self.dp_group is not None:  # every data-parallel rank's parts
            gathered = [torch.empty_like(counts) for _ in range(dist.get_world_size(self.dp_group))]
            dist.all_gather(gathered, counts, group=self.dp_group)
            counts = torch.cat(gathered)
        if self.micro_batches > 1 and bool((counts != counts[0]).any()):
            raise RuntimeError(self._refusal(counts, "the pipeline averages its micro-batches' losses"))
        if training and self.micro_batches == 1 and len(counts) > 1:  # data parallel: `scale` reweighs
            self.pending = labels, counts
        return None

    def scale(self, module, args, output):
        pending, self.pending = self.pending, None
        loss = find_loss(output)
        if pending is None or loss is None:
            return output
        labels, counts = pending
        if self.averaged is None:  # once, alike on every rank
            self.averaged = self._agree(_averaged_targets(loss, find_logits(output), labels), counts.device)
        if self.averaged == _UNKNOWN:
            if bool((counts != counts[0]).any()):
                raise RuntimeError(self._refusal(counts, f"its loss is {_UNKNOWN} of its returned logits, which tridist "
                                                         "would reweigh (found on its first training call)"))
            return output
        way = list(TARGETS).index(self.averaged)
        total = counts[:, way].sum()
        if bool((counts[:, way] == counts[0, way]).all()) or total == 0:
            return output  # the mean of equal parts' means is the global mean already (a batch all ignored: nan anyway)
        mine = counts[dist.get_rank(self.dp_group), way]
        return replace_loss(output, loss * (len(counts) * mine / total).to(loss.dtype))

    def _agree(self, found: str, device) -> str:
        """`found` where every data-parallel rank found it, else _UNKNOWN."""
        names = [*TARGETS, _UNKNOWN]
        code = torch.tensor([names.index(found), -names.index(found)], device=device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX, group=self.dp_group)
        return found if code[0] == -code[1] else _UNKNOWN

    def _refusal(self, counts: torch.Tensor, why: str) -> str:
        return (
            f"parallelize: the data-parallel ranks / micro-batches hold {int(counts[:, 0].min())} to "
            f"{int(counts[:, 0].max())} labelled tokens (labels other than {IGNORE_INDEX}), and {self.name} computes its "
            f"own mean loss: the mean of their means would not be the batch's token mean, as on one device, and "
            f"{why}. Fix: accept `num_items_in_batch` in forward and return the loss summed over tokens divided by it "
            "(Hugging Face's convention: distcore passes the global count), return the per-token cross-entropy mean "
            "with the logits under data parallel alone, or give every rank and micro-batch as many labelled tokens "
            "(pack sequences)")


def _averaged_targets(loss: torch.Tensor, logits: torch.Tensor | None, labels: torch.Tensor) -> str:
    """Which TARGETS `loss` is the cross-entropy mean over: the positions where d loss / d logits is non-zero must be
    exactly the labelled ones of that way, and the loss their mean cross-entropy (2% relative: the model may compute
    it in bf16, whose relative rounding is 2^-8 per operation; a sum or another loss misses by a factor or more).
    _UNKNOWN otherwise, or where it cannot be told (no logits, DTensor logits, fewer than 2 labelled positions)."""
    if (not isinstance(logits, torch.Tensor) or type(logits) is not torch.Tensor or not logits.requires_grad
            or not loss.requires_grad or tuple(logits.shape[:-1]) != tuple(labels.shape)):
        return _UNKNOWN
    (gradient,) = torch.autograd.grad(loss, logits, retain_graph=True, allow_unused=True)
    if gradient is None:
        return _UNKNOWN
    averaged = gradient.abs().amax(dim=-1) > 0
    for name, way in TARGETS.items():
        targets = way(labels)
        labelled = targets != IGNORE_INDEX
        if int(labelled.sum()) >= 2 and torch.equal(averaged, labelled):
            mean = F.cross_entropy(logits.detach()[labelled].float(), targets[labelled])
            if torch.allclose(loss.detach().float(), mean, rtol=2e-2, atol=0.0):
                return name
    return _UNKNOWN
