"""to_distributed(model, optimizer, dataloader, device_num, node_num, config): the strategy chosen for you.

Paddle's to_distributed looks its strategy up in a fixed table (8 devices -> pp2 dp2 mp2), supports
one node and never shards the optimizer or picks micro-batching. Ours asks autotune: the model's
structure is profiled (`ModelSpec.from_module`, by structure, on any device including meta), a cost
model of the hardware prices every valid strategy (dp x tp x pp, sharding level, sequence parallel,
micro-batching, recompute) and the fastest that fits in memory is applied whole:

    fused kernels -> recompute wrappers -> parallelize(dp_config, mp_config, pp_config) -> micro-batching
    -> shard_dataloader over the data-parallel dimension

The returned model, optimizer and dataloader work with the seed's loop unchanged
(`loss, _ = model(inputs, labels=labels); loss.backward(); opt.step(); opt.clear_grad()`), and each
carries the chosen strategy as `.distributed_strategy`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from tridist.autotune.model import DEEPSTACK_ARGUMENTS, readable_attr
from tridist.autotune.strategy import head_replicas
from tridist.kernels.comm_matmul import check_backend_available
from tridist.kernels.fuse import forward_takes

from . import env
from .dataloader import shard_dataloader
from .sample_rows import sample_rows_of
from .expert_parallel import expert_parallel_refusal
from .lora import has_lora_layers, is_lora_layer
from .measure import measure_strategies
from .mesh import ProcessMesh
from .outputs import CACHE_ARGUMENTS
from .parallel_dims import ParallelDims
from .parallelize import parallelize, refuse_compiled, router_aux_loss_on
from .block_check import BlockViews, TensorParallelCheckError, choose_block_views
from .tensor_parallel import (
    ColWiseParallel,
    DistributedNorm,
    LocalParameterRows,
    ReduceSharedOutputGradient,
    ReplicatedColWiseParallel,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnd,
    SequenceSlicedRows,
    ShardLocalParameters,
    SplitGroupNorm,
    TensorParallelPlan,
    UnfusedMixerForward,
    plan_from_names,
)

log = logging.getLogger(__name__)

DEFAULT_INPUT_SHAPE = (4, 1024)  # Paddle's default input_spec: [BATCH_SIZE, SEQ_LENGTH]
_MIXED_PRECISION = {"bfloat16", "float16"}


@dataclass
class ToDistributedConfig:
    """Paddle's fields (`input_spec`, `sequence_parallel`) and ours.

    input_spec: shapes of the model inputs ([batch, seq] lists, or objects with `.shape` such as
      Paddle's InputSpec); the first gives the global batch and sequence length the cost model prices.
      Default: read from the dataloader (its batch size and the first sample's length), else [4, 1024].
    sequence_parallel: force sequence parallel on (Paddle's flag) whenever tensor parallel is chosen.
    device: a hardware profile name ("h100-sxm", "h200", "a100-80gb", "a100-40gb", "cpu") or an
      autotune.DeviceProfile (e.g. one measured by `tridist calibrate`); default: from the device seen.
    mixed_precision: "bfloat16"/"float16" computes in that dtype with fp32 gradient reduction (FSDP2's
      policy) when data parallel is on.
    fuse_kernels: swap in the fused RMSNorm / SwiGLU / rotary layers (kernels.fuse) first.
    strategy: apply this autotune.Strategy instead of searching (it is still validated).
    storage: an Optuna storage for the search (None: in memory); top_k: candidates logged.
    measure: run the `measure_top_k` best predicted strategies for `measure_warmup` + `measure_steps`
      real steps each on copies of the model and optimizer, with the dataloader's batches (measure.py),
      and apply the measured fastest; a candidate that fails (out of memory, refused) is dropped with
      its reason. The device's step-time factor is refitted and, with `measure_save`, saved as the
      profile `<device>-measured` (pass it as `device` next time). `measure_step(model, optimizer,
      batch)`: one training step, where the model is not called as model(**batch) / model(*batch).
      The measurements end up in `model.distributed_measurements` (predicted and measured seconds).
      measure_pick: "top" (the best predicted) or "layouts" (the best predicted of each dp x tp x pp
      layout: a spread of strategies, for the strategy benchmark's predicted-vs-measured correlation).
    overlap_backend: how a strategy with overlap_tp_comm runs its overlapped collectives: "ring"
      (tridist's point-to-point rings, any process group) or "symm_mem" (torch's symmetric-memory fused
      ops: CUDA GPUs of one node); see kernels.comm_matmul.BACKENDS.
    """

    input_spec: list | None = None
    sequence_parallel: bool = False
    device: object = None
    mixed_precision: str | None = None
    fuse_kernels: bool = True
    strategy: object = None
    storage: object = None
    top_k: int = 5
    search_options: dict = field(default_factory=dict)
    measure: bool = False
    measure_top_k: int = 3
    measure_steps: int = 3
    measure_warmup: int = 1
    measure_step: object = None
    measure_save: bool = True
    measure_pick: str = "top"
    overlap_backend: str = "ring"

    def __post_init__(self):
        from tridist.autotune.measured import MEASURE_PICKS
        from tridist.kernels.comm_matmul import BACKENDS

        if self.overlap_backend not in BACKENDS:
            raise ValueError(f"ToDistributedConfig: overlap_backend must be one of {list(BACKENDS)} ('ring': any "
                             f"process group; 'symm_mem': CUDA GPUs of one node), got {self.overlap_backend!r}")

        if self.measure_pick not in MEASURE_PICKS:
            raise ValueError(f"ToDistributedConfig: measure_pick must be 'top' (the best predicted strategies) or "
                             f"'layouts' (the best of each dp x tp x pp layout), got {self.measure_pick!r}")


def _as_config(config) -> ToDistributedConfig:
    """`config` as a ToDistributedConfig: None is the default, a dict names its fields (`parallelize`'s config is a
    dict, so users pass one here too); anything else, or a dict naming no field, is refused with the fields."""
    if config is None or isinstance(config, ToDistributedConfig):
        return config or ToDistributedConfig()
    names = [f.name for f in dataclasses.fields(ToDistributedConfig)]
    if not isinstance(config, dict):
        raise TypeError(f"to_distributed: config must be a ToDistributedConfig or a dict of its fields, got "
                        f"{type(config).__name__}; e.g. ToDistributedConfig(sequence_parallel=True)")
    unknown = [key for key in config if key not in names]
    if unknown:
        hints = "; ".join(f"{key!r}: did you mean {difflib.get_close_matches(str(key), names, n=2, cutoff=0.5)}?"
                          for key in unknown)
        raise TypeError(f"to_distributed: config names no field {unknown} of ToDistributedConfig ({hints}); "
                        f"its fields are {names}")
    return ToDistributedConfig(**config)


def to_distributed(model: torch.nn.Module, optimizer, dataloader, device_num: int, node_num: int | None = 1,
                   config: ToDistributedConfig | dict | None = None):
    """Choose the fastest strategy for `device_num` devices on each of `node_num` nodes and apply it.

    Returns (model, optimizer, dataloader) for the user's unchanged training loop. `optimizer` may be None, as
    parallelize's: build it from the returned model's parameters then, before any evaluation (a forward without
    backward leaves FSDP2's parameters gathered: README, "sharding levels").
    """
    from tridist import autotune

    refuse_compiled(model, "to_distributed")
    config = _as_config(config)
    node_num = node_num or 1
    env.init_parallel_env()
    # An overlap backend these devices cannot run is an error now, not a knob the search quietly drops
    # (the tensor-parallel group, chosen later, is checked when the strategy is applied).
    check_backend_available("to_distributed: ToDistributedConfig.overlap_backend", config.overlap_backend, env.device())
    world = env.get_world_size()
    if device_num * node_num != world:
        raise ValueError(
            f"to_distributed: device_num={device_num} x node_num={node_num} = {device_num * node_num} devices, but "
            f"this job has {world} processes; launch with torchrun --nnodes {node_num} --nproc-per-node {device_num}"
        )
    global_batch, seq_len = _input_shape(config, dataloader)
    cluster = autotune.Cluster(nodes=node_num, devices_per_node=device_num, device=_device_profile(config),
                               engine="torch+tridist" if config.fuse_kernels else "torch")  # what will run
    layers = None  # the decoder-layer list's name
    try:
        spec = autotune.ModelSpec.from_module(model, seq_len=seq_len)
        layers = spec.structure.layers
    except autotune.UnrecognisedModel as error:
        if config.strategy is not None:  # the reason belongs in the refusal
            _refuse_without_structure(config.strategy, error)
        log.warning("to_distributed: %s; %s", error, "applying the given strategy, which does not need more" if
                    config.strategy is not None else "falling back to data parallel with sharding")
        spec, layers = None, error.layers
    limits: dict[str, str] = {}
    if router_aux_loss_on(model):
        limits["pp"] = ("the model adds its router's load-balancing loss, computed from every layer's router logits, "
                        "which pipeline stages do not hold together")
        limits["sequence_parallel"] = ("the model adds its router's load-balancing loss, computed from every token's "
                                       "router logits, which sequence parallel splits over the tp ranks")
    from .pipeline import embeddings_after_layers, reentrant_checkpointing, reused_outputs  # (torch's pipelining)

    late = embeddings_after_layers(model, layers) if layers is not None else []
    if late:
        limits["pp"] = (f"{late} hold an embedding registered after the decoder layers but looked up before them "
                        "(per-layer inputs reaching every layer): no split into pipeline stages computes it where it is used")
    if lora := has_lora_layers(model):
        limits["overlap_tp_comm"] = (f"{lora[0]} and {len(lora) - 1} more are LoRA layers, whose base matmul and "
                                     "adapters overlap_comm's rings cannot compute together")
    if spec is not None and (why := _lora_inside_moe_blocks(model, spec.structure)):
        limits["sequence_parallel"] = why
    if why := reentrant_checkpointing(model):
        limits["pp"] = why
    if spec is not None and spec.structure.is_moe and world > 1 and (config.strategy is None or config.strategy.ep > 1):
        why = expert_parallel_refusal(model, spec.structure.experts_modules())
        if why:  # e.g. Llama 4's experts, which run every token
            limits["ep"] = why
    strategy, searched = _choose(spec, cluster, global_batch, config, world, limits=limits)
    if strategy.pp > 1 and "pp" not in limits and layers is not None:  # the probe forward only where pp is chosen
        reused = reused_outputs(model, layers)  # (pipeline.probe_forward)
        if reused:
            limits["pp"] = (f"the logits are computed from {reused} besides the hidden states each decoder layer passes "
                            "to the next: a pipeline stage would hold zeros in their place")
            strategy, searched = _choose(spec, cluster, global_batch, config, world, limits=limits)
    # Every rank runs the same checks: all choose alike. A given strategy that recomputes is checked too: the
    # recompute wrappers go on before parallelize, whose own refusal would leave them on the caller's model.
    while strategy.tp > 1 and (config.strategy is None or strategy.recompute != "none"):
        found = {dim: why for dim, why in _tensor_parallel_limits(model, strategy, spec, config).items()
                 if dim not in limits}
        if not found:
            break
        for dim, why in found.items():
            log.warning("to_distributed: %s excluded: %s", _KNOB_NAMES[dim], why)
        limits.update(found)  # grows each round: at most one round per kind of limit
        strategy, searched = _choose(spec, cluster, global_batch, config, world, limits=limits)
    measurements = None
    if config.measure and config.strategy is None and spec is not None:
        if optimizer is None:
            raise ValueError("to_distributed: ToDistributedConfig(measure=True) times training steps, which need the "
                             "optimizer; pass it, or measure=False")
        strategy, measurements = _measured_choice(model, optimizer, dataloader, spec, config, searched, world)
    model, optimizer, loader = _apply_with_loader(model, optimizer, dataloader, strategy, spec, config, layers=layers)
    vars(model).pop("_tridist_forward_probe", None)  # served the pipeline (its weak references would not pickle)
    for obj in (model, optimizer, loader):
        if obj is not None:  # an optimizer may come later (parallelize's optimizer=None)
            obj.distributed_strategy = strategy
    if measurements is not None:
        model.distributed_measurements = measurements
    return model, optimizer, loader


_KNOB_NAMES = {"tp": "tensor parallel", "recompute": "activation recompute",
               "overlap_tp_comm": "overlapped tensor-parallel communication"}


def _apply_with_loader(model, optimizer, dataloader, strategy, spec, config, *, layers: str | None = None):
    mesh = _dims(strategy).mesh
    media = sample_rows_of(model)  # a vision-language model's images: split with their samples
    model, optimizer = apply_strategy(model, optimizer, strategy, spec=spec, config=config, mesh=mesh, layers=layers)
    return model, optimizer, shard_dataloader(dataloader, meshes=mesh, shard_dims="dp", sample_rows=media)


# --------------------------------------------------------------------------------------- choosing


def _input_shape(config: ToDistributedConfig, dataloader) -> tuple[int, int]:
    """(global batch, sequence length): from input_spec, else the dataloader, else Paddle's default."""
    if config.input_spec:
        first = config.input_spec[0]
        shape = list(getattr(first, "shape", first))
        if len(shape) < 2 or not all(isinstance(d, int) and d > 0 for d in shape[:2]):
            raise ValueError(f"to_distributed: input_spec[0] must have a [batch, seq] shape with known sizes, got {shape}")
        return shape[0], shape[1]
    batch = getattr(dataloader, "batch_size", None) or getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None)
    try:
        seq = int(np.shape(_first_input(dataloader.dataset[0]))[-1])
    except Exception:  # noqa: BLE001 - any dataset: the default shape is a fine fallback
        seq = None
    if batch and seq:
        return int(batch), seq
    log.warning("to_distributed: could not read the batch shape from the dataloader; using %s", list(DEFAULT_INPUT_SHAPE))
    return DEFAULT_INPUT_SHAPE


def _first_input(sample):
    """The model's first input in a dataset sample: (inputs, labels), {"input_ids": ...}, or a tensor."""
    if isinstance(sample, (tuple, list)):
        return sample[0]
    if isinstance(sample, dict):
        return next(iter(sample.values()))
    return sample


def _device_profile(config: ToDistributedConfig):
    if config.device is not None:
        return config.device
    if not torch.cuda.is_available():
        return "cpu"
    from tridist.autotune.hardware import builtin_profile_for

    device = torch.device("cuda", torch.cuda.current_device())
    profile, known = builtin_profile_for(device)
    if not known:
        log.warning("to_distributed: no built-in profile for %r; pricing it as an H100 (run `tridist calibrate`)",
                    torch.cuda.get_device_name(device))
    return profile


def refuse_router_logits_per_call(model: torch.nn.Module) -> None:
    """Under sequence parallel on a mixture of experts: a call passing output_router_logits=True (transformers'
    per-call override of the config) would compute the load-balancing loss from each rank's slice of the
    sequence; such a call raises instead."""

    def check(module, args, kwargs):
        if kwargs.get("output_router_logits"):
            raise ValueError("output_router_logits=True under sequence parallel on a mixture of experts: the router's "
                             "load-balancing loss takes every token's logits and each tp rank holds its own slice; "
                             "call without it, or train with tp but no sequence parallel")

    model.register_forward_pre_hook(check, with_kwargs=True)


def unsupported(spec) -> dict[str, str]:
    """What distcore cannot apply to this model yet: {knob (autotune.search.KEPT_AT's): the reason}. The search
    keeps those knobs at their defaults (and says why), and a given strategy that needs them is refused, so
    that no strategy to_distributed chooses fails when applied. A mixture of experts trains with every knob but
    the overlapped tensor-parallel edges (its MoE blocks have no column-parallel entry: `tensor_parallel_plan`)."""
    structure = getattr(spec, "structure", None)
    limits: dict[str, str] = {}
    if structure is None:
        return limits
    if structure.is_moe:
        limits["overlap_tp_comm"] = (
            f"the MoE blocks ({structure.pattern(structure.moe).rstrip('.')} in {len(structure.moe_layers)} of "
            f"{structure.num_layers} layers) have no column-parallel entry for the all-gather to overlap with")
    if getattr(structure, "unplanned", ()):
        limits["sequence_parallel"] = (
            f"{[structure.pattern(n) for n in structure.unplanned]} hold parameters no plan names (whole on every tp "
            "rank): on a rank's slice of the sequence their gradients would cover that slice only")
    # A head of the model's own (structure.task_head: a classifier's score) stays whole on every tp rank, after
    # the final norm's gathered output under sequence parallel, and on the last pipeline stage: nothing to limit.
    if structure.tied_embeddings and not structure.lm_head and not structure.task_head:
        limits["tp"] = limits["pp"] = (
            "the embedding's weight is also the LM head, used by the model's forward itself (no head module): "
            "a tied weight is split by tensor parallel, and shared across pipeline stages, only between an "
            "embedding and a Linear head")
    if structure.latent_kv:
        limits["overlap_tp_comm"] = (
            f"multi-head latent attention: its column-parallel projections ({structure.q}, {structure.latent_kv}) "
            "take the low-rank latents, not the attention's input, which the overlapped all-gather ring gathers")
    if structure.linear_attention is not None:
        limits["overlap_tp_comm"] = (f"the linear-attention mixers ({structure.pattern(structure.linear_attention.mixer)}) "
                                     "project their input after masking its padding (transformers' "
                                     "apply_mask_to_padding_states), not the region's input that the overlapped "
                                     "all-gather ring computes their projections from")
    if getattr(spec, "packed_unequal_qkv", False) and not getattr(spec, "qkv_interleaved", False):
        limits["overlap_tp_comm"] = (f"{structure.qkv} packs q/k/v of unequal sizes (grouped-query heads): split on "
                                     "its input features, it reduce-scatters its output, which the overlapped "
                                     "all-gather ring cannot feed")
    return limits


def _search_space(config: ToDistributedConfig):
    """The search space and the other search options of the config (distcore's limits for the model go
    to the search as `excluded`, which keeps those knobs at autotune.search.KEPT_AT and says why)."""
    from tridist import autotune

    options = dict(config.search_options)
    space = options.pop("space", None) or autotune.SearchSpace(
        sequence_parallel=(True,) if config.sequence_parallel else (False, True),
    )
    return space, options


def _violates(strategy, dim: str) -> bool:
    from tridist.autotune.search import KEPT_AT

    if dim == "balanced_stages":  # the search's knob; a strategy lists its stages (None: the even layout)
        return strategy.layers_per_stage is not None
    return getattr(strategy, dim) not in KEPT_AT[dim]


def _tensor_parallel_limits(model: torch.nn.Module, strategy, spec, config: ToDistributedConfig) -> dict[str, str]:
    """What the model's blocks rule out for the strategy's tensor parallel (block_check.py; the model is
    not changed): "overlap_tp_comm" where a block cannot run overlapped (checked first: an entry projection
    fed something else than its region's input, a block only right in global view), so that tensor parallel
    itself is judged without it; "sequence_parallel" where blocks fail under it only (a mixture of experts', LoRA layers');
    "tp" where a block is wrong in local and in global view, or the plan cannot be applied to it (a style's own
    refusal, which applying the strategy would raise: the search moves on instead); "recompute" where
    blocks run in global view and the strategy recomputes them (global_view.refuse_recompute says why), or where
    selective recompute would re-run an attention module whose local view swaps its parameters in around its
    forward (`_swapped_around_recompute`)."""
    structure = spec.structure
    plan = tensor_parallel_plan(model, structure, sequence_parallel=strategy.sequence_parallel, tp=strategy.tp)
    dims = _dims(strategy)

    def views(plan):
        return choose_block_views(model, plan, tp_mesh=dims.device_mesh("mp"), process_mesh=dims.mesh)

    def refusal(plan) -> tuple[BlockViews | None, str | None]:
        """(the views, None), or (None, why the plan is wrong or cannot be applied: a style's own refusal, e.g. a
        LoRA layer on Jamba's dt_proj, which applying the searched strategy would raise instead of falling back)."""
        try:
            chosen = views(plan)
        except TensorParallelCheckError as error:
            return None, str(error)
        if chosen.refused:
            return None, "; ".join(f"applying the plan to {name} raised {why}" for name, why in chosen.refused.items())
        return chosen, None

    if strategy.overlap_tp_comm:
        overlapped, why = refusal(dataclasses.replace(plan, overlap_comm=config.overlap_backend))
        if why is not None:
            return {"overlap_tp_comm": why}
        if overlapped.global_view:
            return {"overlap_tp_comm": f"blocks {sorted(overlapped.global_view)} cannot run overlapped "
                                       f"({next(iter(overlapped.global_view.values()))})"}
    chosen, why = refusal(plan)
    if why is not None:
        if strategy.sequence_parallel:
            # Blocks that run on sequence slices in local view only (MoE blocks: one that needs global view gets them
            # token-split; LoRA layers, which have no global view, in a block whose local view fails under sp alone:
            # Bloom's and MPT's residual add inside the attention): judge tensor parallel itself without it.
            _, without = refusal(tensor_parallel_plan(model, structure, sequence_parallel=False, tp=strategy.tp))
            return {"sequence_parallel": why} if without is None else {"tp": without}
        return {"tp": why}
    if chosen.global_view and strategy.recompute != "none":
        return {"recompute": f"blocks {sorted(chosen.global_view)} run in global view under tensor parallel "
                             f"({next(iter(chosen.global_view.values()))}), where activation recompute cannot run"}
    swapped = _swapped_around_recompute(structure, chosen.repairs) if strategy.recompute == "selective" else []
    if swapped:
        return {"recompute": f"selective recompute re-runs the attention's forward alone, without its hooks, and under "
                             f"tensor parallel {swapped} swap this rank's parameters in around that forward (gpt-oss's "
                             "attention sinks split by head); use recompute='full' or 'none'"}
    return {}


def _swapped_around_recompute(structure, repairs: dict) -> list[str]:
    """The attention modules (the ones selective recompute wraps) whose block-check repairs work in forward hooks that
    a recomputation would not run (ShardHeadParameters, ShardLocalParameters and DistributedNorm swap parameters in;
    a style that is `recomputable`, ShardHeadInput, is not counted), each as 'name (styles)'."""
    wrapped = {f"{structure.layers}.{i}.{structure.attention}" for i in _attention_layers(structure)}
    return [f"{name} ({', '.join(type(style).__name__ for style in styles)})"
            for name, styles in sorted(repairs.items())
            if name in wrapped and not all(style.recomputable for style in styles)]


def _choose(spec, cluster, global_batch: int, config: ToDistributedConfig, world: int, limits: dict | None = None):
    """(the strategy every rank applies, the SearchResult behind it on rank 0: None elsewhere, and where
    no search ran: a given strategy, an unrecognised model)."""
    from tridist import autotune

    limits = {**unsupported(spec), **(limits or {})}
    if config.strategy is not None:
        strategy = config.strategy
        if spec is not None:
            autotune.check(spec, cluster, strategy, global_batch_size=global_batch)
        reasons = [f"{dim}={getattr(strategy, dim)} cannot be applied to this model: {why}"
                   for dim, why in limits.items() if _violates(strategy, dim)]
        if reasons:
            raise autotune.InvalidStrategy(strategy, reasons)
        _log_choice(strategy, "given in ToDistributedConfig.strategy", [])
        return strategy, None
    if spec is None:  # unrecognised structure: nothing but data parallel needs no knowledge of it
        strategy = _fallback(world, global_batch)
        _log_choice(strategy, "fallback for an unrecognised model", [])
        return strategy, None
    for dim, why in limits.items():
        log.warning("to_distributed: %s kept at its default for this model: %s", dim, why)
    best, message, result = _search_on_rank_zero(spec, cluster, global_batch, config, limits, world)
    if best is None:
        strategy = _fallback(world, global_batch)
        log.warning("to_distributed: %s; trying %s", message, strategy.describe())
        return strategy, result
    return best, result


def _search_on_rank_zero(spec, cluster, global_batch: int, config: ToDistributedConfig, limits: dict, world: int):
    """(the best strategy or None, why none, the SearchResult on rank 0 / None elsewhere): rank 0 searches
    and every rank takes its answer. Searches
    on every rank could disagree (a resumed storage one rank sees late) and would all write to a shared
    storage at once. A failure on rank 0 is raised on every rank, not left for the others to wait on."""
    from tridist import autotune

    space, options = _search_space(config)  # on every rank: bad options fail everywhere alike
    decision: list = [None]
    failure = result = None
    if env.get_rank() == 0:
        try:
            result = autotune.search(spec, cluster, global_batch_size=global_batch, storage=config.storage,
                                     top_k=config.top_k, space=space, excluded=limits, **options)
        except Exception as error:  # noqa: BLE001 - re-raised below, after the others have heard of it
            failure, decision = error, [(None, None, f"{type(error).__name__}: {error}")]
        else:
            decision = [(result.best.strategy if result.best else None, result.message or "no strategy fits in memory", None)]
            if result.best is not None:
                _log_choice(result.best.strategy, f"fastest of {result.n_evaluated} strategies priced",
                            result.ranked[: config.top_k], basis=f"{cluster.profile.basis}; engine {cluster.engine.name}")
    if world > 1 and dist.is_initialized():
        dist.broadcast_object_list(decision, src=0)
    best, message, error = decision[0]
    if failure is not None:
        raise failure
    if error is not None:
        raise RuntimeError(f"to_distributed: the strategy search failed on rank 0: {error}")
    return best, message, result


def _measured_choice(model, optimizer, dataloader, spec, config: ToDistributedConfig, result, world: int):
    """(the measured fastest strategy, the measurements): rank 0 names the top candidates of its search
    (`result`, None on the other ranks), every rank measures each (measure.py), rank 0 re-ranks
    (autotune.measured) and every rank applies its answer."""
    from tridist.autotune.measured import candidates_to_measure, rerank

    names = [[c.strategy for c in candidates_to_measure(result, config.measure_top_k, config.measure_pick)]
             if result is not None else None]
    if world > 1:
        dist.broadcast_object_list(names, src=0)
    measured = measure_strategies(
        names[0], model=model, optimizer=optimizer, dataloader=dataloader, steps=config.measure_steps,
        warmup=config.measure_warmup, step=config.measure_step,
        apply=lambda m, o, s: _apply_with_loader(m, o, dataloader, s, spec, config))
    decision: list = [None]
    if env.get_rank() == 0:
        ranking = rerank(result, measured, save=config.measure_save)
        decision = [(ranking.best.strategy if ranking.best else None, ranking.measurements, ranking.result.message)]
        _log_measured(ranking)
    if world > 1:
        dist.broadcast_object_list(decision, src=0)
    best, measurements, message = decision[0]
    if best is None:
        raise RuntimeError(f"to_distributed(measure=True): {message}")
    return best, measurements


def _log_measured(ranking) -> None:
    lines = [f"to_distributed: measured {len(ranking.measurements)} candidates, predicted vs measured per step "
             f"(new step-time factor {ranking.profile.step_time_scale:.3g} for {ranking.profile.name})"]
    for m in ranking.measurements:
        measured = f"{m.measured_s * 1e3:9.2f} ms" if m.measured_s is not None else f"dropped: {m.failure}"
        lines.append(f"  {m.strategy.describe():48s} predicted {m.predicted_s * 1e3:9.2f} ms  measured {measured}")
    log.info("\n".join(lines))
    print("\n".join(lines), flush=True)


def _fallback(world: int, global_batch: int):
    from tridist import autotune

    if global_batch % world:
        raise ValueError(
            f"to_distributed: the global batch ({global_batch}) does not split over {world} data-parallel ranks; "
            "use a batch size divisible by the number of devices"
        )
    return autotune.Strategy(dp=world, tp=1, pp=1, sharding_level=3 if world > 1 else 0,
                             micro_batch_size=global_batch // world, num_micro_batches=1)


def _log_choice(strategy, why: str, candidates, basis: str | None = None) -> None:
    lines = [f"to_distributed: {strategy.describe()} ({why})"]
    if candidates and basis:
        lines.append(f"  predictions: {basis}")
    for rank, candidate in enumerate(candidates, 1):
        lines.append(
            f"  #{rank} {candidate.strategy.describe():48s} step {candidate.step_time_s * 1e3:9.2f} ms  "
            f"memory {candidate.memory_bytes_per_device / 2**30:8.2f} GiB/device"
        )
    log.info("\n".join(lines))
    if env.get_rank() == 0:
        print("\n".join(lines), flush=True)


# --------------------------------------------------------------------------------------- applying


def _dims(strategy) -> ParallelDims:
    """The strategy's degrees on a new mesh: tp innermost (consecutive ranks: inside a node), then dp, pp
    outermost (Megatron's order)."""
    return ParallelDims.for_degrees(dp=strategy.dp, tp=strategy.tp, pp=strategy.pp)


def _needs_structure(strategy) -> list[str]:
    """What of `strategy` needs the model's recognised structure inside its layers: tensor parallel's plan,
    expert parallel's experts, selective recompute's attention."""
    return [what for what, needed in (("tensor parallel", strategy.tp > 1), ("expert parallel", strategy.ep > 1),
                                      ("selective recompute", strategy.recompute == "selective")) if needed]


def _needs_layers(strategy) -> list[str]:
    """What of `strategy` needs the decoder-layer list alone: pipeline stages, micro-batches (a one-stage
    pipeline), full recompute (each layer re-run)."""
    return [what for what, needed in (("pipeline parallel", strategy.pp > 1),
                                      ("micro-batching", strategy.num_micro_batches > 1),
                                      ("full recompute", strategy.recompute == "full")) if needed]


def _refuse_without_structure(strategy, error) -> None:
    """Raise InvalidStrategy when `strategy` needs more of the model than UnrecognisedModel `error` found."""
    from tridist import autotune

    needs = _needs_structure(strategy) + ([] if error.layers else _needs_layers(strategy))
    if not needs:
        return
    fix = (f"the decoder-layer list {error.layers} was found, so give a strategy with tp=1, ep=1 and no selective "
           "recompute (pipeline stages, micro-batches and full recompute need that list alone)" if error.layers else
           "give a data-parallel-only strategy with one micro-batch and no recompute")
    raise autotune.InvalidStrategy(strategy, [
        f"{' and '.join(needs)} need(s) a recognised model structure, and this model's is not: {error}; {fix}, or "
        f"strategy=None (data parallel is then chosen)"]) from error


def apply_strategy(model: torch.nn.Module, optimizer, strategy, *, spec=None, config: ToDistributedConfig | None = None,
                   mesh: ProcessMesh | None = None, layers: str | None = None):
    """Apply an autotune.Strategy to `model` and `optimizer` (in place) on `mesh` (default: the
    strategy's ParallelDims layout of all ranks); returns both. `spec`: the model's autotune.ModelSpec, whose
    structure tensor parallel, expert parallel and selective recompute need; without one, `layers` (an
    UnrecognisedModel's `.layers`) names the decoder-layer list, enough for pipeline stages, micro-batches and
    full recompute."""
    config = config or ToDistributedConfig()
    structure = getattr(spec, "structure", None)
    layers = structure.layers if structure is not None else layers
    needs = _needs_structure(strategy) if structure is None else []
    needs += _needs_layers(strategy) if layers is None else []
    if needs:
        raise ValueError(
            f"to_distributed: {' and '.join(needs)} need(s) a recognised model structure (autotune.ModelSpec."
            "from_module), or for pipeline stages, micro-batches and full recompute the decoder-layer list "
            "(apply_strategy(layers=...)); use a data-parallel-only strategy with one micro-batch for this model"
        )
    if strategy.ep > 1 and not structure.is_moe:
        raise ValueError(f"to_distributed: ep={strategy.ep} needs a recognised mixture of experts; use ep=1")
    if config.mixed_precision is not None and config.mixed_precision not in _MIXED_PRECISION:
        raise ValueError(f"to_distributed: mixed_precision must be one of {sorted(_MIXED_PRECISION)} or None")
    if config.fuse_kernels:
        from tridist import kernels

        report = kernels.fuse(model)
        log.info("to_distributed: %s", report)
    if strategy.recompute != "none":
        apply_recompute(model, layers=layers, attention=structure and structure.attention, mode=strategy.recompute,
                        attention_layers=_attention_layers(structure) if structure else None)
    parallel_config = {"dp_config": {"sharding_level": strategy.sharding_level}}
    if config.mixed_precision is not None:
        parallel_config["dp_config"].update(param_dtype=config.mixed_precision, reduce_dtype="float32")
    if strategy.ep > 1:
        parallel_config["ep_config"] = {
            "degree": strategy.ep, "fused_activation": config.fuse_kernels,
            "experts": structure.experts_modules()}
    if strategy.tp > 1:
        plan = tensor_parallel_plan(model, structure, sequence_parallel=strategy.sequence_parallel, tp=strategy.tp)
        parallel_config["mp_config"] = {"parallelize_plan": plan,
                                        "overlap_comm": strategy.overlap_tp_comm and config.overlap_backend}
    if strategy.pp > 1 or strategy.num_micro_batches > 1:
        # Without pipeline stages, micro-batching is gradient accumulation: a one-stage pipeline
        # (1F1B: forward and backward one micro-batch at a time, gradients reduced once per step).
        parallel_config["pp_config"] = {
            "split_spec": layers,
            "schedule": "Interleaved1F1B" if strategy.virtual_pp > 1 else "1F1B",
            "micro_batches": strategy.num_micro_batches,
            **({"virtual_pp_degree": strategy.virtual_pp} if strategy.virtual_pp > 1 else {}),
            **({"layers_per_stage": list(strategy.layers_per_stage)} if strategy.layers_per_stage else {}),
        }
    if strategy.tp > 1 and strategy.sequence_parallel and structure.is_moe:
        refuse_router_logits_per_call(model)
    return parallelize(model, optimizer, mesh or _dims(strategy).mesh, parallel_config)


def tensor_parallel_plan(model: torch.nn.Module, structure, *, sequence_parallel: bool,
                         tp: int = 1) -> TensorParallelPlan:
    """The typed plan for a recognised Llama-like structure (Megatron's split), named with the model's own
    module names (no patterns to re-match): column-parallel q/k/v (or a packed qkv, its part sizes as
    recognised; one held per key/value head, [q..q k v], split contiguously: GPT-NeoX's, Bloom's, Falcon's), an
    attention's own output-gate projection (with the query heads) and gate/up, row-parallel o and down,
    vocabulary-split embedding and LM head (one split when they are tied). Where
    `tp` exceeds a layer's own key/value heads (read from its k projection: layers may differ, Gemma 4's per-layer
    configs) and they divide it, that layer's k and v projections get ReplicatedColWiseParallel(tp // heads), each
    head computed on that many ranks (separate k and v only). Layers whose token mixer is Gated DeltaNet linear
    attention (or Kimi Delta Attention, Mamba-2; Mamba-1 and LFM2's gated short convolution by channel) get their
    mixer split by head instead of the attention's plan (`_add_linear_attention`).

    A mixture of experts: attention split in every layer, the MLP in its dense layers only; its MoE blocks
    (router, experts, shared experts) stay whole on every tp rank (Megatron's expert tensor parallel of 1).
    Without sequence parallel each tp rank routes the same tokens and runs the same experts, or its
    expert-parallel share of them, so their gradients come out equal on the tp ranks and need no reduction.
    With it, each tp rank routes its own slice of the sequence through the whole block (ShardLocalParameters
    on each of the block's modules with parameters: the module code sees plain local tensors, the gradients
    are summed over the tp ranks), so no rank repeats another's expert compute; expert parallel takes the
    experts modules over from there (expert_parallel.py). Where the block is the layer itself (Gemma 4: router and
    experts beside the attention), all of the layer but its attention does so; a shared expert beside the block
    (Granite's shared_mlp, the layer adding its output to the block's) runs on the slice too. A router whose load-balancing loss
    takes every token's logits cannot see a slice (refused by `to_distributed`)."""
    if structure.is_moe and sequence_parallel and router_aux_loss_on(model):
        raise ValueError("tensor_parallel_plan: sequence parallel on a mixture of experts whose router's load-balancing "
                         "loss takes every token's logits: each tp rank would see its own slice; set "
                         "model.config.output_router_logits = False, or use tp without sequence parallel")
    if structure.is_moe and sequence_parallel and (why := _lora_inside_moe_blocks(model, structure)):
        raise NotImplementedError(f"tensor_parallel_plan: {why}")
    plan: dict = {}
    indices = range(structure.num_layers)
    layers = [f"{structure.layers}.{i}" if structure.layers else str(i) for i in indices]
    # Blocks of one part (Nemotron-H's) hold no token mixer (an MLP or MoE block alone) or no MLP.
    without_mlp = {*structure.moe_layers, *structure.mlp_free_layers}
    dense_layers = [layer for i, layer in zip(indices, layers) if i not in without_mlp]
    linear = structure.linear_attention
    linear_indices = set(linear.layers) if linear else set()
    linear_layers = [layer for i, layer in zip(indices, layers) if i in linear_indices]
    attention = set(_attention_layers(structure))
    attention_layers = [layer for i, layer in zip(indices, layers) if i in attention]

    def add(name, *styles):
        if name:
            plan.setdefault(name, []).extend(styles)

    def add_per_layer(relative, *styles, among=layers):
        if relative:
            for layer in among:
                add(f"{layer}.{relative}", *styles)

    add_per_layer(structure.q, ColWiseParallel(), among=attention_layers)
    # each part of a packed qkv split on its own, or, where the projection holds [q..q k v] per key/value head,
    # contiguously (the block check runs the block in global view if its code packs otherwise)
    packed = ColWiseParallel(packed_parts=1 if structure.qkv_interleaved else structure.qkv_sizes)
    for layer in attention_layers:
        replicas = _kv_head_replicas(model, layer, structure, tp)
        for projection in (structure.k, structure.v):
            add_per_layer(projection, ReplicatedColWiseParallel(replicas) if replicas > 1 else ColWiseParallel(),
                          among=[layer])
        if structure.qkv:  # key/value heads fewer than the ranks in a packed [q | k | v]: k and v replicated
            add_per_layer(structure.qkv, ReplicatedColWiseParallel(replicas, packed_query=structure.qkv_sizes[0])
                          if replicas > 1 else packed, among=[layer])
    add_per_layer(structure.latent_kv, ColWiseParallel(), among=attention_layers)  # DeepSeek's kv_b_proj
    add_per_layer(structure.attention_gate, ColWiseParallel(), among=attention_layers)  # each rank its heads' gates
    add_per_layer(structure.o, RowWiseParallel(), among=attention_layers)
    if structure.latent_kv_down and structure.latent_rotary_features:  # DeepSeek's rotary key, one for every head
        add_per_layer(structure.latent_kv_down, ReduceSharedOutputGradient(structure.latent_rotary_features),
                      among=attention_layers)
    if linear is not None:
        _add_linear_attention(add, [f"{layer}.{linear.mixer}" for layer in linear_layers], linear, tp)
    for projection in (structure.gate, structure.up):
        add_per_layer(projection, ColWiseParallel(), among=dense_layers)
    add_per_layer(structure.gate_up, ColWiseParallel(packed_parts=2), among=dense_layers)
    add_per_layer(structure.down, RowWiseParallel(), among=dense_layers)
    add(structure.embedding, RowWiseParallel())  # vocabulary-split embedding, full outputs
    if structure.lm_head_param and (structure.lm_head or not structure.tied_embeddings):
        # An nn.Linear head gathers its logits (the model's loss sees full logits); a bare weight used as
        # `x @ weight` keeps them split and its cross entropy runs vocabulary-parallel. A head tied to the
        # embedding is split on the vocabulary as the embedding is: one weight, one split.
        add(structure.lm_head_param, ColWiseParallel(gather_output=structure.lm_head_layout == "linear"))
    if sequence_parallel:
        # The sequence is split after the embeddings: after the later registered of the token embedding and a learned
        # position embedding, whose lookups the model adds (Megatron scatters that sum). Both run whole on every
        # rank, outside the region (the split's backward gathers the gradient).
        order = {name: i for i, (name, _) in enumerate(model.named_modules())}
        embeddings = [name for name in (structure.embedding, structure.position_embedding) if name in order]
        add(max(embeddings, key=order.get, default=structure.embedding), SequenceParallelBegin())
        # Rows the module holding the layers adds to their hidden states at positions over the whole sequence
        # (Qwen3-VL's deepstack features): this rank's part of them
        holder, _, layers_attribute = structure.layers.rpartition(".")
        if all(forward_takes(model.get_submodule(holder), name) for name in DEEPSTACK_ARGUMENTS):
            add(holder, SequenceSlicedRows(*DEEPSTACK_ARGUMENTS, layers=layers_attribute))
        add_per_layer(structure.attention, SequenceParallelDisable(), among=attention_layers)
        if linear is not None:
            add_per_layer(linear.mixer, SequenceParallelDisable(), among=linear_layers)
        add_per_layer(structure.mlp, SequenceParallelDisable(), among=dense_layers)
        moe_layers = [layer for i, layer in zip(indices, layers) if i in set(structure.moe_layers)]
        for layer in moe_layers:  # each tp rank routes its own slice of the sequence through the whole block
            # Where the block is the layer itself (Gemma 4: router and experts beside the attention and a dense MLP
            # every token runs), all of the layer but its attention, which is a Disable region as in dense layers.
            # A shared expert beside the block (Granite's shared_mlp) runs on the same slice.
            block = f"{layer}.{structure.moe}" if structure.moe else layer
            beside = [f"{layer}.{name}" for name in structure.shared_experts
                      if structure.moe and not name.startswith(f"{structure.moe}.")]
            for part in (block, *beside):
                for name, module in model.get_submodule(part).named_modules():
                    if not structure.moe and f"{name}.".startswith(f"{structure.attention}."):
                        continue
                    if any(True for _ in module.parameters(recurse=False)):
                        add(f"{part}.{name}" if name else part, ShardLocalParameters())
        # Gather the sequence before the final norm: models' code may read its output at the whole sequence's shape
        # (GPTBigCode reshapes it to the input's), and the head takes the whole sequence anyway. One norm on the whole
        # sequence on every rank, as the head is: its weight sees every token, so its gradient needs no sum over the
        # tp ranks. The span between Begin and End is read in registration order (_with_sequence_context): a final
        # norm registered before the layers (OPT's) would leave them out of it, so there the LM head module ends it,
        # as it did for every model before 2026-11-30.
        # Without a final norm (GPT-1, OLMo's parameter-free one, nanochat's functional one), the last decoder layer's
        # output is gathered: model code between the layers and the head may read it at the whole sequence's shape
        # (GPT-1 reshapes it to the input's).
        late_norm = structure.final_norm if order.get(structure.final_norm, -1) > order.get(structure.layers, -1) else None
        end = late_norm or structure.lm_head or structure.final_norm
        if structure.final_norm is None and layers:
            add(layers[-1], SequenceParallelEnd(at_output=True))
        else:
            add(end, SequenceParallelEnd())
    resolved = plan_from_names(model, plan)
    if sequence_parallel and not set(layers) <= resolved.sequence_span:  # a setting not honoured is an error
        raise ValueError(f"tensor_parallel_plan: sequence parallel would leave decoder layers out of its span: the span "
                         f"runs from the embedding to {end!r} in the order the modules are registered, and "
                         f"{sorted(set(layers) - resolved.sequence_span)[:3]} are not between them; register the final "
                         "norm and the head after the layer list, or use tp without sequence parallel")
    return resolved


def _lora_inside_moe_blocks(model: torch.nn.Module, structure) -> str:
    """Why sequence parallel cannot run the model's MoE blocks ('' where it can): each tp rank runs a block on its slice
    of the sequence with the block's parameters swapped in as local tensors around each module's forward, their
    gradients summed over the ranks (ShardLocalParameters), and a LoRA layer inside the block (peft's LoRA on the
    router or the experts' parameters) reads its adapters' weights outside their own forward."""
    names = [f"{structure.layers}.{i}.{structure.moe}" if structure.moe else f"{structure.layers}.{i}"
             for i in structure.moe_layers]
    lora = [f"{name}.{inner}" for name in names for inner, module in model.get_submodule(name).named_modules()
            if inner and is_lora_layer(module)]
    if not lora:
        return ""
    return (f"sequence parallel runs each mixture-of-experts block on this rank's slice of the sequence, its "
            f"parameters' gradients summed over the tp ranks, which the LoRA layers inside it ({lora[:2]}"
            f"{f' and {len(lora) - 2} more' if len(lora) > 2 else ''}) do not allow; use tp without sequence parallel "
            "(the blocks then run whole on every tp rank), or leave the router and the experts out of the LoRA targets")


def _kv_head_replicas(model: torch.nn.Module, layer: str, structure, tp: int) -> int:
    """On how many of the `tp` ranks each key/value head of `layer` is computed: autotune's `head_replicas` of this
    layer's own heads (1 where they cannot be read: no k projection, no head_dim). Heads that tp neither divides
    nor is a multiple of are refused, naming the layer, as are replicas of a packed qkv laid out [q..q k v] per
    key/value head with several of them (autotune.tensor_parallel_problems refuses such a tp first)."""
    if not (structure.k and structure.v or structure.qkv) or tp == 1:
        return 1
    heads = _layer_kv_heads(model, layer, structure)
    name = f"{layer}.{structure.k or structure.qkv}"
    if heads is not None and heads % tp and tp % heads:
        raise ValueError(f"tensor_parallel_plan: {name} computes {heads} key/value heads, which tp={tp} neither "
                         "divides nor is a multiple of; use a tp that divides them or that they divide")
    replicas = 1 if heads is None else head_replicas(heads, tp)
    if replicas > 1 and structure.qkv and structure.qkv_interleaved and heads > 1:
        raise ValueError(f"tensor_parallel_plan: {name} packs [q..q k v] for each of its {heads} key/value heads, "
                         f"which tp={tp} exceeds: their replicas cannot be cut from it; use a tp that divides {heads}")
    return replicas


def _layer_kv_heads(model: torch.nn.Module, layer: str, structure) -> int | None:
    """The key/value heads `layer`'s k projection (or a packed qkv's key part) computes: its outputs over its
    attention's head_dim (None where either cannot be read)."""
    attention = model.get_submodule(f"{layer}.{structure.attention}") if structure.attention else None
    head_dim = readable_attr(attention, "head_dim") if attention is not None else None
    out = structure.qkv_sizes[1] if structure.qkv else getattr(model.get_submodule(f"{layer}.{structure.k}"),
                                                                 "out_features", None)
    if not isinstance(head_dim, int) or not isinstance(out, int) or out % head_dim:
        return None
    return out // head_dim


def _add_linear_attention(add, mixers: list[str], linear, tp: int) -> None:
    """Each linear-attention or state-space mixer split by head, a Mamba-1 mixer or a gated short convolution by
    channel (autotune.model.LinearAttention says how): its projections from the hidden states column-parallel (a
    packed one part by part; a part of fewer units than the `tp` ranks, Mamba-2's B and C of n_groups groups, whole on
    every rank, each keeping its group), its output projection row-parallel, Mamba-1's selective projection
    row-parallel with its output's gradient summed over the mp ranks (ReduceSharedOutputGradient: every rank's
    channels use the whole dt, B and C), the rows of its convolution and per-head parameters this rank's
    (LocalParameterRows, which also localises its head counts and widths), its shared norms (a gated output norm,
    one weight for every head; Jamba's norms over dt, B and C) with their gradients summed over the mp ranks, and a
    norm over groups of heads that tp splits with its statistics summed over the ranks sharing a group
    (SplitGroupNorm); a Mamba-1 or Mamba-2 mixer kept on its torch path, which calls the split modules
    (UnfusedMixerForward)."""
    units = dict(linear.units)
    for mixer in mixers:
        for name, parts in linear.columns:
            add(f"{mixer}.{name}", ColWiseParallel(packed_parts=parts if len(parts) > 1 else 1, part_units=units.get(name)))
        add(f"{mixer}.{linear.output}", RowWiseParallel())
        if linear.row_shared:  # Mamba-1's x_proj: its summed dt, B and C feed every rank's channels
            name, outputs = linear.row_shared
            add(f"{mixer}.{name}", RowWiseParallel(inside_region=True), ReduceSharedOutputGradient(outputs))
        for name in linear.shared:
            add(f"{mixer}.{name}", ShardLocalParameters())
        if linear.kind in ("mamba1", "mamba2"):  # (their fused training kernels take the weights themselves)
            add(mixer, UnfusedMixerForward())
        if linear.group_norm and linear.num_k_heads < tp:
            add(f"{mixer}.{linear.group_norm}", SplitGroupNorm(linear.num_k_heads))
        if linear.whole_norm:  # MiniMax's norm over every head's features: its statistics summed over the ranks
            add(f"{mixer}.{linear.whole_norm}", DistributedNorm())
        add(mixer, LocalParameterRows(rows=dict(linear.rows), counts=linear.counts, dims=dict(linear.row_dims),
                                      units={name: units[name] for name, _ in linear.rows if name in units},
                                      part_counts=dict(linear.part_counts)))


def _attention_layers(structure) -> tuple[int, ...]:
    """The indices of the layers whose token mixer is the structure's `attention`: not linear attention (no scores),
    not a block without a token mixer (Nemotron-H's MLP and MoE blocks, whose `mixer` is no attention)."""
    linear = structure.linear_attention
    replaced = linear.layers if linear and not linear.beside_attention else ()  # (Falcon-H1's runs beside attention)
    other = set(replaced) | set(structure.mixer_free_layers)
    return tuple(i for i in range(structure.num_layers) if i not in other)


def apply_recompute(model: torch.nn.Module, *, layers: str, attention: str | None = None, mode: str,
                    attention_layers: tuple[int, ...] | None = None) -> None:
    """Activation recompute: "full" re-runs each decoder layer of the list `layers` in backward, "selective"
    its `attention` (the part whose activations grow with the sequence, its s x s scores; a name inside the
    layer) in `attention_layers` (None: every layer); the others, whose token mixer is linear attention or that
    have none, have no scores to drop: left as they are (and a linear mixer's tensor-parallel split takes its rows in
    hooks a recomputed forward would not run). The
    forward is wrapped per instance, so parameter names (and checkpoints) do not change, and the recomputation
    re-runs the forward only, not the hooks distcore puts on the module (pipeline inputs, sequence splits), which
    must run once. (torch's composable `checkpoint(module)` re-runs those hooks; a wrapper module renames
    parameters.)"""
    if mode == "selective" and not attention:
        raise ValueError("to_distributed: selective recompute needs the attention module a recognised model "
                         "structure names; use recompute='full'")
    for index, layer in enumerate(model.get_submodule(layers)):
        if mode == "selective" and attention_layers is not None and index not in attention_layers:
            continue
        target = layer if mode == "full" else layer.get_submodule(attention)
        target.forward = functools.partial(_recomputed, target.forward)
        target._tridist_recompute_wrapper = mode  # an overlapped region refuses it (overlap.py)
        layer._tridist_recompute = mode  # a block in global view refuses it (global_view.refuse_recompute)


def _is_cache(value) -> bool:
    """A Hugging Face key/value cache (transformers.cache_utils.Cache), without importing transformers."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(value, cache_utils.Cache)


def _recomputed(forward, *args, **kwargs):
    """`forward` under activation checkpointing while gradients are recorded. A key/value cache passed in
    (Hugging Face models build one whenever `config.use_cache`) would get the keys appended twice, once
    by the forward and again by the recomputation, which then attends over both: the cache is left out,
    as Hugging Face's own gradient checkpointing turns `use_cache` off in training. By keyword or by
    position (GPT-2's blocks take it second)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    args = tuple(None if _is_cache(value) else value for value in args)
    kwargs = {key: None if key in CACHE_ARGUMENTS or _is_cache(value) else value for key, value in kwargs.items()}
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
