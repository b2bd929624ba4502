"""Optuna sweeps of the fused kernels' launch configurations (`tridist autotune kernels`).

One study per *bucket*: a kernel (rms_norm / add_rms_norm / rotary / swiglu, forward or backward: each
a `kernels.configs.Tunable`) at one real shape, which stands for its table bucket (`tuning_key`). A
trial picks a configuration from the kernel's own `search_space` and is

1. pruned at once if its tile exceeds the kernel's register limit (the reason is stored);
2. launched: a compile error or out-of-resources is pruned with the error;
3. checked against the eager reference and an fp64 gold with the test suite's criterion
   (`kernels.testing.compare_with_reference`); a wrong output is pruned, never timed;
4. timed quickly; more than SLOWER_THAN_BEST x the best so far is pruned ("clearly slower");
5. timed for real: CUDA events, warm-up, median of repeats, L2 flushed before each run
   (`triton.testing.do_bench`).

The heuristic configuration is always the first trial, so every bucket's gain over it is measured in
the same run. Trials live in an Optuna storage (SQLite under ~/.cache/tridist by default, any RDB
URL): a study is named by the kernel, bucket, kernel version, device and torch/Triton versions, so an
interrupted sweep resumes and a changed kernel starts afresh. The best configuration per bucket is
merged into the device's table that `kernels.configs` reads at launch (with its gain and timings).

Budget: `trials` per bucket and an optional `minutes` for the whole sweep (shared evenly by the
buckets not yet swept). The timer is injectable (`timer(fn, *, config, quick) -> ms`), so the
machinery runs in the tests on Triton's CPU interpreter with a deterministic clock.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import torch

from tridist.kernels import configs
from tridist.kernels import testing as kernel_testing
from tridist.kernels._common import use_triton
from tridist.kernels.ops import rms_norm as rms_norm_ops
from tridist.kernels.ops import rotary as rotary_ops
from tridist.kernels.ops import swiglu as swiglu_ops
from tridist.kernels.reference import rms_norm_reference, rotary_reference, swiglu_reference

from .hardware import cache_dir
from .search import _resolve_storage

OPS = ("rms_norm", "add_rms_norm", "rotary", "swiglu")
KINDS = ("fwd", "bwd")
# A candidate whose quick timing is over 1.5x the best full timing so far is not timed in full: the
# quick timing's spread between runs (do_bench over 10 ms) is a few percent, far below 50%.
SLOWER_THAN_BEST = 1.5
DEFAULT_TRIALS = 32
NO_GPU_EXIT = 3  # `tridist autotune kernels` without a GPU: said so, nothing tuned

Timer = Callable[..., float]


class SweepUnavailable(RuntimeError):
    """The kernels cannot be timed here (no GPU, and not under the Triton interpreter)."""


# -------------------------------------------------------------------------------------------- buckets


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One study: `op`'s `kind` kernel at `tokens` rows of `width` (hidden, intermediate or, for
    rotary, head_dim with `heads` q and `kv_heads` k heads)."""

    op: str
    kind: str
    tokens: int
    width: int
    dtype: torch.dtype = torch.bfloat16
    heads: int = 0
    kv_heads: int = 0

    def __post_init__(self):
        if self.op not in OPS or self.kind not in KINDS:
            raise ValueError(f"unknown kernel {self.op}/{self.kind}: ops are {', '.join(OPS)}, kinds {', '.join(KINDS)}")
        if self.op == "rotary" and not (self.heads and self.kv_heads and self.heads % self.kv_heads == 0):
            raise ValueError(f"rotary buckets need heads divisible by kv_heads, got {self.heads}/{self.kv_heads}")

    @property
    def tunable(self) -> configs.Tunable:
        if self.op == "rotary":
            return rotary_ops.TUNABLES[self.kind]
        if self.op == "swiglu":
            return swiglu_ops.TUNABLES[self.kind]
        return rms_norm_ops.TUNABLES[self.op, self.kind]

    @property
    def key(self) -> str:
        """The table bucket this shape stands for (the launchers' own key function)."""
        if self.op == "rotary":
            return rotary_ops.tuning_key(self.tokens, self.width, self.heads, self.kv_heads, self.dtype)
        if self.op == "swiglu":
            return swiglu_ops.tuning_key(self.tokens, self.width, self.dtype)
        return rms_norm_ops.tuning_key(self.tokens, self.width, self.dtype)

    @property
    def shape(self) -> str:
        heads = f" x {self.heads}/{self.kv_heads} heads" if self.op == "rotary" else ""
        return f"{self.tokens} x {self.width}{heads} {str(self.dtype).removeprefix('torch.')}"

    def heuristic(self) -> dict:
        if self.op == "rotary":
            return rotary_ops.heuristic_config(self.width // 2, max(self.heads, self.kv_heads))
        if self.op == "swiglu":
            return swiglu_ops.heuristic_config(self.width)
        return rms_norm_ops.heuristic_config(self.kind, self.width, residual=self.op == "add_rms_norm")

    def space(self) -> dict[str, list[int]]:
        """The kernel's search space, with the heuristic's values added (the heuristic is always trial 0)."""
        if self.op == "rotary":
            space = rotary_ops.search_space(self.width // 2, max(self.heads, self.kv_heads))
        elif self.op == "swiglu":
            space = swiglu_ops.search_space(self.width)
        else:
            space = rms_norm_ops.search_space(self.kind, self.width)
        heuristic = self.heuristic()
        return {name: sorted(set(values) | {heuristic[name]}) for name, values in space.items()}

    def infeasible(self, config: dict) -> str | None:
        """Why `config` is not worth compiling (over the kernel's register limit), or None."""
        limit = {"swiglu": swiglu_ops.MAX_TILE_ELEMENTS, "rms_norm": rms_norm_ops.MAX_TILE_ELEMENTS,
                 "add_rms_norm": rms_norm_ops.MAX_TILE_ELEMENTS}.get(self.op)
        if limit and config["BLOCK_M"] * config["BLOCK_N"] > limit:
            return f"tile of {config['BLOCK_M']} x {config['BLOCK_N']} elements over the kernel's limit of {limit}"
        return None


def default_buckets(dtypes: Sequence[torch.dtype] = (torch.bfloat16,), *, ops: Sequence[str] = OPS,
                    quick: bool = False) -> list[Bucket]:
    """Llama-class shapes: hidden 2048/4096/8192 for the norms, SwiGLU at 8192 and 14336 (Llama 3 8B),
    rotary at head_dim 128 with 32 q / 8 k heads; 4096, 16384 and 65536 tokens (quick: one shape per
    kernel at 16384 tokens)."""
    tokens = (16384,) if quick else (4096, 16384, 65536)
    buckets = []
    for dtype in dtypes:
        for op in ops:
            for kind in KINDS:
                if op == "rotary":
                    buckets += [Bucket(op, kind, t, 128, dtype, heads=32, kv_heads=8) for t in tokens]
                    continue
                widths = {"swiglu": (14336,) if quick else (8192, 14336)}.get(op, (4096,) if quick else (2048, 4096, 8192))
                buckets += [Bucket(op, kind, t, w, dtype) for w in widths for t in tokens if t * w <= 2**30]
    return buckets


# ------------------------------------------------------------------------------- launching and checking


@dataclasses.dataclass
class BucketRun:
    """A bucket's inputs on the device: `run(config)` launches the kernel, `check(outputs)` says what is wrong."""

    run: Callable[[dict], tuple[torch.Tensor, ...]]
    names: tuple[str, ...]
    reference: tuple[torch.Tensor, ...]  # the eager reference in the bucket's dtype
    gold: tuple[torch.Tensor, ...]  # the same in fp64

    def check(self, outputs: Sequence[torch.Tensor]) -> str | None:
        for name, ours, ref, gold in zip(self.names, outputs, self.reference, self.gold):
            if ours.shape != ref.shape:
                return f"{name}: shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
            verdict = kernel_testing.compare_with_reference(ours, ref, gold)
            if not verdict["ok"]:
                return (f"{name}: max error vs fp64 {verdict['error']:.3g} > allowed {verdict['allowed']:.3g} "
                        f"(2 x eager's {verdict['reference_error']:.3g} + one ulp)")
        return None


def _grads(fn, inputs, grad_outputs):
    """fn(*inputs)'s gradients w.r.t. inputs, for the given output gradients (reference backward)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return tuple(g.detach() for g in torch.autograd.grad(outputs, leaves, grad_outputs))


def _both(fn, *tensors):
    """fn on the bucket's tensors (the eager reference) and on fp64 copies (the gold)."""
    return fn(*tensors), fn(*(t.double() if t is not None else None for t in tensors))


def prepare(bucket: Bucket, device: torch.device, *, seed: int = 0) -> BucketRun:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(device=device, dtype=bucket.dtype)

    rows, width = bucket.tokens, bucket.width
    if bucket.op in ("rms_norm", "add_rms_norm"):
        residual = bucket.op == "add_rms_norm"
        x, w = randn(rows, width), randn(width, scale=0.1, shift=1.0)
        if bucket.kind == "fwd":
            res = randn(rows, width) if residual else None

            def run(config):
                y, h, _ = rms_norm_ops._forward(x, res, w, 1e-6, 0.0, False, config=config)
                return (y, h) if residual else (y,)

            def reference(x_, w_, res_):
                out = rms_norm_reference(x_, w_, 1e-6, residual=res_)
                return out if residual else (out,)

            ref, gold = _both(reference, x, w, res)
            return BucketRun(run, ("y", "h") if residual else ("y",), ref, gold)
        _, _, rstd = rms_norm_ops._forward(x, None, w, 1e-6, 0.0, False)
        dy, dh = randn(rows, width), (randn(rows, width) if residual else None)

        def run(config):
            return rms_norm_ops._backward(dy, dh, x, w, rstd, 0.0, False, x.dtype, True, config=config)

        def reference(x_, w_, dy_, dh_):
            dx, dw = _grads(lambda a, b: rms_norm_reference(a, b, 1e-6), (x_, w_), (dy_,))
            return (dx + dh_ if dh_ is not None else dx), dw

        ref, gold = _both(reference, x, w, dy, dh)
        return BucketRun(run, ("dx", "dw"), ref, gold)

    if bucket.op == "swiglu":
        gate, up = randn(rows, width), randn(rows, width)
        if bucket.kind == "fwd":
            ref, gold = _both(lambda g, u: (swiglu_reference(g, u),), gate, up)
            return BucketRun(lambda config: (swiglu_ops._forward(gate, up, config=config),), ("out",), ref, gold)
        grad = randn(rows, width)

        def run(config):
            dgate, dup = torch.empty_like(gate), torch.empty_like(up)
            swiglu_ops._backward_into(grad, gate, up, dgate, dup, config=config)
            return dgate, dup

        ref, gold = _both(lambda g, u, d: _grads(swiglu_reference, (g, u), (d,)), gate, up, grad)
        return BucketRun(run, ("dgate", "dup"), ref, gold)

    # rotary: one sequence of `tokens` positions, q/k in [batch, seq, heads, head_dim], an HF-style [T, D] table
    q, k = randn(1, rows, bucket.heads, width), randn(1, rows, bucket.kv_heads, width)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, width, 2, dtype=torch.float64) / width))
    angles = torch.outer(torch.arange(rows, dtype=torch.float64), inv_freq)
    table = torch.cat([angles, angles], dim=-1)
    cos, sin = table.cos().float().to(device), table.sin().float().to(device)
    conjugate = bucket.kind == "bwd"
    a, b = (randn(*q.shape), randn(*k.shape)) if conjugate else (q, k)

    def run(config):
        return rotary_ops._rotary(a, b, cos, sin, None, False, False, False, width, conjugate, config=config)

    if conjugate:
        reference = lambda q_, k_, ga, gb, c, s: _grads(lambda x, y: rotary_reference(x, y, c, s), (q_, k_), (ga, gb))
        ref, gold = _both(reference, q, k, a, b, cos, sin)
    else:
        ref, gold = _both(lambda q_, k_, c, s: rotary_reference(q_, k_, c, s), q, k, cos, sin)
    return BucketRun(run, ("dq", "dk") if conjugate else ("q", "k"), tuple(ref), tuple(gold))


