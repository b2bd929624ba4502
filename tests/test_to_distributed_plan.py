"""to_distributed's single-process parts: the tensor/sequence-parallel plan it builds from a recognised
structure, and the batch shape it prices."""

import types

import pytest

from tridist import autotune
from tridist.bench.models import build_model, make_seed_dataloader
from tridist.distcore import auto as td
from tridist.distcore.tensor_parallel import ColWiseParallel, RowWiseParallel, SequenceParallelBegin, SequenceParallelEnd


@pytest.mark.parametrize("name, head, end_module", [  # the sequence gathered before the final norm
    ("seed-llama", "weight", "norm"),             # bare root LM head
    ("hf-llama", "lm_head", "model.norm"),
    ("paddle-llama", "lm_head.weight", "llama.norm"),  # a bare weight in its LlamaLMHead
])
def test_plan_names_every_projection_by_its_own_name(name, head, end_module):
    """The typed plan holds the model's own module names (no patterns to re-match), the packed parts'
    sizes and the sequence-parallel context."""
    model = build_model(name)
    structure = autotune.ModelSpec.from_module(model, seq_len=8).structure
    plan = td.tensor_parallel_plan(model, structure, sequence_parallel=True)
    modules = dict(model.named_modules())
    assert all(n in modules for n in plan.styles) and set(plan.bare) <= {n for n, _ in model.named_parameters()}
    layers = len(model.get_submodule(structure.layers))
    colwise = [n for n, styles in plan.styles.items() if any(isinstance(s, ColWiseParallel) for s in styles)]
    rowwise = [n for n, styles in plan.styles.items() if any(isinstance(s, RowWiseParallel) for s in styles)]
    per_layer_col = 1 if name == "paddle-llama" else 3  # packed qkv, or q/k/v
    per_layer_col += 1 if name == "paddle-llama" else 2  # packed gate_up, or gate/up
    assert len([n for n in colwise if ".layers." in n or n.startswith("layers.")]) == layers * per_layer_col
    assert len([n for n in rowwise if n.endswith(("o_proj", "down_proj"))]) == 2 * layers
    assert head in [*colwise, *plan.bare]
    if name == "paddle-llama":  # packed [q | k | v] sizes as recognised
        qkv = plan.styles[f"{structure.layers}.0.{structure.qkv}"][0]
        assert qkv.packed_parts == structure.qkv_sizes and len(set(qkv.packed_parts)) == 1
    ends = [n for n, styles in plan.styles.items() if any(isinstance(s, SequenceParallelEnd) for s in styles)]
    begins = [n for n, styles in plan.styles.items() if any(isinstance(s, SequenceParallelBegin) for s in styles)]
    assert ends == [end_module] and begins == [structure.embedding]
    assert f"{structure.layers}.0" in plan.sequence_span and plan.lazy_split


def test_the_sequence_is_gathered_before_a_final_norm_registered_after_the_layers():
    """Under sequence parallel the region ends at the final norm where it is registered after the layer list
    (GPTBigCode's code reshapes its output to the whole sequence's shape), else at the LM head: the span is read in
    registration order, and OPT's final norm, registered before its layers, left every layer out of it (sequence
    parallel silently off: a review's find). A span without every layer is refused, naming the fix."""
    pytest.importorskip("transformers")
    import transformers as hf

    from tests.hf_models import build

    for family, end in (("gpt-bigcode", "transformer.ln_f"), ("opt", "lm_head"), ("llama", "model.norm")):
        model = build(family)
        structure = autotune.ModelSpec.from_module(model, seq_len=8).structure
        plan = td.tensor_parallel_plan(model, structure, sequence_parallel=True)
        ends = [n for n, styles in plan.styles.items() if any(isinstance(s, SequenceParallelEnd) for s in styles)]
        layers = {f"{structure.layers}.{i}" for i in range(structure.num_layers)}
        assert ends == [end] and layers <= plan.sequence_span, (family, ends)
    # A classifier (no LM head module) whose final norm is registered before its layers: nothing to end at after them
    model = hf.LlamaForSequenceClassification(hf.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_labels=3, pad_token_id=2))
    model.model._modules = {name: model.model._modules[name] for name in ("embed_tokens", "norm", "layers", "rotary_emb")}
    structure = autotune.ModelSpec.from_module(model, seq_len=8).structure
    with pytest.raises(ValueError, match=r"would leave decoder layers out of its span.*register the final norm"):
        td.tensor_parallel_plan(model, structure, sequence_parallel=True)


