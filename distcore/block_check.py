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

Cost: one forward of the model on batch 2 and 4 x tp tokens (stopped after the last block type
is seen), and two copies of one block per type (fp32, freed after the check).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from .fake_tensor_log import expected_failures_unlogged
from .global_view import apply_global_view
from .lora import is_lora_layer
from .sequence_layout import SEQUENCE_DIM, gather_sequence, map_first_activation
from .outputs import find_loss
from .tensor_parallel import (DistributedNorm, FreshLocalOutput, RowWiseParallel, ShardHeadParameters,
                              ShardLocalParameters, apply_local_view, head_input_owners, head_width_owners,
                              install_lazy_split, per_head_parameter_owners)

log = logging.getLogger(__name__)

OUTSIDE_BLOCKS = "the parts outside the decoder blocks"  # BlockViews.refused's key for them
_PROBE_TOKENS_PER_RANK = 4  # probe sequence = 4 x tp: divisible by tp (sequence parallel), more than one token per rank
# Two rows: code that mixes up the batch with another dim merged into it (an input laid out [heads x batch] where
# ShardHeadInput cuts [batch x heads]) computes the same as one device on a single row, and differs on two.
_PROBE_BATCH = 2
# fp32 rounding of a tensor-parallel block differs from one device only in the order of its sums
# (row-parallel partial sums added by an all-reduce): about sqrt(K) * 2^-24 relative for a sum of K
# terms, under 1e-5 for any K up to 10^5. A wrong head split or a scrambled layout changes the output
# by the size of the block's contribution (order 0.1 to 1 of it): 1e-3 separates the two by a wide margin.
_RELATIVE_TOLERANCE = 1e-3
# Gradients are compared the same way, element-wise relative to the tensor's largest element, floored at
# 1e-2 of the block's largest gradient element (a gradient that nearly cancels rounds like its terms).
# The backward of a block is the same kind of sums in another order (partial sums all-reduced, Partial
# weight gradients summed over the ranks): rounding ~ sqrt(K) * 2^-24 of the terms; a missing reduction
# or a gradient of one rank's shard only is off by a fraction of order 1/tp of the gradient.
_GRADIENT_FLOOR = 1e-2
_SEED = 1234
# autograd's refusal of an in-place change of DTensor.to_local's output (a view made inside an autograd Function),
# as torch words it: a block failing with it gets FreshLocalOutput on its row-parallel Linears. Should torch reword
# it, the block runs in global view instead, as before the repair existed.
_LOCAL_OUTPUT_CHANGED_IN_PLACE = "of _ToTorchTensor is a view and is being modified inplace"


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


def block_kind(block: torch.nn.Module) -> tuple:
    """What one check of a block stands for: its type, its children's names and types, and its parameters' names.
    Blocks of one class may differ in them (a mixture of experts' dense first layers and its MoE layers: an MLP or
    an MoE block under one name; MiMo-V2-Flash's sliding-window layers, whose attention holds a sink per head that
    its full-attention layers have not), and the plan or the check's repairs treat them differently."""
    return (type(block), tuple((name, type(child)) for name, child in block.named_children()),
            tuple(name for name, _ in block.named_parameters()))


def capture(model: torch.nn.Module, blocks: list[tuple[str, torch.nn.Module]], *,
            tp: int) -> dict[tuple, BlockSample] | str:
    """One forward of `model` on `4 x tp` token ids (batch _PROBE_BATCH, under no_grad, in eval mode, the RNG
    untouched) that records what the first of `blocks` of each kind (`block_kind`) receives; a string says why it
    could not run (the blocks then run in global view). On meta (LazyGuard) models the forward runs on meta. Only the
    blocks the plan splits: a vision-language model's vision blocks, which token ids never reach, are not among them."""
    firsts: dict[tuple, tuple[str, torch.nn.Module]] = {}
    for name, block in blocks:
        firsts.setdefault(block_kind(block), (name, block))
    if not firsts:
        return {}
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if embedding is None:
        return "the model has no nn.Embedding, so no token ids to run it on"
    samples: dict[tuple, BlockSample] = {}
    copies = {kind: copy.deepcopy(block) for kind, (_, block) in firsts.items()}  # before the hooks go on

    def recorder(kind):
        def record(module, args, kwargs):
            if kind not in samples:
                samples[kind] = BlockSample(copies[kind], tree_map(_spec, args), tree_map(_spec, kwargs))
            if len(samples) == len(firsts):
                raise _Captured
        return record

    handles = [block.register_forward_pre_hook(recorder(kind), with_kwargs=True, prepend=True)
               for kind, (_, block) in firsts.items()]
    modes = {module: module.training for module in model.modules()}
    device = embedding.weight.device
    ids = (torch.arange(_PROBE_TOKENS_PER_RANK * tp, device=device) % embedding.num_embeddings).repeat(_PROBE_BATCH, 1)
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


