"""The cost model's Gated DeltaNet (linear attention) terms against arithmetic written out in the test (the
conventions of test_cost_terms.py: round device rates, efficiencies of 1, every expected value a sum a reader can
redo, none computed by calling `estimate` for the expectation), and the recognised shapes of transformers' models
against their real parameters."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tridist.autotune import (
    Cluster,
    GatedDeltaNet,
    ModelSpec,
    Strategy,
    activation_bytes_per_layer,
    estimate,
    hardware_flops_per_step,
    model_flops_per_step,
    preset,
    stage_parameters,
)
from tridist.autotune.cost import LINEAR_ATTENTION_CHUNK, _layer_cost
from tridist.autotune.engine import MEGATRON

from tests.test_cost_terms import COMPUTE_ONLY, INTRA, TINY, _cluster, _ring

# TINY (test_cost_terms.py: h 8, 4 heads of 2, 2 kv heads, ffn 16, vocab 32, seq 4) with layers 0 and 2 Gated
# DeltaNet: 2 key heads and 4 value heads, both 2 wide; key width 4, value width 8, convolution channels
# [q | k | v] 4 + 4 + 8 = 16.
#   Mixer: from the hidden size to q, k, v (16), z (8), β and decay (4 + 4): 8·32 = 256; back 8·8 = 64: 320 in
#   matrices (split by tp); the convolution 16·4, a time-step bias and a decay per value head 2·4, the gated
#   norm 2: 74 whole on every rank.
#   A linear layer: 320 + 74 + SwiGLU 384 + norms 16 = 794; an attention layer 592 (test_cost_terms.py).
GDN = GatedDeltaNet(layers=(0, 2), num_k_heads=2, num_v_heads=4, head_k_dim=2, head_v_dim=2, conv_kernel_size=4)
TINY_GDN = replace(TINY, gated_delta_net=GDN, name="tiny-gdn")
E = 2  # bf16 bytes
CHUNK = 4  # chunk_gated_delta_rule's chunk of 64 tokens, cut to TINY's sequence of 4


def test_parameters_by_hand():
    assert GDN.conv_channels == 16 and GDN.matmul_parameters(8) == 320 and GDN.other_parameters == 74
    assert TINY_GDN.num_parameters == 2 * 592 + 2 * 794 + 256 + 256 + 8 == 3292
    assert stage_parameters(TINY_GDN, 1, 1, 0) == 3292
    # tp 2: a linear layer 320/2 + 74 + 384/2 + 16 = 442, an attention layer 576/2 + 16 = 304; embedding and head
    # split, the final norm whole.
    assert stage_parameters(TINY_GDN, 2, 1, 0) == 2 * 442 + 2 * 304 + 128 + 128 + 8
    # pp 2: layers 0 (linear) and 1 (attention) with the embedding; 2 (linear) and 3 with the head and final norm.
    assert [stage_parameters(TINY_GDN, 1, 2, r) for r in range(2)] == [794 + 592 + 256, 794 + 592 + 256 + 8]


def test_flops_by_hand():
    """Per token forward: matmuls 2·(2 attention layers of 576 + 2 linear layers of 320 + 384) = 5120; the
    attention core 4·s·q for the 2 attention layers, 4·4·8·2 = 256; the linear core per value head
    3·C·dk + 2·C·dv + 3·dk·dv = 24 + 16 + 12 = 52 multiply-adds, 2·4·52 = 416 FLOPs per layer; logits 2·32·8 = 512;
    x3 for forward + backward, 4 tokens. Executed besides: flash's Q·Kᵀ again (half the attention core), the linear
    kernels' recomputed states (C·dk + C·dv + 2·dk·dv = 24 per head, 2·4·24 = 192 per layer); full recompute a
    forward of every layer, selective the attention core only."""
    assert LINEAR_ATTENTION_CHUNK == 64 and min(LINEAR_ATTENTION_CHUNK, TINY.seq_len) == CHUNK
    model = 3 * 4 * (5120 + 256 + 2 * 416 + 512)
    assert model_flops_per_step(TINY_GDN, 1) == model
    always = 4 * (256 / 2 + 2 * 192)
    assert hardware_flops_per_step(TINY_GDN, 1) == model + always
    assert hardware_flops_per_step(TINY_GDN, 1, "selective") == model + always + 4 * 256
    assert hardware_flops_per_step(TINY_GDN, 1, "full") == model + always + 4 * (5120 + 256 + 2 * 416)


def test_activations_by_hand():
    """4 tokens, e = 2. Outside the split regions as an attention layer's: the two norms' inputs, the mixer's and
    the MLP's inputs, 4·(2·16 + 16 + 16) = 256. Inside, per token: the convolution's input and output 2·16, q and k
    normalised at the 4 value heads 2·4·2, the chunk's matrix A 4·C, z, the core's and the norm's outputs 3·8, β 4,
    all in bf16: 2·92 = 184; 6 fp32 values per value head 4·6·4 = 96; SwiGLU's three ffn tensors 2·3·16 = 96:
    4·(184 + 96 + 96) = 1504. No core term: selective recompute keeps it all; full keeps the layer's input."""
    outside, inside = 256, 4 * (184 + 96 + 96)
    assert activation_bytes_per_layer(TINY_GDN, 1, linear=True) == outside + inside
    assert activation_bytes_per_layer(TINY_GDN, 1, tp=2, linear=True) == outside + inside / 2
    assert activation_bytes_per_layer(TINY_GDN, 1, tp=2, sequence_parallel=True, linear=True) == (outside + inside) / 2
    assert activation_bytes_per_layer(TINY_GDN, 1, recompute="selective", linear=True) == outside + inside
    assert activation_bytes_per_layer(TINY_GDN, 1, recompute="full", linear=True) == E * 4 * 8
    # The spec's attention layers are priced as before.
    assert activation_bytes_per_layer(TINY_GDN, 1) == activation_bytes_per_layer(TINY, 1)


