"""linear_cross_entropy: loss and gradients against the exact (fp64) values within stated rounding bounds,
options, strides, chunking, memory (no [tokens, vocab] tensor), op registration, torch.compile, errors.

The exact values are the documented semantics, `F.cross_entropy(softcap(F.linear(h, w, b)), ...)`, by
autograd on fp64 copies of the inputs. The bounds (`_error_bounds`) follow the op's own arithmetic: the
chunk's logits from an fp32-accumulated GEMM rounded to the input dtype, everything after that in fp32,
the logits' gradient rounded to the input dtype, then GEMMs with fp32 accumulation. For fp32 inputs they
are within ~1e-4 relative, so a wrong scale, a dropped term or a lost chunk shows; for bf16/fp16 they are
dominated by the rounding of the logits (2**-8 / 2**-11 relative), which the op shares with eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tridist import kernels
from tridist.kernels import _common
from tridist.kernels.ops import linear_cross_entropy as lce_module
from tridist.kernels.testing import upcast

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
U32 = torch.finfo(torch.float32).eps / 2  # fp32 unit roundoff: one fp32 operation's relative error


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 tokens (39 tokens: 8, 8, 8, 8, 7): gradients accumulate over chunks, the last one short;
    the CPU path's slices of a chunk 3 tokens (8 = 3 + 3 + 2, 7 = 3 + 3 + 1)."""
    monkeypatch.setattr(lce_module, "MIN_CHUNK_TOKENS", 8)
    monkeypatch.setattr(lce_module, "MAX_CHUNK_TOKENS", 8)
    monkeypatch.setattr(lce_module, "UPCAST_TOKENS", 3)


@pytest.fixture
def small_blocks(monkeypatch):
    """Vocabulary blocks of 128 columns (1000 = 7 x 128 + 104): the online max and sum cross blocks."""
    monkeypatch.setattr(lce_module, "MAX_BLOCK_N", 128)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These tensors are tiny: a second intra-op thread only adds synchronisation, which costs milliseconds
    per op when the machine's cores are shared (the whole file ran 3x slower on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def torch_path(monkeypatch):
    """The CPU PyTorch implementation only, for what does not depend on the kernels (the chunk loop's
    Python, strides, autograd plumbing, registration): the interpreter is too slow to run everything twice."""
    monkeypatch.setattr(_common, "TRITON_INTERPRET", False)


@pytest.fixture(autouse=True)
def _packed_rows(monkeypatch):
    """Up to 16384 elements per tile: Triton's interpreter runs programs one after another at milliseconds
    each, so fewer, wider programs keep the file fast. Only the launch changes (a GPU packs rows of small
    vocabularies the same way); test_one_row_per_program runs the heuristic's GPU tiles."""
    monkeypatch.setattr(lce_module, "TARGET_TILE_ELEMENTS", 1 << 14)


# ------------------------------------------------------------------------------------------ references


def _softcap(x, softcap):
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def _reference(hidden, weight, labels, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
               softcap=None, num_items_in_batch=None):
    """The documented semantics written as eager code; on fp64 inputs, the exact values."""
    logits = _softcap(F.linear(hidden, weight, bias), softcap)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, weight.shape[0])
    options = {"ignore_index": ignore_index, "label_smoothing": label_smoothing}
    if num_items_in_batch is not None:  # transformers' fixed_cross_entropy
        return F.cross_entropy(logits, labels.reshape(-1), reduction="sum", **options) / num_items_in_batch
    loss = F.cross_entropy(logits, labels.reshape(-1), reduction=reduction, **options)
    return loss.reshape(labels.shape) if reduction == "none" else loss


def _unit(dtype):
    return torch.finfo(dtype).eps / 2  # one rounding to dtype, relative: 2**-24 fp32, 2**-11 fp16, 2**-8 bf16


