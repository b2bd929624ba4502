"""Communication-overlapped tensor-parallel matmuls: `all_gather_matmul` and `matmul_reduce_scatter`.

The two linears at the borders of a sequence-parallel region (Megatron-style tensor parallel with
sequence parallelism) each pair a collective with a matmul:

- entry, a ColWise linear whose input is sharded along the sequence:
  `y = F.linear(all_gather(x_shard, dim=gather_dim), weight)`;
- exit, a RowWise linear whose output goes back onto sequence shards:
  `y_shard = reduce_scatter(F.linear(x, weight), dim=scatter_dim)`.

Run one after the other, the collective and the matmul serialise. Here each is decomposed into a ring
of `world_size` steps over chunks of the gathered/scattered dim, and every step computes on the chunk
already present while the next chunk travels, so the communication hides behind the matmul.

Weight convention: `weight` is `[out_features, in_features]`, nn.Linear's own layout (what F.linear
takes): pass `linear.weight` of a ColWise/RowWise-sharded nn.Linear as it is. Neither op takes a bias:
add a ColWise bias to `y` after the call, and a RowWise bias to `y_shard` after the reduce-scatter
(adding it inside would add it `world_size` times).

Ring schedules (rank r of a group of W, chunk c = rows [c*n, (c+1)*n) of the gathered/scattered dim;
each rank sends to r+1 and receives from r-1, one `batch_isend_irecv` per step):

- all-gather ring (`all_gather_matmul` forward, `matmul_reduce_scatter` backward): at step s rank r
  holds the shard of rank (r - s) mod W; it posts send(that shard) + recv(the shard of r - s - 1),
  computes the matmul of the chunk it holds into its rows of the output, then waits. W matmuls and
  W - 1 transfers, each transfer under a matmul.
- reduce-scatter ring (`matmul_reduce_scatter` forward, `all_gather_matmul` backward): the running sum
  of chunk c starts at rank c + 1 and travels c+1 -> c+2 -> ... -> c, each rank adding its own
  partial product. At step s rank r posts send(its running sum) + recv(the running sum of chunk
  r - 1 - s), computes its partial product of that chunk while the sum travels, then waits and adds.
  The running sums are fp32 whatever the input dtype and are cast once at the end (fp32 on the wire:
  twice the bytes of a bf16 reduce-scatter, for one rounding instead of W - 1).

Backward:
- `all_gather_matmul`: grad_x_shard = reduce-scatter of `grad_y @ weight` along gather_dim (the
  reduce-scatter ring, overlapped); grad_weight = `grad_y^T @ gathered x`, accumulated in fp32 chunk by
  chunk inside that same ring, so it adds compute under the transfers. Memory: by default the
  forward keeps the gathered x (the ring receives straight into one [W, *x_shard.shape] buffer, so
  keeping it costs no copy; it is what a plain all_gather + F.linear would save too). With
  `save_gathered=False` only the shard is kept (W times less activation memory per layer) and the
  backward gathers x again with the all-gather ring, each chunk's grad_weight product hiding that
  transfer: W - 1 extra transfers per backward, no extra exposed communication when the matmuls are
  long enough (Megatron-LM's sequence-parallel choice).
- `matmul_reduce_scatter`: grad_x = all_gather(grad_y_shard) @ weight and grad_weight =
  all_gather(grad_y_shard)^T @ x, both computed per chunk inside one all-gather ring (the same ring
  as `all_gather_matmul`'s forward, with weight^T). Nothing beyond x and weight is saved.

On CUDA with NCCL: the transfers are NCCL point-to-point ops, which run on NCCL's own stream; the
work handles are waited on right before their chunk is used (`work.wait()` makes the compute stream
wait on that stream, it does not block the host), so the matmul of step s, queued on the compute
stream after the transfers of step s were posted, overlaps them. Overlap can only be seen on GPUs
(on gloo/CPU both run on the same cores); nothing here asserts a speed-up.

torch's own async tensor parallel, `torch.ops.symm_mem.fused_all_gather_matmul` /
`fused_matmul_reduce_scatter` (torch.distributed._symmetric_memory), overlaps the same way with
symmetric memory: peers map each other's buffers over NVLink and copy engines move the chunks, with
no NCCL kernels competing for SMs; Inductor substitutes them for all_gather + mm patterns when
`torch._inductor.config._micro_pipeline_tp` is set. They are CUDA-only (CUDA and Meta kernels, no CPU),
need P2P-capable GPUs in one node and symmetric-memory allocations, and have no autograd formula.
`backend="symm_mem"` runs them, with the autograd formula added (symm_mem_matmul.py). The default,
`backend="ring"`, is this portable ring: it runs on any backend with point-to-point ops (gloo on CPU,
NCCL within and across nodes), keeps reduce-scatter sums in fp32, and is the one the GPU-free test
suite runs end to end; the symmetric-memory ops may hide more on one NVLink node (no NCCL kernels on
the SMs): time both on those GPUs (a few training steps of each) before switching.

torch.compile: both ops are registered with torch.library (`tridist::all_gather_matmul`,
`tridist::matmul_reduce_scatter` and their backwards), keyed by the group's name, so a compiled
graph holds each as one opaque node and fullgraph capture works. They are declared functional (no
mutated arguments): like any collective, every rank must run them in the same order, which a graph
compiled identically on every rank does; their outputs are always used, so they are never
eliminated. Eager calls skip the op dispatch and run a torch.autograd.Function directly.

Limits: every rank of the group must pass a shard of the same shape (the ring does not check across
ranks: a mismatch fails in gloo and hangs or corrupts in NCCL); the gathered/scattered dim must be a
leading dim (not the contracted last dim); the reduce-scatter splits evenly (the dim must divide by
the group size); double backward is not supported.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ._common import SUPPORTED_DTYPES, no_autocast

__all__ = ["BACKENDS", "all_gather_matmul", "check_backend_available", "matmul_reduce_scatter"]


# ------------------------------------------------------------------------------------------ the group


@dataclass(frozen=True)
class _Ring:
    group: dist.ProcessGroup
    size: int
    rank: int  # in the group
    next: int  # global ranks of the neighbours: we send to `next`, receive from `prev`
    prev: int


def _default_group(op: str):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{op}: torch.distributed is not initialized; call torch.distributed.init_process_group(...) "
            "first (group=None means the default group)"
        )
    return dist.group.WORLD


def _resolve_group(op: str, group) -> dist.ProcessGroup:
    return _default_group(op) if group is None else group


def _group_name(op: str, group) -> str:
    return _resolve_group(op, group).group_name


def _group_by_name(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


def _ring(op: str, group: dist.ProcessGroup, device: torch.device) -> _Ring:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"{op}: this process (global rank {dist.get_rank()}) is not a member of the group; "
            "call it only on the group's ranks (dist.new_group returns a placeholder to the others)"
        )
    _check_backend(op, group, device)
    return _Ring(
        group=group,
        size=size,
        rank=rank,
        next=dist.get_global_rank(group, (rank + 1) % size),
        prev=dist.get_global_rank(group, (rank - 1) % size),
    )


def _check_backend(op: str, group: dist.ProcessGroup, device: torch.device) -> None:
    """NCCL moves CUDA tensors only, gloo's point-to-point ops CPU tensors only: say so up front."""
    if dist.get_world_size(group) == 1:
        return  # no transfer at all
    spec = str(dist.get_backend(group))
    if ":" in spec:  # "cpu:gloo,cuda:nccl"
        by_device = dict(part.split(":", 1) for part in spec.replace(" ", "").split(","))
        backend = by_device.get(device.type)
        if backend is None:
            raise ValueError(
                f"{op}: the group's backends ({spec}) have none for {device.type} tensors; "
                f"move the tensors to one of {sorted(by_device)} or use a group with a {device.type} backend"
            )
    else:
        backend = spec
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"{op}: the group uses NCCL, which moves CUDA tensors only, but the tensors are on {device}; "
            "move them to the GPU (.cuda()) or use a gloo group for CPU tensors"
        )
    if backend == "gloo" and device.type != "cpu":
        raise ValueError(
            f"{op}: the group uses gloo, whose send/recv take CPU tensors only, but the tensors are on {device}; "
            "use an NCCL group for CUDA tensors (init_process_group('cpu:gloo,cuda:nccl') or 'nccl')"
        )


