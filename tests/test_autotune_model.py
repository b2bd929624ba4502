"""ModelSpec.from_module: recognition by structure on the bench models (real and meta device), the
names it reports for tensor-parallel plans, head counts from attributes / rotary tables, and clear
`UnrecognisedModel` errors."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

from tridist.autotune import GatedDeltaNet, ModelSpec, UnrecognisedModel, preset, recognise
from tridist.autotune.model import readable_attr
from tridist.bench.models import build_model


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_seed_llama():
    model = build_model("seed-llama", "tiny")
    spec = ModelSpec.from_module(model, seq_len=32)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (2, 64, 4, 4)
    assert (spec.ffn_hidden_size, spec.vocab_size, spec.head_dim, spec.seq_len) == (176, 128, 16, 32)
    assert spec.gated_mlp and not spec.tied_embeddings
    assert spec.num_parameters == _count(model)
    s = spec.structure
    assert (s.layers, s.attention, s.q, s.k, s.v, s.o) == ("layers", "self_attn", "self_attn.q_proj",
                                                          "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    assert (s.mlp, s.gate, s.up, s.down) == ("mlp", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert (s.embedding, s.final_norm) == ("embed_tokens", "norm")
    assert (s.lm_head_param, s.lm_head_layout) == ("weight", "matmul")  # the seed's bare [hidden, vocab] weight
    assert s.layer_norms == ("input_layernorm", "post_attn_layernorm")
    assert s.pattern(s.q) == "layers.*.self_attn.q_proj"


def test_hf_llama_grouped_query_attention():
    model = build_model("hf-llama", "tiny")
    spec = ModelSpec.from_module(model, seq_len=64)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.kv_size) == (4, 2, 16, 32)
    assert spec.num_parameters == _count(model)
    s = spec.structure
    assert s.layers == "model.layers" and s.pattern(s.k) == "model.layers.*.self_attn.k_proj"
    assert (s.embedding, s.final_norm, s.lm_head, s.lm_head_param, s.lm_head_layout) == (
        "model.embed_tokens", "model.norm", "lm_head", "lm_head.weight", "linear")


def test_paddle_llama_packed_projections_and_bare_weight_head():
    model = build_model("paddle-llama", "tiny")
    spec = ModelSpec.from_module(model, seq_len=16)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.ffn_hidden_size, spec.vocab_size) == (4, 32, 4, 64, 128)
    assert spec.num_parameters == _count(model)
    s = spec.structure
    assert (s.qkv, s.q, s.gate_up, s.gate) == ("self_attn.qkv_proj", None, "mlp.gate_up_proj", None)
    assert s.pattern(s.gate_up) == "llama.layers.*.mlp.gate_up_proj"
    assert (s.lm_head, s.lm_head_param, s.lm_head_layout) == ("lm_head", "lm_head.weight", "matmul")
    roles = s.tp_roles()
    assert roles["llama.layers.*.self_attn.qkv_proj"] == "colwise" and roles["llama.layers.*.mlp.down_proj"] == "rowwise"
    assert roles["llama.embed_tokens"] == "embedding" and roles["lm_head.weight"] == "lm_head"
    assert roles["llama.norm"] == "norm" and roles["llama.layers.*.input_layernorm"] == "norm"
    # the seed config: hidden 20 == ffn 20, the ambiguous shapes are told apart by the head attributes
    seed = ModelSpec.from_module(build_model("paddle-llama", "seed"))
    assert (seed.hidden_size, seed.ffn_hidden_size, seed.num_heads, seed.structure.qkv) == (20, 20, 2, "self_attn.qkv_proj")


@pytest.mark.parametrize("name", ["seed-llama", "hf-llama", "paddle-llama"])
def test_meta_device_large_model(name):
    overrides = {"seed-llama": dict(num_hidden_layers=32), "hf-llama": dict(num_hidden_layers=32, num_key_value_heads=8),
                 "paddle-llama": dict(num_layers=32, hidden_size=4096, intermediate_size=11008, vocab_size=32000,
                                      num_attention_heads=32)}[name]
    with torch.device("meta"):
        model = build_model(name, "seed", **overrides)
    assert next(model.parameters()).is_meta
    spec = ModelSpec.from_module(model, seq_len=4096)
    assert spec.num_layers == 32 and spec.num_parameters == _count(model)
    if name == "hf-llama":
        assert spec.num_kv_heads == 8


def test_tied_embeddings_and_overrides():
    model = build_model("hf-llama", "tiny")
    model.lm_head.weight = model.model.embed_tokens.weight
    spec = ModelSpec.from_module(model)
    # Hugging Face's tie: a Linear head registered with the embedding's weight (what tensor parallel splits)
    assert spec.tied_embeddings and (spec.structure.lm_head, spec.structure.lm_head_param) == ("lm_head", "lm_head.weight")
    assert spec.num_parameters == _count(model)
    model.lm_head = nn.Identity()  # a forward multiplying by the embedding's weight itself: no head module
    spec = ModelSpec.from_module(model)
    assert spec.tied_embeddings and spec.structure.lm_head is None
    assert spec.structure.lm_head_param == "model.embed_tokens.weight"
    assert ModelSpec.from_module(model, seq_len=8, name="mine").name == "mine"


class _Attn(nn.Module):
    """No head-count attribute anywhere: heads come from the rotary table (inv_freq has d/2 entries)."""

    def __init__(self, h, d):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.register_buffer("inv_freq", torch.ones(d // 2))


class _Ffn(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)


class _Block(nn.Module):
    def __init__(self, h, f, d):
        super().__init__()
        self.attention, self.feed_forward = _Attn(h, d), _Ffn(h, f)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(h), nn.RMSNorm(h)


class _MetaStyle(nn.Module):
    """Meta's original Llama naming (wq/wk/wv/wo, w1/w2/w3, tok_embeddings, output)."""

    def __init__(self, h=48, f=96, d=12, layers=3, vocab=50):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(_Block(h, f, d) for _ in range(layers))
        self.norm = nn.RMSNorm(h)
        self.output = nn.Linear(h, vocab, bias=False)


def test_meta_llama_naming_and_rotary_head_dim():
    spec = ModelSpec.from_module(_MetaStyle())
    assert (spec.num_heads, spec.head_dim, spec.ffn_hidden_size) == (4, 12, 96)
    s = spec.structure
    assert (s.attention, s.o, s.gate, s.up, s.down) == ("attention", "attention.wo", "feed_forward.w1",
                                                       "feed_forward.w3", "feed_forward.w2")
    assert (s.embedding, s.lm_head_param) == ("tok_embeddings", "output.weight")


def test_unrecognised_models_say_what_is_missing():
    with pytest.raises(UnrecognisedModel, match="no decoder-layer list"):
        ModelSpec.from_module(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    # Layers without an attention/MLP split
    flat = nn.Module()
    flat.embed = nn.Embedding(10, 8)
    flat.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    with pytest.raises(UnrecognisedModel, match="attention and MLP"):
        ModelSpec.from_module(flat)
    # No head count anywhere (no attribute, no rotary table): the message says how to fix it
    model = _MetaStyle()
    for block in model.layers:
        del block.attention.inv_freq
    with pytest.raises(UnrecognisedModel, match="num_heads="):
        ModelSpec.from_module(model)
    assert ModelSpec.from_module(model, num_heads=4).num_heads == 4
    with pytest.raises(UnrecognisedModel, match="expected an nn.Module"):
        recognise("not a model")
    # No embedding
    model = _MetaStyle()
    del model.tok_embeddings
    with pytest.raises(UnrecognisedModel, match="no token embedding") as caught:
        ModelSpec.from_module(model, hidden_size=48)
    assert caught.value.layers == "layers"  # the layer list found is named (pipeline stages need no more)
    assert issubclass(UnrecognisedModel, ValueError)


def test_state_space_mixers_not_read_are_refused_naming_them():
    """A state-space mixer the recogniser does not read (a causal conv1d over packed projections that hold per-head
    state parameters beside q/k/v) is no attention tensor parallel can split. Bamba's Mamba-2 mixer was read as a
    packed qkv of 128 heads over 384 key/value heads, and ModelSpec then raised a ValueError that to_distributed did
    not catch (its search crashed); a mixer without Mamba-2's attributes (here Bamba's, its n_groups removed) is
    refused naming it, and the layer list. A model of Mamba-2 layers and MLPs alone has no attention to read (one of
    mixers alone is read: test_state_space_models_alone_are_read_as_blocks_of_their_mixer)."""
    from tests.hf_models import build

    pytest.importorskip("transformers")
    model = build("bamba")
    del model.model.layers[0].mamba.n_groups
    with pytest.raises(UnrecognisedModel, match=r"model\.layers\.0: mamba holds a convolution \(conv1d\)") as caught:
        ModelSpec.from_module(model)
    assert caught.value.layers == "model.layers"
    # a Mamba-2 mixer and an MLP in every layer (Bamba without attention layers): no attention beside the mixer
    with pytest.raises(UnrecognisedModel, match=r"every layer of model\.layers mixes tokens by linear attention "
                                                 r"\(mamba\) and holds no attention beside it"):
        ModelSpec.from_module(build("bamba", config=dict(attn_layer_indices=[])))


@pytest.mark.parametrize("family", ["mamba", "falcon-mamba", "mamba2"])
def test_state_space_models_alone_are_read_as_blocks_of_their_mixer(family):
    """Models of state-space mixers alone (a norm and a mixer in each block: transformers' Mamba, Falcon Mamba,
    Mamba-2; refused before: "no attention layer to read the structure from") are read as blocks without an MLP whose
    token mixer is the linear mixer: no attention, no MLP (None in the structure, 0 heads and 0 MLP width in the
    spec), every parameter counted but the mixers' biases (within 1%: Mamba-1's convolution and time-step biases; a
    Mamba-2 mixer priced as a Gated DeltaNet). The tp plan splits each mixer as in the hybrids and names no attention
    or MLP; the search leaves selective recompute out (validate refuses it: nothing to recompute), and every path of
    the estimate takes the spec. A spec of 0 heads with a layer that attends is refused."""
    from tests.hf_models import build
    from tridist.autotune import Cluster, Strategy, estimate
    from tridist.autotune.search import enumerate_layouts, layout_strategies
    from tridist.autotune.strategy import validate
    from tridist.distcore.auto import apply_recompute, tensor_parallel_plan
    from tridist.distcore.tensor_parallel import UnfusedMixerForward, resolve_plan

    pytest.importorskip("transformers")
    model = build(family)
    spec = ModelSpec.from_module(model, seq_len=16)
    structure = spec.structure
    assert (structure.attention, structure.o, structure.mlp, structure.down) == (None, None, None, None)
    assert structure.mlp_free_layers == spec.mlp_free_layers == (0, 1) and structure.layer_norms == ("norm",)
    assert structure.linear_attention.mixer == "mixer" and structure.linear_attention.layers == (0, 1)
    assert structure.linear_attention.kind == ("mamba2" if family == "mamba2" else "mamba1")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.ffn_hidden_size) == (0, 0, 0, 0)
    assert "no attention no MLP" in spec.describe() and "attention out" not in structure.describe()
    actual = sum(p.numel() for p in model.parameters())
    assert abs(spec.num_parameters - actual) < 0.01 * actual, (spec.num_parameters, actual)
    styles = tensor_parallel_plan(model, structure, sequence_parallel=True).styles
    mixer = "backbone.layers.0.mixer"
    split = {name: [type(x).__name__ for x in kinds] for name, kinds in styles.items() if name.startswith(mixer)}
    expected = {f"{mixer}.in_proj": ["ColWiseParallel"], f"{mixer}.out_proj": ["RowWiseParallel"],
                mixer: ["UnfusedMixerForward", "LocalParameterRows", "SequenceParallelDisable"]}
    if family != "mamba2":  # x_proj's dt, B and C feed every rank's channels
        expected[f"{mixer}.x_proj"] = ["RowWiseParallel", "ReduceSharedOutputGradient"]
    assert split == expected, split
    assert not any(".self_attn" in name or ".mlp" in name for name in styles), sorted(styles)
    # the same style in a user's Paddle-style plan (a dict of patterns): accepted there too
    user = resolve_plan(model, {"backbone.layers.*.mixer": UnfusedMixerForward()}).styles
    assert [type(x).__name__ for x in user["backbone.layers.1.mixer"]] == ["UnfusedMixerForward"], user
    cluster = Cluster(1, 4)
    for strategy in (Strategy(1, 2, 2, sequence_parallel=True, num_micro_batches=2), Strategy(2, 2, 1, recompute="full"),
                     Strategy(1, 4, 1, sequence_parallel=True)):
        step = estimate(spec, cluster, strategy, global_batch_size=strategy.global_batch_size).time.total_s
        assert 0 < step < float("inf"), (strategy, step)
    selective = Strategy(2, 2, 1, recompute="selective")
    assert any("without attention" in r for r in validate(spec, cluster, selective, global_batch_size=2))
    assert all(s.recompute != "selective" for tp, pp in enumerate_layouts(spec, cluster, 4)
               for s in layout_strategies(spec, cluster, 4, tp, pp))
    with pytest.raises(ValueError, match="selective recompute needs the attention module"):
        apply_recompute(model, layers=structure.layers, attention=structure.attention, mode="selective")
    with pytest.raises(ValueError, match=r"num_heads=0 \(no attention\) needs every layer a linear mixer's"):
        dataclasses.replace(spec, gated_delta_net=dataclasses.replace(spec.gated_delta_net, layers=(0,)))


