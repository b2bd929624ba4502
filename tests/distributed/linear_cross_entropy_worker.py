"""kernels.linear_cross_entropy vocabulary-parallel (2 gloo processes; run by test_linear_cross_entropy_tp.py):
the LM head's weight a DTensor split on its rows (Shard(0), as ColwiseParallel splits an nn.Linear head;
37 rows: 19 and 18, an uneven split), hidden states replicated: the loss and the gradients of hidden, the
weight's shards and the bias's equal the single-device op on the whole weight, for every reduction and
option, over several chunks, in the Triton kernels (interpreted) and the CPU path; layouts it cannot use are
errors naming the fix.

Tolerances. Both sides run the same chunk loop on the same fp32 logits (torch.mm of the same rows and weight
rows: each logit is the same dot product). They differ in three places only: the sum of exponentials is
two fp32 partial sums rescaled to the global max (exp of a difference of two fp32 maxima, one rounding each)
and added, instead of one running sum: within (V + 4) u32 relative, V = 37; the row statistics are added
over the ranks in another order (the same bound); and grad_hidden is the sum of two partial GEMMs over
18-19 vocabulary rows, rounded to the input dtype and added (one more rounding to it) instead of one GEMM
over 37 rows: (V + 2) u32 of the magnitudes in fp32, plus 2 u of the input dtype for bf16. Every other
gradient element (the weight's and bias's rows) is computed from its own rows with the same arithmetic as
on one device, given the statistics. So fp32: rtol 1e-5 (>> 41 u32 = 2.4e-6 through the softmax's
factor-of-a-few sensitivity), atol 1e-6 (elements near 0); bf16: the grad_hidden's two roundings, 2 x 2**-8
relative of the partial sums' magnitudes, which the values here keep within 4x the result (rtol 2e-2); the
rest as fp32 up to the one rounding both sides share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tridist import kernels
from tridist.kernels.ops import linear_cross_entropy as lce_module
from tests.distributed.harness import interprets_kernels, run_checks

VOCAB, HIDDEN = 37, 8  # 37 rows over 2 ranks: 19 + 18
OPTIONS = [
    {},
    {"reduction": "sum", "softcap": 2.0},
    {"label_smoothing": 0.1, "softcap": 3.0},
    {"num_items_in_batch": 9},
    {"reduction": "none", "label_smoothing": 0.2},
]
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 2e-2, "atol": 1e-3}}


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _inputs(dtype, *, all_ignored=False):
    generator = torch.Generator().manual_seed(0)  # the same on every rank: the replicated inputs
    hidden = torch.randn(3, 7, HIDDEN, generator=generator).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) / 2).to(dtype)
    bias = torch.randn(VOCAB, generator=generator).to(dtype)
    labels = torch.randint(0, VOCAB, (3, 7), generator=generator)
    labels[0, :4] = -100  # padding
    labels[2, 5] = 0  # the first row of the first shard
    labels[1, 2], labels[1, 3] = 18, 19  # the last row of rank 0's shard, the first of rank 1's
    if all_ignored:
        labels[:] = -100
    return hidden, weight, bias, labels


def _compare(dtype, options, *, with_bias=True, all_ignored=False):
    mesh = _mesh()
    hidden, weight, bias, labels = _inputs(dtype, all_ignored=all_ignored)
    bias = bias if with_bias else None
    # A scalar loss's grad_output other than 1 (as gradient accumulation or a loss scaler give): the backward
    # scales what the forward left, one chunk's GEMMs included, and all-reduces grad_hidden there.
    grad_output = (torch.arange(21.0).reshape(3, 7) / 10 if options.get("reduction") == "none" else torch.tensor(0.75))

    leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((bias,) if with_bias else ())]
    expected = kernels.linear_cross_entropy(leaves[0], leaves[1], labels, bias=leaves[2] if with_bias else None, **options)
    expected_grads = torch.autograd.grad((expected * grad_output).sum(), leaves)

    split_weight = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    split_bias = distribute_tensor(bias, mesh, [Shard(0)]).requires_grad_() if with_bias else None
    whole_hidden = DTensor.from_local(hidden.clone().requires_grad_(), mesh, [Replicate()], run_check=False)
    loss = kernels.linear_cross_entropy(whole_hidden, split_weight, labels, bias=split_bias, **options)
    assert type(loss) is torch.Tensor, type(loss)  # a plain loss, the same on every rank
    inputs = [whole_hidden, split_weight] + ([split_bias] if with_bias else [])
    grads = torch.autograd.grad((loss * grad_output).sum(), inputs)
    assert [g.placements for g in grads] == [t.placements for t in inputs], [g.placements for g in grads]

    tolerance = TOLERANCE[dtype]
    what = f"{dtype} {options} bias={with_bias} all_ignored={all_ignored}"
    torch.testing.assert_close(loss, expected, equal_nan=all_ignored, msg=lambda m: f"loss, {what}: {m}", **tolerance)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, expected_grads):
        torch.testing.assert_close(got.full_tensor(), want, msg=lambda m: f"grad of {name}, {what}: {m}", **tolerance)


def _every_case():
    for dtype in (torch.float32, torch.bfloat16):
        for options in OPTIONS:
            _compare(dtype, options)
    _compare(torch.float32, {}, with_bias=False)
    _compare(torch.float32, {"reduction": "sum"}, all_ignored=True)
    _compare(torch.float32, {}, all_ignored=True)  # mean of nothing: nan, as torch gives


def _small_chunks():
    """Chunks of 4 tokens (21 tokens: 6 chunks, the last one short): each chunk's statistics reduced on its own."""
    saved = lce_module.MIN_CHUNK_TOKENS, lce_module.MAX_CHUNK_TOKENS
    lce_module.MIN_CHUNK_TOKENS = lce_module.MAX_CHUNK_TOKENS = 4
    return saved


