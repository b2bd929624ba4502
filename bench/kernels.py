"""Kernel benchmark: the fused ops against eager PyTorch, torch.compile and Liger-Kernel.

The elementwise ops are memory-bound, so their figure of merit is achieved bandwidth: the minimum number
of bytes an op must move (each input read once, each output written once) divided by its time, and that
as a percentage of the device's measured copy bandwidth, the practical ceiling for a streaming kernel.
linear_cross_entropy (an LM head and its loss) is GEMM-bound: its limit is the rate of torch.mm at the
head's shape, measured in the same run (`pct_matmul`), and its point is memory, so its rows also carry
the peak memory a call adds above its inputs (`peak_mib`: CUDA's allocator peak, torch's MemTracker on
the CPU). It runs in fwd (the loss alone) and fwd+bwd: a fused loss computes its gradients in the forward
(as Liger's does), so a backward-only time would compare nothing alike.

Every variant is checked once against the eager reference before it is timed; a mismatch or an
exception lands in the `error` column of the results instead of disappearing.

    df = run_kernel_benchmark(ops=["rms_norm"], quick=True)      # also writes the report

pandas is imported lazily (inside `run_kernel_benchmark`) so that `tridist --help` stays fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import logging
import math
import statistics
import sys
import time
from typing import Callable, Iterable, Sequence

import torch

logger = logging.getLogger(__name__)

OPS = ("rms_norm", "add_rms_norm", "rotary", "swiglu", "geglu", "linear_cross_entropy")
GATED_OPS = ("swiglu", "geglu")  # one kernel pair, silu or gelu (tanh approximation: Gemma's) of the gate
LOSS_OP = "linear_cross_entropy"
LOSS_MODES = ("fwd", "fwd+bwd")  # see the module docstring
# Report order: baselines first, ours last.
VARIANTS = ("eager", "compile", "liger", "tridist")
MODES = ("fwd", "bwd", "fwd+bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

EPS = 1e-6
ROPE_BASE = 10000.0  # Llama's rotary base frequency
GQA_GROUP = 4  # query heads per key/value head (Llama-2-70B / Llama-3 style grouped-query attention)
RSTD_BYTES = 4  # RMSNorm keeps one fp32 1/rms per row for the backward

# Relative tolerance of the correctness check: max |ours - eager| / max |eager|. Loose on purpose (a
# few units in the last place of the dtype): this guards the benchmark against timing a broken
# variant; tests/ holds the exact numerical checks.
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
CHECK_CHUNK = 1 << 24  # elements compared at a time (64 MiB in fp32)

# Timing budgets in ms: triton.testing.do_bench's defaults on CUDA; CPU runs are short smoke runs.
CUDA_WARMUP_MS, CUDA_REP_MS = 25, 100
CPU_WARMUP_MS, CPU_REP_MS = 10, 100
CPU_MIN_REPS, CPU_MAX_REPS = 5, 200
# do_bench sizes its timed runs to fill `rep` ms, so a call over 50 ms is timed once (over 33, twice): on the H100
# (bench/results/h100-2026-11-27c) one sample of the 83 ms linear_cross_entropy read 96 ms, and compile's
# median moved 81 -> 88 ms between leases. Ten samples bound a median's noise at the cost of ~1 s per large case.
CUDA_MIN_REPS = 10
CPU_THREADS = 1  # see benchmark_settings

# Buffer sizes for the copy-bandwidth ceiling: far larger than any cache on either device.
CUDA_COPY_BYTES = 1 << 30  # 1 GiB
CPU_COPY_BYTES = 256 << 20  # 256 MiB

RESULT_COLUMNS = (
    "op", "shape", "dtype", "variant", "mode", "time_ms", "gbps", "pct_copy_bw", "bytes",
    "tridist_speedup", "error", "tokens", "width", "device", "vocab", "tflops", "pct_matmul", "peak_mib",
)
IGNORED_LABEL_SHARE = 0.1  # linear_cross_entropy's cases: padding labelled -100


class VariantUnavailable(RuntimeError):
    """A variant cannot run here at all (package missing, op not exported): skipped, with the reason logged."""


# ------------------------------------------------------------------------------------------------ cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark shape.

    `width` is the hidden size for the norms, rotary (query heads = width / head_dim, key/value
    heads = query heads / GQA_GROUP) and linear_cross_entropy (with its `vocab`), and the
    intermediate size for SwiGLU. Rotary splits `tokens` into batch x `seq_len`.
    """

    op: str
    tokens: int
    width: int
    dtype: str = "bf16"
    head_dim: int = 128
    seq_len: int | None = None
    vocab: int | None = None

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; valid ops: {', '.join(OPS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; valid dtypes: {', '.join(DTYPES)}")
        if self.op == "rotary" and (self.width % self.head_dim or self.tokens % self.rotary_seq_len):
            raise ValueError(f"rotary case needs width % head_dim == 0 and tokens % seq_len == 0: {self}")
        if (self.op == LOSS_OP) != (self.vocab is not None):
            raise ValueError(f"a {LOSS_OP} case needs a vocab (the head's rows), and only it takes one: {self}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def rotary_seq_len(self) -> int:
        return self.seq_len or self.tokens

    @property
    def rotary_heads(self) -> tuple[int, int]:
        """(query heads, key/value heads)."""
        q_heads = self.width // self.head_dim
        return q_heads, max(1, q_heads // GQA_GROUP)

    @property
    def shape(self) -> str:
        """A compact label for tables: the dimensions that matter for this op."""
        if self.op == "rotary":
            q_heads, kv_heads = self.rotary_heads
            batch = self.tokens // self.rotary_seq_len
            return f"B={batch} S={self.rotary_seq_len} Hq={q_heads} Hk={kv_heads} D={self.head_dim}"
        if self.op in GATED_OPS:
            return f"T={self.tokens} I={self.width}"
        if self.op == LOSS_OP:
            return f"T={self.tokens} H={self.width} V={self.vocab}"
        return f"T={self.tokens} H={self.width}"


# Llama-family sizes: hidden 2048/4096/8192 with their SwiGLU intermediate sizes (TinyLlama-1.1B,
# Llama-2-7B, Llama-2-70B), and 1 / 4 / 16 sequences of 4096 tokens per device.
CUDA_HIDDEN = (2048, 4096, 8192)
CUDA_INTERMEDIATE = {2048: 5632, 4096: 11008, 8192: 22016}
CUDA_TOKENS = (4096, 16384, 65536)
CUDA_SEQ_LEN = 4096
# CPU: small shapes, so that a full run with torch.compile takes a minute or two; intermediate
# = 2.75 x hidden as in Llama; head_dim 64 keeps a few heads at these widths.
CPU_SHAPES = ((512, 256), (2048, 1024))  # (tokens, hidden)
CPU_HEAD_DIM = 64
CPU_SEQ_LEN = 1024
# linear_cross_entropy (tokens, hidden, vocab): Llama-2's head on 4096 tokens, Llama-3-8B's (128,256 entries)
# on 8192 and 16384 (the 8192 x 128,256: 4.2 GB of fp32 logits in eager). CPU: vocab 8 x hidden,
# a second or two per fwd+bwd on one thread.
CUDA_LOSS_SHAPES = ((4096, 2048, 32000), (8192, 4096, 128256), (16384, 4096, 128256))
CPU_LOSS_SHAPES = ((512, 256, 2048), (2048, 1024, 8192))


def _case(op: str, *, tokens: int, hidden: int, dtype: str, head_dim: int, seq_len: int,
          intermediate: int) -> Case:
    if op in GATED_OPS:
        return Case(op, tokens, intermediate, dtype)
    if op == "rotary":
        return Case(op, tokens, hidden, dtype, head_dim=head_dim, seq_len=min(seq_len, tokens))
    return Case(op, tokens, hidden, dtype)


def default_cases(*, device_type: str, ops: Iterable[str] | None = None, dtype: str | None = None,
                  quick: bool = False) -> list[Case]:
    """The case grid: realistic Llama shapes on CUDA (bf16), a handful of small fp32 shapes on CPU.

    `quick` keeps one mid-size shape per op (CUDA) or the smallest (CPU).
    """
    ops = list(ops or OPS)
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; valid ops: {', '.join(OPS)}")
    loss_cases = []
    if LOSS_OP in ops:
        ops.remove(LOSS_OP)
        grid = CUDA_LOSS_SHAPES if device_type == "cuda" else CPU_LOSS_SHAPES
        grid = grid[1:2] if quick and device_type == "cuda" else grid[:1] if quick else grid
        loss_dtype = dtype or ("bf16" if device_type == "cuda" else "fp32")
        loss_cases = [Case(LOSS_OP, t, h, loss_dtype, vocab=v) for t, h, v in grid]
    if device_type == "cuda":
        dtype = dtype or "bf16"
        shapes = [(16384, 4096)] if quick else [(t, h) for h in CUDA_HIDDEN for t in CUDA_TOKENS]
        intermediate = CUDA_INTERMEDIATE
        head_dim, seq_len = 128, CUDA_SEQ_LEN
    else:
        dtype = dtype or "fp32"
        shapes = list(CPU_SHAPES[:1] if quick else CPU_SHAPES)
        intermediate = {h: h * 11 // 4 for _, h in shapes}  # Llama's ratio, 2.75
        head_dim, seq_len = CPU_HEAD_DIM, CPU_SEQ_LEN
    return [
        _case(op, tokens=t, hidden=h, dtype=dtype, head_dim=head_dim, seq_len=seq_len,
              intermediate=intermediate[h])
        for op in ops
        for t, h in shapes
    ] + loss_cases


# ------------------------------------------------------------------------------------------ bytes moved


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")


def rms_norm_bytes(*, tokens: int, hidden: int, elem_size: int, mode: str) -> int:
    """Minimum traffic of RMSNorm over a [tokens, hidden] input, in bytes.

    fwd:     read x, w; write y                       = (2·T·H + H)·s
    bwd:     read x, dy, w, rstd; write dx, dw        = (3·T·H + 2·H)·s + 4·T
    fwd+bwd: the sum                                  (s = element size, rstd is fp32 per row)
    """
    _check_mode(mode)
    fwd = (2 * tokens * hidden + hidden) * elem_size
    bwd = (3 * tokens * hidden + 2 * hidden) * elem_size + RSTD_BYTES * tokens
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def add_rms_norm_bytes(*, tokens: int, hidden: int, elem_size: int, mode: str) -> int:
    """Minimum traffic of the residual add fused with RMSNorm: h = x + r; y = rms_norm(h) · w.

    fwd:     read x, r, w; write y, h                 = (4·T·H + H)·s
    bwd:     read dy, dh, h, w, rstd; write dx, dw    = (4·T·H + 2·H)·s + 4·T
             (the gradient of x and of the residual is the same tensor: written once)
    fwd+bwd: the sum
    """
    _check_mode(mode)
    fwd = (4 * tokens * hidden + hidden) * elem_size
    bwd = (4 * tokens * hidden + 2 * hidden) * elem_size + RSTD_BYTES * tokens
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def rotary_bytes(*, batch: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
                 elem_size: int, mode: str) -> int:
    """Minimum traffic of rotary embedding on q [B, S, Hq, D] and k [B, S, Hk, D] with cos/sin [S, D].

    fwd:     read q, k, cos, sin; write q_out, k_out  = (2·B·S·(Hq + Hk)·D + 2·S·D)·s
    bwd:     read dq_out, dk_out, cos, sin; write dq, dk: the same
    fwd+bwd: the sum
    """
    _check_mode(mode)
    one_pass = (2 * batch * seq_len * (q_heads + kv_heads) * head_dim + 2 * seq_len * head_dim) * elem_size
    return {"fwd": one_pass, "bwd": one_pass, "fwd+bwd": 2 * one_pass}[mode]


def swiglu_bytes(*, tokens: int, intermediate: int, elem_size: int, mode: str) -> int:
    """Minimum traffic of silu(gate) · up on [tokens, intermediate] tensors.

    fwd:     read gate, up; write out                 = 3·T·I·s
    bwd:     read dout, gate, up; write dgate, dup    = 5·T·I·s
    fwd+bwd: the sum                                  = 8·T·I·s
    """
    _check_mode(mode)
    n = tokens * intermediate * elem_size
    return {"fwd": 3 * n, "bwd": 5 * n, "fwd+bwd": 8 * n}[mode]


def linear_cross_entropy_bytes(*, tokens: int, hidden: int, vocab: int, elem_size: int, mode: str) -> int:
    """Minimum traffic of an LM head + loss (no logits held): read hidden [T, H], weight [V, H] and the
    int64 labels; fwd writes the fp32 loss, the backward the gradients of hidden and weight."""
    _check_mode(mode)
    reads = (tokens * hidden + vocab * hidden) * elem_size + 8 * tokens
    grads = (tokens * hidden + vocab * hidden) * elem_size
    return {"fwd": reads + 4, "bwd": reads + grads, "fwd+bwd": reads + 4 + grads}[mode]


def linear_cross_entropy_flops(case: Case, mode: str) -> float:
    """GEMM FLOPs: the logits (2·T·H·V) in fwd; with the gradients of hidden and weight, 3x that."""
    one = 2.0 * case.tokens * case.width * case.vocab
    return {"fwd": one, "bwd": 2 * one, "fwd+bwd": 3 * one}[mode]


def modes_for(case: Case, modes: Sequence[str] = MODES) -> list[str]:
    """The modes of `modes` that `case` is timed in (linear_cross_entropy: LOSS_MODES, see the module docstring)."""
    return [m for m in modes if case.op != LOSS_OP or m in LOSS_MODES]


def bytes_moved(case: Case, mode: str) -> int:
    """Minimum bytes `case` must move in `mode` (see the per-op functions for the formulas)."""
    elem_size = torch.empty((), dtype=case.torch_dtype).element_size()
    if case.op == LOSS_OP:
        return linear_cross_entropy_bytes(tokens=case.tokens, hidden=case.width, vocab=case.vocab,
                                          elem_size=elem_size, mode=mode)
    if case.op == "rms_norm":
        return rms_norm_bytes(tokens=case.tokens, hidden=case.width, elem_size=elem_size, mode=mode)
    if case.op == "add_rms_norm":
        return add_rms_norm_bytes(tokens=case.tokens, hidden=case.width, elem_size=elem_size, mode=mode)
    if case.op == "rotary":
        q_heads, kv_heads = case.rotary_heads
        return rotary_bytes(batch=case.tokens // case.rotary_seq_len, seq_len=case.rotary_seq_len,
                            q_heads=q_heads, kv_heads=kv_heads, head_dim=case.head_dim,
                            elem_size=elem_size, mode=mode)
    return swiglu_bytes(tokens=case.tokens, intermediate=case.width, elem_size=elem_size, mode=mode)


# ----------------------------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class OpInputs:
    """Arguments for one call of an op (same for every variant) and the tensors that receive gradients."""

    args: tuple
    kwargs: dict
    grad_inputs: list[torch.Tensor]

    def call(self, fn: Callable):
        return fn(*self.args, **self.kwargs)


def _rope_tables(seq_len: int, head_dim: int, *, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's cos/sin tables, [S, D] with the half-width frequencies repeated (rotate-half pairing)."""
    inv_freq = 1.0 / ROPE_BASE ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def make_inputs(case: Case, device, *, requires_grad: bool, seed: int = 0) -> OpInputs:
    """Fresh, deterministic inputs for `case` (the same values for every variant, given the seed).

    Fresh tensors per variant matter: Liger-Kernel overwrites some of its inputs in place.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = case.torch_dtype

    def randn(*shape, scale=1.0, shift=0.0):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale + shift
        return t.to(dtype).requires_grad_(requires_grad)

    if case.op in ("rms_norm", "add_rms_norm"):
        x = randn(case.tokens, case.width)
        weight = randn(case.width, scale=0.1, shift=1.0)  # trained norm weights sit around 1
        if case.op == "rms_norm":
            return OpInputs((x, weight), {"eps": EPS}, [x, weight])
        residual = randn(case.tokens, case.width)
        return OpInputs((x, weight), {"eps": EPS, "residual": residual}, [x, residual, weight])
    if case.op == LOSS_OP:
        hidden = randn(case.tokens, case.width)
        weight = randn(case.vocab, case.width, scale=case.width ** -0.5)  # logits of unit scale
        labels = torch.randint(0, case.vocab, (case.tokens,), generator=gen, device=device)
        labels[torch.rand(case.tokens, generator=gen, device=device) < IGNORED_LABEL_SHARE] = -100
        return OpInputs((hidden, weight, labels), {}, [hidden, weight])
    if case.op == "rotary":
        q_heads, kv_heads = case.rotary_heads
        seq_len = case.rotary_seq_len
        batch = case.tokens // seq_len
        q = randn(batch, seq_len, q_heads, case.head_dim)
        k = randn(batch, seq_len, kv_heads, case.head_dim)
        cos, sin = _rope_tables(seq_len, case.head_dim, dtype=dtype, device=device)
        return OpInputs((q, k, cos, sin), {}, [q, k])
    gate = randn(case.tokens, case.width)
    up = randn(case.tokens, case.width)
    return OpInputs((gate, up), {}, [gate, up])


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _output_grads(outputs: Sequence[torch.Tensor], *, seed: int) -> list[torch.Tensor]:
    """Fixed random upstream gradients, one per output."""
    gen = torch.Generator(device=outputs[0].device).manual_seed(seed + 1)
    return [torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float32).to(o.dtype) for o in outputs]


# --------------------------------------------------------------------------------------------- variants


def _reference(op: str) -> Callable:
    from tridist.kernels.reference import (
        linear_cross_entropy_reference,
        rms_norm_reference,
        rotary_reference,
        swiglu_reference,
        geglu_reference,
    )

    return {"rms_norm": rms_norm_reference, "add_rms_norm": rms_norm_reference, "rotary": rotary_reference,
            "swiglu": swiglu_reference, "geglu": geglu_reference, LOSS_OP: linear_cross_entropy_reference}[op]


def _tridist(op: str) -> Callable:
    """The fused op from `kernels`, imported here so that the benchmark runs while kernels/ is in progress."""
    name = {"rms_norm": "rms_norm", "add_rms_norm": "rms_norm",
            "rotary": "apply_rotary_pos_emb", "swiglu": "swiglu", "geglu": "geglu", LOSS_OP: LOSS_OP}[op]
    try:
        from tridist import kernels
    except Exception as exc:  # noqa: BLE001 - any import failure makes the variant unavailable
        raise VariantUnavailable(f"import tridist.kernels failed: {exc!r}") from exc
    fn = getattr(kernels, name, None)
    if fn is None:
        raise VariantUnavailable(f"kernels does not export {name} yet")
    return fn


def _compiled(op: str) -> Callable:
    """torch.compile of the eager reference, static shapes: Inductor's best case for each shape.

    Dynamo's cache is reset first: compiled graphs are keyed on the reference's code object, and a
    grid of shapes x (training, inference) would otherwise hit the recompile limit and fall back to
    eager silently. The "bwd" mode needs `benchmark_settings()` (donated buffers off).
    """
    torch._dynamo.reset()
    return torch.compile(_reference(op), dynamic=False)


def _liger(op: str, device: torch.device) -> Callable:
    """Liger-Kernel's autograd functions behind the reference's signature.

    The adaptations are views (no copies, so nothing extra is timed): Liger's RoPE takes q/k as
    [B, H, S, D] views of [B, S, H, D] storage and cos/sin as [1, S, D]. Liger overwrites caller
    tensors in place (RoPE: q, k and the incoming gradients; SwiGLU backward: its saved inputs), so
    repeated timing runs on drifting values: the traffic, and so the time, is the same.
    """
    if device.type != "cuda":
        raise VariantUnavailable("Liger-Kernel runs on GPUs only")
    if importlib.util.find_spec("liger_kernel") is None:
        raise VariantUnavailable("liger_kernel is not installed")
    try:
        if op == "rms_norm":
            return _liger_rms_norm()
        if op == "add_rms_norm":
            return _liger_add_rms_norm()
        if op == "rotary":
            return _liger_rotary()
        if op == LOSS_OP:
            return _liger_linear_cross_entropy()
        if op == "geglu":  # gelu's tanh approximation, as ours by default
            from liger_kernel.ops.geglu import LigerGELUMulFunction

            return lambda gate, up: LigerGELUMulFunction.apply(gate, up)
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return lambda gate, up: LigerSiLUMulFunction.apply(gate, up)
    except ImportError as exc:
        raise VariantUnavailable(f"liger_kernel has no {op}: {exc}") from exc


def _liger_rms_norm() -> Callable:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None) in
    # current releases; older ones lack in_place. in_place=True would write dX into the caller's dY.
    params = inspect.signature(LigerRMSNormFunction.forward).parameters
    extra = (0.0, "llama", False) if "in_place" in params else (0.0, "llama")

    def rms_norm(x, weight, eps=EPS):
        return LigerRMSNormFunction.apply(x, weight, eps, *extra)

    return rms_norm


def _liger_add_rms_norm() -> Callable:
    # forward(ctx, X, R, W, eps, offset=0.0, casting_mode="llama", in_place=False) -> (Y, X + R)
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    def add_rms_norm(x, weight, eps=EPS, residual=None):
        return LigerFusedAddRMSNormFunction.apply(x, residual, weight, eps, 0.0, "llama", False)

    return add_rms_norm


def _liger_rotary() -> Callable:
    # forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1), q/k [B, H, S, D], cos [1, S, D]
    from liger_kernel.ops.rope import LigerRopeFunction

    def rotary(q, k, cos, sin):
        q_out, k_out = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])
        return q_out.transpose(1, 2), k_out.transpose(1, 2)

    return rotary


def _liger_linear_cross_entropy() -> Callable:
    # forward(ctx, _input, weight, target, bias=None, ce_weight=None, ignore_index=-100, ...): the loss, or
    # (loss, z_loss, ...) in releases that can return the z-loss too.
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    def linear_cross_entropy(hidden, weight, labels):
        out = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, labels)
        return out[0] if isinstance(out, tuple) else out

    return linear_cross_entropy


def build_variant(op: str, variant: str, *, device: torch.device) -> Callable:
    """A callable with the reference's signature for `op`; raises VariantUnavailable when it cannot run."""
    if variant == "eager":
        return _reference(op)
    if variant == "compile":
        return _compiled(op)
    if variant == "tridist":
        return _tridist(op)
    if variant == "liger":
        return _liger(op, device)
    raise ValueError(f"unknown variant {variant!r}; valid variants: {', '.join(VARIANTS)}")


# ---------------------------------------------------------------------------------------- correctness


@dataclasses.dataclass
class Expected:
    """The eager reference's outputs and input gradients for one case, and the upstream gradients used."""

    outputs: list[torch.Tensor]
    grads: list[torch.Tensor]
    output_grads: list[torch.Tensor]


def _forward_backward(fn: Callable, case: Case, device, *, output_grads=None, seed: int = 0):
    inputs = make_inputs(case, device, requires_grad=True, seed=seed)
    outputs = _as_tuple(inputs.call(fn))
    snapshot = [o.detach().clone() for o in outputs]  # Liger's backward may overwrite buffers
    if output_grads is None:
        output_grads = _output_grads(outputs, seed=seed)
    # Clones: Liger's RoPE backward writes the input gradients into the upstream gradients.
    torch.autograd.backward(outputs, [g.clone() for g in output_grads])
    grads = [t.grad.detach().clone() if t.grad is not None else None for t in inputs.grad_inputs]
    return snapshot, grads, output_grads


def reference_results(case: Case, device, *, seed: int = 0) -> Expected:
    outputs, grads, output_grads = _forward_backward(_reference(case.op), case, device, seed=seed)
    return Expected(outputs, grads, output_grads)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in fp32, NaN if either holds NaN; in chunks, so that the largest
    CUDA cases (65536 x 22016) need no full-size fp32 copies."""
    got, want = got.reshape(-1), want.reshape(-1)
    max_err = max_ref = 0.0
    for start in range(0, want.numel(), CHECK_CHUNK):
        g, w = got[start:start + CHECK_CHUNK].float(), want[start:start + CHECK_CHUNK].float()
        err = (g - w).abs().max().item()
        if math.isnan(err):
            return math.nan
        max_err, max_ref = max(max_err, err), max(max_ref, w.abs().max().item())
    return max_err / max(max_ref, 1e-6)  # floor: an all-zero reference compares absolutely


def check_variant(fn: Callable, case: Case, device, expected: Expected, *, seed: int = 0) -> str:
    """One forward + backward of `fn` against the eager reference: "" when it matches, else why not."""
    try:
        outputs, grads, _ = _forward_backward(fn, case, device, output_grads=expected.output_grads, seed=seed)
    except Exception as exc:  # noqa: BLE001 - whatever broke, the table must say so
        return _error_text(exc, context="")
    if len(outputs) != len(expected.outputs):
        return f"mismatch: {len(outputs)} outputs, expected {len(expected.outputs)}"
    tolerance = CHECK_TOLERANCE[case.torch_dtype]
    named = [(f"output[{i}]", g, w) for i, (g, w) in enumerate(zip(outputs, expected.outputs))]
    named += [(f"grad[{i}]", g, w) for i, (g, w) in enumerate(zip(grads, expected.grads))]
    for name, got, want in named:
        if got is None or want is None:
            if got is not want:
                return f"mismatch: {name} is {'missing' if got is None else 'unexpected'}"
            continue
        if got.shape != want.shape:
            return f"mismatch: {name} shape {tuple(got.shape)} != {tuple(want.shape)}"
        err = _relative_error(got, want)
        if not err <= tolerance:  # also catches NaN
            return f"mismatch: {name} relative error {err:.3g} > {tolerance:g}"
    return ""


# ----------------------------------------------------------------------------------------------- timing


def make_timed_fn(fn: Callable, inputs: OpInputs, mode: str, *, seed: int = 0) -> Callable:
    """The closure to time for `mode`; it returns the op's outputs (fwd) or the inputs' gradients.

    fwd: the op alone (inputs do not require grad, so no graph is recorded).
    bwd: the forward runs once here; each timed run is a backward with retain_graph=True and a fixed
         random upstream gradient.
    fwd+bwd: forward and backward.
    The backward is `torch.autograd.grad`: the gradients are returned, not accumulated into the leaves'
    .grad. Accumulating would time autograd's bookkeeping, not the op: an op that hands one tensor to two
    inputs (add_rms_norm's x and residual both get the gradient of x + residual) makes AccumulateGrad copy it
    for the second leaf, 2 T H bytes that no variant moves inside a model, where the gradient flows on to
    the ops that produced the inputs (about 30% of add_rms_norm's backward time on an H100 at 65,536 x 2,048).
    The call made here also triggers torch.compile's compilation, outside the timed region.
    """
    _check_mode(mode)
    if mode == "fwd":
        return lambda: inputs.call(fn)
    outputs = _as_tuple(inputs.call(fn))
    output_grads = _output_grads(outputs, seed=seed)
    wrt = inputs.grad_inputs

    def gradients(outs, retain_graph=False):
        return torch.autograd.grad(outs, wrt, output_grads, retain_graph=retain_graph, allow_unused=True)

    if mode == "bwd":
        gradients(outputs, retain_graph=True)  # compiles the backward

        def backward_only():
            return gradients(outputs, retain_graph=True)

        return backward_only
    gradients(outputs)
    del outputs

    def forward_backward():
        return gradients(_as_tuple(inputs.call(fn)))

    return forward_backward


def reset_grads(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


def _cpu_median_ms(fn: Callable, *, grad_to_none: Sequence[torch.Tensor], warmup_ms: float,
                   rep_ms: float) -> float:
    """Median wall time of `fn`: one untimed call (compilation, allocator), warm-up calls for
    `warmup_ms`, then enough runs to fill `rep_ms`, sized from the warm-up's median."""

    def timed_call() -> float:
        reset_grads(grad_to_none)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    timed_call()
    warmup = [timed_call()]
    while sum(warmup) < warmup_ms and len(warmup) < CPU_MAX_REPS:
        warmup.append(timed_call())
    estimate_ms = max(statistics.median(warmup), 1e-3)
    reps = min(CPU_MAX_REPS, max(CPU_MIN_REPS, int(rep_ms / estimate_ms)))
    return statistics.median(timed_call() for _ in range(reps))


def _cuda_median_ms(fn: Callable, *, grad_to_none: Sequence[torch.Tensor], warmup_ms: float,
                    rep_ms: float) -> float:
    """triton.testing.do_bench's timing (CUDA events around each call, L2 flushed and gradients reset
    before it, runs sized from a 5-call estimate), with at least CUDA_MIN_REPS timed calls."""
    from triton import runtime

    driver = runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()

    def prepare() -> None:
        reset_grads(grad_to_none)
        driver.clear_cache(cache)

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        prepare()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(CUDA_MIN_REPS, int(rep_ms / estimate_ms)))]
    for start, end in events:
        prepare()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def time_ms(fn: Callable, *, device: torch.device, grad_to_none: Sequence[torch.Tensor] = (),
            warmup_ms: float | None = None, rep_ms: float | None = None) -> float:
    """Median time of one call of `fn` in ms: CUDA events, L2 flushed before each run (as triton's
    do_bench, with a floor on the number of runs); perf_counter on the CPU."""
    if device.type == "cuda":
        return _cuda_median_ms(fn, grad_to_none=grad_to_none, warmup_ms=warmup_ms or CUDA_WARMUP_MS,
                               rep_ms=rep_ms or CUDA_REP_MS)
    return _cpu_median_ms(fn, grad_to_none=grad_to_none, warmup_ms=warmup_ms or CPU_WARMUP_MS,
                          rep_ms=rep_ms or CPU_REP_MS)


def measure_copy_bandwidth(device, *, nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes/s), counting bytes read plus written.

    This is the practical ceiling for a streaming kernel (H100 SXM: ~3.0 TB/s of a 3.35 TB/s spec).
    """
    device = torch.device(device)
    nbytes = nbytes or (CUDA_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device=device)
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ------------------------------------------------------------------------------------------------ driver


def resolve_device(device=None) -> torch.device:
    """None or "auto": CUDA when available, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch.cuda.is_available() is False")
    return device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"CPU: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    import platform

    return f"CPU: {platform.processor() or platform.machine()}"


def environment(device: torch.device, copy_bw_gbps: float) -> dict:
    """What the report's header says about where and when the numbers were taken."""
    import datetime
    import platform

    import triton

    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "copy_bw_gbps": copy_bw_gbps,
        "cuda": torch.version.cuda or "",
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        **provenance(device),
    }


def provenance(device: torch.device) -> dict:
    """The NVIDIA driver (nvidia-smi; "" without one), tridist's version and the git commit of the
    checkout it runs from ("" outside a git checkout): stamped on every CSV row."""
    import importlib.metadata
    import subprocess
    from pathlib import Path

    def run(command, **kwargs) -> str:
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=10, check=True, **kwargs).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    driver = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[:1] if device.type == "cuda" else []
    try:
        version = importlib.metadata.version("tridist")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    return {"driver": driver[0] if driver else "", "tridist": version,
            "commit": run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent)}


def _log_progress(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _error_text(exc: Exception, *, context: str) -> str:
    return f"failed{context}: {type(exc).__name__}: {exc}".splitlines()[0][:200]


def _time_mode(fn: Callable, case: Case, mode: str, *, device: torch.device, warmup_ms, rep_ms) -> float:
    inputs = make_inputs(case, device, requires_grad=mode != "fwd")
    return time_ms(make_timed_fn(fn, inputs, mode), device=device, warmup_ms=warmup_ms, rep_ms=rep_ms)


def peak_mib(fn: Callable, case: Case, mode: str, *, device: torch.device) -> float:
    """The memory one call of `mode` adds at its peak above what exists before it (its inputs; gradients
    are written during the call), in MiB: CUDA's allocator peak, torch's MemTracker on the CPU."""
    inputs = make_inputs(case, device, requires_grad=mode != "fwd")
    timed = make_timed_fn(fn, inputs, mode)  # one untimed call: compilation, allocator
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        timed()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        timed()
    return tracker.get_tracker_snapshot("peak")[device]["Total"] / 2**20


def matmul_tflops(case: Case, *, device: torch.device, warmup_ms=None, rep_ms=None) -> float:
    """The rate of torch.mm at the head's shape, [T, H] x [H, V] in the case's dtype: the limit of a GEMM-bound
    op (its % in `pct_matmul`), measured like the ops."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(case.tokens, case.width, generator=gen, device=device).to(case.torch_dtype)
    b = torch.randn(case.width, case.vocab, generator=gen, device=device).to(case.torch_dtype)
    ms = time_ms(lambda: torch.mm(a, b), device=device, warmup_ms=warmup_ms, rep_ms=rep_ms)
    return 2.0 * case.tokens * case.width * case.vocab / (ms * 1e-3) / 1e12


def _run_case(case: Case, *, device: torch.device, variants: Sequence[str], modes: Sequence[str],
              copy_bw_gbps: float, skipped: dict, warmup_ms, rep_ms) -> list[dict]:
    """All variants and modes of one case: check each variant once against eager, then time each mode.

    A variant that fails its check with an exception is not timed; one whose numbers mismatch is
    timed, and the mismatch stays in its rows' `error` column.
    """
    base = {"op": case.op, "shape": case.shape, "dtype": case.dtype, "tokens": case.tokens, "width": case.width,
            "vocab": case.vocab}
    modes = modes_for(case, modes)
    rows = []
    try:
        expected = reference_results(case, device)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the other cases still run
        error = _error_text(exc, context=" (eager reference)")
        return [{**base, "variant": v, "mode": m, "bytes": bytes_moved(case, m), "error": error,
                 "time_ms": math.nan, "gbps": math.nan, "pct_copy_bw": math.nan}
                for v in variants for m in modes]
    for variant in variants:
        try:
            fn = build_variant(case.op, variant, device=device)
        except VariantUnavailable as exc:
            if (variant, case.op) not in skipped:
                logger.warning("skipping variant %s for %s: %s", variant, case.op, exc)
                skipped[(variant, case.op)] = str(exc)
            continue
        error = "" if variant == "eager" else check_variant(fn, case, device, expected)  # eager is the reference
        for mode in modes:
            row = {**base, "variant": variant, "mode": mode, "bytes": bytes_moved(case, mode), "error": error,
                   "time_ms": math.nan}
            if not error.startswith("failed"):
                try:
                    row["time_ms"] = _time_mode(fn, case, mode, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms)
                    if case.op == LOSS_OP:  # the loss's point is memory (module docstring)
                        row["peak_mib"] = peak_mib(fn, case, mode, device=device)
                except Exception as exc:  # noqa: BLE001 - recorded in the table
                    row["error"] = _error_text(exc, context=f" ({mode})")
            rows.append(row)
    del expected
    if device.type == "cuda":
        torch.cuda.empty_cache()
    matmul = matmul_tflops(case, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms) if case.op == LOSS_OP else math.nan
    for row in rows:
        seconds = row["time_ms"] * 1e-3
        row["gbps"] = row["bytes"] / seconds / 1e9 if seconds > 0 else math.nan
        row["pct_copy_bw"] = 100.0 * row["gbps"] / copy_bw_gbps
        if case.op == LOSS_OP:
            row["tflops"] = linear_cross_entropy_flops(case, row["mode"]) / seconds / 1e12 if seconds > 0 else math.nan
            row["pct_matmul"] = 100.0 * row["tflops"] / matmul
    return rows


def _summary(rows: list[dict]) -> str:
    """One progress line's worth: fwd+bwd (else the last mode) time per variant."""
    by_variant = {}
    for row in rows:
        if row["mode"] == "fwd+bwd" or row["variant"] not in by_variant:
            by_variant[row["variant"]] = row
    parts = []
    for variant, row in by_variant.items():
        flag = " (!)" if row["error"] else ""
        if row["op"] == LOSS_OP:
            parts.append(f"{variant} {row['time_ms']:.4g} ms {row.get('pct_matmul', math.nan):.0f}% of mm "
                         f"{row.get('peak_mib', math.nan):.0f} MiB{flag}")
        else:
            parts.append(f"{variant} {row['time_ms']:.4g} ms {row['pct_copy_bw']:.0f}%{flag}")
    mode = "fwd+bwd" if any(r["mode"] == "fwd+bwd" for r in rows) else (rows[-1]["mode"] if rows else "")
    return f"[{mode}] " + ", ".join(parts)


def _add_speedups(df):
    """tridist_speedup = this row's time / tridist's time for the same case and mode (>1: tridist is faster)."""
    keys = ["op", "shape", "dtype", "mode"]
    ours = (df.loc[df["variant"] == "tridist", keys + ["time_ms"]]
            .drop_duplicates(keys).rename(columns={"time_ms": "tridist_ms"}))
    merged = df[keys + ["time_ms"]].merge(ours, on=keys, how="left")  # keeps df's row order
    df["tridist_speedup"] = (merged["time_ms"] / merged["tridist_ms"]).to_numpy()
    return df


@contextlib.contextmanager
def benchmark_settings(device: torch.device, *, cpu_threads: int | None = CPU_THREADS):
    """Process settings for a benchmark run, restored afterwards.

    - AOTAutograd's donated buffers off: a compiled backward that reuses its saved tensors' memory
      refuses retain_graph=True (checked when the backward runs), which the "bwd" mode needs.
      Donation saves peak memory, not traffic, and one compiled graph then serves every mode.
    - CPU runs pinned to `cpu_threads` (None: torch's setting): on a shared machine an OpenMP
      barrier waiting for a descheduled thread stalls an op for milliseconds.
    """
    import torch._functorch.config as functorch_config  # not loaded until something compiles

    previous_threads = torch.get_num_threads()
    if device.type == "cpu" and cpu_threads:
        torch.set_num_threads(cpu_threads)
    try:
        with functorch_config.patch(donated_buffer=False):
            yield
    finally:
        torch.set_num_threads(previous_threads)


def _run_cases(cases: Sequence[Case], *, device: torch.device, variants: Sequence[str],
               modes: Sequence[str], copy_bw_gbps: float, progress: bool, warmup_ms, rep_ms):
    """Rows of every case, one progress line per case; also the variants skipped and why."""
    skipped: dict = {}
    rows = []
    for i, case in enumerate(cases, 1):
        start = time.perf_counter()
        case_rows = _run_case(case, device=device, variants=variants, modes=modes, copy_bw_gbps=copy_bw_gbps,
                              skipped=skipped, warmup_ms=warmup_ms, rep_ms=rep_ms)
        rows.extend(case_rows)
        _log_progress(progress, f"[{i}/{len(cases)}] {case.op} {case.shape} {case.dtype}: "
                                f"{_summary(case_rows)} ({time.perf_counter() - start:.1f} s)")
    return rows, {f"{variant} / {op}": why for (variant, op), why in skipped.items()}


def run_kernel_benchmark(ops=None, dtype=None, device=None, quick=False, compile=True, out_dir=None,
                         progress=True, *, cases: Sequence[Case] | None = None,
                         variants: Sequence[str] | None = None, modes: Sequence[str] = MODES,
                         warmup_ms: float | None = None, rep_ms: float | None = None,
                         copy_bw_gbps: float | None = None, cpu_threads: int | None = CPU_THREADS,
                         write_report: bool = True):
    """Benchmark the fused ops against their baselines; returns one row per (case, variant, mode).

    `cases` overrides the default grid (tests pass tiny ones); `variants` defaults to every variant
    (minus "compile" when compile=False; unavailable ones are skipped with a logged reason);
    `copy_bw_gbps` skips the copy-bandwidth measurement; `cpu_threads` (None: leave torch's setting)
    applies to CPU runs. Writes results.csv, report.md and plot.png under `out_dir` (default
    reports/kernels-<device>-<timestamp>/) unless write_report is False; the report's directory is
    in df.attrs["report_dir"], the environment in df.attrs["meta"].
    """
    import pandas as pd

    device = resolve_device(device)
    if cases is None:
        cases = default_cases(device_type=device.type, ops=ops, dtype=dtype, quick=quick)
    variants = [v for v in (variants or VARIANTS) if compile or v != "compile"]
    for mode in modes:
        _check_mode(mode)

    with benchmark_settings(device, cpu_threads=cpu_threads):
        if copy_bw_gbps is None:
            _log_progress(progress, f"measuring copy bandwidth on {device_name(device)} ...")
            copy_bw_gbps = measure_copy_bandwidth(device)
        _log_progress(progress, f"copy bandwidth: {copy_bw_gbps:.1f} GB/s; {len(cases)} cases x "
                                f"{len(variants)} variants x {len(modes)} modes")
        rows, skipped = _run_cases(cases, device=device, variants=variants, modes=modes,
                                   copy_bw_gbps=copy_bw_gbps, progress=progress, warmup_ms=warmup_ms,
                                   rep_ms=rep_ms)
        meta = environment(device, copy_bw_gbps)

    df = pd.DataFrame(rows, columns=list(RESULT_COLUMNS))  # columns no row sets yet: NaN
    df["device"] = meta["device"]
    df = _add_speedups(df)
    df.attrs["meta"] = {**meta, "skipped": skipped}
    if write_report:
        from tridist.bench.report import write_kernel_report

        df.attrs["report_dir"] = str(write_kernel_report(df, out_dir=out_dir, meta=df.attrs["meta"]))
    return df
