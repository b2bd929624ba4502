"""Compile every kernel variant for an H100 (sm_90) with Triton's real compiler, on a machine with no GPU.

Run as a script (without TRITON_INTERPRET, so the kernels are JIT functions). Prints one JSON line per
kernel variant: whether it compiled to a cubin, which global load/store widths its PTX uses, and its
registers per thread and spill stack (bytes of local memory per thread; `cuobjdump -res-usage` of the
cubin), from which `occupancy` derives the warps an SM holds. Integer arguments and pointers get the
16-divisibility attribute the JIT infers at a real launch for aligned buffers and hidden sizes like 4096;
unit strides are constexpr 1, as the JIT specialises them.

`python -m tests._gpu_codegen --study` prints instead the RMSNorm / add_rms_norm backward's grid of
launch configurations at hidden 4096 and 8192 (issue 23's medium shapes), with the heuristic's own marked.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

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
    result["barriers"] = len(re.findall(r"\bbar\.sync\b", ptx))  # layout conversions through shared memory, mostly
    # Instructions of the special function units (MUFU on sm_90: a quarter of an SM's lanes, 16 per clock) by
    # kind; a division `div.full` is one reciprocal. Each is one per element of the thread's tile.
    result["special"] = dict(Counter(re.findall(r"\b(ex2|lg2|rcp|rsqrt|sqrt|sin|cos|tanh|div)\.", ptx)))
    result.update(resource_usage(compiled.asm["cubin"]))
    # Global loads that come after a global store in the machine code: a load cannot move above a store the
    # compiler cannot prove apart, so each such load waits a further round trip to memory after the first.
    memory = re.findall(r"\b(LDG|STG)\.", cuobjdump("-sass", compiled.asm["cubin"]))
    result["loads_after_first_store"] = memory[memory.index("STG"):].count("LDG") if "STG" in memory else 0
    result["warps_per_sm"] = occupancy(result["registers"], num_warps)
    return result


def cuobjdump(option: str, cubin: bytes) -> str:
    """What Triton's bundled cuobjdump prints of a cubin with `option` (-res-usage, -sass)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([tool, option, file.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread and the spill stack (bytes per thread) of a cubin."""
    registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump("-res-usage", cubin)).groups()
    return {"registers": int(registers), "spill_stack_bytes": int(stack)}


