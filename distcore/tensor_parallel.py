"""Tensor parallelism from Paddle's `mp_config={"parallelize_plan": {...}}`, on torch's parallelize_module.

Plan keys are Paddle's: a regular expression fully matching module names
(`llama.layers.*.mlp.up_proj`), or a parameter name ending in `.weight`/`.bias`, which means its owning
Linear/Embedding. Values are a style or a list of styles. A key that matches nothing is reported with
the nearest module names (a warning; an error with `mp_config["strict"] = True`): the seed's own
example names modules its model lacks.

Model code written for one device keeps working on local shards: Linear outputs stay local (torch's
default), and attention modules whose q/k/v projections are split get their head counts divided
(`num_heads`, `num_key_value_heads`, ...), so `reshape(b, s, self.num_heads, d)` sees the local heads.
Embeddings and the LM head give full (replicated) outputs, so norms and losses are unchanged.

Sequence parallel (SequenceParallelBegin/End/Disable/Enable) splits activations on the sequence dim
between its boundaries (see the section below). The split happens at the Begin module's output, as in
Paddle, so model code must take sequence lengths (masks, default positions) from input_ids, as the
seed and Paddle's Llama do. Hugging Face-style code that derives them from the embedding output sees
the local length there and is not supported with a split after the embedding yet.
"""

from __future__ import annotations

import difflib
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

log = logging.getLogger(__name__)

# Attributes model code uses as head counts in reshapes (seed: num_heads; HF: num_key_value_heads, ...).
_HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_kv_heads")
_QKV_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "wq", "wk", "wv")


