"""save_state under one layout, load_state under another: ZeRO-3 on 4 processes, or dp2 x mp2 tensor
parallel on 4 processes; resumed under sharding level 1 on 2 processes and on a single process:
training continues exactly (same next loss, same parameters)."""

import pytest

from tests.distributed.harness import assert_check, launch


@pytest.fixture(scope="module", params=["zero3", "tensor-parallel"])
def saved(request, tmp_path_factory):
    layout = request.param
    directory = tmp_path_factory.mktemp(f"checkpoint-{layout}")
    env = {"CHECKPOINT_DIR": str(directory), "CHECKPOINT_LAYOUT": layout}
    results = launch("tests.distributed.checkpoint_worker", nproc=4, out_dir=directory / "save",
                     extra_env={**env, "CHECKPOINT_PHASE": "save"})
    assert_check(results, "check_save_then_continue", nproc=4)
    return directory, env


@pytest.mark.parametrize("nproc", [2, 1], ids=["2-processes-level-1", "single-process"])
def test_load_under_another_layout(saved, nproc):
    directory, env = saved
    results = launch("tests.distributed.checkpoint_worker", nproc=nproc, out_dir=directory / f"load{nproc}",
                     extra_env={**env, "CHECKPOINT_PHASE": "load"})
    assert_check(results, "check_load_under_another_layout_and_continue", nproc=nproc)
    assert_check(results, "check_missing_checkpoint_is_a_clear_error", nproc=nproc)
