"""kernels.fuse on the seed model and a Hugging Face-style Llama: the fused kernels really run (counted
launches), logits and every gradient match within fp32 rounding, train/eval modes are kept, and the
structural candidates that do not compute RMSNorm/SwiGLU/rotary (near look-alikes) are left alone."""

from __future__ import annotations

import collections
import contextlib
import copy
import enum
import functools
import importlib
import inspect
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from transformers.utils.deprecation import deprecate_kwarg
from triton.runtime.jit import KernelInterface

from tridist import kernels
from tridist.bench.models import build_model, hf_llama, seed_llama

MODELS = ["seed-llama", "hf-llama"]
VOCAB = 128  # the tiny configs' vocabulary
LAYERS = 2  # the tiny configs' depth
HIDDEN = 64  # the tiny configs' hidden size
SEQ_LEN = 8

# Fused kernel launches of one forward (and, one backward kernel per call, of one backward) of a tiny
# model: two norms per layer and the final norm, one SwiGLU and one rotary (q and k together) per layer.
LAUNCHES = {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS}

# Tolerances from rounding, not fitted. Both models run the same matmuls; only the fused ops'
# evaluation order differs. The worst of those is RMSNorm's mean of squares, a sum of HIDDEN positive
# terms, whose rounding error is at most (HIDDEN − 1)·u relative, u = 2^-24 (recursive summation:
# γ(n−1) times the sum of |terms|; Higham, Accuracy and Stability of Numerical Algorithms, ch. 4);
# silu, the rotation and the rescale differ by a few ulps. Each fused op thus perturbs the residual
# stream by at most HIDDEN·u of its magnitude; the sum over the ops of a forward pass bounds the
# logits' difference relative to their largest entry, and the backward pass runs every op's backward
# kernel as well (twice the budget). A fused op computing other math (no sigmoid, swapped gate/up, a
# wrong eps or offset) moves logits by percents and gradients by ~100% (measured: 7-24% and 115-146%
# for a SwiGLU without its sigmoid), far outside these budgets.
U_FP32 = 2.0**-24
U_BF16 = 2.0**-8  # 8 significant bits
FUSED_OPS = sum(LAUNCHES.values())
FP32_FORWARD_BUDGET = FUSED_OPS * HIDDEN * U_FP32  # ≈ 3.4e-5
FP32_BACKWARD_BUDGET = 2 * FP32_FORWARD_BUDGET
# In bf16 the fused ops round where the eager model rounds (cast_to follows the model), so each op's
# output may differ by one bf16 rounding of its own, where the fp32 evaluation orders disagree.
BF16_FORWARD_BUDGET = FUSED_OPS * U_BF16  # ≈ 3.5%


def _batch(batch=2, seq_len=SEQ_LEN, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=generator)
    labels = torch.randint(0, VOCAB, (batch, seq_len), generator=generator)
    return ids, labels


def _fused_copy(model):
    fused = copy.deepcopy(model)
    return fused, kernels.fuse(fused)


@contextlib.contextmanager
def _kernel_launches():
    """Counts Triton kernel launches (`kernel[grid](...)`), keyed by the op file that defines the kernel
    ('rms_norm', 'swiglu', 'rotary'): proof that a fused op ran, which matching outputs are not (a
    fallback to the eager function matches too)."""
    counts = collections.Counter()
    launch = KernelInterface.__getitem__

    def counting_launch(kernel, grid):
        counts[kernel.fn.__module__.rpartition(".")[2]] += 1
        return launch(kernel, grid)

    with mock.patch.object(KernelInterface, "__getitem__", counting_launch):
        yield counts


def _assert_within(actual, expected, budget, what=""):
    """|actual − expected| ≤ budget · max|expected| everywhere (a norm-wise bound, so that tiny entries
    of a tensor are held to the rounding of its large ones, where fp32 rounding errors come from)."""
    assert actual.dtype == expected.dtype, what
    error = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert error <= budget * scale, f"{what}: max error {error:.3g} > {budget:.3g} x {scale:.3g}"


# ---------------------------------------------------------------------------------------- the models


@pytest.mark.parametrize("name", MODELS)
def test_fuse_replaces_every_norm_mlp_and_rotary(name):
    model = build_model(name)
    fused, report = _fused_copy(model)
    assert report.count("rms_norm") == LAUNCHES["rms_norm"]
    assert report.count("swiglu") == LAUNCHES["swiglu"]
    assert report.count("rotary") == LAUNCHES["rotary"]
    assert report.skipped == []
    assert sum(isinstance(m, kernels.FusedRMSNorm) for m in fused.modules()) == LAUNCHES["rms_norm"]
    assert sum(isinstance(m, kernels.FusedSwiGLUMLP) for m in fused.modules()) == LAUNCHES["swiglu"]
    expected_cast = "weight" if name == "seed-llama" else "input"
    assert all(m.cast_to == expected_cast for m in fused.modules() if isinstance(m, kernels.FusedRMSNorm))
    # Parameter names (state dict keys, tensor-parallel plans) do not change.
    assert list(fused.state_dict()) == list(model.state_dict())
    # Plain attributes that other code reads (sizes, eps under its own name) are carried over.
    norm = fused.norm if name == "seed-llama" else fused.model.norm
    mlp = (fused.layers if name == "seed-llama" else fused.model.layers)[0].mlp
    assert norm.variance_epsilon == norm.eps == (1.0 if name == "seed-llama" else 1e-6)
    assert mlp.intermediate_size == 176 and mlp.hidden_size == HIDDEN
    assert "rms_norm" in str(report) and "rotary" in str(report)


