"""Checks of shard_dataloader and DataParallel on 4 gloo processes (run by tests/distributed/test_data.py)."""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, SequentialSampler, TensorDataset,
)

from tridist import distcore
import tridist.distcore.dataloader as dataloader_module
from tridist.distcore import ProcessMesh, Replicate, Shard
from tests.distributed import equivalence
from tests.distributed.harness import run_checks

FEATURES = 3  # width of each sample's input row


def rank() -> int:
    return dist.get_rank()


class Samples(Dataset):
    """Sample i is (a row of i's, the label i); remembers which indices this process read."""

    def __init__(self, size: int, *, as_dict: bool = False, extra: bool = False):
        self.size, self.as_dict, self.extra = size, as_dict, extra
        self.seen: list[int] = []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        self.seen.append(index)
        row, label = torch.full((FEATURES,), float(index)), torch.tensor(index)
        if self.as_dict:
            return {"input_ids": row, "labels": label, "name": f"sample{index}"}
        return (row, label, torch.tensor([index, -index])) if self.extra else (row, label)


class StreamedSamples(IterableDataset):
    def __init__(self, size: int):
        self.size = size

    def __iter__(self):
        return ((torch.full((FEATURES,), float(i)), torch.tensor(i)) for i in range(self.size))


def sequential_loader(dataset, batch_size: int, drop_last: bool = False) -> DataLoader:
    """The seeds' loader: an explicit BatchSampler over a SequentialSampler."""
    sampler = BatchSampler(SequentialSampler(dataset), batch_size=batch_size, drop_last=drop_last)
    return DataLoader(dataset, batch_sampler=sampler)


def expect_error(error_type, fragments, call) -> None:
    try:
        call()
    except error_type as error:
        for fragment in fragments:
            assert fragment in str(error), f"{fragment!r} not in: {error}"
    else:
        raise AssertionError(f"expected {error_type.__name__} mentioning {fragments}")


def rows(tensor) -> list:
    return distcore.local_value(tensor)[:, 0].tolist()


DP_MP = ([[0, 1], [2, 3]], ["dp", "mp"])


# -------------------------------------------------------------------------------- shard_dataloader


def check_batches_on_a_2x2_mesh_match_one_process():
    mesh = ProcessMesh(*DP_MP)
    dataset = Samples(12)
    loader = sequential_loader(dataset, batch_size=6)
    expected = list(loader)
    dataset.seen.clear()
    dist_loader = distcore.shard_dataloader(loader, mesh, shard_dims="dp")
    assert dist_loader.loads_per_rank and dist_loader.dataloader is loader
    assert dist_loader.meshes == [mesh] and dist_loader.shard_dims == ["dp"]
    batches = list(dist_loader())  # callable, as in Paddle's loops
    assert len(batches) == len(expected) == len(dist_loader) == len(loader) == 2
    dp = rank() // 2
    for (inputs, labels), (expected_inputs, expected_labels) in zip(batches, expected):
        assert isinstance(inputs, DTensor) and tuple(inputs.shape) == (6, FEATURES)
        assert tuple(inputs.placements) == (Shard(0), Replicate())
        assert labels.dtype == torch.int64 and inputs.dtype == torch.float32
        assert torch.equal(distcore.unshard_dtensor(inputs), expected_inputs)
        assert torch.equal(distcore.unshard_dtensor(labels), expected_labels)
        assert torch.equal(distcore.local_value(inputs), expected_inputs[3 * dp : 3 * dp + 3])  # contiguous
    shards = [None] * 4
    dist.all_gather_object(shards, [distcore.local_value(b[0]) for b in batches])
    for peer in (0, 2):  # mp peers (same dp index) hold the same slices
        assert all(torch.equal(a, b) for a, b in zip(shards[peer], shards[peer + 1]))
    assert sorted(dataset.seen) == [i + 3 * dp for i in (0, 1, 2, 6, 7, 8)]  # only its own samples read
    assert [rows(b[0]) for b in dist_loader] == [rows(b[0]) for b in batches]  # iterable again


