"""Pipeline parallelism (`pp_config`) behind the user's plain training loop, on torch.distributed.pipelining.

How a model written for one device becomes pipeline stages, without tracing it:

- `split_spec` names the decoder-layer list (split evenly; where the stages do not divide the layers,
  the first and last stages, which also run the embedding and the LM head, get a layer fewer, as
  autotune's `stage_layers`; or as `layers_per_stage` lists) or exact split points
  (`{"llama.layers.1": SplitPoint.END}`). Stage `s` owns its layers; modules the forward calls before the
  layer list (the embedding) belong to the first stage, those it calls after it (final norm, LM head) to the
  last: the order of the calls is seen in one forward on fake tensors (shapes only) of 8 token ids, or, where
  that cannot run, taken from the order the modules are registered in. Bare parameters of the containers go where
  that forward reads them (the seed's LM-head `weight`: the last stage), or, unread, with the modules beside them
  it does not call (LLaVA-NeXT's `image_newline`, with the vision tower: the first stage). Parameter-free modules (rotary tables, masks, `global_spec` layers) run on every
  stage.
- Each stage is a *view* of the model: a shallow copy of the containers on the path to the layer
  list, sharing every owned module, with modules of other stages replaced by parameter-free
  stand-ins. Parameter names stay the model's own, so checkpoints move between strategies.
- A stage runs the model's own `forward` on its micro-batch. A stand-in of an earlier stage returns
  zeros of the right shape (computed on the meta device), so the code before the layers (masks,
  positions from the embedding output) runs as written; the stage's first layer then takes the
  activation received from the previous stage instead. A stand-in of a later stage ends the stage:
  its output is the last owned layer's.
- torch's schedules (1F1B, GPipe, interleaved 1F1B) drive the stages. `model(inputs, labels=...)`
  runs the whole schedule (forward and backward of every micro-batch) and returns the mean loss on
  every rank. The call's gradients are kept apart until the `loss.backward()` in the user's loop adds them to
  the parameters', times the factor the loop scaled the loss by (`(loss / accumulation_steps).backward()`, a
  loss scaler), as one device's backward would: a zero_grad() between the call and its backward clears only
  earlier gradients, a loss that gets no backward adds nothing, losses may get their backward in any order,
  each once (a second one raises), and a call's gradients live as long as its loss's graph. The schedule's
  backward runs at the factor the loop applied to the previous loss, and the loss's backward corrects by the
  ratio of the two (1 while the factor holds), so a loss scaler's factor reaches an fp16 backward as on one
  device. The first call, before any factor is known, runs at torch.amp.GradScaler's default init_scale
  (PROVISIONAL_SCALE, 65,536: exact for a loop with that scaler; for fp32 and bf16 a power of two that the
  correction undoes exactly; an fp16 loop with a lower factor whose first call overflows at 65,536 gets that
  call's gradients non-finite, with a warning, so its scaler skips the step). The call after the factor changed
  ran at the old factor, so a scaler's back-off after an overflow takes effect one call later (one more skipped
  step; the scale settles one halving lower; a factor that changes at every call, such as a token-weighted
  loss's, runs each backward at the last one's, which in fp16 can overflow where one device would not). A non-finite
  gradient on one rank is made visible on every rank, so a scaler skips the step everywhere
  (_agree_on_non_finite: one all-reduce at each loss's backward, so every rank calls backward() on a returned
  loss, or none does, as under DDP and FSDP). Gradients accumulate over calls, also across evaluations and batches of other
  shapes (which re-run torch's shape inference).

Semantics and limits worth knowing:
- The loss (and gradient) is the mean of the micro-batch losses, as in Megatron-LM and Paddle. With
  ignored labels (padding, ignore_index) spread unevenly, that is the global token mean only for models
  that take `num_items_in_batch` (Hugging Face's causal LMs: token_mean.py passes the global count); a
  model that averages its own loss over uneven micro-batches gets an error naming the fix. A micro-batch
  whose labels are all ignored has torch's 0/0 = nan mean loss, so the reported loss is nan (its
  gradient is zero).
- An exception in one stage's forward (a shape error) stops that rank only; the other ranks of the
  pipeline wait for it in their communication until the process group's timeout, as with torch's
  pipelining. Debug a model on one device (or with pp=1) first. A training call without labels is
  not such an exception: the schedule completes (on a zero loss) and every rank raises the same error.
- A call in eval mode (`model.eval()`), or under no_grad, runs the schedule's forward only: its loss
  has no backward (one raises an error saying so). It returns its pipeline's loss (not averaged over
  data-parallel replicas, as data parallel does), so one replica may evaluate alone where its forward
  needs no other (sharding_level 0); with labels, the loss is the token mean of the batch it was given
  (Hugging Face models), without labels there is none (None in its place). It also returns the logits
  of the whole batch (the last stage's micro-batches joined), by default on every rank of the pipeline
  (one broadcast from the last stage: each rank then holds what one device would); `pp_config
  ["eval_logits"]` = "last_stage" keeps them on the last stage's ranks (None elsewhere, no
  communication), "none" keeps none (an evaluation of the loss alone).
- Each rank's model holds its own stages' parameters only: `torch.nn.utils.clip_grad_norm_(
  model.parameters(), ...)` computes and clips by this rank's norm, not the whole model's;
  `distcore.clip_grad_norm_(model, ...)` (clip.py) sums the stages' norms over the pp group, counting a
  weight tied across stages (an embedding and its LM head: TiedAcrossStages) on its first stage only.
- `model(...)` returns what the model returns, rebuilt on every rank: a bare loss, a tuple, a dict or a
  Hugging Face `ModelOutput`, with the global loss in its place and, in an evaluation, the logits in
  theirs. Other outputs are None (a training call's logits too: the schedule frees each micro-batch's),
  as are hidden states and caches, which other stages computed in part. Inputs may be positional or keywords
  (`model(input_ids=..., attention_mask=..., labels=...)`); every batch-major tensor is split.
- Outputs of an earlier stage's module other than the hidden states (a second tuple element: a mask it
  builds, an auxiliary loss) are zeros on later stages (a warning says so). A layer of a later stage that
  computes with a stand-in's zeros (HY V4's top-k indices from the layer before; RoFormer's positions from
  a module with parameters before the layers) is an error naming the argument and the module; taking them
  unused is not (GLM-MoE-DSA). A module placed on an earlier stage but called after this stage's layers
  (one registered before them, where the call-order probe could not run) is an error naming it.

Tensor and data parallelism are applied to each stage view (FSDP2 with the view as root, as torch's
pipelining expects), so dp x mp x pp composes.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import enum
import inspect
import logging
import math
import re
import warnings
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining import SplitPoint as _TorchSplitPoint
from torch.distributed.tensor import DTensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.weak import WeakTensorKeyDictionary
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..autotune.strategy import stage_layers
from ..kernels.fuse import forward_takes, labelled_call, looks_like_stacked_experts
from .api import local_value
from . import env
from .env import all_reduce_mean_
from .fake_tensor_log import expected_failures_unlogged
from .outputs import CACHE_ARGUMENTS, OutputForm, find_logits, find_loss
from .sample_rows import KNOWN_LAYOUTS, SampleRows, sample_count, sample_rows_of, split_samples
from .tensor_parallel import take_pending_split, tied_parameter_names
from .unused_parameters import trackers_of

log = logging.getLogger(__name__)


class SplitPoint(enum.Enum):
    """Paddle's split points: a stage boundary before (BEGINNING) or after (END) the named layer."""

    BEGINNING = "beginning"
    END = "end"


_SCHEDULES = {  # Paddle's schedule_mode names, and torch's
    "1F1B": Schedule1F1B,
    "GPipe": ScheduleGPipe,
    "FThenB": ScheduleGPipe,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "VPP": ScheduleInterleaved1F1B,
}
_INTERLEAVED = {"Interleaved1F1B", "VPP"}
PP_KEYS = ("split_spec", "global_spec", "schedule", "micro_batches", "accumulate_steps", "virtual_pp_degree", "vpp_degree",
           "layers_per_stage", "eval_logits")
# Where an evaluation's logits are returned: on every rank of the pipeline (one broadcast from the last
# stage: each rank then holds what one device would), on the last stage's ranks only (None elsewhere,
# no communication), or nowhere (an evaluation of the loss alone keeps no logits).
EVAL_LOGITS = ("every_rank", "last_stage", "none")
# The factor the first training call's backward runs at, before the loop's is known (PipelineRunner): a loss
# scaler's usual one (torch.amp.GradScaler's default init_scale), without which fp16 gradients underflow; a power
# of two, so the correction to the loop's factor is exact wherever the gradients stay in range.
PROVISIONAL_SCALE = 65536.0


# ------------------------------------------------------------------------------------------ the config


@dataclass
class PipelineConfig:
    layer_list: str  # qualified name of the nn.ModuleList holding the decoder layers
    stage_starts: list[int]  # first layer index of each stage, in stage order
    num_layers: int
    schedule: str
    micro_batches: int
    chunks_per_rank: int  # > 1: interleaved (virtual) stages, rank r holds stages r, r + pp, ...
    eval_logits: str = "every_rank"  # one of EVAL_LOGITS
    sample_rows: SampleRows | None = None  # a vision-language model's media: their rows split by samples

    @property
    def num_stages(self) -> int:
        return len(self.stage_starts)

    def stage_of_layer(self, index: int) -> int:
        return max(s for s, start in enumerate(self.stage_starts) if start <= index)


def parse_pp_config(model: torch.nn.Module, pp_config: dict, *, pp: int) -> PipelineConfig:
    """Validate `pp_config` against the model and the mesh's pp degree; errors say how to fix it."""
    unknown = sorted(set(pp_config) - set(PP_KEYS))
    if unknown:
        raise ValueError(f"parallelize: unknown pp_config key(s) {unknown}; valid keys are {list(PP_KEYS)}")
    if "split_spec" not in pp_config:
        raise ValueError("parallelize: pp_config needs 'split_spec' (the decoder-layer list's name, e.g. 'llama.layers')")
    schedule = pp_config.get("schedule", "1F1B")
    if schedule not in _SCHEDULES:
        raise ValueError(f"parallelize: pp_config['schedule'] = {schedule!r}; choose one of {list(_SCHEDULES)}")
    chunks = pp_config.get("virtual_pp_degree", pp_config.get("vpp_degree", 2 if schedule in _INTERLEAVED else 1))
    if schedule not in _INTERLEAVED and chunks != 1:
        raise ValueError(f"parallelize: virtual_pp_degree={chunks} needs an interleaved schedule ('Interleaved1F1B')")
    if schedule in _INTERLEAVED and chunks < 2:
        raise ValueError("parallelize: the interleaved schedule needs virtual_pp_degree >= 2 stages per rank")
    # 1F1B needs at least one micro-batch per stage; a larger number shrinks the bubble (p-1)/(m+p-1).
    micro_batches = pp_config.get("micro_batches", pp_config.get("accumulate_steps", pp))
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"parallelize: pp_config['micro_batches'] must be a positive integer, got {micro_batches!r}")
    num_stages = pp * chunks
    if schedule == "1F1B" and micro_batches < num_stages:
        raise ValueError(
            f"parallelize: the 1F1B schedule needs at least one micro-batch per stage ({num_stages}), got "
            f"micro_batches={micro_batches}; raise pp_config['micro_batches'] or use schedule='GPipe'"
        )
    layer_list, starts, num_layers = _split_layers(model, pp_config["split_spec"], num_stages=num_stages,
                                                   layers_per_stage=pp_config.get("layers_per_stage"))
    _check_global_spec(model, pp_config.get("global_spec"))
    eval_logits = pp_config.get("eval_logits", "every_rank")
    if eval_logits not in EVAL_LOGITS:
        raise ValueError(f"parallelize: pp_config['eval_logits'] = {eval_logits!r}; choose one of {list(EVAL_LOGITS)}")
    return PipelineConfig(layer_list, starts, num_layers, schedule, micro_batches, chunks, eval_logits,
                          sample_rows_of(model))


