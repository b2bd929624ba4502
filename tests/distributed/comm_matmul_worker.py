"""Checks of kernels.all_gather_matmul / matmul_reduce_scatter on 4 gloo processes (run by
tests/distributed/test_comm_matmul.py): the world group of 4, sub-groups of 2 (ranks {0, 2} and
{1, 3}: group ranks differ from global ranks) and groups of 1.

The reference is one process doing the whole computation with autograd: every rank draws the same
global tensors (all ranks' shards, weights and output gradients), so the plain all-gather + F.linear
(F.linear + reduce-scatter) is computed without any collective, and each rank compares its own part.
"""

from __future__ import annotations

import os
import sys
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tridist.kernels import all_gather_matmul, matmul_reduce_scatter
from tests.distributed import equivalence
from tests.distributed.harness import raises, run_checks
from tests.distributed.symm_mem_cpu import symm_mem_on_cpu

GROUPS: dict[str, dist.ProcessGroup] = {}


def _groups():
    if not GROUPS:
        rank = dist.get_rank()
        pairs = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 2), (1, 3))}  # every rank creates all
        singles = {r: dist.new_group([r]) for r in range(dist.get_world_size())}
        GROUPS.update(world=dist.group.WORLD, pair=pairs[(0, 2) if rank % 2 == 0 else (1, 3)], single=singles[rank])
    return GROUPS


def _full_shape(dims: tuple, dim: int, size: int) -> list[int]:
    """dims = the shard's shape; the gathered/global shape has `size` times the rows of `dim`."""
    shape = list(dims)
    shape[dim] *= size
    return shape


def _assert_close(name, result, expected, magnitude, *, dtype, terms: int, wire_roundings: int = 0):
    """Element by element, within the rounding bound of the two computations (no fitted tolerance).

    Every output is a sum of products; `magnitude` is the sum of their absolute values (the reference
    computed on |inputs|). An fp32 sum of at most `terms` terms, in any order or chunking, errs by at most
    terms·u·Σ|terms| (Higham, §4.2; u = 2^-24), the ring's and the reference's alike: 2·terms·u·Σ|terms|
    between them. In half precision (unit roundoff u_h), measured against the fp32 reference, add the
    roundings of a path through the op: the inputs cast to the dtype (two factors of each product:
    2·u_h), each chunk's product (u_h) and the result (u_h), each at most u_h times the |terms| it holds:
    4·u_h·Σ|terms|, plus one u_h for second-order terms. (The matmuls accumulate in fp32 inside, as
    torch's CPU and CUDA GEMMs do for half inputs.) `wire_roundings`: further half-precision roundings
    of a partial sum on its way (a reduce-scatter summing W partials in the dtype: W - 1), each at most
    u_h·Σ|terms|. A ring bug (a chunk from the wrong rank, a step skipped, a partial sum added twice)
    moves an element by O(Σ|terms|)."""
    assert result.shape == expected.shape, f"{name}: shape {tuple(result.shape)} != {tuple(expected.shape)}"
    assert result.dtype == dtype, f"{name}: dtype {result.dtype} != {dtype}"
    half_roundings = 0 if dtype == torch.float32 else (5 + wire_roundings) * torch.finfo(dtype).eps / 2
    allowed = (2 * terms * equivalence.U + half_roundings) * magnitude
    excess = (result.double() - expected.double()).abs() / allowed.double()
    worst = excess.max().item() if excess.numel() else 0.0
    equivalence.record(f"{dtype} rounding bound", worst)
    assert worst <= 1, f"{name}: error {worst:.3g} times the rounding bound at {divmod(excess.argmax().item(), result.shape[-1])}"


def _make_leaf(shape, dtype, *, transposed: bool, source: torch.Tensor):
    """A leaf holding `source` in `dtype`, and the (possibly non-contiguous) view to pass in.

    transposed: the leaf is stored with its last two dims swapped and the view transposes it back,
    a non-contiguous input like the [S, B, H] <-> [B, S, H] transposes of model code.
    """
    if transposed:
        leaf = source.transpose(-1, -2).to(dtype, copy=True).contiguous().requires_grad_()
        assert leaf.is_leaf
        view = leaf.transpose(-1, -2)
        assert not view.is_contiguous()
        return leaf, view, lambda grad: grad.transpose(-1, -2)
    leaf = source.to(dtype, copy=True).requires_grad_()
    assert leaf.is_leaf
    return leaf, leaf, lambda grad: grad


