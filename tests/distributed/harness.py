"""Run distributed checks (gloo, CPU) on several processes; assert them per test.

Starting processes costs seconds (each imports torch), so a worker module holds many checks, the modules
of one world size run together (merged_worker.py), and those worlds are forked from one process that
imported them (launch_merged, forked_launch.py); torchrun (`launch`) starts the launches that test
launching itself (simulated nodes). Every rank runs all of its checks in the same order (collectives
require it) and appends each result to its own JSON-lines file as it goes. A check that hangs is reported
by name: the last one without a result. A launch that ends badly (a worker crashed or aborted, even after
writing all its results, or a timeout) fails every test of that launch, with the exit status and the tail
of the output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from tridist.distcore.env import destroy_parallel_env
from tridist.kernels import _common
from tests import settle_garbage_collector
from tests.distributed import equivalence
from tests.distributed.forked_launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def launch(worker_module: str, *, nproc: int, out_dir: Path, nnodes: int = 1, timeout_s: float = 300, extra_env=None) -> dict:
    """torchrun `worker_module` on `nnodes` simulated nodes of `nproc` local processes each.

    Several nodes are several torchrun agents meeting at a c10d rendezvous on this machine, as
    separate machines would. Returns {check: {rank: result}}.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    _claim_once_per_run(out_dir, worker_module, nproc, nnodes, extra_env)
    # cwd=ROOT puts the repository root on the workers' sys.path (`-m tests.distributed...`); tridist
    # itself comes from the installation, and tests/__init__.py refuses the root's top-level copies.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    if nnodes == 1:
        return _results(out_dir, _run_agents([["--standalone"]], worker_module, nproc, out_dir, env, timeout_s))
    # Several nodes meet at a port found free beforehand, which another launch of the suite may take first (the
    # store then fails to bind and the other agents time out connecting to it, before any check ran: 3 of 1,737
    # tests once): such a launch is started again on another port, at most twice.
    for attempt in range(3):
        endpoint, run_id = f"127.0.0.1:{free_port()}", f"{out_dir.name}-{attempt}"
        topology = [
            [f"--nnodes={nnodes}", f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]
            for node in range(nnodes)
        ]
        failure = _run_agents(topology, worker_module, nproc, out_dir, env, timeout_s)
        if not (failure and "RendezvousConnectionError" in failure and not any(out_dir.glob("rank*.jsonl"))):
            break
    return _results(out_dir, failure)


def _run_agents(topology: list[list[str]], worker_module: str, nproc: int, out_dir: Path, env: dict,
                timeout_s: float) -> str | None:
    """Run one torchrun agent per node of `topology` (each its arguments) to the end: the failures, or None."""
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *node_args, f"--nproc-per-node={nproc}", "-m", worker_module, str(out_dir)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # its own process group: a timeout kills the workers too
        )
        for node_args in topology
    ]
    failures = []
    for agent in agents:
        try:
            _, stderr = agent.communicate(timeout=timeout_s)
            if agent.returncode != 0:
                failures.append(f"torchrun exited {agent.returncode}:\n{stderr[-4000:]}")
        except subprocess.TimeoutExpired:
            # Workers hung in a collective (one rank failed, the others wait) hold the pipes open: kill
            # the agent's group and every process under it (torchrun starts each worker in a session of
            # its own, out of that group's reach), or communicate() would wait for them forever. The
            # descendants are listed first: once the agent dies they are re-parented and unfindable.
            workers = _descendants(agent.pid)
            os.killpg(agent.pid, signal.SIGKILL)
            _kill(workers)
            failures.append(f"timed out after {timeout_s}s:\n{agent.communicate()[1][-4000:]}")
    return "\n".join(failures) or None


