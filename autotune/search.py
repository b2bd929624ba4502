"""Search for the fastest strategy that fits in memory: an Optuna study over process layouts, each
trial solved exactly by the cost model.

Why two levels. The full space (dp, tp, pp, sharding, sp, overlap, micro-batch size and count,
recompute, virtual stages) has tens of thousands of points for a 1024-device cluster. The cost model
scores a point in ~20 us, so the whole space is cheap to score, but not as Optuna trials (about a
millisecond each in memory, tens of milliseconds in SQLite) and not exactly by a sampler. So a trial
is a *layout* (tp, pp; dp follows), the decision that fixes the process mesh, and inside a trial the
remaining knobs (a few hundred points) are enumerated exactly. Realistic clusters have a few dozen
layouts, so the study enumerates them all (every layout enqueued with `enqueue_trial`) and the answer
is the exact optimum; for larger layout spaces (or `method="tpe"`) a TPE sampler runs a trial budget,
warm-started with the classic heuristic (tp inside a node, the smallest pp that fits, dp for the rest).

Optuna 5 specifics: memory is a constraint set with `trial.set_constraint` (feasible when <= 0), so
`study.best_trial` is the best layout that fits; the categorical choices of tp and pp are fixed for a
given problem (all divisors that the model allows) and invalid combinations are told as pruned.
Each trial stores its layout's best candidates, so a study in a persistent storage (SQLite file, any
RDB URL) is resumed with `load_if_exists`: a second search reuses every finished trial.

`exhaustive_search` is the reference: plain enumeration of every raw combination filtered by
`validate`, with no Optuna and none of the layout logic; tests compare the two.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from .cost import COST_MODEL_VERSION, balanced_layout, estimate
from .hardware import Cluster, cache_dir
from .measured import MEASURE_PICKS
from .model import ModelSpec
from .strategy import (RECOMPUTE_MODES, SHARDING_LEVELS, Strategy, kv_head_replicas, stage_layers, tensor_parallel_problems,
                       validate)

__all__ = [
    "Candidate",
    "SearchResult",
    "SearchSpace",
    "LayoutResult",
    "search",
    "exhaustive_search",
    "enumerate_layouts",
    "layout_strategies",
    "heuristic_layout",
    "pareto_front",
    "default_storage",
    "EXHAUSTIVE_LAYOUT_LIMIT",
]

# Up to this many layouts every one is a trial (exact); beyond it TPE runs a budget. 128 layouts
# cost ~0.1 s of Optuna overhead in memory and a few seconds in SQLite; realistic clusters have < 60.
EXHAUSTIVE_LAYOUT_LIMIT = 128
TPE_DEFAULT_TRIALS = 64  # TPE's budget when the layout space is too large to enumerate
STORED_CANDIDATES_PER_LAYOUT = 10  # kept in each trial, so a resumed search can rank without re-solving
PROGRESS_INTERVAL_S = 0.5  # minimum time between two progress lines
STUDY_FORMAT_VERSION = 2  # bump when what a trial stores changes (2: a strategy's layers_per_stage)


@dataclass(frozen=True)
class SearchSpace:
    """Which values of each knob the search may choose (the lead can restrict it to what the runtime
    supports). `tp`/`pp`/`ep` of None mean every degree the model and cluster allow."""

    sharding_levels: tuple[int, ...] = SHARDING_LEVELS
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    sequence_parallel: tuple[bool, ...] = (False, True)
    overlap_tp_comm: tuple[bool, ...] = (False, True)
    max_virtual_pp: int = 4
    max_micro_batch_size: int | None = None
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None  # expert-parallel degrees (mixtures of experts); None: every one allowed
    num_micro_batches: tuple[int, ...] | None = None  # None: any that splits the batch
    # Pipeline stages as stage_layers lays them out (False) and balanced by FLOPs (True: cost.balanced_layout, where
    # it differs)
    balanced_stages: tuple[bool, ...] = (False, True)

    def signature(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Candidate:
    """One ranked strategy: predicted step time, peak memory per device, model TFLOP/s per device and
    the flat breakdown of `Estimate.breakdown()`."""

    strategy: Strategy
    step_time_s: float
    memory_bytes_per_device: float
    tflops_per_device: float
    breakdown: dict = field(default_factory=dict, compare=False, hash=False)

    def sort_key(self) -> tuple:
        """Fastest first; exact ties go to less memory, then to the simpler strategy."""
        return (self.step_time_s, self.memory_bytes_per_device, self.strategy.sort_key())

    def to_dict(self) -> dict:
        return {"strategy": self.strategy.to_dict(), "step_time_s": self.step_time_s,
                "memory_bytes_per_device": self.memory_bytes_per_device,
                "tflops_per_device": self.tflops_per_device, "breakdown": dict(self.breakdown)}

    @classmethod
    def from_dict(cls, data: dict) -> "Candidate":
        return cls(Strategy.from_dict(data["strategy"]), data["step_time_s"], data["memory_bytes_per_device"],
                   data["tflops_per_device"], dict(data.get("breakdown", {})))

    @classmethod
    def from_estimate(cls, est) -> "Candidate":
        return cls(est.strategy, est.step_time_s, est.memory_bytes_per_device, est.tflops_per_device, est.breakdown())


@dataclass
class LayoutResult:
    """The exact solution of one layout (tp, pp): its fastest feasible candidates, its time/memory
    Pareto front, and, when nothing fits, the leanest candidate (for the error message)."""

    tp: int
    pp: int
    dp: int
    top: list[Candidate]
    pareto: list[Candidate]
    evaluated: int
    feasible: int
    leanest: Candidate | None = None
    capacity_bytes: float = 0.0

    @property
    def best(self) -> Candidate | None:
        return self.top[0] if self.top else None

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "evaluated": self.evaluated, "feasible": self.feasible,
                "capacity_bytes": self.capacity_bytes, "top": [c.to_dict() for c in self.top],
                "pareto": [c.to_dict() for c in self.pareto],
                "leanest": self.leanest.to_dict() if self.leanest else None}

    @classmethod
    def from_json(cls, data: dict) -> "LayoutResult":
        return cls(data["tp"], data["pp"], data["dp"], [Candidate.from_dict(c) for c in data["top"]],
                   [Candidate.from_dict(c) for c in data["pareto"]], data["evaluated"], data["feasible"],
                   Candidate.from_dict(data["leanest"]) if data.get("leanest") else None,
                   data.get("capacity_bytes", 0.0))


@dataclass
class SearchResult:
    """`best` (None when nothing fits: see `message`), `ranked` (fastest first, out-of-memory
    strategies excluded), the time/memory `pareto` front (by memory), one best per layout, and how
    the search ran (study name, storage, trials run and reused, strategies scored, seconds)."""

    best: Candidate | None
    ranked: list[Candidate]
    pareto: list[Candidate]
    layouts: list[LayoutResult]
    spec: ModelSpec
    cluster: Cluster
    global_batch_size: int
    method: str
    study_name: str
    storage: str
    n_trials: int
    n_new_trials: int
    n_evaluated: int
    elapsed_s: float
    message: str = ""
    study: object = field(default=None, repr=False)
    pruned: tuple[str, ...] = ()  # what the search left out and why (the engine's and the caller's limits)
    measured: object = None  # a measured.MeasuredRanking after a measured search

    def layout_rank(self, tp: int, pp: int) -> int | None:
        """1-based rank of a layout by its best feasible time (None if it has no feasible strategy)."""
        ordered = sorted((l for l in self.layouts if l.best), key=lambda l: l.best.sort_key())
        for rank, layout in enumerate(ordered, 1):
            if (layout.tp, layout.pp) == (tp, pp):
                return rank
        return None

    def to_frame(self, candidates: Iterable[Candidate] | None = None):
        """The ranked candidates as a pandas DataFrame (strategy fields, time, memory, breakdown)."""
        import pandas as pd  # lazily: `import tridist.autotune` must not import pandas

        rows = []
        for rank, cand in enumerate(self.ranked if candidates is None else candidates, 1):
            row = {"rank": rank, **cand.strategy.to_dict(), "step_time_s": cand.step_time_s,
                   "memory_gb": cand.memory_bytes_per_device / 1e9, "tflops_per_device": cand.tflops_per_device}
            row.update(cand.breakdown)
            rows.append(row)
        return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------- enumeration


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_choices(spec: ModelSpec, cluster: Cluster, space: SearchSpace) -> list[int]:
    """Tensor-parallel degrees the model allows on the cluster's engine: divisors of the device count that split
    its heads and widths (strategy.tensor_parallel_problems; the same for every trial of a study)."""
    allowed = set(space.tp) if space.tp is not None else None
    return [t for t in _divisors(cluster.num_devices)
            if not tensor_parallel_problems(spec, cluster, t) and (allowed is None or t in allowed)]


def _pp_choices(spec: ModelSpec, cluster: Cluster, space: SearchSpace) -> list[int]:
    """Pipeline degrees: divisors of the device count with a layer for every stage (a degree that does
    not divide the layer count gives uneven stages: strategy.stage_layers), the first stage past the layers the model
    adds to (ModelSpec.layers_added_to: those and one more) where there is more than one stage."""
    allowed = set(space.pp) if space.pp is not None else None
    return [p for p in _divisors(cluster.num_devices)
            if (p == 1 or p <= spec.num_layers - spec.layers_added_to) and (allowed is None or p in allowed)]


# Where the runtime cannot apply a knob, the value the search keeps it at.
KEPT_AT = {"tp": (1,), "pp": (1,), "ep": (1,), "num_micro_batches": (1,), "recompute": ("none",),
           "sequence_parallel": (False,), "overlap_tp_comm": (False,), "balanced_stages": (False,)}


def engine_space(space: SearchSpace, cluster: Cluster, excluded: dict[str, str] | None = None, *,
                 spec: ModelSpec | None = None) -> tuple[SearchSpace, tuple[str, ...]]:
    """`space` without what the runtime cannot apply, and the reasons (shown in reports): `excluded`,
    {knob: why} from the caller (distcore's limits for a model, `distcore.auto.unsupported`), and what
    the cluster's engine cannot run (for `spec`'s model)."""
    limits = dict(excluded or {})
    if spec is not None and spec.is_moe and not cluster.engine.expert_tensor_parallel:
        limits.setdefault("overlap_tp_comm", f"the {cluster.engine.name} engine runs the MoE blocks whole on every tp "
                                             "rank, with no column-parallel entry for the all-gather to overlap with "
                                             "(EngineProfile.expert_tensor_parallel)")
    unknown = sorted(set(limits) - set(KEPT_AT))
    if unknown:
        raise ValueError(f"search: cannot exclude {unknown}; excludable knobs: {sorted(KEPT_AT)}")
    if not cluster.engine.overlap_tp_comm:
        limits.setdefault("overlap_tp_comm", f"the {cluster.engine.name} engine does not overlap tensor parallel's "
                                             "communication with its matmuls")
    pruned = []
    for knob, why in limits.items():
        allowed = getattr(space, knob)
        if allowed is None or set(allowed) - set(KEPT_AT[knob]):
            space = dataclasses.replace(space, **{knob: KEPT_AT[knob]})
            pruned.append(f"{knob} kept at {KEPT_AT[knob][0]}: {why}")
    return space, tuple(pruned)


def enumerate_layouts(spec: ModelSpec, cluster: Cluster, global_batch_size: int,
                      space: SearchSpace | None = None) -> list[tuple[int, int]]:
    """Valid (tp, pp) pairs: tp·pp divides the devices and dp = devices/(tp·pp) divides the batch."""
    space = space or SearchSpace()
    n = cluster.num_devices
    layouts = []
    for tp in _tp_choices(spec, cluster, space):
        for pp in _pp_choices(spec, cluster, space):
            if n % (tp * pp) == 0 and global_batch_size % (n // (tp * pp)) == 0:
                layouts.append((tp, pp))
    return layouts


def layout_strategies(spec: ModelSpec, cluster: Cluster, global_batch_size: int, tp: int, pp: int,
                      space: SearchSpace | None = None) -> Iterator[Strategy]:
    """Every valid strategy of one layout, built so that it satisfies the rules by construction."""
    space = space or SearchSpace()
    dp = cluster.num_devices // (tp * pp)
    local_batch = global_batch_size // dp
    # Interleaving: v stages per rank, of a layer at least (uneven where pp*v does not divide the layers).
    max_vpp = spec.num_layers // pp
    levels = [lvl for lvl in space.sharding_levels if lvl == 0 or dp > 1]
    recompute = [r for r in space.recompute if not (r == "selective" and (spec.flash_attention or not spec.num_heads))]
    tp_modes = [(False, False)]
    if tp > 1 and spec.seq_len % tp == 0 and True in space.sequence_parallel:
        tp_modes.append((True, False))
        if True in space.overlap_tp_comm and kv_head_replicas(spec, tp) == 1:  # replicated k/v: no overlap
            tp_modes.append((True, True))
    if False not in space.sequence_parallel and tp > 1:
        tp_modes = [mode for mode in tp_modes if mode[0]]
    if False not in space.overlap_tp_comm:
        tp_modes = [mode for mode in tp_modes if mode[1]]
    # Expert parallel: degrees that divide dp and the expert count (ep folds into dp).
    eps = [e for e in _divisors(dp) if spec.num_experts % e == 0 and (space.ep is None or e in space.ep)] \
        if spec.is_moe else [1]
    for mbs in _divisors(local_batch):
        if space.max_micro_batch_size is not None and mbs > space.max_micro_batch_size:
            break
        m = local_batch // mbs
        if (pp > 1 and m < pp) or (space.num_micro_batches is not None and m not in space.num_micro_batches):
            continue
        vpps = [1] if pp == 1 else [v for v in range(1, min(max_vpp, space.max_virtual_pp) + 1)
                                    if v == 1 or m % pp == 0]
        for v, level, (sp, overlap), rc, ep in itertools.product(vpps, levels, tp_modes, recompute, eps):
            if overlap and rc == "selective" and not cluster.engine.overlap_with_selective_recompute:
                continue  # the engine's selective recompute runs outside the overlapped region (strategy.py)
            for stages in _stage_layouts(spec, pp * v, space):
                yield Strategy(dp, tp, pp, level, sp, mbs, m, rc, overlap, v, ep, stages)


def _stage_layouts(spec: ModelSpec, num_stages: int, space: SearchSpace) -> list[tuple[int, ...] | None]:
    """The stage layouts a strategy of `num_stages` pipeline stages may take: stage_layers' even one (None) and the
    FLOPs-balanced one where it differs (cost.balanced_layout); None alone where the stages cannot each hold a layer
    (validate refuses such a strategy). Those whose first stage ends among the layers the model adds to
    (ModelSpec.layers_added_to) are left out; where that leaves none, the first stage takes those layers and one more,
    the other stages the rest as stage_layers lays them out."""
    balanced = (balanced_layout(spec, num_stages)
                if 1 < num_stages <= spec.num_layers and True in space.balanced_stages else None)
    layouts = [None] if balanced is None else [None, balanced] if False in space.balanced_stages else [balanced]
    first = spec.layers_added_to + 1  # the fewest layers the first stage may hold
    if first > 1 and 1 < num_stages <= spec.num_layers:
        layouts = [layout for layout in layouts if (layout or stage_layers(spec.num_layers, num_stages))[0] >= first]
        if not layouts and spec.num_layers - first >= num_stages - 1:  # those layers, the others spread evenly
            layouts = [(first, *stage_layers(spec.num_layers - first, num_stages - 1))]
    return layouts


def pareto_front(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Candidates no other one beats in both step time and memory, by increasing memory."""
    front: list[Candidate] = []
    for cand in sorted(candidates, key=lambda c: (c.memory_bytes_per_device, c.step_time_s, c.strategy.sort_key())):
        if not front or cand.step_time_s < front[-1].step_time_s:
            front.append(cand)
    return front


