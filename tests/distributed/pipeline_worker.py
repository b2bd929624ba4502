"""Checks of parallelize's pipeline parallelism (pp_config) on 4 gloo processes: every schedule, and
pp combined with dp and mp, trains like one process on the same global batches (losses and final
parameters), with the user's plain loop."""

from __future__ import annotations

import datetime
import functools
import gc
import sys
import warnings
from pathlib import Path

import torch

from tridist import distcore
from tridist import kernels
from tridist.bench.models import SeedLlamaModel, build_model, tiny_seed_config
from tridist.distcore import ColWiseParallel, ProcessMesh, RowWiseParallel, SplitPoint
from tests.distributed import equivalence
from tests.distributed.harness import interprets_kernels, raises, run_checks

GLOBAL_BATCH, SEQ_LEN, STEPS, VOCAB, LAYERS = 8, 8, 3, 128, 4
SPLIT = {"seed-llama": "layers", "hf-llama": "model.layers"}


def _batches():
    generator = torch.Generator().manual_seed(5)
    return [
        (torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator),
         torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator))
        for _ in range(STEPS)
    ]


def _model(name: str, fused: bool = False, layers: int = LAYERS):
    torch.manual_seed(0)
    model = build_model(name, num_hidden_layers=layers)
    if fused:
        kernels.fuse(model)
    # SGD: its update is linear in the gradient, so summation order (micro-batches, shards) stays at
    # rounding level.
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def _train(model, optimizer, mesh=None, batches=None) -> equivalence.Trace:
    trace = equivalence.Trace()
    for inputs, labels in batches or _batches():
        trace.step(model, _forward_backward(model, mesh, inputs, labels))
        optimizer.step()
        optimizer.zero_grad()  # parallelize's optimizer also has Paddle's clear_grad
    return trace.end(model)


def _forward_backward(model, mesh, inputs, labels):
    if mesh is not None and "dp" in mesh.dim_names:  # global-view batches, as shard_dataloader yields them
        inputs, labels = equivalence.global_view_batch(mesh, inputs, labels)
    loss, _ = model(inputs, labels=labels)
    loss.backward()
    return loss


@functools.cache  # one single-process run per model, shared by the checks (they only read it)
def _reference(name: str, layers: int = LAYERS) -> equivalence.Trace:
    return _train(*_model(name, layers=layers))  # unfused: the fused kernels must match eager


def _equal_to_one_process(name: str, mesh: ProcessMesh, config: dict, *, fused: bool = False, layers: int = LAYERS):
    model, optimizer = distcore.parallelize(*_model(name, fused=fused, layers=layers), mesh, config)
    trace = _train(model, optimizer, mesh)
    equivalence.assert_same_training(trace, _reference(name, layers))
    names = set(trace.parameters)
    assert names and names < set(_reference(name, layers).parameters), names  # this stage's parameters only, same names
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {id(p) for p in model.parameters()}
    return model