def _subnormal_spacing(dtype):
    """The absolute error of one rounding below the normal range: fp16's 2**-24 matters here (a gradient
    scaled by 1 / tokens of a probability of 1e-6 is subnormal in fp16, in eager as in the op)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def _error_bounds(hidden, weight, labels, bias, grad_output, *, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, softcap=None, num_items_in_batch=None):
    """Elementwise bounds (fp64) on |ours - exact| for the loss and the gradients of hidden, weight, bias.

    Logits: an fp32-accumulated GEMM of H products (any order: within (H + 1) u32 of A = |h| |w| + |b|),
    rounded to the input dtype once, or twice where the BLAS rounds the product before adding the bias:
    dx = 2 u (|x| + |b|) + (H + 2) u32 A. With softcap, tanh is 1/c-Lipschitz, so z = c tanh(x / c) is off
    by dx plus its own fp32 evaluation (exp, two additions, a division, a product: 8 u32 c).
    Loss of a row: lse and z_label each move by at most delta = max |dz| of the row (softmax weights sum to
    1); the fp32 sum of V exponentials is within (V + 2M + 6) u32 relative (V additions; each exp's argument
    z - max within 2M u32, M = max |z|), an absolute error of lse; the remaining few operations add
    4 u32 (|lse| + M), the sum of z for label smoothing eps V u32 M. Reductions: an fp32 sum of N row losses,
    (N + 1) u32 of their magnitudes, and one division.
    Gradient of the logits, g = r (p - (1 - eps) y - eps / V) (1 - t^2) with r the row's scale: p = exp(z - lse)
    is off by a factor exp(rho) with rho = 2 delta + lse's error + (|z - lse| + 4) u32; t^2 by (2|t| + dz/c) dz/c;
    then 6 fp32 operations and the rounding to the input dtype (2 u: also covers the interpreter's truncating
    conversion). Gradients of hidden, weight, bias: those errors through |w|, |h| or a column sum, plus the
    fp32 GEMM's (K + 1) u32 over its K terms, plus the final rounding (2 u; twice when the backward multiplies
    a saved gradient by a grad_output other than 1). Every rounding to the input dtype also adds one
    subnormal spacing, absolute (`_subnormal_spacing`)."""
    dtype, (vocab, hidden_size) = hidden.dtype, weight.shape
    u, tiny = _unit(dtype), _subnormal_spacing(dtype)
    h = hidden.detach().double().reshape(-1, hidden_size)
    w = weight.detach().double()
    b = bias.detach().double() if bias is not None else torch.zeros(vocab, dtype=torch.float64)
    y = labels.reshape(-1)
    active = y != ignore_index
    n_tokens = y.shape[0]

    x = h @ w.T + b
    dz = 2 * (u * (x.abs() + b.abs()) + tiny) + (hidden_size + 2) * U32 * (h.abs() @ w.abs().T + b.abs())
    if softcap is not None:
        t = torch.tanh(x / softcap)
        z, dz = softcap * t, dz + 8 * U32 * softcap
        deriv, d_deriv = 1 - t * t, (2 * t.abs() + dz / softcap) * dz / softcap
    else:
        z, deriv, d_deriv = x, torch.ones_like(x), torch.zeros_like(x)
    delta = dz.amax(1, keepdim=True)
    big = z.abs().amax(1, keepdim=True)
    lse = torch.logsumexp(z, 1, keepdim=True)
    lse_error = (vocab + 2 * big + 6) * U32 + U32 * lse.abs()
    row_bound = 2 * delta + lse_error + 4 * U32 * (lse.abs() + big) + label_smoothing * vocab * U32 * big
    row_bound = torch.where(active[:, None], row_bound, 0.0)[:, 0]
    exact_rows = _reference(h, w, labels.reshape(-1), b, ignore_index=ignore_index, reduction="none",
                            label_smoothing=label_smoothing, softcap=softcap).abs()
    sum_bound = row_bound.sum() + (n_tokens + 1) * U32 * exact_rows.sum()

    scalar = reduction != "none"
    if num_items_in_batch is not None or reduction == "mean":
        denominator = float(num_items_in_batch if num_items_in_batch is not None else active.sum())
        loss_bound = sum_bound / denominator + U32 * exact_rows.sum() / denominator
        row_scale = torch.full((n_tokens,), 1 / denominator, dtype=torch.float64)
    elif reduction == "sum":
        loss_bound, row_scale = sum_bound, torch.ones(n_tokens, dtype=torch.float64)
    else:
        loss_bound, row_scale = row_bound.reshape(labels.shape), torch.ones(n_tokens, dtype=torch.float64)
    row_scale = (row_scale * grad_output.double().reshape(-1)).abs() if not scalar else row_scale * grad_output.double().abs()
    row_scale = torch.where(active, row_scale, 0.0)[:, None]

    p = torch.softmax(z, 1)
    target = F.one_hot(torch.where(active, y, 0), vocab).double()
    q = p - (1 - label_smoothing) * target - label_smoothing / vocab
    g = row_scale * q.abs() * deriv
    rho = 2 * delta + lse_error + ((z - lse).abs() + 4) * U32
    dp = p * torch.expm1(rho)
    dg = row_scale * (dp * deriv + (q.abs() + dp) * d_deriv)
    dg = dg + (2 * u + 6 * U32) * (g + dg) + tiny
    magnitude = g + dg
    rounds = 2 if scalar and float(grad_output) != 1.0 else 1
    gh = magnitude @ w.abs()
    bounds = {
        "hidden": dg @ w.abs() + (vocab + 1) * U32 * gh + rounds * (2 * u * gh + tiny),
        "weight": dg.T @ h.abs() + (n_tokens + 1) * U32 * (magnitude.T @ h.abs()),
        "bias": dg.sum(0) + (n_tokens + 1) * U32 * magnitude.sum(0),
    }
    bounds["weight"] += rounds * (2 * u * (magnitude.T @ h.abs()) + tiny)
    bounds["bias"] += rounds * (2 * u * magnitude.sum(0) + tiny)
    bounds["hidden"] = bounds["hidden"].reshape(hidden.shape)
    return loss_bound, bounds


def _assert_within(name, ours, exact, bound):
    assert ours.shape == exact.shape, (name, ours.shape, exact.shape)
    error = (ours.detach().double() - exact.detach().double()).abs()
    bad = ~(error <= bound)  # a nan fails too
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} elements beyond the rounding bound; e.g. at {i}: ours "
            f"{ours[i].item()!r}, exact {exact[i].item()!r}, bound {bound[i].item():.3g}"
        )


def _check(hidden, weight, labels, bias=None, *, grad_output=None, **options):
    """Loss and every requested gradient of linear_cross_entropy against the exact values, within the bounds;
    gradients in their inputs' dtypes."""
    leaves = {name: t for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias))
              if t is not None and t.requires_grad}
    loss = kernels.linear_cross_entropy(hidden, weight, labels, bias=bias, **options)
    wide = {name: upcast(t) for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias))}
    exact = _reference(wide["hidden"], wide["weight"], labels, wide["bias"], **options)
    assert loss.dtype == torch.float32 and loss.shape == exact.shape
    grad_output = torch.ones_like(loss) if grad_output is None else grad_output
    grads = torch.autograd.grad(loss, list(leaves.values()), grad_output)
    exact_grads = torch.autograd.grad(exact, [wide[name] for name in leaves], grad_output.double())
    loss_bound, bounds = _error_bounds(hidden, weight, labels, bias, grad_output, **options)
    _assert_within("loss", loss, exact, loss_bound)
    for (name, leaf), ours, gold in zip(leaves.items(), grads, exact_grads):
        assert ours.dtype == leaf.dtype, f"d{name}: dtype {ours.dtype}, the input's is {leaf.dtype}"
        _assert_within(f"d{name}", ours, gold, bounds[name])
    return loss, dict(zip(leaves, grads))


