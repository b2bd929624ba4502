"""Device profiles and clusters: the hardware numbers the cost model prices a training step with.

A `DeviceProfile` holds the few figures an analytical model needs: matmul peak and the fraction of it
that large GEMMs reach, memory size and bandwidth, and the bandwidth/latency of the links inside a
node and between nodes (alpha-beta model of a collective). The built-in profiles use public spec
sheets (each number says where it comes from); `tridist calibrate` measures the machine it runs on
and saves a profile as JSON, which `get_profile` finds again by name or path.

A `Cluster` is `nodes x devices_per_node` identical devices; ranks are laid out node by node, so a
group of consecutive ranks that fits in `devices_per_node` talks over the intra-node link.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .engine import DEFAULT_ENGINE, EngineProfile, get_engine

__all__ = [
    "DeviceProfile",
    "Cluster",
    "DEVICE_PROFILES",
    "get_profile",
    "save_profile",
    "load_profile",
    "cache_dir",
    "profile_dir",
    "DTYPE_BYTES",
]

GB = 1e9  # spec sheets quote decimal gigabytes
GIB = 2**30
TFLOPS = 1e12

# Bytes per element of the training compute dtype; mixed precision trains in bf16.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


CALIBRATED_PREFIX = "tridist calibrate on"  # how `calibrate` starts a measured profile's source


_MAY_BE_ZERO = ("overlap_chunking_overhead", "overlap_interference")  # measured fractions: 0 is a valid reading


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator (or CPU socket set) and its links; all rates are per device, per direction.

    `matmul_efficiency` is the share of the peak that a large, well-shaped GEMM reaches (cuBLAS on a
    spec-clocked part); `comm_efficiency` the share of the link bandwidth a ring collective's bus
    bandwidth reaches (NCCL's busbw / link rate). A measured profile stores measured rates with
    efficiencies of 1.0.
    """

    name: str
    peak_bf16_flops: float  # dense tensor-core FLOP/s
    peak_fp32_flops: float  # plain fp32 (no TF32: torch's default for matmul)
    memory_bytes: float
    hbm_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per device per direction (NVLink)
    inter_node_bandwidth: float  # bytes/s per device per direction (one NIC per device)
    intra_node_latency: float = 5.7e-6  # s per ring step: NCCL tuning.cc hwLat NVLINK Ring/Simple 5.7 us
    inter_node_latency: float = 6.6e-6  # s per ring step: NCCL tuning.cc hwLat NET Ring/Simple 6.6 us
    matmul_efficiency: float = 0.8
    hbm_efficiency: float = 0.9  # H100: ~3.0 of 3.35 TB/s in a device-to-device copy (ARCHITECTURE.md 3)
    comm_efficiency: float = 0.8  # nccl-tests busbw is ~75-85% of the NVLink/IB line rate
    source: str = "spec sheet"
    arch: str = "default"  # the GPU architecture ("hopper", "ampere"): engines' kernels differ by it
    # Measured step time / predicted step time of strategies run on this device (a `measure=True`
    # search fits it: the median ratio over every candidate it ran; `measured_steps` counts them).
    step_time_scale: float = 1.0
    measured_steps: int = 0
    # Measured by `tridist calibrate` with torch's kernels, in bf16 (None: not measured): the FLOP rate of
    # a decoder layer's own GEMMs (q/k/v, o, gate/up, down at a training token count, forward and both
    # backward products) and of SDPA's attention forward + backward (FLOPs counted as the cost model
    # counts them). Engines that run torch's kernels use them instead of peak x efficiency.
    layer_gemm_flops: float | None = None
    attention_flops: float | None = None
    # Bytes/s tridist's fused RMSNorm, rotary and SwiGLU kernels reach, forward + backward, at the layer's
    # shapes (measured on a GPU by `tridist calibrate`): the torch+tridist engine's elementwise rate.
    fused_kernel_bandwidth: float | None = None
    # Measured on a GPU by `tridist calibrate` (bench/overlap.py's emulated ring at the layer's shape; None:
    # the cost model's constants): how much slower the ring's tp chunked matmuls are than one matmul
    # (chunked / whole - 1), and the matmuls' slowdown per second of transfer running beside them.
    overlap_chunking_overhead: float | None = None
    overlap_interference: float | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            optional = field.type == "float | None" and value is not None
            if field.name in _MAY_BE_ZERO:
                if optional and not (isinstance(value, (int, float)) and value >= 0):
                    raise ValueError(f"DeviceProfile {self.name!r}: {field.name} must be >= 0, got {value!r}")
            elif (field.type == "float" or optional) and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"DeviceProfile {self.name!r}: {field.name} must be a positive number, got {value!r}")

    @property
    def basis(self) -> str:
        """What predictions on this profile rest on, shown with every prediction: a profile measured by
        `tridist calibrate` (its source names device, torch and date), or datasheet figures, which the
        torch-native engine does not reach (predictions read optimistic)."""
        measured = (f"; step times x{self.step_time_scale:.3g} as measured over {self.measured_steps} candidate runs"
                    if self.measured_steps else "")
        if self.source.startswith(CALIBRATED_PREFIX):
            return f"calibrated: {self.source.removeprefix(CALIBRATED_PREFIX).strip()}{measured}"
        if measured:
            return f"datasheet ({self.name}){measured}"
        return f"datasheet only ({self.name}): expect optimistic times; run `tridist calibrate` on the device"

    def matmul_flops(self, dtype: str = "bf16") -> float:
        """Achievable matmul FLOP/s in `dtype` (peak x efficiency)."""
        peak = self.peak_fp32_flops if dtype == "fp32" else self.peak_bf16_flops
        return peak * self.matmul_efficiency

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceProfile":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"device profile has unknown field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)


