"""kernels.fuse on real Hugging Face transformers models (tests/hf_models.py): every norm, SwiGLU MLP and
rotary of the families that have them is replaced and its fused kernel really runs (counted launches);
loss, logits and every gradient stay within fp32 rounding of the unfused model; Gemma's GeGLU MLP is left
alone with the reason (never fused as SwiGLU); `strict=True` raises instead; models built on the meta
device (LazyGuard) are fused like materialised ones."""

from __future__ import annotations

import copy

import pytest
import torch

from tridist import distcore, kernels
from tridist.distcore.lazy import materialize
from tests.hf_models import HIDDEN, LAYERS, VOCAB, build
from tests.test_fuse import U_FP32, _assert_within, _kernel_launches

pytest.importorskip("transformers")

SEQ_LEN = 8
# family -> fused ops per forward: norms (2 per layer + final; Gemma2 has 4 per layer), SwiGLU MLPs, rotaries.
EXPECTED = {
    "llama": {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},
    "llama-tied": {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},
    "mistral": {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},
    "qwen2": {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},
    "qwen3": {"rms_norm": 4 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},  # + per-head q/k norms
    "olmo2": {"rms_norm": 4 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},  # + q/k norms over the projection
    "phi3": {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},  # packed gate_up
    "gemma": {"rms_norm": 2 * LAYERS + 1, "rotary": LAYERS},  # GeGLU MLP: not SwiGLU
    "gemma2": {"rms_norm": 4 * LAYERS + 1, "rotary": LAYERS},
    "gpt-neox": {"rotary": LAYERS},  # LayerNorm and GELU MLP; partial rotary (rotary_pct 0.5)
}
# Same reasoning as tests/test_fuse.py: each fused op perturbs the residual stream by at most
# HIDDEN·u of its magnitude (its longest fp32 reduction is over HIDDEN features), summed over the
# fused ops of a pass; the backward runs each op's backward kernel too (twice the budget).
def _budgets(family):
    ops = sum(EXPECTED[family].values())
    return ops * HIDDEN * U_FP32, 2 * ops * HIDDEN * U_FP32


def _batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=generator)


@pytest.mark.parametrize("family", list(EXPECTED))
def test_fuse_replaces_and_matches_loss_logits_and_every_gradient(family):
    model = build(family)
    fused = copy.deepcopy(model)
    report = kernels.fuse(fused)
    for kind, count in EXPECTED[family].items():
        assert report.count(kind) == count, (kind, str(report))
    rotaries = [name for name, what in report.replaced if what.startswith("rotary")]
    assert rotaries == [n for n, m in fused.named_modules() if n.endswith(("self_attn", "attention")) and "forward" in vars(m)]
    if family == "gpt-neox":
        assert all("partial rotary" in what for _, what in report.replaced)
    if family.startswith("gemma"):
        assert {why for _, why in report.skipped} == {
            "has gate/up/down projections but its output is not down(silu(gate(x)) * up(x)); left as is"}
    else:
        assert report.skipped == [], str(report)
    assert list(fused.state_dict()) == list(model.state_dict())

    ids = _batch()
    # Reversed positions with a padded first sequence: the rotary must use the given positions and the mask.
    position_ids = torch.arange(SEQ_LEN).flip(0).expand(2, SEQ_LEN)
    mask = torch.ones(2, SEQ_LEN, dtype=torch.long)
    mask[0, :2] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=position_ids, labels=ids)
    expected = model(**kwargs)
    expected.loss.backward()
    with _kernel_launches() as forward:
        out = fused(**kwargs)
    with _kernel_launches() as backward:
        out.loss.backward()
    assert forward == EXPECTED[family] and backward == EXPECTED[family], (forward, backward)
    forward_budget, backward_budget = _budgets(family)
    _assert_within(out.logits, expected.logits, forward_budget, "logits")
    _assert_within(out.loss, expected.loss, forward_budget, "loss")
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        _assert_within(q.grad, p.grad, backward_budget, name)


def test_gpt2_has_nothing_to_fuse():
    report = kernels.fuse(build("gpt2"))  # LayerNorm, GELU MLP, learned positions
    assert report.replaced == [] and report.skipped == []


def test_strict_raises_naming_each_candidate_and_changes_nothing():
    model = build("gemma")
    before = [type(m) for m in model.modules()]
    with pytest.raises(kernels.FuseError, match=r"(?s)2 candidate\(s\).*model.layers.0.mlp.*silu"):
        kernels.fuse(model, strict=True)
    assert [type(m) for m in model.modules()] == before
    report = kernels.fuse(model, strict=True, swiglu=False)  # the MLP left out: nothing else fails
    assert report.count("rms_norm") == 2 * LAYERS + 1 and report.count("rotary") == LAYERS


def test_strict_passes_when_everything_fuses():
    report = kernels.fuse(build("llama"), strict=True)
    assert report.skipped == [] and report.count("rotary") == LAYERS


def test_meta_device_model_is_fused_and_trains_like_the_eager_one():
    """Built under LazyGuard: fused on meta, then materialised; the same values in an unfused eager model
    give the same loss and gradients."""
    with distcore.LazyGuard(seed=7):
        lazy = build("llama")
    report = kernels.fuse(lazy)
    assert {k: report.count(k) for k in EXPECTED["llama"]} == EXPECTED["llama"] and report.skipped == []
    assert all(p.device.type == "meta" for p in lazy.parameters())
    materialize(lazy)
    eager = build("llama")
    eager.load_state_dict(lazy.state_dict())
    ids = _batch(1)
    expected = eager(input_ids=ids, labels=ids)
    expected.loss.backward()
    with _kernel_launches() as launches:
        out = lazy(input_ids=ids, labels=ids)
    out.loss.backward()
    assert launches == EXPECTED["llama"]
    forward_budget, backward_budget = _budgets("llama")
    _assert_within(out.loss, expected.loss, forward_budget, "loss")
    for (name, p), q in zip(eager.named_parameters(), lazy.parameters()):
        _assert_within(q.grad, p.grad, backward_budget, name)


def test_compiled_fused_transformers_model_is_one_graph_and_matches():
    """torch.compile(fullgraph=True) of a fused transformers Llama: one graph, no recompilation on the
    next call (the fused rotary's globals are a module torch.compile can guard), same logits."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build("llama")
    fused = copy.deepcopy(model)
    kernels.fuse(fused)
    compiled = torch.compile(fused, fullgraph=True)
    for seed in (0, 1):
        ids = _batch(seed)
        with _kernel_launches() as launches:
            out = compiled(input_ids=ids)
        assert launches["rotary"] == LAYERS
        forward_budget, _ = _budgets("llama")
        _assert_within(out.logits, model(input_ids=ids).logits, forward_budget, "logits")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
