"""Launch.launch: the first launch of each specialisation goes through Triton's JIT, the next ones call the
compiled kernel it returned straight, with every argument in the kernel's order. A fake kernel records both
paths (CPU); on a GPU the real kernels run both paths against the reference."""

import types
import weakref

import pytest
import torch

from tridist.kernels import _common
from tridist.kernels._common import Launch


class _FakeCompiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args))


class JITFunction:
    """Like Triton's: `kernel[grid](*args, **kwargs)` launches and returns the compiled kernel."""

    arg_names = ["x_ptr", "y_ptr", "n_rows", "eps", "offset", "stride", "BLOCK"]
    params = [types.SimpleNamespace(name=n, default=1.0 if n == "offset" else _common.inspect.Parameter.empty,
                                    is_constexpr=n == "BLOCK") for n in arg_names]
    pre_run_hooks = []

    def __init__(self):
        self.log = []
        self.compiled = _FakeCompiled(self.log)

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return self.compiled
        return jit


@pytest.fixture
def compiled_launches(monkeypatch):
    """Launch.launch as on a GPU without launch hooks."""
    monkeypatch.setattr(_common, "_current_device", lambda: 0)
    monkeypatch.setattr(_common, "_current_stream", lambda device: f"stream{device}")
    monkeypatch.setattr(_common, "_jit_launch_needed", lambda kernel: False)


def _paths(kernel):
    return [entry[0] for entry in kernel.log]


def test_after_the_first_launch_the_compiled_kernel_runs_with_every_argument_in_order(compiled_launches):
    kernel, plan = JITFunction(), Launch((5, 2), dict(n_rows=7, stride=3, BLOCK=64, num_warps=4))
    x, y = torch.zeros(8), torch.zeros(8)
    plan.launch(kernel, x, y, eps=1e-5)
    plan.launch(kernel, y, x, eps=1e-6)
    assert _paths(kernel) == ["jit", "direct"]
    assert kernel.log[0][1:] == ((5, 2), (x, y), dict(eps=1e-5, n_rows=7, stride=3, BLOCK=64, num_warps=4))
    args = kernel.log[1][1]
    assert args[:9] == (5, 2, 1, "stream0", "function", "metadata", None, None, None)
    # x_ptr, y_ptr, n_rows, eps, offset (the parameter's default), stride, BLOCK; num_warps is no argument
    assert args[9:11] == (y, x) and args[11:] == (7, 1e-6, 1.0, 3, 64)


def test_a_plan_keeps_no_launch_s_tensors_alive(compiled_launches):
    """Plans stay cached (up to 4,096): a tensor of the launch that compiled one must not live on with it."""
    kernel, plan = JITFunction(), Launch((1,), dict(n_rows=7, stride=3, BLOCK=64))
    x = torch.zeros(8)
    plan.launch(kernel, x, x.clone(), eps=1e-5)
    kernel.log.clear()  # the fake's own record of the launches
    alive = weakref.ref(x)
    del x
    assert alive() is None


def test_a_new_specialisation_goes_through_the_jit_once(compiled_launches):
    kernel, plan = JITFunction(), Launch((1,), dict(n_rows=7, stride=3, BLOCK=64))
    x = torch.zeros(64)
    plan.launch(kernel, x, x, eps=1e-5)
    plan.launch(kernel, x[1:], x, eps=1e-5)  # 4 bytes past a 16-byte boundary: Triton compiles another kernel
    plan.launch(kernel, x[1:], x, eps=2e-5)
    plan.launch(kernel, x.double(), x, eps=1e-5)  # another dtype
    plan.launch(kernel, x, x, eps=1e-5, offset=0)  # an int where a float was: another argument type
    plan.launch(kernel, x, x, eps=1e-5, offset=1)  # Triton specialises ints equal to 1
    plan.launch(kernel, x, x, eps=1e-5, offset=1)
    plan.launch(kernel, x, x, eps=1e-5, offset=1.0)
    plan.launch(kernel, x, x, offset=1.0, eps=1e-5)  # the same types in the other order: other slots
    plan.launch(kernel, x, x, offset=2.0, eps=1e-6)
    assert _paths(kernel) == ["jit", "jit", "direct", "jit", "jit", "jit", "direct", "jit", "jit", "direct"]
    assert kernel.log[-1][1][12:14] == (1e-6, 2.0)  # eps, offset: each in its own slot
    direct = kernel.log[2][1][9:]
    assert [t.data_ptr() for t in direct[:2]] == [x.data_ptr() + 4, x.data_ptr()]
    assert direct[2:] == (7, 2e-5, 1.0, 3, 64)


def test_a_constexpr_scalar_and_a_kernel_other_than_a_jit_function_keep_the_jit_launch(compiled_launches):
    """A per-call constexpr is compiled into the kernel (its value is not in the key); an autotuner picks its
    constexprs per call."""
    kernel, plan = JITFunction(), Launch((1,), dict(n_rows=7, stride=3, eps=1e-5))
    x = torch.zeros(8)
    for _ in range(2):
        plan.launch(kernel, x, x, BLOCK=64)
    tuned = type("Autotuner", (JITFunction,), {})()
    for _ in range(2):
        plan.launch(tuned, x, x, BLOCK=64)
    assert _paths(kernel) == _paths(tuned) == ["jit", "jit"]


def test_what_only_the_jit_honours_is_read_at_every_launch(monkeypatch):
    """Launch and pre-run hooks, debug and instrumentation modes, set after a kernel's first launch."""
    from triton import knobs

    kernel = JITFunction()
    assert not _common._jit_launch_needed(kernel)
    for setting, value in ((knobs.runtime, "debug"), True), ((knobs.compilation, "instrumentation_mode"), "gsan"), \
            ((knobs.runtime, "launch_exit_hook"), lambda *a: None):
        with monkeypatch.context() as patch:
            patch.setattr(*setting, value)
            assert _common._jit_launch_needed(kernel), setting
    kernel.pre_run_hooks = [lambda *a, **k: None]
    assert _common._jit_launch_needed(kernel)


