"""ExpertParallelExperts on 2 gloo processes (run by test_expert_parallel.py; experts that run every token, as
Llama 4's, by ExpertParallelDenseExperts, with uneven tokens per rank): the routed experts split over
an ep group of 2, each rank's tokens dispatched to their experts' rank and back. Output, the input's gradient
and the experts' gradients equal one process running both ranks' tokens through the whole experts, also
when a rank receives no tokens at all (every token routed to the other rank's experts): its backward must
still run the dispatch's all-to-all, or its peer waits forever (a hang found when pipeline stages' shape
inference ran MoE layers on uninitialised inputs, which routed every token to one rank).

Tolerance: both sides compute each token's expert outputs with the same fp32 GEMMs on the same rows; only
the order of sums differs (an expert's weight gradient adds the two ranks' tokens in another order, 1/ep
scaled): rtol 1e-5, atol 1e-6 (values of order 1, sums of under 20 terms: ~20 u32 = 1.2e-6 relative).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tridist.distcore.expert_parallel import OWN_FORWARD, ROUTED_SWIGLU, ExpertParallelExperts
from tridist.kernels.ops.swiglu import eager_swiglu, routed_swiglu
from tests.distributed.harness import run_checks

EXPERTS, HIDDEN, FFN, TOKENS, K = 4, 8, 6, 5, 2
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class _StackedExperts(torch.nn.Module):
    """Hugging Face's stacked SwiGLU experts (what ExpertParallelExperts splits, after its probe)."""

    def __init__(self, generator, experts: int = EXPERTS):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * FFN, HIDDEN, generator=generator) / HIDDEN**0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, HIDDEN, FFN, generator=generator) / FFN**0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):  # Hugging Face's experts' math and interface
        return routed_swiglu(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                             activation=eager_swiglu)


