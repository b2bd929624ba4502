"""`tridist demo`: the to_distributed seed's example end to end on the local devices.

Builds the seed's Llama-like model (small), its random-token dataloader and SGD optimizer, lets
`distcore.to_distributed` choose and apply a strategy for the devices of this machine (the GPUs, or
CPU processes with gloo), trains a few steps with the seed's loop as written, and shows the chosen
strategy and the losses next to a single-device run of the same model on the same batches.

Without torchrun it launches itself under torchrun (one process per GPU, or `--nproc` CPU processes).
Exits non-zero when the distributed losses differ from the single-device ones.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# Small enough for CPU processes, big enough to split: 4 heads and 4 layers divide tp and pp of 2 and 4.
DEMO_CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_attention_heads=4,
                   num_hidden_layers=4, max_position_embeddings=64)
BATCH_SIZE, BATCH_NUM, SEQ_LENGTH, LEARNING_RATE = 8, 4, 64, 0.1
# fp32 on both sides; tensor/pipeline/data parallelism only reorder sums. A loss is a chain of fp32 sums
# of a few thousand terms (n): reordered, it moves by at most ~2·n·u ~ 1e-4 of itself (u = 2^-24, the
# worst case; measured ~1e-7). After an SGD step the parameters may also differ by that relative rounding
# of their update, which moves the loss by at most 1e-3 of how far training moved it. The same criterion
# as the test suite's (tests/distributed/equivalence.py); a real bug (a dropped average, a skipped
# micro-batch) moves the loss by a fraction of its change, orders of magnitude above.
LOSS_RTOL, DRIFT_RTOL = 1e-4, 1e-3


def launch(nproc: int | None) -> int:
    """Run the demo under torchrun on this machine; returns its exit status."""
    import torch

    if nproc is None:
        nproc = torch.cuda.device_count() or 4
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "tridist.bench.demo", "--worker"]
    print(f"tridist demo: {' '.join(command[1:])}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(command, env=env)


def _model_and_optimizer():
    import torch

    from tridist.bench.models import SeedLlamaModel, SeedLlamaConfig

    torch.manual_seed(0)
    model = SeedLlamaModel(SeedLlamaConfig(**DEMO_CONFIG))
    return model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)


def _loader():
    from tridist.bench.models import make_seed_dataloader

    return make_seed_dataloader(batch_size=BATCH_SIZE, batch_num=BATCH_NUM, seq_length=SEQ_LENGTH,
                                vocab_high=DEMO_CONFIG["vocab_size"])


def _single_device_losses(device) -> list[float]:
    model, opt = _model_and_optimizer()
    model.to(device)
    losses = []
    for inputs, labels in _loader():
        loss, _ = model(inputs.to(device), labels=labels.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def worker() -> int:
    import torch
    import torch.distributed as dist

    from tridist import distcore

    distcore.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = distcore.env.device()
    model, opt = _model_and_optimizer()
    model.to(device)
    # The seed's call: the devices of one node; sequence_parallel is the seed's own config flag.
    dist_config = distcore.ToDistributedConfig(sequence_parallel=True)
    dist_model, dist_opt, dist_loader = distcore.to_distributed(model, opt, _loader(), device_num=world, node_num=1,
                                                                config=dist_config)
    losses = []
    for epoch in range(1):
        dist_model.train()
        for i, data in enumerate(dist_loader()):
            inputs, labels = data
            loss, _ = dist_model(inputs, labels=labels)
            if rank == 0:
                print(f"epoch {epoch}, step {i}: loss {loss.item():.6f}", flush=True)
            loss.backward()
            dist_opt.step()
            dist_opt.clear_grad()
            losses.append(loss.item())
    status = 0
    if rank == 0:
        reference = _single_device_losses(device)
        print(f"\nstrategy on {world} {device.type} device(s): {dist_model.distributed_strategy.describe()}")
        print(f"{'step':>4}  {'distributed':>12}  {'one device':>12}  {'|diff|':>9}")
        for step, (a, b) in enumerate(zip(losses, reference)):
            print(f"{step:>4}  {a:12.6f}  {b:12.6f}  {abs(a - b):9.2e}")
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        allowed = [LOSS_RTOL * abs(b) + DRIFT_RTOL * abs(b - reference[0]) for b in reference]
        same = len(losses) == len(reference) and all(abs(a - b) <= tol for a, b, tol in zip(losses, reference, allowed))
        print(f"losses {'match' if same else 'DIFFER from'} one device (max |diff| {worst:.2e}, "
              f"tolerance {min(allowed):.1e}..{max(allowed):.1e})")
        status = 0 if same else 1
    flag = torch.tensor([status], device=device)
    dist.all_reduce(flag)  # every rank exits with rank 0's verdict
    verdict = int(flag.item())
    distcore.env.destroy_parallel_env()
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tridist.bench.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: GPUs, else 4 CPU processes)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return worker() if args.worker or "RANK" in os.environ else launch(args.nproc)


if __name__ == "__main__":
    sys.exit(main())
