"""Expert parallel: a mixture of experts' routed experts split over `ep` ranks of the data-parallel group.

As torchtitan and Megatron-Core fold expert parallel into data parallel, the dp ranks are laid out as
[dp / ep, ep] (ep innermost: consecutive dp ranks share an expert group). In each MoE layer a rank holds
num_experts / ep of the experts (the weights are DTensors on the "ep" mesh dimension, Shard(0), so that
checkpoints and the optimizer see the whole expert tensor); its tokens go to the ranks of their experts
and come back with two all-to-alls of variable sizes (torch's autograd all_to_all_single), forward and
backward. The router, attention and every other parameter stay data parallel over all dp ranks.

Gradients: a rank's expert gradient already sums the contributions of every token its ep group routed
there (the all-to-all's backward), so data parallel reduces the experts over the dp / ep ranks that hold
the same experts ("edp"), averaging over those, and the forward scales the experts' gradient by 1 / ep
(an identity whose backward multiplies; FSDP2's own `set_gradient_divide_factor` needs a PREMUL_SUM
reduction, which gloo lacks): the result equals the average over dp that the other parameters get. ZeRO
levels shard the experts over "edp" and the rest over all of dp.

Three kinds of experts module split (`split_kind`): Hugging Face's stacked SwiGLU experts (3-D `gate_up_proj`
[experts, 2·ffn, hidden] and `down_proj` [experts, hidden, ffn], as Mixtral, Qwen3-MoE and Qwen2-MoE hold them,
or tridist's FusedSwiGLUExperts) run as the kernels' routed SwiGLU; any other module of Hugging Face's experts
interface, `forward(hidden_states, top_k_index, top_k_weights)`, whose parameters are all stacked on the
expert count (gpt-oss: transposed, with biases and a clamped activation) runs its own forward on the rank's
experts, with expert indices local to the rank. Experts that run every token (Llama 4: `forward(hidden_states)`
on [experts x tokens] rows, each expert's block pre-weighted by the router) get each rank's rows of their
experts from every ep rank by one all-to-all of equal blocks, run their own forward on them and send the
outputs back (`ExpertParallelDenseExperts`). A probe checks each kind before anything is split; a module of no
kind is refused, and `to_distributed`'s search keeps ep at 1 for it. Pipeline stages split their own MoE layers (the
[pp, dp / ep, ep] mesh). Under tensor parallel (attention split over "mp") the MoE blocks stay whole on
every mp rank, as Megatron's expert tensor parallel of 1: the mp ranks hold the same tokens, route them
alike and each sends them to the experts' ranks of its own ep group (the dp ranks at its mp coordinate,
the [dp / ep, ep, mp] mesh), so each mp rank computes the same expert gradients and none is reduced over
mp. Under sequence parallel the blocks run on each mp rank's slice of the sequence instead, every module of the
block with parameters kept whole by ShardLocalParameters (their gradients summed over mp:
`distcore.auto.tensor_parallel_plan`). Expert parallel takes such an experts module over (ShardLocalParameters.
release) and splits it as any other: each mp rank routes its own tokens through its ep group, and the experts'
gradients, each mp rank's for its tokens, are summed over mp in the backward (one all-reduce per experts module
and backward).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .tensor_parallel import ShardLocalParameters, _elsewhere

__all__ = ["ExpertParallelDenseExperts", "ExpertParallelExperts", "EP_KEYS", "apply_expert_parallel", "expert_mesh",
           "split_kind"]

EP_KEYS = ("degree", "experts", "fused_activation")


ROUTED_SWIGLU = "stacked SwiGLU experts (the fused routed SwiGLU)"
OWN_FORWARD = "stacked experts run by their own forward"
EVERY_TOKEN = "stacked experts that run every token, by their own forward"


def split_kind(experts: torch.nn.Module) -> tuple[str | None, str]:
    """How expert parallel runs a rank's share of `experts`: (ROUTED_SWIGLU, OWN_FORWARD or EVERY_TOKEN, "") or
    (None, why none applies)."""
    from tridist.kernels.fuse import experts_verdict

    why_not_swiglu = experts_verdict(experts)
    if why_not_swiglu is None and set(experts._parameters) == {"gate_up_proj", "down_proj"}:
        return ROUTED_SWIGLU, ""
    why_not_swiglu = why_not_swiglu or "SwiGLU experts candidate: parameters beyond gate_up_proj and down_proj"
    why_not_own = own_forward_verdict(experts)
    if why_not_own is None:
        return OWN_FORWARD, ""
    why_not_every_token = every_token_verdict(experts)
    if why_not_every_token is None:
        return EVERY_TOKEN, ""
    return None, (f"{why_not_swiglu}; as stacked experts run by their own forward: {why_not_own}; as experts that "
                  f"run every token: {why_not_every_token}")


def own_forward_verdict(experts: torch.nn.Module) -> str | None:
    """None when each ep rank can run `experts`' own forward on its experts alone; else why not. That needs
    Hugging Face's experts interface `forward(hidden_states, top_k_index, top_k_weights)`, parameters all of
    the module itself, stacked on a first dim of the expert count, no buffers, and a probe: the experts split
    in two groups, each group's forward on its rows with indices local to the group and unit weights, then
    weighted and summed, gives the whole module's output (fresh fp32 parameters, a few experts). The probe
    sees forward values in the module's current mode: a forward whose experts interact only through a
    custom backward, token counts (capacity dropping) or more experts than it probes could still pass."""
    from tridist.kernels.fuse import _probe_input

    def split_equals_whole(whole, group, weights, half, hidden):
        tokens, k = 6, 2
        generator = torch.Generator(device="cpu").manual_seed(78)
        index = torch.stack([torch.randperm(2 * half, generator=generator)[:k] for _ in range(tokens)])
        routing = torch.rand(tokens, k, generator=generator)
        x = _probe_input((tokens, hidden))
        expected = torch.func.functional_call(whole, weights, (x, index, routing))
        split = torch.zeros_like(x)
        for first in (0, half):
            token, slot = torch.nonzero((index >= first) & (index < first + half), as_tuple=True)
            local = {name: w[first:first + half] for name, w in weights.items()}
            out = torch.func.functional_call(group, local, (x[token], index[token, slot, None] - first,
                                                            x.new_ones(len(token), 1)))
            split.index_add_(0, token, out * routing[token, slot, None])
        return expected, split

    return _probe_split(experts, 3, split_equals_whole,
                        "its forward does not take (hidden_states, top_k_index, top_k_weights)",
                        "its output is not the sum of its experts' outputs on their routed rows, weighted (a probe)")


def every_token_verdict(experts: torch.nn.Module) -> str | None:
    """None when `experts` runs every expert on its own block of rows, so that each ep rank can run its own
    forward on its experts' blocks alone (Llama 4: `forward(hidden_states)` with [experts x tokens, hidden]
    rows, expert e's block the e-th); else why not. Parameters and probe as `own_forward_verdict`'s: the two
    groups' blocks through their experts, concatenated, give the whole module's output."""
    from tridist.kernels.fuse import _probe_input

    def split_equals_whole(whole, group, weights, half, hidden):
        x = _probe_input((2 * half * 3, hidden))  # 3 tokens per expert
        expected = torch.func.functional_call(whole, weights, (x,))
        blocks = x.view(2 * half, 3, hidden)
        split = torch.cat([torch.func.functional_call(group, {n: w[first:first + half] for n, w in weights.items()},
                                                      (blocks[first:first + half].reshape(-1, hidden),))
                           for first in (0, half)])
        return expected, split

    return _probe_split(experts, 1, split_equals_whole, "its forward does not take (hidden_states) alone",
                        "its output is not each expert's block of rows through that expert (a probe)")


def _probe_split(experts: torch.nn.Module, n_inputs: int, split_equals_whole, wrong_signature: str,
                 wrong_output: str) -> str | None:
    """The checks two kinds share: parameters all the module's own and stacked on the expert count, no buffers,
    no hooks, a forward taking `n_inputs` inputs; then `split_equals_whole(whole, group, weights, half, hidden)`
    (the probe's two results, with the module copied for 2·half and half experts: fresh fp32 parameters) must
    agree at one of the parameters' widths (the input's is one of them)."""
    from tridist.kernels.fuse import _close, fresh_probe_values, stacked_expert_count

    num_experts, why_not = stacked_expert_count(experts)
    if num_experts is None:
        return why_not
    params = dict(experts.named_parameters(recurse=False))
    try:
        inspect.signature(experts.forward).bind(*[None] * n_inputs)
    except TypeError:
        return wrong_signature
    if experts._forward_hooks or experts._forward_pre_hooks:
        return "it has forward hooks"
    half = 2 if num_experts >= 4 else 1
    generator = torch.Generator(device="cpu").manual_seed(77)
    weights = {name: fresh_probe_values((2 * half, *p.shape[1:]), generator) for name, p in params.items()}
    try:
        whole, group = _local_template(experts, 2 * half), _local_template(experts, half)
    except Exception as error:  # noqa: BLE001 - a module that cannot be copied this way is refused, with why
        return f"it cannot be copied for a share of its experts ({type(error).__name__}: {error})"
    failures = []
    for hidden in sorted({d for p in params.values() for d in p.shape[1:]}):  # the input's width is one of them
        try:
            with torch.no_grad():
                expected, split = split_equals_whole(whole, group, weights, half, hidden)
        except Exception as error:  # noqa: BLE001 - a wrong width fails; the reasons are reported if all do
            failures.append(f"{hidden}: {type(error).__name__}")
            continue
        return None if _close(split, expected) else wrong_output
    return f"its forward failed on a probe at every candidate width ({', '.join(failures)})"


def _local_template(experts: torch.nn.Module, count: int) -> torch.nn.Module:
    """A copy of `experts` for `count` of its experts, its parameters meta placeholders (a call passes the real
    ones: torch.func.functional_call), sharing its config, `num_experts` set to `count`."""
    from tridist.kernels.fuse import stacked_experts_copy

    return stacked_experts_copy(experts, count)


class ExpertParallelExperts(torch.nn.Module):
    """One MoE layer's routed experts, this rank holding `num_experts / ep` of them. The parameters keep the
    replaced module's names (`gate_up_proj`, `down_proj`, biases) as DTensors sharded on the expert dimension
    over `ep_mesh`; `forward` is Hugging Face's experts interface. `kind` (`split_kind`): the kernels' routed
    SwiGLU, or the replaced module's own forward on this rank's experts (probed here when not given).
    `sum_gradients_over`: the mesh of ranks that hold the same experts and route other tokens to them (the mp
    ranks under sequence parallel), over which the experts' gradients are summed in the backward."""

    def __init__(self, experts: torch.nn.Module, ep_mesh: DeviceMesh, *, fused_activation: bool,
                 kind: str | None = None, sum_gradients_over: DeviceMesh | None = None):
        super().__init__()
        from tridist.kernels.ops.swiglu import eager_swiglu, swiglu

        if kind is None:
            kind, why = split_kind(experts)
            if kind is None:
                raise ValueError(f"expert parallel: {type(experts).__name__} cannot be split: {why}")
        if (kind == EVERY_TOKEN) != isinstance(self, ExpertParallelDenseExperts):
            raise ValueError(f"expert parallel: {kind} split as {type(self).__name__}; experts that run every token "
                             "split as ExpertParallelDenseExperts, the others as ExpertParallelExperts")
        params = dict(experts.named_parameters(recurse=False))
        self.num_experts, self.ep = next(iter(params.values())).shape[0], ep_mesh.size()
        if self.num_experts % self.ep:
            raise ValueError(f"expert parallel: {self.num_experts} experts do not split over ep={self.ep} ranks; "
                             "pick an ep degree that divides the expert count")
        self.ep_mesh, self.sum_gradients_over = ep_mesh, sum_gradients_over
        self.local_experts = self.num_experts // self.ep
        for name, weight in params.items():
            sharded = distribute_tensor(weight.detach(), ep_mesh, [Shard(0)])  # rank 0's experts, scattered
            self.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=weight.requires_grad))
        self.kind = kind
        self.fused_activation = fused_activation and kind == ROUTED_SWIGLU
        self.activation = swiglu if fused_activation else eager_swiglu
        # The replaced module, for this rank's experts: kept out of the submodules (its parameters are
        # placeholders, the shards above are passed in at each call).
        self.__dict__["own"] = _local_template(experts, self.local_experts) if kind != ROUTED_SWIGLU else None

    def train(self, mode: bool = True) -> "ExpertParallelExperts":
        super().train(mode)
        if self.own is not None:  # not a submodule: its mode follows this module's by hand
            self.own.train(mode)
        return self

    def extra_repr(self) -> str:
        summed = f", gradients summed over {self.sum_gradients_over.size()} ranks" if self.sum_gradients_over else ""
        return f"{self.local_experts} of {self.num_experts} experts, {self.kind}{summed}"

    def _local_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's experts as plain tensors, their gradients scaled by 1 / ep (the module docstring) and summed
        over `sum_gradients_over`."""
        group = self.sum_gradients_over.get_group() if self.sum_gradients_over is not None else None
        return {name: _ExpertGradient.apply(p.to_local(), 1.0 / self.ep, group)
                for name, p in self._parameters.items()}

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        from tridist.kernels.ops.swiglu import routed_swiglu, sort_by_expert

        k = top_k_index.shape[-1]
        group = self.ep_mesh.get_group()
        order, counts = sort_by_expert(top_k_index, self.num_experts)  # by expert: by destination rank too
        with torch.no_grad():
            received = torch.empty_like(counts)  # [source rank, local expert]: rows each rank sends here
            dist.all_to_all_single(received, counts, group=group)
            send = counts.view(self.ep, self.local_experts).sum(1).tolist()
            receive = received.view(self.ep, self.local_experts).sum(1).tolist()
            local_ids = torch.arange(self.local_experts, device=counts.device).repeat(self.ep)
            local_ids = local_ids.repeat_interleave(received)  # each received row's local expert
        tokens = order // k
        rows = all_to_all_single_autograd(hidden_states[tokens], receive, send, group)
        local = self._local_parameters()
        unit = rows.new_ones(rows.shape[0], 1)
        if self.own is None:
            out = routed_swiglu(rows, local_ids[:, None], unit, local["gate_up_proj"], local["down_proj"],
                                activation=self.activation)
        elif rows.shape[0]:
            out = torch.func.functional_call(self.own, local, (rows, local_ids[:, None], unit))
        else:  # the interface's output is the input's shape; a module's own forward may not take zero rows
            out = rows.new_zeros(rows.shape)
        if rows.shape[0] == 0:
            # No tokens here this step. The weights still get their (zero) gradient, and the output still
            # depends on `rows`: autograd runs only the nodes on a path to the loss, and the dispatch's
            # backward all-to-all is a collective the ep peers run (a rank skipping it hangs them all).
            out = out + 0 * (sum(w.sum() for w in local.values()) + rows.sum())
        out = all_to_all_single_autograd(out, send, receive, group)
        out = out * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, tokens, out.to(hidden_states.dtype))


class ExpertParallelDenseExperts(ExpertParallelExperts):
    """Experts that run every token (kind EVERY_TOKEN: Llama 4's), this rank holding `num_experts / ep` of them.
    `forward(hidden_states)` takes [experts x tokens, hidden] rows, expert e's block of this rank's tokens the
    e-th (the MoE block repeats and weighs them). Block j of experts belongs to ep rank j: one all-to-all sends
    each rank's blocks of rank j's experts there, every rank runs its experts on all its group's tokens, and a
    second all-to-all brings the outputs back in the same order."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        group, width, held = self.ep_mesh.get_group(), hidden_states.shape[-1], self.local_experts
        tokens = hidden_states.shape[0] // self.num_experts
        with torch.no_grad():  # each ep rank's token count (its micro-batch's)
            counts = torch.full((self.ep,), tokens, dtype=torch.int64, device=hidden_states.device)
            theirs = torch.empty_like(counts)
            dist.all_to_all_single(theirs, counts, group=group)
            theirs = theirs.tolist()
        send, receive = [held * tokens] * self.ep, [held * t for t in theirs]
        rows = all_to_all_single_autograd(hidden_states, receive, send, group)  # rank r's blocks of my experts
        rows = torch.cat([block.view(held, t, width) for block, t in zip(rows.split(receive), theirs)], dim=1)
        local = self._local_parameters()
        out = torch.func.functional_call(self.own, local, (rows.reshape(-1, width),)).view(held, -1, width)
        out = torch.cat([block.reshape(-1, width) for block in out.split(theirs, dim=1)])
        return all_to_all_single_autograd(out, send, receive, group)


class _ExpertGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `scale` and, given a `group`, sums it over the
    group's ranks (each computed it for its own tokens)."""

    @staticmethod
    def forward(ctx, x, scale, group):
        ctx.scale, ctx.group = scale, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad * ctx.scale
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def expert_mesh(mesh, ep: int, device_type: str) -> DeviceMesh:
    """The job's mesh (a ProcessMesh with a "dp" dimension, and "pp" and "mp" or not) with "dp" split into
    ("edp", "ep"), ep innermost within dp: its "ep" dimension holds the experts' shards, "edp" the ranks that
    share them; the "mp" ranks each hold the same experts (expert_parallel's docstring). Every rank builds it
    alike (DeviceMesh creation is collective)."""
    names = list(mesh.dim_names)
    if "dp" not in names:
        raise ValueError(f"expert parallel folds into data parallel: the mesh {names} has no 'dp' dimension")
    ranks = np.asarray(mesh.mesh)
    axis = names.index("dp")
    dp = ranks.shape[axis]
    if ep < 1 or dp % ep:
        raise ValueError(f"expert parallel: ep={ep} must divide the data-parallel degree {dp} (ep folds into dp)")
    shape = ranks.shape[:axis] + (dp // ep, ep) + ranks.shape[axis + 1:]
    return DeviceMesh(device_type, torch.as_tensor(ranks.reshape(shape)),
                      mesh_dim_names=tuple(names[:axis] + ["edp", "ep"] + names[axis + 1:]))


def apply_expert_parallel(model: torch.nn.Module, experts: list[str], ep_mesh: DeviceMesh, *,
                          fused_activation: bool = True) -> list[ExpertParallelExperts]:
    """Replace each named experts module of `model` by its expert-parallel split (in place); returns them.
    Each must be of a kind `split_kind` knows (checked by its probes). Another pipeline stage's modules (a stage
    holds some layers only) are passed over. An experts module a tensor-parallel plan keeps whole on every mp rank
    for its own tokens (ShardLocalParameters, under sequence parallel) is taken over, its gradients summed over mp."""
    modules = dict(model.named_modules())
    replaced, kinds = [], {}  # split_kind's verdict per _probe_key, probed once
    for name in experts:
        if _elsewhere(name, modules):
            continue  # another pipeline stage's module
        if name not in modules:
            raise ValueError(f"expert parallel: the model has no module {name!r} (ep_config['experts'])")
        module = modules[name]
        if isinstance(module, ExpertParallelExperts):
            raise ValueError(f"expert parallel: {name} is split already")
        on_sequence_slices = ShardLocalParameters.release(module)  # the mp mesh, or None
        if any(isinstance(p, DTensor) for p in module.parameters()):
            raise ValueError(f"expert parallel: {name}'s parameters are already DTensors (split by a tensor-parallel "
                             "plan?); leave the experts out of mp_config's plan (or give them ShardLocalParameters, "
                             "under sequence parallel): expert parallel splits them")
        key = _probe_key(module)
        if key not in kinds:
            kinds[key] = split_kind(module)
        kind, why = kinds[key]
        if kind is None:
            raise ValueError(f"expert parallel: {name} ({type(module).__name__}) cannot be split: {why}. distcore "
                             "splits stacked experts of Hugging Face's interface forward(hidden_states, "
                             "top_k_index, top_k_weights) and experts that run every token (forward(hidden_states) "
                             "on [experts x tokens] rows); keep ep=1 for this model")
        split = (ExpertParallelDenseExperts if kind == EVERY_TOKEN else ExpertParallelExperts)(
            module, ep_mesh, fused_activation=fused_activation, kind=kind,
            sum_gradients_over=on_sequence_slices)
        split.training = module.training
        parent_name, _, child = name.rpartition(".")
        (model.get_submodule(parent_name) if parent_name else model)._modules[child] = split
        replaced.append(split)
    return replaced


def _probe_key(module: torch.nn.Module) -> tuple:
    """What split_kind's verdict depends on: the module's type and its parameters' names and shapes."""
    return (type(module), *[(n, tuple(p.shape)) for n, p in module.named_parameters()])


def expert_parallel_refusal(model: torch.nn.Module, experts: list[str]) -> str | None:
    """Why expert parallel cannot split the named experts modules of `model` (each _probe_key probed once), or None."""
    seen = set()
    for name in experts:
        module = model.get_submodule(name)
        if _probe_key(module) in seen:
            continue
        seen.add(_probe_key(module))
        kind, why = split_kind(module)
        if kind is None:
            return f"{name} ({type(module).__name__}) cannot be split: {why}"
    return None