def check_lazy_model_materialises_only_its_stage():
    """A LazyGuard model (meta device) under dp2 x pp2: each rank materialises its stage's shards only,
    with the values the single-device model gets from initialize(), and trains like it."""

    def lazy():
        torch.manual_seed(0)
        with distcore.LazyGuard():
            return build_model("hf-llama", num_hidden_layers=LAYERS)

    reference = lazy()
    for tensor in [*reference.parameters(), *reference.buffers()]:
        tensor.initialize()
    ref_trace = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.5))
    model = lazy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # built from meta parameters, as users do
    model, optimizer = distcore.parallelize(model, optimizer, DP2_PP2, {"dp_config": {"sharding_level": 2}, **_pp("hf-llama")})
    assert not [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    equivalence.assert_same_training(_train(model, optimizer, DP2_PP2), ref_trace)  # initial values: exact


def _pp(name: str, **pp_extra) -> dict:
    return {"pp_config": {"split_spec": SPLIT[name], **pp_extra}}


PP4 = ProcessMesh([0, 1, 2, 3], ["pp"])
DP2_PP2 = ProcessMesh([[0, 1], [2, 3]], ["dp", "pp"])
MP2_PP2 = ProcessMesh([[0, 1], [2, 3]], ["pp", "mp"])


def check_1f1b_four_stages():
    model = _equal_to_one_process("seed-llama", PP4, _pp("seed-llama"))
    stage = torch.distributed.get_rank()
    assert [n for n, _ in model.named_children()] == ["embed_tokens", "layers", "norm", "loss_func"]
    kept = [i for i, layer in enumerate(model.layers) if not getattr(layer, "_tridist_stand_in", False)]
    assert kept == [stage], kept  # one decoder layer per stage
    assert ("weight" in dict(model.named_parameters())) == (stage == 3)  # the bare LM head: last stage


@interprets_kernels
def check_gpipe_hf_style_model_with_fused_kernels():
    model = _equal_to_one_process("hf-llama", PP4, _pp("hf-llama", schedule="GPipe", micro_batches=4), fused=True)
    owned = [layer for layer in model.model.layers if not getattr(layer, "_tridist_stand_in", False)]
    assert isinstance(owned[0].mlp, kernels.FusedSwiGLUMLP) and isinstance(owned[0].input_layernorm, kernels.FusedRMSNorm)


def check_interleaved_with_data_parallel():
    """Two stages per rank (layers 0 and 2 on pp rank 0), dp2 level 1 sharding each stage."""
    model = _equal_to_one_process(
        "hf-llama", DP2_PP2, {"dp_config": {"sharding_level": 1}, **_pp("hf-llama", schedule="Interleaved1F1B")}
    )
    pp_rank = DP2_PP2.coordinate()[1]
    kept = [i for i, layer in enumerate(model.model.layers) if not getattr(layer, "_tridist_stand_in", False)]
    assert kept == [pp_rank, pp_rank + 2], kept


def check_data_parallel_levels():
    for level in (0, 3):
        _equal_to_one_process("seed-llama", DP2_PP2, {"dp_config": {"sharding_level": level}, **_pp("seed-llama")})


def check_split_points():
    """A dict split_spec cuts exactly there (Paddle's form): stage 0 = layer 0, stage 1 = layers 1-3."""
    config = {"dp_config": {"sharding_level": 2}, "pp_config": {"split_spec": {"model.layers.0": SplitPoint.END}}}
    model = _equal_to_one_process("hf-llama", DP2_PP2, config)
    kept = [i for i, layer in enumerate(model.model.layers) if not getattr(layer, "_tridist_stand_in", False)]
    assert kept == ([0] if DP2_PP2.coordinate()[1] == 0 else [1, 2, 3]), kept


def _kept_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if not getattr(layer, "_tridist_stand_in", False)]


def check_uneven_stages():
    """Stage counts that do not divide the layers: 6 layers on pp 4 (1, 2, 2, 1: the ends, which also run
    the embedding and the LM head, hold fewer) and 5 layers on dp 2 x pp 2 (3, 2), as autotune's cost model
    prices them; an explicit layers_per_stage (1, 3). Each equals one process."""
    model = _equal_to_one_process("hf-llama", PP4, _pp("hf-llama"), layers=6)
    assert _kept_layers(model) == [[0], [1, 2], [3, 4], [5]][torch.distributed.get_rank()], _kept_layers(model)
    model = _equal_to_one_process("hf-llama", DP2_PP2, {"dp_config": {"sharding_level": 1}, **_pp("hf-llama")}, layers=5)
    assert _kept_layers(model) == ([0, 1, 2] if DP2_PP2.coordinate()[1] == 0 else [3, 4]), _kept_layers(model)
    model = _equal_to_one_process("hf-llama", DP2_PP2, {"dp_config": {"sharding_level": 2}, **_pp("hf-llama", layers_per_stage=[1, 3])})
    assert _kept_layers(model) == ([0] if DP2_PP2.coordinate()[1] == 0 else [1, 2, 3]), _kept_layers(model)


HF_TP_PLAN = {
    "model.embed_tokens": [ColWiseParallel(), distcore.SequenceParallelBegin()],
    "model.layers.*.self_attn.(q|k|v)_proj": ColWiseParallel(),
    "model.layers.*.self_attn.o_proj": RowWiseParallel(),
    "model.layers.*.self_attn": distcore.SequenceParallelDisable(),
    "model.layers.*.mlp.(gate|up)_proj": ColWiseParallel(),
    "model.layers.*.mlp.down_proj": RowWiseParallel(),
    "model.layers.*.mlp": distcore.SequenceParallelDisable(),
    "lm_head": [ColWiseParallel(gather_output=True), distcore.SequenceParallelEnd()],
}


