"""Paddle's `shard_dataloader`: every rank gets its data-parallel slice of each global batch, as DTensors.

`shard_dataloader(loader, meshes, input_keys=None, shard_dims=None)` wraps a torch DataLoader. Each
yielded tensor is a DTensor with the GLOBAL shape (dim 0 = global batch size) on its mesh: Shard(0)
along the data-parallel mesh dim, Replicate() along the others. So a run over N ranks sees exactly the
global batches a single device sees, split contiguously with torch.chunk sizes (dp rank 0 gets the first
rows). torch's DistributedSampler strides over samples instead, which does not reproduce them: give
the loader a plain sampler (a DataLoader over a DistributedSampler is refused, as each rank would
slice its already strided batches again and see only a fraction of its data).

Batch sizes: every data-parallel rank must get at least one sample of every global batch. torch.chunk
sizes are ceil(n / dp) per slice, so e.g. a batch of 6 over 4 ranks gives 2, 2, 2, 0: refused although
6 >= 4. When the loader's sizes are known (a map-style dataset with torch's BatchSampler: len of the
sampler, batch_size, drop_last), every global batch, the short last one included unless drop_last,
is checked when the ShardDataloader is built; otherwise each batch is checked as it comes. Use a batch
size that is a multiple of the data-parallel degree, and drop_last=True if the dataset does not
divide into whole batches.

Uneven slices and gradient averaging: DataParallel (DDP) and the sharded optimizers average the
gradients over the data-parallel ranks, i.e. they take the mean of the per-rank mean losses. That is
one device's mean over the global batch only when every rank holds the same number of samples; when a
global batch does not divide evenly by the dp degree (e.g. 7 samples as 2, 2, 2, 1), the samples of
the smaller slices weigh more. The ShardDataloader warns once when it meets (or, with known sizes,
foresees) such a batch. The same caveat holds, even with equal slices, for a loss normalised by a
per-rank count, e.g. a token-level cross-entropy averaged over the tokens that are not ignored
(ignore_index / padding): the mean of per-rank token means differs from the mean over all the global
batch's tokens when the ranks' token counts differ. To match one device, sum the loss and divide by
the global count (all-reduce the count over the data-parallel group first), or use equal counts.

How the samples are loaded:
- Per-rank loading (the usual case: a map-style dataset with a batch sampler and torch's default
  collate): the loader is rebuilt over the same dataset, collate_fn, workers, ... with a batch sampler
  that wraps the original one and keeps only this rank's slice of each global batch's indices, so each
  rank reads only its own samples. Not used by default with a custom collate_fn, which may pad each
  batch to its longest sample (then per-slice collation would change the shapes); pass
  `per_rank_loading=True` to force it when the collate_fn is per-sample.
- Otherwise (an iterable-style dataset, a loader without a batch sampler, a custom collate_fn, a
  DataLoader subclass or any other iterable): every rank iterates the full batches and slices the
  collated tensors on dim 0. Correct in all cases; each rank reads every sample.

Shuffling: a sampler with a `generator` attribute (RandomSampler, SubsetRandomSampler, ...) would shuffle
with each process's own RNG. At each epoch rank 0's choice is broadcast: its generator's state, or, for
a sampler without a generator, a seed that rank 0 draws from its global RNG exactly as RandomSampler
does (the generator built from it stays on the sampler; every rank makes the same draw and keeps rank 0's, so
each rank's global RNG advances as one process's). An iterable-style dataset must itself yield
the same order on every rank.

Non-tensor items (strings, ...) are not DTensors: they pass through as the collate_fn made them, which
with per-rank loading covers only this rank's samples.

Tensors whose rows are not samples: every tensor of a batch must hold one row per sample on dim 0, or be a media
tensor that `sample_rows` (a vision-language model's layout: sample_rows.py; to_distributed passes
`sample_rows_of(model)`) assigns to samples by their placeholder tokens. Such a tensor goes to each rank as a plain
tensor of its samples' rows (None where they hold no image): its ranks hold different numbers of rows, which no
DTensor of one global shape describes, and the model takes local values. Any other tensor of another row count is
refused, naming it (sliced by its own rows, it would give a rank other samples' data).
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset
from torch.utils.data._utils.collate import default_collate

from . import env
from .api import dtensor_from_local
from .mesh import ProcessMesh
from .sample_rows import SampleRows, check_rows, take_samples

_BATCH_DIM = 0  # the dim that holds the samples of a collated batch
_FULL_BATCH = (1, 0)  # (number of slices, index): the whole global batch


# ------------------------------------------------------------------------------ meshes and slices


@dataclass(frozen=True)
class _MeshLayout:
    """Where one group of tensors lives: a mesh and the mesh dim that splits the batch (None: replicated)."""

    mesh: ProcessMesh
    shard_dim: str | None

    @property
    def num_slices(self) -> int:
        return 1 if self.shard_dim is None else self.mesh.get_dim_size(self.shard_dim)

    def slice_index(self, rank: int) -> int | None:
        """Which slice of the global batch `rank` holds; None when the rank is not in the mesh."""
        coordinate = self.mesh.coordinate(rank)
        if coordinate is None:
            return None
        return 0 if self.shard_dim is None else coordinate[self.mesh.dim_index(self.shard_dim)]

    @property
    def placements(self) -> list:
        return [Shard(_BATCH_DIM) if name == self.shard_dim else Replicate() for name in self.mesh.dim_names]


def _as_mesh_list(meshes) -> list[ProcessMesh]:
    mesh_list = list(meshes) if isinstance(meshes, (list, tuple)) else [meshes]
    if not mesh_list or not all(isinstance(mesh, ProcessMesh) for mesh in mesh_list):
        raise TypeError(
            "shard_dataloader: meshes must be a ProcessMesh or a non-empty list of them (one per pipeline "
            f"stage: the first holds the inputs, the last the labels), got {meshes!r}"
        )
    return mesh_list


def _shard_dim_name(shard_dim, mesh: ProcessMesh) -> str | None:
    if shard_dim is None:
        return None
    if isinstance(shard_dim, int) and not isinstance(shard_dim, bool):
        if not -mesh.ndim <= shard_dim < mesh.ndim:
            raise ValueError(
                f"shard_dataloader: shard_dims index {shard_dim} is out of range for {mesh} "
                f"({mesh.ndim} dim(s): {mesh.dim_names}); give a dim name or an index in [0, {mesh.ndim})"
            )
        return mesh.dim_names[shard_dim]
    if isinstance(shard_dim, str):
        if shard_dim not in mesh.dim_names:
            raise ValueError(
                f"shard_dataloader: shard_dims {shard_dim!r} is not a dim of {mesh}; its dims are "
                f"{mesh.dim_names}: name the data-parallel one (or pass None to replicate the batch)"
            )
        return shard_dim
    raise TypeError(f"shard_dataloader: shard_dims entries must be a mesh dim name, an index or None, got {shard_dim!r}")


def _mesh_layouts(meshes: list[ProcessMesh], shard_dims) -> list[_MeshLayout]:
    """One layout per mesh; `shard_dims` is one dim for all meshes or a list with one per mesh."""
    if isinstance(shard_dims, (list, tuple)):
        if len(shard_dims) != len(meshes):
            raise ValueError(
                f"shard_dataloader: {len(shard_dims)} shard_dims {list(shard_dims)} for {len(meshes)} mesh(es); "
                "give one per mesh, or a single dim name for all of them"
            )
        per_mesh = list(shard_dims)
    else:
        per_mesh = [shard_dims] * len(meshes)
    return [_MeshLayout(mesh, _shard_dim_name(dim, mesh)) for mesh, dim in zip(meshes, per_mesh)]


def _slice_bounds(global_size: int, num_slices: int, index: int) -> tuple[int, int]:
    """(start, length) of slice `index` of `global_size` samples: torch.chunk sizes, as DTensor's Shard."""
    length, start = Shard.local_shard_size_and_offset(global_size, num_slices, index)
    return int(start), int(length)