def occupancy(registers: int, num_warps: int) -> int:
    """Warps an sm_90 SM holds of a kernel using `registers` per thread: 65,536 registers per SM, allocated
    per warp in units of 256, at most 64 warps and 32 programs."""
    per_warp = -(-registers * 32 // 256) * 256
    programs = min(65536 // per_warp // num_warps, 64 // num_warps, 32)
    return programs * num_warps


def backward_study():
    """The RMSNorm backward (without and with the residual's gradient, add_rms_norm's) over launch
    configurations at hidden 4096 and 8192: registers, spills and warps per SM, the heuristic's marked."""
    bwd_ptrs = {"dy_ptr": BF16, "dh_ptr": BF16, "h_ptr": BF16, "w_ptr": BF16, "rstd_ptr": FP32, "dx_ptr": BF16,
                "dw_partial_ptr": FP32}
    units = {n: 1 for n in ("dy_stride_col", "dh_stride_col", "h_stride_col", "w_stride")}
    for hidden in (4096, 8192):
        chosen = rms_norm.heuristic_config("bwd", hidden)
        for has_dh in (False, True):
            for block_n in (b for b in (2048, 4096, 8192) if b <= hidden):
                for block_m in (1, 2, 4):
                    for num_warps in (4, 8, 16):
                        # The single-pass loop plain and software-pipelined (its tiles' rows copied ahead).
                        for stages in (1, 3) if block_n >= hidden else (1,):
                            result = compile_variant(
                                f"{'add_rms_norm' if has_dh else 'rms_norm'}_bwd[H={hidden}]", rms_norm._rms_norm_bwd_kernel,
                                bwd_ptrs, {"HAS_DH": has_dh, "ROUND": 2, "SINGLE_PASS": block_n >= hidden, "COMPUTE_DW": True,
                                           "BLOCK_M": block_m, "BLOCK_N": block_n, "NUM_STAGES": stages, **units},
                                ("offset",), num_warps)
                            heuristic = (block_n, block_m, num_warps, stages) == (
                                chosen["BLOCK_N"], chosen["BLOCK_M"], chosen["num_warps"], chosen["NUM_STAGES"])
                            yield {**result, "BLOCK_N": block_n, "BLOCK_M": block_m, "num_warps": num_warps,
                                   "NUM_STAGES": stages, "heuristic": heuristic}


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
        # The single-pass backward also software-pipelined (3 stages: the next tiles' rows copied ahead).
        for stages in (1, 3) if single_pass else (1,):
            yield (
                f"rms_norm_bwd[single_pass={single_pass}{', stages=3' if stages > 1 else ''}]", rms_norm._rms_norm_bwd_kernel,
                {"dy_ptr": BF16, "dh_ptr": BF16, "h_ptr": BF16, "w_ptr": BF16, "rstd_ptr": FP32, "dx_ptr": BF16, "dw_partial_ptr": FP32},
                {"HAS_DH": True, "ROUND": 2, "SINGLE_PASS": single_pass, "COMPUTE_DW": True, "BLOCK_M": 2, "BLOCK_N": 4096,
                 "NUM_STAGES": stages, **unit("dy_stride_col", "dh_stride_col", "h_stride_col", "w_stride")},
                ("offset",), 8,
            )
    # add_rms_norm's backward in the heuristic's configurations at the single-pass widths it packs rows for
    # (rms_norm.RESIDUAL_BACKWARD_ELEMENTS_PER_THREAD).
    for hidden in (2048, 4096, 8192):
        config = rms_norm.heuristic_config("bwd", hidden, residual=True)
        yield (
            f"add_rms_norm_bwd[H={hidden}]", rms_norm._rms_norm_bwd_kernel,
            {"dy_ptr": BF16, "dh_ptr": BF16, "h_ptr": BF16, "w_ptr": BF16, "rstd_ptr": FP32, "dx_ptr": BF16, "dw_partial_ptr": FP32},
            {"HAS_DH": True, "ROUND": 2, "SINGLE_PASS": True, "COMPUTE_DW": True, "BLOCK_M": config["BLOCK_M"],
             "BLOCK_N": config["BLOCK_N"], "NUM_STAGES": config["NUM_STAGES"],
             **unit("dy_stride_col", "dh_stride_col", "h_stride_col", "w_stride")},
            ("offset",), config["num_warps"],
        )
    # Llama's 32 heads x 64 pairs (one token per tile), short heads (tiles of several tokens of 4 heads x 32 pairs),
    # Qwen's 16 heads x 64 pairs and 64 heads x 64 pairs (two tiles of 32 heads: the loop over head tiles), in the
    # tiles the launcher builds for the heuristic's configuration (rotary.heuristic_config, rotary.tokens_per_tile,
    # the plan's ONE_HEAD_TILE and BLOCK_HK), with a quarter as many key heads (grouped-query attention).
    # DeepSeek-V3's deinterleaving forward too (interleaved pairs read, halves written).
    for interleaved, deinterleave, heads, block_r in (
            (False, False, 32, 64), (True, False, 32, 64), (True, True, 32, 64), (False, False, 4, 32),
            (False, False, 16, 64), (False, False, 64, 64)):
        config = rotary.heuristic_config(block_r, heads)
        tokens, block_h = config["TOKENS_PER_PROGRAM"], config["BLOCK_H"]
        block_t = rotary.tokens_per_tile(tokens, block_h, block_r, 16)
        yield (
            f"rotary[interleaved={interleaved}{', deinterleave' if deinterleave else ''}, BLOCK_T={block_t}, "
            f"BLOCK_H={block_h}{'' if block_h >= heads else f', heads={heads}'}]",
            rotary._rotary_kernel,
            {"q_ptr": BF16, "k_ptr": BF16, "q_out_ptr": BF16, "k_out_ptr": BF16, "cos_ptr": FP32, "sin_ptr": FP32, "pos_ptr": "*i64"},
            {"HAS_POSITIONS": True, "X_INTERLEAVED": interleaved, "Y_INTERLEAVED": interleaved and not deinterleave,
             "HALF_TABLE": False, "CONJUGATE": False, "HAS_PASS": True,
             "TOKENS_PER_PROGRAM": tokens, "BLOCK_T": block_t, "BLOCK_H": block_h, "BLOCK_R": block_r, "BLOCK_P": 16,
             "ONE_HEAD_TILE": block_h >= heads, "BLOCK_HK": min(block_h, max(1, heads // 4)),
             **unit("q_stride_d", "k_stride_d", "qo_stride_d", "ko_stride_d", "table_stride_d")},
            (), 4,
        )
    unit_cols = lambda *names: unit(*(f"{n}_stride_col" for n in names))  # noqa: E731
    # SwiGLU's rows addressed by their strides (a packed [gate | up] input's halves), and dense inputs as one run
    # (a projection's outputs: FLAT; EVEN where the tiles divide it, as 4 x 1024 tiles divide 16,384 x 11,008);
    # GeGLU's two gelus (ACTIVATION 1: the tanh approximation, as Gemma's; 2: exact, erf) on the flat run.
    for label, flat, activation in (("swiglu", False, 0), ("swiglu_flat", True, 0), ("geglu_tanh_flat", True, 1),
                                    ("geglu_flat", True, 2)):
        addressing = {"FLAT": flat, "EVEN": flat, "WIDE": False, "ACTIVATION": activation}
        yield (f"{label}_fwd", swiglu._swiglu_fwd_kernel, {"gate_ptr": BF16, "up_ptr": BF16, "out_ptr": BF16},
               {"BLOCK_M": 4, "BLOCK_N": 1024, **addressing, **unit_cols("gate", "up")}, (), 4)
        yield (f"{label}_bwd", swiglu._swiglu_bwd_kernel,
               {n: BF16 for n in ("grad_ptr", "gate_ptr", "up_ptr", "dgate_ptr", "dup_ptr")},
               {"BLOCK_M": 4, "BLOCK_N": 1024, **addressing, **unit_cols("grad", "gate", "up", "dgate", "dup")}, (), 4)


if __name__ == "__main__":
    if "--study" in sys.argv:
        for row in backward_study():
            print(json.dumps({k: v for k, v in row.items() if k not in ("loads", "stores")}), flush=True)
    else:
        for label, fn, pointers, constexprs, floats, num_warps in variants():
            print(json.dumps(compile_variant(label, fn, pointers, constexprs, floats, num_warps)))
    sys.stdout.flush()
