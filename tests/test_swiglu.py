"""The gated activations, SwiGLU (silu) and GeGLU (gelu: tanh approximation and exact), in their two-tensor and
split-in-half forms, against the plain PyTorch reference and fp64."""

from __future__ import annotations

import pytest
import torch

from tridist import kernels
from tridist.kernels.reference import gated_reference, swiglu_reference
from tridist.kernels.ops.swiglu import MAX_BLOCK_N
from tridist.kernels.testing import assert_matches_reference, assert_rounded_once, converts_toward_zero, upcast

# The interpreter computes with numpy, which warns where fp32 overflows as IEEE arithmetic intends: exp(-z) to inf
# in a saturated sigmoid (s = 1 / (1 + inf) = 0), and inf * 0 in the branch tl.where discards.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One element, a prime width, a width just over one column block (no power-of-two padding), 4-D (three
# leading dims that merge into one row index, in the inputs and in the gradient buffers), and a run of elements
# that the heuristic's tiles (4 x 1024) divide: contiguous, it is read without masks (the plan's EVEN). The
# two-tensor form's contiguous inputs take the flat addressing (FLAT), the split-in-half form's halves the rows'.
SHAPES = [(1, 1), (3, 37), (2, MAX_BLOCK_N + 5), (2, 3, 2, 176), (16, MAX_BLOCK_N)]
U32 = torch.finfo(torch.float32).eps / 2  # fp32 unit roundoff: one fp32 operation's relative error
ACTIVATIONS = ["silu", "gelu_tanh", "gelu"]
K0 = 2 * (2 / torch.pi) ** 0.5  # gelu's tanh approximation: act(x) = x sigmoid(z), z = x (K0 + K1 x^2)
K1 = K0 * 0.044715


def _fused(activation):
    """The public function of `activation`: swiglu, or geglu with its `approximate`."""
    if activation == "silu":
        return kernels.swiglu
    return lambda *t: kernels.geglu(*t, approximate="tanh" if activation == "gelu_tanh" else "none")


def _fp32_error_bounds(gate, up, grad, activation="silu"):
    """Elementwise bounds (fp64) on the error of computing out, d_gate and d_up in fp32.

    silu and gelu's tanh approximation are x s, s = sigmoid(z), with z = x (silu) or x (K0 + K1 x^2): four
    roundings and two rounded constants put z within 6 |z| u, exp(-z) is then within (7 |z| + 4) u (|z| u from
    scaling the argument where exp is computed as exp2, as on GPUs), 1 + e and the division add u each: s within
    (7 |z| + 6) u; out = x s y and d_up = g x s: two more products. act' = s (1 + x (1 - s) z'): 1 - s is off by
    up to (7 |z| + 7) u absolute, times x z' (z' = 1, or K0 + 3 K1 x^2 within 5 u), so act' is within
    (7 |z| + 16)(|x z'| + 1) u of |s|, times |g y|. For silu (z = x) this is the earlier (|x| + 8) u analysis
    loosened by the constant 7; the factors 2 and 8 are margin. For |x| <= 12 (these tests) still below half a
    bf16 or fp16 spacing where the values are not tiny, so a second rounding shows.

    Exact gelu is 0.5 x (1 + erf(x / sqrt(2))): erf within 2 ulp, plus 1 u absolute from the rounded argument
    (erf's slope times its argument is at most 0.48): 1 + erf within 5 u absolute, which for negative x is a
    large part of the tiny 1 + erf (the cancellation eager's fp32 gelu has too): out within 2.5 |x y| u + 4 u
    |out|. act' = cdf + x phi(x): cdf within 2.5 u, x phi(x) within (x^2 / 2 + 8) u relative.
    """
    x, y, g = (t.detach().double() for t in (gate, up, grad))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(x / 2**0.5))
        x_phi = x * torch.exp(-x * x / 2) / (2 * torch.pi) ** 0.5
        out = 2 * (4 * U32 * (x * cdf * y).abs() + 2.5 * U32 * (x * y).abs())
        d_gate = 4 * U32 * (g * y).abs() * (3 + x_phi.abs() * (x * x / 2 + 8) + (cdf + x_phi).abs())
        d_up = 2 * (4 * U32 * (g * x * cdf).abs() + 2.5 * U32 * (g * x).abs())
        return out, d_gate, d_up
    z, dz = (x, torch.ones_like(x)) if activation == "silu" else (x * (K0 + K1 * x * x), K0 + 3 * K1 * x * x)
    s = torch.sigmoid(z)
    relative = 2 * (7 * z.abs() + 8) * U32
    # Where exp(-z) overflows fp32 (z < -88.7), s = 1 / (1 + exp(-z)) is 0 while sigmoid(z) < exp(-88.7) < 4 tiny
    # (fp32's smallest normal): an absolute error of up to that, times what multiplies s.
    flushed = 4 * torch.finfo(torch.float32).tiny
    d_gate = 8 * (7 * z.abs() + 16) * ((x * dz).abs() + 1) * U32 * (g * y * s).abs()
    d_gate = d_gate + flushed * ((x * dz).abs() + 1) * (g * y).abs()
    return (relative * (x * s * y).abs() + flushed * (x * y).abs(), d_gate,
            relative * (g * x * s).abs() + flushed * (g * x).abs())