def _chunk_sizes(global_size: int, num_slices: int) -> list[int]:
    return [_slice_bounds(global_size, num_slices, index)[1] for index in range(num_slices)]


def _check_batch_splits(global_size: int, layouts: list[_MeshLayout], *, where: str = "") -> None:
    """Every data-parallel rank must get at least one sample (an empty local batch breaks mean losses)."""
    for layout in layouts:
        sizes = _chunk_sizes(global_size, layout.num_slices)
        if sizes[-1] == 0:
            raise ValueError(
                f"shard_dataloader: a global batch of {global_size} sample(s){where} cannot be split over "
                f"{layout.num_slices} data-parallel ranks (dp degree {layout.num_slices}: dim "
                f"{layout.shard_dim!r} of {layout.mesh}): torch.chunk gives slices of {sizes}, so "
                f"{sizes.count(0)} rank(s) would get no sample. Use a batch size that is a multiple of the "
                f"data-parallel degree ({layout.num_slices}), and drop_last=True if the dataset does not divide "
                "into whole batches (to drop a short last batch)"
            )


def _uneven_split(global_size: int, layouts: list[_MeshLayout]) -> tuple[_MeshLayout, list[int]] | None:
    """The first layout that splits `global_size` samples into unequal slices, with the slice sizes."""
    for layout in layouts:
        if layout.num_slices > 1 and global_size % layout.num_slices:
            return layout, _chunk_sizes(global_size, layout.num_slices)
    return None


