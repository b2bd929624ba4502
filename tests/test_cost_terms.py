"""Each term of `estimate`'s time and memory breakdowns against arithmetic written out in the test.

The model is small enough to count by hand and the devices have round rates with efficiencies of 1,
so every expected value below is a sum a reader can redo. Three device regimes isolate the terms:
SLOW_COMPUTE (matmuls at 1 MFLOP/s, free memory traffic) makes every overlap window far longer than
the communication it hides, so what stays exposed is the documented first chunk exactly;
COMPUTE_ONLY (free memory traffic) makes step time a pure FLOP count; MEMORY_BOUND (free FLOPs) a
pure byte count. None of the expected values calls `estimate` (the search tests compare the search
with a brute force over the same `estimate`, where a formula error cancels out).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tridist.autotune import (
    Cluster,
    DeviceProfile,
    InvalidStrategy,
    ModelSpec,
    Strategy,
    activation_bytes_per_layer,
    balanced_layout,
    balanced_stage_layers,
    check,
    estimate,
    hardware_flops_per_step,
    model_flops_per_step,
    rank_layers,
    stage_layers,
    stage_parameters,
)
from tridist.autotune.cost import OVERLAP_COMPUTE_COST
from tridist.autotune.engine import MEGATRON, TORCH

# The hand counts below use the Megatron engine: no dispatch floor, no FSDP2 buffer copies (the torch
# engine's terms are counted in test_autotune_engine.py).
ELEMENTWISE_FWD_TRAFFIC = MEGATRON.elementwise_traffic
FLASH_ATTENTION_RELATIVE_EFFICIENCY = MEGATRON.attention("default")

# Llama-like (SwiGLU, GQA, flash attention, no dropout, untied head), counted by hand:
#   head_dim 8/4 = 2, q = 4·2 = 8, kv = 2·2 = 4
#   per layer: attention h·(2q + 2kv) = 8·24 = 192 and SwiGLU 3·h·f = 3·8·16 = 384: 576 in matrices
#   (split by tp), 2h = 16 in the two norms (replicated): 592; embedding (and untied head) V·h = 256;
#   final norm h = 8.
TINY = ModelSpec(num_layers=4, hidden_size=8, num_heads=4, num_kv_heads=2, ffn_hidden_size=16, vocab_size=32,
                 seq_len=4, name="tiny")
# GPT-like: the same sizes with a GELU MLP, dropout, the attention matrix stored, a tied head.
TINY_GPT = replace(TINY, num_kv_heads=4, gated_mlp=False, flash_attention=False, dropout=True, tied_embeddings=True,
                   name="tiny-gpt")
E = 2  # bf16 bytes
RC = OVERLAP_COMPUTE_COST  # compute lost per second of hidden communication


def _cluster(nodes, per_node, *, flops=1e12, hbm=1e12, hbm_efficiency=1.0, matmul_efficiency=1.0):
    """Round rates: intra-node links 100 GB/s with 1 µs per ring step, inter-node 10 GB/s with 3 µs."""
    device = DeviceProfile(name="round", peak_bf16_flops=flops, peak_fp32_flops=flops, memory_bytes=1e15,
                           hbm_bandwidth=hbm, intra_node_bandwidth=100e9, inter_node_bandwidth=10e9,
                           intra_node_latency=1e-6, inter_node_latency=3e-6, matmul_efficiency=matmul_efficiency,
                           hbm_efficiency=hbm_efficiency, comm_efficiency=1.0)
    return Cluster(nodes, per_node, device, engine="megatron")


INTRA, INTER = (100e9, 1e-6), (10e9, 3e-6)
SLOW_COMPUTE = {"flops": 1e6, "hbm": 1e30}
COMPUTE_ONLY = {"flops": 1e12, "hbm": 1e30}
MEMORY_BOUND = {"flops": 1e30, "hbm": 1e12}


def _run(spec, cluster, **strategy):
    s = Strategy(**strategy)
    return estimate(spec, cluster, s, global_batch_size=s.global_batch_size)


def _exposed_share(parts):
    """Overlapped communication adds its first of `parts` chunks (nothing to hide behind) plus RC per
    second of the rest (the compute it slows down), when the compute window is long enough."""
    return 1 / parts + RC * (1 - 1 / parts)


def _ring(kind, nbytes, n, link):
    """Ring all-reduce 2(n−1)/n·bytes/bw + 2(n−1)·α; all-gather / reduce-scatter half of it."""
    bandwidth, latency = link
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    return steps / n * nbytes / bandwidth + steps * latency


# ------------------------------------------------------------------------------------ parameters


def test_stage_parameters_by_hand_norms_replicated_and_tied_head_on_both_ends():
    assert TINY.num_parameters == 4 * 592 + 256 + 256 + 8 == 2888
    assert stage_parameters(TINY, 1, 1, 0) == 2888
    tied = replace(TINY, tied_embeddings=True)
    assert stage_parameters(tied, 1, 1, 0) == 4 * 592 + 256 + 8  # one matrix serves both ends
    # pp = 2, tp = 2: two layers per stage, 2·(576/2 + 16) = 608; the vocabulary split by tp: 128.
    # A tied head whose two ends are on different stages is a second copy on the last stage.
    for spec in (TINY, tied):
        assert stage_parameters(spec, 2, 2, 0) == 608 + 128
        assert stage_parameters(spec, 2, 2, 1) == 608 + 8 + 128


def test_a_task_head_is_priced_at_its_own_width_not_the_vocabularys():
    """A classifier's head (3 labels) instead of an LM head: its weight is 3 x hidden, its logits 3 per token, so
    the step computes and holds less (it was priced as an LM head: [tokens, vocab] logits)."""
    classifier = replace(TINY, head_outputs=3)
    assert classifier.head_width == 3 and TINY.head_width == TINY.vocab_size
    assert classifier.num_parameters == TINY.num_parameters - (32 - 3) * 8
    assert stage_parameters(classifier, 1, 1, 0) == classifier.num_parameters
    lm, task = (_run(spec, _cluster(1, 2, **COMPUTE_ONLY), dp=2, tp=1, pp=1, micro_batch_size=2) for spec in (TINY, classifier))
    assert task.model_flops_per_step < lm.model_flops_per_step and task.step_time_s < lm.step_time_s
    # the loss's logits, [tokens, head width] in the compute dtype and fp32, are the only activations that differ
    tokens, e = 2 * TINY.seq_len, _cluster(1, 2).dtype_bytes
    assert lm.memory.activations - task.memory.activations == pytest.approx(tokens * (32 - 3) * (e + 4))


def test_uneven_pipeline_stages_hold_fewer_layers_at_the_ends():
    """A pp that does not divide the layers: the middle stages take a layer more (Llama 3 405B's 126
    layers on 16 stages: 7, 8 x 14, 7), extra layers beyond them go to the first stage, then the last."""
    assert stage_layers(126, 16) == (7,) + (8,) * 14 + (7,)
    assert stage_layers(6, 4) == (1, 2, 2, 1) and stage_layers(5, 2) == (3, 2) and stage_layers(8, 4) == (2,) * 4
    assert rank_layers(8, 2, 2) == (4, 4) and rank_layers(6, 4) == (1, 2, 2, 1)
    with pytest.raises(ValueError, match="cannot fill"):
        stage_layers(3, 4)
    # TINY's 4 layers on pp 3 (1, 2, 1) and tp 1: the middle rank holds two layers and nothing else.
    assert [stage_parameters(TINY, 1, 3, r) for r in range(3)] == [592 + 256, 2 * 592, 592 + 8 + 256]


def _compositions(n, k):
    """Every way to cut n layers into k contiguous stages of one at least."""
    if k == 1:
        yield (n,)
        return
    for first in range(1, n - k + 2):
        for rest in _compositions(n - first, k - 1):
            yield (first, *rest)


def _stage_costs(sizes, costs, first, last):
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [sum(costs[a:a + n]) + (first if i == 0 else 0) + (last if i == len(sizes) - 1 else 0)
            for i, (a, n) in enumerate(zip(starts, sizes))]


def test_balanced_stages_are_the_least_slowest_stage_of_every_split():
    """balanced_stage_layers against every split of up to 9 layers into up to 4 stages, random integer costs (exact
    in floating point) and end costs: the slowest stage is the least any split reaches; of the splits that reach it,
    the even one where it is among them, else one with the least sum of squares."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, min(4, n))
        costs = [rng.randint(0, 9) for _ in range(n)]
        first, last = rng.choice([0, 2, 5]), rng.choice([0, 3, 20])
        layout = balanced_stage_layers(costs, k, first=first, last=last)
        splits = {sizes: _stage_costs(sizes, costs, first, last) for sizes in _compositions(n, k)}
        least = min(max(c) for c in splits.values())
        assert sum(layout) == n and len(layout) == k and min(layout) >= 1
        assert max(splits[layout]) == least, (costs, k, first, last, layout)
        even = stage_layers(n, k)
        if max(splits[even]) == least:
            assert layout == even
        else:
            assert sum(c * c for c in splits[layout]) == min(sum(c * c for c in v) for v in splits.values()
                                                             if max(v) == least)


