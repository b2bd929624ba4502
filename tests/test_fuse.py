"""kernels.fuse on the seed model and a Hugging Face-style Llama: same outputs, gradients and training."""

from __future__ import annotations

import copy

import pytest
import torch

from tridist import kernels
from tridist.bench.models import build_model, hf_llama, seed_llama

MODELS = ["seed-llama", "hf-llama"]
VOCAB = 128  # the tiny configs' vocabulary


def _batch(batch=2, seq_len=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=generator)
    labels = torch.randint(0, VOCAB, (batch, seq_len), generator=generator)
    return ids, labels


def _fused_copy(model):
    fused = copy.deepcopy(model)
    return fused, kernels.fuse(fused)


@pytest.mark.parametrize("name", MODELS)
def test_fuse_replaces_every_norm_mlp_and_rotary(name):
    model = build_model(name)
    layers = 2  # tiny configs
    fused, report = _fused_copy(model)
    assert report.count("rms_norm") == 2 * layers + 1
    assert report.count("swiglu") == layers
    assert report.count("rotary") == layers
    assert report.skipped == []
    assert sum(isinstance(m, kernels.FusedRMSNorm) for m in fused.modules()) == 2 * layers + 1
    assert sum(isinstance(m, kernels.FusedSwiGLUMLP) for m in fused.modules()) == layers
    expected_cast = "weight" if name == "seed-llama" else "input"
    assert all(m.cast_to == expected_cast for m in fused.modules() if isinstance(m, kernels.FusedRMSNorm))
    # Parameter names (state dict keys, tensor-parallel plans) do not change.
    assert list(fused.state_dict()) == list(model.state_dict())
    assert "rms_norm" in str(report) and "rotary" in str(report)


@pytest.mark.parametrize("name", MODELS)
def test_fused_model_matches_outputs_and_gradients(name):
    model = build_model(name)
    fused, _ = _fused_copy(model)
    ids, labels = _batch()
    position_ids = torch.arange(8).flip(0).expand(2, 8) if name == "seed-llama" else None
    losses = []
    for m in (model, fused):
        loss, logits = m(ids, labels=labels, position_ids=position_ids)
        loss.backward()
        losses.append((loss, logits))
    torch.testing.assert_close(losses[1][0], losses[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[1][1], losses[0][1], rtol=1e-5, atol=1e-5)
    for (pname, p), q in zip(model.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=pname)


@pytest.mark.parametrize("name", MODELS)
def test_training_converges_identically(name):
    """A few AdamW steps with and without fuse: the same loss curve (convergence test)."""
    model = build_model(name)
    fused, _ = _fused_copy(model)
    curves = []
    for m in (model, fused):
        optimizer = torch.optim.AdamW(m.parameters(), lr=3e-3)
        curve = []
        for step in range(5):
            ids, labels = _batch(seed=step % 2)  # two batches, seen alternately, so the loss must fall
            loss, _ = m(ids, labels=labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            curve.append(loss.item())
        curves.append(curve)
    assert curves[0][-1] < curves[0][0]
    assert curves[1] == pytest.approx(curves[0], rel=1e-4)


def test_optimizer_built_before_fuse_keeps_training_the_model():
    model = build_model("seed-llama")
    params_before = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kernels.fuse(model)
    assert all(a is b for a, b in zip(model.parameters(), params_before))
    norm_weight = model.norm.weight.detach().clone()
    loss, _ = model(*_batch()[:1], labels=_batch()[1])
    loss.backward()
    optimizer.step()
    assert not torch.equal(model.norm.weight, norm_weight)


def test_rotary_fusion_is_per_instance():
    """Only the fused model's attention modules change; the defining module and other models don't."""
    original_function = seed_llama.apply_rotary_pos_emb
    model, other = build_model("seed-llama"), build_model("seed-llama")
    kernels.fuse(model)
    assert seed_llama.apply_rotary_pos_emb is original_function
    assert "forward" in vars(model.layers[0].self_attn)
    assert "forward" not in vars(other.layers[0].self_attn)
    fused_globals = model.layers[0].self_attn.forward.__func__.__globals__
    assert fused_globals["apply_rotary_pos_emb"].__wrapped__ is original_function


def test_fuse_twice_changes_nothing_more():
    model = build_model("hf-llama")
    kernels.fuse(model)
    second = kernels.fuse(model)
    assert second.replaced == [] and second.skipped == []


def test_selective_fusion():
    model = build_model("hf-llama")
    report = kernels.fuse(model, rms_norm=False, rotary=False)
    assert report.count("swiglu") == 2 and report.count("rms_norm") == 0 and report.count("rotary") == 0
    assert isinstance(model.model.norm, hf_llama.LlamaRMSNorm)


class _GeluMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(8, 12), torch.nn.Linear(8, 12), torch.nn.Linear(12, 8))

    def forward(self, x):
        return self.down_proj(torch.nn.functional.gelu(self.gate_proj(x)) * self.up_proj(x))


class _LayerNormWithoutBias(torch.nn.Module):
    """Structurally like an RMSNorm (one 1-D weight, an eps) but subtracts the mean."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))
        self.eps = 1e-5

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (8,), self.weight, None, self.eps)


class _Gemma1pNorm(torch.nn.Module):
    """Gemma's RMSNorm: scale by (1 + w), weight initialised at zero."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8))
        self.eps = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def test_look_alikes_are_left_alone_with_a_reason_and_offsets_are_detected():
    container = torch.nn.ModuleDict(
        {"gelu_mlp": _GeluMLP(), "layer_norm": _LayerNormWithoutBias(), "gemma_norm": _Gemma1pNorm()}
    )
    hooked = _Gemma1pNorm()
    hooked.register_forward_hook(lambda *args: None)
    container["hooked"] = hooked
    report = kernels.fuse(container)
    skipped = dict(report.skipped)
    assert "not down(silu(gate(x)) * up(x))" in skipped["gelu_mlp"]
    assert "not RMSNorm" in skipped["layer_norm"]
    assert "hooks" in skipped["hooked"]
    assert isinstance(container["gemma_norm"], kernels.FusedRMSNorm) and container["gemma_norm"].offset == 1.0
    assert isinstance(container["gelu_mlp"], _GeluMLP) and isinstance(container["layer_norm"], _LayerNormWithoutBias)
    x = torch.randn(3, 8)
    torch.testing.assert_close(container["gemma_norm"](x), _Gemma1pNorm.forward(container["gemma_norm"], x))


class _BiasFreeLayerNorm(torch.nn.Module):
    """A hand-written LayerNorm without bias: at large hidden sizes in bf16 its row means are tiny."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16))
        self.eps = 1e-5

    def forward(self, x):
        h = x.float()
        h = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


class _GeGLUWithZeroDown(_GeluMLP):
    """GeGLU whose down projection starts at zero (a common init): its output is 0, like SwiGLU's."""

    def __init__(self):
        super().__init__()
        torch.nn.init.zeros_(self.down_proj.weight)
        torch.nn.init.zeros_(self.down_proj.bias)


class _MLPWithExtraArgument(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(8, 12), torch.nn.Linear(8, 12), torch.nn.Linear(12, 8))

    def forward(self, x, scale):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)) * scale