# ---------------------------------------------------------------------------------------- validation


def _check_inputs(op: str, x_name: str, x: torch.Tensor, weight: torch.Tensor, dim, dim_name: str) -> int:
    """Checks that need no group; returns `dim` as a non-negative leading dim of x."""
    for name, t in ((x_name, x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op}: {x_name} has dtype {x.dtype}; supported dtypes are float32, float16 and bfloat16 "
            f"(cast it, e.g. {x_name}.to(torch.bfloat16))"
        )
    if weight.dtype != x.dtype:
        raise TypeError(
            f"{op}: weight has dtype {weight.dtype} but {x_name} has {x.dtype}; they must match "
            f"(cast one, e.g. weight.to({x_name}.dtype), or run under torch.autocast, which casts both)"
        )
    if x.device != weight.device:
        raise ValueError(
            f"{op}: {x_name} is on {x.device} and weight on {weight.device}; move them to one device with .to(device)"
        )
    if x.dim() < 2:
        raise ValueError(
            f"{op}: {x_name} must have at least 2 dims ([..., rows, in_features]) so that {dim_name} names a "
            f"leading dim; got shape {tuple(x.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        hint = ""
        if weight.dim() == 2 and weight.shape[0] == x.shape[-1]:
            hint = " It looks transposed: pass nn.Linear's weight as it is ([out, in]), not weight.T."
        raise ValueError(
            f"{op}: weight must be [out_features, in_features] (nn.Linear's layout, as F.linear takes it) with "
            f"in_features = {x_name}.shape[-1] = {x.shape[-1]}; got weight of shape {tuple(weight.shape)}.{hint}"
        )
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: {dim_name} must be an int, got {dim!r}")
    ndim = x.dim()
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: {dim_name}={dim} is out of range for {x_name} of shape {tuple(x.shape)}")
    if dim % ndim == ndim - 1:
        raise ValueError(
            f"{op}: {dim_name}={dim} is {x_name}'s last dim, the in_features the matmul contracts; it must be a "
            f"leading dim (0..{ndim - 2}), e.g. 1 for the sequence dim of [batch, seq, hidden] or 0 for [seq, batch, hidden]"
        )
    return dim % ndim


def _check_divisible(op: str, x: torch.Tensor, dim: int, size: int) -> None:
    if x.shape[dim] % size:
        multiple = -(-x.shape[dim] // size) * size
        raise ValueError(
            f"{op}: x.shape[{dim}] = {x.shape[dim]} (scatter_dim={dim}) is not divisible by the group size {size}, "
            f"so it cannot be reduce-scattered into equal shards; pad that dim to a multiple of {size} "
            f"(e.g. {multiple}) or scatter along another dim"
        )


# ------------------------------------------------------------------------------------------- the rings


def _transfer(ring: _Ring, send: torch.Tensor, recv: torch.Tensor):
    """Post send(`send`) to the next rank and recv(into `recv`) from the previous one; returns the works."""
    return dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, ring.next, ring.group), dist.P2POp(dist.irecv, recv, ring.prev, ring.group)]
    )


