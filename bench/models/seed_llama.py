"""PyTorch port of the Llama-style example from Paddle's ``paddle.distributed.to_distributed`` docs.

The seed (``/work/shared/seeds/000_2a1badcf803c9373.txt``) is the reference workload for the
to-distributed work, so this file keeps its names, attribute names, "bshd" layout
([batch, seq, heads, head_dim]) and math line for line. Deliberate differences, all harmless for the
seed's own usage:

* sizes come from :class:`SeedLlamaConfig` instead of module constants, and every module is handed
  its sizes (the seed's ``DecoderLayer`` builds ``Mlp()`` with default sizes, which would silently
  ignore a non-default ``intermediate_size``);
* ``Model.forward`` honours a caller-supplied padding ``attention_mask`` (the seed overwrites the
  argument with all-ones; with ``attention_mask=None`` the behaviour is identical).

Plain torch only: nothing from this repository may be imported here, because kernel-fusion and
distributed tests use this model as the unmodified reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

from ._autocast import autocast_disabled

__all__ = [
    "SeedLlamaConfig",
    "tiny_seed_config",
    "RotaryEmbedding",
    "rotate_half",
    "apply_rotary_pos_emb",
    "scaled_dot_product_attention",
    "Attention",
    "Mlp",
    "RMSNorm",
    "DecoderLayer",
    "_prepare_decoder_attention_mask",
    "Model",
    "RandomDataset",
    "make_seed_dataloader",
    "train_seed_example",
]




@dataclass(frozen=True)
class SeedLlamaConfig:
    """Sizes of the seed example; the defaults are the seed's module constants."""

    vocab_size: int = 8000  # VOCAB_SIZE
    hidden_size: int = 2048  # HIDDEN_SIZE
    intermediate_size: int = 4096  # INTERMEDIATE_SIZE
    num_attention_heads: int = 32  # N_HEAD
    num_hidden_layers: int = 4  # NUM_HIDDEN_LAYERS
    max_position_embeddings: int = 1024  # SEQ_LENGTH: the rotary cache length
    rope_base: float = 10000.0
    # The seed really sets RMSNorm.variance_epsilon = 1.0 (not the usual 1e-6); kept for fidelity.
    rms_norm_eps: float = 1.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def tiny_seed_config(**overrides) -> SeedLlamaConfig:
    """A config small enough for CPU unit tests; intermediate 176 is deliberately not a power of two."""
    tiny = SeedLlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=32,
    )
    return replace(tiny, **overrides)


class RotaryEmbedding(nn.Module):
    """cos/sin tables cached once as [1, S, 1, D] (bshd broadcast shape), sliced per call."""

    def __init__(self, dim: int, max_position_embeddings: int = 2048, base: float = 10000.0):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float() / self.dim))
        # Buffers (not plain attributes as in paddle) so that .to(device) moves them; non-persistent so
        # that they stay out of state_dict, like the seed's attributes.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(seq_len=max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len: int) -> None:
        self.max_seq_len_cached = seq_len
        t = torch.arange(seq_len, dtype=torch.float32)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, :, None, :], persistent=False)

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cached[:, :seq_len, :, :]
        sin = self.sin_cached[:, :seq_len, :, :]
        return (
            cos.to(x.dtype) if cos.dtype != x.dtype else cos,
            sin.to(x.dtype) if sin.dtype != x.dtype else sin,
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    """Rotate bshd ``q``/``k``; ``cos``/``sin`` are the [1, S, 1, D] tables from RotaryEmbedding.

    Kept module-level and looked up by name in ``Attention.forward`` so a fusion pass can swap it.
    Note (seed semantics): the tables were already sliced to the current sequence length, so
    ``position_ids`` must lie in ``[0, seq_len)``.
    """
    if position_ids is None:
        cos = cos[:, : q.shape[1], :, :]
        sin = sin[:, : q.shape[1], :, :]
    else:
        cos = cos.squeeze(2).squeeze(0)  # [S, D]
        sin = sin.squeeze(2).squeeze(0)
        cos = cos[position_ids].unsqueeze(2)  # [B, S, 1, D]
        sin = sin[position_ids].unsqueeze(2)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def scaled_dot_product_attention(query_states, key_states, value_states, attention_mask):
    """The seed's explicit attention: bshd in, [B, S, H*D] out, additive mask, softmax in fp32."""
    bsz, q_len, num_heads, head_dim = query_states.shape
    _, kv_seq_len, _, _ = value_states.shape
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    value_states = value_states.transpose(1, 2)
    attn_weights = torch.matmul(query_states / math.sqrt(head_dim), key_states.transpose(2, 3))
    attention_mask = attention_mask.reshape(bsz, 1, q_len, kv_seq_len)
    attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2)
    attn_output = attn_output.reshape(bsz, q_len, head_dim * num_heads)
    return attn_output


