"""Time a grid of launch configurations of one kernel at shapes the sweep's buckets do not cover (GPU only).

    python3 scripts/probe_configs.py OUT.csv add_rms_norm bwd 65536x2048,65536x4096 \
        'BLOCK_M=1,2 num_warps=4,8,16 PROGRAMS_PER_SM=2,4,8 NUM_STAGES=1,2'

Every configuration is checked against the fp64 gold first (the sweep's criterion, autotune.kernel_sweep), then
timed by CUDA events with L2 flushed (`bench.kernels.time_ms`, the benchmark's timer); parameters not on the command line keep the
heuristic's values. Prints and writes one row per (shape, configuration), the heuristic's row marked.
"""

from __future__ import annotations

import csv
import itertools
import sys
import time

import torch

from tridist.autotune.kernel_sweep import Bucket, prepare
from tridist.bench.kernels import time_ms


def main(out_path: str, op: str, kind: str, shapes: str, grid: str) -> None:
    axes = {name: [int(v) for v in values.split(",")] for name, values in (item.split("=") for item in grid.split())}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: TRITON_INTERPRET=1, a smoke run
    rows = []
    for shape in shapes.split(","):
        tokens, width = (int(v) for v in shape.split("x"))
        bucket = Bucket(op, kind, tokens, width)
        run, heuristic = prepare(bucket, device), bucket.heuristic()
        unknown = sorted(set(axes) - set(heuristic))
        if unknown:
            sys.exit(f"probe_configs: {op} {kind} has no launch parameter {', '.join(unknown)}; "
                     f"its parameters are {', '.join(sorted(heuristic))}")
        configs = [heuristic] + [{**heuristic, **dict(zip(axes, values))} for values in itertools.product(*axes.values())]
        for i, config in enumerate(configs):
            start = time.perf_counter()
            try:
                error = run.check(run.run(config))
                ms = None if error else time_ms(lambda: run.run(config), device=device)
            except Exception as exc:  # a configuration that does not compile or launch
                error, ms = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}", None
            row = {"shape": shape, "heuristic": i == 0, **config, "ms": ms, "error": error or ""}
            rows.append(row)
            print(f"{shape} {'H ' if i == 0 else '  '}{config} -> {ms if ms is None else f'{ms:.4f}'} ms {error or ''}"
                  f" ({time.perf_counter() - start:.1f} s)", flush=True)
        best = min((r for r in rows if r["shape"] == shape and r["ms"]), key=lambda r: r["ms"])
        print(f"best at {shape}: {best}", flush=True)
    with open(out_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main(*sys.argv[1:])