def check_tensor_and_sequence_parallel_in_stages():
    """mp2 x pp2: sequence-split activations travel between stages; head counts localised per stage."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _equal_to_one_process("hf-llama", MP2_PP2, {"mp_config": {"parallelize_plan": HF_TP_PLAN}, **_pp("hf-llama")})
    assert not [w for w in caught if "matches no module" in str(w.message)], [str(w.message) for w in caught]
    owned = [layer for layer in model.model.layers if not getattr(layer, "_tridist_stand_in", False)]
    assert owned[0].self_attn.num_heads == 2 and owned[0].self_attn.q_proj.weight.to_local().shape[0] == 32


def check_sequence_parallel_beginning_at_a_stage_boundary():
    """SequenceParallelBegin on stage 0's last layer: the split it defers to the next parameterised module
    (on stage 1) is taken as the activation leaves stage 0, not left pending on stage 0's ranks."""
    plan = {
        "model.layers.1": distcore.SequenceParallelBegin(),
        "model.layers.*.self_attn.(q|k|v)_proj": ColWiseParallel(),
        "model.layers.*.self_attn.o_proj": RowWiseParallel(),
        "model.layers.(2|3).self_attn": distcore.SequenceParallelDisable(),
        "model.layers.*.mlp.(gate|up)_proj": ColWiseParallel(),
        "model.layers.*.mlp.down_proj": RowWiseParallel(),
        "model.layers.(2|3).mlp": distcore.SequenceParallelDisable(),
        "lm_head": [ColWiseParallel(gather_output=True), distcore.SequenceParallelEnd()],
    }
    model = _equal_to_one_process("hf-llama", MP2_PP2, {"mp_config": {"parallelize_plan": plan}, **_pp("hf-llama")})
    # Each stage owns its split, and none is left pending after a step.
    splits = [vars(view).get("_tridist_sequence_split") for view in model._tridist_pipeline.views]
    assert all(split is not None and not split.pending for split in splits), splits
    if MP2_PP2.coordinate()[0] == 1:  # stage 1 ran on sequence shards: its norms are sequence parallel
        assert isinstance(model.model.layers[2].input_layernorm.weight, torch.distributed.tensor.DTensor)


def _assert_logits(got, want) -> None:
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, (type(got), getattr(got, "shape", None), want.shape)
    equivalence.assert_tensors_close("logits", {"logits": got}, {"logits": want})  # a forward's rounding only


def check_evaluation_runs_forward_only():
    """model.eval() under no_grad: the schedule's forward only; the loss and the whole batch's logits
    (on every rank) equal one process's, with labels or without (then the loss is None)."""
    reference, _ = _model("hf-llama")
    model, _ = _model("hf-llama")
    model, _ = distcore.parallelize(model, None, PP4, _pp("hf-llama"))
    inputs, labels = _batches()[0]
    model.eval()
    reference.eval()
    with torch.no_grad():
        loss, logits = model(inputs, labels=labels)
        expected, expected_logits = reference(inputs, labels=labels)
        unlabelled, unlabelled_logits = model(inputs)
    equivalence.assert_losses_close([loss.item()], [expected.item()])
    assert not loss.requires_grad
    _assert_logits(logits, expected_logits)
    assert unlabelled is None
    _assert_logits(unlabelled_logits, expected_logits)
    assert all(p.grad is None for p in model.parameters())
    # The stages follow the model's own modes, module by module: a submodule the user put in eval mode
    # (dropout off in one part) stays so while the model trains.
    # In eval mode the schedule runs the forward only, also with autograd on: a backward says why it cannot.
    loss, _ = model(inputs, labels=labels)
    try:
        loss.backward()
    except RuntimeError as error:
        assert "model.train()" in str(error), str(error)
    else:
        raise AssertionError("backward of an eval-mode pipeline loss passed silently")
    owned = next(layer for layer in model.model.layers if not getattr(layer, "_tridist_stand_in", False))
    model.train()
    owned.mlp.eval()
    model(inputs, labels=labels)[0].backward()
    assert model.training and owned.training and not owned.mlp.training


def _expect(error_type, fragment: str, config: dict, name: str = "seed-llama", mesh=PP4):
    model, optimizer = _model(name)
    try:
        distcore.parallelize(model, optimizer, mesh, config)
    except error_type as error:
        assert fragment in str(error), str(error)
    else:
        raise AssertionError(f"no {error_type.__name__} for {config}")


