"""distcore.outputs: the loss and the logits are found in every kind of output users' models return,
the loss replaced without touching the caller's object, and an output's form rebuilds the same kind
elsewhere (with or without a loss, with or without logits); packed
`query_key_value` projections must state their layout; distcore's global token mean keeps a caller's count."""

import pytest
import torch

from tridist.distcore.outputs import OutputForm, find_logits, find_loss, replace_loss
from tridist.distcore.tensor_parallel import ColWiseParallel, packed_sizes

transformers = pytest.importorskip("transformers")
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

LOSS, NEW = torch.tensor(2.5), torch.tensor(1.0)
LOGITS = torch.ones(2, 3)


@pytest.mark.parametrize("output", [
    LOSS, (LOSS, LOGITS), [LOSS, LOGITS], {"loss": LOSS, "logits": LOGITS},
    CausalLMOutputWithPast(loss=LOSS, logits=LOGITS),
])
def test_loss_found_replaced_and_rebuilt(output):
    assert find_loss(output) is LOSS
    new = replace_loss(output, NEW)
    assert find_loss(new) is NEW and type(new) is type(output)
    assert find_loss(output) is LOSS  # the caller's object is unchanged
    if not torch.is_tensor(output):
        assert new[1] is LOGITS if not isinstance(output, dict) else new["logits"] is LOGITS
    rebuilt = OutputForm.of(output).build(NEW)
    assert type(rebuilt) is (tuple if isinstance(output, (tuple, list)) else type(output))
    assert find_loss(rebuilt) is NEW
    if isinstance(output, CausalLMOutputWithPast):
        assert rebuilt.logits is None and rebuilt.loss is NEW


@pytest.mark.parametrize("output", [LOGITS, (LOGITS, LOSS), {"logits": LOGITS}, torch.tensor(3),
                                    CausalLMOutputWithPast(logits=LOGITS)])
def test_no_loss_is_none(output):
    assert find_loss(output) is None  # not 0-dim floating, not first, or no "loss" key


@pytest.mark.parametrize("output", [
    LOGITS, (LOGITS, None), (LOSS, LOGITS), (None, LOGITS), [LOSS, LOGITS, None], {"logits": LOGITS, "other": LOGITS},
    {"loss": LOSS, "logits": LOGITS}, CausalLMOutputWithPast(logits=LOGITS), CausalLMOutputWithPast(loss=LOSS, logits=LOGITS),
])
def test_logits_found_and_rebuilt_with_or_without_a_loss(output):
    """What a pipeline's last stage sends back in evaluation: the logits in their place, the loss where
    the model returned one (a call without labels has none), every other output None."""
    assert find_logits(output) is LOGITS
    form = OutputForm.of(output)
    has_loss = find_loss(output) is not None
    rebuilt = form.build(NEW if has_loss else None, LOGITS + 1)
    assert type(rebuilt) is (tuple if isinstance(output, (tuple, list)) else type(output))
    assert torch.equal(find_logits(rebuilt), LOGITS + 1)
    assert (find_loss(rebuilt) is NEW) if has_loss else find_loss(rebuilt) is None
    if isinstance(output, dict):
        assert set(rebuilt) == set(output) and all(rebuilt[k] is None for k in rebuilt if k not in ("loss", "logits"))
    if isinstance(output, CausalLMOutputWithPast):
        assert rebuilt.past_key_values is None and (rebuilt.loss is NEW) == has_loss
    if form.has_loss:  # a training call: the loss alone, the logits None where they were
        assert find_logits(form.build(NEW)) is None


@pytest.mark.parametrize("output", [LOSS, (LOSS,), (LOSS, None), {"loss": LOSS}, torch.tensor(3.0), [None]])
def test_no_logits_is_none(output):
    assert find_logits(output) is None


