"""Tiny real Hugging Face transformers models, built in code (nothing is downloaded): the families
users bring. Each config is the smallest that keeps the family's distinguishing structure: grouped-
query attention (4 query heads, 2 key/value heads), Qwen2's q/k/v biases, Phi-3's packed qkv and
gate_up, Gemma's `1 + w` norms and GeGLU MLP, Gemma2's extra norms and soft-capping, tied embeddings,
Qwen3's per-head q/k RMSNorms (one weight shared by every head), OLMo2's q/k RMSNorms over the whole
projection (all heads' features), GPT-NeoX's per-head interleaved query_key_value and partial rotary,
GPT-2's Conv1D projections; Granite's and Cohere's scaled logits (and Granite's embedding, residual and
attention multipliers; Cohere's interleaved rotary, and its LayerNorms, which fuse leaves alone); and mixtures of experts (Mixtral, Qwen3-MoE with a dense first layer, Qwen2-MoE
with a shared expert), their experts as transformers stores them: 3-D stacked weights beside a router."""

from __future__ import annotations

import functools

import torch

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 128, 64, 2, 4, 2
# Sliding-window attention (Mistral, Gemma 2 and 3) over fewer positions than the tests' sequences (8 tokens):
# the configs' defaults (4,096) would make every window the whole causal prefix, indistinguishable from full
# attention.
SLIDING_WINDOW = 4

