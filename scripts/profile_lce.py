"""Where linear_cross_entropy's fwd+bwd time goes, against torch.compile of eager linear + cross-entropy (issue 23:
the shapes where compile still wins, bench/results/h100-2026-11-27b/NOTES.md).

For each shape: CUDA-event time of both variants (the benchmark's and triton.testing.do_bench's, L2 flushed), then a torch.profiler
table (CPU and CUDA, sorted by CUDA time) of a few fwd+bwd calls and a Chrome trace, so that the time outside
the three GEMMs (kernels, copies, host syncs: cudaStreamSynchronize / Memcpy DtoH rows) can be read off.
Each variant is also timed plainly (5 calls back to back, perf_counter around a synchronize): on the H100 (2026-11-27,
bench/results/h100-2026-11-27c/NOTES.md) do_bench gave the chunked 16,384 x 4,096 x 128,256 96 ms where its GPU
time was 83 and a plain loop took 82: do_bench times a call over 50 ms once (its runs fill 100 ms), so that
figure was one sample. The benchmark's timing keeps at least 10.
Usage: python scripts/profile_lce.py [OUT_DIR] [--shapes=16384x4096x128256,...] [--mode=fwd]
(a CUDA device; `--smoke` runs tiny shapes on the CPU)
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tridist import kernels

SMOKE = "--smoke" in sys.argv
flags = dict(a.split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
out = Path(args[0] if args else "profile-lce")
out.mkdir(parents=True, exist_ok=True)
device = torch.device("cpu" if SMOKE else "cuda")
SHAPES = [(64, 32, 500)] if SMOKE else [(4096, 2048, 32000), (8192, 4096, 128256)]  # tokens, hidden, vocabulary
MODE = flags.get("--mode", "fwd+bwd")  # or fwd (the 8,192-token forward was 1.045x compile: h100-2026-11-27d)
if MODE not in ("fwd", "fwd+bwd"):
    sys.exit(f"--mode must be fwd or fwd+bwd, got {MODE!r}")
if "--shapes" in flags:
    SHAPES = [tuple(int(n) for n in shape.split("x")) for shape in flags["--shapes"].split(",")]
report = []


def log(line=""):
    print(line, flush=True)
    report.append(line)


def eager(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels)


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


def plain_ms(step, calls: int = 5) -> float:
    """Milliseconds per call of `calls` back to back, perf_counter around a synchronize."""
    import time

    sync()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    sync()
    return (time.perf_counter() - start) / calls * 1e3


def timed(step) -> str:
    """bench's timing (CUDA events, L2 flushed, at least 10 runs) and do_bench's, which times a call over
    50 ms once."""
    from tridist.bench.kernels import time_ms

    line = f"{time_ms(step, device=device):.3f} ms (bench, median)"
    if device.type == "cuda":
        import triton.testing

        line += f", {triton.testing.do_bench(step, return_mode='median'):.3f} ms (do_bench)"
    return line


for tokens, hidden_size, vocab in SHAPES:
    dtype = torch.float32 if SMOKE else torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size ** 0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    grad = torch.tensor(0.7, device=device)  # not 1 (as in the benchmark): the backward applies it to what the forward left
    for name, fn in (("tridist", kernels.linear_cross_entropy), ("compile", torch.compile(eager))):
        def step(fn=fn):
            if MODE == "fwd":  # as the benchmark's fwd: inputs that need no gradient, so no graph is recorded
                with torch.no_grad():
                    return fn(hidden, weight, labels)
            return torch.autograd.grad(fn(hidden, weight, labels), (hidden, weight), grad)

        for _ in range(3):  # compilation, allocator, autotuning
            step()
        sync()
        log(f"{name} {tokens} x {hidden_size} x {vocab}: {MODE} {timed(step)}, {plain_ms(step):.3f} ms (plain loop)")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(5):
                step()
            sync()
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        log(prof.key_averages().table(sort_by=sort, row_limit=30))
        prof.export_chrome_trace(str(out / f"{name}-{MODE}-{tokens}x{hidden_size}x{vocab}.json"))

(out / "report.txt").write_text("\n".join(report) + "\n")
