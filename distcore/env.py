"""The parallel environment, read from torchrun's variables: init_parallel_env, ParallelEnv, ranks.

Launch with torchrun (`torchrun --nproc-per-node 8 train.py`, or with `--nnodes` and a c10d
rendezvous across machines). A script run without torchrun is a world of one process: it still gets a
process group, so the same code runs on one device.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import time

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _launched_by_torchrun() -> bool:
    present = [name for name in _TORCHRUN_VARIABLES if name in os.environ]
    if present and len(present) != len(_TORCHRUN_VARIABLES):
        missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
        raise RuntimeError(
            f"init_parallel_env: the environment sets {present} but not {missing}; launch the script with "
            "`torchrun --nproc-per-node N script.py` (it sets all of them), or set none of them to run "
            "as a single process"
        )
    return bool(present)


def default_backend() -> str:
    """NCCL wherever CUDA is available (every rank decides alike on a uniform cluster), gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_device_index() -> int:
    """The GPU of this process: LOCAL_RANK, modulo the visible devices (schedulers that expose one GPU
    per process through CUDA_VISIBLE_DEVICES give every process device 0)."""
    return int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())


def init_parallel_env(backend: str | None = None, *, timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed from torchrun's environment (idempotent).

    Under torchrun: one process group over all ranks, NCCL on GPUs (each process bound to the GPU of
    its LOCAL_RANK) or gloo on CPUs. Without torchrun: a group of one process.
    """
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    options = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if backend == "nccl":
        torch.cuda.set_device(local_device_index())
        # Eager NCCL initialisation: later point-to-point transfers among a subset of ranks (reshard
        # between pipeline stages) must not be the group's first, lazily-initialising operation.
        options["device_id"] = torch.device("cuda", local_device_index())
    if _launched_by_torchrun():
        dist.init_process_group(**options)
    else:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **options)
    if backend == "gloo":
        # Paddle-style scripts end without destroying the group: end it on the way out, while the
        # interpreter is alive (see destroy_parallel_env). A no-op where the script ended it itself.
        atexit.register(destroy_parallel_env)


# After the last collective, gloo's worker threads still free the finished work objects, and with them
# tensors that Python owns, which takes the GIL. A thread that asks for the GIL once the interpreter
# finalises is killed inside a noexcept destructor and the process aborts ("terminate called without
# an active exception", after every result was written: 3 of 30 launches of the 4-rank checkpoint test
# under load; gdb shows ProcessGroupGloo::runLoop freeing an AsyncBarrierWork's prior allgather).
# destroy_process_group does not stop those threads: they end with the last reference to the group,
# i.e. in finalisation. So the way out releases the GIL for a moment: a thread needs one scheduling
# slice to finish; Linux's scheduling latency is tens of milliseconds even with 8 processes on 2
# cores, and 0.2 s once per process costs nothing (0 aborts in 60 such launches with it).
GLOO_SETTLE_S = 0.2


def destroy_parallel_env() -> None:
    """Destroy every process group, then let gloo's threads finish freeing their last work (idempotent).

    Call it last in a script (every rank, after its last collective); init_parallel_env registers it to
    run at exit for the gloo group it creates, so scripts that never end their group exit cleanly too.
    """
    if not dist.is_initialized():
        return
    uses_gloo = "gloo" in str(dist.get_backend())  # "gloo", or a device map such as "cpu:gloo,cuda:nccl"
    dist.destroy_process_group()
    if uses_gloo:
        time.sleep(GLOO_SETTLE_S)


def get_rank(group=None) -> int:
    """This process's rank (in `group` if given); 0 before initialisation outside torchrun."""
    if dist.is_initialized():
        return dist.get_rank(group)
    return int(os.environ.get("RANK", 0))


def get_world_size(group=None) -> int:
    """The number of processes (in `group` if given); 1 before initialisation outside torchrun."""
    if dist.is_initialized():
        return dist.get_world_size(group)
    return int(os.environ.get("WORLD_SIZE", 1))


def all_reduce_mean_(tensor, group) -> None:
    """In place: the mean of `tensor` over the ranks of `group` (a sum then a division: gloo has no AVG)."""
    dist.all_reduce(tensor, group=group)
    tensor /= dist.get_world_size(group)


class ParallelEnv:
    """Paddle's ParallelEnv: where this process sits in the job, read from torchrun's environment."""

    @property
    def rank(self) -> int:
        return get_rank()

    @property
    def world_size(self) -> int:
        return get_world_size()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def local_world_size(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    @property
    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", 0))

    @property
    def device_type(self) -> str:
        """"gpu" under NCCL, "cpu" under gloo: the backend in use once initialised, else the default."""
        backend = dist.get_backend() if dist.is_initialized() else default_backend()
        return "gpu" if backend == "nccl" else "cpu"

    @property
    def device_id(self) -> int:
        """The GPU this process uses; 0 on a CPU."""
        return local_device_index() if self.device_type == "gpu" else 0

    @property
    def master_endpoint(self) -> str:
        return f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '')}"

    # Paddle's aliases.
    nranks = world_size
    dev_id = device_id
    trainer_id = rank

    def __repr__(self) -> str:
        return (
            f"ParallelEnv(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}, "
            f"device_type={self.device_type!r}, device_id={self.device_id})"
        )