def _assert_packed_split_priced(spec, degrees) -> None:
    """Under each tp of `degrees` the linear mixers' unequally packed projections (split on their inputs: a
    reduce-scatter forward, an all-gather backward) add to the step's tensor-parallel communication."""
    from tridist.autotune import Cluster, Strategy, estimate

    unpacked = dataclasses.replace(spec, gated_delta_net=dataclasses.replace(spec.gated_delta_net, packed_split_outputs=0))
    for tp in degrees:
        strategy = Strategy(dp=1, tp=tp, pp=1, micro_batch_size=1, num_micro_batches=1)
        priced = [estimate(s, Cluster(1, tp), strategy, global_batch_size=1).time.tp_comm_s for s in (spec, unpacked)]
        assert priced[0] > priced[1] > 0, (tp, priced)


def test_mamba2_mixers_are_read_for_the_split_by_head():
    """Mamba-2 layers beside attention layers (Bamba, Granite 4.0-H): read as LinearAttention of kind "mamba2", its
    state groups (n_groups) as the key heads and its heads as the value heads. in_proj packs [z | x | B | C | dt]: z,
    x and dt split with the heads, B and C with the groups (`units`); the convolution's rows over [x | B | C], dt_bias,
    A_log and D (one per head) and the gated norm's weight (one per feature of x) are this rank's; num_heads and
    intermediate_size are divided, n_groups and conv_dim summed from their parts' shares (`part_counts`). The plan
    puts SplitGroupNorm on the gated norm where tp exceeds the groups only. Priced as a Gated DeltaNet of its groups
    and heads (B and C as q and k), whose key heads tp may exceed where they divide it. Falcon-H1's Mamba-2 mixer in
    every layer, beside the attention, stays a module no plan names (whole on every rank). A part of the mixer no
    split knows is refused, naming it."""
    from tests.hf_models import build
    from tridist.autotune import Cluster, Strategy, validate
    from tridist.distcore.auto import tensor_parallel_plan

    pytest.importorskip("transformers")
    spec = ModelSpec.from_module(build("bamba"), seq_len=16)
    linear, inner, bc = spec.structure.linear_attention, 8 * 16, 16
    assert (linear.kind, linear.mixer, linear.layers, linear.num_k_heads, linear.num_v_heads) == ("mamba2", "mamba", (0,), 1, 8)
    assert (linear.columns, linear.output, linear.group_norm) == ((("in_proj", (inner, inner, bc, bc, 8)),), "out_proj", "norm")
    assert dict(linear.rows) == {"conv1d.weight": (inner, bc, bc), "conv1d.bias": (inner, bc, bc), "norm.weight": (inner,),
                                 "dt_bias": (8,), "A_log": (8,), "D": (8,)}
    assert dict(linear.units) == {"in_proj": (8, 8, 1, 1, 8), "conv1d.weight": (8, 1, 1), "conv1d.bias": (8, 1, 1),
                                  "norm.weight": (8,)}
    assert (linear.counts, dict(linear.part_counts)) == (("num_heads", "intermediate_size"), {
        "n_groups": ((1, 1),), "conv_dim": ((inner, 8), (bc, 1), (bc, 1))})
    assert spec.gated_delta_net == GatedDeltaNet(layers=(0,), num_k_heads=1, num_v_heads=8, head_k_dim=16, head_v_dim=16,
                                                 conv_kernel_size=4, key_heads_replicable=True,
                                                 packed_split_outputs=2 * inner + 2 * bc + 8)
    _assert_packed_split_priced(spec, (2, 4))
    model = build("bamba")
    for tp, split in ((2, True), (1, False)):
        styles = tensor_parallel_plan(model, spec.structure, sequence_parallel=False, tp=tp).styles
        assert [type(x).__name__ for x in styles.get("model.layers.0.mamba.norm", [])] == (["SplitGroupNorm"] if split else [])
    two_groups = build("bamba-2-groups")
    styles = tensor_parallel_plan(two_groups, ModelSpec.from_module(two_groups, seq_len=16).structure,
                                  sequence_parallel=False, tp=2).styles
    assert "model.layers.0.mamba.norm" not in styles  # a group per rank: the norm runs as it is
    # tp may exceed the groups where they divide it (not the heads)
    for tp, refused in ((2, False), (4, False), (8, False), (16, True)):
        strategy = Strategy(dp=1, tp=tp, pp=1, micro_batch_size=1, num_micro_batches=1)
        problems = " ".join(validate(spec, Cluster(1, tp), strategy, global_batch_size=1))
        assert "num_k_heads" not in problems and ("gated_delta_net.num_v_heads=8" in problems) == refused, (tp, problems)
    # 3 groups under tp 2 and 4: neither divides nor is a multiple of them, said so in the model's terms
    three = dataclasses.replace(spec, gated_delta_net=dataclasses.replace(spec.gated_delta_net, num_k_heads=3, num_v_heads=12))
    for tp in (2, 4):
        problems = " ".join(validate(three, Cluster(1, tp), Strategy(dp=1, tp=tp, pp=1, micro_batch_size=1,
                                                                     num_micro_batches=1), global_batch_size=1))
        assert f"tp={tp} neither divides the 3 state groups of the Mamba-2 mixers (n_groups" in problems, problems
    # Granite 4.0-H with experts: its shared MLP beside the MoE block, which every token runs, read as a shared expert
    # (before: a module no plan names, sp refused)
    experts = ModelSpec.from_module(build("granite-hybrid"), seq_len=16)
    assert (experts.structure.moe, experts.structure.shared_experts, experts.structure.unplanned,
            experts.shared_ffn_hidden_size) == ("block_sparse_moe", ("shared_mlp",), (), 128)
    granite = ModelSpec.from_module(build("granite-hybrid-dense"), seq_len=16).structure
    assert (granite.linear_attention.kind, granite.gate_up, granite.down) == (
        "mamba2", "shared_mlp.input_linear", "shared_mlp.output_linear")
    # Falcon-H1's Mamba-2 mixer beside the attention in every layer: both read, the mixer's µP multipliers over its
    # input projection's outputs (mup_vector, a buffer along its last dim) split as those outputs
    falcon = ModelSpec.from_module(build("falcon-h1"), seq_len=16).structure
    mixer = falcon.linear_attention
    assert (falcon.unplanned, falcon.attention, mixer.mixer, mixer.layers, mixer.beside_attention) == (
        (), "self_attn", "mamba", (0, 1), True)
    assert dict(mixer.rows)["mup_vector"] == (128, 128, 16, 16, 8) and dict(mixer.row_dims) == {"mup_vector": 2}
    assert dict(mixer.part_counts)["groups_time_state_size"] == ((16, 1),)
    # its optional gated norm over groups (mamba_rms_norm) is none the reader splits: the mixer whole, as before, saying so
    normed = ModelSpec.from_module(build("falcon-h1", config=dict(mamba_rms_norm=True)), seq_len=16).structure
    assert normed.unplanned == ("mamba",) and normed.linear_attention is None
    assert any("the Mamba-2 mixers beside the attention are not split (model.layers.0.mamba.norm" in n for n in normed.notes)
    model = build("bamba")
    model.model.layers[0].mamba.extra = nn.Linear(8, 8)
    with pytest.raises(UnrecognisedModel, match=r"model\.layers\.0\.mamba\.extra \(Linear: weight \(8, 8\), bias \(8,\)\) "
                                                 r"is none of a Mamba-2 mixer's parts"):
        ModelSpec.from_module(model)
    model = build("bamba")
    model.model.layers[0].mamba.register_parameter("scale", nn.Parameter(torch.ones(3)))
    with pytest.raises(UnrecognisedModel, match=r"mamba\.scale \(3,\) is no parameter of one entry per head \(8\)"):
        ModelSpec.from_module(model)


def test_split_group_norm_checks_the_norm_it_splits():
    """SplitGroupNorm computes a grouped gated RMSNorm itself (each group's sum of squares summed over its ranks), so
    it first checks the module it replaces computes that: Bamba's, Granite 4.0-H's and Mamba-2's own pass; a norm
    taken before the gate, or over the whole width where the groups are two, is refused; so is a module without a
    group size. The formula on one rank equals transformers' module (the same fp32 arithmetic)."""
    from tests.hf_models import build
    from tridist.distcore.tensor_parallel import _check_grouped_gated_norm, _grouped_gated_rms_norm

    transformers = pytest.importorskip("transformers")
    for family, groups in (("bamba", 1), ("granite-hybrid-dense", 1), ("bamba-2-groups", 2)):
        norm = build(family).model.layers[0].mamba.norm
        torch.nn.init.normal_(norm.weight)
        _check_grouped_gated_norm("norm", norm, groups)
    norm = build("bamba-2-groups").model.layers[0].mamba.norm
    with pytest.raises(ValueError, match="is not a grouped gated RMSNorm of 1 groups"):
        _check_grouped_gated_norm("norm", norm, 1)  # its group_size is half the width
    norm.group_size = norm.weight.shape[0]  # the whole width, where the mixer has two groups: caught by the probe
    with pytest.raises(ValueError, match="is not a grouped gated RMSNorm of 2 groups"):
        _check_grouped_gated_norm("norm", norm, 2)

    class BeforeGate(type(build("bamba").model.layers[0].mamba.norm)):
        def forward(self, hidden_states, gate=None):
            variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
            normed = hidden_states.float() * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * (normed * nn.functional.silu(gate.float())).to(hidden_states.dtype)

    with pytest.raises(ValueError, match="computes otherwise than a gated RMSNorm normalised in 1 groups after the gate"):
        _check_grouped_gated_norm("norm", BeforeGate(128, 128), 1)
    with pytest.raises(ValueError, match=r"norm \(LayerNorm\) is not a grouped gated RMSNorm"):
        _check_grouped_gated_norm("norm", nn.LayerNorm(8), 1)
    mamba_norm = transformers.models.mamba2.modeling_mamba2.MambaRMSNormGated(64, group_size=32)
    hidden, gate = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    torch.testing.assert_close(_grouped_gated_rms_norm(hidden, gate, mamba_norm.weight, mamba_norm.variance_epsilon, 32),
                               mamba_norm(hidden, gate))


