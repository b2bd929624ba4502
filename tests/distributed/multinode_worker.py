"""Checks on 2 simulated nodes x 2 processes (torchrun agents meeting at a c10d rendezvous)."""

from __future__ import annotations

import os

from tridist import distcore
from tests.distributed import parallelize_worker, to_distributed_worker
from tests.distributed.harness import run_checks


def check_environment_of_each_node():
    env = distcore.ParallelEnv()
    assert env.world_size == 4 and env.local_world_size == 2
    assert env.node_rank == int(os.environ["GROUP_RANK"]) in (0, 1)
    assert env.rank == env.node_rank * 2 + env.local_rank  # torchrun numbers ranks node by node


def check_zero3_across_nodes_equals_one_process():
    parallelize_worker._check_level(3)


def check_to_distributed_on_two_nodes():
    """node_num=2: the cluster the search prices has two nodes (tensor parallel stays inside one, the
    mesh puts tp on consecutive ranks); the seed loop trains like one device."""
    model, _, _ = to_distributed_worker._seed_loop("hf-llama", node_num=2)
    strategy = model.distributed_strategy
    assert strategy.num_devices == 4 and strategy.tp <= 2, strategy


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