def check_errors():
    _expect(ValueError, "fewer than the 8 pipeline stages", _pp("seed-llama", schedule="Interleaved1F1B"))
    _expect(ValueError, "must list 4 positive layer counts", _pp("seed-llama", layers_per_stage=[2, 1, 1, 1]))
    _expect(ValueError, "must name one layer list", {"pp_config": {"split_spec": "decoder.layers"}})
    _expect(ValueError, "unknown pp_config key", _pp("seed-llama", accumulate=2))
    _expect(ValueError, "choose one of", _pp("seed-llama", schedule="zigzag"))
    _expect(ValueError, "pp_config['eval_logits'] = 'all'; choose one of", _pp("seed-llama", eval_logits="all"))
    _expect(ValueError, "needs 4", {"pp_config": {"split_spec": {"layers.1": SplitPoint.END}}})
    _expect(ValueError, "not a layer of a layer list", {"pp_config": {"split_spec": {"norm": SplitPoint.END}}})
    _expect(NotImplementedError, "global layer 'norm' has parameters", _pp("seed-llama", global_spec="norm"))
    _expect(ValueError, "its own named dimension", {"dp_config": {}, **_pp("seed-llama")}, mesh=ProcessMesh([0, 1, 2, 3]))
    _expect(ValueError, "at least one micro-batch per stage (4)", _pp("seed-llama", micro_batches=2))
    model, optimizer = _model("seed-llama")
    model, optimizer = distcore.parallelize(model, optimizer, PP4, _pp("seed-llama", schedule="GPipe", micro_batches=3))
    inputs, labels = _batches()[0]
    try:
        model(inputs, labels=labels)
    except ValueError as error:
        assert "divisible by 3" in str(error), str(error)
    else:
        raise AssertionError("a batch of 8 split into 3 micro-batches was accepted")
    # The seed model averages its own loss: over micro-batches of uneven labelled tokens the schedule's mean of
    # their means is not one device's token mean; refused on every rank (before, a warning)
    model, optimizer = distcore.parallelize(*_model("seed-llama"), PP4, _pp("seed-llama"))
    labels = labels.clone()
    labels[:2, :5] = -100
    for call in (lambda: model(inputs, labels=labels), lambda: model(inputs, None, None, labels)):  # by position too
        try:
            call()
        except RuntimeError as error:
            assert "Model computes its own mean loss" in str(error) and "micro-batches' losses" in str(error), str(error)
        else:
            raise AssertionError("an own mean loss over uneven micro-batches was accepted")


def check_checkpoint_moves_between_pipeline_and_other_layouts():
    """Saved under dp2 x pp2 after two steps, resumed under dp4 (no pipeline) and under pp4: the third
    step equals the uninterrupted single-process run. SGD with momentum: optimizer state to carry."""
    path = Path(sys.argv[1]) / "pipeline-checkpoint"

    def model_and_optimizer():
        model, _ = _model("hf-llama")
        return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    reference = _train(*model_and_optimizer())
    batches = _batches()
    model, optimizer = distcore.parallelize(*model_and_optimizer(), DP2_PP2, {"dp_config": {"sharding_level": 1}, **_pp("hf-llama")})
    saved = _train(model, optimizer, DP2_PP2, batches[:2])
    distcore.save_state(model, optimizer, path)
    for mesh, config in [
        (ProcessMesh([0, 1, 2, 3], ["dp"]), {"dp_config": {"sharding_level": 1}}),
        (PP4, _pp("hf-llama", schedule="GPipe")),
    ]:
        model, optimizer = distcore.parallelize(*model_and_optimizer(), mesh, config)
        distcore.load_state(model, optimizer, path)
        resumed = _train(model, optimizer, mesh, batches[2:])
        # The whole run: the saved run's first two steps, the resumed third, against three uninterrupted steps.
        equivalence.assert_losses_close(saved.losses + resumed.losses, reference.losses)
        moved = {n: reference.parameters[n] - reference.initial[n] for n in resumed.parameters}
        equivalence.assert_tensors_close(f"parameters resumed under {mesh.dim_names}", resumed.parameters, reference.parameters, scale=moved)


def _step(model, optimizer, mesh, inputs, labels) -> float:
    loss = _forward_backward(model, mesh, inputs, labels)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _local_rows(mesh, *tensors):
    """This data-parallel rank's contiguous share of global batches (as shard_tensor gives it)."""
    if "dp" not in mesh.dim_names:
        return tensors
    dp_rank, dp = mesh.coordinate()[mesh.dim_names.index("dp")], mesh.shape[mesh.dim_names.index("dp")]
    return tuple(t.chunk(dp)[dp_rank] for t in tensors)


