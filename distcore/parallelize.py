"""parallelize(model, optimizer, mesh, config): Paddle's one-call parallelisation, on torch's engine.

Data parallel (`dp_config={"sharding_level": 0..3}`) over the mesh dimension named "dp" (a mesh with a
"dp" dimension of more than one rank gets level 0 without a dp_config, as Paddle keeps its replicas in step):
- 0: replicated parameters, gradients all-reduced (FSDP2's `replicate`, which, unlike DDP, also
  accepts tensor-parallel DTensor parameters);
- 1 and 2: FSDP2 `fully_shard(reshard_after_forward=False)`: optimizer states and gradients sharded
  (ZeRO-2). Stage 1 gets stage 2's memory saving for free: reduce-scatter + all-gather move the same
  bytes as the all-reduce that ZeRO-1 would need;
- 3: `fully_shard(reshard_after_forward=True)`: parameters sharded too (ZeRO-3).
Sharding is applied per decoder block (each child of the model's layer lists), then to the root, so
that communication of one block overlaps computation of the next (torchtitan's recipe).

The user's loop stays the plain one: inputs from shard_dataloader (global-view DTensors) are
unwrapped to this rank's shard, and a returned loss carries the global mean value on every rank
(its gradient stays the local one, which data parallelism averages).

Tensor parallel (`mp_config`, see tensor_parallel.py) over the mesh dimension named "mp" is applied
first, then data parallel over "dp" on the resulting DTensor parameters (2-D: FSDP2 composes with
tensor parallel). Pipeline parallel (`pp_config`, see pipeline.py) over "pp" splits the model into
stages first; each stage is then parallelised over "mp" and "dp" the same way, and `model(...)` runs
the pipeline schedule, so any dp x mp x pp mesh trains with the plain loop.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from dataclasses import dataclass

import torch
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils._pytree import tree_map

from . import env
from .api import local_value
from .block_check import BlockViews, choose_block_views, decoder_blocks
from .buffers import cast_buffers_as_loaded
from .evaluation import guard_evaluations, ranks_of_the_forward
from .expert_parallel import EP_KEYS, ExpertParallelExperts, apply_expert_parallel, expert_mesh
from .export import export_after_parallelize
from .global_view import apply_global_view, refuse_overlap, refuse_recompute
from .lazy import materialize
from .lora import guard_after_parallelize
from .mesh import ProcessMesh, get_mesh
from .outputs import find_loss, replace_loss
from .random_state import keep_tensor_parallel_random_state_alike
from .token_mean import install_global_token_mean
from .sample_rows import media_encoders
from .unused_parameters import UnusedParameters
from .optimizer import mark_replaced, with_paddle_methods
from .parallel_dims import KINDS, ParallelDims
from .overlap import mark_checked
from .packed import fsdp_shard_placement
from .tensor_parallel import (TensorParallelPlan, apply_local_view, check_overlap_backend, guard_outside_span, install_lazy_split,
                              resolve_plan)

log = logging.getLogger(__name__)

_CONFIG_KEYS = ("dp_config", "mp_config", "pp_config", "ep_config")
_DP_KEYS = ("sharding_level", "param_dtype", "reduce_dtype")
_MP_KEYS = ("parallelize_plan", "strict", "overlap_comm")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def router_aux_loss_on(model: torch.nn.Module) -> bool:
    """Whether the model's config asks for its router's load-balancing loss (transformers' output_router_logits,
    on the config or a composite model's text config)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    return any(getattr(c, "output_router_logits", False) for c in (config, text) if c is not None)


def parallelize(model: torch.nn.Module, optimizer=None, mesh: ProcessMesh | None = None, config: dict | None = None):
    """Parallelise `model` (in place) and rebuild `optimizer` over its new parameters.

    Returns `(model, optimizer)`; with no mesh, or a config naming none of dp_config / mp_config /
    pp_config, both come back unchanged (Paddle's behaviour).
    """
    refuse_compiled(model, "parallelize")
    config = dict(config or {})
    unknown = sorted(set(config) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"parallelize: unknown config key(s) {unknown}; valid keys are {list(_CONFIG_KEYS)}")
    mesh = mesh if mesh is not None else get_mesh()
    if mesh is None or not any(key in config for key in _CONFIG_KEYS):
        return model, optimizer
    ep_config = _sub_config(config, "ep_config", EP_KEYS)
    if ep_config is not None:
        config.setdefault("dp_config", {})  # expert parallel folds into data parallel
    if "dp_config" not in config and "dp" in mesh.dim_names and mesh.get_dim_size("dp") > 1:
        # Paddle keeps parameters replicated over a "dp" dimension and reduces their gradients without a
        # dp_config; left out, each replica would train on its own rows only.
        log.info("parallelize: the mesh's 'dp' dimension (%d ranks) without dp_config: data parallel at sharding_level 0",
                 mesh.get_dim_size("dp"))
        config["dp_config"] = {}
    dims = ParallelDims.from_mesh(mesh, [kind for kind in KINDS if f"{kind}_config" in config])
    _check_optimizer_fresh(optimizer)
    _check_same_values_on_every_rank(model, mesh)
    names_before: dict[int, list[str]] = {}  # every name: a tied parameter's may live on another stage
    params_before: dict[int, torch.nn.Parameter] = {}
    trainable_before: dict[str, bool] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_before.setdefault(id(param), []).append(name)
        params_before[id(param)] = param
        trainable_before[name] = param.requires_grad
    mp_config, dp_config = _sub_config(config, "mp_config", _MP_KEYS), _sub_config(config, "dp_config", _DP_KEYS)
    compute_dtype = _mixed_precision(dp_config).param_dtype if dp_config is not None else None
    cast_buffers = compute_dtype not in (None, torch.float32)  # FSDP2 casts parameters alone (buffers.py)
    if cast_buffers:  # before any stage's probe runs with them
        cast_buffers_as_loaded(model, compute_dtype)
    lazy_buffers = cast_buffers and any(b.is_meta and b.is_floating_point() for b in model.buffers())  # cast once real
    experts = _expert_parallel_plan(model, mesh, ep_config) if ep_config is not None else None
    if "pp_config" in config:
        if router_aux_loss_on(model):
            raise NotImplementedError(
                "parallelize: the model adds its router's load-balancing loss, computed from every layer's router "
                "logits, which pipeline stages do not hold together (the last stage would see its own layers' only); "
                "set model.config.output_router_logits = False, or train without pp_config")
        views = None
        if mp_config is not None:
            # Keys are matched (warnings, or errors with strict) and blocks checked on the whole model,
            # once, before the stages are cut: a block that fails leaves the model unchanged.
            plan = resolve_plan(model, mp_config.get("parallelize_plan", {}), strict=mp_config.get("strict", False),
                                overlap_comm=mp_config.get("overlap_comm", False))
            check_overlap_backend(plan, dims.device_mesh("mp"))
            views = choose_block_views(model, plan, tp_mesh=dims.device_mesh("mp"), process_mesh=mesh)
            refuse_recompute(model, views.global_view)
            if plan.overlap_comm:
                refuse_overlap(views.global_view)
        # Imported here: torch.distributed.pipelining imports torch._dynamo (~0.9 s), which a job without
        # pipeline stages never needs.
        from . import pipeline

        runner = pipeline.apply_pipeline_parallel(
            model, pp_mesh=dims.device_mesh("pp"), pp_rank_groups=dims.rank_groups("pp"),
            pp_config=dict(config["pp_config"] or {}), device=env.device(),
            dp_group=dims.group("dp"),
            parallelize_stage=lambda stage: _apply_tensor_and_data_parallel(
                stage, dims=dims, mp_config=mp_config, dp_config=dp_config, warn_unmatched=False, views=views,
                experts=experts,
            ),
            compute_dtype=compute_dtype,
        )
        micro_batches = runner.config.micro_batches
    else:
        _apply_tensor_and_data_parallel(model, dims=dims, mp_config=mp_config, dp_config=dp_config, experts=experts)
        if dp_config is not None:
            _report_global_mean_loss(model, group=dims.group("dp"))
        micro_batches = 1
    dp_group = dims.group("dp")
    if dp_group is not None or micro_batches > 1:
        install_global_token_mean(model, dp_group=dp_group, micro_batches=micro_batches)
    _unwrap_dtensor_inputs(model)
    guard_after_parallelize(model)  # peft's LoRA: adapters added later, generate past the root's hooks
    replicated_dp = dp_config is None or dp_config.get("sharding_level", 0) == 0
    forward_ranks = ranks_of_the_forward(model, mesh, pipeline="pp_config" in config, expert_parallel=experts is not None,
                                         replicated_dp=replicated_dp)
    if forward_ranks is not None:
        guard_evaluations(model, forward_ranks)  # `if rank == 0: evaluate(model)` raises instead of hanging
    # transformers' / peft's save_pretrained writes the one-device state dict
    export_after_parallelize(model, num_parameters=sum(p.numel() for p in params_before.values()))
    if mp_config is not None and dims.degree("mp") > 1:  # the replicas' dropout masks (random_state.py)
        keep_tensor_parallel_random_state_alike(model, tp_group=dims.group("mp"), device=env.device())
    # A LazyGuard model is still on meta: each rank now materialises only its own shards (of its own
    # stage), one parameter at a time; the optimizer below then holds the real parameters.
    materialize(model, device=env.device(), strict=False)
    if lazy_buffers:  # LazyGuard's, materialised just now
        cast_buffers_as_loaded(model, compute_dtype)
    _check_trainable_kept(model, trainable_before)
    mark_replaced(params_before, names_before, model)
    if optimizer is None:
        return model, None
    # Pipeline parallel leaves other stages' parameters out of this rank's model.
    # (Data parallel's unused-parameter trackers reach any optimizer's step through its parameters:
    # unused_parameters.py.)
    optimizer = _rebuild_optimizer(optimizer, model, names_before, drop_missing="pp_config" in config)
    return model, optimizer


def _check_trainable_kept(model: torch.nn.Module, before: dict[str, bool]) -> None:
    """Every parameter still requires grad as it did before (a frozen one that became trainable would get a
    gradient and move under an optimizer given all parameters: torch's SequenceParallel style did so)."""
    changed = [name for name, param in model.named_parameters(remove_duplicate=False)
               if name in before and param.requires_grad != before[name]]
    if changed:
        raise RuntimeError(f"parallelize: requires_grad of {changed[:4]}{' ...' if len(changed) > 4 else ''} changed "
                           "while parallelising; this is a bug in tridist, please report it with the model and config")


def _sub_config(config: dict, key: str, valid: tuple) -> dict | None:
    if key not in config:
        return None
    sub = dict(config[key] or {})
    bad = sorted(set(sub) - set(valid))
    if bad:
        raise ValueError(f"parallelize: unknown {key} key(s) {bad}; valid keys are {list(valid)}")
    return sub


def _apply_tensor_and_data_parallel(model: torch.nn.Module, *, dims: ParallelDims, mp_config: dict | None,
                                    dp_config: dict | None, warn_unmatched: bool = True, views: BlockViews | None = None,
                                    experts: "_ExpertPlan | None" = None) -> None:
    """Tensor parallel over "mp" first (its block check runs the blocks whole), then expert parallel within
    "dp" (the MoE blocks, which tensor parallel leaves whole), then data parallel over "dp" on the resulting
    DTensor parameters."""
    if mp_config is not None:
        with warnings.catch_warnings():
            if not warn_unmatched:  # pipeline stages: keys were checked against the whole model already
                warnings.simplefilter("ignore")
            changes = apply_tensor_parallel(
                model, plan=mp_config.get("parallelize_plan", {}), tp_mesh=dims.device_mesh("mp"),
                process_mesh=dims.mesh, strict=mp_config.get("strict", False) and warn_unmatched, views=views,
                overlap_comm=mp_config.get("overlap_comm", False),
            )
        log.info("parallelize: tensor parallel:\n  %s", "\n  ".join(changes))
    if experts is not None:
        apply_expert_parallel(model, experts.names, experts.mesh["ep"], fused_activation=experts.fused_activation)
    if dp_config is not None:
        apply_data_parallel(
            model, dp_mesh=dims.device_mesh("dp"), sharding_level=dp_config.get("sharding_level", 0),
            mp_policy=_mixed_precision(dp_config), expert_mesh=experts.mesh if experts is not None else None,
        )


@dataclass(frozen=True)
class _ExpertPlan:
    """What expert parallel splits: the experts modules by name, over the [..., dp / ep, ep] mesh."""

    names: tuple[str, ...]
    mesh: object  # DeviceMesh with "edp" and "ep" dimensions
    fused_activation: bool


def _expert_parallel_plan(model: torch.nn.Module, mesh: ProcessMesh, ep_config: dict) -> _ExpertPlan:
    """ep_config's experts (default: every MoE layer's, recognised by structure on the whole model, before
    pipeline stages are cut) and the expert mesh (expert_parallel.py), built once on every rank."""
    degree = ep_config.get("degree")
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise ValueError(f"parallelize: ep_config['degree'] must be a positive integer, got {degree!r}")
    names = ep_config.get("experts")
    if names is None:
        from tridist import autotune

        structure = autotune.recognise(model)
        if not structure.is_moe:
            raise ValueError("parallelize: ep_config on a model without a mixture of experts (none recognised); "
                             "name the experts modules with ep_config['experts']")
        names = structure.experts_modules()
    plan = _ExpertPlan(tuple(names), expert_mesh(mesh, degree, env.device().type),
                       ep_config.get("fused_activation", True))
    log.info("parallelize: expert parallel over %d ranks: %d experts modules", degree, len(plan.names))
    return plan


def apply_tensor_parallel(model: torch.nn.Module, *, plan: "dict | TensorParallelPlan", tp_mesh, process_mesh, strict: bool = False,
                          views: BlockViews | None = None, overlap_comm=False) -> list[str]:
    """Apply `plan` to `model` over the 1-D `tp_mesh`; returns a line per module changed (for the log).

    Each decoder-block type is checked first (block_check.py): its tensor-parallel copy must equal its
    single-device copy on a tiny input, forward and backward, in local view with the repairs the check
    found (added to the plan), else in global view (global_view.py). `views`: decided already
    (parallelize checks the whole model before pipeline stages are cut); None checks `model` here.
    """
    resolved = resolve_plan(model, plan, strict=strict, overlap_comm=overlap_comm)
    check_overlap_backend(resolved, tp_mesh)  # before any module changes
    if views is None:
        views = choose_block_views(model, resolved, tp_mesh=tp_mesh, process_mesh=process_mesh)
    modules = dict(model.named_modules())
    views = views.within(name for name in modules if resolved.styles_under(name) or name in views.repairs)
    global_view = views.global_view
    if global_view:
        refuse_recompute(model, global_view)
        if resolved.overlap_comm:
            refuse_overlap(global_view)
    resolved = resolved.with_styles(views.repairs)
    changes = apply_local_view(model, resolved.excluding(global_view), tp_mesh=tp_mesh, process_mesh=process_mesh)
    if resolved.overlap_comm:
        mark_checked(model, [name for name, _ in decoder_blocks(model) if resolved.styles_under(name)])
    for name, reason in global_view.items():
        changes.append(f"{name}: global view ({reason})")
        model.get_submodule(name)._tridist_global_view = reason  # for the log and tests
        changes += apply_global_view(model.get_submodule(name), resolved.within(name), tp_mesh=tp_mesh,
                                     process_mesh=process_mesh, sequence_split=name in resolved.sequence_span)
    install_lazy_split(model, resolved.lazy_split, tp_mesh=tp_mesh)
    guard_outside_span(model, resolved)
    return changes


# --------------------------------------------------------------------------------------- data parallel


def apply_data_parallel(model: torch.nn.Module, *, dp_mesh, sharding_level: int, mp_policy: MixedPrecisionPolicy,
                        expert_mesh=None) -> None:
    """Replicate (level 0) or shard (levels 1-3) `model` over `dp_mesh`, block by block, then the root.

    Why per block: each block's all-gather / reduce-scatter then overlaps the neighbouring blocks'
    compute, and at level 3 only one block's parameters are unsharded at a time. Expert-parallel experts
    (`expert_mesh`: the [dp / ep, ep] mesh) go first, over its "edp" dimension (expert_parallel.py says how
    their gradients come out the dp average). Ranks may use different parameters in a step (experts their tokens
    did not choose): an UnusedParameters over the units keeps them one device's (unused_parameters.py). No one holds
    it: its hooks on the units keep it alive, and any optimizer's step finds it through the parameters.
    """
    if sharding_level not in (0, 1, 2, 3):
        raise ValueError(f"parallelize: dp_config['sharding_level'] must be 0, 1, 2 or 3, got {sharding_level!r}")
    # Expert-parallel experts: their grouped GEMMs run every local expert, which gets a gradient on every rank
    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)] if expert_mesh is not None else []
    for unit in experts:
        if sharding_level == 0:
            replicate(unit, mesh=expert_mesh["edp"], mp_policy=mp_policy)
        else:
            fully_shard(unit, mesh=expert_mesh["edp"], reshard_after_forward=sharding_level == 3, mp_policy=mp_policy)
    units = _data_parallel_units(model)
    if sharding_level == 0:
        for unit in [*units.shared, *units.blocks]:
            replicate(unit, mesh=dp_mesh, mp_policy=mp_policy)
        replicate(model, mesh=dp_mesh, mp_policy=mp_policy)
        UnusedParameters([*units.shared, *units.blocks, model], dp_mesh.get_group(), apart=experts)
        return
    reshard = sharding_level == 3
    # Called by several blocks: gathered for their calls, their gradients accumulated over them
    for unit in [*units.shared, *(units.tied or [])]:
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                    shard_placement_fn=fsdp_shard_placement)
    order = {id(module): index for index, module in enumerate(model.modules())}
    blocks = sorted([*units.blocks, *(units.tied_blocks if units.tied is not None else [])], key=lambda b: order[id(b)])
    for index, block in enumerate(blocks):
        # The last block's backward starts right after forward: resharding it would only re-gather.
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard and index < len(blocks) - 1, mp_policy=mp_policy,
                    shard_placement_fn=fsdp_shard_placement)  # packed projections shard on dim 1
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy, shard_placement_fn=fsdp_shard_placement)
    tied_modules = [module for group in units.tied or [] for module in group]
    UnusedParameters([*units.shared, *tied_modules, *blocks, model], dp_mesh.get_group(), apart=experts)


