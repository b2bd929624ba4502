"""The cost model's mixture-of-experts terms against arithmetic written out in the test (the conventions of
test_cost_terms.py: round device rates, efficiencies of 1, every expected value a sum a reader can redo,
none computed by calling `estimate` for the expectation), and its check against published MoE runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tridist.autotune import (
    Cluster,
    InvalidStrategy,
    ModelSpec,
    Strategy,
    activation_bytes_per_layer,
    estimate,
    model_flops_per_step,
    preset,
    stage_parameters,
)
from tridist.autotune.cost import _layer_cost, all_to_all_time
from tridist.autotune.engine import ENGINES
from tridist.autotune.search import search
from tridist.autotune.published_runs import MOE_RUNS, TOLERANCE
from tridist.autotune.strategy import rank_layer_indices

from tests.test_cost_terms import COMPUTE_ONLY, INTER, INTRA, _cluster

# TINY (test_cost_terms.py: h 8, 4 heads of 2, 2 kv heads, ffn 16, vocab 32, seq 4) with layers 1-3 MoE:
#   4 experts of ffn 8, top-2, no shared expert. One expert 3·8·8 = 192, router 4·8 = 32.
#   Dense layer: attention 192 + SwiGLU 384 + norms 16 = 592. MoE layer: 192 + 4·192 + 32 + 16 = 1008.
#   Total 592 + 3·1008 + embedding 256 + head 256 + final norm 8 = 4136; a token skips 2 experts in each
#   MoE layer: 4136 − 3·2·192 = 2984 active.
TINY_MOE = ModelSpec(num_layers=4, hidden_size=8, num_heads=4, num_kv_heads=2, ffn_hidden_size=16, vocab_size=32,
                     seq_len=4, num_experts=4, experts_per_token=2, expert_ffn_hidden_size=8, moe_layers=(1, 2, 3),
                     expert_load_imbalance=1.5, name="tiny-moe")
E = 2  # bf16 bytes


def test_parameters_by_hand():
    assert TINY_MOE.num_parameters == 4136
    assert TINY_MOE.active_parameters == 2984
    assert (TINY_MOE.num_moe_layers, TINY_MOE.num_dense_layers) == (3, 1)
    shared = replace(TINY_MOE, shared_ffn_hidden_size=4)  # + 3 layers x 3·8·4
    assert shared.num_parameters == 4136 + 3 * 96 and shared.active_parameters == 2984 + 3 * 96


def test_stage_parameters_split_experts_over_ep_and_tp():
    assert stage_parameters(TINY_MOE, 1, 1, 0) == 4136
    assert stage_parameters(TINY_MOE, 1, 1, 0, ep=2) == 4136 - 3 * 2 * 192  # 2 of the 4 experts per layer
    # tp 2, ep 2: dense layer 576/2 + 16; MoE layer attention 192/2 + router 32 (replicated) + norms 16
    # + 2 experts of 192/2; embedding and head split, final norm whole.
    assert stage_parameters(TINY_MOE, 2, 1, 0, ep=2) == (288 + 16) + 3 * (96 + 32 + 16 + 2 * 96) + 128 + 128 + 8
    # pp 2: layers 0-1 (one dense, one MoE) + embedding; layers 2-3 (MoE) + head + final norm.
    assert rank_layer_indices(4, 2) == ((0, 1), (2, 3))
    assert [stage_parameters(TINY_MOE, 1, 2, r) for r in range(2)] == [592 + 1008 + 256, 2 * 1008 + 256 + 8]


def test_flops_count_the_active_experts_only():
    # Per token: 2·(dense 576 + 3 MoE layers of attention 192 + router 32 + 2 experts 384) = 4800 matmul
    # FLOPs, 4·s·q·L = 512 attention core, 2·V·h = 512 logits; x3 for forward + backward, 4 tokens.
    assert model_flops_per_step(TINY_MOE, 1) == 3 * 4 * (4800 + 512 + 512)


def test_moe_layer_gemms_by_hand():
    """FLOP-bound (COMPUTE_ONLY): attention 2·4·8·16 + 2·4·8·8 = 1536, router 2·4·8·4 = 256, experts as
    E/ep groups of tokens·k·imbalance/(E/ep) rows: ep 1: 4 groups of 2 rows (no imbalance without ep)
    of 2·2·8·16 + 2·2·8·8 = 768; ep 2: 2 groups of 4·2·1.5/2 = 6 rows of 2304."""
    cluster = _cluster(1, 2, **COMPUTE_ONLY)
    assert _layer_cost(TINY_MOE, cluster, 1, 1, False, True, 1).gemm_fwd == pytest.approx((1536 + 256 + 4 * 768) / 1e12)
    assert _layer_cost(TINY_MOE, cluster, 1, 1, False, True, 2).gemm_fwd == pytest.approx((1536 + 256 + 2 * 2304) / 1e12)
    assert _layer_cost(TINY_MOE, cluster, 1, 1, False, False, 1).gemm_fwd == pytest.approx(
        (1536 + 2 * 4 * 8 * 32 + 2 * 4 * 16 * 8) / 1e12)  # the dense layer: SwiGLU of 16


def test_moe_activations_by_hand():
    """sb = 4 tokens, e = 2: outside 4·(4·2·8) = 256 plus the k·imbalance dispatched copies 2·imb·2·8 and the
    fp32 router scores 4·4 per token; inside q, k, v, o 2·(8 + 4 + 4 + 8) = 48 plus 3 SwiGLU tensors of the
    expert ffn for k·imbalance copies, 3·2·2·imb·8; flash's log-sum-exp 4·4 heads per token."""
    for imbalance in (1.0, 1.5):
        outside = 4 * (64 + 32 * imbalance + 16)
        inside = 4 * (48 + 96 * imbalance)
        core = 4 * 4 * 4
        assert activation_bytes_per_layer(TINY_MOE, 1, moe=True, imbalance=imbalance) == pytest.approx(
            outside + inside + core)
        assert activation_bytes_per_layer(TINY_MOE, 1, tp=2, moe=True, imbalance=imbalance) == pytest.approx(
            outside + (inside + core) / 2)


