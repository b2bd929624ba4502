"""Column-parallel bare weights (an LM head `x @ weight`) and vocabulary-parallel cross entropy.

Paddle's ColWiseParallel on a bare parameter (`"lm_head.weight"` of its LlamaLMHead, or the
to_distributed seed's root `"weight"`) splits the weight's output dim, the vocabulary, over the mp
ranks. The parameter becomes a DTensor Shard(1), so the optimizer, FSDP2 and checkpoints see it
sharded. The model code that uses it was written for one device: `torch.matmul(hidden, self.weight)`,
often followed by the loss in the same forward. It keeps working because the owning module's (and
the whole model's) forward runs in a *global view* (a TorchFunctionMode):

- an operation that meets the weight (or a tensor computed from it) together with plain tensors treats
  the plain ones as replicated over the mp ranks, which they are (activations outside the split
  layers, or after SequenceParallelEnd gathered the sequence). `hidden @ weight` thus gives
  vocabulary-parallel logits: a DTensor Shard(-1) of global shape [..., vocab], so
  `logits.reshape(-1, vocab_size)` and anything else model code does with them keeps its meaning;
- `F.cross_entropy` / `nn.CrossEntropyLoss` on logits split on the class dim is computed
  vocabulary-parallel (Megatron's algorithm: all-reduce the row max, the sum of exponentials and the
  target's logit; the backward is local), so the full logits are never materialised. It returns a
  plain tensor, so the rest of the loss code and the user's `loss.backward()` / `loss.item()` are
  ordinary. Options it does not cover (class weights, label smoothing, probability targets) gather
  the logits first, with a warning: correct, at the memory cost of the full logits.

Why not torch's `loss_parallel()`: its backward must run inside the same context manager, but the
user's plain loop calls `loss.backward()` outside the model; an autograd Function carries its own
backward. Why not torch's `implicit_replication()`: it wraps plain tensors below autograd, so their
gradients would come back as (partial) DTensors into plain-tensor graphs; here the wrapping is
`DTensor.from_local`, whose backward all-reduces the partial gradient, as ColwiseParallel's input does.

`ColWiseParallel(gather_output=True)` turns the results of operations that combine the weight with an
activation into full plain tensors right away (the full logits; cross entropy is then ordinary).
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _get_current_function_mode_stack
from torch.utils._pytree import tree_map

from tridist.kernels.ops.linear_cross_entropy import check_class_indices

_HEADS_ATTR = "_tridist_global_view_heads"  # [(path relative to the module, parameter name, gather_output)]
_MODE_ATTR = "_tridist_global_view"  # the mode a module's forward pushed, popped by its forward hook
_DERIVED_ATTR = "_tridist_from_head"  # on tensors computed from a head weight: its gather_output


def split_bare_weight(model: torch.nn.Module, name: str, style, *, tp_mesh) -> str:
    """ColWiseParallel on the bare parameter `name` (e.g. "lm_head.weight", or "weight" on the root):
    shard its output dim over `tp_mesh` and run the model's and the owner's forward in the global view."""
    owner_name, _, pname = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    param = getattr(owner, pname)
    kind = type(style).__name__
    if kind != "ColWiseParallel":
        raise NotImplementedError(
            f"parallelize: {kind} on the bare parameter {name!r}: distcore splits bare weights column-wise only "
            "(ColWiseParallel, for a [in, out] weight used as `x @ weight`, such as an LM head); leave it out "
            "of the plan or make it an nn.Linear"
        )
    if getattr(style, "packed_parts", None) not in (None, 1):
        raise NotImplementedError(f"parallelize: packed_parts on the bare parameter {name!r} is not supported")
    if param.dim() != 2:
        raise NotImplementedError(
            f"parallelize: ColWiseParallel on {name!r} of shape {list(param.shape)}: a bare parameter must be a "
            "2-D [in, out] weight (Paddle's layout, used as `x @ weight`)"
        )
    tp = tp_mesh.size()
    if param.shape[1] % tp:
        raise ValueError(
            f"parallelize: ColWiseParallel on {name!r} splits its {param.shape[1]} output columns (the vocabulary "
            f"of an LM head) over {tp} ranks, which does not divide them; use a tensor-parallel degree that "
            f"divides {param.shape[1]} (or pad the vocabulary)"
        )
    sharded = distribute_tensor(param.detach(), tp_mesh, [Shard(1)])
    owner.register_parameter(pname, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
    gather = style.gather_output
    _add_scope(model, owner_name, pname, gather)
    if owner is not model:  # the owner may also be called on its own (a pipeline stage, a test)
        _add_scope(owner, "", pname, gather)
    layout = "full logits (gathered)" if gather else "vocabulary-parallel logits and cross entropy"
    return f"{name}: {style!r} (bare weight split on dim 1; {layout})"


def _add_scope(module: torch.nn.Module, path: str, pname: str, gather: bool) -> None:
    """Record the head on `module` by relative path (so copies of the module keep working) and, once,
    hook the module's forward to run in the global view.

    Hooks rather than a wrapped `forward`: pipeline stages call the model's class forward on a stage view
    from their own `forward`, inside the view's __call__ (so its hooks run) but bypassing any forward
    installed on the instance."""
    heads = module.__dict__.get(_HEADS_ATTR)
    if heads is None:
        heads = module.__dict__[_HEADS_ATTR] = []
        module.register_forward_pre_hook(_enter_global_view)
        module.register_forward_hook(_exit_global_view, always_call=True)  # pops the mode on errors too
    heads.append((path, pname, gather))


def _enter_global_view(module: torch.nn.Module, args) -> None:
    stale = module.__dict__.pop(_MODE_ATTR, None)
    if stale is not None and _get_current_function_mode() is stale:
        # The last forward ended by a BaseException (a pipeline stage's exit), which skips forward hooks.
        stale.__exit__(None, None, None)
    if any(isinstance(mode, _GlobalView) for mode in _get_current_function_mode_stack()):
        return  # an enclosing module's forward already runs in the global view
    heads = [(module.get_submodule(path), pname, gather) for path, pname, gather in module.__dict__[_HEADS_ATTR]]
    mode = _GlobalView(heads)
    mode.__enter__()
    module.__dict__[_MODE_ATTR] = mode


def _exit_global_view(module: torch.nn.Module, args, output):
    mode = module.__dict__.get(_MODE_ATTR)
    if mode is None or _get_current_function_mode() is not mode:  # nested, or another mode left on top
        return None
    del module.__dict__[_MODE_ATTR]
    mode.__exit__(None, None, None)
    return _plain_losses(output)


def _plain_losses(output):
    """A scalar computed from the head (a loss written without F.cross_entropy, say) leaves the model as
    a plain tensor: the user's loop calls `.backward()`/`.item()` on it and data parallel all-reduces it."""

    def plain(x):
        if isinstance(x, DTensor) and x.dim() == 0 and getattr(x, _DERIVED_ATTR, None) is not None:
            return _full_plain(x)
        return x

    if isinstance(output, tuple):
        return tuple(plain(x) for x in output)
    return plain(output)