def _uneven_warning(global_size: int, layout: _MeshLayout, sizes: list[int], where: str = "") -> str:
    return (
        f"shard_dataloader: a global batch of {global_size} sample(s){where} is split unevenly over "
        f"{layout.num_slices} data-parallel ranks (dim {layout.shard_dim!r} of {layout.mesh}): torch.chunk "
        f"gives slices of {sizes}. Data-parallel gradient averaging (the mean of the per-rank mean losses) "
        "then differs from one device's mean over the global batch: the samples of smaller slices weigh "
        f"more. To avoid it, use a batch size that is a multiple of the data-parallel degree ({layout.num_slices}) "
        "and drop_last=True (or a dataset size that divides into whole batches). A loss normalised by a "
        "per-rank count (e.g. tokens not ignored) has the same caveat: see distcore.dataloader's docstring"
    )


def _known_batch_sizes(dataloader) -> tuple[list[int], str] | None:
    """Every global batch size of an epoch and how they arise, when the loader tells them up front.

    Only for torch's own BatchSampler (a subclass may batch differently) over a sampler with a length.
    """
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return None
    batch_sampler = dataloader.batch_sampler
    if type(batch_sampler) is not BatchSampler:
        return None
    try:
        num_samples = len(batch_sampler.sampler)
    except TypeError:
        return None
    batch_size, drop_last = batch_sampler.batch_size, batch_sampler.drop_last
    full, rest = divmod(num_samples, batch_size)
    sizes = [batch_size] * full + ([rest] if rest and not drop_last else [])
    return sizes, f"{num_samples} samples, batch_size={batch_size}, drop_last={drop_last}"


def _check_not_distributed_sampler(dataloader) -> None:
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    samplers = [getattr(dataloader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)]
    if any(isinstance(sampler, DistributedSampler) for sampler in samplers):
        raise ValueError(
            "shard_dataloader: the DataLoader samples with torch's DistributedSampler, which already gives each "
            "rank a strided 1/num_replicas of the samples; shard_dataloader would slice each of those batches "
            "again, so every rank would see only a fraction of its data. Pass a plain sampler instead (e.g. "
            "DataLoader(dataset, batch_size=<global batch size>, shuffle=True)): shard_dataloader does the "
            "splitting, giving each data-parallel rank its contiguous slice of every global batch"
        )