def test_gated_deltanet_layers_are_read_beside_attention():
    """Qwen3.5 and Qwen3-Next: Gated DeltaNet linear-attention layers beside gated full-attention ones. The attention
    is read from a full-attention layer (its query projection twice what its output projection takes: [query | gate]
    per head), the mixer from the first linear one, with what tensor parallel splits and how: Qwen3.5 packs
    [q | k | v] in one projection (its output projection told from the square in_proj_z by its name: the value heads'
    width is the hidden size here), Qwen3-Next groups its projections by key head (a contiguous split). Every layer
    is its kind's template's; validate asks tp to divide the mixers' head counts too."""
    from tests.hf_models import build
    from tridist.autotune import Cluster, Strategy, validate

    pytest.importorskip("transformers")
    spec = ModelSpec.from_module(build("qwen3.5", layers=4), seq_len=16)
    s, linear = spec.structure, spec.structure.linear_attention
    assert (s.q, s.o, s.qk_norms) == ("self_attn.q_proj", "self_attn.o_proj", ("self_attn.q_norm", "self_attn.k_norm"))
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attention_output_gate) == (4, 2, 16, True)
    key, value = 4 * 8, 8 * 8
    assert spec.gated_delta_net == GatedDeltaNet(layers=(0, 2), num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=8,
                                                 conv_kernel_size=4, packed_split_outputs=2 * key + value)  # [q | k | v]
    _assert_packed_split_priced(spec, (2, 4))
    assert linear == dataclasses.replace(
        linear, mixer="linear_attn", layers=(0, 2), num_k_heads=4, num_v_heads=8,
        columns=(("in_proj_qkv", (key, key, value)), ("in_proj_z", (value,)), ("in_proj_b", (8,)), ("in_proj_a", (8,))),
        output="out_proj", rows=(("conv1d.weight", (key, key, value)), ("dt_bias", (8,)), ("A_log", (8,))),
        shared=("norm",), counts=("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"))
    assert any("layers 0, 2 mix tokens" in note for note in s.notes), s.notes
    assert "linear attention  model.layers.*.linear_attn in layers 0, 2" in s.describe()
    with pytest.raises(ValueError, match="no tensor-parallel roles for linear attention"):
        s.tp_roles()
    strategy = Strategy(dp=1, tp=8, pp=1, micro_batch_size=1, num_micro_batches=1)
    assert "tp=8 does not divide gated_delta_net.num_k_heads=4" in " ".join(validate(spec, Cluster(1, 8), strategy, global_batch_size=1))
    next_linear = ModelSpec.from_module(build("qwen3-next"), seq_len=16).structure.linear_attention
    assert next_linear.columns == (("in_proj_qkvz", (96,)), ("in_proj_ba", (8,)))  # 2 key heads, each [q k v v z z], [b b a a]
    assert (next_linear.layers, next_linear.rows[0]) == ((0,), ("conv1d.weight", (16, 16, 32)))
    # Not gated: a query projection as wide as the output projection's input, both twice the heads' width by the
    # attributes, is no [query | gate] (the widths decide, not the arithmetic of the counts)
    model = build_model("hf-llama", "tiny")
    for layer in model.model.layers:
        layer.self_attn.q_proj = nn.Linear(64, 128, bias=False)
        layer.self_attn.o_proj = nn.Linear(128, 64, bias=False)
    with pytest.raises(UnrecognisedModel, match="could not determine the number of attention heads"):
        ModelSpec.from_module(model)


def test_linear_attention_that_is_not_read_whole_is_refused():
    """A Gated DeltaNet mixer with a part tensor parallel would not know how to split, value heads that do not group
    over the key heads, a model whose every layer is linear attention (no attention layer to read), and a linear
    layer unlike the first: refused, naming them."""
    from tests.hf_models import build

    pytest.importorskip("transformers")
    model = build("qwen3.5", layers=4)
    model.model.layers[0].linear_attn.extra = nn.Linear(8, 8)
    model.model.layers[2].linear_attn.extra = nn.Linear(8, 8)
    with pytest.raises(UnrecognisedModel, match=r"model\.layers\.0\.linear_attn\.extra \(Linear: weight \(8, 8\), "
                                                 r"bias \(8,\)\) is none of a Gated DeltaNet mixer's parts"):
        ModelSpec.from_module(model)
    model = build("qwen3.5", layers=2)
    model.model.layers[0].linear_attn.num_v_heads = 6
    with pytest.raises(UnrecognisedModel, match=r"model\.layers\.0\.linear_attn: 6 value heads do not group over 4 key"):
        ModelSpec.from_module(model)
    model = build("qwen3.5", layers=4)
    model.model.layers[2].linear_attn.register_parameter("scale", nn.Parameter(torch.ones(3)))
    with pytest.raises(UnrecognisedModel, match=r"model\.layers\.2 outside its MLP is not model\.layers\.0's "
                                                 r"\(linear_attn\.scale only here\)"):
        ModelSpec.from_module(model)
    model = build("qwen3.5", layers=2)
    model.model.layers[1] = build("qwen3.5", layers=2).model.layers[0]
    with pytest.raises(UnrecognisedModel, match="every layer of model.layers mixes tokens by linear attention"):
        ModelSpec.from_module(model)


def test_gated_deltanet_plan_splits_each_mixer_by_head():
    """to_distributed's tensor-parallel plan for Qwen3.5: in the linear layers each mixer's projections column-
    (in_proj_qkv part by part) and row-parallel, its gated norm's gradient summed over the ranks, its convolution's
    and per-head parameters' rows and its counts this rank's, the whole mixer gathering the sequence under sequence
    parallel; attention's styles in the attention layers only. Such a block has no global view to fall back to: the
    block check refuses it by name wherever it could not keep it in local view. Selective recompute wraps the
    attention layers' attention alone (the linear layers have no scores to drop)."""
    from tests.hf_models import build
    from tridist import distcore
    from tridist.distcore.auto import _attention_layers, apply_recompute, tensor_parallel_plan
    from tridist.distcore.block_check import TensorParallelCheckError, _refuse_without_global_view

    pytest.importorskip("transformers")
    model = build("qwen3.5")
    structure = ModelSpec.from_module(model, seq_len=16).structure
    plan = tensor_parallel_plan(model, structure, sequence_parallel=True)
    styles, mixer = plan.styles, "model.layers.0.linear_attn"
    assert {name: [type(x).__name__ for x in kinds] for name, kinds in styles.items() if name.startswith(mixer)} == {
        f"{mixer}.in_proj_qkv": ["ColWiseParallel"], f"{mixer}.in_proj_z": ["ColWiseParallel"],
        f"{mixer}.in_proj_b": ["ColWiseParallel"], f"{mixer}.in_proj_a": ["ColWiseParallel"],
        f"{mixer}.out_proj": ["RowWiseParallel"], f"{mixer}.norm": ["ShardLocalParameters"],
        mixer: ["LocalParameterRows", "SequenceParallelDisable"]}
    assert styles[f"{mixer}.in_proj_qkv"][0].packed_parts == (32, 32, 64) and styles[f"{mixer}.in_proj_z"][0].packed_parts == 1
    rows = styles[mixer][0]
    assert rows.rows == {"conv1d.weight": (32, 32, 64), "dt_bias": (8,), "A_log": (8,)}
    assert rows.counts == ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")
    assert isinstance(rows, distcore.LocalParameterRows) and not rows.global_view
    assert not any(name.startswith("model.layers.0.self_attn") or name.startswith("model.layers.1.linear_attn")
                   for name in styles)
    assert {"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.o_proj"} <= set(styles)
    layers = model.model.layers
    with pytest.raises(TensorParallelCheckError, match=r"\('model\.layers\.0'\) cannot be checked: probe; its "
                                                       r"\['linear_attn'\] run in local view only"):
        _refuse_without_global_view(plan, "model.layers.0", layers[0], "cannot be checked: probe")
    _refuse_without_global_view(plan, "model.layers.1", layers[1], "cannot be checked: probe")  # attention: global view
    apply_recompute(model, layers=structure.layers, attention=structure.attention, mode="selective",
                    attention_layers=_attention_layers(structure))
    wrapped = [n for n, m in model.named_modules() if getattr(m, "_tridist_recompute_wrapper", None) == "selective"]
    assert wrapped == ["model.layers.1.self_attn"], wrapped


def _saved_bytes(run, model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for the backward while `run()` executes, but the model's
    parameters' and buffers' and the input `x`'s (what a mixer keeps of its own)."""
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), x)}
    storages: dict[int, int] = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in skip:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


def _assert_channel_mixer_priced(spec, odd) -> None:
    """A channel mixer's spec: tp 2 divides its channels, and a mixer of `odd` channels (which 4 does not divide) is
    refused naming them; every path of the estimate takes it (tp with and without sp, stages, full recompute)."""
    from tridist.autotune import Cluster, Strategy, estimate
    from tridist.autotune.strategy import tensor_parallel_problems

    assert tensor_parallel_problems(spec, Cluster(1, 8), 2) == []
    problems = tensor_parallel_problems(dataclasses.replace(spec, gated_delta_net=odd), Cluster(1, 8), 4)
    assert any(f"gated_delta_net.channels={odd.channels}" in p for p in problems), problems
    for strategy in (Strategy(1, 2, 1, sequence_parallel=True), Strategy(1, 2, 1, recompute="full"),
                     Strategy(1, 1, 2, num_micro_batches=2)):
        step = estimate(spec, Cluster(1, 2), strategy, global_batch_size=strategy.num_micro_batches).time.total_s
        assert 0 < step < float("inf"), (strategy, step)


