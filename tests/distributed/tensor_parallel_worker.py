"""Checks of parallelize's tensor parallelism (mp_config) on 4 gloo processes: a 2x2 (dp, mp) mesh,
losses and parameters equal to one process on the same global batches."""

from __future__ import annotations

import copy
import functools

import warnings

import torch
import torch.nn.functional as F

from tridist import distcore
from tridist import kernels
from tridist.bench.models import build_model
from tridist.distcore import ColWiseParallel, ProcessMesh, RowWiseParallel, Shard
from tests.distributed import equivalence
from tests.distributed.harness import interprets_kernels, run_checks

GLOBAL_BATCH, SEQ_LEN, STEPS, VOCAB = 4, 8, 3, 128
MESH = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])

HF_PLAN = {
    "model.embed_tokens": ColWiseParallel(),
    "model.layers.*.self_attn.(q|k|v)_proj": ColWiseParallel(),
    "model.layers.*.self_attn.o_proj": RowWiseParallel(),
    "model.layers.*.mlp.(gate|up)_proj": ColWiseParallel(),
    "model.layers.*.mlp.down_proj": RowWiseParallel(),
    "lm_head.weight": ColWiseParallel(gather_output=True),
}
SEED_PLAN = {  # the seed model's LM head (a bare parameter) is left replicated here; see SEED_LM_HEAD
    "embed_tokens": RowWiseParallel(),  # vocabulary-parallel embedding
    "layers.*.self_attn.[qkv]_proj": ColWiseParallel(),
    "layers.*.self_attn.o_proj": RowWiseParallel(),
    "layers.*.mlp.gate_proj": ColWiseParallel(),
    "layers.*.mlp.up_proj": ColWiseParallel(),
    "layers.*.mlp.down_proj": RowWiseParallel(),
}


def _batches():
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator),
         torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator))
        for _ in range(STEPS)
    ]


def _model(name: str, fused: bool = False):
    torch.manual_seed(0)
    model = _HAND_WRITTEN[name]() if name in _HAND_WRITTEN else build_model(name)
    if fused:
        kernels.fuse(model)
    # SGD: its update is linear in the gradient, so tensor-parallel summation order stays at rounding
    # level (Adam divides by sqrt(v) and amplifies it where gradients are near zero).
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def _train(model, optimizer, *, sharded_inputs: bool) -> equivalence.Trace:
    batches = _batches()
    if sharded_inputs:  # global-view batches split over dp, as shard_dataloader yields them
        batches = [tuple(distcore.shard_tensor(t, MESH, [Shard(0), distcore.Replicate()]) for t in batch)
                   for batch in batches]
    return equivalence.train(model, optimizer, batches)


@functools.cache  # one single-device run per model, shared by the checks (callers only read it)
def _reference_run(name: str) -> equivalence.Trace:
    return _train(*_model(name), sharded_inputs=False)


def _equal_to_one_process(name: str, config: dict, *, fused: bool = False, sharded_inputs: bool = False):
    reference = _reference_run(name)  # unfused: the fused kernels on local shards must match eager
    model, optimizer = distcore.parallelize(*_model(name, fused=fused), MESH, config)
    trace = _train(model, optimizer, sharded_inputs=sharded_inputs)
    assert set(trace.parameters) == set(reference.parameters)  # nothing lost or renamed
    equivalence.assert_same_training(trace, reference)
    return model


def check_hf_model_tensor_parallel():
    model = _equal_to_one_process("hf-llama", {"mp_config": {"parallelize_plan": HF_PLAN}})
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.to_local().shape[0] == attention.q_proj.weight.shape[0] // 2


def check_seed_model_with_fixed_head_count_reshape():
    model = _equal_to_one_process("seed-llama", {"mp_config": {"parallelize_plan": SEED_PLAN}})
    assert model.layers[0].self_attn.num_heads == 2  # 4 heads, 2 per tensor-parallel rank


@interprets_kernels
def check_fused_kernels_run_on_local_shards():
    model = _equal_to_one_process("hf-llama", {"mp_config": {"parallelize_plan": HF_PLAN}}, fused=True)
    assert isinstance(model.model.layers[0].mlp, kernels.FusedSwiGLUMLP)


def check_data_and_tensor_parallel_2d():
    for level in (0, 2):
        config = {"dp_config": {"sharding_level": level}, "mp_config": {"parallelize_plan": HF_PLAN}}
        _equal_to_one_process("hf-llama", config, sharded_inputs=True)


SP_BOUNDARIES_SEED = {  # the parallelize seed's boundaries, for the to_distributed seed model's names
    "embed_tokens": [RowWiseParallel(), distcore.SequenceParallelBegin()],
    "layers.*.self_attn": distcore.SequenceParallelDisable(),
    "layers.*.mlp": distcore.SequenceParallelDisable(need_transpose=False),
    "norm": distcore.SequenceParallelEnd(),  # its LM head is the root's matmul: gather before the last norm
}


def check_sequence_parallel():
    model = _equal_to_one_process("seed-llama", {"mp_config": {"parallelize_plan": {**SEED_PLAN, **SP_BOUNDARIES_SEED}}})
    norm = model.layers[0].input_layernorm  # not in the plan: made sequence parallel implicitly
    assert isinstance(norm.weight, torch.distributed.tensor.DTensor)
    attention = model.layers[0].self_attn  # its exit reduce-scatters onto sequence shards: no extra split
    hooks = [hook.__qualname__ for hook in attention._forward_hooks.values()]
    # (and the guard that closes a sharded region's dropout stream: ShardedRegionRandomState)
    assert attention.o_proj._tridist_scatters_sequence and hooks == ["ShardedRegionRandomState.leave",
                                                                     "_check_exit.<locals>.hook"], hooks


def check_sequence_parallel_hf_style_model():
    """HF-style code builds its causal mask and positions from the embedding output: the split waits
    for the first decoder block, so they see the whole sequence."""
    plan = {
        **HF_PLAN,
        "model.embed_tokens": [ColWiseParallel(), distcore.SequenceParallelBegin()],
        "model.layers.*.self_attn": distcore.SequenceParallelDisable(),
        "model.layers.*.mlp": distcore.SequenceParallelDisable(),
        "lm_head": distcore.SequenceParallelEnd(),
    }
    model = _equal_to_one_process("hf-llama", {"mp_config": {"parallelize_plan": plan}})
    assert isinstance(model.model.norm.weight, torch.distributed.tensor.DTensor)  # final norm on slices


@interprets_kernels
def check_sequence_parallel_with_fused_kernels_and_data_parallel():
    """FusedRMSNorm on sequence slices (DTensor inputs) + fused SwiGLU/rotary on local shards, dp2 x mp2."""
    config = {"dp_config": {"sharding_level": 2}, "mp_config": {"parallelize_plan": {**SEED_PLAN, **SP_BOUNDARIES_SEED}}}
    model = _equal_to_one_process("seed-llama", config, fused=True, sharded_inputs=True)
    assert isinstance(model.layers[0].input_layernorm, kernels.FusedRMSNorm)


