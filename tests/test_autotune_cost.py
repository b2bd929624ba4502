"""The cost model against hand-computed cases: FLOPs, collectives, bubble, model-state memory per
ZeRO stage, activation memory (Korthikanti's 34 + 5as/h and its tp/sp/recompute variants), the
pipeline's in-flight micro-batches, tensor-parallel traffic, and the validity rules' messages.
Memory is also checked against real tensors: model states after an AdamW step, and the activations
a fused layer saves for backward (counted with saved-tensor hooks). Each term of `estimate`'s
breakdowns is pinned against hand arithmetic in test_cost_terms.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tridist.autotune import (
    Cluster,
    InvalidStrategy,
    ModelSpec,
    Strategy,
    activation_bytes_per_layer,
    all_gather_time,
    all_reduce_time,
    estimate,
    hardware_flops_per_step,
    megatron_flops_per_step,
    model_flops_per_step,
    model_state_bytes,
    p2p_time,
    pipeline_bubble_fraction,
    preset,
    reduce_scatter_time,
    validate,
)
from tridist.autotune.cost import OVERLAP_COMPUTE_COST, _in_flight_layers

# A small Megatron-style GPT: GELU MLP of 4h, MHA, dropout, tied embeddings, attention matrix stored.
GPT = ModelSpec(num_layers=8, hidden_size=64, num_heads=4, ffn_hidden_size=256, vocab_size=128, seq_len=32,
                gated_mlp=False, tied_embeddings=True, flash_attention=False, dropout=True, name="tiny-gpt")
# A small Llama: SwiGLU, GQA (4 query heads share 2 kv heads), flash attention, no dropout.
LLAMA = ModelSpec(num_layers=8, hidden_size=64, num_heads=4, ffn_hidden_size=176, vocab_size=128, num_kv_heads=2,
                  seq_len=32, name="tiny-llama")


# ----------------------------------------------------------------------------------------------- FLOPs


def test_flops_hand_computed_gpt():
    spec = ModelSpec(num_layers=2, hidden_size=8, num_heads=2, ffn_hidden_size=32, vocab_size=16, seq_len=4,
                     gated_mlp=False, tied_embeddings=True, flash_attention=False, dropout=True)
    # 72·B·s·L·h²·(1 + s/6h + V/12Lh) = 72·3·4·2·64·(1 + 4/48 + 16/192) = 110592 · 7/6
    assert model_flops_per_step(spec, 3) == pytest.approx(129024, rel=1e-12)


def test_flops_hand_computed_llama_gqa_swiglu():
    spec = ModelSpec(num_layers=2, hidden_size=8, num_heads=4, ffn_hidden_size=12, vocab_size=10, num_kv_heads=2,
                     seq_len=4)
    # per layer: q/o 8x8 each, k/v 8x4 each -> 192 params; SwiGLU 3·8·12 = 288; 480 matmul params.
    # forward per token: L·(2·480 + 4·s·q) + 2·V·h = 2·(960 + 128) + 160 = 2336; ×3 passes ×B·s tokens.
    assert spec.layer_matmul_parameters == 480
    assert model_flops_per_step(spec, 1) == pytest.approx(3 * 4 * 2336, rel=1e-12)


@pytest.mark.parametrize("name", ["megatron-18.4b", "megatron-76.1b", "megatron-1t"])
def test_flops_equal_megatron_formula_on_gpt_shapes(name):
    spec = preset(name)
    b, s, l, h, v = 1024, spec.seq_len, spec.num_layers, spec.hidden_size, spec.vocab_size
    assert model_flops_per_step(spec, b) == pytest.approx(megatron_flops_per_step(b, s, l, h, v), rel=1e-12)
    # Full recompute: Narayanan et al.'s 96 formula (the logits are not recomputed).
    assert hardware_flops_per_step(spec, b, "full") == pytest.approx(
        megatron_flops_per_step(b, s, l, h, v, full_recompute=True), rel=1e-12)


def test_recompute_and_flash_flops():
    base = model_flops_per_step(LLAMA, 4)
    tokens = 4 * LLAMA.seq_len
    core = 4.0 * LLAMA.seq_len * LLAMA.q_size * LLAMA.num_layers
    matmul = 2.0 * LLAMA.layer_matmul_parameters * LLAMA.num_layers
    # flash attention recomputes Q·Kᵀ in backward: half the attention core's forward
    assert hardware_flops_per_step(LLAMA, 4) == pytest.approx(base + tokens * 0.5 * core)
    assert hardware_flops_per_step(LLAMA, 4, "full") == pytest.approx(base + tokens * (matmul + 1.5 * core))
    assert hardware_flops_per_step(GPT, 4, "selective") == pytest.approx(
        model_flops_per_step(GPT, 4) + tokens * 4.0 * GPT.seq_len * GPT.q_size * GPT.num_layers)


# ----------------------------------------------------------------------------------------- collectives


def test_ring_collectives_alpha_beta():
    nbytes, bw, lat = 1e9, 100e9, 1e-5
    assert all_reduce_time(nbytes, 8, bw, lat) == pytest.approx(2 * 7 / 8 * 0.01 + 14e-5)
    assert all_gather_time(nbytes, 8, bw, lat) == pytest.approx(7 / 8 * 0.01 + 7e-5)
    assert reduce_scatter_time(nbytes, 8, bw, lat) == all_gather_time(nbytes, 8, bw, lat)
    # an all-reduce = reduce-scatter + all-gather (sequence parallel moves the same volume)
    assert all_reduce_time(nbytes, 8, bw, lat) == pytest.approx(2 * all_gather_time(nbytes, 8, bw, lat))
    assert all_reduce_time(nbytes, 1, bw, lat) == 0.0 and all_gather_time(nbytes, 1, bw, lat) == 0.0
    assert p2p_time(nbytes, bw, lat) == pytest.approx(lat + 0.01)


def test_cluster_links_intra_vs_inter_node():
    cluster = Cluster(2, 4, "h100-sxm")
    p = cluster.profile
    assert cluster.link(4, 1) == (p.intra_node_bandwidth * p.comm_efficiency, p.intra_node_latency)
    assert cluster.link(8, 1) == (p.inter_node_bandwidth * p.comm_efficiency, p.inter_node_latency)
    assert cluster.link(2, 4) == (p.inter_node_bandwidth * p.comm_efficiency, p.inter_node_latency)  # dp across nodes


def test_tensor_parallel_traffic_counts_and_cross_node_pricing():
    """4 collectives of b·s·h per layer per micro-batch (6 with full recompute), 3 more at the ends, and the
    default engine's vocabulary-parallel fused loss: one chunk of the 64 tokens (vocabulary 128 / 8 rows),
    its statistics all-reduced, 64 fp32 maxima then 3 x 64 fp32 sums."""
    spec = ModelSpec(num_layers=8, hidden_size=64, num_heads=8, ffn_hidden_size=176, vocab_size=128, seq_len=32)
    cluster = Cluster(1, 8, "h100-sxm")
    for recompute, per_layer in (("none", 4), ("full", 6)):
        s = Strategy(dp=1, tp=8, pp=1, micro_batch_size=2, num_micro_batches=3, recompute=recompute)
        est = estimate(spec, cluster, s, global_batch_size=6)
        bw, lat = cluster.link(8, 1)
        one = all_reduce_time(2 * 2 * spec.seq_len * spec.hidden_size, 8, bw, lat)
        statistics = all_reduce_time(4 * 64, 8, bw, lat) + all_reduce_time(12 * 64, 8, bw, lat)
        assert est.time.tp_comm_s == pytest.approx(3 * ((spec.num_layers * per_layer + 3) * one + statistics), rel=1e-12)
    # tp=8 over two 4-device nodes is priced at the inter-node link: 450 vs 50 GB/s for large messages
    s = Strategy(dp=1, tp=8, pp=1, micro_batch_size=2, num_micro_batches=3)
    inside = estimate(preset("llama2-7b"), Cluster(1, 8), s, global_batch_size=6).time.tp_comm_s
    across = estimate(preset("llama2-7b"), Cluster(2, 4), s, global_batch_size=6).time.tp_comm_s
    assert across > 5 * inside


def test_overlap_hides_tensor_parallel_traffic_but_its_first_chunk():
    """Llama-2-7B, tp = 8 with sequence parallel, 2 micro-batches of 4 sequences: 4 collectives of b·s·h
    per layer and 3 at the ends. Overlapped with the GEMMs (chunked tp = 8 ways), a layer's traffic
    still shows its first chunk, plus OVERLAP_COMPUTE_COST per second hidden (the GEMMs it slows);
    the 3 at the ends are not overlapped. Compute is unchanged. (An engine that overlaps: Megatron's.)"""
    cluster = Cluster(1, 8, engine="megatron")
    plain = Strategy(dp=1, tp=8, pp=1, sequence_parallel=True, micro_batch_size=4, num_micro_batches=2)
    overlapped = dataclasses.replace(plain, overlap_tp_comm=True)
    spec = preset("llama2-7b")
    a = estimate(spec, cluster, plain, global_batch_size=8)
    b = estimate(spec, cluster, overlapped, global_batch_size=8)
    one = all_reduce_time(2 * 4 * spec.seq_len * spec.hidden_size, 8, *cluster.link(8, 1))
    layer = 4 * one
    assert a.time.tp_comm_s == pytest.approx(2 * (spec.num_layers * layer + 3 * one), rel=1e-12)
    exposed = layer / 8 + OVERLAP_COMPUTE_COST * layer * 7 / 8
    assert b.time.tp_comm_s == pytest.approx(2 * (spec.num_layers * exposed + 3 * one), rel=1e-12)
    assert b.time.compute_s == a.time.compute_s


# ---------------------------------------------------------------------------------------------- bubble


def test_bubble_fractions():
    assert pipeline_bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert pipeline_bubble_fraction(1, 12) == 0.0
    assert pipeline_bubble_fraction(4, 12, virtual_pp=2) == pytest.approx(3 / 27)


# estimate's bubble from every rank's time: tests/test_pipeline_schedule.py


def test_first_stage_holds_p_micro_batches():
    # 1F1B: rank r holds p − r micro-batches (capped by m); layers per stage 5, p = 4 -> L = 20 layer-batches
    assert _in_flight_layers((5,), 4, 8, 0) == 20
    assert _in_flight_layers((5,), 4, 8, 3) == 5
    assert _in_flight_layers((5,), 4, 2, 0) == 10
    # interleaved (v = 2 chunks of 5 layers): L·(1 + (p − 1)/(p·v)) on the first stage (Korthikanti et al.), L = 40
    assert _in_flight_layers((5, 5), 4, 8, 0) == pytest.approx(40 * (1 + 3 / 8))


# ---------------------------------------------------------------------------------------------- memory


def test_model_state_bytes_per_zero_stage():
    n, dp = 1e9, 8
    assert model_state_bytes(n, dp, 0) == (2e9, 2e9, 12e9)  # 16 bytes per parameter
    assert model_state_bytes(n, dp, 1) == (2e9, 2e9, 1.5e9)
    assert model_state_bytes(n, dp, 2) == (2e9, 0.25e9, 1.5e9)
    assert model_state_bytes(n, dp, 3) == (0.25e9, 0.25e9, 1.5e9)
    assert model_state_bytes(n, dp, 0, dtype_bytes=4) == (4e9, 4e9, 8e9)  # fp32 Adam: no master copy


def test_estimate_model_states_equal_parameter_count():
    spec = preset("llama2-7b")
    est = estimate(spec, Cluster(1, 8), Strategy(dp=8, tp=1, pp=1, sharding_level=1, micro_batch_size=1,
                                                  num_micro_batches=1), global_batch_size=8)
    n = spec.num_parameters
    assert est.memory.weights == pytest.approx(2 * n) and est.memory.gradients == pytest.approx(2 * n)
    assert est.memory.optimizer_states == pytest.approx(12 * n / 8)


def test_korthikanti_activation_formula():
    s, b, h, a = GPT.seq_len, 2, GPT.hidden_size, GPT.num_heads
    full = s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(GPT, b) == pytest.approx(full)
    assert activation_bytes_per_layer(GPT, b, tp=4) == pytest.approx(s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert activation_bytes_per_layer(GPT, b, tp=4, sequence_parallel=True) == pytest.approx(full / 4)
    assert activation_bytes_per_layer(GPT, b, recompute="selective") == pytest.approx(34 * s * b * h)
    assert activation_bytes_per_layer(GPT, b, recompute="full") == pytest.approx(2 * s * b * h)
    assert activation_bytes_per_layer(GPT, b, tp=4, sequence_parallel=True, recompute="full") == pytest.approx(
        2 * s * b * h / 4)


def test_activation_formula_gqa_swiglu_flash():
    s, b, h, q, kv, f, a = LLAMA.seq_len, 1, LLAMA.hidden_size, LLAMA.q_size, LLAMA.kv_size, LLAMA.ffn_hidden_size, 4
    # norms 2·2h, qkv and MLP inputs 2h each; Q, o-input 2q each; K, V 2kv each; SwiGLU 3 x 2f; lse 4 bytes/head
    expected = s * b * (8 * h + 4 * q + 4 * kv + 6 * f) + 4 * a * s * b
    assert activation_bytes_per_layer(LLAMA, b) == pytest.approx(expected)


def test_model_state_bytes_match_real_tensors_after_adamw_step():
    """fp32 AdamW: 4 + 4 + 8 bytes per parameter; mixed precision (bf16 model, fp32 master copy with
    Adam): 2 + 2 + 12. Counted on real tensors of the HF-style model after one step."""
    from tridist.bench.models import build_model

    model = build_model("hf-llama", "tiny")
    n = ModelSpec.from_module(model, seq_len=16).num_parameters
    ids = torch.randint(0, 128, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(ids, labels=ids)[0].backward()
    opt.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    states = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.dim() > 0)
    assert (weights, grads, states) == model_state_bytes(n, 1, 0, dtype_bytes=4)

    model = build_model("hf-llama", "tiny").to(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-3)
    model(ids, labels=ids)[0].backward()
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.float()
    opt.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    states = sum(m.numel() * m.element_size() for m in master)
    states += sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.dim() > 0)
    assert (weights, grads, states) == model_state_bytes(n, 1, 0, dtype_bytes=2)


def test_activation_memory_against_saved_tensors_of_a_fused_layer():
    """Bytes a decoder layer saves for backward (saved-tensor hooks), Paddle-style model with the fused
    kernels and SDPA (flash-like on the CPU): within 25% above the formula; the excess at this tiny
    size is the rotary cos/sin tables and SDPA's own output copy, both O(head_dim) or O(q) terms."""
    from tridist import kernels
    from tridist.bench.models import build_model

    model = build_model("paddle-llama", "tiny", hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    kernels.fuse(model)
    batch, seq = 2, 32
    spec = ModelSpec.from_module(model, seq_len=seq)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = max(storages.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    layer = model.llama.layers[0]
    def enter(*_):
        hooks.__enter__()

    def leave(*_):
        hooks.__exit__(None, None, None)

    pre, post = layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)
    ids = torch.randint(0, 128, (batch, seq))
    model(ids, labels=ids)
    pre.remove(), post.remove()
    measured = sum(storages.values())
    predicted = activation_bytes_per_layer(spec, batch, dtype_bytes=2)
    assert predicted <= measured <= 1.25 * predicted, (measured, predicted)


# ---------------------------------------------------------------------------------------------- rules


def _reasons(strategy: Strategy, spec=LLAMA, cluster=None, batch=16) -> str:
    return " | ".join(validate(spec, cluster or Cluster(1, 8), strategy, global_batch_size=batch))


def test_validity_rules_and_messages():
    ok = Strategy(dp=2, tp=2, pp=2, micro_batch_size=2, num_micro_batches=4)
    assert validate(LLAMA, Cluster(1, 8), ok, global_batch_size=16) == []
    assert "must equal the cluster's 8 devices" in _reasons(Strategy(2, 2, 1, micro_batch_size=4, num_micro_batches=2))
    assert "must equal the global batch size 16" in _reasons(Strategy(2, 2, 2, micro_batch_size=1, num_micro_batches=4))
    # tp above the 2 key/value heads: Megatron-Core refuses (tp must divide them), the torch engines replicate each
    # head over tp / 2 ranks (distcore's ReplicatedColWiseParallel); a tp they do not divide is refused by both.
    above = Strategy(1, 4, 2, micro_batch_size=2, num_micro_batches=8)
    assert "does not divide num_kv_heads=2; pick a tp that divides it (the megatron engine splits them evenly)" in \
        _reasons(above, cluster=Cluster(1, 8, engine="megatron"))
    assert _reasons(above) == ""
    odd = dataclasses.replace(LLAMA, num_heads=6, num_kv_heads=3, head_dim=LLAMA.head_dim)
    assert "tp=2 does not divide num_kv_heads=3; pick a tp that divides it or that it divides" in _reasons(
        Strategy(1, 2, 4, micro_batch_size=2, num_micro_batches=8), spec=odd)
    # pp need not divide the layers (uneven stages: 8 layers on 3 stages are 3, 3, 2), but each stage needs one.
    assert _reasons(Strategy(1, 1, 3, num_micro_batches=3), cluster=Cluster(1, 3), batch=3) == ""
    assert "exceed the 8 layers" in _reasons(Strategy(1, 1, 3, num_micro_batches=6, virtual_pp=3), cluster=Cluster(1, 3), batch=6)
    assert "sequence_parallel needs tp > 1" in _reasons(
        Strategy(8, 1, 1, sequence_parallel=True, micro_batch_size=2, num_micro_batches=1))
    assert "overlap_tp_comm needs sequence_parallel" in _reasons(
        Strategy(4, 2, 1, overlap_tp_comm=True, micro_batch_size=4, num_micro_batches=1))
    assert "needs dp > 1" in _reasons(Strategy(1, 2, 4, sharding_level=1, micro_batch_size=4, num_micro_batches=4))
    assert "flash attention already does" in _reasons(
        Strategy(8, 1, 1, recompute="selective", micro_batch_size=2, num_micro_batches=1))
    assert "recompute must be one of" in _reasons(
        Strategy(8, 1, 1, recompute="some", micro_batch_size=2, num_micro_batches=1))
    assert "at least one micro-batch per stage" in _reasons(Strategy(2, 1, 4, micro_batch_size=4, num_micro_batches=2))
    assert "virtual_pp > 1 (interleaved schedule) needs pp > 1" in _reasons(
        Strategy(8, 1, 1, micro_batch_size=2, num_micro_batches=1, virtual_pp=2))
    assert "multiple of pp (2)" in _reasons(Strategy(2, 2, 2, micro_batch_size=1, num_micro_batches=3, virtual_pp=2),
                                            batch=6)
    assert "positive integer" in _reasons(Strategy(0, 8, 1))


def test_estimate_rejects_invalid_strategy_with_all_reasons():
    with pytest.raises(InvalidStrategy) as info:
        estimate(LLAMA, Cluster(1, 8), Strategy(dp=3, tp=3, pp=1), global_batch_size=4)
    assert len(info.value.reasons) >= 3 and "num_heads=4" in str(info.value)


def test_memory_fits_flag_and_breakdown_keys():
    """Llama-2-70B replicated on 8 H100s: 16 bytes per parameter of model states alone exceed the
    usable 0.9 x 80 GB. The flat breakdown reports the same numbers under its documented keys."""
    spec = preset("llama2-70b")
    est = estimate(spec, Cluster(1, 8), Strategy(dp=8, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1),
                   global_batch_size=8)
    n = spec.num_parameters
    assert (est.memory.weights, est.memory.gradients, est.memory.optimizer_states) == (2 * n, 2 * n, 12 * n)
    assert est.capacity_bytes == pytest.approx(0.9 * 80e9) and 16 * n > est.capacity_bytes
    assert not est.fits
    b = est.breakdown()
    assert (b["weights_bytes"], b["optimizer_states_bytes"], b["buffers_bytes"]) == (
        est.memory.weights, est.memory.optimizer_states, est.memory.buffers)
    assert (b["compute_s"], b["dp_comm_s"], b["optimizer_s"]) == (
        est.time.compute_s, est.time.dp_comm_s, est.time.optimizer_s)
    # MFU = model FLOPs / (step time x devices x the H100's 989.4 TFLOP/s bf16 peak)
    assert b["mfu"] == pytest.approx(model_flops_per_step(spec, 8) / (est.step_time_s * 8 * 989.4e12), rel=1e-12)
    assert b["tokens_per_s"] == pytest.approx(8 * spec.seq_len / est.step_time_s, rel=1e-12)


def test_frozen_parameters_take_no_gradients_optimizer_states_or_weight_gradient_gemms():
    """peft's LoRA: 1% of Llama 3 70B's parameters train (ModelSpec.trainable_fraction). The weights and ZeRO-3's
    gathers of them stay; the gradients, optimizer states, the gradients' reduce-scatter and the optimizer step are
    1% of a full training's; the backward's GEMMs take the input's gradient and 1% of the weights' (the layers'
    compute drops by about a third of their GEMM time, 3 passes -> 2.01)."""
    full = preset("llama3-70b")
    lora = dataclasses.replace(full, trainable_fraction=0.01)
    cluster = Cluster(2, 8, "h100-sxm")
    s = Strategy(dp=2, tp=8, pp=1, sharding_level=3, micro_batch_size=1, num_micro_batches=2)
    a, b = (estimate(spec, cluster, s, global_batch_size=4) for spec in (full, lora))
    assert b.memory.weights == a.memory.weights
    assert b.memory.gradients == pytest.approx(0.01 * a.memory.gradients)
    assert b.memory.optimizer_states == pytest.approx(0.01 * a.memory.optimizer_states)
    assert b.memory.activations == a.memory.activations
    assert b.time.optimizer_s == pytest.approx(0.01 * a.time.optimizer_s)
    assert 0.6 < b.time.compute_s / a.time.compute_s < 0.8, (b.time.compute_s, a.time.compute_s)
    assert b.time.dp_comm_s < a.time.dp_comm_s  # the weights' gathers stay, the gradients' scatter shrinks
    # At ZeRO-0 the data-parallel traffic is the gradients' all-reduce alone: 1% of the bytes (plus the latency terms)
    plain = dataclasses.replace(s, sharding_level=0)
    a0, b0 = (estimate(spec, cluster, plain, global_batch_size=4) for spec in (full, lora))
    assert 0 < b0.time.dp_comm_s < 0.02 * a0.time.dp_comm_s, (b0.time.dp_comm_s, a0.time.dp_comm_s)
    assert "1.00% of them trained" in lora.describe() and "trained" not in full.describe()
    for bad in (0, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="trainable_fraction must be a share of the parameters in"):
            dataclasses.replace(full, trainable_fraction=bad)


def test_the_trained_share_is_read_from_the_model():
    """from_module reads requires_grad: a model with its MLPs frozen trains the rest's share; peft's LoRA adapters on
    a tiny Llama theirs; a model training everything 1.0."""
    peft = pytest.importorskip("peft")
    from tests.hf_models import build

    model = build("llama")
    assert ModelSpec.from_module(model).trainable_fraction == 1.0
    for name, param in model.named_parameters():
        param.requires_grad_(".mlp." not in name)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ModelSpec.from_module(model).trainable_fraction == pytest.approx(trained / total, abs=1e-6)
    lora = peft.get_peft_model(build("llama"), peft.LoraConfig(r=4, target_modules="all-linear"))
    adapters = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)
    spec = ModelSpec.from_module(lora)
    assert spec.trainable_fraction == pytest.approx(adapters / sum(p.numel() for p in lora.parameters()), abs=1e-6)
    assert spec.trainable_fraction < 0.2