@contextlib.contextmanager
def _in_flight(works):
    """Wait for `works` when the block ends, also when it raises: otherwise the work objects and the
    buffers being received into die with this frame while gloo still writes into them, and a caller
    that catches the error (a test harness, a retry loop) goes on, or exits, with transfers in flight.
    Every peer posted its matching operations of this step before its own compute, so the wait ends."""
    try:
        yield
    finally:
        for work in works:
            work.wait()


def _ring_all_gather(shard: torch.Tensor, ring: _Ring, visit, slots: torch.Tensor | None = None) -> None:
    """Call `visit(src, chunk)` on every rank's shard (own first), each while the next one travels.

    `shard` must be contiguous. With `slots` ([W, *shard.shape]) every shard is received into
    `slots[src]` and kept (the gathered tensor, source-major); without, two spare buffers rotate.
    """
    size, rank = ring.size, ring.rank
    if slots is not None:
        slots[rank].copy_(shard)
        current = slots[rank]
    else:
        current = shard  # never received into: the input is not mutated
        spares = [torch.empty_like(shard) for _ in range(min(2, size - 1))]
    for step in range(size):
        src = (rank - step) % size  # whose shard `current` is
        works, incoming = [], None
        if step + 1 < size:
            # A spare is reused two steps after it was sent and visited; both waited (on CUDA, NCCL's
            # stream waits for the compute stream when an op is posted, so the visit is done too).
            incoming = slots[(src - 1) % size] if slots is not None else spares[step % 2]
            works = _transfer(ring, current, incoming)
        with _in_flight(works):
            visit(src, current)  # computes while `incoming` travels
        if incoming is not None:
            current = incoming


def _ring_reduce_scatter(partial, ring: _Ring, out_dtype: torch.dtype) -> torch.Tensor:
    """This rank's chunk of the sum over ranks of `partial(c)`, reduced around the ring in fp32.

    `partial(c)` returns this rank's (contiguous) contribution to chunk c; it is called once per chunk,
    in ring order, each call while the previous running sum travels.
    """
    size, rank = ring.size, ring.rank
    if size == 1:
        return partial(0).to(out_dtype)
    total = partial((rank - 1) % size).to(torch.float32).contiguous()  # chunk r-1 starts here
    spares = [torch.empty_like(total) for _ in range(min(2, size - 1))]
    for step in range(1, size):
        incoming = spares[(step - 1) % 2]  # last sent two steps ago, that send waited: free
        with _in_flight(_transfer(ring, total, incoming)):
            contribution = partial((rank - 1 - step) % size)  # the chunk whose running sum arrives
        total = incoming.add_(contribution)
    return total.to(out_dtype)  # the chunk of this rank, summed over all ranks: cast once


# ------------------------------------------------------------------------------------- matmul helpers


def _chunk(t: torch.Tensor, dim: int, index: int, length: int) -> torch.Tensor:
    return t.narrow(dim, index * length, length)


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b for a [..., p] and b [p, q]; straight into `out` when it is contiguous."""
    if out.is_contiguous() and a.is_contiguous():
        torch.mm(a.view(-1, a.shape[-1]), b, out=out.view(-1, b.shape[-1]))
    else:  # a strided slice of the output (gathered dim not the outermost): one copy of this chunk
        out.copy_(torch.matmul(a, b))


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_rows: torch.Tensor, x_rows: torch.Tensor) -> None:
    """grad_weight (fp32) += grad_rows^T @ x_rows ([rows, out] and [rows, in])."""
    if grad_rows.dtype == torch.float32:
        grad_weight.addmm_(grad_rows.t(), x_rows)
    else:  # a half-precision product (fp32 accumulation inside the GEMM), summed over chunks in fp32
        grad_weight.add_(grad_rows.t() @ x_rows)


# ------------------------------------------------------------------------- forward and backward math


def _gathered_output_shape(x_shard: torch.Tensor, dim: int, size: int, weight: torch.Tensor) -> list[int]:
    """F.linear(all_gather(x_shard, dim), weight)'s shape over a group of `size`."""
    shape = list(x_shard.shape)
    shape[dim] *= size
    shape[-1] = weight.shape[0]
    return shape


