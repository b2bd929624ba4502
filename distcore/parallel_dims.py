"""ParallelDims: the parallel degrees of one run, their checks and their meshes (torchtitan's ParallelDims).

parallelize and to_distributed get every 1-D mesh here and nowhere else:
- `ParallelDims.for_degrees(dp=, tp=, pp=)` lays out a new mesh for a strategy: tp innermost (its
  ranks consecutive, so inside a node), then dp, pp outermost (Megatron's order);
- `ParallelDims.from_mesh(mesh, kinds)` takes the user's ProcessMesh and the kinds of parallelism its
  config asks for ("dp", "mp", "pp"), checked at once: each kind needs a dimension of its name, except
  that a 1-D mesh whose dimension has another name serves a single kind (Paddle's examples do that).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .mesh import ProcessMesh

KINDS = ("dp", "mp", "pp")  # Paddle's names: data, model (tensor) and pipeline parallel
_CONFIG_OF = {"dp": "dp_config", "mp": "mp_config", "pp": "pp_config"}


@dataclass(frozen=True)
class ParallelDims:
    """`mesh`: the ranks of the run; `kinds`: the kinds of parallelism asked for, each with its mesh dim."""

    mesh: ProcessMesh
    kinds: tuple[str, ...]

    @classmethod
    def for_degrees(cls, *, dp: int, tp: int, pp: int) -> "ParallelDims":
        degrees = {"dp": dp, "tp": tp, "pp": pp}
        bad = {name: value for name, value in degrees.items() if not isinstance(value, int) or value < 1}
        if bad:
            raise ValueError(f"ParallelDims: degrees must be positive integers, got {bad}")
        ranks = np.arange(dp * tp * pp).reshape(pp, dp, tp)
        return cls(ProcessMesh(ranks.tolist(), dim_names=["pp", "dp", "mp"]), KINDS)

    @classmethod
    def from_mesh(cls, mesh: ProcessMesh, kinds) -> "ParallelDims":
        kinds = tuple(kinds)
        unknown = [kind for kind in kinds if kind not in KINDS]
        if unknown:
            raise ValueError(f"ParallelDims: unknown kind(s) {unknown}; kinds are {list(KINDS)}")
        configs = [_CONFIG_OF[kind] for kind in kinds]
        if mesh.ndim == 1 and mesh.dim_names[0] not in KINDS:
            if len(kinds) > 1:
                raise ValueError(
                    f"parallelize: {configs} on a 1-D mesh with dimension {mesh.dim_names[0]!r}: each kind of parallelism "
                    "needs its own named dimension, e.g. ProcessMesh([[0, 1], [2, 3]], dim_names=['dp', 'pp'])"
                )
            return cls(mesh, kinds)
        for kind in kinds:
            if kind not in mesh.dim_names:
                raise ValueError(
                    f"parallelize: {_CONFIG_OF[kind]} needs a mesh dimension named {kind!r}; this mesh has "
                    f"{mesh.dim_names} (name the dimensions, e.g. ProcessMesh(..., dim_names=['dp', 'mp']))"
                )
        return cls(mesh, kinds)

    def degree(self, kind: str) -> int:
        """How many ranks `kind` spans (1 where it is not asked for)."""
        if kind not in self.kinds:
            return 1
        return self.mesh.get_dim_size(kind) if kind in self.mesh.dim_names else self.mesh.size

    def device_mesh(self, kind: str):
        """The 1-D torch DeviceMesh of `kind` (collective on first use, as every DeviceMesh)."""
        self._require(kind)
        return self.mesh.device_mesh[kind] if kind in self.mesh.dim_names else self.mesh.device_mesh

    def rank_groups(self, kind: str) -> list[list[int]]:
        """Every group of ranks along `kind` (one per coordinate of the other dims, in the mesh's order), each
        in `kind`'s order: what every rank must enumerate alike to create subgroups collectively."""
        self._require(kind)
        if kind not in self.mesh.dim_names:
            return [list(self.mesh.process_ids)]
        ranks = np.moveaxis(np.asarray(self.mesh.mesh), self.mesh.dim_index(kind), -1)
        return ranks.reshape(-1, ranks.shape[-1]).tolist()

    def _require(self, kind: str) -> None:
        if kind not in self.kinds:
            raise ValueError(f"ParallelDims: {kind!r} parallelism is not asked for here (asked: {list(self.kinds)})")

    def group(self, kind: str):
        """The process group of `kind`, or None where it is not asked for."""
        return self.device_mesh(kind).get_group() if kind in self.kinds else None
