"""pipeline.py's stage hooks on one process: the first layer of a later stage takes the received activation
in place of the earlier stages' placeholder, and only that argument; a key/value cache asked for is refused."""

from __future__ import annotations

import warnings

import pytest
import torch

from tridist.distcore.pipeline import PipelineConfig, _StageState, _refuse_a_cache, install_layer_hooks


class _Layer(torch.nn.Module):
    def forward(self, hidden, mask=None):
        return hidden if mask is None else hidden + mask


def _stage_one():
    layers = torch.nn.ModuleList([_Layer(), _Layer()])
    config = PipelineConfig("layers", [0, 1], 2, "GPipe", 2, 1)
    state = _StageState(stage=1, is_first=False, is_last=True)
    install_layer_hooks(layers, config, state)
    return layers, state


def test_received_activation_replaces_the_placeholder():
    layers, state = _stage_one()
    placeholder, received = torch.zeros(2), torch.ones(2)
    state.last_placeholder, state.received = placeholder, received
    assert torch.equal(layers[1](placeholder, None), received)
    assert torch.equal(layers[1](hidden=placeholder), received)


def test_no_placeholder_is_an_error_not_a_none_argument_replaced():
    """Hidden states the caller passed in (inputs_embeds): no earlier module ran, so there is no placeholder;
    a None argument (a mask) must not be taken for it."""
    layers, state = _stage_one()
    state.last_placeholder, state.received = None, torch.ones(2)
    with pytest.raises(RuntimeError, match="no module of an earlier stage produced its input"):
        layers[1](torch.full((2,), 5.0), None)


class _EmbeddingWithMask(torch.nn.Module):
    """A first-stage module returning the hidden states and a second tensor (a padding mask it builds)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)

    def forward(self, ids):
        return self.embed(ids), (ids != 0).float()


def test_earlier_module_with_several_outputs_warns_that_later_stages_see_zeros():
    """A later stage sees zeros for what an earlier stage's module computes: the first output is replaced by
    the received activation, the others (a mask, a router loss) stay zeros, which must not pass silently."""
    from tridist.distcore.pipeline import _meta_copy, _StandIn

    state = _StageState(stage=1, is_first=False, is_last=True)
    stand_in = _StandIn("embed", 0, _meta_copy(_EmbeddingWithMask()), state, "earlier")
    with pytest.warns(UserWarning, match="stage 1 sees zeros for all but the first"):
        hidden, mask = stand_in(torch.ones(2, 3, dtype=torch.long))
    assert state.last_placeholder is hidden and hidden.shape == (2, 3, 4) and not mask.any()
    single = _StandIn("embed", 0, _meta_copy(torch.nn.Embedding(10, 4)), state, "earlier")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        single(torch.ones(2, 3, dtype=torch.long))  # one output: nothing to warn about


class _ScaledByBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, ids):
        return self.embed(ids), self.scale.expand(*ids.shape, 4)


def test_under_mixed_precision_stand_ins_compute_in_the_parameters_compute_dtype():
    """FSDP2's mixed precision casts an earlier stage's parameters to bf16 for its forward, not its buffers: the
    stand-in's zeros follow (an fp32 embedding's stand-in gave fp32 zeros in a bf16 forward: Gemma 2's and Bloom's
    masks took fp32's minimum from them, -inf in bf16, NaN losses); a buffer's output keeps its dtype."""
    from tridist.distcore.pipeline import _meta_copy, _StandIn

    state = _StageState(stage=1, is_first=False, is_last=True, device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    stand_in = _StandIn("embed", 0, _meta_copy(_ScaledByBuffer(), state.compute_dtype), state, "earlier")
    with pytest.warns(UserWarning, match="sees zeros"):
        hidden, scale = stand_in(torch.ones(2, 3, dtype=torch.long))
    assert (hidden.dtype, scale.dtype) == (torch.bfloat16, torch.float32)
    plain = _StandIn("embed", 0, _meta_copy(_ScaledByBuffer()), state, "earlier")  # no mixed precision: its own dtype
    with pytest.warns(UserWarning, match="sees zeros"):
        assert plain(torch.ones(2, 3, dtype=torch.long))[0].dtype == torch.float32


class _MatmulWithFp32Mask(torch.nn.Module):
    """GPT-1's attention in small: scores plus a mask built in the dtype the caller passes (GPT-1 takes it from the
    model's first parameter), then a batched matmul with the values (its projection of the hidden states)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, hidden, mask):
        values = hidden @ self.weight
        return torch.bmm((hidden + mask)[None], values[None].transpose(1, 2))[0]