def test_all_to_all_by_hand():
    nbytes = 1e6
    # Inside a node: (n−1)/n of the bytes over NVLink, n−1 pairwise steps.
    assert all_to_all_time(nbytes, 4, *INTRA) == pytest.approx(3 / 4 * nbytes / INTRA[0] + 3 * INTRA[1])
    # Two of the four on each node: one peer over NVLink, two over the NIC at the same time; the slower wins.
    crossing = all_to_all_time(nbytes, 4, *INTRA, local_ranks=2, inter_bandwidth=INTER[0], inter_latency=INTER[1])
    assert crossing == pytest.approx(max(1 / 4 * nbytes / INTRA[0] + INTRA[1], 2 / 4 * nbytes / INTER[0] + 2 * INTER[1]))
    assert all_to_all_time(nbytes, 1, *INTRA) == 0.0


@pytest.mark.parametrize("nodes, per_node", [(1, 4), (2, 2)], ids=["one node", "two nodes"])
def test_expert_parallel_all_to_all_in_the_step(nodes, per_node):
    """dp 4, ep 4, one micro-batch of one sequence: each MoE layer sends tokens·k·imbalance hidden vectors
    4 times (dispatch and combine, forward and backward), 6 with full recompute; three MoE layers."""
    cluster = _cluster(nodes, per_node)
    routed = E * 4 * 2 * 1.5 * 8
    if nodes == 1:
        one = 3 / 4 * routed / INTRA[0] + 3 * INTRA[1]
    else:
        one = max(1 / 4 * routed / INTRA[0] + INTRA[1], 2 / 4 * routed / INTER[0] + 2 * INTER[1])
    for recompute, count in (("none", 4), ("full", 6)):
        s = Strategy(dp=4, tp=1, pp=1, ep=4, recompute=recompute)
        est = estimate(TINY_MOE, cluster, s, global_batch_size=4)
        assert est.time.ep_comm_s == pytest.approx(3 * count * one)
    assert estimate(TINY_MOE, cluster, Strategy(dp=4, tp=1, pp=1), global_batch_size=4).time.ep_comm_s == 0.0


