"""What every fused op shares: where it runs, which inputs it accepts, and how rows are addressed."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import torch
from triton import knobs
from triton.runtime import driver

# Triton decides at decoration time whether `@triton.jit` functions run in its CPU interpreter, so the
# variable is read once, at import, like Triton does.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def use_triton(tensor: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; CPU tensors run them only in Triton's interpreter.

    Without TRITON_INTERPRET=1 a CPU tensor takes the plain PyTorch implementation of the same math,
    which is much faster on a CPU than interpreting the kernels.
    """
    if tensor.is_cuda:  # the attribute, not tensor.device.type: that builds a device object per call (~0.7 us)
        return True
    return tensor.is_cpu and TRITON_INTERPRET


def is_dtensor(tensor) -> bool:
    # By name: importing torch.distributed.tensor for every call (or at import) is not needed here.
    return type(tensor).__name__ == "DTensor"


def keeps_whole(tensor, dims) -> bool:
    """A DTensor each of whose shards holds whole extents of `dims` (no placement splits them) and no pending
    sum: an op that works along `dims` only (a row's features, a position's pair) can run on the shards."""
    wanted = {d % tensor.dim() for d in dims}
    return not any(p.is_partial() or split_dim(p, tensor.dim()) in wanted for p in tensor.placements)


def split_dim(placement, ndim: int) -> int | None:
    """The tensor dim a DTensor placement splits (Shard, or torch's _StridedShard, which is no Shard), or None."""
    if placement.is_shard() or type(placement).__name__ == "_StridedShard":
        return placement.dim % ndim
    return None


def local_saved_tensors():
    """For an op computed on DTensors' local shards: the tensors its backward saves stay the plain local
    tensors, whatever saved-tensor hooks an enclosing context set (tensor parallel's global view saves plain
    tensors as replicated DTensors, which a shard's backward must not meet). Under torch.compile nothing: the op
    is a node of the traced graph, whose saved tensors AOTAutograd decides, and Dynamo cannot trace the hooks'
    context (a graph break at every fused op on sequence-parallel shards)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(tensor):
    return tensor


@functools.lru_cache(maxsize=None)
def note_unfused(op: str, why: str) -> None:
    """Logged once per op and reason: a fused op ran as the unfused ops on DTensors (correct, not fused)."""
    logging.getLogger("tridist.kernels").info("%s: the unfused ops run on these DTensors (%s)", op, why)


def as_dtensor_like(local: torch.Tensor, like, placements=None, shape=None) -> torch.Tensor:
    """`local` (this rank's shard of an op's output) as a DTensor on `like`'s mesh: with `like`'s placements and
    shape unless given (uneven shards keep their true global shape). Its global strides lay the dims out in
    `local`'s memory order (an output that kept a transposed input's layout stays so): DTensor decides views by
    them, and strides that disagreed with the local tensor's made a later view fail (`torch.matmul` of a rotated
    query in global view: "view size is not compatible")."""
    from torch.distributed.tensor import DTensor

    shape = tuple(like.shape if shape is None else shape)
    if not _dense(local):
        local = local.contiguous()
    stride = [0] * len(shape)
    running = 1
    for dim in _memory_order(local):
        stride[dim] = running
        running *= shape[dim]
    return DTensor.from_local(local, like.device_mesh, placements or like.placements, run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


def _memory_order(tensor: torch.Tensor) -> list[int]:
    """`tensor`'s dims from the innermost (smallest stride) out."""
    return sorted(range(tensor.dim()), key=lambda d: (tensor.stride(d), tensor.shape[d]))


