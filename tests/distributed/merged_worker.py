"""Several worker modules' checks in one world: its processes start and join the process group once instead of
once per module (harness.launch_merged forks them from one process that imported the modules once:
forked_launch.py; on a 2-core machine starting a 4-process torchrun launch cost tens of CPU-seconds before
its first check). Which modules, and which of their checks, come in the environment
(TRIDIST_MERGED: {"data_worker": null, "overlap_worker": ["check_a", ...]}, null for all); each result is
named "<module>.<check>" (harness.module_results reads one module's back)."""

from __future__ import annotations

import importlib
import json
import os

from tridist import distcore
from tests.distributed.harness import run_checks

if __name__ == "__main__":
    checks = {}
    for module_name, only in json.loads(os.environ["TRIDIST_MERGED"]).items():
        module = importlib.import_module(f"tests.distributed.{module_name}")
        checks.update({f"{module_name}.{name}": fn for name, fn in module.CHECKS.items() if only is None or name in only})
    distcore.init_parallel_env()
    run_checks(checks)  # ends the process group
