"""RMSNorm, optionally fused with the residual add: Triton kernels, launchers, torch.library ops, layer.

    y = cast(x_fp32 * rsqrt(mean(x_fp32^2) + eps)) * (offset + weight)

Statistics are always fp32. `cast_to` picks which reference the rounding follows:
- "weight" (the seed model, Paddle): the normalised row is rounded to the weight's dtype when the
  weight is fp16/bf16, and the product has the weight's dtype (fp32 for an fp32 weight);
- "input" (Hugging Face Llama): it is rounded to the input's dtype; the product has the promoted dtype.
With `residual`, `h = x + residual` (rounded to their promoted dtype, as eager does) is normalised and
returned too, so a decoder layer reads the residual stream once.

Backward recomputes the normalised row from the saved input and the fp32 per-row 1/rms. The weight
gradient is reduced without atomics: each program of a persistent grid sums its rows into its own
fp32 row of a partial buffer, and those rows are summed in a fixed order, so results are deterministic.
Rows longer than what fits in registers (MAX_SINGLE_PASS_COLS) are processed in column blocks.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import configs
from ..reference import rms_norm_reference
from .._common import (
    cast,
    cdiv,
    is_dtensor,
    local_saved_tensors,
    HALF_DTYPES,
    Launch,
    row_args,
    check_dtype,
    check_same_device,
    eager_autograd,
    next_power_of_2,
    num_programs_for_persistent_grid,
    use_triton,
)

# A row of up to 16384 elements stays in registers (<= 32 fp32 values per thread at 16 warps);
# longer rows are streamed in blocks of MULTI_PASS_BLOCK_N columns (two reads of the row). The
# backward keeps three rows live (x, dy, dx) and spills above 8192 columns on sm_90 (ptxas: 128
# registers + 188 B of spills at 16384), so it streams earlier.
MAX_SINGLE_PASS_COLS = 16384
MAX_SINGLE_PASS_COLS_BACKWARD = 8192
MULTI_PASS_BLOCK_N = 4096
# Rows are packed into one program until a tile holds this many elements, so that short rows
# (hidden 64-1024) still give each program enough bytes in flight.
TARGET_TILE_ELEMENTS = 4096
# Persistent backward grid: two programs per SM hide the latency of the reductions.
# Occupancy on sm_90 (`python -m tests._gpu_codegen --study`: ptxas registers, no spills at either): the
# heuristic's backward holds 24 warps per SM at hidden 4096 (80 registers; 16 for add_rms_norm's 112) and 16
# at 8192 (82 / 112 registers: one 16-warp program per SM, not the two the grid asks for). 16 warps at
# BLOCK_N 4096 would hold 32 (59 / 63 registers, single pass at 4096, two passes at 8192); both are in
# search_space, so a sweep on an H100 decides between them (the heuristic stays until one has measured it).
BACKWARD_PROGRAMS_PER_SM = 2
# The backward's single-pass loop over its tiles, software-pipelined when above 1 (NUM_STAGES). On sm_90
# (`python -m tests._gpu_codegen --study`), 3 stages copy the next tiles with cp.async: 49 KB of shared memory
# per program at hidden 2048 and 4096, 98 KB at 8192, registers 95-112 -> 116-128, the same 16 warps per SM.
# Not measured on a GPU yet: the heuristic keeps the plain loop; the sweep's search space has 1, 2 and 4.
BACKWARD_NUM_STAGES = 1
# add_rms_norm's backward (three rows streamed in: dy, the residual stream's gradient, h) at single-pass widths
# RESIDUAL_BACKWARD_MIN_COLS..MAX_SINGLE_PASS_COLS_BACKWARD: RESIDUAL_BACKWARD_ELEMENTS_PER_THREAD elements of
# the tile per thread over max(4, BLOCK_N / 1024) warps: rows packed into the tile and more loads in flight
# per thread, at the price of occupancy (255 registers, 8 warps per SM; <= 48 B of spills on sm_90 by
# `python -m tests._gpu_codegen --study`). Measured on an H100 (2026-11-27, scripts/probe_configs.py at 65,536
# rows, bench/results/h100-2026-11-27b/probe): hidden 2048 BLOCK_M 4 x 4 warps 0.389 ms against the general
# heuristic's 2 x 8 warps 0.453; hidden 8192 2 x 8 warps 1.510 against 1 x 16 warps 1.721 (compile's whole
# add_rms_norm backward: ~0.40 and ~1.6). 128 elements per thread spills kilobytes (4 ms at 8192); 4096 is the
# rule's unmeasured middle (2 x 4 warps: the 8192 winner's 255 registers and 48 B of spills).
RESIDUAL_BACKWARD_ELEMENTS_PER_THREAD = 64
RESIDUAL_BACKWARD_MIN_COLS = 2048

ROUND_NONE, ROUND_TO_WEIGHT, ROUND_TO_INPUT = 0, 1, 2


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_offsets(rows, inner_rows, stride_outer, stride_inner):
    rows = rows.to(tl.int64)
    return (rows // inner_rows) * stride_outer + (rows % inner_rows) * stride_inner


@triton.jit
def _load_h(
    x_ptr, x_rows, x_stride_col, res_ptr, res_rows, res_stride_col, h_ptr, cols, mask,
    HAS_RESIDUAL: tl.constexpr,
):
    """The row to normalise, in fp32: x, or x + residual rounded to the residual stream's dtype."""
    cols = cols.to(tl.int64)  # a transposed input can have column strides whose products pass 2**31
    h = tl.load(x_ptr + x_rows[:, None] + cols[None, :] * x_stride_col, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + res_rows[:, None] + cols[None, :] * res_stride_col, mask=mask, other=0.0)
        # Round like eager's `x + residual` so the statistics see the same values as the reference.
        h = (h + r.to(tl.float32)).to(h_ptr.dtype.element_ty).to(tl.float32)
    return h


