"""Run distributed checks under torchrun (gloo, CPU) once per worker module; assert them per test.

Launching processes costs seconds (each imports torch), so a worker module holds many checks: every
rank runs all of them in the same order (collectives require it) and appends each result to its own
JSON-lines file as it goes. A check that hangs is reported by name: the last one without a result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]


def launch(worker_module: str, *, nproc: int, out_dir: Path, timeout_s: float = 300, extra_env=None) -> dict:
    """torchrun `worker_module` on `nproc` local processes; returns {check: {rank: result}}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", worker_module, str(out_dir),
    ]
    try:
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        failure = None if run.returncode == 0 else f"torchrun exited {run.returncode}:\n{run.stderr[-4000:]}"
    except subprocess.TimeoutExpired as expired:
        failure = f"timed out after {timeout_s}s:\n{(expired.stderr or b'')[-4000:]!r}"
    results: dict = {}
    for path in sorted(out_dir.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            results.setdefault(record["check"], {})[rank] = record
    results["__launch__"] = {"failure": failure}
    return results


def assert_check(results: dict, name: str, *, nproc: int) -> None:
    by_rank = results.get(name, {})
    launch_failure = results["__launch__"]["failure"]
    missing = [r for r in range(nproc) if r not in by_rank]
    assert not missing, f"check {name!r} has no result on ranks {missing} (hung or crashed). {launch_failure or ''}"
    failures = {r: rec["error"] for r, rec in by_rank.items() if rec["status"] != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{e}" for r, e in sorted(failures.items()))


def run_checks(checks: dict[str, Callable[[], None]]) -> None:
    """Worker side: run every check on this rank, appending one JSON line per result."""
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    path = out_dir / f"rank{rank}.jsonl"
    for name, check in checks.items():
        try:
            check()
            record = {"check": name, "status": "ok"}
        except Exception:  # noqa: BLE001 - reported to the test
            record = {"check": name, "status": "fail", "error": traceback.format_exc()[-4000:]}
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
