"""save_state under one layout, load_state under another: ZeRO-3 on 4 processes, or dp2 x mp2 tensor
parallel on 4 processes; resumed under sharding level 1 on 2 processes and on a single process: every
parameter and optimizer state resumes bit for bit, and the next step equals the saving run's within
rounding (tests/distributed/equivalence.py). Packed projections (split per part) and a
vocabulary-parallel LM head saved under dp2 x mp2 resume under mp4 and on a single process as an
uninterrupted single-process run."""

import pytest

from tests.distributed.harness import assert_check, launch


def _save(tmp_path_factory, layout: str):
    directory = tmp_path_factory.mktemp(f"checkpoint-{layout}")
    env = {"CHECKPOINT_DIR": str(directory), "CHECKPOINT_LAYOUT": layout}
    results = launch("tests.distributed.checkpoint_worker", nproc=4, out_dir=directory / "save",
                     extra_env={**env, "CHECKPOINT_PHASE": "save"})
    assert_check(results, "check_save_then_continue", nproc=4)
    return directory, env


@pytest.fixture(scope="module", params=["zero3", "tensor-parallel"])
def saved(request, tmp_path_factory):
    return _save(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def saved_packed(tmp_path_factory):
    return _save(tmp_path_factory, "packed-tensor-parallel")


def _load(saved, nproc: int) -> None:
    directory, env = saved
    results = launch("tests.distributed.checkpoint_worker", nproc=nproc, out_dir=directory / f"load{nproc}",
                     extra_env={**env, "CHECKPOINT_PHASE": "load"})
    assert_check(results, "check_load_under_another_layout_and_continue", nproc=nproc)
    assert_check(results, "check_missing_checkpoint_is_a_clear_error", nproc=nproc)


@pytest.mark.parametrize("nproc", [2, 1], ids=["2-processes-level-1", "single-process"])
def test_load_under_another_layout(saved, nproc):
    _load(saved, nproc)


@pytest.mark.parametrize("nproc", [4, 1], ids=["mp4", "single-process"])
def test_packed_tensor_parallel_loads_under_another_degree(saved_packed, nproc):
    _load(saved_packed, nproc)
