"""Checks of to_distributed on gloo processes (world size from torchrun): the seed's example loop as
written (`dist_loader()`, `clear_grad()`) trains like one device, with the searched strategy and with
strategies forced through ToDistributedConfig.strategy that cover tp, sp, pp, interleaving,
micro-batching (gradient accumulation) and recompute."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from tridist import autotune
from tridist import distcore
from tridist.bench.models import build_model, make_seed_dataloader, seed_llama
from tests.distributed import equivalence
from tests.distributed.harness import run_checks

BATCH, BATCHES, SEQ_LEN, VOCAB, LAYERS = 4, 3, 8, 128, 4


def _model(name: str = "seed-llama", layers: int = LAYERS):
    torch.manual_seed(0)
    model = build_model(name, num_hidden_layers=layers)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loader():
    return make_seed_dataloader(batch_size=BATCH, batch_num=BATCHES, seq_length=SEQ_LEN, vocab_high=VOCAB)


@functools.cache  # one single-device run per model, shared by the checks
def _reference(name: str, layers: int = LAYERS) -> equivalence.Trace:
    model, optimizer = _model(name, layers)
    return equivalence.train(model, optimizer, _loader())


def _seed_loop(name: str = "seed-llama", *, node_num: int = 1, layers: int = LAYERS, **config_fields):
    """The to_distributed seed's example, as written, after building model, opt and loader."""
    model, opt = _model(name, layers)
    dist_config = distcore.ToDistributedConfig(**config_fields)
    dist_model, dist_opt, dist_loader = distcore.to_distributed(
        model, opt, _loader(), device_num=dist.get_world_size() // node_num, node_num=node_num, config=dist_config
    )
    trace = equivalence.Trace()
    for epoch in range(1):
        dist_model.train()
        for i, data in enumerate(dist_loader()):
            inputs, labels = data
            loss, _ = dist_model(inputs, labels=labels)
            loss.backward()
            trace.step(dist_model, loss)
            dist_opt.step()
            dist_opt.clear_grad()
    assert len(trace.losses) == BATCHES, trace.losses
    equivalence.assert_same_training(trace.end(dist_model), _reference(name, layers))
    return dist_model, dist_opt, dist_loader


def check_searched_strategy_matches_one_device():
    model, optimizer, loader = _seed_loop(sequence_parallel=True)
    strategy = model.distributed_strategy
    assert strategy is optimizer.distributed_strategy is loader.distributed_strategy
    assert strategy.num_devices == dist.get_world_size() and strategy.global_batch_size == BATCH, strategy


def _forced(**fields):
    world = dist.get_world_size()
    return autotune.Strategy(**fields) if fields["dp"] * fields["tp"] * fields["pp"] == world else None