def _loaded_slice(layouts: list[_MeshLayout], rank: int) -> tuple[int, int]:
    """The slice of each global batch this rank loads: (number of slices, index).

    Its own slice when every mesh holding it agrees on it; the full batch when they differ (it then
    cuts each mesh's slice itself). A rank in no mesh only needs the shapes: the smallest slice.
    """
    held = {(layout.num_slices, layout.slice_index(rank)) for layout in layouts if rank in layout.mesh}
    if len(held) == 1:
        return held.pop()
    if not held:
        return (max(layout.num_slices for layout in layouts), 0)
    return _FULL_BATCH


def _as_tensor(value):
    """A numeric numpy array (bools, ints, floats or complex numbers: a collate_fn's own) as a tensor sharing its
    memory: the batch's tensors, distributed and checked alike; anything else as is."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        return torch.from_numpy(value)
    return value


def _check_one_row_per_sample(batch) -> None:
    """A list, tuple or tensor batch: every tensor (of one dim or more) holds one row per sample on dim 0, the
    first tensor's count (each would be sliced by its own rows otherwise: another tensor's rows given to a rank)."""
    leaves = [leaf for leaf in _tensor_leaves(batch) if leaf.dim() > 0]
    if leaves and any(leaf.shape[0] != leaves[0].shape[0] for leaf in leaves):
        raise ValueError(
            f"shard_dataloader: the batch's tensors hold {[leaf.shape[0] for leaf in leaves]} row(s) on dim 0: each "
            "rank gets a slice of the samples, so every tensor must hold one row per sample (a vision-language "
            "model's per-image tensors can be split by their samples in a dict batch, with sample_rows)")


def _tensor_leaves(batch) -> list[torch.Tensor]:
    """The tensors of a collated batch (dicts, lists and tuples of them), in order: what `_distribute` makes
    DTensors of, numeric numpy arrays included."""
    batch = _as_tensor(batch)
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [leaf for value in batch.values() for leaf in _tensor_leaves(value)]
    if isinstance(batch, (list, tuple)):
        return [leaf for value in batch for leaf in _tensor_leaves(value)]
    return []


# ------------------------------------------------------------------------------------ shuffling


def _shuffling_sampler(dataloader):
    """The sampler that orders the samples, if it shuffles with a torch.Generator (or could)."""
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else getattr(dataloader, "sampler", None)
    if sampler is not None and hasattr(sampler, "generator"):
        if sampler.generator is None or isinstance(sampler.generator, torch.Generator):
            return sampler
    return None


class _ShuffleSync:
    """Gives every rank rank 0's shuffling for the coming epoch (collective over all ranks)."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.seedless = sampler is not None and sampler.generator is None  # it draws from the global RNG

    def __call__(self) -> None:
        if self.sampler is None or env.get_world_size() == 1:
            return
        if self.seedless:
            # RandomSampler's own draw, made on every rank (each rank's global RNG advances as a single
            # process's does: a draw on rank 0 only would leave the ranks' dropout masks apart), rank 0's kept.
            seed = _broadcast_from_rank0(int(torch.empty((), dtype=torch.int64).random_().item()))
            self.sampler.generator = torch.Generator().manual_seed(seed)
        else:
            state = _broadcast_from_rank0(self.sampler.generator.get_state())
            self.sampler.generator.set_state(state)


def _broadcast_from_rank0(value):
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


# ----------------------------------------------------------------------------- per-rank loading


class _SliceBatchSampler:
    """Wraps a batch sampler: yields only this rank's slice of each global batch's indices.

    Each pass queues the global batch sizes in order (the DataLoader keeps batches in order) so that
    the yielded DTensors get their global shape; `latest_sizes` is the queue of the pass started last.
    """

    def __init__(self, batch_sampler, *, loaded_slice: tuple[int, int], layouts: list[_MeshLayout], on_epoch_start):
        self.batch_sampler = batch_sampler
        self.loaded_slice = loaded_slice
        self.layouts = layouts
        self.on_epoch_start = on_epoch_start
        self.latest_sizes: collections.deque[int] = collections.deque()

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        # Called synchronously when a DataLoader pass starts: the caller picks up this pass's queue.
        self.latest_sizes = collections.deque()
        return self._slices(self.latest_sizes)

    def _slices(self, global_sizes: collections.deque):
        # Runs at the first request for indices, after the DataLoader drew its worker seed, as the
        # sampler's own first draw would: rank 0 then shuffles exactly like a single process.
        self.on_epoch_start()
        num_slices, index = self.loaded_slice
        for indices in self.batch_sampler:
            indices = list(indices)
            _check_batch_splits(len(indices), self.layouts)
            start, length = _slice_bounds(len(indices), num_slices, index)
            global_sizes.append(len(indices))
            yield indices[start : start + length]