@dataclass
class _DataParallelUnits:
    """The modules data parallel replicates or shards as units before the root (`_data_parallel_units`).

    `shared`: the outermost modules that two or more blocks hold (Zamba's one transformer block in older
    transformers, which every hybrid layer calls): FSDP2 manages a parameter in one unit only, so such a module is
    a unit of its own, made before the blocks (whose units then leave it out). `tied`: per set of parameters that
    blocks share otherwise (one tensor registered in modules of several blocks: transformers' Zamba ties each
    hybrid layer's transformer block to layer 2's), the modules holding exactly that set, one per block; sharded
    as one unit (`fully_shard([modules])`: gathered once for all their calls, each parameter managed once), made
    before the blocks. `blocks`: the decoder blocks that are units of their own; `tied_blocks`: those holding a
    tied set, units only where `tied` is sharded (levels 1-3; `replicate` takes one module, so at level 0 and where
    the tied parameters do not make up whole modules the root manages those blocks)."""

    shared: list[torch.nn.Module]
    tied: list[list[torch.nn.Module]] | None  # None: the tied parameters do not make up whole modules
    blocks: list[torch.nn.Module]
    tied_blocks: list[torch.nn.Module]


def _data_parallel_units(model: torch.nn.Module) -> _DataParallelUnits:
    # A multimodal model's media encoder (its vision tower's blocks) stays in the root's unit: a data-parallel rank
    # whose samples hold no image never calls it, and a unit whose forward does not run on every rank would enter
    # its reduce-scatter on some ranks only (gloo aborts); the root's always runs, its unused parameters reducing zeros
    encoders = media_encoders(model)
    blocks = list({id(block): block for name, block in decoder_blocks(model)
                   if not any(name.startswith(f"{encoder}.") for encoder in encoders)}.values())
    holders: dict[int, set[int]] = {}  # module -> the blocks that hold it
    for index, block in enumerate(blocks):
        for module in block.modules():
            if module is not block:
                holders.setdefault(id(module), set()).add(index)
    shared, inside = [], set()
    for block in blocks:
        for module in block.modules():
            if len(holders.get(id(module), ())) > 1 and id(module) not in inside and next(module.parameters(), None) is not None:
                shared.append(module)
                inside.update(id(m) for m in module.modules())
    owners: dict[int, set[int]] = {}  # parameter -> the blocks that hold it outside the shared modules
    for index, block in enumerate(blocks):
        for module in block.modules():
            if id(module) not in inside:
                for parameter in module.parameters(recurse=False):
                    owners.setdefault(id(parameter), set()).add(index)
    tied_params = {p for p, o in owners.items() if len(o) > 1}
    tied_indices = set().union(*(owners[p] for p in tied_params))
    tied = _tied_modules([blocks[i] for i in sorted(tied_indices)], tied_params, inside) if tied_params else []
    if tied is None:
        log.info("parallelize: data parallel: blocks %s share parameters that make up no whole modules; the root "
                 "manages those blocks", sorted(tied_indices))
    whole = {id(m) for group in tied or [] for m in group}  # a block tied whole is its group's unit
    return _DataParallelUnits(shared=shared, tied=tied,
                              blocks=[b for i, b in enumerate(blocks) if i not in tied_indices],
                              tied_blocks=[blocks[i] for i in sorted(tied_indices) if id(blocks[i]) not in whole])