class _CountsTokens(torch.nn.Module):
    def forward(self, scores):
        return torch.zeros(int((scores > 0).sum()))  # data-dependent: its size is a count of the scores' values


def test_a_stand_in_that_cannot_run_on_meta_names_the_cause():
    """An earlier stage's module whose code cannot run on the meta device is refused by name: its inputs mixing fp32
    and the compute dtype under mixed precision (GPT-1's attention mask in the dtype of the stage's first parameter,
    fp32 outside FSDP2's forward, beside bf16 hidden states), or its code reading values (a router's counts)."""
    from tridist.distcore.pipeline import _meta_copy, _StandIn

    state = _StageState(stage=1, is_first=False, is_last=True, device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    mixed = _StandIn("h.0", 0, _meta_copy(_MatmulWithFp32Mask(), state.compute_dtype), state, "earlier")
    with pytest.raises(RuntimeError, match=r"runs 'h.0' \(stage 0's\).*mix fp32 and torch.bfloat16.*GPT-1.*pp=1"):
        mixed(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 4))
    assert mixed(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    counts = _StandIn("router", 0, _meta_copy(_CountsTokens()), state, "earlier")
    with pytest.raises(RuntimeError, match=r"runs 'router'.*needs values there.*pp=1 for this model"):
        counts(torch.ones(3))


def test_a_later_stage_reads_an_earlier_modules_weight_device_shape_and_dtype_only():
    """Llama 4's decoder runs `input_ids.to(self.embed_tokens.weight.device)` before the embedding: on a later
    stage the embedding is a stand-in, whose weight reads as this stage's device with the real shape and
    dtype; using its values, or reading what the module does not have, is an error naming the fix."""
    from tridist.distcore.pipeline import _meta_copy, _StandIn

    state = _StageState(stage=1, is_first=False, is_last=True, device=torch.device("cpu"))
    stand_in = _StandIn("model.embed_tokens", 0, _meta_copy(torch.nn.Embedding(10, 4, dtype=torch.bfloat16)), state,
                        "earlier")
    weight = stand_in.weight
    assert (weight.device, weight.dtype, tuple(weight.shape), weight.dim(), weight.size(-1)) == (
        torch.device("cpu"), torch.bfloat16, (10, 4), 2, 4)
    torch.ones(2, dtype=torch.long).to(weight.device)  # the Llama 4 read
    with pytest.raises(AttributeError, match=r"'model.embed_tokens.weight'.*stage 0.*pp=1"):
        weight.sum()
    with pytest.raises(AttributeError, match=r"'model.embed_tokens' lives on pipeline stage 0.*'scale'.*pp=1"):
        stand_in.scale
    elsewhere = _StandIn("model.embed_tokens", 0, None, None, "elsewhere")  # in the user's model, no stage running
    with pytest.raises(AttributeError, match="lives on pipeline stage 0"):
        elsewhere.weight
    assert not hasattr(elsewhere, "weight")


def test_a_stand_in_answers_its_modules_plain_settings_alone():
    """Nemotron-H's model picks each block's mask by `layer.block_type` on every stage: a stand-in answers the
    module's public plain settings (strings, numbers, booleans, None, tuples of them) as the module would, on any
    stage and in the user's model; its tensors, configs and other objects still raise, naming the stage."""
    from tridist.distcore.pipeline import _plain_attributes, _StandIn

    block = torch.nn.Linear(4, 4)
    block.block_type, block.layer_idx, block.window, block.kinds = "mamba", 3, None, ("a", 1)
    block.name, block.owner, block.role = "mixer", "expert", "router"  # the stand-in's own fields, by their names
    block.config, block._private = {"hidden": 4}, "x"
    plain = _plain_attributes(block)
    assert {k: plain[k] for k in ("block_type", "layer_idx", "window", "kinds")} == {
        "block_type": "mamba", "layer_idx": 3, "window": None, "kinds": ("a", 1)}
    assert "config" not in plain and "_private" not in plain
    for state, role in ((_StageState(stage=1, is_first=False, is_last=True, device=torch.device("cpu")), "later"),
                        (None, "elsewhere")):
        stand_in = _StandIn("model.layers.2", 0, None, state, role, plain)
        assert (stand_in.block_type, stand_in.layer_idx, stand_in.kinds) == ("mamba", 3, ("a", 1))
        assert (stand_in.name, stand_in.owner, stand_in.role) == ("mixer", "expert", "router")
        assert stand_in.tridist_stage == 0  # the stage holding the module (tensor parallel's change notes read it)
        with pytest.raises(AttributeError, match=r"'model.layers.2' lives on pipeline stage 0.*'config'"):
            stand_in.config


def test_a_later_stages_module_called_before_this_stages_last_layer_is_an_error_naming_it():
    """A module registered after the decoder layers is placed on the last stage and ends an earlier stage when
    called; called before that stage's last layer ran (before or between the layers), the stage has nothing to
    end with: an error naming the module (before, "stage 0 ends with NoneType" in training)."""
    from tridist.distcore.pipeline import _StandIn, _StageExit

    state = _StageState(stage=0, is_first=True, is_last=False)
    late = _StandIn("model.per_layer_projection", 1, None, state, "later")
    with pytest.raises(RuntimeError, match=r"stage 0 calls 'model.per_layer_projection', placed on stage 1.*pp=1"):
        late(torch.ones(2, 4))
    state.last_output = torch.ones(2, 4)  # after this stage's last layer: the stage ends here
    with pytest.raises(_StageExit):
        late(torch.ones(2, 4))


class _PerLayerInputs(torch.nn.Module):
    """Gemma 4's layout: the decoder's per-layer input table registered after its layer list."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(4)
        self.embed_tokens_per_layer = torch.nn.Embedding(10, 8)


def test_an_embedding_registered_after_the_layers_is_refused_when_the_stages_are_placed():
    from tridist.distcore.pipeline import _placement, embeddings_after_layers

    model = torch.nn.Module()
    model.model = _PerLayerInputs()
    model.lm_head = torch.nn.Linear(4, 10)
    assert embeddings_after_layers(model, "model.layers") == ["model.embed_tokens_per_layer"]
    with pytest.raises(NotImplementedError, match=r"\['model.embed_tokens_per_layer'\] hold an embedding.*pp=1"):
        _placement(model, PipelineConfig("model.layers", [0, 1], 2, "GPipe", 2, 1))
    del model.model.embed_tokens_per_layer
    assert embeddings_after_layers(model, "model.layers") == []
    assert _placement(model, PipelineConfig("model.layers", [0, 1], 2, "GPipe", 2, 1)).owner["lm_head"] == 1


class _LayerPassingTopK(torch.nn.Module):
    """HY V4's layout: each layer returns its hidden states and its indexer's top-k, which the next one takes and
    uses where it has no indexer of its own (GLM-MoE-DSA's layers each have one: they take it and ignore it)."""

    def __init__(self, own_indexer: bool = False):
        super().__init__()
        self.own_indexer = own_indexer

    def forward(self, hidden, prev_topk_indices=None):
        own = self.own_indexer or prev_topk_indices is None
        topk = hidden.topk(2, dim=-1).indices if own else prev_topk_indices
        return hidden * 2 + hidden.gather(-1, topk).sum(), topk


def test_a_later_stages_layer_computing_with_an_earlier_layers_other_output_is_an_error():
    """Only the hidden states pass between stages: where the stage's first layer computes with another output of
    the previous layer (HY V4's top-k indices), it would compute from the stand-in's zeros, silently (the sweep's HY
    V4 under dp 2 x pp 2: first-step gradients 56% off); an error naming the argument, the module it comes from and
    what used it. A layer that takes it without using it (GLM-MoE-DSA's, with their own indexers) runs, and may
    read its shape."""
    from tridist.distcore.pipeline import _meta_copy, _StandIn

    for own_indexer in (False, True):
        layers = torch.nn.ModuleList([_LayerPassingTopK(own_indexer), _LayerPassingTopK(own_indexer)])
        state = _StageState(stage=1, is_first=False, is_last=True)
        install_layer_hooks(layers, PipelineConfig("layers", [0, 1], 2, "GPipe", 2, 1), state)
        stand_in = _StandIn("layers.0", 0, _meta_copy(_LayerPassingTopK(own_indexer)), state, "earlier")
        with pytest.warns(UserWarning, match="sees zeros for all but the first"):
            hidden, topk = stand_in(torch.ones(2, 4))
        state.received = torch.arange(8.0).reshape(2, 4)
        if own_indexer:
            out, _ = layers[1](hidden, prev_topk_indices=topk)
            assert torch.equal(out, state.received * 2 + 18.0)  # the received activation's own top-2: 3 + 2 + 7 + 6
        else:
            with pytest.raises(RuntimeError, match=r"on stage 1, a layer \(_LayerPassingTopK\) takes argument "
                                                   r"'prev_topk_indices' from 'layers.0', which runs on stage 0; it "
                                                   r"computes with it \(gather\).*pp=1"):
                layers[1](hidden, prev_topk_indices=topk)


class _LayerWithPositions(torch.nn.Module):
    def forward(self, hidden, positions):
        return hidden + positions.sum()


def test_a_table_computed_before_the_layers_by_an_earlier_stages_module_is_an_error_in_any_layer():
    """RoFormer's sinusoidal positions come from a module with (frozen) parameters registered before the layers: on
    a later stage its stand-in returned zeros, which every layer there took, a view of them (`[None, None]`):
    attention without positions, silently (the sweep's RoFormer under dp 2 x pp 2: stage 1's q/k gradients 100%
    off). An error naming the argument, the module and its stage, from whichever of the stage's layers takes it."""
    from tridist.distcore.pipeline import _meta_copy, _StandIn

    layers = torch.nn.ModuleList([_LayerWithPositions() for _ in range(3)])
    state = _StageState(stage=1, is_first=False, is_last=True)
    install_layer_hooks(layers, PipelineConfig("layers", [0, 1], 3, "GPipe", 2, 1), state)  # layers 1, 2 on stage 1
    table = torch.nn.Embedding(8, 4)
    table.weight.requires_grad_(False)
    positions = _StandIn("encoder.embed_positions", 0, _meta_copy(table), state, "earlier")(torch.arange(3))[None, None]
    state.received = torch.ones(2, 4)
    placeholder = _StandIn("layers.0", 0, _meta_copy(_LayerWithPositions()), state, "earlier")(torch.zeros(2, 4),
                                                                                                 torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"takes argument 1 from 'encoder.embed_positions', which runs on stage 0; it "
                                           r"computes with it \(sum\)"):
        layers[1](placeholder, positions)
    hidden = layers[1](placeholder, torch.ones(1))  # the received activation for the placeholder; real positions
    assert torch.equal(hidden, torch.full((2, 4), 2.0))
    with pytest.raises(RuntimeError, match=r"_LayerWithPositions\) takes argument 'positions' from 'encoder.embed_posi"):
        layers[2](hidden, positions=positions)  # a later layer of the stage, by keyword


def test_an_earlier_stages_module_called_after_this_stages_layers_is_an_error_naming_it():
    """OPT registers its final norm before its layer list: placed on the first stage, the last stage called its
    stand-in after the layers and took its zeros for the final hidden states (the sweep's OPT under dp 2 x pp 2: the
    embedding's gradient 100% off, the norm's missing). An error naming it now; before the layers, a stand-in's zeros
    are what the stage expects."""
    from tridist.distcore.pipeline import _meta_copy, _StandIn

    layers = torch.nn.ModuleList([_Layer(), _Layer()])
    state = _StageState(stage=1, is_first=False, is_last=True)
    install_layer_hooks(layers, PipelineConfig("layers", [0, 1], 2, "GPipe", 2, 1), state)
    norm = _StandIn("model.decoder.final_layer_norm", 0, _meta_copy(torch.nn.LayerNorm(4)), state, "earlier")
    placeholder = norm(torch.ones(2, 4))  # before the layers: zeros, the received activation replaces them
    state.last_placeholder, state.received = placeholder, torch.ones(2, 4)
    hidden = layers[1](placeholder)
    with pytest.raises(RuntimeError, match=r"stage 1 calls 'model.decoder.final_layer_norm' after its own layers, but "
                                           r"it is placed on stage 0.*register it after the layer list, or use pp=1"):
        norm(hidden)


class _RegisteredOutOfOrder(torch.nn.Module):
    """OPT's and Camembert's layouts: the LM head and the final norm registered before the layer list, called after it."""

    def __init__(self, *, needs_values: bool = False):
        super().__init__()
        self.head = torch.nn.Linear(4, 10)
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.needs_values = needs_values

    def forward(self, ids):
        if self.needs_values and int(ids.max()) > 9:  # a value, which a forward on fake tensors cannot read
            raise ValueError("token out of range")
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def test_modules_are_placed_on_the_stage_where_the_forward_calls_them():
    """The LM head and the final norm go to the last stage, where the forward calls them, though registered before
    the layers (before, OPT's final norm went to the first stage: an error on the last one); one forward on fake
    tensors shows it, reading no weight and leaving the model as it was (its mode, its values). Where the forward
    reads a value, a forward of the real weights shows it; where neither runs (a value read on the meta device), the
    modules are placed by where they are registered, as before."""
    from tridist.distcore.pipeline import _placement

    config = PipelineConfig("layers", [0, 1], 2, "GPipe", 2, 1)
    by_call = {"head": 1, "embed": 0, "norm": 1, "layers.0": 0, "layers.1": 1}
    model = _RegisteredOutOfOrder()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    assert _placement(model, config).owner == by_call
    assert model.training and all(torch.equal(p, before[name]) for name, p in model.state_dict().items())
    assert _placement(_RegisteredOutOfOrder(needs_values=True), config).owner == by_call
    owner = _placement(_RegisteredOutOfOrder(needs_values=True).to("meta"), config).owner
    assert owner == {"head": 0, "embed": 0, "norm": 0, "layers.0": 0, "layers.1": 1}, owner


class _BareParameters(torch.nn.Module):
    """A container's bare parameters: a learned start token added to the embeddings, a newline token used only among
    the image features (LLaVA-NeXT's `image_newline`: a forward on token ids alone never reads it) beside a vision
    tower registered before the layers, and an LM-head weight used as `x @ weight.T` after them."""

    def __init__(self, *, needs_values: bool = False):
        super().__init__()
        self.needs_values = needs_values
        self.start = torch.nn.Parameter(torch.randn(4))
        self.tower = torch.nn.Linear(3, 4)
        self.newline = torch.nn.Parameter(torch.randn(4))
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.head_weight = torch.nn.Parameter(torch.randn(10, 4))

    def forward(self, ids, images=None):
        if self.needs_values and int(ids.max()) > 9:  # a value, which no forward on the meta device can read
            raise ValueError("token out of range")
        x = self.embed(ids) + self.start
        if images is not None:
            x = x + (self.tower(images) + self.newline).sum()
        for layer in self.layers:
            x = layer(x)
        return x @ self.head_weight.T


def test_bare_parameters_are_placed_where_the_forward_reads_them_or_with_the_modules_it_does_not_call():
    """The start token goes to the first stage (read before the layers), the head's weight to the last (after them),
    the newline token, unread by a forward on token ids, to the first, with the vision tower that forward does not call
    either (before: every bare parameter on the last stage, and LLaVA-NeXT refused at the first step). The second
    stage's view holds zeros in the place of the first stage's (its code before the layers reads them) and the first
    stage's view holds no head weight; where the probe cannot run (a value read on the meta device), every one goes to
    the last, as before."""
    from tridist.distcore.pipeline import _placement, build_stage_view

    config = PipelineConfig("layers", [0, 1], 2, "GPipe", 2, 1)
    model = _BareParameters()
    placement = _placement(model, config)
    assert placement.bare == {"start": 0, "newline": 0, "head_weight": 1}, placement.bare
    assert placement.owner["tower"] == 0
    first, second = (build_stage_view(model, config, placement, _StageState(stage=s, is_first=s == 0, is_last=s == 1))
                     for s in (0, 1))
    assert set(dict(first.named_parameters(recurse=False))) == {"start", "newline"}
    assert set(dict(second.named_parameters(recurse=False))) == {"head_weight"}
    for name in ("start", "newline"):
        zeros = getattr(second, name)
        assert not isinstance(zeros, torch.nn.Parameter) and torch.equal(zeros, torch.zeros(4)), name
    with pytest.raises(AttributeError):
        first.head_weight
    assert _placement(_BareParameters(needs_values=True), config).bare == placement.bare
    assert set(_placement(_BareParameters(needs_values=True).to("meta"), config).bare.values()) == {1}


class _SideInputLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, b):
        return x + torch.tanh(self.lin(x) + b)


class _BareSideInput(torch.nn.Module):
    """A bare parameter read before the layers whose result reaches every layer beside the hidden states."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.bias = torch.nn.Parameter(torch.randn(4))
        self.layers = torch.nn.ModuleList([_SideInputLayer() for _ in range(2)])
        self.head = torch.nn.Linear(4, 10)

    def forward(self, ids):
        x, b = self.embed(ids), self.bias * 1.0
        for layer in self.layers:
            x = layer(x, b)
        return self.head(x)


def test_a_first_stage_bare_parameter_reaching_the_layers_beside_the_hidden_states_is_refused():
    """A review found it training silently wrong (a later stage's zeros in its place: gradients 30-70% off): a bare
    parameter read before the layers is a source of what is computed from it, as a module called before them is, and
    one reaching the loss beside the hidden states is refused, naming it."""
    from tridist.distcore.pipeline import _placement

    with pytest.raises(NotImplementedError, match=r"computed from \['bare parameter bias'\] besides the hidden states"):
        _placement(_BareSideInput(), PipelineConfig("layers", [0, 1], 2, "GPipe", 2, 1))


class _CalledBetweenLayers(torch.nn.Module):
    """Modules with parameters that the forward first calls between two decoder layers, one registered before the
    layer list and one after it."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.early = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.late = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10)

    def forward(self, ids):
        x = self.layers[0](self.embed(ids))
        x = self.late(self.early(x))
        return self.head(self.layers[1](x))


def test_a_module_first_called_between_the_layers_is_placed_where_it_is_registered():
    """The probe forward places only modules called before the first layer or after the last; one called between
    them stays where it is registered: after the layer list, the last stage, whose stand-in on stage 0 then refuses
    the call before stage 0's last layer ran (test_a_later_stages_module_called_before...). Placed on the first stage
    instead (as called "before"), the last stage would compute from its stand-in's zeros."""
    from tridist.distcore.pipeline import _placement, probe_forward

    model = _CalledBetweenLayers()
    assert probe_forward(model, "layers").after == {"embed": False, "head": True}
    owner = _placement(model, PipelineConfig("layers", [0, 1], 2, "GPipe", 2, 1)).owner
    assert owner == {"embed": 0, "early": 0, "late": 1, "head": 1, "layers.0": 0, "layers.1": 1}, owner


class _Mixed(torch.nn.Module):
    """Layers whose outputs model code reuses: an ELMo-style mix of every layer's output (`mix`), the embeddings
    fed to every layer beside the hidden states (`embeddings`, Zamba's), or a value one layer hands the next that
    the next ignores (`handed`, GLM-MoE-DSA's top-k)."""

    def __init__(self, reuse: str):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList([_TwoInputs() for _ in range(4)])
        self.head = torch.nn.Linear(4, 10)
        self.reuse = reuse

    def forward(self, ids, labels=None):
        x = first = self.embed(ids)
        outputs, handed = [], None
        for layer in self.layers:
            x, handed = layer(x, first if self.reuse == "embeddings" else None, handed)
            outputs.append(x)
        logits = self.head(torch.stack(outputs).mean(0) if self.reuse == "mix" else x)
        # With labels, the loss alone (as a fused LM head + loss returns it): the probe passes labels
        return logits if labels is None else torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, hidden, beside=None, handed=None):
        out = self.linear(hidden if beside is None else hidden + beside)
        return out, out.sum(-1)


def test_logits_computed_from_other_stages_outputs_are_refused_at_parallelize():
    """Model code that reuses layer outputs, or an embedding beside every layer, computed on another stage: a stage
    would compute from a stand-in's zeros (a hand-written mix of the layers ran under pp 2 with the loss 0.7% and the
    first stage's gradients 90% off, without an error). Refused when the stages are placed, naming what the loss
    (the probe passes labels) is computed from; a value handed on and ignored is not refused (the runtime guard names
    any use)."""
    from tridist.distcore.pipeline import _placement, reused_outputs

    config = PipelineConfig("layers", [0, 2], 4, "GPipe", 2, 1)  # layers 0, 1 on stage 0; 2, 3 on stage 1
    with pytest.raises(NotImplementedError, match=r"loss and logits are computed from \['decoder layer 0', 'decoder layer 1', "
                                                  r"'decoder layer 2'\] besides the hidden states.*pp=1"):
        _placement(_Mixed("mix"), config)
    assert reused_outputs(_Mixed("embeddings"), "layers") == ["embed"]
    assert reused_outputs(_Mixed("handed"), "layers") == []
    assert _placement(_Mixed("handed"), config).owner["head"] == 1


class _Rescaling(_RegisteredOutOfOrder):
    """RWKV's habit: its forward rescales weights in place when the mode switched (`layers_are_rescaled`); it also
    keeps the last length seen and counts its `calls` in a buffer (as a BatchNorm's statistics); `in_place` changes a
    weight in every forward."""

    def __init__(self, *, in_place: bool = False):
        super().__init__(needs_values=True)  # a forward of the real weights
        self.rescaled, self.in_place, self.length = False, in_place, None
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, ids):
        self.length = ids.shape[-1]  # a setting the forward leaves behind
        if self.training == self.rescaled or self.in_place:
            with torch.no_grad():
                self.head.weight.mul_(2.0)
            self.rescaled = not self.training
        self.calls += 1
        return super().forward(ids)


