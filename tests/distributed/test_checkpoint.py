"""save_state under ZeRO-3 on 4 processes; load_state under sharding level 1 on 2 processes and on a
single process: training resumes exactly (same next loss, same parameters)."""

import pytest

from tests.distributed.harness import assert_check, launch


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoint")
    saved = launch(
        "tests.distributed.checkpoint_worker", nproc=4, out_dir=directory / "save",
        extra_env={"CHECKPOINT_PHASE": "save", "CHECKPOINT_DIR": str(directory)},
    )
    assert_check(saved, "check_save_then_continue", nproc=4)
    return directory


@pytest.mark.parametrize("nproc", [2, 1], ids=["2-processes-level-1", "single-process"])
def test_load_under_another_layout(checkpoint_dir, nproc):
    results = launch(
        "tests.distributed.checkpoint_worker", nproc=nproc, out_dir=checkpoint_dir / f"load{nproc}",
        extra_env={"CHECKPOINT_PHASE": "load", "CHECKPOINT_DIR": str(checkpoint_dir)},
    )
    assert_check(results, "check_load_under_another_layout_and_continue", nproc=nproc)
    assert_check(results, "check_missing_checkpoint_is_a_clear_error", nproc=nproc)
