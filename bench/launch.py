"""`tridist bench launch`: the host time of each fused op's launch path, against one eager elementwise op.

A memory-bound kernel on a few million elements runs in microseconds on an H100, so the Python around
its launch (argument checks, the autograd.Function, output allocation, the launch configuration, the
launch's arguments) decides the time at common shapes. This benchmark times that path alone: the Triton
launch is stubbed out (`KernelInterface.__getitem__` returns a no-op) and the ops take their Triton path
on tiny CPU tensors, so any machine measures it, with or without a GPU or the interpreter. The baseline
is `torch.mul` on the same tensors, forward and forward+backward, in the same process. Two floors are shown
beside the ops: a minimal autograd.Function (forward returns a view), and "torch's part of rms_norm": a Function
entered as the ops enter theirs (the C entry point) with rms_norm's five arguments, which allocates its output
and 1/rms, saves three tensors and returns one output, and launches nothing (no checks, no plan): what an op
of that shape costs before any code of ours runs.

Targets (kernels issue): forward at most 3x `torch.mul`'s forward, forward+backward at most 2x its
forward+backward. Each row is the best of `repeats` means over `calls` calls (perf_counter); Triton's own
launcher is not in it (stubbed), and grows with the number of kernel arguments on a GPU.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

import torch

FORWARD_TARGET = 3.0  # x torch.mul's forward
FORWARD_BACKWARD_TARGET = 2.0  # x torch.mul's forward+backward


@contextlib.contextmanager
def stubbed_launches():
    """Every Triton launch a no-op, and CPU tensors on the kernels' Triton path, until the block ends."""
    from triton.runtime.jit import KernelInterface

    from tridist.kernels import _common

    getitem, interpret = KernelInterface.__getitem__, _common.TRITON_INTERPRET
    KernelInterface.__getitem__ = lambda self, grid: _no_launch
    _common.TRITON_INTERPRET = True
    try:
        yield
    finally:
        KernelInterface.__getitem__, _common.TRITON_INTERPRET = getitem, interpret


def _no_launch(*args, **kwargs) -> None:
    return None


class _Minimal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _RMSNormShape(torch.autograd.Function):
    """rms_norm's autograd.Function with nothing of ours in it: its arguments, allocations, saves and output."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, cast_to_input):
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None, None, None


_rms_norm_shape = super(torch.autograd.Function, _RMSNormShape).apply  # the C entry point, as eager_autograd's


def cases() -> dict[str, Callable[[], object]]:
    """Each op's call on tiny CPU inputs that require grad (the training path: an autograd.Function)."""
    from tridist import kernels

    generator = torch.Generator().manual_seed(0)  # not the caller's global random state
    leaf = lambda *shape: torch.randn(*shape, generator=generator).requires_grad_()  # noqa: E731
    x, y, residual, weight = leaf(4, 64), leaf(4, 64), leaf(4, 64), leaf(64)
    q, k = leaf(1, 4, 8, 16), leaf(1, 2, 8, 16)
    cos, sin = torch.randn(1, 8, 16, generator=generator), torch.randn(1, 8, 16, generator=generator)
    return {
        "torch.mul": lambda: torch.mul(x, y),
        "minimal autograd.Function": lambda: _Minimal.apply(x),
        "torch's part of rms_norm": lambda: _rms_norm_shape(x, weight, 1e-6, 0.0, False),
        "rms_norm": lambda: kernels.rms_norm(x, weight, 1e-6),
        "add_rms_norm": lambda: kernels.rms_norm(x, weight, 1e-6, residual=residual),
        "rotary": lambda: kernels.apply_rotary_pos_emb(q, k, cos, sin, layout="bhsd"),
        "swiglu": lambda: kernels.swiglu(x, y),
    }


def _forward_backward(call: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        outputs = call()
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    return run


def _time_together(fns: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, float]:
    """Microseconds per call of each fn: the best of `repeats` means (the least disturbed by other work).
    The fns take turns within every repeat, so a slow spell of the machine hits all of them alike."""
    for fn in fns.values():
        for _ in range(max(1, calls // 10)):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
    return best


def run_launch_benchmark(*, calls: int = 2000, repeats: int = 5, out_dir: str | Path | None = None):
    """A DataFrame: per op, forward and forward+backward host microseconds and their ratios to torch.mul's
    (and whether each meets its target); with `out_dir`, results.csv, report.md and plot.png there."""
    import pandas as pd

    with stubbed_launches():
        ops = cases()
        forward = _time_together(ops, calls, repeats)
        backward = _time_together({name: _forward_backward(c) for name, c in ops.items()}, max(1, calls // 4), repeats)
    rows = [{"op": name, "fwd_us": forward[name], "fwd_bwd_us": backward[name]} for name in ops]
    frame = pd.DataFrame(rows).set_index("op")
    frame["fwd_x_mul"] = frame["fwd_us"] / frame.loc["torch.mul", "fwd_us"]
    frame["fwd_bwd_x_mul"] = frame["fwd_bwd_us"] / frame.loc["torch.mul", "fwd_bwd_us"]
    frame["fwd_within_target"] = frame["fwd_x_mul"] <= FORWARD_TARGET
    frame["fwd_bwd_within_target"] = frame["fwd_bwd_x_mul"] <= FORWARD_BACKWARD_TARGET
    if out_dir is not None:
        _write(frame, Path(out_dir))
    return frame


def _write(frame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "results.csv")
    lines = ["# Launch path: host time with the Triton launch stubbed out", "",
             f"Targets: forward <= {FORWARD_TARGET:g}x torch.mul, forward+backward <= {FORWARD_BACKWARD_TARGET:g}x "
             "(same process, tiny CPU tensors).", "",
             "| op | fwd us | x mul | fwd+bwd us | x mul |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {op} | {r.fwd_us:.1f} | {r.fwd_x_mul:.1f} | {r.fwd_bwd_us:.1f} | {r.fwd_bwd_x_mul:.1f} |"
              for op, r in frame.iterrows()]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for ax, column, target, title in ((axes[0], "fwd_x_mul", FORWARD_TARGET, "forward"),
                                      (axes[1], "fwd_bwd_x_mul", FORWARD_BACKWARD_TARGET, "forward+backward")):
        ax.barh(frame.index, frame[column], color=["tab:green" if v <= target else "tab:red" for v in frame[column]])
        ax.axvline(target, color="black", linestyle="--", label=f"target {target:g}x")
        ax.set_title(f"{title}: host time / torch.mul's")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)
    plt.close(fig)