def _split_layers(model: torch.nn.Module, split_spec, *, num_stages: int,
                  layers_per_stage=None) -> tuple[str, list[int], int]:
    """The layer list and each stage's first layer. A layer-list name splits it as autotune's cost model
    prices it (`stage_layers`: equal stages, or where the stage count does not divide the layers, a layer
    fewer on the first and last stages), or as `layers_per_stage` lists; a dict gives SplitPoints."""
    modules = dict(model.named_modules())
    if layers_per_stage is not None and not isinstance(split_spec, str):
        raise ValueError("parallelize: pp_config layers_per_stage goes with a layer-list name as split_spec, not SplitPoints")
    if isinstance(split_spec, str):
        lists = [n for n, m in modules.items() if n and isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]
        matched = [n for n in lists if n == split_spec or re.fullmatch(split_spec, n)]
        if len(matched) != 1:
            nearest = difflib.get_close_matches(split_spec, lists, n=3, cutoff=0.3)
            raise ValueError(
                f"parallelize: pp_config split_spec {split_spec!r} must name one layer list of the model; "
                f"it matches {matched or 'none'}" + (f"; layer lists: {nearest}" if nearest else "")
            )
        layers = len(modules[matched[0]])
        if layers_per_stage is None:
            if layers < num_stages:
                raise ValueError(
                    f"parallelize: split_spec {split_spec!r} has {layers} layers, fewer than the {num_stages} pipeline "
                    "stages (x virtual stages) of the mesh; each stage needs one layer at least: use fewer stages"
                )
            sizes = stage_layers(layers, num_stages)
        else:
            sizes = list(layers_per_stage) if isinstance(layers_per_stage, (list, tuple)) else None
            if (sizes is None or len(sizes) != num_stages or sum(sizes) != layers
                    or not all(isinstance(n, int) and n >= 1 for n in sizes)):
                raise ValueError(
                    f"parallelize: pp_config layers_per_stage = {layers_per_stage!r} must list {num_stages} positive "
                    f"layer counts (one per stage, x virtual stages) adding up to the {layers} layers of {split_spec!r}"
                )
        starts = [sum(sizes[:stage]) for stage in range(num_stages)]
        return matched[0], starts, layers
    if not isinstance(split_spec, dict) or not split_spec:
        raise TypeError("parallelize: pp_config split_spec must be a layer-list name or a dict {layer name: SplitPoint}")
    boundaries, parents = set(), set()
    for key, point in split_spec.items():
        point = _as_split_point(point, key)
        names = [n for n in modules if n and re.fullmatch(key, n)]
        if not names:
            nearest = difflib.get_close_matches(key, [n for n in modules if n], n=3, cutoff=0.4)
            raise ValueError(f"parallelize: split_spec key {key!r} matches no module" + (f"; nearest names: {nearest}" if nearest else ""))
        for name in names:
            parent, _, index = name.rpartition(".")
            if not index.isdigit() or not isinstance(modules.get(parent), (torch.nn.ModuleList, torch.nn.Sequential)):
                raise ValueError(
                    f"parallelize: split point {name!r} is not a layer of a layer list; pipeline stages split between "
                    "the decoder layers of one nn.ModuleList (e.g. 'llama.layers.1': SplitPoint.END)"
                )
            parents.add(parent)
            boundaries.add(int(index) + (1 if point is SplitPoint.END else 0))
    if len(parents) != 1:
        raise ValueError(f"parallelize: split points must all be in one layer list, got layers of {sorted(parents)}")
    layer_list = parents.pop()
    num_layers = len(modules[layer_list])
    boundaries.discard(0)
    boundaries.discard(num_layers)
    starts = [0, *sorted(boundaries)]
    if len(starts) != num_stages:
        raise ValueError(
            f"parallelize: split_spec cuts {layer_list!r} into {len(starts)} stages, but the mesh's pp dimension "
            f"(x virtual stages) needs {num_stages}; give {num_stages - 1} split point(s)"
        )
    return layer_list, starts, num_layers


def _as_split_point(point, key: str) -> SplitPoint:
    if isinstance(point, SplitPoint):
        return point
    if isinstance(point, _TorchSplitPoint):  # torch's enum: same meaning, different values
        return SplitPoint[point.name]
    if isinstance(point, str) and point.upper() in SplitPoint.__members__:
        return SplitPoint[point.upper()]
    raise TypeError(f"parallelize: split_spec[{key!r}] = {point!r}; use distcore.SplitPoint.END or .BEGINNING")


def _check_global_spec(model: torch.nn.Module, global_spec) -> None:
    """Global layers run on every stage; with parameters, each stage would train its own copy."""
    if global_spec is None:
        return
    for key in [global_spec] if isinstance(global_spec, str) else list(global_spec):
        matched = [(n, m) for n, m in model.named_modules() if n and re.fullmatch(key, n)]
        if not matched:
            raise ValueError(f"parallelize: pp_config global_spec {key!r} matches no module of the model")
        for name, module in matched:
            if next(module.parameters(), None) is not None:
                raise NotImplementedError(
                    f"parallelize: global layer {name!r} has parameters; a global layer is duplicated on every stage, "
                    "which is meant for parameter-free layers (positions, masks, rotary tables): move its parameters "
                    "into the first stage's modules"
                )


# ------------------------------------------------------------------------------------------ stage views


class _StageExit(BaseException):
    """Raised by a later stage's stand-in: this stage's part of the forward is done. A BaseException so
    that model code catching Exception cannot swallow it."""


@dataclass
class _StageState:
    """What one stage's forward needs while the model's own forward runs."""

    stage: int
    is_first: bool
    is_last: bool
    micro_batch: int = 0
    received: torch.Tensor | None = None  # the previous stage's activation
    last_placeholder: torch.Tensor | None = None  # the output of the stand-in just before our first layer
    # every stand-in's zeros in this forward, by their memory: StorageWeakRef -> (the stand-in's name, its stage)
    stand_in_zeros: dict = field(default_factory=dict)
    last_output: object = None  # our last layer's output (None: it has not run in this micro-batch's forward)
    output_form: OutputForm | None = None  # the kind of output the model returned (last stage)
    keep_logits: bool = False  # this call is an evaluation whose logits are returned (last stage)
    logits: dict = field(default_factory=dict)  # micro-batch -> its logits, detached (last stage, evaluation)
    missing_loss: bool = False  # a micro-batch's output held no loss (last stage)
    device: torch.device | None = None  # where this stage's parameters live (what another stage's reads as)
    # The dtype the parameters compute in, where it is not theirs (FSDP2's mixed precision: bf16 over fp32): another
    # stage's module computes in it, so its stand-in's zeros have it too
    compute_dtype: torch.dtype | None = None


# torch's errors for operands of two floating dtypes (bmm, baddbmm, scaled_dot_product_attention: their meta kernels
# check; matmul's and addmm's do not)
_MIXED_DTYPES = re.compile(r"expected scalar type \S+ but found|dtypes must be the same|to have the same dtype")


