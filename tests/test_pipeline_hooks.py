"""pipeline.py's stage hooks on one process: the first layer of a later stage takes the received activation
in place of the earlier stages' placeholder, and only that argument."""

from __future__ import annotations

import warnings

import pytest
import torch

from tridist.distcore.pipeline import PipelineConfig, _StageState, install_layer_hooks


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