def _dense(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements fill its memory in some order of its dims (a permutation of a contiguous tensor)."""
    expected = 1
    for dim in _memory_order(tensor):
        if tensor.shape[dim] != 1 and tensor.stride(dim) != expected:
            return False
        expected *= tensor.shape[dim]
    return True


def no_autocast(device: torch.device):
    """A block whose dtypes are settled before it runs (the public functions apply autocast's cast themselves)."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def check_dtype(op: str, name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op}: {name} has dtype {tensor.dtype}; supported dtypes are float32, float16 and bfloat16 "
            f"(cast it, e.g. {name}.to(torch.bfloat16))"
        )


def check_same_device(op: str, first: torch.Tensor, *others: torch.Tensor | None, names: tuple[str, ...]) -> None:
    """Raise naming each tensor's device unless `first` and the `others` given (not None) share one; `names`
    names them in order (one name per tensor)."""
    assert len(names) == 1 + len(others), names
    device = first.device
    for other in others:
        if other is not None and other.device != device:
            _raise_on_devices(op, **dict(zip(names, (first, *others))))


def _raise_on_devices(op: str, **tensors: torch.Tensor | None) -> None:
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in present.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {where}; move them with .to(device)")


@functools.lru_cache(maxsize=None)
def num_programs_for_persistent_grid(device: torch.device, programs_per_sm: int) -> int:
    """How many programs a persistent kernel launches: a few per multiprocessor keeps every SM busy.

    In the interpreter programs run one after another, so a small fixed number is best.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count * programs_per_sm
    return 4


class Launch:
    """One kernel launch worked out ahead by an op's cached launch plan (`configs.launch_plan`): the grid and
    every argument that is neither a tensor nor a per-call scalar (sizes, strides, constexprs, num_warps).

    `launch(kernel, *tensors, **scalars)` runs `kernel[grid](*tensors, **scalars, **kwargs)`. Triton's JIT
    launch binds and specialises every argument on every call: 15.7 us of host time for 8 arguments and
    36.8 us for RMSNorm's 19 on an H100's host (2026-11-26), as long as the kernel runs at common shapes. A
    plan's launches differ only in their tensors and per-call scalars, so after the first launch of each of
    their specialisations (`_specialisation`) the compiled kernel that launch returned is called straight,
    as Inductor's launchers do (6.1 us for the 8 arguments). Triton's interpreter, and whatever only the JIT
    honours (`_jit_launch_needed`: launch and pre-run hooks, debug and instrumentation modes) keep the JIT
    launch.
    """

    __slots__ = ("grid", "kwargs", "_compiled")

    def __init__(self, grid: tuple, kwargs: dict):
        self.grid = grid
        self.kwargs = kwargs  # shared by every launch of the plan: read-only
        self._compiled: dict = {}  # _specialisation -> _CompiledLaunch, or None: this one keeps the JIT launch

    def __repr__(self) -> str:
        return f"Launch(grid={self.grid}, kwargs={self.kwargs})"

    def launch(self, kernel, *tensors: torch.Tensor, **scalars) -> None:
        # Only a plain JITFunction's launch returns its compiled kernel: Triton's interpreter's kernels, autotuners
        # (which pick constexprs per call) and other KernelInterfaces keep the JIT launch.
        if type(kernel).__name__ != "JITFunction" or _jit_launch_needed(kernel):
            kernel[self.grid](*tensors, **scalars, **self.kwargs)
            return
        device = _current_device()
        key = _specialisation(device, tensors, scalars)
        compiled = self._compiled.get(key, _UNSEEN)
        if compiled is _UNSEEN:  # Triton's JIT compiles or finds the kernel and launches it once
            returned = kernel[self.grid](*tensors, **scalars, **self.kwargs)
            self._compiled[key] = _CompiledLaunch.of(kernel, returned, self, tensors, scalars)
        elif compiled is None:
            kernel[self.grid](*tensors, **scalars, **self.kwargs)
        else:
            compiled(device, tensors, scalars.values())


_UNSEEN = object()


def _current_device() -> int:
    """The device Triton's JIT launches on: the current CUDA device (not the tensors')."""
    return driver.active.get_current_device()


def _current_stream(device: int):
    return driver.active.get_current_stream(device)


def _jit_launch_needed(kernel) -> bool:
    """Whether a launch must go through Triton's JIT, which alone honours them: a launch hook (a profiler's,
    e.g. Proton), Triton's debug or instrumentation mode, a stages-inspection hook, the kernel's pre-run hooks.
    Read at every launch: they may be set after the first. Triton <= 3.6 keeps None for an unset hook, later
    versions an empty HookChain."""
    runtime = knobs.runtime  # getattr: not every Triton version has every knob
    return (_hook_set(getattr(runtime, "launch_enter_hook", None)) or _hook_set(getattr(runtime, "launch_exit_hook", None))
            or bool(getattr(runtime, "debug", False))
            or bool(getattr(knobs.compilation, "instrumentation_mode", ""))
            or getattr(runtime, "add_stages_inspection_hook", None) is not None
            or bool(getattr(kernel, "pre_run_hooks", None)))


def _hook_set(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))


def _specialisation(device: int, tensors: tuple, scalars: dict) -> tuple:
    """What Triton's JIT specialises a kernel on among a plan's per-call arguments, or finer: each tensor's
    dtype and whether its address is a multiple of 16 bytes; each scalar's type, and an int's value (Triton
    specialises ints equal to 1 and multiples of 16, and picks i32 or i64 by range); the scalars' names, whose
    slots a launch writes."""
    key = [device]
    for t in tensors:  # a plain loop: ~0.4 us less than building a pair per tensor, on every launch
        key.append(t.dtype)
        key.append(t.data_ptr() % 16 == 0)
    if scalars:
        key.append(tuple(scalars))
        key.extend(float if type(v) is float else (type(v), v) for v in scalars.values())
    return tuple(key)


class _CompiledLaunch:
    """A compiled kernel launched straight: its argument list in the kernel's order with the plan's values
    filled in, the per-call tensors and scalars written into their slots at each launch."""

    __slots__ = ("compiled", "run", "function", "metadata", "grid", "template", "n_tensors", "scalar_slots")

    @classmethod
    def of(cls, kernel, returned, launch: Launch, tensors: tuple, scalars: dict) -> "_CompiledLaunch | None":
        """The direct launch of what a JITFunction's `kernel[grid](...)` returned, or None where only the JIT launch
        will do: a returned object that is no compiled kernel, a per-call scalar that is a constexpr (compiled
        in: its value is not in the key), arguments the kernel does not list."""
        if not all(hasattr(returned, a) for a in ("run", "function", "packed_metadata")):
            return None
        names, params = list(getattr(kernel, "arg_names", ())), getattr(kernel, "params", ())
        constexprs = {p.name for p in params if getattr(p, "is_constexpr", False)}
        if constexprs & set(scalars):
            return None
        given = dict(zip(names, tensors), **scalars, **launch.kwargs)
        if len(tensors) > len(names) or not all(isinstance(t, torch.Tensor) for t in tensors):
            return None
        defaults = {p.name: p.default for p in params}
        template = []
        for name in names:
            value = given.get(name, defaults.get(name, inspect.Parameter.empty))
            if value is inspect.Parameter.empty:
                return None
            template.append(value)
        self = cls()
        self.compiled = returned  # holds the loaded module: the function handle below lives as long as it
        self.run, self.function, self.metadata = returned.run, returned.function, returned.packed_metadata
        self.grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        self.n_tensors = len(tensors)
        self.scalar_slots = tuple(names.index(name) for name in scalars)
        # The plan outlives this launch: its template must not keep this launch's tensors (their memory) alive.
        for slot in (*range(self.n_tensors), *self.scalar_slots):
            template[slot] = None
        self.template = template
        return self

    def __call__(self, device: int, tensors: tuple, scalars) -> None:
        args = self.template.copy()
        args[:self.n_tensors] = tensors
        for slot, value in zip(self.scalar_slots, scalars):
            args[slot] = value
        # launch_metadata and the enter/exit hooks are None: Launch.launch takes the JIT path when a hook is set
        self.run(*self.grid, _current_stream(device), self.function, self.metadata, None, None, None, *args)


def row_args(prefix: str, shape: tuple, strides: tuple) -> dict | None:
    """How a kernel addresses the rows of a [*leading, n_cols] tensor of this shape and strides without a copy,
    as its `{prefix}_inner_rows`, `_stride_outer`, `_stride_inner` and `_stride_col` arguments; None when
    the leading dims do not merge into two row strides (rare: a 4-D view with three non-mergeable leading
    dims), which the caller copies first.

    Row r sits at `(r // inner_rows) * stride_outer + (r % inner_rows) * stride_inner`, and column c of it
    at `+ c * stride_col`. Two row strides cover every 2-D and 3-D view (slices, [S, B, H] transposes) and
    any leading dims that merge.
    """
    geometry = _row_geometry(tuple(shape), tuple(strides))
    if geometry is None:
        return None
    _, inner_rows, stride_outer, stride_inner, stride_col = geometry
    return {f"{prefix}_inner_rows": inner_rows, f"{prefix}_stride_outer": stride_outer,
            f"{prefix}_stride_inner": stride_inner, f"{prefix}_stride_col": stride_col}


def dense_row_major(shape: tuple, strides: tuple) -> bool:
    """Whether a tensor of this shape and strides is its elements in one run, row-major (what `.contiguous()`
    makes; a dim of size 1 may have any stride)."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _row_geometry(shape: tuple, strides: tuple) -> tuple[int, int, int, int, int] | None:
    """(n_rows, inner_rows, stride_outer, stride_inner, stride_col) of a tensor of this shape and strides (see
    row_args), or None when its leading dims do not merge into two row strides. Asked when a plan is built."""
    groups: list[list[int]] = []  # [size, stride] of merged leading dims, innermost first
    for size, stride in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue  # a size-1 dim never moves the address
        if groups and stride == groups[-1][0] * groups[-1][1]:
            groups[-1][0] *= size  # contiguous with the dim inside it: merge
        else:
            groups.append([size, stride])
    if len(groups) > 2:
        return None
    groups += [[1, 0]] * (2 - len(groups))
    (inner_rows, stride_inner), (outer_rows, stride_outer) = groups
    return inner_rows * outer_rows, inner_rows, stride_outer, stride_inner, strides[-1] if shape else 1


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints: triton.cdiv is a constexpr function whose call from Python costs ~3 us."""
    return -(-a // b)


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)` without its host cost (~5 us amid a backward) when the dtype already matches."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def wait_for_collective(value):
    """Tensor parallel's functional collectives return an AsyncCollectiveTensor: a wrapper with no
    storage of its own whose collective may still be in flight. A kernel needs the finished plain
    tensor (Triton reads data pointers); any other value passes through unchanged."""
    if type(value).__name__ == "AsyncCollectiveTensor" and callable(getattr(value, "wait", None)):
        return value.wait()
    return value


# The types of an op's arguments that are never an AsyncCollectiveTensor: one set lookup each instead of a wait check.
_NOT_COLLECTIVE = frozenset({torch.Tensor, torch.nn.Parameter, bool, int, float, str, type(None)})


def waited(values: tuple) -> tuple:
    """`values` with each AsyncCollectiveTensor waited for (`wait_for_collective`)."""
    if all(type(value) in _NOT_COLLECTIVE for value in values):
        return values
    return tuple(map(wait_for_collective, values))


def eager_autograd(forward, setup_context, backward, *, returns: int | None = None):
    """An autograd.Function running an op's own forward, setup_context and backward directly.

    A torch.library custom op costs ~15-20 us of Python dispatch per call in eager mode, as long as a
    memory-bound kernel on 16M elements runs on an H100, so eager calls would be CPU-bound. The public
    functions therefore call this in eager mode and the registered op under torch.compile (one graph
    node). Both share the same code; `ctx.eager` tells the backward to call implementations directly.

    `returns`: how many of the forward's outputs the caller gets (the first ones); the rest (RMSNorm's
    1/rms) are only for `setup_context` to save. Each output of an autograd.Function costs ~4 us of host
    time. The backward is then called with the returned outputs' gradients only (it takes the others as
    parameters defaulting to None).
    """

    class EagerFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            inputs = waited(inputs)
            output = forward(*inputs)
            ctx.eager = True
            setup_context(ctx, inputs, output)
            if returns is None:
                return output
            return output[0] if returns == 1 else output[:returns]

        @staticmethod
        def backward(ctx, *grads):
            grads = waited(grads)
            if not torch.is_grad_enabled():  # the usual backward (create_graph=False): no graph to keep out of
                return backward(ctx, *grads)
            with torch.no_grad():
                input_grads = backward(ctx, *grads)
            # create_graph=True: the backward kernels are not differentiable. Like the registered op,
            # raise if anyone differentiates these gradients, rather than silently dropping their
            # second-order terms (torch's once_differentiable only does so when `grads` require grad).
            anchors = [t for t in (*ctx.saved_tensors, *grads) if torch.is_tensor(t) and t.requires_grad]
            single = torch.is_tensor(input_grads)
            wrapped = _raise_on_differentiation(
                (input_grads,) if single else input_grads, anchors, op=getattr(forward, "__name__", "op")
            )
            return wrapped[0] if single else wrapped

    checked_apply = EagerFunction.apply
    # Function.apply's Python wrapper (~2.5 us a call) binds default arguments (these forwards take none),
    # routes functorch transforms (vmap, grad) and unwraps tensors escaped from a finished transform; the
    # C entry point under it does the rest. Outside transforms, the wrapper's remaining step is done here.
    fast_apply = super(torch.autograd.Function, EagerFunction).apply
    unwrap_if_dead = torch._C._functorch.unwrap_if_dead
    transforms_active = torch._C._are_functorch_transforms_active

    def apply(*inputs):
        if transforms_active():
            return checked_apply(*inputs)
        return fast_apply(*[unwrap_if_dead(t) if isinstance(t, torch.Tensor) else t for t in inputs])

    return apply


def _raise_on_differentiation(tensors, anchors, *, op: str):
    """`tensors` with a grad_fn that raises when differentiated.

    The error node also takes the op's saved inputs and incoming gradients that require grad
    (`anchors`): the autograd engine only runs nodes on a path to the requested inputs, so a node
    hanging off detached leaves would be pruned and second-order terms dropped silently after all.
    An op whose backward depends on neither (rotary: linear in q and k) has no second-order terms
    through its inputs, so nothing is lost there.
    """
    present = [t for t in tensors if t is not None]
    error = torch._C._functions.DelayedError(
        f"tridist: double backward through {op} is not supported (its backward kernels are not "
        "differentiable); compute higher-order gradients with the unfused reference ops".encode(),
        len(present) + len(anchors),
    )
    wrapped = iter(error(*[t.detach().requires_grad_() for t in present], *anchors))
    return tuple(next(wrapped) if t is not None else None for t in tensors)