@dataclass(frozen=True)
class BlockViews:
    """What the check decided for a model's tensor-parallel blocks: `global_view` {block name: why it runs
    in global view}; `repairs` {module name: styles the check adds to the plan for blocks in local view}:
    ShardLocalParameters where parameters kept whole see only this rank's shard of the activations (their
    gradients summed over the mp ranks), DistributedNorm where a norm runs over a dim the plan splits;
    `refused` {block name, or OUTSIDE_BLOCKS: the error applying the plan to it raised}: a plan the model cannot take
    (parallelize raises that error when it applies the plan; to_distributed's search leaves the strategy out)."""

    global_view: dict = dataclasses.field(default_factory=dict)
    repairs: dict = dataclasses.field(default_factory=dict)
    refused: dict = dataclasses.field(default_factory=dict)

    def within(self, names) -> "BlockViews":
        """Only the entries of modules among `names` (a pipeline stage's)."""
        names = set(names)
        return BlockViews({n: r for n, r in self.global_view.items() if n in names},
                          {n: st for n, st in self.repairs.items() if n in names})


@torch.enable_grad()  # the checks differentiate, also where parallelize is called under torch.no_grad()
def choose_block_views(model: torch.nn.Module, plan, *, tp_mesh, process_mesh) -> BlockViews:
    """Check each block type that the plan changes, forward and backward: its output, the gradient of its
    input and the gradient of every parameter as the optimizer will see it must equal one device's. Returns
    the blocks (every instance of a type) that run in global view and the repairs local view needs.
    Changes nothing; raises TensorParallelCheckError for a type wrong in both views."""
    views = BlockViews()
    if refusal := check_outside_blocks(model, plan, tp_mesh=tp_mesh, process_mesh=process_mesh):
        views.refused[OUTSIDE_BLOCKS] = refusal
    planned = [(name, block) for name, block in decoder_blocks(model) if plan.styles_under(name)]
    if not planned:
        return views
    samples = capture(model, planned, tp=tp_mesh.size())
    if isinstance(samples, str):
        for name, block in planned:
            _refuse_without_global_view(plan, name, block, f"cannot be checked: {samples}")
        log.warning("parallelize: tensor parallel blocks cannot be checked: %s; they run in global view", samples)
        return BlockViews({name: f"not checked: {samples}" for name, _ in planned})
    verdicts: dict[tuple, tuple[str | None, dict]] = {}  # kind -> (why global view, or None; repairs relative to the block)
    for name, block in planned:
        kind = block_kind(block)
        kind_name = kind[0].__name__
        if kind in verdicts:
            continue
        sample = samples.get(kind)
        if sample is None:
            _refuse_without_global_view(plan, name, block, "cannot be checked: no input of it was captured")
            verdicts[kind] = (f"not checked: no input of {kind_name} was captured", {})
            continue
        check = _Check(sample_plan=plan.within(name), tp_mesh=tp_mesh, process_mesh=process_mesh,
                       sequence_split=name in plan.sequence_span)
        try:
            reference = _Reference.of(sample, torch.device(tp_mesh.device_type))
        except _Unchecked as reason:
            _refuse_without_global_view(plan, name, block, f"cannot be checked: {reason}")
            verdicts[kind] = (f"not checked: {reason}", {})
            log.warning("parallelize: %s (%s) runs in global view, not checked: %s", kind_name, name, reason)
            continue
        local, repairs = check.local_view(reference)
        if check.refused is not None:
            views.refused[name] = check.refused
        if local is None:
            verdicts[kind] = (None, repairs)
            continue
        _refuse_without_global_view(plan, name, block, f"in local view {local}")
        global_ = check.difference(reference, view="global")
        if global_ is not None:
            raise TensorParallelCheckError(
                f"parallelize: tensor parallel changes what {kind_name} ({name!r}) computes: in local view "
                f"{local}; in global view {global_}. Check the plan for this block (a split whose model code "
                "mixes the pieces, e.g. a packed projection of another layout), or leave it out of mp_config"
            )
        verdicts[kind] = (f"its local view {local}", {})
        log.warning("parallelize: %s (%s) runs in global view: its local view %s", kind_name, name, local)
    for name, block in planned:
        reason, repairs = verdicts[block_kind(block)]
        if reason is not None:
            views.global_view[name] = reason
        views.repairs.update({f"{name}.{module}": styles for module, styles in repairs.items()})
    return views