def _check(fn_inputs, activation="silu"):
    """Outputs and input gradients of the fused gated activation of `fn_inputs` against the eager reference and
    fp64 gold (kernels.testing's criterion), and as the fp32 computation rounded once to their dtypes: the eager
    reference computes in the input dtype, so only the second check sees a kernel that does too."""

    def fwd_bwd(fn, inputs, grad):
        out = fn(*inputs)
        return out, torch.autograd.grad(out, inputs, grad)

    def reference(*inputs):
        return gated_reference(*inputs, activation) if len(inputs) == 2 else gated_reference(*inputs, None, activation)

    def exact(*inputs):
        """The fp64 gold: gelu in forms without cancellation in the negative tail, where 1 + tanh(u) and
        1 + erf(w) of the eager formulas lose every digit even in fp64 (x < -8): x sigmoid(2u) and
        0.5 x erfc(-w)."""
        x, y = inputs if len(inputs) == 2 else inputs[0].chunk(2, dim=-1)
        if activation == "gelu_tanh":
            return x * torch.sigmoid(x * (K0 + K1 * x * x)) * y
        if activation == "gelu":
            return 0.5 * x * torch.special.erfc(-x / 2**0.5) * y
        return torch.nn.functional.silu(x) * y

    ref_out = reference(*fn_inputs)
    grad = torch.randn_like(ref_out)
    out, grads = fwd_bwd(_fused(activation), fn_inputs, grad)
    ref_out, ref_grads = fwd_bwd(reference, fn_inputs, grad)
    gold_out, gold_grads = fwd_bwd(exact, [upcast(t) for t in fn_inputs], grad.double())
    assert_matches_reference(out, ref_out, gold_out, name="out")
    for name, g, r, gg in zip(("dx", "dy"), grads, ref_grads, gold_grads):
        assert_matches_reference(g, r, gg, name=name)

    gate, up = fn_inputs if len(fn_inputs) == 2 else fn_inputs[0].chunk(2, dim=-1)
    out_bound, d_gate_bound, d_up_bound = _fp32_error_bounds(gate, up, grad, activation)
    if len(fn_inputs) == 2:
        grad_bounds = (d_gate_bound, d_up_bound)
    else:  # one gradient buffer: [d_gate | d_up]
        grad_bounds = (torch.cat([d_gate_bound, d_up_bound], -1),)
    results = zip(("out", "dx", "dy"), (out, *grads), (gold_out, *gold_grads), (out_bound, *grad_bounds))
    for name, ours, exact, bound in results:
        truncates = converts_toward_zero(ours.device, ours.dtype)
        assert_rounded_once(ours, exact, bound=bound, toward_zero=truncates, name=name)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_two_tensor_form(backend, shape, dtype, activation):
    # Scale 3 so that the activation's curved region and its tails are both exercised.
    x = (3 * torch.randn(shape, dtype=dtype)).requires_grad_()
    y = torch.randn(shape, dtype=dtype, requires_grad=True)
    _check([x, y], activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_in_half_form(backend, shape, dtype, activation):
    packed = (*shape[:-1], 2 * shape[-1])
    x = (3 * torch.randn(packed, dtype=dtype)).requires_grad_()
    _check([x], activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_saturated_gates_give_the_activation_s_limits(backend, dtype, activation):
    """Far out in both tails (from 200, where sigmoid(-x) is 0 in fp32, past 1e30, where gelu's cubic would
    overflow fp32, to 3e38, near fp32's and bf16's largest) act(x) is x or 0 and act' is 1 or 0, finite: no inf
    times zero in the derivative (x (1 - s) z' alone is -inf below -1.6e35), no overflow in the output."""
    gate = torch.tensor([-3e38, -1e36, -1e30, -1e4, -200.0, 200.0, 1e4, 1e30, 3e38]).to(dtype).requires_grad_()
    up = torch.ones_like(gate, requires_grad=True)
    out = _fused(activation)(gate, up)
    d_gate, d_up = torch.autograd.grad(out, (gate, up), torch.ones_like(out))
    positive = gate.detach() > 0
    assert torch.equal(out, torch.where(positive, gate.detach(), torch.zeros_like(out))), out
    assert torch.equal(d_gate, positive.to(dtype)), d_gate
    assert torch.equal(d_up, out.detach()), d_up


@pytest.mark.parametrize(
    "x_dtype, y_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.float16), (torch.float16, torch.bfloat16)],
    ids=str,
)
def test_mixed_dtypes(backend, x_dtype, y_dtype):
    """The output takes the promoted dtype, each gradient its input's: values, not only dtypes (a
    gradient rounded through the other input's dtype and cast back keeps the right dtype)."""
    x = (3 * torch.randn(4, 40)).to(x_dtype).requires_grad_()
    y = torch.randn(4, 40, dtype=y_dtype, requires_grad=True)
    _check([x, y])


def test_views_whose_rows_need_more_than_two_strides(backend):
    """Four dims stored in reverse order merge into no fewer than three row strides: the launcher copies the
    inputs and the gradient once; the gradient buffers it writes are its own, contiguous."""
    def reversed_dims(*shape):
        return torch.randn(*reversed(shape)).permute(3, 2, 1, 0)

    x, y, grad = reversed_dims(2, 3, 4, 10).requires_grad_(), reversed_dims(2, 3, 4, 10).requires_grad_(), reversed_dims(2, 3, 4, 10)
    out, ref = kernels.swiglu(x, y), swiglu_reference(x, y)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out, (x, y), grad), torch.autograd.grad(ref, (x, y), grad)):
        torch.testing.assert_close(a, b)