def device() -> torch.device:
    """The device this process computes on: its GPU under NCCL, the CPU under gloo."""
    env = ParallelEnv()
    return torch.device("cuda", env.device_id) if env.device_type == "gpu" else torch.device("cpu")


# One log line for a rank left waiting this long in `every_rank_calls`: ranks that call a checkpoint together
# arrive within a step's skew (seconds), so a minute's wait is almost surely a call on some ranks only, while the
# error comes only at the process group's timeout (10 minutes by default) in case a rank is merely slow.
ARRIVAL_LOG_S = 60.0


COLLECTIVE_CALL_FIX = "it is collective: call it on every rank, not under `if rank == 0:`"


def every_rank_calls(what: str, *, ranks: list[int] | None = None, fix: str = COLLECTIVE_CALL_FIX) -> None:
    """Returns once every rank of `ranks` (default: the job's; every one of them passes the same list) has
    called `what` as many times as this rank has (this call included); raises a RuntimeError naming the ranks
    that did not, and `fix`, at the process group's timeout.

    For the collective entry points that scripts are wont to call on rank 0 alone (`if rank == 0:
    model.save_pretrained(path)`, the habit of DDP scripts, where each rank holds the whole model). Called so,
    their first collective would wait for ranks that never come, or pair with those ranks' next collectives (the
    training's own all-gathers): a hang, or a checkpoint of mixed-up tensors. The ranks therefore meet first
    in the process group's store, where no collective can pair with them, and a rank left waiting says why
    after `ARRIVAL_LOG_S`. Nothing to do in a world of one; skipped where the group has no store."""
    if not dist.is_initialized():
        return
    ranks = sorted(range(dist.get_world_size()) if ranks is None else ranks)
    store = _default_store() if len(ranks) > 1 else None
    if store is None:
        return
    rank = dist.get_rank()
    group = "world" if len(ranks) == dist.get_world_size() else ",".join(map(str, ranks))
    prefix = f"tridist/every_rank_calls/{what}/{group}"
    call = f"{prefix}/{store.add(f'{prefix}/calls/{rank}', 1)}"  # this rank's how-manieth call of `what`
    store.set(f"{call}/rank{rank}", "1")  # read only to name the absent ranks
    if store.add(f"{call}/arrived", 1) == len(ranks):
        store.set(f"{call}/all", "1")
    start, pause, logged = time.monotonic(), 0.001, False
    timeout_s = store.timeout.total_seconds()
    # store.check polls without blocking (store.wait's timeouts print a C++ warning each); one key per poll
    while not store.check([f"{call}/all"]):
        waited = time.monotonic() - start
        if waited >= timeout_s:
            absent = _absent(store, call, ranks)
            store.add(f"{prefix}/calls/{rank}", -1)  # as if never called: the ranks' counts stay in step
            store.add(f"{call}/arrived", -1)
            store.delete_key(f"{call}/rank{rank}")
            raise RuntimeError(f"{what}: rank {rank} waited {waited:.1f} s (the process group's timeout) for rank(s) "
                               f"{absent} to do the same; {fix}")
        if not logged and waited >= ARRIVAL_LOG_S:
            log.warning("%s: rank %d has waited %.0f s for rank(s) %s to do the same; %s",
                        what, rank, waited, _absent(store, call, ranks), fix)
            logged = True
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


def _absent(store, call: str, ranks: list[int]) -> list[int]:
    return [r for r in ranks if not store.check([f"{call}/rank{r}"])]


def _default_store():
    """The default process group's store (torch keeps it private), or None where there is none to read."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None
