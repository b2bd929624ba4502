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
from tridist.autotune.cost import LINEAR_ATTENTION_CHUNK, _layer_cost, _layer_timing, _linear_core_flops, all_reduce_time
from tridist.autotune.engine import ENGINES, MEGATRON

from tests.test_cost_terms import COMPUTE_ONLY, INTRA, TINY, _cluster, _ring
from tests.test_moe_cost import TINY_MOE

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
    the MLP's inputs, 4·(2·16 + 16 + 16) = 256. Inside, per token, in bf16: the convolution's input 16, q and k
    normalised at the 2 key heads 2·4, v's copy 8, the chunk's matrix A 4·C, β 4, the gated norm's two tensors 2·8
    and the output projection's input 8: 2·76 = 152; in fp32: the gated norm's three 3·8 and its 1/rms per value
    head 4, the decay's three values per value head 3·4, q's and k's 1/norm per key head 2·2: 4·44 = 176; SwiGLU's
    three ffn tensors 2·3·16 = 96: 4·(152 + 176 + 96) = 1696. No core term: selective recompute keeps it all; full
    keeps the layer's input."""
    outside, inside = 256, 4 * (152 + 176 + 96)
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
    1952 (test_activations_by_hand) and 896 (TINY's attention layer: test_cost_terms.py). The first rank, the
    device's peak, has both micro-batches in flight (4 layer-micro-batches) and their embedding outputs (2 x 4
    tokens x 8 in bf16)."""
    est = estimate(TINY_GDN, _cluster(1, 2), Strategy(dp=1, tp=1, pp=2, num_micro_batches=2), global_batch_size=2)
    assert est.memory.activations == 4 * (1952 + 896) / 2 + 2 * E * 4 * 8
    assert est.memory.weights == E * (794 + 592 + 256)


def test_full_recompute_holds_the_largest_kind_of_layer_whole():
    """Full recompute keeps each layer's input (4 layers x 4 tokens x 8 in bf16) and, while one layer is recomputed,
    its whole set: the linear layer's 1952, larger than an attention layer's 896; with the embedding's output and
    the logits (4 x 32 x 6) on the one rank."""
    est = estimate(TINY_GDN, _cluster(1, 1), Strategy(dp=1, tp=1, pp=1, recompute="full"), global_batch_size=1)
    assert est.memory.activations == 4 * 64 + 1952 + 64 + 4 * 32 * 6


def test_selective_recompute_re_runs_no_linear_core():
    """Without flash attention (transformers' eager attention) selective recompute re-runs the attention layers'
    core and its elementwise work; a Gated DeltaNet layer's compute is the same with and without it."""
    eager = replace(TINY_GDN, flash_attention=False)
    cluster = _cluster(1, 1)
    timing = {rc: _layer_timing(eager, cluster, 1, 1, False, rc, False, False, 1, True) for rc in ("none", "selective")}
    assert timing["selective"].compute == timing["none"].compute
    attention = {rc: _layer_timing(eager, cluster, 1, 1, False, rc, False, False, 1) for rc in ("none", "selective")}
    cost = _layer_cost(eager, cluster, 1, 1, False)
    assert attention["selective"].compute - attention["none"].compute == pytest.approx(
        cost.core_fwd + cost.core_elementwise_fwd)


def test_chunks_of_64_tokens_in_longer_sequences():
    """At 128 tokens the chunk is chunk_gated_delta_rule's 64: per value head 3·64·2 + 2·64·2 + 3·2·2 = 652
    multiply-adds forward and 64·2 + 64·2 + 2·2·2 = 264 recomputed, x 2 FLOPs x 4 value heads."""
    assert _linear_core_flops(replace(TINY_GDN, seq_len=128)) == (8 * 652, 8 * 264)


# TINY_MOE (test_moe_cost.py: layers 1-3 MoE, 4 experts of ffn 8, top-2) with layers 0 and 2 Gated DeltaNet: every kind
# of layer (0 linear and dense, 1 and 3 attention and MoE, 2 linear and MoE), as Qwen3-Next's MoE and linear layers.
#   Layer 0: 794; layers 1, 3: 1008 (test_moe_cost.py); layer 2: the mixer 394, 4 experts of 192, router 32, norms 16:
#   1210. Total 794 + 2·1008 + 1210 + 256 + 256 + 8 = 4540; a token skips 2 experts in each of the 3 MoE layers.
TINY_MOE_GDN = replace(TINY_MOE, gated_delta_net=GDN, name="tiny-moe-gdn")


def test_every_kind_of_layer_in_one_model():
    """Parameters per pipeline rank follow each rank's kinds (pp 2: layers 0, 1 with the embedding; 2, 3 with the head
    and final norm). Under the torch engines with tp 2 and sequence parallel the whole MoE blocks' gradients are
    summed over the tp ranks once per step, in all 3 MoE layers (the linear one among them): an all-reduce of 3 x
    (router 32 + 4 experts of 192) parameters, the only tp term sequence parallel adds."""
    assert TINY_MOE_GDN.num_parameters == 4540 and TINY_MOE_GDN.active_parameters == 4540 - 3 * 2 * 192
    assert [stage_parameters(TINY_MOE_GDN, 1, 2, r) for r in range(2)] == [794 + 1008 + 256, 1210 + 1008 + 256 + 8]
    cluster = replace(_cluster(1, 2), engine=ENGINES["torch+tridist"])
    with_sp, without = (estimate(TINY_MOE_GDN, cluster, Strategy(dp=1, tp=2, pp=1, sequence_parallel=sp),
                                 global_batch_size=1) for sp in (True, False))
    bw, latency = cluster.link(2, 1)
    assert with_sp.time.tp_comm_s - without.time.tp_comm_s == pytest.approx(
        all_reduce_time(E * 3 * (32 + 4 * 192), 2, bw, latency), rel=1e-9)


def test_the_memory_peak_is_found_on_a_middle_rank_of_another_kind():
    """Eight layers on pp 4 (two each), four micro-batches: 1F1B keeps min(m, pp - r) of them on rank r, 4, 3, 2 and 1.
    The two middle ranks hold as many layers, but only the later one (layers 4 and 5) the linear ones, whose
    activations (1952 each) exceed an attention layer's (896): it is the peak (more than the first rank's 4 x 2
    attention layers and embedding outputs), though the earlier middle rank has more micro-batches in flight."""
    spec = replace(TINY_GDN, num_layers=8, gated_delta_net=replace(GDN, layers=(4, 5)))
    est = estimate(spec, _cluster(1, 4), Strategy(dp=1, tp=1, pp=4, num_micro_batches=4), global_batch_size=4)
    first, earlier, later = 4 * 2 * 896 + 4 * 64, 3 * 2 * 896, 2 * 2 * 1952
    assert later > first > earlier and est.memory.activations == later
    assert est.memory.weights == E * 2 * 794


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
