"""The forked launch (forked_launch.py, harness.launch_forked) that runs the merged checks: each worker gets
torchrun's variables for its rank, ends through a normal interpreter exit (a crash there is the launch's
failure, as under torchrun), a failed worker's peers are ended instead of waiting for the timeout, and a
module that starts a thread before the fork is refused. The workers are launch_probe_worker.py: no torch."""

import json
import time

import pytest

from tests.distributed.harness import Phase, assert_check, launch_forked

PROBE = "tests.distributed.launch_probe_worker"


def _launch(tmp_path, *actions: dict, timeout_s: float = 60, env=None) -> list[dict]:
    phases = [Phase(2, PROBE, tmp_path / f"phase{i}", {"TRIDIST_PROBE": json.dumps(a), **(env or {})})
              for i, a in enumerate(actions)]
    return launch_forked(phases, timeout_s=timeout_s)


def test_workers_get_their_ranks_and_exit_through_the_interpreter(tmp_path):
    first, second = _launch(tmp_path, {}, {})
    for results in (first, second):
        assert_check(results, "check_probe", nproc=2)
    environments = [second["check_probe"][rank]["environment"] for rank in range(2)]
    assert [e["RANK"] for e in environments] == [e["LOCAL_RANK"] for e in environments] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in environments} == {e["LOCAL_WORLD_SIZE"] for e in environments} == {"2"}
    assert len({e["MASTER_PORT"] for e in environments}) == 1 and environments[0]["GROUP_RANK"] == "0"
    assert environments[0]["TORCHELASTIC_RUN_ID"] != first["check_probe"][0]["environment"]["TORCHELASTIC_RUN_ID"]
    assert all((tmp_path / f"phase{p}" / f"exited{r}").exists() for p in range(2) for r in range(2))  # atexit ran


def test_a_crash_at_exit_after_every_result_fails_the_launch(tmp_path):
    (results,) = _launch(tmp_path, {"1": "abort_at_exit"})
    assert set(results["check_probe"]) == {0, 1}  # both wrote their result
    assert "worker rank 1 was killed by SIGABRT" in results["__launch__"]["failure"]
    with pytest.raises(AssertionError, match="the launch ended badly"):
        assert_check(results, "check_probe", nproc=2)


def test_a_failed_worker_ends_its_peers_and_the_later_phases_still_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIDIST_LAUNCH_GRACE_S", "1")
    start = time.monotonic()
    failed, after = _launch(tmp_path, {"0": "raise", "1": "wait"}, {})
    assert time.monotonic() - start < 30  # not the 600 s rank 1 would sleep
    failure = failed["__launch__"]["failure"]
    assert "worker rank 0 exited 1" in failure and "rank 0 failed as asked" in failure, failure  # its traceback
    assert "worker rank 1 was killed by SIGKILL" in failure, failure
    assert_check(after, "check_probe", nproc=2)


def test_a_timeout_kills_every_worker_and_names_the_unfinished_phases(tmp_path):
    (results,) = _launch(tmp_path, {"0": "wait", "1": "wait"}, timeout_s=3)
    assert results["__launch__"]["failure"].startswith("timed out after 3s"), results["__launch__"]["failure"]
    assert not list(tmp_path.glob("phase0/exited*"))  # killed, not ended


def test_a_module_that_starts_a_thread_is_refused_before_any_fork(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIDIST_PROBE_THREAD", "1")  # the launcher's own environment: it imports the module
    (results,) = _launch(tmp_path, {}, env={"TRIDIST_MERGED": json.dumps({"launch_probe_worker": None})})
    failure = results["__launch__"]["failure"]
    assert "the launcher exited 1 before this phase ended" in failure and "started threads" in failure, failure
    assert not list(tmp_path.glob("phase0/rank*"))