def test_strided_inputs_and_gradients(backend):
    """Transposed inputs, a packed input that is itself a slice, and a non-contiguous gradient."""
    x = torch.randn(40, 3, 7).transpose(0, 1).requires_grad_()  # [3, 40, 7] view
    y = torch.randn(7, 40, 3).permute(2, 1, 0).requires_grad_()
    grad = torch.randn(7, 40, 3).permute(2, 1, 0)
    out = kernels.swiglu(x, y)
    ref = swiglu_reference(x, y)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out, (x, y), grad), torch.autograd.grad(ref, (x, y), grad)):
        torch.testing.assert_close(a, b)

    wide = torch.randn(5, 30, requires_grad=True)
    packed = wide[:, 3:27]  # a strided slice of width 24 = 2 x 12
    out = kernels.swiglu(packed)
    ref = swiglu_reference(packed)
    torch.testing.assert_close(out, ref)
    g = torch.randn(12, 5).t()
    torch.testing.assert_close(torch.autograd.grad(out, wide, g)[0], torch.autograd.grad(ref, wide, g)[0])


def test_no_mutation_and_second_backward(backend):
    x = torch.randn(3, 9, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(3, 9, dtype=torch.bfloat16, requires_grad=True)
    saved = [t.detach().clone() for t in (x, y)]
    out = kernels.swiglu(x, y)
    grad = torch.randn_like(out)
    grad_saved = grad.clone()
    first = torch.autograd.grad(out, (x, y), grad, retain_graph=True)
    second = torch.autograd.grad(out, (x, y), grad)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(torch.equal(a, b.detach()) for a, b in zip(saved, (x, y)))
    assert torch.equal(grad, grad_saved)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_layers(backend, activation):
    torch.manual_seed(1)
    mlp = kernels.FusedSwiGLUMLP(16, 44, activation=activation)
    x = torch.randn(2, 3, 16)
    expected = mlp.down_proj(gated_reference(mlp.gate_proj(x), mlp.up_proj(x), activation))
    torch.testing.assert_close(mlp(x), expected)
    wrapped = kernels.FusedSwiGLUMLP.from_linears(gate_proj=mlp.gate_proj, up_proj=mlp.up_proj, down_proj=mlp.down_proj,
                                                  activation=activation)
    assert wrapped.gate_proj is mlp.gate_proj and wrapped.activation == activation
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in mlp.named_parameters()]
    torch.testing.assert_close(wrapped(x), expected)
    torch.testing.assert_close(kernels.FusedSwiGLU()(x), swiglu_reference(x[..., :8], x[..., 8:]))