def test_ambiguous_packed_layout_must_be_stated():
    linear = torch.nn.Linear(8, 24)
    with pytest.raises(ValueError, match=r"packed_parts=1\) for q/k/v packed per head"):
        packed_sizes("layers.0.attention.query_key_value", linear, ColWiseParallel(), 2, parent=None)
    assert packed_sizes("layers.0.attention.query_key_value", linear, ColWiseParallel(packed_parts=1), 2, parent=None) == (24,)
    assert packed_sizes("layers.0.self_attn.qkv_proj", linear, ColWiseParallel(), 2, parent=None) == (8, 8, 8)


def test_packed_sizes_from_head_counts_or_the_plan():
    """q/k/v sizes follow the attention's head counts (its own, else its config's, as Phi-3 keeps them);
    a plan may give them; sizes that do not add up or do not split are errors naming the fix."""
    qkv = torch.nn.Linear(16, 32)  # 4 query heads and 2 key/value heads of 4
    attention = torch.nn.Module()
    attention.config = type("Config", (), {"num_attention_heads": 4, "num_key_value_heads": 2})()
    assert packed_sizes("self_attn.qkv_proj", qkv, ColWiseParallel(), 2, parent=attention) == (16, 8, 8)
    assert packed_sizes("x.fused", qkv, ColWiseParallel(packed_parts=(16, 8, 8)), 2, parent=None) == (16, 8, 8)
    with pytest.raises(ValueError, match="add up to its 32 outputs"):
        packed_sizes("x.fused", qkv, ColWiseParallel(packed_parts=(16, 8, 4)), 2, parent=None)
    with pytest.raises(ValueError, match="does not divide them"):
        packed_sizes("self_attn.qkv_proj", qkv, ColWiseParallel(), 16, parent=attention)


def test_exact_token_mean_only_for_transformers_causal_lm_loss():
    """num_items_in_batch is passed only where its count's convention is known (transformers'
    ForCausalLMLoss shifts labels inside, called by the forward); a model that averages itself is reweighed
    or refused (token_mean.py)."""
    from tests.hf_models import build
    from tridist.bench.models import build_model
    from tridist.distcore.token_mean import takes_num_items

    assert takes_num_items(build("llama", layers=1)) and takes_num_items(build("gpt2", layers=1))
    assert not takes_num_items(build_model("seed-llama"))
    # CPM-Ant inherits transformers' loss_function and takes **kwargs, but computes its own cross entropy: the count
    # was passed and ignored (its loss the mean of rank means under dp); its own mean is reweighed instead
    import transformers

    cpmant = transformers.CpmAntForCausalLM(transformers.CpmAntConfig(
        vocab_size=128, hidden_size=32, num_attention_heads=2, dim_head=16, dim_ff=64, num_hidden_layers=1))
    assert not takes_num_items(cpmant)

    class OwnLoss(torch.nn.Module):  # takes the keyword, but its count's convention is unknown
        loss_function = staticmethod(lambda *a, **k: None)

        def forward(self, ids, labels=None, **kwargs):
            return ids

    assert not takes_num_items(OwnLoss())


def test_the_global_token_mean_keeps_a_callers_num_items_in_batch():
    """distcore's token mean passes the batch's label count as `num_items_in_batch` where the caller gave none, and
    keeps the caller's where given (Hugging Face's Trainer counts over its own gradient-accumulation steps): the
    loss is then the token sum over the caller's count, as without distcore."""
    from tests.hf_models import build
    from tridist.distcore.token_mean import install_global_token_mean

    model = build("llama")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    plain_mean = model(ids, labels=labels).loss
    token_sum = model(ids, labels=labels, num_items_in_batch=torch.tensor(1.0)).loss
    install_global_token_mean(model, dp_group=None, micro_batches=1)
    assert torch.allclose(model(ids, labels=labels).loss, token_sum / 12)  # labelled after the shift: 5 + 7
    assert torch.allclose(model(ids, labels=labels).loss, plain_mean)
    assert torch.allclose(model(ids, labels=labels, num_items_in_batch=torch.tensor(7.0)).loss, token_sum / 7)