def check_implicit_sequence_parallel_stays_inside_the_region():
    """Only norms between Begin and End run on sequence slices; one before or after sees the whole
    sequence and must keep plain parameters (reducing its gradients would multiply them by tp)."""
    from tridist.distcore.tensor_parallel import _sequence_parallel_norms, resolve_plan

    toy = torch.nn.Sequential()
    toy.add_module("pre_norm", torch.nn.LayerNorm(8))
    toy.add_module("embed", torch.nn.Linear(8, 8))
    toy.add_module("mid_norm", torch.nn.LayerNorm(8))
    toy.add_module("head", torch.nn.Linear(8, 8))
    toy.add_module("post_norm", torch.nn.LayerNorm(8))
    plan = resolve_plan(toy, {"embed": distcore.SequenceParallelBegin(), "head": distcore.SequenceParallelEnd()})
    assert plan.sequence_region == {"mid_norm"}, plan.sequence_region
    changes = _sequence_parallel_norms(toy, plan.sequence_region, tp_mesh=MESH.device_mesh["mp"])
    assert [c.split(":")[0] for c in changes] == ["mid_norm"], changes
    assert isinstance(toy.mid_norm.weight, torch.distributed.tensor.DTensor)
    assert not isinstance(toy.pre_norm.weight, torch.distributed.tensor.DTensor)
    assert not isinstance(toy.post_norm.weight, torch.distributed.tensor.DTensor)


def check_sequence_parallel_enable_alone():
    """Paddle's example form: SequenceParallelEnable on a norm with no Begin/End: split on entry, gather
    on exit, weight gradients reduced (a plain SequenceParallel here would scale them by tp)."""
    _equal_to_one_process("hf-llama", {"mp_config": {"parallelize_plan": {**HF_PLAN, "model.norm": distcore.SequenceParallelEnable()}}})


class _ToyBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.o_proj = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.o_proj(self.up(x)) + x  # a residual add after the row-parallel exit, inside the region