def check_uneven_last_batch():
    mesh = ProcessMesh(*DP_MP)
    loader = sequential_loader(Samples(7), batch_size=4)
    batches = list(distcore.shard_dataloader(loader, mesh, shard_dims="dp"))
    assert [tuple(b[0].shape) for b in batches] == [(4, FEATURES), (3, FEATURES)]
    dp = rank() // 2
    assert rows(batches[0][0]) == ([0.0, 1.0] if dp == 0 else [2.0, 3.0])
    assert rows(batches[1][0]) == ([4.0, 5.0] if dp == 0 else [6.0])  # 3 rows: 2 + 1
    assert distcore.unshard_dtensor(batches[1][1]).tolist() == [4, 5, 6]


def check_two_meshes_pipeline():
    """Stage 0 holds the inputs, stage 1 the labels (and any further element)."""
    stage0, stage1 = ProcessMesh([0, 1], ["dp"]), ProcessMesh([2, 3], ["dp"])
    dataset = Samples(8, extra=True)
    loader = sequential_loader(dataset, batch_size=4)
    dist_loader = distcore.shard_dataloader(loader, [stage0, stage1], shard_dims="dp")
    assert dist_loader.shard_dims == ["dp", "dp"]
    for step, (inputs, labels, extra) in enumerate(dist_loader()):
        assert tuple(inputs.shape) == (4, FEATURES) and tuple(labels.shape) == (4,) and tuple(extra.shape) == (4, 2)
        assert inputs.device_mesh is stage0.device_mesh
        assert labels.device_mesh is stage1.device_mesh and extra.device_mesh is stage1.device_mesh
        own = [4 * step + 2 * (rank() % 2), 4 * step + 2 * (rank() % 2) + 1]  # dp index within the stage
        if rank() in (0, 1):
            assert rows(inputs) == [float(i) for i in own]
            assert distcore.local_value(labels).numel() == 0 and distcore.local_value(extra).numel() == 0
        else:
            assert distcore.local_value(labels).tolist() == own
            assert distcore.local_value(extra)[:, 0].tolist() == own
            assert distcore.local_value(inputs).numel() == 0
    assert sorted(dataset.seen) == [i + 2 * (rank() % 2) for i in (0, 1, 4, 5)]


def check_dict_batches_and_input_keys():
    stage0, stage1 = ProcessMesh([0, 1], ["dp"]), ProcessMesh([2, 3], ["dp"])
    loader = sequential_loader(Samples(4, as_dict=True), batch_size=4)
    batch = next(iter(distcore.shard_dataloader(loader, [stage0, stage1], input_keys=["input_ids"], shard_dims="dp")))
    assert batch["input_ids"].device_mesh is stage0.device_mesh and batch["labels"].device_mesh is stage1.device_mesh
    assert tuple(batch["input_ids"].shape) == (4, FEATURES) and tuple(batch["labels"].shape) == (4,)
    own = [2 * (rank() % 2), 2 * (rank() % 2) + 1]
    assert batch["name"] == [f"sample{i}" for i in own]  # not a tensor: as collated (this rank's samples)
    if rank() in (0, 1):
        assert rows(batch["input_ids"]) == [float(i) for i in own]
    else:
        assert distcore.local_value(batch["labels"]).tolist() == own
    one_mesh = next(iter(distcore.shard_dataloader(loader, ProcessMesh(*DP_MP), shard_dims="dp")))
    assert distcore.unshard_dtensor(one_mesh["labels"]).tolist() == [0, 1, 2, 3]
    without_keys = distcore.shard_dataloader(loader, [stage0, stage1], shard_dims="dp")
    expect_error(ValueError, ["input_keys", "'input_ids'", "2 meshes"], lambda: next(iter(without_keys)))


