"""Checks of LazyGuard models under parallelize on 4 gloo processes: every rank materialises only its
own shards, with the values the single-device LazyGuard model gets from initialize(), and trains alike."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tridist import distcore
from tridist.bench.models import build_model
from tridist.distcore import LazyGuard, ProcessMesh, Replicate, Shard
from tridist.distcore.lazy import LazyInitError, materialize
from tests.distributed import equivalence
from tests.distributed.harness import run_checks
from tests.distributed.tensor_parallel_worker import HF_PLAN, SEED_PLAN

WORLD, GLOBAL_BATCH, SEQ_LEN, STEPS = 4, 4, 8, 3
# 130 rows over 4 ranks: uneven FSDP shards (33, 33, 33, 31), so FSDP2's padded local storage is used.
UNEVEN_VOCAB = 130
DP_MESH = ProcessMesh(list(range(WORLD)), ["dp"])
MESH_2D = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


def _lazy_model(name: str, **overrides):
    torch.manual_seed(0)  # every rank alike: the guard's seed is drawn from the global generator
    with LazyGuard():
        return build_model(name, **overrides)


def _single_device(name: str, **overrides):
    """The reference: the same LazyGuard model, every tensor materialised with Paddle's initialize()."""
    model = _lazy_model(name, **overrides)
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.initialize()
    return model


def _batches(vocab: int):
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, vocab, (GLOBAL_BATCH, SEQ_LEN), generator=generator),
         torch.randint(0, vocab, (GLOBAL_BATCH, SEQ_LEN), generator=generator))
        for _ in range(STEPS)
    ]


def _train(model, optimizer, vocab: int, mesh=None) -> equivalence.Trace:
    batches = _batches(vocab)
    if mesh is not None:  # global-view batches split over dp, as shard_dataloader yields them
        placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
        batches = [tuple(distcore.shard_tensor(t, mesh, placements) for t in batch) for batch in batches]
    return equivalence.train(model, optimizer, batches)


def _materialisation_problems(model, reference) -> list[str]:
    """Right after parallelize: what is left on meta, and which tensors' shards do not form the
    reference value. Returned, not raised: every rank must go on to the same collectives."""
    ref = dict(reference.named_parameters()) | dict(reference.named_buffers())
    problems = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            problems.append(f"{name} is still on meta")
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # all-gathers the shards
        if not torch.equal(full.detach(), ref[name].detach()):
            problems.append(f"{name} differs by {(full - ref[name]).abs().max()}")
    return problems


def _equal_to_single_device(name: str, config: dict, mesh, make_optimizer, vocab: int, **overrides):
    reference = _single_device(name, vocab_size=vocab, **overrides)
    ref_trace = _train(reference, make_optimizer(reference.parameters()), vocab)

    model = _lazy_model(name, vocab_size=vocab, **overrides)
    optimizer = make_optimizer(model.parameters())  # built from meta parameters, the user's order
    model, optimizer = distcore.parallelize(model, optimizer, mesh, config)
    problems = _materialisation_problems(model, _single_device(name, vocab_size=vocab, **overrides))
    held = [p for group in optimizer.param_groups for p in group["params"]]
    trace = _train(model, optimizer, vocab, mesh=mesh)
    assert not problems, problems
    assert [id(p) for p in held] == [id(p) for p in model.parameters()] and not any(p.is_meta for p in held)
    equivalence.assert_same_training(trace, ref_trace)
    # The tensor-parallel check ran on the meta model's shapes and kept the local view.
    global_view = {name: m._tridist_global_view for name, m in model.named_modules() if hasattr(m, "_tridist_global_view")}
    assert not global_view, global_view
    return model


def _sgd(params):
    # SGD: tensor-parallel summation order stays at rounding level (see tensor_parallel_worker).
    return torch.optim.SGD(params, lr=0.5)


def check_fsdp_sharding_level_3_uneven_adamw():
    """ZeRO-3 over 4 ranks with uneven shards; AdamW built from the meta parameters before parallelize
    (eps raised to 1e-3 so that its update cannot amplify rounding: equivalence.py)."""
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-3)
    _equal_to_single_device("hf-llama", {"dp_config": {"sharding_level": 3}}, DP_MESH, adamw, UNEVEN_VOCAB)