def check_batch_shapes_change_and_gradients_accumulate_across_calls():
    """Calls with other batch sizes and sequence lengths than the first (torch sizes the stages' receive
    buffers once), evaluations of two sizes between two calls that accumulate gradients, one optimizer
    step: equal to one process. dp2 x pp2 with FSDP2, whose gradients torch's stage re-initialisation
    clears."""
    generator = torch.Generator().manual_seed(11)

    def batch(size, length):
        return tuple(torch.randint(0, VOCAB, (size, length), generator=generator) for _ in range(2))

    first, evaluated, other_eval, accumulated, last = batch(8, 8), batch(4, 8), batch(8, 6), batch(4, 6), batch(8, 8)
    traces = []
    for parallel in (False, True):
        model, optimizer = _model("hf-llama")
        if parallel:
            model, optimizer = distcore.parallelize(model, optimizer, DP2_PP2, {"dp_config": {"sharding_level": 2}, **_pp("hf-llama")})
        trace = equivalence.Trace()
        for step in (first, accumulated):
            # Training: this dp rank's rows; the loss shown is the global mean, as one process computes it.
            loss, _ = model(*_local_rows(DP2_PP2, step[0]), labels=_local_rows(DP2_PP2, step[1])[0]) if parallel else model(step[0], labels=step[1])
            loss.backward()
            trace.add_loss(loss)
            model.eval()
            with torch.no_grad():  # evaluation: the loss of this pipeline's rows, on both sides
                for inputs, labels in (evaluated, other_eval):
                    inputs, labels = _local_rows(DP2_PP2, inputs, labels)
                    trace.add_loss(model(inputs, labels=labels)[0])
            model.train()
        trace.before_first_update(model)  # the gradients of both calls, accumulated
        optimizer.step()
        optimizer.zero_grad()
        trace.add_loss(_step(model, optimizer, DP2_PP2 if parallel else PP4, *last))
        traces.append(trace.end(model))
    reference, trace = traces
    equivalence.assert_same_training(trace, reference)


def check_scaling_the_returned_loss_scales_the_gradients():
    """Gradient accumulation as written for one device: `(loss / 2).backward()` per call, one step, twice.
    The schedule ran the backward inside model(...), so the factor reaches the gradients afterwards."""
    generator = torch.Generator().manual_seed(12)
    batches = [tuple(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator) for _ in range(2)) for _ in range(2)]
    traces = []
    for parallel in (False, True):
        model, optimizer = _model("seed-llama")
        if parallel:
            model, optimizer = distcore.parallelize(model, optimizer, DP2_PP2, {"dp_config": {"sharding_level": 1}, **_pp("seed-llama")})
        trace = equivalence.Trace()
        for _ in range(2):  # gradients freed before the first round, zeroed (Paddle's clear_grad) before the second
            for inputs, labels in batches:
                if parallel:
                    inputs, labels = _local_rows(DP2_PP2, inputs, labels)
                loss, _ = model(inputs, labels=labels)
                (loss / 2).backward()
                trace.add_loss(loss)
            trace.before_first_update(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        traces.append(trace.end(model))
    reference, trace = traces
    equivalence.assert_same_training(trace, reference)
    optimizer.zero_grad()


def check_each_loss_adds_its_gradients_at_its_backward():
    """Loops that treat the returned loss as one device's: the call's gradients count only through its loss's
    backward, at that time, times its factor. dp2 x pp2 against one process, three loops from batches a, b, c:
    - discard a window: `(la / 2).backward()`, lb gets no backward (a nan loss skipped), zero_grad (both
      set_to_none values), `(lc / 2).backward()`: the gradients are lc's / 2;
    - torch's tutorial order: `loss = model(...)`, zero_grad, `loss.backward()`, each batch: the last batch's;
    - a factor of 0 (a loop's skip), `(la * 0).backward()`, then `lb.backward()`: lb's (the next call's backward
      runs at the last usable factor, not 0);
    - zero_grad(set_to_none=False), lb with no backward, `lc.backward()`, then lb freed: lc's (lb's zeros given
      back only where nothing took their place);
    - late and repeated: la, lb computed, then `(lb * 0.5).backward()` and `la.backward()`: la + lb / 2; a
      second backward of la (its graph retained) raises.
    Before, the gradients were merged into .grad inside model(...): the first loop gave 0.92 of relative error
    (zeroed) or an AttributeError (freed), the second trained on nothing."""
    a, b, c = (tuple(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(s))
                     for _ in range(2)) for s in (31, 32, 33))

    def discard_window(model, optimizer, rows, set_to_none):
        (model(*rows(a)[:1], labels=rows(a)[1])[0] / 2).backward()
        model(*rows(b)[:1], labels=rows(b)[1])  # no backward
        optimizer.zero_grad(set_to_none=set_to_none)
        (model(*rows(c)[:1], labels=rows(c)[1])[0] / 2).backward()

    def zero_before_backward(model, optimizer, rows):
        for batch in (a, b):
            loss = model(*rows(batch)[:1], labels=rows(batch)[1])[0]
            optimizer.zero_grad()
            loss.backward()

    def zero_factor(model, optimizer, rows):  # a loop's skip by a factor of 0: the next backward runs as before
        (model(*rows(a)[:1], labels=rows(a)[1])[0] * 0).backward()
        model(*rows(b)[:1], labels=rows(b)[1])[0].backward()

    def freed_after_a_later_backward(model, optimizer, rows):
        model(*rows(a)[:1], labels=rows(a)[1])[0].backward()
        optimizer.zero_grad(set_to_none=False)
        skipped = model(*rows(b)[:1], labels=rows(b)[1])[0]  # no backward; freed after c's: c's gradients stay
        model(*rows(c)[:1], labels=rows(c)[1])[0].backward()
        del skipped
        gc.collect()

    def late(model, optimizer, rows):
        first = model(*rows(a)[:1], labels=rows(a)[1])[0]
        (model(*rows(b)[:1], labels=rows(b)[1])[0] * 0.5).backward()
        first.backward(retain_graph=True)
        return first

    loops = {"discard, zeroed": lambda *m: discard_window(*m, False), "discard, freed": lambda *m: discard_window(*m, True),
             "zero before backward": zero_before_backward, "zero factor": zero_factor,
             "freed after a later backward": freed_after_a_later_backward, "late": late}
    for name, loop in loops.items():
        grads = []
        for parallel in (False, True):
            model, optimizer = _model("seed-llama")
            if parallel:
                model, optimizer = distcore.parallelize(model, optimizer, DP2_PP2,
                                                        {"dp_config": {"sharding_level": 1}, **_pp("seed-llama")})
            returned = loop(model, optimizer, (lambda t: _local_rows(DP2_PP2, *t)) if parallel else (lambda t: t))
            grads.append(equivalence.gradients(model))
        reference, got = grads
        equivalence.assert_tensors_close(f"gradients ({name})", got, reference)
    try:  # the last loop's first loss, retained: its gradients were added once
        returned.backward()
    except RuntimeError as error:
        assert "second time" in str(error), str(error)
    else:
        raise AssertionError("a second backward of one pipeline loss was accepted")
    optimizer.zero_grad()