class _Style:
    """Base of Paddle's parallel styles (configuration only; applied by parallelize)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


@dataclass(repr=False)
class ColWiseParallel(_Style):
    """Split the output features (a Linear's columns; an Embedding's hidden dim)."""

    gather_output: bool = False


@dataclass(repr=False)
class RowWiseParallel(_Style):
    """Split the input features (a Linear's rows; an Embedding's vocabulary)."""

    is_input_parallel: bool = True


@dataclass(repr=False)
class PrepareLayerInput(_Style):
    """`fn(process_mesh)` returns a forward pre-hook for the layer (Paddle's semantics)."""

    fn: Callable


@dataclass(repr=False)
class PrepareLayerOutput(_Style):
    """`fn(process_mesh)` returns a forward hook for the layer."""

    fn: Callable


@dataclass(repr=False)
class _SequenceParallelStyle(_Style):
    need_transpose: bool = True


class SequenceParallelBegin(_SequenceParallelStyle):
    pass


class SequenceParallelEnd(_SequenceParallelStyle):
    pass


class SequenceParallelEnable(_Style):
    pass


class SequenceParallelDisable(_SequenceParallelStyle):
    pass


STYLES = (ColWiseParallel, RowWiseParallel, PrepareLayerInput, PrepareLayerOutput,
          SequenceParallelBegin, SequenceParallelEnd, SequenceParallelEnable, SequenceParallelDisable)


def apply_tensor_parallel(model: torch.nn.Module, *, plan: dict, tp_mesh, process_mesh, strict: bool = False) -> list[str]:
    """Apply `plan` to `model` over the 1-D `tp_mesh`; returns a line per module changed (for the log).

    Two passes: every key is matched first, then styles are applied knowing each module's
    SequenceParallelDisable ancestor (a row-parallel linear there reduce-scatters straight onto
    sequence shards instead of all-reducing then slicing: half the bytes, as Megatron does).
    """
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize: mp_config['parallelize_plan'] must be a dict of pattern -> style(s), got {type(plan).__name__}")
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    styles_of: dict[str, list] = {}
    for key, value in plan.items():
        styles = list(value) if isinstance(value, (list, tuple)) else [value]
        for style in styles:
            if not isinstance(style, STYLES):
                raise TypeError(
                    f"parallelize: plan key {key!r} has {style!r}; styles are {', '.join(s.__name__ for s in STYLES)}"
                )
        for name in _match(key, modules, params, strict=strict):
            styles_of.setdefault(name, []).extend(styles)
    disabled = [name for name, styles in styles_of.items() if any(isinstance(s, SequenceParallelDisable) for s in styles)]
    tp = tp_mesh.size()
    changes: list[str] = []
    for name in reversed(list(modules)):  # children first: a Disable region then knows its row-parallel exit
        for style in styles_of.get(name, []):
            inside_disabled = any(name.startswith(region + ".") for region in disabled)
            changes.append(_apply(name, modules[name], style, tp_mesh=tp_mesh, tp=tp, process_mesh=process_mesh,
                                  scatter_sequence=inside_disabled))
    changes += _localise_head_counts(model, tp=tp)
    if any(isinstance(style, _SP_STYLES) for styles in styles_of.values() for style in styles):
        changes += _sequence_parallel_norms(model, tp_mesh=tp_mesh)
    return changes


def _match(key: str, modules: dict, params: dict, *, strict: bool) -> list[str]:
    """Module names the key names: a full regex match, or the owner of a `.weight`/`.bias` parameter."""
    try:
        pattern = re.compile(key)
    except re.error as error:
        raise ValueError(f"parallelize: plan key {key!r} is not a valid regular expression: {error}") from None
    if key.rpartition(".")[2] in ("weight", "bias"):  # a parameter: its owner (the root for a bare "weight")
        owners = [name.rpartition(".")[0] for name in params if pattern.fullmatch(name)]
        matched = sorted(set(owners), key=list(modules).index)
    else:
        matched = [name for name in modules if name and pattern.fullmatch(name)]
    if not matched:
        nearest = difflib.get_close_matches(key, [n for n in modules if n], n=3, cutoff=0.4)
        message = f"parallelize: plan key {key!r} matches no module or parameter of the model" + (
            f"; nearest names: {nearest}" if nearest else ""
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=4)
    return matched


def _apply(name: str, module: torch.nn.Module, style, *, tp_mesh, tp: int, process_mesh, scatter_sequence: bool) -> str:
    if isinstance(style, PrepareLayerInput):
        module.register_forward_pre_hook(style.fn(process_mesh))
        return f"{name}: input hook"
    if isinstance(style, PrepareLayerOutput):
        module.register_forward_hook(style.fn(process_mesh))
        return f"{name}: output hook"
    if isinstance(style, (_SequenceParallelStyle, SequenceParallelEnable)):
        return _apply_sequence_parallel(name, module, style, tp_mesh=tp_mesh)
    if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        raise NotImplementedError(
            f"parallelize: {type(style).__name__} on {name or 'the model'!r} ({type(module).__name__}): distcore splits "
            "nn.Linear and nn.Embedding modules; a bare weight parameter used inside forward (the seed's LM head) "
            "is not supported yet"
        )
    _check_divisible(name, module, style, tp)
    if isinstance(module, torch.nn.Embedding):
        # Full (replicated) embeddings out: the hidden dim (column) or the vocabulary (row) is split.
        torch_style = ColwiseParallel(output_layouts=Replicate()) if isinstance(style, ColWiseParallel) else RowwiseParallel(input_layouts=Replicate())
    elif isinstance(style, ColWiseParallel):
        torch_style = ColwiseParallel(output_layouts=Replicate() if style.gather_output else Shard(-1))
    else:
        # Inside a sequence-parallel Disable region the output goes straight to sequence shards.
        output = Shard(_SEQUENCE_DIM) if scatter_sequence else Replicate()
        torch_style = RowwiseParallel(input_layouts=Shard(-1) if style.is_input_parallel else Replicate(), output_layouts=output)
    parallelize_module(module, tp_mesh, torch_style)
    if scatter_sequence and isinstance(style, RowWiseParallel):
        module._tridist_scatters_sequence = True
        return f"{name}: {style!r} (reduce-scatter onto sequence shards)"
    return f"{name}: {style!r}"


def _check_divisible(name: str, module: torch.nn.Module, style, tp: int) -> None:
    if isinstance(module, torch.nn.Linear):
        dim, size = ("out_features", module.out_features) if isinstance(style, ColWiseParallel) else ("in_features", module.in_features)
    else:
        dim, size = ("embedding_dim", module.embedding_dim) if isinstance(style, ColWiseParallel) else ("num_embeddings", module.num_embeddings)
    if size % tp:
        raise ValueError(
            f"parallelize: {type(style).__name__} on {name!r} splits {dim}={size} over {tp} ranks, which does not "
            f"divide it; use a tensor-parallel degree that divides {size}"
        )


def _localise_head_counts(model: torch.nn.Module, *, tp: int) -> list[str]:
    """Divide the head counts of attention modules whose q/k/v projections were split."""
    changes = []
    for name, module in model.named_modules():
        split = [c for c in _QKV_NAMES if isinstance(getattr(module, c, None), torch.nn.Linear)
                 and isinstance(getattr(module, c).weight, DTensor)]
        if not split:
            continue
        for attribute in _HEAD_COUNT_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % tp:
                    raise ValueError(
                        f"parallelize: {name}.{attribute} = {value} heads cannot be split over {tp} tensor-parallel "
                        f"ranks; use a degree that divides the number of heads"
                    )
                setattr(module, attribute, value // tp)
                changes.append(f"{name}.{attribute}: {value} -> {value // tp} (local heads)")
    return changes


# ------------------------------------------------------------------------------------ sequence parallel
#
# Between SequenceParallelBegin and SequenceParallelEnd, activations [batch, seq, hidden] are split on
# the sequence dim across the tensor-parallel ranks: norms and residual adds work on S / tp tokens.
# Regions marked SequenceParallelDisable (attention, MLP: their tensor-parallel linears need the whole
# sequence) gather their input and split their output again. The two moves are differentiable DTensor
# redistributions: gather = all-gather forward / own slice backward (the column-parallel linears
# already all-reduce their input gradients); split = own slice forward / all-gather backward.
# Parameters of modules that see only S / tp tokens (norm weights) get partial gradients: torch's
# SequenceParallel style makes them Replicate DTensors whose gradients are reduced over the ranks.

_SP_STYLES = (_SequenceParallelStyle, SequenceParallelEnable)
_SEQUENCE_DIM = 1  # [batch, seq, hidden], the layout of the seed and Hugging Face models


def _gather_sequence(x: torch.Tensor, tp_mesh) -> torch.Tensor:
    return DTensor.from_local(x, tp_mesh, [Shard(_SEQUENCE_DIM)], run_check=False).redistribute(
        tp_mesh, [Replicate()]
    ).to_local(grad_placements=[Replicate()])


def _split_sequence(x: torch.Tensor, tp_mesh) -> torch.Tensor:
    if x.shape[_SEQUENCE_DIM] % tp_mesh.size():
        raise ValueError(
            f"parallelize: sequence parallel splits the sequence ({x.shape[_SEQUENCE_DIM]} tokens) over "
            f"{tp_mesh.size()} ranks, which does not divide it; use a sequence length divisible by the mp degree"
        )
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(_SEQUENCE_DIM)]).to_local()