@pytest.mark.parametrize("name", MODELS)
def test_fused_kernels_run_and_match_logits_and_every_gradient(name):
    model = build_model(name)
    fused, _ = _fused_copy(model)
    ids, labels = _batch()
    # Reversed positions: a rotary that ignored position_ids would rotate by the wrong angles.
    position_ids = torch.arange(SEQ_LEN).flip(0).expand(2, SEQ_LEN)
    loss, logits = model(ids, labels=labels, position_ids=position_ids)
    loss.backward()
    with _kernel_launches() as forward:
        fused_loss, fused_logits = fused(ids, labels=labels, position_ids=position_ids)
    with _kernel_launches() as backward:
        fused_loss.backward()
    assert forward == LAUNCHES and backward == LAUNCHES
    _assert_within(fused_logits, logits, FP32_FORWARD_BUDGET, "logits")
    _assert_within(fused_loss, loss, FP32_FORWARD_BUDGET, "loss")
    for (pname, p), q in zip(model.named_parameters(), fused.parameters()):
        _assert_within(q.grad, p.grad, FP32_BACKWARD_BUDGET, pname)


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


def test_fused_model_under_bf16():
    """bf16 weights (mixed precision training): fused and unfused logits stay within bf16 rounding."""
    model = build_model("hf-llama").to(torch.bfloat16)
    fused, report = _fused_copy(model)
    assert report.count("rms_norm") == LAUNCHES["rms_norm"]
    ids, _ = _batch()
    _, logits = model(ids)
    with _kernel_launches() as launches:
        _, fused_logits = fused(ids)
    assert launches == LAUNCHES
    assert fused_logits.dtype == logits.dtype == torch.bfloat16
    _assert_within(fused_logits, logits, BF16_FORWARD_BUDGET, "bf16 logits")


def test_replacements_keep_each_modules_train_eval_mode():
    """A replacement takes the mode of the module it replaces; the projections it wraps keep theirs."""
    model = build_model("hf-llama").eval()
    model.model.layers[0].train()
    model.model.layers[0].mlp.down_proj.eval()  # e.g. a frozen adapter inside a training MLP
    before = {name: module.training for name, module in model.named_modules()}
    report = kernels.fuse(model)
    assert report.count("rms_norm") == LAUNCHES["rms_norm"] and report.count("swiglu") == LAUNCHES["swiglu"]
    after = {name: module.training for name, module in model.named_modules()}
    assert {name: before[name] for name in after} == after
    assert after["model.layers.0.input_layernorm"] and not after["model.layers.1.input_layernorm"]
    assert after["model.layers.0.mlp"] and not after["model.layers.0.mlp.down_proj"]


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


def test_meta_device_model_is_fused_in_place():
    """Probes run on CPU copies: a model still on meta is fused like a materialised one, parameters kept."""
    with torch.device("meta"):
        model = build_model("seed-llama")
    params = list(model.parameters())
    report = kernels.fuse(model)
    assert {kind: report.count(kind) for kind in LAUNCHES} == LAUNCHES and report.skipped == []
    assert all(a is b for a, b in zip(model.parameters(), params)) and all(p.is_meta for p in params)


@pytest.mark.parametrize("name", MODELS)
def test_compiled_fused_model_has_no_graph_breaks(name):
    """torch.compile(fullgraph=True) captures a fused model (the ops are torch.library ops)."""
    model = build_model(name)
    fused, _ = _fused_copy(model)
    ids, _ = _batch()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    _, logits = compiled(ids)
    _, expected = model(ids)
    _assert_within(logits, expected, FP32_FORWARD_BUDGET, "compiled logits")
    logits.sum().backward()
    assert all(p.grad is not None for p in fused.parameters() if p.requires_grad)


# ------------------------------------------------------------------------- near look-alikes, variants


class _Norm(torch.nn.Module):
    """Structurally an RMSNorm (one 1-D weight, an eps); `normalise(h, eps)` (fp32) says what it computes.
    Scales by `offset + weight` and returns the input's dtype (as Hugging Face's RMSNorm does)."""

    def __init__(self, hidden, normalise, *, eps=1e-6, offset=0.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((hidden,), 1.0 - offset))  # offset + weight starts at 1
        self.eps, self.offset, self.normalise = eps, offset, normalise

    def forward(self, x):
        return (self.normalise(x.float(), self.eps) * (self.offset + self.weight.float())).to(x.dtype)


def _mean_square(h):
    return h.pow(2).mean(-1, keepdim=True)


def _rms(h, eps):
    return h * torch.rsqrt(_mean_square(h) + eps)


def _rms_by_division(h, eps):  # the same math in another order: sqrt, then divide
    return h / torch.sqrt(_mean_square(h) + eps)


def _eps_outside_sqrt(h, eps):
    return h / (_mean_square(h).sqrt() + eps)


def _layer_norm(h, eps):  # subtracts the mean
    return (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + eps)


def _by_variance(h, eps):  # the variance instead of the mean square: RMSNorm on zero-mean rows only
    return h * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + eps)


def _needs_state(h, eps):  # a forward that cannot run on a probe (state the probe's copy lacks)
    raise RuntimeError("no cache was set up")


def _bessel_mean_square(h, eps):  # sum of squares over n − 1: 1/(2n) relative off RMSNorm
    return h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / (h.shape[-1] - 1) + eps)


class _GatedMLP(torch.nn.Module):
    """Structurally a SwiGLU MLP (gate/up/down, or a packed gate_up); `combine(first, second)` of the
    two projections says what it computes."""

    def __init__(self, combine, *, packed=False, bias=False, hidden=8, ffn=12):
        super().__init__()
        if packed:
            self.gate_up_proj = torch.nn.Linear(hidden, 2 * ffn, bias=bias)
        else:
            self.gate_proj = torch.nn.Linear(hidden, ffn, bias=bias)
            self.up_proj = torch.nn.Linear(hidden, ffn, bias=bias)
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=bias)
        self.combine = combine

    def forward(self, x):
        if "gate_up_proj" in self._modules:
            first, second = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            first, second = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.combine(first, second))


def _swiglu(gate, up):
    return F.silu(gate) * up