def _tied_modules(blocks: list[torch.nn.Module], tied_params: set[int], inside: set[int]) -> list[list] | None:
    """Per set of tied parameters, the outermost module of each block whose parameters are all tied ones and are
    that set; None where some tied parameter is in no such module (a LayerNorm whose weight alone is tied), or
    where two sets overlap (FSDP2 would manage a parameter in two units)."""
    groups: dict[frozenset, list[torch.nn.Module]] = {}
    for block in blocks:
        taken: set[int] = set(inside)
        for module in block.modules():  # outer modules first
            if id(module) in taken:
                continue
            ids = frozenset(id(p) for p in module.parameters())
            if ids and ids <= tied_params:
                groups.setdefault(ids, []).append(module)
                taken.update(id(m) for m in module.modules())
    covered = [p for ids in groups for p in ids]
    if set(covered) != tied_params or len(covered) != len(tied_params):
        return None
    return list(groups.values())


def _mixed_precision(dp_config: dict) -> MixedPrecisionPolicy:
    """FSDP2's policy: compute in param_dtype, reduce gradients in reduce_dtype (fp32 recommended)."""

    def dtype(key):
        value = dp_config.get(key)
        if value is None or isinstance(value, torch.dtype):
            return value
        if value not in _DTYPES:
            raise ValueError(f"parallelize: dp_config[{key!r}] must be one of {list(_DTYPES)}, got {value!r}")
        return _DTYPES[value]

    return MixedPrecisionPolicy(param_dtype=dtype("param_dtype"), reduce_dtype=dtype("reduce_dtype"))