def check_tensor_sequence_and_pipeline_parallel_with_recompute():
    strategy = _forced(dp=1, tp=2, pp=2, sequence_parallel=True, micro_batch_size=2, num_micro_batches=2, recompute="full")
    if strategy is None:
        return
    calls = []
    model, _, _ = _seed_loop(strategy=strategy)
    owned = [layer for layer in model.layers if not getattr(layer, "_tridist_stand_in", False)]
    owned[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
    inputs, labels = next(iter(_loader()))
    loss, _ = model(inputs, labels=labels)
    assert len(calls) == 2 * 2, calls  # full recompute: every micro-batch's layer runs again in backward


def check_gradient_accumulation_with_tensor_and_data_parallel():
    strategy = _forced(dp=2, tp=2, pp=1, sharding_level=1, micro_batch_size=1, num_micro_batches=2)
    if strategy is not None:
        _seed_loop(strategy=strategy, fuse_kernels=False)  # fused kernels under tp: the check above


def check_interleaved_pipeline_on_hf_style_model():
    """dp 2 x pp 2 x 2 virtual stages of a 5-layer model on the stages the strategy lists (layers_per_stage 2, 1, 1,
    1, as the search's balanced layouts come: rank 0 holds stages 0 and 2, 3 layers; rank 1 stages 1 and 3, 2 layers;
    stage_layers' even layout, 1, 2, 1, 1, would give rank 0 two), uneven as the search offers interleaving where
    pp * virtual_pp does not divide the layers."""
    world = dist.get_world_size()
    if world != 4:  # smaller worlds are covered by the pipeline suite
        return
    strategy = autotune.Strategy(dp=world // 2, tp=1, pp=2, virtual_pp=2, micro_batch_size=1,
                                 num_micro_batches=BATCH // (world // 2), sharding_level=2 if world > 2 else 0,
                                 layers_per_stage=(2, 1, 1, 1))
    dist_model, _, _ = _seed_loop("hf-llama", layers=5, strategy=strategy, fuse_kernels=False)  # (the interpreter's cost)
    held = sum(1 for name, _ in dist_model.named_parameters() if name.endswith("input_layernorm.weight"))
    assert held == (3 if dist.get_rank() // 2 == 0 else 2), held  # ranks 0-1: pp stage 0 (ParallelDims: pp outermost)


def check_mixed_precision_computes_in_bf16_with_fp32_master_weights():
    world = dist.get_world_size()
    if world != 2:  # FSDP2's policy does not depend on the world size: one launch covers it
        return
    strategy = autotune.Strategy(dp=world, tp=1, pp=1, sharding_level=2 if world > 1 else 0, micro_batch_size=BATCH // world)
    model, opt = _model()
    seen = []
    model.layers[0].mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    model, opt, loader = distcore.to_distributed(
        model, opt, _loader(), device_num=world, config=distcore.ToDistributedConfig(strategy=strategy, mixed_precision="bfloat16", fuse_kernels=False)
    )
    trace = equivalence.train(model, opt, loader())
    assert seen and set(seen) == {torch.bfloat16}, seen
    assert all(p.dtype == torch.float32 for p in model.parameters())  # sharded fp32 master weights
    # Gradients reduced in fp32 (FSDP2's policy; its state is private API, read here only): bf16 sums would pass the
    # bf16 tolerance below
    from torch.distributed.fsdp import FSDPModule

    policies = {(m._get_fsdp_state()._mp_policy.param_dtype, m._get_fsdp_state()._mp_policy.reduce_dtype)
                for m in model.modules() if isinstance(m, FSDPModule)}
    assert policies == {(torch.bfloat16, torch.float32)}, policies
    equivalence.assert_same_training(trace, _reference("seed-llama"), rtol=equivalence.BF16_RTOL,
                                     loss_rtol=equivalence.BF16_LOSS_RTOL)  # bf16 rounding only


def check_invalid_forced_strategy_is_refused():
    model, opt = _model()
    bad = autotune.Strategy(dp=dist.get_world_size(), tp=1, pp=1, micro_batch_size=3, num_micro_batches=1)
    try:
        distcore.to_distributed(model, opt, _loader(), device_num=dist.get_world_size(), config=distcore.ToDistributedConfig(strategy=bad))
    except autotune.InvalidStrategy as error:
        assert "batch" in str(error), str(error)
    else:
        raise AssertionError("a strategy whose batch does not match the dataloader's was accepted")
    try:
        distcore.to_distributed(model, opt, _loader(), device_num=dist.get_world_size() + 1)
    except ValueError as error:
        assert "torchrun" in str(error), str(error)
    else:
        raise AssertionError("a device count that is not the world size was accepted")


class _LogitsFromEmbeddings(torch.nn.Module):
    """A hand-written decoder whose logits read the embeddings beside the last layer's output (a skip over every
    layer): no split into pipeline stages computes them (a later stage holds zeros for the embeddings)."""

    class Block(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.linear = torch.nn.Linear(width, width)

        def forward(self, hidden):
            return hidden + self.linear(hidden).tanh()

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, width)
        self.layers = torch.nn.ModuleList([self.Block(width) for _ in range(LAYERS)])
        self.norm = torch.nn.LayerNorm(width)
        self.lm_head = torch.nn.Linear(width, VOCAB)

    def forward(self, input_ids, labels=None):
        hidden = embeddings = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        logits = self.lm_head(self.norm(hidden) + embeddings)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def check_pipeline_parallel_is_refused_for_logits_that_read_other_outputs():
    """Forced pp 2: refused with the strategy (InvalidStrategy, naming the embeddings), before parallelize splits
    the model; searched over pp 2 only: the search keeps pp at 1 and says why, and the model trains."""
    world = dist.get_world_size()
    if world != 2:  # the probe does not depend on the world size: one launch covers it
        return
    torch.manual_seed(0)
    model = _LogitsFromEmbeddings()
    forced = autotune.Strategy(dp=1, tp=1, pp=2, micro_batch_size=BATCH // 2, num_micro_batches=2)
    try:
        distcore.to_distributed(model, None, _loader(), device_num=world, config=distcore.ToDistributedConfig(strategy=forced))
    except autotune.InvalidStrategy as error:
        assert "from ['embed_tokens'] besides" in str(error) and "would hold zeros" in str(error), str(error)
    else:
        raise AssertionError("pipeline parallel was accepted for logits computed from the embeddings")
    config = distcore.ToDistributedConfig(search_options={"space": autotune.SearchSpace(pp=(2,))})
    model, _, _ = distcore.to_distributed(model, None, _loader(), device_num=world, config=config)
    assert model.distributed_strategy.pp == 1, model.distributed_strategy


class _OutsideModule(torch.nn.Module):
    """The seed's Llama with a Linear of its own registered outside the span between the embedding and the final norm:
    after everything else (the final norm and the head's weight), or first (before the embedding). It is applied after
    the final norm, between the last layer and the final norm, or to every attention's input (a hook)."""

    def __init__(self, registered: str, applied: str):
        super().__init__()
        llama = _model(layers=2)[0]
        width = llama.norm.weight.shape[0]
        if registered == "first":
            self.extra = torch.nn.Linear(width, width)
        self.llama, self.applied = llama, applied
        if registered == "last":
            self.extra = torch.nn.Linear(width, width)
        if applied == "in attention":
            for layer in llama.layers:
                layer.self_attn.register_forward_pre_hook(lambda module, args: (self.extra(args[0]), *args[1:]))

    def forward(self, input_ids, labels=None):
        llama, (batch, seq) = self.llama, input_ids.shape
        hidden = llama.embed_tokens(input_ids)
        positions = torch.arange(seq).expand(batch, seq)
        mask = seed_llama._prepare_decoder_attention_mask(torch.ones(batch, seq, dtype=torch.bool), (batch, seq), hidden.dtype)
        for layer in llama.layers:
            hidden = layer(hidden, positions, mask)
        if self.applied == "before norm":
            hidden = self.extra(hidden)
        hidden = llama.norm(hidden)
        if self.applied == "after norm":
            hidden = self.extra(hidden)
        logits = hidden @ llama.weight
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def check_a_module_registered_outside_the_sequence_parallel_span_is_refused_on_its_slices():
    """The sequence-parallel span is read in registration order: a Linear registered after the final norm (or before
    the embedding) is left whole, its gradients not summed over the tp ranks. Given the whole sequence it is right,
    and trains as one process under tp 2 + sp: applied after the final norm, or inside every attention (a Disable
    region, which gathers the sequence; a first guard, which went by the state of the forward, refused it: a review's
    find). Applied between the last layer and the final norm, on this rank's slice of the sequence, its gradients
    covered that slice only, silently (registered last or first: the second a review's find); now the first forward
    raises, naming the module and the fix."""
    if dist.get_world_size() != 2:  # the guard does not depend on the world size: one launch covers it
        return
    strategy = autotune.Strategy(dp=1, tp=2, pp=1, sequence_parallel=True, micro_batch_size=BATCH)
    config = distcore.ToDistributedConfig(strategy=strategy, fuse_kernels=False)  # the guard is no kernel's
    for registered, applied in (("last", "after norm"), ("last", "in attention")):
        torch.manual_seed(0)
        whole = _OutsideModule(registered, applied)
        reference = equivalence.train(whole, torch.optim.SGD(whole.parameters(), lr=0.1), _loader())
        torch.manual_seed(0)
        whole = _OutsideModule(registered, applied)
        model, optimizer, loader = distcore.to_distributed(whole, torch.optim.SGD(whole.parameters(), lr=0.1), _loader(),
                                                           device_num=2, config=config)
        equivalence.assert_same_training(equivalence.train(model, optimizer, loader()), reference)

    for registered in ("last", "first"):
        torch.manual_seed(0)
        model, _, loader = distcore.to_distributed(_OutsideModule(registered, "before norm"), None, _loader(),
                                                   device_num=2, config=config)
        inputs, labels = next(iter(loader()))
        try:
            model(inputs, labels=labels)
        except ValueError as error:
            assert "'extra' (Linear) runs on a slice of the sequence (4 of its 8 tokens)" in str(error), error
            assert "register it between the decoder layers' list and the final norm" in str(error), error
        else:
            raise AssertionError(f"a Linear registered {registered} ran on sequence slices without an error")


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    distcore.init_parallel_env()
    run_checks(CHECKS)  # ends the process group