def _rank_in(group):
    return dist.get_rank(group), dist.get_world_size(group)


# ---------------------------------------------------------------------------------- all_gather_matmul


def _all_gather_matmul_case(group_key, shard_shape, dim, *, out=40, dtype=torch.float32, transposed=False,
                            save_gathered=True, need_x=True, need_w=True, seed=0, backend="ring"):
    group = _groups()[group_key]
    rank, size = _rank_in(group)
    generator = torch.Generator().manual_seed(seed)
    x_full = torch.randn(_full_shape(shard_shape, dim, size), generator=generator)
    weights = torch.randn(size, out, shard_shape[-1], generator=generator) / shard_shape[-1] ** 0.5
    y_shape = [*x_full.shape[:-1], out]
    grads = torch.randn(size, *y_shape, generator=generator)
    rows = shard_shape[dim]

    def reference(absolute=False):  # every rank's y = F.linear(x_full, weight_q); loss = sum <y_q, g_q>
        value = torch.abs if absolute else torch.clone  # on |inputs|: the sums of |terms| of every output
        x, w = value(x_full).requires_grad_(), value(weights).requires_grad_()
        ys = [F.linear(x, w[q]) for q in range(size)]
        torch.autograd.backward(ys, [value(g) for g in grads])
        return ys[rank].detach(), x.grad.narrow(dim, rank * rows, rows), w.grad[rank]

    expected, magnitude = reference(), reference(absolute=True)
    # The longest sums: y over in_features, grad_x over the outputs of every rank, grad_weight over all rows.
    terms = shard_shape[-1] + size * out + x_full.numel() // shard_shape[-1]

    x_leaf, x_in, unview_x = _make_leaf(shard_shape, dtype, transposed=transposed,
                                        source=x_full.narrow(dim, rank * rows, rows))
    w_leaf, w_in, unview_w = _make_leaf(weights[rank].shape, dtype, transposed=transposed, source=weights[rank])
    x_leaf.requires_grad_(need_x)
    w_leaf.requires_grad_(need_w)
    x_before, w_before = x_leaf.detach().clone(), w_leaf.detach().clone()
    y = all_gather_matmul(x_in, w_in, group, gather_dim=dim, save_gathered=save_gathered, backend=backend)
    bound = dict(dtype=dtype, terms=terms, wire_roundings=_wire_roundings(backend, size))
    assert y.is_contiguous(), f"{backend}: y has strides {y.stride()}"  # model code may .view() it
    _assert_close("y", y.detach(), expected[0], magnitude[0], **bound)
    y.backward(grads[rank].to(dtype))
    assert torch.equal(x_leaf.detach(), x_before) and torch.equal(w_leaf.detach(), w_before), "inputs mutated"
    if need_x:
        _assert_close("grad_x_shard", unview_x(x_leaf.grad), expected[1], magnitude[1], **bound)
    else:
        assert x_leaf.grad is None
    if need_w:
        _assert_close("grad_weight", unview_w(w_leaf.grad), expected[2], magnitude[2], **bound)
    else:
        assert w_leaf.grad is None


def _wire_roundings(backend: str, size: int) -> int:
    """The ring sums partials in fp32; torch's symmetric-memory reference ops (what these CPU tests run,
    symm_mem_cpu.py) reduce-scatter them in the input dtype, gloo adding the W partials one by one."""
    return size - 1 if backend == "symm_mem" else 0


def check_all_gather_matmul_seq_dim_world():
    _all_gather_matmul_case("world", (2, 6, 24), 1)


def check_all_gather_matmul_dim0_world():
    _all_gather_matmul_case("world", (6, 3, 24), 0)


def check_all_gather_matmul_pair_subgroup():
    _all_gather_matmul_case("pair", (3, 6, 24), 1, seed=1)
    _all_gather_matmul_case("pair", (6, 2, 24), 0, seed=2)


def check_all_gather_matmul_single_rank_group():
    _all_gather_matmul_case("single", (2, 6, 24), 1, seed=3)


def check_all_gather_matmul_non_contiguous():
    _all_gather_matmul_case("world", (2, 6, 24), 1, transposed=True, seed=4)
    _all_gather_matmul_case("pair", (6, 2, 24), 0, transposed=True, seed=5)


