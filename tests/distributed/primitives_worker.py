"""Checks of distcore's primitives on 4 gloo processes (run by tests/distributed/test_primitives.py)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tridist import distcore
from tridist.distcore import Partial, ProcessMesh, Replicate, Shard
from tests.distributed import equivalence
from tests.distributed.harness import run_checks

DENSE = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]  # the notes seed's example tensor


def rank() -> int:
    return dist.get_rank()


def check_environment():
    distcore.init_parallel_env()
    env = distcore.ParallelEnv()
    assert env.rank == int(os.environ["RANK"]) == distcore.get_rank()
    assert env.world_size == env.nranks == 4 == distcore.get_world_size()
    assert env.local_rank == int(os.environ["LOCAL_RANK"])
    assert env.device_type == "cpu" and env.device_id == 0


def check_mesh_geometry():
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    assert mesh.shape == [2, 2] and mesh.process_ids == [0, 1, 2, 3]
    assert mesh.coordinate() == [rank() // 2, rank() % 2]
    assert mesh.get_mesh_with_dim("mp") == ProcessMesh([[0, 2], [1, 3]], ["mp", "dp"])
    assert mesh.get_mesh_with_dim("mp", 1) == ProcessMesh([1, 3], ["dp"])
    assert mesh.get_submesh_with_dim("dp").process_ids == [rank() % 2, rank() % 2 + 2]
    assert mesh.device_mesh.get_coordinate() == (rank() // 2, rank() % 2)


def check_mesh_larger_than_world_is_an_error():
    try:
        ProcessMesh(list(range(8)), ["dp"]).device_mesh
    except ValueError as error:
        assert "has 4 process(es)" in str(error) and "torchrun --nproc-per-node 8" in str(error)
    else:
        raise AssertionError("expected a ValueError")


def check_shard_tensor_local_values():
    mesh = ProcessMesh([0, 1], dim_names=["x"])
    dense = torch.tensor(DENSE)
    rows = distcore.shard_tensor(dense, mesh, [Shard(0)])
    cols = distcore.shard_tensor(dense, mesh, [Shard(1)])
    if rank() in (0, 1):
        assert distcore.local_value(rows).tolist() == [DENSE[rank()]]
        expected_cols = [[1.0, 2.0], [4.0, 5.0]] if rank() == 0 else [[3.0], [6.0]]  # torch.chunk sizes
        assert distcore.local_value(cols).tolist() == expected_cols
        assert distcore.unshard_dtensor(cols).tolist() == DENSE
    else:  # not in the mesh: empty shards, global metadata still known
        assert distcore.local_value(rows).numel() == 0 and tuple(rows.shape) == (2, 3)


def check_shard_tensor_on_a_2d_mesh_and_partial():
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    dense = torch.arange(16.0).reshape(4, 4)
    both = distcore.shard_tensor(dense, mesh, [Shard(0), Shard(1)])
    r, c = rank() // 2, rank() % 2
    assert torch.equal(distcore.local_value(both), dense[2 * r : 2 * r + 2, 2 * c : 2 * c + 2])
    partial = distcore.shard_tensor(dense, mesh, [Partial(), Replicate()])
    expected_local = dense if rank() // 2 == 0 else torch.zeros_like(dense)  # first along the partial dim holds it
    assert torch.equal(distcore.local_value(partial), expected_local)
    # Exact: the sum over the partial dim adds zeros to the one rank's value.
    assert torch.equal(distcore.unshard_dtensor(distcore.reshard(partial, mesh, [Replicate(), Replicate()])), dense)
    rows = distcore.reshard(both, mesh, [Shard(0), Replicate()])
    assert torch.equal(distcore.local_value(rows), dense[2 * r : 2 * r + 2])


def check_shard_tensor_errors():
    mesh = ProcessMesh([0, 1], dim_names=["x"])
    for placements, message in (([Shard(2)], "shard dim must be in [0, 2)"), ([Shard(0), Shard(1)], "2 placement(s)")):
        try:
            distcore.shard_tensor(torch.tensor(DENSE), mesh, placements)
        except ValueError as error:
            assert message in str(error), str(error)
        else:
            raise AssertionError(f"expected an error for {placements}")


def check_parameter_stays_a_parameter():
    mesh = ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    weight = torch.nn.Parameter(torch.randn(8, 4))
    sharded = distcore.shard_tensor(weight, mesh, [Shard(0)])
    assert isinstance(sharded, torch.nn.Parameter) and sharded.requires_grad
    frozen = distcore.shard_tensor(torch.randn(8, 4), mesh, [Shard(0)], stop_gradient=False)
    assert frozen.requires_grad


def check_dtensor_from_local():
    mesh = ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    local = torch.full((2, 3), float(rank()))
    tensor = distcore.dtensor_from_local(local, mesh, [Shard(0)])
    assert tuple(tensor.shape) == (8, 3)
    assert distcore.unshard_dtensor(tensor)[:, 0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    uneven = distcore.dtensor_from_local(torch.ones(2 if rank() < 3 else 1, 3), mesh, [Shard(0)], shape=(7, 3))
    assert tuple(uneven.shape) == (7, 3) and distcore.unshard_dtensor(uneven).sum().item() == 21


def check_reshard_across_meshes_same_layout():
    """Pipeline case: stage 0 on ranks [0, 1], stage 1 on [2, 3], same placements: direct sends."""
    stage0, stage1 = ProcessMesh([0, 1], ["x"]), ProcessMesh([2, 3], ["x"])
    dense = torch.arange(12.0).reshape(4, 3)
    moved = distcore.reshard(distcore.shard_tensor(dense, stage0, [Shard(0)]), stage1, [Shard(0)])
    assert moved.device_mesh is stage1.device_mesh
    if rank() in (2, 3):
        assert torch.equal(distcore.local_value(moved), dense[2 * (rank() - 2) : 2 * (rank() - 2) + 2])
    else:
        assert distcore.local_value(moved).numel() == 0


def check_reshard_across_meshes_of_other_shapes_and_overlap():
    source = ProcessMesh([[0, 1]], ["x", "y"])
    dense = torch.arange(20.0).reshape(4, 5)
    tensor = distcore.shard_tensor(dense, source, [Replicate(), Shard(1)])  # uneven columns: 3 + 2
    for target, placements in (
        (ProcessMesh([1, 2, 3], ["z"]), [Shard(0)]),  # overlaps the source at rank 1; uneven rows 2+1+1
        (ProcessMesh([3, 2], ["z"]), [Replicate()]),  # reversed rank order
        (ProcessMesh([[2], [3]], ["a", "b"]), [Shard(1), Replicate()]),
    ):
        moved = distcore.reshard(tensor, target, placements)
        if rank() in target:
            assert torch.equal(distcore.unshard_dtensor(moved), dense), (target, placements)


def check_reshard_across_meshes_is_differentiable():
    """y = x @ w0 on stage 0, reshard to stage 1, z = y @ w1, a squared error against each row's own
    target (a sum over rows alone could not tell rows apart): loss and gradients match one process."""
    torch.manual_seed(0)
    x, w0, w1, target = torch.randn(4, 6), torch.randn(6, 5), torch.randn(5, 3), torch.randn(4, 3)
    stage0, stage1 = ProcessMesh([0, 1], ["dp"]), ProcessMesh([2, 3], ["dp"])
    d_w0 = distcore.shard_tensor(torch.nn.Parameter(w0.clone()), stage0, [Replicate()])
    d_w1 = distcore.shard_tensor(torch.nn.Parameter(w1.clone()), stage1, [Replicate()])
    d_x = distcore.shard_tensor(x, stage0, [Shard(0)])  # data parallel over the stage's two ranks
    y = distcore.reshard(d_x @ d_w0, stage1, [Shard(0)])
    loss = ((y @ d_w1 - distcore.shard_tensor(target, stage1, [Shard(0)])) ** 2).sum()
    loss.backward()
    ref_w0, ref_w1 = w0.clone().requires_grad_(), w1.clone().requires_grad_()
    ref_loss = (((x @ ref_w0) @ ref_w1 - target) ** 2).sum()
    ref_loss.backward()
    if rank() in (0, 1):
        equivalence.assert_tensors_close("gradients", {"w0": distcore.unshard_dtensor(d_w0.grad)}, {"w0": ref_w0.grad})
    else:
        equivalence.assert_tensors_close("gradients", {"w1": distcore.unshard_dtensor(d_w1.grad)}, {"w1": ref_w1.grad})
        equivalence.assert_losses_close([distcore.unshard_dtensor(loss).item()], [ref_loss.item()])


def check_per_rank_meshes_cannot_back_groups():
    """get_submesh_with_dim differs per rank: building groups on it would wire them wrongly."""
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    try:
        mesh.get_submesh_with_dim("dp").device_mesh
    except RuntimeError as error:
        assert "different meshes" in str(error) and "get_group" in str(error), str(error)
    else:
        raise AssertionError("expected a RuntimeError")
    group = mesh.device_mesh.get_group("dp")  # the right way: ranks {r % 2, r % 2 + 2}
    value = torch.tensor([float(rank())])
    dist.all_reduce(value, group=group)
    assert value.item() == 2 * (rank() % 2) + 2


def check_shard_tensor_of_an_activation_keeps_its_gradient():
    """Paddle's notes shard inputs inside forward: gradients must reach what produced them."""
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    weight = torch.nn.Parameter(torch.arange(12.0).reshape(4, 3))
    activation = weight * 2  # the same value on every rank, requires grad, not a leaf
    sharded = distcore.shard_tensor(activation, mesh, [Shard(0), Replicate()])
    assert torch.equal(distcore.local_value(sharded), (weight * 2)[2 * (rank() // 2) : 2 * (rank() // 2) + 2].detach())
    sharded.sum().backward()
    assert weight.grad is not None
    # Each rank's gradient covers its own rows (y peers share them); summed over x they cover all.
    local_rows = slice(2 * (rank() // 2), 2 * (rank() // 2) + 2)
    assert torch.equal(weight.grad[local_rows], torch.full((2, 3), 2.0))


def check_shard_tensor_of_a_dtensor_parameter():
    mesh = ProcessMesh([0, 1, 2, 3], ["x"])
    param = distcore.shard_tensor(torch.nn.Parameter(torch.randn(8, 4)), mesh, [Shard(0)])
    moved = distcore.shard_tensor(param, mesh, [Replicate()], dtype=torch.float64)
    assert isinstance(moved, torch.nn.Parameter) and moved.requires_grad and moved.dtype == torch.float64
    assert moved.is_leaf and distcore.local_value(moved).shape == (8, 4)


def check_reshard_between_equal_meshes_named_differently():
    source, target = ProcessMesh([0, 1, 2, 3], ["dp"]), ProcessMesh([0, 1, 2, 3], ["x"])
    weight = torch.nn.Parameter(torch.arange(8.0))
    tensor = distcore.shard_tensor(weight * 1, source, [Shard(0)])
    moved = distcore.reshard(tensor, target, [Replicate()])
    assert moved.device_mesh is target.device_mesh and torch.equal(distcore.local_value(moved), torch.arange(8.0))
    moved.sum().backward()
    assert weight.grad is not None


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
