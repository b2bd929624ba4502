"""Compile every kernel variant for an H100 (sm_90) with Triton's real compiler, on a machine with no GPU.

Run as a script (without TRITON_INTERPRET, so the kernels are JIT functions). Prints one JSON line per
kernel variant: whether it compiled to a cubin and which global load/store widths its PTX uses.
Integer arguments and pointers get the 16-divisibility attribute the JIT infers at a real launch for
aligned buffers and hidden sizes like 4096; unit strides are constexpr 1, as the JIT specialises them.
"""

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tridist.kernels.ops import rms_norm, rotary, swiglu

BF16, FP32 = "*bf16", "*fp32"


def compile_variant(label, fn, pointers, constexprs, floats=(), num_warps=4):
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name) or ("fp32" if name in floats else "i32")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name] not in ("constexpr", "fp32")
    }
    result = {"kernel": label}
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps},
        )
    except Exception as error:  # reported, and asserted on by the test
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        return result
    ptx = compiled.asm["ptx"]
    result["cubin_bytes"] = len(compiled.asm["cubin"])
    result["loads"] = sorted(set(re.findall(r"ld\.global(?:\.[a-z0-9]+)*", ptx)))
    result["stores"] = sorted(set(re.findall(r"st\.global(?:\.[a-z0-9]+)*", ptx)))
    return result


def variants():
    unit = lambda *names: {n: 1 for n in names}  # noqa: E731
    rms_ptrs = {"x_ptr": BF16, "res_ptr": BF16, "w_ptr": BF16, "y_ptr": BF16, "h_ptr": BF16, "rstd_ptr": FP32}
    for single_pass in (True, False):
        for residual in (True, False):
            yield (
                f"rms_norm_fwd[single_pass={single_pass},residual={residual}]", rms_norm._rms_norm_fwd_kernel, rms_ptrs,
                {"HAS_RESIDUAL": residual, "ROUND": 1, "SINGLE_PASS": single_pass, "BLOCK_M": 1, "BLOCK_N": 4096,
                 **unit("x_stride_col", "res_stride_col", "w_stride")},
                ("eps", "offset"), 8,
            )
        yield (
            f"rms_norm_bwd[single_pass={single_pass}]", rms_norm._rms_norm_bwd_kernel,
            {"dy_ptr": BF16, "dh_ptr": BF16, "h_ptr": BF16, "w_ptr": BF16, "rstd_ptr": FP32, "dx_ptr": BF16, "dw_partial_ptr": FP32},
            {"HAS_DH": True, "ROUND": 2, "SINGLE_PASS": single_pass, "COMPUTE_DW": True, "BLOCK_M": 2, "BLOCK_N": 4096,
             **unit("dy_stride_col", "dh_stride_col", "h_stride_col", "w_stride")},
            ("offset",), 8,
        )
    # Llama's 32 heads x 64 pairs (one token per tile), and short heads: 16 tokens per tile of 4 heads x 32 pairs
    # (the tile the launcher builds for them: rotary.tokens_per_tile).
    for interleaved, tokens, block_h, block_r in ((False, 1, 32, 64), (True, 1, 32, 64), (False, 16, 4, 32)):
        block_t = rotary.tokens_per_tile(tokens, block_h, block_r, 16)
        yield (
            f"rotary[interleaved={interleaved}, BLOCK_T={block_t}]", rotary._rotary_kernel,
            {"q_ptr": BF16, "k_ptr": BF16, "q_out_ptr": BF16, "k_out_ptr": BF16, "cos_ptr": FP32, "sin_ptr": FP32, "pos_ptr": "*i64"},
            {"HAS_POSITIONS": True, "INTERLEAVED": interleaved, "HALF_TABLE": False, "CONJUGATE": False, "HAS_PASS": True,
             "TOKENS_PER_PROGRAM": tokens, "BLOCK_T": block_t, "BLOCK_H": block_h, "BLOCK_R": block_r, "BLOCK_P": 16,
             **unit("q_stride_d", "k_stride_d", "qo_stride_d", "ko_stride_d", "table_stride_d")},
            (), 4,
        )
    unit_cols = lambda *names: unit(*(f"{n}_stride_col" for n in names))  # noqa: E731
    yield ("swiglu_fwd", swiglu._swiglu_fwd_kernel, {"gate_ptr": BF16, "up_ptr": BF16, "out_ptr": BF16},
           {"BLOCK_M": 4, "BLOCK_N": 1024, **unit_cols("gate", "up")}, (), 4)
    yield ("swiglu_bwd", swiglu._swiglu_bwd_kernel, {n: BF16 for n in ("grad_ptr", "gate_ptr", "up_ptr", "dgate_ptr", "dup_ptr")},
           {"BLOCK_M": 4, "BLOCK_N": 1024, **unit_cols("grad", "gate", "up", "dgate", "dup")}, (), 4)


if __name__ == "__main__":
    for label, fn, pointers, constexprs, floats, num_warps in variants():
        print(json.dumps(compile_variant(label, fn, pointers, constexprs, floats, num_warps)))
    sys.stdout.flush()