class _GatedNorm(_Norm):
    """Mamba 2's gated RMSNorm (transformers' MambaRMSNormGated, also in Bamba, Falcon-H1, Nemotron-H, Zamba 2):
    `norm(x, gate)` multiplies silu(gate) in before normalising. Called with its input alone (as a probe calls
    it) it is a plain RMSNorm: only the forward's signature tells it apart."""

    def forward(self, x, gate=None):
        if gate is not None:
            x = x * F.silu(gate)
        return super().forward(x)


class _ScaledMLP(_GatedMLP):
    """A SwiGLU MLP whose forward takes a second input (a per-token scale, as some shared experts take their
    routing weights); with the input alone it is a plain SwiGLU MLP."""

    def forward(self, x, scale=None):
        out = super().forward(x)
        return out if scale is None else out * scale


def _hooked(module, pre=False):
    (module.register_forward_pre_hook if pre else module.register_forward_hook)(lambda *args: None)
    return module


NOT_RMS_NORM = "not RMSNorm"
NOT_SWIGLU = "not down(act(gate(x)) * up(x)) for act silu, gelu or gelu's tanh approximation"
# factory -> what fuse must do: ("rms_norm", offset) or ("swiglu" / "geglu", activation) to replace, else the
# reason to skip.
CANDIDATES = {
    # True RMSNorms, however written: replaced, with the offset detected.
    "rms": (lambda: _Norm(HIDDEN, _rms), ("rms_norm", 0.0)),
    "rms-by-division": (lambda: _Norm(HIDDEN, _rms_by_division), ("rms_norm", 0.0)),
    "rms-seed-eps-1": (lambda: _Norm(HIDDEN, _rms, eps=1.0), ("rms_norm", 0.0)),
    "gemma-1-plus-w": (lambda: _Norm(HIDDEN, _rms, offset=1.0), ("rms_norm", 1.0)),
    "torch-nn-rmsnorm": (lambda: torch.nn.RMSNorm(HIDDEN, eps=1e-6), ("rms_norm", 0.0)),
    # Near look-alikes of RMSNorm: left alone.
    "layer-norm-no-bias": (lambda: _Norm(HIDDEN, _layer_norm), NOT_RMS_NORM),
    "eps-outside-sqrt": (lambda: _Norm(HIDDEN, _eps_outside_sqrt, eps=1.0), NOT_RMS_NORM),
    # Pins the probe's non-zero mean: on zero-mean rows of this width, var and mean square differ by
    # mean²/var ~ 1/hidden ≈ 2e-5 relative, inside the probe's tolerance; with the mean, by ~100%.
    "variance-not-mean-square": (lambda: _Norm(65536, _by_variance), NOT_RMS_NORM),
    # Pins the probe's tolerance (rtol 1e-4): 1/(2·2047) ≈ 2.4e-4 relative off, which a probe
    # loosened to 1e-3 would accept.
    "bessel-mean-square": (lambda: _Norm(2048, _bessel_mean_square), NOT_RMS_NORM),
    "forward-raises-on-a-probe": (lambda: _Norm(HIDDEN, _needs_state), "forward failed on a probe (RuntimeError: no cache"),
    "rms-with-pre-hook": (lambda: _hooked(_Norm(HIDDEN, _rms), pre=True), "hooks"),
    "rms-with-hook": (lambda: _hooked(_Norm(HIDDEN, _rms)), "hooks"),
    # A forward that takes more than its input: the probe sees the module's plain path only, and FusedRMSNorm
    # would take the gate for a residual.
    "gated-rms-norm": (lambda: _GatedNorm(HIDDEN, _rms), "takes more than the input (gate)"),
    # True SwiGLU MLPs: replaced.
    "swiglu": (lambda: _GatedMLP(_swiglu), ("swiglu", "silu")),
    "swiglu-sigmoid-written-out-with-biases": (lambda: _GatedMLP(lambda g, u: g * torch.sigmoid(g) * u, bias=True),
                                               ("swiglu", "silu")),
    "swiglu-packed-gate-up": (lambda: _GatedMLP(_swiglu, packed=True), ("swiglu", "silu")),
    # True GeGLU MLPs, each gelu told from the other (they differ by ~1e-4 at the probe's scale): replaced.
    "geglu": (lambda: _GatedMLP(lambda g, u: F.gelu(g) * u), ("geglu", "gelu")),
    "geglu-tanh": (lambda: _GatedMLP(lambda g, u: F.gelu(g, approximate="tanh") * u), ("geglu", "gelu_tanh")),
    "geglu-tanh-written-out-packed": (lambda: _GatedMLP(
        lambda g, u: 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))) * u, packed=True),
        ("geglu", "gelu_tanh")),
    # Near look-alikes: left alone.
    "swapped-gate-up": (lambda: _GatedMLP(lambda g, u: F.silu(u) * g), NOT_SWIGLU),
    "packed-up-gate": (lambda: _GatedMLP(lambda g, u: F.silu(u) * g, packed=True), NOT_SWIGLU),
    "geglu-swapped-gate-up": (lambda: _GatedMLP(lambda g, u: F.gelu(u) * g), NOT_SWIGLU),
    # quick_gelu, x sigmoid(1.702 x), is within ~0.02 of gelu: nearest is not near enough.
    "quick-gelu": (lambda: _GatedMLP(lambda g, u: g * torch.sigmoid(1.702 * g) * u), NOT_SWIGLU),
    "bilinear-no-sigmoid": (lambda: _GatedMLP(lambda g, u: g * u), NOT_SWIGLU),
    "swiglu-with-a-second-input": (lambda: _ScaledMLP(_swiglu), "takes more than the input (scale)"),
}


def _probe_rows(width):
    """Rows of very different scales, from below eps's square root (where how eps enters decides the
    output) to large, with and without a mean."""
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(5, width, generator=generator)
    scales = torch.tensor([1e-4, 1e-3, 0.1, 1.0, 10.0])[:, None]
    return rows * scales + torch.tensor([0.0, 0.0, 0.0, 2.0, -5.0])[:, None]


