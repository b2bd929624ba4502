"""distcore.sequence_layout.map_output: a module's hidden states (its output, or the first of a tuple or list) mapped,
the rest and the container's kind kept; distcore.outputs.replace_loss, which replaces a tuple's first entry the same
way (it rebuilt a namedtuple from one list: a TypeError)."""

from collections import namedtuple

import torch

from tridist.distcore.outputs import replace_loss
from tridist.distcore.sequence_layout import first_output, map_output

Pair = namedtuple("Pair", "hidden extra")


def test_map_output_keeps_the_container():
    add = lambda x: x + 10  # noqa: E731
    assert map_output(1, add) == 11
    assert map_output((1, 2), add) == (11, 2) and type(map_output((1, 2), add)) is tuple
    assert map_output([1, 2], add) == [11, 2]  # GPT-1's blocks return lists
    mapped = map_output(Pair(1, 2), add)  # a namedtuple's constructor takes fields, not one iterable
    assert type(mapped) is Pair and mapped == Pair(11, 2)
    assert first_output(Pair(1, 2)) == 1 and first_output([3]) == 3


def test_replace_loss_keeps_the_container():
    loss, logits, new = torch.tensor(1.0), torch.zeros(2, 3), torch.tensor(2.0)
    replaced = replace_loss(Pair(loss, logits), new)
    assert type(replaced) is Pair and replaced.hidden is new and replaced.extra is logits
    assert replace_loss([loss, logits], new)[0] is new and type(replace_loss((loss, logits), new)) is tuple