def check_shuffled_loader_gives_every_rank_the_same_batches():
    """Each rank seeds its RNG differently on purpose; all follow rank 0, which matches one process."""
    mesh = ProcessMesh([0, 1, 2, 3], ["dp"])
    dataset = Samples(16)
    epochs = 2  # the second epoch reshuffles: synchronised again

    def labels_per_epoch(loader, unshard):
        return [[(unshard(y) if unshard else y).tolist() for _, y in loader] for _ in range(epochs)]

    torch.manual_seed(1234)  # the single-process reference, as rank 0 seeds it
    expected = labels_per_epoch(DataLoader(dataset, batch_size=4, shuffle=True), None)
    torch.manual_seed(1234 + 1000 * rank())  # rank 0: 1234; the others differ
    dist_loader = distcore.shard_dataloader(DataLoader(dataset, batch_size=4, shuffle=True), mesh, shard_dims="dp")
    assert labels_per_epoch(dist_loader, distcore.unshard_dtensor) == expected
    assert expected[0] != expected[1]

    # A generator given to the DataLoader, seeded differently per rank: rank 0's state wins.
    def seeded_loader(seed: int) -> DataLoader:
        return DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))

    expected = labels_per_epoch(seeded_loader(7), None)
    dist_loader = distcore.shard_dataloader(seeded_loader(7 + rank()), mesh, shard_dims=0)  # a dim index
    assert labels_per_epoch(dist_loader, distcore.unshard_dtensor) == expected

    # Every rank seeded alike: each rank's global RNG ends where one process's does (a draw on rank 0 alone
    # would leave the ranks' dropout masks apart after the first epoch: tensor-parallel replicas diverged).
    torch.manual_seed(99)
    labels_per_epoch(DataLoader(dataset, batch_size=4, shuffle=True), None)
    expected_state = torch.get_rng_state()
    torch.manual_seed(99)
    labels_per_epoch(distcore.shard_dataloader(DataLoader(dataset, batch_size=4, shuffle=True), mesh, shard_dims="dp"),
                     distcore.unshard_dtensor)
    assert torch.equal(torch.get_rng_state(), expected_state)