class _ScaledExitBlock(_ToyBlock):
    """The row-parallel output times a learnt scale: a product, like the CPU's dropout, but with a parameter, whose
    gradient on sequence slices would be partial."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((8,), 2.0))

    def forward(self, x):
        return self.o_proj(self.up(x)) * self.scale


class _Toy(torch.nn.Module):
    def __init__(self, block: type = _ToyBlock):
        super().__init__()
        self.inp, self.block, self.out = torch.nn.Linear(8, 8), block(), torch.nn.Linear(8, 8)
        self.qkv_proj = torch.nn.Linear(8, 24)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def check_sequence_parallel_refusals():
    def expect(error_type, message, plan, model=None, sequence: int = 2):
        model = model or _Toy()
        try:
            model, _ = distcore.parallelize(model, None, MESH, {"mp_config": {"parallelize_plan": plan}})
            model(torch.randn(2, sequence, 8))  # a sequence of 2 = tp: a wrong exit would broadcast silently
        except error_type as error:
            assert message in str(error), str(error)
        else:
            raise AssertionError(f"expected {error_type.__name__}: {message}")

    Begin, End, Disable = distcore.SequenceParallelBegin, distcore.SequenceParallelEnd, distcore.SequenceParallelDisable
    region = {"inp": Begin(), "block": Disable(), "block.up": ColWiseParallel(), "block.o_proj": RowWiseParallel(), "out": End()}
    expect(RuntimeError, "is not the output of its row-parallel linear", region)
    expect(ValueError, "(3 tokens) over 2 ranks, which does not divide it", region, sequence=3)  # refused at the split
    expect(RuntimeError, "is not the output of its row-parallel linear", region, model=_Toy(_ScaledExitBlock))
    expect(ValueError, "run on sequence slices", {"inp": Begin(), "out": End()})  # block's weights uncovered
    expect(ValueError, "assume activations already split", {"block": Disable()})
    tied = build_model("hf-llama", tie_word_embeddings=True)
    expect(NotImplementedError, "tied parameter", HF_PLAN, model=tied)


def check_plan_errors():
    model, optimizer = _model("hf-llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distcore.parallelize(model, optimizer, MESH, {"mp_config": {"parallelize_plan": {"model.embed_token": ColWiseParallel()}}})
    assert any("matches no module" in str(w.message) and "model.embed_tokens" in str(w.message) for w in caught)
    cases = [
        ({"parallelize_plan": {"llama.layers.*.mlp": ColWiseParallel()}, "strict": True}, ValueError, "matches no module"),
        ({"parallelize_plan": {"lm_head": "colwise"}}, TypeError, "styles are"),
        ({"parallelize_plan": {"model.norm": ColWiseParallel()}}, NotImplementedError, "nn.Linear, transformers' Conv1D and nn.Embedding"),
        ({"plan": {}}, ValueError, "unknown mp_config key"),
    ]
    for mp_config, error_type, message in cases:
        model, optimizer = _model("hf-llama")
        try:
            distcore.parallelize(model, optimizer, MESH, {"mp_config": mp_config})
        except error_type as error:
            assert message in str(error), str(error)
        else:
            raise AssertionError(f"expected {error_type.__name__} for {mp_config}")
    seed, optimizer = _model("seed-llama")
    try:
        distcore.parallelize(seed, optimizer, MESH, {"mp_config": {"parallelize_plan": {"weight": RowWiseParallel()}}})
    except NotImplementedError as error:
        assert "column-wise only" in str(error), str(error)
    else:
        raise AssertionError("expected NotImplementedError for a row-wise bare weight")


def check_degree_must_divide_the_model():
    mesh = ProcessMesh([0, 1, 2, 3], ["mp"])
    model, optimizer = _model("hf-llama")  # 2 key/value heads cannot be split over 4 ranks
    try:
        distcore.parallelize(model, optimizer, mesh, {"mp_config": {"parallelize_plan": HF_PLAN}})
    except ValueError as error:
        assert "num_key_value_heads = 2 heads cannot be split over 4" in str(error), str(error)
        assert "or ReplicatedColWiseParallel(replicas=2) on its key/value projections" in str(error), str(error)
    else:
        raise AssertionError("expected a ValueError")
    # Packed projections of unequal sizes are split through their input features: 5 of them over mp 2
    try:
        distcore.parallelize(torch.nn.Sequential(torch.nn.Linear(5, 8)), None, MESH,
                             {"mp_config": {"parallelize_plan": {"0": ColWiseParallel(packed_parts=(4, 2, 2))}}})
    except ValueError as error:
        assert "unequal sizes [4, 2, 2], split through its input features (5), which 2 ranks" in str(error), str(error)
    else:
        raise AssertionError("unequal packed parts split through 5 input features over 2 ranks were accepted")


# ------------------------------------------------------- bare-weight LM heads and packed projections

SEED_LM_HEAD = {"weight": ColWiseParallel()}  # the root's `logits = hidden @ self.weight`, loss in the same forward

PADDLE_SEED_PLAN = {  # the parallelize seed's mp plan, verbatim (its "llama.position_embedding" matches nothing)
    "llama.embed_tokens": [ColWiseParallel(), distcore.SequenceParallelBegin()],
    "llama.position_embedding": [ColWiseParallel(), distcore.SequenceParallelBegin()],
    "llama.layers.*.self_attn.qkv_proj": ColWiseParallel(),
    "llama.layers.*.self_attn.o_proj": RowWiseParallel(),
    "llama.layers.*.self_attn": distcore.SequenceParallelDisable(),
    "llama.layers.*.mlp.gate_up_proj": ColWiseParallel(),
    "llama.layers.*.mlp.down_proj": RowWiseParallel(),
    "llama.layers.*.mlp": distcore.SequenceParallelDisable(need_transpose=False),
    "lm_head.weight": ColWiseParallel(),
    "lm_head": distcore.SequenceParallelEnd(),
}

PACKED_PLAN = {  # paddle-llama without sequence parallel
    "llama.embed_tokens": ColWiseParallel(),
    "llama.layers.*.self_attn.qkv_proj": ColWiseParallel(),
    "llama.layers.*.self_attn.o_proj": RowWiseParallel(),
    "llama.layers.*.mlp.gate_up_proj": ColWiseParallel(),
    "llama.layers.*.mlp.down_proj": RowWiseParallel(),
    "lm_head.weight": ColWiseParallel(),
}


class _CountVocabParallelLosses:
    """Counts the cross entropies computed vocabulary-parallel (the full logits never gathered)."""

    def __enter__(self):
        from tridist.distcore import vocab_parallel

        self.function, self.calls = vocab_parallel._VocabParallelCrossEntropy, 0
        original = self.function.apply

        def counted(*args):
            self.calls += 1
            return original(*args)

        self.function.apply = counted
        return self

    def __exit__(self, *exc):
        del self.function.apply  # back to the class's own


def _placements(param) -> tuple:
    return tuple(param.placements)


def check_seed_model_vocab_parallel_lm_head():
    """The seed's bare LM head split over the vocabulary under dp2 x mp2 (sharding level 1): the loss is
    a vocabulary-parallel cross entropy, the logits stay split, training equals one process."""
    config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": {**SEED_PLAN, **SEED_LM_HEAD}}}
    with _CountVocabParallelLosses() as counter:
        model = _equal_to_one_process("seed-llama", config, sharded_inputs=True)
    # One per step, and one by parallelize's check of the parts outside the blocks (the head and its loss).
    assert counter.calls == STEPS + 1, counter.calls
    assert _placements(model.weight) == (Shard(0), Shard(1)), model.weight.placements  # dp (FSDP) x mp (vocabulary)
    inputs = torch.randint(0, VOCAB, (GLOBAL_BATCH // 2, SEQ_LEN))
    loss, logits = model(inputs, labels=inputs)
    assert not isinstance(loss, torch.distributed.tensor.DTensor) and loss.dim() == 0
    assert isinstance(logits, torch.distributed.tensor.DTensor) and logits.shape[-1] == VOCAB
    assert logits.to_local().shape[-1] == VOCAB // 2  # never gathered


def check_seed_model_lm_head_gather_output():
    """gather_output=True: full logits (plain tensors) come out of the matmul; the loss is ordinary."""
    config = {"mp_config": {"parallelize_plan": {**SEED_PLAN, "weight": ColWiseParallel(gather_output=True)}}}
    with _CountVocabParallelLosses() as counter:
        model = _equal_to_one_process("seed-llama", config)
    assert counter.calls == 0
    _, logits = model(torch.randint(0, VOCAB, (2, SEQ_LEN)))
    assert not isinstance(logits, torch.distributed.tensor.DTensor) and logits.shape == (2, SEQ_LEN, VOCAB)


def check_seed_model_lm_head_with_sequence_parallel():
    config = {"mp_config": {"parallelize_plan": {**SEED_PLAN, **SP_BOUNDARIES_SEED, **SEED_LM_HEAD}}}
    _equal_to_one_process("seed-llama", config)


def check_parallelize_seed_example_plan():
    """The parallelize seed's exact mp plan on its model (paddle-llama) with dp sharding level 1: the
    unmatched "llama.position_embedding" only warns; training equals one process."""
    config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": PADDLE_SEED_PLAN}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _CountVocabParallelLosses() as counter:
            model = _equal_to_one_process("paddle-llama", config, sharded_inputs=True)
    unmatched = [str(w.message) for w in caught if "matches no module" in str(w.message)]
    assert len(unmatched) == 1 and "llama.position_embedding" in unmatched[0], unmatched
    assert counter.calls == STEPS + 1, counter.calls  # + parallelize's check of the head and its loss
    layer = model.llama.layers[0]
    assert layer.self_attn.num_heads == 2  # 4 heads, 2 per mp rank (localised through the packed qkv_proj)
    from torch.distributed.tensor.placement_types import _StridedShard

    # FSDP shards packed weights on dim 1, so its dp shard composes with the per-part mp split.
    assert _placements(layer.self_attn.qkv_proj.weight) == (Shard(1), _StridedShard(0, split_factor=3))
    assert _placements(layer.mlp.gate_up_proj.weight) == (Shard(1), _StridedShard(0, split_factor=2))
    assert _placements(model.lm_head.weight) == (Shard(0), Shard(1))
    assert isinstance(model.llama.norm.weight, torch.distributed.tensor.DTensor)  # implicit sequence parallel


def check_packed_projections_split_per_part_with_canonical_global_value():
    """Each mp rank holds its share of q, of k and of v (of gate and of up); the global value, the state
    dict and unshard_dtensor keep the single-device layout; training equals one process."""
    reference, _ = _model("paddle-llama")
    model, optimizer = _model("paddle-llama")
    model, optimizer = distcore.parallelize(model, optimizer, MESH, {"mp_config": {"parallelize_plan": PACKED_PLAN}})
    rank = MESH.device_mesh["mp"].get_local_rank()
    state = model.state_dict()
    for name, parts in (("llama.layers.0.self_attn.qkv_proj.weight", 3), ("llama.layers.1.mlp.gate_up_proj.weight", 2)):
        param, full = model.get_parameter(name), reference.get_parameter(name).detach()
        expected_local = torch.cat([part.chunk(2, dim=0)[rank] for part in full.chunk(parts, dim=0)])
        assert torch.equal(param.to_local(), expected_local), name
        assert torch.equal(distcore.unshard_dtensor(param.detach()), full), name
        assert torch.equal(state[name].full_tensor(), full), name
    _equal_to_one_process("paddle-llama", {"mp_config": {"parallelize_plan": PACKED_PLAN}})


def check_packed_projection_gather_output():
    """gather_output=True on a packed projection gives its full, single-device-layout output."""
    plan = {
        **PACKED_PLAN,
        "llama.layers.*.self_attn.qkv_proj": ColWiseParallel(gather_output=True),
        "llama.layers.*.self_attn.o_proj": RowWiseParallel(is_input_parallel=False),  # takes the full heads
    }
    model = _equal_to_one_process("paddle-llama", {"mp_config": {"parallelize_plan": plan}})
    assert model.llama.layers[0].self_attn.num_heads == 4  # full q/k/v: all heads
    # In local view: a wrong local view (heads localised, or the row-parallel input taken as split) would fall back to
    # global view, still equal to one process
    assert not _global_view_reasons(model), _global_view_reasons(model)


def check_vocab_parallel_cross_entropy_matches_torch():
    """Losses and gradients of F.cross_entropy on vocabulary-split logits equal torch's on full logits:
    reductions, ignored targets (the default -100, a given index, a given negative one), class dim 1 of a 3-D
    input, an unbatched input; label smoothing (not
    vocabulary-parallel) gathers with a warning and stays correct; a target outside the vocabulary raises."""
    from torch.distributed.tensor import distribute_tensor

    from tridist.distcore.vocab_parallel import _GlobalView

    tp_mesh = MESH.device_mesh["mp"]
    generator = torch.Generator().manual_seed(5)
    cases = [
        ((6, VOCAB), (6,), 1, {"reduction": "mean"}),
        ((6, VOCAB), (6,), 1, {"reduction": "sum", "ignore_index": 7}),
        ((6, VOCAB), (6,), 1, {"ignore_index": -1}),  # a negative one, outside [0, vocab) as -100 is
        ((2, VOCAB, 3), (2, 3), 1, {"reduction": "none"}),
        ((VOCAB,), (), 0, {}),
        ((6, VOCAB), (6,), 1, {"label_smoothing": 0.1}),
    ]
    for logits_shape, target_shape, class_dim, options in cases:
        full = torch.randn(logits_shape, generator=generator)
        target = torch.randint(0, VOCAB, target_shape, generator=generator)
        if target.dim():
            target[0] = options.get("ignore_index", 7)  # an ignored target where ignore_index is given
            if "ignore_index" not in options:
                target[-1] = -100  # F.cross_entropy's default ignore_index
        reference = full.clone().requires_grad_()
        expected = F.cross_entropy(reference, target, **options)
        expected.sum().backward()
        split = distribute_tensor(full, tp_mesh, [Shard(class_dim)]).requires_grad_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with _GlobalView([]):
                loss = F.cross_entropy(split, target, **options)
        gathered = any("gathering the full logits" in str(w.message) for w in caught)
        assert gathered == ("label_smoothing" in options), (options, [str(w.message) for w in caught])
        assert not isinstance(loss, torch.distributed.tensor.DTensor)
        loss.sum().backward()
        # One cross entropy: sums over <= 128 logits and 6 rows, far inside RTOL (equivalence.py).
        equivalence.assert_tensors_close("cross entropy", {f"loss {options}": loss.detach(), f"grad {options}": split.grad.full_tensor()},
                                         {f"loss {options}": expected.detach(), f"grad {options}": reference.grad})
    # A target outside the vocabulary: an error, as on one device (it lies in no rank's columns).
    split = distribute_tensor(torch.randn(2, VOCAB, generator=generator), tp_mesh, [Shard(1)])
    try:
        with _GlobalView([]):
            F.cross_entropy(split, torch.tensor([1, VOCAB]))
    except RuntimeError as error:
        assert f"targets must be class indices in [0, {VOCAB})" in str(error), error
    else:
        raise AssertionError("a target outside the vocabulary was taken")


class _StageExit(BaseException):
    """Like a pipeline stage's exit: a BaseException, which skips forward hooks (even always_call ones)."""


