"""The session's merged launches: one world per world size (8, 4, 2, then 1 processes), all forked from one
process that imported their modules once (harness.launch_merged, forked_launch.py), runs the checks of every
worker module whose test module declares it (MERGED = {worker module: {world size: its checks, or None for
all}}): see merged_worker.py. Only the test modules collected are launched, so running one test file still
runs only its own checks. The larger worlds go first: a smaller world may read what a larger one wrote in the
session's scratch directory (TRIDIST_SCRATCH: checkpoints saved on 4 processes, loaded on 2 and on 1)."""

import pytest


@pytest.fixture(scope="session")
def merged_launches(request, tmp_path_factory) -> dict:
    """{world size: that launch's results}; read one module's with harness.module_results."""
    from tests.distributed.harness import launch_merged  # here: xdist's controller loads this file too (torch)

    by_world: dict[int, dict] = {}
    for item in request.session.items:
        for worker, worlds in getattr(item.module, "MERGED", {}).items():
            for nproc, checks in worlds.items():
                by_world.setdefault(nproc, {})[worker] = None if checks is None else list(checks)
    return launch_merged(by_world, out_root=tmp_path_factory.mktemp("merged"), scratch=tmp_path_factory.mktemp("scratch"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    # Under pytest-xdist (--dist loadgroup) every test of the merged launches runs on one worker, which
    # launches them once; each other launch (its own module fixture) keeps its module together. tryfirst:
    # xdist's own hook (no order of its own) turns the xdist_group marker into the group, and pluggy may
    # call it before this conftest's; harness.launch fails a launch started twice in one run.
    for item in items:
        if "merged_launches" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("merged launches"))
        elif item.module.__name__.startswith("tests.distributed."):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