def _all_gather_matmul_forward(x_shard, weights, group, dim: int, keep_gathered: bool):
    """(ys, gathered or None): ys[i] = F.linear(all_gather(x_shard, dim), weights[i]), one ring for all;
    gathered = every rank's shard, source-major [W, *shard] (kept when asked, or for a group of one
    when asked: then a copy)."""
    op = "all_gather_matmul"
    ring = _ring(op, group, x_shard.device)
    with torch.profiler.record_function("tridist.all_gather_matmul"), no_autocast(x_shard.device):
        x_shard = x_shard.contiguous()
        rows = x_shard.shape[dim]
        ys = [x_shard.new_empty(_gathered_output_shape(x_shard, dim, ring.size, w)) for w in weights]
        weights_t = [w.t() for w in weights]
        slots = x_shard.new_empty((ring.size, *x_shard.shape)) if keep_gathered else None

        def visit(src, chunk):
            for y, weight_t in zip(ys, weights_t):
                _matmul_into(_chunk(y, dim, src, rows), chunk, weight_t)

        _ring_all_gather(x_shard, ring, visit, slots)
    return ys, slots


def _all_gather_matmul_backward(grad_ys, grad_gathered, x_shard, gathered, weights, group, dim: int, need_x: bool,
                                need_ws):
    """(grad_x_shard or None, [grad_weight or None per weight]). `gathered`: the forward's [W, *shard] or
    None; grad_ys[i] None: that output was unused; grad_gathered: the gradient of the returned gathered
    input (its own rows add to grad_x_shard: every rank computed with its copy), or None."""
    op = "all_gather_matmul"
    used = [i for i, g in enumerate(grad_ys) if g is not None]
    ring = _ring(op, group, x_shard.device)
    grad_x = None
    grad_weights = [None] * len(weights)
    with torch.profiler.record_function("tridist.all_gather_matmul.backward"), no_autocast(x_shard.device):
        rows = x_shard.shape[dim]
        x_shard = x_shard.contiguous()
        if ring.size == 1 and gathered is None:
            gathered = x_shard.unsqueeze(0)
        need_w = [need_ws[i] and i in used for i in range(len(weights))]
        for i, wanted in enumerate(need_w):
            if wanted:
                grad_weights[i] = torch.zeros(weights[i].shape, dtype=torch.float32, device=weights[i].device)

        def grad_rows(i, c):  # grad_ys[i]'s chunk c as [rows, out_i]
            return _chunk(grad_ys[i], dim, c, rows).reshape(-1, weights[i].shape[0])

        def add_weight_grads(c, x_chunk, grads=None):
            x_rows = x_chunk.reshape(-1, x_chunk.shape[-1])
            for i in used:
                if need_w[i]:
                    g = grad_rows(i, c) if grads is None else grads[i]
                    _accumulate_weight_grad(grad_weights[i], g, x_rows)

        if any(need_w) and gathered is None:  # regather x, each chunk's products hiding the next transfer
            _ring_all_gather(x_shard, ring, add_weight_grads)
        if need_x and used:

            def partial(c):  # this rank's share of grad_x_shard of rank c: sum_i grad_ys[i][c] @ weights[i]
                grads = {i: grad_rows(i, c) for i in used}
                if any(need_w) and gathered is not None:
                    add_weight_grads(c, gathered[c], grads)  # more compute under the same transfer
                total = None
                for i in used:
                    product = grads[i] @ weights[i]
                    total = product if total is None else total.add_(product)
                return total.view(x_shard.shape)

            grad_x = _ring_reduce_scatter(partial, ring, x_shard.dtype)
        elif any(need_w) and gathered is not None:
            for c in range(ring.size):
                add_weight_grads(c, gathered[c])
        if need_x and grad_gathered is not None:  # the gathered input's own use on this rank: its own rows
            own = grad_gathered[ring.rank].to(x_shard.dtype)
            grad_x = own.clone() if grad_x is None else grad_x.add_(own)
        elif need_x and grad_x is None:
            grad_x = torch.zeros_like(x_shard)
    grad_weights = [g.to(w.dtype) if g is not None else None for g, w in zip(grad_weights, weights)]
    return grad_x, grad_weights