def _pareto_estimates(estimates: list) -> list:
    """`pareto_front` on estimates (no breakdown dicts built for the dominated ones)."""
    front = []
    for est in sorted(estimates, key=lambda e: (e.memory_bytes_per_device, e.step_time_s, e.strategy.sort_key())):
        if not front or est.step_time_s < front[-1].step_time_s:
            front.append(est)
    return front


def _solve_layout(spec: ModelSpec, cluster: Cluster, global_batch_size: int, tp: int, pp: int,
                  space: SearchSpace, keep: int) -> LayoutResult:
    """Score every strategy of the layout; keep its `keep` fastest feasible ones (and the fastest of each
    expert-parallel degree, for reports) and its Pareto front."""
    feasible = []
    leanest = None
    evaluated = 0
    capacity = 0.0
    for strategy in layout_strategies(spec, cluster, global_batch_size, tp, pp, space):
        est = estimate(spec, cluster, strategy, global_batch_size=global_batch_size, validate=False)
        evaluated += 1
        capacity = est.capacity_bytes
        if est.fits:
            feasible.append(est)
        elif leanest is None or est.memory_bytes_per_device < leanest.memory_bytes_per_device:
            leanest = est
    feasible.sort(key=lambda e: (e.step_time_s, e.memory_bytes_per_device, e.strategy.sort_key()))
    kept = feasible[:keep]
    for ep in sorted({e.strategy.ep for e in feasible} - {e.strategy.ep for e in kept}):
        kept.append(next(e for e in feasible if e.strategy.ep == ep))  # the fastest of every ep degree too
    top = [Candidate.from_estimate(e) for e in kept]
    pareto = [Candidate.from_estimate(e) for e in _pareto_estimates(feasible)]
    dp = cluster.num_devices // (tp * pp)
    return LayoutResult(tp, pp, dp, top, pareto, evaluated, len(feasible),
                        Candidate.from_estimate(leanest) if leanest is not None and not feasible else None, capacity)


