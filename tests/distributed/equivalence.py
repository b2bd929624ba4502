"""When does a distributed run compute what one process computes? The criteria every *_worker.py uses,
and why their tolerances are what they are. Nothing here is fitted to one machine's BLAS.

Rounding. fp32's unit roundoff is u = 2^-24 ~ 6.0e-8. A sum of n terms, in any order, blocking or split
over ranks, errs from the exact sum by at most (n - 1)·u·Σ|terms| (Higham, Accuracy and Stability of
Numerical Algorithms, §4.2); two evaluations in different orders (one process vs. shards or micro-batches,
one CPU's BLAS blocking vs. another's) differ by at most twice that. A gradient of the tiny models here
is a chain of such sums: over the tokens of a batch (<= 96), the hidden size (64), the MLP width (176),
the vocabulary (128), the sequence (<= 12), forward and backward through <= 4 layers. Counting every
contraction of the chain one after the other, n <= 96 + 4·2·(64 + 176 + 128 + 12) ~ 3100, so
2·n·u ~ 4e-4 relative to Σ|terms| in the worst case (every rounding of the same sign; in practice they
are random and add up like sqrt(n)·u ~ 3e-6). Measured over every suite: first-step gradients differ by
<= 7e-7 relative (each check's result holds its `measured` error/allowed ratios; see run_checks).

Bugs move a gradient by a fixed fraction: a data-parallel average dropped or applied twice (a factor of
dp, an error >= 1/2), one of m micro-batches skipped or counted twice (1/m >= 1/8 here), a wrong shard
offset or a missing reduction (O(1)). RTOL = 1e-3 sits between the two: above the worst-case rounding
bound, two orders of magnitude below the smallest bug.

What is compared, and when:
- gradients of the first step, before any optimizer step can amplify rounding: per tensor, norm-wise,
  ||g - g_ref|| <= RTOL·(||g_ref|| + FLOOR·rms(all of g_ref)·sqrt(numel)). The floor is for a tensor
  whose gradient nearly cancels: its rounding error is set by the size of its terms, not of their sum,
  and the model's typical gradient element stands for that size. FLOOR = 1e-2: the smallest real
  tensor here (hf-llama's deepest q_proj) has 1.2e-2 of the model's rms, so the floor at most doubles
  its tolerance, while a tensor that cancels to 0 is still held to 1e-5 of the typical element;
- parameters after several steps, only with optimizers that cannot amplify rounding: SGD (with or
  without momentum: linear in the gradients), or AdamW with eps raised to 1e-3 (its first update
  lr·g/(|g| + eps) moves by at most the gradient's relative error; with eps = 1e-8 an element whose
  gradient is rounding noise gets ±lr by the sign of that noise, which is what broke on another
  machine). The error is measured against how far training moved each tensor, ||θ_ref - θ_0||, with
  the same RTOL and FLOOR: relative to that displacement, a step adds the gradients' relative rounding
  and the curvature carries earlier differences on by (1 + lr·||H||) per step (measured: <= 5e-5
  after 3 SGD steps at lr 0.5, 20x under RTOL), while a bug in the update (a shard not stepped,
  stepped twice, a wrong state or hyper-parameter) is O(1e-2..1) of it;
- losses: |l - l_ref| <= LOSS_RTOL·|l_ref| + RTOL·|l_ref - l_ref[0]|. The first term is the forward's
  own rounding (a loss is one chain of the sums above, 2·n·u < 1e-4 relative to it: LOSS_RTOL); the
  second is the parameters' allowed drift (they may differ by RTOL of the displacement that moved the
  loss by |l_ref - l_ref[0]|). Measured: <= 2e-3 of that allowance.

Exact by construction (compared with torch.equal elsewhere): initial values (the same seed, sharding
only moves values), materialised shards, data loading, checkpointed state after a load.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

U = 2.0**-24  # fp32 unit roundoff
RTOL = 1e-3
FLOOR = 1e-2
LOSS_RTOL = 1e-4
# bf16 compute (FSDP2's param_dtype) against the fp32 reference: bf16's unit roundoff is 2^-8 ~ 3.9e-3,
# and every op's output is rounded to it, about d ~ 64 roundings along a gradient's path forward and
# backward through these models. They are independent (and the same on any machine: fp32 differences
# of ~1e-7 rarely flip a bf16 rounding), so they add up like sqrt(d)·2^-8 ~ 3e-2 (measured: 1e-2). 0.1
# leaves 3x over that and stays 5x under the smallest bug it must see (a dp average dropped, >= 1/2).
BF16_RTOL = 0.1
# A loss near ln(vocabulary) is a mean over tokens of log-softmax terms of O(1) logits, each rounded
# to 2^-8 relative: 4·2^-8 covers it (measured: 1e-4 relative, the mean averages the roundings away).
BF16_LOSS_RTOL = 4 * 2.0**-8

# The largest error / allowed ratio seen per kind of comparison in the current check: run_checks writes it
# into the check's result (the margin of that check is its inverse).
MEASURED: dict[str, float] = {}


def record(kind: str, ratio: float) -> None:
    MEASURED[kind] = max(MEASURED.get(kind, 0.0), ratio)


def full_values(tensors: dict) -> dict:
    """{name: the full (unsharded) tensor, detached}; a collective where tensors are DTensors (every rank
    of their meshes must call it, in the same order). None stays None (a parameter without gradient).

    DTensors of one mesh, placements, shape and dtype (a model's layers hold many) are gathered as one:
    their shards stacked on a new leading dim, the placements moved one dim on. The values are those of
    each tensor's own full_tensor(); one collective instead of one per tensor (each costs milliseconds of
    DTensor dispatch and a rendezvous of every rank, which on a 2-core machine weighed on every check)."""
    full: dict = {}
    alike: dict = {}
    for name, t in tensors.items():
        if isinstance(t, DTensor):
            alike.setdefault((t.device_mesh, tuple(t.placements), tuple(t.shape), t.dtype), []).append(name)
        else:
            full[name] = None if t is None else t.detach().clone()
    for (mesh, placements, shape, _), names in alike.items():
        stacked_shape = (len(names), *shape)
        stacked = DTensor.from_local(
            torch.stack([tensors[name].detach().to_local() for name in names]), mesh,
            [_one_dim_on(p) for p in placements], run_check=False, shape=stacked_shape,
            stride=torch.empty(stacked_shape, device="meta").stride())
        for name, value in zip(names, stacked.full_tensor().unbind(0)):
            full[name] = value.clone()
    return {name: full[name] for name in tensors}


def _one_dim_on(placement):
    """The placement of a tensor's shard once a leading dim is stacked in front of it."""
    if type(placement) is Shard:
        return Shard(placement.dim + 1)
    if type(placement) is _StridedShard:  # torch's part-by-part split (not a Shard subclass)
        return _StridedShard(placement.dim + 1, split_factor=placement.split_factor)
    assert not placement.is_shard(), f"a shard placement full_values does not know: {placement!r}"
    return placement  # Replicate, Partial