class Attention(nn.Module):
    def __init__(self, config: SeedLlamaConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            base=config.rope_base,
        )

    def forward(self, hidden_states, position_ids=None, attention_mask=None):
        bsz, q_len, _ = hidden_states.shape
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        # The seed's reshape([0, 0, H, D]): batch and seq kept, heads fixed.
        query_states = query_states.reshape(bsz, q_len, self.num_heads, self.head_dim)
        key_states = key_states.reshape(bsz, q_len, self.num_heads, self.head_dim)
        value_states = value_states.reshape(bsz, q_len, self.num_heads, self.head_dim)
        kv_seq_len = key_states.shape[-3]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        output = scaled_dot_product_attention(query_states, key_states, value_states, attention_mask)
        attn_output = self.o_proj(output)
        return attn_output


class Mlp(nn.Module):
    def __init__(self, config: SeedLlamaConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def forward(self, x):
        # paddle.incubate.nn.functional.swiglu(gate, up) == silu(gate) * up
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Module):
    """The seed's RMSNorm: normalise in fp32, cast down only for fp16/bf16 weights, then scale.

    Unlike HF's LlamaRMSNorm the output of an fp32 weight stays fp32 whatever the input dtype, and
    the scale multiplies after the cast (``hidden * weight``, not ``weight * hidden``).
    """

    def __init__(self, hidden_size: int, eps: float = 1.0):
        super().__init__()
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.get_default_dtype()))
        self.variance_epsilon = eps  # the seed hard-codes 1.0

    def forward(self, hidden_states):
        with autocast_disabled(hidden_states.device):
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            hidden_states = torch.rsqrt(variance + self.variance_epsilon) * hidden_states
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        return hidden_states * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, config: SeedLlamaConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.self_attn = Attention(config)
        self.mlp = Mlp(config)  # sizes passed down (the seed's Mlp() used module defaults)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attn_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_ids=None, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_ids, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attn_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


def _prepare_decoder_attention_mask(attention_mask, input_shape, dtype):
    """[B, S] keep-mask (1 = attend) -> additive [B, 1, S, S] mask: 0 where allowed, finfo.min elsewhere."""
    batch_size, src_length = attention_mask.shape[0], attention_mask.shape[-1]
    batch_size, target_length = input_shape
    attention_mask = attention_mask[:, None, None, :].to(torch.bool)
    expanded_attn_mask = attention_mask.expand(batch_size, 1, target_length, src_length)
    mask = torch.tril(torch.ones((target_length, target_length), dtype=torch.bool, device=attention_mask.device))
    combined_attention_mask = mask[None, None, :, :].expand(batch_size, 1, target_length, target_length)
    expanded_attn_mask = expanded_attn_mask & combined_attention_mask
    expanded_attn_mask = torch.where(
        expanded_attn_mask,
        torch.tensor(0.0, dtype=dtype, device=attention_mask.device),
        torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=attention_mask.device),
    )
    return expanded_attn_mask