def test_short_convolutions_are_read_for_the_split_by_channel():
    """LFM2's gated short convolutions (in_proj to [B | C | x], a depthwise causal convolution over B·x, gated by C;
    refused under tp before: "conv holds a convolution") are read as LinearAttention of kind "short_conv", their
    channels as the heads: in_proj split part by part, out_proj row-parallel, the convolution's rows (with its bias
    where the config has one) this rank's, no count to localise (the code chunks the projection's output). LFM2-MoE's
    first layer is dense beside its convolution: the attention is read from the MoE layer, the MLP from the dense one.
    Priced as a ShortConvolution: every parameter counted; its saved activations six per channel and token, measured
    with saved-tensor hooks on transformers' module; a tp that does not divide the channels is refused naming them. A
    module of another make (a fourth parameter) is not read as one: the convolution is then refused as before."""
    from tests.hf_models import build
    from tridist.autotune import ShortConvolution
    from tridist.autotune.cost import _linear_mixer_bytes
    from tridist.distcore.auto import tensor_parallel_plan

    pytest.importorskip("transformers")
    model = build("lfm2")
    spec = ModelSpec.from_module(model, seq_len=16)
    linear = spec.structure.linear_attention
    assert (linear.kind, linear.mixer, linear.layers, linear.output, linear.counts) == ("short_conv", "conv", (0,), "out_proj", ())
    assert (linear.columns, dict(linear.rows)) == ((("in_proj", (64, 64, 64)),), {"conv.weight": (64,)})
    assert spec.gated_delta_net == ShortConvolution(layers=(0,), channels=64, conv_kernel_size=3)
    assert spec.num_parameters == _count(model)
    styles = tensor_parallel_plan(model, spec.structure, sequence_parallel=True, tp=2).styles
    assert [type(x).__name__ for x in styles["model.layers.0.conv.in_proj"]] == ["ColWiseParallel"]
    assert styles["model.layers.0.conv.in_proj"][0].packed_parts == (64, 64, 64)
    assert [type(x).__name__ for x in styles["model.layers.0.conv.out_proj"]] == ["RowWiseParallel"]
    assert "LocalParameterRows" in [type(x).__name__ for x in styles["model.layers.0.conv"]]
    biased = ModelSpec.from_module(build("lfm2", config=dict(conv_bias=True)), seq_len=16)
    assert dict(biased.structure.linear_attention.rows) == {"conv.weight": (64,), "conv.bias": (64,)}

    # What the mixer keeps for its backward: [B | C | x], B·x, the convolution's output (s + taps - 1 positions:
    # causal_conv1d_fn pads before it slices) and the output projection's input
    model = model.to(torch.bfloat16)
    mixer, (batch, seq) = model.model.layers[0].conv, (2, 16)
    x = torch.randn(batch, seq, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = _saved_bytes(lambda: mixer(x), model, x)
    predicted = batch * seq * _linear_mixer_bytes(ModelSpec.from_module(model, seq_len=seq), 2)
    assert predicted <= saved <= predicted * (1 + (3 - 1) / seq / 6), (saved, predicted)
    # tp splits the channels; one that does not divide them is refused naming them
    _assert_channel_mixer_priced(spec, ShortConvolution(layers=(0,), channels=66))

    moe = ModelSpec.from_module(build("lfm2-moe"), seq_len=16)
    s = moe.structure
    assert (s.linear_attention.layers, s.moe_layers, s.mlp, s.gate, s.attention) == (
        (0,), (1,), "feed_forward", "feed_forward.w1", "self_attn"), s.describe()
    assert moe.num_parameters == _count(build("lfm2-moe"))

    # A module with a fourth parameter beside the three is no short convolution: refused as a convolution, as before
    other = build("lfm2")
    other.model.layers[0].conv.extra = nn.Linear(64, 64)
    with pytest.raises(UnrecognisedModel, match="conv holds a convolution"):
        ModelSpec.from_module(other, seq_len=16)


def test_lightning_attention_is_read_for_the_split_by_head():
    """MiniMax's lightning attention layers (beside softmax attention layers of the same class, under one name;
    refused under tp before: "decoder layers differ") are read as LinearAttention of kind "lightning": qkv_proj (its
    [q k v] laid out per head: one part, a contiguous split) and output_gate column-parallel, out_proj row-parallel,
    the decay buffers this rank's rows (each along its heads: the third dim from the end, as broadcast from
    slope_rate, even where the block is as long as the heads are many), the norm over every head's features with its
    statistics summed (DistributedNorm), num_attention_heads local. Priced as a LightningAttention: every parameter
    counted; its saved activations within 10% of what transformers' torch path keeps (saved-tensor hooks; the formula
    is a least-squares fit whose residual is a few percent); a tp that does not divide the heads is refused naming
    them. A lightning attention with a parameter of its own is refused naming what it expects."""
    from tests.hf_models import build
    from tridist.autotune import LightningAttention
    from tridist.autotune.cost import _linear_mixer_bytes
    from tridist.distcore.auto import tensor_parallel_plan

    pytest.importorskip("transformers")
    model = build("minimax")
    spec = ModelSpec.from_module(model, seq_len=16)
    linear = spec.structure.linear_attention
    assert (linear.kind, linear.mixer, linear.layers, linear.output, linear.counts, linear.whole_norm) == (
        "lightning", "self_attn", (0,), "out_proj", ("num_attention_heads",), "norm")
    assert dict(linear.columns) == {"qkv_proj": (192,), "output_gate": (64,)}
    assert dict(linear.rows) == dict.fromkeys(("slope_rate", "query_decay", "key_decay", "diagonal_decay"), (4,))
    assert dict(linear.row_dims) == {"diagonal_decay": 1}
    assert spec.gated_delta_net == LightningAttention(layers=(0,), channels=4, head_dim=16, block_size=4)
    assert spec.num_parameters == _count(model)
    styles = tensor_parallel_plan(model, spec.structure, sequence_parallel=True, tp=2).styles
    mixer = "model.layers.0.self_attn"
    assert [(type(x).__name__, x.packed_parts) for x in styles[f"{mixer}.qkv_proj"]] == [("ColWiseParallel", 1)]
    assert [type(x).__name__ for x in styles[f"{mixer}.output_gate"]] == ["ColWiseParallel"]
    assert [type(x).__name__ for x in styles[f"{mixer}.out_proj"]] == ["RowWiseParallel"]
    assert [type(x).__name__ for x in styles[f"{mixer}.norm"]] == ["DistributedNorm"]
    assert "LocalParameterRows" in [type(x).__name__ for x in styles[mixer]]

    mixer_module, (batch, seq) = model.model.layers[0].self_attn, (2, 16)
    x = torch.randn(batch, seq, 64, requires_grad=True)
    saved = _saved_bytes(lambda: mixer_module(x, None, None), model, x)
    predicted = batch * seq * _linear_mixer_bytes(spec, 4)  # fp32
    assert 0.9 * predicted <= saved <= 1.1 * predicted, (saved, predicted)
    _assert_channel_mixer_priced(spec, LightningAttention(layers=(0,), channels=6, head_dim=16, block_size=4))

    other = build("minimax")
    other.model.layers[0].self_attn.extra = nn.Parameter(torch.ones(4))
    with pytest.raises(UnrecognisedModel, match="a lightning attention needs .* and no parameters of its own"):
        ModelSpec.from_module(other, seq_len=16)


def test_mamba1_mixers_are_read_for_the_split_by_channel():
    """Jamba's Mamba-1 layers beside attention layers (two layer classes: a decoder-layer list of entries that differ
    in their token mixer alone; before, no decoder-layer list was found, so every strategy but data parallel was
    refused). Read as LinearAttention of kind "mamba1", its channels as the heads: in_proj [x | z] part by part, x_proj
    row-parallel inside the sequence-parallel region with its output's gradient summed over the ranks (`row_shared`),
    the norms over dt, B and C shared, the rows of the convolution, dt_proj, A_log and D this rank's, intermediate_size
    local. Priced as a SelectiveScan (every parameter but the biases counted, as the notes say); its tp must divide the
    channels. Entries of two classes that differ in more than the mixer and their norms are no decoder-layer list."""
    from tests.hf_models import build
    from tridist.autotune import Cluster, SelectiveScan, Strategy, estimate
    from tridist.distcore.auto import tensor_parallel_plan

    pytest.importorskip("transformers")
    model = build("jamba")
    spec = ModelSpec.from_module(model, seq_len=16)
    linear, inner = spec.structure.linear_attention, 128
    assert (linear.kind, linear.mixer, linear.layers, linear.output, linear.counts) == (
        "mamba1", "mamba", (0,), "out_proj", ("intermediate_size",))
    assert (linear.columns, linear.row_shared) == ((("in_proj", (inner, inner)),), ("x_proj", 4 + 2 * 16))
    assert dict(linear.rows) == {name: (inner,) for name in ("conv1d.weight", "conv1d.bias", "dt_proj.weight",
                                                             "dt_proj.bias", "A_log", "D")}
    assert set(linear.shared) == {"dt_layernorm", "b_layernorm", "c_layernorm"}
    assert spec.gated_delta_net == SelectiveScan(layers=(0,), channels=inner, state_size=16, dt_rank=4)
    biases = 2 * inner  # the convolution's and dt_proj's, not counted
    assert spec.num_parameters == _count(model) - biases
    assert "2 bias vector(s) per layer are not counted by the cost model" in spec.structure.notes
    assert (spec.structure.moe_layers, spec.structure.attention) == ((1,), "self_attn")
    styles = tensor_parallel_plan(model, spec.structure, sequence_parallel=True, tp=2).styles
    x_proj = styles["model.layers.0.mamba.x_proj"]
    assert [type(x).__name__ for x in x_proj] == ["RowWiseParallel", "ReduceSharedOutputGradient"]
    assert x_proj[0].inside_region and x_proj[1].features == 36
    assert [type(x).__name__ for x in styles["model.layers.0.mamba.b_layernorm"]] == ["ShardLocalParameters"]
    # Per tp rank the mixer holds 1/tp of its split projections and the rest whole (dt_proj's weight, which its code
    # reads, among them), as the cost model prices it (biases aside)
    split = {name for name, held in styles.items() if {type(x).__name__ for x in held} & {"ColWiseParallel", "RowWiseParallel"}}
    held = sum(p.numel() / (2 if f"model.layers.0.mamba.{n.rpartition('.')[0]}" in split else 1)
               for n, p in model.model.layers[0].mamba.named_parameters() if not n.endswith("bias"))
    assert spec.gated_delta_net.matmul_parameters(64) / 2 + spec.gated_delta_net.other_parameters == held, held
    _assert_channel_mixer_priced(spec, SelectiveScan(layers=(0,), channels=130, state_size=16, dt_rank=4))
    # What it keeps: its channels' share inside the split region, dt, B and C (before and after their norms) whole on
    # every tp rank: 2 x (4 + 2 x 16) per token
    from tridist.autotune.cost import _activation_terms
    outside, inside, core, whole = _activation_terms(spec, 1, 2, moe=False, linear=True)
    assert whole == 16 * 2 * 2 * 36 and core == 0, (inside, whole)
    # its [dt | B | C] all-reduced both ways: tp prices more tensor-parallel communication than without it
    tp2 = Strategy(1, 2, 1)
    alone = dataclasses.replace(spec, gated_delta_net=dataclasses.replace(spec.gated_delta_net, state_size=1, dt_rank=1))
    assert estimate(spec, Cluster(1, 2), tp2, global_batch_size=1).time.tp_comm_s > \
        estimate(alone, Cluster(1, 2), tp2, global_batch_size=1).time.tp_comm_s

    # dt_rank + 2 x d_state the hidden size (32 + 2 x 16 = 64): x_proj and out_proj of one shape, told apart by
    # their order (x_proj first); read the other way round, x_proj would be the region's exit and out_proj's gradient
    # summed over the ranks
    alike = ModelSpec.from_module(build("jamba", config=dict(mamba_dt_rank=32)), seq_len=16).structure.linear_attention
    assert (alike.output, alike.row_shared) == ("out_proj", ("x_proj", 64)), (alike.output, alike.row_shared)

    # OLMo-Hybrid's layers differ in their norms too (pre-norm linear-attention layers, post-norm attention layers):
    # the same list (before: no decoder-layer list found), each kind's norms its own
    hybrid = build("olmo-hybrid")
    spec = ModelSpec.from_module(hybrid, seq_len=16)
    assert (spec.structure.layers, spec.structure.linear_attention.layers) == ("model.layers", (0,))
    assert spec.num_parameters == _count(hybrid)

    class Other(nn.Module):  # a second class with other children beside its mixer
        def __init__(self):
            super().__init__()
            self.mamba, self.extra, self.feed_forward = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    mixed = build("jamba")
    mixed.model.layers[1] = Other()
    with pytest.raises(UnrecognisedModel, match="no decoder-layer list found"):
        ModelSpec.from_module(mixed, seq_len=16)


def test_kimi_delta_attention_mixers_are_read_for_the_split_by_head():
    """Kimi Delta Attention mixers (Kimi Linear; Ling's hybrid, transformers' bailing_hybrid) beside latent attention:
    refused under tp before (a convolution in the attention block). Read as LinearAttention of kind "kda": q, k, v,
    beta, the decay gate's and the output gate's projections column-parallel (Kimi's from low-rank latents, whose
    down-projections stay whole), o_proj row-parallel, the convolution's, time-step bias's and decay's rows this
    rank's (Kimi's decay A_log [1, 1, heads, 1] along dim 2), the gated norm shared, the head counts of the mixer
    and of its forget gate local. Ling's latent attention's per-head output gate is split with the query heads. A
    parameter of another shape in the mixer is refused, naming it."""
    from tests.hf_models import build
    from tridist.distcore.auto import tensor_parallel_plan

    pytest.importorskip("transformers")
    kimi = build("kimi-linear")
    linear = ModelSpec.from_module(kimi, seq_len=16).structure.linear_attention
    assert (linear.kind, linear.layers, linear.output, linear.shared) == ("kda", (1,), "o_proj", ("o_norm",))
    assert {n for n, _ in linear.columns} == {"q_proj", "k_proj", "v_proj", "b_proj", "forget_gate.f_b_proj", "g_b_proj"}
    assert dict(linear.rows) == {"conv1d.weight": (64, 64, 64), "forget_gate.dt_bias": (64,), "forget_gate.A_log": (4,)}
    assert linear.row_dims == (("forget_gate.A_log", 2),)
    assert set(linear.counts) == {"num_heads", "qkv_dim", "conv_dim", "forget_gate.num_heads", "forget_gate.qkv_dim"}
    styles = tensor_parallel_plan(kimi, ModelSpec.from_module(kimi, seq_len=16).structure, sequence_parallel=True).styles
    assert "model.layers.1.self_attn.forget_gate.f_a_proj" not in styles  # the latent's down-projection: whole
    rows = next(x for x in styles["model.layers.1.self_attn"] if type(x).__name__ == "LocalParameterRows")
    assert rows.dims == {"forget_gate.A_log": 2}
    ling = build("ling-hybrid")
    spec = ModelSpec.from_module(ling, seq_len=16)
    assert {n for n, _ in spec.structure.linear_attention.columns} == {"q_proj", "k_proj", "v_proj", "b_proj",
                                                                       "forget_gate.f_proj", "g_proj"}
    assert spec.structure.linear_attention.row_dims == () and spec.structure.attention_gate == "self_attn.g_proj"
    assert "self_attn.g_proj gives one output gate per head (4), priced as none" in spec.structure.notes
    # The models' own layer order: linear layers first, the dense first layer a linear one (refused before: "the dense
    # layers all mix tokens by linear attention"); its MLP read there, the attention from the MoE layer. Kimi's with
    # 8 heads of 8: its latents' down-projections (64 -> 8) stay whole, found by their up-projections beside them.
    for family in ("kimi-linear-first", "ling-hybrid-first"):
        spec = ModelSpec.from_module(build(family), seq_len=16)
        s = spec.structure
        assert (s.mlp, s.gate, s.down, s.moe_layers, s.linear_attention.layers) == (
            "mlp", "mlp.gate_proj", "mlp.down_proj", (1, 2), (0, 1)), s.describe()
    columns = {n for n, _ in ModelSpec.from_module(build("kimi-linear-first"), seq_len=16).structure.linear_attention.columns}
    assert columns == {"q_proj", "k_proj", "v_proj", "b_proj", "forget_gate.f_b_proj", "g_b_proj"}, columns
    ling.model.layers[1].self_attn.forget_gate.extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(UnrecognisedModel, match=r"forget_gate\.extra \(3,\) is no parameter of one entry per head"):
        ModelSpec.from_module(ling, seq_len=16)


def test_local_parameter_rows_swap_and_refusals():
    """LocalParameterRows (a Gated DeltaNet mixer's style) on a world of one: the forward sees plain local rows, the
    parameters stay whole DTensors after every forward (also beside ShardLocalParameters on the same module, whose
    swap keeps what the other put aside), and after a forward that raised, gradients reach them; a parameter already split, a name that is no
    parameter and parts that are not its rows are refused naming them, before the module is changed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from tridist.distcore import LocalParameterRows, ShardLocalParameters
    from tridist.distcore.tensor_parallel import StyleTarget

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(4, 4, 2, groups=4, bias=False)
            self.A = nn.Parameter(torch.arange(4.0))
            self.extra = nn.Parameter(torch.ones(3))
            self.heads = 4
            self.fail = False

        def forward(self, x):
            assert not any(isinstance(p, DTensor) for p in (self.A, self.conv.weight, self.extra))  # local values
            if self.fail:
                raise RuntimeError("the forward failed")
            self.seen = getattr(self, "scale", None)  # the buffer this call reads
            return (x * self.A).sum() + self.conv.weight.sum() + self.extra.sum()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("mp",))
        mixer = Mixer()
        for style in (LocalParameterRows(rows={"conv.weight": (2, 2), "A": (4,)}, counts=("heads",)), ShardLocalParameters()):
            style.apply(StyleTarget("mixer", mixer, None, tp_mesh=mesh, process_mesh=None))
        for _ in range(2):
            mixer(torch.ones(4)).backward()
            assert all(isinstance(p, DTensor) for p in mixer._parameters.values()), mixer._parameters
        assert isinstance(mixer.conv.weight, DTensor) and mixer.A.grad.to_local().tolist() == [2.0] * 4
        # A forward that raises: each style's swap-back runs regardless (each alone on a module, where no other
        # style's would put its parameters back; and both together).
        for style in (LocalParameterRows(rows={"A": (4,)}), ShardLocalParameters(), None):
            module = mixer if style is None else Mixer()
            if style is not None:
                style.apply(StyleTarget("m", module, None, tp_mesh=mesh, process_mesh=None))
            module.fail = True
            with pytest.raises(RuntimeError, match="the forward failed"):
                module(torch.ones(4))
            assert isinstance(module.A, DTensor), (style, module.A)
        for module, rows, why in ((mixer, {"A": (4,)}, "m.A is split already"),  # ShardLocalParameters made it one
                                  (Mixer(), {"B": (4,)}, "names m.B, which is no parameter or buffer of Mixer"),
                                  (Mixer(), {"nope.weight": (4,)}, "names m.nope.weight, which is no parameter"),
                                  (Mixer(), {"A": (4,), "conv.weight": (2, 3)}, r"conv.weight \(shape \(4, 1, 2\)\) "
                                                                               r"does not split as rows of parts \[2, 3\]")):
            with pytest.raises(ValueError, match=why):
                LocalParameterRows(rows=rows).apply(StyleTarget("m", module, None, tp_mesh=mesh, process_mesh=None))
            assert not isinstance(module.A, DTensor) or module is mixer  # refused before anything changed
        # Buffers: a persistent one (MiniMax's decays) stays whole, this rank's rows swapped in around each call (its
        # checkpoint holds the whole); a non-persistent one's (Falcon-H1's mup_vector) rows are taken once, or where it
        # is still on the meta device (LazyGuard materialises it later) at the first forward
        module = Mixer()
        module.register_buffer("scale", torch.arange(4.0))
        whole = module.scale
        LocalParameterRows(rows={"scale": (4,)}).apply(StyleTarget("m", module, None, tp_mesh=mesh, process_mesh=None))
        module(torch.ones(4))
        assert module.seen is not whole and torch.equal(module.seen, whole)  # this rank's rows: all of them on one
        assert module.scale is whole and module.state_dict()["scale"].data_ptr() == whole.data_ptr()
        module = Mixer()
        module.register_buffer("scale", torch.empty(1, 4, device="meta"), persistent=False)
        LocalParameterRows(rows={"scale": (4,)}, dims={"scale": 1}).apply(
            StyleTarget("m", module, None, tp_mesh=mesh, process_mesh=None))
        assert module.scale.is_meta
        module.register_buffer("scale", torch.full((1, 4), 2.0), persistent=False)  # as materialize() puts it
        module(torch.ones(4))
        assert module.scale.tolist() == [[2.0] * 4] and "scale" not in module.state_dict()
    finally:
        dist.destroy_process_group()


def test_replicated_colwise_on_a_world_of_one_and_its_refusals():
    """ReplicatedColWiseParallel on a world of one (one group of one rank: the whole output) computes the Linear's
    output and gradients; its parameters stay whole DTensors after a forward; what it cannot split is refused naming
    it before the module changes (replicas that do not divide the ranks, not a Linear, a parameter split already)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from tridist.distcore import ReplicatedColWiseParallel
    from tridist.distcore.tensor_parallel import StyleTarget

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("mp",))
        torch.manual_seed(0)
        linear, x = nn.Linear(4, 6), torch.randn(3, 4, requires_grad=True)
        reference = nn.Linear(4, 6)
        reference.load_state_dict(linear.state_dict())
        ReplicatedColWiseParallel(replicas=1).apply(StyleTarget("k", linear, None, tp_mesh=mesh, process_mesh=None))
        out = linear(x)
        assert type(out) is torch.Tensor and torch.equal(out, reference(x))
        out.sum().backward()
        reference(x).sum().backward()
        assert isinstance(linear.weight, DTensor) and isinstance(linear.bias, DTensor)
        assert torch.equal(linear.weight.grad.full_tensor(), reference.weight.grad)
        for module, replicas, why in ((nn.Linear(4, 6), 2, r"replicas=2\) on 'k': replicas must be a positive integer "
                                                            "dividing the 1 tensor-parallel ranks"),
                                      (nn.Conv1d(4, 4, 1), 1, "a Conv1d, not an nn.Linear"),
                                      (linear, 1, "k.weight is split already")):
            with pytest.raises(ValueError, match=why):
                ReplicatedColWiseParallel(replicas=replicas).apply(StyleTarget("k", module, None, tp_mesh=mesh,
                                                                               process_mesh=None))
            assert module is linear or not isinstance(module.weight, DTensor)  # refused before anything changed
    finally:
        dist.destroy_process_group()