# --------------------------------------------------------------------------------- built-in profiles

# NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s dense BF16 (1979 with sparsity), 66.9 TFLOP/s FP32,
# 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s total (450 GB/s per direction). DGX H100: one
# ConnectX-7 400 Gb/s NIC per GPU = 50 GB/s per direction. ~800 TFLOP/s measured bf16 GEMM
# (ARCHITECTURE.md section 3) -> efficiency 0.8.
_H100_SXM = DeviceProfile(
    name="h100-sxm",
    peak_bf16_flops=989.4 * TFLOPS,
    peak_fp32_flops=66.9 * TFLOPS,
    memory_bytes=80 * GB,
    hbm_bandwidth=3.35e12,
    intra_node_bandwidth=450 * GB,
    inter_node_bandwidth=50 * GB,
    matmul_efficiency=0.8,
    source="NVIDIA H100 SXM5 datasheet; DGX H100 (8x ConnectX-7 400 Gb/s)",
    arch="hopper",
)

# NVIDIA H200 SXM datasheet: same compute as H100 SXM (989.4 dense BF16, 66.9 FP32), 141 GB HBM3e at
# 4.8 TB/s, NVLink 4 900 GB/s total; DGX/HGX H200 networking as DGX H100 (400 Gb/s per GPU).
_H200 = dataclasses.replace(
    _H100_SXM,
    name="h200",
    memory_bytes=141 * GB,
    hbm_bandwidth=4.8e12,
    source="NVIDIA H200 SXM datasheet; HGX H200 (8x 400 Gb/s NICs)",
)

# NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense BF16, 19.5 TFLOP/s FP32, 80 GB HBM2e at
# 2.039 TB/s, NVLink 3 600 GB/s total (300 per direction). DGX A100 / Selene: one HDR InfiniBand
# 200 Gb/s NIC per GPU = 25 GB/s per direction. Large bf16 GEMMs reach ~250-270 TFLOP/s -> 0.8.
_A100_80GB = DeviceProfile(
    name="a100-80gb",
    peak_bf16_flops=312 * TFLOPS,
    peak_fp32_flops=19.5 * TFLOPS,
    memory_bytes=80 * GB,
    hbm_bandwidth=2.039e12,
    intra_node_bandwidth=300 * GB,
    inter_node_bandwidth=25 * GB,
    matmul_efficiency=0.8,
    source="NVIDIA A100 SXM4 80GB datasheet; DGX A100 (8x HDR 200 Gb/s)",
    arch="ampere",
)

# NVIDIA A100 SXM4 40GB datasheet: same compute, 40 GB HBM2 at 1.555 TB/s, same NVLink 3 and DGX A100 NICs.
_A100_40GB = dataclasses.replace(
    _A100_80GB,
    name="a100-40gb",
    memory_bytes=40 * GB,
    hbm_bandwidth=1.555e12,
    source="NVIDIA A100 SXM4 40GB datasheet; DGX A100 (8x HDR 200 Gb/s)",
)

# A generic CPU host, order of magnitude only (run `tridist calibrate` for real figures): a 32-core
# AVX-512 server socket peaks near 2-3 TFLOP/s fp32 (cores x 2 FMA units x 16 lanes x 2 x ~2.5 GHz)
# and about twice that in bf16 with AMX/AVX512-BF16; 8-channel DDR5 ~300 GB/s; "devices" on one
# host talk through shared memory (gloo, ~10 GB/s) and across hosts over 100 GbE (12.5 GB/s line rate).
_CPU = DeviceProfile(
    name="cpu",
    peak_bf16_flops=4 * TFLOPS,
    peak_fp32_flops=2 * TFLOPS,
    memory_bytes=256 * GB,
    hbm_bandwidth=300 * GB,
    intra_node_bandwidth=10 * GB,
    inter_node_bandwidth=12.5 * GB,
    intra_node_latency=20e-6,  # gloo over loopback TCP: tens of microseconds per message
    inter_node_latency=50e-6,  # Ethernet round trip with kernel TCP stack
    matmul_efficiency=0.5,  # oneDNN on mid-size GEMMs rarely passes half the FMA peak
    hbm_efficiency=0.7,  # STREAM copy reaches ~70% of DDR peak
    comm_efficiency=0.5,  # gloo's ring is memcpy- and TCP-bound
    source="generic CPU server, order of magnitude; calibrate for real numbers",
    arch="cpu",
)

