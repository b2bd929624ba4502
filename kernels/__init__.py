"""tridist.kernels: fused Triton kernels with forward and backward, as ops, functions and layers.

CUDA tensors run the Triton kernels; CPU tensors run a plain PyTorch implementation of the same math,
or the Triton kernels in Triton's interpreter when TRITON_INTERPRET=1 is set before import.
Every op is registered with torch.library (namespace `tridist`) so torch.compile captures it whole.
"""

from .fuse import FuseReport, fuse
from .ops.rms_norm import FusedRMSNorm, rms_norm
from .ops.rotary import FusedRotaryEmbedding, apply_rotary_pos_emb
from .ops.swiglu import FusedSwiGLU, FusedSwiGLUMLP, swiglu

__all__ = [
    "FuseReport",
    "FusedRMSNorm",
    "FusedRotaryEmbedding",
    "FusedSwiGLU",
    "FusedSwiGLUMLP",
    "apply_rotary_pos_emb",
    "fuse",
    "rms_norm",
    "swiglu",
]