class _StandIn(torch.nn.Module):
    """Takes the place of a module owned by another stage; holds no parameters.

    Before this stage ("earlier"): returns zeros shaped like the real output (computed by running a
    meta-device copy), so model code between modules runs unchanged. After it ("later"): ends the
    stage. In the user-facing model (no stage running) it only reports where the module lives.
    """

    _tridist_stand_in = True

    def __init__(self, name: str, owner: int, meta_module: torch.nn.Module | None, state: _StageState | None, role: str,
                 plain: dict | None = None):
        super().__init__()
        # (underscored: the module's own public settings, `_plain`, may be called name, owner or role)
        self._tridist_name, self._tridist_owner, self._tridist_role = name, owner, role
        self.__dict__["_meta_module"] = meta_module  # not a submodule: no parameters, no state_dict entries
        self.__dict__["_state"] = state
        self.__dict__["_plain"] = plain or {}

    @property
    def tridist_stage(self) -> int:
        """The pipeline stage that holds the module this stands in for."""
        return self._tridist_owner

    def forward(self, *args, **kwargs):
        state, name, owner = self._state, self._tridist_name, self._tridist_owner
        if state is None or self._tridist_role == "elsewhere":
            raise RuntimeError(f"pipeline parallel: {name!r} runs on pipeline stage {owner}, not on this rank")
        if self._tridist_role == "later":
            if state.last_output is None:  # this stage's last layer has not run: the stage cannot end here
                raise RuntimeError(
                    f"pipeline parallel: stage {state.stage} calls {name!r}, placed on stage {owner} as a "
                    "module that runs after the decoder layers (where the probe forward called it, or else where it "
                    "is registered), before its own last layer ran; the model calls it before or between the layers, "
                    "which no split into stages serves: "
                    "use pp=1 for this model")
            raise _StageExit()
        if state.last_output is not None:  # a final norm registered before the layers, the probe forward failing
            raise RuntimeError(
                f"pipeline parallel: stage {state.stage} calls {name!r} after its own layers, but it is placed on "
                f"stage {owner} as a module that runs before the decoder layers (where the probe forward called "
                "it, or else where it is registered); this stage would compute from its stand-in's zeros: register "
                "it after the layer list, or use "
                "pp=1 for this model")
        device = _device_of(args, kwargs)
        try:
            meta_out = self._meta_run(args, kwargs)
        except Exception as error:  # noqa: BLE001 - any failure of the model's code on meta tensors, named
            if state.compute_dtype is not None and _MIXED_DTYPES.search(str(error)):
                cause = (f"its inputs mix fp32 and {state.compute_dtype}: under mixed precision the model's code took "
                         "a dtype from a tensor this stage holds in fp32, such as its first parameter outside FSDP2's "
                         "forward (GPT-1's attention mask); train it with pp=1 or without mixed precision")
            else:
                cause = ("its code needs values there, data-dependent code such as a router's expert counts: use pp=1 "
                         "for this model")
            raise RuntimeError(
                f"pipeline parallel: stage {state.stage} runs {name!r} (stage {owner}'s) on the meta device to "
                f"shape the zeros standing in for its output, and {cause} ({type(error).__name__}: {error})") from error
        output = tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) else t, meta_out)
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        state.last_placeholder = first if isinstance(first, torch.Tensor) else None
        zeros = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        for tensor in zeros:  # for the layers' guard (_guard_stand_in_zeros)
            if tensor.numel():
                state.stand_in_zeros[StorageWeakRef(tensor.untyped_storage())] = (name, owner)
        if len(zeros) > 1 and not self.__dict__.get("_warned"):
            self.__dict__["_warned"] = True
            warnings.warn(
                f"pipeline parallel: {name!r} (stage {owner}) returns several tensors; stage {state.stage} "
                "sees zeros for all but the first (which the received activation replaces): a mask, a cache or an "
                "auxiliary loss it computes does not reach later stages. Compute those outside the module, from "
                "the inputs, or in a parameter-free module (those run on every stage)",
                stacklevel=2,
            )
        return output

    def _meta_run(self, args, kwargs):
        """The module's meta copy run on the call's inputs on the meta device; where its code needs the values of
        its integer inputs (a vision tower's patch counts from its grid), with those real (`_MetaWhereMeta`), from
        then on (the first way costs no dispatch per op: a text model's embedding)."""
        if not self.__dict__.get("_integers_real"):
            try:
                with torch.no_grad():
                    return self._meta_module(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            except Exception:  # noqa: BLE001 - answered by the run with real integers, whose error is raised
                self.__dict__["_integers_real"] = True
        with torch.no_grad(), _MetaWhereMeta():
            return self._meta_module(*tree_map(_to_meta_but_integers, args), **tree_map(_to_meta_but_integers, kwargs))

    def __getattr__(self, attribute: str):
        try:
            return super().__getattr__(attribute)
        except AttributeError:
            pass
        plain = self.__dict__.get("_plain", {})
        if attribute in plain:  # the module's own setting (Nemotron-H's block_type, read by its model's forward)
            return plain[attribute]
        meta = self.__dict__.get("_meta_module")
        state = self.__dict__.get("_state")
        name, owner = self.__dict__.get("_tridist_name"), self.__dict__.get("_tridist_owner")
        held = None
        if meta is not None:
            held = meta._parameters.get(attribute)
            held = meta._buffers.get(attribute) if held is None else held
        if held is not None and state is not None and state.device is not None:
            return _ForeignTensor(f"{name}.{attribute}", owner, held, state.device)
        if attribute in ("dtype", "device") and meta is not None and state is not None and state.device is not None:
            # transformers' PreTrainedModel.dtype / .device (its parameters'), read around the module's call
            # (Qwen2-VL: pixel_values.type(self.visual.dtype)): the dtype its parameters have, this stage's device
            first = next((p for p in meta.parameters() if p.is_floating_point()), None)
            if first is not None:
                return first.dtype if attribute == "dtype" else state.device
        raise AttributeError(
            f"pipeline parallel: {name!r} lives on pipeline stage {owner}; its {attribute!r} is not on this "
            "rank. Model code that reads it outside that module's own forward cannot run on another stage: use a "
            "strategy without pipeline parallel for this model (pp=1)"
        )

    def extra_repr(self) -> str:
        return f"{self._tridist_name!r} on stage {self._tridist_owner}"


_PLAIN_TYPES = (str, int, float, bool, type(None))


def _plain_attributes(module: torch.nn.Module) -> dict:
    """The public attributes of `module` that are plain immutable values (strings, numbers, booleans, None and tuples
    of them): its settings, as a layer's `block_type` or `layer_idx`. A stand-in answers them as the module would:
    model code reads such settings outside the module's forward (Nemotron-H's model picks each layer's mask by its
    block_type) on every stage. Tensors, modules, configs and other mutable objects are left out (reading one still
    raises, naming the stage that holds the module)."""
    def plain(value) -> bool:
        return isinstance(value, _PLAIN_TYPES) or isinstance(value, tuple) and all(map(plain, value))

    return {k: v for k, v in vars(module).items() if not k.startswith("_") and plain(v)}


class _ForeignTensor:
    """What another stage's parameter or buffer reads as in model code that runs on this stage (Llama 4:
    `input_ids.to(self.embed_tokens.weight.device)`): its shape and dtype, and this stage's device. Its values
    are not here: anything but those reads raises, naming the tensor."""

    def __init__(self, name: str, owner: int, meta: torch.Tensor, device: torch.device):
        self.name, self.owner, self.shape, self.dtype, self.device = name, owner, meta.shape, meta.dtype, device
        self.ndim = meta.dim()

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.ndim

    def __getattr__(self, attribute: str):
        raise AttributeError(
            f"pipeline parallel: model code on this stage uses {self.name!r} ({attribute!r}), a tensor of pipeline stage "
            f"{self.owner}; only its shape, dtype and device can be read here. Use a strategy without pipeline "
            "parallel for this model (pp=1)"
        )

    def __getitem__(self, index):  # BigBird's code indexes another stage's weight
        return self.__getattr__("__getitem__")

    def __repr__(self) -> str:
        return f"_ForeignTensor({self.name!r} of stage {self.owner}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _device_of(args, kwargs) -> torch.device:
    leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.device.type != "meta"]
    return leaves[0].device if leaves else torch.device("cpu")


def _to_meta(x):
    if isinstance(x, DTensor):
        x = x.to_local()
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _to_meta_but_integers(x):
    """A stand-in's input on the meta device, but for integer and boolean tensors, which keep their values: the
    shapes a module computes from them (a vision tower's patches per image, from its grid's t, h, w) are read there
    (`_MetaWhereMeta` takes them to the meta device where they meet a meta tensor)."""
    if isinstance(x, DTensor):
        x = x.to_local()
    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
        return x.to("meta")
    return x


class _MetaWhereMeta(TorchDispatchMode):
    """An op that takes a meta tensor takes its other tensors (of one dim or more: scalars mix) on the meta device
    too, so a stand-in's meta run computes shapes from the real integers it was given (`_to_meta_but_integers`) and meta values
    from everything else; ops on those integers alone run for real (cu_seqlens from a grid, `.tolist()` of them).
    An integer or boolean tensor sent to the meta device explicitly stays where it is (LFM2-VL's vision tower takes its
    patch mask to its embeddings' device, then asks `mask.all()`): it meets meta tensors in the ops above."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func is torch.ops.aten._to_copy.default and (kwargs or {}).get("device") == torch.device("meta")
                and not args[0].is_meta and not (args[0].is_floating_point() or args[0].is_complex())):
            kwargs = {key: value for key, value in kwargs.items() if key != "device"}
        leaves = [x for x in tree_flatten((args, kwargs or {}))[0] if isinstance(x, torch.Tensor)]
        if any(x.is_meta for x in leaves):
            args, kwargs = tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) and not x.is_meta
                                    and x.dim() > 0 else x, (args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _meta_copy(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A copy of `module` whose parameters and buffers live on the meta device (no memory), its floating-point
    parameters in `compute_dtype` where given (as FSDP2's mixed precision casts them for the forward; buffers stay). A
    mixture of experts' routed experts (Hugging Face's stacked experts: their routing loops read token indices, which
    meta tensors do not hold) become `_MetaExperts`, which give the output's shape only."""
    memo = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(local_value(tensor), device="meta",
                                dtype=_computed_in(tensor, compute_dtype) if isinstance(tensor, torch.nn.Parameter) else None)
        memo[id(tensor)] = torch.nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else meta
    copied = copy.deepcopy(module, memo)
    for name, child in list(copied.named_modules()):
        if name and _meta_replaceable_experts(child):
            parent, _, leaf = name.rpartition(".")
            (copied.get_submodule(parent) if parent else copied)._modules[leaf] = _MetaExperts()
    return copied


def _computed_in(param: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `param` computes in: `compute_dtype` for a floating-point one where given (mixed precision)."""
    return compute_dtype if compute_dtype is not None and param.is_floating_point() else param.dtype


def _meta_replaceable_experts(module: torch.nn.Module) -> bool:
    """Hugging Face's stacked experts: gated (`looks_like_stacked_experts`) or not (Nemotron-H's ReLU² experts: 3-D
    `up_proj` and `down_proj` of the module itself)."""
    params = module._parameters
    return looks_like_stacked_experts(module) or all(
        isinstance(params.get(n), torch.Tensor) and params[n].dim() == 3 for n in ("up_proj", "down_proj"))


class _MetaExperts(torch.nn.Module):
    """Routed experts on the meta device, for the shape of an earlier stage's output: Hugging Face's experts
    interface, `forward(hidden_states, top_k_index, top_k_weights)`, returns a tensor shaped like its input."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.empty_like(hidden_states)


