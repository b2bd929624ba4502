"""Start the suite's merged launches by forking one process that has already imported everything.

A torchrun launch starts each worker as a fresh interpreter: on a 2-core machine every one of them spends
~10 CPU-seconds importing torch, transformers and tridist (and ~4 more on transformers' modeling code at its
first model), which is most of what the small launches cost. Here one parent imports the worker modules
once (with the collector paused), freezes what they left, and for each phase (a world size) forks that many
workers with the variables torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT,
TORCHELASTIC_RUN_ID, ...). Each worker then runs its module as `python -m` would (runpy, as __main__) and
ends as any interpreter does (sys.exit: atexit handlers, module teardown, C++ destructors), so a crash at
exit still shows in its exit status. torchrun itself stays under test where it is the subject: the
multinode launch (agents meeting at a c10d rendezvous) and the README's demo.

Usage: python -m tests.distributed.forked_launch PHASES_JSON, a list of
{"nproc": n, "module": "tests.distributed...", "out_dir": path, "env": {...}}, run in order. A phase writes
launch.json in its out_dir ({"exit": {rank: status}}: 0, an exit code, or minus the signal that killed it)
and each rank's stdout and stderr to rank<r>.log there. Like torchrun, the parent ends a phase's remaining
workers once one of them fails (they would wait in a collective for the failed one until the timeout).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
from pathlib import Path

# Modules the workers import lazily (at their first model, their first pipeline), by the package they come
# from: imported here, once, where the workers' modules imported that package (transformers' modeling_utils
# alone costs ~3 CPU-seconds: it imports torch._dynamo).
PRELOAD = {"transformers": "transformers.modeling_utils", "tridist.distcore": "tridist.distcore.pipeline"}

# After a worker fails, how long the others get to notice (a collective with the failed peer errors out)
# before they are killed (TRIDIST_LAUNCH_GRACE_S: a test's shorter wait).
GRACE_S = 10


def free_port() -> int:
    """A TCP port free on this machine now (the rendezvous of a world; harness.launch's nodes too)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _import_everything(phases: list[dict]) -> None:
    """The worker modules a merged phase names (TRIDIST_MERGED), and what they import lazily. The phase's own
    module is left to each worker's runpy (as __main__, it runs afresh anyway; merged_worker.py is a few lines)."""
    for phase in phases:
        for module in json.loads(phase["env"].get("TRIDIST_MERGED", "{}")):
            importlib.import_module(f"tests.distributed.{module}")
    for package, module in PRELOAD.items():
        if package in sys.modules:
            importlib.import_module(module)
    if "torch._dynamo" in sys.modules:
        _warm_up_compile()
    # Forking a process with more than one thread copies only the forking thread: a lock another thread
    # held stays locked in the children forever.
    threads = threading.enumerate()
    if len(threads) > 1:
        raise RuntimeError(f"forked_launch: the imports started threads {[t.name for t in threads]}; forking "
                           "now could deadlock the workers. Import that module lazily or launch with torchrun.")


def _warm_up_compile() -> None:
    """One torch.compile of a tiny function (forward and backward, the suite's aot_eager backend): its first call
    in a process imports ~550 more modules and fills Dynamo's and AOTAutograd's lookup tables (1.6 CPU-seconds
    after the imports above), which every worker of a world that compiles would otherwise repeat. Dynamo's caches
    are reset after it: the workers start with none of its compiled code. torch.fx's interpreter opens a (disabled)
    tqdm bar, whose first one starts tqdm's monitor thread: ended here, before any fork (a worker's own first bar
    starts its own)."""
    import torch
    import tqdm

    x = torch.ones(2, requires_grad=True)
    torch.compile(lambda t: (t * 2).sin().sum(), backend="aot_eager")(x).backward()
    torch._dynamo.reset()
    if tqdm.tqdm.monitor is not None:
        tqdm.tqdm.monitor.exit()  # sets its event and joins it
        tqdm.tqdm.monitor = None


def _worker(phase: dict, rank: int, port: int, run_id: str) -> None:
    """In the forked child: become rank `rank` of the phase's world and run its module as __main__. Never
    returns: the interpreter exits (normally, finalising) with the module's status."""
    nproc, out_dir = phase["nproc"], Path(phase["out_dir"])
    os.environ.update(phase["env"])
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
    })
    log = os.open(out_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.argv = [phase["module"], str(out_dir)]
    status = 0
    try:
        runpy.run_module(phase["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        status = exit_.code
    except BaseException:  # noqa: BLE001 - reported as the worker's failure
        import traceback

        traceback.print_exc()
        status = 1
    sys.exit(status)  # up through the parent's frames (none holds a finally) to a normal interpreter exit


def _status(wait_status: int) -> int:
    return -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def _run_phase(phase: dict, index: int) -> bool:
    port, run_id = free_port(), f"forked-{os.getpid()}-{index}"
    Path(phase["out_dir"]).mkdir(parents=True, exist_ok=True)  # where the workers log and report
    ranks = {}
    for rank in range(phase["nproc"]):
        pid = os.fork()
        if pid == 0:
            _worker(phase, rank, port, run_id)
        ranks[pid] = rank
    statuses: dict[int, int] = {}
    kill_at = None  # once a worker failed: when its peers still running are killed
    while len(statuses) < len(ranks):
        pid, wait_status = os.waitpid(-1, os.WNOHANG if kill_at else 0)
        if pid == 0:  # none ended since the last look
            if time.monotonic() > kill_at:
                for other in (pid for pid, rank in ranks.items() if rank not in statuses):
                    os.kill(other, signal.SIGKILL)  # not reaped yet, so still ours to signal
            time.sleep(0.1)
            continue
        statuses[ranks[pid]] = _status(wait_status)
        if statuses[ranks[pid]] != 0 and kill_at is None:
            kill_at = time.monotonic() + float(os.environ.get("TRIDIST_LAUNCH_GRACE_S", GRACE_S))
    (Path(phase["out_dir"]) / "launch.json").write_text(json.dumps({"exit": statuses}))
    return all(status == 0 for status in statuses.values())


def main() -> int:
    phases = json.loads(sys.argv[1])
    gc.disable()  # the imports make no garbage worth a collection (tests/distributed/__init__.py)
    _import_everything(phases)
    gc.collect()
    gc.freeze()  # the workers inherit it: their collections skip the imports, whose pages stay shared
    ok = True
    for index, phase in enumerate(phases):
        ok = _run_phase(phase, index) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
