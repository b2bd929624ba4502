"""distcore's environment outside torchrun: a world of one, and clear errors (each in a subprocess,
so this test process never initialises torch.distributed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def run_python(code: str, **env_overrides):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_single_process_is_a_world_of_one():
    code = """
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
    run = run_python(code)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_partial_torchrun_environment_is_an_error():
    run = run_python("from tridist import distcore; distcore.init_parallel_env()", RANK="0", WORLD_SIZE="2")
    assert run.returncode != 0
    assert "torchrun --nproc-per-node N" in run.stderr and "MASTER_ADDR" in run.stderr


def test_mesh_larger_than_the_job_is_an_error():
    run = run_python("from tridist import distcore; distcore.ProcessMesh([0, 1], ['dp']).device_mesh")
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


def test_gloo_group_is_destroyed_at_exit():
    """A script that never destroys its group (the Paddle loops don't) has it destroyed by an exit handler
    while the interpreter is alive: a gloo group left to finalisation can abort the process."""
    code = """
import atexit
import torch.distributed as dist
from tridist import distcore
distcore.init_parallel_env()
assert dist.is_initialized()
atexit._run_exitfuncs()
assert not dist.is_initialized()
print("ok")
"""
    run = run_python(code)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
