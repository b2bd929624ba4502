"""Probe (GPU): can a Triton kernel be launched straight through its CompiledKernel, and what does that save?
Prints the installed Triton's launch API facts and host us per call of: kernel[grid](...), the binder alone,
compiled.run(...) with a prepared argument list. Run: python3 scripts/probe_direct_launch.py"""
import inspect
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _add(x_ptr, y_ptr, out_ptr, n, stride, eps, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y + eps if FLAG else x, mask=mask)


def timeit(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


x = torch.randn(4096, device="cuda")
y, out = torch.randn_like(x), torch.empty_like(x)
print("triton", triton.__version__, "torch", torch.__version__)
compiled = _add[(4,)](x, y, out, 4096, 1, 1e-5, BLOCK=1024, FLAG=True)
print("returns", type(compiled).__name__, "attrs:", [a for a in ("run", "function", "packed_metadata", "launch_metadata")
                                                   if hasattr(compiled, a)])
print("arg_names", getattr(_add, "arg_names", None))
print("jit run source args:", inspect.signature(_add.run))
src = inspect.getsource(type(_add).run)
print("\n".join(line for line in src.splitlines() if "kernel.run(" in line or "bound_args.values" in line))
from triton.runtime import driver
dev = driver.active.get_current_device()
stream = driver.active.get_current_stream(dev)
cache = _add.device_caches[dev]
print("device_caches entry len", len(cache))
binder = cache[-1]
bound, spec, opts = binder(x, y, out, 4096, 1, 1e-5, BLOCK=1024, FLAG=True)
print("bound keys", list(bound), "spec", spec)
vals = list(bound.values())
run = compiled.run
fn = compiled.function
meta = compiled.packed_metadata
out.zero_()
run(4, 1, 1, stream, fn, meta, None, None, None, *vals)
torch.cuda.synchronize()
print("direct launch correct:", torch.allclose(out, x + y + 1e-5))
print("us/call jit      ", round(timeit(lambda: _add[(4,)](x, y, out, 4096, 1, 1e-5, BLOCK=1024, FLAG=True)), 2))
print("us/call binder   ", round(timeit(lambda: binder(x, y, out, 4096, 1, 1e-5, BLOCK=1024, FLAG=True)), 2))
print("us/call stream   ", round(timeit(lambda: driver.active.get_current_stream(driver.active.get_current_device())), 2))
print("us/call direct   ", round(timeit(lambda: run(4, 1, 1, stream, fn, meta, None, None, None, *vals)), 2))
print("us/call direct+stream", round(timeit(lambda: run(4, 1, 1, driver.active.get_current_stream(driver.active.get_current_device()), fn, meta, None, None, None, x, y, out, 4096, 1, 1e-5, 1024, True)), 2))
print("us/call empty_like", round(timeit(lambda: torch.empty_like(x)), 2))
print("us/call x+y       ", round(timeit(lambda: x + y), 2))
