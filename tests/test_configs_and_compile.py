"""Launch configuration lookup (tuned table vs heuristic), torch.compile capture, and import hygiene."""

from __future__ import annotations

import json

import pytest
import torch

from tridist import kernels
from tridist.kernels import configs
from tridist.kernels.ops import rms_norm as rms_norm_module, swiglu as swiglu_module
from tridist.kernels.reference import rms_norm_reference, rotary_reference, swiglu_reference


CPU = torch.device("cpu")
FWD, BWD = rms_norm_module.TUNABLES["rms_norm", "fwd"], rms_norm_module.TUNABLES["rms_norm", "bwd"]


@pytest.fixture
def tuned_table(tmp_path, monkeypatch):
    """Point kernels at a tuned table file written by the test, in the format autotune writes.

    `write({tunable: {key: config}}, **overrides)`: the table's fields (device, versions, format) are
    this process's unless overridden; `versions={tunable: "..."}` sets a kernel's recorded version."""
    path = tmp_path / "table.json"
    monkeypatch.setenv("TRIDIST_KERNEL_CONFIGS", str(path))

    def write(entries: dict, *, versions: dict | None = None, **fields):
        table = {"format": configs.TABLE_FORMAT, "device": "cpu", **configs.software_versions(), **fields,
                 "kernels": {t.name: {"version": (versions or {}).get(t, t.version),
                                      "entries": {key: {"config": cfg, "gain": 1.0} for key, cfg in by_key.items()}}
                             for t, by_key in entries.items()}}
        path.write_text(json.dumps(table))
        configs.clear_cache()

    yield write
    configs.clear_cache()


def test_heuristic_without_a_table(tuned_table):
    cfg = rms_norm_module.launch_config("fwd", 64, 4096, torch.bfloat16, CPU)
    assert cfg == {"BLOCK_N": 4096, "BLOCK_M": 1, "num_warps": 8}
    wide = rms_norm_module.launch_config("fwd", 64, 65536, torch.bfloat16, CPU)
    assert wide["BLOCK_N"] == rms_norm_module.MULTI_PASS_BLOCK_N  # streamed in column blocks
    narrow = rms_norm_module.launch_config("fwd", 64, 100, torch.float32, CPU)
    assert narrow["BLOCK_N"] == 128 and narrow["BLOCK_M"] == 32  # short rows packed into one tile
    assert rms_norm_module.launch_config("bwd", 64, 100, torch.float32, CPU)["PROGRAMS_PER_SM"] == 2
    assert swiglu_module.launch_config("fwd", 64, 11008, torch.bfloat16, CPU)["BLOCK_N"] == swiglu_module.MAX_BLOCK_N


def test_launches_follow_a_new_table_after_clear_cache(tuned_table, monkeypatch):
    """Launch plans are cached per shape; a table written after the first launch (a sweep in this process)
    reaches the next launch once clear_cache() runs, as autotune's sweep calls it."""
    from tridist.kernels import _common

    monkeypatch.setattr(_common, "TRITON_INTERPRET", True)
    launched = []

    class Recorder:  # the kernel, recording each launch's configuration instead of running
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid, kwargs["BLOCK_N"]))

    monkeypatch.setattr(rms_norm_module, "_rms_norm_fwd_kernel", Recorder())
    x, w = torch.randn(5, 40), torch.rand(40)
    kernels.rms_norm(x, w)
    tuned_table({FWD: {rms_norm_module.tuning_key(5, 40, torch.float32): {"BLOCK_N": 16, "BLOCK_M": 2, "num_warps": 1}}})
    kernels.rms_norm(x, w)
    assert launched == [((1,), 64), ((3,), 16)]


def test_buckets():
    assert [configs.rows_bucket(n) for n in (1, 1024, 1025, 4096, 5000, 65536, 10**7)] == [
        1024, 1024, 4096, 4096, 16384, 65536, 65536]
    assert [configs.width_bucket(n) for n in (1, 40, 64, 11008, 14336)] == [1, 64, 64, 16384, 16384]
    # One entry serves every shape of its bucket: 40 and 64 columns, 5 and 1000 rows.
    assert rms_norm_module.tuning_key(5, 40, torch.float32) == rms_norm_module.tuning_key(1000, 64, torch.float32)
    assert rms_norm_module.tuning_key(5, 40, torch.float32) != rms_norm_module.tuning_key(5000, 40, torch.float32)