@triton.jit
def _round_normed(normed, x_ptr, w_ptr, h_ptr, ROUND: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    if ROUND == 1:
        normed = normed.to(w_ptr.dtype.element_ty).to(tl.float32)
    elif ROUND == 2:
        if HAS_RESIDUAL:
            normed = normed.to(h_ptr.dtype.element_ty).to(tl.float32)
        else:
            normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    return normed


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr,
    n_rows, n_cols, eps, offset,
    x_inner_rows, x_stride_outer, x_stride_inner, x_stride_col,
    res_inner_rows, res_stride_outer, res_stride_inner, res_stride_col,
    w_stride,
    HAS_RESIDUAL: tl.constexpr, ROUND: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    x_rows = _row_offsets(rows, x_inner_rows, x_stride_outer, x_stride_inner)
    res_rows = _row_offsets(rows, res_inner_rows, res_stride_outer, res_stride_inner)
    out_rows = rows.to(tl.int64) * n_cols  # y and h are fresh contiguous tensors
    eps = tl.cast(eps, tl.float32)
    offset = tl.cast(offset, tl.float32)
    cols = tl.arange(0, BLOCK_N)

    if SINGLE_PASS:
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        # The weight is read with the row, before any store: a load after a store cannot move above it (the
        # compiler cannot rule out that they alias). Read after the reduction and 1/rms's store, it was a second
        # round trip to memory per row, unhidden where few rows share an SM (hidden 8,192: 16 warps a row); now
        # sm_90's code issues it amid the reduction (tests/test_gpu_codegen.py).
        w = tl.load(w_ptr + cols * w_stride, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
        h = _load_h(x_ptr, x_rows, x_stride_col, res_ptr, res_rows, res_stride_col, h_ptr, cols, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(h_ptr + out_rows[:, None] + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
        normed = _round_normed(h * rstd[:, None], x_ptr, w_ptr, h_ptr, ROUND, HAS_RESIDUAL)
        tl.store(y_ptr + out_rows[:, None] + cols[None, :], (normed * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    else:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            block = start + cols
            mask = row_mask[:, None] & (block < n_cols)[None, :]
            h = _load_h(x_ptr, x_rows, x_stride_col, res_ptr, res_rows, res_stride_col, h_ptr, block, mask, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                tl.store(h_ptr + out_rows[:, None] + block[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
            sum_sq += tl.sum(h * h, axis=1)
        rstd = tl.rsqrt(sum_sq / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        for start in range(0, n_cols, BLOCK_N):
            block = start + cols
            mask = row_mask[:, None] & (block < n_cols)[None, :]
            # Recompute h from the inputs rather than re-reading h_ptr: other threads wrote it.
            h = _load_h(x_ptr, x_rows, x_stride_col, res_ptr, res_rows, res_stride_col, h_ptr, block, mask, HAS_RESIDUAL)
            w = tl.load(w_ptr + block * w_stride, mask=block < n_cols, other=0.0).to(tl.float32) + offset
            normed = _round_normed(h * rstd[:, None], x_ptr, w_ptr, h_ptr, ROUND, HAS_RESIDUAL)
            tl.store(y_ptr + out_rows[:, None] + block[None, :], (normed * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, dh_ptr, h_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
    n_rows, n_cols, offset,
    dy_inner_rows, dy_stride_outer, dy_stride_inner, dy_stride_col,
    dh_inner_rows, dh_stride_outer, dh_stride_inner, dh_stride_col,
    h_inner_rows, h_stride_outer, h_stride_inner, h_stride_col,
    w_stride,
    HAS_DH: tl.constexpr, ROUND: tl.constexpr, SINGLE_PASS: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """dx = rstd * (dn - normed * mean(dn * normed)), dn = dy * (offset + w); dw = sum_rows dy * normed.

    A persistent grid: program p takes row tiles p, p + P, p + 2P, ... and writes its weight-gradient
    partial sum to row p of dw_partial (no two programs touch the same row, hence no atomics). With
    NUM_STAGES > 1 the single-pass loop is software-pipelined: the next tiles' rows are copied to shared memory
    (cp.async on sm_90) while this one's row sums reduce.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    offset = tl.cast(offset, tl.float32)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)  # column strides of transposed gradients can be large
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    dw_row = dw_partial_ptr + pid.to(tl.int64) * n_cols

    if SINGLE_PASS:
        col_mask = cols < n_cols
        w = tl.load(w_ptr + cols * w_stride, mask=col_mask, other=0.0).to(tl.float32) + offset
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for tile in tl.range(pid, n_tiles, n_programs, num_stages=NUM_STAGES):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            h_rows = _row_offsets(rows, h_inner_rows, h_stride_outer, h_stride_inner)
            dy_rows = _row_offsets(rows, dy_inner_rows, dy_stride_outer, dy_stride_inner)
            h = tl.load(h_ptr + h_rows[:, None] + cols[None, :] * h_stride_col, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + dy_rows[:, None] + cols[None, :] * dy_stride_col, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            normed = h * rstd[:, None]
            if COMPUTE_DW:
                dw_acc += tl.sum(dy * _round_normed(normed, h_ptr, w_ptr, h_ptr, ROUND, False), axis=0)
            dn = dy * w[None, :]
            correction = tl.sum(dn * normed, axis=1) / n_cols
            dx = (dn - normed * correction[:, None]) * rstd[:, None]
            if HAS_DH:
                dh_rows = _row_offsets(rows, dh_inner_rows, dh_stride_outer, dh_stride_inner)
                dx += tl.load(dh_ptr + dh_rows[:, None] + cols[None, :] * dh_stride_col, mask=mask, other=0.0).to(tl.float32)
            out_rows = rows.to(tl.int64) * n_cols
            tl.store(dx_ptr + out_rows[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            tl.store(dw_row + cols, dw_acc, mask=col_mask)
    else:
        for tile in range(pid, n_tiles, n_programs):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < n_rows
            h_rows = _row_offsets(rows, h_inner_rows, h_stride_outer, h_stride_inner)
            dy_rows = _row_offsets(rows, dy_inner_rows, dy_stride_outer, dy_stride_inner)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            correction = tl.zeros([BLOCK_M], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                block = start + cols
                mask = row_mask[:, None] & (block < n_cols)[None, :]
                h = tl.load(h_ptr + h_rows[:, None] + block[None, :] * h_stride_col, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + dy_rows[:, None] + block[None, :] * dy_stride_col, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + block * w_stride, mask=block < n_cols, other=0.0).to(tl.float32) + offset
                correction += tl.sum(dy * w[None, :] * h, axis=1)
            correction = correction * rstd / n_cols
            for start in range(0, n_cols, BLOCK_N):
                block = start + cols
                col_mask = block < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                h = tl.load(h_ptr + h_rows[:, None] + block[None, :] * h_stride_col, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + dy_rows[:, None] + block[None, :] * dy_stride_col, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + block * w_stride, mask=col_mask, other=0.0).to(tl.float32) + offset
                normed = h * rstd[:, None]
                if COMPUTE_DW:
                    # This program's own row of the partial buffer: a plain read-modify-write, no race.
                    partial = tl.load(dw_row + block, mask=col_mask, other=0.0)
                    partial += tl.sum(dy * _round_normed(normed, h_ptr, w_ptr, h_ptr, ROUND, False), axis=0)
                    tl.store(dw_row + block, partial, mask=col_mask)
                    # The load and store layouts differ, so the next tile may read this element from
                    # another thread: order the two within the program.
                    tl.debug_barrier()
                dx = (dy * w[None, :] - normed * correction[:, None]) * rstd[:, None]
                if HAS_DH:
                    dh_rows = _row_offsets(rows, dh_inner_rows, dh_stride_outer, dh_stride_inner)
                    dx += tl.load(dh_ptr + dh_rows[:, None] + block[None, :] * dh_stride_col, mask=mask, other=0.0).to(tl.float32)
                out_rows = rows.to(tl.int64) * n_cols
                tl.store(dx_ptr + out_rows[:, None] + block[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------- launch configurations

_FORWARD_PARAMS = frozenset({"BLOCK_M", "BLOCK_N", "num_warps"})
_BACKWARD_PARAMS = _FORWARD_PARAMS | {"PROGRAMS_PER_SM", "NUM_STAGES"}
# The sweep's limits: a tile of more than 2**16 elements needs over 64 fp32 registers per thread even
# at 32 warps (spills), and single-pass rows wider than 2**15 always spill on sm_90.
MAX_TILE_ELEMENTS = 1 << 16
MAX_BLOCK_N = 1 << 15
# One Tunable per (op, direction): add_rms_norm's kernels are the same functions compiled with the
# residual branch (HAS_RESIDUAL / HAS_DH), a different binary with its own best launch.
TUNABLES = {
    (op, kind): configs.Tunable(
        f"{op}_{kind}", _FORWARD_PARAMS if kind == "fwd" else _BACKWARD_PARAMS,
        (_rms_norm_fwd_kernel if kind == "fwd" else _rms_norm_bwd_kernel, _load_h, _round_normed, _row_offsets),
    )
    for op in ("rms_norm", "add_rms_norm") for kind in ("fwd", "bwd")
}


tuning_key = configs.row_tuning_key  # the tuned table's bucket of a launch (also what the sweep writes under)


def heuristic_config(kind: str, n_cols: int, residual: bool = False) -> dict:
    """BLOCK_N, BLOCK_M (rows per tile) and num_warps (+ PROGRAMS_PER_SM and NUM_STAGES for "bwd") without a table.

    The whole row in one block up to MAX_SINGLE_PASS_COLS (no padding beyond the next power of two),
    otherwise MULTI_PASS_BLOCK_N-wide blocks; short rows are packed until a tile holds
    TARGET_TILE_ELEMENTS; one warp per 512 elements of the tile (16 bytes per thread per load for
    bf16), between 1 and 16 warps; the backward's persistent grid has BACKWARD_PROGRAMS_PER_SM and its loop
    BACKWARD_NUM_STAGES stages. add_rms_norm's backward (`residual`) at single-pass widths from
    RESIDUAL_BACKWARD_MIN_COLS packs RESIDUAL_BACKWARD_ELEMENTS_PER_THREAD per thread instead.
    """
    block_n = max(16, next_power_of_2(n_cols))
    if block_n > (MAX_SINGLE_PASS_COLS if kind == "fwd" else MAX_SINGLE_PASS_COLS_BACKWARD):
        block_n = MULTI_PASS_BLOCK_N
    block_m = max(1, min(64, TARGET_TILE_ELEMENTS // block_n))
    num_warps = max(1, min(16, block_m * block_n // 512))
    if kind == "bwd" and residual and RESIDUAL_BACKWARD_MIN_COLS <= n_cols <= block_n:  # single pass, measured widths
        num_warps = max(4, block_n // 1024)
        block_m = RESIDUAL_BACKWARD_ELEMENTS_PER_THREAD * 32 * num_warps // block_n
    config = {"BLOCK_N": block_n, "BLOCK_M": block_m, "num_warps": num_warps}
    if kind == "bwd":
        config["PROGRAMS_PER_SM"] = BACKWARD_PROGRAMS_PER_SM
        config["NUM_STAGES"] = BACKWARD_NUM_STAGES
    return config


def search_space(kind: str, n_cols: int) -> dict[str, list[int]]:
    """What the sweep may try: every launch here is correct; MAX_TILE_ELEMENTS bounds the tile."""
    widest = min(max(16, next_power_of_2(n_cols)), MAX_BLOCK_N)
    space = {
        "BLOCK_N": [b for b in (16 << i for i in range(12)) if widest // 16 <= b <= widest],
        "BLOCK_M": [1, 2, 4, 8, 16, 32, 64],
        "num_warps": [1, 2, 4, 8, 16, 32],
    }
    if kind == "bwd":
        space["PROGRAMS_PER_SM"] = [1, 2, 4, 8]
        space["NUM_STAGES"] = [1, 2, 4]  # 4 stages of an 8192-wide tile need more shared memory than an SM has
    return space


_cached_heuristic_config = functools.lru_cache(maxsize=4096)(heuristic_config)  # launches share its dicts: read-only


def launch_config(kind: str, n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device, *,
                  residual: bool = False) -> dict:
    """The tuned table's entry for this launch's bucket when there is one, else `heuristic_config`."""
    tunable = TUNABLES["add_rms_norm" if residual else "rms_norm", kind]
    tuned = configs.tuned_config(tunable, device, tuning_key(n_rows, n_cols, dtype))
    return tuned if tuned is not None else _cached_heuristic_config(kind, n_cols, residual)


# -------------------------------------------------------------------------------------------- launchers


def _output_dtypes(h_dtype: torch.dtype, w_dtype: torch.dtype, cast_to_input: bool):
    """(rounding mode of the normalised row, output dtype), following the chosen reference."""
    if cast_to_input:
        round_mode = ROUND_TO_INPUT if h_dtype in HALF_DTYPES else ROUND_NONE
        return round_mode, torch.promote_types(h_dtype, w_dtype)
    if w_dtype in HALF_DTYPES:
        return ROUND_TO_WEIGHT, w_dtype
    return ROUND_NONE, torch.promote_types(torch.float32, w_dtype)


class _ForwardPlan(NamedTuple):
    h_dtype: torch.dtype  # x + residual's
    y_dtype: torch.dtype
    stats_shape: tuple  # 1/rms: one per row
    launch: Launch | None  # None: no rows or no columns, nothing to launch


def _forward_dtypes(x_dtype, res_dtype, w_dtype, cast_to_input: bool):
    """(h's dtype: x + residual's, the rounding mode of the normalised row, y's dtype); `res_dtype` None
    without a residual."""
    h_dtype = torch.promote_types(x_dtype, res_dtype) if res_dtype is not None else x_dtype
    return (h_dtype, *_output_dtypes(h_dtype, w_dtype, cast_to_input))


@configs.launch_plan
def _forward_plan(shape, x_strides, res_strides, x_dtype, res_dtype, w_dtype, w_stride, device, cast_to_input,
                  config=None) -> _ForwardPlan | None:
    """The forward's outputs and launch for inputs of these shapes, strides and dtypes (`res_*` None without a
    residual); None when an input must be copied first (`row_args`)."""
    n_cols, n_rows = shape[-1], math.prod(shape[:-1])
    h_dtype, round_mode, y_dtype = _forward_dtypes(x_dtype, res_dtype, w_dtype, cast_to_input)
    x_args = row_args("x", shape, x_strides)
    res_args = row_args("res", shape, x_strides if res_strides is None else res_strides)
    if x_args is None or res_args is None:
        return None
    launch = None
    if n_rows and n_cols:
        cfg = config or launch_config("fwd", n_rows, n_cols, x_dtype, device, residual=res_dtype is not None)
        launch = Launch((cdiv(n_rows, cfg["BLOCK_M"]),), dict(
            n_rows=n_rows, n_cols=n_cols, **x_args, **res_args, w_stride=w_stride,
            HAS_RESIDUAL=res_dtype is not None, ROUND=round_mode, SINGLE_PASS=cfg["BLOCK_N"] >= n_cols,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
        ))
    return _ForwardPlan(h_dtype, y_dtype, tuple(shape[:-1]), launch)


def _forward(x, residual, weight, eps, offset, cast_to_input, config=None):
    """y, h (x + residual, or y itself) and the fp32 1/rms per row; `config` overrides the launch
    configuration (the kernel sweep times candidates this way)."""
    res_dtype = None if residual is None else residual.dtype
    if not use_triton(x):
        return _forward_torch(x, residual, weight, eps, offset,
                              *_forward_dtypes(x.dtype, res_dtype, weight.dtype, cast_to_input))
    plan_of = _forward_plan if config is None else _forward_plan.__wrapped__
    plan = plan_of(x.shape, x.stride(), None if residual is None else residual.stride(), x.dtype, res_dtype,
                   weight.dtype, weight.stride(0), x.device, cast_to_input, config)
    if plan is None:
        return _forward(x.contiguous(), None if residual is None else residual.contiguous(), weight, eps, offset,
                        cast_to_input, config)
    y = torch.empty_like(x, dtype=plan.y_dtype, memory_format=torch.contiguous_format)
    h = y if residual is None else torch.empty_like(x, dtype=plan.h_dtype, memory_format=torch.contiguous_format)
    rstd = x.new_empty(plan.stats_shape, dtype=torch.float32)
    if plan.launch is not None:
        plan.launch.launch(_rms_norm_fwd_kernel, x, x if residual is None else residual, weight, y, h, rstd,
                           eps=eps, offset=offset)
    return y, h, rstd


class _BackwardPlan(NamedTuple):
    partial_shape: tuple  # the weight gradient's fp32 partial sums: one row per program
    zero_partial: bool  # the partial rows must start at zero (the multi-pass kernel accumulates into them)
    launch: Launch | None  # None: no rows or no columns, nothing to launch


@configs.launch_plan
def _backward_plan(shape, h_strides, dy_strides, dh_strides, h_dtype, w_dtype, w_stride, device, cast_to_input,
                   compute_dw, config=None) -> _BackwardPlan | None:
    """The backward's launch for gradients and saved inputs of these shapes, strides and dtypes (`dh_strides`
    None without the residual stream's gradient); None when an input must be copied first (`row_args`)."""
    n_cols, n_rows = shape[-1], math.prod(shape[:-1])
    round_mode, _ = _output_dtypes(h_dtype, w_dtype, cast_to_input)
    h_args, dy_args = row_args("h", shape, h_strides), row_args("dy", shape, dy_strides)
    dh_args = row_args("dh", shape, dy_strides if dh_strides is None else dh_strides)
    if h_args is None or dy_args is None or dh_args is None:
        return None
    cfg = config or launch_config("bwd", n_rows, n_cols, h_dtype, device, residual=dh_strides is not None)
    single_pass = cfg["BLOCK_N"] >= n_cols
    n_tiles = cdiv(n_rows, cfg["BLOCK_M"])
    n_programs = max(1, min(n_tiles, num_programs_for_persistent_grid(device, cfg["PROGRAMS_PER_SM"])))
    launch = None
    if n_rows and n_cols:
        launch = Launch((n_programs,), dict(
            n_rows=n_rows, n_cols=n_cols, **dy_args, **dh_args, **h_args, w_stride=w_stride,
            HAS_DH=dh_strides is not None, ROUND=round_mode, SINGLE_PASS=single_pass, COMPUTE_DW=compute_dw,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], NUM_STAGES=cfg["NUM_STAGES"], num_warps=cfg["num_warps"],
        ))
    return _BackwardPlan((n_programs, n_cols) if compute_dw else (0,), launch is None or not single_pass, launch)


def _backward(dy, dh, h, weight, rstd, offset, cast_to_input, dx_dtype, compute_dw, config=None):
    if not use_triton(h):
        round_mode, _ = _output_dtypes(h.dtype, weight.dtype, cast_to_input)
        return _backward_torch(dy, dh, h, weight, rstd, offset, round_mode, dx_dtype, compute_dw)
    plan_of = _backward_plan if config is None else _backward_plan.__wrapped__
    plan = plan_of(h.shape, h.stride(), dy.stride(), None if dh is None else dh.stride(), h.dtype, weight.dtype,
                   weight.stride(0), h.device, cast_to_input, compute_dw, config)
    if plan is None:
        return _backward(dy.contiguous(), None if dh is None else dh.contiguous(), h.contiguous(), weight, rstd,
                         offset, cast_to_input, dx_dtype, compute_dw, config)
    dx = torch.empty_like(h, dtype=dx_dtype, memory_format=torch.contiguous_format)
    dw_partial = (torch.zeros if plan.zero_partial else torch.empty)(
        plan.partial_shape, dtype=torch.float32, device=h.device)
    if plan.launch is not None:
        plan.launch.launch(_rms_norm_bwd_kernel, dy, dy if dh is None else dh, h, weight, rstd, dx, dw_partial,
                           offset=offset)
    if not compute_dw:
        return dx, weight.new_empty(0)
    return dx, cast(dw_partial.sum(0), weight.dtype)


def _round_torch(normed, round_mode, weight_dtype, h_dtype):
    if round_mode == ROUND_TO_WEIGHT:
        return normed.to(weight_dtype).float()
    if round_mode == ROUND_TO_INPUT:
        return normed.to(h_dtype).float()
    return normed


def _forward_torch(x, residual, weight, eps, offset, h_dtype, round_mode, y_dtype):
    """The same math in plain PyTorch, for CPU tensors outside the interpreter."""
    h = (x + residual).to(h_dtype) if residual is not None else x
    hf = h.float()
    rstd = torch.rsqrt(hf.pow(2).mean(-1) + eps)
    normed = _round_torch(hf * rstd.unsqueeze(-1), round_mode, weight.dtype, h_dtype)
    # Contiguous outputs, as the Triton path and the fake implementations produce.
    y = (normed * (weight.float() + offset)).to(y_dtype).contiguous()
    return y, (h.contiguous() if residual is not None else y), rstd.contiguous()


def _backward_torch(dy, dh, h, weight, rstd, offset, round_mode, dx_dtype, compute_dw):
    hf, dyf, rstd = h.float(), dy.float(), rstd.unsqueeze(-1)
    normed = hf * rstd
    dn = dyf * (weight.float() + offset)
    dx = (dn - normed * (dn * normed).mean(-1, keepdim=True)) * rstd
    if dh is not None:
        dx = dx + dh.float()
    if compute_dw:
        rounded = _round_torch(normed, round_mode, weight.dtype, h.dtype)
        dw = (dyf * rounded).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
    else:
        dw = weight.new_empty(0)
    return dx.to(dx_dtype).contiguous(), dw


# ------------------------------------------------------------------------------ torch.library operators


def _rms_norm_impl(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast_to_input: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = _forward(x, None, weight, eps, offset, cast_to_input)
    return y, rstd


def _add_rms_norm_impl(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast_to_input: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(x, residual, weight, eps, offset, cast_to_input)


def _rms_norm_backward_impl(
    grad_y: torch.Tensor,
    grad_h: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    cast_to_input: bool,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(grad_y, grad_h, h, weight, rstd, offset, cast_to_input, h.dtype, compute_dw)


_rms_norm_op = torch.library.custom_op("tridist::rms_norm", mutates_args=())(_rms_norm_impl)
_add_rms_norm_op = torch.library.custom_op("tridist::add_rms_norm", mutates_args=())(_add_rms_norm_impl)
_rms_norm_backward_op = torch.library.custom_op("tridist::rms_norm_backward", mutates_args=())(_rms_norm_backward_impl)


def _backward_fn(ctx):
    return _rms_norm_backward_impl if getattr(ctx, "eager", False) else _rms_norm_backward_op


@_rms_norm_op.register_fake
def _(x, weight, eps, offset, cast_to_input):
    _, y_dtype = _output_dtypes(x.dtype, weight.dtype, cast_to_input)
    return x.new_empty(x.shape, dtype=y_dtype), x.new_empty(x.shape[:-1], dtype=torch.float32)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset, cast_to_input):
    h_dtype = torch.promote_types(x.dtype, residual.dtype)
    _, y_dtype = _output_dtypes(h_dtype, weight.dtype, cast_to_input)
    return (
        x.new_empty(x.shape, dtype=y_dtype),
        x.new_empty(x.shape, dtype=h_dtype),
        x.new_empty(x.shape[:-1], dtype=torch.float32),
    )


@_rms_norm_backward_op.register_fake
def _(grad_y, grad_h, h, weight, rstd, offset, cast_to_input, compute_dw):
    return h.new_empty(h.shape), weight.new_empty(weight.shape if compute_dw else (0,))


def _setup_rms_norm(ctx, inputs, output):
    x, weight, _, offset, cast_to_input = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset, ctx.cast_to_input = offset, cast_to_input


def _backward_rms_norm(ctx, grad_y, grad_rstd=None):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _backward_fn(ctx)(
        grad_y, None, x, weight, rstd, ctx.offset, ctx.cast_to_input, ctx.needs_input_grad[1]
    )
    return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None


def _setup_add_rms_norm(ctx, inputs, output):
    x, residual, weight, _, offset, cast_to_input = inputs
    _, h, rstd = output
    ctx.save_for_backward(h, weight, rstd)
    ctx.offset, ctx.cast_to_input = offset, cast_to_input
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype


def _backward_add_rms_norm(ctx, grad_y, grad_h, grad_rstd=None):
    h, weight, rstd = ctx.saved_tensors
    dh, dw = _backward_fn(ctx)(
        grad_y, grad_h, h, weight, rstd, ctx.offset, ctx.cast_to_input, ctx.needs_input_grad[2]
    )
    # h = x + residual: both receive the gradient of h (cast back to their own dtype if they differ).
    return cast(dh, ctx.x_dtype), cast(dh, ctx.residual_dtype), (dw if ctx.needs_input_grad[2] else None), None, None, None


torch.library.register_autograd("tridist::rms_norm", _backward_rms_norm, setup_context=_setup_rms_norm)
torch.library.register_autograd("tridist::add_rms_norm", _backward_add_rms_norm, setup_context=_setup_add_rms_norm)
# In eager mode the caller gets y (and h), not the 1/rms the backward keeps.
_rms_norm_eager = eager_autograd(_rms_norm_impl, _setup_rms_norm, _backward_rms_norm, returns=1)
_add_rms_norm_eager = eager_autograd(_add_rms_norm_impl, _setup_add_rms_norm, _backward_add_rms_norm, returns=2)


# ------------------------------------------------------------------------------------------- public API


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    cast_to: str = "weight",
):
    """Fused RMSNorm over the last dimension of `x` (any leading shape, any strides).

    Returns `y`, or `(y, x + residual)` when `residual` is given. `offset` adds a constant to the
    weight (1.0 for Gemma-style `(1 + w)` norms). `cast_to` is "weight" (seed/Paddle rounding) or
    "input" (Hugging Face Llama rounding); see the module docstring.
    """
    if is_dtensor(x):
        return _rms_norm_on_shards(x, weight, eps, offset=offset, residual=residual, cast_to=cast_to)
    op = "rms_norm"
    if cast_to not in ("weight", "input"):
        raise ValueError(f"{op}: cast_to must be 'weight' (seed/Paddle) or 'input' (Hugging Face), got {cast_to!r}")
    check_dtype(op, "x", x)
    check_dtype(op, "weight", weight)
    check_same_device(op, x, weight, residual, names=("x", "weight", "residual"))
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension (the hidden size), got a scalar")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{op}: weight has shape {tuple(weight.shape)} but x's hidden size (last dim) is {x.shape[-1]}; "
            f"the weight must be 1-D of size {x.shape[-1]}"
        )
    if residual is None:
        if torch.compiler.is_compiling():
            return _rms_norm_op(x, weight, float(eps), float(offset), cast_to == "input")[0]
        return _rms_norm_eager(x, weight, float(eps), float(offset), cast_to == "input")
    check_dtype(op, "residual", residual)
    if residual.shape != x.shape:
        raise ValueError(
            f"{op}: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; they must match"
        )
    if torch.compiler.is_compiling():
        return _add_rms_norm_op(x, residual, weight, float(eps), float(offset), cast_to == "input")[:2]
    return _add_rms_norm_eager(x, residual, weight, float(eps), float(offset), cast_to == "input")


def _rms_norm_on_shards(x, weight, eps, *, offset, residual, cast_to):
    """RMSNorm of a DTensor split on non-hidden dims (sequence parallel): the kernel runs on local
    shards. The weight's gradient from a shard covers only its rows: Partial over those mesh dims."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if any(p.is_partial() for p in x.placements):
        raise ValueError(
            f"rms_norm: a DTensor with placements {x.placements} is pending a reduction; redistribute it "
            "(to Shard or Replicate) before normalising"
        )
    if not is_dtensor(weight) or weight.device_mesh != x.device_mesh:
        raise ValueError(
            "rms_norm: a DTensor input needs its weight as a DTensor on the same mesh (Replicate), so that the "
            "weight gradient of each shard is reduced; distribute the weight (parallelize does)"
        )
    if any(p.is_shard(x.dim() - 1) or p.is_shard(-1) for p in x.placements):
        # The hidden dim itself is split (a norm over a tensor-parallel projection, OLMo2's q/k norms): each
        # row's mean of squares needs every rank's part. The unfused ops on DTensors reduce it (one
        # all-reduce of the statistic per call); the kernel's row statistics stay local by design.
        return rms_norm_reference(x, weight, eps, offset=offset, residual=residual, cast_to=cast_to)
    weight_grad_placements = [Partial() if p.is_shard() else Replicate() for p in x.placements]
    local_weight = weight.to_local(grad_placements=weight_grad_placements)
    if residual is not None:
        if not is_dtensor(residual):
            raise ValueError("rms_norm: with a DTensor input, the residual must be a DTensor too")
        residual = residual.redistribute(x.device_mesh, x.placements)
    local_residual = residual.to_local() if residual is not None else None
    with local_saved_tensors():
        out = rms_norm(x.to_local(), local_weight, eps, offset=offset, residual=local_residual, cast_to=cast_to)

    def wrap(local):
        return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())

    return (wrap(out[0]), wrap(out[1])) if residual is not None else wrap(out)


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm layer on the fused kernel; `forward(x, residual=None)` mirrors `rms_norm`."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        cast_to: str = "weight",
        device=None,
        dtype=None,
    ):
        super().__init__()
        init = 0.0 if offset else 1.0  # (offset + weight) starts at 1 either way
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), init, device=device, dtype=dtype))
        self.eps, self.offset, self.cast_to = eps, offset, cast_to

    @classmethod
    def from_parameter(cls, weight: torch.nn.Parameter, eps: float, *, offset: float = 0.0, cast_to: str = "weight"):
        """A layer around an existing weight (the same Parameter: optimizers holding it stay valid)."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.weight = weight
        layer.eps, layer.offset, layer.cast_to = eps, offset, cast_to
        return layer

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, offset=self.offset, residual=residual, cast_to=self.cast_to)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}, cast_to={self.cast_to!r}"