def test_expert_states_are_sharded_over_the_ranks_that_share_them():
    """dp 4, ep 2, ZeRO-1: the other parameters' Adam states (12 bytes) over 4 ranks, the experts' over the
    dp / ep = 2 ranks that hold the same experts. Non-expert: 592 + 3·(192 + 32 + 16) + 256 + 256 + 8 =
    1832; experts: 3 layers x 2 of 192 = 1152."""
    est = estimate(TINY_MOE, _cluster(1, 4), Strategy(dp=4, tp=1, pp=1, ep=2, sharding_level=1), global_batch_size=4)
    assert est.memory.optimizer_states == 12 * 1832 / 4 + 12 * 1152 / 2
    assert est.memory.weights == est.memory.gradients == E * (1832 + 1152)


def test_strategy_rules_for_expert_parallel():
    cluster = _cluster(1, 4)
    with pytest.raises(InvalidStrategy, match="ep=2 must divide dp=1"):
        estimate(TINY_MOE, cluster, Strategy(dp=1, tp=4, pp=1, ep=2), global_batch_size=1)
    with pytest.raises(InvalidStrategy, match="does not divide num_experts=4"):
        estimate(TINY_MOE, Cluster(1, 3, _cluster(1, 1).profile, engine="megatron"), Strategy(dp=3, tp=1, pp=1, ep=3),
                 global_batch_size=3)
    with pytest.raises(InvalidStrategy, match="expert parallel needs a mixture-of-experts model"):
        estimate(replace(TINY_MOE, num_experts=0, experts_per_token=0, expert_ffn_hidden_size=None, moe_layers=None),
                 cluster, Strategy(dp=4, tp=1, pp=1, ep=2), global_batch_size=4)
    with pytest.raises(InvalidStrategy, match="expert_ffn_hidden_size=6"):
        estimate(replace(TINY_MOE, expert_ffn_hidden_size=6), cluster, Strategy(dp=1, tp=4, pp=1), global_batch_size=1)
    # The torch engines keep each expert whole on every tp rank: tp need not divide its width (7 here).
    odd = replace(TINY_MOE, expert_ffn_hidden_size=7)
    with pytest.raises(InvalidStrategy, match="expert_ffn_hidden_size=7"):
        estimate(odd, _cluster(1, 2), Strategy(dp=1, tp=2, pp=1), global_batch_size=1)
    torch_engine = replace(_cluster(1, 2), engine=ENGINES["torch+tridist"])
    assert estimate(odd, torch_engine, Strategy(dp=1, tp=2, pp=1), global_batch_size=1).step_time_s > 0


def test_spec_rules_for_experts():
    with pytest.raises(ValueError, match="experts_per_token"):
        replace(TINY_MOE, experts_per_token=5)
    with pytest.raises(ValueError, match="set num_experts too"):
        replace(TINY_MOE, num_experts=0)
    with pytest.raises(ValueError, match="moe_layers"):
        replace(TINY_MOE, moe_layers=(2, 4))
    with pytest.raises(ValueError, match="at least 1.0"):
        replace(TINY_MOE, expert_load_imbalance=0.5)
    # moe_layers=None means every layer, and follows a replaced layer count.
    assert replace(preset("mixtral-8x7b"), num_layers=8).num_moe_layers == 8


