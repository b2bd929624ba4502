"""Checks of parallelize's tensor parallelism (mp_config) on 4 gloo processes: a 2x2 (dp, mp) mesh,
losses and parameters equal to one process on the same global batches."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import distcore
import kernels
from bench.models import build_model
from distcore import ColWiseParallel, ProcessMesh, RowWiseParallel, Shard
from tests.distributed.harness import run_checks

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
SEED_PLAN = {  # the seed model's LM head is a bare parameter: left replicated here
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
    model = build_model(name)
    if fused:
        kernels.fuse(model)
    # SGD: its update is linear in the gradient, so tensor-parallel summation order stays at rounding
    # level (Adam divides by sqrt(v) and amplifies it where gradients are near zero).
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def _train(model, optimizer, *, sharded_inputs: bool):
    losses = []
    for inputs, labels in _batches():
        if sharded_inputs:  # global-view batches split over dp, as shard_dataloader yields them
            inputs, labels = (distcore.shard_tensor(t, MESH, [Shard(0), distcore.Replicate()]) for t in (inputs, labels))
        loss, _ = model(inputs, labels=labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _equal_to_one_process(name: str, config: dict, *, fused: bool = False, sharded_inputs: bool = False):
    reference, ref_optimizer = _model(name, fused=fused)
    ref_losses = _train(reference, ref_optimizer, sharded_inputs=False)
    model, optimizer = _model(name, fused=fused)
    model, optimizer = distcore.parallelize(model, optimizer, MESH, config)
    losses = _train(model, optimizer, sharded_inputs=sharded_inputs)
    assert all(abs(a - b) < 2e-5 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    ref_params = dict(reference.named_parameters())
    initial, _ = _model(name, fused=fused)
    initial_params = dict(initial.named_parameters())
    assert set(ref_params) == {n for n, _ in model.named_parameters()}  # nothing lost or renamed
    for pname, param in model.named_parameters():
        full = distcore.unshard_dtensor(param.detach())
        assert torch.allclose(full, ref_params[pname].detach(), atol=5e-5), (pname, (full - ref_params[pname]).abs().max())
        # Trained, not merely equal to the initial value in both runs (a parameter the optimizer lost).
        assert not torch.equal(full, initial_params[pname].detach()), f"{pname} was never updated"
    return model


def check_hf_model_tensor_parallel():
    model = _equal_to_one_process("hf-llama", {"mp_config": {"parallelize_plan": HF_PLAN}})
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.to_local().shape[0] == attention.q_proj.weight.shape[0] // 2


def check_seed_model_with_fixed_head_count_reshape():
    model = _equal_to_one_process("seed-llama", {"mp_config": {"parallelize_plan": SEED_PLAN}})
    assert model.layers[0].self_attn.num_heads == 2  # 4 heads, 2 per tensor-parallel rank


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
    assert attention.o_proj._tridist_scatters_sequence and hooks == ["_check_exit.<locals>.hook"], hooks


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


def check_sequence_parallel_with_fused_kernels_and_data_parallel():
    """FusedRMSNorm on sequence slices (DTensor inputs) + fused SwiGLU/rotary on local shards, dp2 x mp2."""
    config = {"dp_config": {"sharding_level": 2}, "mp_config": {"parallelize_plan": {**SEED_PLAN, **SP_BOUNDARIES_SEED}}}
    model = _equal_to_one_process("seed-llama", config, fused=True, sharded_inputs=True)
    assert isinstance(model.layers[0].input_layernorm, kernels.FusedRMSNorm)


def check_implicit_sequence_parallel_stays_inside_the_region():
    """Only norms between Begin and End run on sequence slices; one before or after sees the whole
    sequence and must keep plain parameters (reducing its gradients would multiply them by tp)."""
    from distcore.tensor_parallel import _sequence_parallel_norms

    toy = torch.nn.Sequential()
    toy.add_module("pre_norm", torch.nn.LayerNorm(8))
    toy.add_module("embed", torch.nn.Linear(8, 8))
    toy.add_module("mid_norm", torch.nn.LayerNorm(8))
    toy.add_module("head", torch.nn.Linear(8, 8))
    toy.add_module("post_norm", torch.nn.LayerNorm(8))
    toy.embed._tridist_sequence_parallel = "SequenceParallelBegin"
    toy.head._tridist_sequence_parallel = "SequenceParallelEnd"
    names = [name for name, _ in toy.named_modules()]
    region = (names.index("embed"), names.index("head"))
    changes = _sequence_parallel_norms(toy, region=region, tp_mesh=MESH.device_mesh["mp"])
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


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = torch.nn.Linear(8, 8), _ToyBlock(), torch.nn.Linear(8, 8)
        self.qkv_proj = torch.nn.Linear(8, 24)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def check_sequence_parallel_refusals():
    def expect(error_type, message, plan, model=None):
        model = model or _Toy()
        try:
            model, _ = distcore.parallelize(model, None, MESH, {"mp_config": {"parallelize_plan": plan}})
            model(torch.randn(2, 2, 8))  # a sequence of 2 = tp: a wrong exit would broadcast silently
        except error_type as error:
            assert message in str(error), str(error)
        else:
            raise AssertionError(f"expected {error_type.__name__}: {message}")

    Begin, End, Disable = distcore.SequenceParallelBegin, distcore.SequenceParallelEnd, distcore.SequenceParallelDisable
    expect(RuntimeError, "is not the output of its row-parallel linear",
           {"inp": Begin(), "block": Disable(), "block.up": ColWiseParallel(), "block.o_proj": RowWiseParallel(), "out": End()})
    expect(ValueError, "run on sequence slices", {"inp": Begin(), "out": End()})  # block's weights uncovered
    expect(ValueError, "assume activations already split", {"block": Disable()})
    expect(NotImplementedError, "packed projection", {"qkv_proj": ColWiseParallel()})
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
        ({"parallelize_plan": {"model.norm": ColWiseParallel()}}, NotImplementedError, "nn.Linear and nn.Embedding"),
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
        distcore.parallelize(seed, optimizer, MESH, {"mp_config": {"parallelize_plan": {"weight": ColWiseParallel()}}})
    except NotImplementedError as error:
        assert "bare weight parameter" in str(error)
    else:
        raise AssertionError("expected NotImplementedError for the seed's bare LM head weight")


def check_degree_must_divide_the_model():
    mesh = ProcessMesh([0, 1, 2, 3], ["mp"])
    model, optimizer = _model("hf-llama")  # 2 key/value heads cannot be split over 4 ranks
    try:
        distcore.parallelize(model, optimizer, mesh, {"mp_config": {"parallelize_plan": HF_PLAN}})
    except ValueError as error:
        assert "num_key_value_heads = 2 heads cannot be split over 4" in str(error), str(error)
    else:
        raise AssertionError("expected a ValueError")


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)
    dist.destroy_process_group()