def _compare(route):
    """`route(rank)`: each rank's [TOKENS, K] expert indices."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    experts = _StackedExperts(torch.Generator().manual_seed(0))  # the same weights on every rank
    for kind in (ROUTED_SWIGLU, OWN_FORWARD):  # the fused routed SwiGLU; the module's own forward on local experts
        _compare_kind(experts, ExpertParallelExperts(experts, mesh, fused_activation=False, kind=kind), route)


def _compare_kind(experts, split, route):
    world = dist.get_world_size()
    inputs = []
    for rank in range(world):  # every rank's tokens, known everywhere for the single-process reference
        generator = torch.Generator().manual_seed(100 + rank)
        inputs.append((torch.randn(TOKENS, HIDDEN, generator=generator), route(rank),
                       torch.rand(TOKENS, K, generator=generator)))
    upstream = [torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(200 + r)) for r in range(world)]

    rank = dist.get_rank()
    hidden, index, weights = inputs[rank]
    hidden = hidden.clone().requires_grad_()
    out = split(hidden, index, weights)
    (out * upstream[rank]).sum().backward()

    whole = [t.detach().clone().requires_grad_() for t in (experts.gate_up_proj, experts.down_proj)]
    leaves = [h.clone().requires_grad_() for h, _, _ in inputs]
    outs = [routed_swiglu(h, i, w, *whole, activation=eager_swiglu) for h, (_, i, w) in zip(leaves, inputs)]
    sum((o * g).sum() for o, g in zip(outs, upstream)).backward()

    torch.testing.assert_close(out, outs[rank].detach(), **TOLERANCE)
    torch.testing.assert_close(hidden.grad, leaves[rank].grad, **TOLERANCE)
    # Data parallel averages the gradients over ranks; expert parallel's 1/ep scale gives that average here.
    for name, reference in zip(("gate_up_proj", "down_proj"), whole):
        got = getattr(split, name).grad.full_tensor()
        torch.testing.assert_close(got, reference.grad / world, msg=lambda m: f"{split.kind}, {name}: {m}", **TOLERANCE)


def check_tokens_dispatched_and_combined_equal_one_process():
    _compare(lambda rank: torch.randint(0, EXPERTS, (TOKENS, K), generator=torch.Generator().manual_seed(rank)))


def check_a_rank_that_receives_no_tokens_still_runs_the_backward_all_to_all():
    """Every token of both ranks routed to experts 0 and 1, which rank 0 holds: rank 1 receives none."""
    _compare(lambda rank: torch.tensor([[0, 1]] * TOKENS))


class _EveryTokenExperts(torch.nn.Module):
    """Experts that run every token, as Llama 4's: [experts x tokens, hidden] rows, expert e's block the e-th,
    weights stored [experts, hidden, 2·ffn] and [experts, ffn, hidden]."""

    def __init__(self, generator):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, 2 * FFN, generator=generator) / HIDDEN**0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN, generator=generator) / FFN**0.5)

    def forward(self, hidden_states):
        blocks = hidden_states.view(self.gate_up_proj.shape[0], -1, hidden_states.shape[-1])
        return torch.bmm(eager_swiglu(torch.bmm(blocks, self.gate_up_proj)), self.down_proj).view(-1, HIDDEN)


def check_experts_that_run_every_token_with_uneven_tokens_equal_one_process():
    """ExpertParallelDenseExperts with 5 tokens on rank 0 and 3 on rank 1 (uneven micro-batches): each rank's
    output and input gradient equal the whole module's on its own rows, and the experts' gradients (1/ep
    scaled) the data-parallel average of one process running both ranks' rows."""
    from tridist.distcore.expert_parallel import EVERY_TOKEN, ExpertParallelDenseExperts

    world, rank = dist.get_world_size(), dist.get_rank()
    experts = _EveryTokenExperts(torch.Generator().manual_seed(0))
    split = ExpertParallelDenseExperts(experts, init_device_mesh("cpu", (world,)), fused_activation=False)
    assert split.kind == EVERY_TOKEN
    tokens = [5, 3][:world] + [4] * max(0, world - 2)
    rows = [torch.randn(EXPERTS * t, HIDDEN, generator=torch.Generator().manual_seed(300 + r)) for r, t in enumerate(tokens)]
    upstream = [torch.randn(EXPERTS * t, HIDDEN, generator=torch.Generator().manual_seed(400 + r)) for r, t in enumerate(tokens)]
    mine = rows[rank].clone().requires_grad_()
    out = split(mine)
    (out * upstream[rank]).sum().backward()

    reference = _EveryTokenExperts(torch.Generator().manual_seed(0))
    leaves = [r.clone().requires_grad_() for r in rows]
    outs = [reference(leaf) for leaf in leaves]
    sum((o * g).sum() for o, g in zip(outs, upstream)).backward()
    torch.testing.assert_close(out, outs[rank].detach(), **TOLERANCE)
    torch.testing.assert_close(mine.grad, leaves[rank].grad, **TOLERANCE)
    for name in ("gate_up_proj", "down_proj"):
        got = getattr(split, name).grad.full_tensor()
        torch.testing.assert_close(got, getattr(reference, name).grad / world, msg=lambda m: f"{name}: {m}", **TOLERANCE)


def check_an_ep_degree_that_does_not_divide_the_experts_is_refused_and_the_split_keeps_the_mode():
    """3 experts over ep 2: an error naming both and the fix. apply_expert_parallel on a model in eval mode: the split
    module is in eval mode too, and follows the model's train(); unfused, it runs the eager activation."""
    from tridist.distcore.expert_parallel import apply_expert_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        ExpertParallelExperts(_StackedExperts(torch.Generator().manual_seed(0), experts=3), mesh, fused_activation=False)
    except ValueError as error:
        assert "3 experts do not split over ep=2" in str(error) and "divides the expert count" in str(error), str(error)
    else:
        raise AssertionError("3 experts split over ep=2")
    model = torch.nn.Module()
    model.experts = _StackedExperts(torch.Generator().manual_seed(0))
    model.eval()
    (split,) = apply_expert_parallel(model, ["experts"], mesh, fused_activation=False)
    assert model.experts is split and not split.training
    assert split.activation is eager_swiglu  # fused_activation=False: the CPU path computes alike, so asked by name
    model.train()
    assert split.training


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    from tridist import distcore

    distcore.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