def check_global_view_never_outlives_the_forward():
    """The global view of a vocabulary-parallel head ends with the model's forward, also when the forward
    raises (an Exception, or a BaseException that skips forward hooks: cleaned up at the next forward)."""
    from torch.overrides import _get_current_function_mode_stack

    model, _ = _model("paddle-llama")
    model, _ = distcore.parallelize(model, None, MESH, {"mp_config": {"parallelize_plan": PACKED_PLAN}})
    inputs = torch.randint(0, VOCAB, (2, SEQ_LEN))

    def fail_with(error_type):
        def hook(module, args, output):
            raise error_type("stop")

        handle = model.llama.norm.register_forward_hook(hook)
        try:
            model(inputs, labels=inputs)
        except error_type:
            pass
        finally:
            handle.remove()

    fail_with(RuntimeError)
    assert _get_current_function_mode_stack() == []
    fail_with(_StageExit)
    assert len(_get_current_function_mode_stack()) == 1  # left behind until the next forward
    loss, _ = model(inputs, labels=inputs)
    assert _get_current_function_mode_stack() == [] and torch.isfinite(loss)


class _GroupedQueryAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.num_key_value_heads = 4, 2
        self.qkv_proj = torch.nn.Linear(16, 16 + 2 * 8)  # q: 4 heads of 4; k, v: 2 heads of 4


def check_unsupported_layouts_are_refused_clearly():
    """Packed parts that the degree does not divide, a bare weight that does not split evenly, a 1-D bare
    parameter, and a tied weight split in one holder only are refused with how to fix the plan."""

    def expect(error_type, message, model, plan):
        try:
            distcore.parallelize(model, None, MESH, {"mp_config": {"parallelize_plan": plan}})
        except error_type as error:
            assert message in str(error), str(error)
        else:
            raise AssertionError(f"expected {error_type.__name__}: {message}")

    wrapper = torch.nn.Module()
    wrapper.self_attn = _GroupedQueryAttention()
    expect(ValueError, "sizes [16, 9, 7]", wrapper, {"self_attn.qkv_proj": ColWiseParallel(packed_parts=(16, 9, 7))})
    odd_vocab = build_model("paddle-llama", vocab_size=127)
    expect(ValueError, "does not divide them", odd_vocab, {"lm_head.weight": ColWiseParallel()})
    norm_weight = {"llama.norm.weight": ColWiseParallel()}  # a bare 1-D parameter
    expect(NotImplementedError, "2-D [in, out] weight", build_model("paddle-llama"), norm_weight)
    tied = build_model("paddle-llama")
    tied.llama.embed_tokens.weight = tied.lm_head.weight  # one parameter owned by two modules, as tied weights are
    expect(NotImplementedError, "tied parameter", tied, {"lm_head.weight": ColWiseParallel()})


# ------------------------------------------------------------------ a model written for one device
# As a user writes it: module-level constants in the attention's reshapes. In local view (local shards,
# head counts divided) `reshape(b, s, N_HEADS, -1)` cuts the local features into the global number of
# heads (half-size heads): with `reshape(b, s, HIDDEN)` after attention it fails on a shape, with
# `reshape(b, s, -1)` it computes scrambled heads and trains silently wrong. The block check sends
# the blocks to global view, where they train as on one device.

