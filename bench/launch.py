"""`tridist bench launch`: the host time of each fused op's launch path, against one eager elementwise op.

A memory-bound kernel on a few million elements runs in microseconds on an H100, so the Python around
its launch (argument checks, the autograd.Function, output allocation, the launch configuration, the
launch's arguments) decides the time at common shapes. This benchmark times that path alone: Triton's
launcher is stubbed out (`stubbed_launches`: our direct launch of the compiled kernel runs, as on a GPU, up to
the C launcher) and the ops take their Triton path on tiny CPU tensors, so any machine measures it, with or
without a GPU. The baseline is `torch.mul` on the same tensors, forward and forward+backward, in the same
process. Floors are shown beside the ops: a minimal autograd.Function (forward returns a view); torch's own
`F.layer_norm` (a C++ op with C++ autograd) and `F.rms_norm` (a composite of elementwise ops) on the same tensors;
and each op's "torch part": a Function entered as the ops enter theirs (the C entry point) with the op's
arguments, allocations, saved tensors and outputs, which launches nothing (no checks, no plan): what an op of
that shape costs before any code of ours runs. "ours" is the op's time above its torch part.

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
import torch.nn.functional as F

FORWARD_TARGET = 3.0  # x torch.mul's forward
FORWARD_BACKWARD_TARGET = 2.0  # x torch.mul's forward+backward


@contextlib.contextmanager
def stubbed_launches():
    """Until the block ends: CPU tensors on the kernels' Triton path, and every launch runs our launch path
    (`Launch.launch`) as on a GPU with Triton's launcher stubbed out: the first launch of a specialisation goes
    through the JIT (`kernel[grid](...)`, stubbed to return a compiled kernel whose launcher does nothing), the
    next ones call that compiled kernel straight. Under Triton's interpreter (TRITON_INTERPRET=1 at import) the
    kernels keep the JIT launch, stubbed the same way. The launch plans made meanwhile are forgotten."""
    from triton.runtime.jit import KernelInterface

    from tridist.kernels import _common, configs

    saved = (KernelInterface.__getitem__, _common.TRITON_INTERPRET, _common._current_device, _common._current_stream)
    KernelInterface.__getitem__ = lambda self, grid: _no_jit_launch
    _common.TRITON_INTERPRET = True
    _common._current_device, _common._current_stream = (lambda: 0), (lambda device: None)
    configs.clear_cache()
    try:
        yield
    finally:
        configs.clear_cache()  # their compiled kernels are the stub's
        KernelInterface.__getitem__, _common.TRITON_INTERPRET, _common._current_device, _common._current_stream = saved


class _NoLaunch:
    """What the stubbed JIT launch returns: a compiled kernel whose launcher does nothing."""

    function = packed_metadata = None

    @staticmethod
    def run(*args) -> None:
        return None


def _no_jit_launch(*args, **kwargs) -> _NoLaunch:
    return _NoLaunch


class _Minimal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _torch_part(allocate, saved, returns: int, backward):
    """An op's autograd.Function with nothing of ours in it, entered as the ops enter theirs (the C entry point,
    as `eager_autograd`'s): its arguments, `allocate(*inputs)`'s outputs, `saved(inputs, outputs)` saved, the
    first `returns` outputs returned, and `backward(saved_tensors, grads)`'s allocations. Launches nothing."""

    class TorchPart(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            outputs = allocate(*inputs)
            ctx.save_for_backward(*saved(inputs, outputs))
            return outputs[0] if returns == 1 else outputs[:returns]

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx.saved_tensors, grads)

    return super(torch.autograd.Function, TorchPart).apply


def _empty(t):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _rows(t):
    return t.new_empty(t.shape[:-1], dtype=torch.float32)  # RMSNorm's 1/rms per row


# What each op's Function costs torch: rms_norm (x, weight, eps, offset, cast_to_input) allocates y and 1/rms,
# saves x, weight, 1/rms, returns y, and its backward allocates dx and the weight's gradient; add_rms_norm
# (x, residual, ...) also allocates and returns h = x + residual, saved in x's place, and gives dh to both
# inputs; rotary (q, k, cos, sin, position_ids, layout, interleaved, rotary_dim, conjugate) allocates and returns
# both rotated tensors, saves the tables and positions, and its backward allocates dq and dk; swiglu (gate, up)
# allocates and returns one tensor, saves both inputs, and its backward allocates both gradients.
_TORCH_PARTS = {
    "rms_norm": _torch_part(lambda x, w, *_: (_empty(x), _rows(x)), lambda i, o: (i[0], i[1], o[1]), 1,
                            lambda s, g: (_empty(s[0]), _empty(s[1]), None, None, None)),
    "add_rms_norm": _torch_part(lambda x, r, w, *_: (_empty(x), _empty(x), _rows(x)), lambda i, o: (o[1], i[2], o[2]),
                                2, lambda s, g: (_empty(s[0]),) * 2 + (_empty(s[1]), None, None, None)),
    "rotary": _torch_part(lambda q, k, *_: (_empty(q), _empty(k)), lambda i, o: i[2:5], 2,
                          lambda s, g: (_empty(g[0]), _empty(g[1])) + (None,) * 7),
    "swiglu": _torch_part(lambda gate, up: (_empty(gate),), lambda i, o: i, 1,
                          lambda s, g: (_empty(s[0]), _empty(s[1]))),
}
OPS = tuple(_TORCH_PARTS)
BASELINES = ("torch.mul", "minimal autograd.Function", "torch F.layer_norm", "torch F.rms_norm")