def test_key_value_heads_below_tp_are_replicated_in_the_plan():
    """Where tp exceeds a layer's key/value heads (read from its own k projection) and they divide it, its k and v
    projections compute each head on tp / heads ranks; q and the rest split as before. Layers may differ (Gemma 4's
    per-layer configs): each follows its own heads; a tp they neither divide nor are divided by is refused, naming
    the layer. A packed qkv is left to autotune's rule (it cannot replicate k and v alone)."""
    from torch import nn
    from tridist.autotune.strategy import kv_head_replicas
    from tridist.distcore import ReplicatedColWiseParallel

    model = build_model("hf-llama")  # 4 query heads, 2 key/value heads
    spec = autotune.ModelSpec.from_module(model, seq_len=8)
    assert [kv_head_replicas(spec, tp) for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]
    structure = spec.structure
    head_dim = model.model.layers[1].self_attn.head_dim
    model.model.layers[1].self_attn.k_proj = nn.Linear(spec.hidden_size, head_dim, bias=False)  # one head here
    model.model.layers[1].self_attn.v_proj = nn.Linear(spec.hidden_size, head_dim, bias=False)
    plan = td.tensor_parallel_plan(model, structure, sequence_parallel=False, tp=4)
    for layer, replicas in ((0, 2), (1, 4)):
        for projection in (structure.k, structure.v):
            (style,) = plan.styles[f"{structure.layers}.{layer}.{projection}"]
            assert type(style) is ReplicatedColWiseParallel and style.replicas == replicas and not style.global_view
    plan = td.tensor_parallel_plan(model, structure, sequence_parallel=False, tp=2)
    assert type(plan.styles[f"{structure.layers}.0.{structure.k}"][0]) is ColWiseParallel  # 2 heads: split evenly
    assert plan.styles[f"{structure.layers}.1.{structure.k}"][0].replicas == 2
    layer = f"{structure.layers}.0"
    assert type(plan.styles[f"{layer}.{structure.q}"][0]) is ColWiseParallel
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj computes 2 key/value heads, which tp=3"):
        td.tensor_parallel_plan(model, structure, sequence_parallel=False, tp=3)
    # A block the block check cannot keep in local view is refused, saying why and what to do (DiffLlama's attention
    # splits its one local value head in two).
    from tridist.distcore.block_check import TensorParallelCheckError, _refuse_without_global_view

    plan = td.tensor_parallel_plan(model, structure, sequence_parallel=False, tp=4)
    with pytest.raises(TensorParallelCheckError, match=r"ReplicatedColWiseParallel: each rank computes its own "
                                                       r"key/value head from the whole weights; use a tp that divides"):
        _refuse_without_global_view(plan, layer, model.get_submodule(layer), "in local view fails")
    packed = build_model("paddle-llama")
    plan = td.tensor_parallel_plan(packed, autotune.ModelSpec.from_module(packed, seq_len=8).structure,
                                   sequence_parallel=False, tp=4)
    assert not any(type(s) is ReplicatedColWiseParallel for styles in plan.styles.values() for s in styles)


def test_plan_from_names_refuses_a_name_the_model_lacks():
    from tridist.distcore.tensor_parallel import plan_from_names

    model = build_model("hf-llama")
    with pytest.raises(ValueError, match="nearest names"):
        plan_from_names(model, {"model.layers.0.self_attn.q_projection": [ColWiseParallel()]})