def test_layer_time_by_hand():
    """FLOP-bound (COMPUTE_ONLY), tp 2: the linear layer's projections 2·4·8·32/2 + 2·4·8·8/2 = 1280 and SwiGLU's
    2·4·8·32/2 + 2·4·16·8/2 = 1536; its core 4 tokens x 416 / 2 at the attention kernel's rate, its backward twice
    that plus the recomputed states (4 x 192 / 2); selective recompute re-runs none of it. Under tp its whole
    parameters' gradients (74 in bf16) are all-reduced over the 2 ranks; no q/k norm or packed q/k/v collective."""
    cluster = _cluster(1, 2, **COMPUTE_ONLY)
    rate = 1e12 * MEGATRON.attention("default")
    cost = _layer_cost(TINY_GDN, cluster, 2, 1, False, False, 1, True)
    assert cost.gemm_fwd == pytest.approx((1280 + 1536) / 1e12)
    assert cost.core_fwd == pytest.approx(4 * 416 / 2 / rate)
    assert cost.core_bwd == pytest.approx(2 * 4 * 416 / 2 / rate + 4 * 192 / 2 / rate)
    assert cost.selective_fwd == 0.0 and cost.core_elementwise_fwd == 0.0
    assert cost.linear_collectives == pytest.approx(_ring("all-reduce", E * 74, 2, INTRA))
    assert cost.qk_norm_collectives == cost.packed_qkv_collectives == cost.latent_collectives == 0.0
    attention = _layer_cost(TINY_GDN, cluster, 2, 1, False)
    assert attention == _layer_cost(TINY, cluster, 2, 1, False)  # the attention layers as in a model without linear ones
    assert attention.linear_collectives == 0.0 and attention.selective_fwd == attention.core_fwd


