"""RMSNorm (and the fused residual add) against the plain PyTorch reference, forward and backward.

Two kinds of check:
- accuracy against the eager reference and an fp64 gold (`_check`, kernels.testing's criterion);
- the documented semantics, rounding included (`_check_documented`): y and h are bit for bit what the
  module docstring defines from the kernel's own fp32 1/rms, and every gradient is the exact gradient
  computed in fp32 and rounded once. The accuracy criterion cannot see a skipped documented rounding
  or a computation in a half dtype (both stay within eager's own error); this one does.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tridist import kernels
from tridist.kernels import configs
from tridist.kernels.ops import rms_norm as rms_norm_module
from tridist.kernels.ops.rms_norm import MAX_SINGLE_PASS_COLS
from tridist.kernels.reference import rms_norm_reference
from tridist.kernels.testing import (
    assert_matches_reference,
    assert_rounded_once,
    converts_toward_zero,
    round_to,
    upcast,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HALF = (torch.float16, torch.bfloat16)
U32 = torch.finfo(torch.float32).eps / 2  # fp32 unit roundoff: one fp32 operation's relative error

# Odd sizes on purpose: one element, one row, rows that do not fill a tile, a prime hidden size, a
# row that needs several column blocks (> MAX_SINGLE_PASS_COLS).
SHAPES = [(1, 1), (3, 5, 37), (2, 130), (1, 1, 4096), (2, MAX_SINGLE_PASS_COLS + 37)]
# More row tiles than the persistent backward grid has programs (4 off-GPU): every program loops,
# accumulating its weight-gradient partial across tiles (in registers, or in memory when multi-pass).
PERSISTENT_SHAPES = [(300, 100), (11, MAX_SINGLE_PASS_COLS + 37)]


def _rows(shape, dtype):
    """Random rows whose rms spans 1e-3 to 10: at rms 1e-3, mean(x^2) = 1e-6 = eps, so a dropped or
    misplaced eps moves the result by ~30%; rows of rms ~1 alone would hide it under 1e-6."""
    scale = 10 ** torch.empty(*shape[:-1], 1).uniform_(-3, 1)
    return (torch.randn(shape) * scale).to(dtype)


def _inputs(shape, dtype, *, residual: bool, weight_dtype=None, residual_dtype=None):
    x = _rows(shape, dtype).requires_grad_()
    w = (torch.rand(shape[-1], dtype=weight_dtype or dtype) + 0.5).requires_grad_()
    r = torch.randn(shape, dtype=residual_dtype or dtype, requires_grad=True) if residual else None
    return x, w, r


def _fwd_bwd(fn, x, w, r, grads):
    """Outputs and input gradients of fn(x, w, r) for the given output gradients."""
    out = fn(x, w, r)
    outs = out if isinstance(out, tuple) else (out,)
    leaves = [t for t in (x, w, r) if t is not None]
    input_grads = torch.autograd.grad(outs, leaves, grads[: len(outs)])
    return outs, input_grads


def _check(x, w, r=None, *, grads=None, cast_to="weight", offset=0.0, eps=1e-6):
    """y (and h), dx, dw (and dresidual) against the eager reference and its fp64 gold."""

    def ours(x, w, r):
        return kernels.rms_norm(x, w, eps, offset=offset, residual=r, cast_to=cast_to)

    def reference(x, w, r):
        return rms_norm_reference(x, w, eps, offset=offset, residual=r, cast_to=cast_to)

    ref_outs = reference(x, w, r)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    grads = grads or [torch.randn_like(o) for o in ref_outs]
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
    _check(*_inputs(shape, dtype, residual=residual))


@pytest.mark.parametrize("shape", PERSISTENT_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_persistent_backward_loops_over_tiles(backend, shape, dtype):
    _check(*_inputs(shape, dtype, residual=True))


@pytest.mark.parametrize("cast_to", ["weight", "input"])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float16)], ids=str)
def test_cast_semantics_with_mixed_dtypes(backend, cast_to, dtypes):
    """Seed rounding ("weight") and Hugging Face rounding ("input") with input/weight dtypes that differ."""
    x_dtype, w_dtype = dtypes
    _check(*_inputs((4, 48), x_dtype, residual=False, weight_dtype=w_dtype), cast_to=cast_to)


def test_offset_weight(backend):
    _check(*_inputs((3, 67), torch.bfloat16, residual=True), offset=1.0)


def test_large_eps_of_the_seed_model(backend):
    """The seed model's RMSNorm really uses variance_epsilon = 1.0."""
    _check(*_inputs((2, 3, 40), torch.float32, residual=False), eps=1.0)


