"""Checks of mp_config["overlap_comm"] (distcore/overlap.py): sequence-parallel tensor parallel whose
region edges run kernels.all_gather_matmul / matmul_reduce_scatter. Run on 4 gloo processes (tp 4 and
dp 2 x tp 2) and on 2 (tp 2) by test_overlap.py: every strategy trains like one process with overlap on
and off, on the seed model, the HF-style model (grouped-query attention), the packed-qkv model, with
the fused kernels and with FSDP2 sharding on the same mesh; the profiler shows the rings ran."""

from __future__ import annotations

import copy
import os

import torch

from tridist import distcore
from tridist.distcore import ColWiseParallel, ProcessMesh, RowWiseParallel
from tests.distributed import equivalence
from tests.distributed.harness import interprets_kernels, run_checks
from tests.distributed.symm_mem_cpu import symm_mem_on_cpu
from tests.distributed.tensor_parallel_worker import (
    GQA_PACKED_PLAN,
    HF_PLAN,
    PADDLE_SEED_PLAN,
    SEED_PLAN,
    SP_BOUNDARIES_SEED,
    _batches,
    _model,
    _reference_run,
    _train,
)

SEED_SP_PLAN = {**SEED_PLAN, **SP_BOUNDARIES_SEED}
HF_SP_PLAN = {
    **HF_PLAN,
    "model.embed_tokens": [ColWiseParallel(), distcore.SequenceParallelBegin()],
    "model.layers.*.self_attn": distcore.SequenceParallelDisable(),
    "model.layers.*.mlp": distcore.SequenceParallelDisable(),
    "lm_head": distcore.SequenceParallelEnd(),
}
RINGS = ("tridist.all_gather_matmul", "tridist.all_gather_matmul.backward", "tridist.matmul_reduce_scatter",
         "tridist.matmul_reduce_scatter.backward")


def _world() -> int:
    return int(os.environ["WORLD_SIZE"])


def _tp_mesh() -> ProcessMesh:
    """Every rank in one tensor-parallel group: tp 4 on 4 processes, tp 2 on 2."""
    return ProcessMesh(list(range(_world())), dim_names=["mp"])


def _dp_tp_mesh() -> ProcessMesh | None:
    """dp 2 x tp 2 on 4 processes (the layout tensor_parallel_worker's _train shards batches for)."""
    return ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]) if _world() == 4 else None


def _trains_like_one_process(name: str, mesh, config: dict, *, fused: bool = False, overlap: bool = True):
    config = {**config, "mp_config": {**config["mp_config"], "overlap_comm": overlap}}
    model, optimizer = distcore.parallelize(*_model(name, fused=fused), mesh, config)
    trace = _train(model, optimizer, sharded_inputs="dp" in mesh.dim_names)
    reference = _reference_run(name)  # one process, unfused
    assert set(trace.parameters) == set(reference.parameters)
    equivalence.assert_same_training(trace, reference)
    return model


def _overlapped(module) -> bool:
    return type(module).__name__.startswith("Overlapped")


def check_seed_model_overlap_on_and_off():
    """tp 4 (tp 2 on two processes): the seed model with sequence parallel, overlap on and off, equal to one process."""
    model = _trains_like_one_process("seed-llama", _tp_mesh(), {"mp_config": {"parallelize_plan": SEED_SP_PLAN}})
    layer = model.layers[0]
    assert all(_overlapped(m) for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                        layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj))
    assert type(layer.self_attn.q_proj).__name__ == "OverlappedEntryLinear"
    assert layer.self_attn.num_heads == 4 // _world()  # local heads, as without overlap
    off = _trains_like_one_process("seed-llama", _tp_mesh(), {"mp_config": {"parallelize_plan": SEED_SP_PLAN}},
                                   overlap=False)
    assert not _overlapped(off.layers[0].self_attn.q_proj)


def check_hf_style_model_with_grouped_query_heads():
    """The HF-style model (4 query / 2 key-value heads): tp 2 alone, and dp 2 x tp 2 with ZeRO-2."""
    if _world() == 2:
        _trains_like_one_process("hf-llama", _tp_mesh(), {"mp_config": {"parallelize_plan": HF_SP_PLAN}})
    else:
        _trains_like_one_process("hf-llama", _dp_tp_mesh(), {"dp_config": {"sharding_level": 2},
                                                             "mp_config": {"parallelize_plan": HF_SP_PLAN}})


