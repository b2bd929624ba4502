"""A vocabulary-parallel embedding in local view: each mp rank holds a slice of the vocabulary's rows.

RowWiseParallel on an nn.Embedding splits its weight's rows (the vocabulary) over the mp ranks, as Megatron-LM's
VocabParallelEmbedding does: a rank looks up the token ids that fall in its rows, zeroes the others' outputs, and
the ranks sum their outputs (one all-reduce of the embeddings). The weight is a Shard(0) DTensor (the optimizer,
FSDP2 and checkpoints see it split); the module's own forward runs on plain tensors, the ids shifted into its
rows, its weight and padding index swapped for their local values for the call only.

Why not torch's RowwiseParallel on the embedding: its DTensor lookup produces a `_MaskPartial` output whose mask
buffer torch.compile cannot trace (FakeTensor meets the real mask: pytorch/pytorch#160697), so a model distributed
with a vocabulary-split embedding could not be compiled. This lookup is plain tensor code, and the sum over the
ranks a DTensor redistribution (Partial -> Replicate), which torch.compile traces.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .sequence_layout import map_first_activation


def split_embedding_vocabulary(name: str, module: torch.nn.Embedding, tp_mesh) -> str:
    """Split `module`'s vocabulary (its weight's rows) over `tp_mesh`: token ids in, the full embeddings out on
    every rank (plain tensors)."""
    unsupported = [option for option, value in (("max_norm", module.max_norm), ("scale_grad_by_freq", module.scale_grad_by_freq),
                                                ("sparse", module.sparse)) if value]
    if unsupported:
        raise NotImplementedError(
            f"parallelize: RowWiseParallel on the embedding {name!r} with {', '.join(unsupported)}: a rank sees only the "
            "ids of its own vocabulary rows, so the renormalised rows, the ids' frequencies or sparse gradients would "
            f"be computed from part of the batch; leave {name!r} out of the plan (replicated), or build it without them")
    weight = distribute_tensor(module.weight.detach(), tp_mesh, [Shard(0)])
    module.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=module.weight.requires_grad))
    rows, (start, _) = compute_local_shape_and_global_offset(weight.shape, tp_mesh, [Shard(0)])
    lookup = _LocalLookup(start, rows[0], weight.shape[0], tp_mesh)
    module.register_forward_pre_hook(lookup.enter, with_kwargs=True)
    module.register_forward_hook(lookup.leave, always_call=True)
    return f"{name}: RowWiseParallel (vocabulary rows {start}..{start + rows[0] - 1} here; outputs summed over the mp ranks)"


class _LocalLookup:
    """The hooks of one vocabulary-parallel embedding: `enter` shifts the ids into this rank's rows (the others to
    row 0, masked) and swaps in the local weight and padding index; `leave` swaps them back, zeroes the masked
    positions' outputs and sums the outputs over the mp ranks."""

    def __init__(self, start: int, rows: int, vocab: int, tp_mesh):
        self.start, self.rows, self.vocab, self.tp_mesh = start, rows, vocab, tp_mesh

    def enter(self, module: torch.nn.Embedding, args, kwargs):
        saved = {"weight": module._parameters["weight"], "padding_idx": module.padding_idx}

        def local_ids(ids: torch.Tensor) -> torch.Tensor:
            # An id outside the vocabulary is outside every rank's rows: its embedding would be zeros, where one
            # device raises. Checked on the device, in stream order (no host sync on an accelerator).
            torch._assert_async(((ids >= 0) & (ids < self.vocab)).all(),
                                f"embedding: token ids must lie in [0, {self.vocab}) (the vocabulary)")
            saved["outside"] = (ids < self.start) | (ids >= self.start + self.rows)
            return (ids - self.start).masked_fill(saved["outside"], 0)

        args, kwargs = map_first_activation(args, kwargs, local_ids)
        weight = saved["weight"]
        # The local rows' gradient flows back into the Shard(0) DTensor parameter.
        module._parameters["weight"] = weight.to_local() if isinstance(weight, DTensor) else weight
        if module.padding_idx is not None:  # its row (gradient kept at zero) on the rank that holds it, else none
            local = module.padding_idx - self.start
            module.padding_idx = local if 0 <= local < self.rows else None
        module._tridist_vocab_lookup = saved
        return args, kwargs

    def leave(self, module: torch.nn.Embedding, args, output):
        saved = vars(module).pop("_tridist_vocab_lookup", None)
        if saved is None:  # the forward stopped before `enter` swapped anything
            return output
        module._parameters["weight"], module.padding_idx = saved["weight"], saved["padding_idx"]
        if output is None:  # the forward raised (an always-call hook): its error goes on
            return None
        output = output.masked_fill(saved["outside"].unsqueeze(-1), 0)
        # The global shape given (a Partial's is the local one): working it out is a call torch.compile cannot trace.
        partial = DTensor.from_local(output, self.tp_mesh, [Partial()], run_check=False, shape=output.shape,
                                     stride=output.stride())
        return partial.redistribute(self.tp_mesh, [Replicate()]).to_local()
