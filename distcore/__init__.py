"""tridist.distcore: PaddlePaddle's auto-parallel API for PyTorch models, on torch's own engine.

ProcessMesh / placements / shard_tensor / reshard map onto DeviceMesh and DTensor; reshard between
two meshes (pipeline stages) uses point-to-point transfers; processes are launched by torchrun.
"""

from .block_check import TensorParallelCheckError
from .api import dtensor_from_local, local_value, reshard, shard_tensor, unshard_dtensor
from .data_parallel import DataParallel
from .dataloader import ShardDataloader, shard_dataloader
from .sample_rows import MediaRows, SampleRows, sample_rows_of
from .checkpoint import full_state_dict, load_full_state_dict, load_state, save_state
from .clip import clip_grad_norm_
from .env import ParallelEnv, get_rank, get_world_size, init_parallel_env
from .lazy import LazyGuard
from .mesh import ProcessMesh, get_mesh, set_mesh
from .parallelize import parallelize
from .auto import ToDistributedConfig, apply_strategy, to_distributed
from .optimizer import ShardingStage1, ShardingStage2, ShardingStage3, shard_optimizer
from .tensor_parallel import (
    ColWiseParallel,
    DistributedNorm,
    FreshLocalOutput,
    LocalHeadWidths,
    LocalParameterRows,
    PrepareLayerInput,
    PrepareLayerOutput,
    ReplicatedColWiseParallel,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SplitGroupNorm,
    UnfusedMixerForward,
    SequenceParallelEnable,
    SequenceParallelEnd,
    SequenceSlicedRows,
    ReduceSharedOutputGradient,
    ShardHeadInput,
    ShardHeadParameters,
    ShardLocalParameters,
)
from .placements import Partial, ReduceType, Replicate, Shard, is_partial


def __getattr__(name: str):
    # SplitPoint lives with the pipeline (pipeline.py), whose torch.distributed.pipelining imports torch._dynamo
    # (~0.9 s): imported when first used, not with distcore.
    if name == "SplitPoint":
        from .pipeline import SplitPoint

        return SplitPoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ColWiseParallel",
    "DistributedNorm",
    "ReduceSharedOutputGradient",
    "SequenceSlicedRows",
    "ShardHeadParameters",
    "ShardHeadInput",
    "LocalHeadWidths",
    "FreshLocalOutput",
    "ShardLocalParameters",
    "LocalParameterRows",
    "SplitGroupNorm",
    "UnfusedMixerForward",
    "ReplicatedColWiseParallel",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "RowWiseParallel",
    "SequenceParallelBegin",
    "SequenceParallelDisable",
    "SequenceParallelEnable",
    "SequenceParallelEnd",
    "DataParallel",
    "Partial",
    "ParallelEnv",
    "LazyGuard",
    "ProcessMesh",
    "ReduceType",
    "Replicate",
    "Shard",
    "ShardDataloader",
    "ShardingStage1",
    "ShardingStage2",
    "ShardingStage3",
    "SplitPoint",
    "MediaRows",
    "SampleRows",
    "sample_rows_of",
    "TensorParallelCheckError",
    "ToDistributedConfig",
    "apply_strategy",
    "clip_grad_norm_",
    "to_distributed",
    "dtensor_from_local",
    "get_mesh",
    "get_rank",
    "get_world_size",
    "init_parallel_env",
    "is_partial",
    "full_state_dict",
    "load_full_state_dict",
    "load_state",
    "local_value",
    "parallelize",
    "reshard",
    "save_state",
    "set_mesh",
    "shard_dataloader",
    "shard_optimizer",
    "shard_tensor",
    "unshard_dtensor",
]