# fuse's rounding probe runs a bf16-weight copy on fp32 input, which torch.nn.RMSNorm warns about
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("kind", CANDIDATES)
def test_fuse_replaces_true_variants_and_leaves_near_look_alikes(kind):
    factory, expected = CANDIDATES[kind]
    container = torch.nn.ModuleDict({"candidate": factory()})
    original = copy.deepcopy(container["candidate"])
    report = kernels.fuse(container)
    if isinstance(expected, str):
        assert report.replaced == [] and container["candidate"].__class__ is original.__class__
        assert expected in dict(report.skipped)["candidate"]
        return
    op, detail = expected
    assert report.skipped == [] and report.count(op) == 1
    replaced = container["candidate"]
    assert isinstance(replaced, kernels.FusedRMSNorm if op == "rms_norm" else kernels.FusedSwiGLUMLP)
    if op == "rms_norm":
        assert replaced.offset == detail and replaced.eps == original.eps
    else:
        assert replaced.activation == detail
    # One fused op: within (its longest sum)·u of the original's largest output, as FP32_FORWARD_BUDGET
    # argues: the norm's mean of squares, or the down projection's sum over the silu products.
    if op == "rms_norm":
        width = reduction = replaced.weight.shape[0]
    else:
        width, reduction = replaced.down_proj.out_features, replaced.down_proj.in_features
    x = _probe_rows(width)
    with _kernel_launches() as launches:
        out = replaced(x)
    assert launches == {"swiglu" if op == "geglu" else op: 1}  # GeGLU runs the gated activations' kernel
    _assert_within(out, original(x), reduction * U_FP32, kind)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_one_fuse_call_probes_each_kind_once_and_gives_each_its_own_verdict(monkeypatch):
    """fuse probes one module per kind (fuse._kind: class, parameter shapes, plain attributes, attribute
    objects by identity, children): every candidate above twice in one model gets the verdict it gets
    alone, with one probe per kind. Look-alikes of one class differ only in an attribute (the function
    `normalise` or `combine`, eps, the offset): a kind that ignored attributes would hand the first
    one's verdict to the others."""
    fuse_module = importlib.import_module("tridist.kernels.fuse")  # `kernels.fuse` is the function
    probes = []
    for name in ("_rms_norm_verdict", "_gated_mlp_verdict"):
        original = getattr(fuse_module, name)
        monkeypatch.setattr(fuse_module, name, lambda module, *args, _original=original: (probes.append(module), _original(module, *args))[1])
    first = {kind: factory() for kind, (factory, _) in CANDIDATES.items()}
    # The second of each a deep copy: the same attribute objects (a lambda is another object per factory call)
    container = torch.nn.ModuleDict({f"{kind}_{i}": m if i == 0 else copy.deepcopy(m) for kind, m in first.items() for i in (0, 1)})
    report = kernels.fuse(container)
    replaced, skipped = dict(report.replaced), dict(report.skipped)
    for kind, (_, expected) in CANDIDATES.items():
        for name in (f"{kind}_0", f"{kind}_1"):
            if isinstance(expected, str):
                assert name not in replaced and expected in skipped[name], (name, report)
            else:
                op, offset = expected
                assert replaced[name].startswith(op) and name not in skipped, (name, report)
                if op == "rms_norm":
                    assert container[name].offset == offset, name
    unprobed = sum(1 for _, expected in CANDIDATES.values()  # refused before any probe
                   if isinstance(expected, str) and ("hooks" in expected or "more than the input" in expected))
    assert len(probes) == len(CANDIDATES) - unprobed, [type(m).__name__ for m in probes]


class _Mode(str, enum.Enum):
    GEMMA = "gemma"


class _NormByMode(torch.nn.Module):
    """An RMSNorm whose offset depends on what `mode` is (its type, not only its value) and on whether a
    `bias` parameter is registered, even as None: look-alikes that only a type- and None-aware kind tells apart."""

    def __init__(self, mode, *, bias_slot=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((HIDDEN,), 0.5))
        self.eps, self.mode = 1e-6, mode
        if bias_slot:
            self.register_parameter("bias", None)

    def forward(self, x):
        gemma = self.mode is _Mode.GEMMA or self.mode is True or "bias" in self._parameters
        return (_rms(x.float(), self.eps) * ((1.0 if gemma else 0.0) + self.weight.float())).to(x.dtype)


@pytest.mark.parametrize("plain, other", [
    (lambda: _NormByMode("gemma"), lambda: _NormByMode(_Mode.GEMMA)),  # equal in Python, a str and an Enum
    (lambda: _NormByMode(1), lambda: _NormByMode(True)),  # 1 == True
    (lambda: _NormByMode(0), lambda: _NormByMode(0, bias_slot=True)),  # a parameter registered as None
])
def test_modules_alike_only_in_value_get_their_own_probe(plain, other):
    """Two modules of one class whose attributes compare equal (or differ by a None parameter) but compute
    different functions: in one fuse call each gets the offset it gets alone (0 and 1), whichever comes first."""
    for first, second in ((plain, other), (other, plain)):
        container = torch.nn.ModuleDict({"a": first(), "b": second()})
        kernels.fuse(container)
        offsets = [container["a"].offset, container["b"].offset]
        expected = []
        for make in (first, second):
            single = torch.nn.ModuleDict({"m": make()})
            kernels.fuse(single)
            expected.append(single["m"].offset)
        assert sorted(expected) == [0.0, 1.0] and offsets == expected, (offsets, expected)


def _rotary_ignoring_positions(q, k, cos, sin, position_ids):
    """The seed's signature, but rows 0..S-1 of the tables whatever position_ids say."""
    return seed_llama.apply_rotary_pos_emb(q, k, cos, sin, None)