def check_packed_qkv_and_gate_up():
    """paddle-llama's packed qkv_proj and gate_up_proj (each part split on its own) are overlapped entries:
    the parallelize seed's plan, with dp sharding level 1 on 4 processes."""
    if _world() == 2:
        model = _trains_like_one_process("paddle-llama", _tp_mesh(), {"mp_config": {"parallelize_plan": PADDLE_SEED_PLAN}})
    else:
        model = _trains_like_one_process("paddle-llama", _dp_tp_mesh(), {"dp_config": {"sharding_level": 1},
                                                                         "mp_config": {"parallelize_plan": PADDLE_SEED_PLAN}})
    layer = model.llama.layers[0]
    assert _overlapped(layer.self_attn.qkv_proj) and _overlapped(layer.mlp.gate_up_proj)
    assert layer.self_attn.num_heads == 4 // 2 if _world() == 4 else 2


@interprets_kernels
def check_fused_kernels_and_fsdp2_on_the_same_mesh():
    """Fused RMSNorm / rotary / SwiGLU on local shards and sequence slices, FSDP2 (ZeRO-3: parameters
    sharded over dp too) on the tensor-parallel DTensors."""
    mesh = _dp_tp_mesh() or _tp_mesh()
    config = {"mp_config": {"parallelize_plan": SEED_SP_PLAN}}
    if "dp" in mesh.dim_names:
        config["dp_config"] = {"sharding_level": 3}
    model = _trains_like_one_process("seed-llama", mesh, config, fused=True)
    from tridist import kernels

    assert isinstance(model.layers[0].mlp, kernels.FusedSwiGLUMLP) and _overlapped(model.layers[0].mlp.gate_proj)


def _ring_events(model, ids, labels) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss, _ = model(ids, labels=labels)
        loss.backward()
    names = [event.name for event in prof.events()]
    return {ring: names.count(ring) for ring in RINGS}


def check_profiler_shows_the_overlapped_rings():
    """One ring per region edge and step: 2 layers x (attention + MLP) entries and exits, forward and backward;
    none without overlap."""
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    for overlap, expected in ((True, 4), (False, 0)):
        config = {"mp_config": {"parallelize_plan": SEED_SP_PLAN, "overlap_comm": overlap}}
        model, _ = distcore.parallelize(*_model("seed-llama"), _tp_mesh(), config)
        counts = _ring_events(model, ids, ids)
        assert counts == {ring: expected for ring in RINGS}, (overlap, counts)


class _Block(torch.nn.Module):
    def __init__(self, scale_input: str = ""):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.scale_input = scale_input  # "": reads its input; "copy": a scaled copy; "in place": scales it first

    def forward(self, x):
        if self.scale_input == "copy":
            x = x * 2
        elif self.scale_input == "in place":
            x.mul_(2)
        return self.down(torch.relu(self.up(x)))


class _Toy(torch.nn.Module):
    def __init__(self, scale_input: str = ""):
        super().__init__()
        self.inp, self.block, self.out = torch.nn.Linear(8, 8), _Block(scale_input), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


TOY_PLAN = {"inp": distcore.SequenceParallelBegin(), "block": distcore.SequenceParallelDisable(),
            "block.up": ColWiseParallel(), "block.down": RowWiseParallel(), "out": distcore.SequenceParallelEnd()}


def check_overlap_that_cannot_be_honoured_is_refused():
    def expect(error_type, message, plan, *, model=None, overlap=True, run=False):
        model = model or _Toy()
        try:
            model, _ = distcore.parallelize(model, None, _tp_mesh(), {"mp_config": {"parallelize_plan": plan,
                                                                                     "overlap_comm": overlap}})
            if run:
                model(torch.randn(2, 4, 8))
        except error_type as error:
            assert message in str(error), str(error)
        else:
            raise AssertionError(f"expected {error_type.__name__}: {message}")

    # tensor parallel without sequence parallel: nothing to overlap
    expect(ValueError, "has no sequence-parallel region", {"block.up": ColWiseParallel(), "block.down": RowWiseParallel()})
    # an entry projection fed something else than the region's input
    expect(RuntimeError, "block.up was called with a tensor other than its region's input", TOY_PLAN,
           model=_Toy(scale_input="copy"), run=True)
    expect(RuntimeError, "the input of block was changed in place before up read it", TOY_PLAN,
           model=_Toy(scale_input="in place"), run=True)
    # selective recompute wraps the attention's forward: its recomputation would skip the region's gather
    from tridist.autotune import ModelSpec
    from tridist.distcore.auto import apply_recompute

    model, _ = _model("seed-llama")
    structure = ModelSpec.from_module(model, seq_len=8).structure
    apply_recompute(model, layers=structure.layers, attention=structure.attention, mode="selective")
    expect(ValueError, "self_attn's forward is wrapped for activation recompute on its own", SEED_SP_PLAN, model=model)
    expect(ValueError, "mp_config['overlap_comm'] must be True, False or a backend's name ['ring', 'symm_mem']",
           TOY_PLAN, overlap="yes")
    # torch's symmetric-memory ops have no CPU kernels (outside symm_mem_on_cpu): refused before any change
    model = _Toy()
    expect(ValueError, "no kernel of symm_mem::fused_all_gather_matmul for cpu tensors", TOY_PLAN, model=model,
           overlap="symm_mem")
    assert type(model.block.up) is torch.nn.Linear
    # with pipeline stages too: the backend is refused as such, before the blocks are checked
    pp_mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "mp"])
    try:
        distcore.parallelize(*_model("seed-llama"), pp_mesh, {
            "mp_config": {"parallelize_plan": SEED_SP_PLAN, "overlap_comm": "symm_mem"},
            "pp_config": {"split_spec": "layers", "micro_batches": 2}})
    except ValueError as error:
        assert "mp_config['overlap_comm']: backend='symm_mem'" in str(error), str(error)
    else:
        raise AssertionError("overlap_comm='symm_mem' without kernels was accepted with pipeline stages")
    try:
        distcore.ToDistributedConfig(overlap_backend="nccl")
    except ValueError as error:
        assert "overlap_backend must be one of ['ring', 'symm_mem']" in str(error), str(error)
    else:
        raise AssertionError("ToDistributedConfig(overlap_backend='nccl') was accepted")
    # grouped-query q/k/v packed in one Linear: split on its input features, cannot be fed by the ring
    from tests.distributed.tensor_parallel_worker import CONSTANTS_SEQUENCE_PARALLEL, GroupedQueryPackedModel

    expect(ValueError, "its packed parts have unequal sizes", {**GQA_PACKED_PLAN, **CONSTANTS_SEQUENCE_PARALLEL},
           model=GroupedQueryPackedModel())


