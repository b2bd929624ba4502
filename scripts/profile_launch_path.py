"""Where the host time of one small-shape call goes (issue 23: shapes where torch.compile wins).

On a CUDA machine: for each small case, GPU time (triton.testing.do_bench, which loops the call, so a
host-bound call shows its host time), host time per call (calls queued without syncing), the same for
torch.compile of the eager reference, a decomposition of RMSNorm's forward (raw Triton launch, launcher,
op, public function), a cProfile of the public call and a torch.profiler table (CPU and CUDA).
Usage: python scripts/profile_launch_path.py [OUT_DIR]
"""
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from tridist.kernels import rms_norm, swiglu
from tridist.kernels.ops import rms_norm as rms_mod

out = Path(sys.argv[1] if len(sys.argv) > 1 else "profile-out")
out.mkdir(parents=True, exist_ok=True)
dev, dt = "cuda", torch.bfloat16
report = []


def log(line=""):
    print(line, flush=True)
    report.append(line)


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def gpu_us(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3


def rms_ref(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(w.dtype) * w


def swiglu_ref(a, b):
    return torch.nn.functional.silu(a) * b


T, H, I = 4096, 2048, 5632
x = torch.randn(T, H, device=dev, dtype=dt, requires_grad=True)
w = torch.ones(H, device=dev, dtype=dt, requires_grad=True)
a = torch.randn(T, I, device=dev, dtype=dt, requires_grad=True)
b = torch.randn(T, I, device=dev, dtype=dt, requires_grad=True)
gy, gs = torch.randn(T, H, device=dev, dtype=dt), torch.randn(T, I, device=dev, dtype=dt)
rms_c, swi_c = torch.compile(rms_ref), torch.compile(swiglu_ref)


def fwdbwd(f, *args, g):
    def run():
        y = f(*args)
        y.backward(g)
    return run


cases = {
    "rms_norm fwd (grad)": (lambda: rms_norm(x, w), lambda: rms_c(x, w)),
    "rms_norm fwd (no_grad)": (lambda: rms_norm(x.detach(), w.detach()), lambda: rms_c(x.detach(), w.detach())),
    "rms_norm fwd+bwd": (fwdbwd(rms_norm, x, w, g=gy), fwdbwd(rms_c, x, w, g=gy)),
    "swiglu fwd (grad)": (lambda: swiglu(a, b), lambda: swi_c(a, b)),
    "swiglu fwd+bwd": (fwdbwd(swiglu, a, b, g=gs), fwdbwd(swi_c, a, b, g=gs)),
}
log(f"# Launch path at small shapes ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
    f"triton {triton.__version__})")
log("")
log("| case | tridist GPU us | tridist host us/call | compile GPU us | compile host us/call |")
log("| --- | ---: | ---: | ---: | ---: |")
for name, (ours, theirs) in cases.items():
    log(f"| {name} | {gpu_us(ours):.1f} | {host_us(ours):.1f} | {gpu_us(theirs):.1f} | {host_us(theirs):.1f} |")

# RMSNorm forward, layer by layer (no grad): where the host microseconds go.
xd, wd = x.detach(), w.detach()
plan = rms_mod._forward_plan(xd.shape, xd.stride(), None, xd.dtype, None, wd.dtype, wd.stride(0), xd.device,
                             False, None)
y = torch.empty_like(xd)
h = y
rstd = xd.new_empty((T,), dtype=torch.float32)
kern = rms_mod._rms_norm_fwd_kernel
layers = {
    "raw Triton launch": lambda: kern[plan.launch.grid](xd, xd, wd, y, h, rstd, eps=1e-6, offset=0.0,
                                                        **plan.launch.kwargs),
    "Launch.launch (compiled kernel called straight)": lambda: plan.launch.launch(kern, xd, xd, wd, y, h, rstd,
                                                                                  eps=1e-6, offset=0.0),
    "three torch.empty": lambda: (torch.empty_like(xd), xd.new_empty((T,), dtype=torch.float32)),
    "_forward_plan (cached)": lambda: rms_mod._forward_plan(xd.shape, xd.stride(), None, xd.dtype, None, wd.dtype,
                                                            wd.stride(0), xd.device, False, None),
    "_forward": lambda: rms_mod._forward(xd, None, wd, 1e-6, 0.0, False),
    "_rms_norm_impl": lambda: rms_mod._rms_norm_impl(xd, wd, 1e-6, 0.0, False),
    "_rms_norm_eager (autograd.Function)": lambda: rms_mod._rms_norm_eager(xd, wd, 1e-6, 0.0, False),
    "torch.library op": lambda: rms_mod._rms_norm_op(xd, wd, 1e-6, 0.0, False),
    "public rms_norm": lambda: rms_norm(xd, wd),
    "public rms_norm, requires_grad": lambda: rms_norm(x, w),
    "eager torch.add (floor)": lambda: torch.add(xd, xd),
}
log("")
log("## RMSNorm forward, host us per call by layer (T=4096 H=2048 bf16)")
log("")
for name, fn in layers.items():
    log(f"- {name}: {host_us(fn, 1000):.1f}")

for name in ("rms_norm fwd (no_grad)", "rms_norm fwd+bwd", "swiglu fwd+bwd"):
    fn = cases[name][0]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    (out / f"cprofile-{name.replace(' ', '_').replace('(', '').replace(')', '').replace('+', '')}.txt").write_text(
        s.getvalue())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
    log("")
    log(f"## torch.profiler: {name} (50 calls)")
    log("")
    log("```")
    log(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    log("```")

(out / "launch-path.md").write_text("\n".join(report) + "\n")