HIDDEN, N_HEADS, FFN = 32, 4, 64


class _ConstantsAttention(torch.nn.Module):
    def __init__(self, merge: str, distance: bool):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))
        self.merge, self.distance = merge, distance

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).reshape(b, s, N_HEADS, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = q * torch.cos(torch.arange(s, dtype=q.dtype))[:, None]  # a tensor the block makes itself
        if self.distance:  # an op with no DTensor sharding rule: global view cannot run it either
            o = torch.softmax(-torch.cdist(q, k), dim=-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, HIDDEN if self.merge == "hidden" else -1))


class _ConstantsMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(HIDDEN, FFN), torch.nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class _ConstantsBlock(torch.nn.Module):
    def __init__(self, merge: str, distance: bool):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.attn, self.mlp = _ConstantsAttention(merge, distance), _ConstantsMLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ConstantsModel(torch.nn.Module):
    def __init__(self, merge: str = "hidden", distance: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(_ConstantsBlock(merge, distance) for _ in range(2))
        self.norm, self.head = torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, labels=None):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), logits


# ------------------------------------------------------- packed q/k/v of unequal sizes (grouped-query)
# Phi-3's layout with the head counts on the module (as hand-written models keep them): qkv_proj packs
# [q (4 heads) | k (2 heads) | v (2 heads)] with a bias, sliced at the module's head counts.


class _GroupedQueryPackedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, HIDDEN // 4
        self.qkv_proj = torch.nn.Linear(HIDDEN, (4 + 2 * 2) * self.head_dim)  # with a bias
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class GroupedQueryPackedModel(ConstantsModel):
    def __init__(self):
        super().__init__("minus")
        for block in self.blocks:
            block.attn = _GroupedQueryPackedAttention()


GQA_PACKED_PLAN = {
    "blocks.*.attn.qkv_proj": ColWiseParallel(), "blocks.*.attn.o_proj": RowWiseParallel(),
    "blocks.*.mlp.up": ColWiseParallel(), "blocks.*.mlp.down": RowWiseParallel(),
}


def check_unequal_packed_parts_split_part_by_part():
    """Grouped-query q/k/v packed in one Linear: each mp rank's output holds its 2 query heads and its key/
    value head (local view, head counts divided), the weight is split on its input features with the
    single-device layout as its global value; training equals one process under mp, dp x mp (ZeRO-2)
    and with sequence parallel."""
    reference, _ = _model("gqa-packed")
    model, _ = distcore.parallelize(*_model("gqa-packed"), MESH, {"mp_config": {"parallelize_plan": GQA_PACKED_PLAN}})
    attention = model.blocks[0].attn
    assert not _global_view_reasons(model) and (attention.num_heads, attention.num_key_value_heads) == (2, 1)
    assert attention.qkv_proj.weight.placements[-1] == Shard(1)  # (Replicate() over the mesh's dp dimension first)
    for name in ("blocks.0.attn.qkv_proj.weight", "blocks.0.attn.qkv_proj.bias"):
        assert torch.equal(distcore.unshard_dtensor(model.get_parameter(name).detach()), reference.get_parameter(name).detach())
    _equal_to_one_process("gqa-packed", {"mp_config": {"parallelize_plan": GQA_PACKED_PLAN}})
    sequence_parallel = {**GQA_PACKED_PLAN, **CONSTANTS_SEQUENCE_PARALLEL}
    model = _equal_to_one_process("gqa-packed", {"dp_config": {"sharding_level": 2}, "mp_config": {"parallelize_plan": sequence_parallel}})
    assert not _global_view_reasons(model)


_HAND_WRITTEN = {"constants-hidden": functools.partial(ConstantsModel, "hidden"),
                 "constants-minus": functools.partial(ConstantsModel, "minus"),
                 "gqa-packed": GroupedQueryPackedModel}
CONSTANTS_PLAN = {
    "blocks.*.attn.[qkv]_proj": ColWiseParallel(), "blocks.*.attn.o_proj": RowWiseParallel(),
    "blocks.*.mlp.up": ColWiseParallel(), "blocks.*.mlp.down": RowWiseParallel(),
}
CONSTANTS_SEQUENCE_PARALLEL = {
    "embed": distcore.SequenceParallelBegin(), "blocks.*.attn": distcore.SequenceParallelDisable(),
    "blocks.*.mlp": distcore.SequenceParallelDisable(), "head": distcore.SequenceParallelEnd(),
}


def _global_view_reasons(model) -> dict:
    return {name: m._tridist_global_view for name, m in model.named_modules() if hasattr(m, "_tridist_global_view")}


def check_module_constants_model_trains_in_global_view_with_sequence_parallel():
    """mp x dp (ZeRO-2) with sequence parallel: equal to one process; both blocks in global view, for
    the reason the check found (a shape error, or numbers that differ)."""
    config = {"dp_config": {"sharding_level": 2}, "mp_config": {"parallelize_plan": {**CONSTANTS_PLAN, **CONSTANTS_SEQUENCE_PARALLEL}}}
    for merge, symptom in (("hidden", "fails: RuntimeError: shape"), ("minus", "differs from one device")):
        model = _equal_to_one_process(f"constants-{merge}", config)
        reasons = _global_view_reasons(model)
        assert set(reasons) == {"blocks.0", "blocks.1"} and all(symptom in r for r in reasons.values()), reasons
        weight = model.blocks[0].attn.q_proj.weight  # still split over mp (and sharded over dp)
        assert weight.placements[weight.device_mesh.mesh_dim_names.index("mp")] == Shard(0), weight.placements


def check_module_constants_model_trains_in_global_view_without_sequence_parallel():
    model = _equal_to_one_process("constants-minus", {"mp_config": {"parallelize_plan": CONSTANTS_PLAN}})
    assert set(_global_view_reasons(model)) == {"blocks.0", "blocks.1"}
    assert not _global_view_reasons(_equal_to_one_process("hf-llama", {"mp_config": {"parallelize_plan": HF_PLAN}}))