class Model(nn.Module):
    """The seed's decoder-only LM: ``forward(...) -> (loss, logits)``, LM head a bare [hidden, vocab] weight."""

    def __init__(self, config: SeedLlamaConfig | None = None):
        super().__init__()
        self.config = config if config is not None else SeedLlamaConfig()
        self.vocab_size = self.config.vocab_size
        self.hidden_size = self.config.hidden_size
        self.intermediate_size = self.config.intermediate_size
        self.embed_tokens = nn.Embedding(self.vocab_size, self.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(self.config) for _ in range(self.config.num_hidden_layers)])
        self.norm = RMSNorm(self.hidden_size, eps=self.config.rms_norm_eps)
        # paddle's create_parameter default initializer is XavierUniform.
        self.weight = nn.Parameter(torch.empty(self.hidden_size, self.vocab_size, dtype=torch.get_default_dtype()))
        nn.init.xavier_uniform_(self.weight)
        self.ignore_index = -100
        self.loss_func = nn.CrossEntropyLoss(reduction="none", ignore_index=self.ignore_index)

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None):
        batch_size, seq_length = input_ids.shape
        inputs_embeds = self.embed_tokens(input_ids)
        if attention_mask is None:  # the seed always uses all-ones here
            attention_mask = torch.ones((batch_size, seq_length), dtype=torch.bool, device=input_ids.device)
        if position_ids is None:
            position_ids = torch.arange(seq_length, dtype=torch.int64, device=input_ids.device).expand(
                batch_size, seq_length
            )
        attention_mask = _prepare_decoder_attention_mask(
            attention_mask, (batch_size, seq_length), inputs_embeds.dtype
        )
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_ids, attention_mask)
        hidden_states = self.norm(hidden_states)
        logits = torch.matmul(hidden_states, self.weight)
        loss = None
        if labels is not None:
            # Per-token CE over the vocab dim; paddle takes [B, S, V] vs [B, S, 1], torch wants [N, V] vs [N].
            masked_lm_loss = self.loss_func(
                logits.float().reshape(-1, self.vocab_size), labels.reshape(-1)
            ).reshape(labels.shape)
            # Seed semantics: average over tokens with loss > 0, which drops ignore_index tokens
            # (their loss is exactly 0) and also any token predicted with probability exactly 1.
            binary_sequence = torch.where(
                masked_lm_loss > 0, torch.ones_like(masked_lm_loss), torch.zeros_like(masked_lm_loss)
            )
            count = torch.sum(binary_sequence)
            if count == 0:
                loss = torch.sum(masked_lm_loss * binary_sequence)
            else:
                loss = torch.sum(masked_lm_loss * binary_sequence) / count
        return (loss, logits)


class RandomDataset(Dataset):
    def __init__(self, inputs, labels, num_samples: int):
        self.inputs = inputs
        self.labels = labels
        self.num_samples = num_samples

    def __getitem__(self, idx):
        return self.inputs[idx], self.labels[idx]

    def __len__(self):
        return self.num_samples


def make_seed_dataloader(
    batch_size: int = 4,
    batch_num: int = 2,
    seq_length: int = SeedLlamaConfig.max_position_embeddings,
    vocab_high: int = 1024,
    seed: int = 0,
) -> DataLoader:
    """The seed's random token data: ``batch_num`` in-order batches of [batch_size, seq_length] int64.

    Inputs and labels are independent uniform draws from [0, vocab_high) (the seed uses 1024, below
    its vocab of 8000; keep ``vocab_high <= vocab_size``). A private RandomState keeps it reproducible
    without touching numpy's global state.
    """
    rng = np.random.RandomState(seed)
    num_samples = batch_size * batch_num
    input_seqs = rng.randint(low=0, high=vocab_high, size=(num_samples, seq_length)).astype("int64")
    labels = rng.randint(low=0, high=vocab_high, size=(num_samples, seq_length)).astype("int64")
    dataset = RandomDataset(torch.from_numpy(input_seqs), torch.from_numpy(labels), num_samples)
    sampler = BatchSampler(SequentialSampler(dataset), batch_size=batch_size, drop_last=True)
    return DataLoader(dataset, batch_sampler=sampler)


def train_seed_example(model: Model, loader: DataLoader, *, epochs: int = 1, learning_rate: float = 0.1) -> list[float]:
    """The seed's single-process training loop (SGD, lr 0.1); returns the loss of every step."""
    opt = torch.optim.SGD(model.parameters(), lr=learning_rate)
    losses = []
    for _epoch in range(epochs):
        model.train()
        for inputs, labels in loader:
            loss, _ = model(inputs, labels=labels)
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
    return losses
