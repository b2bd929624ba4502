"""The kernels go through Triton's real compiler for an H100 (no GPU needed) with 16-byte accesses.

The interpreter accepts programs the compiler rejects (and the reverse), so this catches compile-only
errors in CI; the access widths are what memory-bound kernels need to approach the bandwidth limit.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests._gpu_codegen"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    if run.returncode != 0 and "ptxas" in run.stderr:
        pytest.skip(f"Triton's bundled ptxas is unavailable: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return {r["kernel"]: r for r in map(json.loads, run.stdout.splitlines())}


def test_every_variant_compiles_for_sm90(compiled):
    assert len(compiled) == 24
    failures = {name: r["error"] for name, r in compiled.items() if "error" in r}
    assert not failures, failures
    assert all(r["cubin_bytes"] > 0 for r in compiled.values())


# add_rms_norm's backward at hidden 4096 and 8192 (rms_norm.RESIDUAL_BACKWARD_ELEMENTS_PER_THREAD) spills up to 48
# bytes per thread, on purpose: at 8192 that configuration took 1.510 ms on an H100 against 1.721 for the
# spill-free heuristic before it (bench/results/h100-2026-11-27b/probe); kilobytes of spills took 4-37 ms.
MEASURED_SPILL_BYTES = {"add_rms_norm_bwd[H=4096]": 48, "add_rms_norm_bwd[H=8192]": 48}


def test_no_variant_spills_registers(compiled):
    """Spilled registers go to local memory, extra traffic for a memory-bound kernel: none of the launches
    the kernels make at these shapes spills (ptxas's stack of 0 bytes) beyond what was measured to pay
    (MEASURED_SPILL_BYTES), and each keeps 8 or more warps in flight per SM."""
    spills = {name: r["spill_stack_bytes"] for name, r in compiled.items()
              if r["spill_stack_bytes"] > MEASURED_SPILL_BYTES.get(name, 0)}
    assert not spills, spills
    assert all(0 < r["registers"] <= 255 and r["warps_per_sm"] >= 8 for r in compiled.values()), {
        name: (r["registers"], r["warps_per_sm"]) for name, r in compiled.items()}


@pytest.mark.parametrize(
    "name", ["rms_norm_fwd[single_pass=True,residual=False]", "rms_norm_bwd[single_pass=True]", "rotary[interleaved=False, BLOCK_T=1, BLOCK_H=32]", "rotary[interleaved=False, BLOCK_T=8, BLOCK_H=4]",
             "rotary[interleaved=False, BLOCK_T=1, BLOCK_H=16]", "swiglu_fwd", "swiglu_bwd",
             "swiglu_flat_fwd", "swiglu_flat_bwd", "geglu_tanh_flat_fwd", "geglu_tanh_flat_bwd", "geglu_flat_fwd",
             "geglu_flat_bwd"]
)
def test_hot_accesses_are_16_byte_vectors(compiled, name):
    result = compiled[name]
    assert "ld.global.v4.b32" in result["loads"], result["loads"]
    assert "st.global.v4.b32" in result["stores"], result["stores"]


def test_rotary_tiles_of_wide_heads_hold_one_token(compiled):
    """At 16 heads x 64 pairs (Qwen's and Mistral's 128-wide heads) the heuristic's program loops over tiles of one
    token: a tile of two took 128 registers and 8 barriers on sm_90 (the table rows converted into the heads'
    layout through shared memory) and ran at 79-80% of an H100's copy bandwidth where compile reached 93%
    (bench/results/h100-2026-11-27); one token per tile takes 56 registers and no barrier
    (rotary.MULTI_TOKEN_ELEMENTS_PER_THREAD). Wider heads hold one token per tile already; their 16-20 warps per SM
    reached 95-97% of copy bandwidth there."""
    for name in ("rotary[interleaved=False, BLOCK_T=1, BLOCK_H=16]", "rotary[interleaved=False, BLOCK_T=1, BLOCK_H=32]"):
        assert compiled[name]["barriers"] == 0, (name, compiled[name]["barriers"])
        assert compiled[name]["warps_per_sm"] >= 16, (name, compiled[name]["registers"])


def test_forwards_issue_every_load_before_their_first_store(compiled):
    """A global load after a global store cannot move above it (the compiler cannot prove them apart), so it waits
    a second round trip to memory. RMSNorm's forward read the weight after the row's reduction and 1/rms's store,
    and rotary rotated q, then k (and each tile of heads after the last): two or more round trips per row or
    token, exposed where few of them share an SM. On an H200 these ran at 88-92% of copy bandwidth where
    torch.compile reached 98% (rms_norm at hidden 8,192; rotary at B=16 with 16 and 32 heads, 1.09-1.10x compile's
    time: bench/results/h200-2026-11-28). Now every load of a row, or of a token's q and k heads, is issued
    first. Only rotary's loop over tiles of heads (64 heads of 128 features: two tiles) still loads after a store,
    which shows that the count sees such loads."""
    first = [name for name in compiled if name.startswith(("rms_norm_fwd[single_pass=True", "swiglu", "geglu"))
             or (name.startswith("rotary[") and "heads=" not in name)]
    assert len(first) == 15, first
    late = {name: compiled[name]["loads_after_first_store"] for name in first if compiled[name]["loads_after_first_store"]}
    assert not late, late
    assert compiled["rotary[interleaved=False, BLOCK_T=1, BLOCK_H=32, heads=64]"]["loads_after_first_store"] > 0


def test_geglu_backward_takes_one_exp_and_one_division_per_element(compiled):
    """gelu's tanh approximation's backward needs sigmoid(z) and sigmoid(-z) to their last digit; as e = exp(-|z|)
    and 1 / (1 + e) it takes one exp and one division per element, as SwiGLU's. Two of each (sigmoid(z) and
    sigmoid(-z) apart) took 1.12x torch.compile's time on an H200, whose bandwidth leaves the backward's
    arithmetic exposed (bench/results/h200-2026-11-28); 96 registers there, 64 now. A tile of 4 x 1024 at 4 warps
    holds 32 elements per thread."""
    for name in ("swiglu_flat_bwd", "geglu_tanh_flat_bwd"):
        assert compiled[name]["special"] == {"ex2": 32, "div": 32}, (name, compiled[name]["special"])
    assert compiled["geglu_tanh_flat_bwd"]["registers"] <= compiled["swiglu_flat_bwd"]["registers"], compiled