def _map_first_activation(args, kwargs, fn):
    """Apply fn to the module's hidden states: the first positional argument, else `hidden_states`."""
    if args and torch.is_tensor(args[0]):
        return (fn(args[0]), *args[1:]), kwargs
    for key in ("hidden_states", "x", "input"):
        if torch.is_tensor(kwargs.get(key)):
            return args, {**kwargs, key: fn(kwargs[key])}
    raise ValueError("parallelize: a sequence-parallel boundary found no hidden-states tensor in the module's inputs")


def _map_output(output, fn):
    if isinstance(output, tuple) and output:
        return (fn(output[0]), *output[1:])
    return fn(output)


def _apply_sequence_parallel(name: str, module: torch.nn.Module, style, *, tp_mesh) -> str:
    def gather_input(_, args, kwargs):
        return _map_first_activation(args, kwargs, lambda x: _gather_sequence(x, tp_mesh))

    def split_output(_, args, output):
        return _map_output(output, lambda x: _split_sequence(x, tp_mesh))

    if isinstance(style, SequenceParallelBegin):
        module.register_forward_hook(split_output)
    elif isinstance(style, SequenceParallelEnd):
        module.register_forward_pre_hook(gather_input, with_kwargs=True)
    elif isinstance(style, SequenceParallelDisable):
        module.register_forward_pre_hook(gather_input, with_kwargs=True)
        if not any(getattr(m, "_tridist_scatters_sequence", False) for m in module.modules()):
            module.register_forward_hook(split_output)  # no row-parallel exit: split the full output
    else:  # SequenceParallelEnable: the module runs on its sequence slice; its parameters are shared
        parallelize_module(module, tp_mesh, SequenceParallel(sequence_dim=_SEQUENCE_DIM, use_local_output=True))
    module._tridist_sequence_parallel = type(style).__name__
    return f"{name}: {type(style).__name__}"


def _sequence_parallel_norms(model: torch.nn.Module, *, tp_mesh) -> list[str]:
    """Norm-like modules (only 1-D parameters, none split) inside the sequence-parallel region that the
    plan did not mark: they run on sequence slices, so their parameters need SequenceParallel too
    (Paddle applies this implicitly; its example marks only the boundaries).

    The region is what is registered after the first Begin module and before the last End module
    (registration order is execution order in Llama-style models), outside Disable/Begin/End
    subtrees. A norm before Begin or after End runs on the whole sequence and is left alone: making
    it sequence parallel would reduce its full-sequence gradients over the ranks (tp times too large).
    """
    names = [name for name, _ in model.named_modules()]
    marks = {name: getattr(module, "_tridist_sequence_parallel", None) for name, module in model.named_modules()}
    begins = [i for i, name in enumerate(names) if marks[name] == "SequenceParallelBegin"]
    ends = [i for i, name in enumerate(names) if marks[name] == "SequenceParallelEnd"]
    if not begins:
        return []
    first, last = min(begins), (max(ends) if ends else len(names))
    boundary_subtrees = [name for name in names if marks[name] in ("SequenceParallelDisable", "SequenceParallelBegin", "SequenceParallelEnd")]
    changes = []
    for index, (name, module) in enumerate(model.named_modules()):
        params = list(module.parameters(recurse=False))
        if (
            not first < index < last
            or marks[name]
            or any(name == b or name.startswith(b + ".") for b in boundary_subtrees)
            or not params
            or any(p.dim() != 1 or isinstance(p, DTensor) for p in params)
        ):
            continue
        parallelize_module(module, tp_mesh, SequenceParallel(sequence_dim=_SEQUENCE_DIM, use_local_output=True))
        module._tridist_sequence_parallel = "SequenceParallelEnable"
        changes.append(f"{name}: SequenceParallelEnable (implicit: runs on sequence slices)")
    return changes