def test_tuned_entry_wins_and_is_used_by_the_launch(tuned_table, backend):
    """A tuned config that forces the multi-pass path on a short row must still give right answers."""
    key = rms_norm_module.tuning_key(5, 40, torch.float32)
    tuned = {"BLOCK_N": 16, "BLOCK_M": 2, "num_warps": 1}
    swiglu_fwd = swiglu_module.TUNABLES["fwd"]
    tuned_table({FWD: {key: tuned}, BWD: {key: {**tuned, "PROGRAMS_PER_SM": 1, "NUM_STAGES": 2}},
                 swiglu_fwd: {swiglu_module.tuning_key(5, 40, torch.float32): tuned}})
    assert rms_norm_module.launch_config("fwd", 5, 40, torch.float32, CPU) == tuned
    # add_rms_norm is its own binary with its own entries: none here, so the heuristic.
    assert rms_norm_module.launch_config("fwd", 5, 40, torch.float32, CPU, residual=True)["BLOCK_N"] == 64
    x = torch.randn(5, 40, requires_grad=True)
    w = torch.rand(40, requires_grad=True)
    y = kernels.rms_norm(x, w)
    torch.testing.assert_close(y, rms_norm_reference(x, w))
    grads = torch.autograd.grad(y.sum(), (x, w))
    ref_grads = torch.autograd.grad(rms_norm_reference(x, w).sum(), (x, w))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(kernels.swiglu(x, x), swiglu_reference(x, x))


def test_launches_read_the_table(tuned_table, monkeypatch):
    """The launchers themselves pass the tuned entry to the kernel (not only launch_config)."""
    if not rms_norm_module.use_triton(torch.empty(0)):
        pytest.skip("the Triton path runs on CPU only under TRITON_INTERPRET=1")
    seen = []
    real = rms_norm_module._rms_norm_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append({k: kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps")})
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(rms_norm_module, "_rms_norm_fwd_kernel", Spy())
    tuned = {"BLOCK_N": 32, "BLOCK_M": 4, "num_warps": 2}
    tuned_table({FWD: {rms_norm_module.tuning_key(6, 64, torch.float32): tuned}})
    x = torch.randn(6, 64)
    torch.testing.assert_close(kernels.rms_norm(x, torch.ones(64)), rms_norm_reference(x, torch.ones(64)))
    kernels.rms_norm(torch.randn(5000, 64), torch.ones(64))  # another rows bucket: the heuristic
    assert seen == [tuned, rms_norm_module.heuristic_config("fwd", 64)]


@pytest.mark.parametrize(
    "entry, problem",
    [
        ({"BLOCK_N": 64, "BLOCK_SIZE": 4}, "unknown parameters"),
        ({"BLOCK_N": 64, "num_warps": 4}, "lacks"),  # BLOCK_M missing
        ({"BLOCK_N": 48, "BLOCK_M": 1, "num_warps": 4}, "powers of two"),  # tl.arange needs 2**k
        ({"BLOCK_N": 64, "BLOCK_M": 1, "num_warps": 64}, "out of range"),  # over CUDA's 1024 threads
    ],
)
def test_invalid_entry_is_ignored_with_a_warning(tuned_table, entry, problem):
    tuned_table({FWD: {rms_norm_module.tuning_key(3, 64, torch.float32): entry}})
    with pytest.warns(UserWarning, match=problem):
        cfg = rms_norm_module.launch_config("fwd", 3, 64, torch.float32, CPU)
    assert cfg == {"BLOCK_N": 64, "BLOCK_M": 64, "num_warps": 8}  # the heuristic
    x = torch.randn(3, 64)
    torch.testing.assert_close(kernels.rms_norm(x, torch.ones(64)), rms_norm_reference(x, torch.ones(64)))


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"device": "NVIDIA H100 80GB HBM3"}, "tuned on 'NVIDIA H100"),
        ({"triton": "0.0.1"}, "tuned under triton 0.0.1"),
        ({"torch": "1.0"}, "tuned under torch 1.0"),
        ({"format": 1}, "format 1"),
        ({"versions": {FWD: "0123456789abcdef"}}, "kernel's source is now"),
    ],
)
def test_stale_table_falls_back_to_the_heuristic(tuned_table, fields, problem):
    """A table from another device, other torch/Triton versions or an older kernel source is not used."""
    key = rms_norm_module.tuning_key(3, 64, torch.float32)
    tuned_table({FWD: {key: {"BLOCK_N": 16, "BLOCK_M": 2, "num_warps": 1}}}, **fields)
    with pytest.warns(UserWarning, match=problem):
        cfg = rms_norm_module.launch_config("fwd", 3, 64, torch.float32, CPU)
    assert cfg == rms_norm_module.heuristic_config("fwd", 64)


