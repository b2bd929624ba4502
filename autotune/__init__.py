"""Cost model and Optuna search over training strategies.

    spec = ModelSpec.from_module(model, seq_len=4096)       # or preset("llama2-70b")
    cluster = Cluster(nodes=16, devices_per_node=8, device="h100-sxm")
    result = search(spec, cluster, global_batch_size=1024)
    result.best.strategy                                     # Strategy(dp=..., tp=..., pp=..., ...)

Importing this package imports neither torch, optuna, pandas nor matplotlib: each is imported inside
the function that needs it (`ModelSpec.from_module`, `search`, `SearchResult.to_frame`, calibration).
"""

from .cost import (
    COST_MODEL_VERSION,
    Estimate,
    MemoryBreakdown,
    TimeBreakdown,
    activation_bytes_per_layer,
    all_gather_time,
    all_reduce_time,
    balanced_layout,
    estimate,
    hardware_flops_per_step,
    layer_forward_flops,
    megatron_flops_per_step,
    model_flops_per_step,
    model_state_bytes,
    p2p_time,
    pipeline_bubble_fraction,
    reduce_scatter_time,
    stage_parameters,
)
from .hardware import DEVICE_PROFILES, Cluster, DeviceProfile, get_profile, load_profile, save_profile
from .model import (PRESETS, ChannelMixer, GatedDeltaNet, LatentAttention, LightningAttention, LinearAttention, ModelSpec,
                    ModelStructure, SelectiveScan, ShortConvolution, UnrecognisedModel, preset, recognise)
from .search import (
    Candidate,
    LayoutResult,
    SearchResult,
    SearchSpace,
    default_storage,
    enumerate_layouts,
    exhaustive_search,
    heuristic_layout,
    pareto_front,
    search,
)
from .strategy import (
    RECOMPUTE_MODES,
    InvalidStrategy,
    Strategy,
    balanced_stage_layers,
    check,
    head_replicas,
    kv_head_replicas,
    rank_layers,
    stage_layers,
    tensor_parallel_problems,
    validate,
)

__all__ = [
    "ChannelMixer", "GatedDeltaNet", "LatentAttention", "LightningAttention", "LinearAttention", "ModelSpec", "ModelStructure", "SelectiveScan", "ShortConvolution", "UnrecognisedModel", "PRESETS", "preset", "recognise",
    "DeviceProfile", "Cluster", "DEVICE_PROFILES", "get_profile", "load_profile", "save_profile",
    "Strategy", "InvalidStrategy", "RECOMPUTE_MODES", "validate", "check", "stage_layers", "balanced_stage_layers",
    "rank_layers", "head_replicas", "kv_head_replicas", "tensor_parallel_problems",
    "estimate", "Estimate", "TimeBreakdown", "MemoryBreakdown", "COST_MODEL_VERSION",
    "model_flops_per_step", "hardware_flops_per_step", "megatron_flops_per_step",
    "all_reduce_time", "all_gather_time", "reduce_scatter_time", "p2p_time", "pipeline_bubble_fraction",
    "activation_bytes_per_layer", "model_state_bytes", "stage_parameters", "balanced_layout",
    "layer_forward_flops",
    "search", "SearchResult", "SearchSpace", "Candidate", "LayoutResult", "exhaustive_search",
    "enumerate_layouts", "heuristic_layout", "pareto_front", "default_storage",
]