def _matmul_reduce_scatter_forward(x, weight, group, dim: int):
    """reduce_scatter(F.linear(x, weight), dim), partial products summed around the ring in fp32."""
    op = "matmul_reduce_scatter"
    ring = _ring(op, group, x.device)
    _check_divisible(op, x, dim, ring.size)
    rows = x.shape[dim] // ring.size
    with no_autocast(x.device):
        weight_t = weight.t()

        def partial(c):
            return torch.matmul(_chunk(x, dim, c, rows), weight_t).contiguous()

        with torch.profiler.record_function("tridist.matmul_reduce_scatter"):
            return _ring_reduce_scatter(partial, ring, x.dtype)


def _matmul_reduce_scatter_backward(grad_y_shard, x, weight, group, dim: int, need_x: bool, need_w: bool):
    """grad_x = all_gather(grad_y_shard) @ weight, grad_weight = all_gather(grad_y_shard)^T @ x: one ring."""
    op = "matmul_reduce_scatter"
    ring = _ring(op, group, grad_y_shard.device)
    grad_x = grad_weight = None
    with no_autocast(x.device):
        grad_y_shard = grad_y_shard.contiguous()
        rows, in_features = grad_y_shard.shape[dim], x.shape[-1]
        if need_x:
            grad_x = x.new_empty(x.shape)  # contiguous
        if need_w:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)

        def visit(src, g_chunk):  # the grad_y shard of rank `src`: rows src of grad_y
            if need_x:
                _matmul_into(_chunk(grad_x, dim, src, rows), g_chunk, weight)
            if need_w:
                x_rows = _chunk(x, dim, src, rows).reshape(-1, in_features)
                _accumulate_weight_grad(grad_weight, g_chunk.reshape(-1, g_chunk.shape[-1]), x_rows)

        if need_x or need_w:
            with torch.profiler.record_function("tridist.matmul_reduce_scatter.backward"):
                _ring_all_gather(grad_y_shard, ring, visit)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_x, grad_weight


# --------------------------------------------------------------------------------- eager autograd


@dataclass(frozen=True)
class _Backend:
    """How one backend computes the two ops and their backwards (same signatures as the ring's)."""

    all_gather_matmul_forward: Callable
    all_gather_matmul_backward: Callable
    matmul_reduce_scatter_forward: Callable
    matmul_reduce_scatter_backward: Callable


def _backend(name: str) -> _Backend:
    if name == "symm_mem":
        from . import symm_mem_matmul as symm

        return _Backend(symm.all_gather_matmul_forward, symm.all_gather_matmul_backward,
                        symm.matmul_reduce_scatter_forward, symm.matmul_reduce_scatter_backward)
    return _Backend(_all_gather_matmul_forward, _all_gather_matmul_backward,
                    _matmul_reduce_scatter_forward, _matmul_reduce_scatter_backward)


# The autograd Functions keep the group's name, not the group (as the registered ops do). A graph lives
# as long as its outputs, in a script until the interpreter exits, and a ProcessGroup on it would outlive
# dist.destroy_process_group(), gloo's worker threads with it. Such a thread frees each finished
# collective's work, and with it tensors Python holds too, which takes the GIL: once the interpreter
# finalises, that aborts the process ("terminate called without an active exception") after every result
# was printed. Unreferenced, the group ends in destroy_process_group, which waits for its threads.


class _AllGatherMatmul(torch.autograd.Function):
    """Outputs: the gathered input [W, *shard] (an empty tensor unless asked for), then one y per weight."""

    @staticmethod
    def forward(ctx, x_shard, group, dim, save_gathered, return_gathered, backend, *weights):
        ys, gathered = _backend(backend).all_gather_matmul_forward(
            x_shard, weights, group, dim, _keep_gathered(save_gathered, return_gathered, group))
        ctx.group_name, ctx.dim, ctx.return_gathered, ctx.backend = group.group_name, dim, return_gathered, backend
        ctx.set_materialize_grads(False)  # an unused output (or gathered input) gets no zero-filled gradient
        # Keep the gathered x, or only the shard to gather again in backward (never both).
        ctx.save_for_backward(x_shard if gathered is None else None, gathered, *weights)
        if return_gathered:
            return (gathered, *ys)
        placeholder = x_shard.new_empty(0)
        ctx.mark_non_differentiable(placeholder)
        return (placeholder, *ys)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_gathered, *grad_ys):
        x_shard, gathered, *weights = ctx.saved_tensors
        group = _group_by_name(ctx.group_name)
        if x_shard is None:  # the gathered x holds a copy of this rank's shard
            x_shard = gathered[dist.get_rank(group)]
        grad_x, grad_weights = _backend(ctx.backend).all_gather_matmul_backward(
            list(grad_ys), grad_gathered if ctx.return_gathered else None, x_shard, gathered, weights, group,
            ctx.dim, ctx.needs_input_grad[0], ctx.needs_input_grad[6:],
        )
        return (grad_x, None, None, None, None, None, *grad_weights)


