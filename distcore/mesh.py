"""ProcessMesh: Paddle's n-dimensional grid of ranks with named dimensions, backed by a torch DeviceMesh.

A mesh may hold any subset of the world's ranks in any order (a pipeline stage's sub-mesh, say).
Creating its DeviceMesh is collective over *all* ranks (torch builds one process group per mesh
dimension), which SPMD programs satisfy naturally: every rank builds the same meshes in the same
order. Ranks outside a mesh take part in the creation and then hold empty shards of tensors on it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import env

_DEVICE_MESHES: dict[tuple, DeviceMesh] = {}  # one DeviceMesh (and process groups) per distinct mesh
_GLOBAL_MESH: "ProcessMesh | None" = None


class ProcessMesh:
    """`ProcessMesh(mesh, dim_names)`: e.g. `ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])`."""

    def __init__(self, mesh, dim_names: Sequence[str] | None = None):
        array = np.array(mesh.tolist() if torch.is_tensor(mesh) else mesh, dtype=np.int64)
        if array.ndim == 0:
            array = array.reshape(1)
        if array.size == 0:
            raise ValueError("ProcessMesh: the mesh holds no ranks")
        if len(np.unique(array)) != array.size or array.min() < 0:
            raise ValueError(f"ProcessMesh: ranks must be distinct non-negative integers, got {array.tolist()}")
        dim_names = list(dim_names) if dim_names is not None else [f"d{i}" for i in range(array.ndim)]
        if len(dim_names) != array.ndim:
            raise ValueError(
                f"ProcessMesh: a {array.ndim}-D mesh {list(array.shape)} needs {array.ndim} dim_names, got {dim_names}"
            )
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"ProcessMesh: dim_names must be distinct, got {dim_names}")
        self._mesh = array
        self._dim_names = dim_names

    # ------------------------------------------------------------------------------------ geometry

    @property
    def mesh(self) -> np.ndarray:
        return self._mesh

    @property
    def shape(self) -> list[int]:
        return list(self._mesh.shape)

    @property
    def ndim(self) -> int:
        return self._mesh.ndim

    @property
    def dim_names(self) -> list[str]:
        return list(self._dim_names)

    @property
    def process_ids(self) -> list[int]:
        return self._mesh.flatten().tolist()

    @property
    def size(self) -> int:
        return int(self._mesh.size)

    def dim_index(self, dim_name: str) -> int:
        if dim_name not in self._dim_names:
            raise ValueError(f"ProcessMesh: no dimension {dim_name!r}; this mesh has {self._dim_names}")
        return self._dim_names.index(dim_name)

    def get_dim_size(self, dim_name: str) -> int:
        return self.shape[self.dim_index(dim_name)]

    def __contains__(self, rank: int) -> bool:
        return int(rank) in self.process_ids

    def coordinate(self, rank: int | None = None) -> list[int] | None:
        """The coordinate of `rank` (default: this process) in the mesh, or None if it is not in it."""
        rank = env.get_rank() if rank is None else rank
        where = np.argwhere(self._mesh == rank)
        return where[0].tolist() if len(where) else None

    def get_mesh_with_dim(self, dim_name: str, index: int | None = None) -> "ProcessMesh":
        """The mesh with `dim_name` moved first; with `index`, the sub-mesh at that index along it.

        E.g. for dims (dp, mp, pp), `get_mesh_with_dim("pp", 0)` is the (dp, mp) mesh of stage 0.
        """
        axis = self.dim_index(dim_name)
        moved = np.moveaxis(self._mesh, axis, 0)
        names = [dim_name] + [n for n in self._dim_names if n != dim_name]
        if index is None:
            return ProcessMesh(moved, names)
        if not -moved.shape[0] <= index < moved.shape[0]:
            raise IndexError(f"ProcessMesh: index {index} out of range for dimension {dim_name!r} of size {moved.shape[0]}")
        sub = moved[index]
        return ProcessMesh(sub if sub.ndim else sub.reshape(1), names[1:] or [dim_name])

    def get_submesh_with_dim(self, dim_name: str) -> "ProcessMesh":
        """The 1-D mesh along `dim_name` through this process (its group on that dimension).

        A per-rank view, for reading ranks: it differs between ranks, so never build tensors or
        process groups on it (`device_mesh` refuses); use `mesh.device_mesh.get_group(dim_name)`.
        """
        coordinate = self.coordinate()
        if coordinate is None:
            raise ValueError(f"ProcessMesh: rank {env.get_rank()} is not in {self}")
        axis = self.dim_index(dim_name)
        index = tuple(slice(None) if i == axis else c for i, c in enumerate(coordinate))
        return ProcessMesh(self._mesh[index], [dim_name])

    # ------------------------------------------------------------------------------ torch backing

    @property
    def device_mesh(self) -> DeviceMesh:
        """The torch DeviceMesh of this mesh (created on first use; collective over all ranks)."""
        env.init_parallel_env()
        world = env.get_world_size()
        if max(self.process_ids) >= world:
            raise ValueError(
                f"ProcessMesh: the mesh uses rank {max(self.process_ids)} but the job has {world} process(es); "
                f"launch with `torchrun --nproc-per-node {max(self.process_ids) + 1}` (or more nodes), "
                "or build a mesh that fits the job"
            )
        key = (tuple(self.shape), tuple(self.process_ids), tuple(self._dim_names))
        if key not in _DEVICE_MESHES:
            _check_same_mesh_on_every_rank(key)
            device_type = env.device().type
            _DEVICE_MESHES[key] = DeviceMesh(device_type, torch.from_numpy(self._mesh), mesh_dim_names=tuple(self._dim_names))
        return _DEVICE_MESHES[key]

    # -------------------------------------------------------------------------------------- misc

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, ProcessMesh)
            and self.shape == other.shape
            and self.process_ids == other.process_ids
            and self._dim_names == other._dim_names
        )

    def __hash__(self) -> int:
        return hash((tuple(self.shape), tuple(self.process_ids), tuple(self._dim_names)))

    def __repr__(self) -> str:
        return f"ProcessMesh({self._mesh.tolist()}, dim_names={self._dim_names})"


def _check_same_mesh_on_every_rank(key: tuple) -> None:
    """DeviceMesh creation builds process groups collectively: every rank must ask for the same mesh
    at the same moment, or groups get wired to the wrong ranks (silently). One all-gather checks it."""
    world = env.get_world_size()
    if world == 1:
        return
    keys: list = [None] * world
    dist.all_gather_object(keys, key)
    if any(other != key for other in keys):
        differing = sorted({str(k) for k in keys})
        raise RuntimeError(
            "ProcessMesh: ranks are creating different meshes at the same point "
            f"({'; '.join(differing)}): every rank must build the same meshes in the same order. "
            "A per-rank view such as get_submesh_with_dim() cannot back tensors or groups; use "
            "mesh.device_mesh.get_group(dim_name) for a dimension's group"
        )


def set_mesh(mesh: ProcessMesh) -> None:
    """Set the global mesh that `parallelize` and friends use when given none."""
    global _GLOBAL_MESH
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"set_mesh: expected a ProcessMesh, got {type(mesh).__name__}")
    _GLOBAL_MESH = mesh


def get_mesh() -> ProcessMesh | None:
    return _GLOBAL_MESH


def as_process_mesh(mesh: "ProcessMesh | DeviceMesh") -> ProcessMesh:
    """A ProcessMesh for a ProcessMesh or a torch DeviceMesh (the mesh of a DTensor)."""
    if isinstance(mesh, ProcessMesh):
        return mesh
    names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    process_mesh = ProcessMesh(mesh.mesh, names)
    _DEVICE_MESHES.setdefault((tuple(process_mesh.shape), tuple(process_mesh.process_ids), tuple(process_mesh.dim_names)), mesh)
    return process_mesh