# ------------------------------------------------------------------------------- the user's plain loop


def _unwrap_dtensor_inputs(model: torch.nn.Module) -> None:
    """shard_dataloader yields global-view DTensors; the data-parallel model computes on local shards."""

    def hook(module, args, kwargs):
        return tree_map(local_value, args), tree_map(local_value, kwargs)  # nested dicts/lists too

    model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


def _report_global_mean_loss(model: torch.nn.Module, *, group) -> None:
    """The loss the model returns (alone, first in a tuple, or a dict's / Hugging Face ModelOutput's
    "loss": see outputs.py) shows the mean over data-parallel ranks, so every rank prints the loss a
    single device would; its gradient stays the local one (which data parallel averages). Other
    outputs (logits) stay this rank's, for its own part of the batch."""

    def hook(module, args, output):
        # Training steps only (under grad mode, in eval mode too: token_mean._training): every rank runs those; an
        # evaluation (under no_grad) on one rank must not wait for a collective the others never join.
        loss = find_loss(output)
        if loss is None or not torch.is_grad_enabled():
            return output
        mean = loss.detach().clone()
        env.all_reduce_mean_(mean, group)
        return replace_loss(output, loss + (mean - loss.detach()))

    model.register_forward_hook(hook)


# ------------------------------------------------------------------------------- the model as given