def test_spec_validation_and_presets():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelSpec(2, 64, 4, 128, 100, num_kv_heads=3)
    with pytest.raises(ValueError, match="positive integer"):
        ModelSpec(0, 64, 4, 128, 100)
    llama70 = preset("llama2-70b")
    assert 68e9 < llama70.num_parameters < 70e9 and llama70.kv_size == 1024
    assert 6.6e9 < preset("llama2-7b").num_parameters < 6.8e9
    # Megatron's published sizes (Narayanan et al. 2021, Table 1): 18.4B, 39.1B, 76.1B, 145.6B, 310.1B
    for name, billions in (("megatron-18.4b", 18.4), ("megatron-39.1b", 39.1), ("megatron-76.1b", 76.1),
                           ("megatron-145.6b", 145.6), ("megatron-310.1b", 310.1)):
        assert preset(name).num_parameters / 1e9 == pytest.approx(billions, rel=0.01)
    assert preset("gpt3-175b").num_parameters / 1e9 == pytest.approx(175, rel=0.02)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("nope")
    assert dataclasses.replace(preset("llama2-7b"), seq_len=2048) == preset("llama2-7b", seq_len=2048)


def test_packed_grouped_query_qkv_is_flagged_for_the_cost_model():
    """Phi-3 packs q/k/v with fewer key/value heads: the spec says so (tensor parallel then pays a
    reduce-scatter of the packed output, cost.py); equal parts and separate projections do not."""
    pytest.importorskip("transformers")
    from tests.hf_models import build

    assert ModelSpec.from_module(build("phi3", layers=1), seq_len=16).packed_unequal_qkv
    assert not ModelSpec.from_module(build("llama", layers=1), seq_len=16).packed_unequal_qkv
    assert not ModelSpec.from_module(build_model("paddle-llama"), seq_len=16).packed_unequal_qkv  # packed, equal parts