def heuristic_layout(spec: ModelSpec, cluster: Cluster, global_batch_size: int,
                     space: SearchSpace | None = None,
                     solved: dict | None = None) -> tuple[int, int] | None:
    """The classic rule: the largest tp that stays inside a node, then the smallest pp whose best
    strategy fits in memory, dp for the rest (None when no such layout fits)."""
    space = space or SearchSpace()
    layouts = enumerate_layouts(spec, cluster, global_batch_size, space)
    solved = {} if solved is None else solved
    tps = sorted({tp for tp, _ in layouts}, key=lambda t: (t > cluster.devices_per_node, -t if t <= cluster.devices_per_node else t))
    for tp in tps:
        for pp in sorted(pp for t, pp in layouts if t == tp):
            if (tp, pp) not in solved:
                solved[(tp, pp)] = _solve_layout(spec, cluster, global_batch_size, tp, pp, space, STORED_CANDIDATES_PER_LAYOUT)
            if solved[(tp, pp)].best is not None:
                return tp, pp
    return None


# ------------------------------------------------------------------------------------ exhaustive


def exhaustive_search(spec: ModelSpec, cluster: Cluster, *, global_batch_size: int,
                      space: SearchSpace | None = None, top_k: int = 10) -> list[Candidate]:
    """The reference answer: every raw combination of the knobs, kept if `validate` accepts it and
    it fits in memory, sorted fastest first (no Optuna, no layout decomposition)."""
    space, _ = engine_space(space or SearchSpace(), cluster, spec=spec)  # what search() prunes, pruned alike
    n = cluster.num_devices
    found = []
    degrees = _divisors(n)
    mbs_values = [b for b in _divisors(global_batch_size)
                  if space.max_micro_batch_size is None or b <= space.max_micro_batch_size]
    tps = set(space.tp) if space.tp is not None else None
    pps = set(space.pp) if space.pp is not None else None
    for dp, tp in itertools.product(degrees, degrees):
        if n % (dp * tp) or (tps is not None and tp not in tps):
            continue
        pp = n // (dp * tp)
        if pps is not None and pp not in pps:
            continue
        for mbs in mbs_values:
            if global_batch_size % (dp * mbs):
                continue
            m = global_batch_size // (dp * mbs)
            if space.num_micro_batches is not None and m not in space.num_micro_batches:
                continue
            eps = [e for e in degrees if space.ep is None or e in space.ep]
            for v, level, sp, overlap, rc, ep in itertools.product(
                    range(1, space.max_virtual_pp + 1), space.sharding_levels, space.sequence_parallel,
                    space.overlap_tp_comm, space.recompute, eps):
                for stages in _stage_layouts(spec, pp * v, space):
                    strategy = Strategy(dp, tp, pp, level, sp, mbs, m, rc, overlap, v, ep, stages)
                    if validate(spec, cluster, strategy, global_batch_size=global_batch_size):
                        continue
                    est = estimate(spec, cluster, strategy, global_batch_size=global_batch_size, validate=False)
                    if est.fits:
                        found.append(Candidate.from_estimate(est))
    found.sort(key=Candidate.sort_key)
    return found[:top_k] if top_k else found