def _inputs(leading, hidden_size, vocab, dtype=torch.float32, *, bias=True, ignored=0.25, scale=1.0):
    """hidden ~ N(0, 1), weight ~ N(0, scale^2 / H) (logits ~ N(0, scale^2)), a bias, and about `ignored`
    of the labels set to ignore_index (-100)."""
    hidden = torch.randn(*leading, hidden_size).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size) * scale / max(hidden_size, 1) ** 0.5).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(vocab)).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, leading)
    drop = torch.rand(leading) < ignored
    if ignored < 1 and drop.numel():
        drop.view(-1)[0] = False  # at least one token counts: the mean stays finite
    labels[drop] = -100
    return hidden, weight, labels, b


# ------------------------------------------------------------------------------------------ the tests


# (leading shape, hidden size, vocabulary): one token and one class; a prime vocabulary; 39 tokens in
# three leading dims; a 32003 vocabulary (8 column blocks of 4096, the last partial). One chunk each
# (fewer tokens than MIN_CHUNK_TOKENS): the chunk loop has tests of its own below.
SHAPES = [((1,), 1, 1), ((5,), 8, 37), ((3, 1, 13), 16, 1000), ((2, 3), 8, 32003)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_exact(backend, shape, dtype):
    _check(*_inputs(*shape, dtype, scale=3.0))


OPTIONS = [
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.1},
    {"softcap": 2.0},  # logits ~ N(0, 9): tanh saturates, 1 - t^2 spans (0, 1]
    {"softcap": 2.0, "label_smoothing": 0.3, "reduction": "none"},
    {"num_items_in_batch": 23},
    {"num_items_in_batch": torch.tensor(23)},
    {"ignore_index": 3},  # another ignored value than -100; -100 is then invalid, so none are -100 here
]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_options(backend, options):
    hidden, weight, labels, bias = _inputs((3, 13), 16, 1000, scale=3.0)
    if "ignore_index" in options:
        labels = torch.where(labels == -100, 3, labels)
    grad_output = torch.randn(3, 13) if options.get("reduction") == "none" else None
    _check(hidden, weight, labels, bias, grad_output=grad_output, **options)