def test_distcore_limits_overlap_for_unequal_packed_qkv():
    """Phi-3's packed grouped-query qkv cannot feed the overlapped all-gather ring: distcore says so, and
    to_distributed's search keeps overlap off for it (with the reason); a packed qkv of equal parts can."""
    pytest.importorskip("transformers")
    from tests.hf_models import build
    from tridist.distcore.auto import unsupported

    phi3 = unsupported(ModelSpec.from_module(build("phi3", layers=1), seq_len=16))
    assert "unequal sizes" in phi3["overlap_tp_comm"] and "tp" not in phi3
    assert "overlap_tp_comm" not in unsupported(ModelSpec.from_module(build_model("paddle-llama"), seq_len=16))


def _query_key_value_models():
    """GPT-NeoX ([q k v] per head), Bloom (the same, and ALiBi), Persimmon (the same, per-head q/k norms) and Falcon's
    three layouts ([q..q k v] per key/value head; multi-query: one head, so [q | k | v]; per head), tiny."""
    hf = pytest.importorskip("transformers")
    common = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=1)
    falcon = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=1)
    return {
        "gpt-neox": hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**common, intermediate_size=128, rotary_pct=0.5)),
        "bloom": hf.BloomForCausalLM(hf.BloomConfig(vocab_size=128, hidden_size=64, n_layer=1, n_head=4)),
        "persimmon": hf.PersimmonForCausalLM(hf.PersimmonConfig(**common, intermediate_size=128)),
        "falcon-grouped": hf.FalconForCausalLM(hf.FalconConfig(**falcon, num_kv_heads=2, new_decoder_architecture=True)),
        "falcon-multi-query": hf.FalconForCausalLM(hf.FalconConfig(**falcon)),
        "falcon-per-head": hf.FalconForCausalLM(hf.FalconConfig(**falcon, multi_query=False)),
    }


def test_query_key_value_is_split_by_key_value_head_and_tensor_parallel_allowed():
    """Every transformers model naming its packed projection `query_key_value` holds [q..q k v] per key/value head:
    the structure says so, distcore's plan splits it contiguously (each rank's heads whole, no reduce-scatter, so
    the overlapped ring may feed it) and tensor parallel is no longer refused for it (it was, the layout "not told";
    the block check now tells a code that packs otherwise: tests/distributed/transformers_worker.py). Phi-3's
    `qkv_proj` stays [q | k | v], split part by part."""
    from tests.hf_models import build
    from tridist.distcore.auto import tensor_parallel_plan, unsupported
    from tridist.distcore.tensor_parallel import ColWiseParallel

    for name, model in _query_key_value_models().items():
        spec = ModelSpec.from_module(model, seq_len=16)
        assert spec.structure.qkv.endswith("query_key_value") and spec.structure.qkv_interleaved, name
        assert spec.qkv_interleaved and unsupported(spec) == {}, (name, unsupported(spec))
        heads = spec.num_kv_heads
        plan = tensor_parallel_plan(model, spec.structure, sequence_parallel=False, tp=2 if heads % 2 == 0 else 1)
        styles = plan.styles[f"{spec.structure.layers}.0.{spec.structure.qkv}"]
        assert styles == [ColWiseParallel(packed_parts=1)], (name, styles)
    assert ModelSpec.from_module(_query_key_value_models()["falcon-grouped"], seq_len=16).packed_unequal_qkv
    phi3 = ModelSpec.from_module(build("phi3", layers=1), seq_len=16)
    assert not phi3.qkv_interleaved and not phi3.structure.qkv_interleaved and phi3.structure.qkv_sizes == (64, 32, 32)


def test_key_value_heads_fewer_than_the_ranks_are_replicated_inside_a_packed_qkv():
    """A packed [q | k | v] whose key/value heads tp exceeds (Falcon's and GPTBigCode's multi-query attention: one
    head; Phi-3's grouped-query qkv_proj at tp 4): tp is allowed (it was refused) and the plan splits the query part
    over the ranks with each key/value head computed on tp / heads of them. Falcon's [q..q k v] for each of several
    key/value heads cannot give replicas: that tp stays refused, by autotune and by the plan."""
    hf = pytest.importorskip("transformers")
    from tests.hf_models import build
    from tridist.autotune import Cluster
    from tridist.autotune.strategy import tensor_parallel_problems
    from tridist.distcore.auto import tensor_parallel_plan
    from tridist.distcore.tensor_parallel import ReplicatedColWiseParallel

    models = _query_key_value_models()
    models["gpt-bigcode"] = hf.GPTBigCodeForCausalLM(hf.GPTBigCodeConfig(vocab_size=128, n_embd=64, n_head=4, n_layer=1))
    models["phi3"] = build("phi3", layers=1)
    for name, tp, qkv in (("falcon-multi-query", 2, "transformer.h.0.self_attention.query_key_value"),
                          ("gpt-bigcode", 4, "transformer.h.0.attn.c_attn"),
                          ("phi3", 4, "model.layers.0.self_attn.qkv_proj")):
        spec = ModelSpec.from_module(models[name], seq_len=16)
        assert tensor_parallel_problems(spec, Cluster(1, tp), tp) == [], name
        plan = tensor_parallel_plan(models[name], spec.structure, sequence_parallel=False, tp=tp)
        replicas = tp // spec.num_kv_heads
        assert plan.styles[qkv] == [ReplicatedColWiseParallel(replicas, packed_query=64)], (name, plan.styles[qkv])
    grouped = models["falcon-grouped"]
    spec = ModelSpec.from_module(grouped, seq_len=16)
    problems = tensor_parallel_problems(spec, Cluster(1, 4), 4)
    assert any("packing [q..q k v] for each key/value head cannot be" in p for p in problems), problems
    with pytest.raises(ValueError, match="packs \\[q..q k v\\] for each of its 2 key/value heads"):
        tensor_parallel_plan(grouped, spec.structure, sequence_parallel=False, tp=4)


def test_a_learned_position_embedding_is_found_and_the_sequence_split_after_it():
    """OPT's and GPTBigCode's learned absolute positions (an nn.Embedding of the hidden width outside the layers, a row
    per position, OPT's offset by 2) are recognised; under sequence parallel the plan splits the sequence after that
    lookup, not after the token embedding's (its parameters ran on sequence slices: refused before). Llama has none."""
    pytest.importorskip("transformers")
    from tests.hf_models import build
    from tridist.distcore.auto import tensor_parallel_plan
    from tridist.distcore.tensor_parallel import SequenceParallelBegin

    for family, embedding, positions in (("opt", "model.decoder.embed_tokens", "model.decoder.embed_positions"),
                                         ("gpt-bigcode", "transformer.wte", "transformer.wpe"),
                                         ("llama", "model.embed_tokens", None)):
        model = build(family, layers=1)
        structure = ModelSpec.from_module(model, seq_len=16).structure
        assert (structure.embedding, structure.position_embedding) == (embedding, positions), family
        plan = tensor_parallel_plan(model, structure, sequence_parallel=True, tp=2)
        begins = [name for name, styles in plan.styles.items() if any(isinstance(s, SequenceParallelBegin) for s in styles)]
        assert begins == [positions or embedding], (family, begins)


def test_a_task_head_is_told_apart_from_a_tied_lm_head():
    """Sequence and token classifiers (reward models' `score`) and question answering end in a head of their
    own, not the vocabulary's: the structure names it, and distcore allows tp and pp for it (it refused them,
    taking the embedding for an LM head the forward uses itself). LM heads, tied or not, have none."""
    hf = pytest.importorskip("transformers")
    from tests.hf_models import HIDDEN, KV_HEADS, HEADS, VOCAB, build
    from tridist.distcore.auto import unsupported

    config = hf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
                            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, pad_token_id=2, num_labels=3)
    for cls, head in ((hf.LlamaForSequenceClassification, "score"), (hf.LlamaForTokenClassification, "score"),
                      (hf.LlamaForQuestionAnswering, "qa_outputs")):
        spec = ModelSpec.from_module(cls(config), seq_len=16)
        assert spec.structure.task_head == head and spec.structure.lm_head is None, cls.__name__
        assert spec.head_outputs == (2 if head == "qa_outputs" else 3) and not spec.tied_embeddings  # priced so
        limits = unsupported(spec)
        assert "tp" not in limits and "pp" not in limits, limits
    for family in ("llama", "llama-tied", "gemma"):
        structure = ModelSpec.from_module(build(family, layers=1), seq_len=16).structure
        assert structure.task_head is None and structure.lm_head == "lm_head", family


def test_qk_norms_are_recognised_by_their_size():
    """q/k norms under the attention module are told apart by their weight's size: head_dim (Qwen3, one
    weight applied to every head) or the q / kv projection's width (OLMo2, all heads' features). They are
    not layer norms (OLMo2's q norm is hidden-wide here: 4 heads x 16 = 64), and their weights count."""
    pytest.importorskip("transformers")
    import transformers as hf

    from tests.hf_models import build

    qwen3, olmo2, llama = (build(name, layers=1) for name in ("qwen3", "olmo2", "llama"))
    specs = {name: ModelSpec.from_module(model, seq_len=16) for name, model in
             (("qwen3", qwen3), ("olmo2", olmo2), ("llama", llama))}
    assert {name: spec.qk_norm for name, spec in specs.items()} == {"qwen3": "head", "olmo2": "projection", "llama": None}
    for name in ("qwen3", "olmo2"):
        s = specs[name].structure
        assert s.qk_norms == ("self_attn.q_norm", "self_attn.k_norm") and not s.notes
        assert "self_attn.q_norm" not in s.layer_norms and len(s.layer_norms) == 2
        assert "q/k norms" in s.describe()
    assert specs["llama"].structure.qk_norms == ()
    assert specs["qwen3"].qk_norm_parameters == 2 * 16 and specs["olmo2"].qk_norm_parameters == 64 + 32
    for name, model in (("qwen3", qwen3), ("olmo2", olmo2), ("llama", llama)):
        assert specs[name].num_parameters == _count(model)
    # One kv head: OLMo2's k norm is head_dim wide, its q norm (4 x 16) still makes it "projection".
    mqa = hf.Olmo2ForCausalLM(hf.Olmo2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=1))
    assert ModelSpec.from_module(mqa, seq_len=16).qk_norm == "projection"
    with torch.device("meta"):  # structure only, as for the other families
        assert ModelSpec.from_module(build("qwen3", layers=1), seq_len=16).qk_norm == "head"
    with pytest.raises(ValueError, match="qk_norm must be one of"):
        ModelSpec(2, 64, 4, 128, 100, qk_norm="per-head")
    spec = dataclasses.replace(preset("llama3-8b"), qk_norm="head")  # hashable, as the cost model's cache needs
    assert spec != preset("llama3-8b") and hash(spec) == hash(dataclasses.replace(preset("llama3-8b"), qk_norm="head"))