def _rotate_pairs(x):
    """GPT-J's rotation by 90 degrees of adjacent features: (x_2j, x_2j+1) -> (-x_2j+1, x_2j)."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


def _rotary_interleaved(q, k, cos, sin, position_ids):
    """GPT-J's pairing (adjacent features) with the seed's signature: another rotation."""
    cos, sin = (table[0, :, 0][position_ids].unsqueeze(2) for table in (cos, sin))  # [B, S, 1, D]
    return q * cos + _rotate_pairs(q) * sin, k * cos + _rotate_pairs(k) * sin


class _AttentionIgnoringPositions(torch.nn.Module):
    def forward(self, q, k, cos, sin, position_ids):
        return _rotary_ignoring_positions(q, k, cos, sin, position_ids)


class _InterleavedAttention(torch.nn.Module):
    def forward(self, q, k, cos, sin, position_ids):
        return _rotary_interleaved(q, k, cos, sin, position_ids)


@pytest.mark.parametrize("attention", [_AttentionIgnoringPositions, _InterleavedAttention])
def test_rotary_look_alikes_are_left_alone(attention):
    container = torch.nn.ModuleDict({"attention": attention()})
    report = kernels.fuse(container)
    assert report.replaced == []
    assert "does not behave like the seed's or Hugging Face's rotary" in dict(report.skipped)["attention"]
    assert "forward" not in vars(container["attention"])


def _hf_interleaved_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """Cohere's rotary (Hugging Face's signature, adjacent features paired, tables repeat_interleave'd)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_pairs(q) * sin, k * cos + _rotate_pairs(k) * sin