def check_block_wrong_in_both_views_is_refused_by_name():
    """Local view fails on the constants; global view on an op DTensor cannot shard (cdist): an error
    naming the block and both causes, before anything is changed."""
    torch.manual_seed(0)
    model = ConstantsModel("hidden", distance=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        distcore.parallelize(model, None, MESH, {"mp_config": {"parallelize_plan": CONSTANTS_PLAN}})
    except distcore.TensorParallelCheckError as error:
        message = str(error)
    else:
        raise AssertionError("a block wrong in both views was accepted")
    assert "'blocks.0'" in message and "local view fails" in message and "cdist" in message, message
    assert all(torch.equal(p, before[n]) and not isinstance(p, torch.distributed.tensor.DTensor)
               for n, p in model.named_parameters())


def check_to_distributed_excludes_tensor_parallel_a_block_cannot_take():
    """A recognised (Llama-like) model whose blocks are wrong under tp in both views: the search's tp=2
    is dropped with the reason, and the strategy chosen instead trains."""
    from tridist import autotune

    torch.manual_seed(0)
    model = ConstantsModel("hidden", distance=True)
    for block in model.blocks:
        block.attn.num_heads = N_HEADS  # what the structure recogniser reads
    samples = [(inputs[row], labels[row]) for inputs, labels in _batches() for row in range(GLOBAL_BATCH)]
    space = autotune.SearchSpace(tp=(2,), pp=(1,), sequence_parallel=(False,), overlap_tp_comm=(False,))
    config = distcore.ToDistributedConfig(fuse_kernels=False, search_options={"space": space})
    model, optimizer, loader = distcore.to_distributed(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.DataLoader(samples, batch_size=GLOBAL_BATCH),
        device_num=4, config=config)
    assert model.distributed_strategy.tp == 1 and model.distributed_strategy.dp == 4, model.distributed_strategy
    for inputs, labels in loader():
        loss, _ = model(inputs, labels=labels)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
    assert torch.isfinite(loss)


# --------------------------------------------------------------- the block check's own strength
# Blocks whose tensor-parallel local view is wrong in a small or hidden way, each by one fault of its code
# (module-level head counts, as model code not written for tp has them). The check must send each to
# global view (where the same code is right) or repair it, before anything changes; a check that compared
# forward outputs only, loosely, or let NaN through would keep these in local view.


class _BackwardScaledByHeads(torch.autograd.Function):
    """Identity forward; the backward scales the gradient by local heads / all heads: a fault that only a
    comparison of gradients sees (its forward is right in local view)."""

    @staticmethod
    def forward(ctx, x, fraction):
        ctx.fraction = fraction
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.fraction, None


class _FaultyAttention(torch.nn.Module):
    def __init__(self, fault: str):
        super().__init__()
        self.q_proj, self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False), torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.num_heads, self.fault = N_HEADS, fault
        self.gain = torch.nn.Parameter(torch.ones(HIDDEN // N_HEADS))  # one per head feature, shared by the heads
        self.register_buffer("marker", torch.ones(()))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.num_heads, -1) * self.gain  # right on local heads; its gradient is not
        if self.fault == "small":  # 0.25% off on local heads: above the 1e-3 tolerance, under a loosened one
            q = q * (1 + 0.005 * (N_HEADS - self.num_heads) / N_HEADS)
        elif self.fault == "nan" and self.num_heads != N_HEADS:
            q = q * float("nan")
        elif self.fault == "backward":
            q = _BackwardScaledByHeads.apply(q, self.num_heads / N_HEADS)
        elif self.fault == "unchecked" and self.marker.item() != 1.0:  # the check's random buffers: fails there
            raise RuntimeError("this block runs only with its marker at 1")
        return self.o_proj(q.reshape(b, s, -1))


class FaultyModel(torch.nn.Module):
    def __init__(self, fault: str):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(_FaultyBlock(fault) for _ in range(2))
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, labels=None):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), logits


class _FaultyBlock(torch.nn.Module):
    def __init__(self, fault: str):
        super().__init__()
        self.norm, self.attn = torch.nn.LayerNorm(HIDDEN), _FaultyAttention(fault)

    def forward(self, x):
        return x + self.attn(self.norm(x))


FAULTY_PLAN = {"blocks.*.attn.q_proj": ColWiseParallel(), "blocks.*.attn.o_proj": RowWiseParallel()}
FAULTS = ("none", "small", "nan", "backward", "unchecked")
_HAND_WRITTEN.update({f"faulty-{fault}": functools.partial(FaultyModel, fault) for fault in FAULTS})


def check_block_check_sends_small_nan_and_backward_only_faults_to_global_view():
    """Each fault found before training, named by its block, and the block trains right in global view
    (dp x tp, equal to one process): a 0.25% output error, NaN in local view only, and a gradient scaled by
    1/tp behind a right forward."""
    symptoms = {"small": "in the output by", "nan": "in the output by inf", "backward": "in the input's gradient"}
    for fault, symptom in symptoms.items():
        model = _equal_to_one_process(f"faulty-{fault}", {"dp_config": {}, "mp_config": {"parallelize_plan": FAULTY_PLAN}})
        reasons = _global_view_reasons(model)
        assert set(reasons) == {"blocks.0", "blocks.1"} and all(symptom in r for r in reasons.values()), (fault, reasons)


def check_block_check_unchecked_block_runs_in_global_view():
    """A block whose single-device copy cannot run on the probe's inputs is not checked: it runs in global
    view (which needs nothing of local view's assumptions), never unchecked in local view."""
    model = _equal_to_one_process("faulty-unchecked", {"mp_config": {"parallelize_plan": FAULTY_PLAN}})
    reasons = _global_view_reasons(model)
    assert set(reasons) == {"blocks.0", "blocks.1"} and all(r.startswith("not checked") for r in reasons.values()), reasons


def check_replicated_parameter_on_head_shards_gets_summed_gradients():
    """`gain`, kept whole and applied to each local head, is found by its gradients (each rank's covers its
    heads; their sum is one device's), not by its name: local view with the repair, a Replicate DTensor
    whose gradient is summed over mp; equal to one process under dp x tp, unfused and fused."""
    model = _equal_to_one_process("faulty-none", {"dp_config": {"sharding_level": 2}, "mp_config": {"parallelize_plan": FAULTY_PLAN}})
    assert not _global_view_reasons(model)
    gain = model.blocks[0].attn.gain
    assert gain.placements[gain.device_mesh.mesh_dim_names.index("mp")] == distcore.Replicate(), gain.placements


def check_outside_blocks_are_checked_forward_and_backward():
    """The embedding, the final norm and the LM head with its loss are checked like the blocks: with
    distcore's sequence-parallel norms planted away (and the guard that would refuse them), the final norm's
    weight gradient covers one sequence slice; parallelize raises before anything changes, naming it."""
    from tridist.distcore import tensor_parallel

    plan = {**HF_PLAN, "model.embed_tokens": [ColWiseParallel(), distcore.SequenceParallelBegin()],
            "model.layers.*.self_attn": distcore.SequenceParallelDisable(),
            "model.layers.*.mlp": distcore.SequenceParallelDisable(), "lm_head": distcore.SequenceParallelEnd()}
    norms, guard = tensor_parallel._sequence_parallel_norms, tensor_parallel._check_region_parameters
    tensor_parallel._sequence_parallel_norms = lambda root, region, *, tp_mesh: []
    tensor_parallel._check_region_parameters = lambda root, region: None
    try:
        distcore.parallelize(_model("hf-llama")[0], None, MESH, {"mp_config": {"parallelize_plan": plan}})
    except distcore.TensorParallelCheckError as error:
        assert "outside its decoder blocks" in str(error) and "model.norm.weight" in str(error), error
    else:
        raise AssertionError("a final norm with one slice's gradient was not caught")
    finally:
        tensor_parallel._sequence_parallel_norms, tensor_parallel._check_region_parameters = norms, guard