def test_balanced_stages_move_layers_off_a_heavy_head():
    """Equal layers and a head lighter than one: the even layout (Llama 3 405B's 7, 8 x 14, 7). A head of 7
    layers (Gemma 2 2B's vocabulary against its width) on 26 layers and 4 stages: (8, 8, 8, 2), whose slowest stage
    costs 9 layers where the even (6, 7, 7, 6) has 6 + 7 = 13 on the last."""
    assert balanced_stage_layers([1.0] * 126, 16, first=0.01, last=0.65) == stage_layers(126, 16)
    assert balanced_stage_layers([1.0] * 26, 4, last=7.0) == (8, 8, 8, 2)
    assert balanced_stage_layers([1.0] * 8, 4) == (2, 2, 2, 2)
    with pytest.raises(ValueError, match="cannot fill"):
        balanced_stage_layers([1.0] * 3, 4)
    with pytest.raises(ValueError, match="finite and non-negative"):
        balanced_stage_layers([1.0, -1.0], 1)
    with pytest.raises(ValueError, match="finite and non-negative"):
        balanced_stage_layers([float("nan"), 1.0, 1.0], 2)
    # ties are relative to the costs' scale: microseconds balance as seconds do
    assert balanced_stage_layers([1e-10, 1e-10, 1e-10, 5e-10], 2) == balanced_stage_layers([1, 1, 1, 5], 2) == (3, 1)
    with pytest.raises(ValueError, match="must list 2 positive layer counts adding up to 4"):
        rank_layers(4, 2, 1, (1, 1, 2))


def test_balanced_layout_weighs_each_layer_kind_and_the_head():
    """TINY's layers: 2·576 matmul FLOPs per token and 2·4·(8 + 8) = 128 of attention core, 1280 in all; its head
    2·32·8 = 512. A vocabulary of 8·32 (head 4096, 3.2 layers) on 4 layers and 2 stages: (3, 1) (3 x 1280 against
    1280 + 4096) where the even (2, 2) has a last stage of 6656. An MoE layer of 2 active experts of width 16
    (matmuls 2·(192 + 2·384 + 8·4 router)) beside dense ones weighs more."""
    from tridist.autotune.cost import layer_forward_flops

    assert layer_forward_flops(TINY) == (1280.0,) * 4
    assert balanced_layout(TINY, 2) is None and balanced_layout(TINY, 4) is None
    wide = replace(TINY, vocab_size=8 * 32)
    assert balanced_layout(wide, 2) == (3, 1)
    moe = replace(TINY, num_layers=6, num_experts=4, experts_per_token=2, expert_ffn_hidden_size=16,
                  moe_layers=(2, 3, 4, 5))
    flops = layer_forward_flops(moe)
    assert flops[:2] == (1280.0,) * 2 and flops[2] == flops[5] == 2 * (192 + 2 * 384 + 8 * 4) + 128
    assert balanced_layout(moe, 2) == (4, 2)  # 2 x 1280 + 2 x 2112 = 6784 against 2 x 2112 + 512 = 4736
    assert estimate(wide, Cluster(1, 2, engine="megatron"), Strategy(1, 1, 2, num_micro_batches=4, layers_per_stage=(3, 1)),
                    global_batch_size=4).time.compute_s < \
        estimate(wide, Cluster(1, 2, engine="megatron"), Strategy(1, 1, 2, num_micro_batches=4),
                 global_batch_size=4).time.compute_s
    # the layers each rank holds: 3 layers and the embedding, 1 layer with the final norm and the head
    assert [stage_parameters(wide, 1, 2, r, layers_per_stage=(3, 1)) for r in range(2)] == \
        [3 * 592 + 256 * 8, 592 + 8 + 256 * 8]


