"""pytest-benchmark over the kernel benchmark's case grid: one test per (case, variant, mode).

    pytest bench/suites --benchmark-only                       # CUDA shapes on a GPU, quick CPU shapes otherwise
    pytest bench/suites --benchmark-only -k "rms_norm and tridist" --benchmark-json=kernels.json

Same cases, inputs, correctness check and timed closures as `tridist bench kernels` (bench/kernels.py);
pytest-benchmark adds its statistics, comparisons between saved runs (--benchmark-compare) and JSON.
Each timed round ends with torch.cuda.synchronize(), so a round is the kernel's time plus the launch
and sync overhead: use `tridist bench kernels` (CUDA events) for bandwidth figures.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from tridist.bench import kernels as kb

DEVICE = kb.resolve_device()
ON_CUDA = DEVICE.type == "cuda"
CASES = kb.default_cases(device_type=DEVICE.type, quick=not ON_CUDA)
# Rounds of one call each: enough for a stable median; the CPU set is a smoke run.
ROUNDS, WARMUP_ROUNDS = (100, 10) if ON_CUDA else (20, 3)

PARAMS = [
    pytest.param(case, variant, mode, id=f"{case.op}-{case.shape.replace(' ', '_')}-{case.dtype}-{variant}-{mode}")
    for case in CASES for variant, mode in itertools.product(kb.VARIANTS, kb.modes_for(case))
]


@functools.lru_cache(maxsize=1)  # tests of one case run back to back; keep one case's reference alive
def _expected(case: kb.Case) -> kb.Expected:
    return kb.reference_results(case, DEVICE)


@pytest.fixture(scope="module", autouse=True)
def _benchmark_settings():
    with kb.benchmark_settings(DEVICE):
        yield


def _sync() -> None:
    if ON_CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("case, variant, mode", PARAMS)
def test_kernel(benchmark, case: kb.Case, variant: str, mode: str):
    try:
        fn = kb.build_variant(case.op, variant, device=DEVICE)
    except kb.VariantUnavailable as exc:
        pytest.skip(str(exc))
    error = kb.check_variant(fn, case, DEVICE, _expected(case))
    assert not error, f"{variant} {case.op} {case.shape}: {error}"

    inputs = kb.make_inputs(case, DEVICE, requires_grad=mode != "fwd")
    timed = kb.make_timed_fn(fn, inputs, mode)

    def setup():
        _sync()

    def run():
        timed()
        _sync()

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    nbytes = kb.bytes_moved(case, mode)
    benchmark.extra_info.update(op=case.op, shape=case.shape, dtype=case.dtype, variant=variant, mode=mode,
                                bytes=nbytes)
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["gbps"] = nbytes / benchmark.stats.stats.median / 1e9