def _results(out_dir: Path, failure: str | None) -> dict:
    """{check: {rank: its record}} from the ranks' JSON-lines files, and the launch's failure (or None)."""
    results: dict = {}
    for path in sorted(out_dir.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            results.setdefault(record["check"], {})[rank] = record
    results["__launch__"] = {"failure": failure}
    return results


def _claim_once_per_run(out_dir: Path, worker_module: str, nproc: int, nnodes: int, extra_env) -> None:
    """Under pytest-xdist, fail a launch that another worker of the same run already started: the tests of
    one launch share an xdist_group (tests/distributed/conftest.py), so a second start means the groups
    were lost (e.g. the markers were added after xdist read them) and the suite does its costliest work twice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    # xdist gives each worker <run's basetemp>/popen-<worker>; the claims live beside them, in the run's
    # basetemp (pytest rotates it away like the rest).
    run_root = next((parent.parent for parent in out_dir.parents if parent.name == f"popen-{worker}"), None)
    if worker is None or run_root is None:
        return
    # The same launch on another worker differs only in its scratch directory (a path of its own).
    env = {name: value for name, value in (extra_env or {}).items() if name != "TRIDIST_SCRATCH"}
    key = hashlib.sha256(json.dumps([worker_module, nproc, nnodes, env], sort_keys=True).encode()).hexdigest()[:16]
    claims = run_root / "launch-claims"
    claims.mkdir(exist_ok=True)
    try:
        os.close(os.open(claims / key, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        raise RuntimeError(
            f"{worker_module} on {nnodes}x{nproc} processes was already launched by another xdist worker of "
            "this run: its tests lost their xdist_group (run with --dist loadgroup, and add the markers in a "
            "tryfirst pytest_collection_modifyitems, before xdist reads them)") from None


@dataclasses.dataclass(frozen=True)
class Phase:
    """One world of a forked launch: `nproc` workers running `module` (as `python -m module out_dir` would),
    with `env` added to their environment."""

    nproc: int
    module: str
    out_dir: Path
    env: dict = dataclasses.field(default_factory=dict)


def launch_forked(phases: list[Phase], *, timeout_s: float) -> list[dict]:
    """Run `phases` in turn, each world forked from one process that imported once the worker modules the
    phases' TRIDIST_MERGED name (forked_launch.py says why and what stays under torchrun). Returns each phase's results, as `launch`
    does: a phase whose worker failed, crashed at exit or did not finish has its `__launch__` failure."""
    spec = json.dumps([{"nproc": p.nproc, "module": p.module, "out_dir": str(p.out_dir), "env": p.env} for p in phases])
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tests.distributed.forked_launch", spec], cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # the workers are forked into its process group: a timeout kills them all
    )
    try:
        _, stderr = launcher.communicate(timeout=timeout_s)
        unfinished = f"the launcher exited {launcher.returncode} before this phase ended"
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        stderr = launcher.communicate()[1]
        unfinished = f"timed out after {timeout_s}s"
    return [_results(phase.out_dir, _phase_failure(phase, unfinished, stderr)) for phase in phases]


def _phase_failure(phase: Phase, unfinished: str, launcher_stderr: str) -> str | None:
    """None when every worker of the phase exited 0; else which did not, with the tail of its output."""
    def tail(rank: int) -> str:
        log = phase.out_dir / f"rank{rank}.log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else "(no output)"

    status_file = phase.out_dir / "launch.json"
    if not status_file.exists():
        logs = "\n".join(f"rank {rank}:\n{tail(rank)}" for rank in range(phase.nproc))
        return f"{unfinished}:\n{launcher_stderr[-3000:]}\n{logs}"
    statuses = {int(rank): status for rank, status in json.loads(status_file.read_text())["exit"].items()}
    failed = {rank: status for rank, status in sorted(statuses.items()) if status != 0}
    if not failed:
        return None
    described = {rank: f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited {status}"
                 for rank, status in failed.items()}
    return "\n".join(f"worker rank {rank} {described[rank]}:\n{tail(rank)}" for rank in failed)


def launch_merged(worlds: dict[int, dict], *, out_root: Path, scratch: Path, timeout_s: float = 1800) -> dict[int, dict]:
    """The merged launches ({world size: {worker module: its checks to run, or None for all}}), largest world
    first, each a phase of one forked launch running merged_worker.py with `scratch` as TRIDIST_SCRATCH (a
    directory the phases share); returns {world size: its results} (read one module's with `module_results`)."""
    phases = [Phase(nproc, "tests.distributed.merged_worker", out_root / f"merged{nproc}",
                    {"TRIDIST_MERGED": json.dumps(worlds[nproc]), "TRIDIST_SCRATCH": str(scratch)})
              for nproc in sorted(worlds, reverse=True)]
    for phase in phases:
        _claim_once_per_run(phase.out_dir, phase.module, phase.nproc, 1, phase.env)
    return {phase.nproc: results for phase, results in zip(phases, launch_forked(phases, timeout_s=timeout_s))}


def module_results(merged: dict, module: str) -> dict:
    """One module's part of a merged launch's results, named as its own launch would name them (the launch's
    failure, a crash or a timeout, fails every module's tests)."""
    prefix = f"{module}."
    results = {name[len(prefix):]: value for name, value in merged.items() if name.startswith(prefix)}
    results["__launch__"] = merged["__launch__"]
    return results


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children before grandchildren."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # ended while listed
    found, queue = [], [pid]
    while queue:
        children = parents.get(queue.pop(0), [])
        found += children
        queue += children
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # already gone


def assert_check(results: dict, name: str, *, nproc: int) -> None:
    by_rank = results.get(name, {})
    launch_failure = results["__launch__"]["failure"]
    missing = [r for r in range(nproc) if r not in by_rank]
    assert not missing, f"check {name!r} has no result on ranks {missing} (hung or crashed). {launch_failure or ''}"
    failures = {r: rec["error"] for r, rec in by_rank.items() if rec["status"] != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{e}" for r, e in sorted(failures.items()))
    # A process that aborts at exit (a C++ terminate in teardown) has written every result: its crash
    # is a failure of the suite all the same, and of each of its tests.
    assert launch_failure is None, f"check {name!r} passed, but the launch ended badly: {launch_failure}"


def interprets_kernels(check: Callable[[], None]) -> Callable[[], None]:
    """Marks a check whose subject is the fused Triton kernels themselves (on local shards, in pipeline
    stages, beside FSDP2): where the launch has TRITON_INTERPRET=1 (the suite's default, tests/conftest.py)
    it runs them in Triton's interpreter. Every other check runs the kernels' CPU path: the same fused
    modules, autograd Functions and DTensor handling, with the kernels' math in PyTorch (kernels/_common.py
    `use_triton`). Interpreting the kernels in every training step costs ~10x (to_distributed's searched
    strategy: 13.5 s against 1.4 s on 4 processes) and checks no more of distcore; the kernels themselves
    are checked against their references in tests/test_*.py, under the interpreter."""
    check.interprets_kernels = True
    return check


def raises(kind, fragments, call) -> str:
    """The message of the `kind` error `call()` raises, asserted to contain each of `fragments` (a refusal's cause and
    fix); an AssertionError if it raises nothing."""
    try:
        call()
    except kind as error:
        message = str(error)
        missing = [f for f in fragments if f not in message]
        assert not missing, f"message lacks {missing}: {message}"
        return message
    raise AssertionError(f"expected {kind.__name__} containing {fragments}")


def on_rank_0(compute):
    """compute()'s result, computed on rank 0 alone and sent to every rank; its error raised on every rank (the others
    would wait for the result forever). For the single-device references: the same seed and batches give every rank
    the same values, so the others would repeat rank 0's work on the machine's two cores (gloo's broadcast blocks
    without using a core while they wait). Every rank asks at the same point of the same check, as for any
    collective. Rank 0's random state is left as it was (the reference seeds its model's build)."""
    result = [None]
    if dist.get_rank() == 0:
        with torch.random.fork_rng(devices=[]):
            try:
                result = [(compute(), None)]
            except Exception as error:  # noqa: BLE001 - raised on every rank below
                result = [(None, f"{type(error).__name__}: {error}")]
    dist.broadcast_object_list(result, src=0)
    value, error = result[0]
    if error is not None:
        raise RuntimeError(f"the one-process reference failed on rank 0: {error}")
    return value


def run_checks(checks: dict[str, Callable[[], None]]) -> None:
    """Worker side: run every check on this rank, appending one JSON line per result (with the
    equivalence margins the check measured), then end the process group. The Triton interpreter runs only
    in checks marked `interprets_kernels`."""
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    path = out_dir / f"rank{rank}.jsonl"
    only = os.environ.get("TRIDIST_CHECKS")  # a developer's subset: "check_a,check_b" (the test then fails on the rest)
    if only:
        checks = {name: fn for name, fn in checks.items() if name in only.split(",")}
    interpreter = _common.TRITON_INTERPRET  # the launch's: the kernels were decorated for the interpreter
    settle_garbage_collector()  # the imports, paused while the worker imported (tests/distributed/__init__.py)
    for name, check in checks.items():
        _common.TRITON_INTERPRET = interpreter and getattr(check, "interprets_kernels", False)
        equivalence.MEASURED.clear()
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            check()
            record = {"check": name, "status": "ok"}
        except Exception:  # noqa: BLE001 - reported to the test
            record = {"check": name, "status": "fail", "error": traceback.format_exc()[-4000:]}
        record["measured"] = dict(equivalence.MEASURED)  # largest error / allowed, per kind
        record["seconds"] = round(time.perf_counter() - start, 2)  # where the suite's time goes
        record["cpu_seconds"] = round(time.process_time() - cpu_start, 2)  # this rank's, all its threads
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
    end_process_group()


def end_process_group() -> None:
    """Leave together: a barrier (no rank tears down gloo while a peer still talks to it), then end every
    process group while the interpreter is fully alive, letting gloo's threads finish their last work
    (distcore.env.destroy_parallel_env says why: otherwise a process can abort at exit)."""
    if dist.is_initialized():
        dist.barrier()
        destroy_parallel_env()
