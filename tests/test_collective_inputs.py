"""Fused ops take the outputs of tensor parallel's functional collectives (AsyncCollectiveTensor, a
storage-less wrapper) as inputs and incoming gradients, in the Triton interpreter as on a GPU."""

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from tridist import kernels
from tridist.kernels import reference


def _async(tensor):
    return AsyncCollectiveTensor(tensor)


def test_rms_norm_swiglu_rotary_accept_async_collective_tensors():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 24, requires_grad=True)
    w = torch.rand(24, requires_grad=True)
    y = kernels.rms_norm(_async(x * 1), w)
    torch.testing.assert_close(y, reference.rms_norm_reference(x, w))
    y.backward(_async(torch.ones_like(y)))
    assert w.grad is not None  # the wrapper built here has no autograd link to x; w still gets its gradient

    a, b = torch.randn(3, 7), torch.randn(3, 7)
    torch.testing.assert_close(kernels.swiglu(_async(a), _async(b)), torch.nn.functional.silu(a) * b)

    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    expected = kernels.apply_rotary_pos_emb(q, k, cos, sin)
    got = kernels.apply_rotary_pos_emb(_async(q), _async(k), cos, sin)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