def test_kernel_version_follows_the_source():
    """The version is a hash of the kernels' source: the four rms_norm tunables share code but not binaries,
    and each op's version differs from the others'."""
    versions = {t.name: t.version for t in (*rms_norm_module.TUNABLES.values(), *swiglu_module.TUNABLES.values())}
    assert versions["rms_norm_fwd"] == versions["add_rms_norm_fwd"] != versions["rms_norm_bwd"]
    assert len({versions["rms_norm_fwd"], versions["swiglu_fwd"], versions["swiglu_bwd"]}) == 3
    edited = configs.Tunable("x", frozenset(), (lambda a: a + 1,))
    assert edited.version != configs.Tunable("x", frozenset(), (lambda a: a + 2,)).version


def test_unreadable_table_is_ignored_with_a_warning(tmp_path, monkeypatch):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    monkeypatch.setenv("TRIDIST_KERNEL_CONFIGS", str(path))
    configs.clear_cache()
    with pytest.warns(UserWarning, match="unreadable"):
        rms_norm_module.launch_config("fwd", 3, 64, torch.float32, CPU)
    configs.clear_cache()


def test_table_location_is_per_device(monkeypatch):
    monkeypatch.delenv("TRIDIST_KERNEL_CONFIGS", raising=False)
    path = configs.tuned_table_path(CPU)
    assert path.name == "cpu.json" and "tridist" in str(path)
    assert configs.config_key(n_cols=8, dtype=torch.bfloat16) == "dtype=bfloat16,n_cols=8"


class _Block(torch.nn.Module):
    """The fused ops in one small block, the way a decoder layer uses them (a SwiGLU and a GeGLU MLP)."""

    def __init__(self):
        super().__init__()
        self.norm = kernels.FusedRMSNorm(16)
        self.rotary = kernels.FusedRotaryEmbedding(8, 16)
        self.mlp = kernels.FusedSwiGLUMLP(16, 24)
        self.geglu_mlp = kernels.FusedSwiGLUMLP(16, 24, activation="gelu_tanh")

    def forward(self, x, residual):
        y, h = self.norm(x, residual)
        q = y.view(2, 5, 2, 8)
        q, k = self.rotary(q, q[:, :, :1])
        return self.mlp(q.reshape(2, 5, 16)) + self.geglu_mlp(q.reshape(2, 5, 16)) + k.sum(), h


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(compile_backend, backend):
    if compile_backend == "inductor" and backend == "triton":
        pytest.skip("inductor + interpreted kernels adds nothing over aot_eager and costs a C++ build")
    block = _Block()
    x = torch.randn(2, 5, 16, requires_grad=True)
    residual = torch.randn(2, 5, 16)
    out, h = block(x, residual)
    (expected_grad,) = torch.autograd.grad(out.sum() + h.sum(), x)
    compiled = torch.compile(block, fullgraph=True, backend=compile_backend)
    out_c, h_c = compiled(x, residual)
    (grad_c,) = torch.autograd.grad(out_c.sum() + h_c.sum(), x)
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_c, expected_grad, rtol=1e-5, atol=1e-5)