class RandomlyMasked(Dataset):
    """MLM-style: sample i is a row of i's with one position, drawn from python's `random`, masked to -1."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index):
        row = torch.full((FEATURES,), float(index))
        row[random.randrange(FEATURES)] = -1.0
        return row, torch.tensor(index)


def check_ranks_that_load_the_same_samples_must_get_the_same_values():
    """Tensor-parallel ranks load the same samples; a dataset (or collate_fn) that draws random numbers with each
    rank seeded apart gave each its own values, and tensor parallel would combine partial results of different
    inputs, silently. Refused at the batch, on every rank, naming the cause; seeded alike, the batches pass.
    Per-rank loading (the dataset's own draws) and whole-batch loading (a collate_fn's torch draws) alike."""
    mesh = ProcessMesh(*DP_MP)

    def masking_collate(samples):  # a custom collate_fn: whole batches are read on every rank
        rows = torch.stack([row for row, _ in samples])
        rows[torch.rand(rows.shape) < 0.5] = -1.0
        return rows, torch.stack([label for _, label in samples])

    def numpy_masking_collate(samples):  # numpy arrays, which shard_dataloader distributes as tensors
        rows = np.stack([row.numpy() for row, _ in samples])
        rows[np.random.rand(*rows.shape) < 0.5] = -1.0
        return rows, np.stack([label.numpy() for _, label in samples])

    for loader, seed in ((sequential_loader(RandomlyMasked(), batch_size=4), random.seed),
                         (DataLoader(Samples(8), batch_size=4, collate_fn=masking_collate), torch.manual_seed),
                         (DataLoader(Samples(8), batch_size=4, collate_fn=numpy_masking_collate), np.random.seed)):
        seed(7 + rank())
        expect_error(ValueError, ["load the same part of the global batch but got different values",
                                  "seed torch, random and numpy alike"],
                     lambda: next(iter(distcore.shard_dataloader(loader, mesh, shard_dims="dp"))))
        seed(7)
        assert len(list(distcore.shard_dataloader(loader, mesh, shard_dims="dp"))) == 2


def check_whole_batch_fallbacks():
    """Iterable datasets and custom collate_fns: whole batches are read and sliced on every rank."""
    mesh = ProcessMesh(*DP_MP)
    streamed = DataLoader(StreamedSamples(10), batch_size=4)
    dist_loader = distcore.shard_dataloader(streamed, mesh, shard_dims="dp")
    assert not dist_loader.loads_per_rank
    batches = list(dist_loader)
    assert [tuple(b[0].shape) for b in batches] == [(4, FEATURES), (4, FEATURES), (2, FEATURES)]
    assert [distcore.unshard_dtensor(b[1]).tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert rows(batches[2][0]) == ([8.0] if rank() < 2 else [9.0])

    def padding_collate(samples):  # pads to the longest sample of the batch: per-slice collation would differ
        return torch.nn.utils.rnn.pad_sequence([torch.arange(int(label) + 1) for _, label in samples], batch_first=True)

    padded = DataLoader(Samples(4), batch_size=4, collate_fn=padding_collate)
    dist_padded = distcore.shard_dataloader(padded, mesh, shard_dims="dp")
    assert not dist_padded.loads_per_rank
    (batch,) = list(dist_padded)
    assert tuple(batch.shape) == (4, 4) and torch.equal(distcore.unshard_dtensor(batch), next(iter(padded)))
    assert distcore.shard_dataloader(padded, mesh, shard_dims="dp", per_rank_loading=True).loads_per_rank


def check_replicated_when_no_shard_dims():
    mesh = ProcessMesh(*DP_MP)
    (inputs, _), _ = list(distcore.shard_dataloader(sequential_loader(Samples(6), batch_size=3), mesh))
    assert tuple(inputs.placements) == (Replicate(), Replicate()) and rows(inputs) == [0.0, 1.0, 2.0]


def check_errors():
    mesh = ProcessMesh(*DP_MP)
    loader = sequential_loader(Samples(6), batch_size=3)
    expect_error(ValueError, ["'pp'", "['dp', 'mp']"], lambda: distcore.shard_dataloader(loader, mesh, shard_dims="pp"))
    expect_error(ValueError, ["2 shard_dims", "1 mesh"], lambda: distcore.shard_dataloader(loader, mesh, shard_dims=["dp", "mp"]))
    expect_error(TypeError, ["ProcessMesh"], lambda: distcore.shard_dataloader(loader, [[0, 1]], shard_dims="dp"))
    dp4 = ProcessMesh([0, 1, 2, 3], ["dp"])
    expect_error(  # the sizes are known: refused when built
        ValueError, ["batch of 3", "4 data-parallel ranks", "[1, 1, 1, 0]", "drop_last"],
        lambda: distcore.shard_dataloader(loader, dp4, shard_dims="dp"),
    )
    streamed_loader = DataLoader(StreamedSamples(3), batch_size=3)
    streamed = distcore.shard_dataloader(streamed_loader, dp4, shard_dims="dp")  # sizes unknown: checked per batch
    expect_error(ValueError, ["batch of 3", "4 data-parallel ranks", "[1, 1, 1, 0]", "multiple of"], lambda: list(streamed))


def check_batch_sizes_are_checked_when_built():
    """A global batch that leaves a dp rank empty is refused by shard_dataloader, not at an epoch's end."""
    dp4 = ProcessMesh([0, 1, 2, 3], ["dp"])
    expect_error(  # 6 >= 4 samples, yet torch.chunk gives 2, 2, 2, 0
        ValueError,
        ["batch of 6", "4 data-parallel ranks", "[2, 2, 2, 0]", "multiple of the data-parallel degree (4)", "drop_last=True"],
        lambda: distcore.shard_dataloader(sequential_loader(Samples(12), batch_size=6), dp4, shard_dims="dp"),
    )
    dataset = Samples(10)  # batches of 4, 4 and a last one of 2
    expect_error(
        ValueError, ["batch of 2", "last batch of an epoch", "10 samples", "[1, 1, 0, 0]", "drop_last=True"],
        lambda: distcore.shard_dataloader(DataLoader(dataset, batch_size=4, shuffle=True), dp4, shard_dims="dp"),
    )
    expect_error(  # also when every rank reads whole batches
        ValueError, ["batch of 2", "[1, 1, 0, 0]"],
        lambda: distcore.shard_dataloader(DataLoader(dataset, batch_size=4), dp4, shard_dims="dp", per_rank_loading=False),
    )
    assert dataset.seen == []  # refused before reading anything
    dropped = distcore.shard_dataloader(DataLoader(dataset, batch_size=4, drop_last=True), dp4, shard_dims="dp")
    assert [tuple(b[0].shape) for b in dropped] == [(4, FEATURES)] * 2
    # On a 2x2 mesh the dp degree is 2: a last batch of 2 is fine there, and replicated batches need no split.
    assert len(list(distcore.shard_dataloader(DataLoader(dataset, batch_size=4), ProcessMesh(*DP_MP), shard_dims="dp"))) == 3
    assert len(list(distcore.shard_dataloader(sequential_loader(Samples(3), batch_size=3), dp4))) == 1


