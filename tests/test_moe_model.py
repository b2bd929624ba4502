"""Mixtures of experts are recognised by structure (transformers' Mixtral, Qwen3-MoE and Qwen2-MoE, and
hand-written models with listed or [experts, in, out] experts, shared experts and dense layers mixed in),
searched with an expert-parallel degree, and kept by to_distributed to what distcore applies to them
(data parallel with sharding and expert parallel: tests/distributed/transformers_worker.py trains them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tridist.autotune import Cluster, ModelSpec, SearchSpace, Strategy, UnrecognisedModel, preset, search
from tridist.distcore.auto import apply_strategy, tensor_parallel_plan, unsupported

from tests.hf_models import EXPERTS, LAYERS, MOE_FAMILIES, TOP_K, build


def _counted(model: nn.Module) -> int:
    """The parameters the cost model counts: no bias vectors, no Qwen2-MoE shared-expert gate (hidden -> 1)."""
    return sum(p.numel() for n, p in model.named_parameters() if not n.endswith("bias") and "shared_expert_gate" not in n)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_transformers_moe_families_are_recognised(family):
    model = build(family)
    spec = ModelSpec.from_module(model, seq_len=16)
    s = spec.structure
    assert (spec.num_experts, spec.experts_per_token) == (EXPERTS, TOP_K)
    assert (s.moe, s.router, s.experts, s.expert_layout) == ("mlp", "mlp.gate.weight", "mlp.experts", "stacked")
    assert spec.expert_ffn_hidden_size == model.config.moe_intermediate_size if family != "mixtral" else 96
    moe_layers = (1,) if family == "qwen3-moe" else tuple(range(LAYERS))  # Qwen3-MoE: mlp_only_layers=[0]
    assert s.moe_layers == spec.moe_layer_indices == moe_layers
    assert spec.num_parameters == _counted(model)
    assert (s.attention, s.q, s.o) == ("self_attn", "self_attn.q_proj", "self_attn.o_proj")
    if family == "qwen3-moe":  # the dense layer's MLP is named as before
        assert (s.gate, s.up, s.down, spec.ffn_hidden_size) == ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                                               model.config.intermediate_size)
        assert spec.qk_norm == "head"
    if family == "qwen2-moe":
        assert s.shared_experts == ("mlp.shared_expert",) and spec.shared_ffn_hidden_size == 48
    assert "MoE block" in s.describe() and "experts (stacked)" in s.describe()


def test_gemma4_experts_beside_a_dense_mlp_in_the_decoder_layer_are_recognised():
    """Gemma 4's mixture of experts (26B-A4B's layout): the router and the experts are children of the decoder layer
    itself, beside a dense MLP every token runs, and the config names the experts per token `top_k_experts` (before:
    unrecognised, "the number of experts per token was not found"). The MoE block is the layer; its dense MLP is
    read as a shared expert (whole on every tp rank, as the experts are). Under sequence parallel (refused at first)
    each tp rank runs all of the layer but its attention on its own slice of the sequence: every module there with
    parameters of its own gets ShardLocalParameters (the norms too: the router's input norm takes the tokens
    flattened, [tokens, hidden], which torch's SequenceParallel style would split on the hidden dim), and the
    attention is a SequenceParallelDisable region split over the heads. The spec counts every parameter but the
    extra norms and the router's scales (noted: 7 norms per layer)."""
    model = build("gemma4-moe")
    spec = ModelSpec.from_module(model, seq_len=16)
    s = spec.structure
    assert (spec.num_experts, spec.experts_per_token, spec.expert_ffn_hidden_size) == (EXPERTS, TOP_K, 32)
    assert (s.moe, s.router, s.experts, s.shared_experts, s.moe_layers) == ("", "router.proj.weight", "experts", ("mlp",),
                                                                            tuple(range(LAYERS)))
    assert spec.shared_ffn_hidden_size == model.config.intermediate_size
    hidden = model.config.hidden_size
    extra = LAYERS * (5 * hidden + hidden + EXPERTS)  # 5 norms beyond 2, the router's scale and per-expert scale
    assert spec.num_parameters == _counted(model) - extra and "7 norm(s) per layer found" in " ".join(s.notes)
    assert "sequence_parallel" not in unsupported(spec)
    plan = tensor_parallel_plan(model, s, sequence_parallel=True, tp=2)
    layer = dict(model.model.layers[0].named_modules())
    local = {name.removeprefix("model.layers.0.") for name, styles in plan.styles.items()
             if name.startswith("model.layers.0.") and any(type(x).__name__ == "ShardLocalParameters" for x in styles)}
    assert local == {name for name, module in layer.items() if name and not name.startswith("self_attn")
                     and any(True for _ in module.parameters(recurse=False))}, local
    assert {"router", "router.proj", "experts", "mlp.down_proj", "pre_feedforward_layernorm_2"} <= local, local
    assert [type(x).__name__ for x in plan.styles["model.layers.0.self_attn"]] == ["SequenceParallelDisable"]


class _SwiGLU(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)


class _ListedMoE(nn.Module):
    """DeepSeek-style: a Linear router, a list of expert MLPs, a shared expert."""

    def __init__(self, hidden, ffn, experts, top_k, shared_ffn):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(_SwiGLU(hidden, ffn) for _ in range(experts))
        self.shared_experts = _SwiGLU(hidden, shared_ffn)
        self.top_k = top_k


class _StackedMoE(nn.Module):
    """torchtitan-style: a bare [experts, hidden] router and experts stored [experts, in, out]."""

    def __init__(self, hidden, ffn, experts, top_k):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(experts, hidden))
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.experts.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.experts.w3 = nn.Parameter(torch.empty(experts, hidden, ffn))
        if top_k:
            self.num_experts_per_tok = top_k