def test_probes_are_not_fooled_by_values_or_precision():
    container = torch.nn.ModuleDict(
        {"layer_norm": _BiasFreeLayerNorm(8192), "geglu": _GeGLUWithZeroDown(), "extra_arg": _MLPWithExtraArgument()}
    )
    report = kernels.fuse(container)
    skipped = dict(report.skipped)
    assert report.replaced == []
    assert "not RMSNorm" in skipped["layer_norm"]
    assert "not down(silu(gate(x)) * up(x))" in skipped["geglu"]
    assert "forward failed on a probe" in skipped["extra_arg"] and "TypeError" in skipped["extra_arg"]


def test_fused_rotary_keeps_eager_dtype_promotion():
    """bf16 q with fp32 tables: eager `q * cos` gives fp32, so the fused call must fall back."""
    model = build_model("seed-llama")
    kernels.fuse(model)
    attention_globals = model.layers[0].self_attn.forward.__func__.__globals__
    fused_apply = attention_globals["apply_rotary_pos_emb"]
    q = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    cos, sin = torch.rand(1, 4, 1, 16), torch.rand(1, 4, 1, 16)
    out = fused_apply(q, q, cos, sin, None)
    expected = seed_llama.apply_rotary_pos_emb(q, q, cos, sin, None)
    assert out[0].dtype == expected[0].dtype == torch.float32
    torch.testing.assert_close(out[0], expected[0])


def test_meta_device_model_is_reported_not_crashed():
    with torch.device("meta"):
        model = build_model("seed-llama")
    report = kernels.fuse(model)
    assert report.count("rms_norm") == 0
    assert any("meta device" in why for _, why in report.skipped)


def test_fused_model_under_bf16():
    """bf16 weights (mixed precision training): fused and unfused stay within bf16 rounding."""
    model = build_model("hf-llama").to(torch.bfloat16)
    fused, report = _fused_copy(model)
    assert report.count("rms_norm") == 5
    ids, labels = _batch()
    loss, logits = model(ids, labels=labels)
    fused_loss, fused_logits = fused(ids, labels=labels)
    assert fused_logits.dtype == logits.dtype == torch.bfloat16
    assert abs(fused_loss.item() - loss.item()) < 0.02 * abs(loss.item())


@pytest.mark.parametrize("name", MODELS)
def test_compiled_fused_model_has_no_graph_breaks(name):
    """torch.compile(fullgraph=True) captures a fused model (the ops are torch.library ops)."""
    model = build_model(name)
    fused, _ = _fused_copy(model)
    ids, _ = _batch()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    _, logits = compiled(ids)
    _, expected = model(ids)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    logits.sum().backward()
    assert all(p.grad is not None for p in fused.parameters() if p.requires_grad)
