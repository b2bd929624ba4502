"""Gated activations, `act(gate) * up`: SwiGLU (`act` = silu, Llama's MLP) and GeGLU (`act` = gelu, Gemma's MLP
with its tanh approximation, or exact): Triton kernels, launchers, torch.library ops, activation and MLP layers.

Two forms share one pair of kernels (the activation is a constexpr, ACTIVATION):
- `swiglu(gate, up)` / `geglu(gate, up)`: two tensors (the seed's `swiglu(gate_proj(x), up_proj(x))`);
- `swiglu(x)` / `geglu(x)`: one tensor split in half on the last dim (Paddle's swiglu with y=None, a fused
  gate_up projection). Its halves are strided views, and its gradient is written straight into one
  buffer of x's shape: no concatenation, no copy.
The row is tiled in fixed-width blocks (no padding of 11008 to 16384 lanes). The backward recomputes the
activation from the saved inputs instead of storing it, and computes both gradients in one pass:

    d_gate = g * up * act'(gate),   d_up = g * act(gate)

silu and gelu's tanh approximation are both `x * sigmoid(z)`: z = x for silu, and, as 0.5 (1 + tanh(u)) =
sigmoid(2u), z = 2u = 2 sqrt(2/pi) (x + 0.044715 x^3) for gelu's; then act' = s + x s (1 - s) z', s = sigmoid(z).
Exact gelu is 0.5 x (1 + erf(x / sqrt(2))), act' = 0.5 (1 + erf(x / sqrt(2))) + x exp(-x^2 / 2) / sqrt(2 pi).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import configs
from .._common import (Launch, as_dtensor_like, cdiv, check_dtype, check_same_device, dense_row_major,
                       eager_autograd, is_dtensor, keeps_whole, local_saved_tensors, next_power_of_2, note_unfused,
                       row_args, split_dim, use_triton)
from ..reference import gated_reference

# The gate's activation (the kernels' ACTIVATION constexpr) by the names the public functions and layers take.
SILU, GELU_TANH, GELU = 0, 1, 2
ACTIVATIONS = {"silu": SILU, "gelu_tanh": GELU_TANH, "gelu": GELU}
_NAMES = {code: name for name, code in ACTIVATIONS.items()}

# Tiles of up to 1024 columns x enough rows for 4096 elements: wide enough for 16-byte accesses per
# thread across 4-8 warps, narrow enough that the last partial block of a row wastes little.
MAX_BLOCK_N = 1024
TARGET_TILE_ELEMENTS = 4096


# ---------------------------------------------------------------------------------------------- kernels


@triton.jit
def _tile(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows.to(tl.int64), cols, mask


@triton.jit
def _offsets(rows, cols, inner_rows, stride_outer, stride_inner, stride_col):
    row_offsets = (rows // inner_rows) * stride_outer + (rows % inner_rows) * stride_inner
    # int64 columns: a transposed input's column stride times the width can pass 2**31.
    return row_offsets[:, None] + cols[None, :].to(tl.int64) * stride_col


@triton.jit
def _flat_tile(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr):
    """Every tensor dense and row-major (`FLAT`): the elements as one run, BLOCK_M * BLOCK_N of them per program,
    one offset for every tensor (int64 only where the run's last tile passes 2**31 - 1: `WIDE`)."""
    index = tl.int64 if WIDE else tl.int32
    offsets = tl.program_id(0).to(index) * (BLOCK_M * BLOCK_N) + tl.arange(0, BLOCK_M * BLOCK_N)
    return offsets, offsets < tl.cast(n_rows, index) * n_cols


@triton.jit
def _load(ptr, offsets, mask, EVEN: tl.constexpr):
    """fp32 values at `ptr + offsets`; without a mask where every offset is in range (`EVEN`)."""
    if EVEN:
        return tl.load(ptr + offsets).to(tl.float32)
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, offsets, values, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr + offsets, values.to(ptr.dtype.element_ty))
    else:
        tl.store(ptr + offsets, values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _logistic_argument(x, ACTIVATION: tl.constexpr):
    """(z, dz/dx) with act(x) = x * sigmoid(z): silu's z = x; gelu's tanh approximation's z = 2 sqrt(2/pi)
    (x + 0.044715 x^3), its polynomial taken at x clamped to +-100 (where sigmoid(z) is 0 or 1 in fp32 either
    way: the clamp changes no result, and x^2 cannot overflow into an inf times the (1 - s) = 0 of act').
    One return: Triton compiles every return of a function, also under a constexpr branch not taken."""
    if ACTIVATION == 1:  # GELU_TANH
        xc = tl.minimum(tl.maximum(x, -100.0), 100.0)
        x2 = xc * xc
        z = xc * (1.5957691216057308 + 0.07135481627260025 * x2)
        dz = 1.5957691216057308 + 0.21406444881780076 * x2
    else:  # SILU
        z = x
        dz = tl.full(x.shape, 1.0, tl.float32)
    return z, dz


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    """act(x) in fp32."""
    if ACTIVATION == 2:  # GELU: 0.5 x (1 + erf(x / sqrt(2)))
        act = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:
        z, _ = _logistic_argument(x, ACTIVATION)
        act = x / (1.0 + tl.exp(-z))
    return act


@triton.jit
def _activation_and_derivative(x, ACTIVATION: tl.constexpr):
    """(act(x), act'(x)) in fp32."""
    if ACTIVATION == 2:  # GELU
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        act = x * cdf
        derivative = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327  # 1 / sqrt(2 pi)
    else:
        z, dz = _logistic_argument(x, ACTIVATION)
        # act' = s (1 + x (1 - s) z') = s + x s (1 - s) z'.
        if ACTIVATION == 1:
            # One exp and one division: with e = exp(-|z|) in (0, 1] and r = 1 / (1 + e), s = sigmoid(z) is r or
            # e r by z's sign, and s (1 - s) = e r^2 for both, to its last digit (1 - s itself would lose exp(-z)'s
            # digits where z > 0, and gelu's z grows as x^3: act' is 1 + 1.4e-6 at x = 5, which 1 - s = 0 rounds
            # to 1). The former sigmoid(z) and sigmoid(-z), two of each (sm_90, 4 x 1024 tiles, 4 warps): 41.2 SASS
            # instructions per element, 4 MUFU, 96 registers; this: 34.2, 2, 64 (`tests/_gpu_codegen.py`).
            # x (e r^2) before z': x e r^2 is 0 where z' is large (|x| far out, z clamped), never inf times 0.
            e = tl.exp(-tl.abs(z))
            r = 1.0 / (1.0 + e)
            er = e * r
            s = tl.where(z >= 0, r, er)
            act = x * s
            derivative = s + x * (er * r) * dz
        else:  # silu: eager's own formula, 1 - s; s is 0 below x = -88, so the term is too
            s = 1.0 / (1.0 + tl.exp(-z))
            act = x * s
            derivative = s + act * (1.0 - s) * dz
    return act, derivative


@triton.jit
def _swiglu_fwd_kernel(
    gate_ptr, up_ptr, out_ptr, n_rows, n_cols,
    gate_inner_rows, gate_stride_outer, gate_stride_inner, gate_stride_col,
    up_inner_rows, up_stride_outer, up_stride_inner, up_stride_col,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FLAT: tl.constexpr, EVEN: tl.constexpr,
    WIDE: tl.constexpr,
):
    if FLAT:
        offsets, mask = _flat_tile(n_rows, n_cols, BLOCK_M, BLOCK_N, WIDE)
        gate_offs, up_offs, out_offs = offsets, offsets, offsets
    else:
        rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
        gate_offs = _offsets(rows, cols, gate_inner_rows, gate_stride_outer, gate_stride_inner, gate_stride_col)
        up_offs = _offsets(rows, cols, up_inner_rows, up_stride_outer, up_stride_inner, up_stride_col)
        out_offs = rows[:, None] * n_cols + cols[None, :]
    gate = _load(gate_ptr, gate_offs, mask, EVEN)
    up = _load(up_ptr, up_offs, mask, EVEN)
    _store(out_ptr, out_offs, _activation(gate, ACTIVATION) * up, mask, EVEN)


@triton.jit
def _swiglu_bwd_kernel(
    grad_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n_rows, n_cols,
    grad_inner_rows, grad_stride_outer, grad_stride_inner, grad_stride_col,
    gate_inner_rows, gate_stride_outer, gate_stride_inner, gate_stride_col,
    up_inner_rows, up_stride_outer, up_stride_inner, up_stride_col,
    dgate_inner_rows, dgate_stride_outer, dgate_stride_inner, dgate_stride_col,
    dup_inner_rows, dup_stride_outer, dup_stride_inner, dup_stride_col,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FLAT: tl.constexpr, EVEN: tl.constexpr,
    WIDE: tl.constexpr,
):
    if FLAT:
        offsets, mask = _flat_tile(n_rows, n_cols, BLOCK_M, BLOCK_N, WIDE)
        grad_offs, gate_offs, up_offs, dgate_offs, dup_offs = offsets, offsets, offsets, offsets, offsets
    else:
        rows, cols, mask = _tile(n_rows, n_cols, BLOCK_M, BLOCK_N)
        grad_offs = _offsets(rows, cols, grad_inner_rows, grad_stride_outer, grad_stride_inner, grad_stride_col)
        gate_offs = _offsets(rows, cols, gate_inner_rows, gate_stride_outer, gate_stride_inner, gate_stride_col)
        up_offs = _offsets(rows, cols, up_inner_rows, up_stride_outer, up_stride_inner, up_stride_col)
        dgate_offs = _offsets(rows, cols, dgate_inner_rows, dgate_stride_outer, dgate_stride_inner, dgate_stride_col)
        dup_offs = _offsets(rows, cols, dup_inner_rows, dup_stride_outer, dup_stride_inner, dup_stride_col)
    grad = _load(grad_ptr, grad_offs, mask, EVEN)
    gate = _load(gate_ptr, gate_offs, mask, EVEN)
    up = _load(up_ptr, up_offs, mask, EVEN)
    act, derivative = _activation_and_derivative(gate, ACTIVATION)
    _store(dgate_ptr, dgate_offs, grad * up * derivative, mask, EVEN)
    _store(dup_ptr, dup_offs, grad * act, mask, EVEN)


# ------------------------------------------------------------------------------- launch configurations

# One Tunable per direction, shared by the activations: each compiles its own binary, but all are one or two
# transcendental functions per element of a memory-bound pass, so one launch configuration serves them.
TUNABLES = {
    kind: configs.Tunable(f"swiglu_{kind}", frozenset({"BLOCK_M", "BLOCK_N", "num_warps"}),
                          (_swiglu_fwd_kernel if kind == "fwd" else _swiglu_bwd_kernel, _tile, _offsets, _flat_tile,
                           _load, _store, _logistic_argument, _activation, _activation_and_derivative))
    for kind in ("fwd", "bwd")
}
# The sweep's limit: at most 16384 elements per tile (the backward holds five fp32 values per element:
# 80 registers per thread at 16 warps).
MAX_TILE_ELEMENTS = 1 << 14


tuning_key = configs.row_tuning_key  # the tuned table's bucket of a launch (also what the sweep writes under)


def heuristic_config(n_cols: int) -> dict:
    """BLOCK_M, BLOCK_N and num_warps without a table.

    Blocks of min(next_pow2(n_cols), MAX_BLOCK_N) columns, rows packed until a tile holds
    TARGET_TILE_ELEMENTS, one warp per 1024 elements (4 for a full tile).
    """
    block_n = min(max(16, next_power_of_2(n_cols)), MAX_BLOCK_N)
    block_m = max(1, TARGET_TILE_ELEMENTS // block_n)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": max(1, block_m * block_n // 1024)}


def search_space(n_cols: int) -> dict[str, list[int]]:
    """What the sweep may try: every launch here is correct; MAX_TILE_ELEMENTS bounds the tile."""
    widest = min(max(16, next_power_of_2(n_cols)), 4096)
    return {
        "BLOCK_N": [b for b in (16 << i for i in range(9)) if b <= widest],
        "BLOCK_M": [1, 2, 4, 8, 16, 32, 64],
        "num_warps": [1, 2, 4, 8, 16],
    }


_cached_heuristic_config = functools.lru_cache(maxsize=4096)(heuristic_config)  # launches share its dicts: read-only


def launch_config(kind: str, n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The tuned table's entry for this launch's bucket when there is one, else `heuristic_config`."""
    tuned = configs.tuned_config(TUNABLES[kind], device, tuning_key(n_rows, n_cols, dtype))
    return tuned if tuned is not None else _cached_heuristic_config(n_cols)


@configs.launch_plan
def _plan(kind: str, activation: int, shape, strides: tuple, dtype, device, config=None) -> Launch | None | bool:
    """The launch of `kind` ("fwd": reads gate, up; "bwd": grad, gate, up, writes dgate, dup) with this activation
    (SILU, GELU_TANH, GELU) over tensors of this shape with these strides (one tuple per tensor, in that order);
    False when an input must be copied first (`row_args`), None when there is nothing to launch.

    When every tensor is dense and row-major (`FLAT`: a projection's output, the common case) the elements are
    one run, tiled in BLOCK_M * BLOCK_N elements with one offset for all (as Inductor's pointwise kernels do):
    no per-row index arithmetic, and no masks when the tiles divide the run (`EVEN`). Otherwise the rows are
    addressed by their strides, in [BLOCK_M, BLOCK_N] tiles."""
    _check_code(activation)  # here, built once per signature: the ops take the code from anyone
    names = ("gate", "up") if kind == "fwd" else ("grad", "gate", "up", "dgate", "dup")
    args = [row_args(name, shape, tensor_strides) for name, tensor_strides in zip(names, strides)]
    if None in args:
        return False
    n_rows, n_cols = math.prod(shape[:-1]), shape[-1]
    if not (n_rows and n_cols):
        return None
    cfg = config or launch_config(kind, n_rows, n_cols, dtype, device)
    flat = all(dense_row_major(shape, tensor_strides) for tensor_strides in strides)
    tile, n_elements = cfg["BLOCK_M"] * cfg["BLOCK_N"], n_rows * n_cols
    if flat:
        grid, even = (cdiv(n_elements, tile), 1), n_elements % tile == 0
    else:
        grid, even = (cdiv(n_rows, cfg["BLOCK_M"]), cdiv(n_cols, cfg["BLOCK_N"])), False
    return Launch(grid, dict(
        n_rows=n_rows, n_cols=n_cols, **{k: v for named in args for k, v in named.items()},
        ACTIVATION=activation, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], FLAT=flat, EVEN=even,
        WIDE=n_elements + tile > 2**31 - 1,  # the last tile's offsets, masked or not, must not overflow int32
        num_warps=cfg["num_warps"],
    ))


# ------------------------------------------------------------------------------------------- launchers


def _forward(gate: torch.Tensor, up: torch.Tensor, activation: int = SILU, config: dict | None = None) -> torch.Tensor:
    """act(gate) * up; `config` overrides the launch configuration (the kernel sweep times candidates this way)."""
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    if not use_triton(gate):  # contiguous, as the Triton path and the fake implementation produce
        return (_activation_torch(gate.float(), activation) * up.float()).to(out_dtype).contiguous()
    launch = (_plan if config is None else _plan.__wrapped__)(
        "fwd", activation, gate.shape, (gate.stride(), up.stride()), gate.dtype, gate.device, config)
    if launch is False:
        return _forward(gate.contiguous(), up.contiguous(), activation, config)
    out = torch.empty_like(gate, dtype=out_dtype, memory_format=torch.contiguous_format)
    if launch is not None:
        launch.launch(_swiglu_fwd_kernel, gate, up, out)
    return out


def _backward_into(grad, gate, up, dgate, dup, activation: int = SILU, config=None) -> None:
    """Write both input gradients into the (possibly strided) tensors dgate and dup (`config`: as in _forward)."""
    if not use_triton(gate):
        torch_dgate, torch_dup = _backward_torch(grad, gate, up, activation)
        dgate.copy_(torch_dgate)
        dup.copy_(torch_dup)
        return
    launch = (_plan if config is None else _plan.__wrapped__)(
        "bwd", activation, gate.shape, (grad.stride(), gate.stride(), up.stride(), dgate.stride(), dup.stride()),
        gate.dtype, gate.device, config)
    if launch is False:
        if row_args("dgate", dgate.shape, dgate.stride()) is None or row_args("dup", dup.shape, dup.stride()) is None:
            raise ValueError(f"gated activation: gradient buffers with strides {dgate.stride()} and {dup.stride()} "
                             "need more than two row strides")  # outputs are written in place, never copied
        return _backward_into(grad.contiguous(), gate.contiguous(), up.contiguous(), dgate, dup, activation, config)
    if launch is not None:
        launch.launch(_swiglu_bwd_kernel, grad, gate, up, dgate, dup)


_K0 = 2 * math.sqrt(2 / math.pi)  # z = x (K0 + K1 x^2) = 2 sqrt(2/pi) (x + 0.044715 x^3)
_K1 = _K0 * 0.044715


def _logistic_argument_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_logistic_argument` of gelu's tanh approximation in torch ops: (z, dz/dx)."""
    clamped = x.clamp(-100.0, 100.0)
    x2 = clamped.square()
    return clamped * (_K0 + _K1 * x2), _K0 + 3 * _K1 * x2


def _check_code(activation: int) -> None:
    if activation not in _NAMES:
        raise ValueError(f"gated activation: activation code {activation!r} is none of {_NAMES}")


def _activation_torch(x: torch.Tensor, activation: int) -> torch.Tensor:
    """act(x) of fp32 x as the kernels compute it: gelu's tanh approximation as x sigmoid(z), which keeps the tail
    that 0.5 x (1 + tanh(u)) (torch's F.gelu) loses to cancellation for negative x."""
    _check_code(activation)
    if activation == SILU:
        return F.silu(x)
    if activation == GELU:  # 0.5 x (1 + erf), in the kernel's order: torch's F.gelu overflows to inf past 1.7e38
        return 0.5 * x * (1 + torch.erf(x * math.sqrt(0.5)))
    return x * torch.sigmoid(_logistic_argument_torch(x)[0])


def _backward_torch(grad, gate, up, activation: int = SILU):
    """The same math in plain PyTorch, for CPU tensors outside the interpreter."""
    g, x, y = grad.float(), gate.float(), up.float()
    # ATen's fused silu_backward and gelu_backward (g * act'(x)): fewer temporaries on a CPU.
    if activation == SILU:
        dgate, act = torch.ops.aten.silu_backward(g * y, x), F.silu(x)
    elif activation == GELU:
        dgate, act = torch.ops.aten.gelu_backward(g * y, x), _activation_torch(x, GELU)
    else:  # act' = s (1 + x (1 - s) z'), with 1 - s = sigmoid(-z) to its last digit
        z, dz = _logistic_argument_torch(x)
        s = torch.sigmoid(z)
        act = x * s
        dgate = g * y * (s + act * torch.sigmoid(-z) * dz)  # as the kernel: no -inf times s = 0 far out
    return dgate.to(gate.dtype).contiguous(), (g * act).to(up.dtype).contiguous()


def _halves(x: torch.Tensor):
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


# ------------------------------------------------------------------------------ torch.library operators


def _gated_impl(gate: torch.Tensor, up: torch.Tensor, activation: int) -> torch.Tensor:
    return _forward(gate, up, activation)


def _gated_backward_impl(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                         activation: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(gate):
        return _backward_torch(grad, gate, up, activation)
    dgate, dup = torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(up, memory_format=torch.contiguous_format)
    _backward_into(grad, gate, up, dgate, dup, activation)
    return dgate, dup


def _gated_packed_impl(x: torch.Tensor, activation: int) -> torch.Tensor:
    return _forward(*_halves(x), activation)


def _gated_packed_backward_impl(grad: torch.Tensor, x: torch.Tensor, activation: int) -> torch.Tensor:
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    _backward_into(grad, *_halves(x), *_halves(dx), activation)
    return dx


_gated_op = torch.library.custom_op("tridist::gated_activation", mutates_args=())(_gated_impl)
_gated_backward_op = torch.library.custom_op("tridist::gated_activation_backward", mutates_args=())(_gated_backward_impl)
_gated_packed_op = torch.library.custom_op("tridist::gated_activation_packed", mutates_args=())(_gated_packed_impl)
_gated_packed_backward_op = torch.library.custom_op("tridist::gated_activation_packed_backward", mutates_args=())(
    _gated_packed_backward_impl
)


@_gated_op.register_fake
def _(gate, up, activation):
    _check_code(activation)
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@_gated_backward_op.register_fake
def _(grad, gate, up, activation):
    return torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(up, memory_format=torch.contiguous_format)


@_gated_packed_op.register_fake
def _(x, activation):
    _check_code(activation)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@_gated_packed_backward_op.register_fake
def _(grad, x, activation):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_gated(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:-1])
    ctx.activation = inputs[-1]


def _backward_gated(ctx, grad):
    gate, up = ctx.saved_tensors
    backward = _gated_backward_impl if getattr(ctx, "eager", False) else _gated_backward_op
    return *backward(grad, gate, up, ctx.activation), None


def _backward_gated_packed(ctx, grad):
    (x,) = ctx.saved_tensors
    backward = _gated_packed_backward_impl if getattr(ctx, "eager", False) else _gated_packed_backward_op
    return backward(grad, x, ctx.activation), None


torch.library.register_autograd("tridist::gated_activation", _backward_gated, setup_context=_setup_gated)
torch.library.register_autograd("tridist::gated_activation_packed", _backward_gated_packed, setup_context=_setup_gated)
_gated_eager = eager_autograd(_gated_impl, _setup_gated, _backward_gated)
_gated_packed_eager = eager_autograd(_gated_packed_impl, _setup_gated, _backward_gated_packed)


# ------------------------------------------------------------------------------------------- public API


def swiglu(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(x) * y`; with `y=None`, x's last dimension is split in half: `silu(x1) * x2`.

    Computed in fp32 and rounded once to the promoted dtype of the inputs. Any shape and strides.
    """
    return _gated(x, y, SILU, "swiglu")


def geglu(x: torch.Tensor, y: torch.Tensor | None = None, *, approximate: str = "tanh") -> torch.Tensor:
    """`gelu(x, approximate) * y` (Gemma's MLP: `gelu_pytorch_tanh`); with `y=None`, x's last dimension is split in
    half: `gelu(x1) * x2`. `approximate`: "tanh" (torch's `F.gelu(approximate="tanh")`, transformers'
    `gelu_pytorch_tanh` and `gelu_new`) or "none" (the exact, erf form).

    Computed in fp32 and rounded once to the promoted dtype of the inputs. Any shape and strides.
    """
    if approximate not in ("tanh", "none"):
        raise ValueError(f"geglu: approximate must be 'tanh' or 'none' (as torch's F.gelu), got {approximate!r}")
    return _gated(x, y, GELU_TANH if approximate == "tanh" else GELU, "geglu")


def gated_activation(x: torch.Tensor, y: torch.Tensor | None, activation: str, *, op: str = "gated_activation"):
    """`act(x) * y` (or of x's two halves with `y=None`) for `activation` in ACTIVATIONS: what `swiglu` and `geglu`
    call; `op` names the caller in errors."""
    return _gated(x, y, ACTIVATIONS[_checked_activation(op, activation)], op)


def _gated(x: torch.Tensor, y: torch.Tensor | None, code: int, op: str) -> torch.Tensor:
    """`gated_activation` with the activation's kernel code (SILU, GELU_TANH, GELU)."""
    if is_dtensor(x) or is_dtensor(y):
        return _gated_on_shards(x, y, code, op)
    check_dtype(op, "x", x)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension, got a scalar")
    if y is None:
        if x.shape[-1] % 2:
            raise ValueError(
                f"{op}: with y=None the last dim of x is split in half (gate, up), so it must be even; got {x.shape[-1]}"
            )
        return (_gated_packed_op if torch.compiler.is_compiling() else _gated_packed_eager)(x, code)
    check_dtype(op, "y", y)
    check_same_device(op, x, y, names=("x", "y"))
    if x.shape != y.shape:
        raise ValueError(f"{op}: x {tuple(x.shape)} and y {tuple(y.shape)} must have the same shape")
    return (_gated_op if torch.compiler.is_compiling() else _gated_eager)(x, y, code)


def _gated_on_shards(x, y, code: int, op: str):
    """A gated activation of DTensors (a block in tensor parallel's global view): the kernel runs on each rank's
    shards where they pair up elementwise, else the unfused ops run on the DTensors (DTensor moves what it must).

    Two tensors with equal placements pair up shard by shard. The split-in-half form pairs up when the last
    dim is whole on each rank, or split part by part (a packed gate_up projection's output: `_StridedShard`
    of its last dim with split_factor 2, each rank holding [its gate | its up]); the output then has the
    last dim split evenly."""
    last = x.dim() - 1
    if y is not None:
        if is_dtensor(x) and is_dtensor(y) and x.placements == y.placements and keeps_whole(x, ()):
            with local_saved_tensors():
                return as_dtensor_like(_gated(x.to_local(), y.to_local(), code, op), x)
        note_unfused(op, f"x {getattr(x, 'placements', 'plain')}, y {getattr(y, 'placements', 'plain')}")
        return gated_reference(x, y, _NAMES[code])
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    if keeps_whole(x, (last,)):
        with local_saved_tensors():
            return as_dtensor_like(_gated(x.to_local(), None, code, op), x, shape=shape)
    halves = [type(p).__name__ == "_StridedShard" and p.dim % x.dim() == last and p.split_factor == 2
              for p in x.placements]
    others_whole = all(half or not (p.is_partial() or split_dim(p, x.dim()) == last) for p, half in zip(x.placements, halves))
    if any(halves) and others_whole:
        from torch.distributed.tensor import Shard

        placements = [Shard(last) if half else p for p, half in zip(x.placements, halves)]
        with local_saved_tensors():
            return as_dtensor_like(_gated(x.to_local(), None, code, op), x, placements=placements,
                                   shape=shape)
    note_unfused(op, f"x {x.placements} splits the gate and up halves unevenly")
    return gated_reference(x, None, _NAMES[code])


class FusedSwiGLU(torch.nn.Module):
    """The SwiGLU activation as a layer: `forward(x, y=None)` is `swiglu(x, y)`."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return swiglu(x, y)


class FusedSwiGLUMLP(torch.nn.Module):
    """`down_proj(act(gate_proj(x)) * up_proj(x))` with the fused gated activation: the Llama MLP (`activation`
    "silu", SwiGLU) or Gemma's (`"gelu_tanh"`, GeGLU; `"gelu"` for the exact gelu).

    Keeps the attribute names of the seed and Hugging Face MLPs (gate_proj, up_proj, down_proj), so
    parameter names, state dicts and tensor-parallel plans written for those models still apply. A
    fused projection (`gate_up_proj`, gate then up, as in Phi-3) uses the split-in-half form.
    """

    activation = "silu"  # the instance's own; this default serves instances pickled before the attribute existed

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False, activation: str = "silu",
                 device=None, dtype=None):
        super().__init__()
        factory = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **factory)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **factory)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **factory)
        self.activation = _checked_activation("FusedSwiGLUMLP", activation)

    @classmethod
    def from_linears(cls, *, down_proj: torch.nn.Module, gate_proj=None, up_proj=None, gate_up_proj=None,
                     activation: str = "silu"):
        """Wrap existing projections (the same modules and parameters, nothing copied).

        Pass either gate_proj and up_proj, or one gate_up_proj whose output is [gate | up].
        """
        if (gate_up_proj is None) == (gate_proj is None or up_proj is None):
            raise ValueError("FusedSwiGLUMLP.from_linears: pass gate_proj and up_proj, or gate_up_proj alone")
        mlp = cls.__new__(cls)
        torch.nn.Module.__init__(mlp)
        if gate_up_proj is not None:
            mlp.gate_up_proj = gate_up_proj
        else:
            mlp.gate_proj, mlp.up_proj = gate_proj, up_proj
        mlp.down_proj = down_proj
        mlp.activation = _checked_activation("FusedSwiGLUMLP.from_linears", activation)
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        code = ACTIVATIONS[self.activation]
        if "gate_up_proj" in self._modules:
            return self.down_proj(_gated(self.gate_up_proj(x), None, code, "FusedSwiGLUMLP"))
        return self.down_proj(_gated(self.gate_proj(x), self.up_proj(x), code, "FusedSwiGLUMLP"))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


def _checked_activation(where: str, activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return activation


def _sorted_pairs(top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token-expert pairs of `top_k_index` [tokens, k] as flat indices, sorted by expert and in token order
    within one; their experts in that order)."""
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)
    return order, experts[order]


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token-expert pairs of `top_k_index` [tokens, k] as flat indices, sorted by expert and in token order
    within one, slots of `num_experts` or more left out; the pairs per expert [num_experts])."""
    with torch.no_grad():
        order, sorted_experts = _sorted_pairs(top_k_index)
        kept = int(torch.searchsorted(sorted_experts, num_experts))  # sentinels (>= num_experts) sort last
        return order[:kept], torch.bincount(sorted_experts[:kept], minlength=num_experts)


def stacked_experts_layout_error(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> str | None:
    """None for stacked SwiGLU experts in Hugging Face's layout (`gate_up_proj` [experts, 2·ffn, hidden],
    `down_proj` [experts, hidden, ffn]), else what differs."""
    if (gate_up_proj.dim() != 3 or down_proj.dim() != 3 or gate_up_proj.shape[0] != down_proj.shape[0]
            or gate_up_proj.shape[1] != 2 * down_proj.shape[2] or gate_up_proj.shape[2] != down_proj.shape[1]):
        return (f"gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} are not [experts, "
                "2·ffn, hidden] and [experts, hidden, ffn]")
    return None


def grouped_mm_supported(x: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs the experts of rows like `x`: bf16 (its documented input dtype; what
    torch.compile's shape function accepts) on a CPU or a CUDA device of compute capability 8.0+, with rows of
    16-byte multiples (the kernels' stride requirement, for the hidden and ffn widths)."""
    if not hasattr(F, "grouped_mm") or x.dtype != torch.bfloat16 or down_proj.dtype != torch.bfloat16:
        return False
    if not all(n * x.element_size() % 16 == 0 for n in down_proj.shape[1:]):
        return False
    return x.device.type == "cpu" or (x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) >= (8, 0))


def routed_swiglu(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *, grouped_mm: bool | None = None,
                  activation=swiglu) -> torch.Tensor:
    """Each token's k experts, `down(activation(x @ gate_upᵀ))` weighted by `top_k_weights` and summed, with
    `gate_up_proj` [experts, 2·ffn, hidden] and `down_proj` [experts, hidden, ffn] (Hugging Face's layout); an
    index of `experts` or more is a slot to skip. The pairs are sorted by expert; each projection runs as
    one grouped GEMM where the device has one (`grouped_mm=None`: `grouped_mm_supported`), with no host sync,
    else as a loop over the experts that received tokens (which reads their counts on the host).
    `activation(x)` takes the packed [gate | up] rows: the fused `swiglu`, or an eager one."""
    if grouped_mm is None:
        grouped_mm = grouped_mm_supported(hidden_states, down_proj)
    experts = _experts_grouped if grouped_mm else _experts_loop
    out, order, tokens = experts(hidden_states, top_k_index, gate_up_proj, down_proj, activation)
    out = out * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add_(0, tokens, out.to(hidden_states.dtype))


def _experts_loop(hidden_states, top_k_index, gate_up_proj, down_proj, activation):
    """(each routed pair's expert output, the pairs' flat indices in that order, their tokens): a loop over the
    experts that received tokens, slots to skip left out (sort_by_expert reads the counts on the host)."""
    order, counts = sort_by_expert(top_k_index, gate_up_proj.shape[0])
    tokens = order // top_k_index.shape[-1]
    x = hidden_states[tokens]
    parts, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            rows = x[start:start + count]
            parts.append(F.linear(activation(F.linear(rows, gate_up_proj[expert])), down_proj[expert]))
            start += count
    return (torch.cat(parts) if parts else x.new_zeros(0, hidden_states.shape[-1])), order, tokens


def _experts_grouped(hidden_states, top_k_index, gate_up_proj, down_proj, activation):
    """_experts_loop's answer by two grouped GEMMs over every token-expert pair, sorted by expert, without a host
    sync (slots to skip included, as zero rows).

    Slots to skip (index >= experts) sort last, beyond the last offset: the grouped GEMM leaves those rows of
    its output, and of its input's gradient, uninitialised. Rows between the two GEMMs only reach the second,
    which reads none past the offset; masking the gathered rows (whose backward zeroes the gradient rows the
    first GEMM left so) and the second GEMM's output keeps them out of every sum (transformers does the same)."""
    num_experts = gate_up_proj.shape[0]
    with torch.no_grad():
        # A negative index would sort first and shift every group: refused, on the device (no host sync).
        torch._assert_async((top_k_index >= 0).all(),
                            "routed_swiglu: expert indices must be >= 0 (an index of experts or more is a slot to skip)")
        order, sorted_experts = _sorted_pairs(top_k_index)
        # Where each expert's rows end: the sorted pairs below the next expert's index. A fixed-size answer
        # (bincount's size would depend on the values, a sync); slots to skip sort past the last offset.
        ends = torch.arange(1, num_experts + 1, dtype=sorted_experts.dtype, device=sorted_experts.device)
        offsets = torch.searchsorted(sorted_experts, ends).to(torch.int32)
        skipped = (sorted_experts >= num_experts)[:, None]
    tokens = order // top_k_index.shape[-1]
    x = hidden_states[tokens].masked_fill(skipped, 0)
    gate_up = F.grouped_mm(x, gate_up_proj.transpose(-2, -1), offs=offsets)
    out = F.grouped_mm(activation(gate_up), down_proj.transpose(-2, -1), offs=offsets).masked_fill(skipped, 0)
    return out, order, tokens


def eager_swiglu(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of packed [gate | up] rows, in eager PyTorch ops (Hugging Face's experts' math)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class FusedSwiGLUExperts(torch.nn.Module):
    """A mixture of experts' routed SwiGLU MLPs stored as 3-D weights (Hugging Face's layout: `gate_up_proj`
    [experts, 2·ffn, hidden], gate rows then up rows; `down_proj` [experts, hidden, ffn]), with the fused
    activation. `forward(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])`
    is Hugging Face's experts interface: each token's k experts, weighted, summed (`routed_swiglu`: grouped
    GEMMs where torch has them, bf16 on a CPU or an Ampere+ GPU, a loop over the experts hit elsewhere). The
    parameters are the replaced module's own (same objects, same names), so state dicts and optimizers still
    apply.
    """

    def __init__(self, gate_up_proj: torch.nn.Parameter, down_proj: torch.nn.Parameter, *,
                 grouped_mm: bool | None = None):
        super().__init__()
        problem = stacked_experts_layout_error(gate_up_proj, down_proj)
        if problem:
            raise ValueError(f"FusedSwiGLUExperts: {problem}")
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.num_experts = gate_up_proj.shape[0]
        self.grouped_mm = grouped_mm

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        inputs = (hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)
        if any(is_dtensor(t) for t in inputs):
            return self._on_replicas(inputs)
        return routed_swiglu(*inputs, grouped_mm=self.grouped_mm)

    def _on_replicas(self, inputs):
        """`forward`'s inputs (hidden states, top-k index and weights, the two weights) with DTensors among them
        (an MoE block in tensor parallel's global view, which runs whole on every tp rank): every rank holds every
        token and every expert, so the experts run on the local values, and each rank's gradients are already
        the whole ones (Replicate, no reduction). Any other placement is refused: the token routing does not
        split."""
        dtensors = [t for t in inputs if is_dtensor(t)]
        split = sorted({repr(p) for t in dtensors for p in t.placements if not p.is_replicate()})
        if split or len({t.device_mesh for t in dtensors}) > 1:
            raise ValueError(
                f"FusedSwiGLUExperts: DTensor inputs must be replicated on one mesh (an MoE block in global view runs "
                f"whole on every tensor-parallel rank; under sequence parallel it runs in local view, on the rank's "
                f"slice), got placements {split or 'on several meshes'}; run the block in local view, or without "
                "sequence parallel, or unfused (fuse(..., swiglu=False))")
        with local_saved_tensors():
            out = routed_swiglu(*(t.to_local() if is_dtensor(t) else t for t in inputs), grouped_mm=self.grouped_mm)
        like = inputs[0] if is_dtensor(inputs[0]) else dtensors[0]
        return as_dtensor_like(out, like, shape=out.shape)