def check_all_gather_matmul_bf16():
    _all_gather_matmul_case("world", (2, 6, 24), 1, dtype=torch.bfloat16, seed=6)
    _all_gather_matmul_case("pair", (6, 2, 24), 0, dtype=torch.bfloat16, seed=7)


def check_all_gather_matmul_fp16():
    _all_gather_matmul_case("world", (2, 6, 24), 1, dtype=torch.float16, seed=8)


def check_all_gather_matmul_regather_in_backward():
    _all_gather_matmul_case("world", (2, 6, 24), 1, save_gathered=False, seed=9)
    _all_gather_matmul_case("pair", (6, 2, 24), 0, save_gathered=False, dtype=torch.bfloat16, seed=10)


def check_all_gather_matmul_other_ranks():
    _all_gather_matmul_case("world", (12, 24), 0, seed=11)  # 2-D
    _all_gather_matmul_case("world", (2, 3, 2, 24), 1, seed=12)  # 4-D, gathered dim in the middle
    _all_gather_matmul_case("pair", (2, 3, 2, 24), -3, seed=13)  # negative dim


def check_all_gather_matmul_partial_requires_grad():
    _all_gather_matmul_case("world", (2, 6, 24), 1, need_x=False, seed=14)
    _all_gather_matmul_case("world", (2, 6, 24), 1, need_w=False, seed=15)
    _all_gather_matmul_case("pair", (2, 6, 24), 1, need_x=False, save_gathered=False, seed=16)


# ------------------------------------------------------------------------------ matmul_reduce_scatter


def _matmul_reduce_scatter_case(group_key, x_shape, dim, *, out=40, dtype=torch.float32, transposed=False,
                                need_x=True, need_w=True, seed=0, backend="ring"):
    group = _groups()[group_key]
    rank, size = _rank_in(group)
    generator = torch.Generator().manual_seed(100 + seed)
    xs = torch.randn(size, *x_shape, generator=generator)  # each rank's x (its in_features shard)
    weights = torch.randn(size, out, x_shape[-1], generator=generator) / x_shape[-1] ** 0.5
    y_shape = [*x_shape[:-1], out]
    grad_full = torch.randn(y_shape, generator=generator)
    rows = x_shape[dim] // size

    def reference(absolute=False):  # y = sum_q F.linear(x_q, w_q); rank r keeps rows r of it
        value = torch.abs if absolute else torch.clone  # on |inputs|: the sums of |terms| of every output
        x, w = value(xs).requires_grad_(), value(weights).requires_grad_()
        y = sum(F.linear(x[q], w[q]) for q in range(size))
        y.backward(value(grad_full))
        return y.detach().narrow(dim, rank * rows, rows), x.grad[rank], w.grad[rank]

    expected, magnitude = reference(), reference(absolute=True)
    # The longest sums: y over every rank's in_features, grad_x over out, grad_weight over all rows.
    terms = size * x_shape[-1] + out + xs[0].numel() // x_shape[-1]

    x_leaf, x_in, unview_x = _make_leaf(x_shape, dtype, transposed=transposed, source=xs[rank])
    w_leaf, w_in, unview_w = _make_leaf(weights[rank].shape, dtype, transposed=transposed, source=weights[rank])
    x_leaf.requires_grad_(need_x)
    w_leaf.requires_grad_(need_w)
    x_before, w_before = x_leaf.detach().clone(), w_leaf.detach().clone()
    y_shard = matmul_reduce_scatter(x_in, w_in, group, scatter_dim=dim, backend=backend)
    bound = dict(dtype=dtype, terms=terms, wire_roundings=_wire_roundings(backend, size))
    _assert_close("y_shard", y_shard.detach(), expected[0], magnitude[0], **bound)
    y_shard.backward(grad_full.narrow(dim, rank * rows, rows).to(dtype))
    assert torch.equal(x_leaf.detach(), x_before) and torch.equal(w_leaf.detach(), w_before), "inputs mutated"
    if need_x:
        _assert_close("grad_x", unview_x(x_leaf.grad), expected[1], magnitude[1], **bound)
    else:
        assert x_leaf.grad is None
    if need_w:
        _assert_close("grad_weight", unview_w(w_leaf.grad), expected[2], magnitude[2], **bound)
    else:
        assert w_leaf.grad is None


def check_matmul_reduce_scatter_seq_dim_world():
    _matmul_reduce_scatter_case("world", (2, 24, 24), 1)  # seq 6 per rank


def check_matmul_reduce_scatter_dim0_world():
    _matmul_reduce_scatter_case("world", (24, 3, 24), 0, seed=1)