def test_interleaved_ranks_hold_each_warm_up_forwards_own_chunk():
    """Interleaved 1F1B's warm-up on rank r runs 2(p - r - 1) + (v - 1)p + 1 forwards, the k-th on chunk (k // p) mod v:
    with chunks of 3, 3, 3 and 1 layers (a balanced layout's last rank, pp 4 x 4 virtual stages, 16 micro-batches)
    the last rank's 13 forwards hold 4 x 3 + 4 x 3 + 4 x 3 + 1 x 1 = 37 layer-micro-batches, not the mean's
    13 x 10 / 4 = 32.5; even chunks give the mean (the even layout's count, as before)."""
    from tridist.autotune.cost import _in_flight_layers

    assert _in_flight_layers((3, 3, 3, 1), 4, 16, 3) == 37
    assert _in_flight_layers((3, 3, 3, 3), 4, 16, 0) == 19 * 12 / 4
    assert _in_flight_layers((5,), 4, 16, 1) == 5 * 3  # no interleaving: p - r micro-batches of the rank's layers
    # two middle ranks with the same layers in other chunks hold other amounts: both are priced, not the earlier alone
    from tridist.autotune.cost import _peak_ranks

    same = ((1,), (2,), (2,), (1,))
    assert _peak_ranks(same) == [0, 1, 3] and _peak_ranks(same, ((1,), (1, 1), (2, 0), (1,))) == [0, 1, 2, 3]


def test_a_strategys_stage_layout_is_checked_and_round_trips():
    cluster = Cluster(1, 2, engine="megatron")
    good = Strategy(1, 1, 2, num_micro_batches=4, layers_per_stage=(3, 1))
    check(TINY, cluster, good, global_batch_size=4)
    assert Strategy.from_dict(good.to_dict() | {"layers_per_stage": [3, 1]}) == good
    assert good.describe().startswith("dp1 tp1 pp2[3,1] ")
    for bad, words in (((2, 1), "must list pp\\*virtual_pp = 2 positive"), ((4, 0), "positive"),
                       ((1, 1, 1, 1), "must list")):
        with pytest.raises(InvalidStrategy, match=words):
            check(TINY, cluster, replace(good, layers_per_stage=bad), global_batch_size=4)
    with pytest.raises(InvalidStrategy, match="needs pp > 1"):
        check(TINY, Cluster(1, 1, engine="megatron"), Strategy(1, 1, 1, num_micro_batches=4, layers_per_stage=(4,)),
              global_batch_size=4)


def test_the_slowest_pipeline_rank_sets_the_pace():
    """Six layers on pp 4 (1, 2, 2, 1) cost what the fuller of a 2-layer middle rank and the 1-layer last
    rank with the LM head costs: between 6 layers on pp 6 (one layer each) and on pp 3 (two each)."""
    six = replace(TINY, num_layers=6)
    cluster = lambda n: Cluster(1, n, engine="megatron")  # noqa: E731

    def step(pp):
        strategy = Strategy(dp=1, tp=1, pp=pp, micro_batch_size=1, num_micro_batches=12)
        return estimate(six, cluster(pp), strategy, global_batch_size=12).time.compute_s

    assert step(6) < step(4) <= step(3) * (1 + 1e-12)


# ------------------------------------------------------------------------------ data parallel


# Two layouts: A keeps the dp group inside a node (stride 1, 8 devices per node), with two pipeline
# stages whose larger one (the last: 2·592 + 8 + 256 = 1448 parameters, vs 1440 on the first) sets
# the traffic; B puts tp innermost so the two dp ranks are 2 apart and, with 2 devices per node, on
# different nodes: 4·(576/2 + 16) + 256/2 + 8 + 256/2 = 1480 parameters.
DP_LAYOUTS = {
    "A-intra-pp2": (_cluster(1, 8, **SLOW_COMPUTE), dict(dp=4, tp=1, pp=2, num_micro_batches=3), 1448, INTRA, 2),
    "B-inter-tp2": (_cluster(2, 2, **SLOW_COMPUTE), dict(dp=2, tp=2, pp=1, num_micro_batches=2), 1480, INTER, 4),
}


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("layout", DP_LAYOUTS)
def test_dp_communication_per_sharding_level_and_micro_batch(layout, level):
    cluster, strategy, params, link, layers = DP_LAYOUTS[layout]
    est = _run(TINY, cluster, sharding_level=level, **strategy)
    dp, m = strategy["dp"], strategy["num_micro_batches"]
    nbytes = E * params  # bf16 gradients / weights of the device
    all_reduce = _ring("all-reduce", nbytes, dp, link)
    gather = scatter = _ring("all-gather", nbytes, dp, link)
    # Each collective overlaps a stage's backward (or forward) pass of `layers` layers; the last
    # layer's share (the first gather's) cannot be hidden.
    expected = {
        0: all_reduce,  # once per step, after the last micro-batch
        1: scatter + gather,  # reduce-scatter the gradients, all-gather the updated weights
        2: m * scatter + gather,  # gradients cannot accumulate unsharded: reduce-scatter per micro-batch
        3: m * (gather + gather + scatter),  # weights gathered for forward and backward, per micro-batch
    }[level]
    assert est.time.dp_comm_s == pytest.approx(expected * _exposed_share(layers), rel=1e-12)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_optimizer_step_is_divided_by_dp_under_zero(level):
    # Layout A (1448 parameters on the busiest device), HBM at 1 TB/s of which half is reached:
    # Adam reads and writes 28 bytes per parameter; ZeRO 1-3 update 1/dp of them on each device.
    cluster = _cluster(1, 8, hbm=1e12, hbm_efficiency=0.5)
    est = _run(TINY, cluster, dp=4, tp=1, pp=2, num_micro_batches=3, sharding_level=level)
    shard = 4 if level else 1
    assert est.time.optimizer_s == pytest.approx(28 * 1448 / shard / 0.5e12, rel=1e-12)


# ---------------------------------------------------------------------------- tensor parallel