def _can_load_per_rank(dataloader) -> bool:
    return (
        isinstance(dataloader, DataLoader)
        and not isinstance(dataloader.dataset, IterableDataset)
        and dataloader.batch_sampler is not None
    )


def _rebuilt_loader(dataloader: DataLoader, batch_sampler: _SliceBatchSampler) -> DataLoader:
    """The same loader (dataset, collate, workers, memory pinning, ...) over `batch_sampler`.

    in_order stays True: the queued global sizes and the other ranks rely on the batch order.
    """
    return DataLoader(
        dataloader.dataset,
        batch_sampler=batch_sampler,
        num_workers=dataloader.num_workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        prefetch_factor=dataloader.prefetch_factor,
        persistent_workers=dataloader.persistent_workers,
        pin_memory_device=dataloader.pin_memory_device,
        in_order=True,
    )


# ----------------------------------------------------------------------------- batch -> DTensors


def _to_dtensor(tensor: torch.Tensor, layout: _MeshLayout, *, global_size: int | None, loaded_slice, check_split) -> DTensor:
    """`tensor` (this rank's loaded samples) as a DTensor of the global batch on `layout`'s mesh."""
    if tensor.dim() == 0:  # not per sample (a custom collate's scalar): the same value everywhere
        return dtensor_from_local(tensor.to(env.device()), layout.mesh, [Replicate()] * layout.mesh.ndim, shape=())
    if global_size is None:  # the full batch was loaded
        global_size = tensor.shape[_BATCH_DIM]
    check_split(global_size, layout)
    rank = env.get_rank()
    index = layout.slice_index(rank)
    if index is None:  # not on this mesh: an empty shard, as torch gives ranks outside a DTensor's mesh
        local = tensor.new_empty(0)
    elif loaded_slice == (layout.num_slices, index):
        local = tensor
        expected = _slice_bounds(global_size, layout.num_slices, index)[1]
        if local.shape[_BATCH_DIM] != expected:
            raise ValueError(
                f"shard_dataloader: this rank loaded {expected} sample(s) but the collate_fn returned a tensor "
                f"with {local.shape[_BATCH_DIM]} rows on dim 0; with per-rank loading every tensor must hold "
                "one row per sample: pass per_rank_loading=False"
            )
    else:  # the full batch was loaded: cut this mesh's slice
        start, length = _slice_bounds(global_size, layout.num_slices, index)
        local = tensor.narrow(_BATCH_DIM, start, length)
    global_shape = (global_size, *tensor.shape[_BATCH_DIM + 1 :])
    return dtensor_from_local(local.to(env.device()), layout.mesh, layout.placements, shape=global_shape)


