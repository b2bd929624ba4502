"""distcore's environment outside torchrun: a world of one, and clear errors (each in a process of its own,
so this test process never initialises torch.distributed)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("test_distcore_env")  # one worker runs the scenarios (one fixture)
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")


# Each scenario must start in a process that never initialised torch.distributed. One subprocess imports
# torch and tridist once (~7 CPU-seconds on this project's machines) and forks a child per scenario, with
# the scenario's environment; a child ends as the interpreter would (exit handlers run, then its status).
_DRIVER = r"""
import atexit, json, os, sys, traceback
import torch
from tridist import distcore
scenarios, out_dir = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for name, (code, env) in scenarios.items():
    out, err = (os.path.join(out_dir, f"{name}.{kind}") for kind in ("out", "err"))
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, out), (2, err)):  # also what C++ code writes
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        os.environ.update(env)
        status = 0
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc()
            status = 1
        try:
            atexit._run_exitfuncs()
        except BaseException:
            traceback.print_exc()
            status = status or 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    results[name] = {"returncode": os.waitstatus_to_exitcode(wait_status),
                     "stdout": open(out).read(), "stderr": open(err).read()}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict:
    """{scenario: its run (returncode, stdout, stderr)}, each in a fresh child process (see _DRIVER)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    out_dir = tmp_path_factory.mktemp("distcore_env")
    run = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(SCENARIOS), str(out_dir)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return {name: SimpleNamespace(**result) for name, result in json.loads(run.stdout).items()}


_WORLD_OF_ONE = """
import torch
from tridist import distcore
from tridist.distcore import ProcessMesh, Shard
assert distcore.get_rank() == 0 and distcore.get_world_size() == 1   # before init: from the environment
distcore.init_parallel_env()
distcore.init_parallel_env()                                          # idempotent
env = distcore.ParallelEnv()
assert (env.rank, env.world_size, env.nranks, env.local_rank, env.device_type) == (0, 1, 1, 0, "cpu")
t = distcore.shard_tensor(torch.arange(6.0).reshape(2, 3), ProcessMesh([0], ["dp"]), [Shard(0)])
assert distcore.local_value(t).tolist() == [[0, 1, 2], [3, 4, 5]]
print("ok")
"""


def test_single_process_is_a_world_of_one(scenarios):
    run = scenarios["world_of_one"]
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_partial_torchrun_environment_is_an_error(scenarios):
    run = scenarios["partial_torchrun_environment"]
    assert run.returncode != 0
    assert "torchrun --nproc-per-node N" in run.stderr and "MASTER_ADDR" in run.stderr


def test_mesh_larger_than_the_job_is_an_error(scenarios):
    run = scenarios["mesh_larger_than_the_job"]
    assert run.returncode != 0 and "launch with `torchrun --nproc-per-node 2`" in run.stderr


@pytest.mark.parametrize(
    "code, message",
    [
        ("ProcessMesh([[0, 1], [1, 2]])", "distinct"),
        ("ProcessMesh([[0, 1], [2, 3]], dim_names=['dp'])", "needs 2 dim_names"),
        ("ProcessMesh([0, 1], dim_names=['x']).get_mesh_with_dim('y')", "no dimension 'y'"),
        ("set_mesh([0, 1])", "expected a ProcessMesh"),
        ("Partial('product')", "reduce_type must be one of"),
    ],
)
def test_mesh_and_placement_errors(code, message):
    from tridist import distcore  # noqa: F401 - the names below

    namespace = {name: getattr(distcore, name) for name in distcore.__all__}
    with pytest.raises((ValueError, TypeError), match=message):
        eval(code, namespace)


def test_mesh_geometry_without_a_process_group():
    from tridist.distcore import ProcessMesh

    mesh = ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["dp", "mp", "pp"])  # the parallelize seed's
    assert mesh.get_mesh_with_dim("pp", 0) == ProcessMesh([[0, 2], [4, 6]], ["dp", "mp"])
    assert mesh.get_mesh_with_dim("dp", 1).process_ids == [4, 5, 6, 7]
    assert mesh.coordinate(5) == [1, 0, 1] and mesh.coordinate(9) is None
    assert mesh.get_dim_size("mp") == 2 and 7 in mesh and 8 not in mesh


_DESTROYED_AT_EXIT = """
import atexit
import torch.distributed as dist
from tridist import distcore
distcore.init_parallel_env()
assert dist.is_initialized()
atexit._run_exitfuncs()
assert not dist.is_initialized()
print("ok")
"""


def test_gloo_group_is_destroyed_at_exit(scenarios):
    """A script that never destroys its group (the Paddle loops don't) has it destroyed by an exit handler
    while the interpreter is alive: a gloo group left to finalisation can abort the process."""
    run = scenarios["destroyed_at_exit"]
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


# {scenario: (its code, its environment on top of this one's without torchrun's variables)}
SCENARIOS = {
    "world_of_one": (_WORLD_OF_ONE, {}),
    "partial_torchrun_environment": ("from tridist import distcore; distcore.init_parallel_env()",
                                     {"RANK": "0", "WORLD_SIZE": "2"}),
    "mesh_larger_than_the_job": ("from tridist import distcore; distcore.ProcessMesh([0, 1], ['dp']).device_mesh", {}),
    "destroyed_at_exit": (_DESTROYED_AT_EXIT, {}),
}
