"""A training strategy (how a step is split over devices) and the rules that make one valid.

`validate` returns every broken rule as a sentence that says how to fix it, so a caller (the search,
`to_distributed`, a user building a Strategy by hand) can show all problems at once; `check` raises
`InvalidStrategy` with them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .model import ChannelMixer

if TYPE_CHECKING:
    from .hardware import Cluster
    from .model import ModelSpec

__all__ = ["Strategy", "InvalidStrategy", "RECOMPUTE_MODES", "SHARDING_LEVELS", "validate", "check", "stage_layers",
           "balanced_stage_layers", "rank_layers", "rank_layer_indices", "head_replicas", "kv_head_replicas", "tensor_parallel_problems"]

RECOMPUTE_MODES = ("none", "selective", "full")
SHARDING_LEVELS = (0, 1, 2, 3)  # ZeRO stage: 1 optimizer states, 2 + gradients, 3 + parameters


def stage_layers(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Decoder layers per pipeline stage, in stage order. Equal where the count divides; otherwise the
    middle stages take one layer more (ceil) and the first and last stages, which also run the embedding
    and the LM head with its loss, fewer (floor), as Llama 3 405B's 126 layers on 16 stages were laid out
    (7, 8 x 14, 7). More extra layers than middle stages go to the first stage, then to the last (the LM
    head and loss outweigh the embedding). The cost model and distcore's pipeline both use this layout."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages (each needs at least one)")
    base, extra = divmod(num_layers, num_stages)
    order = [*range(1, num_stages - 1), 0, num_stages - 1][:extra]  # middle stages first, then first, last
    return tuple(base + (stage in order) for stage in range(num_stages))


# Two stage costs closer than this, relative to the model's whole cost, are equal: costs are sums of floats, added in
# other orders.
_COST_TIE = 1e-9


def balanced_stage_layers(layer_costs: Sequence[float], num_stages: int, *, first: float = 0.0,
                          last: float = 0.0) -> tuple[int, ...]:
    """Decoder layers per pipeline stage that minimise the slowest stage's cost: contiguous stages of one layer
    at least, stage i costing the sum of its layers' `layer_costs` plus `first` on the first stage (the embedding)
    and `last` on the last (the LM head and its loss). The pipeline runs at its slowest stage's pace, so a layout
    that lowers that maximum is faster whatever the others cost. Of the layouts that reach the minimum,
    `stage_layers`' even one where it is among them, else the one with the least sum of squared stage costs (the
    most even). Exact: a dynamic program over the split points (O(stages x layers^2), cached by its callers).
    Stages, not ranks: with interleaving (rank r holding stages r, r + pp, ...) the ranks' sums are then close to
    balanced too, not necessarily the best rank-level layout (the search prices both it and the even one)."""
    n, costs = len(layer_costs), [float(c) for c in layer_costs]
    if num_stages < 1 or n < num_stages:
        raise ValueError(f"{n} layers cannot fill {num_stages} pipeline stages (each needs at least one)")
    if not all(math.isfinite(c) and c >= 0 for c in costs + [first, last]):
        raise ValueError("balanced_stage_layers: costs must be finite and non-negative")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(stage: int, start: int, end: int) -> float:
        return (prefix[end] - prefix[start] + (first if stage == 0 else 0.0)
                + (last if stage == num_stages - 1 else 0.0))

    def layout_costs(sizes) -> list[float]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [stage_cost(i, start, start + size) for i, (start, size) in enumerate(zip(starts, sizes))]

    # best[k][j]: the least maximum over the first k stages holding the first j layers
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            best[k][j] = min(max(best[k - 1][i], stage_cost(k - 1, i, j)) for i in range(k - 1, j))
    optimum = best[num_stages][n]
    bound = optimum + _COST_TIE * (prefix[-1] + first + last)
    even = stage_layers(n, num_stages)
    if max(layout_costs(even)) <= bound:
        return even
    # Of the layouts whose every stage is within the optimum: the least sum of squared stage costs.
    squares = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    squares[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                cost = stage_cost(k - 1, i, j)
                if cost <= bound and squares[k - 1][i] + cost * cost < squares[k][j]:
                    squares[k][j], choice[k][j] = squares[k - 1][i] + cost * cost, i
    sizes, end = [], n
    for k in range(num_stages, 0, -1):
        sizes.append(end - choice[k][end])
        end = choice[k][end]
    return tuple(reversed(sizes))


def _stage_sizes(num_layers: int, num_stages: int, layers_per_stage: tuple[int, ...] | None) -> tuple[int, ...]:
    if layers_per_stage is None:
        return stage_layers(num_layers, num_stages)
    sizes = tuple(layers_per_stage)
    if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 1:
        raise ValueError(f"layers_per_stage={sizes} must list {num_stages} positive layer counts adding up to "
                         f"{num_layers} layers")
    return sizes


def first_stage_layers(spec: "ModelSpec", strategy: "Strategy") -> int | None:
    """The decoder layers of the strategy's first pipeline stage (its first virtual stage, interleaved); None where its
    layers_per_stage lays out no valid stages (validate says why)."""
    try:
        return _stage_sizes(spec.num_layers, strategy.pp * strategy.virtual_pp, strategy.layers_per_stage)[0]
    except (ValueError, TypeError):
        return None


def rank_layers(num_layers: int, pp: int, virtual_pp: int = 1,
                layers_per_stage: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Decoder layers per pipeline rank: rank r holds stages r, r + pp, ... (torch's looped placement); the stages
    as `layers_per_stage` lists them (a Strategy's), else as `stage_layers` lays them out."""
    per_stage = _stage_sizes(num_layers, pp * virtual_pp, layers_per_stage)
    return tuple(sum(per_stage[r::pp]) for r in range(pp))


