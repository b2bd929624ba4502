"""distcore.LazyGuard on one process: meta construction, per-tensor seeded replay, Paddle's initialize()."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import weakref

import pytest
import torch
from torch import nn

from tridist import distcore
from tridist.bench.models import build_model
from tridist.distcore.lazy import LazyInitError, materialize


def _lazy(build, seed: int = 0):
    torch.manual_seed(seed)
    with distcore.LazyGuard():
        return build()


def _tensors(model):
    return [*model.parameters(), *model.buffers()]


def _values(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def test_lazy_model_holds_no_storage():
    model = _lazy(lambda: build_model("hf-llama"))
    assert all(t.is_meta for t in _tensors(model)) and len(_tensors(model)) > 10
    assert all(hasattr(p, "initialize") for p in model.parameters())


def test_values_are_per_tensor_whatever_the_order():
    forward = _lazy(lambda: build_model("seed-llama"))
    for tensor in _tensors(forward):
        tensor.initialize()
    backward = _lazy(lambda: build_model("seed-llama"))
    torch.manual_seed(123)  # the global stream must not matter either
    for tensor in reversed(_tensors(backward)):
        tensor.initialize()
    partial = _lazy(lambda: build_model("seed-llama"))
    only = partial.layers[1].mlp.up_proj.weight
    only.initialize()  # alone: the others stay on meta
    assert sum(not t.is_meta for t in _tensors(partial)) == 1
    a, b = _values(forward), _values(backward)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(only, a["layers.1.mlp.up_proj.weight"])
    # Re-seeding reproduces the model; another seed (or a second guard without re-seeding) does not.
    other = materialize(_lazy(lambda: build_model("seed-llama"), seed=1))
    assert not torch.equal(other.layers[0].mlp.up_proj.weight, a["layers.0.mlp.up_proj.weight"])


def test_initialize_leaves_the_global_random_stream_alone():
    model = _lazy(lambda: build_model("hf-llama"))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    materialize(model)
    assert torch.equal(torch.rand(3), expected)


def test_deterministic_buffers_equal_the_eager_ones():
    for name in ("seed-llama", "hf-llama"):
        eager = build_model(name)
        lazy = materialize(_lazy(lambda: build_model(name)))
        eager_buffers = dict(eager.named_buffers())
        assert eager_buffers and all(torch.equal(b, eager_buffers[n]) for n, b in lazy.named_buffers()), name


def test_random_parameters_follow_their_initialisers():
    seed = materialize(_lazy(lambda: build_model("seed-llama")))
    hidden, vocab, inter = 64, 128, 176
    xavier = math.sqrt(6 / (hidden + vocab))  # the seed's LM head: xavier_uniform_
    assert seed.weight.abs().max() <= xavier and seed.weight.abs().max() > 0.9 * xavier
    kaiming = 1 / math.sqrt(hidden)  # nn.Linear: kaiming_uniform_(a=sqrt(5)) gives U(-1/sqrt(fan_in), ...)
    up = seed.layers[0].mlp.up_proj.weight
    assert up.abs().max() <= kaiming and up.abs().max() > 0.9 * kaiming
    down = seed.layers[0].mlp.down_proj.weight
    assert down.abs().max() <= 1 / math.sqrt(inter)
    assert abs(seed.embed_tokens.weight.std().item() - 1.0) < 0.05  # nn.Embedding: N(0, 1)
    assert torch.equal(seed.layers[0].input_layernorm.weight, torch.ones(hidden))  # norms: ones

    hf = materialize(_lazy(lambda: build_model("hf-llama")))  # HF's _init_weights: weight.data.normal_(0, 0.02)
    q = hf.model.layers[0].self_attn.q_proj.weight
    assert abs(q.std().item() - 0.02) < 0.002 and abs(q.mean().item()) < 0.002
    values = [p for p in hf.parameters() if p.dim() == 2]
    for i, a in enumerate(values):  # random parameters differ from one another
        for b in values[i + 1:]:
            if a.shape == b.shape:
                assert not torch.equal(a, b)


def test_paddle_notes_example():
    """The notes' LazyGuard example: two create_parameter weights (Paddle's default XavierUniform),
    p.initialize() on each, then a plain AdamW loop."""

    class MlpModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.w0 = nn.Parameter(nn.init.xavier_uniform_(torch.empty(64, 256)))
            self.w1 = nn.Parameter(nn.init.xavier_uniform_(torch.empty(256, 64)))

        def forward(self, x):
            return torch.matmul(torch.matmul(x, self.w0), self.w1)

    with distcore.LazyGuard():
        model = MlpModel()
    assert model.w0.is_meta
    for p in model.parameters():
        p.initialize()
    bound = math.sqrt(6 / (64 + 256))
    assert 0.9 * bound < model.w0.abs().max() <= bound
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, labels = torch.randn(4, 16, 64), torch.randn(4, 16, 64)
    losses = []
    for _ in range(3):
        loss = nn.functional.mse_loss(model(inputs), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["seed-llama", "hf-llama"])
def test_lazy_model_trains_like_an_eager_copy(name):
    """Materialised, the lazy model is an ordinary model: it trains exactly like an eager model loaded
    with the same values. The optimizer was built from the meta parameters (the user's order)."""
    lazy = _lazy(lambda: build_model(name))
    optimizer = torch.optim.AdamW(lazy.parameters(), lr=1e-2)
    for tensor in _tensors(lazy):
        tensor.initialize()
    eager = build_model(name)
    eager.load_state_dict(lazy.state_dict())
    eager_optimizer = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        inputs, labels = (torch.randint(0, 128, (2, 8), generator=generator) for _ in range(2))
        for model, opt in ((lazy, optimizer), (eager, eager_optimizer)):
            loss, _ = model(inputs, labels=labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert torch.equal(*(m(inputs, labels=labels)[0] for m in (lazy, eager)))
    for (n, a), (_, b) in zip(lazy.named_parameters(), eager.named_parameters()):
        assert torch.equal(a, b), n


def test_aliases_views_and_tied_weights():
    """Aliases share one record: a write into a slice (an embedding's padding row, a parameter's
    columns), ops reading the tensor they write, out=, a buffer that is a view of a computed tensor,
    a tied weight, a dtype cast on meta after the guard."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4, padding_idx=0)  # reset_parameters zeroes row 0 in place
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.scale = nn.Parameter(torch.empty(3, 4))
            with torch.no_grad():
                self.scale.fill_(2.0)
                self.scale[:, 1:].mul_(3.0)  # in place into a view of a parameter
                self.scale.add_(self.scale)  # reads the tensor it writes
            counts = torch.zeros(3)
            torch.add(counts, 1.0, out=counts)
            counts[0] = counts[1] * 5
            self.register_buffer("counts", counts)
            table = torch.arange(12.0).reshape(3, 4)
            self.register_buffer("table_t", table.t())  # a view, as torch's transposes are

    model = _lazy(Model)
    model.scale.data = model.scale.data.to(torch.float64)  # converted on meta after the guard
    materialize(model)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight[0], torch.zeros(4))
    assert model.scale.dtype == torch.float64
    assert torch.equal(model.scale, torch.tensor([[4.0, 12.0, 12.0, 12.0]] * 3, dtype=torch.float64))
    assert torch.equal(model.counts, torch.tensor([5.0, 1.0, 1.0]))
    assert torch.equal(model.table_t, torch.arange(12.0).reshape(3, 4).t())


def test_errors_name_the_tensor_and_the_fix():
    class ValueDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))
            if self.w.sum() > 0:  # Python control flow on values that do not exist yet
                self.w.data.neg_()

    with pytest.raises(LazyInitError, match="data-dependent"):
        _lazy(ValueDependent)

    class WithGenerator(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4).normal_(generator=torch.Generator().manual_seed(0)))

    with pytest.raises(LazyInitError, match="generator"):
        _lazy(WithGenerator)

    outside = nn.Linear(4, 4, device="meta")  # meta, but not built under LazyGuard
    with pytest.raises(LazyInitError, match=r"\['weight', 'bias'\].*LazyGuard"):
        materialize(outside)

    model = _lazy(lambda: nn.Linear(4, 4))
    with torch.no_grad():
        model.weight.zero_()  # after the guard: not recorded
    with pytest.raises(LazyInitError, match="weight was modified in place after its LazyGuard exited"):
        materialize(model)

    model = _lazy(lambda: nn.Linear(4, 4))
    with distcore.LazyGuard(), pytest.raises(LazyInitError, match="after the `with LazyGuard"):
        model.weight.initialize()

    class BitView(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("bits", torch.zeros(4).view(torch.int32))  # reinterpreted, not converted

    with pytest.raises(LazyInitError, match=r"view\(dtype\).*\.to\(dtype\)"):
        _lazy(BitView)


def test_deep_copy_replays_the_same_values():
    """A deep copy of a lazy model (a reference copy, say) materialises to the original's values."""
    model = _lazy(lambda: build_model("hf-llama"))
    twin = copy.deepcopy(model)
    a, b = _values(materialize(model)), _values(materialize(twin))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_strict_false_leaves_unrecorded_meta_tensors():
    """parallelize's mode: meta tensors without a record (built outside LazyGuard) stay on meta."""
    model = _lazy(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    model.append(nn.Linear(4, 4, device="meta"))
    model[1].weight = nn.Parameter(torch.empty(4, 4, device="meta"))  # replaced: its record does not apply
    materialize(model, strict=False)
    assert not model[0].weight.is_meta and not model[1].bias.is_meta
    assert model[1].weight.is_meta and model[2].weight.is_meta


class _Cycle:
    """Garbage the collector has not freed yet: a reference cycle holding a weak reference."""

    def __init__(self, tensor):
        self.cycle, self.ref = self, weakref.ref(tensor)


@contextlib.contextmanager
def _collector_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("materialise", ["initialize", "materialize"])
def test_weak_references_in_uncollected_garbage_do_not_stop_materialisation(materialise):
    """torch.utils.swap_tensors refuses a tensor a weak reference points to. A garbage cycle holding one (as a
    FakeTensorMode that saw the meta parameters does until the collector runs), even one in the oldest generation,
    is freed first; a live one is an error naming the tensor."""
    model, expected = _lazy(lambda: build_model("seed-llama")), _lazy(lambda: build_model("seed-llama"))
    for tensor in _tensors(expected):
        tensor.initialize()
    cycles = [_Cycle(tensor) for tensor in _tensors(model)]
    gc.collect()  # survived a full collection: in the oldest generation, which young collections never scan
    with _collector_paused():
        del cycles  # garbage now: only a full collection frees it
        assert all(weakref.getweakrefs(t) for t in _tensors(model))
        if materialise == "initialize":
            for tensor in _tensors(model):
                tensor.initialize()
        else:
            materialize(model)
    assert all(torch.equal(got, expected_value) for got, expected_value in zip(_values(model).values(),
                                                                               _values(expected).values()))
    model = _lazy(lambda: nn.Sequential(nn.Linear(4, 4)))
    held = weakref.ref(model[0].weight)
    with pytest.raises(LazyInitError, match=r"cannot materialise 0\.weight: a weak reference to it is alive"):
        materialize(model)
    assert held() is model[0].weight and model[0].weight.is_meta


def test_a_lazy_model_materialises_after_the_pipelines_probe_forward():
    """The pipeline's probe forward runs the meta model on fake tensors, whose FakeTensorMode keeps a weak reference
    to every parameter until the collector frees it (parallelize materialises after the probe: with the collector
    not run in between, every swap failed)."""
    from tridist.distcore.pipeline import probe_forward

    model = _lazy(lambda: build_model("hf-llama"))
    with _collector_paused():
        assert probe_forward(model, "model.layers").reused == []
        vars(model).pop("_tridist_forward_probe")  # its weak references, as the pipeline's placement drops it
        assert any(weakref.getweakrefs(p) for p in model.parameters())  # what failed the swap
        materialize(model)
    assert not any(t.is_meta for t in _tensors(model))


def test_a_transformers_model_is_initialised_inside_the_guard_or_refused():
    """transformers skips a model's _init_weights where the default device is meta, as inside LazyGuard: a real
    transformers Falcon-H1 built there held uninitialised memory in its Mamba mixers' D, A_log and dt_bias (which its
    constructor leaves to _init_weights) and torch's default initialisation elsewhere; materialised, its logits were
    NaN. Now refused, naming the fix; with model.initialize_weights() inside the guard (recorded), it materialises
    with transformers' own values: D and dt_bias 1, A_log log(1..heads), projections at initializer_range."""
    pytest.importorskip("transformers")
    from tests.hf_models import build

    with distcore.LazyGuard():
        model = build("falcon-h1")
    with pytest.raises(LazyInitError, match=r"the transformers model FalconH1ForCausalLM was built on the meta device.*"
                                            r"Call model.initialize_weights\(\) inside the `with LazyGuard\(\):` block"):
        materialize(model)
    with distcore.LazyGuard():
        model = build("falcon-h1")
        model.initialize_weights()
    materialize(model)
    mixer, heads = model.model.layers[1].mamba, model.config.mamba_n_heads
    assert mixer.D.tolist() == [1.0] * heads and mixer.dt_bias.tolist() == [1.0] * heads
    assert torch.allclose(mixer.A_log, torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
    weight = model.model.layers[0].self_attn.q_proj.weight  # 4,096 draws of N(0, 0.02): the std within 10%
    assert abs(weight.std().item() / model.config.initializer_range - 1) < 0.1, weight.std()
    assert torch.isfinite(model(input_ids=torch.randint(3, 100, (2, 8))).logits).all()