def test_batch_shape_from_input_spec_loader_or_default():
    class Spec:
        shape = [16, 256]

    config = td.ToDistributedConfig(input_spec=[Spec()])
    assert td._input_shape(config, None) == (16, 256)
    loader = make_seed_dataloader(batch_size=4, batch_num=2, seq_length=12, vocab_high=64)
    assert td._input_shape(td.ToDistributedConfig(), loader) == (4, 12)
    assert td._input_shape(td.ToDistributedConfig(), object()) == td.DEFAULT_INPUT_SHAPE
    with pytest.raises(ValueError, match="batch, seq"):
        td._input_shape(td.ToDistributedConfig(input_spec=[[None, 8]]), None)


@pytest.mark.parametrize("features", [0, -3, 2.5])
def test_a_shared_output_gradient_needs_a_positive_count_of_trailing_outputs(features):
    """ReduceSharedOutputGradient(0) would sum the whole output's gradient (`grad[..., -0:]` is all of it):
    refused when the plan is written, naming the value."""
    from tridist.distcore import ReduceSharedOutputGradient

    with pytest.raises(ValueError, match=f"positive count of trailing outputs, got {features!r}"):
        ReduceSharedOutputGradient(features)


def test_a_compiled_model_is_refused_naming_the_fix():
    """torch.compile(model) before distribution: its graph would be the undistributed model's, and the loss hooks
    would sit on the wrapper (the token-mean check then named a wrong cause); compile the returned model instead."""
    import torch

    from tridist import distcore

    compiled = torch.compile(build_model("seed-llama"))
    for api, call in (("to_distributed", lambda: td.to_distributed(compiled, None, None, device_num=1)),
                      ("parallelize", lambda: distcore.parallelize(compiled, None, None, {"dp_config": {}}))):
        with pytest.raises(TypeError, match=rf"{api}: the model is a torch.compile wrapper \(OptimizedModule around "
                                            r"\w+\).*pass the model itself \(model._orig_mod\)"):
            call()


def test_config_may_be_a_dict_of_its_fields_and_a_misspelt_field_is_named():
    """`parallelize` takes its config as a dict, so users pass one to to_distributed too: it names the fields; a
    key that is no field, or a config of another type, is refused before any process group starts (it read
    `config.overlap_backend` off the dict: an AttributeError)."""
    import torch

    assert td._as_config({"sequence_parallel": True, "top_k": 2}) == td.ToDistributedConfig(sequence_parallel=True, top_k=2)
    assert td._as_config(None) == td.ToDistributedConfig()
    given = td.ToDistributedConfig(sequence_parallel=True, top_k=3)
    assert td._as_config(given) is given  # a config object as it was given
    with pytest.raises(TypeError, match=r"\['sequnce_parallel'\].*did you mean \['sequence_parallel'\]"):
        td.to_distributed(torch.nn.Linear(2, 2), None, None, 1, config={"sequnce_parallel": True})
    for other in (["sequence_parallel"], "sequence_parallel", types.SimpleNamespace(sequence_parallel=True)):
        with pytest.raises(TypeError, match=f"a ToDistributedConfig or a dict of its fields, got {type(other).__name__}"):
            td.to_distributed(torch.nn.Linear(2, 2), None, None, 1, config=other)


def test_the_search_space_keeps_sequence_parallel_where_the_config_asks_for_it():
    """ToDistributedConfig(sequence_parallel=True) restricts the search to sequence parallel; the default searches
    both; a space given in search_options is taken as it is."""
    assert td._search_space(td.ToDistributedConfig(sequence_parallel=True))[0].sequence_parallel == (True,)
    assert td._search_space(td.ToDistributedConfig())[0].sequence_parallel == (False, True)
    space = autotune.SearchSpace(tp=(2,))
    assert td._search_space(td.ToDistributedConfig(search_options={"space": space, "n_trials": 3})) == (space, {"n_trials": 3})


