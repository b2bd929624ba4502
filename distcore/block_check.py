"""Tensor parallel is checked before training: each decoder-block type once, on a tiny input.

Local view (tensor_parallel.apply_local_view) is Megatron's: model code sees this rank's shards, and
head counts are divided so `reshape(b, s, self.num_heads, -1)` sees the local heads. Code that is not
written for it computes silently wrong numbers: `q.reshape(b, s, N_HEADS, -1)` with a module-level
constant splits the local features into the global head count (wrong head size), and
`o.reshape(b, s, HIDDEN)` fails only on a shape, or, with `-1`, trains on scrambled heads.

So, before anything is changed, one instance of each block type (a child of the model's layer list)
is copied twice with the same deterministic random weights, in fp32: one copy stays whole (the
single-device reference), the other gets the block's part of the plan in local view. Both run
forward (and the tensor-parallel one backward) on the same inputs: random values of the shapes the
block receives in the model (captured by one forward of the model on a few token ids: `capture`).
Blocks whose local view differs from the reference run in global view (global_view.py: DTensors
with global shapes, as Paddle's auto-parallel does), if that copy matches; otherwise parallelize
raises `TensorParallelCheckError` naming the block and what differs.

Cost: one forward of the model on batch 1 and 4 x tp tokens (stopped after the last block type
is seen), and two copies of one block per type (fp32, freed after the check).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

log = logging.getLogger(__name__)

_PROBE_TOKENS_PER_RANK = 4  # probe sequence = 4 x tp: divisible by tp (sequence parallel), more than one token per rank
# fp32 rounding of a tensor-parallel block differs from one device only in the order of its sums
# (row-parallel partial sums added by an all-reduce): about sqrt(K) * 2^-24 relative for a sum of K
# terms, under 1e-5 for any K up to 10^5. A wrong head split or a scrambled layout changes the output
# by the size of the block's contribution (order 0.1 to 1 of it): 1e-3 separates the two by a wide margin.
_RELATIVE_TOLERANCE = 1e-3
_SEED = 1234


class TensorParallelCheckError(RuntimeError):
    """A decoder block computes differently under tensor parallel, in local and in global view."""


@dataclass
class BlockSample:
    """What one block type receives in the model: a copy of its first instance made before any
    parallelism (the reference's structure), and its call's inputs (tensors as shape/dtype specs,
    integer and boolean values kept: positions and masks)."""

    block: torch.nn.Module
    args: tuple
    kwargs: dict

    def inputs(self, device: torch.device):
        """Deterministic random floats (the same on every rank), integers and booleans as captured."""
        generator = torch.Generator().manual_seed(_SEED)

        def make(leaf):
            if not isinstance(leaf, _TensorSpec):
                return leaf
            if leaf.value is not None:
                return leaf.value.to(device)
            if leaf.dtype.is_floating_point:
                return torch.randn(leaf.shape, generator=generator).to(device)
            if leaf.dtype == torch.bool:
                return torch.ones(leaf.shape, dtype=torch.bool, device=device)
            return torch.arange(leaf.shape[-1] if leaf.shape else 1, device=device).expand(leaf.shape).to(leaf.dtype)

        return tree_map(make, self.args), tree_map(make, self.kwargs)


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple
    dtype: torch.dtype
    value: torch.Tensor | None  # integers and booleans of a real (not meta) tensor


def _spec(leaf):
    if type(leaf).__name__.endswith("Cache"):
        return None  # a key/value cache (Hugging Face's DynamicCache): the check's two calls must not share one
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, DTensor):
        leaf = leaf.full_tensor()
    keep = not leaf.dtype.is_floating_point and leaf.device.type != "meta"
    return _TensorSpec(tuple(leaf.shape), leaf.dtype, leaf.detach().cpu().clone() if keep else None)


class _Unchecked(Exception):
    """The block's single-device copy does not run on the probe's inputs: nothing to compare with."""


class _Captured(Exception):
    """Every block type has been seen: the probe forward stops there."""


def decoder_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The repeated blocks: children of every ModuleList (a Llama's `layers`), outermost lists only,
    with parameters (a pipeline stand-in of another stage has none)."""
    blocks, seen = [], set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and id(module) not in seen:
            for index, child in enumerate(module):
                seen.update(id(m) for m in child.modules())
                if next(child.parameters(), None) is not None:
                    blocks.append((f"{name}.{index}" if name else str(index), child))
    return blocks


def capture(model: torch.nn.Module, *, tp: int) -> dict[type, BlockSample] | str:
    """One forward of `model` on `4 x tp` token ids (batch 1, under no_grad, in eval mode, the RNG
    untouched) that records what the first block of each type receives; a string says why it could
    not run (the blocks then run in global view). On meta (LazyGuard) models the forward runs on meta."""
    firsts: dict[type, tuple[str, torch.nn.Module]] = {}
    for name, block in decoder_blocks(model):
        firsts.setdefault(type(block), (name, block))
    if not firsts:
        return {}
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if embedding is None:
        return "the model has no nn.Embedding, so no token ids to run it on"
    samples: dict[type, BlockSample] = {}
    copies = {kind: copy.deepcopy(block) for kind, (_, block) in firsts.items()}  # before the hooks go on

    def record(module, args, kwargs):
        if type(module) not in samples:
            samples[type(module)] = BlockSample(copies[type(module)], tree_map(_spec, args), tree_map(_spec, kwargs))
        if len(samples) == len(firsts):
            raise _Captured

    handles = [block.register_forward_pre_hook(record, with_kwargs=True, prepend=True) for _, block in firsts.values()]
    modes = {module: module.training for module in model.modules()}
    device = embedding.weight.device
    ids = (torch.arange(_PROBE_TOKENS_PER_RANK * tp, device=device) % embedding.num_embeddings).unsqueeze(0)
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(ids)
    except _Captured:
        pass
    except Exception as error:  # noqa: BLE001 - any model: the reason is logged and the blocks run in global view
        return f"the model did not run on token ids {tuple(ids.shape)} ({type(error).__name__}: {error})"
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.train(training)
    missing = [name for kind, (name, _) in firsts.items() if kind not in samples]
    if missing:
        return f"the probe forward never reached {missing}"
    return samples


def choose_block_views(model: torch.nn.Module, plan, *, tp_mesh, process_mesh) -> dict[str, str]:
    """Check each block type that the plan changes; returns {block name: why it runs in global view}
    for every instance of the types whose local view differs from one device. Changes nothing; raises
    TensorParallelCheckError for a type wrong in both views."""
    planned = [(name, block) for name, block in decoder_blocks(model) if plan.styles_under(name)]
    if not planned:
        return {}
    samples = capture(model, tp=tp_mesh.size())
    if isinstance(samples, str):
        log.warning("parallelize: tensor parallel blocks cannot be checked: %s; they run in global view", samples)
        return {name: f"not checked: {samples}" for name, _ in planned}
    verdicts: dict[type, str | None] = {}
    for name, block in planned:
        kind = type(block)
        if kind in verdicts:
            continue
        sample = samples.get(kind)
        if sample is None:
            verdicts[kind] = f"not checked: no input of {kind.__name__} was captured"
            continue
        sample_plan = plan.within(name)
        in_span = name in plan.sequence_span
        try:
            reference = _Reference.of(sample, torch.device(tp_mesh.device_type))
        except _Unchecked as reason:
            verdicts[kind] = f"not checked: {reason}"
            log.warning("parallelize: %s (%s) runs in global view, not checked: %s", kind.__name__, name, reason)
            continue
        local = _difference(reference, sample_plan, view="local", tp_mesh=tp_mesh, process_mesh=process_mesh, sequence_split=in_span)
        if local is None:
            verdicts[kind] = None
            continue
        global_ = _difference(reference, sample_plan, view="global", tp_mesh=tp_mesh, process_mesh=process_mesh, sequence_split=in_span)
        if global_ is not None:
            raise TensorParallelCheckError(
                f"parallelize: tensor parallel changes what {kind.__name__} ({name!r}) computes: in local view "
                f"{local}; in global view {global_}. Check the plan for this block (a split whose model code "
                "mixes the pieces, e.g. a packed projection of another layout), or leave it out of mp_config"
            )
        verdicts[kind] = f"its local view {local}"
        log.warning("parallelize: %s (%s) runs in global view: its local view %s", kind.__name__, name, local)
    return {name: verdicts[type(block)] for name, block in planned if verdicts[type(block)] is not None}


@dataclass
class _Reference:
    """A block type's single-device copy (seeded weights) and its output on the check's inputs: made once
    per type, for the local and then (if that differs) the global view; each run gets fresh inputs
    (`sample.inputs` is deterministic), so a block writing into its inputs cannot skew the next."""

    sample: BlockSample
    device: torch.device
    block: torch.nn.Module
    output: torch.Tensor

    @staticmethod
    def of(sample: BlockSample, device: torch.device) -> "_Reference":
        block = _seeded_copy(sample.block, device)
        args, kwargs = sample.inputs(device)
        try:
            with torch.no_grad():
                output = _first_tensor(block(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - any model code: the block then runs in global view unchecked
            raise _Unchecked(f"it did not run on the probe's inputs ({type(error).__name__}: {error})") from error
        return _Reference(sample, device, block, output)


def _difference(reference: _Reference, plan, *, view: str, tp_mesh, process_mesh, sequence_split: bool) -> str | None:
    """None if the block's `view` tensor-parallel copy computes what its whole copy computes, else how not."""
    from .global_view import apply_global_view
    from .tensor_parallel import _gather_sequence, _map_first_activation, apply_local_view

    parallel = copy.deepcopy(reference.block)
    args, kwargs = reference.sample.inputs(reference.device)
    expected = reference.output
    try:
        if view == "local":
            apply_local_view(parallel, plan, tp_mesh=tp_mesh, process_mesh=process_mesh)
        else:
            apply_global_view(parallel, plan, tp_mesh=tp_mesh, process_mesh=process_mesh, sequence_split=sequence_split)
    except (ValueError, TypeError, NotImplementedError):
        # A plan this block cannot take (a degree that does not divide it, ...): applying it to the
        # model itself raises the same error, naming the model's modules.
        return None
    try:
        if sequence_split:
            rank, tp = tp_mesh.get_local_rank(), tp_mesh.size()
            args, kwargs = _map_first_activation(args, kwargs, lambda x: x.chunk(tp, dim=1)[rank].contiguous())
        output = _first_tensor(parallel(*args, **kwargs))
        output.float().square().sum().backward()  # the backward must run too (global view: every op has a rule)
        with torch.no_grad():
            got = _gather_sequence(output.detach(), tp_mesh) if sequence_split else output.detach()
    except Exception as error:  # noqa: BLE001 - reported with the block's name by the caller
        return f"fails: {type(error).__name__}: {str(error).splitlines()[0].rstrip('.') if str(error) else ''}"
    if got.shape != expected.shape:
        return f"gives an output of shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
    scale = expected.abs().max().clamp_min(1e-30)
    error = (got - expected).abs().max() / scale
    if not error <= _RELATIVE_TOLERANCE:  # NaN included
        return f"differs from one device by {error.item():.2e} of the output's size (tolerance {_RELATIVE_TOLERANCE:g})"
    return None


def _seeded_copy(block: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The block in fp32 with deterministic random floating-point parameters and buffers (the same on
    every rank, meta blocks included); integer and boolean buffers keep their values, or are zero on meta."""
    copied = copy.deepcopy(block)
    generator = torch.Generator().manual_seed(_SEED)
    tensors = [*copied.named_parameters(), *copied.named_buffers()]
    meta = any(t.device.type == "meta" for _, t in tensors)
    if meta:
        copied = copied.to_empty(device=device)
    copied = copied.to(device)
    with torch.no_grad():
        for name, tensor in [*copied.named_parameters(), *copied.named_buffers()]:
            if tensor.dtype.is_floating_point:
                fan_in = tensor.shape[-1] if tensor.dim() > 1 else 1
                value = torch.randn(tensor.shape, generator=generator) / fan_in**0.5
                owner, _, leaf = name.rpartition(".")
                module = copied.get_submodule(owner)
                if leaf in module._parameters:
                    module._parameters[leaf] = torch.nn.Parameter(value.to(device), requires_grad=module._parameters[leaf].requires_grad)
                else:
                    module._buffers[leaf] = value.to(device)
            elif meta:
                tensor.zero_()
    return copied.train(False)


def _first_tensor(output) -> torch.Tensor:
    leaves, _ = tree_flatten(output if not hasattr(output, "to_tuple") else output.to_tuple())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.full_tensor() if isinstance(leaf, DTensor) else leaf
    raise TypeError(f"parallelize: a decoder block returned no tensor ({type(output).__name__})")
