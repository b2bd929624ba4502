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