def check_block_check_tolerance_and_verdicts_unit():
    """The comparison itself: NaN fails; a 2e-3 relative error fails (the tolerance's derivation: rounding
    stays under 1e-5, a real fault is 1e-3 or more); rounding (1e-6) passes."""
    from tridist.distcore import block_check

    expected = torch.linspace(-1, 1, 64)
    tolerance = block_check._RELATIVE_TOLERANCE
    assert block_check._relative_error(expected + 1e-6, expected, 0.0) <= tolerance
    assert not block_check._relative_error(expected * (1 + 2e-3), expected, 0.0) <= tolerance
    nan = expected.clone()
    nan[3] = float("nan")
    assert not block_check._relative_error(nan, expected, 0.0) <= tolerance


def check_attention_with_dropout_in_global_view_runs_on_local_shards():
    """Attention with dropout in a block in global view takes torch's math path, which DTensor cannot run (a
    causal mask built as a plain tensor: "mixed torch.Tensor and DTensor"; Phi-3 crashed on a view). It runs
    on each rank's own batch rows or heads instead (global_view.attention_on_local_shards). At dropout 0 it
    equals the attention of the whole tensors, output and the gradients of q, k and v, for every split of the
    query (rows, heads, none), key and value split alike or replicated, grouped-query heads, and masks causal,
    boolean per row, float per head, or a replicated DTensor. Allowed: 2^-20 of the largest value: each rank
    runs the same kernel on the same (row, head) slices, whose blocking does not depend on how many there are
    (equal bit for bit here); a kernel whose blocking did would round differently, 2^-24 per operation over 16
    terms. With dropout, replicated attention draws one mask on every rank of the group, and a head split masks of
    this rank's own (ShardedRegionRandomState, as in local view): with every head's inputs alike, the two ranks'
    outputs differ."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from tridist.distcore.global_view import _LocalAttention, attention_on_local_shards
    from tridist.distcore.random_state import ShardedRegionRandomState

    mesh = MESH.device_mesh["mp"]
    generator = torch.Generator().manual_seed(0)
    batch, heads, seq, dim = 2, 4, 8, 16
    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    splits = (Shard(0), Shard(1), Replicate())
    cases = [(q, kv, g, m, batch) for q in splits for kv in (None, Replicate()) for g in (False, True)
             for m in ("causal", "bool", "float", "dtensor")]
    # Masks of fewer dims, aligned from the right ([seq, seq]; [heads, seq, seq]), under each split; 3 batch rows,
    # which 2 ranks do not divide: computed whole on each rank (Replicate), not split unevenly
    cases += [(Shard(1), None, False, "2-d", batch), (Shard(0), None, False, "3-d", batch),
              (Shard(1), None, False, "3-d", batch), (Shard(0), None, False, "causal", 3), (Shard(0), None, True, "bool", 3)]
    for query_split, kv_split, grouped, mask_kind, rows in cases:
        q = rand(rows, heads, seq, dim).requires_grad_()
        k, v = (rand(rows, heads // 2 if grouped else heads, seq, dim).requires_grad_() for _ in range(2))
        mask = {"causal": None, "bool": rand(rows, 1, seq, seq) > -0.5, "float": rand(rows, heads, seq, seq),
                "dtensor": rand(1, 1, seq, seq), "2-d": rand(seq, seq), "3-d": rand(heads, seq, seq)}[mask_kind]
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=grouped)
        grad = rand(*want.shape)
        want.backward(grad)
        dq = distribute_tensor(q.detach(), mesh, [query_split]).requires_grad_()
        dk, dv = (distribute_tensor(t.detach(), mesh, [kv_split or query_split]).requires_grad_() for t in (k, v))
        dmask = distribute_tensor(mask, mesh, [Replicate()]) if mask_kind == "dtensor" else mask
        got = attention_on_local_shards(dq, dk, dv, attn_mask=dmask, is_causal=mask is None, enable_gqa=grouped)
        got.backward(distribute_tensor(grad, mesh, got.placements))
        case = (query_split, kv_split, grouped, mask_kind, rows)
        assert got.placements == ((Replicate(),) if rows % mesh.size() else (query_split,)), (case, got.placements)
        for name, value, expected in (("out", got, want), ("dq", dq.grad, q.grad), ("dk", dk.grad, k.grad),
                                      ("dv", dv.grad, v.grad)):
            scale = float(expected.abs().max())
            torch.testing.assert_close(value.full_tensor(), expected, rtol=0, atol=2**-20 * scale, msg=lambda m: f"{case} {name}: {m}")
    # With dropout, through the global view's mode: the output is a mask's (not the whole attention at dropout 0).
    # Every head's inputs alike, so that both ranks' local heads are too.
    q, k, v = (rand(batch, 1, seq, dim).expand(batch, heads, seq, dim).contiguous() for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for split in (Replicate(), Shard(1)):
        placed = [distribute_tensor(t, mesh, [split]) for t in (q, k, v)]
        torch.manual_seed(5)  # alike on every rank, as TensorParallelRandomState keeps them
        with _LocalAttention(ShardedRegionRandomState(mesh.get_local_rank(), torch.device("cpu"))):
            out = F.scaled_dot_product_attention(*placed, dropout_p=0.5, is_causal=True)
        assert isinstance(out, DTensor) and out.placements == (split,), out
        assert not torch.allclose(out.to_local(), whole if split == Replicate() else whole.chunk(2, dim=1)[0])
        if split == Replicate():  # on the shared stream: as the same call on plain tensors
            torch.manual_seed(5)
            assert torch.equal(out.to_local(), F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True))
        others = [None] * mesh.size()
        torch.distributed.all_gather_object(others, out.to_local(), group=mesh.get_group())
        alike = all(torch.equal(o, others[0]) for o in others)
        assert alike if split == Replicate() else not alike, (
            split, "both ranks drew one mask" if alike else "replicas drew apart")



class _DropoutBlock(torch.nn.Module):
    """up (column-parallel) -> dropout of this rank's features -> down (row-parallel) -> dropout of the replicated
    output (`outer`; else none)."""

    def __init__(self, outer: bool = True):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.inner, self.outer = torch.nn.Dropout(0.5), torch.nn.Dropout(0.5) if outer else torch.nn.Identity()

    def forward(self, x):
        return self.outer(self.down(self.inner(self.up(x))))


def check_dropout_in_a_sharded_region_draws_this_ranks_own_masks():
    """Between a column-parallel output and the row-parallel input each tp rank holds its own features (heads):
    a dropout there draws from this rank's stream (ShardedRegionRandomState, Megatron's RNG tracker), so the two
    ranks' masks differ (with one stream, feature f and f + 32 shared theirs), while the dropout of the replicated
    output after the row-parallel linear draws one mask on both. Two blocks draw different masks, also with no
    draw from the shared stream between them (the first block has no outer dropout). Activation
    recompute (torch's checkpoint, as distcore's recompute and Hugging Face's gradient checkpointing run it)
    replays each region's masks: the output and every gradient equal the run without it, bit for bit. A forward
    stopped inside a region (an error there) leaves it closed (the guard on the column-parallel linear's parent)."""
    from torch.utils.checkpoint import checkpoint

    mesh, peers = MESH.device_mesh["mp"], MESH.device_mesh["mp"].get_group()
    torch.manual_seed(0)
    model = torch.nn.Sequential(_DropoutBlock(outer=False), _DropoutBlock())
    model, _ = distcore.parallelize(model, None, MESH, {"mp_config": {"parallelize_plan": {
        r"\d\.up": ColWiseParallel(), r"\d\.down": RowWiseParallel()}}})
    masks = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_hook(lambda m, args, out, name=name: masks.__setitem__(name, out == 0))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

    def run(recompute: bool):
        for block in model:
            vars(block).pop("forward", None)
            if recompute:
                block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)
        torch.manual_seed(2)  # alike on both tp ranks, as TensorParallelRandomState keeps them per call
        out = model(x)
        out.square().sum().backward()
        grads = {n: p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone()
                 for n, p in model.named_parameters()}
        model.zero_grad()
        return out.detach(), grads, dict(masks), torch.get_rng_state()

    out, grads, drawn, state = run(recompute=False)
    theirs = [None] * mesh.size()
    torch.distributed.all_gather_object(theirs, (drawn, state), group=peers)
    other = theirs[1 - mesh.get_local_rank()]
    assert torch.equal(drawn["1.outer"], other[0]["1.outer"]), "the replicated output's masks differ"
    for block in ("0", "1"):
        assert not torch.equal(drawn[f"{block}.inner"], other[0][f"{block}.inner"]), "both ranks drew one inner mask"
    assert not torch.equal(drawn["0.inner"], drawn["1.inner"]), "two regions drew one mask"
    assert torch.equal(state, other[1]), "the shared stream parted"
    again, grads_again, drawn_again, _ = run(recompute=True)
    assert torch.equal(out, again) and all(torch.equal(drawn[n], drawn_again[n]) for n in drawn)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_again[name]), f"{name}: the recomputed regions drew other masks"
    tracker = next(hook.__self__ for hook in model[0].up._forward_hooks.values() if hook.__name__ == "enter")

    def stop(*_):
        raise RuntimeError("stopped inside the region")

    handle = model[0].inner.register_forward_hook(stop)
    try:
        model(x)
    except RuntimeError as error:
        assert "stopped inside" in str(error), error
    finally:
        handle.remove()
    assert tracker._shared is None, "a region stayed open after the forward raised"
    # A column-parallel linear that gathers its output opens no region: the activations after it are replicated, and
    # a dropout there draws one mask on both ranks
    torch.manual_seed(0)
    gathered, _ = distcore.parallelize(torch.nn.Sequential(_DropoutBlock(outer=False)), None, MESH, {"mp_config": {
        "parallelize_plan": {r"0\.up": ColWiseParallel(gather_output=True), r"0\.down": RowWiseParallel(is_input_parallel=False)}}})
    gathered[0].inner.register_forward_hook(lambda m, args, out: masks.__setitem__("gathered", out == 0))
    torch.manual_seed(3)
    gathered(x)
    theirs = [None] * mesh.size()
    torch.distributed.all_gather_object(theirs, masks["gathered"], group=peers)
    assert masks["gathered"].shape[-1] == 64 and all(torch.equal(m, theirs[0]) for m in theirs), \
        "a dropout after a gathered output drew apart"