def cases() -> dict[str, Callable[[], object]]:
    """The baselines and each op's call on tiny CPU inputs that require grad (the training path: an
    autograd.Function), then each op's torch part (`_TORCH_PARTS`) on the same inputs as "<op> torch part"."""
    from tridist import kernels

    generator = torch.Generator().manual_seed(0)  # not the caller's global random state
    leaf = lambda *shape: torch.randn(*shape, generator=generator).requires_grad_()  # noqa: E731
    x, y, residual, weight = leaf(4, 64), leaf(4, 64), leaf(4, 64), leaf(64)
    q, k = leaf(1, 4, 8, 16), leaf(1, 2, 8, 16)
    cos, sin = torch.randn(1, 8, 16, generator=generator), torch.randn(1, 8, 16, generator=generator)
    calls = {
        "torch.mul": lambda: torch.mul(x, y),
        "minimal autograd.Function": lambda: _Minimal.apply(x),
        # torch's own norms on the same tensors: a C++ op with C++ autograd (and its statistics saved), and a
        # composite of elementwise ops: what the targets ask of an op, measured on torch's side.
        "torch F.layer_norm": lambda: F.layer_norm(x, (64,), weight),
        "torch F.rms_norm": lambda: F.rms_norm(x, (64,), weight, 1e-6),
        "rms_norm": lambda: kernels.rms_norm(x, weight, 1e-6),
        "add_rms_norm": lambda: kernels.rms_norm(x, weight, 1e-6, residual=residual),
        "rotary": lambda: kernels.apply_rotary_pos_emb(q, k, cos, sin, layout="bhsd"),
        "swiglu": lambda: kernels.swiglu(x, y),
    }
    parts = _TORCH_PARTS
    calls.update({
        "rms_norm torch part": lambda: parts["rms_norm"](x, weight, 1e-6, 0.0, False),
        "add_rms_norm torch part": lambda: parts["add_rms_norm"](x, residual, weight, 1e-6, 0.0, False),
        "rotary torch part": lambda: parts["rotary"](q, k, cos, sin, None, True, False, 16, False),
        "swiglu torch part": lambda: parts["swiglu"](x, y),
    })
    return calls


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
    """A DataFrame indexed by torch.mul, the minimal autograd.Function and each op: forward and forward+backward
    host microseconds, their ratios to torch.mul's and whether each op meets its target, and, per op, its torch
    part's ratios (`floor_*_x_mul`) and the microseconds of ours above it (`ours_*_us`); with `out_dir`,
    results.csv, report.md and plot.png there."""
    import pandas as pd

    with stubbed_launches():
        timed = cases()
        forward = _time_together(timed, calls, repeats)
        backward = _time_together({name: _forward_backward(c) for name, c in timed.items()}, max(1, calls // 4), repeats)
    mul_fwd, mul_fwd_bwd = forward["torch.mul"], backward["torch.mul"]
    rows = []
    for name in (*BASELINES, *OPS):
        row = {"op": name, "fwd_us": forward[name], "fwd_bwd_us": backward[name],
               "fwd_x_mul": forward[name] / mul_fwd, "fwd_bwd_x_mul": backward[name] / mul_fwd_bwd}
        part = f"{name} torch part"
        if part in timed:
            row.update(floor_fwd_x_mul=forward[part] / mul_fwd, floor_fwd_bwd_x_mul=backward[part] / mul_fwd_bwd,
                       ours_fwd_us=forward[name] - forward[part], ours_fwd_bwd_us=backward[name] - backward[part])
        rows.append(row)
    frame = pd.DataFrame(rows).set_index("op")
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

    def cell(value, digits=1):
        return "" if value != value else f"{value:.{digits}f}"  # NaN: the baselines have no torch part

    lines = ["# Launch path: host time with the Triton launch stubbed out", "",
             f"Targets: forward <= {FORWARD_TARGET:g}x torch.mul, forward+backward <= {FORWARD_BACKWARD_TARGET:g}x "
             "(same process, tiny CPU tensors). \"torch part\": the op's autograd.Function with its arguments, "
             "allocations, saved tensors and outputs and nothing of ours; \"ours\": the microseconds above it.", "",
             "| op | fwd us | x mul | torch part x mul | ours us | fwd+bwd us | x mul | torch part x mul | ours us |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {op} | {r.fwd_us:.1f} | {r.fwd_x_mul:.1f} | {cell(r.floor_fwd_x_mul)} | {cell(r.ours_fwd_us)} | "
              f"{r.fwd_bwd_us:.1f} | {r.fwd_bwd_x_mul:.1f} | {cell(r.floor_fwd_bwd_x_mul)} | {cell(r.ours_fwd_bwd_us)} |"
              for op, r in frame.iterrows()]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for ax, column, target, title in ((axes[0], "fwd_x_mul", FORWARD_TARGET, "forward"),
                                      (axes[1], "fwd_bwd_x_mul", FORWARD_BACKWARD_TARGET, "forward+backward")):
        ax.barh(frame.index, frame[column], color=["tab:green" if v <= target else "tab:red" for v in frame[column]])
        floor = frame[f"floor_{column}"]
        ax.scatter(floor, frame.index, marker="|", s=300, color="black", label="torch part (floor)")
        ax.axvline(target, color="black", linestyle="--", label=f"target {target:g}x")
        ax.set_title(f"{title}: host time / torch.mul's")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "plot.png", dpi=120)
    plt.close(fig)