def test_ops_are_registered_with_torch_library():
    for name in ("rms_norm", "add_rms_norm", "rms_norm_backward", "rotary", "gated_activation",
                 "gated_activation_packed", "gated_activation_backward", "gated_activation_packed_backward"):
        assert hasattr(torch.ops.tridist, name)
    q = torch.randn(1, 3, 2, 4)
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    torch.library.opcheck(torch.ops.tridist.rotary.default, (q, q, cos, sin, None, False, False, False, 4, False))
    for activation in (0, 1, 2):  # silu, gelu's tanh approximation, gelu
        torch.library.opcheck(torch.ops.tridist.gated_activation.default,
                              (torch.randn(3, 5, requires_grad=True), torch.randn(3, 5), activation))
    torch.library.opcheck(
        torch.ops.tridist.add_rms_norm.default,
        (torch.randn(3, 8, requires_grad=True), torch.randn(3, 8), torch.rand(8, requires_grad=True), 1e-6, 0.0, False),
    )
    out = rotary_reference(q, q, cos, sin)[0]
    torch.testing.assert_close(out, q)  # identity rotation (cos 1, sin 0) guards the op arguments above


def _non_contiguous(*shape):
    return torch.randn(*reversed(shape)).permute(*reversed(range(len(shape))))


def test_ops_pass_opcheck_with_strided_inputs(backend):
    """The real outputs have the strides the fake implementations promise (torch.compile relies on it)."""
    x = _non_contiguous(6, 8).requires_grad_()
    w = torch.rand(8, requires_grad=True)
    torch.library.opcheck(torch.ops.tridist.rms_norm.default, (x, w, 1e-6, 0.0, True))
    torch.library.opcheck(torch.ops.tridist.add_rms_norm.default, (x, _non_contiguous(6, 8), w, 1e-6, 1.0, False))
    torch.library.opcheck(torch.ops.tridist.gated_activation.default, (x, _non_contiguous(6, 8), 0))
    torch.library.opcheck(torch.ops.tridist.gated_activation_packed.default, (_non_contiguous(6, 16).requires_grad_(), 1))
    q = torch.randn(2, 3, 4, 8).transpose(1, 2).requires_grad_()  # bhsd view of bshd storage
    cos, sin = torch.rand(4, 8), torch.rand(4, 8)
    torch.library.opcheck(torch.ops.tridist.rotary.default, (q, q, cos, sin, None, True, True, True, 8, False))


def test_double_backward_through_rotary_is_exact(backend):
    """Rotary is linear in q and k: its second derivative is zero, so double backward is exact."""
    x = torch.randn(2, 3, 4, 8, requires_grad=True)
    cos, sin = torch.rand(3, 8), torch.rand(3, 8)
    grads = []
    for fn in (kernels.apply_rotary_pos_emb, rotary_reference):
        (g,) = torch.autograd.grad(fn(x, x, cos, sin)[0].pow(2).sum() + (x**3).sum(), x, create_graph=True)
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1])
    # d/dx of the rotary part of g is not zero here (pow(2) makes the outer function non-linear), and
    # it flows through the incoming gradient: differentiating it must raise, not drop it.
    with pytest.raises(RuntimeError, match="double backward through .* is not supported"):
        torch.autograd.grad(grads[0].sum(), x)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "swiglu", "swiglu_packed", "geglu"])
def test_double_backward_raises_instead_of_dropping_terms(backend, op):
    x = torch.randn(2, 3, 4, 8, requires_grad=True)
    w = torch.rand(8, requires_grad=True)
    out = {
        "rms_norm": lambda: kernels.rms_norm(x, w),
        "add_rms_norm": lambda: kernels.rms_norm(x, w, residual=x)[0],
        "swiglu": lambda: kernels.swiglu(x, x),
        "swiglu_packed": lambda: kernels.swiglu(x),
        "geglu": lambda: kernels.geglu(x, x),
    }[op]()
    # With another differentiable term, grad has a grad_fn: a non-differentiable backward would
    # silently drop the op's second-order terms here instead of failing.
    (grad,) = torch.autograd.grad(out.sum() + (x**3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward through .* is not supported"):
        torch.autograd.grad(grad.sum(), x)


