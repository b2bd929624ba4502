"""Run candidate strategies for a few real steps on the user's model and data (to_distributed's measure=True).

Each candidate runs on copies: the model and its optimizer are deep-copied together (the copy's
optimizer holds the copy's parameters and the original's state), the strategy is applied to the copy,
and `warmup + steps` steps run over batches of the user's dataloader (cycled if it is shorter), as the
user's loop would: `model(**batch)` for a dict, `model(*batch)` for a tuple or list, `model(batch)`
otherwise, then `loss.backward()`, `optimizer.step()`, `optimizer.zero_grad()` (or the config's
`measure_step(model, optimizer, batch)`). The step time is the median of the timed steps, the slowest
rank's; the user's model, optimizer, dataloader position and random state are left as they were.

A candidate that raises on any rank (out of memory, a block the tensor-parallel check refuses) is
reported with its reason on every rank and dropped. Limit: a failure inside a collective on some ranks
only (one rank out of memory mid-forward) leaves the others waiting in that collective until the
process group's timeout, as any distributed job would.
"""

from __future__ import annotations

import copy
import gc
import logging
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from . import env
from .outputs import find_loss

log = logging.getLogger(__name__)


def default_step(model: torch.nn.Module, optimizer, batch) -> None:
    """One training step as the user's plain loop writes it."""
    if isinstance(batch, dict):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(*batch)
    else:
        output = model(batch)
    loss = find_loss(output)
    if loss is None:
        raise ValueError(
            "to_distributed(measure=True): the model returned no loss for a batch of the dataloader (called as "
            "model(**batch) / model(*batch) / model(batch)); pass ToDistributedConfig(measure_step=fn), fn(model, "
            "optimizer, batch) running one training step"
        )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def measure_strategies(strategies: list, *, model: torch.nn.Module, optimizer, dataloader,
                       apply: Callable, steps: int, warmup: int, step: Callable | None = None) -> dict:
    """{strategy: seconds per step (the slowest rank's median) or the failure's reason}, the same on every
    rank. `apply(model, optimizer, strategy) -> (model, optimizer, loader)` applies a strategy to copies."""
    step = step or default_step
    results = {}
    devices = [env.device()] if env.device().type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the user's training draws the same random numbers after
        for strategy in strategies:
            outcome = _run(strategy, model, optimizer, dataloader, apply, steps, warmup, step)
            results[strategy] = _agree(outcome)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            shown = f"{results[strategy] * 1e3:.2f} ms/step" if isinstance(results[strategy], float) else results[strategy]
            log.info("to_distributed: measured %s: %s", strategy.describe(), shown)
    return results


def _run(strategy, model, optimizer, dataloader, apply, steps: int, warmup: int, step) -> float | str:
    try:
        work_model, work_optimizer = copy.deepcopy((model, optimizer))
        work_model, work_optimizer, loader = apply(work_model, work_optimizer, strategy)
        work_model.distributed_strategy = strategy  # as to_distributed's model carries it (a measure_step may read it)
        batches = _cycle(loader)
        samples = []
        for index in range(warmup + steps):
            batch = next(batches)
            _synchronize()
            started = time.perf_counter()
            step(work_model, work_optimizer, batch)
            _synchronize()
            if index >= warmup:
                samples.append(time.perf_counter() - started)
        return statistics.median(samples)
    except Exception as error:  # noqa: BLE001 - the candidate's failure, reported and dropped
        return f"{type(error).__name__}: {error}"


def _agree(outcome: float | str) -> float | str:
    """Every rank's outcome combined: the first failure's reason, else the slowest rank's time."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return outcome
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    failures = [(rank, o) for rank, o in enumerate(outcomes) if isinstance(o, str)]
    if failures:
        rank, reason = failures[0]
        return f"rank {rank}: {reason}"
    return max(outcomes)


def _cycle(loader):
    while True:
        produced = False
        for batch in loader:
            produced = True
            yield batch
        if not produced:
            raise ValueError("to_distributed(measure=True): the dataloader yields no batch to measure with")


def _synchronize() -> None:
    if torch.cuda.is_available() and env.device().type == "cuda":
        torch.cuda.synchronize(env.device())
