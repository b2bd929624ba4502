"""RMSNorm (and the fused residual add) against the plain PyTorch reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from tridist import kernels
from tridist.kernels.reference import rms_norm_reference
from tridist.kernels.ops.rms_norm import MAX_SINGLE_PASS_COLS
from tridist.kernels.testing import assert_matches_reference, upcast

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Odd sizes on purpose: one element, one row, rows that do not fill a tile, a prime hidden size, a
# row that needs several column blocks (> MAX_SINGLE_PASS_COLS).
SHAPES = [(1, 1), (3, 5, 37), (2, 130), (1, 1, 4096), (2, MAX_SINGLE_PASS_COLS + 37)]
# More row tiles than the persistent backward grid has programs (4 off-GPU): every program loops,
# accumulating its weight-gradient partial across tiles (in registers, or in memory when multi-pass).
PERSISTENT_SHAPES = [(300, 100), (11, MAX_SINGLE_PASS_COLS + 37)]


def _inputs(shape, dtype, *, residual: bool, weight_dtype=None):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (torch.rand(shape[-1], dtype=weight_dtype or dtype) + 0.5).requires_grad_()
    r = torch.randn(shape, dtype=dtype, requires_grad=True) if residual else None
    return x, w, r


def _fwd_bwd(fn, x, w, r, grads):
    """Outputs and input gradients of fn(x, w, r) for the given output gradients."""
    out = fn(x, w, r)
    outs = out if isinstance(out, tuple) else (out,)
    leaves = [t for t in (x, w, r) if t is not None]
    input_grads = torch.autograd.grad(outs, leaves, grads[: len(outs)])
    return outs, input_grads


def _check(shape, dtype, *, residual, cast_to="weight", offset=0.0, weight_dtype=None, eps=1e-6):
    x, w, r = _inputs(shape, dtype, residual=residual, weight_dtype=weight_dtype)

    def ours(x, w, r):
        return kernels.rms_norm(x, w, eps, offset=offset, residual=r, cast_to=cast_to)

    def reference(x, w, r):
        return rms_norm_reference(x, w, eps, offset=offset, residual=r, cast_to=cast_to)

    ref_outs = reference(x, w, r)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    grads = [torch.randn_like(o) for o in ref_outs]
    outs, in_grads = _fwd_bwd(ours, x, w, r, grads)
    ref_outs, ref_grads = _fwd_bwd(reference, x, w, r, grads)
    gold_outs, gold_grads = _fwd_bwd(reference, upcast(x), upcast(w), upcast(r), [g.double() for g in grads])
    for name, o, ro, go in zip(("y", "h"), outs, ref_outs, gold_outs):
        assert_matches_reference(o, ro, go, name=name)
    for name, g, rg, gg in zip(("dx", "dw", "dresidual"), in_grads, ref_grads, gold_grads):
        assert_matches_reference(g, rg, gg, name=name)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_matches_reference(backend, shape, dtype, residual):
    _check(shape, dtype, residual=residual)


@pytest.mark.parametrize("shape", PERSISTENT_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_persistent_backward_loops_over_tiles(backend, shape, dtype):
    _check(shape, dtype, residual=True)


@pytest.mark.parametrize("cast_to", ["weight", "input"])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float16)], ids=str)
def test_cast_semantics_with_mixed_dtypes(backend, cast_to, dtypes):
    """Seed rounding ("weight") and Hugging Face rounding ("input") with input/weight dtypes that differ."""
    x_dtype, w_dtype = dtypes
    _check((4, 48), x_dtype, residual=False, cast_to=cast_to, weight_dtype=w_dtype)


@pytest.mark.parametrize("offset", [1.0])
def test_offset_weight(backend, offset):
    _check((3, 67), torch.bfloat16, residual=True, offset=offset)


def test_large_eps_of_the_seed_model(backend):
    """The seed model's RMSNorm really uses variance_epsilon = 1.0."""
    _check((2, 3, 40), torch.float32, residual=False, eps=1.0)


