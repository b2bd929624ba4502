"""kernels.fuse on real Hugging Face transformers models (tests/hf_models.py): every norm, SwiGLU MLP and
rotary of the families that have them, and the LM head + loss of every causal LM, are replaced and their
fused kernels really run (counted launches); loss, logits and every gradient stay within fp32 rounding of
the unfused model (a labelled call returns logits=None, a call without labels the logits); Gemma's GeGLU
MLP is fused as GeGLU (gelu's tanh approximation: never as SwiGLU); `strict=True` raises where a candidate is
left alone; models built on the meta device (LazyGuard) are fused like materialised ones."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from tridist import distcore, kernels
from tridist.distcore.lazy import materialize
from tridist.kernels.ops.linear_cross_entropy import FusedLMHead
from tests.hf_models import HIDDEN, LAYERS, MORE_FAMILIES, SCALED_LOGITS, VOCAB, ScaledLogitsHead, build
from tests.test_fuse import U_FP32, _assert_within, _kernel_launches

pytest.importorskip("transformers")

SEQ_LEN = 8
# family -> fused ops per forward: norms (2 per layer + final; Gemma2 has 4 per layer), SwiGLU or GeGLU MLPs,
# rotaries (report kinds; `_launches` turns them into the counted kernels' files).
EXPECTED = {
    "llama": {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},
    "llama-tied": {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},
    "mistral": {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},
    "qwen2": {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},
    "qwen3": {"rms_norm": 4 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},  # + per-head q/k norms
    "olmo2": {"rms_norm": 4 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},  # + q/k norms over the projection
    "phi3": {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},  # packed gate_up
    "gemma": {"rms_norm": 2 * LAYERS + 1, "geglu": LAYERS, "rotary": LAYERS},  # GeGLU MLP (gelu_pytorch_tanh)
    "gemma2": {"rms_norm": 4 * LAYERS + 1, "geglu": LAYERS, "rotary": LAYERS},
    "gpt-neox": {"rotary": LAYERS},  # LayerNorm and GELU MLP; partial rotary (rotary_pct 0.5)
    "granite": {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS, "rotary": LAYERS},  # logits / logits_scaling
    "cohere": {"swiglu": LAYERS, "rotary": LAYERS},  # logits * logit_scale; interleaved rotary; LayerNorms left alone
}
# What fuse leaves alone, with its reason, where a family has modules that look like candidates.
SKIPPED = {
    "cohere": {"has a 1-D weight and eps=1e-05 but its output is not RMSNorm(x) * (w or 1 + w); left as is"},
}
# The LM head + loss of every family: one op in the report; in a labelled forward one chunk of 2 x 8 tokens, two kernels (statistics, then loss and logits'
# gradient); the backward launches none (a mean loss's gradients are computed in the forward).
HEAD_AND_LOSS = {family: 1 for family in EXPECTED}
LOSS_FORWARD_LAUNCHES = {"linear_cross_entropy": 2}
# Same reasoning as tests/test_fuse.py: each fused op perturbs the residual stream by at most
# HIDDEN·u of its magnitude (its longest fp32 reduction is over HIDDEN features), summed over the
# fused ops of a pass; the backward runs each op's backward kernel too (twice the budget).
# The fused loss adds its longest reduction, the log-sum-exp over VOCAB logits (and the hidden gradient's
# GEMM over VOCAB), in another order than eager: VOCAB·u more. A scaled family's fused loss rounds each
# hidden state times the scale once (eager rounds each logit times the scale instead): each logit moves by
# at most u of the sum of its HIDDEN products' magnitudes, HIDDEN·u more.
def _budgets(family):
    ops = sum(EXPECTED[family].values())
    loss = VOCAB if HEAD_AND_LOSS.get(family) else 0
    loss += HIDDEN if family in SCALED_LOGITS else 0
    return (ops * HIDDEN + loss) * U_FP32, 2 * (ops * HIDDEN + loss) * U_FP32


def _launches(ops: dict) -> dict:
    """The kernel launches of these report kinds, keyed by the kernels' files: GeGLU runs swiglu.py's kernels."""
    launches = {}
    for kind, count in ops.items():
        file = "swiglu" if kind == "geglu" else kind
        launches[file] = launches.get(file, 0) + count
    return launches


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
    assert report.count("linear_cross_entropy") == HEAD_AND_LOSS.get(family, 0), str(report)
    rotaries = [name for name, what in report.replaced if what.startswith("rotary")]
    assert rotaries == [n for n, m in fused.named_modules() if n.endswith(("self_attn", "attention")) and "forward" in vars(m)]
    assert isinstance(getattr(fused, "lm_head", None), FusedLMHead) == bool(HEAD_AND_LOSS.get(family))
    if family == "gpt-neox":
        assert all("partial rotary" in what for _, what in report.replaced if what.startswith("rotary"))
    if family.startswith("gemma"):  # gelu_pytorch_tanh: the tanh approximation, told from exact gelu
        assert all(m.activation == "gelu_tanh" for m in fused.modules() if isinstance(m, kernels.FusedSwiGLUMLP))
    if family == "cohere":  # adjacent features paired (GPT-J's rotation), the kernel's INTERLEAVED path
        assert all("interleaved pairs" in what for _, what in report.replaced if what.startswith("rotary"))
    assert {why for _, why in report.skipped} == SKIPPED.get(family, set()), str(report)
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
    loss_launches = LOSS_FORWARD_LAUNCHES if HEAD_AND_LOSS.get(family) else {}
    assert forward == {**_launches(EXPECTED[family]), **loss_launches} and backward == _launches(EXPECTED[family]), (
        forward, backward)
    forward_budget, backward_budget = _budgets(family)
    assert (out.logits is None) == bool(HEAD_AND_LOSS.get(family)), type(out.logits)  # labelled: no logits (as Liger)
    _assert_within(out.loss, expected.loss, forward_budget, "loss")
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        _assert_within(q.grad, p.grad, backward_budget, name)
    del kwargs["labels"]  # without labels: the logits, from the head as before
    with torch.no_grad(), _kernel_launches() as forward:
        unlabelled = fused(**kwargs)
        expected_logits = model(**kwargs).logits
    assert unlabelled.loss is None and forward == _launches(EXPECTED[family]), forward
    _assert_within(unlabelled.logits, expected_logits, forward_budget, "logits")


@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_fuse_keeps_loss_logits_and_every_gradient_of_more_families(family):
    """More families users bring (tests/hf_models.py MORE_FAMILIES: latent attention, attention sinks, linear
    and chunked attention, LayerNorm models, experts in several layouts): fuse replaces what it recognises
    (the LM head + loss of every one, Llama 4's too, whose base_model_prefix names no child), gives a reason
    for what it leaves alone, and the loss, the logits and every gradient stay within the rounding budget of
    the fused kernels that ran (counted, as above). Both models draw the same random numbers (routers' jitter,
    dropout)."""
    model = build(family)
    fused = copy.deepcopy(model)
    report = kernels.fuse(fused)
    assert report.count("linear_cross_entropy") == 1 and isinstance(fused.lm_head, FusedLMHead), str(report)
    assert all(why for _, why in report.skipped), str(report)
    if family in ("glm4", "ernie4_5", "ernie4_5_moe"):  # GLM's rotary: adjacent pairs by the table's first half
        rotaries = [what for _, what in report.replaced if what.startswith("rotary")]
        assert len(rotaries) == 2 and all("from the table's first half" in what for what in rotaries), str(report)
    rotary_kind = {
        "deepseek-v3": "written as halves",  # rope_interleave (its default): the pairs' results as halves
        "deepseek-v2": "complex convention (bhsd)",  # apply_rotary_emb(xq, xk, freqs_cis)
        "llama4": "complex convention (bshd)",
        "gpt-oss": "tables of one entry per pair",
        "gemma4": "one tensor per call",
    }.get(family)
    if rotary_kind:
        rotaries = [what for _, what in report.replaced if what.startswith("rotary")]
        assert len(rotaries) == 2 and all(rotary_kind in what for what in rotaries), str(report)
    if family == "bamba":  # the mixers' gated norms are left alone (FusedRMSNorm would take the gate for a residual)
        gated = {name for name, why in report.skipped if "more than the input (gate)" in why}
        assert gated == {"model.layers.0.mamba.norm"}, str(report)  # its one Mamba layer
    mask = torch.ones(2, SEQ_LEN, dtype=torch.long)
    mask[0, :2] = 0
    kwargs = dict(input_ids=_batch(), attention_mask=mask, labels=_batch())
    torch.manual_seed(1)
    expected = model(**kwargs)
    expected.loss.backward()
    torch.manual_seed(1)
    with _kernel_launches() as forward:
        out = fused(**kwargs)
    out.loss.backward()
    ops = sum(count for op, count in forward.items() if op != "linear_cross_entropy")
    assert ops > 0 or family in ("opt", "openai-gpt", "bloom", "mpt", "gpt-bigcode"), forward  # LayerNorms, ReLU or GELU MLPs: the LM head + loss alone fuses
    assert forward["linear_cross_entropy"] == LOSS_FORWARD_LAUNCHES["linear_cross_entropy"], forward
    budget = (ops * HIDDEN + VOCAB) * U_FP32  # as _budgets: each fused op's reduction, and the loss's
    _assert_within(out.loss, expected.loss, budget, "loss")
    gradients = {name: p.grad for name, p in model.named_parameters()}
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is None:
            continue
        if name.endswith("k_proj.bias"):  # zero in exact arithmetic (softmax ignores a shift shared by a query's
            # scores): rounding noise on both sides, held to the rounding of the key weight's gradient it comes with
            error = (q.grad - p.grad).abs().max().item()
            assert error <= 2 * budget * gradients[name.replace("bias", "weight")].abs().max().item(), (name, error)
        else:
            _assert_within(q.grad, p.grad, 2 * budget, name)
    del kwargs["labels"]
    with torch.no_grad():
        torch.manual_seed(1)
        logits = fused(**kwargs).logits
        torch.manual_seed(1)
        expected_logits = model(**kwargs).logits
    _assert_within(logits, expected_logits, budget, "logits")


def test_a_head_of_its_own_is_left_alone_with_the_reason():
    """A BERT-style decoder's head is a module of its own (BertGenerationOnlyLMHead holding its Linear as `decoder`):
    fuse leaves its head + loss alone and says why (before, its report was empty: "fused 0 module(s), left 0 alone");
    strict refuses it; the model computes as before."""
    model = build("bert-generation")
    ids = _batch()
    expected = model(input_ids=ids, labels=ids).loss
    report = kernels.fuse(model)
    assert report.replaced == [] and [name for name, _ in report.skipped] == ["lm_head"], str(report)
    assert "lm_head is a transformers.models.bert_generation.modeling_bert_generation.BertGenerationOnlyLMHead, not an nn.Linear" \
        in report.skipped[0][1], report.skipped
    assert torch.equal(model(input_ids=ids, labels=ids).loss, expected)
    with pytest.raises(kernels.FuseError, match="lm_head: LM head \\+ loss candidate"):
        kernels.fuse(model, strict=True)
    assert kernels.fuse(model, linear_cross_entropy=False).skipped == []


def test_gpt2_fuses_only_its_head_and_loss():
    model = build("gpt2")  # LayerNorm, GELU MLP, learned positions; the head tied to the embedding
    fused = copy.deepcopy(model)
    report = kernels.fuse(fused)
    assert [what.split(":")[0] for _, what in report.replaced] == ["linear_cross_entropy"] and report.skipped == []
    assert fused.lm_head.weight is fused.transformer.wte.weight  # still tied
    ids = _batch()
    expected = model(input_ids=ids, labels=ids)
    out = fused(input_ids=ids, labels=ids)
    expected.loss.backward()
    out.loss.backward()
    _assert_within(out.loss, expected.loss, VOCAB * U_FP32, "loss")
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        _assert_within(q.grad, p.grad, 2 * VOCAB * U_FP32 + 2 * HIDDEN * U_FP32, name)


class _OwnForwardHead(torch.nn.Linear):
    """No state beside weight and bias, but a forward of its own (its output is the logits times 2)."""

    def forward(self, hidden_states):
        return 2 * super().forward(hidden_states)


class _InheritedForwardHead(_OwnForwardHead):
    """The same forward, inherited: the class itself defines none."""


class _Doubled(torch.nn.Module):
    def forward(self, weight):
        return 2 * weight


def _doubled_forward(self, hidden_states):
    return 2 * torch.nn.functional.linear(hidden_states, self.weight)


def _head(model, kind: str) -> None:
    """`model`'s LM head made `kind`: a head of another class with the same weight, or the same head changed."""
    if kind in ("scaled", "own forward", "inherited forward"):
        cls = {"scaled": ScaledLogitsHead, "own forward": _OwnForwardHead, "inherited forward": _InheritedForwardHead}[kind]
        head = cls(HIDDEN, VOCAB)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
        model.lm_head = head
    elif kind == "parametrized":  # torch's parametrization: the weight computed from `original` (its class's forward kept)
        torch.nn.utils.parametrize.register_parametrization(model.lm_head, "weight", _Doubled())
    elif kind == "instance forward":  # a forward put on the instance (accelerate's hooks do so)
        model.lm_head.forward = types.MethodType(_doubled_forward, model.lm_head)
    elif kind == "buffer":  # state the forward does not read, which a FusedLMHead would not keep (checkpoints)
        model.lm_head.register_buffer("temperature", torch.ones(()))


# What the reason names, by head.
_HEAD_REASONS = {
    "dory": ["its own forward (DoryLMHead.forward)", "logit_scale beside weight and bias"],
    "scaled": ["its own forward (ScaledLogitsHead.forward)", "logit_scale beside weight and bias"],
    "own forward": ["its own forward (_OwnForwardHead.forward)"],
    "inherited forward": ["its own forward (_InheritedForwardHead.forward)"],
    "parametrized": ["parametrizations.weight.original beside weight and bias"],
    "instance forward": ["a forward set on the instance"],
    "buffer": ["temperature beside weight and bias"],
}


@pytest.mark.parametrize("head", list(_HEAD_REASONS))
def test_a_head_with_its_own_forward_or_state_is_left_alone(head):
    """The probe runs a thin nn.Linear in the head's place, so an nn.Linear subclass's forward and state went
    unseen: Dory's learned logit scale is 1 at initialisation (the probe's losses agreed), and the fused head
    dropped it, silently: it never got a gradient. Such a head (and one whose forward or weight is changed on the
    instance, or that holds a buffer the fused head would not keep) is left alone naming why, and the loss and
    every gradient (the scale's included) stay the unfused model's."""
    import transformers as hf

    if head == "dory":
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if "dory" not in CONFIG_MAPPING_NAMES:  # the test extra pins 5.24; a user's older transformers runs the rest
            pytest.skip(f"Dory is a transformers 5.24 model type; this is {hf.__version__}")
        config = hf.AutoConfig.for_model("dory", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        model = hf.AutoModelForCausalLM.from_config(config)
        assert type(model.lm_head).__name__ == "DoryLMHead" and hasattr(model.lm_head, "logit_scale")
    else:
        model = build("llama")
        _head(model, head)
    fused = copy.deepcopy(model)
    report = kernels.fuse(fused)
    why = dict(report.skipped).get("lm_head", "")
    assert report.count("linear_cross_entropy") == 0 and type(fused.lm_head) is type(model.lm_head), str(report)
    assert all(reason in why for reason in _HEAD_REASONS[head]), why
    ids = _batch()
    expected, out = model(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    expected.loss.backward()
    out.loss.backward()
    ops = sum(1 for _, what in report.replaced)  # norms, MLPs and rotaries: each op's reduction, as _budgets
    _assert_within(out.loss, expected.loss, ops * HIDDEN * U_FP32, "loss")
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        assert q.grad is not None, name
        _assert_within(q.grad, p.grad, 2 * ops * HIDDEN * U_FP32, name)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_an_mlp_with_dropout_is_left_alone_in_either_mode(mode):
    """Seed-OSS's MLP applies dropout (residual_dropout, 0.1 by default) after down(act(gate(x)) * up(x)). Probed in
    the caller's eval mode (from_pretrained returns one) it was fused and its dropout lost in training; probes run
    in training mode now, and the MLP is left alone naming why. The model keeps its mode."""
    import transformers as hf

    config = hf.AutoConfig.for_model("seed_oss", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert config.residual_dropout == 0.1  # transformers' default
    model = getattr(hf.AutoModelForCausalLM.from_config(config), mode)()
    report = kernels.fuse(model)
    assert model.training == (mode == "train")
    skipped = dict(report.skipped)
    assert all(type(layer.mlp).__name__ == "SeedOssMLP" for layer in model.model.layers)
    assert "in eval mode only (dropout" in skipped["model.layers.0.mlp"], skipped
    assert any(what.startswith("rms_norm") for _, what in report.replaced), report.replaced  # the rest still fuses


@pytest.mark.parametrize("family", ["llama", "qwen3-moe"])
def test_fuse_keeps_the_callers_random_state(family):
    """Its probes and the new modules' default initialisation drew from the global generator: a fused model then
    trained on other random numbers (dropout masks, shuffling) than the unfused one from the same seed."""
    model = build(family)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    assert kernels.fuse(model).replaced
    assert torch.equal(torch.rand(4), expected)


def test_strict_raises_naming_each_candidate_and_changes_nothing():
    model = build("cohere")  # its LayerNorms (weight and eps, no bias) are RMSNorm candidates that fail the probe
    before = [type(m) for m in model.modules()]
    with pytest.raises(kernels.FuseError, match=r"(?s)3 candidate\(s\).*model.layers.0.input_layernorm.*model.norm"):
        kernels.fuse(model, strict=True)
    assert [type(m) for m in model.modules()] == before
    report = kernels.fuse(model, strict=True, rms_norm=False)  # the norms left out: nothing else fails
    assert report.count("swiglu") == LAYERS and report.count("rotary") == LAYERS
    assert report.count("linear_cross_entropy") == 1


def test_strict_passes_when_everything_fuses():
    report = kernels.fuse(build("llama"), strict=True)
    assert report.skipped == [] and report.count("rotary") == LAYERS


def test_meta_device_model_is_fused_and_trains_like_the_eager_one():
    """Built under LazyGuard: fused on meta, then materialised; the same values in an unfused eager model
    give the same loss and gradients."""
    with distcore.LazyGuard(seed=7):
        lazy = build("llama")
        lazy.initialize_weights()  # transformers skips it on the meta device (materialize refuses the model without)
    report = kernels.fuse(lazy)
    assert {k: report.count(k) for k in EXPECTED["llama"]} == EXPECTED["llama"] and report.skipped == []
    assert report.count("linear_cross_entropy") == 1  # probed without reading the (meta) head
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
    assert launches == {**EXPECTED["llama"], **LOSS_FORWARD_LAUNCHES}
    forward_budget, backward_budget = _budgets("llama")
    _assert_within(out.loss, expected.loss, forward_budget, "loss")
    for (name, p), q in zip(eager.named_parameters(), lazy.parameters()):
        _assert_within(q.grad, p.grad, backward_budget, name)


def test_compiled_fused_transformers_model_is_one_graph_and_matches():
    """torch.compile(fullgraph=True) of a fused transformers Llama: one graph, no recompilation on the
    next call (the fused rotary's globals are a module torch.compile can guard), same logits; a labelled
    call compiles whole too, with the fused loss."""
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
    # With labels (another graph, still whole: fullgraph=True raises on a break): the fused loss, no logits.
    with _kernel_launches() as launches:
        out = compiled(input_ids=ids, labels=ids)
    assert out.logits is None and launches["linear_cross_entropy"] == LOSS_FORWARD_LAUNCHES["linear_cross_entropy"]
    _assert_within(out.loss, model(input_ids=ids, labels=ids).loss, _budgets("llama")[0], "loss")
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def _cohere_with_an_unnamed_scale():
    """Cohere's forward multiplies the logits by the scale it read from its config at construction; a config
    that no longer names it leaves a logit transform fuse does not know of."""
    model = build("cohere")
    del model.config.logit_scale
    return model


def _llama_with_a_config_logit_scale():
    model = build("llama")
    model.config.logit_scale = 0.5  # read by fuse, but Llama's forward does not scale
    return model


def _llama_with_a_config_softcap():
    model = build("llama")
    model.config.final_logit_softcapping = 30.0  # read by fuse, but Llama's forward does not cap
    return model


def _llama_with_its_own_loss():
    model = build("llama")
    original = model.loss_function
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: original(logits, labels, vocab_size, **kwargs) * 2
    return model


@pytest.mark.parametrize("make", [_cohere_with_an_unnamed_scale, _llama_with_a_config_logit_scale,
                                  _llama_with_a_config_softcap, _llama_with_its_own_loss])
def test_head_and_loss_left_alone_when_the_forward_computes_another_loss(make):
    """The probe of the forward's tail refuses a logit transform fuse does not reproduce, a scale or a
    soft-capping the config names but the forward does not apply, and a loss function of the user's: the model keeps
    its own head and loss (and the same loss value), with the reason."""
    model = make()
    reference = copy.deepcopy(model)
    report = kernels.fuse(model, rms_norm=False, swiglu=False, rotary=False)
    assert report.count("linear_cross_entropy") == 0 and not isinstance(model.lm_head, FusedLMHead), str(report)
    assert [name for name, why in report.skipped if "is not the cross-entropy of" in why] == ["lm_head"], str(report)
    ids = _batch()
    assert torch.equal(model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss)


def test_a_scaled_head_with_a_bias_is_left_alone():
    """The fused loss scales the hidden states, which equals scaling the logits only without a bias: a Granite
    whose head has one keeps its own head and loss, with the reason."""
    model = build("granite")
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    report = kernels.fuse(model, rms_norm=False, swiglu=False, rotary=False)
    assert not isinstance(model.lm_head, FusedLMHead)
    assert report.skipped == [("lm_head", "LM head + loss candidate: its logits are scaled and its head has a bias "
                                          "(the fused loss scales the hidden states); left as is")], str(report)


def test_a_head_with_hooks_computes_its_logits_and_the_loss_runs_unfused():
    """Tensor parallel puts layout hooks on the head (e.g. gathering its logits): a labelled call then computes
    the logits, returns them, and the model's own loss runs on them (fused loss only on the whole, plain head)."""
    model = build("llama")
    fused = copy.deepcopy(model)
    kernels.fuse(fused, rms_norm=False, swiglu=False, rotary=False)
    seen = []
    fused.lm_head.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    ids = _batch()
    with _kernel_launches() as launches:
        out = fused(input_ids=ids, labels=ids)
    expected = model(input_ids=ids, labels=ids)
    assert seen == [(2, SEQ_LEN, VOCAB)] and launches["linear_cross_entropy"] == 0
    assert torch.equal(out.logits, expected.logits) and torch.equal(out.loss, expected.loss)


def test_a_head_replaced_after_fuse_runs_unfused():
    """resize_token_embeddings puts a new nn.Linear in the head's place: the model's calls keep working, with
    the new head's logits and the model's own loss on them."""
    model = build("llama")
    kernels.fuse(model, rms_norm=False, swiglu=False, rotary=False)
    model.resize_token_embeddings(VOCAB + 8)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.out_features == VOCAB + 8
    ids = _batch()
    out = model(input_ids=ids, labels=ids)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    assert out.logits.shape == (2, SEQ_LEN, VOCAB + 8)
    torch.testing.assert_close(out.loss, expected)


# Mixtures of experts: the experts' SwiGLU (3-D stacked weights) runs the fused activation once per expert
# that received tokens; Qwen3-MoE's dense first layer and Qwen2-MoE's shared expert are SwiGLU MLPs.
MOE_EXPECTED = {  # family -> (FusedSwiGLUExperts, FusedSwiGLUMLP, fused norms) replaced
    "mixtral": (LAYERS, 0, 2 * LAYERS + 1),
    "qwen3-moe": (LAYERS - 1, 1, 4 * LAYERS + 1),
    "qwen2-moe": (LAYERS, LAYERS, 2 * LAYERS + 1),
}


@pytest.mark.parametrize("family", list(MOE_EXPECTED))
def test_fuse_runs_the_experts_swiglu_and_matches_every_gradient(family):
    from tests.hf_models import EXPERTS

    model = build(family)
    fused = copy.deepcopy(model)
    report = kernels.fuse(fused)
    experts, mlps, norms = MOE_EXPECTED[family]
    replaced = [what for _, what in report.replaced]
    assert (replaced.count("swiglu: FusedSwiGLUExperts"), replaced.count("swiglu: FusedSwiGLUMLP"),
            report.count("rms_norm")) == (experts, mlps, norms), str(report)
    assert report.skipped == [] and list(fused.state_dict()) == list(model.state_dict())
    ids = _batch()
    expected = model(input_ids=ids, labels=ids)
    expected.loss.backward()
    with _kernel_launches() as forward:
        out = fused(input_ids=ids, labels=ids)
    with _kernel_launches() as backward:
        out.loss.backward()
    # One launch per expert that received tokens (at most EXPERTS per MoE layer) and per dense MLP, forward and
    # backward alike: the fused activation really ran in every MoE layer.
    assert experts + mlps <= forward["swiglu"] <= experts * EXPERTS + mlps and backward["swiglu"] == forward["swiglu"]
    # The _budgets reasoning, with each fused experts' activation counted once per expert (EXPERTS per layer).
    ops = norms + experts * EXPERTS + mlps + LAYERS  # + rotaries
    budget = (ops * HIDDEN + VOCAB) * U_FP32
    _assert_within(out.loss, expected.loss, budget, "loss")
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        _assert_within(q.grad, p.grad, 2 * budget, name)


def _experts_reference(gate_up, down, x, index, weights):
    """Hugging Face's eager loop (MixtralExperts.forward), sentinel slots (index >= experts) skipped."""
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        token, slot = torch.where(index == expert)
        gate, up = torch.nn.functional.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


# The grouped kernel's rows past the last offset hold whatever memory held (here NaN on purpose): the interpreted
# activation between the GEMMs computes on them (numpy warns) and the layer never reads them back.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype, grouped_mm", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                                               (torch.bfloat16, None)], ids=str)
def test_fused_experts_equal_the_eager_loop_with_idle_experts_and_sentinels(dtype, grouped_mm, monkeypatch):
    """6 experts, top-2 of 11 tokens routed to 4 of them (2 idle), 3 slots marked for another rank (index 6);
    output and the gradients of the input, both weights and the routing weights, as a loop over the experts
    and as grouped GEMMs (torch's CPU kernel: Hopper's path, no host sync, the skipped slots' rows left
    uninitialised by the kernel); None: the choice for the device (bf16 rows of 12 x 2 bytes are no 16-byte
    multiple: the loop). Tolerance: fp32 differs by the order of the hidden-width sums (HIDDEN·u); bf16 rounds
    the activation once where eager rounds silu and the product apart (two bf16 roundings of the ffn-wide
    intermediate, then a sum over ffn = 12 terms)."""
    from tridist.kernels import FusedSwiGLUExperts

    generator = torch.Generator().manual_seed(3)
    experts, hidden, ffn, tokens = 6, 16, 12, 11
    gate_up = (torch.randn(experts, 2 * ffn, hidden, generator=generator) / 4).to(dtype).requires_grad_()
    down = (torch.randn(experts, hidden, ffn, generator=generator) / 4).to(dtype).requires_grad_()
    x = torch.randn(tokens, hidden, generator=generator).to(dtype).requires_grad_()
    index = torch.tensor([[0, 2], [3, 5], [2, 0], [5, 3], [0, 6], [2, 3], [6, 5], [3, 0], [5, 2], [0, 6], [3, 2]])
    weights = torch.rand(tokens, 2, generator=generator).to(dtype).requires_grad_()
    leaves = (x, gate_up, down, weights)
    grad = torch.randn(tokens, hidden, generator=generator).to(dtype)
    if grouped_mm:  # rows past the last offset: NaN, where the kernel leaves whatever the memory held
        real = torch.nn.functional.grouped_mm

        def poisoned(a, b, *, offs, **kwargs):
            out = real(a, b, offs=offs, **kwargs)
            return out.masked_fill(torch.arange(out.shape[0])[:, None] >= offs[-1], float("nan"))

        monkeypatch.setattr(torch.nn.functional, "grouped_mm", poisoned)
    with _kernel_launches() as launches:
        out = FusedSwiGLUExperts(gate_up, down, grouped_mm=grouped_mm)(x, index, weights)
    fused_grads = torch.autograd.grad(out, leaves, grad)
    # The interpreted kernels (once per expert hit, or once over every pair when grouped), or the CPU path (none).
    assert launches["swiglu"] in (0, 1 if grouped_mm else 4)
    reference = _experts_reference(gate_up, down, x, index, weights)
    reference_grads = torch.autograd.grad(reference, leaves, grad)
    budget = HIDDEN * U_FP32 * 4 if dtype == torch.float32 else 4 * 2.0**-8
    _assert_within(out, reference, budget, "output")
    for name, a, b in zip(("x", "gate_up_proj", "down_proj", "weights"), fused_grads, reference_grads):
        _assert_within(a, b, 2 * budget, name)
    assert fused_grads[1][[1, 4]].abs().max() == 0  # idle experts get no gradient


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning")
def test_fused_experts_grouped_mm_path_forward_on_cpu():
    """The grouped-GEMM path in bf16 (16-byte rows) equals the loop: the offsets from the per-expert counts,
    idle experts included, route every row to its expert."""
    from tridist.kernels import FusedSwiGLUExperts

    generator = torch.Generator().manual_seed(5)
    gate_up = torch.randn(4, 32, 16, generator=generator, dtype=torch.bfloat16)
    down = torch.randn(4, 16, 16, generator=generator, dtype=torch.bfloat16)
    x = torch.randn(9, 16, generator=generator, dtype=torch.bfloat16)
    index = torch.tensor([[0, 3], [3, 0], [0, 3], [3, 0], [0, 3], [1, 3], [0, 1], [3, 4], [1, 0]])
    weights = torch.rand(9, 2, generator=generator, dtype=torch.bfloat16)
    with torch.no_grad():
        grouped = FusedSwiGLUExperts(gate_up, down, grouped_mm=True)(x, index, weights)
        loop = FusedSwiGLUExperts(gate_up, down, grouped_mm=False)(x, index, weights)
    _assert_within(grouped.float(), loop.float(), 4 * 2.0**-8, "grouped vs loop")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning")
def test_grouped_experts_compile_to_one_graph_and_match():
    """In bf16 the experts run as grouped GEMMs with no host sync, so torch.compile(fullgraph=True) captures the
    layer whole (a data-dependent count would break the graph), forward and backward, equal to eager's."""
    from tridist.kernels import FusedSwiGLUExperts
    from tridist.kernels.ops.swiglu import grouped_mm_supported

    generator = torch.Generator().manual_seed(7)
    gate_up = torch.nn.Parameter((torch.randn(4, 32, 16, generator=generator) / 4).bfloat16())
    down = torch.nn.Parameter((torch.randn(4, 16, 16, generator=generator) / 4).bfloat16())
    layer = FusedSwiGLUExperts(gate_up, down)
    x = torch.randn(9, 16, generator=generator).bfloat16().requires_grad_()
    index = torch.tensor([[0, 3], [3, 0], [0, 3], [3, 4], [0, 3], [1, 3], [0, 1], [3, 4], [1, 0]])  # 4: skipped
    weights = torch.rand(9, 2, generator=generator).bfloat16()
    assert grouped_mm_supported(x, down)
    grad = torch.randn(9, 16, generator=generator).bfloat16()
    eager_out = layer(x, index, weights)
    eager_grads = torch.autograd.grad(eager_out, (x, gate_up, down), grad)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(x, index, weights)
    grads = torch.autograd.grad(out, (x, gate_up, down), grad)
    # aot_eager runs the same ATen ops: equal up to the order autograd accumulates the gathered rows' gradient.
    _assert_within(out.float(), eager_out.float(), 2.0**-8, "output")
    for name, a, b in zip(("x", "gate_up_proj", "down_proj"), grads, eager_grads):
        _assert_within(a.float(), b.float(), 2.0**-7, name)


def test_negative_expert_indices_are_refused():
    """A negative index would sort before every expert's rows and shift each group onto the wrong expert: both
    paths refuse it (the grouped one on the device, without a host sync)."""
    from tridist.kernels import FusedSwiGLUExperts

    layer = FusedSwiGLUExperts(torch.nn.Parameter(torch.randn(2, 32, 16).bfloat16()),
                               torch.nn.Parameter(torch.randn(2, 16, 16).bfloat16()))
    x, index, weights = torch.randn(3, 16).bfloat16(), torch.tensor([[-1], [0], [1]]), torch.ones(3, 1).bfloat16()
    for grouped_mm in (True, False):
        layer.grouped_mm = grouped_mm
        with pytest.raises(RuntimeError, match=">= 0|non-negative"):
            layer(x, index, weights)


def test_experts_of_another_activation_or_layout_are_left_alone():
    model = build("mixtral")
    for layer in model.model.layers:
        layer.mlp.experts.act_fn = torch.nn.GELU()  # a look-alike: GeGLU experts
    report = kernels.fuse(model)
    assert not any("Experts" in what for _, what in report.replaced)
    assert {why for name, why in report.skipped if name.endswith("experts")} == {
        "has 3-D gate_up_proj/down_proj experts but its output is not each token's experts' down(silu(gate) * up), "
        "weighted and summed; left as is"}


def test_fused_loss_keeps_the_router_load_balancing_loss():
    """Mixtral with output_router_logits adds its router's load-balancing loss to the loss; the fused head + loss
    replaces the cross entropy only (the probe leaves the router loss out: its stand-in decoder has no router
    logits), so loss, aux_loss and every gradient stay the model's within the fp32 budget."""
    model = build("mixtral-aux")
    fused = copy.deepcopy(model)
    report = kernels.fuse(fused)
    assert report.count("linear_cross_entropy") == 1 and report.skipped == [], str(report)
    ids = _batch()
    expected, out = model(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    assert out.logits is None and out.aux_loss is not None
    budget = (VOCAB + 8 * HIDDEN) * U_FP32  # the fused loss's reduction over VOCAB and the fused norms and experts
    _assert_within(out.aux_loss, expected.aux_loss, budget, "aux_loss")
    _assert_within(out.loss, expected.loss, budget, "loss")
    expected.loss.backward()
    out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        _assert_within(q.grad, p.grad, 2 * budget, name)