def check_a_vocabulary_split_embedding_equals_one_device():
    """RowWiseParallel on an nn.Embedding (vocab_embedding.py): each mp rank looks up the ids in its rows of the
    vocabulary and the ranks sum their outputs, which equal one device's bit for bit (a row plus zeros), and so does
    the weight's gradient. The padding row's gradient is zero, and only it: the padding index is shifted into the
    rank's rows with the ids (rank 1's local row 3 is token 11, whose gradient the global index 3 would zero), also
    at either end of a rank's rows (0 and 7 on rank 0, 8 on rank 1: local 0, the last row, one past it). An id
    outside the vocabulary, above or below, raises, as on one device; a lookup that fails inside the embedding leaves
    the module as it was. An option a rank cannot honour on its rows alone (max_norm) is refused."""
    ids = torch.tensor([[1, 11, 3, 8], [15, 0, 7, 9]])  # each padding index below and its row on the other rank
    for padding in (3, 0, 7, 8):
        torch.manual_seed(0)
        whole = torch.nn.Embedding(16, 6, padding_idx=padding)
        model, _ = distcore.parallelize(torch.nn.Sequential(copy.deepcopy(whole)), None, MESH,
                                        {"mp_config": {"parallelize_plan": {"0": RowWiseParallel()}}})
        assert _placements(model[0].weight) == (distcore.Replicate(), Shard(0)), model[0].weight.placements
        out, expected = model(ids), whole(ids)
        assert type(out) is torch.Tensor and torch.equal(out, expected), (padding, (out - expected).abs().max())
        grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
        out.backward(grad)
        expected.backward(grad)
        got = model[0].weight.grad.full_tensor()
        assert torch.equal(got, whole.weight.grad), (padding, (got - whole.weight.grad).abs().amax(1))
        assert not got[padding].any() and got[(padding + 8) % 16].any(), padding
        assert model[0].padding_idx == padding and type(model[0].weight).__name__ == "DTensor"  # swapped back
    for bad in (16, -1):  # an id outside the vocabulary: an error, as on one device (not zeros, which no rank's rows hold)
        try:
            model(torch.tensor([[1, bad]]))
        except RuntimeError as error:
            assert "token ids must lie in [0, 16)" in str(error), error
        else:
            raise AssertionError(f"the id {bad}, outside the vocabulary, was looked up")
    try:  # fails in F.embedding itself, after the lookup swapped in the local weight and padding index
        model(torch.tensor([[1.0, 2.0]]))
    except RuntimeError as error:
        assert "indices" in str(error), error
    else:
        raise AssertionError("floating-point ids were looked up")
    assert model[0].padding_idx == 8 and type(model[0].weight).__name__ == "DTensor", model[0].padding_idx  # put back
    assert "_tridist_vocab_lookup" not in vars(model[0])
    try:
        distcore.parallelize(torch.nn.Sequential(torch.nn.Embedding(16, 6, max_norm=1.0)), None, MESH,
                             {"mp_config": {"parallelize_plan": {"0": RowWiseParallel()}}})
    except NotImplementedError as error:
        assert "with max_norm" in str(error) and "leave '0' out of the plan" in str(error), error
    else:
        raise AssertionError("an embedding with max_norm was split on its vocabulary")


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