def check_toy_region_with_biases_equals_one_process():
    """Biases on both edges (the entry's split with its columns, the exit's added once after the
    reduce-scatter, its gradient summed over the sequence shards), against the same toy on one process."""
    _toy_region_with_biases(True)


def _toy_region_with_biases(overlap):
    torch.manual_seed(0)
    reference = _Toy()
    model, _ = distcore.parallelize(copy.deepcopy(reference), None, _tp_mesh(), {"mp_config": {"parallelize_plan": TOY_PLAN,
                                                                                         "overlap_comm": overlap}})
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    out, expected = model(x), reference(x)
    (out * out).sum().backward()
    (expected * expected).sum().backward()
    equivalence.assert_tensors_close("toy output", {"out": out.detach()}, {"out": expected.detach()})
    equivalence.assert_tensors_close("toy gradients", equivalence.gradients(model), equivalence.gradients(reference))
    # Under autocast the edges' outputs keep autocast's dtype (biases cast as F.linear casts them).
    plain, _ = distcore.parallelize(copy.deepcopy(reference), None, _tp_mesh(), {"mp_config": {"parallelize_plan": TOY_PLAN}})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen = {}
        for name, m in (("overlap", model), ("plain", plain)):
            hook = m.block.up.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, out.dtype))
            m(x)
            hook.remove()
    assert seen == {"overlap": torch.bfloat16, "plain": torch.bfloat16}, seen