def test_the_probe_forward_leaves_the_model_as_it_was():
    """The probe runs in the model's own mode (switching to eval made RWKV rescale its weights and remember it: its
    training under pp then read other stages' layers, refused) and puts back what the forward set: settings and, on
    the real weights, buffers; a forward that changes a parameter in place is an error naming it. Another stage's
    weight read by indexing is the stand-in's error, not a TypeError (BigBird)."""
    from tridist.distcore.pipeline import _ForeignTensor, probe_forward

    model = _Rescaling()
    weight = model.head.weight.clone()
    assert probe_forward(model, "layers").after == {"head": True, "embed": False, "norm": True}
    assert not model.rescaled and model.length is None and model.calls == 0 and torch.equal(model.head.weight, weight)
    with pytest.raises(RuntimeError, match=r"changed \['head.weight'\] in place; use pp=1"):
        probe_forward(_Rescaling(in_place=True), "layers")
    foreign = _ForeignTensor("bert.encoder.layer.2.weight", 1, torch.empty(4, 4, device="meta"), torch.device("cpu"))
    with pytest.raises(AttributeError, match=r"uses 'bert.encoder.layer.2.weight' \('__getitem__'\), a tensor of "
                                             r"pipeline stage 1"):
        foreign[0]


def test_the_probe_forward_is_kept_for_the_same_parameters(monkeypatch):
    """to_distributed probes before fusing the kernels and the pipeline after: one forward while the layer list, the
    mode and every parameter (name and object) are the same, a module replaced around the same parameter included
    (as fusion replaces a norm); a parameter replaced, or the other mode, probes again."""
    from tridist.distcore import pipeline

    runs = []
    probe = pipeline._probe_forward
    monkeypatch.setattr(pipeline, "_probe_forward", lambda *args: runs.append(1) or probe(*args))
    model = _RegisteredOutOfOrder()
    first = pipeline.probe_forward(model, "layers")
    assert pipeline.probe_forward(model, "layers") is first and len(runs) == 1
    norm = torch.nn.LayerNorm(model.norm.weight.shape)  # another module holding the same parameters
    norm.weight, norm.bias = model.norm.weight, model.norm.bias
    model.norm = norm
    assert pipeline.probe_forward(model, "layers") is first and len(runs) == 1
    model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
    assert pipeline.probe_forward(model, "layers").after == first.after and len(runs) == 2
    model.eval()
    pipeline.probe_forward(model, "layers")
    assert len(runs) == 3


