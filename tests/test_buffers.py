"""Buffers under mixed precision (distcore/buffers.py): cast to the compute dtype where the model's own load in that
dtype makes them so, the others kept. The distributed runs: transformers_worker's
check_bf16_mixed_precision_casts_the_buffers_a_bf16_load_makes_bf16."""

from __future__ import annotations

import logging

import pytest
import torch

hf = pytest.importorskip("transformers")

from tridist.distcore.buffers import cast_buffers_as_loaded  # noqa: E402

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)


def _gpt1():
    torch.manual_seed(0)
    return hf.OpenAIGPTLMHeadModel(hf.OpenAIGPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def test_the_buffers_a_bf16_load_makes_bf16_are_cast_and_the_others_kept():
    """GPT-1's causal masks (torch.ones: the default dtype) go to bf16 with their values (0 and 1, exact) and stay out
    of the state dict as before; a Llama's rotary tables (built with .float()) and MiniMax's stay fp32, MiniMax's decay
    rates (a float base to an integer power: the default dtype) go to bf16."""
    model = _gpt1()
    masks = {name: buffer.clone() for name, buffer in model.named_buffers() if name.endswith("attn.bias")}
    keys = set(model.state_dict())
    assert sorted(cast_buffers_as_loaded(model, torch.bfloat16)) == sorted(masks)
    buffers = dict(model.named_buffers())
    for name, mask in masks.items():
        assert buffers[name].dtype == torch.bfloat16 and torch.equal(buffers[name].float(), mask), name
    assert set(model.state_dict()) == keys and model.config.dtype in (None, torch.float32)  # (the build's config: a copy)
    assert cast_buffers_as_loaded(model, torch.bfloat16) == []  # nothing left to cast

    llama = hf.LlamaForCausalLM(hf.LlamaConfig(**TEXT))
    assert cast_buffers_as_loaded(llama, torch.bfloat16) == []
    assert {b.dtype for n, b in llama.named_buffers() if "inv_freq" in n} == {torch.float32}

    minimax = hf.MiniMaxForCausalLM(hf.MiniMaxConfig(**TEXT, head_dim=16, block_size=4, num_local_experts=2,
                                                     layer_types=["linear_attention", "full_attention"]))
    cast = cast_buffers_as_loaded(minimax, torch.bfloat16)
    assert cast and all(".self_attn." in name for name in cast) and "model.layers.0.self_attn.slope_rate" in cast
    assert {b.dtype for n, b in minimax.named_buffers() if "inv_freq" in n} == {torch.float32}


def test_a_buffer_two_modules_share_stays_shared():
    model = _gpt1()
    shared = model.transformer.h[0].attn.bias
    model.transformer.h[1].attn.bias = shared  # (assigning a tensor to a buffer's name replaces the buffer)
    assert cast_buffers_as_loaded(model, torch.bfloat16) == ["transformer.h.0.attn.bias"]  # named once
    assert model.transformer.h[1].attn.bias is model.transformer.h[0].attn.bias
    assert model.transformer.h[1].attn.bias.dtype == torch.bfloat16


def test_a_saved_buffer_the_load_keeps_in_fp32_stays_fp32(monkeypatch):
    """transformers' load keeps what `_keep_in_fp32_modules_strict` names in fp32 (bf16 and fp16), and what
    `_keep_in_fp32_modules` names under fp16, among the checkpoint's keys: a persistent buffer there stays fp32; a
    non-persistent one, which no load reaches, is cast as the class makes it."""
    model = _gpt1()
    model.transformer.h[0].attn._non_persistent_buffers_set.discard("bias")  # saved, so loaded
    monkeypatch.setattr(type(model), "_keep_in_fp32_modules_strict", ["h.*.attn"])
    assert sorted(cast_buffers_as_loaded(model, torch.bfloat16)) == ["transformer.h.1.attn.bias"]
    monkeypatch.setattr(type(model), "_keep_in_fp32_modules_strict", None)
    monkeypatch.setattr(type(model), "_keep_in_fp32_modules", ["h.0"])
    assert cast_buffers_as_loaded(model, torch.float16) == ["transformer.h.1.attn.bias"]  # (h.1 bf16 already: fp16 now)
    assert sorted(cast_buffers_as_loaded(model, torch.bfloat16)) == [  # h.0 not kept under bf16 (h.1 fp16 now)
        "transformer.h.0.attn.bias", "transformer.h.1.attn.bias"]


def test_a_lazy_models_buffers_are_cast_once_materialised():
    """Under LazyGuard the buffers are meta until materialised (their recipes replay then): left alone before, cast
    after (parallelize calls it again after its materialisation)."""
    from tridist.distcore import LazyGuard
    from tridist.distcore.lazy import materialize

    with LazyGuard():
        model = hf.OpenAIGPTLMHeadModel(hf.OpenAIGPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                                           n_head=2))
        model.initialize_weights()
    assert cast_buffers_as_loaded(model, torch.bfloat16) == []
    materialize(model, device=torch.device("cpu"))
    assert len(cast_buffers_as_loaded(model, torch.bfloat16)) == 2
    assert {b.dtype for n, b in model.named_buffers() if n.endswith("attn.bias")} == {torch.bfloat16}


def test_peft_models_are_read_through_their_base_model():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_gpt1(), peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    assert len(cast_buffers_as_loaded(model, torch.bfloat16)) == 2
    assert {b.dtype for n, b in model.named_buffers() if n.endswith("attn.bias")} == {torch.bfloat16}


def test_a_model_that_is_not_a_transformers_model_keeps_its_buffers(monkeypatch, caplog):
    """Its author decides (no `_from_config` to ask); a transformers class that cannot be built from its config on the
    meta device keeps them too, with a warning naming it."""
    plain = torch.nn.Module()
    plain.register_buffer("scale", torch.ones(3))
    assert cast_buffers_as_loaded(plain, torch.bfloat16) == [] and plain.scale.dtype == torch.float32

    model = _gpt1()

    def refuse(*args, **kwargs):
        raise TypeError("needs more than its config")

    monkeypatch.setattr(type(model), "_from_config", classmethod(refuse))
    with caplog.at_level(logging.WARNING, logger="tridist.distcore.buffers"):
        assert cast_buffers_as_loaded(model, torch.bfloat16) == []
    assert "OpenAIGPTLMHeadModel could not be built" in caplog.text
    assert {b.dtype for n, b in model.named_buffers() if n.endswith("attn.bias")} == {torch.float32}