LLAMA_LIKE = ["llama", "llama-tied", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma", "gemma2"]
# Causal LMs whose forward scales the logits before the loss (the fused loss takes the scale from the config);
# the tiny configs' scales are not powers of two, so the scaled hidden states are rounded.
SCALED_LOGITS = ["granite", "cohere"]
FAMILIES = [*LLAMA_LIKE, "gpt-neox", "gpt2", *SCALED_LOGITS]
# Mixtures of experts (kept out of FAMILIES: their distributed checks, expert parallel among them, are their
# own). 4 experts, top-2; Qwen3-MoE's first layer dense (mlp_only_layers), Qwen2-MoE's shared expert beside the
# routed ones.
MOE_FAMILIES = ["mixtral", "qwen3-moe", "qwen2-moe"]
EXPERTS, TOP_K = 4, 2
# More families users bring, each built from its own transformers config class (AutoConfig.for_model) at the
# sizes above; the comment says what it adds. Kept apart from FAMILIES: tests/test_fuse_transformers.py checks
# fuse on all of them, tests/distributed/transformers_worker.py trains some under to_distributed.
_MOE = dict(num_experts_per_tok=TOP_K)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=4)  # Mamba-2 mixers at this scale
MORE_FAMILIES = {
    "phi": ("phi", {}),  # LayerNorm, partial rotary, GELU MLP beside the attention (one norm per block)
    "starcoder2": ("starcoder2", {}),  # LayerNorm, biases everywhere, GELU MLP
    "falcon": ("falcon", dict(num_kv_heads=KV_HEADS, new_decoder_architecture=True)),  # one query_key_value
    # Falcon-7B's multi-query attention: [q..q k v] with one key/value head, so [q | k | v] (its config's default)
    "falcon-mqa": ("falcon", {}),
    # StarCoder's multi-query attention: [q | k | v] in one Linear c_attn with one key/value head, the query's share
    # split at `embed_dim`; learned positions, GELU MLP, LayerNorm (dropouts 0.1 by default: masks differ by layout)
    "gpt-bigcode": ("gpt_bigcode", dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    # [q k v] per head in one query_key_value, as GPT-NeoX's; ALiBi (the model's per-head biases, built for every head)
    "bloom": ("bloom", {}),
    # [q k v] per head in one query_key_value, LayerNorm'd queries and keys (one weight for every head), partial rotary
    "persimmon": ("persimmon", {}),
    # [q | k | v] in one Wqkv, ALiBi (a position bias the model builds for every head), its MLP adding the residual
    "mpt": ("mpt", dict(max_seq_len=64)),
    # Multi-head latent attention (low-rank q and kv, a decoupled rotary part), a dense first layer, then
    # routed experts with a shared one and group-limited routing.
    "deepseek-v3": ("deepseek_v3", dict(num_key_value_heads=HEADS, n_routed_experts=EXPERTS, moe_intermediate_size=32,
                                        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32,
                                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=16,
                                        head_dim=8, **_MOE)),  # query heads 4 x 20 wide: not the hidden size
    # DeepSeek-V2's latent attention with its rotary on complex tables (Llama 4's convention on [B, H, S, D]).
    "deepseek-v2": ("deepseek_v2", dict(num_key_value_heads=HEADS, n_routed_experts=EXPERTS, moe_intermediate_size=32,
                                        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32,
                                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=16,
                                        head_dim=8, **_MOE)),
    # Attention sinks, sliding and full layers, clamped SwiGLU experts stored [experts, hidden, 2 x ffn].
    "gpt-oss": ("gpt_oss", dict(num_local_experts=EXPERTS, head_dim=16, sliding_window=SLIDING_WINDOW, **_MOE)),
    # Every layer a routed expert (top-1) plus a shared one, chunked attention, L2 q/k norms, layers without
    # rotary; its causal LM's base_model_prefix names another child than its decoder.
    "llama4": ("llama4_text", dict(num_local_experts=EXPERTS, num_experts_per_tok=1, intermediate_size_mlp=2 * HIDDEN,
                                   head_dim=16)),
    # Gated DeltaNet linear attention beside gated full attention, experts with a gated shared expert.
    "qwen3-next": ("qwen3_next", dict(head_dim=16, num_experts=EXPERTS, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32, linear_num_value_heads=4,
                                      linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, **_MOE)),
    # Qwen3.5's dense text model: its Gated DeltaNet packs [q | k | v] in one projection (unequal: 2 x 32 and 64
    # features) and the convolution runs over those channels; 4 key heads, each with 2 value heads (2 key heads on
    # each of 2 tp ranks); gated full attention in the other layers.
    "qwen3.5": ("qwen3_5_text", dict(head_dim=16, linear_num_value_heads=8, linear_num_key_heads=4,
                                     linear_key_head_dim=8, linear_value_head_dim=8)),
    # Local (sliding-window, its own rotary base) and global layers alternating (the config's default pattern
    # would make every layer of a small model local), q/k norms, 1 + w norms, GeGLU.
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=SLIDING_WINDOW)),
    # Gemma 4 with its layers' own key/value heads (per_layer_config): one in layer 0, two in layer 1 (tensor parallel
    # replicates the one and splits the two).
    "gemma4-mixed-kv": ("gemma4_text", dict(head_dim=16, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                                            global_head_dim=16, num_key_value_heads=1,
                                            per_layer_config={1: {"head_dim": 16, "num_key_value_heads": 2}})),
    # Gemma 3 1B's multi-query attention: 4 query heads share one key/value head (tensor parallel replicates it).
    "gemma3-mqa": ("gemma3_text", dict(head_dim=16, sliding_window=SLIDING_WINDOW, num_key_value_heads=1)),
    # Per-layer inputs, wider global heads, its rotary one tensor per call (x, cos, sin, unsqueeze_dim).
    "gemma4": ("gemma4_text", dict(head_dim=16, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)),
    "glm4": ("glm4", {}),  # partial interleaved rotary, norms after each sublayer too, packed gate_up
    "olmoe": ("olmoe", dict(num_experts=EXPERTS, **_MOE)),  # q/k norms over the projection, experts as modules
    "cohere2": ("cohere2", dict(head_dim=16)),  # LayerNorm without bias, sliding layers without rotary
    "exaone4": ("exaone4", {}),  # norms after each sublayer, q/k norms
    "smollm3": ("smollm3", {}),  # every fourth layer without rotary
    # A Mamba-2 layer, then an attention layer (IBM's hybrid); the mixer's gated RMSNorm, norm(x, gate), is no plain RMSNorm.
    # The mixer at the hidden size's scale (8 heads x 16 = 2 x hidden; by default 128 heads and a state of 256,
    # whose chunked scan cost 96 s of the suite), chunks of 4 tokens: the tests' 8-token rows span 2, so the scan's
    # inter-chunk path runs too (the default 256 held them in one).
    "bamba": ("bamba", dict(head_dim=16, attn_layer_indices=[1], **_MAMBA2)),
    # Two state groups: tp 2 splits them (a group per rank, its norm local), tp 4 puts each on two ranks.
    "bamba-2-groups": ("bamba", dict(head_dim=16, attn_layer_indices=[1], **{**_MAMBA2, "mamba_n_groups": 2})),
    # IBM's Granite 4.0-H (granitemoehybrid): Bamba's Mamba-2 mixer and attention layers, each with routed experts
    # beside a shared MLP (its packed input_linear [gate | up]); the dense variant (Granite 4.0-H-Micro: no experts)
    # has the shared MLP alone.
    "granite-hybrid": ("granitemoehybrid", dict(layer_types=["linear_attention", "attention"], num_local_experts=EXPERTS,
                                                shared_intermediate_size=2 * HIDDEN, **_MOE, **_MAMBA2)),
    "granite-hybrid-dense": ("granitemoehybrid", dict(layer_types=["linear_attention", "attention"],
                                                      num_local_experts=0, shared_intermediate_size=2 * HIDDEN, **_MAMBA2)),
    # Liquid AI's LFM2: gated short convolutions (in_proj to [B | C | x], a depthwise causal convolution of 3 taps over
    # B·x, gated by C; no state) in the layers between its attention layers (the released 1.2B: 10 of 16), SwiGLU
    # feed-forwards (w1, w3, w2); LFM2-MoE's first layer dense, experts after it.
    "lfm2": ("lfm2", {}),
    # AI2's OLMo-Hybrid: pre-norm Gated DeltaNet layers (input and post-attention norms) beside OLMo 2's post-norm
    # attention layers (post-attention and post-feedforward norms): two layer classes of other norms and mixers
    "olmo-hybrid": ("olmo_hybrid", dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                                        linear_key_head_dim=16, linear_value_head_dim=32)),
    # AI21's Jamba: Mamba-1 mixers (in_proj to [x | z], a depthwise convolution, x_proj to [dt | B | C] with norms on
    # each, dt_proj, A_log of a row of 16 states per channel) in every other layer, attention in the others, whose
    # MLP is a mixture of experts (expert_layer_period 2, offset 1: the dense MLPs beside the Mamba layers).
    "jamba": ("jamba", dict(attn_layer_period=2, attn_layer_offset=1, num_experts=EXPERTS, mamba_d_state=16, **_MOE)),
    "lfm2-moe": ("lfm2_moe", dict(num_dense_layers=1, moe_intermediate_size=HIDDEN, **_MOE)),
    # LayerNorm, learned positions, ReLU MLP; its final norm registered before its layer list (placed by where it is
    # called under pipeline parallel).
    "opt": ("opt", dict(ffn_dim=2 * HIDDEN, word_embed_proj_dim=HIDDEN, dropout=0.0)),  # 0.1 by default: masks differ by layout
    # GPT-1: post-norm blocks returning lists (not tuples), learned positions, GELU MLP; dropout 0.1 by default
    "openai-gpt": ("openai-gpt", dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    # Mamba layers, and hybrid ones that each call a transformer block (its input the hidden states joined with
    # the embeddings) through a linear layer of their own; the blocks' weights are tied to layer 2's (always 4
    # layers: transformers ties to layer 2 by name).
    "zamba": ("zamba", dict(num_hidden_layers=4, layers_block_type=["linear_attention", "linear_attention", "hybrid",
                                                                    "hybrid"], mamba_dt_rank=8)),
    # A Mamba-2 mixer beside the attention in every layer, µP multipliers (its logits * lm_head_multiplier).
    # µP multipliers of its mixer's [z | x | B | C | dt] features apart (the mup_vector buffer; all 1 by default)
    "falcon-h1": ("falcon_h1", dict(head_dim=16, lm_head_multiplier=0.3, mamba_d_ssm=2 * HIDDEN,
                                    ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9], **_MAMBA2)),
    # NVIDIA's Nemotron-H: one mixer per block (a Mamba-2 mixer, attention, a ReLU² MLP or experts with a shared
    # one), the model's forward picking each block's mask by its block_type; 4 blocks, each kind once or twice.
    "nemotron-h": ("nemotron_h", dict(num_hidden_layers=4, head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
                                      ssm_state_size=16, n_groups=1, chunk_size=4,
                                      layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"])),
    "nemotron-h-moe": ("nemotron_h", dict(num_hidden_layers=4, head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
                                          ssm_state_size=16, n_groups=1, chunk_size=4, n_routed_experts=EXPERTS,
                                          moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, **_MOE,
                                          layers_block_type=["linear_attention", "moe", "full_attention", "moe"])),
    # Nemotron's latent MoE (Nemotron 3 Super): the experts on a latent half the hidden size, projected to and from it
    "nemotron-h-latent": ("nemotron_h", dict(num_hidden_layers=4, head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
                                             ssm_state_size=16, n_groups=1, chunk_size=4, n_routed_experts=EXPERTS,
                                             moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                                             moe_latent_size=HIDDEN // 2, **_MOE,
                                             layers_block_type=["linear_attention", "moe", "full_attention", "moe"])),
    # PaddlePaddle's own family: GLM's rotary (adjacent pairs by the table's first half) computed in fp32 and cast
    # back to q's dtype; the MoE variant's experts as modules, its router's correction bias.
    "ernie4_5": ("ernie4_5", {}),
    "ernie4_5_moe": ("ernie4_5_moe", dict(moe_num_experts=EXPERTS, moe_k=TOP_K, moe_intermediate_size=32)),
    # Gemma 4's mixture of experts (26B-A4B's layout): in every layer a dense MLP and routed experts side by side, the
    # router and experts children of the decoder layer itself (no MoE block module); no per-layer inputs.
    "gemma4-moe": ("gemma4_text", dict(head_dim=16, global_head_dim=16, hidden_size_per_layer_input=0, enable_moe_block=True,
                                       num_experts=EXPERTS, top_k_experts=TOP_K, moe_intermediate_size=32)),
    # Attention whose output is gated by a projection of its own beside q/k/v (split with the query heads under tp):
    # AFMoE (Arcee's Trinity) a gate per feature (gate_proj, heads x head_dim), sliding and full layers, a dense first
    # layer, then experts with a shared one; Laguna a gate per head (g_proj, its default `gating`); Beam a gate per
    # feature with a bias per head, the second layer's MLP experts (its mlp_layer_types, set in `build`).
    "afmoe": ("afmoe", dict(head_dim=16, num_experts=EXPERTS, moe_intermediate_size=32, num_shared_experts=1,
                            num_dense_layers=1, global_attn_every_n_layers=2, sliding_window=SLIDING_WINDOW, **_MOE)),
    "laguna": ("laguna", dict(head_dim=16, num_experts=EXPERTS, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32, **_MOE)),
    "beam": ("beam", dict(head_dim=16, num_experts=EXPERTS, moe_intermediate_size=32, sliding_window=SLIDING_WINDOW,
                          n_group=1, topk_group=1, **_MOE)),
    # Value heads wider than the query/key heads (MiMo-V2-Flash: 128 beside 192; here 32 beside 16, the values scaled
    # by attention_value_scale); full and sliding-window layers alternate, the sliding ones with twice the key/value
    # heads and a sink per head (a parameter the full layers have not); a dense first layer, then experts.
    "mimo-v2-flash": ("mimo_v2_flash", dict(head_dim=16, v_head_dim=32, sliding_window=SLIDING_WINDOW,
                                            n_routed_experts=EXPERTS, moe_intermediate_size=32, n_group=1, topk_group=1,
                                            first_k_dense_replace=1, **_MOE)),
    # Two attentions and two MLPs per layer beside a mixture of experts with zero-computation experts (LongCat-Flash):
    # recognised as its first attention and MLP; the rest no plan names (ModelStructure.unplanned), whole on every tp
    # rank, priced so, and no sequence parallel.
    "longcat-flash": ("longcat_flash", dict(ffn_hidden_size=2 * HIDDEN, expert_ffn_hidden_size=32, n_routed_experts=EXPERTS,
                                            zero_expert_num=2, moe_topk=TOP_K, kv_lora_rank=16, q_lora_rank=32,
                                            qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=16, head_dim=8,
                                            num_key_value_heads=HEADS, num_hidden_layers=2 * LAYERS)),  # 2 per layer
    # Kimi Delta Attention layers (separate q, k, v projections and a convolution over them, a per-channel decay gate,
    # an output gate; Kimi Linear's gates from a low-rank latent, Ling's from the hidden states) beside multi-head
    # latent attention, experts with a shared one after a dense first layer.
    **{family: (model_type, dict(linear_num_heads=HEADS, linear_head_dim=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                 qk_nope_head_dim=8, v_head_dim=16, head_dim=16, num_key_value_heads=HEADS,
                                 num_experts=EXPERTS, moe_intermediate_size=32, num_experts_per_token=TOP_K,
                                 num_shared_experts=1, num_expert_group=1, topk_group=1, first_k_dense_replace=1))
       for family, model_type in (("kimi-linear", "kimi_linear"), ("ling-hybrid", "bailing_hybrid"))},
}
# State-space models alone: a norm and a mixer in each block, no attention, no MLP (Mamba-1's selective scan; Falcon
# Mamba's, its dt, B and C normalised without weights; Mamba-2's heads in 2 groups of B and C, chunks of 4 tokens).
MORE_FAMILIES["mamba"] = ("mamba", dict(state_size=16, time_step_rank=8))
MORE_FAMILIES["falcon-mamba"] = ("falcon_mamba", dict(state_size=16, time_step_rank=8))
MORE_FAMILIES["mamba2"] = ("mamba2", dict(state_size=16, num_heads=8, head_dim=16, n_groups=2, chunk_size=4))
# MiniMax-Text-01's layers: lightning attention (linear, blocks of 4 tokens here: two per sequence, so the state carried
# between blocks acts) beside softmax attention, experts in every layer.
MORE_FAMILIES["minimax"] = ("minimax", dict(head_dim=16, block_size=4, num_local_experts=EXPERTS, **_MOE))
# Families whose decoder layers the recogniser does not read (data and pipeline parallel only, fuse replaces nothing):
# a BERT-style decoder, its query/key/value under attention.self and its output projection and MLP under other parents.
UNREAD_FAMILIES = {
    "bert-generation": ("bert-generation", dict(is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
}
# The same in the models' own layer order (linear layers first, the dense first layer a linear one), Kimi's with as
# many heads as a head's width (8 of 8: its latents' down-projections are then as wide as a per-head projection).
_LINEAR_FIRST = dict(num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"])
MORE_FAMILIES["kimi-linear-first"] = ("kimi_linear", {**MORE_FAMILIES["kimi-linear"][1], **_LINEAR_FIRST,
                                                      "linear_num_heads": 8, "linear_head_dim": 8})
MORE_FAMILIES["ling-hybrid-first"] = ("bailing_hybrid", {**MORE_FAMILIES["ling-hybrid"][1], **_LINEAR_FIRST})


class ContiguousQueryKeyValue(torch.nn.Module):
    """A Llama attention whose q, k and v projections are packed into one `query_key_value` as [q | k | v] (ChatGLM's
    layout under GPT-NeoX's name, which distcore splits per key/value head): it computes what the attention it
    replaces computes (the same weights and attention implementation)."""

    def __init__(self, attention):
        super().__init__()
        q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
        self.query_key_value = torch.nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features, bias=False)
        with torch.no_grad():
            self.query_key_value.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
        self.o_proj = attention.o_proj
        self.config, self.layer_idx, self.is_causal = attention.config, attention.layer_idx, True
        self.head_dim, self.scaling, self.attention_dropout = attention.head_dim, attention.scaling, attention.attention_dropout
        self.num_heads, self.num_key_value_heads = attention.config.num_attention_heads, attention.config.num_key_value_heads
        self.num_key_value_groups = attention.num_key_value_groups

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        batch, seq = hidden_states.shape[:2]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        q, k, v = self.query_key_value(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        out, weights = attend(self, q, k, v, attention_mask, scaling=self.scaling,
                              dropout=self.attention_dropout if self.training else 0.0)
        return self.o_proj(out.reshape(batch, seq, -1)), weights


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers Llama's rotary, which ContiguousQueryKeyValue calls by global name as transformers' attentions
    call theirs (so that kernels.fuse replaces it there too)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary

    return llama_rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def contiguous_query_key_value(model) -> None:
    """Every attention of a transformers Llama replaced by its ContiguousQueryKeyValue."""
    for layer in model.model.layers:
        layer.self_attn = ContiguousQueryKeyValue(layer.self_attn)


@functools.cache
def _head_major_alibi_classes():
    """Bloom's model and attention with its ALiBi biases laid out [heads x batch, 1, s] between them (Bloom's own:
    [batch x heads, 1, s]), the attention putting them back before Bloom's own code: one device computes as Bloom."""
    from transformers.models.bloom import modeling_bloom as bloom

    def swap(alibi, rows):
        return alibi.unflatten(0, (rows, -1)).transpose(0, 1).flatten(0, 1)

    class HeadMajorAlibiModel(bloom.BloomModel):
        def build_alibi_tensor(self, attention_mask, num_heads, dtype):
            return swap(bloom.build_alibi_tensor(attention_mask, num_heads, dtype), attention_mask.shape[0])

    class HeadMajorAlibiAttention(bloom.BloomAttention):
        def forward(self, hidden_states, residual, alibi, *args, **kwargs):
            return super().forward(hidden_states, residual, swap(alibi, alibi.shape[0] // hidden_states.shape[0]),
                                   *args, **kwargs)

    return HeadMajorAlibiModel, HeadMajorAlibiAttention


def head_major_alibi(model) -> None:
    """A transformers Bloom made to pass its ALiBi biases head-major ([heads x batch, 1, s]) to its attention, which
    computes what Bloom computes: code that lays a per-head input out otherwise than the batch-major
    [batch x heads] ShardHeadInput cuts."""
    model_class, attention_class = _head_major_alibi_classes()
    model.transformer.__class__ = model_class
    for block in model.transformer.h:
        block.self_attention.__class__ = attention_class


class ScaledLogitsHead(torch.nn.Linear):
    """Dory's LM head (transformers 5.24) written out: an nn.Linear whose logits are multiplied by a learned
    per-token scale, 1 at initialisation (0.02 times a constant 50, as Dory's initializer_range)."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__(hidden, vocab, bias=False)
        self.logit_scale = torch.nn.Parameter(torch.full((vocab,), 0.02))
        self.logit_scale_factor = 1 / 0.02

    def forward(self, hidden_states):
        return super().forward(hidden_states) * (self.logit_scale * self.logit_scale_factor)


def build(family: str, *, layers: int = LAYERS, seed: int = 0, config: dict | None = None) -> torch.nn.Module:
    """`config`: more settings of a MORE_FAMILIES family's, Llama's or Phi-3's config (dropouts, ...)."""
    import transformers as hf

    if config and family not in MORE_FAMILIES and family not in ("llama", "phi3"):
        raise ValueError(f"build: config settings are taken for MORE_FAMILIES, llama and phi3 only, not {family!r}")

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if family == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**common, **(config or {})))
    if family == "llama-eager":  # transformers' eager attention (explicit matmuls) instead of SDPA
        return hf.LlamaForCausalLM(hf.LlamaConfig(**common, attn_implementation="eager"))
    if family == "llama-tied":  # Llama 3.2-style: the LM head is the embedding's weight
        return hf.LlamaForCausalLM(hf.LlamaConfig(**common, tie_word_embeddings=True))
    if family == "mistral":
        return hf.MistralForCausalLM(hf.MistralConfig(**common, sliding_window=SLIDING_WINDOW))
    if family == "qwen2":
        return hf.Qwen2ForCausalLM(hf.Qwen2Config(**common))
    if family == "qwen3":  # q_norm/k_norm: RMSNorm over head_dim, applied per head
        return hf.Qwen3ForCausalLM(hf.Qwen3Config(**common, head_dim=16))
    if family == "olmo2":  # q_norm/k_norm: RMSNorm over num_heads x head_dim (post-norm blocks)
        return hf.Olmo2ForCausalLM(hf.Olmo2Config(**common))
    if family == "phi3":
        return hf.Phi3ForCausalLM(hf.Phi3Config(**common, **(config or {})))
    if family == "phi3-eager":  # transformers' eager attention (explicit matmuls) instead of SDPA
        return hf.Phi3ForCausalLM(hf.Phi3Config(**common, attn_implementation="eager"))
    if family == "gemma":
        return hf.GemmaForCausalLM(hf.GemmaConfig(**common, head_dim=16))
    if family == "gemma2":  # local (sliding-window) and global layers alternate, its default
        return hf.Gemma2ForCausalLM(hf.Gemma2Config(**common, head_dim=16, sliding_window=SLIDING_WINDOW))
    if family == "granite":  # logits / logits_scaling; the embedding, residual branches and attention scores scaled too
        return hf.GraniteForCausalLM(hf.GraniteConfig(**common, embedding_multiplier=3.0, residual_multiplier=0.5,
                                                      attention_multiplier=0.2, logits_scaling=3.0))
    if family == "cohere":  # logits * logit_scale; LayerNorms, interleaved rotary, attention and MLP in parallel
        return hf.CohereForCausalLM(hf.CohereConfig(**common, logit_scale=0.3))
    if family == "gpt-neox":
        return hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
            num_attention_heads=HEADS, max_position_embeddings=64, rotary_pct=0.5, bos_token_id=0, eos_token_id=1))
    moe = dict(num_experts_per_tok=TOP_K)
    if family == "mixtral":
        return hf.MixtralForCausalLM(hf.MixtralConfig(**{**common, "intermediate_size": 96}, num_local_experts=EXPERTS,
                                                      **moe))
    if family == "mixtral-aux":  # the router's load-balancing loss added to the loss (coefficient raised from 0.001)
        return hf.MixtralForCausalLM(hf.MixtralConfig(**{**common, "intermediate_size": 96}, num_local_experts=EXPERTS,
                                                      output_router_logits=True, router_aux_loss_coef=0.05, **moe))
    if family == "qwen3-moe":
        return hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32,
                                                        num_experts=EXPERTS, mlp_only_layers=[0], **moe))
    if family == "qwen2-moe":
        return hf.Qwen2MoeForCausalLM(hf.Qwen2MoeConfig(**common, moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=48, num_experts=EXPERTS, **moe))
    if family == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=layers, n_head=HEADS,
                                                n_positions=64, bos_token_id=0, eos_token_id=1,
                                                # GPT-2 defaults to dropout 0.1: random masks differ between
                                                # layouts; the other families default to 0
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if family in MORE_FAMILIES or family in UNREAD_FAMILIES:
        model_type, extra = {**MORE_FAMILIES, **UNREAD_FAMILIES}[family]
        settings = hf.AutoConfig.for_model(model_type, **{**common, **extra, **(config or {})})
        alternating = {"qwen3-next": ("layer_types", "linear_attention", "full_attention"),
                       "qwen3.5": ("layer_types", "linear_attention", "full_attention"),
                       "gemma3": ("layer_types", "sliding_attention", "full_attention"),
                       "gemma3-mqa": ("layer_types", "sliding_attention", "full_attention"),
                       "beam": ("mlp_layer_types", "dense", "sparse"),
                       "mimo-v2-flash": ("layer_types", "full_attention", "sliding_attention"),
                       "kimi-linear": ("layer_types", "full_attention", "linear_attention"),
                       "ling-hybrid": ("layer_types", "full_attention", "linear_attention"),
                       "lfm2": ("layer_types", "conv", "full_attention"),
                       "lfm2-moe": ("layer_types", "conv", "full_attention"),
                       "minimax": ("layer_types", "linear_attention", "full_attention")}
        if family in alternating and alternating[family][0] not in (config or {}):  # the kinds alternate, the first first
            attribute, *kinds = alternating[family]
            setattr(settings, attribute, [kinds[i % 2] for i in range(layers)])
        return hf.AutoModelForCausalLM.from_config(settings)
    raise ValueError(f"unknown family {family!r}; choose one of "
                     f"{FAMILIES + MOE_FAMILIES + list(MORE_FAMILIES) + list(UNREAD_FAMILIES)}")


def qwen3_vl(layers: int = LAYERS) -> torch.nn.Module:
    """A tiny Qwen3-VL (its text model of `layers` layers), whose vision tower's deepstack features are added to the
    first two text layers' outputs."""
    import transformers as hf

    torch.manual_seed(0)
    config = hf.Qwen3VLConfig(
        text_config=dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, intermediate_size=2 * HIDDEN, vocab_size=VOCAB, head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=HIDDEN,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]))
    return hf.Qwen3VLForConditionalGeneration(config)
