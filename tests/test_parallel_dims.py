"""ParallelDims (single process: layouts and checks; the meshes' process groups are exercised by every
distributed test through parallelize and to_distributed)."""

import pytest

from tridist.distcore import ProcessMesh
from tridist.distcore.parallel_dims import ParallelDims


def test_strategy_layout_is_tp_innermost_then_dp_then_pp():
    dims = ParallelDims.for_degrees(dp=2, tp=2, pp=2)
    assert dims.mesh.dim_names == ["pp", "dp", "mp"]
    assert dims.mesh.mesh.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # tp pairs are consecutive ranks
    assert [dims.degree(kind) for kind in ("dp", "mp", "pp")] == [2, 2, 2]
    with pytest.raises(ValueError, match="positive integers"):
        ParallelDims.for_degrees(dp=0, tp=1, pp=1)


def test_user_mesh_needs_a_named_dimension_per_kind():
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    dims = ParallelDims.from_mesh(mesh, ["dp", "mp"])
    assert (dims.degree("dp"), dims.degree("mp"), dims.degree("pp")) == (2, 2, 1)  # pp not asked for
    with pytest.raises(ValueError, match="pp_config needs a mesh dimension named 'pp'"):
        ParallelDims.from_mesh(mesh, ["dp", "pp"])
    with pytest.raises(ValueError, match="is not asked for"):
        dims.device_mesh("pp")


def test_a_1d_mesh_of_another_name_serves_one_kind_only():
    line = ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    assert ParallelDims.from_mesh(line, ["mp"]).degree("mp") == 4
    with pytest.raises(ValueError, match="each kind of parallelism needs its own named dimension"):
        ParallelDims.from_mesh(line, ["dp", "mp"])


def test_rank_groups_list_every_group_along_a_dim_in_its_order():
    """What every rank enumerates alike to create subgroups collectively (the pipelines' tie groups)."""
    dims = ParallelDims.for_degrees(dp=2, tp=2, pp=2)  # ranks [pp][dp][mp]
    assert dims.rank_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.rank_groups("mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    one_d = ParallelDims.from_mesh(ProcessMesh([0, 1, 2], dim_names=["x"]), ["dp"])
    assert one_d.rank_groups("dp") == [[0, 1, 2]]
    with pytest.raises(ValueError, match="'pp' parallelism is not asked for"):
        one_d.rank_groups("pp")