def test_reentrant_checkpointing_is_told_apart_from_the_non_reentrant_kind():
    """What the pipeline refuses before any communication (torch's stage backward cannot run reentrant
    checkpointing): transformers' per-layer checkpoint function with use_reentrant=True or left to torch's default
    (True), and torch's checkpoint_wrapper with CheckpointImpl.REENTRANT; not the non-reentrant ones, a layer whose
    checkpointing is off, or a checkpoint function of the user's own (which torch judges when it runs)."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    from tridist.distcore.pipeline import _refuse_reentrant_checkpointing, _reentrant_checkpointing

    def hf_layer(func, enabled=True):
        layer = torch.nn.Linear(2, 2)
        layer.gradient_checkpointing, layer._gradient_checkpointing_func = enabled, func
        return layer

    reentrant = [hf_layer(functools.partial(checkpoint, use_reentrant=True)), hf_layer(checkpoint),
                 hf_layer(functools.partial(checkpoint)),
                 checkpoint_wrapper(torch.nn.Linear(2, 2), checkpoint_impl=CheckpointImpl.REENTRANT)]
    other = [hf_layer(functools.partial(checkpoint, use_reentrant=False)),
             hf_layer(functools.partial(checkpoint, use_reentrant=True), enabled=False),
             hf_layer(lambda function, *args: function(*args)), torch.nn.Linear(2, 2),
             checkpoint_wrapper(torch.nn.Linear(2, 2), checkpoint_impl=CheckpointImpl.NO_REENTRANT)]
    assert [_reentrant_checkpointing(m) for m in reentrant] == [True] * 4
    assert [_reentrant_checkpointing(m) for m in other] == [False] * 5
    _refuse_reentrant_checkpointing(torch.nn.Sequential(*other))
    with pytest.raises(ValueError, match=r"4 module\(s\) run under reentrant .*\['0', '1', '2'\] \.\.\..*'use_reentrant': False"):
        _refuse_reentrant_checkpointing(torch.nn.Sequential(*reentrant))


def test_micro_batches_split_only_the_tensors_of_the_batch():
    """A micro-batch gets its rows of every batch-major tensor and the others whole: position ids shared by the
    batch ([1, S], as transformers builds them), a scalar, a table of another leading size."""
    from tridist.distcore.pipeline import split_micro_batches

    ids, mask = torch.arange(32).reshape(4, 8), torch.rand(4, 8)
    positions, table = torch.arange(8)[None], torch.randn(3, 8)
    micro = split_micro_batches((ids,), {"attention_mask": mask, "position_ids": positions, "table": table,
                                         "scale": torch.tensor(2.0)}, 2)
    assert len(micro) == 2
    for index, (args, kwargs) in enumerate(micro):
        rows = slice(2 * index, 2 * index + 2)
        assert torch.equal(args[0], ids[rows]) and torch.equal(kwargs["attention_mask"], mask[rows])
        assert kwargs["position_ids"] is positions and kwargs["table"] is table and kwargs["scale"].item() == 2.0


def test_an_earlier_stages_module_stands_in_with_zeros_of_its_output_dtype_and_shape():
    """On a later stage, a module of an earlier one (an embedding) returns zeros of the shape and dtype its code
    gives on the meta device (bf16 here, not the default fp32: the received activation replaces them, and the
    layers' input must keep the model's dtype)."""
    from tridist.distcore.pipeline import _meta_copy, _StandIn

    state = _StageState(stage=1, is_first=False, is_last=True, device=torch.device("cpu"))
    stand_in = _StandIn("model.embed_tokens", 0, _meta_copy(torch.nn.Embedding(10, 4, dtype=torch.bfloat16)), state,
                        "earlier")
    out = stand_in(torch.ones(2, 3, dtype=torch.long))
    assert (out.dtype, tuple(out.shape), out.device) == (torch.bfloat16, (2, 3, 4), torch.device("cpu"))
    assert not out.any() and state.last_placeholder is out


@pytest.mark.parametrize("asked", [dict(use_cache=True), dict(cache=object()), dict(past_key_values=object()),
                                   dict(past_key_value=object(), use_cache=False)])
def test_a_key_value_cache_asked_for_by_any_name_is_refused(asked):
    """The stages return no cache (generate got token ids of 0, silently): refused whichever name passes it in,
    transformers 5.24's `cache` (which ran through the stages) included; None or use_cache=False pass."""
    with pytest.raises(ValueError, match="use_cache=False"):
        _refuse_a_cache({"input_ids": torch.zeros(1, 2, dtype=torch.long), **asked})
    _refuse_a_cache({"input_ids": None, "use_cache": False, "cache": None, "past_key_values": None})