# ----------------------------------------------------------------------------------------------- timing


def cuda_timer(fn: Callable[[], object], *, config: dict, quick: bool) -> float:
    """Median ms of `fn` by CUDA events after warm-up, L2 flushed before each run (do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=10 if quick else 100,
                                         return_mode="median"))


# ------------------------------------------------------------------------------------------------ sweep


@dataclasses.dataclass
class BucketResult:
    bucket: Bucket
    study_name: str
    heuristic: dict
    heuristic_ms: float | None  # None: the heuristic itself failed (a kernel bug: see pruned)
    best: dict | None
    best_ms: float | None
    trials: int  # finished trials in the study (this run and earlier ones)
    pruned: Counter  # reason kind -> count ("infeasible", "failed", "wrong", "slower")
    heuristic_problem: str | None = None

    @property
    def gain(self) -> float | None:
        """heuristic time / tuned time (1.0: the heuristic was already the best)."""
        if self.heuristic_ms is None or self.best_ms is None:
            return None
        return self.heuristic_ms / self.best_ms

    def row(self) -> dict:
        b = self.bucket
        return {"kernel": b.tunable.name, "bucket": b.key, "shape": b.shape, "heuristic_ms": self.heuristic_ms,
                "tuned_ms": self.best_ms, "gain": self.gain, "trials": self.trials,
                **{f"pruned_{kind}": self.pruned.get(kind, 0) for kind in PRUNE_KINDS},
                "heuristic": json.dumps(self.heuristic, sort_keys=True),
                "tuned": json.dumps(self.best, sort_keys=True) if self.best else "",
                "problem": self.heuristic_problem or ""}


PRUNE_KINDS = ("infeasible", "failed", "wrong", "slower")


@dataclasses.dataclass
class SweepResult:
    device: str
    versions: dict
    storage: str
    table_path: Path | None
    results: list[BucketResult]
    skipped: list[Bucket]  # not reached within the time budget
    seconds: float
    failed: list[tuple[Bucket, str]] = dataclasses.field(default_factory=list)  # the error that stopped a bucket


class _Pruned(Exception):
    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


class _Progress:
    """One line per trial on a terminal (rewritten in place), one per bucket otherwise; with an ETA."""

    def __init__(self, total: int, deadline: float | None, stream, enabled: bool):
        self.total, self.deadline, self.stream, self.enabled = total, deadline, stream, enabled
        self.done, self.start = 0, time.monotonic()
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()

    def eta(self) -> float:
        elapsed = time.monotonic() - self.start
        left = elapsed / max(self.done, 1) * max(self.total - self.done, 0)
        if self.deadline is not None:
            left = min(left, max(0.0, self.deadline - time.monotonic()))
        return left

    def line(self, bucket: Bucket, best_ms: float | None, gain: float | None, *, final: bool) -> None:
        if not self.enabled or not (self.tty or final):
            return
        best = f"best {best_ms:.4g} ms" + (f" ({gain:.2f}x heuristic)" if gain else "") if best_ms else "no valid config yet"
        eta = self.eta()
        text = (f"[{self.done}/{self.total} trials] {bucket.tunable.name} {bucket.shape}: {best}, "
                f"ETA {int(eta // 60)}m{int(eta % 60):02d}s")
        print(("\r" + text.ljust(110)) if self.tty and not final else text, file=self.stream, flush=True)


def _study_name(bucket: Bucket, device: str, versions: dict, space: dict) -> str:
    """Everything a trial's meaning depends on: the kernel's source, the bucket, the device, the versions and
    the search space (Optuna cannot resume a study whose parameters' choices changed)."""
    space_hash = hashlib.sha1(json.dumps(space, sort_keys=True).encode()).hexdigest()[:8]
    return (f"kernels|{bucket.tunable.name}|{bucket.key}|v{bucket.tunable.version}|space-{space_hash}|{device}|"
            f"torch={versions['torch']}|triton={versions['triton']}")


def _sweep_bucket(bucket: Bucket, *, device: torch.device, device_name: str, versions: dict, storage,
                  trials: int, timeout: float | None, timer: Timer, progress: _Progress, seed: int) -> BucketResult:
    import optuna

    space = bucket.space()
    heuristic = bucket.heuristic()
    name = _study_name(bucket, device_name, versions, space)
    sampler = optuna.samplers.TPESampler(seed=seed)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our progress line instead of a log line per trial
    try:
        return _run_study(bucket, name, space, heuristic, sampler, device=device, storage=storage, trials=trials,
                          timeout=timeout, timer=timer, progress=progress, seed=seed)
    finally:
        optuna.logging.set_verbosity(verbosity)


def _run_study(bucket, name, space, heuristic, sampler, *, device, storage, trials, timeout, timer, progress,
               seed) -> BucketResult:
    import optuna

    study = optuna.create_study(study_name=name, storage=storage, direction="minimize", sampler=sampler,
                                load_if_exists=True)
    # The heuristic first; a space no bigger than the budget is then swept exhaustively in a fixed order
    # (queued), a larger one by TPE (seeded). A resumed study skips what it ran already.
    configs_in_space = [dict(zip(space, values)) for values in itertools.product(*space.values())]
    queue = [heuristic] + ([c for c in configs_in_space if c != heuristic] if len(configs_in_space) <= trials else [])
    for config in queue:
        study.enqueue_trial(config, skip_if_exists=True)
    trials = min(trials, len(configs_in_space))
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    remaining = trials - len(study.get_trials(deepcopy=False, states=finished))
    launch = None

    def objective(trial: optuna.Trial) -> float:
        nonlocal launch
        config = {param: trial.suggest_categorical(param, values) for param, values in space.items()}
        try:
            for earlier in study.get_trials(deepcopy=False, states=finished[:2]):
                if earlier.params == config and earlier.number != trial.number:  # TPE repeats itself
                    if earlier.value is not None:
                        return earlier.value
                    raise _Pruned(earlier.user_attrs.get("pruned", "failed"), earlier.user_attrs.get("reason", "repeat"))
            reason = bucket.infeasible(config)
            if reason:
                raise _Pruned("infeasible", reason)
            if launch is None:
                launch = prepare(bucket, device, seed=seed)
            try:
                outputs = launch.run(config)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except Exception as exc:  # compile errors, OutOfResources, launch failures
                raise _Pruned("failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
            wrong = launch.check(outputs)
            if wrong:
                raise _Pruned("wrong", wrong)
            del outputs
            fn = lambda: launch.run(config)
            quick = timer(fn, config=config, quick=True)
            complete = [t.value for t in study.get_trials(deepcopy=False, states=finished[:1])]
            if complete and quick > SLOWER_THAN_BEST * min(complete) and config != heuristic:  # its gain is the point
                raise _Pruned("slower", f"{quick:.4g} ms in a quick timing, over {SLOWER_THAN_BEST}x the best "
                                        f"{min(complete):.4g} ms")
            return timer(fn, config=config, quick=False)
        except _Pruned as pruned:
            trial.set_user_attr("pruned", pruned.kind)
            trial.set_user_attr("reason", pruned.reason)
            raise optuna.TrialPruned(pruned.reason) from None

    def after_trial(study, trial):
        progress.done += 1
        best = _best(study)
        progress.line(bucket, best.value if best else None, _gain(study, heuristic), final=False)

    if remaining > 0:
        study.optimize(objective, n_trials=remaining, timeout=timeout, callbacks=[after_trial], catch=())
    del launch
    best = _best(study)
    heuristic_trial = _trial_with(study, heuristic)
    all_trials = study.get_trials(deepcopy=False, states=finished)
    result = BucketResult(
        bucket=bucket, study_name=name, heuristic=heuristic,
        heuristic_ms=heuristic_trial.value if heuristic_trial is not None else None,
        best=dict(best.params) if best else None, best_ms=best.value if best else None,
        trials=len(all_trials), pruned=Counter(t.user_attrs.get("pruned", "failed") for t in all_trials
                                               if t.state != optuna.trial.TrialState.COMPLETE),
        heuristic_problem=(None if heuristic_trial is None or heuristic_trial.value is not None
                           else f"the heuristic config was pruned: {heuristic_trial.user_attrs.get('reason')}"),
    )
    progress.line(bucket, result.best_ms, result.gain, final=True)
    return result


def _best(study):
    import optuna

    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return min(complete, key=lambda t: t.value) if complete else None


def _trial_with(study, params: dict):
    for trial in study.get_trials(deepcopy=False):
        if trial.params == params and trial.state.is_finished():
            return trial
    return None


def _gain(study, heuristic: dict) -> float | None:
    best, base = _best(study), _trial_with(study, heuristic)
    if best is None or base is None or base.value is None:
        return None
    return base.value / best.value


def default_sweep_storage() -> str:
    return f"sqlite:///{cache_dir() / 'kernel-sweep.db'}"


def run_sweep(buckets: Sequence[Bucket] | None = None, *, device: torch.device | str | None = None,
              trials: int = DEFAULT_TRIALS, minutes: float | None = None, storage=None,
              table_path: str | Path | None = None, write_table: bool = True, timer: Timer | None = None,
              progress: bool = True, stream=None, seed: int = 0) -> SweepResult:
    """Sweep each bucket's launch configurations and merge the winners into the device's table.

    `device`: a CUDA device (default: the current one), or the CPU under TRITON_INTERPRET=1 (tests:
    pass a `timer`, the interpreter's times mean nothing). `storage`: None (SQLite in ~/.cache/tridist,
    resumable), "memory", an RDB URL, an SQLite or journal file path, or an Optuna storage.
    `table_path`: the table to update (default: where `kernels.configs` looks for this device).
    Raises SweepUnavailable where the Triton kernels cannot run.
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SweepUnavailable("a CUDA device was asked for, but torch.cuda.is_available() is False")
    if not use_triton(torch.empty(0, device=device)):
        raise SweepUnavailable(
            "no CUDA GPU here, and the Triton kernels only run on a CPU under TRITON_INTERPRET=1: kernel launch "
            "configurations are tuned by timing real launches on the GPU they will run on")
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    if device.type == "cpu" and timer is None:
        raise ValueError("timing the Triton interpreter says nothing about a GPU: pass a timer (tests) or run on CUDA")
    buckets = list(buckets) if buckets is not None else default_buckets()
    timer = timer or cuda_timer
    storage_arg, storage_desc = _resolve_storage(storage if storage is not None else default_sweep_storage())
    name, versions = configs.device_name(device), configs.software_versions()
    start = time.monotonic()
    deadline = start + minutes * 60 if minutes else None
    bar = _Progress(trials * len(buckets), deadline, stream or sys.stderr, progress)
    results, skipped, failed = [], [], []
    path = Path(table_path) if table_path is not None else configs.tuned_table_path(device)
    for i, bucket in enumerate(buckets):
        timeout = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                skipped += buckets[i:]
                break
            timeout = left / (len(buckets) - i)
        try:
            result = _sweep_bucket(bucket, device=device, device_name=name, versions=versions, storage=storage_arg,
                                   trials=trials, timeout=timeout, timer=timer, progress=bar, seed=seed)
        except Exception as exc:  # noqa: BLE001 - out of memory preparing a big bucket, a timer failure: the rest go on
            failed.append((bucket, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"))
            print(f"tridist autotune kernels: {bucket.tunable.name} {bucket.shape} failed: {failed[-1][1]}",
                  file=stream or sys.stderr)
        else:
            results.append(result)
            if write_table:  # after every bucket: an interrupted sweep keeps what it found
                write_table_file(path, [result], device_name=name, versions=versions)
        bar.done = trials * (i + 1)  # a resumed, timed-out or failed bucket counts as done
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return SweepResult(device=name, versions=versions, storage=storage_desc,
                       table_path=path if write_table and results else None, results=results, skipped=skipped,
                       seconds=time.monotonic() - start, failed=failed)


# ------------------------------------------------------------------------------------------------ table


def write_table_file(path: Path, results: Sequence[BucketResult], *, device_name: str, versions: dict) -> dict:
    """Merge the best config of each bucket into the table at `path` (kept: other buckets of the same
    device, versions and kernel source; dropped: anything stale), atomically; returns the table."""
    table = {}
    if path.exists():
        try:
            table = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            table = {}
    fresh = {"format": configs.TABLE_FORMAT, "device": device_name, **versions}
    if any(table.get(k) != v for k, v in fresh.items()):
        table = {}  # another device, other versions or format: nothing in it can be kept
    table.update(fresh, written=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    kernels = table.setdefault("kernels", {})
    for result in results:
        if result.best is None:
            continue
        tunable = result.bucket.tunable
        section = kernels.get(tunable.name)
        if section is None or section.get("version") != tunable.version:
            section = kernels[tunable.name] = {"version": tunable.version, "entries": {}}
        section["entries"][result.bucket.key] = {
            "config": result.best, "tuned_ms": result.best_ms, "heuristic_ms": result.heuristic_ms,
            "gain": result.gain, "shape": result.bucket.shape, "trials": result.trials,
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    configs.clear_cache()  # launches in this process see the new table
    return table