def test_pipeline_ranks_hold_their_own_kinds_of_layer():
    """pp 2, two micro-batches: each rank holds a linear and an attention layer, priced at their mean activations,
    1760 (test_activations_by_hand) and 896 (TINY's attention layer: test_cost_terms.py). The first rank, the
    device's peak, has both micro-batches in flight (4 layer-micro-batches) and their embedding outputs (2 x 4
    tokens x 8 in bf16)."""
    est = estimate(TINY_GDN, _cluster(1, 2), Strategy(dp=1, tp=1, pp=2, num_micro_batches=2), global_batch_size=2)
    assert est.memory.activations == 4 * (1760 + 896) / 2 + 2 * E * 4 * 8
    assert est.memory.weights == E * (794 + 592 + 256)


def test_linear_layers_are_cheaper_than_attention_at_long_sequences():
    """What linear attention is for: at 32k tokens the same model with attention in every layer spends more time in
    its cores, and the linear layers' core time does not grow with the square of the sequence."""
    spec = preset("qwen3-next-80b-a3b", seq_len=32768)
    attention_everywhere = replace(spec, gated_delta_net=None)
    cluster = Cluster(1, 8, engine="torch+tridist")
    strategy = Strategy(dp=8, tp=1, pp=1, ep=8, sharding_level=3, recompute="full")
    assert (estimate(spec, cluster, strategy, global_batch_size=8).step_time_s
            < estimate(attention_everywhere, cluster, strategy, global_batch_size=8).step_time_s)
    short, long = (_layer_cost(preset("qwen3-next-80b-a3b", seq_len=s), cluster, 1, 1, False, True, 1, True).core_fwd
                   for s in (4096, 32768))
    assert long == pytest.approx(8 * short)


def test_spec_rules():
    with pytest.raises(ValueError, match="num_v_heads=3 must be a multiple of num_k_heads=2"):
        replace(GDN, num_v_heads=3)
    with pytest.raises(ValueError, match="increasing layer indices"):
        replace(GDN, layers=(2, 0))
    with pytest.raises(ValueError, match=r"gated_delta_net.layers must be layer indices in \[0, 4\)"):
        replace(TINY, gated_delta_net=replace(GDN, layers=(0, 4)))
    with pytest.raises(ValueError, match="head_k_dim must be a positive integer"):
        replace(GDN, head_k_dim=0)
    # tp must divide the mixers' head counts (the attention's 4 and 2 heads allow tp 2 here; the key heads do not).
    from tridist.autotune import validate

    odd = replace(TINY, gated_delta_net=replace(GDN, num_k_heads=1))
    reasons = validate(odd, _cluster(1, 2), Strategy(dp=1, tp=2, pp=1), global_batch_size=1)
    assert any("tp=2 does not divide gated_delta_net.num_k_heads=1" in r for r in reasons), reasons


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3-next"])
def test_recognised_shapes_count_the_real_parameters(family):
    """transformers' Qwen3.5 (dense) and Qwen3-Next (MoE) at tiny sizes: the spec read from the model counts its
    parameters exactly (the gated attention's [query | gate] projection and the mixers), but for Qwen3-Next's
    shared experts' one-output gates (a hidden-wide vector per MoE layer, which the cost model leaves out); the
    step is priced."""
    pytest.importorskip("transformers")
    from tests.hf_models import build

    model = build(family, layers=4) if family == "qwen3.5" else build(family)
    spec = ModelSpec.from_module(model, seq_len=16)
    assert spec.attention_output_gate and spec.gated_delta_net is not None
    real = sum(p.numel() for p in model.parameters())
    assert real - spec.num_parameters == spec.num_moe_layers * spec.hidden_size
    assert estimate(spec, Cluster(1, 2), Strategy(dp=1, tp=2, pp=1), global_batch_size=1).step_time_s > 0


def test_the_qwen3_next_preset_is_the_released_model():
    """The preset equals what recognition reads from transformers' Qwen3-Next at its released sizes (its config's
    defaults), built on the meta device."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3NextConfig())
    recognised = ModelSpec.from_module(model, seq_len=4096)
    assert replace(recognised, name="qwen3-next-80b-a3b") == preset("qwen3-next-80b-a3b")
    assert recognised.num_parameters / 1e9 == pytest.approx(79.67, abs=0.01)
