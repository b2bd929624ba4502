"""A worker for test_forked_launch.py, light enough to start in milliseconds (no torch). What each rank does
comes in TRIDIST_PROBE ({rank: action}; "ok" for the others): "ok" writes its result line, the process
environment it was given included; "raise" raises; "abort_at_exit" writes its result, then aborts in an
atexit handler (a crash at interpreter exit, after every result, as gloo's teardown can); "wait" sleeps until
it is killed. Every rank that reaches its interpreter's teardown leaves a file saying so (exited<rank>)."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path

if os.environ.get("TRIDIST_PROBE_THREAD"):  # a module that starts a thread when imported
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()

ENVIRONMENT = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "TRIDIST_PROBE"]

if __name__ == "__main__":
    out_dir, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    action = json.loads(os.environ.get("TRIDIST_PROBE", "{}")).get(str(rank), "ok")
    atexit.register(lambda: (out_dir / f"exited{rank}").touch())
    if action == "abort_at_exit":
        atexit.register(os.abort)  # runs first: last registered
    if action == "raise":
        raise RuntimeError(f"rank {rank} failed as asked")
    if action == "wait":
        time.sleep(600)
    record = {"check": "check_probe", "status": "ok", "environment": {name: os.environ.get(name) for name in ENVIRONMENT}}
    with (out_dir / f"rank{rank}.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
