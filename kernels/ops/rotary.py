"""Rotary position embedding of q and k in one launch: Triton kernel, launcher, torch.library op, layer.

    out = x * cos + rotate(x) * sin        on the first `rotary_dim` features; the rest pass through

Pairs (a, b) of features rotate together: (j, j + rotary_dim/2) for rotate-half (NeoX/Llama) pairing,
(2j, 2j + 1) for interleaved (GPT-J) pairing. DeepSeek's `apply_rotary_pos_emb_interleave` (`deinterleave`)
reads interleaved pairs and writes pair j's outputs to (j, j + rotary_dim/2): its projections' weights hold
the pairs interleaved, its attention takes them as halves. Written per pair, with c/s the table entries of
a or b:

    out_a = x_a * c_a - x_b * s_a          out_b = x_b * c_b + x_a * s_b

which is exactly the reference formula for any table, duplicated or not. The backward is the
transposed map (the inverse rotation when the table is duplicated, as rotary tables are):

    dx_a = g_a * c_a + g_b * s_b           dx_b = g_b * c_b - g_a * s_a

so one kernel serves both directions (CONJUGATE; with `deinterleave` the backward reads halves and writes
interleaved pairs). Tables are read in fp32 or their own dtype, gathered
by `position_ids` when given; q and k may have different head counts (grouped-query attention) and
any strides (views into a fused qkv projection need no copy).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import configs
from .._common import (Launch, as_dtensor_like, cdiv, check_dtype, check_same_device, eager_autograd, is_dtensor, keeps_whole,
                       local_saved_tensors, next_power_of_2, note_unfused, use_triton)
from ..reference import rotary_reference

LAYOUTS = ("bshd", "bhsd")
# Tiles of tokens x heads hold up to this many elements per half (a or b), e.g. 1 token x 32 heads x 64 pairs.
TARGET_TILE_ELEMENTS = 2048
# Tokens per program: enough work per program for short heads, one token when a token is already
# a large tile. The interpreter runs programs one by one, so it gets the packed setting too.
MAX_TOKENS_PER_PROGRAM = 16
# A tile of several tokens holds at most this many elements per half per thread (one 16-byte vector of bf16):
# past it a program loops over single-token tiles instead. sm_90's compile (`tests._gpu_codegen`, 4 warps) of a
# tile of 2 tokens x 16 heads x 64 pairs takes 128 registers and 8 barriers (the table rows converted into the
# heads' layout through shared memory), one of 1 token x 16 heads x 64 pairs 56 and none: at Qwen-style 16 heads
# x 128 an H100 ran the former at 79-80% of copy bandwidth (2026-11-26 and -27, compile 93-94%) and the
# one-token loop at 92% (2026-11-24). Tiles of 1 token x 32 and 64 heads (72 and 103 registers) reach 95-97%.
MULTI_TOKEN_ELEMENTS_PER_THREAD = 8


# ----------------------------------------------------------------------------------------------- kernel


@triton.jit
def _head_rows(ptr, b, s, h0, n_heads, stride_b, stride_s, stride_h, token_valid, BLOCK_H: tl.constexpr):
    """A tile's rows: the addresses of heads h0 .. h0 + BLOCK_H of a tile of tokens ([BLOCK_T, BLOCK_H, 1]), and
    which of them are heads of valid tokens. b, s and token_valid are [BLOCK_T] vectors."""
    heads = (h0 + tl.arange(0, BLOCK_H))[None, :, None]
    rows = (ptr + b * stride_b + s * stride_s)[:, None, None] + heads.to(tl.int64) * stride_h
    return rows, (heads < n_heads) & token_valid[:, None, None]


@triton.jit
def _rotate(x_a, x_b, c_a, c_b, s_a, s_b, CONJUGATE: tl.constexpr):
    if CONJUGATE:
        return x_a * c_a + x_b * s_b, x_b * c_b - x_a * s_a
    return x_a * c_a - x_b * s_a, x_b * c_b + x_a * s_b


@triton.jit
def _rotate_heads(
    x_ptr, y_ptr, b, s, n_heads,
    x_stride_b, x_stride_s, x_stride_h, x_stride_d,
    y_stride_b, y_stride_s, y_stride_h, y_stride_d,
    c_a, c_b, s_a, s_b, cols_a, cols_b, y_cols_a, y_cols_b, pair_mask, pass_cols, pass_mask, token_valid,
    CONJUGATE: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rotate all heads of a tile of tokens of x into y (pass-through features copied), BLOCK_H heads at a time:
    pairs read from x's cols_a / cols_b, written to y's y_cols_a / y_cols_b. The table rows c_a ... s_b are
    [BLOCK_T, 1, BLOCK_R], the columns [1, 1, BLOCK_R] (pass_cols, pass_mask: [1, 1, BLOCK_P])."""
    for h0 in range(0, n_heads, BLOCK_H):
        x_rows, valid = _head_rows(x_ptr, b, s, h0, n_heads, x_stride_b, x_stride_s, x_stride_h, token_valid, BLOCK_H)
        y_rows, _ = _head_rows(y_ptr, b, s, h0, n_heads, y_stride_b, y_stride_s, y_stride_h, token_valid, BLOCK_H)
        mask = valid & pair_mask
        x_a = tl.load(x_rows + cols_a * x_stride_d, mask=mask, other=0.0).to(tl.float32)
        x_b = tl.load(x_rows + cols_b * x_stride_d, mask=mask, other=0.0).to(tl.float32)
        out_a, out_b = _rotate(x_a, x_b, c_a, c_b, s_a, s_b, CONJUGATE)
        tl.store(y_rows + y_cols_a * y_stride_d, out_a.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_rows + y_cols_b * y_stride_d, out_b.to(y_ptr.dtype.element_ty), mask=mask)
        if HAS_PASS:
            passed = tl.load(x_rows + pass_cols * x_stride_d, mask=valid & pass_mask, other=0.0)
            tl.store(y_rows + pass_cols * y_stride_d, passed, mask=valid & pass_mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr,
    n_tokens, seq_len, n_q_heads, n_k_heads, half_rotary, n_pass,
    q_stride_b, q_stride_s, q_stride_h, q_stride_d,
    k_stride_b, k_stride_s, k_stride_h, k_stride_d,
    qo_stride_b, qo_stride_s, qo_stride_h, qo_stride_d,
    ko_stride_b, ko_stride_s, ko_stride_h, ko_stride_d,
    table_stride_b, table_stride_t, table_stride_d,
    pos_stride_b, pos_stride_s,
    HAS_POSITIONS: tl.constexpr, X_INTERLEAVED: tl.constexpr, Y_INTERLEAVED: tl.constexpr,
    HALF_TABLE: tl.constexpr, CONJUGATE: tl.constexpr, HAS_PASS: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, ONE_HEAD_TILE: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    pairs = tl.arange(0, BLOCK_R).to(tl.int64)  # large feature strides must not overflow int32
    pair_mask = pairs < half_rotary
    # Where pair j's a and b features lie: in x (read), in y (written) and in a full-width table, which is
    # interleaved whenever one side is (rotate-half and interleaved pairing as written; `deinterleave` reads
    # interleaved pairs forward and writes them backward).
    interleaved_a, interleaved_b = 2 * pairs, 2 * pairs + 1
    halves_a, halves_b = pairs, pairs + half_rotary
    if X_INTERLEAVED:
        cols_a, cols_b = interleaved_a, interleaved_b
    else:
        cols_a, cols_b = halves_a, halves_b
    if Y_INTERLEAVED:
        y_cols_a, y_cols_b = interleaved_a, interleaved_b
    else:
        y_cols_a, y_cols_b = halves_a, halves_b
    if HALF_TABLE:  # one table entry per pair
        table_a, table_b = pairs, pairs
    elif X_INTERLEAVED or Y_INTERLEAVED:
        table_a, table_b = interleaved_a, interleaved_b
    else:
        table_a, table_b = halves_a, halves_b
    pass_cols = (2 * half_rotary + tl.arange(0, BLOCK_P).to(tl.int64))[None, None, :]
    pass_mask = (tl.arange(0, BLOCK_P) < n_pass)[None, None, :]
    # Tiles are [BLOCK_T tokens, BLOCK_H heads, BLOCK_R pairs]: the columns broadcast over tokens and heads.
    cols_a, cols_b = cols_a[None, None, :], cols_b[None, None, :]
    y_cols_a, y_cols_b = y_cols_a[None, None, :], y_cols_b[None, None, :]
    pair_mask3 = pair_mask[None, None, :]

    # BLOCK_T tokens at a time (it divides TOKENS_PER_PROGRAM): short heads fill a tile with several tokens.
    for t0 in range(0, TOKENS_PER_PROGRAM, BLOCK_T):
        token = tl.program_id(0) * TOKENS_PER_PROGRAM + t0 + tl.arange(0, BLOCK_T)
        token_valid = token < n_tokens
        token = tl.minimum(token, n_tokens - 1).to(tl.int64)  # keep addresses in bounds when masked
        b = token // seq_len
        s = token % seq_len
        if HAS_POSITIONS:
            row = tl.load(pos_ptr + b * pos_stride_b + s * pos_stride_s).to(tl.int64)
        else:
            row = s
        table_row = (b * table_stride_b + row * table_stride_t)[:, None]
        table_mask = pair_mask[None, :]
        c_a = tl.load(cos_ptr + table_row + table_a[None, :] * table_stride_d, mask=table_mask, other=0.0).to(tl.float32)
        c_b = tl.load(cos_ptr + table_row + table_b[None, :] * table_stride_d, mask=table_mask, other=0.0).to(tl.float32)
        s_a = tl.load(sin_ptr + table_row + table_a[None, :] * table_stride_d, mask=table_mask, other=0.0).to(tl.float32)
        s_b = tl.load(sin_ptr + table_row + table_b[None, :] * table_stride_d, mask=table_mask, other=0.0).to(tl.float32)
        c_a, c_b, s_a, s_b = c_a[:, None, :], c_b[:, None, :], s_a[:, None, :], s_b[:, None, :]
        if ONE_HEAD_TILE:
            # Every head of q in one tile, k's in one of BLOCK_HK heads (its own count: grouped-query attention's
            # fewer heads take no masked lanes' registers): all of the tokens' loads are issued before the first
            # store. A load after a store cannot move above it (the compiler cannot rule out that they alias), and
            # rotating q and then k (the loop below) takes two round trips to memory per token.
            q_rows, q_valid = _head_rows(q_ptr, b, s, 0, n_q_heads, q_stride_b, q_stride_s, q_stride_h, token_valid, BLOCK_H)
            k_rows, k_valid = _head_rows(k_ptr, b, s, 0, n_k_heads, k_stride_b, k_stride_s, k_stride_h, token_valid, BLOCK_HK)
            q_mask, k_mask = q_valid & pair_mask3, k_valid & pair_mask3
            q_a = tl.load(q_rows + cols_a * q_stride_d, mask=q_mask, other=0.0).to(tl.float32)
            q_b = tl.load(q_rows + cols_b * q_stride_d, mask=q_mask, other=0.0).to(tl.float32)
            k_a = tl.load(k_rows + cols_a * k_stride_d, mask=k_mask, other=0.0).to(tl.float32)
            k_b = tl.load(k_rows + cols_b * k_stride_d, mask=k_mask, other=0.0).to(tl.float32)
            if HAS_PASS:
                q_pass = tl.load(q_rows + pass_cols * q_stride_d, mask=q_valid & pass_mask, other=0.0)
                k_pass = tl.load(k_rows + pass_cols * k_stride_d, mask=k_valid & pass_mask, other=0.0)
            qo_rows, _ = _head_rows(q_out_ptr, b, s, 0, n_q_heads, qo_stride_b, qo_stride_s, qo_stride_h, token_valid, BLOCK_H)
            ko_rows, _ = _head_rows(k_out_ptr, b, s, 0, n_k_heads, ko_stride_b, ko_stride_s, ko_stride_h, token_valid, BLOCK_HK)
            out_a, out_b = _rotate(q_a, q_b, c_a, c_b, s_a, s_b, CONJUGATE)
            tl.store(qo_rows + y_cols_a * qo_stride_d, out_a.to(q_out_ptr.dtype.element_ty), mask=q_mask)
            tl.store(qo_rows + y_cols_b * qo_stride_d, out_b.to(q_out_ptr.dtype.element_ty), mask=q_mask)
            out_a, out_b = _rotate(k_a, k_b, c_a, c_b, s_a, s_b, CONJUGATE)
            tl.store(ko_rows + y_cols_a * ko_stride_d, out_a.to(k_out_ptr.dtype.element_ty), mask=k_mask)
            tl.store(ko_rows + y_cols_b * ko_stride_d, out_b.to(k_out_ptr.dtype.element_ty), mask=k_mask)
            if HAS_PASS:
                tl.store(qo_rows + pass_cols * qo_stride_d, q_pass, mask=q_valid & pass_mask)
                tl.store(ko_rows + pass_cols * ko_stride_d, k_pass, mask=k_valid & pass_mask)
        else:
            _rotate_heads(
                q_ptr, q_out_ptr, b, s, n_q_heads,
                q_stride_b, q_stride_s, q_stride_h, q_stride_d,
                qo_stride_b, qo_stride_s, qo_stride_h, qo_stride_d,
                c_a, c_b, s_a, s_b, cols_a, cols_b, y_cols_a, y_cols_b, pair_mask3, pass_cols, pass_mask, token_valid,
                CONJUGATE, HAS_PASS, BLOCK_H,
            )
            _rotate_heads(
                k_ptr, k_out_ptr, b, s, n_k_heads,
                k_stride_b, k_stride_s, k_stride_h, k_stride_d,
                ko_stride_b, ko_stride_s, ko_stride_h, ko_stride_d,
                c_a, c_b, s_a, s_b, cols_a, cols_b, y_cols_a, y_cols_b, pair_mask3, pass_cols, pass_mask, token_valid,
                CONJUGATE, HAS_PASS, BLOCK_H,
            )


# ------------------------------------------------------------------------------------ input normalising


def _as_bshd(t: torch.Tensor, layout_bhsd: bool) -> torch.Tensor:
    return t.transpose(1, 2) if layout_bhsd else t


def _table_view(table: torch.Tensor, layout_bhsd: bool) -> torch.Tensor:
    """A [Bt, T, Dt] view of a cos/sin table given as [Bt, T, 1, Dt] / [Bt, 1, T, Dt], [Bt, T, Dt] or [T, Dt]."""
    if table.dim() == 4:
        return table.squeeze(1 if layout_bhsd else 2)
    if table.dim() == 3:
        return table
    return table.unsqueeze(0)


def _positions_view(position_ids: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    return position_ids.reshape(-1, position_ids.shape[-1]).expand(batch, seq_len)


def _bshd(sizes_or_strides, layout_bhsd: bool) -> tuple:
    """A tensor's 4 sizes or strides in bshd order (batch, seq, heads, head_dim): the launcher reads them so
    instead of making transposed views (each ~1 us of host time)."""
    a, b, c, d = sizes_or_strides
    return (a, c, b, d) if layout_bhsd else (a, b, c, d)


# ------------------------------------------------------------------------------- launch configurations

# One kernel serves both directions, but CONJUGATE compiles a different binary: each has its entries.
TUNABLES = {
    kind: configs.Tunable(f"rotary_{kind}", frozenset({"BLOCK_H", "TOKENS_PER_PROGRAM", "num_warps"}),
                          (_rotary_kernel, _rotate_heads, _head_rows, _rotate))
    for kind in ("fwd", "bwd")
}


@functools.lru_cache(maxsize=4096)  # pure, and asked on every launch
def tuning_key(n_tokens: int, head_dim: int, q_heads: int, k_heads: int, dtype: torch.dtype) -> str:
    """The tuned table's bucket: exact head_dim, heads to the next power of two, the GQA ratio, tokens."""
    return configs.config_key(head_dim=head_dim, heads=configs.width_bucket(max(q_heads, k_heads)),
                              gqa=max(1, q_heads // max(1, k_heads)), rows=configs.rows_bucket(n_tokens), dtype=dtype)


def heuristic_config(half_rotary: int, max_heads: int) -> dict:
    """BLOCK_H (heads per tile), TOKENS_PER_PROGRAM and num_warps without a table.

    All heads of a token in one tile up to TARGET_TILE_ELEMENTS per half; tokens packed until a
    program handles about that many pairs; 4 warps (the tile is small and latency-bound).
    """
    block_r = next_power_of_2(half_rotary)
    block_h = min(next_power_of_2(max_heads), max(1, TARGET_TILE_ELEMENTS // block_r))
    per_token = max_heads * block_r
    tokens = max(1, min(MAX_TOKENS_PER_PROGRAM, TARGET_TILE_ELEMENTS // per_token))
    return {"BLOCK_H": block_h, "TOKENS_PER_PROGRAM": tokens, "num_warps": 4}


def tokens_per_tile(tokens_per_program: int, block_h: int, block_r: int, block_p: int = 1, num_warps: int = 4) -> int:
    """BLOCK_T: the tokens one tile holds, the largest power of two dividing TOKENS_PER_PROGRAM whose tiles of
    BLOCK_T x BLOCK_H x BLOCK_R (a half of the rotated features) and BLOCK_T x BLOCK_H x BLOCK_P (the
    pass-through features) stay within TARGET_TILE_ELEMENTS and MULTI_TOKEN_ELEMENTS_PER_THREAD per thread of
    num_warps warps (1 once a token's heads fill that, as at 16 heads x 64 pairs on 4 warps). Short heads (few
    heads, small head_dim) then rotate several tokens per instruction instead of looping over them; the Triton
    interpreter, which pays per operation, too."""
    widest = block_h * max(block_r, block_p)
    limit = min(TARGET_TILE_ELEMENTS, MULTI_TOKEN_ELEMENTS_PER_THREAD * 32 * num_warps)
    block_t = 1
    while tokens_per_program % (2 * block_t) == 0 and 2 * block_t * widest <= limit:
        block_t *= 2
    return block_t


def search_space(half_rotary: int, max_heads: int) -> dict[str, list[int]]:
    """What the sweep may try: any heads-per-tile up to all heads, 1-32 tokens per program, 1-16 warps."""
    return {
        "BLOCK_H": [1 << i for i in range(next_power_of_2(max_heads).bit_length())],
        "TOKENS_PER_PROGRAM": [1, 2, 4, 8, 16, 32],
        "num_warps": [1, 2, 4, 8, 16],
    }


_cached_heuristic_config = functools.lru_cache(maxsize=4096)(heuristic_config)  # launches share its dicts: read-only


def launch_config(kind: str, n_tokens: int, head_dim: int, half_rotary: int, q_heads: int, k_heads: int,
                  dtype: torch.dtype, device: torch.device) -> dict:
    """The tuned table's entry for this launch's bucket when there is one, else `heuristic_config`."""
    tuned = configs.tuned_config(TUNABLES[kind], device, tuning_key(n_tokens, head_dim, q_heads, k_heads, dtype))
    return tuned if tuned is not None else _cached_heuristic_config(half_rotary, max(q_heads, k_heads))


# ------------------------------------------------------------------------------------------- launchers


def _table_geometry(shape: tuple, strides: tuple, layout_bhsd: bool) -> tuple[tuple, tuple]:
    """The sizes and strides of `_table_view(table)` ([Bt, T, Dt]), read off the table's own without making the
    view; a dim of size 1 gets stride 0 (it never moves the address, and tables equal in every other stride
    share one set: torch's `.contiguous()` keeps any stride on such a dim)."""
    if len(shape) == 4:
        kept = (0, 2, 3) if layout_bhsd else (0, 1, 3)
        shape, strides = tuple(shape[i] for i in kept), tuple(strides[i] for i in kept)
    elif len(shape) == 2:
        shape, strides = (1, *shape), (0, *strides)
    return tuple(shape), tuple(stride if size > 1 else 0 for size, stride in zip(shape, strides))


@configs.launch_plan
def _plan(q_shape, q_strides, k_shape, k_strides, q_out_strides, k_out_strides, table_shape, cos_strides, sin_strides,
          pos_shape, pos_strides, dtype, device, layout_bhsd, interleaved, deinterleave, rotary_dim, conjugate,
          config=None) -> Launch | None | bool:
    """The launch rotating q and k (`pos_*` None without position_ids) with tables and tensors of these shapes
    and strides; False when cos and sin differ in strides (copy them first), None when there are no tokens."""
    batch, seq_len, q_heads, head_dim = _bshd(q_shape, layout_bhsd)
    k_heads = _bshd(k_shape, layout_bhsd)[2]
    (_, table_len, table_dim), table_strides = _table_geometry(table_shape, cos_strides, layout_bhsd)
    if table_strides != _table_geometry(table_shape, sin_strides, layout_bhsd)[1]:
        return False  # one set of table strides serves both (rare: tables built apart)
    if pos_shape is None:
        _check_positions_in_table(None, table_len=table_len, seq_len=seq_len)
    n_tokens = batch * seq_len
    if n_tokens == 0:
        return None
    n_pass = head_dim - rotary_dim
    block_r, block_p = next_power_of_2(rotary_dim // 2), max(1, next_power_of_2(n_pass))
    cfg = config or launch_config("bwd" if conjugate else "fwd", n_tokens, head_dim, rotary_dim // 2,
                                  q_heads, k_heads, dtype, device)
    strides = {}
    for prefix, tensor_strides in (("q", q_strides), ("k", k_strides), ("qo", q_out_strides), ("ko", k_out_strides)):
        strides.update(zip((f"{prefix}_stride_{d}" for d in "bshd"), _bshd(tensor_strides, layout_bhsd)))
    return Launch((cdiv(n_tokens, cfg["TOKENS_PER_PROGRAM"]),), dict(
        n_tokens=n_tokens, seq_len=seq_len, n_q_heads=q_heads, n_k_heads=k_heads, half_rotary=rotary_dim // 2,
        n_pass=n_pass, **strides,
        # A table without a batch dimension (or with batch 1: stride 0) is shared by every sequence.
        table_stride_b=table_strides[0], table_stride_t=table_strides[1],
        table_stride_d=table_strides[2],
        # position_ids [S], [1, S] or [B, S] read as [B, S] (`_positions_view`: a batch of one is broadcast).
        pos_stride_b=pos_strides[0] if pos_shape is not None and len(pos_shape) == 2 and pos_shape[0] > 1 else 0,
        pos_stride_s=pos_strides[-1] if pos_shape is not None else 0,
        # Deinterleaving reads interleaved pairs and writes halves; its backward (CONJUGATE) the other way round.
        HAS_POSITIONS=pos_shape is not None, X_INTERLEAVED=interleaved and not (deinterleave and conjugate),
        Y_INTERLEAVED=interleaved and not (deinterleave and not conjugate), HALF_TABLE=table_dim * 2 == rotary_dim,
        CONJUGATE=conjugate, HAS_PASS=n_pass > 0,
        TOKENS_PER_PROGRAM=cfg["TOKENS_PER_PROGRAM"], BLOCK_H=cfg["BLOCK_H"],
        BLOCK_T=tokens_per_tile(cfg["TOKENS_PER_PROGRAM"], cfg["BLOCK_H"], block_r, block_p, cfg["num_warps"]),
        BLOCK_R=block_r, BLOCK_P=block_p, ONE_HEAD_TILE=cfg["BLOCK_H"] >= max(q_heads, k_heads),
        BLOCK_HK=min(cfg["BLOCK_H"], next_power_of_2(k_heads)),
        num_warps=cfg["num_warps"],
    ))


def _rotary(q, k, cos, sin, position_ids, layout_bhsd, interleaved, deinterleave, rotary_dim, conjugate, config=None):
    """Rotated q and k (the inverse rotation with `conjugate`); `config` overrides the launch
    configuration (the kernel sweep times candidates this way)."""
    if not use_triton(q):
        batch, seq_len = _bshd(q.shape, layout_bhsd)[:2]
        cos3, sin3 = _table_view(cos, layout_bhsd), _table_view(sin, layout_bhsd)
        positions = _positions_view(position_ids, batch, seq_len) if position_ids is not None else None
        _check_positions_in_table(positions, table_len=cos3.shape[1], seq_len=seq_len)
        return _rotary_torch(q, k, cos3, sin3, positions, layout_bhsd, interleaved, deinterleave, rotary_dim,
                             cos3.shape[-1] * 2 == rotary_dim, conjugate)
    if position_ids is not None:
        table_len = _table_geometry(cos.shape, cos.stride(), layout_bhsd)[0][1]
        _check_positions_in_table(position_ids, table_len=table_len, seq_len=_bshd(q.shape, layout_bhsd)[1])
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    launch = (_plan if config is None else _plan.__wrapped__)(
        q.shape, q.stride(), k.shape, k.stride(), q_out.stride(), k_out.stride(), cos.shape, cos.stride(),
        sin.stride(), None if position_ids is None else position_ids.shape,
        None if position_ids is None else position_ids.stride(), q.dtype, q.device, layout_bhsd, interleaved,
        deinterleave, rotary_dim, conjugate, config)
    if launch is False:
        return _rotary(q, k, cos.contiguous(), sin.contiguous(), position_ids, layout_bhsd, interleaved, deinterleave,
                       rotary_dim, conjugate, config)
    if launch is not None:  # the kernel addresses the tables and positions in [B, T, D] and [B, S] order
        launch.launch(_rotary_kernel, q, k, q_out, k_out, cos, sin, cos if position_ids is None else position_ids)
    return q_out, k_out


def _check_positions_in_table(positions, *, table_len: int, seq_len: int) -> None:
    if positions is None:
        if seq_len > table_len:
            raise ValueError(
                f"apply_rotary_pos_emb: cos/sin have {table_len} positions but the sequence has {seq_len}; "
                f"build the tables for at least {seq_len} positions (max_position_embeddings)"
            )
        return
    if positions.numel() == 0:
        return
    message = f"apply_rotary_pos_emb: position_ids must lie in [0, {table_len}) (the cos/sin table length)"
    if positions.device.type == "cpu":
        low, high = positions.min().item(), positions.max().item()
        if low < 0 or high >= table_len:
            raise ValueError(f"{message}; got positions from {low} to {high}: build longer tables")
    else:
        # No host sync on an accelerator: the check runs on the device, in stream order.
        torch._assert_async((positions.min() >= 0) & (positions.max() < table_len), message)


def _rotary_torch(q, k, cos3, sin3, positions, layout_bhsd, interleaved, deinterleave, rotary_dim, half_table,
                  conjugate):
    """The same math in plain PyTorch, for CPU tensors outside the interpreter."""
    batch, seq_len = _as_bshd(q, layout_bhsd).shape[:2]
    if positions is not None:
        batch_index = torch.arange(batch, device=cos3.device)[:, None] if cos3.shape[0] > 1 else 0
        cos_rows, sin_rows = cos3[batch_index, positions], sin3[batch_index, positions]
    else:
        cos_rows, sin_rows = cos3[:, :seq_len], sin3[:, :seq_len]
    cos_rows, sin_rows = cos_rows.float().unsqueeze(2), sin_rows.float().unsqueeze(2)  # [B|1, S, 1, Dt]

    def pair_halves(t):
        if half_table:
            return t, t
        return (t[..., 0::2], t[..., 1::2]) if interleaved else t.chunk(2, dim=-1)

    c_a, c_b = pair_halves(cos_rows)
    s_a, s_b = pair_halves(sin_rows)

    # Deinterleaving reads interleaved pairs and writes halves; its backward (conjugate) the other way round.
    x_interleaved = interleaved and not (deinterleave and conjugate)
    y_interleaved = interleaved and not (deinterleave and not conjugate)

    def apply(x):
        x4 = _as_bshd(x, layout_bhsd)
        rot, passed = x4[..., :rotary_dim].float(), x4[..., rotary_dim:]
        x_a, x_b = (rot[..., 0::2], rot[..., 1::2]) if x_interleaved else rot.chunk(2, dim=-1)
        if conjugate:
            out_a, out_b = x_a * c_a + x_b * s_b, x_b * c_b - x_a * s_a
        else:
            out_a, out_b = x_a * c_a - x_b * s_a, x_b * c_b + x_a * s_b
        out = torch.stack([out_a, out_b], dim=-1).flatten(-2) if y_interleaved else torch.cat([out_a, out_b], -1)
        out = torch.cat([out.to(x.dtype), passed], dim=-1)
        # Same strides as the Triton path and the fake implementation (empty_like of the input).
        return torch.empty_like(x).copy_(_as_bshd(out, layout_bhsd))

    return apply(q), apply(k)


# ------------------------------------------------------------------------------ torch.library operator


def _rotary_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    layout_bhsd: bool,
    interleaved: bool,
    deinterleave: bool,
    rotary_dim: int,
    conjugate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotary(q, k, cos, sin, position_ids, layout_bhsd, interleaved, deinterleave, rotary_dim, conjugate)


_rotary_op = torch.library.custom_op("tridist::rotary", mutates_args=())(_rotary_impl)


@_rotary_op.register_fake
def _(q, k, cos, sin, position_ids, layout_bhsd, interleaved, deinterleave, rotary_dim, conjugate):
    return torch.empty_like(q), torch.empty_like(k)


def _setup_rotary(ctx, inputs, output):
    _, _, cos, sin, position_ids, layout_bhsd, interleaved, deinterleave, rotary_dim, _ = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.options = (layout_bhsd, interleaved, deinterleave, rotary_dim)


def _backward_rotary(ctx, grad_q, grad_k):
    cos, sin, position_ids = ctx.saved_tensors
    rotate = _rotary_impl if getattr(ctx, "eager", False) else _rotary_op
    dq, dk = rotate(grad_q, grad_k, cos, sin, position_ids, *ctx.options, True)
    return dq, dk, None, None, None, None, None, None, None, None


torch.library.register_autograd("tridist::rotary", _backward_rotary, setup_context=_setup_rotary)
_rotary_eager = eager_autograd(_rotary_impl, _setup_rotary, _backward_rotary)


# ------------------------------------------------------------------------------------------- public API


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    layout: str = "bshd",
    interleaved: bool = False,
    deinterleave: bool = False,
    rotary_dim: int | None = None,
):
    """Rotate q and k by position in one launch; returns `(q_embed, k_embed)`.

    q: [batch, seq, heads, head_dim] ("bshd", the seed model) or [batch, heads, seq, head_dim] ("bhsd",
    Hugging Face); k the same with possibly fewer heads (GQA). cos/sin: [1 or B, T, 1, D] (bshd) or
    [1 or B, 1, T, D] (bhsd), [B, T, D] or [T, D]; without position_ids, row s of the table is position s
    (T >= seq); with position_ids ([B, S], [1, S] or [S]) row position_ids[b, s] is gathered.
    D is rotary_dim (duplicated tables, as Llama builds them; the default rotary_dim is D) or
    rotary_dim / 2 (one entry per pair, flash-attention style). Features past rotary_dim pass through.
    Pairs are (j, j + rotary_dim / 2) (rotate-half, Llama's), or with `interleaved` (2j, 2j + 1) (GPT-J's, a
    full-width table repeat_interleave'd); `deinterleave` (with `interleaved`) writes pair j's outputs to
    (j, j + rotary_dim / 2), as DeepSeek-V3's `apply_rotary_pos_emb_interleave` does.
    """
    if deinterleave and not interleaved:
        raise ValueError("apply_rotary_pos_emb: deinterleave=True writes interleaved pairs as halves; it needs "
                         "interleaved=True (pairs read from (2j, 2j + 1))")
    if any(is_dtensor(t) for t in (q, k, cos, sin, position_ids)):
        return _rotary_on_shards(q, k, cos, sin, position_ids, layout=layout, interleaved=interleaved,
                                 deinterleave=deinterleave, rotary_dim=rotary_dim)
    rotary_dim = _validate(q, k, cos, sin, position_ids, layout=layout, rotary_dim=rotary_dim)
    op = _rotary_op if torch.compiler.is_compiling() else _rotary_eager
    return op(q, k, cos, sin, position_ids, layout == "bhsd", interleaved, deinterleave, rotary_dim, False)


def _rotary_on_shards(q, k, cos, sin, position_ids, *, layout, interleaved, deinterleave, rotary_dim):
    """Rotary of DTensors (a block in tensor parallel's global view): the kernel runs on each rank's heads
    when q and k are split on their heads dim only (the sequence and head_dim whole, as the tables index
    them) and the tables and positions are replicated; else the unfused ops run on the DTensors."""
    seq_dim = 2 if layout == "bhsd" else 1
    tables = [t for t in (cos, sin, position_ids) if t is not None]
    on_heads = (is_dtensor(q) and is_dtensor(k) and keeps_whole(q, (0, seq_dim, 3)) and keeps_whole(k, (0, seq_dim, 3))
                and all(not is_dtensor(t) or all(p.is_replicate() for p in t.placements) for t in tables))
    if not on_heads:
        placements = [getattr(t, "placements", "plain") for t in (q, k, cos, sin)]
        note_unfused("apply_rotary_pos_emb", f"q, k, cos, sin placed {placements}")
        return rotary_reference(q, k, cos, sin, position_ids, layout=layout, interleaved=interleaved,
                                deinterleave=deinterleave, rotary_dim=rotary_dim)
    local = [t.to_local() if is_dtensor(t) else t for t in (cos, sin, position_ids)]
    with local_saved_tensors():
        q_out, k_out = apply_rotary_pos_emb(q.to_local(), k.to_local(), *local, layout=layout, interleaved=interleaved,
                                            deinterleave=deinterleave, rotary_dim=rotary_dim)
    return as_dtensor_like(q_out, q), as_dtensor_like(k_out, k)


def _validate(q, k, cos, sin, position_ids, *, layout: str, rotary_dim: int | None) -> int:
    """Raise a ValueError/TypeError naming the problem; return the effective rotary_dim. What depends on shapes
    alone is checked once per signature (`_validate_shapes`)."""
    op = "apply_rotary_pos_emb"
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_dtype(op, name, t)
    check_same_device(op, q, k, cos, sin, position_ids, names=("q", "k", "cos", "sin", "position_ids"))
    if q.dtype != k.dtype:
        raise TypeError(f"{op}: q and k must have one dtype, got {q.dtype} and {k.dtype}")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(f"{op}: gradients through cos/sin are not computed; pass cos.detach(), sin.detach()")
    # Under torch.compile the checks run uncached: Dynamo traces the function itself (it warns at an lru_cache).
    validate = _validate_shapes.__wrapped__ if torch.compiler.is_compiling() else _validate_shapes
    if position_ids is None:
        return validate(q.shape, k.shape, cos.shape, sin.shape, None, None, layout, rotary_dim)
    return validate(q.shape, k.shape, cos.shape, sin.shape, position_ids.shape, position_ids.dtype, layout, rotary_dim)


@functools.lru_cache(maxsize=4096)
def _validate_shapes(q_shape, k_shape, table_shape, sin_shape, pos_shape, pos_dtype, layout: str,
                     rotary_dim: int | None) -> int:
    """`_validate`'s checks of shapes, layout and rotary_dim (a pure function of them: an answer is cached, an
    error raised again at every call); the effective rotary_dim."""
    op = "apply_rotary_pos_emb"
    layout_bhsd = layout == "bhsd"
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise ValueError(f"{op}: q and k must be 4-D ({layout}), got shapes {tuple(q_shape)} and {tuple(k_shape)}")
    q4, k4 = _bshd(q_shape, layout_bhsd), _bshd(k_shape, layout_bhsd)
    if q4[0] != k4[0] or q4[1] != k4[1] or q4[3] != k4[3]:
        raise ValueError(
            f"{op}: q {tuple(q_shape)} and k {tuple(k_shape)} must agree on batch, sequence and head_dim "
            f"in layout {layout!r} (only the head count may differ)"
        )
    batch, seq_len, _, head_dim = q4
    if table_shape != sin_shape:
        raise ValueError(f"{op}: cos {tuple(table_shape)} and sin {tuple(sin_shape)} must have the same shape")
    _check_table_shape(op, table_shape, layout, batch)
    table_dim = table_shape[-1]
    rotary_dim = table_dim if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or rotary_dim <= 0 or rotary_dim > head_dim:
        what = "head_dim" if rotary_dim == head_dim else "rotary_dim"
        raise ValueError(f"{op}: {what} = {rotary_dim} must be even, positive and <= head_dim ({head_dim})")
    if table_dim not in (rotary_dim, rotary_dim // 2):
        raise ValueError(
            f"{op}: cos/sin last dim is {table_dim}; expected rotary_dim ({rotary_dim}) or rotary_dim / 2 "
            f"({rotary_dim // 2}, one entry per pair)"
        )
    if pos_shape is not None:
        _check_position_ids(op, pos_shape, pos_dtype, batch, seq_len)
    return rotary_dim


def _check_table_shape(op: str, shape: tuple, layout: str, batch: int) -> None:
    shape = tuple(shape)
    if len(shape) == 4:
        head_axis = 1 if layout == "bhsd" else 2
        if shape[head_axis] != 1 or shape[0] not in (1, batch):
            expected = "[1 or B, 1, T, D]" if layout == "bhsd" else "[1 or B, T, 1, D]"
            raise ValueError(f"{op}: 4-D cos/sin must be {expected} for layout {layout!r}, got {shape}")
    elif len(shape) == 3:
        if shape[0] not in (1, batch):
            raise ValueError(f"{op}: 3-D cos/sin must be [B, T, D] with B = 1 or {batch}, got {shape}")
    elif len(shape) != 2:
        raise ValueError(f"{op}: cos/sin must be [T, D], [B, T, D] or 4-D with a size-1 head dim, got {shape}")


def _check_position_ids(op: str, shape: tuple, dtype: torch.dtype, batch: int, seq_len: int) -> None:
    if dtype.is_floating_point or dtype == torch.bool:
        raise TypeError(f"{op}: position_ids must be an integer tensor, got {dtype}")
    shape = tuple(shape)
    ok = shape in ((seq_len,), (1, seq_len), (batch, seq_len))
    if not ok:
        raise ValueError(f"{op}: position_ids must be [{batch}, {seq_len}], [1, {seq_len}] or [{seq_len}], got {shape}")


class FusedRotaryEmbedding(torch.nn.Module):
    """Llama rotary embedding that owns its frequencies and applies them with the fused kernel.

    `forward(q, k, position_ids=None)` returns the rotated `(q, k)`. Without position_ids, rows of a
    cached fp32 table (one entry per pair) are used and the table grows with the sequence. With
    position_ids, cos/sin are computed for exactly those positions, as Hugging Face does: any position
    works (decoding past the cache included) and nothing syncs with the device. Frequencies and
    tables stay fp32 whatever dtype the model is cast to.
    """

    def __init__(
        self,
        dim: int,
        max_position_embeddings: int = 2048,
        base: float = 10000.0,
        *,
        layout: str = "bshd",
        interleaved: bool = False,
        device=None,
    ):
        super().__init__()
        if dim % 2:
            raise ValueError(f"FusedRotaryEmbedding: dim (the rotary part of head_dim) must be even, got {dim}")
        if layout not in LAYOUTS:
            raise ValueError(f"FusedRotaryEmbedding: layout must be one of {LAYOUTS}, got {layout!r}")
        self.dim, self.base, self.layout, self.interleaved = dim, base, layout, interleaved
        self._build_tables(max_position_embeddings, device=device)

    def _inv_freq(self, device) -> torch.Tensor:
        # Recomputed in fp32 rather than kept as a buffer: module.to(bfloat16) would round a buffer.
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim))

    def _build_tables(self, length: int, *, device=None) -> None:
        t = torch.arange(length, dtype=torch.float32, device=device)
        freqs = torch.outer(t, self._inv_freq(device))  # one entry per pair: no duplicated table needed
        self.register_buffer("cos_cached", freqs.cos(), persistent=False)
        self.register_buffer("sin_cached", freqs.sin(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor | None = None):
        options = {"layout": self.layout, "interleaved": self.interleaved, "rotary_dim": self.dim}
        if position_ids is not None:
            freqs = position_ids.to(torch.float32)[..., None] * self._inv_freq(q.device)
            freqs = freqs.reshape(-1, *freqs.shape[-2:])  # [B or 1, S, dim / 2]
            return apply_rotary_pos_emb(q, k, freqs.cos(), freqs.sin(), **options)
        seq_len = q.shape[2] if self.layout == "bhsd" else q.shape[1]
        if seq_len > self.cos_cached.shape[0] or self.cos_cached.dtype != torch.float32:
            self._build_tables(max(seq_len, self.cos_cached.shape[0]), device=self.cos_cached.device)
        return apply_rotary_pos_emb(q, k, self.cos_cached, self.sin_cached, **options)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, layout={self.layout!r}, interleaved={self.interleaved}"
