"""Correctness criteria for the fused ops, shared by the tests and `tridist check kernels`.

Tolerances are justified by the reference's own error.

A fused kernel computes in fp32 and rounds once; the eager reference rounds after every op in the
input dtype. So we compare both against a "gold" result (the reference on fp64 copies of the inputs)
and require ours to be at most FACTOR times as far from gold as the low-precision reference is
(flash-attention's criterion), plus one unit in the last place of the dtype at the result's
magnitude: Triton's interpreter truncates fp32 -> bf16 instead of rounding to nearest, which costs up
to one extra ulp (compiled Triton on a GPU rounds to nearest even).

That criterion cannot see a kernel that is *more* accurate than eager by breaking the documented
semantics (a skipped rounding, a second rounding in the input dtype that eager also does). Where the
semantics promise fp32 computation rounded once, `assert_rounded_once` checks exactly that, within a
stated fp32 error bound, to nearest or, where the device converts that way, toward zero.
"""

from __future__ import annotations

import functools

import torch

from . import _common

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


# --------------------------------------------------------------------------- rounding-aware criteria
#
# The criterion above accepts anything at least as accurate as eager, so it cannot see a kernel that
# skips a documented rounding or rounds twice (computes in the input dtype): both stay within eager's
# error. Where the semantics promise "computed in fp32, rounded once", the checks below test exactly
# that: the result is the exact value, up to a stated fp32 error bound, rounded once to its dtype.


def spacing(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gap between consecutive `dtype` values at `magnitude` (fp64, >= 0): one ulp there."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(magnitude.double().clamp_min(info.smallest_normal))  # m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.full_like(magnitude, info.eps, dtype=torch.float64), exponent - 1)


def converts_toward_zero(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused ops' fp32 -> `dtype` conversions truncate for tensors on `device` in this process.

    PyTorch and compiled Triton round to nearest even; Triton's CPU interpreter truncates to bf16. Asked
    of Triton itself (one conversion) rather than assumed, so a Triton that changes this still passes.
    """
    device = torch.device(device)
    if dtype == torch.float32 or not _common.use_triton(torch.empty(0, device=device)):
        return False
    return _triton_truncates(device.type, dtype)


@functools.lru_cache(maxsize=None)
def _triton_truncates(device_type: str, dtype: torch.dtype) -> bool:
    import triton
    import triton.language as tl

    @triton.jit
    def convert(src, dst):
        tl.store(dst, tl.load(src).to(dst.dtype.element_ty))

    # 1 + 0.75 ulp: rounding to nearest gives 1 + ulp, truncation gives 1.
    src = torch.tensor([1.0 + 0.75 * torch.finfo(dtype).eps], device=device_type)
    dst = torch.empty(1, dtype=dtype, device=device_type)
    convert[(1,)](src, dst)
    return dst.item() == 1.0


def round_to(t: torch.Tensor, dtype: torch.dtype, *, toward_zero: bool = False) -> torch.Tensor:
    """fp32 `t` converted to `dtype` to nearest even, or by truncation (see converts_toward_zero)."""
    if toward_zero and dtype != torch.float32:
        assert dtype == torch.bfloat16, "only the bf16 conversion is known to truncate"
        return (t.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact: low bits zero
    return t.to(dtype)


def assert_rounded_once(ours, exact, *, bound, toward_zero: bool = False, name: str):
    """`ours` is `exact` (fp64) computed with an error of at most `bound` (elementwise, fp64; the fp32
    arithmetic's) and then rounded once to ours.dtype: to nearest (half a spacing) or, where the device
    converts that way, toward zero (less than a spacing, never away from zero)."""
    assert ours.shape == exact.shape, (name, ours.shape, exact.shape)
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    exact = exact.detach().double()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(exact)
    gap = spacing(exact.abs() + bound, ours.dtype)
    if toward_zero:
        below = torch.where(exact >= 0, bound + gap, bound)
        above = torch.where(exact >= 0, bound, bound + gap)
    else:
        below = above = bound + gap / 2
    error = ours.detach().double() - exact
    bad = (error < -below) | (error > above)
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} elements are not the exact value rounded once to "
            f"{ours.dtype} ({'toward zero' if toward_zero else 'to nearest'}); e.g. at {i}: {ours[tuple(i)].item()!r}, "
            f"exact {exact[tuple(i)].item()!r}, fp32 error bound {bound[tuple(i)].item():.3g}"
        )