def test_non_contiguous_views(backend):
    """An [S, B, H] tensor seen as [B, S, H], a slice of a wider row, and a non-contiguous gradient."""
    base = torch.randn(6, 4, 80)  # [S, B, H + 16]
    x = base.transpose(0, 1)[..., :64].requires_grad_()  # no copy: strides (80, 320, 1)
    residual = torch.randn(4, 64, 6).transpose(1, 2)  # column stride 6: not even unit-stride rows
    w = torch.rand(64) + 0.5
    grad = torch.randn(6, 4, 64).transpose(0, 1)
    assert not x.is_contiguous() and not residual.is_contiguous() and not grad.is_contiguous()
    for r in (None, residual):
        y = kernels.rms_norm(x, w, residual=r)
        y = y[0] if r is not None else y
        y_ref = rms_norm_reference(x, w, residual=r)
        y_ref = y_ref[0] if r is not None else y_ref
        torch.testing.assert_close(y, y_ref)
        (dx,) = torch.autograd.grad(y, x, grad)
        (dx_ref,) = torch.autograd.grad(y_ref, x, grad)
        torch.testing.assert_close(dx, dx_ref)


def test_expanded_gradient(backend):
    """`y.sum().backward()` hands the backward a stride-0 (expanded) gradient."""
    x, w, _ = _inputs((5, 33), torch.float32, residual=False)
    kernels.rms_norm(x, w).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm_reference(x2, w2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_no_mutation_and_second_backward(backend):
    x, w, r = _inputs((4, 3, 50), torch.bfloat16, residual=True)
    saved = [t.detach().clone() for t in (x, w, r)]
    y, h = kernels.rms_norm(x, w, residual=r)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    gy_saved, gh_saved = gy.clone(), gh.clone()
    first = torch.autograd.grad((y, h), (x, w, r), (gy, gh), retain_graph=True)
    second = torch.autograd.grad((y, h), (x, w, r), (gy, gh))
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    for before, after in zip(saved, (x, w, r)):
        assert torch.equal(before, after.detach())
    assert torch.equal(gy, gy_saved) and torch.equal(gh, gh_saved)


def test_weight_gradient_is_deterministic(backend):
    x, w, _ = _inputs((64, 96), torch.float32, residual=False)
    g = torch.randn(64, 96)
    runs = [torch.autograd.grad(kernels.rms_norm(x, w), w, g)[0] for _ in range(3)]
    assert all(torch.equal(runs[0], other) for other in runs[1:])


def test_frozen_weight_gets_no_gradient(backend):
    x = torch.randn(3, 24, requires_grad=True)
    w = torch.rand(24) + 0.5  # requires_grad=False
    kernels.rms_norm(x, w).sum().backward()
    assert w.grad is None and x.grad is not None


def test_layer_matches_functional(backend):
    layer = kernels.FusedRMSNorm(40, eps=1e-5, offset=1.0)
    assert torch.equal(layer.weight + layer.offset, torch.ones(40))  # (offset + weight) starts at 1
    x = torch.randn(2, 7, 40)
    torch.testing.assert_close(layer(x), rms_norm_reference(x, layer.weight, 1e-5, offset=1.0))
    y, h = layer(x, residual=x)
    torch.testing.assert_close(h, 2 * x)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_hidden_size_65536(backend, residual):
    """The largest hidden size the issue names: 16 column blocks, bf16, forward and backward."""
    _check((2, 65536), torch.bfloat16, residual=residual)


def test_zero_rows():
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    y = kernels.rms_norm(x, w)
    y.sum().backward()
    assert y.shape == (0, 16) and torch.equal(w.grad, torch.zeros(16))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (torch.randn(2, 8), torch.ones(7)), "hidden size"),
        (lambda: (torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)), "float64"),
        (lambda: (torch.randint(0, 3, (2, 8)), torch.ones(8)), "int64"),
        (lambda: (torch.randn(2, 8), torch.ones(8, device="meta")), "one device"),
        (lambda: (torch.randn(2, 8), torch.ones(2, 8)), "1-D"),
    ],
)
def test_bad_input_errors(make, message):
    x, w = make()
    with pytest.raises((ValueError, TypeError), match=message):
        kernels.rms_norm(x, w)


def test_bad_residual_and_cast_errors():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="residual has shape"):
        kernels.rms_norm(x, w, residual=torch.randn(2, 9))
    with pytest.raises(ValueError, match="cast_to must be"):
        kernels.rms_norm(x, w, cast_to="output")