def _named_parameters(model) -> dict:
    # Every name of a tied parameter: a pipeline stage may hold it under its other name (the LM head's).
    return model if isinstance(model, dict) else dict(model.named_parameters(remove_duplicate=False))


def gradients(model) -> dict:
    return full_values({name: p.grad for name, p in _named_parameters(model).items()})


def parameters(model) -> dict:
    return full_values(_named_parameters(model))


def assert_tensors_close(kind: str, got: dict, want: dict, *, scale: dict | None = None, rtol: float = RTOL) -> None:
    """Per tensor: ||got - want|| <= rtol·(||scale|| + FLOOR·rms(all of scale)·sqrt(numel)); scale
    defaults to `want` (see the module docstring for what it is for parameters). `got` may hold a subset
    of `want`'s names (a pipeline stage's own parameters)."""
    scale = want if scale is None else scale
    unknown = sorted(set(got) - set(want))
    assert not unknown, f"{kind}: not in the reference: {unknown}"
    present = [s.double() for s in scale.values() if s is not None]
    rms = math.sqrt(sum(float(s.square().sum()) for s in present) / max(1, sum(s.numel() for s in present)))
    problems = []
    for name, value in got.items():
        if (value is None) != (want[name] is None):
            problems.append(f"{name}: {'none' if value is None else 'a'} gradient, the reference has {'none' if want[name] is None else 'one'}")
            continue
        if value is None:
            continue
        if value.shape != want[name].shape:
            problems.append(f"{name}: shape {tuple(value.shape)} != {tuple(want[name].shape)}")
            continue
        error = float((value.double() - want[name].double()).norm())
        size = float(scale[name].double().norm())
        allowed = rtol * (size + FLOOR * rms * math.sqrt(value.numel()))
        record(kind, error / allowed if allowed else (0.0 if error == 0 else math.inf))
        if not error <= allowed:  # NaN fails too
            problems.append(f"{name}: |error| = {error:.3e} = {error / (size or math.nan):.2e} of |reference| {size:.3e} (allowed {allowed:.3e})")
    assert not problems, f"{kind} differ beyond rounding (rtol {rtol:g}):\n  " + "\n  ".join(problems)