def test_tensor_parallel_volume_sequence_parallel_and_the_overlaps_exposed_chunk():
    """tp = 2 (4 collectives of b·s·h per layer per micro-batch, 6 with full recompute, 3 at the ends):
    b·s·h = 1·4·8 elements = 64 bytes, all-reduced over 2 intra-node ranks. Sequence parallel moves
    the same volume (all-gather + reduce-scatter); overlapping it with the GEMMs (split into tp = 2
    chunks) leaves the first chunk exposed, not nothing."""
    cluster = _cluster(1, 8, **SLOW_COMPUTE)
    one = _ring("all-reduce", 64, 2, INTRA)
    m, layers, ends = 2, 4, 3
    base = dict(dp=4, tp=2, pp=1, num_micro_batches=m)
    for recompute, per_layer in (("none", 4), ("full", 6)):
        plain = _run(TINY, cluster, recompute=recompute, **base).time.tp_comm_s
        sp = _run(TINY, cluster, recompute=recompute, sequence_parallel=True, **base).time.tp_comm_s
        overlapped = _run(TINY, cluster, recompute=recompute, sequence_parallel=True, overlap_tp_comm=True,
                          **base).time.tp_comm_s
        assert plain == sp == pytest.approx(m * (layers * per_layer + ends) * one, rel=1e-12)
        assert overlapped == pytest.approx(m * (layers * per_layer * one * _exposed_share(2) + ends * one), rel=1e-12)
    # With no compute to hide behind (free FLOPs and memory), overlapping saves nothing.
    free = _cluster(1, 8, flops=1e30, hbm=1e30)
    plain = _run(TINY, free, sequence_parallel=True, **base).time.tp_comm_s
    overlapped = _run(TINY, free, sequence_parallel=True, overlap_tp_comm=True, **base).time.tp_comm_s
    assert overlapped == pytest.approx(plain, rel=1e-9)


# -------------------------------------------------------------------------------------- pipeline


