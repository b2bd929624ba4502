"""Correctness criteria for the fused ops, shared by the tests and `tridist check kernels`.

Tolerances are justified by the reference's own error.

A fused kernel computes in fp32 and rounds once; the eager reference rounds after every op in the
input dtype. So we compare both against a "gold" result (the reference on fp64 copies of the inputs)
and require ours to be at most FACTOR times as far from gold as the low-precision reference is
(flash-attention's criterion), plus one unit in the last place of the dtype at the result's
magnitude: Triton's interpreter truncates fp32 -> bf16 instead of rounding to nearest, which costs up
to one extra ulp (compiled Triton on a GPU rounds to nearest even).
"""

from __future__ import annotations

import torch

FACTOR = 2.0


def upcast(t):
    if t is None or not torch.is_tensor(t) or not t.is_floating_point():
        return t
    return t.detach().double().requires_grad_(t.requires_grad)


def compare_with_reference(ours, reference, gold, *, factor: float = FACTOR) -> dict:
    """Errors of `ours` and of the low-precision `reference` against fp64 `gold`, and the verdict."""
    gold = gold.double()
    err_ours = (ours.double() - gold).abs().max().item() if ours.numel() else 0.0
    err_ref = (reference.double() - gold).abs().max().item() if ours.numel() else 0.0
    ulp = torch.finfo(ours.dtype).eps * max(1.0, gold.abs().max().item() if gold.numel() else 1.0)
    finite = bool(torch.isfinite(ours).all())
    return {
        "error": err_ours,
        "reference_error": err_ref,
        "allowed": factor * err_ref + ulp,
        "ok": finite and ours.dtype == reference.dtype and err_ours <= factor * err_ref + ulp,
    }


def assert_matches_reference(ours, reference, gold, *, name: str, factor: float = FACTOR):
    assert ours.shape == reference.shape == gold.shape, (name, ours.shape, reference.shape, gold.shape)
    assert ours.dtype == reference.dtype, f"{name}: dtype {ours.dtype} != reference {reference.dtype}"
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    result = compare_with_reference(ours, reference, gold, factor=factor)
    assert result["ok"], (
        f"{name}: max error vs fp64 gold {result['error']:.3g} > {factor} x reference's "
        f"{result['reference_error']:.3g} + one ulp = {result['allowed']:.3g}"
    )