def _keep_gathered(save_gathered: bool, return_gathered: bool, group) -> bool:
    """Keep every rank's shard: for backward (save_gathered, unless the group is one rank: its shard is
    the input) or to return it."""
    return return_gathered or (save_gathered and dist.get_world_size(group) > 1)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, dim, backend):
        y_shard = _backend(backend).matmul_reduce_scatter_forward(x, weight, group, dim)
        ctx.group_name, ctx.dim, ctx.backend = group.group_name, dim, backend
        ctx.save_for_backward(x, weight)
        return y_shard

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y_shard):
        x, weight = ctx.saved_tensors
        grad_x, grad_weight = _backend(ctx.backend).matmul_reduce_scatter_backward(
            grad_y_shard, x, weight, _group_by_name(ctx.group_name), ctx.dim, ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
        )
        return grad_x, grad_weight, None, None, None


# ---------------------------------------------------------------- torch.library ops (torch.compile)


def _empty_like_none(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Custom ops return tensors, never None: an empty tensor stands for 'not computed'."""
    return like.new_empty(0) if t is None else t


def _if_wanted(t: torch.Tensor, wanted: bool):
    return t if wanted else None


@torch.library.custom_op("tridist::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(
    x_shard: torch.Tensor, weights: list[torch.Tensor], group_name: str, gather_dim: int, save_gathered: bool,
    return_gathered: bool, backend: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    group = _group_by_name(group_name)
    ys, gathered = _backend(backend).all_gather_matmul_forward(
        x_shard, weights, group, gather_dim, _keep_gathered(save_gathered, return_gathered, group))
    return _empty_like_none(gathered, x_shard), ys


@_all_gather_matmul_op.register_fake
def _(x_shard, weights, group_name, gather_dim, save_gathered, return_gathered, backend):
    size = _group_by_name(group_name).size()
    ys = [x_shard.new_empty(_gathered_output_shape(x_shard, gather_dim, size, w)) for w in weights]
    if not (return_gathered or (save_gathered and size > 1)):
        return x_shard.new_empty(0), ys
    if backend == "symm_mem":  # a source-major view of the gathered input in its plain layout
        shape = list(x_shard.shape)
        shape[gather_dim] *= size
        return x_shard.new_empty(shape).unflatten(gather_dim, (size, shape[gather_dim] // size)).movedim(gather_dim, 0), ys
    return x_shard.new_empty((size, *x_shard.shape)), ys


@torch.library.custom_op("tridist::all_gather_matmul_backward", mutates_args=())
def _all_gather_matmul_backward_op(
    grad_ys: list[torch.Tensor],
    grad_gathered: torch.Tensor,
    x_shard: torch.Tensor,
    gathered: torch.Tensor,
    weights: list[torch.Tensor],
    group_name: str,
    gather_dim: int,
    need_x: bool,
    need_ws: list[bool],
    backend: str,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    grad_x, grad_weights = _backend(backend).all_gather_matmul_backward(
        [g if g.numel() else None for g in grad_ys], grad_gathered if grad_gathered.numel() else None, x_shard,
        gathered if gathered.numel() else None, weights, _group_by_name(group_name), gather_dim, need_x, need_ws,
    )
    return _empty_like_none(grad_x, x_shard), [_empty_like_none(g, w) for g, w in zip(grad_weights, weights)]


@_all_gather_matmul_backward_op.register_fake
def _(grad_ys, grad_gathered, x_shard, gathered, weights, group_name, gather_dim, need_x, need_ws, backend):
    grad_x = x_shard.new_empty(x_shard.shape) if need_x else x_shard.new_empty(0)
    return grad_x, [w.new_empty(w.shape) if wanted else w.new_empty(0) for w, wanted in zip(weights, need_ws)]


def _setup_all_gather_matmul(ctx, inputs, output):
    x_shard, weights, group_name, gather_dim, save_gathered, return_gathered, backend = inputs
    ctx.group_name, ctx.dim, ctx.return_gathered, ctx.backend = group_name, gather_dim, return_gathered, backend
    gathered = output[0]
    ctx.saved_shard = gathered.numel() == 0  # else the gathered x holds a copy of the shard
    ctx.save_for_backward(x_shard if ctx.saved_shard else None, gathered, *weights)


def _backward_all_gather_matmul(ctx, grad_gathered, grad_ys):
    x_shard, gathered, *weights = ctx.saved_tensors
    if not ctx.saved_shard:
        x_shard = gathered[_group_by_name(ctx.group_name).rank()]
    need_x, need_ws = ctx.needs_input_grad[0], list(ctx.needs_input_grad[1])
    grad_ys = [g if g is not None else x_shard.new_empty(0) for g in grad_ys]
    use_gathered = ctx.return_gathered and grad_gathered is not None
    grad_x, grad_weights = _all_gather_matmul_backward_op(
        grad_ys, grad_gathered if use_gathered else x_shard.new_empty(0), x_shard, gathered, weights,
        ctx.group_name, ctx.dim, need_x, need_ws, ctx.backend,
    )
    return (_if_wanted(grad_x, need_x), [_if_wanted(g, wanted) for g, wanted in zip(grad_weights, need_ws)],
            None, None, None, None, None)


torch.library.register_autograd(
    "tridist::all_gather_matmul", _backward_all_gather_matmul, setup_context=_setup_all_gather_matmul
)


@torch.library.custom_op("tridist::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(x: torch.Tensor, weight: torch.Tensor, group_name: str, scatter_dim: int,
                              backend: str) -> torch.Tensor:
    return _backend(backend).matmul_reduce_scatter_forward(x, weight, _group_by_name(group_name), scatter_dim)


@_matmul_reduce_scatter_op.register_fake
def _(x, weight, group_name, scatter_dim, backend):
    size = _group_by_name(group_name).size()
    _check_divisible("matmul_reduce_scatter", x, scatter_dim, size)
    out_shape = list(x.shape)
    out_shape[scatter_dim] //= size
    out_shape[-1] = weight.shape[0]
    return x.new_empty(out_shape)


@torch.library.custom_op("tridist::matmul_reduce_scatter_backward", mutates_args=())
def _matmul_reduce_scatter_backward_op(
    grad_y_shard: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    group_name: str,
    scatter_dim: int,
    need_x: bool,
    need_w: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_weight = _backend(backend).matmul_reduce_scatter_backward(
        grad_y_shard, x, weight, _group_by_name(group_name), scatter_dim, need_x, need_w
    )
    return _empty_like_none(grad_x, x), _empty_like_none(grad_weight, weight)


@_matmul_reduce_scatter_backward_op.register_fake
def _(grad_y_shard, x, weight, group_name, scatter_dim, need_x, need_w, backend):
    grad_x = x.new_empty(x.shape) if need_x else x.new_empty(0)
    grad_weight = weight.new_empty(weight.shape) if need_w else weight.new_empty(0)
    return grad_x, grad_weight


def _setup_matmul_reduce_scatter(ctx, inputs, output):
    x, weight, group_name, scatter_dim, backend = inputs
    ctx.group_name, ctx.dim, ctx.backend = group_name, scatter_dim, backend
    ctx.save_for_backward(x, weight)


def _backward_matmul_reduce_scatter(ctx, grad_y_shard):
    x, weight = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x, grad_weight = _matmul_reduce_scatter_backward_op(
        grad_y_shard, x, weight, ctx.group_name, ctx.dim, need_x, need_w, ctx.backend
    )
    return _if_wanted(grad_x, need_x), _if_wanted(grad_weight, need_w), None, None, None


torch.library.register_autograd(
    "tridist::matmul_reduce_scatter", _backward_matmul_reduce_scatter, setup_context=_setup_matmul_reduce_scatter
)


# ------------------------------------------------------------------------------------------ public API

# Which implementation moves the chunks. "ring" is the default: it runs on every process group tridist
# supports (gloo on CPU, NCCL within and across nodes), is what the test suite runs, and keeps the
# reduce-scatter's partial sums in fp32. "symm_mem" (symm_mem_matmul.py) is torch's symmetric-memory ops:
# on one NVLink node they move chunks with copy engines, leaving every SM to the matmuls; pick them there
# when a few timed training steps on those GPUs say they hide more.
BACKENDS = ("ring", "symm_mem")


def _check_backend_name(op: str, backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} is not one of {list(BACKENDS)}; 'ring' (the default) runs on "
                         "any process group, 'symm_mem' on CUDA GPUs of one node")
    return backend


def check_backend_available(op: str, backend: str, device, group=None) -> None:
    """Raise, naming the reason and the fix, where `backend` cannot run with `device` tensors (and, given a
    `group`, on that group): what the ops check at each call, for callers that set up ahead (distcore)."""
    _check_backend_name(op, backend)
    if backend == "symm_mem":
        from .symm_mem_matmul import check_available

        check_available(op, torch.device(device), group)



def _apply_autocast(x: torch.Tensor, *weights: torch.Tensor):
    """Under torch.autocast, cast x and the weights to its dtype, as autocast casts F.linear's inputs
    (differentiably); returns (x, list of weights)."""
    device_type = x.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return x.to(dtype), [w.to(dtype) for w in weights]
    return x, list(weights)


def all_gather_matmul(
    x_shard: torch.Tensor, weight, group=None, *, gather_dim: int = 0, save_gathered: bool = True,
    return_gathered: bool = False, backend: str = "ring",
):
    """`F.linear(all_gather(x_shard, dim=gather_dim, group=group), weight)`, the gather hidden behind the matmul.

    The entry of a sequence-parallel region: a ColWise linear whose input is sharded along the
    sequence. `x_shard` is `[..., rows, ..., in_features]` with this rank's rows of the gathered dim
    (every rank the same shape); `weight` is `[out_features, in_features]`, nn.Linear's layout (the
    rank's ColWise shard of it). Returns `[..., world_size * rows, ..., out_features]`, equal to the
    plain all-gather then matmul up to rounding.

    `weight` may be a list of weights (q, k and v; gate and up): the input is gathered once and each
    chunk feeds every projection while the next travels; a list of outputs comes back, one per weight.
    `return_gathered=True` also returns the gathered input, `(x, outputs)` (as torch's symmetric-memory
    `fused_all_gather_matmul` does): model code that reads its input besides the projections gets it
    without a second gather; its gradient on this rank adds this rank's rows to x_shard's gradient.

    `gather_dim`: a leading dim of x_shard (1 for [batch, seq, hidden], 0 for [seq, batch, hidden]).
    `group`: a torch.distributed process group; None means the default group. A group of size 1 is a
    plain matmul. `save_gathered`: keep the gathered input for backward (default, no extra transfers)
    or only the shard, gathering it again in backward (W times less memory, W - 1 more transfers
    hidden behind the grad_weight matmuls). Differentiable in x_shard and the weights; fp32/fp16/bf16
    (weights in x's dtype, or all cast by torch.autocast). The ring schedule, backward and CUDA stream
    behaviour are described in the module docstring. Profiler traces show the forward and backward
    rings as `tridist.all_gather_matmul` and `tridist.all_gather_matmul.backward`.

    `backend`: "ring" (default: tridist's point-to-point ring, any process group, gloo or NCCL, within
    and across nodes) or "symm_mem" (torch's symmetric-memory `fused_all_gather_matmul`: CUDA GPUs of
    one node; the backward's reduce-scatter carries partial sums in the input dtype; save_gathered=False
    is a ring option). See BACKENDS.
    """
    op = "all_gather_matmul"
    backend = _check_backend_name(op, backend)
    single = isinstance(weight, torch.Tensor)
    weights = [weight] if single else list(weight)
    if not weights:
        raise ValueError(f"{op}: weight is an empty list; pass one weight or a list of weights ([out, in] each)")
    x_shard, weights = _apply_autocast(x_shard, *weights)
    dim = None
    for w in weights:
        dim = _check_inputs(op, "x_shard", x_shard, w, gather_dim, "gather_dim")
    if backend == "symm_mem":
        if not save_gathered:
            raise ValueError(f"{op}: save_gathered=False (gather the input again in backward) is an option of "
                             "backend='ring'; backend='symm_mem' keeps the gathered input. Drop it or use backend='ring'")
        check_backend_available(op, backend, x_shard.device, _resolve_group(op, group))
    if torch.compiler.is_compiling():
        gathered, ys = _all_gather_matmul_op(x_shard, weights, _group_name(op, group), dim, bool(save_gathered),
                                             bool(return_gathered), backend)
    else:
        group = _resolve_group(op, group)
        gathered, *ys = _AllGatherMatmul.apply(x_shard, group, dim, bool(save_gathered), bool(return_gathered),
                                               backend, *weights)
    outputs = ys[0] if single else list(ys)
    if not return_gathered:
        return outputs
    return _source_major_to_gathered(gathered, dim), outputs


def _source_major_to_gathered(gathered: torch.Tensor, dim: int) -> torch.Tensor:
    """[W, ..., rows, ...] (one slot per source rank) -> [..., W * rows, ...]: a view when the gathered dim
    is the outermost (or the dims before it are 1), else one copy."""
    moved = gathered.movedim(0, dim)  # [..., W, rows, ...]
    shape = list(moved.shape)
    shape[dim:dim + 2] = [shape[dim] * shape[dim + 1]]
    return moved.reshape(shape)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group=None, *, scatter_dim: int = 0,
                          backend: str = "ring") -> torch.Tensor:
    """`reduce_scatter(F.linear(x, weight), dim=scatter_dim, group=group)` (sum), overlapped with the matmul.

    The exit of a sequence-parallel region: a RowWise linear whose partial outputs are summed over
    the group and left sharded along the sequence. `x` is `[..., rows, ..., in_features]` (this rank's
    in_features shard of the activation), `weight` `[out_features, in_features]`, nn.Linear's layout
    (the rank's RowWise shard). Returns this rank's `x.shape[scatter_dim] // world_size` rows of the
    sum: `[..., rows // world_size, ..., out_features]`. Partial sums travel and accumulate in fp32 and
    are cast once to x's dtype.

    `scatter_dim`: a leading dim of x whose size divides by the group size. `group`: None means the
    default group; a group of size 1 is a plain matmul. Differentiable in x and weight; fp32/fp16/bf16.

    `backend`: "ring" (default) or "symm_mem" (torch's symmetric-memory `fused_matmul_reduce_scatter`:
    CUDA GPUs of one node; partial sums travel in x's dtype and are summed once). See BACKENDS.
    """
    op = "matmul_reduce_scatter"
    backend = _check_backend_name(op, backend)
    x, (weight,) = _apply_autocast(x, weight)
    dim = _check_inputs(op, "x", x, weight, scatter_dim, "scatter_dim")
    if backend == "symm_mem":
        check_backend_available(op, backend, x.device, _resolve_group(op, group))
    if torch.compiler.is_compiling():
        return _matmul_reduce_scatter_op(x, weight, _group_name(op, group), dim, backend)
    group = _resolve_group(op, group)
    _check_divisible(op, x, dim, dist.get_world_size(group))  # before any rank posts a transfer
    return _MatmulReduceScatter.apply(x, weight, group, dim, backend)