def _distribute(value, layout: _MeshLayout, **slicing):
    """Every tensor (and numeric numpy array) in `value` as a DTensor on `layout`; the rest as is."""
    value = _as_tensor(value)
    if torch.is_tensor(value):
        return _to_dtensor(value, layout, **slicing)
    if isinstance(value, Mapping):
        return _same_mapping(value, {key: _distribute(item, layout, **slicing) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return _same_sequence(value, [_distribute(item, layout, **slicing) for item in value])
    return value


def _same_mapping(original: Mapping, items: dict):
    try:
        return type(original)(items)
    except TypeError:
        return items


def _same_sequence(original, items: list):
    if isinstance(original, tuple) and hasattr(original, "_fields"):  # a namedtuple
        return type(original)(*items)
    try:
        return type(original)(items)
    except TypeError:
        return items


# ------------------------------------------------------------------------------------ the loader


class ShardDataloader:
    """A data loader yielding each global batch as DTensors sliced over the data-parallel ranks.

    Iterable and callable (`for batch in loader()`, as Paddle's loops do); `len()` is the original's.
    `dataloader`, `meshes` (a list) and `shard_dims` (one dim name or None per mesh) are what it was
    built from. Build it with `shard_dataloader`.
    """

    def __init__(self, dataloader, meshes, input_keys=None, shard_dims=None, *, per_rank_loading: bool | None = None,
                 sample_rows: SampleRows | None = None):
        env.init_parallel_env()
        self.sample_rows = sample_rows
        _check_not_distributed_sampler(dataloader)
        self.dataloader = dataloader
        self.meshes = _as_mesh_list(meshes)
        self._layouts = _mesh_layouts(self.meshes, shard_dims)
        self.shard_dims = [layout.shard_dim for layout in self._layouts]
        self.input_keys = list(input_keys) if input_keys is not None else None
        self._warned_uneven = False
        self._check_known_batch_sizes(per_rank_loading)
        for mesh in self.meshes:  # collective on creation: every rank creates them now, in the same order
            mesh.device_mesh
        self._sync_shuffling = _ShuffleSync(_shuffling_sampler(dataloader))
        self._loaded_slice, self._slice_sampler, self._loader = self._loading_plan(per_rank_loading)
        # The groups of ranks that load the same part of each global batch (known alike on every rank): they
        # compare what they loaded (_check_loaded_alike).
        loading: dict[tuple, list[int]] = {}
        for rank in range(env.get_world_size()):
            part = self._loaded_slice if self._slice_sampler is None else _loaded_slice(self._layouts, rank)
            loading.setdefault(part, []).append(rank)
        self._ranks_loading_alike = [ranks for ranks in loading.values() if len(ranks) > 1]

    def _loading_plan(self, per_rank_loading: bool | None):
        """(slice each rank loads, slice sampler or None, the loader to iterate)."""
        if per_rank_loading is None:
            # Not with a custom collate_fn, which may pad to the batch's longest sample, nor with a
            # DataLoader subclass, whose behaviour a rebuilt DataLoader would lose.
            per_rank_loading = (
                _can_load_per_rank(self.dataloader)
                and type(self.dataloader) is DataLoader
                and self.dataloader.collate_fn is default_collate
            )
        elif per_rank_loading and not _can_load_per_rank(self.dataloader):
            raise ValueError(
                "shard_dataloader: per_rank_loading=True needs a torch DataLoader over a map-style dataset with "
                "a batch sampler (batch_size=... or batch_sampler=...); leave per_rank_loading unset for this loader"
            )
        if not per_rank_loading:
            return _FULL_BATCH, None, self.dataloader
        loaded_slice = _loaded_slice(self._layouts, env.get_rank())
        sampler = _SliceBatchSampler(
            self.dataloader.batch_sampler, loaded_slice=loaded_slice, layouts=self._layouts,
            on_epoch_start=self._sync_shuffling,
        )
        return loaded_slice, sampler, _rebuilt_loader(self.dataloader, sampler)

    def _check_known_batch_sizes(self, per_rank_loading: bool | None) -> None:
        """Refuse now (not at an epoch's last batch) a global batch that leaves a rank empty; warn of uneven ones.

        Only when the batch sizes are known and the collated tensors have one row per sample: torch's
        default collate, or per-rank loading (which slices the indices themselves).
        """
        known = _known_batch_sizes(self.dataloader)
        if known is None or (self.dataloader.collate_fn is not default_collate and not per_rank_loading):
            return
        sizes, origin = known
        for size in dict.fromkeys(sizes[:1] + sizes[-1:]):  # the full batches' size and the last one's
            where = f" ({'the last batch of an epoch: ' if size != sizes[0] else ''}{origin})"
            _check_batch_splits(size, self._layouts, where=where)
            uneven = _uneven_split(size, self._layouts)
            if uneven is not None and not self._warned_uneven:
                self._warn_uneven(size, *uneven, where=where)

    def _check_split(self, global_size: int, layout: _MeshLayout) -> None:
        """Per batch: no rank left empty; a warning (once) when the slices differ in size."""
        _check_batch_splits(global_size, [layout])
        if not self._warned_uneven:
            uneven = _uneven_split(global_size, [layout])
            if uneven is not None:
                self._warn_uneven(global_size, *uneven)

    def _warn_uneven(self, global_size: int, layout: _MeshLayout, sizes: list[int], *, where: str = "") -> None:
        self._warned_uneven = True
        warnings.warn(_uneven_warning(global_size, layout, sizes, where), UserWarning, stacklevel=2)

    @property
    def loads_per_rank(self) -> bool:
        """Whether each rank reads only its own samples (else every rank reads whole batches)."""
        return self._slice_sampler is not None

    def __len__(self) -> int:
        return len(self.dataloader)

    def __call__(self):
        return iter(self)

    def __iter__(self):
        if self._slice_sampler is None:
            self._sync_shuffling()
            for batch in self._loader:
                self._check_loaded_alike(batch)
                yield self._distribute_batch(batch, global_size=None)
        else:
            batches = iter(self._loader)  # starts the slice sampler's pass, with its own queue of sizes
            global_sizes = self._slice_sampler.latest_sizes
            for batch in batches:
                self._check_loaded_alike(batch)
                yield self._distribute_batch(batch, global_size=global_sizes.popleft())

    def _check_loaded_alike(self, batch) -> None:
        """Ranks that load the same part of a global batch (tensor-parallel and pipeline ranks, and every rank
        where whole batches are read) must hold the same values: tensor parallel combines their partial results
        as if they computed on one copy. A dataset or collate_fn that draws random numbers (random masking,
        crops) with each rank seeded apart gives each its own, and training goes on silently wrong. One
        all-gather of a two-number fingerprint per batch (fp64 sums of every tensor's values and of its values
        weighted by their index), where some ranks share a part; every rank takes the same decision."""
        if not self._ranks_loading_alike:
            return
        plain = [torch.nan_to_num(leaf.detach().to("cpu", torch.float64).flatten(), nan=0.5, posinf=1.0, neginf=-1.0)
                 for leaf in _tensor_leaves(batch)]  # (a nan would differ from itself)
        fingerprint = torch.zeros(2, dtype=torch.float64)
        for k, values in enumerate(plain, start=1):
            fingerprint[0] += k * values.sum()
            fingerprint[1] += k * (values * torch.arange(values.numel(), dtype=torch.float64)).sum()
        gathered = [torch.empty(2, dtype=torch.float64, device=env.device()) for _ in range(env.get_world_size())]
        dist.all_gather(gathered, fingerprint.to(env.device()))
        apart = [ranks for ranks in self._ranks_loading_alike
                 if len({tuple(gathered[rank].tolist()) for rank in ranks}) > 1]
        if apart:
            raise ValueError(
                f"shard_dataloader: ranks {apart[0]} load the same part of the global batch but got different values: "
                "the dataset or collate_fn draws random numbers (random masking, crops, sampling) and the ranks' "
                "generators differ (each rank seeded apart: torch.manual_seed(seed + rank), accelerate's "
                "device_specific seeds). Tensor-parallel and pipeline ranks must compute on the same batch: seed "
                "torch, random and numpy alike on every rank (shard_dataloader keeps torch's global RNG in step), "
                "or move the random draws into the model")

    def _distribute_batch(self, batch, *, global_size: int | None):
        slicing = {"global_size": global_size, "loaded_slice": self._loaded_slice, "check_split": self._check_split}
        layouts = self._layouts
        # Only where the batch is split: each rank whole batches (dp 1, shard_dims None) takes every tensor as it is
        splits = any(layout.num_slices > 1 for layout in layouts)
        if isinstance(batch, Mapping):
            samples, starts = check_rows(batch, self.sample_rows, "shard_dataloader") if splits else (None, {})

            def item(key, value):
                layout = self._dict_layout(batch, key)
                if key in starts:
                    return self._media(value, key, starts, samples, layout)
                if torch.is_tensor(value) and value.dim() and value.shape[0] == 1 != samples and samples is not None:
                    # one row broadcast over the samples (position ids of [1, seq]): whole on every rank
                    return dtensor_from_local(value.to(env.device()), layout.mesh, [Replicate()] * layout.mesh.ndim,
                                              shape=tuple(value.shape))
                return _distribute(value, layout, **slicing)

            return _same_mapping(batch, {key: item(key, value) for key, value in batch.items()})
        if splits:
            _check_one_row_per_sample(batch)
        if isinstance(batch, (list, tuple)):
            # Pipeline: element i on stage i, the rest (labels, ...) on the last stage.
            items = [_distribute(item, layouts[min(i, len(layouts) - 1)], **slicing) for i, item in enumerate(batch)]
            return _same_sequence(batch, items)
        return _distribute(batch, layouts[0], **slicing)

    def _media(self, tensor: torch.Tensor, key: str, starts: dict, samples: int,
               layout: _MeshLayout) -> torch.Tensor | None:
        """A media tensor (rows of images, not samples: sample_rows.py) as this rank's rows, a plain tensor: the rows
        of its slice's samples where the whole batch was loaded (None where they hold no image), else all it loaded
        (its own samples'). Its ranks hold different numbers of rows, which no DTensor of one global shape describes;
        the model takes local values."""
        if self._loaded_slice != _FULL_BATCH:  # this rank's samples alone were loaded
            start, length = 0, samples
        else:
            index = layout.slice_index(env.get_rank())
            if index is None:
                return tensor.new_empty(0).to(env.device())
            start, length = _slice_bounds(samples, layout.num_slices, index)
        rows = take_samples(tensor, key, starts, start, start + length)
        return None if rows is None else rows.to(env.device())

    def _dict_layout(self, batch: Mapping, key) -> _MeshLayout:
        """Keys in input_keys go to the first mesh, the others to the last one."""
        if len(self._layouts) == 1:
            return self._layouts[0]
        if self.input_keys is None:
            raise ValueError(
                f"shard_dataloader: the batches are dicts (keys {list(batch)}) and there are {len(self.meshes)} "
                "meshes; pass input_keys=[...] naming the keys that go to the first mesh (the others go to the last)"
            )
        missing = [name for name in self.input_keys if name not in batch]
        if missing:
            raise ValueError(f"shard_dataloader: input_keys {missing} are not in the batch, whose keys are {list(batch)}")
        return self._layouts[0] if key in self.input_keys else self._layouts[-1]


def shard_dataloader(
    dataloader, meshes, input_keys=None, shard_dims=None, *, per_rank_loading: bool | None = None,
    sample_rows: SampleRows | None = None
) -> ShardDataloader:
    """Paddle's `dist.shard_dataloader`: `dataloader`'s global batches, sliced over the data-parallel ranks.

    meshes: a ProcessMesh (every tensor lives on it) or a list (pipeline stages): element i of a
      list/tuple batch goes to meshes[min(i, len - 1)]; in a dict batch the `input_keys` go to the first
      mesh and the other keys to the last.
    shard_dims: the data-parallel mesh dim (name or index) that splits dim 0 of the batch, one for all
      meshes or a list with one per mesh; None replicates the batch.
    per_rank_loading: None (auto, see the module docstring), True or False.
    sample_rows: a vision-language model's media (`sample_rows_of(model)`, which to_distributed passes): their
      tensors' rows (images, patches) go to the rank holding their samples, as plain tensors of its own rows. A
      dict batch's tensor of another row count than the samples' that it does not describe is refused.
    """
    return ShardDataloader(dataloader, meshes, input_keys, shard_dims, per_rank_loading=per_rank_loading,
                           sample_rows=sample_rows)