def _refuse_without_global_view(plan, name: str, block: torch.nn.Module, why: str) -> None:
    """Raise TensorParallelCheckError where block `name`, which `why` keeps out of local view, holds a style that
    runs in local view only (`global_view` False: LocalParameterRows, a Gated DeltaNet mixer's rows;
    ReplicatedColWiseParallel, key/value heads below tp), each style's `local_only` saying why and the fix."""
    local_only = {module: style for module, styles in plan.within(name).styles.items()
                  for style in styles if not getattr(style, "global_view", True)}
    lora = [module for module in plan.within(name).styles if is_lora_layer(_submodule_or_none(block, module))]
    if lora:
        raise TensorParallelCheckError(
            f"parallelize: {type(block).__name__} ({name!r}) {why}; its LoRA layers {sorted(lora)[:3]} run in local view "
            "only (global view's DTensor split does not reach their adapters), so it has no global view to fall back "
            "to; use a strategy without tensor parallel for this model (dp / ZeRO / pp train LoRA layers as they are)")
    if local_only:
        reasons = "; ".join(dict.fromkeys(f"{type(style).__name__}: {style.local_only}" for style in local_only.values()))
        raise TensorParallelCheckError(
            f"parallelize: {type(block).__name__} ({name!r}) {why}; its {sorted(local_only)} run in local view only, "
            f"so it has no global view to fall back to ({reasons})")