def test_a_blocks_plan_holds_its_own_modules_only_with_ten_or_more_layers():
    """`within("layers.1")` is layer 1's plan, names relative to it; `layers.10` is not under `layers.1` (a name
    prefix without its dot); `excluding(["layers.1"])` keeps layer 10's styles."""
    from tridist.distcore.tensor_parallel import TensorParallelPlan

    col, row = ColWiseParallel(), RowWiseParallel()
    plan = TensorParallelPlan(styles={"layers.1.q": [col], "layers.10.q": [col], "layers.1.o": [row]},
                              bare={"layers.10.scale": [col]}, disabled=frozenset({"layers.1", "layers.10"}))
    inner = plan.within("layers.1")
    assert (inner.styles, inner.bare, inner.disabled) == ({"q": [col], "o": [row]}, {}, frozenset({""})), inner
    rest = plan.excluding(["layers.1"])
    assert (rest.styles, rest.bare, rest.disabled) == (
        {"layers.10.q": [col]}, {"layers.10.scale": [col]}, frozenset({"layers.10"})), rest


def test_per_head_inputs_built_outside_the_attention_are_found_by_their_first_dim():
    """The block check's ShardHeadInput candidates: an attention holding query heads whose forward takes a keyword input
    with one row per head, or per row and head (the probe's batch of 2): Bloom's `alibi` ([batch x heads, 1, s]) and
    MPT's `position_bias` ([heads, 1, s]); not an input of another first dim (the mask), nor a keyword the attention
    does not take."""
    pytest.importorskip("transformers")
    from tests.hf_models import build
    from tridist.distcore.tensor_parallel import ShardHeadInput, head_input_owners

    bloom, mpt, llama = (build(family).transformer.h[0] if family == "bloom" else
                         build(family).transformer.blocks[0] if family == "mpt" else build(family).model.layers[0]
                         for family in ("bloom", "mpt", "llama"))
    shapes = {"alibi": (2 * 4, 1, 8), "attention_mask": (2, 1, 8, 8), "position_bias": (4, 1, 8)}
    assert head_input_owners(bloom, shapes, batch=2) == {"self_attention": ShardHeadInput("alibi", 4)}
    assert head_input_owners(mpt, shapes, batch=2) == {"attn": ShardHeadInput("position_bias", 4)}
    assert head_input_owners(bloom, {"alibi": (12, 1, 8)}, batch=2) == {}  # neither heads nor batch x heads rows
    assert head_input_owners(llama, shapes, batch=2) == {}  # Llama's attention takes neither


def test_attention_settings_read_as_global_widths_are_found():
    """The block check's LocalHeadWidths candidates: an attention holding query heads and a config with head counts
    (Phi-3 slices its packed q/k/v at `config.num_attention_heads`; Llama's holds one too, tried only where local view
    is still wrong), or an attribute of the query heads' width (XGLM's `embed_dim`, equal to heads x head_dim), not
    an attribute of another name or width."""
    pytest.importorskip("transformers")
    import transformers as hf

    from tests.hf_models import build
    from tridist.distcore.tensor_parallel import LocalHeadWidths, head_width_owners

    phi3, llama = build("phi3").model.layers[0], build("llama").model.layers[0]
    xglm = hf.XGLMForCausalLM(hf.XGLMConfig(vocab_size=128, d_model=64, ffn_dim=128, num_layers=1, attention_heads=4))
    assert head_width_owners(phi3) == {"self_attn": LocalHeadWidths((), config=True)}
    assert head_width_owners(llama) == {"self_attn": LocalHeadWidths((), config=True)}
    assert head_width_owners(xglm.model.layers[0]) == {"self_attn": LocalHeadWidths(("embed_dim",), config=False)}
    attention = llama.self_attn
    attention.embed_dim, attention.inner_dim, attention.hidden_size = 4 * 16, 4 * 16 + 1, 4 * 16  # only the first
    assert head_width_owners(llama) == {"self_attn": LocalHeadWidths(("embed_dim",), config=True)}


