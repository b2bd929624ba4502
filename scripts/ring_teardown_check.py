"""A plain user script of the overlapped rings, for checking that it exits cleanly (issue 22).

    torchrun --standalone --nproc-per-node=2 scripts/ring_teardown_check.py

gloo on CPU, `all_gather_matmul` then `matmul_reduce_scatter`, forward and backward, compared with the
same math done by one process, one all-reduce, then `dist.destroy_process_group()` and nothing else: no
tridist helper ends the group, and the outputs stay referenced at module level until the interpreter
exits, as in a script written top to bottom. It prints one line per rank and exits 0; an abort at
interpreter exit (after the line was printed) is what this script is for. Run it many times on a loaded
machine, e.g.

    for i in $(seq 40); do torchrun --standalone --nproc-per-node=2 scripts/ring_teardown_check.py \
        >/dev/null 2>&1; echo $?; done | sort | uniq -c
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tridist.kernels import all_gather_matmul, matmul_reduce_scatter

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

# Every rank draws the same global tensors, so the reference needs no collective.
torch.manual_seed(0)
rows, hidden, inner = 4, 16, 32
x = torch.randn(world * rows, hidden)
w_in = torch.randn(inner * world, hidden)  # ColWise: rank r holds rows [r*inner, (r+1)*inner)
w_out = torch.randn(hidden, inner * world)  # RowWise: rank r holds columns [r*inner, (r+1)*inner)
grad = torch.randn(world * rows, hidden)

x_shard = x.chunk(world)[rank].clone().requires_grad_()
w_in_shard = w_in.chunk(world)[rank].clone().requires_grad_()
w_out_shard = w_out.chunk(world, dim=1)[rank].clone().requires_grad_()
h = all_gather_matmul(x_shard, w_in_shard, gather_dim=0)
y_shard = matmul_reduce_scatter(h, w_out_shard, scatter_dim=0)
y_shard.backward(grad.chunk(world)[rank])

x_ref, w_in_ref, w_out_ref = (t.clone().requires_grad_() for t in (x, w_in, w_out))
y_ref = F.linear(F.linear(x_ref, w_in_ref), w_out_ref)
y_ref.backward(grad)

pairs = {
    "y": (y_shard, y_ref.chunk(world)[rank]),
    "grad x": (x_shard.grad, x_ref.grad.chunk(world)[rank]),
    "grad w_in": (w_in_shard.grad, w_in_ref.grad.chunk(world)[rank]),
    "grad w_out": (w_out_shard.grad, w_out_ref.grad.chunk(world, dim=1)[rank]),
}
wrong = [name for name, (got, want) in pairs.items() if not torch.allclose(got, want, rtol=1e-4, atol=1e-4)]
assert not wrong, f"rank {rank}: {wrong} differ from the single-process reference"
# One collective after the rings, as a script that logs a reduced loss has: gloo runs it on its worker
# threads, which must be gone before the interpreter finalises.
agreed = torch.ones(1)
dist.all_reduce(agreed)
print(f"rank {rank}: forward and backward match the single-process reference on {int(agreed)} ranks", flush=True)

dist.destroy_process_group()
