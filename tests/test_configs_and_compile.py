"""Launch configuration lookup (tuned table vs heuristic), torch.compile capture, and import hygiene."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import configs
from kernels.ops import rms_norm as rms_norm_module, swiglu as swiglu_module
from kernels.reference import rms_norm_reference, rotary_reference, swiglu_reference


@pytest.fixture
def tuned_table(tmp_path, monkeypatch):
    """Point kernels at a tuned table file written by the test (as autotune would write it)."""
    path = tmp_path / "table.json"
    monkeypatch.setenv("TRIDIST_KERNEL_CONFIGS", str(path))

    def write(entries: dict):
        path.write_text(json.dumps({"device": "cpu", "configs": entries}))
        configs.clear_cache()

    yield write
    configs.clear_cache()


def test_heuristic_without_a_table(tuned_table):
    cpu = torch.device("cpu")
    cfg = rms_norm_module.launch_config("fwd", 4096, torch.bfloat16, cpu)
    assert cfg == {"BLOCK_N": 4096, "BLOCK_M": 1, "num_warps": 8}
    wide = rms_norm_module.launch_config("fwd", 65536, torch.bfloat16, cpu)
    assert wide["BLOCK_N"] == rms_norm_module.MULTI_PASS_BLOCK_N  # streamed in column blocks
    narrow = rms_norm_module.launch_config("fwd", 100, torch.float32, cpu)
    assert narrow["BLOCK_N"] == 128 and narrow["BLOCK_M"] == 32  # short rows packed into one tile
    assert swiglu_module.launch_config("fwd", 11008, torch.bfloat16, cpu)["BLOCK_N"] == swiglu_module.MAX_BLOCK_N


def test_tuned_entry_wins_and_is_used_by_the_launch(tuned_table, backend):
    """A tuned config that forces the multi-pass path on a short row must still give right answers."""
    key = configs.config_key(n_cols=40, dtype=torch.float32)
    tuned = {"BLOCK_N": 16, "BLOCK_M": 2, "num_warps": 1}
    tuned_table({"rms_norm_fwd": {key: tuned}, "rms_norm_bwd": {key: tuned}, "swiglu_fwd": {key: tuned}})
    assert rms_norm_module.launch_config("fwd", 40, torch.float32, torch.device("cpu")) == tuned
    x = torch.randn(5, 40, requires_grad=True)
    w = torch.rand(40, requires_grad=True)
    y = kernels.rms_norm(x, w)
    torch.testing.assert_close(y, rms_norm_reference(x, w))
    grads = torch.autograd.grad(y.sum(), (x, w))
    ref_grads = torch.autograd.grad(rms_norm_reference(x, w).sum(), (x, w))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(kernels.swiglu(x, x), swiglu_reference(x, x))


def test_stale_entry_is_ignored_with_a_warning(tuned_table):
    key = configs.config_key(n_cols=64, dtype=torch.float32)
    tuned_table({"rms_norm_fwd": {key: {"BLOCK_N": 64, "BLOCK_SIZE": 3}}})
    with pytest.warns(UserWarning, match="unknown parameters"):
        cfg = rms_norm_module.launch_config("fwd", 64, torch.float32, torch.device("cpu"))
    assert "BLOCK_SIZE" not in cfg


def test_unreadable_table_is_ignored_with_a_warning(tmp_path, monkeypatch):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    monkeypatch.setenv("TRIDIST_KERNEL_CONFIGS", str(path))
    configs.clear_cache()
    with pytest.warns(UserWarning, match="unreadable"):
        rms_norm_module.launch_config("fwd", 64, torch.float32, torch.device("cpu"))
    configs.clear_cache()


def test_table_location_is_per_device(monkeypatch):
    monkeypatch.delenv("TRIDIST_KERNEL_CONFIGS", raising=False)
    path = configs.tuned_table_path(torch.device("cpu"))
    assert path.name == "cpu.json" and "tridist" in str(path)
    assert configs.config_key(n_cols=8, dtype=torch.bfloat16) == "dtype=bfloat16,n_cols=8"


class _Block(torch.nn.Module):
    """All three fused ops in one small block, the way a decoder layer uses them."""

    def __init__(self):
        super().__init__()
        self.norm = kernels.FusedRMSNorm(16)
        self.rotary = kernels.FusedRotaryEmbedding(8, 16)
        self.mlp = kernels.FusedSwiGLUMLP(16, 24)

    def forward(self, x, residual):
        y, h = self.norm(x, residual)
        q = y.view(2, 5, 2, 8)
        q, k = self.rotary(q, q[:, :, :1])
        return self.mlp(q.reshape(2, 5, 16)) + k.sum(), h


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
    for name in ("rms_norm", "add_rms_norm", "rms_norm_backward", "rotary", "swiglu", "swiglu_packed"):
        assert hasattr(torch.ops.tridist, name)
    q = torch.randn(1, 3, 2, 4)
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    torch.library.opcheck(torch.ops.tridist.rotary.default, (q, q, cos, sin, None, False, False, 4, False))
    torch.library.opcheck(torch.ops.tridist.swiglu.default, (torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)))
    torch.library.opcheck(
        torch.ops.tridist.add_rms_norm.default,
        (torch.randn(3, 8, requires_grad=True), torch.randn(3, 8), torch.rand(8, requires_grad=True), 1e-6, 0.0, False),
    )
    out = rotary_reference(q, q, cos, sin)[0]
    torch.testing.assert_close(out, q)  # identity rotation (cos 1, sin 0) guards the op arguments above


def test_import_kernels_stays_light():
    """`import kernels` must not pull optuna, pandas or matplotlib (heavy; only reports need them)."""
    code = "import sys, kernels; heavy = [m for m in ('optuna', 'pandas', 'matplotlib') if m in sys.modules]; print(heavy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