def _refusal(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _submodule_or_none(block: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return block.get_submodule(name)
    except AttributeError:
        return None


@torch.enable_grad()
def check_outside_blocks(model: torch.nn.Module, plan, *, tp_mesh, process_mesh) -> str | None:
    """The parts outside the decoder blocks that the plan changes (the embedding, norms on sequence slices,
    the LM head and the loss, a vocabulary-parallel one included), checked as the blocks are: a copy of the
    model without its blocks (its layer lists emptied), seeded fp32 weights, run on `4 x tp` token ids with
    labels, once whole and once with the plan's outside part in local view; the loss (or, without one, the
    first output) and every parameter's gradient as the optimizer sees it must equal one device's. Raises
    TensorParallelCheckError naming what differs; returns the error applying the plan raised, for a plan the model
    cannot take (None otherwise); a model whose copy does not run without its blocks is not checked (logged)."""
    block_names = [name for name, _ in decoder_blocks(model)]
    outside = plan.excluding(block_names)
    if not outside.styles and not outside.bare:
        return None
    shell = _without_blocks(model)
    device = torch.device(tp_mesh.device_type)
    embedding = next((m for m in shell.modules() if isinstance(m, torch.nn.Embedding)), None)
    if embedding is None:
        return None
    ids = (torch.arange(_PROBE_TOKENS_PER_RANK * tp_mesh.size(), device=device) % embedding.num_embeddings).unsqueeze(0)
    labels = ids.roll(-1, dims=1)
    reference = _seeded_copy(shell, device)
    try:
        expected = _loss_and_gradients(reference, ids, labels)
    except Exception as error:  # noqa: BLE001 - any model code: its outside parts are then left to training
        log.warning("parallelize: the parts outside the decoder blocks are not checked: the model did not run "
                    "without its blocks (%s: %s)", type(error).__name__, error)
        return None
    parallel = copy.deepcopy(reference)
    try:
        apply_local_view(parallel, outside, tp_mesh=tp_mesh, process_mesh=process_mesh)
        modules = dict(parallel.named_modules())
        install_lazy_split(parallel, tuple(n for n in outside.lazy_split if n in modules), tp_mesh=tp_mesh)
        got = _loss_and_gradients(parallel, ids, labels)
    except (ValueError, TypeError, NotImplementedError) as error:
        return _refusal(error)  # a plan the model cannot take: applying it to the model raises the same error, by name
    except Exception as error:  # noqa: BLE001 - reported by name
        raise TensorParallelCheckError(
            f"parallelize: tensor parallel of the parts outside the decoder blocks ({sorted(outside.styles)}) fails "
            f"on one forward and backward: {type(error).__name__}: {error}") from error
    errors = {"the loss": _relative_error(got[0], expected[0], expected[0].abs().max()), **_gradient_errors(got[1], expected[1])}
    bad = [what for what, error in zip(errors, _worst_over_ranks(list(errors.values()), tp_mesh)) if not error <= _RELATIVE_TOLERANCE]
    if bad:
        raise TensorParallelCheckError(
            f"parallelize: tensor parallel changes what the model computes outside its decoder blocks, where these "
            f"differ from one device (tolerance {_RELATIVE_TOLERANCE:g}): {', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}; "
            f"check the plan for {sorted([*outside.styles, *outside.bare])}")
    return None


def _without_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` whose lists of decoder blocks are empty (the blocks themselves are not copied)."""
    lists = {name.rpartition(".")[0] for name, _ in decoder_blocks(model)}
    held = {name: model.get_submodule(name) for name in lists}
    try:
        for name in lists:
            _set_submodule(model, name, torch.nn.ModuleList())
        return copy.deepcopy(model)
    finally:
        for name, modules in held.items():
            _set_submodule(model, name, modules)


def _set_submodule(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, module)


def _loss_and_gradients(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    """The model's loss on (ids, labels) (or a seeded projection of its first output) and every parameter's
    gradient of it, as the optimizer sees them."""
    output = model(ids, labels=labels)
    loss = find_loss(output)
    if loss is None:
        first = _first_tensor(output)
        loss = (first.float() * torch.randn(first.shape, generator=torch.Generator().manual_seed(_SEED + 2)).to(first.device)).sum()
    params = _trained(model)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    return loss.detach(), {name: None if g is None else _as_seen_by_the_optimizer(g) for name, g in zip(params, grads)}


def _worst_over_ranks(errors: list[float], tp_mesh) -> list[float]:
    """Each error's largest value over the mp ranks (NaN as inf), so that every rank takes the same verdict."""
    worst = torch.tensor([e if e == e else math.inf for e in errors], dtype=torch.float64)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX, group=tp_mesh.get_group())
    return worst.tolist()


@dataclass
class _Reference:
    """A block type's single-device copy (seeded weights), its output on the check's inputs and the gradients
    of a seeded random cotangent of that output: of its input (the hidden states) and of each parameter.
    Made once per type; each run gets fresh inputs (`sample.inputs` is deterministic), so a block writing
    into its inputs cannot skew the next."""

    sample: BlockSample
    device: torch.device
    block: torch.nn.Module
    output: torch.Tensor
    cotangent: torch.Tensor
    input_grad: torch.Tensor
    grads: dict  # parameter name -> gradient (None: unused)

    @staticmethod
    def of(sample: BlockSample, device: torch.device) -> "_Reference":
        block = _seeded_copy(sample.block, device)
        args, kwargs = sample.inputs(device)
        x = []
        args, kwargs = map_first_activation(args, kwargs, lambda t: _requiring_grad(t, x))
        try:
            output = _first_tensor(block(*args, **kwargs))
            cotangent = torch.randn(output.shape, generator=torch.Generator().manual_seed(_SEED + 1)).to(output)
            params = _trained(block)
            grads = torch.autograd.grad(output, [*x, *params.values()], cotangent, allow_unused=True)
        except Exception as error:  # noqa: BLE001 - any model code: the block then runs in global view unchecked
            raise _Unchecked(f"it did not run on the probe's inputs ({type(error).__name__}: {error})") from error
        return _Reference(sample, device, block, output.detach(), cotangent, grads[0],
                          {name: grad for name, grad in zip(params, grads[1:])})


def _trained(module: torch.nn.Module) -> dict:
    """The parameters whose gradients the check compares: those that require grad (ERNIE 4.5's router correction
    bias does not; autograd.grad refuses it)."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def _requiring_grad(tensor: torch.Tensor, into: list) -> torch.Tensor:
    tensor = tensor.detach().requires_grad_(tensor.is_floating_point())
    into.append(tensor)
    return tensor


@dataclass
class _Check:
    """Runs a block's tensor-parallel copy (local or global view) against its _Reference."""

    sample_plan: object
    tp_mesh: object
    process_mesh: object
    sequence_split: bool
    # Set by local_view: what applying the plan with the repairs it returns raised (a plan the block cannot take)
    refused: str | None = None

    def local_view(self, reference: _Reference) -> tuple[str | None, dict]:
        """(None, repairs) if local view, with the repairs it needs, computes what one device computes;
        else (how it differs, {}). Repairs are found by rule, from what one run shows, then checked by the
        next run: a module whose 1-D parameters are tp times as wide as its local input normalises over a
        split dim (DistributedNorm); a parameter kept whole whose gradients summed over the mp ranks equal
        one device's while a rank's own does not saw only its shard (ShardLocalParameters); a failed run whose
        attention module holds a parameter with one row per query head (gpt-oss's sinks) splits it with the
        heads (ShardHeadParameters); a run failing where the block changes a row-parallel Linear's local output in
        place (Falcon's `mlp_output += attention_output`) hands on copies of those outputs (FreshLocalOutput); a run
        still wrong or failing whose attention takes a keyword input with one row per head (ALiBi biases built
        outside it: Bloom, MPT, Falcon) cuts that input to this rank's heads (ShardHeadInput); one still wrong or
        failing after that, whose attention reads its query width from an attribute or its head counts from its
        config (XGLM's `embed_dim`, Phi-3's `config.num_attention_heads`), gets them local (LocalHeadWidths)."""
        # Tried in this order, each only once the repairs before it leave the run wrong or failing.
        last_resorts = [head_input_owners(reference.block, {
            keyword: spec.shape for keyword, spec in reference.sample.kwargs.items()
            if isinstance(spec, _TensorSpec) and spec.dtype.is_floating_point}, batch=_PROBE_BATCH),
            head_width_owners(reference.block)]
        repairs: dict = {}  # module name -> the styles added to it

        def new(candidates: dict) -> dict:
            """The candidates {module name: style} not on that module yet."""
            return {name: [style] for name, style in candidates.items()
                    if not any(type(added) is type(style) for added in repairs.get(name, ()))}

        guessed, problem = {}, None  # the last resorts added by the run before, and what was wrong without them
        while True:
            run = self._run(reference, view="local", repairs=repairs)
            if guessed and run.output is None and run.failure is None:
                # A last resort the block cannot take (its apply raised): taken back, the problem stands.
                for name, styles in guessed.items():
                    kept = [style for style in repairs[name] if not any(style is guess for guess in styles)]
                    if kept:
                        repairs[name] = kept
                    else:
                        del repairs[name]
                found = {}
            else:  # (a run whose guessed repairs were taken back, above, says nothing of the plan kept)
                self.refused = run.refused
                found, problem = {}, None
                if run.failure is not None:
                    found = new({name: DistributedNorm() for name in run.split_dim_norms})
                    found.update(new({name: ShardHeadParameters() for name in run.head_parameter_owners}))
                    if _LOCAL_OUTPUT_CHANGED_IN_PLACE in run.failure:
                        found.update(new({name: FreshLocalOutput() for name, styles in self.sample_plan.styles.items()
                                          if any(isinstance(st, RowWiseParallel) for st in styles)}))
                elif run.partial_grads:
                    found = new({name.rpartition(".")[0]: ShardLocalParameters() for name in run.partial_grads})
            guessed = {}
            if not found:
                problem = problem or run.failure or self._compare(reference, run)
                while problem is not None and not found and last_resorts:
                    found = guessed = new(last_resorts.pop(0))
                if not found:
                    return (None, repairs) if problem is None else (problem, {})
            for name, styles in found.items():
                repairs.setdefault(name, []).extend(styles)

    def difference(self, reference: _Reference, *, view: str) -> str | None:
        """None if the block's `view` tensor-parallel copy computes what its whole copy computes, else how not."""
        run = self._run(reference, view=view, repairs={})
        return run.failure or self._compare(reference, run)

    def _run(self, reference: _Reference, *, view: str, repairs: dict) -> "_Run":
        plan = self.sample_plan.with_styles(repairs)
        parallel = copy.deepcopy(reference.block)
        args, kwargs = reference.sample.inputs(reference.device)
        run = _Run()
        try:
            if view == "local":
                apply_local_view(parallel, plan, tp_mesh=self.tp_mesh, process_mesh=self.process_mesh)
            else:
                apply_global_view(parallel, plan, tp_mesh=self.tp_mesh, process_mesh=self.process_mesh,
                                  sequence_split=self.sequence_split)
        except (ValueError, TypeError, NotImplementedError) as error:
            # A plan this block cannot take (a degree that does not divide it, ...): applying it to the
            # model itself raises the same error, naming the model's modules.
            run.refused = _refusal(error)
            return run
        widths = _record_input_widths(parallel) if view == "local" else {}
        rank, tp = self.tp_mesh.get_local_rank(), self.tp_mesh.size()
        cotangent, x = reference.cotangent, []
        try:
            if self.sequence_split:
                args, kwargs = map_first_activation(args, kwargs, lambda t: t.chunk(tp, dim=SEQUENCE_DIM)[rank].contiguous())
                cotangent = cotangent.chunk(tp, dim=SEQUENCE_DIM)[rank]
            args, kwargs = map_first_activation(args, kwargs, lambda t: _requiring_grad(t, x))
            with expected_failures_unlogged():  # a failure is an answer here, reported by the caller
                output = _first_tensor(parallel(*args, **kwargs))
                params = _trained(parallel)
                grads = torch.autograd.grad(output, [*x, *params.values()], cotangent.to(output), allow_unused=True)
            with torch.no_grad():
                run.output, run.input_grad = output.detach(), grads[0]
                if self.sequence_split:
                    run.output = gather_sequence(run.output, self.tp_mesh)
                    run.input_grad = gather_sequence(run.input_grad, self.tp_mesh)
                run.grads = {name: _as_seen_by_the_optimizer(g) for name, g in zip(params, grads[1:])}
                run.partial_grads = self._partial_grads(reference, run, params)
        except Exception as error:  # noqa: BLE001 - reported with the block's name by the caller
            run.failure = f"fails: {type(error).__name__}: {str(error).splitlines()[0].rstrip('.') if str(error) else ''}"
            run.split_dim_norms = [name for name, (width, size) in widths.items() if size == tp * width]
            if view == "local":
                run.head_parameter_owners = per_head_parameter_owners(parallel, reference.block)
        return run

    def _partial_grads(self, reference: _Reference, run: "_Run", params: dict) -> list[str]:
        """Plain (whole) parameters whose gradient differs from one device's on some rank while the sum of
        the ranks' gradients equals it: computed from this rank's shard of the activations only."""
        found, scale = [], _grad_scale(reference.grads)
        for name, param in params.items():
            grad, expected = run.grads.get(name), reference.grads.get(name)
            if isinstance(param, DTensor) or grad is None or expected is None:
                continue
            summed = grad.clone()
            torch.distributed.all_reduce(summed, group=self.tp_mesh.get_group())
            own_ok = _agree(_relative_error(grad, expected, scale) <= _RELATIVE_TOLERANCE, self.tp_mesh)
            if not own_ok and _relative_error(summed, expected, scale) <= _RELATIVE_TOLERANCE:
                found.append(name)
        return found

    def _compare(self, reference: _Reference, run: "_Run") -> str | None:
        """How `run` differs from one device (the worst difference on any mp rank), or None."""
        if run.output is None:
            return None  # the plan does not apply to this block (see _run)
        if run.output.shape != reference.output.shape:
            return f"gives an output of shape {tuple(run.output.shape)} instead of {tuple(reference.output.shape)}"
        errors = {"the output": _relative_error(run.output, reference.output, reference.output.abs().max()),
                  "the input's gradient": _relative_error(run.input_grad, reference.input_grad, reference.input_grad.abs().max())}
        errors.update(_gradient_errors(run.grads, reference.grads))
        worst = _worst_over_ranks(list(errors.values()), self.tp_mesh)
        bad = [(what, error) for what, error in zip(errors, worst) if not error <= _RELATIVE_TOLERANCE]
        if not bad:
            return None
        what, error = bad[0]
        more = f" (and {len(bad) - 1} more: {', '.join(w for w, _ in bad[1:4])}{', ...' if len(bad) > 4 else ''})" if len(bad) > 1 else ""
        return f"differs from one device in {what} by {error:.2e} of its size (tolerance {_RELATIVE_TOLERANCE:g}){more}"


@dataclass
class _Run:
    failure: str | None = None
    refused: str | None = None  # the error applying the plan raised (no output, no failure)
    output: torch.Tensor | None = None
    input_grad: torch.Tensor | None = None
    grads: dict = dataclasses.field(default_factory=dict)
    partial_grads: list = dataclasses.field(default_factory=list)
    split_dim_norms: list = dataclasses.field(default_factory=list)
    head_parameter_owners: list = dataclasses.field(default_factory=list)  # failed run: ShardHeadParameters candidates


def _record_input_widths(block: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """{module name: (its input's last dim, its parameters' size)}, filled as the block runs, for modules
    holding only 1-D parameters of one size that the plan left whole (norm-like modules): what tells a norm
    over a dim the plan splits (its input tp times narrower than its weight) before its forward fails."""
    widths: dict[str, tuple[int, int]] = {}
    for name, module in block.named_modules():
        params = list(module.parameters(recurse=False))
        sizes = {p.numel() for p in params}
        if not params or len(sizes) != 1 or any(p.dim() != 1 or isinstance(p, DTensor) for p in params):
            continue

        def record(module, args, kwargs, name=name, size=sizes.pop()):
            try:
                map_first_activation(args, kwargs, lambda x: widths.setdefault(name, (x.shape[-1], size)))
            except ValueError:
                pass  # no hidden states to measure
        module.register_forward_pre_hook(record, with_kwargs=True)
    return widths


def _as_seen_by_the_optimizer(grad):
    """A gradient as the optimizer steps with it: a DTensor's whole value after its pending reductions
    (Partial summed over the mp ranks, shards gathered); a plain tensor as this rank holds it."""
    if isinstance(grad, DTensor):
        return grad.full_tensor()
    return grad


def _grad_scale(grads: dict) -> float:
    """The floor of a parameter gradient's scale: FLOOR of the largest gradient element of the module. A
    gradient that nearly cancels has rounding set by the size of its terms, not of its sum; the module's
    typical large gradient stands for that size (as in tests/distributed/equivalence.py)."""
    largest = [g.abs().max() for g in grads.values() if g is not None and g.numel()]
    return _GRADIENT_FLOOR * float(max(largest)) if largest else 0.0


def _gradient_errors(got: dict, expected: dict) -> dict:
    """{"the gradient of <name>": relative error} for every parameter of `expected` (inf where only one side
    has a gradient), scaled as _grad_scale says."""
    scale, errors = _grad_scale(expected), {}
    for name, grad in expected.items():
        other = got.get(name)
        if (other is None) != (grad is None):
            errors[f"the gradient of {name}"] = math.inf
        elif grad is not None:
            errors[f"the gradient of {name}"] = _relative_error(other, grad, scale)
    return errors


def _relative_error(got: torch.Tensor, expected: torch.Tensor, scale) -> float:
    """max |got - expected| relative to max(|expected|'s largest element, scale); NaN anywhere gives NaN."""
    if got.shape != expected.shape:
        return math.inf
    size = max(float(expected.abs().max()) if expected.numel() else 0.0, float(scale), 1e-30)
    return float((got.float() - expected.float()).abs().max()) / size if got.numel() else 0.0


def _agree(ok: bool, tp_mesh) -> bool:
    """True on every mp rank if `ok` holds on every one (all ranks then take the same branch)."""
    flag = torch.tensor([0.0 if ok else 1.0])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=tp_mesh.get_group())
    return flag.item() == 0.0


def _seeded_copy(block: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The block in fp32 with deterministic random floating-point parameters and buffers (the same on
    every rank, meta blocks included); integer and boolean buffers keep their values, or are zero on meta."""
    copied = copy.deepcopy(block)
    generator = torch.Generator().manual_seed(_SEED)
    tensors = [*copied.named_parameters(), *copied.named_buffers()]
    meta = any(t.device.type == "meta" for _, t in tensors)
    if meta:
        copied = copied.to_empty(device=device)
    copied = copied.to(device=device, dtype=torch.float32)  # in place: a tied parameter stays one parameter
    with torch.no_grad():
        for name, tensor in [*copied.named_parameters(), *copied.named_buffers()]:
            if tensor.dtype.is_floating_point:
                fan_in = tensor.shape[-1] if tensor.dim() > 1 else 1
                tensor.copy_(torch.randn(tensor.shape, generator=generator) / fan_in**0.5)
            elif meta:
                tensor.zero_()
    return copied.train(False)


def _first_tensor(output) -> torch.Tensor:
    leaves, _ = tree_flatten(output if not hasattr(output, "to_tuple") else output.to_tuple())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.full_tensor() if isinstance(leaf, DTensor) else leaf
    raise TypeError(f"parallelize: a decoder block returned no tensor ({type(output).__name__})")