def check_local_shards_right_after_parallelize():
    """Each rank's local tensors equal its slices of the single-device values, before any step: FSDP2's
    uneven Shard(0) chunks, and 2-D tensor parallel x FSDP2 (_StridedShard over dp, Shard over mp)."""
    rank = dist.get_rank()
    fsdp = _lazy_model("hf-llama", vocab_size=UNEVEN_VOCAB)
    fsdp, _ = distcore.parallelize(fsdp, None, DP_MESH, {"dp_config": {"sharding_level": 3}})
    two_d = _lazy_model("hf-llama")
    config = {"dp_config": {"sharding_level": 3}, "mp_config": {"parallelize_plan": HF_PLAN}}
    two_d, _ = distcore.parallelize(two_d, None, MESH_2D, config)
    # No collectives below: a failing rank cannot leave the others waiting.
    reference = dict(_single_device("hf-llama", vocab_size=UNEVEN_VOCAB).named_parameters())
    for name, param in fsdp.named_parameters():
        assert torch.equal(param.to_local().detach(), torch.chunk(reference[name].detach(), WORLD, dim=0)[rank]), name
    assert fsdp.model.embed_tokens.weight.to_local().shape[0] == (31 if rank == 3 else 33)  # torch.chunk's sizes

    reference = dict(_single_device("hf-llama").named_parameters())
    dp, mp = MESH_2D.device_mesh.get_coordinate()
    layer, ref = two_d.model.layers[0], "model.layers.0"
    q = reference[f"{ref}.self_attn.q_proj.weight"].detach()  # column-parallel: rows over mp, then over dp
    assert torch.equal(layer.self_attn.q_proj.weight.to_local().detach(), q.chunk(2)[mp].chunk(2)[dp])
    down = reference[f"{ref}.mlp.down_proj.weight"].detach()  # row-parallel: columns over mp, rows over dp
    assert torch.equal(layer.mlp.down_proj.weight.to_local().detach(), down.chunk(2, dim=1)[mp].chunk(2)[dp])


def check_tensor_parallel_2d_with_fsdp():
    config = {"dp_config": {"sharding_level": 3}, "mp_config": {"parallelize_plan": HF_PLAN}}
    _equal_to_single_device("hf-llama", config, MESH_2D, _sgd, 128)


def check_seed_model_tensor_parallel_replicated_dp():
    """The seed model (bare LM head weight, rotary cos/sin buffers) under mp x replicated dp (level 0)."""
    config = {"dp_config": {"sharding_level": 0}, "mp_config": {"parallelize_plan": SEED_PLAN}}
    model = _equal_to_single_device("seed-llama", config, MESH_2D, _sgd, 128)
    assert isinstance(model.layers[0].self_attn.q_proj.weight, DTensor)


def check_module_outside_the_tree_is_never_materialised():
    """Only what is in the module tree is materialised (pipeline stand-ins hold other stages' modules
    outside it): a block taken out of the tree keeps its parameters on meta."""
    model = _lazy_model("hf-llama")
    removed = model.model.layers[1]
    model.model.layers[1] = torch.nn.Identity()  # a parameter-free stand-in
    outside = removed.self_attn.q_proj.weight
    model, _ = distcore.parallelize(model, None, DP_MESH, {"dp_config": {"sharding_level": 3}})
    assert all(not p.is_meta for p in model.parameters())
    assert all(p.is_meta for p in removed.parameters()) and outside.is_meta


def check_materialize_after_a_manual_fully_shard():
    """torchtitan's order, with distcore.lazy.materialize in place of to_empty + init: fully_shard on
    the meta model, then materialise; FSDP2 pads the uneven shards from the local tensors written."""
    inputs = torch.randint(0, UNEVEN_VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    _, expected = _single_device("hf-llama", vocab_size=UNEVEN_VOCAB)(inputs)
    model = _lazy_model("hf-llama", vocab_size=UNEVEN_VOCAB)
    for block in model.model.layers:
        fully_shard(block, mesh=DP_MESH.device_mesh)
    fully_shard(model, mesh=DP_MESH.device_mesh)
    materialize(model)
    _, logits = model(inputs)
    equivalence.assert_tensors_close("logits", {"logits": logits.detach()}, {"logits": expected.detach()})


def check_ranks_seeded_differently_are_refused():
    torch.manual_seed(dist.get_rank())  # the mistake: each rank draws another guard seed
    with LazyGuard():
        model = build_model("hf-llama")
    try:
        distcore.parallelize(model, None, DP_MESH, {"dp_config": {"sharding_level": 3}})
    except LazyInitError as error:
        assert "different seeds" in str(error) and "torch.manual_seed" in str(error), str(error)
    else:
        raise AssertionError("expected a LazyInitError")


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