def check_matmul_reduce_scatter_pair_subgroup():
    _matmul_reduce_scatter_case("pair", (3, 12, 24), 1, seed=2)
    _matmul_reduce_scatter_case("pair", (12, 2, 24), 0, seed=3)


def check_matmul_reduce_scatter_single_rank_group():
    _matmul_reduce_scatter_case("single", (2, 6, 24), 1, seed=4)


def check_matmul_reduce_scatter_non_contiguous():
    _matmul_reduce_scatter_case("world", (2, 24, 24), 1, transposed=True, seed=5)
    _matmul_reduce_scatter_case("pair", (12, 2, 24), 0, transposed=True, seed=6)


def check_matmul_reduce_scatter_bf16():
    _matmul_reduce_scatter_case("world", (2, 24, 24), 1, dtype=torch.bfloat16, seed=7)
    _matmul_reduce_scatter_case("pair", (12, 2, 24), 0, dtype=torch.bfloat16, seed=8)


def check_matmul_reduce_scatter_fp16():
    _matmul_reduce_scatter_case("world", (2, 24, 24), 1, dtype=torch.float16, seed=9)


def check_matmul_reduce_scatter_other_ranks():
    _matmul_reduce_scatter_case("world", (24, 24), 0, seed=10)
    _matmul_reduce_scatter_case("world", (2, 12, 2, 24), 1, seed=11)
    _matmul_reduce_scatter_case("pair", (2, 12, 2, 24), -3, seed=12)


def check_matmul_reduce_scatter_partial_requires_grad():
    _matmul_reduce_scatter_case("world", (2, 24, 24), 1, need_x=False, seed=13)
    _matmul_reduce_scatter_case("world", (2, 24, 24), 1, need_w=False, seed=14)


# ------------------------------------------------------------------------------- together, collectives


def check_sequence_parallel_mlp_block_equals_one_process():
    """SP entry (ColWise up) -> gelu -> SP exit (RowWise down), default group, against torch's own
    all_gather_into_tensor / F.linear / all_reduce on the real collectives, forward and backward."""
    rank, size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(42)
    batch, seq, hidden, ffn = 2, 6 * size, 24, 40
    x_full = torch.randn(batch, seq, hidden, generator=generator)
    up = torch.randn(ffn, hidden, generator=generator) / hidden**0.5  # full weights; ColWise/RowWise shards below
    down = torch.randn(hidden, ffn, generator=generator) / ffn**0.5
    cols = ffn // size
    up_shard = up[rank * cols : (rank + 1) * cols].clone().requires_grad_()
    down_shard = down[:, rank * cols : (rank + 1) * cols].clone().requires_grad_()
    x_shard = x_full[:, rank * 6 : (rank + 1) * 6].clone().requires_grad_()

    h = F.gelu(all_gather_matmul(x_shard, up_shard, gather_dim=1))  # group=None: the default group
    out = matmul_reduce_scatter(h, down_shard, scatter_dim=1)
    (out * out).sum().backward()

    # Plain collectives: gather the full input, full MLP on every rank, compare the own rows.
    gathered = [torch.empty_like(x_shard) for _ in range(size)]
    dist.all_gather(gathered, x_shard.detach())
    assert torch.equal(torch.cat(gathered, dim=1), x_full)
    x_ref, up_ref, down_ref = x_full.clone().requires_grad_(), up.clone().requires_grad_(), down.clone().requires_grad_()
    out_ref = F.linear(F.gelu(F.linear(x_ref, up_ref)), down_ref)
    (out_ref * out_ref).sum().backward()
    rows = slice(rank * 6, (rank + 1) * 6)
    # the loss is a sum over ranks of their rows: grads of the shards are the full loss's grads; norm-wise
    # within rounding (equivalence.RTOL: a gelu between two matmuls is not a plain sum of products)
    equivalence.assert_tensors_close("block", {
        "out": out.detach(), "x": x_shard.grad, "up": up_shard.grad, "down": down_shard.grad,
    }, {
        "out": out_ref.detach()[:, rows], "x": x_ref.grad[:, rows],
        "up": up_ref.grad[rank * cols : (rank + 1) * cols], "down": down_ref.grad[:, rank * cols : (rank + 1) * cols],
    })
    # and the partial output summed with a real all_reduce equals ours row for row
    partial = F.linear(h.detach(), down_shard.detach())
    dist.all_reduce(partial)
    equivalence.assert_tensors_close("all_reduce", {"out": out.detach()}, {"out": partial[:, rows]})


