"""Self-contained replica of Hugging Face transformers' ``modeling_llama`` (eager attention path).

transformers is not a dependency, but HF Llama is what most people train, so kernels and the
distributed code are also checked against its structure: "bhsd" attention layout, rotary tables of
shape [B, S, head_dim] computed once per forward and shared by all layers, grouped-query attention,
HF's RMSNorm dtype handling and HF's shifted causal-LM loss. Names and attribute paths follow HF so
that state dicts and fusion passes written for HF modules apply unchanged.

Left out (not needed by tests/benchmarks): KV cache, padding masks, dropout, rope scaling variants,
SDPA/flash dispatch, and returning attention weights from ``LlamaAttention``.

Plain torch only: nothing from this repository may be imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ._autocast import autocast_disabled

__all__ = [
    "LlamaConfig",
    "tiny_hf_config",
    "LlamaRMSNorm",
    "LlamaRotaryEmbedding",
    "rotate_half",
    "apply_rotary_pos_emb",
    "repeat_kv",
    "eager_attention_forward",
    "make_causal_mask",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaDecoderLayer",
    "LlamaModel",
    "LlamaForCausalLM",
    "causal_lm_loss",
]




@dataclass
class LlamaConfig:
    """The subset of transformers' LlamaConfig that the eager forward pass reads (HF defaults: Llama-2 7B)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None -> num_attention_heads (plain multi-head attention)
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    initializer_range: float = 0.02  # std of HF's normal init for Linear/Embedding weights

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")


def tiny_hf_config(**overrides) -> LlamaConfig:
    """A config small enough for CPU unit tests, with GQA (4 query heads share 2 kv heads)."""
    tiny = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    # replace() reruns __post_init__, so derived head_dim follows an overridden hidden_size/heads
    # unless head_dim itself is overridden.
    overrides.setdefault("head_dim", None)
    return replace(tiny, **overrides)


class LlamaRMSNorm(nn.Module):
    """HF semantics: normalise in fp32, cast back to the *input* dtype, then ``weight * h``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    """Default rope: ``forward(x, position_ids) -> (cos, sin)``, each [B, S, head_dim] in x.dtype."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0  # the default rope type does not rescale

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        with autocast_disabled(x.device):  # force fp32
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Rotate q/k. ``unsqueeze_dim=1`` broadcasts [B, S, D] tables over bhsd heads (2 for bshd).

    ``position_ids`` is unused, kept for HF signature compatibility. Called by global name from
    ``LlamaAttention.forward`` so a fusion pass can swap it.
    """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, KV, S, D] -> [B, KV * n_rep, S, D], each kv head repeated for its group of query heads."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def make_causal_mask(q_len: int, kv_len: int, *, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive [1, 1, q_len, kv_len] mask: 0 on and below the (bottom-right aligned) diagonal, finfo.min above."""
    mask = torch.full((q_len, kv_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask = torch.triu(mask, diagonal=kv_len - q_len + 1)
    return mask[None, None, :, :]


def eager_attention_forward(module, query, key, value, attention_mask, *, scaling: float):
    """HF's eager attention: bhsd in, bshd out; additive mask, softmax in fp32."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int = 0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        """``attention_mask``: additive [B or 1, 1, S, S]; None builds the causal mask here."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if attention_mask is None:
            q_len, kv_len = query_states.shape[-2], key_states.shape[-2]
            attention_mask = make_causal_mask(q_len, kv_len, dtype=query_states.dtype, device=query_states.device)

        attn_output, _ = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask, scaling=self.scaling
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()  # HF: ACT2FN[config.hidden_act] with hidden_act="silu"

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int = 0):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(
            hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class LlamaModel(nn.Module):
    """Embeddings + decoder stack + final norm; returns the last hidden states [B, S, hidden]."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, layer_idx=i) for i in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids, position_ids=None):
        inputs_embeds = self.embed_tokens(input_ids)
        seq_len = inputs_embeds.shape[1]
        if position_ids is None:  # HF: cache_position.unsqueeze(0), broadcast over the batch
            position_ids = torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0)
        causal_mask = make_causal_mask(seq_len, seq_len, dtype=inputs_embeds.dtype, device=inputs_embeds.device)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)  # once, shared by all layers
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states, position_embeddings=position_embeddings, attention_mask=causal_mask
            )
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids, labels=None, position_ids=None) -> (loss or None, logits)``.

    Labels are *unshifted* (HF convention: pass ``labels=input_ids``); the loss predicts token t+1
    from position t, ignores -100, and averages over the remaining tokens.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _init_weights(self, module: nn.Module) -> None:
        """HF's LlamaPreTrainedModel._init_weights: N(0, initializer_range), zero biases, unit norms."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
        elif isinstance(module, LlamaRMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, input_ids, labels=None, position_ids=None):
        hidden_states = self.model(input_ids, position_ids=position_ids)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, vocab_size=self.vocab_size)
        return loss, logits


def causal_lm_loss(logits, labels, *, vocab_size: int, ignore_index: int = -100):
    """HF's ForCausalLMLoss: shift labels left by one (pad with ignore_index), fp32 CE, mean over kept tokens."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1).to(logits.device)
    return F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="mean")
