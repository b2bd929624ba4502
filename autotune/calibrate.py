"""Measure the machine this runs on and turn it into a `DeviceProfile` (`tridist calibrate`).

Measured: matmul throughput at a few square sizes in bf16 and fp32 (the best is the profile's peak,
with efficiency 1.0: it is already an achieved rate), the GEMMs a decoder layer really runs (its
q/k/v, o, gate/up and down projections at a training token count, forward and both backward
products) and SDPA's causal attention forward + backward, both in bf16 (the torch engines price
layers with them), memory size, copy bandwidth, and, when the
process is one of several launched by torchrun (WORLD_SIZE > 1), all-reduce and all-gather bus
bandwidth and latency over the default process group. A run inside one node measures the
intra-node link; a run across nodes measures the inter-node link (the bottleneck of a ring that
crosses nodes). What is not measured keeps the value of the closest built-in profile.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import time
from typing import Callable

from .hardware import CALIBRATED_PREFIX, DEVICE_PROFILES, DeviceProfile, builtin_profile_for

__all__ = ["calibrate", "measure_matmul", "measure_copy_bandwidth", "measure_collectives", "measure_layer_gemms",
           "measure_attention", "DEFAULT_SIZES", "LAYER_SHAPES"]

DEFAULT_SIZES = {"cuda": (2048, 4096, 8192), "cpu": (256, 512, 1024)}  # square GEMM sizes per device type
COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 27}  # 1 GiB on a GPU, 128 MiB on a CPU: well past the caches
COMM_SIZES = (1 << 10, 1 << 20, 1 << 24, 1 << 27)  # 1 KiB (latency) ... 128 MiB (bandwidth)
# The layer whose GEMMs and attention are measured: Llama 3 8B's (the model of the torch-native runs in
# published_runs.py: hidden 4096, 32 query and 8 key/value heads of 128, SwiGLU 14336) at 2 sequences of
# 4096 tokens on a GPU; a small Llama-like layer on a CPU (seconds, not minutes).
LAYER_SHAPES = {
    "cuda": dict(batch=2, seq=4096, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336),
    "cpu": dict(batch=2, seq=128, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=704),
}
# The cost model counts a flash-attention core as 4·b·s²·(heads·head_dim) FLOPs forward and 2 + 0.5
# (recomputation) times that backward (cost.py); the measured rate uses the same count.
ATTENTION_PASSES = 1 + 2 + 0.5
WARMUP = 2
REPEATS = 5


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, repeats: int = REPEATS) -> float:
    """Median seconds of `fn()` after warm-up (CUDA is synchronised around each call)."""
    for _ in range(WARMUP):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_matmul(device, dtype, size: int, repeats: int = REPEATS) -> float:
    """Achieved FLOP/s of an [n, n] x [n, n] matmul."""
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = _time(lambda: torch.matmul(a, b), device, repeats)
    return 2.0 * size**3 / seconds


def measure_copy_bandwidth(device, nbytes: int, repeats: int = REPEATS) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    import torch

    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), device, repeats)
    return 2.0 * nbytes / seconds


def measure_layer_gemms(device, dtype, shape: dict, repeats: int = REPEATS) -> float:
    """FLOP/s of one decoder layer's projections (q/k/v packed, o, gate/up packed, down) over batch·seq
    tokens: for each, the forward x·W, the input gradient dY·Wᵀ and the weight gradient xᵀ·dY."""
    import torch

    tokens, h = shape["batch"] * shape["seq"], shape["hidden"]
    q, kv, f = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"], shape["ffn"]
    sets = []
    for n_in, n_out in ((h, q + 2 * kv), (q, h), (h, 2 * f), (f, h)):
        sets.append((torch.randn(tokens, n_in, device=device, dtype=dtype),
                     torch.randn(n_in, n_out, device=device, dtype=dtype) / n_in**0.5,
                     torch.randn(tokens, n_out, device=device, dtype=dtype)))

    def layer():
        for x, w, grad in sets:
            torch.matmul(x, w)
            torch.matmul(grad, w.t())
            torch.matmul(x.t(), grad)

    flops = sum(3 * 2.0 * tokens * w.shape[0] * w.shape[1] for _, w, _ in sets)
    return flops / _time(layer, device, repeats)


def measure_attention(device, dtype, shape: dict, repeats: int = REPEATS) -> float:
    """The rate at which SDPA (causal, torch's fastest backend here) does the cost model's count of
    attention FLOPs, forward and backward."""
    import torch
    import torch.nn.functional as F

    b, s, heads, d = shape["batch"], shape["seq"], shape["heads"], shape["head_dim"]
    q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, heads, s, d, device=device, dtype=dtype)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    counted = ATTENTION_PASSES * 4.0 * b * s**2 * heads * d
    return counted / _time(step, device, repeats)


def measure_collectives(device, sizes=COMM_SIZES, repeats: int = REPEATS,
                        progress: Callable[[str], None] = print) -> dict:
    """All-reduce / all-gather bus bandwidth (nccl-tests' definition) and latency over the default group."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    results = {"all_reduce_busbw": 0.0, "all_gather_busbw": 0.0, "latency": None}
    for nbytes in sizes:
        x = torch.ones(max(nbytes // 4, 1), device=device, dtype=torch.float32)
        out = torch.empty(n * x.numel(), device=device, dtype=torch.float32)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        ar = _time(lambda: dist.all_reduce(x), device, repeats)
        ag = _time(lambda: gather(out, x), device, repeats)
        ar_bw = 2 * (n - 1) / n * nbytes / ar
        ag_bw = (n - 1) / n * n * nbytes / ag
        results["all_reduce_busbw"] = max(results["all_reduce_busbw"], ar_bw)
        results["all_gather_busbw"] = max(results["all_gather_busbw"], ag_bw)
        if nbytes == min(sizes):
            results["latency"] = ar / (2 * (n - 1))  # alpha per ring step from the smallest message
        progress(f"  all-reduce {nbytes / 2**20:9.3f} MiB: {ar * 1e6:9.1f} us, busbw {ar_bw / 1e9:7.2f} GB/s; "
                 f"all-gather busbw {ag_bw / 1e9:7.2f} GB/s")
    return results


def _base_profile(device) -> DeviceProfile:
    """The built-in profile closest to this device, for what is not measured."""
    return DEVICE_PROFILES[builtin_profile_for(device)[0]]


def _memory_bytes(device) -> float:
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return DEVICE_PROFILES["cpu"].memory_bytes


def calibrate(device=None, *, name: str | None = None, sizes=None, dtypes=("bf16", "fp32"), comm: bool = True,
              copy_bytes: int | None = None, repeats: int = REPEATS, layer: dict | None = None,
              progress: Callable[[str], None] = print) -> DeviceProfile:
    """Measure this machine and return its profile (save it with `save_profile`)."""
    import torch

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    base = _base_profile(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    sizes = tuple(sizes or DEFAULT_SIZES[kind])
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} threads)"
    progress(f"calibrating {label}: matmul sizes {sizes} in {', '.join(dtypes)}")
    peaks = {}
    torch_dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    for dtype in dtypes:
        best = 0.0
        for size in sizes:
            flops = measure_matmul(device, torch_dtypes[dtype], size, repeats)
            best = max(best, flops)
            progress(f"  matmul {dtype} {size}x{size}: {flops / 1e12:8.3f} TFLOP/s")
        peaks[dtype] = best
    nbytes = copy_bytes or COPY_BYTES[kind]
    bandwidth = measure_copy_bandwidth(device, nbytes, repeats)
    progress(f"  copy {nbytes / 2**20:.0f} MiB: {bandwidth / 1e9:8.1f} GB/s")
    shape = layer or LAYER_SHAPES[kind]
    layer_gemm = measure_layer_gemms(device, torch.bfloat16, shape, repeats)
    attention = measure_attention(device, torch.bfloat16, shape, repeats)
    progress(f"  decoder layer GEMMs {shape}: {layer_gemm / 1e12:8.3f} TFLOP/s; SDPA causal forward + backward: "
             f"{attention / 1e12:8.3f} TFLOP/s (as the cost model counts)")
    fields = dict(
        name=name or "measured-" + re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-"),
        peak_bf16_flops=peaks.get("bf16", base.peak_bf16_flops * base.matmul_efficiency),
        peak_fp32_flops=peaks.get("fp32", base.peak_fp32_flops * base.matmul_efficiency),
        memory_bytes=_memory_bytes(device), hbm_bandwidth=bandwidth,
        matmul_efficiency=1.0, hbm_efficiency=1.0, layer_gemm_flops=layer_gemm, attention_flops=attention,
        source=f"{CALIBRATED_PREFIX} {label}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}",
    )
    if comm and _distributed_world_size() > 1:
        fields.update(_measured_links(device, base, repeats, progress))
    return dataclasses.replace(base, **fields)


def _distributed_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _measured_links(device, base: DeviceProfile, repeats: int, progress) -> dict:
    """Initialise the default process group if needed (torchrun's env), measure, and map the result
    to the intra- or inter-node link depending on whether the job spans nodes."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    progress(f"collectives over {world} ranks ({'one node' if local == world else 'several nodes'})")
    try:
        measured = measure_collectives(device, repeats=repeats, progress=progress)
    finally:
        if owned:
            dist.destroy_process_group()
    bandwidth = max(measured["all_reduce_busbw"], measured["all_gather_busbw"])
    latency = measured["latency"] or base.intra_node_latency
    if local == world:
        return dict(intra_node_bandwidth=bandwidth, intra_node_latency=latency, comm_efficiency=1.0,
                    inter_node_bandwidth=base.inter_node_bandwidth * base.comm_efficiency)
    return dict(inter_node_bandwidth=bandwidth, inter_node_latency=latency, comm_efficiency=1.0,
                intra_node_bandwidth=base.intra_node_bandwidth * base.comm_efficiency)