def check_vocabulary_parallel_equals_one_device_on_the_cpu_path():
    saved = _small_chunks()
    try:
        _every_case()
    finally:
        lce_module.MIN_CHUNK_TOKENS, lce_module.MAX_CHUNK_TOKENS = saved
    # A bf16 head's 21 tokens in one chunk by the one-chunk rule (chunks of 4 otherwise; the rule allows up to
    # 3 x hidden = 24 here): each rank's weight gradient from one GEMM on its shard in the backward, from the
    # logits' gradient the forward left (mean) or recomputed (reduction="none").
    saved, saved_multiple = _small_chunks(), lce_module.ONE_CHUNK_HIDDEN_MULTIPLE
    lce_module.ONE_CHUNK_HIDDEN_MULTIPLE = 3
    try:
        assert lce_module.chunk_tokens(21, HIDDEN, VOCAB) == 4  # without the rule: 6 chunks
        assert lce_module.chunk_tokens(21, HIDDEN, VOCAB, fp32_accumulator=True) == 21
        for options in (OPTIONS[0], OPTIONS[4]):
            _compare(torch.bfloat16, options)
    finally:
        lce_module.MIN_CHUNK_TOKENS, lce_module.MAX_CHUNK_TOKENS = saved
        lce_module.ONE_CHUNK_HIDDEN_MULTIPLE = saved_multiple


@interprets_kernels
def check_vocabulary_parallel_equals_one_device_in_the_kernels():
    """The Triton kernels with vocab_start past 0 on rank 1 (its label columns and the loss's n_classes the
    whole vocabulary's), in the interpreter; fewer cases: each interpreted launch costs milliseconds."""
    saved = _small_chunks()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            _compare(dtype, OPTIONS[2])
        _compare(torch.float32, OPTIONS[4])
    finally:
        lce_module.MIN_CHUNK_TOKENS, lce_module.MAX_CHUNK_TOKENS = saved


def check_layouts_it_cannot_use_are_errors():
    mesh = _mesh()
    hidden, weight, bias, labels = _inputs(torch.float32)
    split = distribute_tensor(weight, mesh, [Shard(0)])

    def raises(message, hidden=hidden, weight=split, bias=None):
        try:
            kernels.linear_cross_entropy(hidden, weight, labels, bias=bias)
        except (TypeError, ValueError) as error:
            assert message in str(error), error
        else:
            raise AssertionError(f"no error; expected {message!r}")

    raises("must be whole on every rank", hidden=distribute_tensor(hidden, mesh, [Shard(1)]))  # sequence-parallel
    raises("split on its hidden dim", weight=distribute_tensor(weight, mesh, [Shard(1)]))
    raises("must be split alike", bias=bias)  # a plain bias beside a split weight
    raises("taken as a vocabulary-parallel LM head", hidden=DTensor.from_local(hidden, mesh, [Replicate()]), weight=weight)
    # A replicated weight is whole on every rank: the ordinary op, each rank the whole gradient.
    loss = kernels.linear_cross_entropy(hidden, distribute_tensor(weight, mesh, [Replicate()]), labels)
    torch.testing.assert_close(loss, kernels.linear_cross_entropy(hidden, weight, labels))


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    from tridist import distcore

    distcore.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