def _multi_weight_case(group_key, shard_shape, dim, *, outs=(40, 8, 8), use_gathered=True, dtype=torch.float32,
                       backend="ring"):
    """q/k/v from one gather: every output equals its own all-gather + F.linear, the returned gathered
    input equals the plain all-gather, and the gradients include a replicated use of that input (model
    code reading its input besides the projections): own rows only, no reduction."""
    group = _groups()[group_key]
    rank, size = _rank_in(group)
    generator = torch.Generator().manual_seed(11)
    x_full = torch.randn(_full_shape(shard_shape, dim, size), generator=generator)
    weights = [torch.randn(size, out, shard_shape[-1], generator=generator) / shard_shape[-1] ** 0.5 for out in outs]
    grads = [torch.randn(size, *x_full.shape[:-1], out, generator=generator) for out in outs]
    other = torch.randn(x_full.shape, generator=generator)  # d loss / d x of the replicated use
    rows = shard_shape[dim]

    def reference(absolute=False):
        value = torch.abs if absolute else torch.clone
        x = value(x_full).requires_grad_()
        ws = [value(w).requires_grad_() for w in weights]
        ys = [[F.linear(x, w[q]) for q in range(size)] for w in ws]
        terms = [(y * value(g[q])).sum() for y_q, g in zip(ys, grads) for q, y in enumerate(y_q)]
        loss = sum(terms) + ((x * value(other)).sum() if use_gathered else 0)
        loss.backward()
        return [y_q[rank].detach() for y_q in ys], x.grad.narrow(dim, rank * rows, rows), [w.grad[rank] for w in ws]

    expected, magnitude = reference(), reference(absolute=True)
    terms = shard_shape[-1] + size * sum(outs) + 1 + x_full.numel() // shard_shape[-1]
    x_shard = x_full.narrow(dim, rank * rows, rows).to(dtype).requires_grad_()
    w_shards = [w[rank].to(dtype).requires_grad_() for w in weights]
    gathered, ys = all_gather_matmul(x_shard, w_shards, group, gather_dim=dim, return_gathered=True, backend=backend)
    assert isinstance(ys, list) and len(ys) == len(outs)
    assert torch.equal(gathered.detach(), x_full.to(dtype)), "the returned gathered input is the plain all-gather"
    assert gathered.is_contiguous() and all(y.is_contiguous() for y in ys), backend
    bound = dict(dtype=dtype, terms=terms, wire_roundings=_wire_roundings(backend, size))
    for i, y in enumerate(ys):
        _assert_close(f"y{i}", y.detach(), expected[0][i], magnitude[0][i], **bound)
    loss = sum((y * g[rank].to(dtype)).sum() for y, g in zip(ys, grads))
    if use_gathered:
        # A replicated use: every rank computes the same term of the model's loss with its own copy of the
        # gathered input (in tensor parallel each rank's loss is the global loss); the gradient of each
        # shard's rows comes from the rank that owns them, unreduced.
        loss = loss + (gathered * other.to(dtype)).sum()
    loss.backward()
    _assert_close("grad_x_shard", x_shard.grad, expected[1], magnitude[1], **bound)
    for i, w in enumerate(w_shards):
        _assert_close(f"grad_w{i}", w.grad, expected[2][i], magnitude[2][i], **bound)


def check_all_gather_matmul_several_weights_and_the_gathered_input():
    _multi_weight_case("world", (2, 3, 16), 1)  # batch 2: the gathered input is assembled by a copy
    _multi_weight_case("world", (1, 3, 16), 1)  # batch 1: a view of the ring's buffer
    _multi_weight_case("pair", (3, 2, 16), 0, use_gathered=False)
    _multi_weight_case("single", (2, 3, 16), 1)
    _multi_weight_case("world", (2, 3, 16), 1, dtype=torch.bfloat16)


