"""torch.compile(fullgraph=True) captures all_gather_matmul / matmul_reduce_scatter as the registered
tridist ops, forward and backward equal to eager; the benchmark script runs (2 gloo processes; run by
test_comm_matmul.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tridist.kernels import all_gather_matmul, matmul_reduce_scatter
from tests.distributed import equivalence
from tests.distributed.harness import run_checks
from tests.distributed.symm_mem_cpu import symm_mem_on_cpu


GROUP: dict[str, dist.ProcessGroup] = {}  # created by _inputs(), before any compile traces _block (a dict read)


def _block(x_shard, up, down, save_gathered=True, backend="ring"):
    h = F.gelu(all_gather_matmul(x_shard, up, gather_dim=1, save_gathered=save_gathered, backend=backend))  # default group
    return matmul_reduce_scatter(h, down, GROUP["explicit"], scatter_dim=1, backend=backend)  # a ProcessGroup object


def _inputs():
    if "explicit" not in GROUP:  # every check makes its inputs first, on every rank (new_group is collective)
        GROUP["explicit"] = dist.new_group([0, 1])
    generator = torch.Generator().manual_seed(dist.get_rank())
    return (torch.randn(2, 6, 24, generator=generator), torch.randn(20, 24, generator=generator),
            torch.randn(24, 20, generator=generator))


def _run(fn, inputs):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out * out).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def check_compiled_block_equals_eager():
    torch._dynamo.reset()
    counts = {}

    def backend(gm, example_inputs):  # aot_eager, counting the tridist ops of the forward graph
        counts["ops"] = [str(n.target) for n in gm.graph.nodes if "tridist" in str(n.target)]
        return gm.forward

    for save_gathered in (True, False):
        inputs = _inputs()
        eager = _run(lambda *t: _block(*t, save_gathered=save_gathered), inputs)
        compiled_fn = torch.compile(lambda *t: _block(*t, save_gathered=save_gathered), backend="aot_eager", fullgraph=True)
        compiled = _run(compiled_fn, inputs)
        # The same ops (aot_eager may decompose some): equal within rounding (equivalence.py).
        names = ("out", "grad_x", "grad_up", "grad_down")
        equivalence.assert_tensors_close("compiled", dict(zip(names, [compiled[0], *compiled[1]])), dict(zip(names, [eager[0], *eager[1]])))
    graph = torch.compile(_block, backend=backend, fullgraph=True)
    graph(*_inputs())
    assert counts["ops"] == ["tridist.all_gather_matmul.default", "tridist.matmul_reduce_scatter.default"], counts


def check_profiler_names_the_rings_in_a_compiled_graph():
    """The rings keep their record_function ranges when a compiled graph calls the registered ops."""
    torch._dynamo.reset()
    compiled = torch.compile(_block, backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in _inputs()]
    compiled(*leaves).sum().backward()  # compile outside the trace
    leaves = [t.clone().requires_grad_() for t in _inputs()]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(*leaves).sum().backward()
    names = {event.name for event in prof.events()}
    for ring in ("tridist.all_gather_matmul", "tridist.all_gather_matmul.backward", "tridist.matmul_reduce_scatter",
                 "tridist.matmul_reduce_scatter.backward"):
        assert ring in names, (ring, sorted(n for n in names if "tridist" in n))


def check_symm_mem_backend_compiles_to_one_graph():
    """backend="symm_mem" under torch.compile(fullgraph=True): the same tridist ops in the graph (the backend
    one of their arguments; torch's symm_mem ops run inside them), forward and backward equal to eager and
    to the ring, and the profiler shows the tridist ranges in the compiled graph as for the ring
    (symm_mem_cpu.py: torch's reference implementations of the ops on CPU)."""
    torch._dynamo.reset()
    counts = {}

    def backend(gm, example_inputs):
        counts["ops"] = [str(n.target) for n in gm.graph.nodes if "symm_mem" in str(n.target) or "tridist" in str(n.target)]
        return gm.forward

    names = ("out", "grad_x", "grad_up", "grad_down")
    with symm_mem_on_cpu():
        inputs = _inputs()
        eager = _run(lambda *t: _block(*t, backend="symm_mem"), inputs)
        compiled_fn = torch.compile(lambda *t: _block(*t, backend="symm_mem"), backend="aot_eager", fullgraph=True)
        compiled = _run(compiled_fn, inputs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _run(compiled_fn, inputs)
        torch.compile(lambda *t: _block(*t, backend="symm_mem"), backend=backend, fullgraph=True)(*_inputs())
    ring = _run(_block, inputs)
    equivalence.assert_tensors_close("compiled", dict(zip(names, [compiled[0], *compiled[1]])), dict(zip(names, [eager[0], *eager[1]])))
    equivalence.assert_tensors_close("ring", dict(zip(names, [eager[0], *eager[1]])), dict(zip(names, [ring[0], *ring[1]])))
    assert counts["ops"] == ["tridist.all_gather_matmul.default", "tridist.matmul_reduce_scatter.default"], counts
    events = {event.name for event in prof.events()}
    for expected in ("tridist.all_gather_matmul", "tridist.all_gather_matmul.backward", "tridist.matmul_reduce_scatter",
                     "tridist.matmul_reduce_scatter.backward", "symm_mem::fused_all_gather_matmul",
                     "symm_mem::fused_matmul_reduce_scatter"):
        assert expected in events, (expected, sorted(n for n in events if "tridist" in n or "symm" in n))


def check_opcheck():
    """torch.library.opcheck: schemas, fake (meta) implementations, autograd registration, AOT dispatch,
    for both backends (symm_mem: torch's reference implementations as CPU kernels, symm_mem_cpu.py)."""
    with symm_mem_on_cpu():
        for backend in ("ring", "symm_mem"):
            _opcheck(backend)


def _opcheck(backend: str):
    name = dist.group.WORLD.group_name
    x, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    w2 = torch.randn(3, 8, requires_grad=True)
    for save_gathered in ((True, False) if backend == "ring" else (True,)):
        for return_gathered in (False, True):
            torch.library.opcheck(torch.ops.tridist.all_gather_matmul.default,
                                  (x, [w, w2], name, 1, save_gathered, return_gathered, backend))
    torch.library.opcheck(torch.ops.tridist.matmul_reduce_scatter.default,
                          (torch.randn(4, 2, 8, requires_grad=True), w, name, 0, backend))
    grad_ys = [torch.randn(2, 6, 5), torch.randn(2, 6, 3)]
    gathered = torch.randn(2, 2, 3, 8)
    for need_x, need_w in ((True, True), (True, False), (False, True)):
        for grad_gathered in (torch.randn(2, 2, 3, 8), torch.empty(0)):
            torch.library.opcheck(torch.ops.tridist.all_gather_matmul_backward.default,
                                  (grad_ys, grad_gathered, x.detach(), gathered, [w.detach(), w2.detach()], name, 1,
                                   need_x, [need_w, need_w], backend))
        torch.library.opcheck(torch.ops.tridist.matmul_reduce_scatter_backward.default,
                              (torch.randn(2, 2, 5), torch.randn(4, 2, 8), w.detach(), name, 0, need_x, need_w, backend))


def check_benchmark_runs():
    """bench/comm_matmul.py on tiny shapes: it runs and reports every variant (no speed is asserted)."""
    from tridist.bench import comm_matmul

    rows = comm_matmul.run(batch=1, seq=8, hidden=16, out=8, dtype="fp32", iters=1, warmup=0)
    assert [(r["op"], r["variant"]) for r in rows] == [
        (op, variant) for op in ("all_gather_matmul", "matmul_reduce_scatter") for variant in ("sequential", "overlapped")
    ]
    assert all(r["fwd_ms"] > 0 and r["fwd+bwd_ms"] > 0 for r in rows), rows


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    run_checks(CHECKS)  # ends the process group
