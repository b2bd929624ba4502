"""Overlapped tensor-parallel matmuls against the sequential collective-then-matmul they replace.

    torchrun --nproc-per-node 8 -m tridist.bench.comm_matmul --batch 2 --seq 8192 --hidden 8192 --out 28672 --dtype bf16

Times, per rank group of all processes, `kernels.all_gather_matmul` against torch's functional
`all_gather` + F.linear, and `kernels.matmul_reduce_scatter` against F.linear + `reduce_scatter`
(torch's tensor-parallel path), forward and forward+backward, and prints one row each (rank 0).
The overlap only shows on GPUs, where NCCL transfers run on their own stream beside the matmuls; on
gloo/CPU both share the same cores and the numbers merely show that it runs. Nothing here asserts a
speed-up. `--seq` is the full sequence (sharded over the processes); `--out` the full output features
of the ColWise projection (each rank holds out / world_size of them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from tridist.distcore.env import destroy_parallel_env, init_parallel_env
from tridist.kernels import all_gather_matmul, matmul_reduce_scatter

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if callable(getattr(t, "wait", None)) and type(t).__name__ == "AsyncCollectiveTensor" else t


def sequential_all_gather_matmul(x_shard, weight, group, gather_dim):
    return F.linear(_wait(_all_gather(x_shard, gather_dim, group)), weight)


def sequential_matmul_reduce_scatter(x, weight, group, scatter_dim):
    return _wait(_reduce_scatter(F.linear(x, weight), "sum", scatter_dim, group))


def _time_ms(fn, *, iters: int, warmup: int, device: torch.device) -> float:
    """Median wall time of one call, all ranks starting each call together."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(*, batch: int, seq: int, hidden: int, out: int, dtype: str = "bf16", iters: int = 20, warmup: int = 5,
        group=None) -> list[dict]:
    """Timings (ms, median) of the four variants in both modes; every rank must call it."""
    group = dist.group.WORLD if group is None else group
    size = dist.get_world_size(group)
    if seq % size or out % size:
        raise ValueError(f"--seq {seq} and --out {out} must divide by the group size {size}")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    torch_dtype = DTYPES[dtype]
    make = lambda *shape: torch.randn(*shape, device=device, dtype=torch_dtype, requires_grad=True)  # noqa: E731
    x_shard, w_col = make(batch, seq // size, hidden), make(out // size, hidden)  # sequence-parallel in, ColWise
    h, w_row = make(batch, seq, out // size), make(hidden, out // size)  # RowWise in, sequence-parallel out
    cases = {
        ("all_gather_matmul", "sequential"): lambda: sequential_all_gather_matmul(x_shard, w_col, group, 1),
        ("all_gather_matmul", "overlapped"): lambda: all_gather_matmul(x_shard, w_col, group, gather_dim=1),
        ("matmul_reduce_scatter", "sequential"): lambda: sequential_matmul_reduce_scatter(h, w_row, group, 1),
        ("matmul_reduce_scatter", "overlapped"): lambda: matmul_reduce_scatter(h, w_row, group, scatter_dim=1),
    }
    rows = []
    for (op, variant), fn in cases.items():
        with torch.no_grad():
            forward_ms = _time_ms(fn, iters=iters, warmup=warmup, device=device)
        both_ms = _time_ms(lambda: fn().sum().backward(), iters=iters, warmup=warmup, device=device)
        rows.append({"op": op, "variant": variant, "world_size": size, "dtype": dtype, "fwd_ms": forward_ms,
                     "fwd+bwd_ms": both_ms})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096, help="full sequence length (sharded over ranks)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--out", type=int, default=11008, help="full ColWise output features")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    init_parallel_env()  # NCCL on GPUs (each rank on its LOCAL_RANK's device), gloo otherwise
    try:
        rows = run(batch=args.batch, seq=args.seq, hidden=args.hidden, out=args.out, dtype=args.dtype,
                   iters=args.iters, warmup=args.warmup)
        if dist.get_rank() == 0:
            print(f"{'op':<24}{'variant':<12}{'fwd ms':>10}{'fwd+bwd ms':>12}")
            for row in rows:
                print(f"{row['op']:<24}{row['variant']:<12}{row['fwd_ms']:>10.3f}{row['fwd+bwd_ms']:>12.3f}")
    finally:
        destroy_parallel_env()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
