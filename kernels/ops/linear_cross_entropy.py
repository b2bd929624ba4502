"""Linear + cross-entropy over token chunks: the [tokens, vocab] logits are never held whole.

    loss = F.cross_entropy(softcap(hidden @ weight.T + bias).float(), labels, ignore_index=...,
                           reduction=..., label_smoothing=...),   softcap(x) = softcap * tanh(x / softcap)

(softcap: Gemma-2's final logit soft-capping; `num_items_in_batch`: transformers' convention, the summed
loss divided by it.) Tokens are processed in chunks (`chunk_tokens`), each through one reused
[chunk, vocab] buffer:

1. logits = hidden_chunk @ weight.T (+ bias) by torch.mm / addmm in the input dtype: fp32 accumulation
   inside the GEMM (cuBLAS, oneDNN) and one rounding, the logits eager's F.linear produces;
2. `_stats_kernel`: per row, streaming over vocabulary blocks, the running max m of z = softcap(logits)
   and the sum of exp(z - m), the label's z and the sum of z (label smoothing), all in fp32. Rows whose
   label is ignore_index are not read;
3. `_loss_grad_kernel`: lse = m + log(sum), the row's loss, and d loss / d logits written IN PLACE over
   the buffer, rounded once to the input dtype:

       (softmax(z) - (1 - eps) onehot(label) - eps / V) * (1 - tanh^2) * row_scale

   (1 - tanh^2 only with softcap), row_scale = 1 / #non-ignored (mean), 1 / num_items_in_batch, 1 (sum),
   or the token's grad_output (reduction="none", in the backward);
4. grad_hidden[chunk] = grad_logits @ weight in the input dtype; grad_weight += grad_logits.T @ hidden_chunk
   into an fp32 accumulator (cuBLAS's fp32-output GEMM on CUDA, an fp32 upcast of the chunk elsewhere),
   rounded once to the weight's dtype at the end (a scalar loss's in the backward, times grad_output); grad_bias
   likewise from fp32 column sums. Where a half-precision head's tokens fit one chunk (`chunk_tokens` admits up
   to 2 x hidden_size for it), grad_weight is that chunk's one GEMM in the weight's dtype instead, with no
   accumulator.

Where the gradients are computed. For a scalar loss (mean, sum, num_items_in_batch) the forward computes
them for grad_output 1, as Liger does (except for an fp16 head, below): three GEMMs in all, like eager, and the
backward applies grad_output (`_scaled_gradients`) without a host sync and without a product of a weight-sized
gradient, whatever its value (1 for `loss.backward()`, 1 / steps under gradient accumulation, a loss scaler's scale):
- chunks of a bf16 head: its fp32 accumulator is held to the backward, which rounds it to the
  weight's dtype times grad_output in one pass (the rounding the forward would have made); grad_hidden and
  grad_bias are multiplied (tokens x hidden, vocabulary);
- one chunk of a bf16 head (`_one_gemm`, DEFERRED_DTYPES): the forward stops after step 3 and holds the
  logits' gradient; the backward runs step 4's two GEMMs, grad_output folded into the hidden rows for the
  weight's and applied in place to the hidden's (`_deferred_gradients_impl`);
- an fp32 head: its accumulator is the weight's gradient; the backward multiplies, or in eager mode, when
  grad_output is exactly 1 (one host sync on CUDA, as in Liger), hands the saved gradients over;
- an fp16 head: none in the forward. Computed for grad_output 1, its logits' gradient p / tokens falls below
  fp16's range, which eager's keeps only because a loss scaler's factor multiplies it before the rounding; so
  the backward recomputes, as for reduction="none", each row scaled by grad_output over the mean's denominator
  (`_gradients_in_backward`: four GEMMs, and nothing held but the inputs).
Every product is computed in fp32 and rounded once (`_times`). What the forward leaves is never modified, so a
second backward gives the same gradients. The price is memory: grad_hidden and the weight's state are held from
the forward to the backward, for a bf16 head the fp32 accumulator or in one chunk the logits'
gradient (up to 4 bytes per weight element at 2 x hidden tokens), where the finished gradient would be 2: twice
as much per loss whose backward is pending (several only where a pipeline schedule runs micro-batches' forwards
ahead of their backwards on the last stage, as GPipe does; 1F1B runs each backward right after). The peak of one
forward + backward is unchanged: the weight plus 6 bytes per weight element with a bf16 weight (accumulator and
result; in one chunk the logits' gradient and the result), at the forward's end or in the backward.
With reduction="none" each token's gradient is scaled by its own grad_output, unknown in the forward: the
forward computes only the losses and saves the inputs, and the backward recomputes each chunk's logits
(four GEMMs in all) with grad_output as row_scale; nothing is held between the two but the inputs.

Memory (CPU, torch's MemTracker, forward + backward of the loss alone, above its inputs; `bench.kernels.
peak_mib`): 2,048 tokens, hidden 512, vocabulary 32,000, fp32: 227 MiB against eager F.linear +
F.cross_entropy's 813 MiB; with the inputs, 8,192 tokens, hidden 4,096, vocabulary 128,256, bf16 (under
FakeTensorMode): 4.0 GiB against 12.7 GiB. On an H100 (2026-11-26, before the chunk rule's floor) the
second case's CUDA peak above the inputs was 3,070 MiB against eager's 12,024.

Vocabulary parallel (a DTensor weight split on its rows, `_local_inputs`; a VocabShard inside). The
statistics (step 2) and the loss/gradient (step 3) are separate kernels for it: a rank holding rows
vocab_start .. vocab_start + n_cols of the vocabulary all-reduces each chunk's [4, rows] statistics
between the two (`_reduce_stats`: the max with MAX; the sums of exp rescaled to the global max, the
label's z and the sum of z with SUM) and runs the step-3 kernel with n_classes = the whole vocabulary.
Every rank then has the same losses; its grad_hidden is a partial sum over its rows, all-reduced once at
the end (Megatron's column-parallel head), and its weight's gradient is its shard's. All ranks cut the
same chunks (sized by the largest shard), so their collectives pair up.

CUDA tensors run the Triton kernels; CPU tensors run the same chunked steps in plain PyTorch unless
TRITON_INTERPRET=1 is set before import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from .. import configs
from .._common import (
    cdiv,
    check_dtype,
    check_same_device,
    eager_autograd,
    is_dtensor,
    next_power_of_2,
    no_autocast,
    use_triton,
)

# Tokens per chunk (`chunk_tokens`). Liger's rule sizes a chunk's logits like the hidden input (tokens x
# hidden elements), so the loss adds about one hidden-sized buffer to the step; it cuts about vocab / hidden
# chunks (31 for Llama 3) whatever the token count. That is too many for the weight's gradient: each chunk's
# GEMM reads and writes the whole fp32 [vocab, hidden] accumulator, 8 V H bytes against 2 c V H flops, an
# intensity of c / 4 flop per byte for c tokens, while an H100 needs ~260 (~780 bf16 TFLOP/s over ~3 TB/s)
# to stay compute-bound. Measured there (2026-11-26, bench/results/h100-2026-11-26/NOTES.md): 16,384 tokens
# x 128,256 vocabulary in 31 chunks took 122 ms fwd+bwd, 45 ms of it that traffic, slower than eager. Hence
# the floor SPEED_CHUNK_TOKENS (it also keeps small shapes off the per-chunk host cost, ~0.1 ms of launches per
# chunk). At 2,048 (twice the ridge) the same shape's 8 chunks still lost ~4.5 ms to it: each accumulating GEMM
# took 3.68 ms against 3.04 for the chunk's other two (2026-11-27, bench/results/h100-2026-11-27d/profile-lce),
# and the step 84.7 ms against compile's 76.9. Now 4,096 (4x the ridge, half the accumulations; not yet timed
# end to end), but never above hidden_size: then the chunk's logits (c x V) stay at most the weight's size
# (V x H). With a half-precision head the step's peak does not grow:
# it is the fp32 accumulator plus the weight-sized gradient result, which the chunk's logits (freed before
# it) stay under; with an fp32 head it grows by at most the weight's size. MIN_CHUNK_TOKENS
# keeps the GEMM's M dimension one full 128-row tensor-core tile for narrow toy heads; above
# MAX_CHUNK_TOKENS a GEMM runs no faster, it only takes more memory.
# One exception (`fp32_accumulator`): with a half-precision head whose gradient is computed, up to
# ONE_CHUNK_HIDDEN_MULTIPLE x hidden_size tokens run as a single chunk. Their logits (2 T V bytes) are then no
# larger than the fp32 accumulator (4 V H bytes) that a second chunk would need, so the peak of the kernels' path
# (CUDA, the interpreter) does not grow (one chunk: logits + the weight-sized result, 2 V (T + H) <= 6 V H;
# several: accumulator + max(chunk, result) >= 6 V H). The CPU path's fp32 slices (up to UPCAST_TOKENS tokens)
# and a hidden input gathered rather than viewed (`_token_rows`: T x H instead of a chunk's) can add a little.
# The weight's gradient is then one GEMM in the weight's dtype instead of the accumulator's
# traffic: per chunk 8 V H bytes, plus 6 V H for the final rounding. Measured on an H100 (2026-11-27,
# bench/results/h100-2026-11-27b, fwd+bwd): 8,192 x 4,096 x 128,256 took 44.0 ms in 4 chunks, 40.1 in one
# (compile 37.1-37.6; the traffic saved, 18 GB, is ~6 ms at copy bandwidth); 4,096 x 2,048 x 32,000 3.36 ms in
# 2 chunks, 3.21 in one (compile 2.60). CUDA's peak above the inputs stayed 3,070 MiB at the first shape.
ONE_CHUNK_HIDDEN_MULTIPLE = 2
MIN_CHUNK_TOKENS = 128
SPEED_CHUNK_TOKENS = 4096
MAX_CHUNK_TOKENS = 4096
# The plain-PyTorch steps 2 and 3 (CPU) and the weight gradient's fp32 upcast where no fp32-output GEMM of
# half-precision inputs exists (CPU; CUDA before sm_80 or torch 2.8) work on this many of a chunk's tokens at
# a time: their fp32 temporaries are then 256 x 128,256 x 4 bytes = 125 MiB each, where a 2,048-token
# chunk's would be 1 GiB, more than the chunk itself. On a CPU a GEMM 256 deep is compute-bound (a CPU's
# ridge is tens of flop per byte), so the slices cost no speed there.
UPCAST_TOKENS = 256

# Vocabulary columns per block (a 128k row is streamed in 32 blocks); short rows (small vocabularies)
# are packed until a tile holds TARGET_TILE_ELEMENTS, one warp per 512 elements of the tile.
MAX_BLOCK_N = 4096
TARGET_TILE_ELEMENTS = 4096

REDUCTIONS = ("mean", "sum", "none")
# Rows of the per-row statistics buffer (see _stats_kernel).
STAT_MAX, STAT_SUM_EXP, STAT_TARGET, STAT_SUM_Z = range(4)

# cuBLAS's fp32-output GEMM of half-precision inputs (addmm's out_dtype): torch >= 2.8, sm_80 and newer.
_ADDMM_HAS_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def chunk_tokens(n_tokens: int, hidden_size: int, vocab_size: int, *, fp32_accumulator: bool = False) -> int:
    """Tokens per chunk: Liger's n_tokens * hidden_size / vocab_size (the chunk's logits as large as the
    hidden input), raised to min(SPEED_CHUNK_TOKENS, hidden_size) (the weight gradient's traffic; the logits
    then no larger than the weight), clamped to [MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS] and to n_tokens, then
    evened out so that the chunks differ by at most one token (no thin last GEMM). `fp32_accumulator`: more
    than one chunk would sum a half-precision weight's gradient in fp32; then up to
    ONE_CHUNK_HIDDEN_MULTIPLE * hidden_size tokens are one chunk (the logits no larger than that buffer)."""
    if n_tokens <= 0:
        return 1
    if fp32_accumulator and n_tokens <= ONE_CHUNK_HIDDEN_MULTIPLE * hidden_size:
        return n_tokens
    target = -(-n_tokens * hidden_size // max(vocab_size, 1))
    floor = max(MIN_CHUNK_TOKENS, min(SPEED_CHUNK_TOKENS, hidden_size))
    chunk = min(max(target, floor), MAX_CHUNK_TOKENS, n_tokens)
    return -(-n_tokens // -(-n_tokens // chunk))


# ---------------------------------------------------------------------------------------------- kernels


@triton.jit
def _tanh(y):
    """tanh from exp(-2|y|) <= 1: no overflow for any logit (the interpreter has no tanh of its own)."""
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y < 0, -t, t)


# Both kernels take a chunk's logits as [n_rows, n_cols] with row stride stride_row (columns vocab_start ..
# of the vocabulary), a label per row (any integer dtype, stride labels_stride) and one program per
# BLOCK_M rows streaming over the columns in BLOCK_N blocks. The helpers are inlined rather than called:
# in Triton's interpreter every call of a @triton.jit function costs milliseconds.


@triton.jit
def _stats_kernel(
    logits_ptr, labels_ptr, stats_ptr,
    n_rows, n_cols, stride_row, labels_stride, stats_stride, vocab_start, ignore_index, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Per row into the [4, rows] stats: max of z, sum of exp(z - max), the label's z (0 when another
    vocabulary shard holds it), sum of z; z = softcap(logits) in fp32. Ignored rows are not read: -inf, 0, 0, 0."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    labels = tl.load(labels_ptr + rows.to(tl.int64) * labels_stride, mask=row_mask, other=ignore_index).to(tl.int64)
    active = row_mask & (labels != ignore_index)
    target = labels - vocab_start  # the label's column here; outside [0, n_cols) in another shard
    softcap = tl.cast(softcap, tl.float32)  # the interpreter passes Python floats raw
    row_offsets = rows.to(tl.int64) * stride_row

    in_shard = active & (target >= 0) & (target < n_cols)
    z_target = tl.load(logits_ptr + row_offsets + target, mask=in_shard, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z_target = softcap * _tanh(z_target / softcap)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK_M], dtype=tl.float32)
    sum_z = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = active[:, None] & (cols < n_cols)[None, :]
        z = tl.load(logits_ptr + row_offsets[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        if HAS_SMOOTHING:
            sum_z += tl.sum(tl.where(mask, z, 0.0), axis=1)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        # Online softmax: the running sum rescaled to the new max. Ignored rows keep m = -inf; shifting them
        # by 0 instead keeps every exp() argument -inf (exp = 0), never -inf - (-inf) = nan.
        shift = tl.where(active, m_new, 0.0)
        sum_exp = sum_exp * tl.exp(m - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
        m = m_new
    tl.store(stats_ptr + rows, m, mask=row_mask)
    tl.store(stats_ptr + stats_stride + rows, sum_exp, mask=row_mask)
    tl.store(stats_ptr + 2 * stats_stride + rows, tl.where(in_shard, z_target, 0.0), mask=row_mask)
    tl.store(stats_ptr + 3 * stats_stride + rows, sum_z, mask=row_mask)


@triton.jit
def _loss_grad_kernel(
    logits_ptr, labels_ptr, stats_ptr, loss_ptr, scale_ptr,
    n_rows, n_cols, stride_row, labels_stride, stats_stride, scale_stride, vocab_start, n_classes,
    ignore_index, softcap, label_smoothing,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SCALE: tl.constexpr,
    WRITE_LOSS: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """From the (reduced) stats: loss = lse - (1 - eps) z_label - eps / V sum(z), and the gradient over the
    logits, (exp(z - lse) - (1 - eps) [col == label] - eps / V) * (1 - t^2 with softcap) * row_scale;
    ignored rows get 0 for both. V = n_classes, the whole vocabulary."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    labels = tl.load(labels_ptr + rows.to(tl.int64) * labels_stride, mask=row_mask, other=ignore_index).to(tl.int64)
    active = row_mask & (labels != ignore_index)
    target = labels - vocab_start
    softcap = tl.cast(softcap, tl.float32)
    eps = tl.cast(label_smoothing, tl.float32)
    m = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)
    sum_exp = tl.load(stats_ptr + stats_stride + rows, mask=row_mask, other=1.0)
    lse = tl.where(active, m + tl.log(tl.where(active, sum_exp, 1.0)), 0.0)  # ignored rows: no log(0)
    if WRITE_LOSS:
        loss = lse - (1.0 - eps) * tl.load(stats_ptr + 2 * stats_stride + rows, mask=row_mask, other=0.0)
        if HAS_SMOOTHING:
            loss -= eps / n_classes * tl.load(stats_ptr + 3 * stats_stride + rows, mask=row_mask, other=0.0)
        tl.store(loss_ptr + rows, tl.where(active, loss, 0.0), mask=row_mask)
    if COMPUTE_GRAD:
        if HAS_SCALE:
            scale = tl.load(scale_ptr + rows.to(tl.int64) * scale_stride, mask=row_mask, other=0.0).to(tl.float32)
        else:
            scale = tl.full([BLOCK_M], 1.0, tl.float32)
        row_offsets = rows.to(tl.int64) * stride_row
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            offsets = row_offsets[:, None] + cols[None, :]
            z = tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = _tanh(z / softcap)
                z = softcap * t
            grad = tl.exp(z - lse[:, None])
            grad = tl.where(cols[None, :] == target[:, None], grad - (1.0 - eps), grad)
            if HAS_SMOOTHING:
                grad -= eps / n_classes
            if HAS_SOFTCAP:
                grad *= 1.0 - t * t  # d softcap(x) / dx
            # where() after the product: an inf scale (num_items_in_batch = 0) never reaches ignored rows.
            grad = tl.where(active[:, None], grad * scale[:, None], 0.0)
            tl.store(logits_ptr + offsets, grad.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _times_kernel(src_ptr, factor_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    """out = src * factor[0] over contiguous tensors, in fp32, rounded once to out's dtype (`_times`)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: a 256k x 8k weight has 2^31
    mask = offsets < n_elements
    factor = tl.load(factor_ptr).to(tl.float32)
    x = tl.load(src_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x * factor).to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------- launch configurations

TUNABLES = {
    "stats": configs.Tunable("linear_cross_entropy_stats", frozenset({"BLOCK_M", "BLOCK_N", "num_warps"}),
                             (_stats_kernel, _tanh)),
    "grad": configs.Tunable("linear_cross_entropy_grad", frozenset({"BLOCK_M", "BLOCK_N", "num_warps"}),
                            (_loss_grad_kernel, _tanh)),
}

tuning_key = configs.row_tuning_key  # rows of a chunk x vocabulary columns


def heuristic_config(n_cols: int) -> dict:
    block_n = min(max(16, next_power_of_2(n_cols)), MAX_BLOCK_N)
    block_m = max(1, TARGET_TILE_ELEMENTS // block_n)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": max(1, min(16, block_m * block_n // 512))}


def launch_config(kind: str, n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The tuned table's entry for this launch's bucket when there is one, else `heuristic_config`."""
    tuned = configs.tuned_config(TUNABLES[kind], device, tuning_key(n_rows, n_cols, dtype))
    return tuned if tuned is not None else heuristic_config(n_cols)


# ------------------------------------------------------------------------- one chunk: steps 2 and 3


def _chunk_stats(logits, labels, stats, *, vocab_start, ignore_index, softcap, smoothing):
    """Step 2 into stats ([4, rows] fp32): max, sum of exp(z - max), the label's z, sum of z."""
    n_rows, n_cols = logits.shape
    if not use_triton(logits):
        for part in _token_slices(n_rows):
            _chunk_stats_torch(logits[part], labels[part], stats[:, part], vocab_start=vocab_start,
                               ignore_index=ignore_index, softcap=softcap, smoothing=smoothing)
        return
    cfg = launch_config("stats", n_rows, n_cols, logits.dtype, logits.device)
    _stats_kernel[(cdiv(n_rows, cfg["BLOCK_M"]),)](
        logits, labels, stats,
        n_rows, n_cols, logits.stride(0), labels.stride(0), stats.stride(0), vocab_start, ignore_index,
        float(softcap or 1.0),
        HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=smoothing,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
    )


def _chunk_loss_grad(logits, labels, stats, loss, scale, *, vocab_start, n_classes, ignore_index, softcap,
                     label_smoothing, compute_grad):
    """Step 3: per-row losses into `loss` (if given) and, with compute_grad, the gradient over `logits`."""
    n_rows, n_cols = logits.shape
    if not use_triton(logits):
        for part in _token_slices(n_rows):
            _chunk_loss_grad_torch(
                logits[part], labels[part], stats[:, part], loss[part] if loss is not None else None,
                scale[part] if scale is not None else None, vocab_start=vocab_start, n_classes=n_classes,
                ignore_index=ignore_index, softcap=softcap, label_smoothing=label_smoothing, compute_grad=compute_grad,
            )
        return
    cfg = launch_config("grad", n_rows, n_cols, logits.dtype, logits.device)
    _loss_grad_kernel[(cdiv(n_rows, cfg["BLOCK_M"]),)](
        logits, labels, stats, loss if loss is not None else stats, scale if scale is not None else stats,
        n_rows, n_cols, logits.stride(0), labels.stride(0), stats.stride(0),
        scale.stride(0) if scale is not None else 0, vocab_start, n_classes, ignore_index,
        float(softcap or 1.0), float(label_smoothing),
        HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing != 0.0, HAS_SCALE=scale is not None,
        WRITE_LOSS=loss is not None, COMPUTE_GRAD=compute_grad,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
    )


def _token_slices(n_rows: int):
    """Row slices of UPCAST_TOKENS: the plain-PyTorch steps and the weight gradient's upcast work on these."""
    return [slice(start, start + UPCAST_TOKENS) for start in range(0, n_rows, UPCAST_TOKENS)]


def _chunk_stats_torch(logits, labels, stats, *, vocab_start, ignore_index, softcap, smoothing):
    """_chunk_stats in plain PyTorch (CPU), for a few rows (its fp32 temporaries are rows x vocab)."""
    n_cols = logits.shape[1]
    z = _softcap_torch(logits.float(), softcap)
    active = labels != ignore_index
    target = labels - vocab_start
    in_shard = active & (target >= 0) & (target < n_cols)
    m = z.amax(1)
    stats[STAT_MAX] = torch.where(active, m, float("-inf"))
    stats[STAT_SUM_EXP] = torch.where(active, (z - m[:, None]).exp_().sum(1), 0.0)  # one temporary
    stats[STAT_TARGET] = torch.where(in_shard, z.gather(1, target.clamp(0, n_cols - 1)[:, None])[:, 0], 0.0)
    stats[STAT_SUM_Z] = torch.where(active, z.sum(1), 0.0) if smoothing else 0.0


def _chunk_loss_grad_torch(logits, labels, stats, loss, scale, *, vocab_start, n_classes, ignore_index, softcap,
                           label_smoothing, compute_grad):
    """_chunk_loss_grad in plain PyTorch (CPU), for a few rows (its fp32 temporaries are rows x vocab)."""
    n_cols = logits.shape[1]
    active = labels != ignore_index
    lse = torch.where(active, stats[STAT_MAX] + torch.log(stats[STAT_SUM_EXP]), 0.0)
    if loss is not None:
        rows_loss = lse - (1.0 - label_smoothing) * stats[STAT_TARGET]
        if label_smoothing:
            rows_loss = rows_loss - label_smoothing / n_classes * stats[STAT_SUM_Z]
        loss.copy_(torch.where(active, rows_loss, 0.0))
    if compute_grad:
        grad = logits.float() if logits.dtype != torch.float32 else logits  # fp32: in place
        if softcap is not None:
            t = torch.tanh(grad / softcap)
            grad = torch.mul(t, softcap, out=grad)
        grad = grad.sub_(lse[:, None]).exp_()
        target = labels - vocab_start
        in_shard = active & (target >= 0) & (target < n_cols)
        label_term = torch.where(in_shard, label_smoothing - 1.0, 0.0)[:, None]  # - (1 - eps) at the label
        grad.scatter_add_(1, target.clamp(0, n_cols - 1)[:, None], label_term)
        if label_smoothing:
            grad.sub_(label_smoothing / n_classes)
        if softcap is not None:
            grad.mul_(t.mul_(t).neg_().add_(1.0))  # d softcap(x) / dx = 1 - tanh^2
        if scale is not None:
            grad.mul_(scale.float()[:, None])
        grad.masked_fill_(~active[:, None], 0.0)  # after the product, as in the kernel
        if grad is not logits:
            logits.copy_(grad)


def _softcap_torch(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return x if softcap is None else torch.tanh(x / softcap) * softcap


# ------------------------------------------------------------------------------------ the chunk loop


def _token_rows(hidden: torch.Tensor, n_tokens: int):
    """`rows(start, end)`: hidden's tokens [start, end) as an [n, H] matrix (any column stride; torch.mm
    takes it as is). A view when hidden's leading dims merge into one stride (contiguous, a row slice of
    one, [S, 1, H]); otherwise (hidden[:, :-1] of a batch, an [S, B, H] transpose) only those tokens are
    gathered: one chunk-sized copy, never a copy of hidden."""
    hidden_size = hidden.shape[-1]
    try:
        flat = hidden.view(n_tokens, hidden_size)
    except RuntimeError:
        leading = hidden.shape[:-1]
        return lambda start, end: hidden[torch.unravel_index(torch.arange(start, end, device=hidden.device), leading)]
    return lambda start, end: flat[start:end]


def _accumulate_weight_grad(acc: torch.Tensor, grad_logits: torch.Tensor, rows: torch.Tensor, first: bool) -> None:
    """acc (fp32) += grad_logits.T @ rows, the chunk's product never rounded to a half dtype. The first chunk
    writes acc instead (beta 0: its uninitialised values are not read, NaN included), which saves zeroing
    the accumulator and reading the zeros back, 8 bytes per weight element (2 ms of an H100's bandwidth at
    Llama 3's 128,256 x 4,096 head)."""
    beta = 0 if first else 1
    if grad_logits.dtype == torch.float32:
        acc.addmm_(grad_logits.t(), rows, beta=beta)
    elif acc.device.type == "cuda" and _ADDMM_HAS_OUT_DTYPE and torch.cuda.get_device_capability(acc.device)[0] >= 8:
        torch.addmm(acc, grad_logits.t(), rows, out_dtype=torch.float32, beta=beta, out=acc)
    else:  # fp32 copies of UPCAST_TOKENS of the chunk's tokens at a time (never weight-sized)
        for i, part in enumerate(_token_slices(rows.shape[0])):
            acc.addmm_(grad_logits[part].t().float(), rows[part].float(), beta=beta if i == 0 else 1)


# A scalar loss's one-chunk gradient GEMMs wait for the backward (`_deferred_gradients_impl`) in bf16 only: folding
# grad_output into fp16 hidden rows would overflow under a loss scaler (65,536 x |h| > 65,504 for |h| > 1), where
# the weight's gradient itself fits. (An fp16 head computes every gradient in the backward: _gradients_in_backward.)
DEFERRED_DTYPES = (torch.bfloat16,)


# `_times_kernel`'s elements per program: a streaming pass, 16 per thread of 8 warps (untuned: any block of a few
# thousand elements keeps an H100's bandwidth busy).
TIMES_BLOCK = 4096


def _times(t: torch.Tensor, grad_loss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t * grad_loss, a new tensor of `dtype`: computed in fp32 and rounded once, with no fp32 copy of t. (grad_loss
    as a one-element tensor takes part in type promotion: a 0-dim one would be cast to t's half dtype first on CUDA,
    where a loss scaler's 65,536 is inf in fp16.) A contiguous Triton tensor outside a traced graph takes
    `_times_kernel`: torch's mul into another dtype with a one-element operand runs its generic, unvectorized
    kernel, which took ~2.7 ms for the fp32 accumulator of a 128,256 x 4,096 head on an H100 (2026-11-27,
    bench/results/h100-2026-11-27d/profile-lce), 2.6x the time of the 3.2 GB it moves. A traced graph keeps the
    mul, which inductor fuses with the rounding."""
    factor = grad_loss.reshape(1).float()
    out = t.new_empty(t.shape, dtype=dtype)
    # is_compiling() first: dynamo does not trace is_fake, and reads is_compiling() as a constant
    if (not torch.compiler.is_compiling() and use_triton(t) and t.is_contiguous() and t.numel() > 0
            and not is_fake(t)):
        _times_kernel[(cdiv(t.numel(), TIMES_BLOCK),)](t, factor, out, t.numel(), BLOCK=TIMES_BLOCK, num_warps=8)
        return out
    return torch.mul(t, factor, out=out)


def _defers(one_gemm: bool, dtype: torch.dtype) -> bool:
    """Whether a scalar loss's forward leaves both gradient GEMMs to the backward: one GEMM of a bf16 head."""
    return one_gemm and dtype in DEFERRED_DTYPES


def _one_gemm(n_tokens: int, hidden_size: int, vocab_rows: int, dtype: torch.dtype, grad_weight: bool) -> bool:
    """Whether a half-precision head's weight gradient is one GEMM in its dtype over all the tokens, which then
    fit one chunk (`chunk_tokens`' exception for it, or few enough tokens anyway); else an fp32 accumulator sums
    it chunk by chunk. `vocab_rows`: the head's rows on this rank (the largest shard's, vocabulary parallel)."""
    return (grad_weight and dtype != torch.float32 and n_tokens > 0
            and chunk_tokens(n_tokens, hidden_size, vocab_rows, fp32_accumulator=True) >= n_tokens)


def _run_chunks(hidden, weight, labels, bias, *, ignore_index, label_smoothing, softcap, scale, loss,
                grad_hidden, grad_weight, grad_bias, shard: "VocabShard | None" = None, defer: bool = False):
    """Steps 1-4 over every chunk of tokens. `labels` and `scale` (row_scale: None, or [tokens] with any
    stride, 0 for one scale) are 1-D; `loss` is None or the [tokens] fp32 output. Returns the requested
    gradients (grad_hidden [tokens, H] in hidden's dtype; grad_bias in fp32; grad_weight in fp32, or in the
    weight's dtype where one chunk of a half-precision head computed it in one GEMM: `_one_gemm`).

    `defer` (a scalar loss, whose grad_output the backward brings): where `_defers` holds (one GEMM of a bf16
    head), neither gradient GEMM runs here; the second value returned is then the logits' gradient [tokens,
    rows] (the first is None), for `_deferred_gradients_impl` to finish with grad_output folded in.

    With `shard` (vocabulary parallel) `weight` and `bias` hold the rows shard.start .. of the vocabulary: each
    chunk's statistics are reduced over shard.group before step 3, and grad_hidden, a partial sum over the
    vocabulary, is summed over the group at the end; losses and grad_hidden come out equal on every rank."""
    n_tokens, (vocab, hidden_size) = labels.shape[0], weight.shape
    compute_grad = grad_hidden or grad_weight or grad_bias
    device, dtype = hidden.device, hidden.dtype
    # Every rank of a vocabulary-parallel group cuts the same chunks (their collectives pair up), sized by
    # the largest shard (uneven splits differ by a row or so).
    # (hidden and weight share their dtype: _validate.)
    vocab_rows = shard.largest_rows if shard is not None else vocab
    chunk = chunk_tokens(n_tokens, hidden_size, vocab_rows, fp32_accumulator=grad_weight and dtype != torch.float32)
    # A half-precision head whose tokens fit one chunk (the rule admits up to 2 x hidden; short inputs fit the
    # floor anyway): its weight gradient is one GEMM in the weight's dtype, as eager's own, with fp32 accumulation
    # inside it and one rounding (on CUDA under PyTorch's matmul settings, as for eager: by default cuBLAS may
    # reduce split-K partial sums in the half dtype, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction).
    # Its result is allocated by that GEMM, after the loss kernels (the CPU path's fp32 slices then are gone).
    one_gemm = _one_gemm(n_tokens, hidden_size, vocab_rows, dtype, grad_weight)
    deferred = defer and _defers(one_gemm, dtype)
    gh = torch.empty((n_tokens, hidden_size), dtype=dtype, device=device) if grad_hidden and not deferred else None
    gw = None
    if grad_weight and not one_gemm:  # the fp32 accumulator; with no tokens the (zero) gradient in the weight's dtype
        gw = torch.empty((vocab, hidden_size), dtype=torch.float32 if n_tokens else dtype, device=device)
    gb = torch.zeros(vocab, dtype=torch.float32, device=device) if grad_bias else None
    if n_tokens == 0:
        return gh, gw if gw is None else gw.zero_(), gb
    vocab_start, n_classes = (shard.start, shard.vocab_size) if shard is not None else (0, vocab)
    buffer = torch.empty((chunk, vocab), dtype=dtype, device=device)
    stats = torch.empty((4, chunk), dtype=torch.float32, device=device)
    rows_of = _token_rows(hidden, n_tokens)
    weight_t = weight.t()
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        rows, logits, chunk_labels = rows_of(start, end), buffer[: end - start], labels[start:end]
        if bias is None:
            torch.mm(rows, weight_t, out=logits)
        else:
            torch.addmm(bias, rows, weight_t, out=logits)
        chunk_stats = stats[:, : end - start]
        _chunk_stats(logits, chunk_labels, chunk_stats, vocab_start=vocab_start, ignore_index=ignore_index,
                     softcap=softcap, smoothing=label_smoothing != 0.0)
        if shard is not None:
            _reduce_stats(chunk_stats, shard.group)
        _chunk_loss_grad(
            logits, chunk_labels, chunk_stats, loss[start:end] if loss is not None else None,
            scale[start:end] if scale is not None else None, vocab_start=vocab_start, n_classes=n_classes,
            ignore_index=ignore_index, softcap=softcap, label_smoothing=label_smoothing, compute_grad=compute_grad,
        )
        if grad_bias:
            gb += logits.sum(0, dtype=torch.float32)
        if deferred:
            return None, logits, gb
        if grad_hidden:
            torch.mm(logits, weight, out=gh[start:end])
        if one_gemm:
            gw = torch.mm(logits.t(), rows)
        elif grad_weight:
            _accumulate_weight_grad(gw, logits, rows, first=start == 0)
    if gh is not None and shard is not None:
        # Each rank's grad_hidden covers its vocabulary rows only (Megatron's column-parallel head: the input's
        # gradient is all-reduced). Summed in hidden's dtype, as eager tensor parallel sums its partial gradients.
        dist.all_reduce(gh, group=shard.group)
    return gh, gw, gb


def _reduce_stats(stats: torch.Tensor, group) -> None:
    """One chunk's [4, rows] statistics of this rank's vocabulary rows made the whole vocabulary's, in place:
    the max by MAX; this rank's sum of exp(z - its max) rescaled to the global max, then the sums (of exp, the
    label's z, held by one rank, and of z) by SUM: two collectives of `rows` and 3 x `rows` fp32 values."""
    local_max = stats[STAT_MAX].clone()
    dist.all_reduce(stats[STAT_MAX], op=dist.ReduceOp.MAX, group=group)  # a row of a contiguous [4, n]: contiguous
    global_max = stats[STAT_MAX]
    # Ignored rows hold -inf everywhere and a sum of 0: keep it (exp(-inf - (-inf)) would be nan).
    stats[STAT_SUM_EXP].mul_(torch.where(global_max.isneginf(), 0.0, (local_max - global_max).exp()))
    sums = stats[STAT_SUM_EXP:].contiguous()  # the rows of a chunk narrower than the buffer are strided
    dist.all_reduce(sums, group=group)
    stats[STAT_SUM_EXP:].copy_(sums)


@dataclass(frozen=True)
class VocabShard:
    """Vocabulary parallel: this rank's weight (and bias) hold the vocabulary rows start .. start + rows of
    vocab_size, split over `group` as DTensor's Shard(0) splits them (torch.chunk: shards of ceil(vocab_size /
    group size) rows, the last ones shorter)."""

    start: int
    vocab_size: int
    group: object  # a torch.distributed ProcessGroup
    largest_rows: int

    @classmethod
    def of(cls, start: int, vocab_size: int, group_name: str | None) -> "VocabShard | None":
        """From the op's arguments (a custom op takes the group by name, as torch's functional collectives do)."""
        if group_name is None:
            return None
        group = dist.distributed_c10d._resolve_process_group(group_name)
        return cls(start, vocab_size, group, -(-vocab_size // group.size()))


def check_class_indices(labels: torch.Tensor, vocab: int, ignore_index: int, *, op: str = "linear_cross_entropy",
                        name: str = "labels") -> None:
    """Labels in [0, vocab) or ignore_index, as F.cross_entropy requires; asynchronous on CUDA (no host
    sync: a device-side assert, as F.cross_entropy gives there), an error right away on the CPU. A loss split
    over the vocabulary needs it most: a label outside lies in no rank's columns, its logit counted as 0."""
    if labels.numel():
        valid = ((labels >= 0) & (labels < vocab)) | (labels == ignore_index)
        torch._assert_async(
            valid.all(),
            f"{op}: {name} must be class indices in [0, {vocab}) or ignore_index ({ignore_index}); "
            "found one outside (a label beyond the vocabulary, or padding marked with another value than ignore_index)",
        )


def _empty(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(0)


# ------------------------------------------------------------------------------ torch.library operators


def _linear_cross_entropy_impl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    reduction: str,
    vocab_start: int,
    vocab_size: int,
    group_name: str | None,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, weight state, grad_bias): what the gradients of the loss itself (grad_output 1) need
    from the forward, each an empty tensor unless requested: grad_hidden in hidden's dtype; grad_bias in fp32;
    the weight's state the fp32 accumulator of its gradient (`_run_chunks`; with no tokens, its zero gradient),
    or, where `_one_gemm` holds, the logits' gradient [tokens, rows], grad_hidden then left empty too: both
    GEMMs run in the backward (`_deferred_gradients_impl`). The backward scales them by grad_output
    (`_scaled_gradients`). With reduction="none" the caller requests none: its gradients come from the backward
    op (see the module docstring). `group_name` (a process group's name, or None): weight and bias are the
    vocabulary rows vocab_start .. of vocab_size, split over that group (VocabShard)."""
    shard = VocabShard.of(vocab_start, vocab_size, group_name)
    with no_autocast(hidden.device):
        check_class_indices(labels, vocab_size, ignore_index)
        flat_labels = labels.reshape(-1)  # a copy of the labels only if they are strided
        n_tokens = flat_labels.shape[0]
        denominator = scale = None
        if reduction == "mean":
            count = num_items_in_batch if num_items_in_batch is not None else (flat_labels != ignore_index).sum()
            denominator = count.to(torch.float32)
            scale = torch.reciprocal(denominator).expand(n_tokens)  # one value for every row: stride 0
        loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        gh, gw, gb = _run_chunks(
            hidden, weight, flat_labels, bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
            softcap=softcap, scale=scale, loss=loss_rows,
            grad_hidden=grad_hidden, grad_weight=grad_weight, grad_bias=grad_bias, shard=shard, defer=True,
        )
        if reduction == "none":
            loss = loss_rows.view(labels.shape)
        elif reduction == "sum":
            loss = loss_rows.sum()
        else:
            loss = loss_rows.sum() / denominator  # 0 / 0 = nan when every label is ignored, as in torch
        return (
            loss,
            gh.view(hidden.shape) if gh is not None else _empty(hidden),
            gw if gw is not None else _empty(weight),
            gb if gb is not None else _empty(hidden),
        )


def _linear_cross_entropy_backward_impl(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    vocab_start: int,
    vocab_size: int,
    group_name: str | None,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none": the chunks again, each token's gradient scaled by its grad_loss."""
    with no_autocast(hidden.device):
        gh, gw, gb = _run_chunks(
            hidden, weight, labels.reshape(-1), bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
            softcap=softcap, scale=grad_loss.reshape(-1), loss=None,
            grad_hidden=grad_hidden, grad_weight=grad_weight, grad_bias=grad_bias,
            shard=VocabShard.of(vocab_start, vocab_size, group_name),
        )
        return (
            gh.view(hidden.shape) if grad_hidden else _empty(hidden),
            gw.to(weight.dtype) if grad_weight else _empty(weight),
            gb.to(bias.dtype) if grad_bias else _empty(hidden),
        )


def _deferred_gradients_impl(
    grad_loss: torch.Tensor,
    grad_logits: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    group_name: str | None,
    grad_hidden: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden or an empty tensor, grad_weight) of a scalar loss whose forward left its logits' gradient
    (one chunk of a bf16 head, `_one_gemm`), times grad_loss: the weight's as one GEMM with grad_loss
    folded into the hidden rows (a tokens x hidden product), then the hidden's as one GEMM scaled in place
    (summed over the vocabulary-parallel group). No host sync and no weight-sized product, whatever grad_loss is
    (a loss scaler's scale, 1 / accumulation steps); grad_logits is only read, so a second backward gets the same
    gradients. Peak: the logits' gradient, the weight's gradient and one tokens x hidden tensor, as the forward's
    one-GEMM path had."""
    n_tokens, hidden_size = grad_logits.shape[0], weight.shape[1]
    with no_autocast(hidden.device):
        gw = torch.mm(grad_logits.t(), _times(hidden.reshape(n_tokens, hidden_size), grad_loss, hidden.dtype))
        if not grad_hidden:
            return _empty(hidden), gw
        gh = torch.mm(grad_logits, weight)
        gh.mul_(grad_loss.reshape(1).float())  # in fp32, rounded once (see _times)
        if group_name is not None:  # each rank's covers its vocabulary rows (see _run_chunks)
            dist.all_reduce(gh, group=dist.distributed_c10d._resolve_process_group(group_name))
        return gh.view(hidden.shape), gw


_lce_op = torch.library.custom_op("tridist::linear_cross_entropy", mutates_args=())(_linear_cross_entropy_impl)
_lce_backward_op = torch.library.custom_op("tridist::linear_cross_entropy_backward", mutates_args=())(
    _linear_cross_entropy_backward_impl
)
_lce_deferred_op = torch.library.custom_op("tridist::linear_cross_entropy_deferred_backward", mutates_args=())(
    _deferred_gradients_impl
)


def _fake_grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias):
    return (
        hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if grad_weight else weight.new_empty(0),
        bias.new_empty(bias.shape) if grad_bias else hidden.new_empty(0),
    )


def _op_one_gemm(hidden, weight, labels, vocab_start, vocab_size, group_name, grad_weight) -> bool:
    """`_one_gemm` from the op's arguments, over the rows `_run_chunks` sizes its chunks by (the largest shard's
    under vocabulary parallel): what the fake and the saved context must agree on with the forward."""
    shard = VocabShard.of(vocab_start, vocab_size, group_name)
    rows = shard.largest_rows if shard is not None else weight.shape[0]
    return _one_gemm(labels.numel(), hidden.shape[-1], rows, hidden.dtype, grad_weight)


@_lce_op.register_fake
def _(hidden, weight, labels, bias, num_items_in_batch, ignore_index, label_smoothing, softcap, reduction,
      vocab_start, vocab_size, group_name, grad_hidden, grad_weight, grad_bias):
    loss = hidden.new_empty(labels.shape if reduction == "none" else (), dtype=torch.float32)
    one_gemm = _op_one_gemm(hidden, weight, labels, vocab_start, vocab_size, group_name, grad_weight)
    deferred = _defers(one_gemm, hidden.dtype)
    if not grad_weight:
        weight_state = weight.new_empty(0)
    elif deferred:
        weight_state = hidden.new_empty((labels.numel(), weight.shape[0]))
    else:  # the fp32 accumulator; the gradient itself where it is one GEMM (fp16) or there are no tokens
        weight_state = weight.new_empty(weight.shape, dtype=weight.dtype if one_gemm or not labels.numel() else torch.float32)
    return (
        loss,
        hidden.new_empty(hidden.shape) if grad_hidden and not deferred else hidden.new_empty(0),
        weight_state,
        hidden.new_empty(bias.shape, dtype=torch.float32) if grad_bias else hidden.new_empty(0),
    )


@_lce_backward_op.register_fake
def _(grad_loss, hidden, weight, labels, bias, ignore_index, label_smoothing, softcap, vocab_start, vocab_size,
      group_name, grad_hidden, grad_weight, grad_bias):
    return _fake_grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias)


@_lce_deferred_op.register_fake
def _(grad_loss, grad_logits, hidden, weight, group_name, grad_hidden):
    return hidden.new_empty(hidden.shape if grad_hidden else (0,)), weight.new_empty(weight.shape)


def _setup_linear_cross_entropy(ctx, inputs, output):
    (hidden, weight, labels, bias, num_items_in_batch, ignore_index, label_smoothing, softcap, reduction,
     vocab_start, vocab_size, group_name, *grad_flags) = inputs
    # The gradient outputs are carried to the backward, never differentiated: no zero gradients are
    # materialised for them (one would be weight-sized).
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1:])
    ctx.recompute = _gradients_in_backward(reduction, hidden.dtype)
    if ctx.recompute:
        ctx.save_for_backward(hidden, weight, labels, bias, num_items_in_batch)
        ctx.options = (ignore_index, label_smoothing, softcap, vocab_start, vocab_size, group_name)
        ctx.reduction = reduction
        return
    ctx.computed = grad_flags  # only these were computed (and are what the caller's inputs need)
    ctx.deferred = _defers(_op_one_gemm(hidden, weight, labels, vocab_start, vocab_size, group_name, grad_flags[1]),
                           hidden.dtype)
    ctx.weight_dtype, ctx.bias_dtype, ctx.group_name = weight.dtype, None if bias is None else bias.dtype, group_name
    ctx.save_for_backward(*output[1:], *((hidden, weight) if ctx.deferred else ()))


def _backward_linear_cross_entropy(ctx, grad_loss, *_):
    needs = ctx.needs_input_grad
    if grad_loss is None:
        return (None,) * len(needs)
    if ctx.recompute:
        hidden, weight, labels, bias, num_items_in_batch = ctx.saved_tensors
        row_scale = _row_scale(grad_loss, labels, num_items_in_batch, ctx.reduction, ignore_index=ctx.options[0])
        backward = _linear_cross_entropy_backward_impl if getattr(ctx, "eager", False) else _lce_backward_op
        gh, gw, gb = backward(row_scale, hidden, weight, labels, bias, *ctx.options,
                              needs[0], needs[1], bias is not None and needs[3])
    else:
        gh, gw, gb = _scaled_gradients(ctx, grad_loss)
    return (gh if needs[0] else None, gw if needs[1] else None, None, gb if needs[3] else None) + (None,) * 11


def _gradients_in_backward(reduction: str, dtype: torch.dtype) -> bool:
    """Whether every gradient waits for the backward, which recomputes the chunks' logits (four GEMMs in all):
    per-token losses ("none", a grad_output per token), and fp16 heads. An fp16 logits' gradient computed for
    grad_output 1 has entries p / tokens below fp16's range (1e-5 / 2,048 < 6e-8, its smallest subnormal): eager's
    keeps them because the loss scaler's factor multiplies them before their rounding, and so does this backward,
    grad_output known (measured, 2,048 tokens x 32,000 vocabulary under a scale of 65,536: the weight's gradient
    5.0e-3 from fp64 computed in the forward, 2.1e-4 for eager)."""
    return reduction == "none" or dtype == torch.float16


def _row_scale(grad_loss, labels, num_items_in_batch, reduction: str, *, ignore_index: int) -> torch.Tensor:
    """Each token's factor in the recomputed gradients: its grad_output ("none"), else grad_output over what the
    forward divided the summed loss by (num_items_in_batch, or the tokens not ignored; 1 for "sum")."""
    if reduction == "none":
        return grad_loss
    if reduction == "sum":
        return grad_loss.expand(labels.shape)
    count = num_items_in_batch if num_items_in_batch is not None else (labels != ignore_index).sum()
    return (grad_loss / count.to(torch.float32)).expand(labels.shape)


def _scaled_gradients(ctx, grad_loss: torch.Tensor):
    """A scalar loss's gradients (those computed) from what its forward left, times grad_loss, in new tensors:
    the forward's state is only read, so a second backward gets the same gradients.
    - One chunk of a bf16 head: both GEMMs here, grad_loss folded in (`_deferred_gradients_impl`).
    - A bf16 head's fp32 accumulator: rounded to the weight's dtype with grad_loss applied in the same pass (the
      rounding the forward would otherwise have made), one rounding; grad_hidden times grad_loss.
    - An fp32 head: its accumulator is the weight's gradient. In eager mode, when grad_loss is exactly 1
      (`loss.backward()`; one host sync on CUDA, as Liger has), the saved gradients themselves are handed over,
      which spares a weight-sized product (autograd never accumulates into a gradient that another reference,
      ctx while the graph is retained, still holds); otherwise products. A compiled graph multiplies.
    grad_bias (fp32, tiny) is multiplied, then rounded to the bias's dtype. Every product is computed in fp32 and
    rounded once (`_times`); a grad_loss other than 1 or a power of two rounds grad_hidden and the hidden rows a
    second time in a half dtype."""
    computed_hidden, computed_weight, computed_bias = ctx.computed
    gh_state, weight_state, gb_state, *inputs = ctx.saved_tensors
    eager = getattr(ctx, "eager", False)
    if ctx.deferred:
        hidden, weight = inputs
        deferred = _deferred_gradients_impl if eager else _lce_deferred_op
        gh, gw = deferred(grad_loss, weight_state, hidden, weight, ctx.group_name, computed_hidden)
    elif eager and computed_weight and weight_state.dtype == ctx.weight_dtype == torch.float32 and _is_one(grad_loss):
        return (gh_state if computed_hidden else None, weight_state, gb_state if computed_bias else None)
    else:
        gh = _times(gh_state, grad_loss, gh_state.dtype) if computed_hidden else None
        gw = _times(weight_state, grad_loss, ctx.weight_dtype) if computed_weight else None
    gb = _times(gb_state, grad_loss, ctx.bias_dtype) if computed_bias else None
    return gh if computed_hidden else None, gw, gb


def _is_one(grad_loss: torch.Tensor) -> bool:
    """Whether the loss's gradient is exactly 1; False where its value is unknown (fake or meta tensors)."""
    if grad_loss.device.type == "meta" or is_fake(grad_loss):
        return False
    return bool(grad_loss == 1)


torch.library.register_autograd(
    "tridist::linear_cross_entropy", _backward_linear_cross_entropy, setup_context=_setup_linear_cross_entropy
)
_lce_eager = eager_autograd(_linear_cross_entropy_impl, _setup_linear_cross_entropy, _backward_linear_cross_entropy)


# ------------------------------------------------------------------------------------------- public API


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.cross_entropy(softcap(F.linear(hidden, weight, bias)).float(), labels, ...)` without the logits.

    hidden: [..., H] (any leading shape and strides); weight: [V, H], nn.Linear's layout (an LM head's
    weight); bias: [V] or None; labels: [...] integer class indices in [0, V) or ignore_index. hidden,
    weight and bias share one dtype (fp32, fp16 or bf16; under torch.autocast they are cast to its dtype,
    as F.linear's inputs are); the loss is fp32, each gradient has its input's dtype.

    reduction: "mean" over the non-ignored tokens (nan when all are ignored, as torch gives), "sum", or
    "none" (per-token losses of labels' shape, 0 where ignored). num_items_in_batch (transformers'
    convention, a number or a one-element tensor): the summed loss divided by it instead of the mean;
    only with reduction="mean". label_smoothing in [0, 1] as in F.cross_entropy; softcap > 0 applies
    Gemma-2's final logit soft-capping softcap * tanh(logits / softcap) before the loss.

    The logits are rounded to the input dtype once (as F.linear's output is), everything after them is
    fp32; the gradients of hidden and weight come from the logits' gradient rounded to the input dtype,
    through fp32-accumulated GEMMs. For mean/sum the gradients are computed in this call (one chunk of a
    bf16 head: up to its logits' gradient, the GEMMs in the backward; the module docstring says what that costs
    in memory), and the backward applies grad_output without a host sync; with an fp32 head `loss.backward()`
    may hand back the very tensors computed here. An fp16 head's gradients are computed in the backward, scaled
    by grad_output before their rounding (a loss scaler's scale keeps them in fp16's range, as in eager).

    Vocabulary-parallel (tensor parallel's LM head): `weight` (and `bias`) a DTensor on a 1-D mesh split on
    its rows, Shard(0); `hidden` and `labels` replicated on that mesh, or plain tensors equal on every rank of
    it. The loss is a plain tensor, the same on every rank; the weight's gradient comes back as its shard,
    hidden's whole (summed over the mesh). Other DTensor layouts are errors naming the fix.
    """
    op = "linear_cross_entropy"
    hidden, weight, bias = _apply_autocast(hidden, weight, bias)
    num_items_in_batch = _validate(
        op, hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, num_items_in_batch
    )
    (hidden, weight, labels, bias), shard = _local_inputs(op, hidden, weight, labels, bias)
    grad_enabled = torch.is_grad_enabled() and not _gradients_in_backward(reduction, hidden.dtype)
    args = (
        hidden, weight, labels, bias, num_items_in_batch, int(ignore_index), float(label_smoothing),
        None if softcap is None else float(softcap), reduction, *shard,
        grad_enabled and hidden.requires_grad, grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )
    loss, *_ = (_lce_op if torch.compiler.is_compiling() else _lce_eager)(*args)
    return loss


def _local_inputs(op, hidden, weight, labels, bias):
    """(hidden, weight, labels, bias) as the op takes them, plain tensors, and the vocabulary's split
    (vocab_start, vocab_size, process group name or None), for the layouts `_vocabulary_layout` accepts.
    The local tensors keep autograd: the weight's gradient comes back as its shard and hidden's as the whole
    gradient, summed over the ranks by the op."""
    vocab = weight.shape[0]
    if not any(is_dtensor(t) for t in (hidden, weight, labels, bias)):
        return (hidden, weight, labels, bias), (0, vocab, None)
    layout = _vocabulary_layout(op, hidden, weight, labels, bias)

    def local(t):
        return t.to_local() if is_dtensor(t) else t

    hidden, labels = local(hidden), local(labels)
    if layout == "replicated":
        return (hidden, weight.to_local(), labels, local(bias)), (0, vocab, None)
    # Shard(0) splits the rows as torch.chunk does: ceil(vocab / ranks) a rank, in rank order. (torch's offset
    # helper reads the mesh coordinate with .item() under torch.compile: a graph break.)
    mesh = weight.device_mesh
    vocab_start = min(mesh.get_local_rank() * -(-vocab // mesh.size()), vocab)
    return (hidden, weight.to_local(), labels, local(bias)), (vocab_start, vocab, mesh.get_group().group_name)


def _vocabulary_layout(op, hidden, weight, labels, bias) -> str:
    """How DTensor inputs (tensor parallel's global view) hold the vocabulary: "sharded" (a weight on a 1-D mesh
    split on its rows, ColwiseParallel's Shard(0) of an nn.Linear head, with bias split alike) or "replicated"
    (the whole weight on every rank); hidden and labels replicated on that mesh, or plain tensors that are the
    same on every rank of it. Any other layout raises the error naming the fix."""

    def describe(t):
        if not is_dtensor(t):
            return "a plain tensor"
        return f"a DTensor {list(getattr(t, 'placements', []))} on {getattr(t, 'device_mesh', 'its mesh')}"

    if not is_dtensor(weight) or weight.device_mesh.ndim != 1:
        raise TypeError(
            f"{op}: DTensor inputs are taken as a vocabulary-parallel LM head: weight a DTensor on a 1-D mesh (the "
            "tensor-parallel group) split on its rows, Shard(0), or replicated; hidden and labels replicated on that "
            f"mesh or plain. Got weight {describe(weight)}, hidden {describe(hidden)}, labels {describe(labels)}; "
            "redistribute them so, or pass local tensors"
        )
    mesh, (placement,) = weight.device_mesh, weight.placements

    def check_whole(name, t):
        if is_dtensor(t) and (t.device_mesh != mesh or not all(p.is_replicate() for p in t.placements)):
            raise ValueError(
                f"{op}: {name} is {describe(t)}; with the weight on {mesh} it must be whole on every rank of that mesh "
                f"(Replicate): gather it first, e.g. {name}.redistribute({name}.device_mesh, [Replicate()]) (a "
                "sequence-parallel hidden state is gathered before the LM head)"
            )

    check_whole("hidden", hidden)
    check_whole("labels", labels)
    if placement.is_replicate():
        check_whole("bias", bias)
        return "replicated"
    if not placement.is_shard(0):
        raise ValueError(
            f"{op}: weight is {describe(weight)}: split on its hidden dim, a vocabulary-parallel loss cannot use it; "
            "split the head on its rows (the vocabulary: ColwiseParallel on an nn.Linear head gives Shard(0))"
        )
    if bias is not None and not (is_dtensor(bias) and bias.device_mesh == mesh and bias.placements == weight.placements):
        raise ValueError(f"{op}: bias is {describe(bias)}; with a vocabulary-split weight it must be split alike "
                         f"(a DTensor [Shard(dim=0)] on {mesh}), as ColwiseParallel splits an nn.Linear's bias")
    return "sharded"


def _apply_autocast(hidden, weight, bias):
    """Under torch.autocast, hidden, weight and bias cast to its dtype (differentiably), as autocast casts
    F.linear's inputs (comm_matmul does the same for its matmuls)."""
    device_type = hidden.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return hidden.to(dtype), weight.to(dtype), (bias.to(dtype) if bias is not None else None)
    return hidden, weight, bias


def _validate(op, hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, num_items):
    """Raise a ValueError/TypeError naming the problem and its fix; return num_items_in_batch as a 0-d
    tensor on hidden's device (or None)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_dtype(op, "hidden", hidden)
    check_dtype(op, "weight", weight)
    if bias is not None:
        check_dtype(op, "bias", bias)
    check_same_device(op, hidden, weight, labels, bias, names=("hidden", "weight", "labels", "bias"))
    if hidden.dim() == 0:
        raise ValueError(f"{op}: hidden must be [..., hidden_size], got a scalar")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{op}: weight has shape {tuple(weight.shape)}; expected [vocab_size, {hidden.shape[-1]}] (nn.Linear's "
            f"[out_features, in_features], hidden's last dim {hidden.shape[-1]}); a [hidden, vocab] weight is passed as weight.t()"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise TypeError(
                f"{op}: {name} has dtype {t.dtype} but hidden has {hidden.dtype}; they must match, as in F.linear "
                f"(cast one, e.g. {name}.to(hidden.dtype), or run under torch.autocast, which casts both)"
            )
    if weight.shape[0] == 0:
        raise ValueError(
            f"{op}: weight has no rows (vocabulary size 0): is it an unmaterialised (e.g. ZeRO-3 sharded) parameter? "
            "Gather it before the call"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}; expected [{weight.shape[0]}] (one per vocabulary entry)")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"{op}: labels must be integer class indices (int64 or int32), got {labels.dtype}; "
            "cast them with labels.long() (probability targets are not supported)"
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{op}: labels have shape {tuple(labels.shape)} but hidden {tuple(hidden.shape)} has {tuple(hidden.shape[:-1])} "
            "tokens; labels must be hidden's shape without its last dim (shift the labels, not the hidden states, "
            "for a causal LM)"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap must be a positive number (Gemma-2 uses 30.0) or None for no soft-capping, got {softcap}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    if num_items is None:
        return None
    if reduction != "mean":
        raise ValueError(
            f"{op}: num_items_in_batch divides the summed loss (transformers' convention) and replaces the mean's "
            f"denominator; leave reduction='mean' with it (got reduction={reduction!r})"
        )
    if torch.is_tensor(num_items):
        if num_items.numel() != 1 or num_items.is_complex() or num_items.dtype == torch.bool:
            raise ValueError(f"{op}: num_items_in_batch must be a number or a one-element real tensor, got {num_items!r}")
        return num_items.reshape(()).to(hidden.device)
    if isinstance(num_items, bool) or not isinstance(num_items, (int, float)) or not num_items > 0:
        raise ValueError(f"{op}: num_items_in_batch must be a positive number (the count of non-ignored labels), got {num_items!r}")
    return torch.full((), num_items, dtype=torch.float32, device=hidden.device)


# ------------------------------------------------------------------------------- a causal LM's head + loss


class FusedLMHead(torch.nn.Linear):
    """An LM head (an nn.Linear around the same weight and bias Parameters) whose logits a causal LM's loss
    can skip. While a labelled call of its model is in flight (`capturing`, set by `fuse`'s hooks on the
    model) its forward keeps the hidden states for the model's `CausalLMLinearCrossEntropy` and returns a
    zero-width stand-in [..., 0] for the logits; at any other time it is nn.Linear. Under tensor parallel
    (ColwiseParallel on the head: its weight a DTensor split on the vocabulary, its input replicated by the
    style's hook) the loss runs vocabulary-parallel and the stand-in is a DTensor, which the style's output
    hook passes on. A head the call cannot skip (a local shard of the weight, hooks around a plain head, any
    other DTensor layout) computes ordinary logits and the loss runs unfused, as it would without fuse."""

    def __init__(self, linear: torch.nn.Linear):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameters: optimizers holding them stay valid
        self.register_parameter("bias", linear.bias)
        self.capturing = False  # set for a labelled call of the model
        self.stood_in = False  # this call's logits are the stand-in
        self.hidden: torch.Tensor | None = None  # the captured input, until the loss takes it

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.capturing and self._can_skip_logits(hidden):
            self.hidden, self.stood_in = hidden, True
            return hidden.new_empty((*hidden.shape[:-1], 0))
        return torch.nn.functional.linear(hidden, self.weight, self.bias)

    def _can_skip_logits(self, hidden: torch.Tensor) -> bool:
        """Plain tensors, every row of the vocabulary and nothing around the call; or a DTensor hidden state
        in the vocabulary-split layout linear_cross_entropy takes (`_vocabulary_layout`'s "sharded"). A weight
        holding part of the vocabulary as a plain tensor, or hooks that transform a plain head's input or
        output, need real logits."""
        if is_dtensor(self.weight) or is_dtensor(hidden):
            try:
                return is_dtensor(hidden) and _vocabulary_layout("FusedLMHead", hidden, self.weight, None,
                                                                 self.bias) == "sharded"
            except (TypeError, ValueError):  # a layout the fused loss cannot take: ordinary logits
                return False
        return self.weight.shape[0] == self.out_features and not (self._forward_hooks or self._forward_pre_hooks)


class CausalLMLinearCrossEntropy:
    """A transformers causal LM's `loss_function` (ForCausalLMLoss's contract: logits, labels, vocab_size,
    num_items_in_batch=None, ignore_index=-100, shift_labels=None) computed by `linear_cross_entropy` from
    the hidden states its `FusedLMHead` captured: labels shifted as ForCausalLMLoss shifts them (position t
    predicts label t + 1) unless `shift_labels` is given, `softcap` the final logit soft-capping the
    model's forward applies (Gemma-2's `final_logit_softcapping`) and `logit_scale` the factor it multiplies
    the logits by before (Cohere's `logit_scale`; Granite's 1 / `logits_scaling`); fuse's probe confirms
    both. A call whose head computed ordinary logits goes to `original`, the loss function this one replaced,
    whose name it keeps (functools.update_wrapper: code that recognises ForCausalLMLoss by name still does).

    The scale multiplies the hidden states (s * (h W^T) = (s * h) W^T without a bias; fuse refuses a head
    with a bias and a scale): one rounding of h to its dtype where eager rounds the logits once more, so
    the loss stays within the same bounds as eager's (exact for powers of two, in any dtype)."""

    def __init__(self, head: FusedLMHead, original, softcap: float | None, logit_scale: float = 1.0):
        functools.update_wrapper(self, original)
        self.head, self.original, self.softcap, self.logit_scale = head, original, softcap, logit_scale

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                 shift_labels=None, **kwargs):
        hidden, self.head.hidden = self.head.hidden, None
        if hidden is None:
            return self.original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        if self.logit_scale != 1.0:
            hidden = hidden * self.logit_scale
        return linear_cross_entropy(hidden, self.head.weight, shift_labels.to(hidden.device), bias=self.head.bias,
                                    ignore_index=ignore_index, softcap=self.softcap,
                                    num_items_in_batch=num_items_in_batch)