def _uneven_warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "unevenly" in str(w.message)]


def check_uneven_batches_warn_once():
    """Slices of unequal sizes: DDP's mean of per-rank means is no longer the global batch's mean."""
    mesh = ProcessMesh(*DP_MP)

    def two_epochs(loader):
        def run():
            dist_loader = distcore.shard_dataloader(loader, mesh, shard_dims="dp")
            for _ in range(2):
                list(dist_loader)
        return run

    # Known sizes (batches of 4 and 3 over dp 2): warned once, when built.
    (message,) = _uneven_warnings(two_epochs(sequential_loader(Samples(7), batch_size=4)))
    for fragment in ["batch of 3", "last batch of an epoch", "2 data-parallel ranks", "[2, 1]", "mean of the per-rank mean",
                     "one device's mean", "multiple of the data-parallel degree (2)", "drop_last=True", "tokens not ignored"]:
        assert fragment in message, f"{fragment!r} not in: {message}"
    # Unknown sizes (an iterable dataset: batches of 3, 3, 2): warned once, at the first uneven batch.
    (message,) = _uneven_warnings(two_epochs(DataLoader(StreamedSamples(8), batch_size=3)))
    assert "batch of 3" in message and "[2, 1]" in message
    assert _uneven_warnings(two_epochs(sequential_loader(Samples(8), batch_size=4))) == []  # even: no warning
    doc = dataloader_module.__doc__
    assert "mean of the per-rank mean losses" in doc and "tokens that are not ignored" in doc


def check_distributed_sampler_is_refused():
    """torch's DistributedSampler strides the samples per rank: slicing its batches again would lose data."""
    dataset = Samples(16)
    mesh = ProcessMesh([0, 1, 2, 3], ["dp"])
    sampler = DistributedSampler(dataset, num_replicas=4, rank=rank(), shuffle=False)
    for loader in (
        DataLoader(dataset, batch_size=4, sampler=sampler),
        DataLoader(dataset, batch_sampler=BatchSampler(sampler, batch_size=4, drop_last=False)),
    ):
        expect_error(
            ValueError, ["DistributedSampler", "fraction", "plain sampler", "shard_dataloader does the splitting"],
            lambda: distcore.shard_dataloader(loader, mesh, shard_dims="dp"),
        )


# ------------------------------------------------------------------------------------ DataParallel


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = {"hidden_size": 8}  # a model attribute users reach through the wrapper
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def forward(self, x):
        return self.layers(x)

    def describe(self) -> str:
        return "mlp"