@pytest.mark.parametrize("nodes, link", [(1, INTRA), (2, INTER)])
@pytest.mark.parametrize("v", [1, 2])
def test_pipeline_p2p_per_schedule_slot_and_link(v, nodes, link):
    """1F1B over pp = 2 stages with m = 4 micro-batches (v chunks per stage when interleaved): v·m + p − 1
    slots on the critical path, each sending an activation forward and a gradient backward. A message is
    b·s·h = 64 bytes, split by tp = 2 under sequence parallel: 32. Ranks are tp-fastest, then dp, then
    pp, so neighbouring stages are tp·dp = 2 ranks apart: within a 4-device node, across 2-device nodes."""
    cluster = _cluster(nodes, 4 // nodes, **SLOW_COMPUTE)
    est = _run(TINY, cluster, dp=1, tp=2, pp=2, num_micro_batches=4, virtual_pp=v, sequence_parallel=True)
    bandwidth, latency = link
    assert est.time.pp_comm_s == pytest.approx(2 * (v * 4 + 2 - 1) * (latency + 32 / bandwidth), rel=1e-12)
    # The bubble, interleaved: (p − 1)/v of the slowest rank's (micro-batch) time, (p − 1)/(v·m) of the ideal step.
    # Without: the other rank's time (a flow shop), the whole model's on one rank (pp = 1, the same tp link) less
    # the slowest rank's (the last: its LM head outweighs the first rank's embedding).
    ideal = est.time.compute_s + est.time.tp_comm_s
    if v == 2:
        assert est.time.bubble_s == pytest.approx(ideal * (2 - 1) / (v * 4), rel=1e-12)
    else:
        whole = _run(TINY, _cluster(1, 2, **SLOW_COMPUTE), dp=1, tp=2, pp=1, num_micro_batches=4,
                     sequence_parallel=True).time
        assert est.time.bubble_s == pytest.approx((whole.compute_s + whole.tp_comm_s - ideal) / 4, rel=1e-12)
        assert est.time.bubble_s < ideal / 4


# ------------------------------------------------------------------------------------------ memory

# Activations per layer of one micro-batch of one sequence (T = b·s = 4 tokens), TINY, 2-byte values:
#   outside the tp regions: two norm inputs, the qkv input, the MLP input: 4·E·h = 64 bytes per token
#   inside: Q and the output projection's input (2·E·q = 32), K and V (2·E·kv = 16), SwiGLU's gate, up
#           and product (3·E·f = 96): 144 bytes per token
#   attention core (flash): an fp32 log-sum-exp per head: 4·4 = 16 bytes per token
ACTIVATION_PER_TOKEN = 64 + 144 + 16  # 224
LAYER_ACTIVATIONS = 4 * ACTIVATION_PER_TOKEN  # 896 bytes
EMBEDDING_OUTPUT = 4 * 8 * E  # T·h·E = 64 bytes: the first stage's input per micro-batch in flight
P2P = 64  # the activation (and its gradient) crossing a stage boundary


def _logits(vocab):
    return 4 * vocab * (E + 4)  # T·V values, bf16 plus the fp32 copy for the cross entropy


def test_activation_bytes_per_layer_by_hand():
    assert activation_bytes_per_layer(TINY, 1) == LAYER_ACTIVATIONS
    # tp = 2 splits the inside and the core; sequence parallel also the outside
    assert activation_bytes_per_layer(TINY, 1, tp=2) == 4 * (64 + (144 + 16) / 2)
    assert activation_bytes_per_layer(TINY, 1, tp=2, sequence_parallel=True) == LAYER_ACTIVATIONS / 2
    # full recompute keeps the layer input only: T·h·E = 64 (/tp under sequence parallel)
    assert activation_bytes_per_layer(TINY, 1, recompute="full") == 64
    assert activation_bytes_per_layer(TINY, 1, tp=2, sequence_parallel=True, recompute="full") == 32


def _states(params):
    return (E * params, E * params, 12 * params)  # bf16 weights and gradients, fp32 master + Adam m, v


def test_memory_first_stage_holds_p_micro_batches_and_the_embedding_outputs():
    """pp = 2, m = 4, no dp: stage 0 holds min(m, p − 0) = 2 micro-batches of its 2 layers and 2
    embedding outputs; stage 1 holds 1 micro-batch and one micro-batch of logits (4·32·6 = 768)."""
    est = _run(TINY, _cluster(1, 2), dp=1, tp=1, pp=2, num_micro_batches=4)
    first = 2 * 2 * LAYER_ACTIVATIONS + 2 * EMBEDDING_OUTPUT  # 3712
    last = 2 * 1 * LAYER_ACTIVATIONS + _logits(32)  # 2560
    buffers = 2 * P2P  # a send and a receive buffer (no dp: no gradient buckets)
    # stage 0: 2·592 + 256 = 1440 parameters; stage 1: 2·592 + 8 + 256 = 1448
    assert 16 * 1440 + first + buffers > 16 * 1448 + last + buffers  # the first stage is the peak
    m = est.memory
    assert (m.weights, m.gradients, m.optimizer_states) == _states(1440)
    assert (m.activations, m.buffers) == (first, buffers)


@pytest.mark.parametrize("tied", [False, True])
def test_memory_last_stage_logits_and_tied_head_copy(tied):
    """A large vocabulary (512): the last stage's logits (4·512·6 = 12288 bytes) make it the peak; its
    head (512·8 = 4096) is there whether or not it is tied to the first stage's embedding."""
    spec = replace(TINY, vocab_size=512, tied_embeddings=tied)
    est = _run(spec, _cluster(1, 2), dp=1, tp=1, pp=2, num_micro_batches=2)
    last_params = 2 * 592 + 8 + 4096  # 5288
    m = est.memory
    assert (m.weights, m.gradients, m.optimizer_states) == _states(last_params)
    assert (m.activations, m.buffers) == (2 * LAYER_ACTIVATIONS + _logits(512), 2 * P2P)


@pytest.mark.parametrize("layout", [dict(), dict(tp=2), dict(pp=2, num_micro_batches=2), dict(num_micro_batches=2)])
def test_fused_loss_holds_a_chunk_and_the_gradients_instead_of_the_logits(layout):
    """An engine that fuses the loss (to_distributed's default) holds, instead of the logits, one chunk of
    them, the hidden states' gradient and, with more than one chunk, the head gradient's fp32 accumulator; on
    the last pipeline stage too, per micro-batch; under tp over the rank's half of the vocabulary
    (vocabulary-parallel). By hand, 256 tokens x vocabulary 512 x h 8, bf16: the logits 256·512·6 = 786432
    bytes; the chunk max(256·8/512, 128) = 128 tokens: 128·512·2 = 131072, the hidden gradient 256·8·2 = 4096,
    the accumulator 4·512·8 = 16384. At 64 tokens one chunk holds them all: no accumulator (the weight's
    gradient is that chunk's one GEMM). Under tp 2 the vocabulary terms halve (256 rows), the hidden gradient
    stays whole."""
    for tokens, chunk in ((256, 128), (64, 64)):
        spec = replace(TINY, vocab_size=512, seq_len=tokens)
        fused_engine = replace(MEGATRON, name="megatron+fused-loss", fused_loss=True)
        strategy = {"dp": 1, "tp": 1, "pp": 1, **layout}
        cluster = _cluster(1, strategy["tp"] * strategy["pp"])
        eager = _run(spec, cluster, **strategy).memory.activations
        fused = _run(spec, replace(cluster, engine=fused_engine), **strategy).memory.activations
        rows = 512 // strategy["tp"]
        accumulator = 4 * rows * 8 if chunk < tokens else 0
        assert eager - fused == tokens * rows * (E + 4) - (chunk * rows * E + tokens * 8 * E + accumulator)


def test_fused_loss_of_an_fp16_head_prices_the_recomputed_logits():
    """An fp16 head's fused loss recomputes its logits in the backward (linear_cross_entropy's
    _gradients_in_backward): one more head GEMM per micro-batch than bf16's, 2·T·h·V = 2·4·8·32 flops at
    1e12 flop/s, twice (2 micro-batches); its statistics' pass too, free at this infinite memory bandwidth.
    Unfused, fp16 and bf16 cost the same."""
    fused_engine = replace(MEGATRON, name="megatron+fused-loss", fused_loss=True)
    strategy = dict(dp=1, tp=1, pp=1, num_micro_batches=2)
    for engine, extra in ((MEGATRON, 0.0), (fused_engine, 2 * (2 * 4 * 8 * 32) / 1e12)):
        bf16, fp16 = (_run(TINY, replace(_cluster(1, 1, **COMPUTE_ONLY), engine=engine, dtype=dtype), **strategy)
                      for dtype in ("bf16", "fp16"))
        assert fp16.time.compute_s - bf16.time.compute_s == pytest.approx(extra, rel=1e-9, abs=1e-18)


@pytest.mark.parametrize("tokens, hidden, vocab", [(64, 8, 512), (8192, 4096, 128256), (8193, 4096, 128256),
                                                  (100_000, 8192, 32000), (3, 16, 8)])
def test_fused_loss_chunk_rule_is_the_kernels(tokens, hidden, vocab):
    from tridist.autotune.cost import fused_loss_bytes
    from tridist.kernels.ops.linear_cross_entropy import chunk_tokens

    spec = replace(TINY, hidden_size=hidden, vocab_size=vocab)
    held = fused_loss_bytes(spec, tokens, 4)  # fp32: no accumulator
    assert held == chunk_tokens(tokens, hidden, vocab) * vocab * 4 + tokens * hidden * 4
    rows = -(-vocab // 4)  # tp 4: the largest shard, which sizes every rank's chunks (VocabShard)
    assert fused_loss_bytes(spec, tokens, 4, tp=4) == chunk_tokens(tokens, hidden, rows) * rows * 4 + tokens * hidden * 4
    # bf16: one chunk up to 2 x hidden tokens, else chunks and the fp32 accumulator of the weight's gradient
    for tp, v in ((1, vocab), (4, rows)):
        chunk = chunk_tokens(tokens, hidden, v, fp32_accumulator=True)
        accumulator = 4 * v * hidden if chunk < tokens else 0
        assert fused_loss_bytes(spec, tokens, 2, tp=tp) == chunk * v * 2 + tokens * hidden * 2 + accumulator


def test_memory_full_recompute_single_stage():
    """pp = 1: one stage is both ends. Full recompute keeps each layer's input (64 bytes) plus the full
    set of the one layer being recomputed, the embedding output and the logits."""
    est = _run(TINY, _cluster(1, 1), dp=1, tp=1, pp=1, num_micro_batches=2, recompute="full")
    m = est.memory
    assert (m.weights, m.gradients, m.optimizer_states) == _states(2888)
    assert m.activations == 4 * 64 + LAYER_ACTIVATIONS + EMBEDDING_OUTPUT + _logits(32)
    assert m.buffers == 0


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_memory_zero_states_and_buffers(level):
    """dp = 2, tp = 2 (no pp): 4·(576/2 + 16) + 128 + 8 + 128 = 1480 parameters on a device, of which a
    layer has 576/2 + 16 = 304. Gradients are bucketed (2 buckets of 25 MiB in flight); ZeRO-2 holds a
    layer's full gradients before their reduce-scatter, ZeRO-3 also the current and the prefetched
    layer's gathered weights."""
    est = _run(TINY, _cluster(1, 4), dp=2, tp=2, pp=1, num_micro_batches=2, sharding_level=level)
    weights, grads, optimizer = E * 1480, E * 1480, 12 * 1480
    optimizer /= 2 if level >= 1 else 1
    grads /= 2 if level >= 2 else 1
    weights /= 2 if level >= 3 else 1
    layer = E * 304
    buffers = 2 * 25 * 2**20 + {0: 0, 1: 0, 2: layer, 3: 3 * layer}[level]
    m = est.memory
    assert (m.weights, m.gradients, m.optimizer_states, m.buffers) == (weights, grads, optimizer, buffers)
    # one micro-batch of layers split by tp, the embedding output, the logits split by tp
    assert m.activations == 4 * activation_bytes_per_layer(TINY, 1, tp=2) + EMBEDDING_OUTPUT + _logits(32) / 2


# ---------------------------------------------------------------------------- compute, recompute


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_compute_time_is_the_hardware_flops_at_the_matmul_rate(recompute, tp):
    """With memory traffic free, a device's compute time is its share of the executed FLOPs (model FLOPs
    + recomputation: ×4/3 of the layers with full recompute, the attention core with selective) at the
    matmul rate; MFU is then the matmul efficiency times model/hardware FLOPs."""
    cluster = _cluster(1, tp, matmul_efficiency=0.8, **COMPUTE_ONLY)
    est = _run(TINY_GPT, cluster, dp=1, tp=tp, pp=1, micro_batch_size=2, num_micro_batches=3, recompute=recompute)
    hardware = hardware_flops_per_step(TINY_GPT, 6, recompute)
    assert est.time.compute_s == pytest.approx(hardware / tp / 0.8e12, rel=1e-12)
    if tp == 1:  # nothing else on the critical path (the optimizer step's traffic is free)
        assert est.mfu == pytest.approx(0.8 * model_flops_per_step(TINY_GPT, 6) / hardware, rel=1e-12)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compute_time_with_flash_attention(recompute):
    """Flash attention: the attention core (4·s·q FLOPs per token per layer forward) runs at 0.75 of the
    matmul rate, and its backward recomputes Q·Kᵀ (half of it): 1 + 2 + 0.5 passes, +1 with full
    recompute. The rest (layer matrices ×3 or ×4, the LM head ×3) runs at the matmul rate."""
    cluster = _cluster(1, 1, **COMPUTE_ONLY)
    est = _run(TINY, cluster, dp=1, tp=1, pp=1, micro_batch_size=2, num_micro_batches=3, recompute=recompute)
    tokens = 6 * 4
    core = tokens * 4 * 4 * 8 * 4 * (3.5 + (recompute == "full"))  # B·s × 4·s·q × L × passes
    layers = tokens * 2 * 576 * 4 * (3 + (recompute == "full"))  # B·s × 2·params × L × passes
    head = tokens * 2 * 32 * 8 * 3
    assert core + layers + head == pytest.approx(hardware_flops_per_step(TINY, 6, recompute), rel=1e-12)
    expected = (layers + head) / 1e12 + core / (FLASH_ATTENTION_RELATIVE_EFFICIENCY * 1e12)
    assert est.time.compute_s == pytest.approx(expected, rel=1e-12)


def test_compute_time_memory_bound_roofline():
    """With free FLOPs, each GEMM [T,k]x[k,n] moves its operands and output (E·(T·k + k·n + T·n) bytes)
    and the element-wise work moves ELEMENTWISE_FWD_TRAFFIC × the stored activations; backward twice
    the forward. T = 4 tokens per micro-batch, 2 micro-batches, one device."""
    cluster = _cluster(1, 1, **MEMORY_BOUND)
    est = _run(TINY, cluster, dp=1, tp=1, pp=1, num_micro_batches=2)
    qkv = 4 * 8 + 8 * 16 + 4 * 16  # T·h + h·(q + 2kv) + T·(q + 2kv) = 224 elements
    out = 4 * 8 + 8 * 8 + 4 * 8  # 128
    gate_up = 4 * 8 + 8 * 32 + 4 * 32  # 416
    down = 4 * 16 + 16 * 8 + 4 * 8  # 224
    layer = 3 * (E * (qkv + out + gate_up + down) + ELEMENTWISE_FWD_TRAFFIC * LAYER_ACTIVATIONS)
    head = 3 * (E * (4 * 8 + 8 * 32 + 4 * 32) + ELEMENTWISE_FWD_TRAFFIC * _logits(32))
    assert est.time.compute_s == pytest.approx(2 * (4 * layer + head) / 1e12, rel=1e-12)


def test_tied_embedding_gradient_is_summed_between_first_and_last_stage():
    """pp 2 with a tied embedding/head: one all-reduce of its gradient (V·h bf16 bytes, 2 ranks) per step
    between the first and the last stage, here 2 ranks apart on one node."""
    untied, tied = (_run(replace(TINY, tied_embeddings=flag), _cluster(1, 2), dp=1, tp=1, pp=2, num_micro_batches=2)
                    for flag in (False, True))
    assert tied.time.pp_comm_s - untied.time.pp_comm_s == pytest.approx(_ring("all-reduce", E * 32 * 8, 2, INTRA), rel=1e-12)


def test_tied_embedding_gradient_under_tensor_parallel_is_the_local_shards():
    """The same under tp 2: each of the tp pairs sums its vocabulary shard, V·h/tp bf16 bytes, between the
    first and the last stage (tp·dp = 2 ranks apart, one node)."""
    untied, tied = (_run(replace(TINY, tied_embeddings=flag), _cluster(1, 4), dp=1, tp=2, pp=2, num_micro_batches=2)
                    for flag in (False, True))
    assert tied.time.pp_comm_s - untied.time.pp_comm_s == pytest.approx(_ring("all-reduce", E * 32 * 8 / 2, 2, INTRA),
                                                                        rel=1e-12)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_fsdp_copies_per_collective_on_the_torch_engine(level):
    """FSDP2 copies each collective's bytes into or out of its buffers (the torch engine's fsdp_copy_passes
    per copy, at memory bandwidth, not hidden): one copy per collective, so 1 at ZeRO-0 (the all-reduce), 2 at
    ZeRO-1 (reduce-scatter and all-gather), m + 1 at ZeRO-2 (a reduce-scatter per micro-batch), 3·m at ZeRO-3.
    dp 2, m 2, TINY whole on each device (2888 parameters); slow matmuls keep every collective hidden but
    its first chunk, on both engines alike, so the engines differ by the copies alone."""
    m = 2
    rates = {"flops": 1e6, "hbm": 1e12}
    runs = {engine: estimate(TINY, Cluster(1, 2, _cluster(1, 2, **rates).profile, engine=engine),
                             Strategy(dp=2, tp=1, pp=1, num_micro_batches=m, sharding_level=level),
                             global_batch_size=2 * m).time.dp_comm_s
            for engine in ("torch", "megatron")}
    copy = TORCH.fsdp_copy_passes * E * 2888 / 1e12
    copies = {0: 1, 1: 2, 2: m + 1, 3: 3 * m}[level]
    assert runs["torch"] - runs["megatron"] == pytest.approx(copies * copy, rel=1e-9)


def test_uneven_stages_memory_peaks_on_the_earliest_fullest_middle_rank():
    """10 layers on pp 4: (2, 3, 3, 2). 1F1B keeps pp − r micro-batches in flight on rank r (m = 4), so rank 1
    holds 3 x 3 layer-micro-batches of activations where rank 2 holds 2 x 3; rank 1 (its 3 layers' states,
    no embedding) is the device's peak."""
    ten = replace(TINY, num_layers=10)
    m = _run(ten, _cluster(1, 4), dp=1, tp=1, pp=4, num_micro_batches=4).memory
    assert m.activations == 9 * LAYER_ACTIVATIONS
    assert (m.weights, m.gradients, m.optimizer_states) == _states(3 * 592)


def test_unequal_packed_qkv_adds_a_reduce_scatter_and_its_gradients_all_gather_per_layer():
    """tp 2, Phi-3-style packed q/k/v (q 8, k 4, v 4 wide): per layer and micro-batch, the packed output
    (b·s·16 bf16) is reduce-scattered forward and its gradient all-gathered backward."""
    equal, packed = (_run(replace(TINY, packed_unequal_qkv=flag), _cluster(1, 2), dp=1, tp=2, pp=1)
                     for flag in (False, True))
    message = E * 1 * 4 * (8 + 2 * 4)
    per_layer = _ring("reduce-scatter", message, 2, INTRA) + _ring("all-gather", message, 2, INTRA)
    assert packed.time.tp_comm_s - equal.time.tp_comm_s == pytest.approx(TINY.num_layers * per_layer, rel=1e-12)
    # Held per key/value head ([q..q k v]: Falcon's query_key_value), it splits contiguously: no collective more
    interleaved = _run(replace(TINY, packed_unequal_qkv=True, qkv_interleaved=True), _cluster(1, 2), dp=1, tp=2, pp=1)
    assert interleaved.time.tp_comm_s == equal.time.tp_comm_s


@pytest.mark.parametrize("kind", ["projection", "head"])
def test_qk_norm_collectives_per_layer_and_micro_batch(kind):
    """tp 2 across two 1-device nodes (10 GB/s, 3 µs a ring step), TINY with s = 1024 and b = 2: 2048
    tokens a micro-batch, m = 3 micro-batches, 4 layers. Per layer and micro-batch:
    projection (OLMo2): the q and k norms each all-reduce their statistic (a fp32 sum of squares per token:
    4·2048 = 8192 bytes) forward and its gradient backward, 4 all-reduces of 8192 bytes, each
    2·(1/2)·8192/10e9 + 2·3e-6 = 6.8192 µs, and all-gather their weights' gradients, E·(q + kv) = 2·12 =
    24 bytes: (1/2)·24/10e9 + 3e-6 = 3.0012 µs; 30.278 µs in all.
    head (Qwen3): the q and k norms' weight gradients (E·head_dim = 4 bytes each) are all-reduced:
    2·(2·(1/2)·4/10e9 + 2·3e-6) = 12.0008 µs. Their weights add 12 (q + kv) or 4 (2·head_dim) replicated
    parameters a layer. No q/k norms, or tp = 1: nothing."""
    from tridist.autotune.cost import _layer_cost

    spec = replace(TINY, seq_len=1024)
    with_norms = replace(spec, qk_norm=kind)
    cluster = _cluster(2, 1)
    tokens = 2 * 1024
    if kind == "projection":
        per_layer = 4 * _ring("all-reduce", 4 * tokens, 2, INTER) + _ring("all-gather", E * (8 + 4), 2, INTER)
        assert per_layer == pytest.approx(4 * (2 * 0.5 * 8192 / 10e9 + 2 * 3e-6) + (0.5 * 24 / 10e9 + 3e-6), rel=1e-12)
        assert per_layer == pytest.approx(30.278e-6, rel=1e-12)
    else:
        per_layer = 2 * _ring("all-reduce", E * 2, 2, INTER)
        assert per_layer == pytest.approx(12.0008e-6, rel=1e-12)
    assert _layer_cost(with_norms, cluster, 2, 2, False).qk_norm_collectives == pytest.approx(per_layer, rel=1e-12)
    base, normed = (_run(s, cluster, dp=1, tp=2, pp=1, micro_batch_size=2, num_micro_batches=3)
                    for s in (spec, with_norms))
    assert normed.time.tp_comm_s - base.time.tp_comm_s == pytest.approx(3 * 4 * per_layer, rel=1e-9)
    assert stage_parameters(with_norms, 1, 1, 0) == 2888 + 4 * {"projection": 12, "head": 4}[kind]
    # tp = 1: no collectives at all
    assert _layer_cost(with_norms, _cluster(1, 1), 1, 2, False).qk_norm_collectives == 0.0
    assert _run(with_norms, _cluster(1, 1), dp=1, tp=1, pp=1, micro_batch_size=2).time.tp_comm_s == 0.0
    assert _layer_cost(spec, cluster, 2, 2, False).qk_norm_collectives == 0.0


def test_overlap_on_the_torch_engine_and_a_calibrated_profile():
    """The same tp = 2 case on the torch+tridist engine: its reduce-scatter ring's fp32 partial sums make
    the overlapped traffic 1.5x the plain volume in bf16 (1x in fp32); a profile's measured interference
    replaces RC, and its chunking overhead adds that share of the layer's GEMM time to compute:
    m x layers x (1 + 2) x gemm_fwd x overhead, the GEMM forward of one layer a known quantity (the
    difference between chunking 0 and 0.1 over 0.1). The engine's vocabulary-parallel fused loss adds, per
    micro-batch, its one chunk's (4 tokens) statistics: all-reduces of 4 maxima and of 3 x 4 sums, fp32."""
    m, layers, ends, per_layer = 2, 4, 3, 4
    one = _ring("all-reduce", 64, 2, INTRA)
    loss_statistics = _ring("all-reduce", 4 * 4, 2, INTRA) + _ring("all-reduce", 12 * 4, 2, INTRA)
    base = dict(dp=4, tp=2, pp=1, num_micro_batches=m, sequence_parallel=True, overlap_tp_comm=True)

    def cluster(engine="torch+tridist", dtype="bf16", **profile):
        c = _cluster(1, 8, **SLOW_COMPUTE)
        return Cluster(1, 8, replace(c.profile, **profile), dtype=dtype, engine=engine)

    def exposed(parts, interference):
        return 1 / parts + interference * (1 - 1 / parts)

    torch_bf16 = _run(TINY, cluster(), **base).time.tp_comm_s
    assert torch_bf16 == pytest.approx(m * (layers * per_layer * one * 1.5 * _exposed_share(2) + ends * one + loss_statistics), rel=1e-12)
    quiet = _run(TINY, cluster(overlap_interference=0.02), **base).time.tp_comm_s
    assert quiet == pytest.approx(m * (layers * per_layer * one * 1.5 * exposed(2, 0.02) + ends * one + loss_statistics), rel=1e-12)
    fp32 = cluster(dtype="fp32")
    one_fp32 = _ring("all-reduce", 128, 2, INTRA)
    assert _run(TINY, fp32, **base).time.tp_comm_s == pytest.approx(
        m * (layers * per_layer * one_fp32 * _exposed_share(2) + ends * one_fp32 + loss_statistics), rel=1e-12)
    compute = [_run(TINY, cluster(overlap_chunking_overhead=x), **base).time.compute_s for x in (0.0, 0.1, 0.2)]
    assert compute[2] - compute[0] == pytest.approx(2 * (compute[1] - compute[0]), rel=1e-9) and compute[1] > compute[0]


# ------------------------------------------------------------------------ key/value heads below tp


def test_key_value_heads_replicated_when_tp_exceeds_them_by_hand():
    """TINY's 2 key/value heads under tp 4 on the torch engines (each head computed on 2 ranks, distcore's
    ReplicatedColWiseParallel; Megatron-Core refuses such a tp). Per rank, FLOP-bound: q/k/v as one GEMM of
    8/4 query and 2 x 2 key/value features (one head each), 2·4·8·6 = 384; o 2·4·2·8 = 128; SwiGLU split
    2·4·8·8 + 2·4·4·8 = 768. Parameters: the k and v weights (2·4·8 = 64) whole on every rank, the rest of
    attention (128) and the MLP (384) split: 64 + 32 + 96 + norms 16 = 208 per layer. Activations: the keys and
    values twice (replicated) inside the split region: 4·(16 + 2·16 + 16 + 96) / 4 and the log-sum-exp's 64 / 4
    beside the outside 256. Once per step the k and v weights' gradients (4 layers of 64) are summed over the 4
    ranks: the only tp term a model whose 4 key/value heads split evenly has not (its k and v 8 wide)."""
    from tridist.autotune.cost import _layer_cost, all_reduce_time
    from tridist.autotune.engine import ENGINES
    from tridist.autotune.search import enumerate_layouts, layout_strategies

    cluster = replace(_cluster(1, 4, **COMPUTE_ONLY), engine=ENGINES["torch+tridist"])
    assert _layer_cost(TINY, cluster, 4, 1, False).gemm_fwd == pytest.approx((384 + 128 + 768) / 1e12)
    assert stage_parameters(TINY, 4, 1, 0) == 4 * 208 + 64 + 64 + 8
    assert activation_bytes_per_layer(TINY, 1, tp=4) == 256 + (4 * (16 + 32 + 16 + 96) + 64) / 4
    even = replace(TINY, num_kv_heads=4)  # k and v 8 wide: split one head per rank, nothing replicated
    cluster = replace(_cluster(1, 4), engine=ENGINES["torch+tridist"])
    replicated, split = (_run(spec, cluster, dp=1, tp=4, pp=1) for spec in (TINY, even))
    assert replicated.time.tp_comm_s - split.time.tp_comm_s == pytest.approx(
        all_reduce_time(E * 4 * 64, 4, *cluster.link(4, 1)), rel=1e-9)
    # The search offers tp 4 on the torch engines, never with overlapped edges (the replicated projections take
    # their input whole); Megatron's engine does not offer it.
    assert (4, 1) in enumerate_layouts(TINY, cluster, 4)
    assert not any(s.overlap_tp_comm for s in layout_strategies(TINY, cluster, 4, 4, 1))
    assert (4, 1) not in enumerate_layouts(TINY, _cluster(1, 4), 4)
    from tridist.autotune import validate

    overlapped = Strategy(dp=1, tp=4, pp=1, sequence_parallel=True, overlap_tp_comm=True)
    assert any("replicated key/value projections take their input whole" in r
               for r in validate(TINY, cluster, overlapped, global_batch_size=1))


def test_key_value_heads_replicated_inside_a_packed_qkv_by_hand():
    """TINY with q, k and v packed in one projection (GPTBigCode's, Falcon's multi-query, Phi-3's) under tp 4:
    distcore keeps the whole packed weight on every rank (ReplicatedColWiseParallel(packed_query=...): one
    parameter), so the query part is whole too: (8 + 2·4)·8 = 128 per layer, with o split (64 / 4), the MLP split
    (384 / 4) and the norms 16: 256 per layer. Once per step its gradient (4 layers of 128) is summed over the 4 ranks,
    where separate k and v projections sum 64 a layer. The same GEMMs as separate projections, and no reduce-scatter
    of the packed output (a packed qkv whose key/value heads tp divides is split on its input features and pays one)."""
    from tridist.autotune.cost import _layer_cost, all_reduce_time
    from tridist.autotune.engine import ENGINES

    packed = replace(TINY, packed_unequal_qkv=True)
    cluster = replace(_cluster(1, 4, **COMPUTE_ONLY), engine=ENGINES["torch+tridist"])
    assert _layer_cost(packed, cluster, 4, 1, False).gemm_fwd == _layer_cost(TINY, cluster, 4, 1, False).gemm_fwd
    assert stage_parameters(packed, 4, 1, 0) == 4 * 256 + 64 + 64 + 8
    cluster = replace(_cluster(1, 4), engine=ENGINES["torch+tridist"])
    whole, separate = (_run(spec, cluster, dp=1, tp=4, pp=1) for spec in (packed, TINY))
    link = cluster.link(4, 1)
    assert whole.time.tp_comm_s - separate.time.tp_comm_s == pytest.approx(
        all_reduce_time(E * 4 * 128, 4, *link) - all_reduce_time(E * 4 * 64, 4, *link), rel=1e-9)