@pytest.mark.parametrize("shape", [(0, 8), (3, 0)], ids=str)
def test_empty(backend, shape):
    _check([torch.randn(shape, requires_grad=True)])
    _check([torch.randn(shape, requires_grad=True), torch.randn(shape, requires_grad=True)])


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(2, 7),), "must be even; got 7"),
        ((torch.randn(2, 8), torch.randn(2, 9)), "must have the same shape"),
        ((torch.randn(2, 8).double(),), "float64"),
        ((torch.randn(2, 8), torch.randn(2, 8, device="meta")), "one device"),
        ((torch.tensor(1.0),), "scalar"),
    ],
)
def test_bad_input_errors(args, message):
    with pytest.raises((ValueError, TypeError), match=message):
        kernels.swiglu(*args)
    with pytest.raises((ValueError, TypeError), match=message):
        kernels.geglu(*args)


def test_unknown_activations_are_refused():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="activation code 7 is none of"):
        torch.ops.tridist.gated_activation(x, x, 7)
    with pytest.raises(ValueError, match="activation must be 'silu', 'gelu_tanh' or 'gelu'"):
        gated_reference(x, x, "relu")
    with pytest.raises(ValueError, match="approximate must be 'tanh' or 'none'"):
        kernels.geglu(x, approximate="erf")
    with pytest.raises(ValueError, match=r"activation must be one of \['gelu', 'gelu_tanh', 'silu'\]"):
        kernels.FusedSwiGLUMLP(8, 16, activation="relu")


def test_dense_inputs_are_addressed_as_one_run_and_others_by_rows():
    """The plan's addressing: FLAT when every tensor is dense and row-major (size-1 dims may have any stride),
    EVEN when the tiles divide the run, WIDE (int64 offsets) when the last tile passes 2**31 - 1; the rows'
    strides otherwise (a half of packed rows, a transposed view)."""
    from tridist.kernels._common import dense_row_major
    from tridist.kernels.ops.swiglu import SILU, _plan

    def plan(shape, *strides, kind="fwd"):
        return _plan.__wrapped__(kind, SILU, shape, strides, torch.bfloat16, torch.device("cuda"),
                                 {"BLOCK_M": 4, "BLOCK_N": 1024, "num_warps": 4}).kwargs

    dense = (1024, 1)
    assert {k: plan((16, 1024), dense, dense)[k] for k in ("FLAT", "EVEN", "WIDE")} == dict(FLAT=True, EVEN=True, WIDE=False)
    assert {k: plan((3, 37), (37, 1), (37, 1))[k] for k in ("FLAT", "EVEN")} == dict(FLAT=True, EVEN=False)
    assert plan((16, 1, 1024), (1024, 7, 1), (1024, 1024, 1))["FLAT"]  # a size-1 dim's stride is never used
    assert not plan((16, 1024), (2048, 1), dense)["FLAT"]  # the gate half of packed [gate | up] rows
    assert not plan((16, 1024), (1, 16), dense)["FLAT"]  # a transposed view
    assert not plan((16, 1024), dense, dense, dense, (2048, 1), dense, kind="bwd")["FLAT"]  # d_gate into packed rows
    assert plan((2**16, 2**15), (2**15, 1), (2**15, 1))["WIDE"]  # 2**31 elements
    assert not plan((2**16, 2**15 - 1), (2**15 - 1, 1), (2**15 - 1, 1))["WIDE"]  # 2**31 - 2**16, + a tile: int32
    assert dense_row_major((2, 3), (3, 1)) and dense_row_major((), ()) and not dense_row_major((2, 3), (1, 2))


def test_int64_offsets_of_a_long_run_compute_the_same(monkeypatch):
    """WIDE (int64 offsets, past 2**31 - 1 elements: too large to run here) forced on a small run, forward and
    backward, matches the int32 run bit for bit."""
    from tridist.kernels._common import use_triton
    from tridist.kernels.ops import swiglu as swiglu_op

    x, y = torch.randn(3, 37, requires_grad=True), torch.randn(3, 37, requires_grad=True)
    if not use_triton(x):
        pytest.skip("the kernels run in Triton's interpreter (TRITON_INTERPRET=1)")
    plain_out = kernels.swiglu(x, y)
    plain_grads = torch.autograd.grad(plain_out, (x, y), torch.ones_like(plain_out))
    wrapped = swiglu_op._plan.__wrapped__

    def wide(*args):
        launch = wrapped(*args)
        launch.kwargs["WIDE"] = True
        return launch

    monkeypatch.setattr(swiglu_op, "_plan", wide)
    out = kernels.swiglu(x, y)
    grads = torch.autograd.grad(out, (x, y), torch.ones_like(out))
    assert torch.equal(out, plain_out) and all(map(torch.equal, grads, plain_grads))