def test_the_interpreter_and_launch_hooks_keep_the_jit_launch(compiled_launches, monkeypatch):
    """Triton's interpreter's kernels (what `triton.jit` makes under TRITON_INTERPRET=1), whatever they return;
    a kernel with a launch hook set."""
    interpreted = type("InterpretedFunction", (JITFunction,), {})()
    plan = Launch((1,), dict(n_rows=7, stride=3, BLOCK=64))
    x = torch.zeros(8)
    for _ in range(3):
        plan.launch(interpreted, x, x, eps=1e-5)
    assert _paths(interpreted) == ["jit"] * 3
    kernel = JITFunction()
    plan.launch(kernel, x, x, eps=1e-5)
    monkeypatch.setattr(_common, "_jit_launch_needed", lambda kernel: True)  # e.g. a profiler's hook
    plan.launch(kernel, x, x, eps=1e-5)
    assert _paths(kernel) == ["jit", "jit"]


@pytest.mark.skipif(not torch.cuda.is_available() or _common.TRITON_INTERPRET,
                    reason="compiled kernels run on a GPU with TRITON_INTERPRET=0")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_launches_on_a_gpu_match_the_reference(dtype, monkeypatch, device="cuda"):
    """Each op twice per input (JIT, then direct), on 16-byte aligned inputs and on views one element off."""
    direct, launch_compiled = [], _common._CompiledLaunch.__call__
    monkeypatch.setattr(_common._CompiledLaunch, "__call__", lambda *a: (direct.append(1), launch_compiled(*a)))
    from tridist.kernels import apply_rotary_pos_emb, geglu, rms_norm, swiglu
    from tridist.kernels.reference import geglu_reference, rms_norm_reference, rotary_reference, swiglu_reference

    torch.manual_seed(0)
    base = torch.randn(4 * 257 * 128 + 1, device=device, dtype=dtype)
    w = torch.rand(128, device=device, dtype=dtype)
    cos, sin = torch.randn(2, 257, 32, device=device, dtype=dtype).unbind(0)

    def check(out, reference, *inputs, **kwargs):
        """Against the reference in fp32 rounded to `dtype`. The kernels round at most twice (RMSNorm rounds the
        normalised row to the weight's dtype before the product), each rounding one ulp of `dtype` at most
        (bf16: 2**-7 relative), plus fp32's own error: sums in another order, cancellation of terms below 20
        in size (atol 1e-4). A wrong argument in a direct launch is off by far more."""
        want = reference(*[t.float() for t in inputs], **kwargs)
        for got, ref in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(got, ref.to(dtype), rtol=2 * 2**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)

    for start in (0, 1, 0, 1):  # aligned, misaligned, then both again: the direct launches
        x = base[start:start + 4 * 257 * 128].view(4, 257, 128)
        check(rms_norm(x, w), rms_norm_reference, x, w)
        gate, up = x[..., :64], x[..., 64:]
        check(swiglu(gate, up), swiglu_reference, gate, up)  # strided rows
        check(swiglu(x, x), swiglu_reference, x, x)  # dense: one run (FLAT), misaligned on the odd rounds
        check(geglu(x, x), geglu_reference, x, x)
        check(geglu(gate, up, approximate="none"), lambda g, u: geglu_reference(g, u, approximate="none"), gate, up)
        q = x.view(4, 257, 4, 32).transpose(1, 2)
        check(apply_rotary_pos_emb(q, q, cos, sin, layout="bhsd"), rotary_reference, q, q, cos, sin, layout="bhsd")
    assert len(direct) >= 6 or device == "cpu"  # the second aligned and misaligned rounds launched straight


@pytest.mark.skipif(not torch.cuda.is_available() or _common.TRITON_INTERPRET,
                    reason="compiled kernels run on a GPU with TRITON_INTERPRET=0")
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("shape", [(4, 256, 128), (3, 37, 100)], ids=str)  # tiles dividing the run (EVEN), and not
def test_gated_activations_on_a_gpu_forward_and_backward(activation, shape, device="cuda"):
    """The compiled gated-activation kernels, dense (FLAT) and packed (strided rows), forward and backward in bf16,
    against the fp32 reference rounded to bf16: one rounding of the output and of each gradient (2**-8 relative)
    on top of fp32's own error (atol 1e-3 for gradients that are sums of products of size up to ~30)."""
    from tridist.kernels.ops.swiglu import gated_activation
    from tridist.kernels.reference import gated_reference

    torch.manual_seed(0)
    for packed in (False, True):
        x = (3 * torch.randn(*shape[:-1], 2 * shape[-1] if packed else shape[-1], device=device)).bfloat16()
        inputs = [x.requires_grad_()] if packed else [x.requires_grad_(), torch.randn_like(x).requires_grad_()]
        args = (inputs[0], None) if packed else tuple(inputs)
        out = gated_activation(*args, activation)
        grad = torch.randn_like(out)
        grads = torch.autograd.grad(out, inputs, grad)
        fp32 = [t.detach().float().requires_grad_() for t in inputs]
        ref = gated_reference(*((fp32[0], None) if packed else fp32), activation)
        ref_grads = torch.autograd.grad(ref, fp32, grad.float())
        torch.testing.assert_close(out, ref.bfloat16(), rtol=2**-7, atol=1e-5)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want.bfloat16(), rtol=2**-7, atol=1e-3)
