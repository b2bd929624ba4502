"""Engine profiles: how close the software that runs a training step comes to the hardware.

A `DeviceProfile` (hardware.py) says what the hardware can do: peak FLOP/s, the share of it a large
cuBLAS GEMM reaches, bandwidths. An `EngineProfile` says what an implementation of the step achieves
on it. The two multiply: the same H100 runs Megatron-LM's fused kernels near 60% MFU and torch-native
eager training near 35% (tests/test_autotune_engine.py checks both against published runs).

The terms (each built-in value says where it comes from):
- `attention_efficiency`: the attention kernel's FLOP rate relative to the device's GEMM rate, per GPU
  architecture (FlashAttention-2, which torch's SDPA runs, lacks Hopper's TMA/wgmma paths: 35% of an
  H100's peak, where FlashAttention-3 and cuDNN reach 75%).
- `elementwise_traffic`: bytes the non-matmul ops (norms, rotary, activations, residual adds) move
  in the forward pass per byte of stored activations. Fused kernels read and write each tensor once;
  eager PyTorch runs RMSNorm, rotary and SwiGLU as chains of small ops (counted below).
- `op_overhead_s` x `ops_per_layer`: the CPU time to dispatch a layer's kernels (forward + backward).
  The GPU runs ahead of the CPU, so this is a floor under a layer's time, not an addition: it decides
  the step time of small layers only.
- `fsdp_copy_passes`: FSDP2 copies each gathered parameter out of its all-gather buffer and each
  gradient into its reduce-scatter buffer (a read and a write of the bytes), on top of the collective.
- `overlap_tp_comm`: whether the engine can run a Strategy with `overlap_tp_comm` at all (Megatron's
  communication-overlapped GEMMs; distcore's `mp_config["overlap_comm"]`, which runs sequence parallel's
  edges through tridist's rings), so the search never proposes, and `check` refuses, what the engine
  would silently run without overlap. `overlap_wire_factor`: the bytes the overlapped collectives move
  per byte of the plain ones (tridist's reduce-scatter ring sums in fp32 on the wire: twice a bf16
  reduce-scatter's bytes, half of sequence parallel's collectives, so 1.5 in 16-bit training).

Not modelled, and so left to the measured calibration factor (`DeviceProfile.step_time_scale`, which
`measure=True` searches fit and save): DTensor's per-op dispatch cost, torch pipelining's Python
schedule, allocator stalls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["EngineProfile", "ENGINES", "get_engine", "DEFAULT_ENGINE"]

@dataclass(frozen=True)
class EngineProfile:
    name: str
    attention_efficiency: tuple[tuple[str, float], ...]  # (device arch, rate relative to its GEMM rate)
    elementwise_traffic: float
    op_overhead_s: float = 0.0
    ops_per_layer: int = 0
    fsdp_copy_passes: float = 0.0
    overlap_tp_comm: bool = False  # runs tensor parallel's collectives fused with the GEMMs
    overlap_wire_factor: float = 1.0  # bytes of the overlapped collectives per byte of the plain ones
    overlap_with_selective_recompute: bool = True  # distcore: no (its selective recompute bypasses the region)
    torch_kernels: bool = False  # runs torch's GEMMs and SDPA: a calibrated profile's measured rates apply
    fused_kernels: bool = False  # runs tridist's fused norm/rotary/SwiGLU: their measured bandwidth applies
    # Computes the LM head's loss by tridist's linear_cross_entropy (kernels.fuse's FusedLMHead), under tensor
    # parallel vocabulary-parallel: the loss holds no [tokens, vocab] logits (cost.py).
    fused_loss: bool = False
    # The routed and shared experts split over tp like the dense MLP (Megatron-Core's default: expert tensor
    # parallel = tp); False: whole on every tp rank (distcore's tensor_parallel_plan; Megatron's
    # expert_tensor_parallel_size=1), which runs the same tokens through them, or under sequence parallel each
    # rank's slice of the sequence (their gradients then summed over tp; with expert parallel, each tp rank
    # routes its slice's tokens through its own ep group).
    expert_tensor_parallel: bool = True
    # tp may exceed the key/value heads, each then computed on tp / kv ranks (distcore's ReplicatedColWiseParallel);
    # Megatron-Core requires tp to divide them (num_query_groups_per_partition = divide(num_query_groups, tp)).
    replicated_kv_heads: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        for arch, value in self.attention_efficiency:
            if not 0 < value <= 1:
                raise ValueError(f"EngineProfile {self.name!r}: attention efficiency on {arch!r} must be in (0, 1], got {value!r}")
        if self.elementwise_traffic <= 0 or self.op_overhead_s < 0 or self.ops_per_layer < 0 or self.fsdp_copy_passes < 0:
            raise ValueError(f"EngineProfile {self.name!r}: traffic must be positive, overheads non-negative")

    def attention(self, arch: str) -> float:
        """The attention kernel's rate relative to the GEMM rate on a device of `arch` (the "default"
        entry for architectures not listed)."""
        table = dict(self.attention_efficiency)
        return table.get(arch, table["default"])

    def layer_floor_s(self) -> float:
        """The CPU dispatch time of one layer's forward and backward (see the module's doc)."""
        return self.op_overhead_s * self.ops_per_layer


# Megatron-LM with Transformer Engine: fused elementwise kernels, cuDNN / FlashAttention-3 attention at
# ~75% of an H100's peak (Shah et al. 2024, FlashAttention-3, abstract: 740 TFLOP/s, 75%), i.e. ~0.75 of a
# ~80%-of-peak GEMM; 1.5 bytes moved per stored byte (counted for Megatron's GPT layer: ~38·sbh + 9·as²b
# moved vs 34·sbh + 5·as²b stored). These are the cost model's terms from before engines existed, checked
# against Megatron-LM's published layouts and TFLOP/s (tests/test_autotune_search.py).
MEGATRON = EngineProfile(
    name="megatron",
    attention_efficiency=(("default", 0.75),),
    elementwise_traffic=1.5,
    overlap_tp_comm=True,
    source="Megatron-LM + Transformer Engine (fused kernels, FlashAttention-3 / cuDNN attention)",
)

# torch-native eager training (FSDP2, DTensor, SDPA), as torchtitan measures it without torch.compile.
# - Attention: SDPA's flash backend is FlashAttention-2: 35% of an H100's peak (Shah et al. 2024,
#   FlashAttention-3, abstract: "FlashAttention-2 achieving only 35% utilization on the H100"), 0.35 /
#   0.8 of its GEMM rate; 50-73% of an A100's peak forward, less backward (Dao 2023, FlashAttention-2,
#   abstract): 0.6 / 0.8.
# - Elementwise: eager RMSNorm (upcast, pow, mean, rsqrt, two multiplies, downcast) moves ~36 bytes per
#   element where a fused kernel moves 4; eager rotary (two multiplies, rotate_half's negate and cat, an
#   add) ~22 where a fused one moves 4; eager SwiGLU (silu, multiply) 10 where a fused one moves 6.
#   Over a Llama-3-8B layer (two norms, rotary of q and k, SwiGLU of 14336, residual adds, attention's
#   transposes) that is ~633 kB per token against ~221 kB fused: 2.9x Megatron's 1.5. Cross-check with our
#   own H100 run (bench/results/h100-2026-11-24: eager / fused time, forward + backward, at large shapes):
#   SwiGLU 1.65x (counted 1.7x), RMSNorm 13x (counted 9x), rotary 11.6x (counted 5.5x): eager ops also
#   run below copy bandwidth, so the count is a floor; the measured ratios make the layer ~4.0x fused.
#   With 4.0x the published runs below would predict 0.95 / 0.92 / 0.91 / 0.81 instead of 1.02 / 0.99 /
#   0.94 / 0.82 (both inside their tolerance); a calibrated profile's measured rates replace both.
# - Dispatch: ~10 us of CPU per eager op (PyTorch's dispatcher + a CUDA launch; the reason CUDA graphs
#   and torch.compile pay off for small shapes), ~45 ops in a Llama layer's forward, twice that backward.
# - FSDP2: all-gather copy-out and reduce-scatter copy-in (torch FSDP2 design: per-parameter DTensors
#   viewed into flat communication buffers), one read and one write of the bytes each.
# Checked against torchtitan's published Llama 3.1 8B (8 and 128 H100s) and Llama 3 8B / 70B (64 A100s)
# runs (autotune/data/torch_native_runs.json, tests/test_autotune_engine.py).
TORCH = EngineProfile(
    name="torch",
    expert_tensor_parallel=False,
    attention_efficiency=(("hopper", 0.35 / 0.8), ("ampere", 0.6 / 0.8), ("default", 0.75)),
    elementwise_traffic=1.5 * 633 / 221,
    op_overhead_s=10e-6,
    ops_per_layer=45 * 3,
    fsdp_copy_passes=2.0,
    torch_kernels=True,
    # distcore's overlap_comm: tridist's all-gather / reduce-scatter rings at sequence parallel's edges
    # (NCCL point-to-point beside the GEMMs); the reduce-scatter ring's partial sums travel in fp32.
    overlap_tp_comm=True,
    overlap_wire_factor=1.5,
    overlap_with_selective_recompute=False,  # the recomputed attention would run without the region's gather
    replicated_kv_heads=True,
    source="torch-native eager (FSDP2, DTensor, SDPA FlashAttention-2); fitted to torchtitan's published runs",
)

# What to_distributed runs by default (fuse_kernels=True): the torch-native engine with tridist's fused
# RMSNorm, rotary and SwiGLU kernels, which move each tensor once, as Megatron's do; about a third of
# the ops to dispatch (each fused chain is one kernel).
TORCH_FUSED = dataclasses.replace(
    TORCH,
    name="torch+tridist",
    elementwise_traffic=MEGATRON.elementwise_traffic,
    ops_per_layer=30 * 3,
    fused_kernels=True,
    fused_loss=True,
    source="torch-native (FSDP2, DTensor, SDPA FlashAttention-2) with tridist's fused kernels",
)

ENGINES: dict[str, EngineProfile] = {e.name: e for e in (TORCH_FUSED, TORCH, MEGATRON)}
DEFAULT_ENGINE = TORCH_FUSED.name  # what `to_distributed` runs (fuse_kernels=True)


def get_engine(engine: EngineProfile | str) -> EngineProfile:
    """An engine by name ("torch+tridist", "torch", "megatron"), or the profile given."""
    if isinstance(engine, EngineProfile):
        return engine
    if engine in ENGINES:
        return ENGINES[engine]
    import difflib

    near = difflib.get_close_matches(str(engine), ENGINES, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(f"unknown engine {engine!r}{hint}; known engines: {', '.join(ENGINES)}")