class _Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.num_heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))


class _Block(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.attention, self.attention_norm, self.ffn_norm = _Attention(hidden, 4), nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.feed_forward = ffn


class _Decoder(nn.Module):
    def __init__(self, blocks, hidden=32, vocab=64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Block(hidden, ffn) for ffn in blocks)
        self.norm = nn.RMSNorm(hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)


def test_listed_experts_shared_experts_and_dense_first_layers():
    with torch.device("meta"):
        model = _Decoder([_SwiGLU(32, 96)] + [_ListedMoE(32, 16, 6, 2, 24) for _ in range(3)])
    spec = ModelSpec.from_module(model, seq_len=8)
    s = spec.structure
    assert (spec.num_experts, spec.experts_per_token, spec.expert_ffn_hidden_size, spec.shared_ffn_hidden_size) == (6, 2, 16, 24)
    assert s.moe_layers == (1, 2, 3) and spec.ffn_hidden_size == 96 and spec.num_dense_layers == 1
    assert (s.router, s.experts, s.expert_layout, s.shared_experts) == (
        "feed_forward.router.weight", "feed_forward.experts", "list", ("feed_forward.shared_experts",))
    assert (s.gate, s.up, s.down) == ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2")
    assert spec.num_parameters == _counted(model)


def test_stacked_in_out_experts_with_a_bare_router():
    with torch.device("meta"):
        model = _Decoder([_StackedMoE(32, 16, 8, 2) for _ in range(2)])
    spec = ModelSpec.from_module(model, seq_len=8)
    assert (spec.num_experts, spec.experts_per_token, spec.expert_ffn_hidden_size) == (8, 2, 16)
    assert spec.structure.router == "feed_forward.gate" and spec.structure.down is None
    assert spec.num_parameters == _counted(model)


def test_a_structure_it_cannot_read_is_reported_with_what_it_found():
    with torch.device("meta"):
        model = _Decoder([_StackedMoE(32, 16, 8, 0) for _ in range(2)])  # no top-k attribute anywhere
    with pytest.raises(UnrecognisedModel, match=r"feed_forward \(8 experts\).*experts_per_token=\.\.\."):
        ModelSpec.from_module(model)
    assert ModelSpec.from_module(model, experts_per_token=2).experts_per_token == 2
    with torch.device("meta"):  # experts without a router beside them: no MoE, and no MLP either
        bare = _Decoder([_StackedMoE(32, 16, 8, 2) for _ in range(2)])
    for block in bare.layers:
        del block.feed_forward.gate
    with pytest.raises(UnrecognisedModel, match="could not find separate attention and MLP.*mixture of experts"):
        ModelSpec.from_module(bare)


def test_real_size_mixtral_on_the_meta_device_is_recognised_and_searched():
    import transformers as hf

    config = hf.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
    with torch.device("meta"):
        model = hf.MixtralForCausalLM(config)
    spec = ModelSpec.from_module(model, seq_len=4096)
    assert spec == dataclasses.replace(preset("mixtral-8x7b"), name=spec.name)
    one_node = search(spec, Cluster(1, 8, "h100-sxm"), global_batch_size=256, storage=None)
    assert one_node.best is None and "no strategy fits" in one_node.message  # 747 GB of Adam states / 8 > 80 GB
    four_nodes = search(spec, Cluster(4, 8, "h100-sxm"), global_batch_size=256, storage=None)
    assert four_nodes.best is not None
    kept = {c.strategy.ep for layout in four_nodes.layouts for c in layout.top}
    assert kept == {1, 2, 4, 8}  # every layout keeps its fastest of each ep degree for the report


def test_search_offers_ep_only_to_moe_models_and_only_where_allowed():
    cluster = Cluster(1, 8, "h100-sxm")
    qwen3 = preset("qwen3-30b-a3b")
    result = search(qwen3, cluster, global_batch_size=64, storage=None, space=SearchSpace(tp=(1,), pp=(1,)))
    assert {c.strategy.ep for c in result.layouts[0].top} == {1, 2, 4, 8}
    kept = search(qwen3, cluster, global_batch_size=8, storage=None, space=SearchSpace(tp=(1,), pp=(1,)),
                  excluded={"ep": "not applied yet", "num_micro_batches": "not applied yet"})
    assert {c.strategy.ep for c in kept.layouts[0].top} == {1}
    assert {c.strategy.num_micro_batches for c in kept.layouts[0].top} == {1}
    dense = search(preset("llama3-8b"), cluster, global_batch_size=64, storage=None, space=SearchSpace(tp=(1,), pp=(1,)))
    assert {c.strategy.ep for c in dense.layouts[0].top} == {1}


def test_to_distributed_keeps_moe_models_to_what_distcore_applies():
    model = build("mixtral")
    spec = ModelSpec.from_module(model, seq_len=16)
    limits = unsupported(spec)
    # tensor (with sequence parallel too), expert, pipeline and data parallel with micro-batches and recompute are
    # applied; the MoE blocks have no column-parallel entry for an overlapped all-gather
    assert set(limits) == {"overlap_tp_comm"} and "no column-parallel entry" in limits["overlap_tp_comm"]
    dense = build("qwen3-moe")
    for layer in dense.model.layers:  # the same model with its MoE block swapped for its first layer's dense MLP
        layer.mlp = dense.model.layers[0].mlp
    with pytest.raises(ValueError, match="ep=2 needs a recognised mixture of experts"):
        apply_strategy(dense, None, Strategy(dp=2, tp=1, pp=1, ep=2), spec=ModelSpec.from_module(dense, seq_len=16))
    # Under sequence parallel each MoE block runs on this rank's slice: every module of it with parameters gets
    # ShardLocalParameters (their gradients summed over tp), and no block is marked to gather the sequence.
    with_sp = tensor_parallel_plan(model, spec.structure, sequence_parallel=True)
    local = {name for name, styles in with_sp.styles.items() if any(type(x).__name__ == "ShardLocalParameters" for x in styles)}
    moe_modules = {f"model.layers.{i}.mlp.{part}" for i in range(len(model.model.layers)) for part in ("gate", "experts")}
    assert local == moe_modules, local
    assert not any(type(x).__name__ == "SequenceParallelDisable" for name, styles in with_sp.styles.items()
                   if ".mlp" in name for x in styles)
    aux = build("mixtral-aux")  # its router's load-balancing loss takes every token's logits
    with pytest.raises(ValueError, match="load-balancing loss takes every token's logits"):
        tensor_parallel_plan(aux, ModelSpec.from_module(aux, seq_len=16).structure, sequence_parallel=True)
    plan = tensor_parallel_plan(model, spec.structure, sequence_parallel=False)  # attention only: every layer is MoE
    split = {name.rpartition(".")[2] for name in plan.styles}
    assert split >= {"q_proj", "k_proj", "v_proj", "o_proj"} and not any(".mlp." in name for name in plan.styles), split
    with pytest.raises(ValueError, match="no tensor-parallel roles for a mixture-of-experts model"):
        spec.structure.tp_roles()


def test_search_equals_exhaustive_enumeration_for_a_mixture_of_experts():
    """The layout search (ep enumerated inside each layout) and plain enumeration of every raw combination
    (ep included) rank the same strategies for a small MoE on 8 devices."""
    from tridist.autotune import exhaustive_search

    spec = ModelSpec(num_layers=4, hidden_size=1024, num_heads=16, ffn_hidden_size=1024, vocab_size=32000,
                     num_kv_heads=4, seq_len=2048, num_experts=8, experts_per_token=2, moe_layers=(1, 2, 3),
                     name="small-moe")
    cluster = Cluster(1, 8, "h100-sxm")
    space = SearchSpace(max_virtual_pp=2, recompute=("none", "full"))
    fast = search(spec, cluster, global_batch_size=16, top_k=100, storage=None, space=space)
    slow = exhaustive_search(spec, cluster, global_batch_size=16, top_k=100, space=space)
    assert [c.strategy for c in fast.ranked] == [c.strategy for c in slow]
    assert {c.strategy.ep for c in slow} >= {1, 2}


@pytest.mark.parametrize("query_latent", [True, False])
def test_deepseek_latent_attention_is_recognised_with_its_experts(query_latent):
    """transformers' DeepSeek-V3 (tests/hf_models.py MORE_FAMILIES): multi-head latent attention (kv_a_proj_with_mqa
    down to a latent and one rotary key, kv_b_proj up to every head; the query through q_a_proj/q_b_proj, or
    q_proj without a query latent, as DeepSeek-V2-Lite), a dense first layer, then routed experts with a
    shared one. Its tensor-parallel plan splits q and kv_b by head, o by input, and sums the rotary key's
    gradient over the tp ranks; overlap is refused (the split projections take the latents)."""
    import transformers as hf

    from tridist.distcore import ColWiseParallel, ReduceSharedOutputGradient, RowWiseParallel

    model = build("deepseek-v3", layers=3)
    if not query_latent:
        config = model.config
        config.q_lora_rank = None
        torch.manual_seed(0)
        model = hf.DeepseekV3ForCausalLM(config)
    spec = ModelSpec.from_module(model, seq_len=16)
    s = spec.structure
    assert (s.q, s.latent_kv, s.latent_kv_down, s.latent_rotary_features, s.k, s.v, s.qkv) == (
        "self_attn.q_b_proj" if query_latent else "self_attn.q_proj", "self_attn.kv_b_proj",
        "self_attn.kv_a_proj_with_mqa", 8, None, None, None)
    assert (spec.num_heads, spec.head_dim, spec.num_kv_heads, spec.qk_norm) == (4, 20, 4, None)  # 12 + 8 wide
    assert (spec.num_experts, spec.experts_per_token, s.moe_layers, s.shared_experts) == (EXPERTS, TOP_K, (1, 2),
                                                                                        ("mlp.shared_experts",))
    assert any("latent attention priced as it runs" in note for note in s.notes), s.notes
    assert "multi-head latent attention" in unsupported(spec)["overlap_tp_comm"]
    # Priced as it runs: every attention projection's weights, the latents' down-projections whole under tp.
    latent = spec.latent_attention
    assert (latent.q_lora_rank, latent.kv_lora_rank, latent.rope_head_dim, latent.v_head_dim) == (
        32 if query_latent else 0, 16, 8, 16)
    attention = model.model.layers[1].self_attn
    weights = {n: m.weight.numel() for n, m in attention.named_modules() if isinstance(m, torch.nn.Linear)}
    assert spec.attention_parameters == sum(weights.values()), (spec.attention_parameters, weights)
    assert spec.attention_unsplit_parameters == weights["kv_a_proj_with_mqa"] + weights.get("q_a_proj", 0)
    assert (spec.key_size, spec.value_size, spec.attention_output_size) == (4 * 20, 4 * 16, 4 * 16)
    plan = tensor_parallel_plan(model, s, sequence_parallel=False)
    styles = {name: [type(st) for st in sts] for name, sts in plan.styles.items() if name.startswith("model.layers.1.self_attn")}
    assert styles == {f"model.layers.1.self_attn.{s.q.rpartition('.')[2]}": [ColWiseParallel],
                      "model.layers.1.self_attn.kv_b_proj": [ColWiseParallel],
                      "model.layers.1.self_attn.o_proj": [RowWiseParallel],
                      "model.layers.1.self_attn.kv_a_proj_with_mqa": [ReduceSharedOutputGradient]}, styles
    assert plan.styles["model.layers.1.self_attn.kv_a_proj_with_mqa"][0].features == 8


def test_expert_parallel_splits_swiglu_experts_and_other_stacked_experts_by_their_own_forward():
    """How expert parallel runs a rank's experts: Mixtral's stacked SwiGLU as the fused routed SwiGLU; gpt-oss's
    (transposed, biased, a clamped activation) by their own forward on the rank's experts, after a probe that
    the experts split into groups with local indices sum to the whole; Llama 4's, which run every token on
    [experts x tokens] rows, by their own forward on the rank's experts' blocks. Experts whose output mixes
    experts fail the probes and are refused, with the reasons."""
    from tridist.distcore.expert_parallel import (EVERY_TOKEN, OWN_FORWARD, ROUTED_SWIGLU, expert_parallel_refusal,
                                                  split_kind)

    experts = {family: build(family).get_submodule(name) for family, name in (
        ("mixtral", "model.layers.0.mlp.experts"), ("gpt-oss", "model.layers.0.mlp.experts"),
        ("llama4", "model.layers.0.feed_forward.experts"))}
    assert split_kind(experts["mixtral"]) == (ROUTED_SWIGLU, "")
    assert split_kind(experts["gpt-oss"]) == (OWN_FORWARD, "")
    assert split_kind(experts["llama4"]) == (EVERY_TOKEN, "")
    llama4 = build("llama4")
    assert expert_parallel_refusal(llama4, ModelSpec.from_module(llama4, seq_len=8).structure.experts_modules()) is None

    gpt_oss, every_token = type(experts["gpt-oss"]), type(experts["llama4"])

    class GlobalIndexScaled(gpt_oss):  # each expert's output scaled by its global index: no split can keep it
        def forward(self, hidden_states, router_indices=None, routing_weights=None):
            scaled = routing_weights * (router_indices + 1)
            return super().forward(hidden_states, router_indices, scaled)

    class Buffered(gpt_oss):
        def __init__(self, config):
            super().__init__(config)
            self.register_buffer("scale", torch.ones(1))

    class BlocksMixed(every_token):  # every expert's block sees the mean of all blocks: no split can keep it
        def forward(self, hidden_states):
            blocks = hidden_states.view(self.gate_up_proj.shape[0], -1, hidden_states.shape[-1])
            return super().forward((blocks + blocks.mean(0)).reshape(hidden_states.shape))

    config = build("gpt-oss").config
    kind, why = split_kind(GlobalIndexScaled(config))
    assert kind is None and "not the sum of its experts' outputs" in why, why
    kind, why = split_kind(Buffered(config))
    assert kind is None and "buffers" in why, why
    mixed = BlocksMixed(build("llama4").config.get_text_config())
    torch.nn.init.normal_(mixed.gate_up_proj)
    kind, why = split_kind(mixed)
    assert kind is None and "not each expert's block of rows through that expert" in why, why
    assert "BlocksMixed" in expert_parallel_refusal(torch.nn.ModuleDict({"experts": mixed}), ["experts"])


def test_a_rank_s_own_experts_follow_train_and_eval_and_share_the_model_config():
    """The split's copy of the replaced experts module (kind OWN_FORWARD) is no submodule: train()/eval() reach it
    by hand, and it shares the model's config (transformers picks the experts' implementation from it per call)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tridist.distcore.expert_parallel import OWN_FORWARD, ExpertParallelExperts

    experts = build("gpt-oss").get_submodule("model.layers.0.mlp.experts")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        split = ExpertParallelExperts(experts, init_device_mesh("cpu", (1,)), fused_activation=True)
        assert split.kind == OWN_FORWARD and not split.fused_activation
        assert getattr(split.own, "config", None) is getattr(experts, "config", None)
        split.train()
        assert split.own.training
        split.eval()
        assert not split.own.training
        assert not any(n.startswith("own") for n, _ in split.named_parameters())  # its placeholders are not parameters
    finally:
        dist.destroy_process_group()


def test_experts_that_run_every_token_are_priced_as_they_run():
    """Llama 4's experts run every expert on every token (weighted by the router): ModelSpec.from_module (which
    to_distributed and `tridist tune` read) prices all of them per token, not the router's top-1, with no
    imbalance under ep (every rank gets the same rows), and says so; routed experts keep their top-k, and an
    explicit experts_per_token wins."""
    for family, k in (("llama4", EXPERTS), ("mixtral", TOP_K), ("gpt-oss", TOP_K)):
        spec = ModelSpec.from_module(build(family), seq_len=16)
        assert spec.experts_per_token == k, (family, spec.experts_per_token)
        assert (spec.expert_load_imbalance == 1.0) == (family == "llama4")
        assert any("runs every expert on every token" in n for n in spec.structure.notes) == (family == "llama4")
    assert ModelSpec.from_module(build("llama4"), seq_len=16, experts_per_token=1).experts_per_token == 1


def test_latent_attention_is_priced_as_it_runs():
    """The cost model's terms for DeepSeek's latent attention: the attention core's FLOPs (Q·Kᵀ over the query
    heads' width, P·V over the value heads'), and under tensor parallel the down-projections to the latents
    whole on every rank (their weights and GEMMs not divided by tp), the rest split."""
    from tridist.autotune import LatentAttention
    from tridist.autotune.cost import _forward_flops_per_token, _layer_parameters

    latent = LatentAttention(kv_lora_rank=512, rope_head_dim=64, v_head_dim=128, q_lora_rank=1536)
    mla = ModelSpec(num_layers=2, hidden_size=7168, num_heads=128, head_dim=192, ffn_hidden_size=18432,
                    vocab_size=129280, seq_len=4096, latent_attention=latent)
    # DeepSeek-V3's per layer: q_a, q_b, kv_a (latent + rotary key), kv_b (keys' latent part + values), o.
    assert mla.attention_parameters == (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256
                                        + 128 * 128 * 7168) == 187_105_280
    assert mla.attention_unsplit_parameters == 7168 * 1536 + 7168 * 576
    _, core, _, _ = _forward_flops_per_token(mla)
    assert core == 2.0 * 4096 * (128 * 192 + 128 * 128) * 2
    split, _ = _layer_parameters(mla, 4, 1, False, 1)
    unsplit = mla.attention_unsplit_parameters
    assert split == (mla.layer_matmul_parameters - unsplit) / 4 + unsplit + mla.layer_norm_parameters
    # Under tp the backward all-reduces the gradients of the latents (query 1536, key/value 512, rotary key 64)
    # in place of the hidden state's (7168).
    from tridist.autotune import Cluster
    from tridist.autotune.cost import _layer_cost, all_reduce_time

    cluster = Cluster(1, 8, "h100-sxm")
    cost = _layer_cost(mla, cluster, 4, 1, False)
    bw, latency = cluster.link(4, 1)
    message = cluster.dtype_bytes * 4096
    assert cost.latent_collectives == pytest.approx(
        sum(all_reduce_time(message * w, 4, bw, latency) for w in (1536, 512, 64)) - cost.tp_collective, rel=1e-12)
    assert _layer_cost(mla, cluster, 1, 1, False).latent_collectives == 0.0
    from tridist.autotune.cost import _layer_timing

    timing = _layer_timing(mla, cluster, 4, 1, False, "none", False, False, 1)
    assert timing.tp == pytest.approx(4 * cost.tp_collective + cost.latent_collectives, rel=1e-12)
    mha = dataclasses.replace(mla, latent_attention=None)  # what it was priced as before: 3.8x the weights
    assert mha.attention_parameters == 4 * 7168 * 128 * 192 and mha.attention_unsplit_parameters == 0
    # The latents' activations (2 bytes each of the latents and their norms' inputs: 2 x (1536 + 512 + 64) per
    # token) are whole on every tp rank, sequence parallel or not: sequence parallel splits the rest of what is
    # outside the tensor-parallel regions (two norm inputs, the qkv and MLP inputs: 4 x 7168 per token), no more.
    from tridist.autotune import activation_bytes_per_layer

    tokens, e = 4096, 2
    latents = tokens * 2 * e * (1536 + 512 + 64)
    outside = tokens * e * 4 * 7168
    whole_sequence = activation_bytes_per_layer(mla, 1, tp=4)
    assert whole_sequence - activation_bytes_per_layer(mla, 1, tp=4, sequence_parallel=True) == pytest.approx(
        outside * (1 - 1 / 4))
    assert activation_bytes_per_layer(mla, 1) - activation_bytes_per_layer(mha, 1) == pytest.approx(
        latents + tokens * e * sum(getattr(mla, n) - getattr(mha, n) for n in ("value_size", "attention_output_size")))
    with pytest.raises(ValueError, match="rotary part"):
        dataclasses.replace(mla, latent_attention=dataclasses.replace(latent, rope_head_dim=192))


def test_the_swiglu_experts_probe_copies_a_few_experts_only_where_that_shows_the_same():
    """`experts_verdict` probes a copy holding 4 of Mixtral's experts (its parameters are all its own and
    stacked, its forward reads `num_experts`); a module with a submodule (which such a copy would keep live: a
    zero-initialised adapter looks absent), a scalar parameter, or an expert count read from elsewhere is probed
    whole, as before: the adapter is found, the scalar does not crash the probe, the other count is no refusal."""
    import copy

    from tridist.kernels.fuse import _few_experts_probe, experts_verdict

    mixtral = build("mixtral").get_submodule("model.layers.0.mlp.experts")
    experts = type(mixtral)
    config = copy.deepcopy(mixtral.config)
    config.num_local_experts = 8
    assert experts_verdict(experts(config)) is None
    assert _few_experts_probe(experts(config)).gate_up_proj.shape[0] == 4

    class Adapted(experts):  # a zero-initialised adapter after the experts: SwiGLU only until it trains
        def __init__(self, config):
            super().__init__(config)
            self.adapter = torch.nn.Linear(config.hidden_size, config.hidden_size, bias=False)
            torch.nn.init.zeros_(self.adapter.weight)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = super().forward(hidden_states, top_k_index, top_k_weights)
            return out + self.adapter(out)

    class Scaled(experts):  # a scalar parameter of its own
        def __init__(self, config):
            super().__init__(config)
            self.scale = torch.nn.Parameter(torch.tensor(1.0))

    class CountedElsewhere(experts):  # the expert count kept in another attribute
        @property
        def num_experts(self):
            return self.n_routed_experts

        @num_experts.setter
        def num_experts(self, value):
            self.n_routed_experts = value

    assert "not each token's experts'" in experts_verdict(Adapted(config))
    assert experts_verdict(Scaled(config)) is None  # probed whole: the scalar gets a fresh value, no crash
    assert experts_verdict(CountedElsewhere(config)) is None
    assert _few_experts_probe(CountedElsewhere(config)).gate_up_proj.shape[0] == 8


def test_sequence_parallel_plan_finds_the_moe_block_by_its_own_name_and_refuses_router_logits():
    """Under sequence parallel the plan gives ShardLocalParameters to the MoE block by the structure's name for it
    (`moe`), which may differ from the dense layers' MLP (`mlp`); where the block is the whole layer, to all of the
    layer but its attention (the test below). The
    router's load-balancing loss is seen on a composite model's text config too, and a call passing
    output_router_logits=True is refused once the model runs on sequence slices."""
    import types

    from tridist.distcore.auto import refuse_router_logits_per_call
    from tridist.distcore.parallelize import router_aux_loss_on

    model = build("qwen3-moe")  # layer 0 dense (mlp_only_layers), layer 1 MoE
    structure = ModelSpec.from_module(model, seq_len=16).structure
    renamed = dataclasses.replace(structure, moe="moe")
    model.model.layers[1].moe = model.model.layers[1]._modules.pop("mlp")  # the MoE layer's block renamed
    plan = tensor_parallel_plan(model, renamed, sequence_parallel=True)
    local = {name for name, styles in plan.styles.items() if any(type(x).__name__ == "ShardLocalParameters" for x in styles)}
    assert local == {"model.layers.1.moe.gate", "model.layers.1.moe.experts"}, local

    composite = types.SimpleNamespace(config=types.SimpleNamespace(
        get_text_config=lambda: types.SimpleNamespace(output_router_logits=True)))
    assert router_aux_loss_on(composite) and not router_aux_loss_on(build("mixtral"))
    mixtral = build("mixtral")
    refuse_router_logits_per_call(mixtral)
    ids = torch.randint(3, 100, (1, 8))
    mixtral(input_ids=ids)
    with pytest.raises(ValueError, match="output_router_logits=True under sequence parallel"):
        mixtral(input_ids=ids, output_router_logits=True)


def test_block_check_tells_a_mixture_s_dense_layers_from_its_moe_layers():
    """The tensor-parallel block check runs once per kind of block (block_check.block_kind: the class and its
    children's names and types): Qwen3-MoE's dense first layer and its MoE layers are one class with an MLP or
    an MoE block under `mlp`, which the plan treats differently, so each gets its own check; Mixtral's layers
    are all alike."""
    from tridist.distcore.block_check import block_kind

    qwen3 = build("qwen3-moe").model.layers
    assert block_kind(qwen3[0]) != block_kind(qwen3[1]) and block_kind(qwen3[0])[0] is block_kind(qwen3[1])[0]
    mixtral = build("mixtral").model.layers
    assert len({block_kind(layer) for layer in mixtral}) == 1