def _full_plain(x: DTensor) -> torch.Tensor:
    """The full value as a plain tensor (differentiable: the gradient goes back as this rank's shard)."""
    return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim).to_local()


class _GlobalView(TorchFunctionMode):
    """Global-view semantics for tensors computed from split bare weights; see the module docstring."""

    def __init__(self, heads: list[tuple[torch.nn.Module, str, bool]]):
        super().__init__()
        self.heads = heads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            logits = args[0] if args else kwargs.get("input")
            if isinstance(logits, DTensor):
                return _cross_entropy(*args, **kwargs)
        tensors = _tensor_arguments(args, kwargs)
        if not any(isinstance(t, DTensor) for t in tensors):
            return func(*args, **kwargs)
        # FSDP2 swaps unsharded parameters in for the forward: look the weights up now, not at setup.
        weights = {id(getattr(owner, pname)): gather for owner, pname, gather in self.heads}
        sources = {  # head weights and tensors computed from them -> their gather_output
            id(t): (t, weights[id(t)] if id(t) in weights else getattr(t, _DERIVED_ATTR, None))
            for t in tensors if isinstance(t, DTensor)
        }
        sources = {key: (t, gather) for key, (t, gather) in sources.items() if gather is not None}
        if not sources:
            return func(*args, **kwargs)
        mesh = next(iter(sources.values()))[0].device_mesh
        has_plain = any(not isinstance(t, DTensor) for t in tensors)
        if has_plain:  # activations are the same on every mp rank: replicated, gradient all-reduced
            replicated = [Replicate()] * mesh.ndim

            def as_replicated(x):
                if torch.is_tensor(x) and not isinstance(x, DTensor):
                    return DTensor.from_local(x, mesh, replicated, run_check=False)
                return x

            args, kwargs = tree_map(as_replicated, args), tree_map(as_replicated, kwargs)
        out = func(*args, **kwargs)
        gather = any(gather for _, gather in sources.values())
        if gather and has_plain:  # gather_output: the weight met an activation, e.g. the logits
            return tree_map(lambda x: _full_plain(x) if isinstance(x, DTensor) else x, out)
        return tree_map(lambda x: _mark(x, gather), out)


