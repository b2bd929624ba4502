"""One merged 4-process launch per session for the worker modules whose tests ask for it (MERGED_WORKER in
the test module, optionally MERGED_CHECKS): see merged_worker.py. Only the modules of the collected tests
are launched, so running one test file still runs only its own checks."""

import pytest

from tests.distributed.harness import MERGED_NPROC, launch_merged


@pytest.fixture(scope="session")
def merged_launch(request, tmp_path_factory) -> dict:
    modules = {}
    for item in request.session.items:
        worker = getattr(item.module, "MERGED_WORKER", None)
        if worker:
            checks = getattr(item.module, "MERGED_CHECKS", None)
            modules[worker] = None if checks is None else list(checks)
    return launch_merged(modules, nproc=MERGED_NPROC, out_dir=tmp_path_factory.mktemp("merged"))