def assert_losses_close(losses: list, ref_losses: list, *, loss_rtol: float = LOSS_RTOL, rtol: float = RTOL) -> None:
    assert len(losses) == len(ref_losses), (losses, ref_losses)
    # A reference whose loss more than doubles in a few steps has diverged: the optimizer then amplifies fp32's
    # reordered sums step by step, so whether the last losses agree depends on the CPU's BLAS, not on the strategy
    # (Gemma 4 at lr 0.5 went 4.8 -> 48 and failed on an AMD EPYC after passing elsewhere). At initialisation the loss
    # is about log(vocab); two SGD steps that help move it by a few percent (every reference here: at most +15%).
    assert max(ref_losses) <= 2 * abs(ref_losses[0]), (
        f"the reference training diverged ({ref_losses}): the comparison would measure the machine's rounding; "
        "lower the learning rate or clip the gradients (the checks' `clip=`)")
    for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
        allowed = loss_rtol * abs(ref) + rtol * abs(ref - ref_losses[0])
        record("losses", abs(loss - ref) / allowed)
        assert abs(loss - ref) <= allowed, f"step {step}: loss {loss!r} != {ref!r} (allowed ±{allowed:.2e}): {losses} vs {ref_losses}"


class Trace:
    """What a training run is compared by: every step's loss, the first step's gradients (before the
    optimizer touched anything) and parameters, the final parameters. Call `step(model, loss)` between
    backward and optimizer.step(), `end(model)` after the last step (or, for other loops, `add_loss` per
    loss and `before_first_update` before the first optimizer step); the snapshots are collectives where
    the parameters are DTensors."""

    def __init__(self):
        self.losses: list[float] = []
        self.initial = self.gradients = self.parameters = None
        self.trainable: set[str] = set()  # the parameters that require grad: training must move each

    def add_loss(self, loss) -> None:
        self.losses.append(loss.item() if torch.is_tensor(loss) else float(loss))

    def before_first_update(self, model) -> None:
        if self.gradients is None:  # both in one gather: a parameter and its gradient are alike DTensors
            named = _named_parameters(model)
            both = full_values({**{("parameter", n): p for n, p in named.items()},
                                **{("gradient", n): p.grad for n, p in named.items()}})
            self.initial = {n: both["parameter", n] for n in named}
            self.gradients = {n: both["gradient", n] for n in named}
            self.trainable = {n for n, p in named.items() if p.requires_grad}

    def step(self, model, loss) -> None:
        self.add_loss(loss)
        self.before_first_update(model)

    def end(self, model) -> "Trace":
        self.parameters = parameters(model)
        return self