def test_non_contiguous_views(backend):
    """An [S, B, H] tensor seen as [B, S, H], a slice of a wider row, non-contiguous gradients of y and h:
    every output and every gradient (x, weight, residual) at the real launch limits."""
    base = torch.randn(6, 4, 80)  # [S, B, H + 16]
    x = base.transpose(0, 1)[..., :64].requires_grad_()  # no copy: strides (80, 320, 1)
    residual = torch.randn(4, 64, 6).transpose(1, 2).requires_grad_()  # column stride 6
    w = (torch.rand(128) + 0.5)[::2].requires_grad_()  # a strided weight (stride 2)
    grad_y = torch.randn(6, 4, 64).transpose(0, 1)
    grad_h = torch.randn(4, 64, 6).transpose(1, 2)
    assert not any(t.is_contiguous() for t in (x, residual, w, grad_y, grad_h))
    _check(x, w, grads=[grad_y])
    _check(x, w, residual, grads=[grad_y, grad_h])


def test_views_whose_rows_need_more_than_two_strides(backend):
    """x, residual and the gradients with four dims stored in reverse order: their three leading dims merge
    into no fewer than three row strides, so the launcher copies them once (and only them)."""
    x = _transposed(_rows((2, 3, 4, 24), torch.float32)).requires_grad_()
    w = (torch.rand(24) + 0.5).requires_grad_()
    r = _transposed(torch.randn(2, 3, 4, 24)).requires_grad_()
    _check(x, w, grads=[_transposed(torch.randn(x.shape))])
    _check(x, w, r, grads=[_transposed(torch.randn(x.shape)), _transposed(torch.randn(x.shape))])


def test_expanded_gradient(backend):
    """`y.sum().backward()` hands the backward a stride-0 (expanded) gradient."""
    x, w, _ = _inputs((5, 33), torch.float32, residual=False)
    _check(x, w, grads=[torch.ones(()).expand(5, 33)])


# ------------------------------------------------------------------------- documented semantics


@pytest.fixture
def small_blocks(monkeypatch):
    """Launch limits shrunk so that widths of tens of columns reach every branch: forward single pass up
    to 32 columns, backward up to 16, 8-column blocks beyond, 32-element tiles (several programs, each
    looping over row tiles in the persistent backward). Only these constants change, not the kernels."""
    for name, value in [
        ("MAX_SINGLE_PASS_COLS", 32), ("MAX_SINGLE_PASS_COLS_BACKWARD", 16),
        ("MULTI_PASS_BLOCK_N", 8), ("TARGET_TILE_ELEMENTS", 32),
    ]:
        monkeypatch.setattr(rms_norm_module, name, value)
    forget_launch_plans()  # made under the real limits: the heuristic and the plans are cached
    yield
    forget_launch_plans()  # ... and those made under the shrunk ones must not outlive them


def forget_launch_plans():
    configs.clear_cache()
    rms_norm_module._cached_heuristic_config.cache_clear()


# 12: single pass both ways (padded to 16); 24: single-pass forward, multi-pass backward (3 blocks);
# 37: multi-pass both ways (5 blocks, the last partial).
WIDTHS = [12, 24, 37]


def _convert(t, dtype):
    """fp32 -> dtype as the op under test converts (kernels.testing.converts_toward_zero)."""
    return round_to(t, dtype, toward_zero=converts_toward_zero(t.device, dtype))


def _documented_forward(x, w, r, rstd, *, offset, cast_to):
    """(y, h, the normalised row after its documented rounding, in fp32), exactly as the module docstring
    defines them from the kernel's own fp32 1/rms: each step is one IEEE fp32 operation (reproducible bit
    for bit) or one conversion."""
    h_dtype = torch.promote_types(x.dtype, r.dtype) if r is not None else x.dtype
    h = _convert(x.float() + r.float(), h_dtype) if r is not None else x.detach()
    normed = h.float() * rstd.unsqueeze(-1)
    round_dtype = w.dtype if cast_to == "weight" else h_dtype
    if round_dtype in HALF:
        normed = _convert(normed, round_dtype).float()
    if cast_to == "weight":
        y_dtype = w.dtype if w.dtype in HALF else torch.float32
    else:
        y_dtype = torch.promote_types(h_dtype, w.dtype)
    return _convert(normed * (w.float() + offset), y_dtype), h, normed


