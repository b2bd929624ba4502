"""Plain PyTorch versions of the fused ops: the math the kernels must reproduce.

These are written the way model code writes them (the seed model, Hugging Face Llama), with autograd
doing the backward. They are the eager baseline of the benchmarks and the reference of the tests;
nothing here is fast or fused on purpose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    cast_to: str = "weight",
):
    """RMSNorm as the seed model (cast_to="weight") or Hugging Face Llama (cast_to="input") writes it."""
    if residual is not None:
        x = x + residual
    hidden = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 statistics (fp64 stays fp64)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    if cast_to == "weight":
        # Seed/Paddle: round to the weight's dtype only when the weight is half precision.
        if weight.dtype in _HALF_DTYPES:
            hidden = hidden.to(weight.dtype)
    elif cast_to == "input":
        # Hugging Face Llama: round back to the input's dtype.
        hidden = hidden.to(x.dtype)
    else:
        raise ValueError(f"cast_to must be 'weight' or 'input', got {cast_to!r}")
    scale = weight + offset if offset else weight
    y = hidden * scale
    return (y, x) if residual is not None else y


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """GPT-J pairing: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    pairs = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1)
    return pairs.flatten(-2)


def _expand_half_table(table: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """A half-width cos/sin table ([..., rotary_dim / 2], flash-attention style) as a full-width one."""
    if interleaved:
        return table.repeat_interleave(2, dim=-1)
    return torch.cat([table, table], dim=-1)


def rotary_reference(
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
    """`x * cos + rotate(x) * sin` on the first `rotary_dim` features of q and k; the rest pass through.

    Accepts the same table shapes as the fused op: [1, T, 1, D] / [B, T, 1, D] (bshd) or [1, 1, T, D] /
    [B, 1, T, D] (bhsd), [B, T, D] and [T, D]; D is rotary_dim or rotary_dim / 2 (half table).
    `deinterleave` (with `interleaved`): the interleaved result's pairs (2j, 2j + 1) are then laid out as
    halves (j, j + rotary_dim / 2), as DeepSeek-V3's `apply_rotary_pos_emb_interleave` returns them.
    """
    if deinterleave and not interleaved:
        raise ValueError("rotary_reference: deinterleave=True needs interleaved=True")
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    seq_len = q.shape[1]
    cos, sin = (_table_as_bsd(t, layout) for t in (cos, sin))  # [B or 1, T, D]
    if position_ids is not None:
        position_ids = position_ids.reshape(-1, seq_len)
        batch_index = torch.arange(cos.shape[0], device=cos.device)[:, None] if cos.shape[0] > 1 else 0
        cos, sin = cos[batch_index, position_ids], sin[batch_index, position_ids]
    else:
        cos, sin = cos[:, :seq_len], sin[:, :seq_len]
    rotary_dim = rotary_dim or cos.shape[-1]
    if cos.shape[-1] * 2 == rotary_dim:
        cos, sin = (_expand_half_table(t, interleaved) for t in (cos, sin))
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
    rotate = rotate_every_two if interleaved else rotate_half

    def apply(x):
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        out = x_rot * cos.to(x.dtype) + rotate(x_rot) * sin.to(x.dtype)
        if deinterleave:
            out = torch.cat([out[..., 0::2], out[..., 1::2]], dim=-1)
        return torch.cat([out, x_pass], dim=-1)

    q_out, k_out = apply(q), apply(k)
    if layout == "bhsd":
        q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out


def _table_as_bsd(table: torch.Tensor, layout: str) -> torch.Tensor:
    if table.dim() == 4:
        return table.squeeze(2 if layout == "bshd" else 1)
    if table.dim() == 3:
        return table
    return table.unsqueeze(0)


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                   ignore_index: int = -100) -> torch.Tensor:
    """An LM head and its loss as causal-LM code writes them: the [tokens, vocab] logits, upcast to fp32."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float().reshape(-1, weight.shape[0]), labels.reshape(-1), ignore_index=ignore_index)


def swiglu_reference(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(x) * y`; with `y=None` the last dimension of x is split in half (Paddle's swiglu)."""
    return gated_reference(x, y, "silu")


def geglu_reference(x: torch.Tensor, y: torch.Tensor | None = None, *, approximate: str = "tanh") -> torch.Tensor:
    """`gelu(x, approximate) * y` (Gemma's MLP); with `y=None` the last dimension of x is split in half."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"geglu_reference: approximate must be 'tanh' or 'none', got {approximate!r}")
    return gated_reference(x, y, "gelu_tanh" if approximate == "tanh" else "gelu")


def gated_reference(x: torch.Tensor, y: torch.Tensor | None, activation: str) -> torch.Tensor:
    """`act(x) * y` in eager ops for `activation` "silu", "gelu_tanh" or "gelu" (exact); with `y=None` the last
    dimension of x is split in half."""
    if activation not in ("silu", "gelu_tanh", "gelu"):
        raise ValueError(f"gated_reference: activation must be 'silu', 'gelu_tanh' or 'gelu', got {activation!r}")
    if y is None:
        x, y = x.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(x) * y
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none") * y