# ----------------------------------------------------------------------------------------- storage


def default_storage() -> str:
    """The persistent study database used by `tridist tune`: <cache_dir>/tune.db (SQLite)."""
    return f"sqlite:///{cache_dir() / 'tune.db'}"


JOURNAL_SUFFIXES = (".log", ".journal")  # a path with these suffixes is an Optuna journal file


def _resolve_storage(storage) -> tuple[object, str]:
    """(what optuna.create_study takes, a printable description). None or "memory" -> in memory;
    a URL ("sqlite:///x.db", "postgresql://...") as is; a path ending in .log/.journal -> an Optuna
    journal file (append-only, no SQL: ~10x cheaper per trial than SQLite); any other path -> an
    SQLite file there."""
    if storage is None or storage in ("memory", ":memory:"):
        return None, "memory"
    if isinstance(storage, (str, Path)):
        text = str(storage)
        if "://" in text:
            if text.startswith("sqlite:///"):
                Path(text[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
            return text, text
        path = Path(text).expanduser().resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix in JOURNAL_SUFFIXES:
            from optuna.storages import JournalStorage
            from optuna.storages.journal import JournalFileBackend

            return JournalStorage(JournalFileBackend(str(path))), f"journal:{path}"
        url = f"sqlite:///{path}"
        return url, url
    return storage, type(storage).__name__  # an optuna BaseStorage instance


def _study_name(spec: ModelSpec, cluster: Cluster, global_batch_size: int, space: SearchSpace) -> str:
    """Deterministic name of the problem, so that the same search finds (and resumes) its study."""
    spec_fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "structure"}
    problem = {"spec": spec_fields, "device": cluster.profile.to_dict(), "nodes": cluster.nodes,
               "devices_per_node": cluster.devices_per_node, "dtype": cluster.dtype,
               "global_batch_size": global_batch_size, "space": space.signature(),
               "engine": dataclasses.asdict(cluster.engine), "cost_model": COST_MODEL_VERSION,
               "format": STUDY_FORMAT_VERSION}
    digest = hashlib.sha256(json.dumps(problem, sort_keys=True, default=str).encode()).hexdigest()[:12]
    label = spec.name or "model"
    return f"tridist-{label}-{cluster.nodes}x{cluster.devices_per_node}-{cluster.profile.name}-gbs{global_batch_size}-{digest}"


# -------------------------------------------------------------------------------------------- search


class _Progress:
    """Rate-limited progress lines on stderr (or a callable(done, total, message))."""

    def __init__(self, enabled, total: int):
        self.callback = enabled if callable(enabled) else None
        self.enabled = bool(enabled)
        self.total = total
        self.last = 0.0

    def __call__(self, done: int, message: str, final: bool = False) -> None:
        if not self.enabled:
            return
        if self.callback is not None:
            self.callback(done, self.total, message)
            return
        now = time.monotonic()
        if final or now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            print(f"[tridist tune] {done}/{self.total} {message}", file=sys.stderr, flush=True)


def _no_fit_message(layouts: list[LayoutResult], spec: ModelSpec, cluster: Cluster, global_batch_size: int) -> str:
    if not layouts:
        first = (f" (pp > 1: at most {spec.num_layers - spec.layers_added_to}, the first stage holding the "
                 f"{spec.layers_added_to} layers the model adds to and one more)" if spec.layers_added_to else "")
        return (f"no valid layout: no (tp, pp) with tp dividing heads/kv heads/hidden/ffn/vocab, pp at most the "
                f"{spec.num_layers} layers{first} and dp = devices/(tp*pp) dividing the global batch "
                f"{global_batch_size} on {cluster.num_devices} devices; change the batch size or device count")
    lean = min((l.leanest for l in layouts if l.leanest), key=lambda c: c.memory_bytes_per_device, default=None)
    capacity = max(l.capacity_bytes for l in layouts)
    detail = ""
    if lean is not None:
        detail = (f"; the leanest strategy ({lean.strategy.describe()}) needs "
                  f"{lean.memory_bytes_per_device / 1e9:.1f} GB per device of {capacity / 1e9:.1f} GB usable")
    return (f"no strategy fits in memory on {cluster.describe()}{detail}: add devices, use devices with more "
            "memory, or shorten the sequence")


def search(model_spec: ModelSpec, cluster: Cluster, *, global_batch_size: int, storage=None, top_k: int = 10,
           space: SearchSpace | None = None, method: str = "auto", n_trials: int | None = None,
           exhaustive_limit: int = EXHAUSTIVE_LAYOUT_LIMIT, study_name: str | None = None,
           progress: bool | Callable = False, seed: int = 0, measure: Callable | None = None,
           measure_top_k: int = 3, measure_pick: str = "top", excluded: dict[str, str] | None = None) -> SearchResult:
    """Find the fastest strategy for `spec` on `cluster` that fits in memory.

    storage: None or "memory" (in memory, the default: fast, and safe when every rank of a job
    searches at once), an RDB URL ("sqlite:///path/tune.db", "postgresql://..."), a file path (an
    SQLite database there) or an Optuna storage object; a persistent storage resumes the study of the
    same problem and reuses its finished trials. method: "auto" (exhaustive up to `exhaustive_limit`
    layouts, else TPE), "exhaustive" or "tpe" (`n_trials` trials, default 64). progress: True prints
    progress lines to stderr; a callable receives (done, total, message). measure: a callable
    `strategy -> seconds per step`, run on the `measure_top_k` best predicted candidates (measure_pick
    "top"), or on the best of each (dp, tp, pp) layout ("layouts": a spread, to judge the model), which then
    rank by their measured times (measured.py; a candidate that raises is dropped with its reason); the
    result's `measured` holds the measurements and the device profile with its refitted factor.
    excluded: {knob: reason} the runtime cannot apply ("tp", "pp", "recompute", "overlap_tp_comm"): kept
    at 1 / "none" / False, the reason listed in the result's `pruned` (and reports).
    """
    spec = model_spec
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if method not in ("auto", "exhaustive", "tpe"):
        raise ValueError(f"method must be 'auto', 'exhaustive' or 'tpe', got {method!r}")
    if measure_pick not in MEASURE_PICKS:
        raise ValueError(f"measure_pick must be one of {', '.join(map(repr, MEASURE_PICKS))}, got {measure_pick!r}")
    if measure is not None and not callable(measure):
        raise TypeError(
            f"search: measure must be a callable strategy -> seconds per step, got {measure!r}; autotune runs no model "
            "itself: measure on your model with distcore.to_distributed(config=ToDistributedConfig(measure=True)) "
            "or `tridist tune --measure`")
    started = time.perf_counter()
    space, pruned = engine_space(space or SearchSpace(), cluster, excluded, spec=spec)
    keep = max(top_k, STORED_CANDIDATES_PER_LAYOUT)
    layouts = enumerate_layouts(spec, cluster, global_batch_size, space)
    if method == "auto":
        method = "exhaustive" if len(layouts) <= exhaustive_limit else "tpe"

    import optuna  # lazily: `import tridist.autotune` must stay light

    storage_arg, storage_desc = _resolve_storage(storage)
    name = study_name or _study_name(spec, cluster, global_batch_size, space)
    tp_choices = _tp_choices(spec, cluster, space) or [1]
    pp_choices = _pp_choices(spec, cluster, space) or [1]
    distributions = {"tp": optuna.distributions.CategoricalDistribution(tp_choices),
                     "pp": optuna.distributions.CategoricalDistribution(pp_choices)}
    sampler = (optuna.samplers.TPESampler(seed=seed, multivariate=True)
               if method == "tpe" else optuna.samplers.RandomSampler(seed=seed))
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(storage=storage_arg, study_name=name, direction="minimize",
                                    sampler=sampler, load_if_exists=True)
        solved, previous = _load_finished(study)
        valid = set(layouts)
        if method == "exhaustive":
            waiting = {_fixed_layout(t) for t in study.get_trials(deepcopy=False,
                                                                  states=(optuna.trial.TrialState.WAITING,))}
            todo = [layout for layout in layouts if layout not in solved]
            for tp, pp in todo:
                if (tp, pp) not in waiting:
                    study.enqueue_trial({"tp": tp, "pp": pp})
            budget = len(todo)
        cache = dict(solved)  # layouts solved in this process (the heuristic's probes too)
        if method == "tpe":
            budget = n_trials if n_trials is not None else TPE_DEFAULT_TRIALS
            if not previous:
                start = heuristic_layout(spec, cluster, global_batch_size, space, solved=cache)
                if start is not None:
                    study.enqueue_trial({"tp": start[0], "pp": start[1]})
        report = _Progress(progress, budget)
        new = 0
        for done in range(1, budget + 1):
            trial = study.ask(distributions)
            layout = (trial.params["tp"], trial.params["pp"])
            if layout not in valid:
                trial.set_user_attr("invalid", f"tp={layout[0]} x pp={layout[1]} is not a valid layout for "
                                                f"{cluster.num_devices} devices and batch {global_batch_size}")
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            if layout not in cache:
                cache[layout] = _solve_layout(spec, cluster, global_batch_size, *layout, space, keep)
            result = cache[layout]
            _record(study, trial, result)
            solved[layout] = result
            new += 1
            best = min((r.best for r in solved.values() if r.best), key=Candidate.sort_key, default=None)
            report(done, f"tp={layout[0]} pp={layout[1]}: "
                         f"{_fmt_time(result.best.step_time_s) if result.best else 'out of memory'}; best "
                         f"{best.strategy.describe() + ' ' + _fmt_time(best.step_time_s) if best else '-'}",
                   final=done == budget)
        n_trials_total = len(study.get_trials(deepcopy=False))
    finally:
        optuna.logging.set_verbosity(verbosity)

    # Re-solve stored layouts that kept fewer candidates than now requested (an older, smaller top_k).
    for layout, result in list(solved.items()):
        if len(result.top) < min(top_k, result.feasible):
            solved[layout] = _solve_layout(spec, cluster, global_batch_size, *layout, space, keep)
    results = [solved[l] for l in layouts if l in solved]
    ranked = sorted((c for r in results for c in r.top), key=Candidate.sort_key)[:top_k]
    pareto = pareto_front(c for r in results for c in r.pareto)
    best = ranked[0] if ranked else None
    _check_against_study(study, best)
    message = "" if best else _no_fit_message(results, spec, cluster, global_batch_size)
    result = SearchResult(
        best=best, ranked=ranked, pareto=pareto, layouts=results, spec=spec, cluster=cluster,
        global_batch_size=global_batch_size, method=method, study_name=name, storage=storage_desc,
        n_trials=n_trials_total, n_new_trials=new, n_evaluated=sum(r.evaluated for r in results),
        elapsed_s=time.perf_counter() - started, message=message, study=study, pruned=pruned,
    )
    if measure is None or best is None:
        return result
    from .measured import measure_top, rerank

    ranking = rerank(result, measure_top(result, measure, top_k=measure_top_k, pick=measure_pick))
    return dataclasses.replace(ranking.result, measured=ranking)


def _fixed_layout(trial) -> tuple | None:
    """The (tp, pp) an enqueued (waiting) trial will run, from Optuna's fixed_params system attr."""
    fixed = trial.system_attrs.get("fixed_params", {})
    return (fixed.get("tp"), fixed.get("pp"))


def _load_finished(study) -> tuple[dict, bool]:
    """Layouts already solved in this study (a resumed search reuses them) and whether any trial exists."""
    import optuna

    solved = {}
    trials = study.get_trials(deepcopy=False)
    for trial in trials:
        if trial.state != optuna.trial.TrialState.COMPLETE or "layout" not in trial.user_attrs:
            continue
        result = LayoutResult.from_json(trial.user_attrs["layout"])
        solved[(result.tp, result.pp)] = result
    return solved, bool(trials)


def _record(study, trial, result: LayoutResult) -> None:
    """Store the layout's solution in the trial and tell Optuna its value and memory constraint
    (relative excess over the usable memory: <= 0 when the layout's best strategy fits)."""
    trial.set_user_attr("layout", result.to_json())
    if result.best is not None:
        value = result.best.step_time_s
        excess = result.best.memory_bytes_per_device / result.capacity_bytes - 1.0
    else:
        lean = result.leanest
        value = lean.step_time_s if lean else math.inf
        excess = (lean.memory_bytes_per_device / result.capacity_bytes - 1.0) if lean else math.inf
        excess = max(excess, 1e-9)  # strictly infeasible
    trial.set_constraint("memory", min(excess, 1e300))
    study.tell(trial, min(value, 1e300))


def _check_against_study(study, best: Candidate | None) -> None:
    """Optuna's feasible best trial and our ranking must agree on the best step time."""
    if best is None:
        return
    try:
        trial = study.best_trial
    except ValueError:  # no feasible trial recorded (e.g. only reused ones without constraints)
        return
    if not math.isclose(trial.value, best.step_time_s, rel_tol=1e-9):
        raise RuntimeError(f"internal error: Optuna's best trial ({trial.value}) disagrees with the ranking "
                           f"({best.step_time_s}) in study {study.study_name}")


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"