def _check_documented(x, w, r, *, dy, dh=None, eps=1e-6, offset=0.0, cast_to="weight"):
    """Forward bit for bit, 1/rms and every gradient within stated fp32 error bounds, rounded once.
    dy (and dh) are converted to the dtype of y (and h)."""
    # The fp32 1/rms is the last tensor the autograd function saved for its backward.
    if r is None:
        y = rms_norm_module.rms_norm(x, w, eps, offset=offset, cast_to=cast_to)
        outs, out_grads, leaves = (y,), (dy.to(y.dtype),), (x, w)
    else:
        y, h = rms_norm_module.rms_norm(x, w, eps, offset=offset, residual=r, cast_to=cast_to)
        outs, out_grads, leaves = (y, h), (dy.to(y.dtype), dh.to(h.dtype)), (x, w, r)
    rstd = y.grad_fn.saved_tensors[-1]
    y_doc, h_doc, normed_doc = _documented_forward(x, w, r, rstd, offset=offset, cast_to=cast_to)
    assert y.dtype == y_doc.dtype and torch.equal(y, y_doc), f"y: {int((y != y_doc).sum())} elements differ"
    if r is not None:
        assert h.dtype == h_doc.dtype and torch.equal(h, h_doc), f"h: {int((h != h_doc).sum())} elements differ"

    # 1/rms of the stream h: a sum of n fp32 squares in any order is within (n + 1) u of exact, rsqrt
    # halves that and adds at most 2 ulp of its own (libm, or rsqrt.approx on a GPU).
    n = x.shape[-1]
    h64 = h_doc.double()
    rstd64 = torch.rsqrt(h64.pow(2).mean(-1) + eps)
    assert ((rstd.double() - rstd64).abs() <= (n / 2 + 4) * U32 * rstd64).all(), "1/rms"

    grads = dict(zip(("x", "w", "r"), torch.autograd.grad(outs, leaves, out_grads)))
    # dx = rstd (dn - normed mean(dn normed)), dn = dy (offset + w), from the saved fp32 1/rms. fp32 error:
    # a few roundings per element plus the n-term row sum: below (n + 8) u times the terms' magnitudes.
    rs, dy64 = rstd.double().unsqueeze(-1), out_grads[0].double()
    normed64 = h64 * rs
    dn = dy64 * (w.double() + offset)
    dx = (dn - normed64 * (dn * normed64).mean(-1, keepdim=True)) * rs
    bound = (n + 8) * U32 * rs * (dn.abs() + normed64.abs() * (dn * normed64).abs().mean(-1, keepdim=True))
    if r is not None:
        dx = dx + out_grads[1].double()
        bound = bound + U32 * dx.abs()  # one more fp32 addition
    # The kernel writes dx in h's dtype; a narrower x or residual gets it converted by PyTorch (to nearest).
    truncates = converts_toward_zero(x.device, h_doc.dtype)
    for name in ("x", "r"):
        if name in grads:
            assert_rounded_once(grads[name], dx, bound=bound, toward_zero=truncates, name=f"d{name}")
    # dw = sum over rows of dy * (normed after its documented rounding); an fp32 sum of `rows` products in
    # any order is within (rows + 1) u of exact. PyTorch converts the fp32 sum to the weight's dtype.
    terms = (dy64 * normed_doc.double()).reshape(-1, n)
    assert_rounded_once(grads["w"], terms.sum(0), bound=(terms.shape[0] + 2) * U32 * terms.abs().sum(0), name="dw")


# (x, weight, residual dtypes, cast_to, offset): each rounding rule of the docstring, and inputs of
# different dtypes (h takes the promoted dtype; each input's gradient comes back in its own dtype).
ROUNDING_CASES = [
    (torch.bfloat16, torch.bfloat16, None, "weight", 0.0),  # seed: normed rounded to the weight's dtype
    (torch.float32, torch.bfloat16, None, "weight", 0.0),  # ... also for an fp32 input; y bf16
    (torch.bfloat16, torch.float32, None, "weight", 1.0),  # fp32 weight: no rounding, y fp32; Gemma offset
    (torch.bfloat16, torch.float32, None, "input", 0.0),  # HF: rounded to bf16, y and dw fp32 show it
    (torch.float32, torch.float16, None, "input", 0.0),  # fp32 input: no rounding; y and dx stay fp32
    (torch.float16, torch.float16, torch.float16, "input", 1.0),  # fused add, all fp16
    (torch.bfloat16, torch.bfloat16, torch.float32, "input", 0.0),  # h fp32: dx bf16, dresidual fp32
    (torch.float16, torch.float32, torch.bfloat16, "weight", 0.0),  # fp16 + bf16: h fp32
    (torch.float32, torch.bfloat16, torch.bfloat16, "weight", 1.0),  # h fp32, dresidual bf16
]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("x_dtype, w_dtype, r_dtype, cast_to, offset", ROUNDING_CASES, ids=str)
def test_documented_rounding_and_mixed_dtypes(backend, small_blocks, width, x_dtype, w_dtype, r_dtype, cast_to, offset):
    residual = r_dtype is not None
    x, w, r = _inputs((2, 5, width), x_dtype, residual=residual, weight_dtype=w_dtype, residual_dtype=r_dtype)
    dh = torch.randn(x.shape) if residual else None
    _check_documented(x, w, r, dy=torch.randn(x.shape), dh=dh, offset=offset, cast_to=cast_to)