def _hf_rotary_swapping_pairs(q, k, cos, sin, unsqueeze_dim=1):
    """The same pairs with the sign of a rotation lost: no rotation at all."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def swap_pairs(x):
        return torch.stack([x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)

    return q * cos + swap_pairs(q) * sin, k * cos + swap_pairs(k) * sin


class _CohereLikeAttention(torch.nn.Module):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _hf_interleaved_rotary(q, k, cos, sin, unsqueeze_dim)


class _SwappingAttention(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return _hf_rotary_swapping_pairs(q, k, cos, sin)


@pytest.mark.parametrize("decorated", [False, True])
def test_interleaved_rotary_is_fused_and_matches_forward_and_backward(decorated):
    """Hugging Face's signature with GPT-J's pairing (Cohere) runs the kernel's interleaved path in both layouts;
    q, k and their gradients within fp32 rounding of the function's own. Each output is x_a c - x_b s (two
    products and a sum, each way): within 2u (|x_a| + |x_b|) <= 2u·√2·|(x_a, x_b)| of exact, and a rotation
    keeps the pair's norm, which is at most √2 max|output|: 4u of the largest output. `decorated`: the forward
    under two decorators (transformers 5.24 wraps every attention forward in one; fuse found no rotary call in
    the wrapper's code, and left every family's rotary unfused without a word)."""
    attention = _DecoratedCohereLikeAttention() if decorated else _CohereLikeAttention()
    report = kernels.fuse(torch.nn.ModuleDict({"attention": attention}))
    assert report.replaced == [("attention", "rotary: _hf_interleaved_rotary (hf convention, interleaved pairs)")], str(report)
    cos, sin = _interleaved_tables()
    _assert_fused_rotary_matches(attention, _hf_interleaved_rotary, cos, sin, seed=3, dtype=torch.float32,
                                 budget=4 * U_FP32)


def _interleaved_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Cohere's cos and sin tables: each pair's angle repeated for its two adjacent features, [B, S, D]."""
    seq, dim = _ROTARY_SEQ, _ROTARY_DIM
    freqs = torch.outer(torch.arange(seq).float(), 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
    return tuple(f(freqs.repeat_interleave(2, -1)).expand(_ROTARY_BATCH, seq, dim) for f in (torch.cos, torch.sin))


def _renaming_keyword(old: str, new: str):
    """A decorator as transformers' `deprecate_kwarg` (on attention forwards since 5.24, renaming
    `past_key_values` to `cache`): a functools.wraps wrapper that renames a keyword and calls the function it
    closes over. Its wrapper also takes a keyword-only default and holds the function in two cells (the copy
    must keep both)."""
    def decorator(function):
        same = function

        @functools.wraps(function)
        def wrapper(*args, _names=(old, new), **kwargs):
            if same is not function:
                raise AssertionError("the wrapper's two cells hold different functions")
            if _names[0] in kwargs:
                kwargs[_names[1]] = kwargs.pop(_names[0])
            return function(*args, **kwargs)
        return wrapper
    return decorator


_BY_NAME = {}


def _looked_up_by_name(function):
    """A decorator whose wrapper finds the function it wraps by name at each call: no closure holds it."""
    _BY_NAME[function.__qualname__] = function

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return _BY_NAME[wrapper.__qualname__](*args, **kwargs)
    return wrapper


def _calling_a_partial(function):
    """A wrapper that holds the function (for its name) but calls a functools.partial of it."""
    call = functools.partial(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        assert function.__name__ == "forward"
        return call(*args, **kwargs)
    return wrapper


class _ClassDecorator:
    """A class-based decorator (functools.update_wrapper on an instance): no plain function to copy."""

    def __init__(self, function):
        functools.update_wrapper(self, function)
        self.function = function

    def __get__(self, instance, owner):
        return self if instance is None else functools.partial(self, instance)

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)


class _DecoratedCohereLikeAttention(torch.nn.Module):
    # Two levels, the outer one transformers' own (its wrapper reads its module's globals, not this one's).
    @deprecate_kwarg("axis", "99.0", new_name="dim")
    @_renaming_keyword("dim", "unsqueeze_dim")
    def forward(self, q, k, cos, sin, *, unsqueeze_dim=1):  # keyword-only: the copy must keep its default
        return _hf_interleaved_rotary(q, k, cos, sin, unsqueeze_dim)


def _attention_under(decorator) -> torch.nn.Module:
    class Attention(torch.nn.Module):
        @decorator
        def forward(self, q, k, cos, sin, unsqueeze_dim=1):
            return _hf_interleaved_rotary(q, k, cos, sin, unsqueeze_dim)
    return Attention()


def test_a_decorated_forward_keeps_its_decorators_and_its_class_untouched():
    """A forward under decorators is copied level by level (the fused kernel runs: the interleaved test above):
    its keyword-only default and the wrappers' own are kept, the wrappers still rename their keywords, and the
    class's own forward is untouched."""
    attention = _DecoratedCohereLikeAttention()
    kernels.fuse(torch.nn.ModuleDict({"attention": attention}))
    cos, sin = _interleaved_tables()
    q = torch.randn(_ROTARY_BATCH, _ROTARY_SEQ, _ROTARY_HEADS, _ROTARY_DIM)
    with _kernel_launches() as counted, pytest.warns(FutureWarning, match="axis"):  # transformers' wrapper ran
        renamed = attention(q, q, cos, sin, axis=2)  # axis -> dim -> unsqueeze_dim: the bshd layout
    assert counted.get("rotary", 0) == 1
    _assert_within(renamed[0], _hf_interleaved_rotary(q, q, cos, sin, unsqueeze_dim=2)[0], 4 * U_FP32, "q")
    q = q.transpose(1, 2)
    with _kernel_launches() as counted:
        default = attention(q, q, cos, sin)  # unsqueeze_dim's default, 1: the bhsd layout
    assert counted.get("rotary", 0) == 1
    _assert_within(default[0], _hf_interleaved_rotary(q, q, cos, sin)[0], 4 * U_FP32, "q")
    assert inspect.unwrap(_DecoratedCohereLikeAttention.forward).__globals__["_hf_interleaved_rotary"] is _hf_interleaved_rotary
    # The copy's `__wrapped__` chain leads to the fused code (what introspection and a later fuse read).
    assert inspect.unwrap(attention.forward).__globals__["_hf_interleaved_rotary"].__wrapped__ is _hf_interleaved_rotary
    assert attention.forward.__qualname__ == _DecoratedCohereLikeAttention.forward.__qualname__


@pytest.mark.parametrize("decorator", [_looked_up_by_name, _calling_a_partial, _ClassDecorator, functools.lru_cache])
def test_a_decorator_the_fused_copy_cannot_be_put_into_is_left_alone(decorator):
    """A wrapper that holds what it wraps in no closure cell, one that calls it through a partial, and decorators
    that are no plain function (a class's instance, functools.lru_cache) cannot be made to call a fused copy:
    left alone, with the reason (the last two made fuse crash, the partial was reported fused but never ran it)."""
    attention = _attention_under(decorator)
    report = kernels.fuse(torch.nn.ModuleDict({"attention": attention}))
    assert report.replaced == [] and "cannot be made to call a fused copy" in dict(report.skipped)["attention"], str(report)
    assert "forward" not in vars(attention)


_ROTARY_BATCH, _ROTARY_SEQ, _ROTARY_HEADS, _ROTARY_KV_HEADS, _ROTARY_DIM = 2, 6, 4, 2, 16


def _assert_fused_rotary_matches(module, function, cos, sin, *, seed, dtype, budget, launches=1):
    """The fused `module` (`launches` rotary launches) against its original `function` (none) in both of Hugging
    Face's layouts (unsqueeze_dim 1: bhsd, 2: bshd): q, k and their gradients within `budget` of the largest value."""
    generator = torch.Generator().manual_seed(seed)
    batch, seq, heads, kv_heads, dim = _ROTARY_BATCH, _ROTARY_SEQ, _ROTARY_HEADS, _ROTARY_KV_HEADS, _ROTARY_DIM
    for unsqueeze_dim, q_shape, k_shape in ((1, (batch, heads, seq, dim), (batch, kv_heads, seq, dim)),
                                            (2, (batch, seq, heads, dim), (batch, seq, kv_heads, dim))):
        q = torch.randn(q_shape, generator=generator).to(dtype)
        k = torch.randn(k_shape, generator=generator).to(dtype)
        grads = torch.randn(q_shape, generator=generator).to(dtype), torch.randn(k_shape, generator=generator).to(dtype)
        results = []
        for call in (module, function):
            qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
            with _kernel_launches() as counted:
                outs = call(qi, ki, cos, sin, unsqueeze_dim=unsqueeze_dim)
            torch.autograd.backward(outs, grads)
            results.append((counted.get("rotary", 0), *outs, qi.grad, ki.grad))
        (fused_launches, *fused), (eager_launches, *eager) = results
        assert (fused_launches, eager_launches) == (launches, 0)
        for name, a, b in zip(("q", "k", "dq", "dk"), fused, eager):
            _assert_within(a, b, budget, name)


def _glm_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """GLM-4's rotary: the usual [freqs | freqs] tables, pair j by the first half's entry j (repeat_interleave'd),
    over the tables' width (partial when narrower than the head)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    width = cos.shape[-1]

    def rotate(x):
        rot, passed = x[..., :width], x[..., width:]
        return torch.cat([rot * cos + _rotate_pairs(rot) * sin, passed], dim=-1)

    return rotate(q), rotate(k)


def _ernie_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """ERNIE 4.5's: GLM's pairing, computed in fp32 and cast back to q's dtype (ERNIE's own has no partial rotary;
    this one, GLM's underneath, accepts narrower tables too)."""
    q_out, k_out = _glm_rotary(q.float(), k.float(), cos.float(), sin.float(), unsqueeze_dim)
    return q_out.to(q.dtype), k_out.to(k.dtype)


def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """DeepSeek-V3's rotary as transformers 5 writes it: GLM's pairs, each pair's results written as halves."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    if k is None:  # mistral_large4's variant rotates q alone when k is None
        return q_embed, None
    k1, k2 = k[..., 0::2], k[..., 1::2]
    return q_embed, torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)


class _GLMAttention(torch.nn.Module):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _glm_rotary(q, k, cos, sin, unsqueeze_dim)


class _DeepSeekAttention(torch.nn.Module):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


class _ErnieAttention(torch.nn.Module):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _ernie_rotary(q, k, cos, sin, unsqueeze_dim)


@pytest.mark.parametrize("attention, function, rotary_width, dtype, what", [
    (_GLMAttention, _glm_rotary, 8, torch.float32, "interleaved pairs from the table's first half, partial rotary"),
    (_GLMAttention, _glm_rotary, 16, torch.float32, "interleaved pairs from the table's first half, partial rotary"),
    # bf16 q and k with fp32 tables: ERNIE returns bf16 (fp32 math cast back), as the kernel does
    (_ErnieAttention, _ernie_rotary, 16, torch.bfloat16, "interleaved pairs from the table's first half, partial rotary"),
    # DeepSeek-V3's: no partial rotary (a narrower table does not broadcast against its pairs)
    (_DeepSeekAttention, apply_rotary_pos_emb_interleave, 16, torch.float32,
     "interleaved pairs from the table's first half written as halves"),
])
def test_glm_and_ernie_rotary_are_fused_and_match_forward_and_backward(attention, function, rotary_width, dtype, what):
    """GLM-4's, ERNIE 4.5's and DeepSeek-V3's rotary (Hugging Face's signature; the tables' first half rotates
    adjacent pairs, DeepSeek writes the results as halves) runs the kernel's interleaved path with half tables
    (DeepSeek's with `deinterleave`), in both layouts, partial where the tables are narrower
    than the head; outputs and gradients within rounding of the function's own: 4u of the largest output in fp32
    (as test_interleaved_rotary_is_fused_and_matches_forward_and_backward argues), and in bf16 one rounding of
    the same fp32 values on each side (2 x 2**-8 relative)."""
    module = attention()
    report = kernels.fuse(torch.nn.ModuleDict({"attention": module}))
    assert report.replaced == [("attention", f"rotary: {function.__name__} (hf convention, {what})")], str(report)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_width, 2).float() / rotary_width)
    freqs = torch.outer(torch.arange(_ROTARY_SEQ).float(), inv_freq)
    cos, sin = (f(torch.cat([freqs, freqs], -1)).expand(_ROTARY_BATCH, _ROTARY_SEQ, rotary_width)
                for f in (torch.cos, torch.sin))
    _assert_fused_rotary_matches(module, function, cos, sin, seed=4, dtype=dtype,
                                 budget=4 * U_FP32 if dtype == torch.float32 else 2 * 2**-8)


def test_deepseek_rotary_of_q_alone_runs_the_original():
    """mistral_large4's DeepSeek rotary takes k=None to rotate q alone: the fused function hands that call to the
    original (the kernel rotates q and k together), and fuses the calls with k."""
    module = _DeepSeekAttention()
    kernels.fuse(torch.nn.ModuleDict({"attention": module}))
    q = torch.randn(_ROTARY_BATCH, _ROTARY_HEADS, _ROTARY_SEQ, _ROTARY_DIM)
    cos, sin = torch.rand(2, _ROTARY_BATCH, _ROTARY_SEQ, _ROTARY_DIM).unbind(0)
    with _kernel_launches() as launches:
        q_out, k_out = module(q, None, cos, sin)
    assert k_out is None and launches.get("rotary", 0) == 0
    torch.testing.assert_close(q_out, apply_rotary_pos_emb_interleave(q, None, cos, sin)[0], rtol=0, atol=0)
    with _kernel_launches() as launches:
        module(q, q, cos, sin)
    assert launches["rotary"] == 1


def apply_rotary_emb(xq, xk, freqs_cis):
    """Llama 4's rotary as transformers 5 writes it: adjacent pairs times complex freqs_cis [B, S, D/2] in fp32 (bshd)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def apply_rotary_emb_bhsd(xq, xk, freqs_cis):
    """DeepSeek-V2's: the same on [B, H, S, D] (its freqs_cis scaled by YaRN's attention factor)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.unsqueeze(1)
    return (torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk))


def _gpt_oss_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """gpt-oss's: tables of one entry per pair ([B, S, D/2]), pairs (j, j + D/2)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate(x):
        first, second = torch.chunk(x, 2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    return rotate(q), rotate(k)


class _Llama4Attention(torch.nn.Module):
    def forward(self, q, k, freqs_cis):
        return apply_rotary_emb(q, k, freqs_cis)


class _DeepSeekV2Attention(torch.nn.Module):
    def forward(self, q, k, freqs_cis):
        return apply_rotary_emb_bhsd(q, k, freqs_cis)


class _GptOssAttention(torch.nn.Module):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _gpt_oss_rotary(q, k, cos, sin, unsqueeze_dim)


@pytest.mark.parametrize("attention, function, layout, dtype", [
    (_Llama4Attention, apply_rotary_emb, "bshd", torch.float32),
    (_DeepSeekV2Attention, apply_rotary_emb_bhsd, "bhsd", torch.float32),
    (_Llama4Attention, apply_rotary_emb, "bshd", torch.bfloat16),  # fp32 math cast back, as the kernel
])
def test_complex_rotary_is_fused_and_matches_forward_and_backward(attention, function, layout, dtype):
    """Llama 4's and DeepSeek-V2's `apply_rotary_emb(xq, xk, freqs_cis)` (complex tables, adjacent pairs, each
    in its layout) run the kernel's interleaved path with freqs_cis's real and imaginary parts as half tables, of
    any magnitude (DeepSeek-V2 scales them; 1.2 here); q, k and their gradients within rounding of the
    function's own: 4u of the largest output in fp32, as test_interleaved_rotary_is_fused_and_matches_forward_and_
    backward argues (a complex product is the same two products and a sum; a magnitude scales both sides alike),
    and in bf16 one rounding of the same fp32 values each (2 x 2**-8 relative)."""
    module = attention()
    report = kernels.fuse(torch.nn.ModuleDict({"attention": module}))
    assert report.replaced == [("attention", f"rotary: {function.__name__} (complex convention ({layout}))")], str(report)
    generator = torch.Generator().manual_seed(5)
    batch, seq, heads, kv_heads, dim = _ROTARY_BATCH, _ROTARY_SEQ, _ROTARY_HEADS, _ROTARY_KV_HEADS, _ROTARY_DIM
    angles = torch.outer(torch.arange(seq).float(), 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs_cis = torch.polar(torch.full((batch, seq, dim // 2), 1.2), angles.expand(batch, seq, dim // 2))
    shape = (lambda h: (batch, seq, h, dim)) if layout == "bshd" else (lambda h: (batch, h, seq, dim))
    q, k = (torch.randn(shape(h), generator=generator).to(dtype) for h in (heads, kv_heads))
    grads = [torch.randn(shape(h), generator=generator).to(dtype) for h in (heads, kv_heads)]
    results = []
    for call in (module, function):
        qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
        with _kernel_launches() as launches:
            outs = call(qi, ki, freqs_cis)
        torch.autograd.backward(outs, grads)
        results.append((launches.get("rotary", 0), *outs, qi.grad, ki.grad))
    (fused_launches, *fused), (eager_launches, *eager) = results
    assert (fused_launches, eager_launches) == (1, 0)
    for name, a, b in zip(("q", "k", "dq", "dk"), fused, eager):
        _assert_within(a, b, 4 * U_FP32 if dtype == torch.float32 else 2 * 2**-8, name)


def test_rotary_with_tables_of_one_entry_per_pair_is_fused_and_matches():
    """gpt-oss's rotary takes [B, S, D/2] tables (one entry per pair, pairs (j, j + D/2)): the kernel's half tables
    over the whole head, in both layouts; within fp32 rounding as test_interleaved_rotary_... argues."""
    module = _GptOssAttention()
    report = kernels.fuse(torch.nn.ModuleDict({"attention": module}))
    assert report.replaced == [("attention", "rotary: _gpt_oss_rotary (hf convention, tables of one entry per pair)")], (
        str(report))
    seq, dim = _ROTARY_SEQ, _ROTARY_DIM
    freqs = torch.outer(torch.arange(seq).float(), 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = (f(freqs).expand(_ROTARY_BATCH, seq, dim // 2) for f in (torch.cos, torch.sin))
    _assert_fused_rotary_matches(module, _gpt_oss_rotary, cos, sin, seed=6, dtype=torch.float32, budget=4 * U_FP32)


def _gemma4_rotary(x, cos, sin, unsqueeze_dim=1):
    """Gemma 3n's and Gemma 4's rotary: one tensor per call (q's, then k's), Llama's pairing."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _gemma4_rotary_pair(q, k, cos, sin, unsqueeze_dim=1):
    return _gemma4_rotary(q, cos, sin, unsqueeze_dim), _gemma4_rotary(k, cos, sin, unsqueeze_dim)


class _Gemma4Attention(torch.nn.Module):
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _gemma4_rotary(q, cos, sin, unsqueeze_dim), _gemma4_rotary(k, cos, sin, unsqueeze_dim)


def test_rotary_of_one_tensor_per_call_is_fused_and_matches():
    """Gemma 4's `apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)` rotates q and k in two calls: each runs the
    kernel (a k of no heads beside it), in both layouts; within fp32 rounding as test_interleaved_rotary_... argues."""
    module = _Gemma4Attention()
    report = kernels.fuse(torch.nn.ModuleDict({"attention": module}))
    assert report.replaced == [("attention", "rotary: _gemma4_rotary (hf convention, one tensor per call)")], str(report)
    seq, dim = _ROTARY_SEQ, _ROTARY_DIM
    freqs = torch.outer(torch.arange(seq).float(), 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = (f(torch.cat([freqs, freqs], -1)).expand(_ROTARY_BATCH, seq, dim) for f in (torch.cos, torch.sin))
    _assert_fused_rotary_matches(module, _gemma4_rotary_pair, cos, sin, seed=7, dtype=torch.float32, budget=4 * U_FP32,
                                 launches=2)


def test_interleaved_pairs_that_do_not_rotate_are_left_alone():
    report = kernels.fuse(torch.nn.ModuleDict({"attention": _SwappingAttention()}))
    assert report.replaced == [] and "does not behave like" in dict(report.skipped)["attention"], str(report)


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


class _GeGLUWithZeroDown(_GatedMLP):
    """GeGLU whose down projection starts at zero (a common init): its output is 0, like SwiGLU's, and it must still
    be told for the exact gelu it computes."""

    def __init__(self):
        super().__init__(lambda g, u: F.gelu(g) * u, bias=True)
        torch.nn.init.zeros_(self.down_proj.weight)
        torch.nn.init.zeros_(self.down_proj.bias)


def test_probes_are_not_fooled_by_values_or_precision():
    container = torch.nn.ModuleDict(
        {"layer_norm": _BiasFreeLayerNorm(8192), "geglu": _GeGLUWithZeroDown()}
    )
    report = kernels.fuse(container)
    skipped = dict(report.skipped)
    assert report.replaced == [("geglu", "geglu (gelu): FusedSwiGLUMLP")] and container["geglu"].activation == "gelu"
    assert NOT_RMS_NORM in skipped["layer_norm"]


def test_a_module_with_only_some_of_a_gated_mlps_projections_is_left_alone():
    """`gate_proj` and `down_proj` without `up_proj` (a plain MLP whose first projection is named gate_proj) is no
    gated MLP: left as it is, and fusing it does not raise (strict included)."""

    class GateDown(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.down_proj = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)))

    model = torch.nn.Sequential(GateDown())
    x = torch.randn(2, 8)
    expected = model(x)
    report = kernels.fuse(model, strict=True)
    assert type(model[0]) is GateDown and not report.replaced, report
    assert torch.equal(model(x), expected)


def test_the_model_itself_as_a_candidate_is_left_alone_with_the_reason():
    """fuse replaces a module by rebinding it in its parent: a model that is itself an RMSNorm has none, and is
    named as skipped (not rebound under the name "" as a child of itself)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = LlamaRMSNorm(8)
    report = kernels.fuse(model)
    assert not report.replaced and report.skipped == [("", "the model itself is the candidate; fuse the model that "
                                                            "contains it")], report
    assert "" not in model._modules and type(model) is LlamaRMSNorm