class _Branchy(torch.nn.Module):
    """Four blocks h + a(h).tanh(), plus b(h).tanh() where the call asks (use_b): b is used by some calls only, as a
    mixture of experts routes tokens (the unused-parameter rule: distcore/unused_parameters.py)."""

    class Block(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

        def forward(self, h, use_b):
            out = h + self.a(h).tanh()
            return out + self.b(h).tanh() if use_b else out

    def __init__(self, width=16):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, width)
        self.layers = torch.nn.ModuleList([self.Block(width) for _ in range(LAYERS)])
        self.norm = torch.nn.LayerNorm(width)
        self.lm_head = torch.nn.Linear(width, VOCAB, bias=False)

    def forward(self, input_ids, labels=None, use_b=False):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, use_b)
        logits = self.lm_head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()), logits


def check_a_loss_without_backward_changes_nothing():
    """A call whose loss gets no backward (a loop skipping a nan loss) leaves the parameters' gradients and the
    optimizer's step as one process, which never made that call, has them; SGD with weight decay, which moves a
    parameter whose gradient is a zero but not one whose gradient is None:
    - dp2 x pp2 at levels 0 and 1: the skipped call used b on dp rank 0; b's gradients stay None at the next step
      (before, the unused-parameter rule's record counted that call: b decayed by lr x wd = 5%);
    - pp4 after zero_grad(set_to_none=False): b's zeroed gradients, which the skipped call accumulated into, are
      zeros again at the next step (before, None: b did not decay);
    - dp2 x pp2 after zero_grad(set_to_none=False), b used before it: b's zeros stay at the next step, where the
      unused-parameter rule made them None (no decay) before;
    - an evaluation after zero_grad(set_to_none=False) under dp2 x pp2 keeps the zeroed gradients (before, None)."""
    generator = torch.Generator().manual_seed(61)
    a, b, c = (tuple(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator) for _ in range(2))
               for _ in range(3))
    for mesh, level, first_uses_b, set_to_none in ((DP2_PP2, 0, False, True), (DP2_PP2, 1, False, True),
                                                    (PP4, None, True, False), (DP2_PP2, 1, True, False)):
        trained = []
        for parallel in (False, True):
            torch.manual_seed(0)
            model = _Branchy()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=0.1)
            rows = (lambda t: _local_rows(mesh, *t)) if parallel else (lambda t: t)
            if parallel:
                config = {"pp_config": {"split_spec": "layers"}}
                if level is not None:
                    config["dp_config"] = {"sharding_level": level}
                model, optimizer = distcore.parallelize(model, optimizer, mesh, config)
            model(*rows(a)[:1], labels=rows(a)[1], use_b=first_uses_b)[0].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
            if parallel:  # the skipped call: b on the first dp rank's data (every rank under pp4)
                model(*rows(b)[:1], labels=rows(b)[1], use_b="dp" not in mesh.dim_names or mesh.coordinate()[0] == 0)
            model(*rows(c)[:1], labels=rows(c)[1], use_b=False)[0].backward()
            optimizer.step()
            trained.append(equivalence.parameters(model))
        reference, got = trained
        equivalence.assert_tensors_close(f"parameters ({mesh.dim_names}, level {level})", got, reference)
    # An evaluation after clear_grad() leaves the zeroed gradients as they were (FSDP2 under dp2 x pp2: torch's
    # stage re-initialisation for the switch to evaluation frees FSDP2's gradients: before, they became None).
    model, _ = distcore.parallelize(_Branchy(), None, DP2_PP2, {"dp_config": {"sharding_level": 1},
                                                                "pp_config": {"split_spec": "layers"}})
    model(*_local_rows(DP2_PP2, *a)[:1], labels=_local_rows(DP2_PP2, *a)[1], use_b=True)[0].backward()
    model.zero_grad(set_to_none=False)
    zeroed = {name for name, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        model(*_local_rows(DP2_PP2, *b)[:1], labels=_local_rows(DP2_PP2, *b)[1])
    model.train()
    kept = {name for name, p in model.named_parameters() if p.grad is not None and not distcore.local_value(p.grad).any()}
    assert zeroed and kept == zeroed, sorted(zeroed - kept)


class _ScaledLossModel(SeedLlamaModel):
    """The cross-entropy times `factor`: 2^-16 makes its fp16 gradients (~1e-3 at factor 1) fall below fp16's
    smallest subnormal (6e-8) unless a loss scaler's factor multiplies them, as a large model's do at any loss;
    2^10 makes them ~1, which fp16 holds, but not times 65,536 (fp16's largest is 65,504)."""

    def __init__(self, config, factor: float):
        super().__init__(config)
        self.factor = factor

    def forward(self, input_ids, labels=None):
        loss, logits = super().forward(input_ids, labels=labels)
        return loss * self.factor, logits


def check_a_loss_scalers_factor_reaches_an_fp16_backward():
    """fp16 under dp2 x pp2 with a loss scaler's factor: `(loss * 65,536).backward()` each call, then the
    gradients over 65,536 (the scaler's unscale), and a back-off to 32,768 on the third call. The schedule's
    backward runs at the last call's factor, and the first call's at 65,536 (a loss scaler's default, before the
    loop's factor is known), so at every call the gradients are as far from the fp32 ones as one process's fp16
    gradients (measured 9.3e-4 and 9.0e-4 relative: fp16 roundings, 2^-11 each, along the same chain in another
    order). Allowed: twice one process's error. Unscaled, as the first call ran before, they underflow: an error
    of 1.29 (one process unscaled: 1.64).
    A loop without a scaler whose gradients (~1) fp16 holds but not times 65,536: the first call's overflow is
    non-finite on every rank, with a warning; the next call runs at the loop's factor, 1, and is finite."""
    inputs, labels = _batches()[0]
    scale = 65536.0

    def built(dtype, factor=2.0**-16):
        torch.manual_seed(0)
        return _ScaledLossModel(tiny_seed_config(num_hidden_layers=LAYERS), factor).to(dtype)

    def gradients(model, factor):
        return {name: g.double() / factor for name, g in equivalence.gradients(model).items()}

    def error(got, want):  # norm-wise over the tensors of `got` (this stage's)
        return (sum(float((got[n] - want[n]).norm() ** 2) for n in got) / sum(float(want[n].norm() ** 2) for n in got)) ** 0.5

    exact = built(torch.float32)
    exact(inputs, labels=labels)[0].backward()
    one = built(torch.float16)
    (one(inputs, labels=labels)[0] * scale).backward()
    want, one_process = gradients(exact, 1.0), gradients(one, scale)
    rows = _local_rows(DP2_PP2, inputs, labels)

    def parallel(factor=2.0**-16):
        model = built(torch.float16, factor)
        return distcore.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), DP2_PP2,
                                    {"dp_config": {"sharding_level": 1}, **_pp("seed-llama")})

    model, optimizer = parallel()
    for call, factor in enumerate((scale, scale, scale / 2)):
        loss, _ = model(rows[0], labels=rows[1])
        (loss * factor).backward()
        got = gradients(model, factor)
        optimizer.zero_grad(set_to_none=True)
        allowed = 2 * error({n: one_process[n] for n in got}, want)
        assert error(got, want) <= allowed, (call, error(got, want), allowed)
        equivalence.record("fp16 gradient error / allowed", error(got, want) / allowed)

    model, optimizer = parallel(2.0**10)
    for call in range(2):
        loss, _ = model(rows[0], labels=rows[1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss.backward()
        finite = all(bool(torch.isfinite(g).all()) for g in equivalence.gradients(model).values())
        warned = any("first training call" in str(w.message) for w in caught)
        assert (finite, warned) == ((False, True) if call == 0 else (True, False)), (call, finite, warned)
        optimizer.zero_grad(set_to_none=True)


class _LogitsLossModel(SeedLlamaModel):
    """A loss computed from the logits without F.cross_entropy (a z-loss-like term): with a vocabulary-
    parallel head it is a DTensor reduced over the split vocabulary, a partial sum on each mp rank."""

    def forward(self, input_ids, labels=None):
        _, logits = super().forward(input_ids)
        return (logits.float() ** 2).mean(), logits


def check_loss_computed_from_vocabulary_parallel_logits():
    """mp2 x pp2, the bare LM head split over the vocabulary: the last stage's loss is the full value."""
    traces = []
    for parallel in (False, True):
        torch.manual_seed(0)
        model = _LogitsLossModel(tiny_seed_config(num_hidden_layers=LAYERS))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        if parallel:
            config = {"mp_config": {"parallelize_plan": {"weight": ColWiseParallel()}}, **_pp("seed-llama")}
            model, optimizer = distcore.parallelize(model, optimizer, MP2_PP2, config)
        traces.append(_train(model, optimizer))
    equivalence.assert_same_training(traces[1], traces[0])


def check_evaluation_on_one_pipeline_only():
    """dp2 x pp2, replicated (sharding level 0: the forward needs no other replica): one data-parallel
    replica evaluates, as data parallel allows on one rank; no collective with the other replica, whose
    ranks go on; the loss is that pipeline's own."""
    model, _ = _model("hf-llama")
    model, _ = distcore.parallelize(model, None, DP2_PP2, {"dp_config": {"sharding_level": 0}, **_pp("hf-llama")})
    reference, _ = _model("hf-llama")
    inputs, labels = _batches()[1]
    model.eval()
    if DP2_PP2.coordinate()[0] == 0:
        with torch.no_grad():
            loss, _ = model(inputs, labels=labels)
            expected, _ = reference(inputs, labels=labels)
        equivalence.assert_losses_close([loss.item()], [expected.item()])
    torch.distributed.barrier()
    # One stage of a pipeline alone: its evaluation raises naming the other stage's rank (distcore/evaluation.py; the
    # process group's timeout shortened), before any transfer: before, it waited for the activations.
    model.train()
    model(inputs, labels=labels)[0].backward()  # every rank: the next forward under no_grad starts an evaluation
    model.eval()
    if DP2_PP2.coordinate() == [0, 0]:
        from tridist.distcore import env

        store, timeout = env._default_store(), env._default_store().timeout
        try:
            store.set_timeout(datetime.timedelta(seconds=0.5))
            with torch.no_grad():
                raises(RuntimeError, ["a forward under no_grad (an evaluation): rank",
                                      f"rank(s) [{DP2_PP2.mesh[0, 1]}] to do the same"], lambda: model(inputs, labels=labels))
        finally:
            store.set_timeout(timeout)
    torch.distributed.barrier()


def check_evaluation_logits_where_asked_and_training_without_labels_fails_everywhere():
    """dp2 x pp2 (each pipeline evaluates its own batch), eval_logits="last_stage": the logits of the
    whole batch on the last stage's ranks only, None elsewhere; a training call without labels raises
    the same error on every rank (no rank is left waiting), and the model trains normally afterwards."""
    model, optimizer = _model("hf-llama")
    model, optimizer = distcore.parallelize(model, optimizer, DP2_PP2, _pp("hf-llama", eval_logits="last_stage"))
    reference, _ = _model("hf-llama")
    inputs, labels = _batches()[DP2_PP2.coordinate()[0]]  # another batch on each replica
    last_stage = DP2_PP2.coordinate()[1] == 1
    model.eval()
    with torch.no_grad():
        loss, logits = model(inputs)
        _, expected_logits = reference(inputs)
    assert loss is None
    if last_stage:
        _assert_logits(logits, expected_logits)
    else:
        assert logits is None, type(logits)
    model.train()
    try:
        model(inputs)
    except ValueError as error:
        assert "must compute its loss" in str(error) and "labels" in str(error), str(error)
    else:
        raise AssertionError("a training call without labels passed silently")
    optimizer.clear_grad()
    equivalence.assert_same_training(_train(model, optimizer, DP2_PP2), _reference("hf-llama"))


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    run_checks(CHECKS)  # ends the process group