def test_an_attention_output_gate_of_its_own_is_split_with_the_query_heads():
    """A projection beside q/k/v gating the attention's output: AFMoE's gate_proj (heads x head_dim: priced as a gated
    query's extra outputs) and Laguna's g_proj (one gate per head: priced as none, noted), each column-parallel in
    to_distributed's plan. A projection of another name or width is no gate (it stays whole, for the block check
    to judge); Qwen3.5's gate inside its query projection is the query's."""
    from tests.hf_models import build
    from tridist.distcore.auto import tensor_parallel_plan

    pytest.importorskip("transformers")
    afmoe, laguna = build("afmoe"), build("laguna")
    a, g = ModelSpec.from_module(afmoe, seq_len=16), ModelSpec.from_module(laguna, seq_len=16)
    assert (a.structure.attention_gate, a.attention_output_gate) == ("self_attn.gate_proj", True)
    assert (g.structure.attention_gate, g.attention_output_gate) == ("self_attn.g_proj", False)
    assert "self_attn.g_proj gives one output gate per head (4), priced as none" in g.structure.notes
    assert "attention output gate model.layers.*.self_attn.gate_proj" in " ".join(a.structure.describe().split())
    # the gate's weights priced as a gated query's: q_size more outputs of the column-parallel projections
    ungated = dataclasses.replace(a, attention_output_gate=False)
    assert a.attention_parameters - ungated.attention_parameters == a.hidden_size * a.q_size
    for model, spec, gate in ((afmoe, a, "gate_proj"), (laguna, g, "g_proj")):
        styles = tensor_parallel_plan(model, spec.structure, sequence_parallel=True).styles
        assert [type(x).__name__ for x in styles[f"model.layers.1.self_attn.{gate}"]] == ["ColWiseParallel"]
    assert not ModelSpec.from_module(build("qwen3.5"), seq_len=16).structure.attention_gate
    # A gate-named projection whose width fits no head count, and one named otherwise, are not read as gates
    for name, width in (("gate_proj", 24), ("extra_proj", 64)):
        model = build("llama", layers=1)
        attention = model.model.layers[0].self_attn
        delattr(attention, "gate_proj") if hasattr(attention, "gate_proj") else None
        setattr(attention, name, nn.Linear(64, width, bias=False))
        spec = ModelSpec.from_module(model, seq_len=16)
        assert spec.structure.attention_gate is None and not spec.attention_output_gate, name


def test_value_heads_of_their_own_width_are_recognised_and_priced():
    """MiMo-V2-Flash's value heads are wider than its query/key heads: recognised (refused before, "key and value
    projections differ in width") with v_head_dim, which the spec prices: the value projection's and the output
    projection's weights are the model's. Its sliding layers' sinks (a parameter its full layers have not) are noted,
    not refused; a layer that lacks another parameter still is. A value projection that is no set of value heads of
    the key/value heads' count, or a v_head_dim beside latent attention, is refused."""
    from tests.hf_models import build
    from tridist.autotune.model import LatentAttention

    pytest.importorskip("transformers")
    model = build("mimo-v2-flash", layers=3)
    spec = ModelSpec.from_module(model, seq_len=16)
    assert (spec.head_dim, spec.v_head_dim, spec.num_heads, spec.num_kv_heads) == (16, 32, 4, 2)
    attention = model.model.layers[0].self_attn  # a full-attention layer, the template
    weights = sum(p.numel() for n, p in attention.named_parameters() if n.endswith("weight"))
    assert spec.attention_parameters == weights, (spec.attention_parameters, weights)
    assert (spec.value_size, spec.attention_output_size) == (2 * 32, 4 * 32)
    assert "self_attn.sinks in some layers only (priced as none)" in spec.structure.notes
    del model.model.layers[1].self_attn.q_proj.weight  # a layer lacking a projection's weight is still refused
    model.model.layers[1].self_attn.q_proj.register_parameter("weight", None)
    with pytest.raises(UnrecognisedModel, match="decoder layers differ"):
        ModelSpec.from_module(model, seq_len=16)
    model = build("mimo-v2-flash", layers=3)
    for layer in model.model.layers:  # 3 value heads of 32 each: not the 2 key/value heads'
        layer.self_attn.v_proj = nn.Linear(64, 96, bias=False)
    with pytest.raises(UnrecognisedModel, match="key and value projections differ in width"):
        ModelSpec.from_module(model, seq_len=16)
    with pytest.raises(ValueError, match="v_head_dim is the value heads' width of plain attention"):
        dataclasses.replace(spec, v_head_dim=32, latent_attention=LatentAttention(
            kv_lora_rank=16, rope_head_dim=8, v_head_dim=16), structure=None)


def test_modules_no_plan_names_are_priced_whole_and_rule_out_sequence_parallel():
    """LongCat-Flash's second attention and MLP and its experts, Falcon-H1's Mamba mixer: modules of the decoder
    layers holding parameters outside what the structure reads (ModelStructure.unplanned, the top-most of each).
    The spec counts them (before: LongCat priced without nine tenths of its parameters), the cost model holds them
    whole on every tp rank and runs them over every token there, and distcore leaves sequence parallel out (on a
    rank's slice their gradients would be partial). A Llama has none; norm-like modules are not counted as such."""
    from tests.hf_models import build
    from tridist.autotune import cost
    from tridist.distcore.auto import unsupported

    pytest.importorskip("transformers")
    longcat = build("longcat-flash")
    spec = ModelSpec.from_module(longcat, seq_len=16)
    assert spec.structure.unplanned == ("mlp", "self_attn.1", "mlps.1"), spec.structure.unplanned
    layer = longcat.model.layers[0]
    assert spec.unplanned_parameters == sum(p.numel() for m in (layer.mlp, layer.self_attn[1], layer.mlps[1])
                                            for p in m.parameters())
    counted = sum(p.numel() for p in longcat.parameters())
    assert abs(spec.num_parameters - counted) < 0.01 * counted, (spec.num_parameters, counted)
    assert "hold parameters no plan names" in unsupported(spec)["sequence_parallel"]
    without = dataclasses.replace(spec, unplanned_parameters=0, structure=None)
    for tp in (1, 2):  # whole on every rank: the same count at any tp
        got, _ = cost._layer_parameters(spec, tp, 1, False, 1)
        assert got - cost._layer_parameters(without, tp, 1, False, 1)[0] == spec.unplanned_parameters
    tokens = 2 * 16  # forward FLOPs: two per weight per token
    assert cost.model_flops_per_step(spec, 2) - cost.model_flops_per_step(without, 2) == \
        cost.FWD_BWD_PASSES * tokens * 2 * spec.unplanned_parameters * spec.num_layers
    # Falcon-H1's mixer beside its attention is split (not whole): both priced in every layer, sp allowed
    falcon = ModelSpec.from_module(build("falcon-h1"), seq_len=16)
    assert falcon.structure.unplanned == () and "sequence_parallel" not in unsupported(falcon)
    linear = falcon.gated_delta_net
    assert linear.beside_attention and falcon.linear_layer_indices == (0, 1)
    both = 2 * (falcon.attention_parameters + linear.matmul_parameters(64) + falcon.mlp_parameters)
    cores = 2 * 16 * (falcon.q_size + falcon.attention_output_size) + cost._linear_core_flops(falcon)[0]
    assert cost.layer_forward_flops(falcon) == (both + cores,) * 2
    one_rank, two_ranks = (cost._layer_parameters(falcon, tp, 1, False, 1, True)[0] for tp in (1, 2))
    whole = linear.other_parameters + 2 * 64  # the mixer's convolution, per-head parameters; the two norms
    # all else split by tp but B and C of its one state group, whole on both ranks: 2 x 16 x 64 priced as half
    assert cost._replicated_key_columns(falcon, 2) == 16 and cost._replicated_key_columns(falcon, 1) == 0
    assert one_rank - whole == 2 * (two_ranks - whole - 16 * 64)
    counted = sum(p.numel() for p in build("falcon-h1").parameters())
    assert abs(falcon.num_parameters - counted) < 0.01 * counted, (falcon.num_parameters, counted)
    llama = ModelSpec.from_module(build("llama"), seq_len=16)
    assert llama.structure.unplanned == () and llama.unplanned_parameters == 0
    # Every kind of layer is scanned: here the only full-attention layer (an MoE one, after a dense and an MoE linear
    # layer), which the first version did not look at
    kimi = build("kimi-linear-first")
    kimi.model.layers[2].extra = nn.Linear(64, 64)
    assert ModelSpec.from_module(kimi, seq_len=16).structure.unplanned == ("extra",)


def test_a_heterogeneous_config_is_read_from_the_layers():
    """transformers' heterogeneous configs (Dots 3: per-layer attributes) raise on a global read of a per-layer
    attribute such as num_key_value_heads: the structure reads it as absent (the shapes decide) and refuses the
    model for its layers of other kinds (the DSA indexer in some), naming them; before, the config's RuntimeError
    escaped to_distributed."""
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=64, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                 qk_nope_head_dim=12, v_head_dim=16, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                 topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1, pad_token_id=2)  # latent attention, as its own
    config = transformers.AutoConfig.for_model("dots3_note_text", **sizes)
    with pytest.raises(RuntimeError, match="per-layer attribute"):
        config.num_key_value_heads
    assert readable_attr(config, "num_key_value_heads") is None
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnrecognisedModel, match=r"decoder layers differ: model\.layers\.\d outside its MLP .*indexer"):
        ModelSpec.from_module(model)


def test_layers_of_another_kind_are_refused_and_other_shapes_noted():
    """The structure names one layer's modules and every plan applies them to every layer: a layer of another
    kind (an attention whose key projection has another name; a dense layer whose MLP names other modules) is
    refused, naming the difference; layers of other shapes only (Gemma 4's global layers, wider heads) are
    recognised, with a note that the cost model prices them as the first. (transformers' MiniMax was the first
    example until its lightning attention layers were read as linear mixers.)"""
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    other = build_model("hf-llama", "tiny")
    other.model.layers[1].self_attn.key = other.model.layers[1].self_attn.k_proj
    del other.model.layers[1].self_attn.k_proj
    with pytest.raises(UnrecognisedModel, match=r"decoder layers differ: model\.layers\.1 outside its MLP .*"
                                                 r"self_attn\.k_proj\.weight missing"):
        ModelSpec.from_module(other)
    # Per-layer inputs of 16 features x 4 layers: that embedding's table is [vocab, hidden] like the head's, and is
    # no head (it was taken for the head, which tensor parallel then split as a Linear)
    gemma4 = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "gemma4_text", **sizes, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16))
    spec = ModelSpec.from_module(gemma4)
    assert any("layers 3 have other parameter shapes than layer 0" in note for note in spec.structure.notes), spec.structure.notes
    structure = spec.structure
    assert (structure.embedding, structure.lm_head, structure.tied_embeddings) == ("model.embed_tokens", "lm_head", True)
    model = build_model("hf-llama", "tiny")
    model.model.layers[1].mlp.w_in = model.model.layers[1].mlp.up_proj  # one dense MLP names another module
    del model.model.layers[1].mlp.up_proj
    with pytest.raises(UnrecognisedModel, match=r"model\.layers\.1 in its MLP .*mlp\.up_proj\.weight missing, "
                                                 r"mlp\.w_in\.weight only here"):
        ModelSpec.from_module(model)