def _transposed(t):
    """`t` with its dims stored in reverse order: every stride differs from a contiguous tensor's."""
    reverse = list(reversed(range(t.dim())))
    return t.permute(reverse).contiguous().permute(reverse)


def _layout(shape, layout):
    """A random float32 tensor of `shape` in the given memory layout."""
    if layout == "contiguous":
        return torch.randn(shape)
    if layout == "transposed":
        return _transposed(torch.randn(shape))
    if layout == "expanded":  # one row seen by every row (stride 0), as `y.sum(0)` hands down
        return torch.randn(shape[-1]).expand(shape)
    raise ValueError(layout)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(
    "dy_layout, dh_layout", [("transposed", "expanded"), ("expanded", "transposed"), ("contiguous", "contiguous")]
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_backward_gradient_layouts(backend, small_blocks, width, dy_layout, dh_layout, residual):
    """x transposed (column stride != 1), residual contiguous, dy/dh transposed or expanded, offset 1:
    every gradient, every branch."""
    shape = (3, 4, width)
    x = _transposed(_rows(shape, torch.float32)).requires_grad_()
    w = (torch.rand(width) + 0.5).requires_grad_()
    r = _layout(shape, "contiguous").requires_grad_() if residual else None  # another layout than x's
    dh = _layout(shape, dh_layout) if residual else None
    _check_documented(x, w, r, dy=_layout(shape, dy_layout), dh=dh, offset=1.0)


@pytest.mark.parametrize("eps", [1e-6, 1.0])
def test_small_rms_rows_show_eps(backend, small_blocks, eps):
    """Rows with rms 1e-3 (eps-dominated at 1e-6) and the seed model's variance_epsilon = 1.0."""
    x = (1e-3 * torch.randn(4, 37)).requires_grad_()
    w = (torch.rand(37) + 0.5).requires_grad_()
    _check_documented(x, w, None, dy=torch.randn(4, 37), eps=eps)


# ------------------------------------------------------------------------------------------ the rest


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


def test_weight_gradient_reduction_uses_no_atomics():
    """The weight gradient is deterministic because each program owns a row of the partial buffer and
    the rows are summed in a fixed order: no atomics. Off a GPU the interpreter runs programs one after
    another, so repeated runs would agree even with atomics; what can be checked here is the mechanism."""
    assert "tl.atomic_" not in inspect.getsource(rms_norm_module)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programs run concurrently only on a GPU")
def test_weight_gradient_is_bitwise_deterministic_on_gpu():
    x = torch.randn(8192, 1024, device="cuda", requires_grad=True)
    w = torch.rand(1024, device="cuda", requires_grad=True)
    g = torch.randn(8192, 1024, device="cuda")
    runs = [torch.autograd.grad(kernels.rms_norm(x, w), w, g)[0] for _ in range(5)]
    assert all(torch.equal(runs[0], other) for other in runs[1:])


def test_frozen_weight_gets_no_gradient(backend):
    x = torch.randn(3, 24, requires_grad=True)
    w = torch.rand(24) + 0.5  # requires_grad=False
    kernels.rms_norm(x, w).sum().backward()
    assert w.grad is None and x.grad is not None


def test_layer_matches_functional(backend):
    layer = kernels.FusedRMSNorm(40, eps=1e-5, offset=1.0)
    assert torch.equal(layer.weight + layer.offset, torch.ones(40))  # (offset + weight) starts at 1
    with torch.no_grad():
        layer.weight.uniform_(-0.5, 0.5)  # away from 1, so that y shows the weight and the offset
    x = torch.randn(2, 7, 40)
    torch.testing.assert_close(layer(x), rms_norm_reference(x, layer.weight, 1e-5, offset=1.0))
    y, h = layer(x, residual=x)
    y_ref, h_ref = rms_norm_reference(x, layer.weight, 1e-5, offset=1.0, residual=x)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(h, h_ref)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_hidden_size_65536(backend, residual):
    """The largest hidden size the issue names: 16 column blocks, bf16, forward and backward."""
    _check(*_inputs((2, 65536), torch.bfloat16, residual=residual))


def test_zero_rows(backend):
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


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("residual", [False, True])
def test_pipelined_backward_loop_gives_the_plain_loop_s_gradients(stages, residual):
    """NUM_STAGES > 1 software-pipelines the single-pass backward's loop over its row tiles (on a GPU the next
    tiles' rows are copied ahead with cp.async): the same arithmetic in the same order, so the same bits as the
    plain loop, the weight gradient's partial sums too, except where the compiler contracts differently. In the
    interpreter 37 rows in tiles of 2 over 4 programs (each loops 4-5 times; this checks the plumbing); on a GPU
    4,001 rows over one program per SM (15-16 loops each: the pipelined loop itself).

    With the residual stream's gradient, sm_90's pipelined loop contracts dx's last product and dh into one fma
    where the plain loop rounds the product first (its PTX at this test's configuration: 8 fma, 16 mul with one
    stage; 12 fma, 12 mul with two; seen on an H100 on 2026-11-27, where bit equality failed). Rounding the
    product t = (dn - normed c) rstd once more moves the sum by at most u |t|, and each result's own rounding by
    u |dx| (u = 2**-24, fp32's unit roundoff), so the two may differ by 4 u (|t| + |dx|), with slack for the
    rounding of t's estimate |dx - dh|. A loop that reads another tile's rows differs by O(1)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not rms_norm_module.use_triton(torch.empty(0, device=device)):
        pytest.skip("the kernels run on CPU only in Triton's interpreter (TRITON_INTERPRET=1)")
    rows = 4001 if device.type == "cuda" else 37
    generator = torch.Generator().manual_seed(0)
    x, r, dy, dh = (torch.randn(rows, 64, generator=generator).to(device) for _ in range(4))
    w = torch.rand(64, generator=generator).to(device) + 0.5
    _, h, rstd = rms_norm_module._forward(x, r if residual else None, w, 1e-6, 0.0, False)
    plain = {"BLOCK_N": 64, "BLOCK_M": 2, "num_warps": 1, "PROGRAMS_PER_SM": 1, "NUM_STAGES": 1}

    def backward(config):
        return rms_norm_module._backward(dy, dh if residual else None, h, w, rstd, 0.0, False, torch.float32, True,
                                         config=config)

    (dx_plain, dw_plain), (dx_pipelined, dw_pipelined) = backward(plain), backward({**plain, "NUM_STAGES": stages})
    assert torch.equal(dw_plain, dw_pipelined)
    if residual:
        unit_roundoff = torch.finfo(torch.float32).eps / 2
        bound = 4 * unit_roundoff * ((dx_plain - dh).abs() + dx_plain.abs())
        assert ((dx_plain - dx_pipelined).abs() <= bound).all(), (dx_plain - dx_pipelined).abs().max()
    else:
        assert torch.equal(dx_plain, dx_pipelined)
    assert rms_norm_module.heuristic_config("bwd", 64)["NUM_STAGES"] == 1  # until a GPU has measured it


def test_add_rms_norm_backward_heuristic_packs_64_elements_per_thread():
    """The H100 probe's winners (bench/results/h100-2026-11-27b/probe) at the measured widths, the rule between
    them, and the general heuristic outside them (rms_norm's backward, narrower rows, multi-pass rows)."""
    config = rms_norm_module.heuristic_config
    assert config("bwd", 2048, residual=True) == {**config("bwd", 2048), "BLOCK_M": 4, "num_warps": 4}
    assert config("bwd", 8192, residual=True) == {**config("bwd", 8192), "BLOCK_M": 2, "num_warps": 8}
    assert config("bwd", 3000, residual=True) == {**config("bwd", 3000), "BLOCK_M": 2, "num_warps": 4}
    for n_cols in (1536, 16384):
        assert config("bwd", n_cols, residual=True) == config("bwd", n_cols)
    assert config("fwd", 2048, residual=True) == config("fwd", 2048)
    assert 4 in rms_norm_module.search_space("bwd", 4096)["NUM_STAGES"]  # the sweep tries the pipelined loop