def check_all_gather_matmul_several_weights_one_unused():
    """An output nobody uses (k of a module that reads only q and v) gets no gradient and breaks nothing."""
    group = _groups()["world"]
    rank, size = _rank_in(group)
    x_shard = torch.randn(2, 3, 16, requires_grad=True)
    ws = [torch.randn(8, 16, requires_grad=True) for _ in range(3)]
    ys = all_gather_matmul(x_shard, ws, group, gather_dim=1)
    (ys[0].sum() + ys[2].sum()).backward()
    assert ws[1].grad is None  # no zero-filled gradient for an unused output
    alone = [w.detach().clone().requires_grad_() for w in (ws[0], ws[2])]
    x_alone = x_shard.detach().clone().requires_grad_()
    sum(y.sum() for y in all_gather_matmul(x_alone, alone, group, gather_dim=1)).backward()
    equivalence.assert_tensors_close("unused", {"x": x_shard.grad, "w0": ws[0].grad, "w2": ws[2].grad},
                                     {"x": x_alone.grad, "w0": alone[0].grad, "w2": alone[1].grad})


def check_profiler_names_the_rings():
    group = _groups()["world"]
    x_shard = torch.randn(2, 3, 16, requires_grad=True)
    w_in, w_out = torch.randn(8, 16, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = matmul_reduce_scatter(all_gather_matmul(x_shard, w_in, group, gather_dim=1), w_out, group, scatter_dim=1)
        y.sum().backward()
    names = {event.name for event in prof.events()}
    for expected in ("tridist.all_gather_matmul", "tridist.all_gather_matmul.backward",
                     "tridist.matmul_reduce_scatter", "tridist.matmul_reduce_scatter.backward"):
        assert expected in names, (expected, sorted(n for n in names if "tridist" in n))


def check_rings_leave_no_work_and_no_group_behind():
    """Once forward and backward are done, while their outputs (and so the autograd graph) are alive, as
    a script's are until interpreter exit: no transfer's Work object survives, and nothing of the ops
    holds the process group. A group held past dist.destroy_process_group() keeps gloo's threads running
    into interpreter finalisation, where a thread freeing its last work aborts the process
    (kernels/comm_matmul.py, above _AllGatherMatmul)."""
    group = _groups()["pair"]
    works = []
    post = dist.batch_isend_irecv

    def recording(ops):  # comm_matmul looks dist.batch_isend_irecv up at each call
        posted = post(ops)
        works.extend(weakref.ref(work) for work in posted)
        return posted

    references = sys.getrefcount(group)
    dist.batch_isend_irecv = recording
    try:
        x_shard = torch.randn(2, 3, 16, requires_grad=True)
        w_in, w_out = torch.randn(8, 16, requires_grad=True), torch.randn(16, 8, requires_grad=True)
        kept = all_gather_matmul(x_shard, w_in, group, gather_dim=1)
        regathered = all_gather_matmul(x_shard, w_in, group, gather_dim=1, save_gathered=False)
        y = matmul_reduce_scatter(kept + regathered, w_out, group, scatter_dim=1)
        y.sum().backward()
    finally:
        dist.batch_isend_irecv = post
    assert works, "the rings posted no transfer through dist.batch_isend_irecv"
    alive = sum(ref() is not None for ref in works)
    assert not alive, f"{alive} of the rings' {len(works)} Work objects outlive them"
    held = sys.getrefcount(group) - references
    assert held == 0, f"the outputs' autograd graph holds {held} references to the process group"


def check_autocast_bf16():
    """Under torch.autocast both inputs are cast like F.linear's; grads reach the fp32 leaves."""
    group = _groups()["pair"]
    rank, size = _rank_in(group)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, 24, generator=generator).requires_grad_()
    w = torch.randn(40, 24, generator=generator).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = all_gather_matmul(x, w, group, gather_dim=1)
        z = matmul_reduce_scatter(y, torch.randn(24, 40, generator=generator), group, scatter_dim=1)
    assert y.dtype == z.dtype == torch.bfloat16 and tuple(y.shape) == (2, 6 * size, 40) and tuple(z.shape) == (2, 6, 24)
    z.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32 and x.grad.shape == x.shape and w.grad.abs().sum() > 0


