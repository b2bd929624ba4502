"""tridist: train large transformer models in PyTorch faster and on more devices with less effort.

One import name, four subpackages (the repository keeps their folders at its root):

- `tridist.kernels`: fused Triton kernels (RMSNorm, rotary, SwiGLU), communication-overlapped
  matmuls and `fuse(model)`;
- `tridist.distcore`: PaddlePaddle's auto-parallel API on torch's DeviceMesh / DTensor / FSDP2 /
  pipelining, and `to_distributed`;
- `tridist.autotune`: the cost model of a training step and the Optuna strategy search;
- `tridist.bench`: benchmarks, reports and the `tridist` command.

`import tridist` is light: it imports neither torch nor any subpackage. The main entry points are
re-exported here and imported on first use (`tridist.fuse`, `tridist.to_distributed`, ...).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBPACKAGES = ("kernels", "distcore", "autotune", "bench")

# Convenience re-exports: public name -> the subpackage that defines it.
_ENTRY_POINTS = {
    "fuse": "kernels",
    "FuseReport": "kernels",
    "parallelize": "distcore",
    "to_distributed": "distcore",
    "ToDistributedConfig": "distcore",
    "apply_strategy": "distcore",
    "ProcessMesh": "distcore",
    "search": "autotune",
    "estimate": "autotune",
    "Strategy": "autotune",
    "ModelSpec": "autotune",
    "Cluster": "autotune",
}

__all__ = ["__version__", *_SUBPACKAGES, *_ENTRY_POINTS]


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _ENTRY_POINTS:
        value = getattr(importlib.import_module(f"{__name__}.{_ENTRY_POINTS[name]}"), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'tridist' has no attribute {name!r}; public names: {', '.join(sorted(__all__))}")


def __dir__():
    return sorted({*globals(), *__all__})
