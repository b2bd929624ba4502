"""to_distributed's single-process parts: the tensor/sequence-parallel plan it builds from a recognised
structure, and the batch shape it prices."""

import re

import pytest
import torch

from tridist import autotune
from tridist.bench.models import build_model, make_seed_dataloader
from tridist.distcore import auto as td
from tridist.distcore.tensor_parallel import ColWiseParallel, RowWiseParallel, SequenceParallelBegin, SequenceParallelEnd


def _matches(model, plan):
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    return {key: [n for n in names if re.fullmatch(key, n)] for key in plan}


@pytest.mark.parametrize("name, head_key, end_module", [
    ("seed-llama", "weight", "norm"),             # bare root LM head: sequence gathered before the final norm
    ("hf-llama", "lm_head.weight", "lm_head"),
    ("paddle-llama", "lm_head.weight", "lm_head"),
])
def test_plan_names_every_projection_and_matches_only_them(name, head_key, end_module):
    model = build_model(name)
    structure = autotune.ModelSpec.from_module(model, seq_len=8).structure
    plan = td.tensor_parallel_plan(structure, sequence_parallel=True)
    matched = _matches(model, plan)
    assert all(matched.values()), {k: v for k, v in matched.items() if not v}
    layers = len(model.get_submodule(structure.layers))
    colwise = [n for key, styles in plan.items() if any(isinstance(s, ColWiseParallel) for s in styles) for n in matched[key]]
    rowwise = [n for key, styles in plan.items() if any(isinstance(s, RowWiseParallel) for s in styles) for n in matched[key]]
    per_layer_col = 1 if name == "paddle-llama" else 3  # packed qkv, or q/k/v
    per_layer_col += 1 if name == "paddle-llama" else 2  # packed gate_up, or gate/up
    assert len([n for n in colwise if ".layers." in n or n.startswith("layers.")]) == layers * per_layer_col
    assert len([n for n in rowwise if n.endswith(("o_proj", "down_proj"))]) == 2 * layers
    assert head_key in [n for key in plan for n in matched[key]]
    ends = [n for key, styles in plan.items() if any(isinstance(s, SequenceParallelEnd) for s in styles) for n in matched[key]]
    begins = [n for key, styles in plan.items() if any(isinstance(s, SequenceParallelBegin) for s in styles) for n in matched[key]]
    assert ends == [end_module] and begins == [structure.embedding]
    # Regular expressions anchored per layer: "layers.1" must not also match "layers.10"-style names.
    assert all("*" not in key for key in plan)


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
