"""The seeds' 8-device examples on 8 gloo processes.

- The Paddle notes' hybrid-parallel example (seeds/003, section 4.4), as written: tensor-parallel
  weights on two 2x2 meshes, data parallel over 'x', the activation resharded from one mesh to the
  other (pipeline), shard_dataloader over both meshes, shard_optimizer, the plain loop.
- paddle.distributed.parallelize's dp x mp x pp example (seeds/001), on its runnable model.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

from tridist import distcore as dist_api
from tridist.bench.models import build_model
from tests.distributed import equivalence
from tests.distributed.harness import run_checks

SEQ_LEN, HIDDEN, BATCH, SAMPLES, STEPS = 4, 8, 4, 12, 3

mesh0 = dist_api.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
mesh1 = dist_api.ProcessMesh([[4, 5], [6, 7]], dim_names=["x", "y"])


class RandomDataset(Dataset):
    def __init__(self, seq_len, hidden, num_samples=100):
        self.seq_len, self.hidden, self.num_samples = seq_len, hidden, num_samples

    def __getitem__(self, index):
        return np.random.RandomState(index).uniform(size=[self.seq_len, self.hidden]).astype("float32")

    def __len__(self):
        return self.num_samples


def initial_weights():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(HIDDEN, 4 * HIDDEN, generator=generator) * 0.1, torch.randn(4 * HIDDEN, HIDDEN, generator=generator) * 0.1


class MlpModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        w0, w1 = initial_weights()
        self.w0 = dist_api.shard_tensor(torch.nn.Parameter(w0), mesh0, [dist_api.Replicate(), dist_api.Shard(1)])
        self.w1 = dist_api.shard_tensor(torch.nn.Parameter(w1), mesh1, [dist_api.Replicate(), dist_api.Shard(0)])

    def forward(self, x):
        x = dist_api.shard_tensor(x, mesh0, [dist_api.Shard(0), dist_api.Replicate()])
        y = torch.matmul(x, self.w0)
        y = dist_api.reshard(y, mesh1, [dist_api.Shard(0), dist_api.Shard(2)])
        z = torch.matmul(y, self.w1)
        return z


def loader():
    dataset = RandomDataset(SEQ_LEN, HIDDEN, SAMPLES)
    return DataLoader(dataset, batch_sampler=BatchSampler(SequentialSampler(dataset), batch_size=BATCH, drop_last=False))


# The example's AdamW, with eps raised from 1e-8 to 1e-3 in both runs so that its update cannot turn the
# rounding of a near-zero gradient into a ±lr step (equivalence.py).
ADAMW = {"lr": 1e-3, "eps": 1e-3}


def single_process() -> equivalence.Trace:
    params = {name: torch.nn.Parameter(w) for name, w in zip(("w0", "w1"), initial_weights())}
    optimizer = torch.optim.AdamW(params.values(), **ADAMW)
    trace = equivalence.Trace()
    for data in loader():
        loss = torch.mean((data @ params["w0"]) @ params["w1"])
        loss.backward()
        trace.step(params, loss)
        optimizer.step()
        optimizer.zero_grad()
    return trace.end(params)


def check_the_notes_hybrid_example():
    model = MlpModel()
    dataloader = dist_api.shard_dataloader(loader(), meshes=[mesh0, mesh1], shard_dims="x")
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    opt = dist_api.shard_optimizer(opt)
    on_mesh1 = dist.get_rank() in mesh1  # the stage holding w1, where the loss is
    own = {"w1": model.w1} if on_mesh1 else {"w0": model.w0}  # each stage compares its own weight
    trace = equivalence.Trace()
    for step, inputs in enumerate(dataloader):
        data = inputs
        logits = model(data)
        loss = torch.mean(logits)
        loss.backward()
        trace.step(own, dist_api.unshard_dtensor(loss) if on_mesh1 else 0.0)
        opt.step()
        opt.clear_grad()
    reference = single_process()
    assert len(trace.losses) == len(reference.losses) == SAMPLES // BATCH
    equivalence.assert_same_training(trace.end(own), reference, losses=on_mesh1)


def _paddle_llama():
    torch.manual_seed(0)
    model = build_model("paddle-llama")
    # SGD rather than the example's AdamW: its update is linear in the gradient, so the sums that tensor
    # and pipeline parallelism reorder stay at rounding level in the comparison.
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def _llama_batches():
    generator = torch.Generator().manual_seed(11)
    vocab = build_model("paddle-llama").lm_head.weight.shape[1]
    return [tuple(torch.randint(0, vocab, (8, 8), generator=generator) for _ in range(2)) for _ in range(STEPS)]


def check_the_parallelize_example_dp_mp_pp():
    """paddle.distributed.parallelize's own example, config as written: mesh [[[0,1],[2,3]],[[4,5],[6,7]]]
    with dims dp, mp, pp; sharding level 1; the Llama plan with sequence parallel (its
    `llama.position_embedding` key names a module the model lacks: a warning); split_spec 'llama.layers'.
    Losses and final parameters equal one process."""
    mesh = dist_api.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dim_names=["dp", "mp", "pp"])
    dist_api.set_mesh(mesh)
    parallel_config = {
        "dp_config": {"sharding_level": 1},
        "mp_config": {
            "parallelize_plan": {
                "llama.embed_tokens": [dist_api.ColWiseParallel(), dist_api.SequenceParallelBegin()],
                "llama.position_embedding": [dist_api.ColWiseParallel(), dist_api.SequenceParallelBegin()],
                "llama.layers.*.self_attn.qkv_proj": dist_api.ColWiseParallel(),
                "llama.layers.*.self_attn.o_proj": dist_api.RowWiseParallel(),
                "llama.layers.*.self_attn": dist_api.SequenceParallelDisable(),
                "llama.layers.*.mlp.gate_up_proj": dist_api.ColWiseParallel(),
                "llama.layers.*.mlp.down_proj": dist_api.RowWiseParallel(),
                "llama.layers.*.mlp": dist_api.SequenceParallelDisable(need_transpose=False),
                "lm_head.weight": dist_api.ColWiseParallel(),
                "lm_head": dist_api.SequenceParallelEnd(),
            }
        },
        "pp_config": {"split_spec": "llama.layers"},
    }
    reference, ref_optimizer = _paddle_llama()
    ref_trace = equivalence.train(reference, ref_optimizer, _llama_batches())
    model, optimizer = _paddle_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist_model, dist_optimizer = dist_api.parallelize(model, optimizer, config=parallel_config)
    assert any("llama.position_embedding" in str(w.message) for w in caught), [str(w.message) for w in caught]
    trace = equivalence.Trace()
    for inputs, labels in _llama_batches():
        inputs, labels = (dist_api.shard_tensor(t, mesh, [dist_api.Shard(0), dist_api.Replicate(), dist_api.Replicate()])
                          for t in (inputs, labels))
        loss, _ = dist_model(inputs, labels=labels)
        loss.backward()
        trace.step(dist_model, loss)
        dist_optimizer.step()
        dist_optimizer.clear_grad()
    trace.end(dist_model)
    names = set(trace.parameters)
    assert names and names < set(ref_trace.parameters), names  # this pipeline stage's parameters, same names
    equivalence.assert_same_training(trace, ref_trace)


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    dist_api.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