def _train(model, batches, steps: int, *, forward=None) -> equivalence.Trace:
    """SGD steps; the trace holds the plain module's parameters (DDP's .module: Paddle's names). The
    loss of a data-parallel rank is its own rows' mean, so losses are not compared."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = getattr(model, "module", model)
    trace = equivalence.Trace()
    for step, batch in zip(range(steps), batches):
        loss = (forward or _mse)(model, step, batch)
        loss.backward()
        trace.step(plain, loss)
        optimizer.step()
        optimizer.zero_grad()
    return trace.end(plain)


def _mse(model, step, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(distcore.local_value(inputs)), distcore.local_value(targets))


def check_data_parallel_matches_one_process():
    steps, global_batch = 3, 8  # 3 steps over 16 samples: the second epoch is reached
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator))
    loader = DataLoader(dataset, batch_size=global_batch)

    def epochs(iterable):
        while True:
            yield from iterable()

    torch.manual_seed(0)
    reference = MLP()
    ref_trace = _train(reference, epochs(lambda: iter(loader)), steps)

    torch.manual_seed(0)
    model = distcore.DataParallel(MLP())
    assert isinstance(model, DistributedDataParallel)
    assert model.config == {"hidden_size": 8} and model.describe() == "mlp" and isinstance(model.module, MLP)
    assert set(model.state_dict()) == set(reference.state_dict())  # Paddle's keys: no "module." prefix
    dist_loader = distcore.shard_dataloader(loader, ProcessMesh([0, 1, 2, 3], ["dp"]), shard_dims="dp")
    equivalence.assert_same_training(_train(model, epochs(dist_loader), steps), ref_trace, losses=False)


def check_data_parallel_over_the_dp_dim_of_a_2x2_mesh():
    """group=(mesh, "dp") / dim_name="dp": the dp group through this rank, {r, r + 2}, from the mesh's DeviceMesh."""
    mesh = ProcessMesh(*DP_MP)
    dp_peers = [rank() % 2, rank() % 2 + 2]
    for group in ({"group": (mesh, "dp")}, {"group": mesh, "dim_name": "dp"}):
        model = distcore.DataParallel(MLP(), **group)
        assert dist.get_process_group_ranks(model.process_group) == dp_peers
        members = torch.tensor([2.0 ** rank()])  # the sum over the group spells out its members, in binary
        dist.all_reduce(members, group=model.process_group)
        assert members.item() == sum(2.0**peer for peer in dp_peers), (members.item(), dp_peers)

    def refused(**group):
        try:
            distcore.DataParallel(MLP(), **group)
        except ValueError as error:
            assert "get_submesh_with_dim" not in str(error)  # a per-rank mesh would wire the groups wrongly
            return str(error)
        raise AssertionError(f"DataParallel accepted {group}")

    message = refused(group=mesh)
    assert "2-D" in message and "(mesh, 'dp')" in message and "dim_name='dp'" in message
    assert "'pp'" in refused(group=(mesh, "pp")) and "'pp'" in refused(group=mesh, dim_name="pp")

    # Training: each dp slice of a global batch of 8 on 2 dp ranks (mp peers alike) equals one process.
    steps = 3
    generator = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator))
    loader = DataLoader(dataset, batch_size=8)
    torch.manual_seed(0)
    reference = MLP()
    ref_trace = _train(reference, (batch for _ in range(2) for batch in loader), steps)
    torch.manual_seed(0)
    model = distcore.DataParallel(MLP(), group=(mesh, "dp"))
    dist_loader = distcore.shard_dataloader(loader, mesh, shard_dims="dp")
    trace = _train(model, (batch for _ in range(2) for batch in dist_loader), steps)
    equivalence.assert_same_training(trace, ref_trace, losses=False)


class NestedSamples(Dataset):
    """Sample i is {"inputs": [x_i], "targets": y_i, "tag": "s"}: a nested batch once collated."""

    def __init__(self, inputs, targets):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        return {"inputs": [self.inputs[index]], "targets": self.targets[index], "tag": "s"}


class LossMLP(MLP):
    """Paddle's loop `loss = model(batch)`: the model takes the whole (nested) batch."""

    def forward(self, batch, scale=None):
        (inputs,) = batch["inputs"]
        loss = torch.nn.functional.mse_loss(self.layers(inputs), batch["targets"])
        return loss if scale is None else loss * scale[0]


def check_data_parallel_takes_shard_dataloader_batches():
    """shard_dataloader's DTensors (nested in dicts and lists, positional or keyword) go straight in."""
    steps = 4
    generator = torch.Generator().manual_seed(2)
    dataset = NestedSamples(torch.randn(16, 4, generator=generator), torch.randn(16, 2, generator=generator))
    loader = DataLoader(dataset, batch_size=8)
    scale = [torch.tensor(1.0)]

    def forward(model, step, batch):
        return model(batch, scale=scale) if step % 2 else model(batch=batch)

    torch.manual_seed(0)
    reference = LossMLP()
    ref_trace = _train(reference, (batch for _ in range(2) for batch in loader), steps, forward=forward)
    torch.manual_seed(0)
    mesh = ProcessMesh([0, 1, 2, 3], ["dp"])
    model = distcore.DataParallel(LossMLP(), group=mesh)  # a 1-D mesh, the same on every rank
    assert dist.get_process_group_ranks(model.process_group) == [0, 1, 2, 3]
    dist_loader = distcore.shard_dataloader(loader, mesh, shard_dims="dp")
    batch = next(iter(dist_loader))
    assert isinstance(batch["inputs"][0], DTensor) and isinstance(batch["targets"], DTensor)
    trace = _train(model, (batch for _ in range(2) for batch in dist_loader), steps, forward=forward)
    equivalence.assert_same_training(trace, ref_trace, losses=False)


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