def check_no_grad_and_detached_inputs():
    x, w = torch.randn(2, 6, 24), torch.randn(40, 24)
    with torch.no_grad():
        y = all_gather_matmul(x.requires_grad_(), w, gather_dim=1)
    assert not y.requires_grad and tuple(y.shape) == (2, 6 * dist.get_world_size(), 40)
    y = matmul_reduce_scatter(torch.randn(8, 24), w, scatter_dim=0)
    assert not y.requires_grad and tuple(y.shape) == (8 // dist.get_world_size(), 40)


# ------------------------------------------------------------------ backend="symm_mem" (torch's ops)


def check_symm_mem_backend_all_gather_matmul():
    with symm_mem_on_cpu():
        _all_gather_matmul_case("world", (2, 6, 24), 1, seed=30, backend="symm_mem")
        _all_gather_matmul_case("pair", (6, 2, 24), 0, transposed=True, seed=31, backend="symm_mem")
        _all_gather_matmul_case("single", (2, 6, 24), 1, seed=32, backend="symm_mem")
        _all_gather_matmul_case("world", (2, 3, 2, 24), -3, dtype=torch.bfloat16, seed=33, backend="symm_mem")
        _all_gather_matmul_case("world", (2, 6, 24), 1, need_x=False, seed=34, backend="symm_mem")
        _all_gather_matmul_case("pair", (2, 6, 24), 1, need_w=False, seed=35, backend="symm_mem")
        # A shard sliced from a wider tensor (q of a packed qkv): rows strided, viewable once flattened;
        # torch's CUDA kernel needs it contiguous (symm_mem_cpu.py asserts it)
        group = _groups()["world"]
        wide = torch.randn(6, 2, 40, generator=torch.Generator().manual_seed(36))
        x, w = wide[..., :24].requires_grad_(False), torch.randn(8, 24)
        assert not x.movedim(0, 0).flatten(0, -2).is_contiguous()
        equivalence.assert_tensors_close("sliced shard", {"y": all_gather_matmul(x, w, group, backend="symm_mem")},
                                         {"y": all_gather_matmul(x, w, group)})


def check_symm_mem_backend_matmul_reduce_scatter():
    with symm_mem_on_cpu():
        _matmul_reduce_scatter_case("world", (2, 24, 24), 1, seed=40, backend="symm_mem")
        _matmul_reduce_scatter_case("pair", (12, 2, 24), 0, transposed=True, seed=41, backend="symm_mem")
        _matmul_reduce_scatter_case("single", (2, 6, 24), 1, seed=42, backend="symm_mem")
        _matmul_reduce_scatter_case("world", (2, 12, 2, 24), 1, dtype=torch.bfloat16, seed=43, backend="symm_mem")
        _matmul_reduce_scatter_case("world", (2, 24, 24), 1, need_x=False, seed=44, backend="symm_mem")
        _matmul_reduce_scatter_case("pair", (2, 24, 24), 1, need_w=False, seed=45, backend="symm_mem")


def check_symm_mem_backend_several_weights_and_the_gathered_input():
    with symm_mem_on_cpu():
        _multi_weight_case("world", (2, 3, 16), 1, backend="symm_mem")
        _multi_weight_case("pair", (3, 2, 16), 0, use_gathered=False, backend="symm_mem")
        _multi_weight_case("pair", (2, 3, 16), 1, backend="symm_mem")  # own rows by group rank, not global rank
        _multi_weight_case("world", (2, 3, 16), 1, dtype=torch.bfloat16, backend="symm_mem")


def check_symm_mem_backend_profiler_names_and_autocast():
    """Traces read the same whatever the backend; autocast casts as for the ring."""
    group = _groups()["world"]
    x_shard = torch.randn(2, 3, 16, requires_grad=True)
    w_in, w_out = torch.randn(8, 16, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    with symm_mem_on_cpu():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            h = all_gather_matmul(x_shard, w_in, group, gather_dim=1, backend="symm_mem")
            matmul_reduce_scatter(h, w_out, group, scatter_dim=1, backend="symm_mem").sum().backward()
        x_shard.grad = w_in.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = all_gather_matmul(x_shard, w_in, group, gather_dim=1, backend="symm_mem")
            z = matmul_reduce_scatter(y, w_out, group, scatter_dim=1, backend="symm_mem")
        z.float().sum().backward()
    names = {event.name for event in prof.events()}
    for expected in ("tridist.all_gather_matmul", "tridist.all_gather_matmul.backward",
                     "tridist.matmul_reduce_scatter", "tridist.matmul_reduce_scatter.backward"):
        assert expected in names, (expected, sorted(n for n in names if "tridist" in n))
    assert y.dtype == z.dtype == torch.bfloat16
    assert x_shard.grad.dtype == w_in.grad.dtype == torch.float32 and w_in.grad.abs().sum() > 0


def check_symm_mem_backend_errors():
    x, w = torch.randn(2, 6, 24), torch.randn(40, 24)
    for call in (lambda: all_gather_matmul(x, w, gather_dim=1, backend="symm_mem"),
                 lambda: matmul_reduce_scatter(torch.randn(2, 8, 24), w, scatter_dim=1, backend="symm_mem")):
        raises(ValueError, ["backend='symm_mem'", "no kernel of symm_mem::fused_", "cpu tensors", "backend='ring'"], call)
    raises(ValueError, ["backend='nccl'", "['ring', 'symm_mem']"], lambda: all_gather_matmul(x, w, gather_dim=1, backend="nccl"))
    raises(ValueError, ["backend='Ring'"], lambda: matmul_reduce_scatter(x, w, scatter_dim=0, backend="Ring"))
    with symm_mem_on_cpu():
        raises(ValueError, ["save_gathered=False", "backend='ring'"],
               lambda: all_gather_matmul(x, w, gather_dim=1, save_gathered=False, backend="symm_mem"))
        raises(ValueError, ["x.shape[1] = 7", "group size"],
               lambda: matmul_reduce_scatter(torch.randn(2, 7, 24), w, scatter_dim=1, backend="symm_mem"))
        # torchrun numbers each node's processes consecutively: with 2 per node, the world spans 2 nodes,
        # the pair {0, 2} / {1, 3} too, and a single rank none.
        previous = os.environ["LOCAL_WORLD_SIZE"]
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        try:
            pair = sorted(dist.get_process_group_ranks(_groups()["pair"]))
            for group, ranks in ((_groups()["world"], [0, 1, 2, 3]), (_groups()["pair"], pair)):
                raises(ValueError, [f"ranks {ranks} span nodes [0, 1]", "LOCAL_WORLD_SIZE=2", "backend='ring'"],
                       lambda: all_gather_matmul(x, w, group, gather_dim=1, backend="symm_mem"))
            assert all_gather_matmul(x, w, _groups()["single"], gather_dim=1, backend="symm_mem").shape == (2, 6, 40)
        finally:
            os.environ["LOCAL_WORLD_SIZE"] = previous


# -------------------------------------------------------------------------------------------- errors


def check_error_messages():
    size = dist.get_world_size()
    x, w = torch.randn(2, 7, 24), torch.randn(40, 24)
    raises(ValueError, ["x.shape[1] = 7", "scatter_dim=1", f"group size {size}", "pad", "multiple of 4", "(e.g. 8)"],
           lambda: matmul_reduce_scatter(x, w, scatter_dim=1))
    raises(ValueError, ["[out_features, in_features]", "(24, 40)", "in_features = x_shard.shape[-1] = 24", "not weight.T"],
           lambda: all_gather_matmul(x, w.t(), gather_dim=1))
    raises(ValueError, ["(40, 25)", "= 24"], lambda: matmul_reduce_scatter(torch.randn(4, 24), torch.randn(40, 25)))
    raises(TypeError, ["torch.bfloat16", "torch.float32", "must match"],
           lambda: all_gather_matmul(x, w.bfloat16(), gather_dim=1))
    raises(TypeError, ["torch.int64", "float32, float16 and bfloat16"],
           lambda: all_gather_matmul(torch.ones(2, 3, 24, dtype=torch.long), w, gather_dim=1))
    raises(ValueError, ["x_shard is on cpu", "weight on meta"],
           lambda: all_gather_matmul(x, torch.empty(40, 24, device="meta"), gather_dim=1))
    raises(ValueError, ["gather_dim=-1", "last dim", "leading dim (0..1)"], lambda: all_gather_matmul(x, w, gather_dim=-1))
    raises(ValueError, ["scatter_dim=3", "out of range"], lambda: matmul_reduce_scatter(x, w, scatter_dim=3))
    raises(ValueError, ["at least 2 dims"], lambda: all_gather_matmul(torch.randn(24), w))
    raises(ValueError, ["gloo", "CPU tensors only", "meta", "NCCL"],
           lambda: all_gather_matmul(torch.empty(2, 6, 24, device="meta"), torch.empty(40, 24, device="meta"), gather_dim=1))
    other = dist.new_group([0, 1])  # every rank creates it; ranks 2 and 3 are not members
    if dist.get_rank() >= 2:
        raises(ValueError, ["not a member", f"global rank {dist.get_rank()}"],
               lambda: all_gather_matmul(x, w, other, gather_dim=1))


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    assert int(os.environ["WORLD_SIZE"]) == 4, "the checks assume 4 processes"
    run_checks(CHECKS)  # ends the process group