def test_presets_match_the_published_sizes():
    mixtral, qwen3 = preset("mixtral-8x7b"), preset("qwen3-30b-a3b")
    assert mixtral.num_parameters / 1e9 == pytest.approx(46.7, abs=0.05)  # Mixtral of Experts, 2024
    assert mixtral.active_parameters / 1e9 == pytest.approx(12.9, abs=0.05)
    assert qwen3.num_parameters / 1e9 == pytest.approx(30.5, abs=0.05)  # Qwen3-30B-A3B model card
    assert qwen3.active_parameters / 1e9 == pytest.approx(3.3, abs=0.06)
    deepseek = preset("deepseek-v3-like")
    assert deepseek.num_dense_layers == 3 and deepseek.num_parameters / 1e9 == pytest.approx(671, rel=0.01)


@pytest.mark.parametrize("run", MOE_RUNS, ids=[r.label for r in MOE_RUNS])
def test_published_moe_runs(run):
    cluster = Cluster(run.nodes, run.strategy.num_devices // run.nodes, run.device, engine=run.engine)
    result = estimate(run.spec(), cluster, run.strategy, global_batch_size=run.strategy.global_batch_size)
    ratio = result.tokens_per_second / cluster.num_devices / run.tokens_per_second_per_device
    assert 1 / (1 + TOLERANCE) <= ratio <= 1 + TOLERANCE, f"{run.label}: predicted / published = {ratio:.2f} ({run.source})"


def test_experts_whole_on_every_tp_rank_under_the_torch_engines():
    """The torch engines (distcore) keep the MoE blocks whole on every tp rank (expert tensor parallel 1),
    Megatron splits the experts' ffn over tp like the dense MLP. tp 2, ep 2, TINY_MOE: the experts' weights
    2 x 192 per layer whole instead of 2 x 96; their GEMMs (FLOP-bound: 4 groups of 2 rows of 768 FLOPs at ep
    1) beside attention split in two (1536 / 2) and the router (256); their activations (3 SwiGLU tensors of
    the expert ffn for k copies of 4 tokens, 4·96 bytes) held whole; the search offers sequence parallel, never
    with expert parallel (test_moe_blocks_on_sequence_slices_by_hand)."""
    assert stage_parameters(TINY_MOE, 2, 1, 0, ep=2, etp=1) == (288 + 16) + 3 * (96 + 32 + 16 + 2 * 192) + 128 + 128 + 8
    megatron = _cluster(1, 2, **COMPUTE_ONLY)
    torch_engine = replace(megatron, engine=ENGINES["torch+tridist"])
    assert not torch_engine.engine.expert_tensor_parallel and megatron.engine.expert_tensor_parallel
    assert _layer_cost(TINY_MOE, torch_engine, 2, 1, False, True, 1).gemm_fwd == pytest.approx((1536 / 2 + 256 + 4 * 768) / 1e12)
    assert _layer_cost(TINY_MOE, megatron, 2, 1, False, True, 1).gemm_fwd == pytest.approx((1536 / 2 + 256 + 4 * 768 / 2) / 1e12)
    # Activation collectives per forward + backward: attention's pair; the whole block's none (its input and output
    # are every rank's, or each rank's slice under sp), Megatron's split experts a pair; a dense layer's two pairs;
    # an MoE block alone (Nemotron-H's) none under the torch engines
    for sp in (False, True):
        assert [_layer_cost(TINY_MOE, cluster, 2, 1, sp, moe, 1, False, part).tp_collectives
                for cluster, moe, part in ((torch_engine, True, "both"), (megatron, True, "both"),
                                           (torch_engine, False, "both"), (torch_engine, True, "mlp"),
                                           (megatron, True, "mlp"))] == [2, 4, 4, 0, 2]
    outside, inside, core, experts = 4 * (64 + 32 + 16), 4 * (48 + 96), 4 * 4 * 4, 4 * 96
    assert activation_bytes_per_layer(TINY_MOE, 1, tp=2, moe=True, etp=1) == pytest.approx(
        outside + experts + (inside - experts + core) / 2)
    assert activation_bytes_per_layer(TINY_MOE, 1, tp=2, moe=True, etp=2) == pytest.approx(outside + (inside + core) / 2)
    spec = replace(TINY_MOE, seq_len=8)
    ranked = search(spec, Cluster(1, 4, megatron.profile, engine="torch+tridist"), global_batch_size=4, storage=None,
                    top_k=1000)
    assert any(c.strategy.sequence_parallel for c in ranked.ranked)
    assert any(c.strategy.sequence_parallel and c.strategy.ep > 1 for c in ranked.ranked)
    assert any("overlap_tp_comm kept at False" in line for line in ranked.pruned), ranked.pruned


def test_moe_blocks_on_sequence_slices_by_hand():
    """Under sequence parallel the torch engines run each whole MoE block on the tp rank's slice of the sequence.
    TINY_MOE, tp 2, FLOP-bound: attention 1536 / 2, the router on 2 of the 4 tokens (256 / 2), the 4 experts on
    2 x 2 / 4 = 1 routed row each (768 / 2); the blocks' gradients summed over the 2 tp ranks once per step: an
    all-reduce of 3 MoE layers x (router 32 + 4 experts of 192) parameters. With expert parallel (ep 2) the router's
    sum stays once per step and each layer's 2 local experts are summed in each backward: once per micro-batch
    and layer. Megatron's split experts are priced as before."""
    from tridist.autotune.cost import all_reduce_time

    megatron = _cluster(1, 2, **COMPUTE_ONLY)
    torch_engine = replace(megatron, engine=ENGINES["torch+tridist"])
    assert _layer_cost(TINY_MOE, torch_engine, 2, 1, True, True, 1).gemm_fwd == pytest.approx(
        (1536 / 2 + 256 / 2 + 4 * 768 / 2) / 1e12)
    assert _layer_cost(TINY_MOE, megatron, 2, 1, True, True, 1).gemm_fwd == pytest.approx(
        (1536 / 2 + 256 + 4 * 768 / 2) / 1e12)  # etp = tp: every rank routes every token, experts split
    cluster = replace(_cluster(1, 2), engine=ENGINES["torch+tridist"])
    with_sp, without = (estimate(TINY_MOE, cluster, Strategy(dp=1, tp=2, pp=1, sequence_parallel=sp),
                                 global_batch_size=1) for sp in (True, False))
    block = 3 * (32 + 4 * 192)
    bw, latency = cluster.link(2, 1)
    layer = {sp: [_layer_cost(TINY_MOE, cluster, 2, 1, sp, moe, 1) for moe in (False, True)] for sp in (True, False)}
    tp_terms = {sp: sum(count * c.tp_collective for count, c in zip((1, 3), layer[sp])) for sp in (True, False)}
    # The layers' own tp collectives are priced alike with and without sequence parallel (a gather and a
    # scatter per all-reduce); the difference is the blocks' gradient all-reduce.
    assert tp_terms[True] == pytest.approx(tp_terms[False])
    assert with_sp.time.tp_comm_s - without.time.tp_comm_s == pytest.approx(all_reduce_time(E * block, 2, bw, latency),
                                                                            rel=1e-9)
    cluster = replace(_cluster(1, 4), engine=ENGINES["torch+tridist"])
    for micro in (1, 2):
        with_sp, without = (estimate(TINY_MOE, cluster, Strategy(dp=2, tp=2, pp=1, ep=2, sequence_parallel=sp,
                                                                 micro_batch_size=2 // micro, num_micro_batches=micro),
                                     global_batch_size=4) for sp in (True, False))
        bw, latency = cluster.link(2, 1)
        expected = all_reduce_time(E * 3 * 32, 2, bw, latency) + micro * 3 * all_reduce_time(E * 2 * 192, 2, bw, latency)
        assert with_sp.time.tp_comm_s - without.time.tp_comm_s == pytest.approx(expected, rel=1e-9)
    estimate(TINY_MOE, _cluster(1, 4), Strategy(dp=2, tp=2, pp=1, ep=2, sequence_parallel=True), global_batch_size=2)