def _shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object sharing `module`'s children and tensors but with its own containers
    (children, parameters, hooks), so a stage can change its copy without touching the model."""
    view = copy.copy(module)
    for key, value in vars(module).items():
        if key.startswith("_") and isinstance(value, (dict, set)):
            view.__dict__[key] = copy.copy(value)
    return view


@dataclass
class _Placement:
    """Which stage owns each module of the model (by qualified name)."""

    path: set[str]  # containers from the root to the layer list (copied per stage)
    owner: dict[str, int] = field(default_factory=dict)  # module name -> stage (absent: every stage)
    bare: dict[str, int] = field(default_factory=dict)  # bare parameter of a container on the path -> stage


def _path_to(layer_list: str) -> set[str]:
    """The containers from the root to the layer list, the list included: "", "model", "model.layers"."""
    parts = layer_list.split(".")
    return {""} | {".".join(parts[: i + 1]) for i in range(len(parts))}


def _outside_modules(model: torch.nn.Module, layer_list: str) -> dict[str, bool]:
    """The modules with parameters beside the path from the root to the layer list (children of its containers),
    each True where it is registered after the path (so placed on the last stage) and False before (the first).
    Parameter-free modules (rotary tables, masks, global layers) run on every stage and are not listed."""
    path = _path_to(layer_list)
    modules = dict(model.named_modules())
    after = {}
    for container in sorted(path - {layer_list}, key=len):
        children = list(modules[container]._modules.items())
        path_index = next(i for i, (n, _) in enumerate(children) if _join(container, n) in path)
        for i, (child_name, child) in enumerate(children):
            name = _join(container, child_name)
            if name in path or child is None or next(child.parameters(), None) is None:
                continue
            after[name] = i > path_index
    return after


def embeddings_after_layers(model: torch.nn.Module, layer_list: str) -> list[str]:
    """Modules with an embedding inside, registered after the decoder-layer list in a container on its path.
    Stages give such a module to the last stage (as a final norm or an LM head: `_placement`), but an embedding is
    looked up before the layers, and what it computes reaches every layer beside the hidden states (Gemma 3n's
    and Gemma 4's per-layer inputs): no split into stages computes it where it is used."""
    modules = dict(model.named_modules())
    return [name for name, after in _outside_modules(model, layer_list).items()
            if after and any(isinstance(m, torch.nn.Embedding) for m in modules[name].modules())]


# Ops whose outputs take only their inputs' shape, dtype and device (Inkling 2's `inputs_embeds.new_zeros(...)`)
_SHAPE_ONLY = {"new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like", "full_like",
               "rand_like", "randn_like", "randint_like"}


class _Sources(TorchFunctionMode):
    """Which marked tensors each tensor is computed from: every torch op's outputs come from its inputs' sources.
    Also where (`position[0]` at the time) each of the `watched` tensors (id -> name) is first read by an op."""

    def __init__(self, watched: dict[int, str] | None = None, position: list[str] | None = None):
        super().__init__()
        self.sources = WeakTensorKeyDictionary()
        self.watched, self.position = watched or {}, position
        self.reads: dict[str, set[str]] = {}  # watched name -> the positions it was read at

    def of(self, value) -> frozenset:
        return frozenset().union(*(self.sources.get(t, frozenset()) for t in tree_flatten(value)[0]
                                   if isinstance(t, torch.Tensor)))

    def mark(self, value, sources: frozenset) -> None:
        for tensor in tree_flatten(value)[0]:
            if isinstance(tensor, torch.Tensor):
                self.sources[tensor] = sources

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.watched:
            for tensor in tree_flatten((args, kwargs))[0]:
                if isinstance(tensor, torch.Tensor) and id(tensor) in self.watched:
                    self.reads.setdefault(self.watched[id(tensor)], set()).add(self.position[0])
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in _SHAPE_ONLY:
            return out
        inputs = self.of((args, kwargs))
        if inputs:
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    self.sources[tensor] = self.sources.get(tensor, frozenset()) | inputs
        return out


@dataclass
class ForwardProbe:
    """What one forward of the whole model shows about the modules beside its layer list (`probe_forward`)."""

    after: dict[str, bool]  # module -> first called after the last layer (True) or before the first (False)
    reused: list[str]  # what the loss and logits are computed from besides the last layer and the modules after it
    # bare parameter of a container on the path to the layer list -> where ops read it ("before", "between",
    # "after" the layers); absent: not read (it serves inputs the probe does not give: LLaVA-NeXT's image_newline)
    bare_reads: dict[str, frozenset[str]] = field(default_factory=dict)


def probe_forward(model: torch.nn.Module, layer_list: str) -> ForwardProbe | None:
    """One forward of `model(ids, labels=ids)` on 8 token ids (labels where the forward takes them), under no_grad in
    the model's own mode, watching the modules beside the layer list (`_outside_modules`) and the layers: where each
    module is first called (before the first layer or after the last one; one called between them is left out), and
    what the loss and the logits are computed from, each layer's hidden-state input counted as received (as a
    pipeline stage receives it). Any other layer's output, or the output of a module called before the layers, that
    reaches them is `reused`: on a later stage it would be a stand-in's zeros (an ELMo-style mix of every layer's
    output, Zamba's embeddings beside each layer, RoFormer's sinusoidal positions, CPM-Ant's position bias). And
    where ops read each bare parameter of the containers on the path to the layer list (`bare_reads`).

    On fake tensors (FakeTensorMode: shapes only, no weight read, no memory) where the model's code allows, else on
    the real weights (a router's data-dependent shapes: a forward of 8 tokens); None where neither runs (values read
    on the meta device): the caller then places modules by where they are registered.

    Kept on the model for a second ask about the same model (to_distributed asks before fusing the kernels, the
    pipeline after; each drops it when done): the key is the layer list, the mode and every parameter's name and
    identity. Fusion keeps them (its modules take the originals' parameters) and computes the same function, so the
    same data flow; any other change of the model's parameters (sharding, a module replaced) asks again."""
    named = list(model.named_parameters(remove_duplicate=False))
    key = (layer_list, model.training, tuple(name for name, _ in named))
    kept = vars(model).get("_tridist_forward_probe")
    if kept is not None and kept[0] == key and all(ref() is p for ref, (_, p) in zip(kept[1], named)):
        return kept[2]
    probe = _probe_forward(model, layer_list)
    # Weak references: an id could be reused by a replacement parameter once the original is freed
    model._tridist_forward_probe = (key, [weakref.ref(p) for _, p in named], probe)
    return probe


def _probe_forward(model: torch.nn.Module, layer_list: str) -> ForwardProbe | None:
    modules = dict(model.named_modules())
    layers = list(modules[layer_list])
    parameter = next(model.parameters(), None)
    if not layers or parameter is None:
        return None
    outside = {name: modules[name] for name in _outside_modules(model, layer_list)}
    bare = _bare_parameters(model, layer_list)
    versions = [(name, p, p._version) for name, p in model.named_parameters()]
    probe = None
    for fake in (True, False):
        if not fake and parameter.is_meta:
            break
        try:
            with expected_failures_unlogged():  # a fake run's failure is answered by the real run
                probe = _run_probe(model, layers, outside, bare, parameter.device, fake=fake)
            break
        except Exception as error:  # noqa: BLE001 - model code that needs values (fake), or cannot run at all
            log.info("pipeline parallel: the probe forward%s failed (%s: %s)", " on fake tensors" if fake else "",
                     type(error).__name__, error)
    changed = [name for name, p, version in versions if p._version != version]
    if changed:
        raise RuntimeError(f"pipeline parallel: the probe forward (one of 8 token ids, to place the stages) changed "
                           f"{changed[:3]} in place; use pp=1 for a model whose forward changes its parameters")
    return probe


def _run_probe(model: torch.nn.Module, layers: list, outside: dict, bare: dict[str, torch.Tensor], device, *,
               fake: bool) -> ForwardProbe:
    position, first_call = ["before"], {}
    tracker = _Sources({id(tensor): name for name, tensor in bare.items()}, position)
    for name, tensor in bare.items():  # a source of what is computed from it (a side input of the layers: refused)
        tracker.sources[tensor] = frozenset({f"bare parameter {name}"})

    def called(name: str) -> None:  # (a pre-hook's return value would replace the module's arguments)
        first_call.setdefault(name, position[0])

    def computed_before(name: str, output) -> None:
        if position[0] == "before":
            tracker.mark(output, tracker.of(output) | {name})

    def received(module, args, kwargs):  # the hidden states: received from the stage before, no source of their own
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            return None
        fresh = hidden.view_as(hidden)
        tracker.sources[fresh] = frozenset()
        return ((fresh, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": fresh})

    hooks = []
    for name, module in outside.items():
        hooks.append(module.register_forward_pre_hook(lambda *_, name=name: called(name)))
        hooks.append(module.register_forward_hook(lambda _, __, output, name=name: computed_before(name, output)))
    for index, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(received, with_kwargs=True))
        hooks.append(layer.register_forward_hook(
            lambda _, __, output, index=index: tracker.mark(output, tracker.of(output) | {f"decoder layer {index}"})))
    hooks.append(layers[0].register_forward_pre_hook(lambda *_: position.__setitem__(0, "between")))
    hooks.append(layers[-1].register_forward_hook(lambda *_: position.__setitem__(0, "after")))
    # The forward runs in the model's own mode (RWKV rescales its weights in place on a switch to eval mode) and
    # leaves nothing behind: the modules' settings (RWKV's `layers_are_rescaled`) are put back, and so are the
    # buffers (a BatchNorm's statistics); a parameter changed in place is an error (probe_forward).
    settings = [(module, _plain_settings(module), dict(module._parameters), dict(module._buffers))
                for module in model.modules()]
    # (In place on a real scalar, fake mode writes it too.) Put back only where written: a write counts as a change
    # (LazyGuard refuses a meta buffer changed after it)
    values = [(b, b._version, b.clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), contextlib.ExitStack() as stack:
            if fake:
                stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(tracker)
            ids = torch.zeros(1, 8, dtype=torch.long, device=device)
            # Labels where the forward takes them (a loss computed beside the logits, or instead of them: a fused LM
            # head); no key/value cache: layers updating one shared cache would each seem to read the others' outputs
            kwargs = {name: value for name, value in (("labels", ids), ("use_cache", False)) if forward_takes(model, name)}
            output = model(ids, **kwargs)
            sources = tracker.of((find_loss(output), find_logits(output)))
    finally:
        for hook in hooks:
            hook.remove()
        for module, plain, parameters, buffers in settings:  # also tensors rebound (`self.count += 1`)
            vars(module).update(plain)
            module._parameters.update(parameters)
            module._buffers.update(buffers)
        with torch.no_grad():
            for buffer, version, value in values:
                if buffer._version != version:
                    buffer.copy_(value)
    allowed = ({f"decoder layer {len(layers) - 1}"} | {name for name, where in first_call.items() if where == "after"}
               # bare parameters read after the layers (or where the stages cannot place them: the last stage's)
               | {f"bare parameter {name}" for name, where in tracker.reads.items() if where != {"before"}})
    return ForwardProbe(after={name: where == "after" for name, where in first_call.items() if where != "between"},
                        reused=sorted(sources - allowed),
                        bare_reads={name: frozenset(where) for name, where in tracker.reads.items()})


def _plain_settings(module: torch.nn.Module) -> dict:
    return {key: value for key, value in vars(module).items()
            if not key.startswith("_") and isinstance(value, (bool, int, float, str, type(None)))}


def reused_outputs(model: torch.nn.Module, layer_list: str) -> list[str]:
    """`probe_forward`'s `reused` (none where the probe cannot run): what no split into pipeline stages computes
    where the logits need it."""
    probe = probe_forward(model, layer_list)
    return probe.reused if probe is not None else []


def _placement(model: torch.nn.Module, config: PipelineConfig) -> _Placement:
    late = embeddings_after_layers(model, config.layer_list)
    if late:
        raise NotImplementedError(
            f"pipeline parallel: {late} hold an embedding but are registered after {config.layer_list!r}, so they "
            "would be placed on the last stage while the forward looks them up before the layers (per-layer inputs "
            "such as Gemma 3n's and Gemma 4's reach every layer beside the hidden states); use pp=1 for this model")
    placement = _Placement(path=_path_to(config.layer_list))
    last = config.num_stages - 1
    probe = probe_forward(model, config.layer_list)
    vars(model).pop("_tridist_forward_probe", None)  # its last ask: the stages change the parameters next
    if probe is not None and probe.reused:
        raise NotImplementedError(_reused_message(probe.reused, config.layer_list))
    # Where the forward calls them, where it can be seen: OPT registers its final norm before its layer list, and
    # Camembert and XLM-R their LM head before the encoder
    called = probe.after if probe is not None else {}
    outside = _outside_modules(model, config.layer_list)
    for name, registered_after in outside.items():
        placement.owner[name] = last if called.get(name, registered_after) else 0
    modules = dict(model.named_modules())
    for index, (child_name, _) in enumerate(modules[config.layer_list]._modules.items()):
        placement.owner[_join(config.layer_list, child_name)] = config.stage_of_layer(index)
    for name in _bare_parameters(model, config.layer_list):
        uncalled = {placement.owner[m] for m in outside if m.rpartition(".")[0] == name.rpartition(".")[0]
                    and m not in called}
        placement.bare[name] = _stage_of_bare_parameter(probe, name, uncalled, last)
    return placement


def _stage_of_bare_parameter(probe: ForwardProbe | None, name: str, uncalled: set[int], last: int) -> int:
    """Where a bare parameter of a container on the path to the layer list lives: on the first stage where the probe
    forward reads it only before the layers (a learned token the model puts among the embeddings); one it does not
    read serves inputs the probe does not give (images: LLaVA-NeXT's `image_newline`, placed among the image
    features) and goes with the modules beside it that the probe did not call either (the vision tower and
    projector, registered before the layers: the first stage), where they all sit on one stage. Anywhere else on the
    last stage (an LM-head weight used as `x @ weight`), as where the probe cannot run. A stage that reads a bare
    parameter it does not hold raises naming it (install_stage_forward). `uncalled`: the stages of the modules beside
    it (its container's children with parameters) that the probe did not call."""
    if probe is None:
        return last
    reads = probe.bare_reads.get(name)
    if reads:
        return 0 if reads == {"before"} else last
    return next(iter(uncalled)) if len(uncalled) == 1 else last


def _reused_message(reused: list[str], layer_list: str) -> str:
    return (f"pipeline parallel: the model's loss and logits are computed from {reused} besides the hidden states "
            f"each layer of {layer_list!r} passes to the next (model code combining layer outputs, or feeding an "
            "embedding to every layer); a pipeline stage holds zeros in the place of another stage's outputs: use pp=1 "
            "for this model")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _bare_parameters(model: torch.nn.Module, layer_list: str) -> dict[str, torch.nn.Parameter]:
    """The bare parameters of the containers on the path to the layer list, by qualified name."""
    modules = dict(model.named_modules())
    return {_join(c, p): v for c in sorted(_path_to(layer_list)) for p, v in modules[c]._parameters.items()
            if v is not None}


def build_stage_view(model: torch.nn.Module, config: PipelineConfig, placement: _Placement, state: _StageState) -> torch.nn.Module:
    """The model as stage `state.stage` sees it (see the module docstring)."""
    last = config.num_stages - 1

    def build(module: torch.nn.Module, name: str) -> torch.nn.Module:
        view = _shallow_copy(module)
        for child_name, child in module._modules.items():
            qualified = _join(name, child_name)
            if child is None:
                continue
            if qualified in placement.path:
                view._modules[child_name] = build(child, qualified)
            elif placement.owner.get(qualified, state.stage) != state.stage:
                owner = placement.owner[qualified]
                role = "earlier" if owner < state.stage else "later"
                meta = _meta_copy(child, state.compute_dtype) if role == "earlier" else None
                view._modules[child_name] = _StandIn(qualified, owner, meta, state, role, _plain_attributes(child))
        # Bare parameters of the containers live on one stage each (_stage_of_bare_parameter). A later stage runs the
        # code before its layers too (on stand-ins' zeros) and reads there an earlier stage's bare parameter (the
        # image features' newline token): zeros of its shape stand in for it, as for a module of that stage.
        for key, param in list(view._parameters.items()):
            owner = placement.bare.get(_join(name, key), last) if param is not None else state.stage
            if owner != state.stage:
                del view._parameters[key]
            if owner < state.stage:
                view.__dict__[key] = torch.zeros(param.shape, dtype=_computed_in(param, state.compute_dtype),
                                                 device=state.device)
        return view

    return build(model, "")


def strip_to_rank(model: torch.nn.Module, placement: _Placement, stages: list[int], last_stage: int) -> None:
    """Replace, in the user's model itself, every module no stage of this rank owns by a stand-in, so
    their memory is freed and the model lists (and checkpoints) only this rank's parameters."""
    modules = dict(model.named_modules())
    for name, owner in placement.owner.items():
        if owner in stages:
            continue
        parent, _, child = name.rpartition(".")
        modules[parent]._modules[child] = _StandIn(name, owner, None, None, "elsewhere", _plain_attributes(modules[name]))
    for container in placement.path:
        module = modules[container]
        for pname in [p for p, v in module._parameters.items() if v is not None]:
            if placement.bare.get(_join(container, pname), last_stage) not in stages:
                del module._parameters[pname]


def adopt_container_parameters(model: torch.nn.Module, views: list[torch.nn.Module], placement: _Placement) -> None:
    """Tensor and data parallelism replaced the bare parameters of the stage's copied containers (the
    LM-head weight) by sharded ones; the user's model (and its optimizer) must hold those."""
    modules = dict(model.named_modules())
    for view in views:
        view_modules = dict(view.named_modules())
        for container in placement.path:
            for pname, param in view_modules[container]._parameters.items():
                if param is not None:
                    modules[container]._parameters[pname] = param


class TiedAcrossStages:
    """Parameters tied between modules of different stages (an embedding on the first stage, the LM head
    on the last), synchronised as Megatron's embedding group does: each of those stages holds a copy, the
    copies start equal (every rank builds the same model, as data parallel assumes), and after each
    training step's backward the copies' gradients are summed over the ranks holding them, so every copy
    takes the whole gradient and the same update. A rank holding no copy takes no part.

    ties: (the tied parameter's names, the process group of the pipeline ranks holding a copy, or None
    when one rank holds them all) for each tie this rank holds.
    """

    def __init__(self, model: torch.nn.Module, placement: _Placement, *, last: int, stage_ids: list[int],
                 pp_rank_groups: list[list[int]]):
        """`pp_rank_groups`: the ranks of every pipeline (ParallelDims.rank_groups("pp")), the same on every rank."""
        rank = dist.get_rank()
        self.ties: list[tuple[list[str], object]] = []
        self.copies_counted_elsewhere: set[str] = set()  # copies past the tie's first stage (clip.clip_grad_norm_)
        for names in tied_parameter_names(model):
            stage_of = {name: _stage_of_parameter(name, placement, last) for name in names}
            stages = set(stage_of.values())
            self.copies_counted_elsewhere.update(name for name, stage in stage_of.items() if stage != min(stages))
            if len(stages) == 1:
                continue  # one stage: one module tree, one parameter
            # Every rank creates the holders' group of every pipeline, in the same order (new_group is a
            # collective of the whole job). Letting only the members create theirs
            # (use_local_synchronization=True) hangs in torch as soon as ranks hold different numbers of
            # groups, e.g. after any subgroup some ranks are not in (pytorch/pytorch#173608).
            group = None
            for pp_ranks in pp_rank_groups:
                members = sorted({pp_ranks[stage % len(pp_ranks)] for stage in stages})  # looped placement
                created = dist.new_group(members) if len(members) > 1 else None
                if rank in members:
                    group = created
            if any(stage in stage_ids for stage in stages):  # a rank holding no copy takes no part
                self.ties.append((names, group))

    def sum_gradients(self, views: list[torch.nn.Module]) -> None:
        """After a training step's backward: every copy's gradient becomes the sum of all copies'."""
        for names, group in self.ties:
            copies = {id(p): p for view in views for name in names if (p := _parameter_or_none(view, name)) is not None}
            params = list(copies.values())
            if not any(p.requires_grad for p in params):  # frozen on every holder alike (a LoRA model's embedding):
                continue  # no gradient, as on one device (a zero one would let weight decay move it)
            grads = [local_value(p.grad) if p.grad is not None else torch.zeros_like(local_value(p)) for p in params]
            total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
            if group is not None:
                dist.all_reduce(total, group=group)
            for p, grad in zip(params, grads):
                if p.grad is None:
                    p.grad = _like(p, total.clone())
                else:
                    grad.copy_(total)


def _stage_of_parameter(param_name: str, placement: _Placement, last: int) -> int:
    module = param_name.rpartition(".")[0]
    while module not in placement.owner and module not in placement.path:
        module = module.rpartition(".")[0]
    if module in placement.path:  # a container's bare parameter
        return placement.bare.get(param_name, last)
    return placement.owner.get(module, last)


def _parameter_or_none(view: torch.nn.Module, name: str):
    try:
        return view.get_parameter(name)
    except AttributeError:  # the module is a stand-in here: another stage holds it
        return None


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A gradient for `param` from its local values (a DTensor parameter gets a DTensor gradient)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


# ------------------------------------------------------------------------------------------ applying


def apply_pipeline_parallel(model: torch.nn.Module, *, pp_mesh, pp_rank_groups: list[list[int]], pp_config: dict,
                            device: torch.device, dp_group,
                            parallelize_stage: Callable[[torch.nn.Module], None],
                            compute_dtype: torch.dtype | None = None) -> "PipelineRunner":
    """Split `model` into pipeline stages over `pp_mesh` (this rank keeps its own; `pp_rank_groups`: the ranks
    of every pipeline of the job, ParallelDims.rank_groups("pp")), parallelise each stage with
    `parallelize_stage` (tensor and data parallel), and make `model(...)` run the schedule. `compute_dtype`: the
    dtype `parallelize_stage`'s data parallel computes the parameters in (mixed precision's param_dtype), where
    another stage's stand-ins shape their zeros (before: fp32 zeros in a bf16 forward, from which Gemma 2's and
    Bloom's masks took fp32's minimum, -inf in bf16: NaN losses).

    Why views and not a traced graph: the model's own forward keeps running (masks, rotary tables, the
    loss), so tensor parallel's hooks and the fused kernels work inside stages as they do without pp.
    """
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    _refuse_reentrant_checkpointing(model)
    config = parse_pp_config(model, pp_config, pp=pp)
    placement = _placement(model, config)
    stage_ids = [pp_rank + chunk * pp for chunk in range(config.chunks_per_rank)]  # torch's looped placement
    tied = TiedAcrossStages(model, placement, last=config.num_stages - 1, stage_ids=stage_ids, pp_rank_groups=pp_rank_groups)
    last = config.num_stages - 1
    micro_batches: list = []  # this step's micro-batches, shared by the stages of this rank
    states = [_StageState(stage=s, is_first=s == 0, is_last=s == last, device=device, compute_dtype=compute_dtype)
              for s in stage_ids]
    views = [build_stage_view(model, config, placement, state) for state in states]
    strip_to_rank(model, placement, stage_ids, last)
    for view, state in zip(views, states):
        parallelize_stage(view)
        install_stage_forward(view, model, state, micro_batches, placement.bare)
        # After FSDP's and tensor parallel's hooks, so the received activation goes in first.
        install_layer_hooks(view.get_submodule(config.layer_list), config, state)
    adopt_container_parameters(model, views, placement)
    stages = [_Stage(view, state, num_stages=config.num_stages, device=device, group=pp_mesh.get_group())
              for view, state in zip(views, states)]
    runner = PipelineRunner(stages=stages, states=states, views=views, config=config, pp_group=pp_mesh.get_group(),
                            dp_group=dp_group, micro_batches=micro_batches, tied=tied)
    original = model.forward

    def forward(*args, **kwargs):
        return runner(model, args, kwargs)

    # The model's own signature: transformers' generate checks its arguments against it (a model whose
    # prepare_inputs_for_generation takes **kwargs, Nemotron-H's: attention_mask 'not used by the model' otherwise)
    forward.__signature__ = inspect.signature(original)
    model.forward = forward
    model._tridist_pipeline = runner
    log.info(
        "parallelize: pipeline stage(s) %s of %d (%s, %d micro-batches), layers %s", stage_ids, config.num_stages,
        config.schedule, config.micro_batches,
        [[i for i in range(config.num_layers) if config.stage_of_layer(i) == s] for s in stage_ids],
    )
    return runner


def _reentrant_checkpointing(module: torch.nn.Module) -> bool:
    """Whether `module` runs its forward under reentrant activation checkpointing, as far as can be told without
    running it: Hugging Face's per-layer checkpointing (`gradient_checkpointing` on, `_gradient_checkpointing_func`
    a partial of torch's checkpoint whose `use_reentrant` is True or left to torch's default, True) or torch's
    `checkpoint_wrapper` with CheckpointImpl.REENTRANT. A model's forward that calls torch.utils.checkpoint(...,
    use_reentrant=True) itself cannot be seen before it runs: torch raises at the first step, on the later stages'
    ranks only, with an error that names the fix (use_reentrant=False)."""
    impl = getattr(module, "checkpoint_impl", None)
    if impl is not None and getattr(impl, "name", None) == "REENTRANT":
        return True
    if getattr(module, "gradient_checkpointing", False) is not True:
        return False
    func = getattr(module, "_gradient_checkpointing_func", None)
    if isinstance(func, partial) and "use_reentrant" in func.keywords:
        return bool(func.keywords["use_reentrant"])
    return (func.func if isinstance(func, partial) else func) is torch_checkpoint


_REENTRANT_FIX = ("transformers' activation checkpointing: model.activation_checkpointing_enable("
                  "activation_checkpointing_kwargs={'use_reentrant': False}) (its default); torch's checkpoint: "
                  "use_reentrant=False; or recompute='full' in the strategy instead")


def reentrant_checkpointing(model: torch.nn.Module) -> str | None:
    """Why `model` cannot be split into pipeline stages as it is, if it runs reentrant activation checkpointing:
    torch.distributed.pipelining computes a stage's input gradients with torch.autograd.grad(inputs=...), which
    torch.utils.checkpoint refuses under use_reentrant=True, raising in the backward of every stage but the
    first while the first stage's ranks wait for it (to_distributed leaves pp out for such a model)."""
    reentrant = [name or "(the model)" for name, module in model.named_modules() if _reentrant_checkpointing(module)]
    if not reentrant:
        return None
    return (f"{len(reentrant)} module(s) run under reentrant activation checkpointing (use_reentrant=True: "
            f"{reentrant[:3]}{' ...' if len(reentrant) > 3 else ''}), which torch's pipeline stages cannot "
            f"differentiate (their input gradients come from torch.autograd.grad). Use the non-reentrant variant, "
            f"whose gradients are the same: {_REENTRANT_FIX}")


def _refuse_reentrant_checkpointing(model: torch.nn.Module) -> None:
    """Before any communication, on every rank alike (the model is the same on every rank; after the split, each
    rank's holds the same flags: transformers sets them on every module that has them, the model's root too)."""
    why = reentrant_checkpointing(model)
    if why:
        raise ValueError(f"pipeline parallel: {why}")


# ------------------------------------------------------------------------------------------- running


class _Stage(PipelineStage):
    """torch's stage, telling the view which micro-batch it is computing (every rank keeps its own
    copy of the batch, so only the activations travel between stages)."""

    def __init__(self, view, state: _StageState, **kwargs):
        super().__init__(view, state.stage, **kwargs)
        self._tridist_state = state

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        self._tridist_state.micro_batch = fwd_chunk_id
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def perform_reduce_grad(self, grad_scale_factor: int):
        if isinstance(self.submod, FSDPModule):
            _uniform_gradient_dtypes(self.submod)
        return super().perform_reduce_grad(grad_scale_factor)


def _uniform_gradient_dtypes(module: FSDPModule) -> None:
    """Before the schedule's one reduction of a step's micro-batches: the zeros FSDP2 reduces for parameters no
    micro-batch used go in the reduce dtype, beside the gradients it accumulated in that dtype.

    With a mixed-precision policy (compute bf16, reduce fp32) FSDP2's post-backward of each micro-batch (which does not
    reduce) moves the gradients into fp32 accumulators; at the reduction, a parameter no micro-batch used brings a bf16
    zero (`reduce_scatter_unused_params`, unused_parameters.py: a vision tower that image-less micro-batches skipped,
    LLaVA's last vision layer, experts no token chose), and FSDP2 asserts "FSDP reduce-scatter expects uniform gradient
    dtype" (pytorch/pytorch#196996, open in torch 2.13). Its other trigger there, a fresh bf16 gradient of a parameter
    first used by the last micro-batch, does not arise here: that micro-batch's post-backward has accumulated it too
    (counted on LLaVA under pp 2, dp 2 x pp 2 and dp 2 with 2 micro-batches: only accumulations and zeros)."""
    state = (replicate.state(module) if isinstance(module, ReplicateModule)  # type: ignore[arg-type]
             else fully_shard.state(module))  # type: ignore[attr-defined]
    for unit_state in state._state_ctx.all_states:
        for group in unit_state._fsdp_param_groups:
            if not group.reduce_scatter_unused_params:
                continue  # no zeros: one dtype already
            parameters = [p for p in group.fsdp_params if hasattr(p, "_unsharded_param")]
            if all(p.unsharded_accumulated_grad is None for p in parameters):
                continue  # nothing accumulated: the zeros are in the compute dtype, as the gradients
            for parameter in parameters:
                unsharded = parameter._unsharded_param
                if (parameter.unsharded_accumulated_grad is None and unsharded.grad is None
                        and unsharded.requires_grad):
                    parameter.unsharded_accumulated_grad = torch.zeros_like(unsharded, dtype=parameter.reduce_dtype)


def install_stage_forward(view: torch.nn.Module, model: torch.nn.Module, state: _StageState, micro_batches: list,
                          bare_parameters: dict[str, int]) -> None:
    """The view's forward: the model's own forward on micro-batch `state.micro_batch`, cut to this stage."""
    model_forward = vars(model).get("forward")
    model_forward = model_forward.__func__ if model_forward is not None else type(model).forward

    def forward(*received):
        args, kwargs = micro_batches[state.micro_batch]
        state.received = None if state.is_first else received[0]
        state.last_output = state.last_placeholder = None
        state.stand_in_zeros = {}
        if state.is_last:  # a causal LM's fused head + loss (kernels.fuse), armed as the model's hooks would
            with labelled_call(view, args, kwargs) as finish:
                return _last_stage_result(finish(run(args, kwargs)), state)
        output = run(args, kwargs)
        hidden = output[0] if isinstance(output, (tuple, list)) else output  # (OpenAI GPT's blocks return lists)
        if not isinstance(hidden, torch.Tensor) or isinstance(hidden, DTensor):
            raise TypeError(
                f"pipeline parallel: stage {state.stage} ends with {type(hidden).__name__}, expected the hidden-states "
                "tensor a decoder layer returns"
            )
        return take_pending_split(view, hidden)  # a SequenceParallelBegin as the stage's last layer

    def run(args, kwargs):
        try:
            return model_forward(view, *args, **kwargs)
        except _StageExit:
            return state.last_output
        except AttributeError as error:
            missing = {name: stage for name, stage in bare_parameters.items()
                       if f"'{name.rpartition('.')[2]}'" in str(error)}
            if not missing:
                raise
            raise RuntimeError(
                f"pipeline parallel: stage {state.stage} uses {sorted(missing)}, a bare parameter of a container "
                f"module, placed on stage {sorted(set(missing.values()))} (each on one stage: where a forward on token ids "
                "alone reads it, else with the modules beside it that forward does not call, else the last stage); wrap "
                "it in a module of its own, registered before the layer list to place it on the first stage or after it "
                "for the last"
            ) from error
        finally:  # nothing of this micro-batch outlives its forward (activations are the schedule's to keep)
            state.received = state.last_output = state.last_placeholder = None
            state.stand_in_zeros = {}

    view.forward = forward


def _last_stage_result(output, state: _StageState) -> torch.Tensor:
    """What the last stage hands the schedule for one micro-batch: its loss. A DTensor loss (computed from
    vocabulary-parallel logits without F.cross_entropy) may be a partial sum on each mp rank: its full
    value, differentiably, as the model's own global view returns it. In an evaluation the logits are
    kept aside (detached; full, where vocabulary-parallel) for the runner to return.

    An output without a loss (a call without labels) hands the schedule a zero that depends on the
    outputs, so the schedule completes on every stage (raising here would leave the others waiting for
    activations' gradients until the timeout); the runner then returns no loss (evaluation) or raises
    on every rank (training)."""
    state.output_form = OutputForm.of(output)
    if state.keep_logits:
        logits = find_logits(output)
        if logits is not None:
            state.logits[state.micro_batch] = (logits.full_tensor() if isinstance(logits, DTensor) else logits).detach()
    loss = find_loss(output)
    if loss is not None:
        return loss.full_tensor() if isinstance(loss, DTensor) else loss
    state.missing_loss = True
    candidates = [find_logits(output), *tree_flatten(output)[0]]
    tracked = next((t for t in candidates if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad), None)
    if tracked is not None:
        return local_value(tracked).sum() * 0.0
    if torch.is_grad_enabled():
        raise ValueError(_NO_LOSS)  # nothing to stand in for a loss: the backward cannot run
    return torch.zeros((), device=_device_of((output,), {}))


_NO_LOSS = (
    "pipeline parallel: a training call must compute its loss (return a scalar loss alone, first in a tuple, or as "
    "a dict's or ModelOutput's 'loss'); call it with labels, e.g. model(input_ids=ids, labels=labels), or evaluate "
    "without labels in eval mode (model.eval()), which returns the logits"
)


class _FromAnotherStage(torch.Tensor):
    """A stand-in's zeros (or a view of them) as one of this stage's layers receives them: reading its metadata is
    allowed (a layer that checks the argument's shape and then ignores it), any computation with it is an error
    naming where the real value would come from (`_tridist_source`)."""

    _METADATA = frozenset({torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
                           torch.Tensor.ndim.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
                           torch.Tensor.is_floating_point, torch.Tensor.requires_grad.__get__, torch.Tensor.__len__})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        source = next(a._tridist_source for a in tree_flatten((args, kwargs))[0] if isinstance(a, cls))
        raise RuntimeError(f"pipeline parallel: {source}; it computes with it ({getattr(func, '__name__', func)}): "
                           "only the hidden states pass between pipeline stages, so it would compute from zeros. Compute "
                           "it inside the layers or in a parameter-free module (those run on every stage), or use a "
                           "strategy without pipeline parallel for this model (pp=1)")


def _guard_stand_in_zeros(layer, args, kwargs, state: _StageState, *, replaced=None):
    """(args, kwargs) of one of this stage's layers with every (view of a) stand-in's zeros other than the hidden
    states the first layer gets replaced (`replaced`) made a _FromAnotherStage: an output of an earlier stage's
    module that only the hidden states would carry over (HY V4's layers pass their indexer's top-k to the next one,
    which uses it where it has no indexer), or a table computed before the layers by a module with parameters
    (RoFormer's sinusoidal positions, a frozen nn.Embedding). The layer computed from those zeros, silently (the
    sweep: first-step gradients 56% and 100% off); now that is an error, and a layer that takes such an argument
    without using it (GLM-MoE-DSA's, each with its own indexer) runs. Views share the zeros' storage, which a weak
    reference names without keeping it (nor its memory) alive."""
    if not state.stand_in_zeros:
        return args, kwargs

    def guarded(key, value):
        if not isinstance(value, torch.Tensor) or value is replaced or not value.numel():
            return value
        source = state.stand_in_zeros.get(StorageWeakRef(value.untyped_storage()))
        if source is None:
            return value
        value = value.detach().as_subclass(_FromAnotherStage)
        value._tridist_source = (f"on stage {state.stage}, a layer ({type(layer).__name__}) takes argument {key!r} "
                                 f"from {source[0]!r}, which runs on stage {source[1]}")
        return value

    return (tuple(guarded(i, value) for i, value in enumerate(args)),
            {key: guarded(key, value) for key, value in kwargs.items()})


def install_layer_hooks(model_layers: torch.nn.Module, config: PipelineConfig, state: _StageState) -> None:
    """On the stage's first layer, take the received activation; on its layers, guard the arguments computed from
    stand-ins' zeros; on its last, remember the output. The hooks are bookkeeping that torch.compile does not trace
    (weak references to storages): torch.compiler.disable'd, they run eagerly around a block compiled alone, even
    with fullgraph=True."""
    owned = [layer for i, layer in enumerate(model_layers) if config.stage_of_layer(i) == state.stage]
    first, last = owned[0], owned[-1]
    if not state.is_first:

        def take_received(module, args, kwargs):
            placeholder = state.last_placeholder
            if state.received is None:
                return None
            if placeholder is None:  # `is None` would match any None argument (a mask, a cache)
                raise RuntimeError(
                    f"pipeline parallel: stage {state.stage}'s first layer ran, but no module of an earlier stage "
                    "produced its input tensor in this forward (hidden states passed in by the caller, e.g. "
                    "inputs_embeds, or an earlier module returning no tensor first); pipeline stages take over the "
                    "output of the modules before them, so compute the input with those modules"
                )
            args, kwargs = _guard_stand_in_zeros(module, args, kwargs, state, replaced=placeholder)
            for i, arg in enumerate(args):
                if arg is placeholder:
                    return (*args[:i], state.received, *args[i + 1 :]), kwargs
            for key, value in kwargs.items():
                if value is placeholder:
                    return args, {**kwargs, key: state.received}
            raise RuntimeError(
                f"pipeline parallel: stage {state.stage}'s first layer does not receive the previous layer's output "
                "unchanged (model code between decoder layers transforms the hidden states); pipeline stages split at "
                "layer outputs, so move that code into the layers"
            )

        first.register_forward_pre_hook(torch.compiler.disable(take_received), with_kwargs=True, prepend=True)

        def guard_arguments(module, args, kwargs):
            return _guard_stand_in_zeros(module, args, kwargs, state)

        for layer in owned[1:]:  # the first is guarded in take_received; the first stage has no earlier stand-ins
            layer.register_forward_pre_hook(torch.compiler.disable(guard_arguments), with_kwargs=True, prepend=True)

    def remember(module, args, output):  # on every stage: a stand-in called after it is misplaced (_StandIn)
        state.last_output = output

    last.register_forward_hook(torch.compiler.disable(remember))


class PipelineRunner:
    """Runs one step of the schedule for the model's forward and reports the global mean loss."""

    def __init__(self, *, stages: list[_Stage], states: list[_StageState], views: list[torch.nn.Module],
                 config: PipelineConfig, pp_group, dp_group, micro_batches: list, tied: TiedAcrossStages):
        self.stages, self.states, self.views, self.config, self.tied = stages, states, views, config, tied
        self.pp_group, self.dp_group, self.micro_batches = pp_group, dp_group, micro_batches
        count = config.micro_batches
        schedule_cls = _SCHEDULES[config.schedule]
        target = stages if config.chunks_per_rank > 1 else stages[0]
        self.schedule = schedule_cls(target, n_microbatches=count, loss_fn=self._micro_batch_loss, scale_grads=False)
        # The factor the loop applied to the last loss it called backward() on: the next schedule's backward runs at it.
        # Before the first backward it is unknown: the first call runs at a loss scaler's usual factor (PROVISIONAL_SCALE).
        self._backward_scale = PROVISIONAL_SCALE
        self._factor_known = False
        self.device = stages[0].device
        self.last_rank = dist.get_global_rank(pp_group, (config.num_stages - 1) % dist.get_world_size(pp_group))
        # The loss returned to the loop hangs off this leaf; its backward only applies the loop's scale.
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        self._shapes = None  # the micro-batch shapes the stages' buffers were sized for
        self._output_form = None  # the model's kind of output, as the last stage last sent it

    def __call__(self, model: torch.nn.Module, args, kwargs):
        _refuse_a_cache(kwargs)
        self.micro_batches[:] = split_micro_batches(args, kwargs, self.config.micro_batches, self.config.sample_rows)
        self._follow_shapes()
        # The views' own copies of the containers take their modes from the model's; the modules they share
        # already have theirs (view.train() would override a submodule the user put in another mode).
        parts = self.config.layer_list.split(".")
        for name in (".".join(parts[:i]) for i in range(len(parts) + 1)):  # "", "model", "model.layers"
            for view in self.views:
                view.get_submodule(name).training = model.get_submodule(name).training
        training = model.training and torch.is_grad_enabled()
        for state in self.states:
            state.micro_batch = 0  # metadata inference on the first call runs micro-batch 0
            state.keep_logits = not training and self.config.eval_logits != "none"
            state.missing_loss = False
            state.logits.clear()
        index = torch.arange(self.config.micro_batches, device=self.device)
        losses: list[torch.Tensor] = []
        call = self._run_keeping_gradients(model, index, losses, training)
        self.micro_batches.clear()  # the batch is the loop's to free
        return self._outputs(losses, call)

    def _follow_shapes(self) -> None:
        """torch infers the activations' shapes from the first call's micro-batches and sizes its receive
        buffers once (again only on an eval/train switch): micro-batches of another shape (another batch
        size, sequence length) would travel into buffers of the old size (gloo aborts the process). A
        shape change re-runs that inference on every stage (a forward of one micro-batch, stage after
        stage: pad batches to a few fixed shapes); all ranks of the pipeline see the same batch. One stage
        (micro-batching alone) sends nothing: nothing to re-run."""
        # A vision-language model's images (sample_rows) are left out: their rows differ from batch to batch and from
        # one data-parallel replica to the next, while what the stages send does not; a re-inference on one replica
        # alone would run its backward's data-parallel reductions out of step with the others' (gloo aborted)
        media = self.config.sample_rows.keys() if self.config.sample_rows is not None else set()
        args, kwargs = self.micro_batches[0]
        leaves = tree_flatten((args, {key: value for key, value in kwargs.items() if key not in media}))[0]
        shapes = tuple((tuple(x.shape), x.dtype) for x in leaves if isinstance(x, torch.Tensor))
        if self._shapes is not None and shapes != self._shapes and self.config.num_stages > 1:
            for flag in ("_stage_forward_initialized", "_stage_backward_initialized",  # single-stage schedules
                         "_stages_forward_initialized", "_stages_backward_initialized"):  # interleaved
                if hasattr(self.schedule, flag):
                    setattr(self.schedule, flag, False)
        self._shapes = shapes

    def _run_keeping_gradients(self, model: torch.nn.Module, index: torch.Tensor, losses: list, training: bool):
        """One step of the schedule (training) or its forward only. The gradients the parameters hold (earlier
        calls', accumulated) are set aside during it (torch's stage re-initialisation, on the first call, at a
        switch between evaluation and training or a shape change, clears FSDP2's gradients) and put back after.
        A training call's own gradients are kept apart from them until its returned loss's backward adds them,
        times the factor the loop applied to the loss (`_CallGradients`), as a backward on one device would: a
        zero_grad() between the call and that backward clears only the earlier gradients, and a call whose loss
        gets no backward adds nothing. Zeroed gradients (Paddle's clear_grad()) are accumulated into instead of set
        aside: they come back through the loss's backward, or as zeros when the loss is freed without one. Returns
        the call's gradients (None for an evaluation)."""
        params = [p for p in model.parameters() if p.requires_grad]
        held = {p: p.grad for p in params if p.grad is not None}
        zeroed = {}  # zeroed, not freed (Paddle's clear_grad()): a training schedule accumulates into them, no second set
        if training and held and not bool(torch.stack([local_value(g).any() for g in held.values()]).any()):
            zeroed, held = held, {}
        for p in held:
            p.grad = None
        # The unused-parameter trackers' record of this call (their hooks fire inside the schedule) waits with its
        # gradients: a call whose loss gets no backward marks nothing used, and its forward counts from the backward on.
        earlier = {tracker: tracker.begin_apart() for tracker in (trackers_of(params) if training else ())}
        grads = None
        try:
            if training:
                # Checkpointing enabled after parallelize (model.activation_checkpointing_enable(...)): refused here,
                # on every rank alike, before the schedule's ranks could part.
                _refuse_reentrant_checkpointing(model)
                self.schedule.step(index, target=index, losses=losses, return_outputs=False)
                self.tied.sum_gradients(self.views)  # this call's gradients only: earlier ones are set aside
                grads = {p: p.grad for p in params if p.grad is not None}
            else:
                with torch.no_grad():
                    self.schedule.eval(index, target=index, losses=losses, return_outputs=False)
        finally:
            used = {tracker: tracker.end_apart(record) for tracker, record in earlier.items()}
            for p in params:
                if p in held:
                    p.grad = held[p]
                elif training:  # this call's (in its gradients), or a zeroed tensor the schedule added to
                    p.grad = None
            if training and grads is None:  # the schedule raised: the zeroed gradients are zeros again
                _zero_again(zeroed)
        if not training:
            return None
        call = _CallGradients(grads, params, self._backward_scale, used, provisional=not self._factor_known)
        if zeroed:  # if the loss gets no backward, they are zeros again, as the call had not run
            # (torch's stage re-initialisation may have freed some: their own tensors then)
            call.zeroed = {p: grads.get(p, grad) for p, grad in zeroed.items()}
            call.restore = weakref.finalize(call, _zero_again, call.zeroed)
            call.restore.atexit = False
        return call

    def _micro_batch_loss(self, output, target):
        """A micro-batch's share of the mean loss; its backward runs at the factor of the last loss's backward."""
        loss = output / self.config.micro_batches
        return _ScaledBackward.apply(loss, self._backward_scale) if self._backward_scale != 1.0 else loss

    def _add_gradients(self, call: "_CallGradients", scale: torch.Tensor) -> None:
        """Backward of a returned loss: add its call's gradients to the parameters' times the loop's factor
        (`(loss / steps).backward()`, a loss scaler's), over the factor the schedule's backward ran at (exactly 1
        while the factor holds); keep the factor for the next call's backward; agree on non-finite gradients."""
        scale = float(scale)
        if call.grads is None:
            raise RuntimeError(
                "pipeline parallel: backward() ran a second time on one returned loss, whose gradients the first "
                "backward already added (the pipeline computes them inside model(...)); call the model again for "
                "another backward")
        if math.isfinite(scale) and scale != 0.0:  # a zero or non-finite factor would spoil the next backward
            self._backward_scale, self._factor_known = scale, True
        factor = scale / call.computed_at
        grads, call.grads = call.grads, None
        if call.restore is not None:
            call.restore.detach()
        for tracker, used in call.used.items():
            tracker.add_apart(used)
        with torch.no_grad():
            for p, grad in grads.items():
                if factor != 1.0:
                    grad.mul_(factor)
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad.add_(grad)
            # Zeroed gradients the call did not reach (torch's stage re-initialisation frees FSDP2's): zeros again
            _zero_again({p: grad for p, grad in call.zeroed.items() if p not in grads})
            # Also unscaled: a loss scaler whose scale came down to 1, a loop's own skip on non-finite gradients.
            overflow = _agree_on_non_finite([local_value(p.grad) for p in call.params if p.grad is not None])
        if overflow and call.provisional and factor < 1.0:
            warnings.warn(
                f"pipeline parallel: the first training call's backward ran before the loop's loss factor was known, "
                f"at {PROVISIONAL_SCALE:,.0f} (torch.amp.GradScaler's default init_scale), and its gradients overflowed "
                f"where the loop's factor, {scale:g}, may not have: they are non-finite on every rank, so a loss scaler "
                f"skips this step and lowers its scale (the next calls run at the loop's factor). fp16 training needs a "
                f"loss scaler: torch.amp.GradScaler() at its default init_scale computes this call as one device does",
                RuntimeWarning, stacklevel=2)

    def _outputs(self, losses: list[torch.Tensor], call: "_CallGradients | None"):
        """The model's kind of output on every rank of the pipeline: the global mean loss (training: also
        averaged over data-parallel replicas) and, for an evaluation, the logits as `eval_logits` says."""
        last = next((s for s in self.states if s.is_last), None)
        own_form = last.output_form if last is not None else None
        packed = torch.zeros(3, device=self.device)
        if losses:  # the last stage: micro-batch losses, each already divided by their count
            packed[0] = torch.stack([loss.detach().float() for loss in losses]).sum()
            packed[1] = float(own_form != self._output_form)  # the kind of output changed (first call)
            packed[2] = float(last.missing_loss)
        dist.broadcast(packed, src=self.last_rank, group=self.pp_group)
        if packed[1]:  # the kind of output (tuple, dict, ModelOutput) only the last stage saw, sent once
            form = [own_form]
            if dist.get_world_size(self.pp_group) > 1:
                dist.broadcast_object_list(form, src=self.last_rank, group=self.pp_group)
            self._output_form = form[0]
        if packed[2] and call is not None:  # on every rank: the schedule ran on a stand-in zero loss (dropped)
            raise ValueError(_NO_LOSS)
        logits = self._eval_logits(last) if call is None else None
        if packed[2]:  # an evaluation without labels
            return self._output_form.build(None, logits)
        # Training steps only, as data parallel reports its loss: an evaluation by one replica (or by
        # replicas with different numbers of batches) must not wait for a collective the others never join.
        if self.dp_group is not None and call is not None:
            all_reduce_mean_(packed[:1], self.dp_group)
        loss = packed[0].clone()
        if call is not None:  # requires grad: the loop's loss.backward() adds the call's gradients at its scale
            loss = _ReturnedLoss.apply(self._anchor, loss, partial(self._add_gradients, call))
        elif torch.is_grad_enabled():  # eval mode with autograd on: no gradients were computed; say so on backward
            loss = _ReturnedLoss.apply(self._anchor, loss, _no_backward_in_eval_mode)
        return self._output_form.build(loss, logits)

    def _eval_logits(self, last: _StageState | None) -> torch.Tensor | None:
        """An evaluation's logits: the last stage's micro-batches' logits joined along the batch (dim 0),
        sent to every rank of the pipeline (`eval_logits="every_rank"`) or kept where they are."""
        mode = self.config.eval_logits
        logits = None
        if last is not None and len(last.logits) == self.config.micro_batches:
            logits = torch.cat([last.logits[i] for i in range(self.config.micro_batches)])
        if last is not None:
            last.logits.clear()
        if mode != "every_rank" or dist.get_world_size(self.pp_group) == 1:
            return logits
        meta = [(logits.shape, logits.dtype) if logits is not None else None]
        dist.broadcast_object_list(meta, src=self.last_rank, group=self.pp_group)
        if meta[0] is None:  # the model returned no logits
            return None
        if logits is None:
            logits = torch.empty(meta[0][0], dtype=meta[0][1], device=self.device)
        dist.broadcast(logits, src=self.last_rank, group=self.pp_group)
        return logits


def _refuse_a_cache(kwargs: dict) -> None:
    """A key/value cache passed in (transformers' generate with use_cache, its default): the stages hold the
    layers apart and return no cache, so generate fed the next step its new tokens alone and got garbage back
    (token ids of 0 under dp 2 x pp 2), silently. With use_cache=False every step runs the whole sequence
    through the pipeline and generates what one device does. Every rank passes the same arguments: refused
    alike, before any communication."""
    if kwargs.get("use_cache") or any(kwargs.get(name) is not None for name in CACHE_ARGUMENTS):
        raise ValueError(
            "pipeline parallel: a key/value cache was asked for (cache / past_key_values / use_cache=True: "
            "model.generate(...) by default), which pipeline stages cannot return; generate with "
            "model.generate(..., use_cache=False) (each step runs the whole sequence through the stages), or on "
            "one device from distcore.full_state_dict(model)")


def _agree_on_non_finite(grads: list[torch.Tensor]) -> bool:
    """Where a stage's gradients hold an inf or a nan, every rank's do (a nan in its first gradient's first
    element). A loss scaler (torch.amp.GradScaler) skips a step whose gradients overflowed and lowers its scale:
    on one device it sees every gradient, here each rank its own stage's (data and tensor parallel shards agree
    through DTensor's reduction of the check), so an overflow in a weight gradient of one stage, which does not
    flow back to the stages before it, left them stepping while that stage skipped, and their scales apart.
    Called at each training call's backward: one check of this rank's gradients and a one-element all-reduce
    over every rank. Returns whether any rank's gradients were non-finite."""
    device = grads[0].device if grads else env.device()
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True, device=device)
    overflow = (~finite).to(torch.int32).reshape(1)
    dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
    if not overflow.item():
        return False
    if bool(finite) and grads:
        grads[0][(0,) * grads[0].dim()] = float("nan")
    return True


def _no_backward_in_eval_mode(grad) -> None:
    raise RuntimeError(
        "pipeline parallel: this loss came from a call in eval mode, which runs the schedule's forward only (no "
        "gradients); to train, call model.train() before the call (switch dropout off per module if needed)"
    )


@dataclass
class _CallGradients:
    """A training call's gradients, apart from the parameters' until its returned loss's backward adds them
    (PipelineRunner._add_gradients; None once added). They live as long as that loss's graph."""

    grads: dict | None  # parameter -> this call's gradient
    params: list  # the parameters that train
    computed_at: float  # the factor the schedule's backward ran at
    used: dict  # unused-parameter tracker -> the parameters this call used (added to its record at the backward)
    provisional: bool = False  # computed_at was PROVISIONAL_SCALE: no loss had got its backward yet
    zeroed: dict = field(default_factory=dict)  # parameter -> its gradient, zeros before the call (clear_grad())
    restore: "weakref.finalize | None" = None  # gives zeroed gradients back as zeros if the loss gets no backward


def _zero_again(zeroed: dict) -> None:
    """Zeroed gradients that a call accumulated into or freed, given back to their parameters as zeros where
    nothing else was put in their place since: a call whose loss got no backward, once freed (a loop that sets
    gradients to None meanwhile and frees that loss later gets the zeros back), or one that raised."""
    with torch.no_grad():
        for p, grad in zeroed.items():
            if p.grad is None:
                p.grad = grad.zero_()


class _ScaledBackward(torch.autograd.Function):
    """The loss itself; its backward starts from `scale` instead of 1 (as `(loss * scale).backward()` would)."""

    @staticmethod
    def forward(ctx, loss, scale):
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _ReturnedLoss(torch.autograd.Function):
    """The loss model(...) returns: its value; its backward hands the incoming gradient (the factor the
    loop scaled the loss by) to `on_backward`."""

    @staticmethod
    def forward(ctx, anchor, value, on_backward):
        ctx.on_backward = on_backward
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.on_backward(grad)
        return None, None, None


def split_micro_batches(args, kwargs, count: int, sample_rows: SampleRows | None = None) -> list:
    """Split every batch-major tensor of (args, kwargs) into `count` equal micro-batches along dim 0;
    other values (and tensors with another leading size: a cache position's) go to every micro-batch unchanged.
    A vision-language model's media (`sample_rows`: pixel_values whose rows are images or their patches) are split
    with their samples; a `pixel_values*` tensor of another leading size that no `sample_rows` assigns is refused
    (every micro-batch would get every image)."""
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        raise ValueError("pipeline parallel: the model's inputs hold no batch tensor to split into micro-batches")
    starts = sample_rows.offsets(kwargs) if sample_rows is not None else {}
    batch = sample_count(kwargs, set(starts), named_only=True) or tensors[0].shape[0]
    for key, value in kwargs.items():
        if (key.startswith("pixel_values") and key not in starts and isinstance(value, torch.Tensor)
                and value.dim() > 0 and value.shape[0] != batch):
            raise ValueError(
                f"pipeline parallel: {key!r} has {value.shape[0]} row(s) where the batch has {batch} sample(s), and "
                f"tridist does not know which rows are which sample's for this model (sample_rows_of: {KNOWN_LAYOUTS}); "
                "give every sample one image of one size, or use no micro-batches (pp 1, num_micro_batches 1)")
    if batch % count:
        raise ValueError(
            f"pipeline parallel splits each batch into {count} micro-batches, but this rank's batch has {batch} "
            f"samples; use a batch size (per data-parallel rank) divisible by {count}, or set pp_config['micro_batches']"
        )
    size = batch // count
    media = split_samples({key: kwargs[key] for key in starts}, starts,
                          [(i * size, (i + 1) * size) for i in range(count)]) if starts else [{}] * count
    micro = []
    for i in range(count):
        part = [x[i * size : (i + 1) * size] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch else x for x in leaves]
        part_args, part_kwargs = tree_unflatten(part, spec)
        micro.append((part_args, {**part_kwargs, **media[i]}))
    return micro