def rank_layer_indices(num_layers: int, pp: int, virtual_pp: int = 1,
                       layers_per_stage: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], ...]:
    """The decoder layers each pipeline rank holds, by index (stages as `rank_layers` takes them, rank r
    holding stages r, r + pp, ...): which of them are mixture-of-experts layers sets a rank's cost."""
    per_stage = _stage_sizes(num_layers, pp * virtual_pp, layers_per_stage)
    starts = [sum(per_stage[:i]) for i in range(len(per_stage))]
    stages = [tuple(range(start, start + n)) for start, n in zip(starts, per_stage)]
    return tuple(tuple(i for stage in stages[r::pp] for i in stage) for r in range(pp))


class InvalidStrategy(ValueError):
    """A strategy breaks one or more validity rules (listed in the message and in `.reasons`)."""

    def __init__(self, strategy: "Strategy", reasons: list[str]):
        self.strategy = strategy
        self.reasons = list(reasons)
        super().__init__(f"invalid strategy {strategy.describe()}: " + "; ".join(reasons))


@dataclass(frozen=True)
class Strategy:
    """dp x tp x pp devices; ZeRO `sharding_level` over dp; `sequence_parallel` (Megatron SP) within tp;
    a step of `num_micro_batches` micro-batches of `micro_batch_size` sequences per dp rank; activation
    `recompute` ("none", "selective": the attention core, "full": the whole layer); `overlap_tp_comm`
    (tp collectives fused with the neighbouring GEMMs: all-gather+matmul, matmul+reduce-scatter);
    `virtual_pp` layer chunks per pipeline rank (interleaved 1F1B); `ep` expert-parallel degree (mixtures of
    experts): the routed experts split over `ep` of the dp ranks (ep divides dp, as torchtitan and
    Megatron-Core fold expert parallel into data parallel), tokens sent to their experts' ranks and back
    by all-to-all, each expert's gradients reduced over the dp / ep ranks that hold it. Under tensor
    parallel the engine decides the experts' split (`EngineProfile.expert_tensor_parallel`): Megatron-Core
    splits their ffn width over tp as the dense MLP's (its default expert tensor parallel = tp), the torch
    engines (distcore) keep each expert whole on every tp rank (expert tensor parallel 1), so only the
    former needs tp to divide the experts' widths. `layers_per_stage`: the decoder layers of each of the
    pp x virtual_pp stages, in stage order (None: `stage_layers`' even layout; the search offers the cost model's
    balanced one, `cost.balanced_layout`, where it is faster)."""

    dp: int
    tp: int
    pp: int
    sharding_level: int = 0
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    recompute: str = "none"
    overlap_tp_comm: bool = False
    virtual_pp: int = 1
    ep: int = 1
    layers_per_stage: tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.layers_per_stage, list):  # as JSON gives it back (to_dict / from_dict): hashable
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.micro_batch_size * self.num_micro_batches

    def sort_key(self) -> tuple:
        """A total order used to break exact ties in predicted time and memory deterministically:
        fewer moving parts first (smaller tp/pp, less sharding, no recompute)."""
        return (self.tp, self.pp, self.virtual_pp, self.layers_per_stage is not None, self.ep, self.sharding_level,
                self.sequence_parallel,
                self.overlap_tp_comm, RECOMPUTE_MODES.index(self.recompute) if self.recompute in RECOMPUTE_MODES else 9,
                -self.micro_batch_size, self.dp)

    def describe(self) -> str:
        """Compact one-line form, e.g. 'dp16 tp8 pp2 zero1 sp mbs1x48 rc=full' ('pp4[9,9,7,1]': the layers of
        each stage, where the strategy lists them)."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.virtual_pp > 1:
            parts[-1] += f"x{self.virtual_pp}"
        if self.layers_per_stage is not None:
            parts[-1] += "[" + ",".join(map(str, self.layers_per_stage)) + "]"
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.sharding_level:
            parts.append(f"zero{self.sharding_level}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.overlap_tp_comm:
            parts.append("overlap")
        parts.append(f"mbs{self.micro_batch_size}x{self.num_micro_batches}")
        parts.append(f"rc={self.recompute}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Strategy":
        return cls(**data)


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _divides(name: str, degree: int, quantity_name: str, quantity: int) -> str | None:
    if quantity % degree:
        return f"{name}={degree} does not divide {quantity_name}={quantity}"
    return None


def kv_head_replicas(spec: "ModelSpec", tp: int) -> int:
    """On how many tp ranks each key/value head is computed (`head_replicas` of the model's key/value heads;
    `tensor_parallel_problems` says where replicas are allowed)."""
    return head_replicas(spec.num_kv_heads, tp)


def head_replicas(heads: int, tp: int) -> int:
    """On how many of `tp` ranks each of `heads` heads is computed: 1 where tp divides them (each rank its own),
    tp / heads where tp exceeds them and they divide tp (each rank the head its local query heads use)."""
    return tp // heads if 0 < heads < tp and tp % heads == 0 else 1  # (0 heads: a model without attention)


def tensor_parallel_problems(spec: "ModelSpec", cluster: "Cluster", tp: int) -> list[str]:
    """Why `tp` cannot split this model on the cluster's engine, as fix-it sentences ([] = it can): tensor parallel
    splits the query heads, the hidden and ffn widths, the vocabulary and the Gated DeltaNet heads evenly (the
    experts' ffn too where the engine splits them), and the key/value heads evenly or, where they are fewer than the
    ranks and the engine replicates them (EngineProfile.replicated_kv_heads), each head over tp / kv ranks (also
    those of a projection packing [q | k | v]; not of one packing [q..q k v] for each of several key/value heads)."""
    problems = []
    linear = spec.gated_delta_net
    # Key heads that divide tp where they are replicable and the engine replicates heads (Mamba-2's state groups: each
    # on tp / groups ranks)
    replicated_keys = (linear and linear.key_heads_replicable and tp % linear.num_k_heads == 0
                       and cluster.engine.replicated_kv_heads)
    replicable_keys = linear and linear.key_heads_replicable and cluster.engine.replicated_kv_heads
    linear_heads = ((() if replicated_keys or replicable_keys else (("gated_delta_net.num_k_heads", linear.num_k_heads),))
                    + (("gated_delta_net.num_v_heads", linear.num_v_heads),)) if linear else ()
    if isinstance(linear, ChannelMixer):  # LFM2's, Mamba-1's: their channels are the units
        linear_heads = (("gated_delta_net.channels", linear.channels),)
    if replicable_keys and not replicated_keys and linear.num_k_heads % tp:
        problems.append(f"tp={tp} neither divides the {linear.num_k_heads} state groups of the Mamba-2 mixers "
                        "(n_groups; gated_delta_net.num_k_heads) nor is a multiple of them; pick a tp that divides "
                        "them or that they divide")
    widths = [("num_heads", spec.num_heads), ("hidden_size", spec.hidden_size),
              ("ffn_hidden_size", spec.ffn_hidden_size), ("vocab_size", spec.vocab_size), *linear_heads]
    if spec.is_moe and cluster.engine.expert_tensor_parallel:  # the experts' ffn split over tp as the dense MLP's
        widths += [("expert_ffn_hidden_size", spec.expert_ffn_hidden_size),
                   ("shared_ffn_hidden_size", spec.shared_ffn_hidden_size)]
    problems += [f"{problem}; pick a tp that divides it" for name, quantity in widths
                 if (problem := _divides("tp", tp, name, quantity))]
    kv = spec.num_kv_heads
    if kv % tp == 0:
        return problems
    replicable = tp % kv == 0 and cluster.engine.replicated_kv_heads
    if replicable and spec.packed_unequal_qkv and spec.qkv_interleaved and kv > 1:
        problems.append(f"tp={tp} exceeds num_kv_heads={kv}, whose heads would be replicated over the tp ranks, which "
                        "a projection packing [q..q k v] for each key/value head cannot be; pick a tp that divides "
                        "num_kv_heads")
    elif replicable and spec.qk_norm == "projection":
        problems.append(f"tp={tp} exceeds num_kv_heads={kv}: the key norm over the whole projection cannot run on "
                        "replicated key heads; pick a tp that divides num_kv_heads")
    elif not replicable:
        how = (f" or that it divides (the {cluster.engine.name} engine then replicates each key/value head)"
               if cluster.engine.replicated_kv_heads else f" (the {cluster.engine.name} engine splits them evenly)")
        problems.append(f"tp={tp} does not divide num_kv_heads={kv}; pick a tp that divides it{how}")
    return problems


def validate(spec: "ModelSpec", cluster: "Cluster", strategy: Strategy, *, global_batch_size: int) -> list[str]:
    """Every rule `strategy` breaks for this model, cluster and batch, as fix-it sentences ([] = valid)."""
    s = strategy
    reasons: list[str] = []
    for name in ("dp", "tp", "pp", "micro_batch_size", "num_micro_batches", "virtual_pp", "ep"):
        if not _is_positive_int(getattr(s, name)):
            reasons.append(f"{name} must be a positive integer, got {getattr(s, name)!r}")
    if reasons:
        return reasons  # the arithmetic below needs integers
    if s.num_devices != cluster.num_devices:
        reasons.append(f"dp*tp*pp = {s.dp}*{s.tp}*{s.pp} = {s.num_devices} must equal the cluster's "
                       f"{cluster.num_devices} devices ({cluster.nodes} nodes x {cluster.devices_per_node})")
    if s.global_batch_size != global_batch_size:
        reasons.append(f"dp*micro_batch_size*num_micro_batches = {s.dp}*{s.micro_batch_size}*{s.num_micro_batches} "
                       f"= {s.global_batch_size} must equal the global batch size {global_batch_size}")
    reasons += tensor_parallel_problems(spec, cluster, s.tp)
    if s.ep > 1:
        if not spec.is_moe:
            reasons.append(f"ep={s.ep}: expert parallel needs a mixture-of-experts model; use ep=1")
        elif spec.num_experts % s.ep:
            reasons.append(f"ep={s.ep} does not divide num_experts={spec.num_experts}; pick an ep that divides it")
        if s.dp % s.ep:
            reasons.append(f"ep={s.ep} must divide dp={s.dp} (the experts are split over data-parallel ranks)")
    # Stages need not hold equal layer counts (stage_layers), but each holds one at least.
    if s.layers_per_stage is not None:
        sizes = s.layers_per_stage
        if s.pp == 1:
            reasons.append("layers_per_stage lays out pipeline stages: it needs pp > 1; use None")
        elif (not isinstance(sizes, tuple) or len(sizes) != s.pp * s.virtual_pp or not all(map(_is_positive_int, sizes))
                or sum(sizes) != spec.num_layers):
            found = (f" ({len(sizes)} counts adding up to {sum(sizes)})"
                     if isinstance(sizes, tuple) and all(isinstance(n, int) for n in sizes) else "")
            reasons.append(f"layers_per_stage={sizes!r}{found} must list pp*virtual_pp = {s.pp * s.virtual_pp} "
                           f"positive layer counts adding up to the {spec.num_layers} layers; or None for the even "
                           "layout")
    if spec.num_layers < s.pp * s.virtual_pp:
        reasons.append(f"pp*virtual_pp = {s.pp}*{s.virtual_pp} stages exceed the {spec.num_layers} layers (each "
                       "stage needs one at least); pick fewer stages")
    elif s.pp > 1 and spec.layers_added_to and (first := first_stage_layers(spec, s)) is not None and (
            first <= spec.layers_added_to):
        reasons.append(f"the first pipeline stage holds {first} layer(s), and the model adds to the outputs of its first "
                       f"{spec.layers_added_to} layers before the next layer takes them (Qwen3-VL's deepstack "
                       "features), which a stage boundary among them would leave out: give layers_per_stage with at "
                       f"least {spec.layers_added_to + 1} layers on the first stage")
    # the pp*virtual_pp stages may be uneven (stage_layers), as without interleaving
    if s.virtual_pp > 1 and spec.num_layers >= s.pp * s.virtual_pp:
        if s.pp == 1:
            reasons.append("virtual_pp > 1 (interleaved schedule) needs pp > 1")
        elif s.num_micro_batches % s.pp:
            reasons.append(f"the interleaved schedule needs num_micro_batches ({s.num_micro_batches}) to be a "
                           f"multiple of pp ({s.pp})")
    if s.pp > 1 and s.num_micro_batches < s.pp:
        reasons.append(f"1F1B needs at least one micro-batch per stage: num_micro_batches={s.num_micro_batches} "
                       f"< pp={s.pp}")
    if s.sharding_level not in SHARDING_LEVELS:
        reasons.append(f"sharding_level must be one of {SHARDING_LEVELS}, got {s.sharding_level!r}")
    elif s.sharding_level > 0 and s.dp == 1:
        reasons.append(f"sharding_level={s.sharding_level} needs dp > 1 (nothing to shard over); use 0")
    if s.recompute not in RECOMPUTE_MODES:
        reasons.append(f"recompute must be one of {RECOMPUTE_MODES}, got {s.recompute!r}")
    elif s.recompute == "selective" and not spec.num_heads:
        reasons.append("selective recompute (of the attention core) has nothing to recompute in a model without "
                       "attention; use 'none' or 'full'")
    elif s.recompute == "selective" and spec.flash_attention:
        reasons.append("selective recompute (of the attention core) is what flash attention already does; "
                       "use 'none' or 'full'")
    if s.sequence_parallel:
        if s.tp == 1:
            reasons.append("sequence_parallel needs tp > 1")
        elif spec.seq_len % s.tp:
            reasons.append(f"sequence_parallel splits the sequence: tp={s.tp} must divide seq_len={spec.seq_len}")
    if s.overlap_tp_comm and not s.sequence_parallel:
        reasons.append("overlap_tp_comm needs sequence_parallel (the overlapped kernels are all-gather+matmul "
                       "and matmul+reduce-scatter)")
    if s.overlap_tp_comm and not cluster.engine.overlap_tp_comm:
        reasons.append(f"overlap_tp_comm: the {cluster.engine.name} engine does not overlap tensor parallel's "
                       "communication with its matmuls (it would run without); use overlap_tp_comm=False")
    elif s.overlap_tp_comm and s.recompute == "selective" and not cluster.engine.overlap_with_selective_recompute:
        reasons.append(f"overlap_tp_comm with selective recompute: the {cluster.engine.name} engine recomputes the "
                       "attention core outside the overlapped region's gather; recompute 'full' or 'none'")
    elif s.overlap_tp_comm and kv_head_replicas(spec, s.tp) > 1:
        reasons.append(f"overlap_tp_comm with tp={s.tp} above num_kv_heads={spec.num_kv_heads}: the replicated key/value "
                       "projections take their input whole, not from the overlapped all-gather ring; use "
                       "overlap_tp_comm=False")
    return reasons


def check(spec: "ModelSpec", cluster: "Cluster", strategy: Strategy, *, global_batch_size: int) -> None:
    """Raise `InvalidStrategy` listing every broken rule."""
    reasons = validate(spec, cluster, strategy, global_batch_size=global_batch_size)
    if reasons:
        raise InvalidStrategy(strategy, reasons)