def check_compiled_model_trains_like_one_process():
    """torch.compile of the whole overlapped model (aot_eager: the graphs Inductor would get): the rings are
    in the graphs (profiler ranges, once per region edge and step) and training equals one process. A
    region outside any decoder block (not checked by parallelize) must run eagerly once before it is traced."""
    torch._dynamo.reset()
    model, optimizer = distcore.parallelize(*_model("seed-llama"), _tp_mesh(),
                                            {"mp_config": {"parallelize_plan": SEED_SP_PLAN, "overlap_comm": True}})
    compiled = torch.compile(model, backend="aot_eager")
    trace = equivalence.train(model, optimizer, _batches(), forward=compiled)
    equivalence.assert_same_training(trace, _reference_run("seed-llama"))
    inputs, labels = _batches()[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # compiled already
        compiled(inputs, labels=labels)[0].backward()
    names = [event.name for event in prof.events()]
    assert {ring: names.count(ring) for ring in RINGS} == {ring: 4 for ring in RINGS}, \
        sorted(set(n for n in names if "tridist" in n))

    # A region outside the decoder blocks was not checked by parallelize: torch.compile must not trace its
    # entries unchecked. Dynamo turns the region's refusal into an eager fallback of that frame (where
    # the check runs), or the refusal reaches the caller: either way an in-place change is caught.
    for scale_input in ("", "in place"):
        torch._dynamo.reset()
        toy, _ = distcore.parallelize(_Toy(scale_input), None, _tp_mesh(),
                                      {"mp_config": {"parallelize_plan": TOY_PLAN, "overlap_comm": True}})
        x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
        try:
            out = torch.compile(toy, backend="aot_eager")(x.clone())
        except RuntimeError as error:
            assert ("block is traced by torch.compile before its in-place check ran" in str(error)
                    or "the input of block was changed in place" in str(error)), str(error)
            assert scale_input or "before its in-place check" in str(error), str(error)
        else:
            assert not scale_input, "an in-place change of an overlapped region's input went unnoticed when compiled"
            assert toy.block.up._tridist_region.checked  # ran eagerly, checked
            equivalence.assert_tensors_close("compiled toy", {"out": out}, {"out": toy(x.clone())})


def check_to_distributed_applies_a_strategy_with_overlap():
    """Strategy(overlap_tp_comm=True) through to_distributed: the projections run overlapped (not a field the
    engine ignores) and training equals one process; the search may now choose it too. Also with full
    activation recompute: the regions run again in backward (their rings too) and leave nothing behind."""
    _to_distributed_with_overlap("none")
    # pipeline stages of tp 2 (each stage's regions overlapped), with full recompute
    _to_distributed_with_overlap("full", pp=2 if _world() == 4 else 1)
    # The search's path: a strategy it proposes with overlap is checked on the model's blocks first;
    # the seed model's run overlapped, so nothing is excluded.
    assert _overlap_limits(distcore.ToDistributedConfig()) == {}


def _overlap_limits(config) -> dict:
    from tridist import autotune
    from tridist.distcore.auto import _tensor_parallel_limits

    model, _ = _model("seed-llama")
    strategy = autotune.Strategy(dp=1, tp=_world(), pp=1, sequence_parallel=True, overlap_tp_comm=True,
                                 micro_batch_size=4, num_micro_batches=1)
    return _tensor_parallel_limits(model, strategy, autotune.ModelSpec.from_module(model, seq_len=8), config)


def check_symm_mem_backend_trains_like_one_process():
    """overlap through torch's symmetric-memory ops (ToDistributedConfig.overlap_backend, mp_config's
    "overlap_comm": "symm_mem"), run on CPU with torch's reference implementations (symm_mem_cpu.py):
    the seed model through to_distributed and the toy with biases equal one process; the ops ran."""
    with symm_mem_on_cpu():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model = _to_distributed_with_overlap("none", backend="symm_mem")
        assert model.layers[0].self_attn.o_proj._tridist_overlap_backend == "symm_mem"
        names = [event.name for event in prof.events()]
        # Every overlapped call ran torch's op: each all-gather (a forward entry, an exit's backward) and
        # each reduce-scatter (a forward exit, an entry's backward); a call left on the ring would not.
        count = names.count
        assert count("tridist.all_gather_matmul") > 0, sorted(set(n for n in names if "tridist" in n))
        assert count("symm_mem::fused_all_gather_matmul") == \
            count("tridist.all_gather_matmul") + count("tridist.matmul_reduce_scatter.backward")
        assert count("symm_mem::fused_matmul_reduce_scatter") == \
            count("tridist.matmul_reduce_scatter") + count("tridist.all_gather_matmul.backward")
        _toy_region_with_biases("symm_mem")
        assert _overlap_limits(distcore.ToDistributedConfig(overlap_backend="symm_mem")) == {}
    # Without kernels for these tensors, the setting is refused at once (not dropped by the search).
    try:
        distcore.to_distributed(*_model("seed-llama"), _loader(), device_num=_world(),
                                config=distcore.ToDistributedConfig(overlap_backend="symm_mem"))
    except ValueError as error:
        assert "ToDistributedConfig.overlap_backend: backend='symm_mem'" in str(error) and "cpu tensors" in str(error), error
    else:
        raise AssertionError("to_distributed accepted overlap_backend='symm_mem' without kernels for CPU tensors")


def _loader():
    batches = _batches()
    return torch.utils.data.DataLoader([(i, l) for inputs, labels in batches for i, l in zip(inputs, labels)],
                                       batch_size=batches[0][0].shape[0])


def _to_distributed_with_overlap(recompute: str, pp: int = 1, backend: str = "ring"):
    from tridist import autotune

    tp = _world() // pp
    strategy = autotune.Strategy(dp=1, tp=tp, pp=pp, sequence_parallel=True, overlap_tp_comm=True,
                                 micro_batch_size=4 // pp, num_micro_batches=pp, recompute=recompute)
    model, optimizer = _model("seed-llama")
    loader = _loader()
    config = distcore.ToDistributedConfig(strategy=strategy, fuse_kernels=False, overlap_backend=backend)
    dist_model, dist_opt, dist_loader = distcore.to_distributed(model, optimizer, loader, device_num=tp * pp, config=config)
    layer = next(m for m in dist_model.modules() if hasattr(m, "self_attn") and not getattr(m, "_tridist_stand_in", False))
    assert _overlapped(layer.self_attn.q_proj) and _overlapped(layer.self_attn.o_proj), type(layer.self_attn.q_proj)
    equivalence.assert_same_training(equivalence.train(dist_model, dist_opt, dist_loader()), _reference_run("seed-llama"))
    return dist_model


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    run_checks(CHECKS)  # ends the process group