def test_eager_attention_keeps_its_scores_for_the_cost_model():
    """transformers' eager attention keeps the s x s scores' fp32 softmax and its cast to the compute dtype for the
    backward (6 bytes per score in bf16: measured here with saved-tensor hooks on a tiny bf16 Llama; flash
    attention's and SDPA's keep none): `flash_attention` is False and `softmax_fp32` True, so the cost model prices
    them and selective recompute (of the attention core) is a valid choice. SDPA, transformers' default, and a
    hand-written model: flash attention."""
    import transformers

    from tridist.autotune import Cluster, Strategy, estimate, validate
    from tridist.autotune.cost import SOFTMAX_FP32_BYTES
    from tests.hf_models import build

    eager, sdpa = (ModelSpec.from_module(build(family), seq_len=4096) for family in ("phi3-eager", "phi3"))
    assert (eager.flash_attention, eager.softmax_fp32, sdpa.flash_attention, sdpa.softmax_fp32) == (False, True, True, False)
    assert dataclasses.replace(eager, flash_attention=True, softmax_fp32=False) == sdpa  # nothing else differs
    assert ModelSpec.from_module(build_model("seed-llama"), seq_len=64).flash_attention
    strategy = Strategy(dp=1, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1)
    cluster = Cluster(1, 1)
    # bf16 scores: the fp32 softmax (4 bytes) and its bf16 cast (2), 4 heads x 4096^2 in each of 2 layers, less what
    # flash attention keeps instead (a statistic per row: 1/4096 of a score's bytes)
    def extra(spec):
        return (estimate(spec, cluster, strategy, global_batch_size=1).memory.activations
                - estimate(sdpa, cluster, strategy, global_batch_size=1).memory.activations)

    assert extra(eager) == pytest.approx(2 * 4 * 4096**2 * (SOFTMAX_FP32_BYTES + 2), rel=1e-3), extra(eager)
    # A softmax in the compute dtype (Megatron's fused one), no dropout: its output alone, which the next matmul reads
    fused_softmax = dataclasses.replace(sdpa, flash_attention=False)
    assert extra(fused_softmax) == pytest.approx(2 * 4 * 4096**2 * 2, rel=1e-3), extra(fused_softmax)
    selective = dataclasses.replace(strategy, recompute="selective")
    assert not validate(eager, cluster, selective, global_batch_size=1)
    assert "flash attention" in " ".join(validate(sdpa, cluster, selective, global_batch_size=1))

    # What transformers' eager attention keeps, per score (a sequence of 24, unlike any other width of the model)
    seq, heads = 24, 4
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=heads,
                                      num_key_value_heads=heads, vocab_size=64, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    kept = {}

    def pack(tensor):
        if tensor.dim() >= 2 and tuple(tensor.shape[-2:]) == (seq, seq):
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids, labels=ids)
    assert sum(kept.values()) == heads * seq * seq * (SOFTMAX_FP32_BYTES + 2), kept


def test_blocks_of_one_part_are_read_and_priced_by_their_part():
    """NVIDIA's Nemotron-H: each block a norm and one mixer (Mamba-2, attention, a ReLU² MLP or experts), all named
    `mixer`. Read as blocks of one part: layers 1 and 3 without a token mixer, 0 and 2 without an MLP; the attention
    read from block 2, the MLP from block 1, the experts from the MoE blocks. Before: 'could not find separate attention
    and MLP blocks'. The cost model prices each block by its part: the FLOPs are the parts' sums, a stage holds the
    model's parameters, and a block of each part keeps what a block of both keeps between them."""
    from tridist.autotune import cost
    from tridist.autotune.cost import _forward_flops_per_token, activation_bytes_per_layer, stage_parameters

    pytest.importorskip("transformers")
    from tests.hf_models import build

    for family in ("nemotron-h", "nemotron-h-moe", "nemotron-h-latent"):
        model = build(family)
        spec = ModelSpec.from_module(model, seq_len=16)
        s = spec.structure
        assert (s.mixer_free_layers, s.mlp_free_layers, s.attention, s.q, s.o, s.layer_norms) == (
            (1, 3), (0, 2), "mixer", "mixer.q_proj", "mixer.o_proj", ("norm",)), s.describe()
        assert (spec.mixer_free_layers, spec.mlp_free_layers) == ((1, 3), (0, 2))
        assert s.linear_attention.layers == (0,) and s.linear_attention.mixer == "mixer"
        assert not any("norm(s) per layer" in note for note in s.notes), s.notes
        assert "no token mixer in layers 1, 3, no MLP in layers 0, 2" in s.describe()
        linear = spec.gated_delta_net.matmul_parameters(spec.hidden_size)
        if family == "nemotron-h":
            assert (s.up, s.down, s.gate, spec.gated_mlp, s.moe_layers) == ("mixer.up_proj", "mixer.down_proj", None,
                                                                             False, ())
            parts = spec.attention_parameters + linear + 2 * spec.mlp_parameters
        else:
            assert (s.moe_layers, s.moe, s.experts, s.shared_experts) == ((1, 3), "mixer", "mixer.experts",
                                                                          ("mixer.shared_experts",))
            parts = spec.attention_parameters + linear + 2 * spec.moe_active_mlp_parameters
        assert _forward_flops_per_token(spec)[0] == 2 * parts
        assert stage_parameters(spec, tp=1, pp=1, stage=0) == spec.num_parameters
        real = sum(p.numel() for p in model.parameters())
        assert abs(spec.num_parameters - real) < 0.01 * real, (spec.num_parameters, real)  # the mixer's extras: ~0.3%
        # Nemotron 3 Super's latent MoE: the experts read at the latent's width (32), the projections priced whole
        assert (spec.expert_input_size, spec.latent_projection_parameters) == (
            (32, 2 * 64 * 32) if family == "nemotron-h-latent" else (None, 0))
    # MLP blocks' biases noted (they were read from the attention block alone)
    biased = ModelSpec.from_module(build("nemotron-h", config=dict(mlp_bias=True)), seq_len=16).structure
    assert any(note.startswith("2 bias vector(s)") for note in biased.notes), biased.notes
    # Blocks of Mamba-2 and attention alone, no MLP or experts anywhere: refused as unrecognised (data parallel then
    # applies; the structure names an MLP), not an AttributeError that skipped the fallback (a review's find)
    no_mlp = build("nemotron-h", config=dict(layers_block_type=["linear_attention", "full_attention"] * 2))
    with pytest.raises(UnrecognisedModel, match="no decoder layer of model.layers holds an MLP or a mixture of experts"):
        ModelSpec.from_module(no_mlp)
    # A block of each part keeps what one of both keeps between them (attention or a linear mixer, an MLP or experts;
    # recompute none and selective)
    for spec, moe_layer, linear in ((preset("llama3-8b"), False, False), (preset("mixtral-8x7b"), True, False),
                                    (spec, False, True)):
        for recompute in ("none", "selective"):
            bytes_of = functools.partial(activation_bytes_per_layer, spec, 1, 2, True, recompute, moe=moe_layer)
            assert bytes_of(part="mixer", linear=linear) + bytes_of(part="mlp") == pytest.approx(
                bytes_of(linear=linear)), (spec.name, recompute)
    cost.clear_caches()


def test_conv1d_projections_are_read_as_linears_and_split_on_their_transposed_dims():
    """transformers' Conv1D ([in, out] weights: GPT-2, GPT-1) is read as a Linear of its in and out features (GPT-2's
    square c_proj too, which the shapes alone cannot orient); the plan ends sequence parallel at GPT-2's
    final norm, and at GPT-1's last layer's output (no final norm: SequenceParallelEnd(at_output=True), its norms inside
    the region). The styles for it split the dims of the transposed layout (world of one: the placements and the
    module's own forward on them, equal to the plain module's)."""
    pytest.importorskip("transformers")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from tests.hf_models import build
    from tridist.autotune.cost import stage_parameters
    from tridist.distcore.auto import tensor_parallel_plan
    from tridist.distcore.linear_like import features, is_linear_like, matmul_weight, weight_out_dim
    from tridist.distcore.tensor_parallel import ColWiseParallel, RowWiseParallel, SequenceParallelEnd, StyleTarget

    for family, end in (("gpt2", "transformer.ln_f"), ("openai-gpt", "transformer.h.1")):
        model = build(family, layers=2)
        spec = ModelSpec.from_module(model, seq_len=16)
        s = spec.structure
        assert (s.qkv, s.o, s.up, s.down, s.qkv_sizes) == ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj",
                                                           (64, 64, 64)), family
        assert (spec.hidden_size, spec.ffn_hidden_size, spec.num_heads, spec.num_kv_heads) == (64, 256, 4, 4), family
        assert spec.position_parameters == 64 * 64, family  # [positions, hidden], priced whole (cost model 27)
        without = dataclasses.replace(spec, position_parameters=0)
        assert stage_parameters(spec, 2, 2, 0) - stage_parameters(without, 2, 2, 0) == 64 * 64  # on the first stage
        assert stage_parameters(spec, 2, 2, 1) == stage_parameters(without, 2, 2, 1)
        # every parameter but the biases (the recogniser's note says so); GPT-1 has no final norm (none counted)
        biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))
        assert spec.num_parameters == _count(model) - biases and spec.final_norm == (family == "gpt2"), family
        plan = tensor_parallel_plan(model, s, sequence_parallel=True, tp=2)
        ends = {name: st for name, styles in plan.styles.items() for st in styles if isinstance(st, SequenceParallelEnd)}
        assert list(ends) == [end] and ends[end].at_output == (family == "openai-gpt"), (family, ends)
        assert {f"{end}.ln_1", f"{end}.ln_2"} <= plan.sequence_region or family == "gpt2", sorted(plan.sequence_region)
    c_attn = model.transformer.h[0].attn.c_attn
    assert (features(c_attn), weight_out_dim(c_attn), weight_out_dim(nn.Linear(2, 3))) == ((64, 192), 1, 0)
    assert matmul_weight(c_attn, c_attn.weight).shape == (192, 64) and not is_linear_like(nn.Conv1d(4, 4, 1))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("mp",))
        x = torch.randn(2, 3, 64)
        for leaf, style, weight, bias in (("c_attn", ColWiseParallel(packed_parts=3), _StridedShard(1, split_factor=3),
                                           Replicate()),
                                          ("c_fc", ColWiseParallel(), Shard(1), Shard(0)),
                                          ("c_proj", RowWiseParallel(), Shard(0), Replicate())):
            attention = leaf == "c_attn"
            whole = getattr(model.transformer.h[0].attn if attention else model.transformer.h[0].mlp, leaf)
            split = type(whole)(whole.nf, whole.nx)
            split.load_state_dict(whole.state_dict())
            parent = model.transformer.h[0].attn if attention else None
            style.apply(StyleTarget(f"h.0.{leaf}", split, parent, tp_mesh=mesh, process_mesh=None))
            assert (split.weight.placements, split.bias.placements) == ((weight,), (bias,)), leaf
            source = x if whole.nx == 64 else torch.randn(2, 3, whole.nx)
            assert torch.equal(split(source), whole(source)), leaf
    finally:
        dist.destroy_process_group()