def refuse_compiled(model: torch.nn.Module, api: str) -> None:
    """A torch.compile wrapper cannot be distributed: its compiled graph would be the undistributed model's, and
    the hooks that make the loss the global batch's token mean would sit on the wrapper, which the loss check then
    takes for a model of its own (the error named the wrong cause)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported (Dynamo costs ~1 s): nothing compiled
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        raise TypeError(
            f"{api}: the model is a torch.compile wrapper (OptimizedModule around {type(model._orig_mod).__name__}), "
            f"whose graph would be that of the undistributed model; pass the model itself (model._orig_mod) and "
            f"compile the model {api} returns (torch.compile(model))")


_SAMPLE = 1 << 16  # elements of each tensor compared: a whole tensor seeded or loaded otherwise differs in all


def _check_same_values_on_every_rank(model: torch.nn.Module, mesh: ProcessMesh) -> None:
    """Every rank must start from the same model: FSDP2 keeps each rank's own shard of its own values (it does not
    broadcast, as DDP does), and modules that no style splits keep each rank's values, so a model seeded per rank
    or loaded on rank 0 only would train as a silent mix of them. Compared by fingerprint (the sum and the sum of
    magnitudes of up to _SAMPLE evenly strided elements of every parameter and persistent buffer, in fp64: bitwise
    equal on equal values; a non-persistent buffer may be scratch memory, left uninitialised), one all-reduce. Meta
    tensors (LazyGuard, materialised alike per tensor) and DTensors are left out, and so is a mesh of a part of the
    job's ranks (the others would not join the collective)."""
    if mesh.size == 1 or mesh.size != env.get_world_size():
        return
    names, parts, device = [], [], env.device()  # the collective's device (the model may still be on the CPU)
    persistent = [(f"{prefix}.{name}" if prefix else name, buffer) for prefix, module in model.named_modules()
                  for name, buffer in module._buffers.items()
                  if buffer is not None and name not in module._non_persistent_buffers_set]
    for name, tensor in [*model.named_parameters(), *persistent]:
        if tensor.is_meta or isinstance(tensor, DTensor) or tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLE)]
        sample = (torch.view_as_real(sample) if sample.is_complex() else sample).to(torch.float64)
        names.append(name)
        parts.append(torch.stack([sample.sum(), sample.abs().sum()]).to(device))
    if not parts:
        return
    values = torch.nan_to_num(torch.stack(parts), nan=math.inf)
    both = torch.cat([values, -values])  # one MAX gives the maximum and the minimum
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
    high, low = both[: len(values)].cpu(), -both[len(values):].cpu()
    differ = [name for name, row in zip(names, (high != low).any(dim=1).tolist()) if row]
    if differ:
        raise ValueError(
            f"parallelize: the model differs between ranks before sharding ({len(differ)} tensor(s): {differ[:4]}"
            f"{' ...' if len(differ) > 4 else ''}); data parallel keeps each rank's own shard and undivided modules "
            "each rank's values, so training would mix them. Build the model with the same seed on every rank, or "
            "load the same weights on every rank (weights loaded on one rank only: broadcast them first, or load "
            "them with distcore.load_state after parallelize)")


