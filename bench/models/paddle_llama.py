"""A runnable PyTorch version of the model in Paddle's ``paddle.distributed.parallelize`` docs example.

The seed (``/work/shared/seeds/001_1153e8d5720e506b.txt``) gives only module names and shapes (its
forwards are ``pass``); its 8-device example plans tensor, sequence and pipeline parallelism by those
names, so this file keeps them exactly:

    llama.embed_tokens                      nn.Embedding(vocab, hidden)
    llama.layers.N.self_attn.qkv_proj       nn.Linear(hidden, 3 * hidden, bias=False)  packed [q | k | v]
    llama.layers.N.self_attn.o_proj         nn.Linear(hidden, hidden, bias=False)
    llama.layers.N.mlp.gate_up_proj         nn.Linear(hidden, 2 * intermediate, bias=False)  packed [gate | up]
    llama.layers.N.mlp.down_proj            nn.Linear(intermediate, hidden, bias=False)
    llama.layers.N.input_layernorm          LlamaRMSNorm (a ``weight``)
    llama.layers.N.post_attention_layernorm LlamaRMSNorm
    llama.norm                              LlamaRMSNorm
    lm_head                                 LlamaLMHead: a bare ``weight`` [hidden, vocab], ``x @ weight``

The forwards are ordinary Llama ones, written for one device: causal attention through
``F.scaled_dot_product_attention`` with rotary embeddings, SwiGLU on ``gate_up.chunk(2)``, RMSNorm,
and ``forward(input_ids, labels=None) -> (loss, logits)`` with a mean cross entropy. Layout is "bhsd"
inside attention.

Pipeline-friendly by construction: the decoder layers are one ``nn.ModuleList`` (``llama.layers``)
run as ``hidden = layer(hidden, cos, sin)``; the per-layer extras (rotary cos/sin) are computed once
before the loop from the positions, so a stage holding any slice of the layers needs only the hidden
states and those tables.

Plain torch only: nothing from this repository may be imported here (distributed tests use this
model as the single-device reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ._autocast import autocast_disabled

__all__ = [
    "PaddleLlamaConfig",
    "tiny_paddle_config",
    "seed_paddle_config",
    "LlamaRMSNorm",
    "LlamaRotaryEmbedding",
    "apply_rotary_pos_emb",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaDecoderLayer",
    "LlamaModel",
    "LlamaLMHead",
    "LlamaForCausalLM",
]


@dataclass(frozen=True)
class PaddleLlamaConfig:
    """Sizes; the defaults are the seed example's ModelConfig (its head count is ours: the seed has none)."""

    vocab_size: int = 10
    hidden_size: int = 20
    intermediate_size: int = 20
    num_layers: int = 2
    num_attention_heads: int = 2  # head_dim 10: rotary needs an even head_dim
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def seed_paddle_config(**overrides) -> PaddleLlamaConfig:
    """The seed example's own sizes (vocab 10, hidden 20, intermediate 20, 2 layers)."""
    return replace(PaddleLlamaConfig(), **overrides)


def tiny_paddle_config(**overrides) -> PaddleLlamaConfig:
    """CPU-test size: divisible by tensor-parallel degrees 2 and 4 (heads, vocab, hidden, intermediate)
    and its 4 layers by pipeline degrees 2 and 4 (or 2 with 2 chunks per stage)."""
    tiny = PaddleLlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=4, num_attention_heads=4)
    return replace(tiny, **overrides)


class LlamaRMSNorm(nn.Module):
    """RMSNorm in fp32, cast back to the input dtype, then scaled (Llama's definition)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        with autocast_disabled(hidden_states.device):
            hidden = hidden_states.to(torch.float32)
            hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden.to(dtype)


class LlamaRotaryEmbedding(nn.Module):
    """cos/sin tables [batch, seq, head_dim] for given positions (no length limit: computed per call)."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # moves with .to(); not in state_dict

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq  # [B, S, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotate-half rotary on bhsd q/k; cos/sin are [B, S, D] (broadcast over heads)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: PaddleLlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, config.hidden_size * 3, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, cos, sin):
        batch, seq, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: PaddleLlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, config.intermediate_size * 2, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # Paddle's swiglu(x) splits the same way
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PaddleLlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, cos, sin):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaModel(nn.Module):
    def __init__(self, config: PaddleLlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = LlamaRotaryEmbedding(config.head_dim, config.rope_theta)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, position_ids=None):
        hidden_states = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        cos, sin = self.rotary_emb(position_ids, hidden_states.dtype)  # once, shared by every layer
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin)
        return self.norm(hidden_states)


class LlamaLMHead(nn.Module):
    """The seed's LM head: a bare [hidden, vocab] parameter (Paddle's [in, out] convention)."""

    def __init__(self, config: PaddleLlamaConfig):
        super().__init__()
        # Paddle's create_parameter initialises weights with XavierUniform.
        self.weight = nn.Parameter(nn.init.xavier_uniform_(torch.empty(config.hidden_size, config.vocab_size)))

    def forward(self, hidden_states):
        return torch.matmul(hidden_states, self.weight)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids, labels=None, position_ids=None) -> (loss, logits)``; loss = mean token CE."""

    def __init__(self, config: PaddleLlamaConfig | None = None):
        super().__init__()
        self.config = config if config is not None else PaddleLlamaConfig()
        self.llama = LlamaModel(self.config)
        self.lm_head = LlamaLMHead(self.config)

    def forward(self, input_ids, labels=None, position_ids=None):
        logits = self.lm_head(self.llama(input_ids, position_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, self.config.vocab_size), labels.reshape(-1))
        return loss, logits
