"""distcore/lora.py: which modules are peft LoRA layers, their adapters, and what tensor parallel refuses of them."""

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, inject_adapter_in_model  # noqa: E402

from tests.hf_models import build  # noqa: E402
from tridist.distcore.lora import has_lora_layers, is_lora_layer, lora_adapters  # noqa: E402


def _injected(**config):
    model = build("llama")
    return inject_adapter_in_model(LoraConfig(r=4, **{"target_modules": ["q_proj", "o_proj"], **config}), model)


def test_lora_layers_are_told_apart_with_their_adapters():
    model = _injected()
    layers = has_lora_layers(model)
    assert layers == [f"model.layers.{i}.self_attn.{p}" for i in range(len(model.model.layers)) for p in ("q_proj", "o_proj")]
    q = model.get_submodule(layers[0])
    assert is_lora_layer(q) and not is_lora_layer(q.base_layer) and not is_lora_layer(model.model.layers[0].self_attn)
    ((a, b),) = lora_adapters(layers[0], q)
    assert (a.in_features, a.out_features, b.in_features, b.out_features) == (q.base_layer.in_features, 4, 4,
                                                                                q.base_layer.out_features)


@pytest.mark.parametrize("what, config, expected", [
    ("DoRA", dict(use_dora=True), r"a variant of LoRA \(DoraLinearVariant: DoRA's weight norm"),
    ("an embedding", dict(target_modules=["embed_tokens"]), r"LoRA adapters of an embedding"),
])
def test_what_tensor_parallel_cannot_split_is_refused_naming_it(what, config, expected):
    model = _injected(**config)
    name = has_lora_layers(model)[0]
    with pytest.raises(NotImplementedError, match=expected + r".*use a strategy without tensor parallel"):
        lora_adapters(name, model.get_submodule(name))


def test_merged_adapters_are_refused_naming_the_fix():
    model = _injected()
    name = has_lora_layers(model)[0]
    layer = model.get_submodule(name)
    layer.merge()
    with pytest.raises(NotImplementedError, match=r"merged into its base weight \(\['default'\]\); unmerge them"):
        lora_adapters(name, layer)
    layer.unmerge()
    assert len(lora_adapters(name, layer)) == 1


def test_fuse_keeps_every_adapter_and_leaves_a_lora_head_alone_naming_it():
    """`fuse` on a model wrapped by get_peft_model with LoRA on every projection and on the LM head: the fused MLPs call
    the LoRA layers (the adapters run), the head is left alone with the reason (peft's lora.Linear, not an nn.Linear:
    a fused head would read the base weight only); the loss and every adapter's gradient are the unfused model's
    (fp32 on the CPU path: the fused ops compute the same sums, to a few ulps)."""
    import copy

    from peft import get_peft_model

    from tridist import kernels

    torch.manual_seed(0)
    model = get_peft_model(build("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj",
                                                                            "down_proj", "lm_head"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    fused = copy.deepcopy(model)
    report = kernels.fuse(fused)
    assert [name for name, _ in report.skipped] == ["base_model.model.lm_head"], str(report)
    assert "peft.tuners.lora.layer.Linear, not an nn.Linear" in report.skipped[0][1]
    ids = torch.randint(3, 100, (2, 8))
    losses = []
    for m in (model, fused):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    grads = {n: p.grad for n, p in fused.named_parameters() if p.grad is not None}
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(expected) and any("lm_head.lora_A" in n for n in grads)
    # Each gradient to 1e-4 of its own norm: the fused ops sum the same fp32 terms in another order (relative error a
    # few hundred ulps at these widths, on any BLAS), which near-cancelling elements show element-wise, not in the norm
    for name, grad in expected.items():
        assert (grads[name] - grad).norm() <= 1e-4 * grad.norm(), (name, (grads[name] - grad).norm(), grad.norm())


@pytest.mark.parametrize("family", ["opt", "llama", "phi3", "gpt2", "bloom"])
def test_the_structure_reads_a_lora_layer_as_its_projection(family):
    """autotune's recogniser sees each LoRA layer as the projection it wraps (not its base layer and adapters as more
    Linears): the LoRA model's structure and shapes are the model's, only the trained share differs. Before, OPT's
    (fc1 and fc2 directly in the layer, checked as nn.Linear) was not recognised with LoRA on them."""
    import dataclasses

    from tridist.autotune import ModelSpec
    from tests.distributed.transformers_worker import _lora

    plain = ModelSpec.from_module(build(family))
    lora = ModelSpec.from_module(_lora(build(family)))
    assert lora.trainable_fraction < 0.2
    assert dataclasses.replace(lora, trainable_fraction=1.0) == plain
    assert lora.structure == plain.structure