def _tensor_arguments(args, kwargs) -> list[torch.Tensor]:
    """Tensors among the arguments, including inside lists/tuples (torch.cat) one level down."""
    found = []
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if torch.is_tensor(v))
    return found


def _mark(x, gather: bool):
    if isinstance(x, DTensor):
        setattr(x, _DERIVED_ATTR, gather)
    return x


# ------------------------------------------------------------------------------------- cross entropy

_CROSS_ENTROPY = inspect.signature(F.cross_entropy)


def _cross_entropy(*args, **kwargs) -> torch.Tensor:
    """F.cross_entropy on a DTensor input: vocabulary-parallel when the input is split on its class dim
    (and no class weights, label smoothing or probability targets); otherwise on the gathered input."""
    bound = _CROSS_ENTROPY.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    logits, target = a["input"], a["target"]
    target = _full_plain(target) if isinstance(target, DTensor) else target
    class_dim = 0 if logits.dim() == 1 else 1
    mesh = logits.device_mesh
    if (
        a["weight"] is None and a["label_smoothing"] == 0.0 and a["size_average"] is None and a["reduce"] is None
        and not target.is_floating_point() and mesh.ndim == 1 and logits.placements == (Shard(class_dim),)
        and logits.shape[class_dim] % mesh.size() == 0
    ):
        return _vocab_parallel_cross_entropy(logits, target, ignore_index=a["ignore_index"], reduction=a["reduction"])
    warnings.warn(
        f"parallelize: cross entropy on logits split as {logits.placements} with options it cannot compute "
        "vocabulary-parallel (class weights, label smoothing, probability targets, legacy size_average/reduce): "
        "gathering the full logits",
        stacklevel=3,
    )
    weight = a["weight"]
    return F.cross_entropy(
        _full_plain(logits), target, weight=_full_plain(weight) if isinstance(weight, DTensor) else weight,
        size_average=a["size_average"], ignore_index=a["ignore_index"], reduce=a["reduce"],
        reduction=a["reduction"], label_smoothing=a["label_smoothing"],
    )


def _vocab_parallel_cross_entropy(logits: DTensor, target: torch.Tensor, *, ignore_index: int, reduction: str) -> torch.Tensor:
    class_dim = 0 if logits.dim() == 1 else 1
    # A target outside the vocabulary lies in no rank's columns: its logit would count as 0, where one device raises.
    check_class_indices(target, logits.shape[class_dim], ignore_index, op="cross_entropy", name="targets")
    local = logits.to_local()
    rows = local.movedim(class_dim, -1).reshape(-1, local.shape[class_dim])
    vocab_start = logits.device_mesh.get_local_rank() * local.shape[class_dim]
    losses = _VocabParallelCrossEntropy.apply(
        rows, target.reshape(-1), vocab_start, ignore_index, logits.device_mesh.get_group()
    )
    if reduction == "none":
        return losses.reshape(target.shape)
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":  # torch's: over non-ignored targets (0/0 = nan when all are ignored)
        return losses.sum() / (target != ignore_index).sum().to(losses.dtype)
    raise ValueError(f"cross_entropy: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross entropy of logits split on the last dim across `group` (rows are the same tokens on
    every rank). Three all-reduces of one value per row forward; the backward is local:
    d loss / d logits = softmax - one_hot(target), on this rank's columns."""

    @staticmethod
    def forward(ctx, rows, target, vocab_start: int, ignore_index: int, group):
        x = rows.float()  # as torch's log_softmax accumulates in fp32
        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = x - row_max[:, None]
        softmax = shifted.exp()
        sum_exp = softmax.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < x.shape[-1])  # the target column is on this rank
        index = torch.where(owned, local_target, 0)
        target_logit = torch.where(owned, shifted.gather(-1, index[:, None]).squeeze(-1), 0.0)
        dist.all_reduce(target_logit, group=group)
        valid = target != ignore_index
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)
        softmax.div_(sum_exp[:, None])
        ctx.save_for_backward(softmax, index, owned & valid, valid)
        ctx.dtype = rows.dtype
        return loss.to(rows.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, hit, valid = ctx.saved_tensors
        scale = torch.where(valid, grad_loss.float(), 0.0)
        grad = softmax * scale[:, None]
        grad.scatter_add_(-1, index[:, None], -(scale * hit)[:, None])
        return grad.to(ctx.dtype), None, None, None, None
