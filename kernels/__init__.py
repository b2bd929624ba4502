"""tridist.kernels: fused Triton kernels with forward and backward, as ops, functions and layers.

CUDA tensors run the Triton kernels; CPU tensors run a plain PyTorch implementation of the same math,
or the Triton kernels in Triton's interpreter when TRITON_INTERPRET=1 is set before import.
Every op is registered with torch.library (namespace `tridist`) so torch.compile captures it whole.
`all_gather_matmul` / `matmul_reduce_scatter` (comm_matmul.py) are tensor-parallel matmuls whose
collective is split into a ring of point-to-point transfers hidden behind the matmul (any backend).
`linear_cross_entropy` is an LM head's linear and the cross-entropy loss over token chunks, never
holding the [tokens, vocab] logits.
"""

from .comm_matmul import all_gather_matmul, matmul_reduce_scatter
from .fuse import FuseError, FuseReport, fuse
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.rms_norm import FusedRMSNorm, rms_norm
from .ops.rotary import FusedRotaryEmbedding, apply_rotary_pos_emb
from .ops.swiglu import FusedSwiGLU, FusedSwiGLUExperts, FusedSwiGLUMLP, geglu, swiglu

__all__ = [
    "FuseError",
    "FuseReport",
    "FusedRMSNorm",
    "FusedRotaryEmbedding",
    "FusedSwiGLU",
    "FusedSwiGLUExperts",
    "FusedSwiGLUMLP",
    "all_gather_matmul",
    "apply_rotary_pos_emb",
    "fuse",
    "geglu",
    "linear_cross_entropy",
    "matmul_reduce_scatter",
    "rms_norm",
    "swiglu",
]
