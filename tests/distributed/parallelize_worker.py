"""Checks of parallelize's data parallelism on 4 gloo processes: every sharding level trains the seed
model like one process does on the global batches (to rounding: equivalence.py)."""

from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist

from tridist import distcore
from tridist.bench.models import build_model
from tridist.distcore import ProcessMesh, Shard
from tests.distributed import equivalence
from tests.distributed.harness import raises, run_checks

WORLD, GLOBAL_BATCH, SEQ_LEN, STEPS, VOCAB = 4, 8, 12, 3, 128


def _batches():
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator),
         torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator))
        for _ in range(STEPS)
    ]


def _model_and_optimizer():
    torch.manual_seed(0)
    model = build_model("seed-llama")
    # AdamW, whose states sharding levels 1-3 shard, with eps raised from 1e-8 to 1e-3: its update then
    # moves by at most the gradient's relative rounding error (see equivalence.py); with 1e-8 an element
    # whose gradient is rounding noise would move by ±lr by the sign of that noise.
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)


def _train(model, optimizer, mesh=None, batches=None) -> equivalence.Trace:
    batches = batches or _batches()
    if mesh is not None:  # global-view inputs, as shard_dataloader yields them; parallelize unwraps this rank's rows
        batches = [equivalence.global_view_batch(mesh, *batch) for batch in batches]
    return equivalence.train(model, optimizer, batches)


@functools.cache  # one single-process run, shared by the checks (they only read it)
def _reference() -> equivalence.Trace:
    return _train(*_model_and_optimizer())


def _check_level(level: int):
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    model, optimizer = distcore.parallelize(*_model_and_optimizer(), mesh, {"dp_config": {"sharding_level": level}})
    equivalence.assert_same_training(_train(model, optimizer, mesh), _reference())


def check_level_0_replicated():
    _check_level(0)


def check_level_1():
    _check_level(1)


def check_level_2():
    _check_level(2)


def check_level_3_parameters_sharded():
    _check_level(3)


def check_mixed_precision_policy():
    """bf16 compute with fp32 gradient reduction (FSDP2's policy): fp32 master weights; losses and
    first-step gradients equal the fp32 run's to bf16 rounding."""
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    config = {"dp_config": {"sharding_level": 2, "param_dtype": "bfloat16", "reduce_dtype": "float32"}}
    model, optimizer = distcore.parallelize(*_model_and_optimizer(), mesh, config)
    dtypes = set()
    model.register_forward_hook(lambda module, args, output: dtypes.add(output[1].dtype))  # the logits
    trace = _train(model, optimizer, mesh)
    assert dtypes == {torch.bfloat16}, dtypes
    assert all(p.dtype == torch.float32 for p in model.parameters())  # sharded master weights stay fp32
    equivalence.assert_same_training(trace, _reference(), rtol=equivalence.BF16_RTOL, loss_rtol=equivalence.BF16_LOSS_RTOL)


def check_parameters_are_sharded_at_level_3():
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    model, optimizer = _model_and_optimizer()
    model, optimizer = distcore.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 3}})
    embed = model.embed_tokens.weight
    assert embed.to_local().shape[0] == VOCAB // WORLD
    optimized = {id(q) for group in optimizer.param_groups for q in group["params"]}
    assert all(id(p) in optimized for p in model.parameters())  # the optimizer updates the sharded params


def check_config_errors():
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    cases = [
        ({"dp_config": {"sharding_level": 4}}, ValueError, "must be 0, 1, 2 or 3"),
        ({"dp_cfg": {}}, ValueError, "unknown config key"),
        ({"dp_config": {"stage": 1}}, ValueError, "unknown dp_config key"),
        ({"pp_config": {"split_spec": "layers"}}, ValueError, "needs a mesh dimension named 'pp'"),
    ]
    for config, error_type, message in cases:
        model, optimizer = _model_and_optimizer()
        try:
            distcore.parallelize(model, optimizer, mesh, config)
        except error_type as error:
            assert message in str(error), str(error)
        else:
            raise AssertionError(f"expected {error_type.__name__} for {config}")
    model, optimizer = _model_and_optimizer()
    assert distcore.parallelize(model, optimizer, None, {"dp_config": {}}) == (model, optimizer)  # no mesh: unchanged
    from tridist.distcore import ShardingStage1

    model, optimizer = _model_and_optimizer()
    zero = distcore.shard_optimizer(optimizer, ShardingStage1("dp", mesh))
    try:
        distcore.parallelize(model, zero, mesh, {"dp_config": {"sharding_level": 1}})
    except ValueError as error:
        assert "pass the plain optimizer" in str(error)
    else:
        raise AssertionError("expected a ValueError for a ZeRO-1 optimizer")