# ------------------------------------------------------------------------------------------ optimizer


def _check_optimizer_fresh(optimizer) -> None:
    if optimizer is None:
        return
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise ValueError(
            "parallelize: pass the plain optimizer, not one sharded by shard_optimizer(ShardingStage1): "
            "dp_config's sharding_level shards its states (FSDP2)"
        )
    if len(optimizer.state):
        raise ValueError(
            "parallelize: the optimizer already has state (it has taken steps); call parallelize before "
            "training, or load the state afterwards with distcore.load_state"
        )


def _rebuild_optimizer(optimizer, model: torch.nn.Module, names_before: dict[int, list[str]], *,
                       drop_missing: bool = False) -> torch.optim.Optimizer:
    """The same optimizer, its groups now holding the model's new (sharded) parameters.

    FSDP2 replaces each parameter by a DTensor parameter of the same name, so groups are mapped by
    name and updated in place (the optimizer has no state yet: checked by _check_optimizer_fresh).
    With `drop_missing` (pipeline parallel), parameters of other stages leave the groups.
    """
    params_after = dict(model.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        new_params = []
        for param in group["params"]:
            names = names_before.get(id(param))
            name = next((n for n in names if n in params_after), None) if names else None
            if drop_missing and names and name is None:
                continue
            if name is None:
                raise ValueError(
                    "parallelize: the optimizer holds a parameter that is not in the model; build the "
                    "optimizer from model.parameters()"
                )
            new_params.append(params_after[name])
        group["params"] = new_params
    return with_paddle_methods(optimizer)