def test_label_smoothing_over_a_small_vocabulary(backend):
    """eps / V weighs every class: with 37 classes a wrong V (e.g. the shard's columns + 1) moves the loss by
    ~1e-3, far beyond fp32's bound; with 1000 it would hide under it."""
    _check(*_inputs((5,), 8, 37, scale=3.0), grad_output=torch.randn(5), label_smoothing=0.3, reduction="none")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_options_in_half_precision(backend, dtype):
    hidden, weight, labels, bias = _inputs((3, 13), 16, 1000, dtype, scale=3.0)
    _check(hidden, weight, labels, bias, softcap=2.0, label_smoothing=0.1)
    _check(hidden, weight, labels, bias, grad_output=torch.randn(3, 13), reduction="none", softcap=2.0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunks_and_vocabulary_blocks(backend, small_chunks, small_blocks, reduction):
    """Five chunks of tokens (the last short; gradients accumulated over them, in the forward for mean and
    recomputed in the backward for none), each row streamed in 8 blocks of 128 columns (the online max and
    sum across blocks), with softcap and label smoothing."""
    grad_output = torch.randn(3, 13) if reduction == "none" else None
    _check(*_inputs((3, 13), 16, 1000, scale=3.0), grad_output=grad_output, reduction=reduction, softcap=2.0,
           label_smoothing=0.1)


def test_one_row_per_program(backend, monkeypatch):
    """The heuristic's GPU tiles for a large vocabulary: one row per program, 4096-column blocks."""
    monkeypatch.setattr(lce_module, "TARGET_TILE_ELEMENTS", 4096)
    assert lce_module.heuristic_config(32003) == {"BLOCK_M": 1, "BLOCK_N": 4096, "num_warps": 8}
    _check(*_inputs((3,), 8, 32003, scale=3.0), label_smoothing=0.1)


def test_scaled_loss_and_frozen_inputs(torch_path, small_chunks):
    """A grad_output other than 1 (loss * 0.37, rounded a second time in the half dtype), a model without
    bias, and frozen hidden states or weight (their gradients are not computed)."""
    hidden, weight, labels, _ = _inputs((3, 13), 16, 1000, torch.bfloat16, bias=False, scale=3.0)
    _check(hidden, weight, labels, grad_output=torch.tensor(0.37))
    _check(hidden.detach(), weight, labels)
    _check(hidden, weight.detach(), labels, reduction="none", grad_output=torch.randn(3, 13))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_label_ignored(backend, reduction):
    """As torch: mean is nan (0 / 0), sum 0, none zeros; every gradient zero."""
    hidden, weight, labels, bias = _inputs((2, 5), 8, 37, ignored=1.0)
    loss = kernels.linear_cross_entropy(hidden, weight, labels, bias=bias, reduction=reduction)
    expected = _reference(hidden, weight, labels, bias, reduction=reduction)
    torch.testing.assert_close(loss, expected, equal_nan=True)
    grads = torch.autograd.grad(loss.sum(), (hidden, weight, bias))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_tokens(torch_path, reduction):
    hidden, weight, _, bias = _inputs((0, 4), 8, 37)
    labels = torch.zeros(0, 4, dtype=torch.long)
    loss = kernels.linear_cross_entropy(hidden, weight, labels, bias=bias, reduction=reduction)
    torch.testing.assert_close(loss, _reference(hidden, weight, labels, bias, reduction=reduction), equal_nan=True)
    grads = torch.autograd.grad(loss.sum(), (hidden, weight, bias), allow_unused=True)
    assert grads[0].shape == hidden.shape and torch.equal(grads[1], torch.zeros_like(weight))


def test_strided_inputs(torch_path, small_chunks):
    """hidden as an [S, B, H] tensor seen [B, S, H], a causal LM's shifted slice hidden[:, :-1] (neither
    flattens to one row stride: each chunk's tokens are gathered), a 1-D hidden (one token), a weight
    stored transposed, strided labels."""
    base = torch.randn(13, 3, 16)
    labels = torch.randint(0, 1000, (13, 3)).t()
    weight = (torch.randn(16, 1000) * 3 / 4).t().requires_grad_()  # [V, H] with strides (1, V)
    bias = torch.randn(1000, requires_grad=True)
    _check(base.transpose(0, 1).requires_grad_(), weight, labels, bias)
    full = torch.randn(3, 14, 16, requires_grad=True)
    _check(full[:, :-1], weight, labels, bias)
    _check(torch.randn(16, requires_grad=True), weight, torch.tensor(7), bias, reduction="none",
           grad_output=torch.tensor(0.5))


def test_chunk_rule():
    """Liger's rule (chunk logits about hidden's size), raised to min(4096, hidden) so that the weight
    gradient's fp32 accumulator is read and written in a few chunks, floor and ceiling, chunks evened out."""
    rule = lce_module.chunk_tokens
    assert rule(8192, 4096, 128256) == 4096  # Liger's target 262 (32 chunks): raised to 4096, 2 chunks
    assert rule(16384, 4096, 128256) == 4096  # 4 chunks where Liger's rule cuts 32 (the H100's 45 ms)
    assert rule(8000, 4096, 128256) == 4000  # 2 chunks of 4096 evened out
    assert rule(2048, 512, 32000) == 512  # target 33: raised to the hidden size, not 4096
    assert rule(16384, 2048, 32000) == 2048  # target 1049: raised to the hidden size
    assert rule(4096, 64, 32000) == lce_module.MIN_CHUNK_TOKENS  # a toy head narrower than the floor
    assert rule(100, 512, 32000) == 100  # fewer tokens than the floor: one chunk
    assert rule(65536, 8192, 32000) == 4096  # target 16777: the ceiling
    assert rule(5000, 4096, 1000) == 2500  # two chunks of the ceiling's 4096 evened out to 2500
    assert rule(0, 16, 10) == 1
    # A half-precision head's gradient: up to 2 x hidden tokens in one chunk, no fp32 accumulator
    assert rule(8192, 4096, 128256, fp32_accumulator=True) == 8192
    assert rule(4096, 2048, 32000, fp32_accumulator=True) == 4096
    assert rule(8193, 4096, 128256, fp32_accumulator=True) == rule(8193, 4096, 128256) == 2731  # 3 chunks


@pytest.mark.parametrize("hidden", [8, 64, 512, 2048, 4096, 8192])
@pytest.mark.parametrize("vocab", [1000, 32000, 128256, 262144])
def test_chunk_logits_never_outgrow_the_weight_or_the_hidden_input(hidden, vocab):
    """The memory bound the rule promises: one chunk's logits (chunk x vocab elements) are at most the
    weight's (vocab x hidden), Liger's hidden-sized buffer (tokens x hidden, plus one row of rounding up), or
    the 128-token floor's, at every token count; and it cuts no more chunks than the floor would."""
    for tokens in (1, 127, 1000, 2047, 2048, 4096, 8192, 16384, 65536, 131072):
        chunk = lce_module.chunk_tokens(tokens, hidden, vocab)
        assert chunk * vocab <= max(hidden * vocab, tokens * hidden + vocab, lce_module.MIN_CHUNK_TOKENS * vocab)
        floor = max(lce_module.MIN_CHUNK_TOKENS, min(lce_module.SPEED_CHUNK_TOKENS, hidden))
        assert -(-tokens // chunk) <= -(-tokens // floor)  # no more chunks than the floor's


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op allocates: outputs on a storage that
    none of the op's arguments holds (views, out= and in-place results, the interpreter's own aliases of
    kernel arguments are not allocations)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.allocated = []  # (elements, dtype) of every allocation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = set()
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                held.add(a.untyped_storage().data_ptr())
            elif isinstance(a, (torch.UntypedStorage, torch.TypedStorage)):
                held.add(a.data_ptr())
        fresh = [(t.numel(), t.dtype) for t in pytree.tree_leaves(out)
                 if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held]
        self.allocated += fresh
        self.largest = max([self.largest, *(n for n, _ in fresh)])
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_never_materialises_the_logits(backend, small_chunks, reduction):
    """Forward and backward (computed in the forward for mean, recomputed for none) allocate no tensor of
    tokens x vocab elements: only chunks of 8 x vocab. hidden is narrower than the token count here, so
    weight-sized tensors stay below it too. Eager does allocate it (the tracker sees what it should)."""
    hidden, weight, labels, bias = _inputs((2, 9), 16, 1000)
    n_logits = 18 * 1000
    with _LargestTensor() as fused:
        loss = kernels.linear_cross_entropy(hidden, weight, labels, bias=bias, reduction=reduction)
        torch.autograd.grad(loss.sum(), (hidden, weight, bias))
    assert 8 * 1000 <= fused.largest < n_logits
    with _LargestTensor() as eager:
        torch.autograd.grad(_reference(hidden, weight, labels, bias, reduction=reduction).sum(), (hidden, weight, bias))
    assert eager.largest >= n_logits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_half_precision_head_in_one_chunk(backend, small_chunks, dtype, reduction):
    """A half-precision head with at most 2 x hidden tokens: one chunk (past MAX_CHUNK_TOKENS, 8 here), whose
    logits are no larger than the fp32 [vocab, hidden] accumulator that chunking would need, and the weight's
    gradient from one GEMM in the weight's dtype: no fp32 weight-sized tensor. One token more: chunks and the
    accumulator again. Both within the rounding bounds, with a grad_output other than 1 (a scalar loss's is
    folded into the backward's GEMMs in one chunk, into the accumulator's rounding otherwise)."""
    hidden_size, vocab = 16, 1000
    for tokens, one_chunk in ((2 * hidden_size, True), (2 * hidden_size + 1, False)):
        hidden, weight, labels, bias = _inputs((tokens,), hidden_size, vocab, dtype, scale=3.0)
        grad_output = torch.randn(tokens) if reduction == "none" else torch.tensor(0.37)
        with _LargestTensor() as fused:
            _check(hidden, weight, labels, bias, grad_output=grad_output, reduction=reduction)
        fp32_weight_sized = [n for n, t in fused.allocated if t == torch.float32 and n == vocab * hidden_size]
        chunk_logits = [n for n, t in fused.allocated if t == dtype and n % vocab == 0 and n != vocab * hidden_size]
        if one_chunk:
            assert max(chunk_logits) == tokens * vocab <= 2 * vocab * hidden_size and not fp32_weight_sized
        else:
            assert max(chunk_logits) <= 8 * vocab and fp32_weight_sized  # 5 chunks of 7 tokens


def test_one_chunk_peak_is_no_higher_than_chunking(small_chunks, monkeypatch):
    """The one-chunk rule's memory claim, by torch's MemTracker over forward + backward on the kernels' path (the
    interpreter; a GPU allocates the same tensors) at the most tokens the rule puts in one chunk: one chunk
    (logits, then the weight-sized result) peaks no higher than chunks of 8 tokens with the fp32 accumulator. The
    CPU PyTorch path is not held to it: its fp32 slices of a chunk grow with the chunk up to UPCAST_TOKENS tokens."""
    from torch.distributed._tools.mem_tracker import MemTracker

    monkeypatch.setattr(_common, "TRITON_INTERPRET", True)
    hidden_size, vocab = 32, 1000
    tokens = lce_module.ONE_CHUNK_HIDDEN_MULTIPLE * hidden_size
    assert lce_module.chunk_tokens(tokens, hidden_size, vocab, fp32_accumulator=True) == tokens

    def peak(multiple):
        monkeypatch.setattr(lce_module, "ONE_CHUNK_HIDDEN_MULTIPLE", multiple)
        hidden, weight, labels, _ = _inputs((tokens,), hidden_size, vocab, torch.bfloat16, bias=False)
        tracker = MemTracker()
        tracker.track_external(hidden, weight)
        with tracker:
            kernels.linear_cross_entropy(hidden, weight, labels).backward()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    one_chunk, chunked = peak(lce_module.ONE_CHUNK_HIDDEN_MULTIPLE), peak(0)
    assert one_chunk <= chunked, (one_chunk, chunked)


@pytest.mark.parametrize("tokens", [32, 33], ids=["one chunk", "chunks"])
def test_half_precision_backward_needs_no_host_sync(torch_path, small_chunks, monkeypatch, tokens):
    """A half-precision head's backward never asks whether grad_output is 1 (`_is_one`: a host sync on CUDA) and
    handles any grad_output alike: one chunk (2 x hidden tokens) and chunks (one more), hidden, weight and bias
    trained or the head frozen. An fp32 head still hands its saved gradients over for grad_output 1 (one sync),
    which spares a weight-sized product."""
    asked = []

    def is_one(grad_loss):
        asked.append(grad_loss.dtype)
        return bool(grad_loss == 1)

    monkeypatch.setattr(lce_module, "_is_one", is_one)
    for dtype in (torch.bfloat16, torch.float16):
        hidden, weight, labels, bias = _inputs((tokens,), 16, 1000, dtype, scale=3.0)
        for grad_output in (None, torch.tensor(4.0), torch.tensor(0.37)):
            _check(hidden, weight, labels, bias, grad_output=grad_output)
            _check(hidden, weight.detach(), labels, grad_output=grad_output)
    assert not asked, asked
    hidden, weight, labels, bias = _inputs((tokens,), 16, 1000)
    _check(hidden, weight, labels, bias)
    assert asked


@pytest.mark.parametrize("tokens", [64, 65], ids=["one chunk", "chunks"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_loss_scalers_grad_output(torch_path, small_chunks, tokens, dtype):
    """grad_output 65,536 (torch.amp.GradScaler's initial scale) on an fp16 and a bf16 head: within the rounding
    bounds, nothing infinite, the scaled gradients themselves inside fp16's range. Folded into fp16 hidden rows the
    scale would overflow them (|h| > 1), and the logits' gradient computed for grad_output 1 would lose its
    entries below fp16's range: an fp16 head's gradients wait for the backward (`_gradients_in_backward`)."""
    hidden, weight, labels, bias = _inputs((tokens,), 32, 1000, dtype, scale=3.0)
    assert float(hidden.detach().abs().max()) * 65536 > torch.finfo(torch.float16).max
    # Most softmax entries / 64 tokens are under fp16's smallest normal (6.1e-5): rounded unscaled, they would be
    # subnormal, 2**-24 apart, an error 65,536 times that once scaled.
    _check(hidden, weight, labels, bias, grad_output=torch.tensor(65536.0))


@pytest.mark.parametrize("tokens", [32, 33], ids=["one chunk", "chunks"])
def test_backward_peak_does_not_grow_with_grad_output(small_chunks, monkeypatch, tokens):
    """MemTracker's peak over forward + backward of a bf16 head is the same for grad_output 1 and 0.37 (gradient
    accumulation's 1 / steps, a loss scaler's scale): the factor is folded into the backward's GEMMs (one chunk)
    or into the accumulator's rounding (chunks), never a product of a weight-sized gradient beside it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    monkeypatch.setattr(_common, "TRITON_INTERPRET", True)  # the kernels' path (the CPU path's slices aside)

    def peak(factor):
        hidden, weight, labels, _ = _inputs((tokens,), 16, 1000, torch.bfloat16, bias=False)
        tracker = MemTracker()
        tracker.track_external(hidden, weight)
        with tracker:
            (kernels.linear_cross_entropy(hidden, weight, labels) * factor).backward()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    assert peak(1.0) == peak(0.37)


def test_no_gradient_work_without_grad(backend, small_chunks):
    """Under no_grad (evaluation) the forward computes only the loss: no weight-sized gradient buffer."""
    hidden, weight, labels, bias = _inputs((3, 13), 16, 1000)
    with torch.no_grad(), _LargestTensor() as tracker:
        loss = kernels.linear_cross_entropy(hidden, weight, labels, bias=bias)
    assert tracker.largest < weight.numel()
    torch.testing.assert_close(loss, _reference(hidden, weight, labels, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_mutation_and_second_backward(backend, reduction, dtype):
    """bf16: 14 tokens in one chunk (the mean's gradient GEMMs in the backward); fp32: an accumulator that is the
    weight's gradient, handed over for grad_output 1."""
    hidden, weight, labels, bias = _inputs((2, 7), 8, 37, dtype)
    saved = [t.detach().clone() for t in (hidden, weight, labels, bias)]
    loss = kernels.linear_cross_entropy(hidden, weight, labels, bias=bias, reduction=reduction)
    grad = torch.randn_like(loss)
    grad_saved = grad.clone()
    first = torch.autograd.grad(loss, (hidden, weight, bias), grad, retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight, bias), grad, retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(torch.equal(a, b.detach()) for a, b in zip(saved, (hidden, weight, labels, bias)))
    assert torch.equal(grad, grad_saved)
    # loss.backward() twice (grad_output 1: an fp32 head's saved gradients themselves are handed over): accumulated
    # .grad is exactly twice the first, the saved gradients were not accumulated into.
    loss.sum().backward(retain_graph=True)
    once = [t.grad.clone() for t in (hidden, weight, bias)]
    loss.sum().backward()
    assert all(torch.equal(t.grad, 2 * g) for t, g in zip((hidden, weight, bias), once))
    if reduction == "mean":
        assert all(torch.equal(g, f) for g, f in zip(once, first)) or not torch.equal(grad, torch.ones_like(grad))


def test_autocast(torch_path):
    """Under torch.autocast the inputs are cast to its dtype, as F.linear's are; the loss stays fp32."""
    hidden, weight, labels, bias = _inputs((2, 7), 16, 37)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = kernels.linear_cross_entropy(hidden, weight, labels, bias=bias)
        (dh,) = torch.autograd.grad(loss, hidden)
    assert loss.dtype == torch.float32 and dh.dtype == torch.float32
    cast = [t.detach().to(torch.bfloat16).requires_grad_() for t in (hidden, weight, bias)]
    _check(cast[0], cast[1], labels, cast[2])  # what autocast hands the op
    torch.testing.assert_close(loss, kernels.linear_cross_entropy(cast[0], cast[1], labels, bias=cast[2]))


def test_ops_are_registered_and_pass_opcheck(torch_path):
    hidden = torch.randn(8, 3, 5).transpose(0, 1).requires_grad_()  # [3, 8, 5], not flattenable
    weight = torch.randn(37, 5, requires_grad=True)
    bias = torch.randn(37, requires_grad=True)
    labels = torch.randint(0, 37, (3, 8))
    labels[0, :3] = -100
    op, backward = torch.ops.tridist.linear_cross_entropy.default, torch.ops.tridist.linear_cross_entropy_backward.default
    torch.library.opcheck(op, (hidden, weight, labels, bias, None, -100, 0.1, 2.0, "mean", 0, 37, None, True, True, True))
    # The other signatures without the AOT-dispatch checks (seconds each); test_torch_compile_fullgraph
    # compiles the recomputing backward.
    cheap = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op, (hidden, weight, labels, None, torch.tensor(9), -100, 0.0, None, "mean", 0, 37, None, True, False, False),
                          test_utils=cheap)
    torch.library.opcheck(op, (hidden, weight, labels, bias, None, -100, 0.0, None, "none", 0, 37, None, False, False, False),
                          test_utils=cheap)
    grad = torch.randn(3, 8)
    torch.library.opcheck(backward, (grad, hidden.detach(), weight.detach(), labels, bias.detach(), -100, 0.0, 3.0,
                                     0, 37, None, True, True, True), test_utils=cheap)
    # A bf16 head: 24 tokens in one chunk (at most 2 x hidden 16), whose forward leaves the logits' gradient (the
    # fake must give its shape and dtype) for the deferred backward op; 40 tokens in chunks (an fp32 accumulator).
    for leading in ((3, 8), (5, 8)):
        h, w = torch.randn(*leading, 16).to(torch.bfloat16), torch.randn(37, 16).to(torch.bfloat16)
        torch.library.opcheck(op, (h.requires_grad_(), w.requires_grad_(), torch.randint(0, 37, leading), None, None,
                                   -100, 0.0, None, "mean", 0, 37, None, True, True, False), test_utils=cheap)
    bf16 = lambda *shape: torch.randn(*shape).to(torch.bfloat16)  # noqa: E731
    torch.library.opcheck(torch.ops.tridist.linear_cross_entropy_deferred_backward.default,
                          (torch.tensor(0.5), bf16(24, 37), bf16(3, 8, 16), bf16(37, 16), None, True), test_utils=cheap)


def test_torch_compile_fullgraph(torch_path):
    """One graph holding the op (mean, with its gradients from the forward) and its recomputing variant
    (none): loss and gradients equal to the eager calls."""

    def losses(hidden, weight, labels, bias):
        mean = kernels.linear_cross_entropy(hidden, weight, labels, bias=bias, softcap=2.0)
        rows = kernels.linear_cross_entropy(hidden, weight, labels, bias=bias, reduction="none", label_smoothing=0.1)
        return mean + (rows * torch.arange(14.0).reshape(2, 7)).sum()

    compiled = torch.compile(losses, fullgraph=True, backend="aot_eager")
    # fp32 (gradients in the forward, an accumulator) and a bf16 head in one chunk (14 <= 2 x 8 tokens: its
    # gradient GEMMs in the backward, the deferred op in the graph); the same ops run both ways: equal.
    for dtype in (torch.float32, torch.bfloat16):
        inputs = _inputs((2, 7), 8, 37, dtype)
        expected = losses(*inputs)
        expected_grads = torch.autograd.grad(expected * 0.5, (inputs[0], inputs[1], inputs[3]))
        out = compiled(*inputs)
        grads = torch.autograd.grad(out * 0.5, (inputs[0], inputs[1], inputs[3]))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, expected_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_labels_out_of_range_raise(torch_path):
    hidden, weight, labels, _ = _inputs((4,), 8, 37)
    for bad in (37, -1):
        labels[1] = bad
        with pytest.raises(RuntimeError, match=r"labels must be class indices in \[0, 37\) or ignore_index"):
            kernels.linear_cross_entropy(hidden, weight, labels)


def test_int32_labels(backend):
    hidden, weight, labels, bias = _inputs((2, 7), 8, 37)
    torch.testing.assert_close(kernels.linear_cross_entropy(hidden, weight, labels.int(), bias=bias),
                               kernels.linear_cross_entropy(hidden, weight, labels, bias=bias))


class DTensor(torch.Tensor):
    """Stands for torch's DTensor, which the op recognises by its type's name (no process group needed)."""


def _call(hidden=None, weight=None, labels=None, **options):
    hidden = torch.randn(2, 3, 8) if hidden is None else hidden
    weight = torch.randn(37, 8) if weight is None else weight
    labels = torch.zeros(2, 3, dtype=torch.long) if labels is None else labels
    return kernels.linear_cross_entropy(hidden, weight, labels, **options)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _call(weight=torch.randn(8, 37)), r"expected \[vocab_size, 8\].*weight.t\(\)"),
        (lambda: _call(weight=torch.randn(37)), r"expected \[vocab_size, 8\]"),
        (lambda: _call(weight=torch.randn(0, 8)), "no rows"),
        (lambda: _call(labels=torch.zeros(6, dtype=torch.long)), "labels must be hidden's shape"),
        (lambda: _call(labels=torch.zeros(2, 3)), r"integer class indices.*labels.long\(\)"),
        (lambda: _call(weight=torch.randn(37, 8, dtype=torch.bfloat16)), r"must match.*autocast"),
        (lambda: _call(bias=torch.randn(36)), r"bias has shape \(36,\); expected \[37\]"),
        (lambda: _call(hidden=torch.randn(2, 3, 8).double(), weight=torch.randn(37, 8).double()), "float64"),
        (lambda: _call(weight=torch.randn(37, 8, device="meta")), "one device"),
        (lambda: _call(hidden=torch.tensor(1.0)), "scalar"),
        # (real DTensors: tests/distributed/linear_cross_entropy_worker.py)
        (lambda: _call(hidden=torch.randn(2, 3, 8).as_subclass(DTensor)), "taken as a vocabulary-parallel LM head"),
        (lambda: _call(reduction="avg"), "reduction must be one of"),
        (lambda: _call(softcap=0.0), "softcap must be a positive number"),
        (lambda: _call(softcap=-30.0), "softcap must be a positive number"),
        (lambda: _call(label_smoothing=1.5), r"label_smoothing must be in \[0, 1\]"),
        (lambda: _call(ignore_index=-100.0), "ignore_index must be an int"),
        (lambda: _call(num_items_in_batch=4, reduction="sum"), "leave reduction='mean'"),
        (lambda: _call(num_items_in_batch=0), "positive number"),
        (lambda: _call(num_items_in_batch=torch.tensor([3, 4])), "one-element"),
    ],
)
def test_bad_input_errors(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def _spy_on_times_kernel(monkeypatch) -> list:
    """The grids `_times_kernel` is launched with from now on (the launches still run)."""
    launches, kernel = [], lce_module._times_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(lce_module, "_times_kernel", Spy())
    return launches


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or _common.TRITON_INTERPRET, reason="compiled Triton on a GPU"))])
@pytest.mark.parametrize("src_dtype,dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                             (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float16)])
def test_times_is_the_fp32_product_rounded_once(monkeypatch, src_dtype, dtype, device):
    """`_times` (grad_output applied in the backward): the Triton pass on a contiguous tensor, two blocks and a
    partial one, equals the fp32 product rounded once to `dtype`, bit for bit (to nearest even; toward zero in
    bf16 under the interpreter: `converts_toward_zero`), with a loss scaler's 65,536 that fp16 could not hold as a
    factor; a transposed tensor takes torch's mul."""
    from tridist.kernels.testing import converts_toward_zero, round_to

    launches = _spy_on_times_kernel(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    t = (torch.randn(2 * lce_module.TIMES_BLOCK + 3, generator=generator) * 1e-3).to(device, src_dtype)
    launched = 2 if _common.use_triton(t) else 0
    for factor in (0.37, 65536.0):
        grad_loss = torch.tensor(factor, device=device)
        expected = round_to(t.float() * torch.tensor(factor, dtype=torch.float32, device=device), dtype,
                            toward_zero=converts_toward_zero(t.device, dtype))
        out = lce_module._times(t, grad_loss, dtype)
        assert out.dtype == dtype and torch.equal(out, expected)
    assert len(launches) == launched
    square = t[:64 * 64].reshape(64, 64).t()  # not contiguous: torch's mul, same values
    out = lce_module._times(square, torch.tensor(0.37, device=device), dtype)
    assert torch.equal(out, (square.float() * 0.37).to(dtype)) and len(launches) == launched


def test_times_takes_torch_mul_for_fake_and_traced_tensors(monkeypatch):
    """`_times` launches its Triton pass on real tensors only: a fake tensor (FakeTensorMode, a compiled graph's
    shape propagation) or a traced call (torch.compile: the graph keeps the mul, which inductor fuses) take torch's
    mul. Under the interpreter the pass would otherwise run (it does for the real call at the end)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    launches = _spy_on_times_kernel(monkeypatch)
    with FakeTensorMode():
        out = lce_module._times(torch.empty(8, 5), torch.tensor(2.0), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (8, 5)
    traced = torch.compile(lambda t, g: lce_module._times(t, g, torch.bfloat16), fullgraph=True, backend="aot_eager")
    t, g = torch.randn(8, 5), torch.tensor(2.0)
    assert torch.equal(traced(t, g), (t * 2.0).to(torch.bfloat16))
    assert launches == []
    lce_module._times(t, g, torch.bfloat16)
    assert len(launches) == (1 if _common.TRITON_INTERPRET else 0)