def check_evaluation_on_one_rank_and_schedulers():
    """model.eval() forward on rank 0 alone must not wait for a collective; schedulers accept the optimizer."""
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    model, optimizer = _model_and_optimizer()
    model, optimizer = distcore.parallelize(model, optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    inputs, labels = _batches()[0]
    loss, _ = model(distcore.shard_tensor(inputs, mesh, [Shard(0)]), labels=distcore.shard_tensor(labels, mesh, [Shard(0)]))
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.clear_grad()
    assert optimizer.get_lr() == 0.5e-2
    if dist.get_rank() == 0:
        model.eval()
        with torch.no_grad():
            eval_loss, _ = model(inputs[:2], labels=labels[:2])
        assert torch.isfinite(eval_loss)
    dist.barrier()
    _evaluation_on_one_rank_of_a_sharded_model_is_refused(inputs, labels)


def _evaluation_on_one_rank_of_a_sharded_model_is_refused(inputs, labels):
    """ZeRO-3: the forward all-gathers the parameters, so rank 0 alone evaluating raises (at the process group's
    timeout, shortened here, after the log line), naming the absent ranks, before any collective: the ranks then
    carry on. Before, it waited in its first all-gather, or paired it with the others' training collectives. Every
    rank evaluating meets once per evaluation (the first forward under no_grad after training)."""
    from tridist.distcore import env

    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    model, optimizer = distcore.parallelize(*_model_and_optimizer(), mesh, {"dp_config": {"sharding_level": 3}})
    store, timeout = env._default_store(), env._default_store().timeout

    def evaluate():
        with torch.no_grad():
            for _ in range(2):  # an evaluation's forwards meet once
                assert torch.isfinite(model(inputs[:2], labels=labels[:2])[0])

    def train():
        loss, _ = model(distcore.shard_tensor(inputs, mesh, [Shard(0)]), labels=distcore.shard_tensor(labels, mesh, [Shard(0)]))
        loss.backward()
        optimizer.clear_grad()

    evaluate()
    train()
    if dist.get_rank() == 0:
        try:
            store.set_timeout(datetime.timedelta(seconds=0.5))
            raises(RuntimeError, ["a forward under no_grad (an evaluation): rank 0 waited",
                                  f"rank(s) {list(range(1, WORLD))} to do the same", "evaluate on every rank",
                                  "sharding_level 0"], evaluate)
        finally:
            store.set_timeout(timeout)
    dist.barrier()
    evaluate()  # every rank: the counts stayed in step
    train()


def _uneven_batches():
    """_batches() with labels -100 spread unevenly over the ranks: rank 0's rows lose 5 labelled tokens each,
    one of rank 1's its last 4 (unshifted 14 / 20 / 24 / 24 per rank, shifted 12 / 19 / 22 / 22)."""
    batches = []
    for inputs, labels in _batches():
        labels = labels.clone()
        labels[: GLOBAL_BATCH // WORLD, :5] = -100
        labels[GLOBAL_BATCH // WORLD, -4:] = -100
        batches.append((inputs, labels))
    return batches


class _ShiftedLoss(torch.nn.Module):
    """The seed model with Hugging Face's shift in its own mean loss (logits at t against label t + 1)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels=None):
        _, logits = self.model(input_ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return loss, logits


class _LossOnly(torch.nn.Module):
    """The seed model returning its mean loss alone: nothing tells which tokens it averaged."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels=None):
        return self.model(input_ids, labels=labels)[0]


def check_own_mean_losses_over_uneven_labels_train_as_one_process():
    """A model that averages its own loss (the seed's cross entropy, unshifted; the same shifted), with labels -100
    spread unevenly over the ranks: its loss and gradients are the global batch's token mean, as on one process
    (each rank's loss reweighed by its share of the labelled tokens; before, a warning said they were the mean of
    the rank means). A loss that does not show which tokens it averaged is refused on its first uneven batch."""
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    for wrap in (lambda model: model, _ShiftedLoss):
        model, optimizer = _model_and_optimizer()
        reference = _train(wrap(model), optimizer, batches=_uneven_batches())
        model, optimizer = _model_and_optimizer()
        model, optimizer = distcore.parallelize(wrap(model), optimizer, mesh, {"dp_config": {"sharding_level": 3}})
        equivalence.assert_same_training(_train(model, optimizer, mesh, batches=_uneven_batches()), reference)

    model, optimizer = _model_and_optimizer()
    model, optimizer = distcore.parallelize(_LossOnly(model), optimizer, mesh, {"dp_config": {"sharding_level": 0}})
    rows = slice(dist.get_rank() * (GLOBAL_BATCH // WORLD), (dist.get_rank() + 1) * (GLOBAL_BATCH // WORLD))
    (inputs, labels), (uneven_inputs, uneven_labels) = _batches()[0], _uneven_batches()[0]
    model(inputs[rows], labels=labels[rows]).backward()  # as many labelled tokens on every rank: the mean is exact
    try:
        model(uneven_inputs[rows], labels=uneven_labels[rows])
    except RuntimeError as error:
        message = str(error)
        assert "hold 14 to 24 labelled tokens" in message and "_LossOnly computes its own mean loss" in message, message
        assert "Fix: accept `num_items_in_batch`" in message, message
    else:
        raise AssertionError("an own mean loss over uneven labels, not known to be a token mean, was accepted")


def check_own_mean_loss_reweighed_by_the_data_parallel_rank_under_tensor_parallel():
    """dp2 x mp2: each rank's own mean loss is reweighed by its data-parallel rank's share of the labelled tokens
    (its position in the dp group, not its global rank: global ranks 2 and 3 are dp rank 1), as one process."""
    from tests.distributed.tensor_parallel_worker import SEED_PLAN

    mesh = ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    model, optimizer = _model_and_optimizer()
    reference = _train(model, optimizer, batches=_uneven_batches())
    model, optimizer = distcore.parallelize(*_model_and_optimizer(), mesh, {"dp_config": {"sharding_level": 1},
                                                                           "mp_config": {"parallelize_plan": SEED_PLAN}})
    equivalence.assert_same_training(_train(model, optimizer, mesh, batches=_uneven_batches()), reference)


def check_own_mean_loss_that_one_rank_cannot_identify_is_refused_everywhere():
    """The first training call finds what the model's loss averages over on each rank; the ranks agree on it. Rank 0's
    rows hold one labelled token, too few to tell a token mean: the ranks' common finding is "unknown", so every rank
    refuses the uneven batch (a rank keeping its own finding would reweigh while rank 0 refuses)."""
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    model, optimizer = distcore.parallelize(*_model_and_optimizer(), mesh, {"dp_config": {"sharding_level": 0}})
    inputs, labels = _batches()[0]
    labels = labels.clone()
    labels[: GLOBAL_BATCH // WORLD] = -100
    labels[0, 3] = 7
    try:
        model(*equivalence.global_view_batch(mesh, inputs), labels=equivalence.global_view_batch(mesh, labels)[0])
        message = ""
    except RuntimeError as error:
        message = str(error)
    messages = [None] * WORLD
    dist.all_gather_object(messages, message)
    assert all("hold 1 to 24 labelled tokens" in m and "found on its first training call" in m for m in messages), messages


class _SharedBlockModel(torch.nn.Module):
    """Layers that share parts, as hand-written hybrids do: layers 0 and 2 call one MLP object (Zamba's shared
    transformer block in older transformers), layers 1 and 3 hold separate norms whose weight is one tensor
    (transformers' tied weights, as in Zamba now), or with `whole_norm` whose weight and bias both are."""

    class Layer(torch.nn.Module):
        def __init__(self, mlp: torch.nn.Module):
            super().__init__()
            self.norm, self.mlp, self.out = torch.nn.LayerNorm(32), mlp, torch.nn.Linear(32, 32)

        def forward(self, x):
            return x + self.out(self.mlp(self.norm(x)))

    def __init__(self, whole_norm: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, VOCAB)
        shared = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        own = lambda: torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())  # noqa: E731
        self.layers = torch.nn.ModuleList([self.Layer(shared), self.Layer(own()), self.Layer(shared), self.Layer(own())])
        self.layers[3].norm.weight = self.layers[1].norm.weight
        if whole_norm:
            self.layers[3].norm.bias = self.layers[1].norm.bias

    def forward(self, inputs, labels):
        x = self.embed(inputs)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def check_blocks_sharing_a_module_or_a_parameter():
    """A module two blocks hold is a data-parallel unit of its own (FSDP2 manages a parameter in one unit: before,
    "shared with a parameter already managed by another FSDP group" on the first step, as Zamba's did). Modules
    of several blocks holding one set of tied parameters (the whole norm) are sharded as one unit and their blocks
    as units too; a block whose tied parameters make up no whole module (the norm's weight alone) is left to the
    root. Every level trains as one process does, each shared gradient the sum of both uses."""
    from torch.distributed.fsdp import FSDPModule

    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    for whole_norm in (False, True):
        model = _SharedBlockModel(whole_norm)
        reference = _train(model, torch.optim.SGD(model.parameters(), lr=0.5), batches=_batches()[:2])
        for level in (0, 3):
            model = _SharedBlockModel(whole_norm)
            model, optimizer = distcore.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.5), mesh,
                                                    {"dp_config": {"sharding_level": level}})
            units = {name for name, module in model.named_modules() if isinstance(module, FSDPModule)}
            expected = {"", "layers.0", "layers.0.mlp", "layers.2"}
            if level == 3 and whole_norm:
                expected |= {"layers.1", "layers.1.norm", "layers.3", "layers.3.norm"}
            assert units == expected, (whole_norm, level, sorted(units))
            equivalence.assert_same_training(_train(model, optimizer, mesh, batches=_batches()[:2]), reference)


class _RoutedModel(torch.nn.Module):
    """A mixture of experts written as transformers' eager one is: each layer runs only the experts its tokens
    chose (by token id here: ids below 43 to expert 0, up to 85 to expert 1, the rest to expert 2), and its
    fourth expert is chosen by none. With a rank's rows holding one range of ids, each rank uses its own experts.
    `dead` is used with a zero gradient: AdamW's weight decay moves it, as it does on one device."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(32)
            self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.SiLU(),
                                                                   torch.nn.Linear(48, 32)) for _ in range(4))

        def forward(self, x, ids):
            h, out = self.norm(x), torch.zeros_like(x)
            choice = ids * 3 // VOCAB
            for index in choice.unique().tolist():  # the experts hit, as transformers' loop
                rows = choice == index
                out = out.index_put((rows,), self.experts[index](h[rows]))
            return x + out

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, VOCAB)
        self.layers = torch.nn.ModuleList([self.Layer(), self.Layer()])
        self.dead = torch.nn.Parameter(torch.ones(4))  # used, its gradient exactly zero (a dead unit): not None

    def forward(self, inputs, labels):
        x = self.embed(inputs)
        for layer in self.layers:
            x = layer(x, inputs)
        logits = self.head(x) + 0 * self.dead.sum()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def _routed_batches():
    """_batches() with each rank's rows' ids in one third of the vocabulary (rank 3's like rank 0's), so each
    rank's layers run one expert; labels anywhere."""
    batches = []
    for inputs, labels in _batches()[:2]:
        rank = torch.arange(GLOBAL_BATCH) // (GLOBAL_BATCH // WORLD) % 3
        batches.append((inputs % (VOCAB // 3) + (rank * (VOCAB // 3) + 1)[:, None], labels))
    return batches


def check_experts_some_ranks_do_not_run():
    """Parameters that some ranks use and others not (experts no token of theirs chose), and parameters no rank uses
    (an expert never chosen): each level trains as one process does, AdamW with weight decay included: a used
    expert's gradient is the sum over the ranks that used it, and the unused one's is None at the optimizer's step,
    so AdamW leaves it alone as on one process. Before, FSDP2 reduce-scattered each rank's used parameters only: gloo aborted on
    collectives of different sizes (transformers' LongCat-Flash, whose tokens may all choose its identity experts)."""
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])

    def optimizer(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1)

    model = _RoutedModel()
    reference = _train(model, optimizer(model), batches=_routed_batches())
    unused = {name for name, gradient in reference.gradients.items() if gradient is None}
    assert unused == {f"layers.{i}.experts.3.{j}.{k}" for i in (0, 1) for j in (0, 2) for k in ("weight", "bias")}, unused
    for level in (0, 3):
        # The optimizer given to parallelize, or built afterwards (optimizer=None) and passed through
        # distcore.shard_optimizer, as Paddle's loops do: the pre-step hook reaches it too.
        for later in (False, True):
            model = _RoutedModel()
            config = {"dp_config": {"sharding_level": level}}
            if later:
                model, none = distcore.parallelize(model, None, mesh, config)
                assert none is None
                optimizer_ = distcore.shard_optimizer(optimizer(model))
            else:
                model, optimizer_ = distcore.parallelize(model, optimizer(model), mesh, config)
                optimizer_ = distcore.shard_optimizer(optimizer_)  # again: the hook runs once per step all the same
            # Between backward and the optimizer's step the unused hold FSDP2's zeros (the step's pre-hook makes
            # them None): the parameters after the steps tell whether AdamW decayed them
            equivalence.assert_same_training(_train(model, optimizer_, mesh, batches=_routed_batches()), reference,
                                             unused_zero=True)


def check_unused_experts_over_accumulation_zeroed_and_loop_set_gradients():
    """The unused-parameter rule in loops other than one backward per step, each against one process, AdamW with
    weight decay (which moves a parameter whose gradient is zeros, not one whose gradient is None), levels 0 and 3:
    - two backwards per step (gradient accumulation): expert 3, which no rank uses, is None at the step; FSDP2's zeros
      from the first backward are not taken, at the second forward, for gradients the loop zeroed;
    - zero_grad(set_to_none=False) after a step whose tokens chose experts 0-2, then a step whose tokens all choose
      expert 0: experts 1 and 2 keep their zeros, which one device steps on (decay, and Adam's momentum);
    - a gradient the loop sets outside autograd (a regulariser's: ones) on expert 3, which no hook saw: kept."""
    mesh = ProcessMesh(list(range(WORLD)), ["dp"])
    routed = _routed_batches()
    only_expert_0 = [(inputs % (VOCAB // 3), labels) for inputs, labels in routed]  # ids below 43 on every rank

    def accumulate(model, optimizer, feed, trace):
        for inputs, labels in routed:
            loss, _ = model(*feed(inputs), labels=feed(labels)[0])
            (loss / 2).backward()
            trace.add_loss(loss)
        trace.before_first_update(model)
        optimizer.step()

    def zeroed(model, optimizer, feed, trace):
        for inputs, labels in (routed[0], only_expert_0[1]):
            loss, _ = model(*feed(inputs), labels=feed(labels)[0])
            loss.backward()
            trace.step(model, loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

    def set_by_the_loop(model, optimizer, feed, trace):
        loss, _ = model(*feed(routed[0][0]), labels=feed(routed[0][1])[0])
        loss.backward()
        for layer in model.layers:
            for p in layer.experts[3].parameters():
                p.grad = torch.ones_like(p) if p.grad is None else p.grad.fill_(1.0)  # FSDP2's zeros here
        trace.step(model, loss)
        optimizer.step()

    for loop in (accumulate, zeroed, set_by_the_loop):
        model = _RoutedModel()
        reference = equivalence.Trace()
        loop(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1), lambda t: (t,), reference)
        reference.end(model)
        for level in (0, 3):
            model = _RoutedModel()
            model, optimizer = distcore.parallelize(
                model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1), mesh,
                {"dp_config": {"sharding_level": level}})
            trace = equivalence.Trace()
            loop(model, optimizer, functools.partial(equivalence.global_view_batch, mesh), trace)
            try:
                equivalence.assert_same_training(trace.end(model), reference, unused_zero=True)
            except AssertionError as error:
                raise AssertionError(f"{loop.__name__}, level {level}: {error}") from None


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
