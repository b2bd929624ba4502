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

The experts module must be Hugging Face's stacked SwiGLU experts (3-D `gate_up_proj` [experts, 2·ffn,
hidden] and `down_proj` [experts, hidden, ffn], `forward(hidden_states, top_k_index, top_k_weights)`), as
Mixtral, Qwen3-MoE and Qwen2-MoE hold them, or tridist's FusedSwiGLUExperts; a probe (kernels.fuse's)
checks that it computes that before it is split. Pipeline stages split their own MoE layers (the
[pp, dp / ep, ep] mesh). Under tensor parallel (attention split over "mp") the MoE blocks stay whole on
every mp rank, as Megatron's expert tensor parallel of 1: the mp ranks hold the same tokens, route them
alike and each sends them to the experts' ranks of its own ep group (the dp ranks at its mp coordinate,
the [dp / ep, ep, mp] mesh), so each mp rank computes the same expert gradients and none is reduced over
mp.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .tensor_parallel import _elsewhere

__all__ = ["ExpertParallelExperts", "EP_KEYS", "apply_expert_parallel", "expert_mesh"]

EP_KEYS = ("degree", "experts", "fused_activation")


class ExpertParallelExperts(torch.nn.Module):
    """One MoE layer's routed experts, this rank holding `num_experts / ep` of them. The parameters keep the
    replaced module's names (`gate_up_proj`, `down_proj`) as DTensors sharded on the expert dimension over
    `ep_mesh`; `forward` is Hugging Face's experts interface."""

    def __init__(self, experts: torch.nn.Module, ep_mesh: DeviceMesh, *, fused_activation: bool):
        super().__init__()
        from tridist.kernels.ops.swiglu import eager_swiglu, swiglu

        gate_up, down = experts.gate_up_proj, experts.down_proj
        self.num_experts, self.ep = gate_up.shape[0], ep_mesh.size()
        if self.num_experts % self.ep:
            raise ValueError(f"expert parallel: {self.num_experts} experts do not split over ep={self.ep} ranks; "
                             "pick an ep degree that divides the expert count")
        self.ep_mesh = ep_mesh
        self.local_experts = self.num_experts // self.ep
        for name, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
            sharded = distribute_tensor(weight.detach(), ep_mesh, [Shard(0)])  # rank 0's experts, scattered
            self.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=weight.requires_grad))
        self.fused_activation = fused_activation
        self.activation = swiglu if fused_activation else eager_swiglu

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
        gate_up, down = (_ScaleGradient.apply(w.to_local(), 1.0 / self.ep) for w in (self.gate_up_proj, self.down_proj))
        out = routed_swiglu(rows, local_ids[:, None], rows.new_ones(rows.shape[0], 1), gate_up, down,
                            activation=self.activation)
        if rows.shape[0] == 0:
            # No tokens here this step. The weights still get their (zero) gradient, and the output still
            # depends on `rows`: autograd runs only the nodes on a path to the loss, and the dispatch's
            # backward all-to-all is a collective the ep peers run (a rank skipping it hangs them all).
            out = out + 0 * (gate_up.sum() + down.sum() + rows.sum())
        out = all_to_all_single_autograd(out, send, receive, group)
        out = out * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, tokens, out.to(hidden_states.dtype))


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


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
    Each must compute Hugging Face's stacked SwiGLU experts (checked by kernels.fuse's probe). Another pipeline
    stage's modules (a stage holds some layers only) are passed over."""
    from tridist.kernels.fuse import experts_verdict

    modules = dict(model.named_modules())
    replaced = []
    for name in experts:
        if _elsewhere(name, modules):
            continue  # another pipeline stage's module
        if name not in modules:
            raise ValueError(f"expert parallel: the model has no module {name!r} (ep_config['experts'])")
        module = modules[name]
        if isinstance(module, ExpertParallelExperts):
            raise ValueError(f"expert parallel: {name} is split already")
        why = experts_verdict(module)
        if why:
            raise ValueError(f"expert parallel: {name} ({type(module).__name__}) {why}: distcore splits stacked "
                             "SwiGLU experts only (Hugging Face's gate_up_proj / down_proj layout)")
        if any(isinstance(p, DTensor) for p in module.parameters()):
            raise ValueError(f"expert parallel: {name}'s parameters are already DTensors (split by a tensor-parallel "
                             "plan?); leave the experts out of mp_config's plan: expert parallel splits them")
        split = ExpertParallelExperts(module, ep_mesh, fused_activation=fused_activation)
        split.training = module.training
        parent_name, _, child = name.rpartition(".")
        (model.get_submodule(parent_name) if parent_name else model)._modules[child] = split
        replaced.append(split)
    return replaced
