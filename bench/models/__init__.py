"""Reference Llama-style models in plain PyTorch, used by tests, demos and benchmarks.

* ``seed_llama``: faithful port of the Paddle ``to_distributed`` docs example (bshd layout).
* ``hf_llama``: replica of Hugging Face ``modeling_llama`` (bhsd layout, GQA).
* ``paddle_llama``: the model of Paddle's ``parallelize`` docs example, made runnable (packed
  ``qkv_proj``/``gate_up_proj``, a bare-weight ``lm_head``), under the example's exact module names.

All return ``(loss, logits)`` from ``forward`` and import nothing from this repository, so they stay
an unmodified baseline for kernel fusion and distributed training.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from torch import nn

from .hf_llama import (
    LlamaAttention,
    LlamaConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    tiny_hf_config,
)
from .paddle_llama import (
    LlamaForCausalLM as PaddleLlamaForCausalLM,
    PaddleLlamaConfig,
    seed_paddle_config,
    tiny_paddle_config,
)
from .seed_llama import (
    Model as SeedLlamaModel,
    SeedLlamaConfig,
    make_seed_dataloader,
    tiny_seed_config,
)

__all__ = [
    "SeedLlamaConfig",
    "SeedLlamaModel",
    "tiny_seed_config",
    "make_seed_dataloader",
    "LlamaConfig",
    "LlamaRMSNorm",
    "LlamaRotaryEmbedding",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaDecoderLayer",
    "LlamaModel",
    "LlamaForCausalLM",
    "tiny_hf_config",
    "PaddleLlamaConfig",
    "PaddleLlamaForCausalLM",
    "tiny_paddle_config",
    "ModelSpec",
    "MODELS",
    "build_model",
]


def _hf_config_at_seed_sizes(**overrides) -> LlamaConfig:
    """HF Llama at the seed example's sizes, so the two models can be benchmarked like for like."""
    seed = SeedLlamaConfig()
    base = LlamaConfig(
        vocab_size=seed.vocab_size,
        hidden_size=seed.hidden_size,
        intermediate_size=seed.intermediate_size,
        num_hidden_layers=seed.num_hidden_layers,
        num_attention_heads=seed.num_attention_heads,
        num_key_value_heads=seed.num_attention_heads,
        max_position_embeddings=seed.max_position_embeddings,
        rope_theta=seed.rope_base,
    )
    overrides.setdefault("head_dim", None)  # re-derive unless given explicitly
    return replace(base, **overrides)


@dataclass(frozen=True)
class ModelSpec:
    """How to build one registered model: its class and a config factory per size name."""

    model_cls: Callable[..., nn.Module]
    configs: dict[str, Callable[..., object]]


MODELS: dict[str, ModelSpec] = {
    "seed-llama": ModelSpec(
        model_cls=SeedLlamaModel,
        configs={"tiny": tiny_seed_config, "seed": lambda **kw: replace(SeedLlamaConfig(), **kw)},
    ),
    "hf-llama": ModelSpec(
        model_cls=LlamaForCausalLM,
        configs={"tiny": tiny_hf_config, "seed": _hf_config_at_seed_sizes},
    ),
    "paddle-llama": ModelSpec(
        model_cls=PaddleLlamaForCausalLM,
        configs={"tiny": tiny_paddle_config, "seed": seed_paddle_config},
    ),
}


def build_model(name: str, size: str = "tiny", **overrides) -> nn.Module:
    """Build a registered model; ``overrides`` replace config fields (e.g. ``num_hidden_layers=1``).

    Seed the RNG (``torch.manual_seed``) beforehand for reproducible weights.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    spec = MODELS[name]
    if size not in spec.configs:
        raise ValueError(f"unknown size {size!r} for model {name!r}; known sizes: {', '.join(sorted(spec.configs))}")
    return spec.model_cls(spec.configs[size](**overrides))