def test_deepstack_rows_are_taken_to_each_ranks_slice_under_sequence_parallel():
    """Qwen3-VL's text model adds rows at a mask's positions over the whole sequence (its deepstack features): under
    sequence parallel the plan gives it SequenceSlicedRows (the mask's and the rows' slice of this rank, the rows'
    gradients summed), nothing without sequence parallel, and nothing to a model whose layers' holder takes no such
    arguments (Llama)."""
    from tridist.distcore.tensor_parallel import SequenceSlicedRows
    from tests.hf_models import build, qwen3_vl

    model = qwen3_vl()
    structure = autotune.ModelSpec.from_module(model, seq_len=16).structure
    styles = td.tensor_parallel_plan(model, structure, sequence_parallel=True).styles
    rows = [(name, style) for name, kinds in styles.items() for style in kinds if isinstance(style, SequenceSlicedRows)]
    assert [(name, style.mask, style.rows, style.layers) for name, style in rows] == [
        ("model.language_model", "visual_pos_masks", "deepstack_visual_embeds", "layers")], rows
    assert not any(isinstance(style, SequenceSlicedRows) for kinds in td.tensor_parallel_plan(
        model, structure, sequence_parallel=False).styles.values() for style in kinds)
    llama = build("llama")
    plain = td.tensor_parallel_plan(llama, autotune.ModelSpec.from_module(llama).structure, sequence_parallel=True)
    assert not any(isinstance(style, SequenceSlicedRows) for kinds in plain.styles.values() for style in kinds)


def test_no_pipeline_stage_ends_among_the_layers_the_deepstack_features_reach():
    """Qwen3-VL adds its deepstack features to its first 2 text layers' outputs before the next layer takes them; a
    pipeline stage ending with one of them would send its output without them (the next stage then refused it at its
    first step: "does not receive the previous layer's output unchanged"). The spec counts them (layers_added_to),
    validate refuses a first stage of 2 layers or fewer naming layers_per_stage, and the search lays the first stage
    out past them (3 layers where the even layout would give 2). Llama adds to none."""
    import dataclasses

    from tridist.autotune import Cluster, Strategy
    from tridist.autotune.search import SearchSpace, _stage_layouts
    from tridist.autotune.strategy import validate
    from tests.hf_models import build, qwen3_vl

    spec = autotune.ModelSpec.from_module(qwen3_vl(layers=4), seq_len=16)
    assert spec.layers_added_to == 2 and autotune.ModelSpec.from_module(build("llama")).layers_added_to == 0
    cluster = Cluster(1, 2)
    for layout, refused in ((None, True), ((2, 2), True), ((1, 3), True), ((3, 1), False)):
        strategy = Strategy(1, 1, 2, num_micro_batches=2, layers_per_stage=layout)
        reasons = [r for r in validate(spec, cluster, strategy, global_batch_size=2) if "deepstack" in r]
        assert bool(reasons) == refused, (layout, reasons)
        assert not refused or "layers_per_stage with at least 3 layers on the first stage" in reasons[0], reasons
    assert _stage_layouts(spec, 2, SearchSpace()) == [(3, 1)]
    assert all(layout is None or layout[0] >= 3 for layout in _stage_layouts(dataclasses.replace(spec, num_layers=12),
                                                                             3, SearchSpace()))
    with pytest.raises(ValueError, match="layers_added_to=5 counts more layers than the 4"):
        dataclasses.replace(spec, layers_added_to=5)


def test_search_names_the_first_stage_where_no_pipeline_degree_leaves_it_past_the_layers_the_model_adds_to():
    """Qwen3-VL of 4 layers adds to the first 2: a pipeline of 3 or 4 stages cannot give its first stage 3 layers and
    the others one each. The search leaves such degrees out of its layouts (as it leaves out more stages than layers),
    so that a space of those degrees alone says there is no valid layout, naming why (it said no strategy fit in
    memory: every layout had evaluated nothing)."""
    from tridist.autotune import Cluster, search
    from tridist.autotune.search import SearchSpace, _pp_choices
    from tests.hf_models import qwen3_vl

    spec = autotune.ModelSpec.from_module(qwen3_vl(layers=4), seq_len=16)
    cluster = Cluster(1, 4)
    assert _pp_choices(spec, cluster, SearchSpace()) == [1, 2]
    result = search(spec, cluster, global_batch_size=4, space=SearchSpace(pp=(4,)))
    assert result.best is None and "no valid layout" in result.message, result.message
    assert "first stage" in result.message and "2 layers the model adds to" in result.message, result.message