DEVICE_PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (_H100_SXM, _H200, _A100_80GB, _A100_40GB, _CPU)}


def builtin_profile_for(device) -> tuple[str, bool]:
    """The name of the built-in profile closest to a torch device, and whether the device is one of
    them (False: a GPU without a profile, priced as an H100 until `tridist calibrate` measures it)."""
    import torch

    if device.type != "cuda":
        return "cpu", True
    name = torch.cuda.get_device_name(device).lower()
    for key, profile in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80gb")):
        if key in name:
            # The A100 comes with 40 or 80 GB (the name does not say): 60 GiB separates them.
            if profile == "a100-80gb" and torch.cuda.get_device_properties(device).total_memory < 60 * 2**30:
                return "a100-40gb", True
            return profile, True
    return "h100-sxm", False


# ------------------------------------------------------------------------------ saving and loading


def cache_dir() -> Path:
    """tridist's cache root: $TRIDIST_CACHE_DIR, else $XDG_CACHE_HOME/tridist, else ~/.cache/tridist."""
    override = os.environ.get("TRIDIST_CACHE_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tridist"


def profile_dir() -> Path:
    """Where measured device profiles are saved and looked up by name."""
    return cache_dir() / "device-profiles"


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def save_profile(profile: DeviceProfile, path: str | Path | None = None) -> Path:
    """Write `profile` as JSON to `path` (default: <profile_dir>/<name>.json) and return the path."""
    target = Path(path) if path is not None else profile_dir() / f"{_slug(profile.name)}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n")
    return target


def load_profile(path: str | Path) -> DeviceProfile:
    """Read a profile written by `save_profile`."""
    with open(path) as f:
        return DeviceProfile.from_dict(json.load(f))


def get_profile(device: str | DeviceProfile) -> DeviceProfile:
    """A profile by built-in name, by the name of a saved (calibrated) profile, or by JSON path."""
    if isinstance(device, DeviceProfile):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a profile name, a JSON path or a DeviceProfile, got {type(device).__name__}")
    if device in DEVICE_PROFILES:
        return DEVICE_PROFILES[device]
    saved = profile_dir() / f"{_slug(device)}.json"
    if saved.is_file():
        return load_profile(saved)
    if device.endswith(".json") or os.sep in device:
        if Path(device).is_file():
            return load_profile(device)
        raise FileNotFoundError(f"device profile file {device!r} does not exist")
    raise ValueError(
        f"unknown device {device!r}; built-in profiles: {', '.join(DEVICE_PROFILES)}; saved profiles in "
        f"{profile_dir()}: {', '.join(sorted(p.stem for p in profile_dir().glob('*.json'))) or '(none)'}; "
        "or pass a JSON path written by `tridist calibrate`"
    )


# ----------------------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Cluster:
    """`nodes` x `devices_per_node` identical devices training in `dtype` (mixed precision: "bf16"),
    with `engine`, the software that runs the step (engine.py: "torch+tridist", what to_distributed
    runs; "torch", eager torch-native; "megatron").

    `device` is a profile name, a saved-profile name or path, or a `DeviceProfile`; `engine` a name or
    an `EngineProfile`; both are resolved at construction.
    """

    nodes: int
    devices_per_node: int
    device: DeviceProfile | str = "h100-sxm"
    dtype: str = "bf16"
    engine: EngineProfile | str = DEFAULT_ENGINE

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Cluster: {name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"Cluster: dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        object.__setattr__(self, "device", get_profile(self.device))
        object.__setattr__(self, "engine", get_engine(self.engine))

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def profile(self) -> DeviceProfile:
        return self.device  # resolved in __post_init__

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def link(self, group_size: int, stride: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of a ring over `group_size` ranks spaced `stride` apart.

        The group stays inside one node when its span (group_size x stride) fits in a node; otherwise
        the ring crosses nodes and every device's NIC is the bottleneck.
        """
        p = self.profile
        if group_size * stride <= self.devices_per_node:
            return p.intra_node_bandwidth * p.comm_efficiency, p.intra_node_latency
        return p.inter_node_bandwidth * p.comm_efficiency, p.inter_node_latency

    def describe(self) -> str:
        return f"{self.nodes}x{self.devices_per_node} {self.profile.name} ({self.dtype}, {self.engine.name})"