def global_view_batch(mesh, *tensors) -> tuple:
    """`tensors` as shard_dataloader yields them: rows split over the mesh's "dp" dimension, replicated over the
    others (parallelize unwraps this rank's rows)."""
    from tridist import distcore

    placements = [Shard(0) if name == "dp" else distcore.Replicate() for name in mesh.dim_names]
    return tuple(distcore.shard_tensor(t, mesh, placements) for t in tensors)


def train_keywords(model, optimizers, batches) -> Trace:
    """The loop users write for transformers' models: for each keyword batch `model(**batch).loss`, backward, record
    the step, then each of `optimizers` steps and zeroes its gradients; returns the run's Trace."""
    trace = Trace()
    for batch in batches:
        out = model(**batch)
        out.loss.backward()
        trace.step(model, out.loss)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return trace.end(model)


def train(model, optimizer, batches, *, forward=None) -> Trace:
    """Most checks' loop: for each (inputs, labels) batch, `loss, _ = forward(inputs, labels=labels)`
    (forward: the model itself by default, or e.g. its compiled version), backward, record the step,
    optimizer step and zero_grad; returns the run's Trace."""
    forward = model if forward is None else forward
    trace = Trace()
    for inputs, labels in batches:
        loss, _ = forward(inputs, labels=labels)
        loss.backward()
        trace.step(model, loss)
        optimizer.step()
        optimizer.zero_grad()
    return trace.end(model)


def assert_same_training(trace: Trace, reference: Trace, *, rtol: float = RTOL, loss_rtol: float = LOSS_RTOL,
                         losses: bool = True, unused_zero: bool = False) -> None:
    """`trace` (distributed, maybe one pipeline stage's parameters) trained like `reference` (one process):
    equal initial values, first-step gradients and losses within rounding, parameters within rounding of
    how far training moved them, and every parameter that requires grad and moved on one process moved (one that
    does not require grad, such as ERNIE 4.5's router correction bias, stays as the reference's). losses=False where this rank sees no loss.
    `unused_zero`: a first-step gradient of zeros stands for the reference's None (a parameter no data-parallel rank
    used holds FSDP2's zeros until the optimizer's step, whose pre-hook makes it None: distcore/unused_parameters.py;
    the parameters after the steps show what the optimizer made of it)."""
    unequal = [n for n, p in trace.initial.items() if not torch.equal(p, reference.initial[n])]
    assert not unequal, f"initial values differ (the same seed; sharding only moves values): {unequal}"
    gradients = trace.gradients
    if unused_zero:
        gradients = {n: None if g is not None and reference.gradients[n] is None and not g.any() else g
                     for n, g in gradients.items()}
    assert_tensors_close("first-step gradients", gradients, reference.gradients, rtol=rtol)
    if losses:
        assert_losses_close(trace.losses, reference.losses, loss_rtol=loss_rtol, rtol=rtol)
    moved = {n: reference.parameters[n] - reference.initial[n] for n in reference.parameters}
    assert_tensors_close("parameters", trace.parameters, reference.parameters, scale=moved, rtol=rtol)
    # Moved on one process, not here: a shard never stepped. (DeepSeek-V3.2's indexer and Falcon-H1's dt_bias
    # require grad but get none from the loss: they stay put on one process too.)
    frozen = [n for n, p in trace.parameters.items() if torch.equal(p, trace.initial[n]) and n in trace.trainable
              and not torch.equal(reference.parameters[n], reference.initial[n])]
    assert not frozen, f"never updated: {frozen}"


def shared_parameters_disagree(model) -> list[str]:
    """The parameters whose whole value differs between two ranks that hold it (a ranks' pair of the same
    pipeline stage; replicas of one computation agree bit for bit): a fingerprint of each (fp64 sums of its
    values and of its values weighted by their index), compared exactly over every rank."""
    mine = {}
    for name, whole in parameters(model).items():  # (DTensors gathered a mesh's alike ones at once)
        whole = whole.double().flatten()
        mine[name] = (whole.sum().item(), (whole * torch.arange(whole.numel(), dtype=torch.float64)).sum().item())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted({name for other in everyone for name, value in other.items() if name in mine and value != mine[name]})
