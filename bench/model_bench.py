"""Model benchmark: one decoder layer's forward + backward and a small Llama's training step, per variant.

Targets ("layer" and "model" on `bench.models.hf_llama`, our replica of Hugging Face's Llama, which needs no
transformers; "hf-model" on transformers' own):

- "layer": one `LlamaDecoderLayer`, forward and backward: input hidden states that require grad, a
  fixed random gradient of the output, the rotary tables and causal mask computed once outside (as
  the model shares them across layers).
- "model": `LlamaForCausalLM`'s whole training step: forward with labels (HF's shifted causal-LM
  loss), backward, `AdamW(foreach=True).step()` and `zero_grad(set_to_none=True)`.
- "hf-model": the same step and sizes on transformers' `LlamaForCausalLM` (its default attention), the model
  users bring: `fuse` also replaces its LM head and loss by the fused linear cross-entropy there, so its
  "fused" and "fused-no-lce" rows give the step's peak memory with and without the [tokens, vocab] logits.
  Without transformers its rows say so.
- "hf-moe": the same step on transformers' `MixtralForCausalLM` (stacked SwiGLU experts, `top_k` per token),
  whose experts `fuse` runs as grouped GEMMs where torch has them (bf16 on a CPU or an Ampere+ GPU) and as a loop elsewhere
  ("fused-experts-loop" forces the loop: the two rows measure the choice).

Variants: "eager" (the model as built), "compile" (`torch.compile(model)`: forward and backward;
the optimizer step stays eager in every variant), "liger" (Liger-Kernel's RMSNorm, SwiGLU MLP and
rope swapped into the same modules: CUDA and liger_kernel only), "fused-no-lce" (`tridist.kernels.fuse` with
`linear_cross_entropy=False`: the head computes the logits; only for a target whose loss fuse can fuse),
"fused-experts-loop" (fuse, the experts as a loop; where fused would run grouped GEMMs), "fused"
(`tridist.kernels.fuse`) and "fused+compile". Every variant starts from a deep copy of one built model
(same initial weights) and runs the same batch. Peak memory: CUDA's allocator peak over one step after the
timing; on a CPU torch's MemTracker over that step, the module and the optimizer's state included.

Before a variant is timed, one forward + backward of it is checked against eager on the same batch:
the output (the model's first-step loss; the layer's residual update `out - x`) and every gradient
(parameters, and the layer's input), as relative L2 errors `|got - eager| / |eager|`. A variant over
tolerance is an error row ("mismatch"), not timed. In bf16/fp16 the tolerance is calibrated on the
run itself: eager in that dtype is compared with an fp32 evaluation of the same weights and batch,
which measures what rounding alone costs at these sizes; a correct variant differs from eager by
about that much (measured on CPU: 0.86-1.1x for gradients, up to 2.6x for the loss, whose error is
~1e-5), so the tolerance is `NOISE_FACTOR` (4) times eager's own error, and never below a floor
(`TOLERANCE_FLOOR`). In fp32 the tolerance is the floor.

    df = run_model_benchmark(targets=["layer"], variants=["eager", "fused"], quick=True)

Heavy imports (pandas, matplotlib) happen inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import gc
import importlib.util
import math
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from .kernels import DTYPES, VariantUnavailable, _log_progress, device_name, environment, resolve_device, time_ms
from .report import device_slug, format_value, markdown_table, stamp_provenance

TARGETS = ("layer", "model", "hf-model", "hf-moe")
# Report order: baselines first, ours last.
VARIANTS = ("eager", "compile", "liger", "fused-no-lce", "fused-experts-loop", "fused", "fused+compile")
COMPILED_VARIANTS = ("compile", "fused+compile")

# Correctness check (see the module docstring): tolerance = max(NOISE_FACTOR x eager's own error
# against fp32, floor), per quantity: "out" (loss / layer update) and "grad" (worst tensor).
NOISE_FACTOR = 4.0
TOLERANCE_FLOOR = {
    torch.float32: {"out": 1e-5, "grad": 1e-4},  # measured on CPU: compile / fused vs eager <= 1e-6
    torch.float16: {"out": 1e-3, "grad": 1e-2},
    torch.bfloat16: {"out": 1e-3, "grad": 1e-2},
}

# Timing budgets in ms (kernels.time_ms: CUDA events as triton's do_bench, perf_counter median on CPU).
# It runs rep_ms / (estimated step time) timed steps, at least 10: 2 s is ~13 steps of the model at ~150 ms.
CUDA_WARMUP_MS, CUDA_REP_MS = 500, 2000
CPU_WARMUP_MS, CPU_REP_MS = 10, 100
CPU_THREADS = 1  # as the kernel benchmark: a shared machine's descheduled OpenMP thread stalls a step
LEARNING_RATE = 1e-4
SEED = 0

RESULT_COLUMNS = (
    "target", "variant", "status", "shape", "dtype", "params", "tokens", "time_ms", "tokens_per_s",
    "peak_mem_gib", "speedup_vs_eager", "speedup_vs_compile", "tflops", "mfu_pct", "loss", "out_err",
    "grad_err", "worst_grad", "out_tol", "grad_tol", "setup_s", "detail", "error", "device",
)


# ------------------------------------------------------------------------------------------------ sizes


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """Sizes of one target: an hf-llama config (heads of head_dim hidden // heads) and the batch; for a mixture
    of experts `experts` experts of width `intermediate`, `top_k` per token."""

    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    layers: int
    vocab: int
    batch: int
    seq: int
    rope_theta: float = 10000.0
    experts: int = 0
    top_k: int = 0

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def overrides(self) -> dict:
        """Config fields for `build_model("hf-llama", "tiny", **overrides)`."""
        return dict(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, max_position_embeddings=self.seq,
                    rope_theta=self.rope_theta)

    def label(self, target: str) -> str:
        common = f"B={self.batch} S={self.seq} H={self.hidden} Hq={self.heads} Hkv={self.kv_heads} I={self.intermediate}"
        if self.experts:
            common += f" E={self.experts} k={self.top_k}"
        return common if target == "layer" else f"L={self.layers} {common} V={self.vocab}"


# CUDA (bf16). layer: a Llama-3-8B decoder layer (hidden 4096, 32 query / 8 key-value heads of 128,
# SwiGLU 14336, rope base 500000) on one 4096-token sequence. model: a ~0.5B-parameter Llama
# (TinyLlama's width: hidden 2048, 16 / 8 heads of 128, SwiGLU 5632; 8 layers, Llama-2 vocabulary)
# on 4 x 2048 tokens: eager attention keeps ~1.6 GB of scores per layer, ~25 GB peak in all, and a
# step is ~0.1-0.2 s, so a variant's timing takes seconds (torch.compile's compilation comes on top).
CUDA_SIZES = {
    "layer": ModelSize(hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=1, vocab=256,
                       batch=1, seq=4096, rope_theta=500000.0),
    "model": ModelSize(hidden=2048, heads=16, kv_heads=8, intermediate=5632, layers=8, vocab=32000,
                       batch=4, seq=2048),
}
CUDA_SIZES["hf-model"] = CUDA_SIZES["model"]
CUDA_QUICK_SIZES = {
    "layer": dataclasses.replace(CUDA_SIZES["layer"], seq=2048),
    "model": dataclasses.replace(CUDA_SIZES["model"], layers=2, batch=2, seq=1024),
}
CUDA_QUICK_SIZES["hf-model"] = CUDA_QUICK_SIZES["model"]
# hf-moe: Qwen3-30B-A3B's expert layout (64 of its 128 experts of width 768, 8 per token) at the model's
# width and batch, 4 layers: ~1,000 tokens per expert, so the experts' grouped GEMMs and the loop over them
# (2 GEMMs per expert and direction) are both fed.
CUDA_SIZES["hf-moe"] = dataclasses.replace(CUDA_SIZES["model"], intermediate=768, layers=4, experts=64, top_k=8)
CUDA_QUICK_SIZES["hf-moe"] = dataclasses.replace(CUDA_SIZES["hf-moe"], layers=2, batch=2, seq=1024)
# CPU (fp32): a few ms per step, so that the pipeline (and the tests) run in seconds. hf-model keeps a real
# vocabulary (Llama-2's 32,000) and 1,024 tokens, since the logits it holds or not are what its fused rows
# are about: 1,024 x 32,000 fp32 logits are 125 MiB, above the 131 MiB of weights, gradients and AdamW
# states that every variant holds (~1 s a step).
CPU_SIZES = {
    "layer": ModelSize(hidden=128, heads=4, kv_heads=2, intermediate=352, layers=1, vocab=256, batch=2, seq=64),
    "model": ModelSize(hidden=128, heads=4, kv_heads=2, intermediate=352, layers=2, vocab=512, batch=2, seq=64),
}
CPU_SIZES["hf-model"] = dataclasses.replace(CPU_SIZES["model"], vocab=32000, batch=4, seq=256)
CPU_QUICK_SIZES = {
    "layer": ModelSize(hidden=64, heads=4, kv_heads=2, intermediate=176, layers=1, vocab=128, batch=2, seq=16),
    "model": ModelSize(hidden=64, heads=4, kv_heads=2, intermediate=176, layers=2, vocab=128, batch=2, seq=16),
}
CPU_QUICK_SIZES["hf-model"] = dataclasses.replace(CPU_QUICK_SIZES["model"], vocab=8192)
CPU_SIZES["hf-moe"] = dataclasses.replace(CPU_SIZES["model"], intermediate=176, experts=8, top_k=2)
CPU_QUICK_SIZES["hf-moe"] = dataclasses.replace(CPU_QUICK_SIZES["model"], intermediate=96, experts=4, top_k=2)


def default_sizes(device_type: str, *, quick: bool = False) -> dict[str, ModelSize]:
    if device_type == "cuda":
        return dict(CUDA_QUICK_SIZES if quick else CUDA_SIZES)
    return dict(CPU_QUICK_SIZES if quick else CPU_SIZES)


def step_flops(target: str, size: ModelSize, matmul_params: int) -> float:
    """Model FLOPs of one step: 6 per matmul weight per token (forward + backward), plus attention's
    two S x S matmuls, 12 * S * Hq * D per token per layer (counted in full, as eager computes them)."""
    layers = 1 if target == "layer" else size.layers
    attention = 12 * layers * size.seq * size.heads * size.head_dim * size.tokens
    return 6.0 * matmul_params * size.tokens + attention


def _matmul_params(module: nn.Module, size: ModelSize) -> int:
    """Weights that multiply activations: every nn.Linear (embedding lookups and norms are not matmuls) and
    the active share (top_k / experts) of stacked experts' 3-D weights."""
    linear = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))
    stacked = sum(p.numel() for p in module.parameters() if p.dim() == 3) if size.experts else 0
    return linear + stacked * size.top_k // max(size.experts, 1)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Datasheet dense peak FLOP/s of this GPU in `dtype` (autotune's device profiles); NaN if unknown or on a CPU."""
    if device.type != "cuda":
        return math.nan
    name = torch.cuda.get_device_name(device).lower()
    key = ("h200" if "h200" in name else "h100-sxm" if "h100" in name and "pcie" not in name
           else "a100-80gb" if "a100" in name else None)
    if key is None:
        return math.nan
    from tridist.autotune.hardware import DEVICE_PROFILES

    profile = DEVICE_PROFILES[key]
    return profile.peak_fp32_flops if dtype == torch.float32 else profile.peak_bf16_flops


# ------------------------------------------------------------------------------------------------ targets


@dataclasses.dataclass
class CheckRun:
    """One forward + backward: the checked output (fp32, on the CPU) and every gradient (on the CPU)."""

    out: torch.Tensor
    grads: dict[str, torch.Tensor]
    loss: float = math.nan


def _param_name(name: str) -> str:
    return name.replace("_orig_mod.", "")  # torch.compile's wrapper prefix


def _grads(module: nn.Module, extra: dict | None = None) -> dict[str, torch.Tensor]:
    grads = dict(extra or {})
    for name, param in module.named_parameters():
        grads[_param_name(name)] = None if param.grad is None else param.grad.detach().to("cpu", copy=True)
    return grads


class Target:
    """A benchmark target: `build(device, dtype)` the module, `batch(device, dtype, seed=)` its inputs,
    `cast_batch(batch, dtype)` them for the fp32 reference, `check_run(fn, module, batch)` one checked forward +
    backward, `make_step(fn, module, batch)` the timed step."""

    name: str
    fusable_loss = False  # fuse() replaces a head + loss here: "fused-no-lce" differs from "fused"
    has_experts = False  # stacked experts: "fused-experts-loop" can differ from "fused"

    @staticmethod
    def unavailable() -> str | None:
        """Why this target cannot be built here (a missing library), or None."""
        return None


class LayerTarget(Target):
    """One decoder layer, forward + backward with a fixed output gradient."""

    name = "layer"

    def __init__(self, size: ModelSize):
        self.size = size

    def build(self, device, dtype) -> nn.Module:
        from tridist.bench.models import build_model

        full = build_model("hf-llama", "tiny", **self.size.overrides())  # HF's N(0, 0.02) init
        self.rotary = full.model.rotary_emb
        return full.model.layers[0].to(dtype)

    def batch(self, device, dtype, *, seed: int = SEED) -> dict:
        from tridist.bench.models.hf_llama import make_causal_mask

        s = self.size
        gen = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(s.batch, s.seq, s.hidden, generator=gen, device=device).to(dtype)
        dy = torch.randn(s.batch, s.seq, s.hidden, generator=gen, device=device).to(dtype)
        positions = torch.arange(s.seq, device=device)[None]
        cos, sin = self.rotary.to(device)(x, positions)
        mask = make_causal_mask(s.seq, s.seq, dtype=dtype, device=device)
        return {"x": x.requires_grad_(), "dy": dy, "cos": cos, "sin": sin, "mask": mask}

    @staticmethod
    def cast_batch(batch: dict, dtype) -> dict:
        """The same batch in another dtype (the fp32 reference): values upcast, the mask rebuilt."""
        from tridist.bench.models.hf_llama import make_causal_mask

        seq = batch["x"].shape[1]
        out = {k: batch[k].detach().to(dtype) for k in ("x", "dy", "cos", "sin")}
        out["x"].requires_grad_()
        out["mask"] = make_causal_mask(seq, seq, dtype=dtype, device=batch["x"].device)
        return out

    @staticmethod
    def _forward(fn, batch):
        return fn(batch["x"], position_embeddings=(batch["cos"], batch["sin"]), attention_mask=batch["mask"])

    def check_run(self, fn, module: nn.Module, batch: dict) -> CheckRun:
        x = batch["x"]
        x.grad = None
        out = self._forward(fn, batch)
        out.backward(batch["dy"].clone())  # a clone: an in-place backward must not touch the timed dy
        update = (out.detach().float() - x.detach().float()).cpu()
        run = CheckRun(update, _grads(module, {"input": None if x.grad is None else x.grad.detach().cpu()}))
        x.grad = None
        module.zero_grad(set_to_none=True)
        return run

    def make_step(self, fn, module: nn.Module, batch: dict) -> tuple[Callable, list, list]:
        """(one step, the tensors whose .grad the timing resets, what holds state across steps)."""

        def step():
            self._forward(fn, batch).backward(batch["dy"])

        return step, [batch["x"], *module.parameters()], [module]


class ModelTarget(Target):
    """The causal LM's training step: loss, backward, AdamW (foreach) step, zero_grad. (The replica computes its
    loss itself: fuse() leaves it and the head alone.)"""

    name = "model"

    def __init__(self, size: ModelSize):
        self.size = size

    def build(self, device, dtype) -> nn.Module:
        from tridist.bench.models import build_model

        model = build_model("hf-llama", "tiny", **self.size.overrides())
        rotary = model.model.rotary_emb
        inv_freq = rotary.inv_freq  # stays fp32: bf16 frequencies would garble the far positions' angles
        model.to(dtype)
        rotary.inv_freq = inv_freq
        return model

    def batch(self, device, dtype, *, seed: int = SEED) -> dict:
        gen = torch.Generator(device=device).manual_seed(seed)
        ids = torch.randint(0, self.size.vocab, (self.size.batch, self.size.seq), generator=gen, device=device)
        return {"input_ids": ids}

    @staticmethod
    def cast_batch(batch: dict, dtype) -> dict:
        return batch

    def check_run(self, fn, module: nn.Module, batch: dict) -> CheckRun:
        ids = batch["input_ids"]
        loss = fn(ids, labels=ids)[0]  # (loss, logits), or a ModelOutput whose first field is the loss
        loss.backward()
        value = loss.detach().float().cpu()
        run = CheckRun(value, _grads(module), loss=float(value))
        module.zero_grad(set_to_none=True)
        return run

    def make_step(self, fn, module: nn.Module, batch: dict) -> tuple[Callable, list, list]:
        ids = batch["input_ids"]
        optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE, foreach=True)

        def step():
            fn(ids, labels=ids)[0].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step, [], [module, optimizer]


class HFModelTarget(ModelTarget):
    """ModelTarget's step on transformers' LlamaForCausalLM of the same sizes (its init, its default attention,
    no key/value cache): a model `fuse` fuses whole, its LM head and loss included."""

    name = "hf-model"
    fusable_loss = True
    architecture = ("LlamaConfig", "LlamaForCausalLM")  # transformers' names

    def extra_config(self) -> dict:
        return {}

    @staticmethod
    def unavailable() -> str | None:
        if importlib.util.find_spec("transformers") is None:
            return "transformers is not installed (pip install transformers)"
        return None

    def build(self, device, dtype) -> nn.Module:
        import transformers

        config_class, model_class = (getattr(transformers, name) for name in self.architecture)
        s = self.size
        config = config_class(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                              num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                              max_position_embeddings=s.seq, rope_theta=s.rope_theta, use_cache=False,
                              **self.extra_config())
        model = model_class(config)
        rotary = model.model.rotary_emb
        inv_freq = rotary.inv_freq  # stays fp32, as in ModelTarget
        model.to(dtype)
        rotary.inv_freq = inv_freq
        return model


class HFMoETarget(HFModelTarget):
    """HFModelTarget's step on transformers' MixtralForCausalLM: `size.experts` SwiGLU experts of width
    `size.intermediate` stacked in 3-D weights, `size.top_k` per token, no router auxiliary loss. fuse runs them
    as grouped GEMMs where torch has them (bf16 on a CPU or an Ampere+ GPU) and as a loop over the experts hit elsewhere;
    "fused-experts-loop" forces the loop, so a run measures the choice."""

    name = "hf-moe"
    has_experts = True
    architecture = ("MixtralConfig", "MixtralForCausalLM")

    def extra_config(self) -> dict:
        return {"num_local_experts": self.size.experts, "num_experts_per_tok": self.size.top_k}


TARGET_CLASSES = {target.name: target for target in (LayerTarget, ModelTarget, HFModelTarget, HFMoETarget)}


def make_target(name: str, size: ModelSize):
    if name not in TARGET_CLASSES:
        raise ValueError(f"unknown target {name!r}; valid targets: {', '.join(TARGETS)}")
    return TARGET_CLASSES[name](size)


# ----------------------------------------------------------------------------------------------- variants


@dataclasses.dataclass
class Built:
    """A variant ready to run: what to call, the module that owns the parameters, and what was swapped in."""

    fn: Callable
    module: nn.Module
    detail: str = ""


def _eager(module: nn.Module, *, device) -> Built:
    return Built(module, module)


def _compile(module: nn.Module, *, device) -> Built:
    torch._dynamo.reset()  # compiled graphs of the previous variant / target: free them, no recompile limit
    return Built(torch.compile(module), module)


def _fuse(module: nn.Module, **options) -> str:
    from tridist.kernels import fuse

    report = fuse(module, **options)
    if not report.replaced:
        raise RuntimeError(f"fuse() replaced nothing: {report}")
    kinds = {kind: report.count(kind) for kind in ("rms_norm", "swiglu", "geglu", "rotary", "linear_cross_entropy")}
    kinds["swiglu experts"] = report.count("swiglu: FusedSwiGLUExperts")
    kinds["swiglu"] -= kinds["swiglu experts"]
    detail = "fused " + ", ".join(f"{n} {kind}" for kind, n in kinds.items() if n)
    if report.skipped:
        detail += f"; left {len(report.skipped)} alone"
    return detail


def _fused(module: nn.Module, *, device) -> Built:
    return Built(module, module, _fuse(module))


def _fused_no_lce(module: nn.Module, *, device) -> Built:
    return Built(module, module, _fuse(module, linear_cross_entropy=False))


def _fused_experts_loop(module: nn.Module, *, device) -> Built:
    from tridist.kernels import FusedSwiGLUExperts
    from tridist.kernels.ops.swiglu import grouped_mm_supported

    detail = _fuse(module)
    experts = [m for m in module.modules() if isinstance(m, FusedSwiGLUExperts)]
    if not experts:
        raise VariantUnavailable("fuse() fused no stacked experts here")
    # The activations have the weights' dtype and device here: down_proj stands in for the hidden states.
    if not any(m.grouped_mm is None and grouped_mm_supported(m.down_proj, m.down_proj) for m in experts):
        raise VariantUnavailable("the same as fused here: fused loops over the experts too (grouped GEMMs need bf16 on a CPU "
                                 "or a CUDA capability 8.0+ GPU, and rows of 16-byte multiples)")
    for m in experts:
        m.grouped_mm = False  # a loop over the experts that received tokens, whatever the device offers
    return Built(module, module, detail + "; experts as a loop")


def _same_as_fused(variant: str, target) -> str | None:
    """Why `variant` would run exactly what "fused" runs on every device for this target (its row says so instead
    of repeating fused's), or None. What depends on the device (grouped GEMMs) the variant's builder decides."""
    if variant == "fused-no-lce" and not target.fusable_loss:
        return f"the same as fused here: fuse() fuses no loss in {target.name}"
    if variant == "fused-experts-loop" and not target.has_experts:
        return f"the same as fused here: {target.name} has no experts"
    return None


def _fused_compile(module: nn.Module, *, device) -> Built:
    detail = _fuse(module)
    torch._dynamo.reset()
    return Built(torch.compile(module), module, detail)


def _liger(module: nn.Module, *, device) -> Built:
    """Liger-Kernel's public module API (liger_kernel.transformers: LigerRMSNorm, LigerSwiGLUMLP,
    liger_rotary_pos_emb) swapped into our replica, as apply_liger_kernel_to_llama does to HF's."""
    if torch.device(device).type != "cuda":
        raise VariantUnavailable("Liger-Kernel runs on GPUs only")
    if importlib.util.find_spec("liger_kernel") is None:
        raise VariantUnavailable("liger_kernel is not installed")
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    except ImportError as exc:  # releases before transformers became optional import it at package level
        raise VariantUnavailable(f"liger_kernel.transformers does not import here: {exc}") from exc
    counts = swap_liger_modules(module, rms_norm_cls=LigerRMSNorm, swiglu_mlp_cls=LigerSwiGLUMLP,
                                rotary_fn=liger_rotary_pos_emb)
    if not any(counts.values()):
        raise VariantUnavailable("no Llama RMSNorm, MLP or attention module to swap Liger's into")
    return Built(module, module, "liger " + ", ".join(f"{n} {kind}" for kind, n in counts.items() if n))


VARIANT_BUILDERS: dict[str, Callable[..., Built]] = {
    "eager": _eager,
    "compile": _compile,
    "liger": _liger,
    "fused-no-lce": _fused_no_lce,
    "fused-experts-loop": _fused_experts_loop,
    "fused": _fused,
    "fused+compile": _fused_compile,
}


def swap_liger_modules(model: nn.Module, *, rms_norm_cls, swiglu_mlp_cls, rotary_fn) -> dict[str, int]:
    """Replace our hf_llama RMSNorms and MLPs with Liger's classes and point each attention's rotary
    call at `rotary_fn`, in place; parameters stay the same objects (same values, same names).

    - RMSNorm: `rms_norm_cls(hidden_size, eps=...)` (Liger's defaults: casting_mode "llama", HF's
      rounding) around the old weight Parameter.
    - MLP: `swiglu_mlp_cls(config)` with config.hidden_size / intermediate_size / hidden_act="silu",
      built on the meta device (no throw-away weights), then given the old projections.
    - Rotary: LlamaAttention.forward calls `apply_rotary_pos_emb` by global name; each instance gets a
      copy of the forward whose globals map that name to `rotary_fn` (HF's signature: q, k [B, H, S, D],
      cos, sin [B, S, D]). The defining module and other instances are untouched.
    """
    from tridist.bench.models.hf_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    counts = {"rms_norm": 0, "swiglu": 0, "rotary": 0}
    for name, module in list(model.named_modules()):
        if isinstance(module, LlamaRMSNorm):
            with torch.device("meta"):
                new = rms_norm_cls(module.weight.shape[0], eps=module.variance_epsilon)
            new.weight = module.weight
            counts["rms_norm"] += _put(model, name, new)
        elif isinstance(module, LlamaMLP):
            config = types.SimpleNamespace(hidden_size=module.hidden_size, intermediate_size=module.intermediate_size,
                                           hidden_act="silu")
            with torch.device("meta"):
                new = swiglu_mlp_cls(config)
            new.gate_proj, new.up_proj, new.down_proj = module.gate_proj, module.up_proj, module.down_proj
            counts["swiglu"] += _put(model, name, new)
        elif isinstance(module, LlamaAttention):
            forward = type(module).forward
            scope = dict(forward.__globals__, apply_rotary_pos_emb=rotary_fn)
            rebound = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__,
                                         forward.__closure__)
            rebound.__kwdefaults__ = forward.__kwdefaults__
            module.forward = types.MethodType(rebound, module)
            counts["rotary"] += 1
    return counts


def _put(model: nn.Module, name: str, new: nn.Module) -> int:
    if not name:
        raise VariantUnavailable("the model itself is an RMSNorm / MLP: nothing to swap into")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    new.train(parent.training)
    setattr(parent, child, new)
    return 1


# ---------------------------------------------------------------------------------------------- checking


def relative_error(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """|got - want| / |want| (L2, fp32); inf when one is missing or the shapes differ, NaN propagates."""
    if got is None or want is None:
        return 0.0 if got is None and want is None else math.inf
    if got.shape != want.shape:
        return math.inf
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def compare(run: CheckRun, ref: CheckRun) -> tuple[float, float, str]:
    """(output error, worst gradient error, that gradient's name) of `run` against `ref`."""
    out_err = relative_error(run.out, ref.out)
    grad_err, worst = 0.0, ""
    for name, want in ref.grads.items():
        err = relative_error(run.grads.get(name), want)
        if not err <= grad_err:  # also takes NaN
            grad_err, worst = err, name
            if math.isnan(err):
                break
    missing = set(run.grads) - set(ref.grads)
    if missing:
        return out_err, math.inf, f"unexpected gradient {sorted(missing)[0]}"
    return out_err, grad_err, worst


@dataclasses.dataclass
class Reference:
    """Eager's check run, the tolerances derived from it, and how they were derived."""

    run: CheckRun
    out_tol: float
    grad_tol: float
    basis: str


def tolerances(dtype: torch.dtype, noise: tuple[float, float] | None) -> tuple[float, float]:
    """(output, gradient) tolerance: NOISE_FACTOR x eager's own error against fp32, at least the floor."""
    floor = TOLERANCE_FLOOR[dtype]
    if noise is None:
        return floor["out"], floor["grad"]
    out_noise, grad_noise = (n if math.isfinite(n) else 0.0 for n in noise)
    return max(NOISE_FACTOR * out_noise, floor["out"]), max(NOISE_FACTOR * grad_noise, floor["grad"])


# ----------------------------------------------------------------------------------------------- running


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _copy_to(base: nn.Module, device: torch.device) -> nn.Module:
    return copy.deepcopy(base).to(device)


def _reference(target, base: nn.Module, batch: dict, *, device, dtype) -> Reference:
    """Eager's check run; in bf16/fp16 also an fp32 evaluation of the same weights and batch, whose
    distance from eager sets the tolerances."""
    module = _copy_to(base, device)
    ref = target.check_run(module, module, batch)
    del module
    _free(device)
    if dtype == torch.float32:
        out_tol, grad_tol = tolerances(dtype, None)
        return Reference(ref, out_tol, grad_tol, "fp32: the floor")
    try:
        exact = _copy_to(base, device).float()
        exact_run = target.check_run(exact, exact, target.cast_batch(batch, torch.float32))
        del exact
        out_noise, grad_noise, _ = compare(ref, exact_run)
        basis = f"eager's error vs fp32: out {out_noise:.2g}, grad {grad_noise:.2g}"
        out_tol, grad_tol = tolerances(dtype, (out_noise, grad_noise))
    except Exception as exc:  # noqa: BLE001 - e.g. no room for an fp32 copy: fall back to the floor
        out_tol, grad_tol = tolerances(dtype, None)
        basis = f"fp32 reference failed ({type(exc).__name__}); the floor"
    _free(device)
    return Reference(ref, out_tol, grad_tol, basis)


def _error_text(exc: BaseException, context: str = "") -> str:
    return f"failed{context}: {type(exc).__name__}: {exc}".splitlines()[0][:200]


def _time_variant(target, built: Built, batch: dict, *, device, warmup_ms, rep_ms) -> tuple[float, float]:
    """(median step time in ms, peak memory in GiB of one more step: CUDA's allocator peak; on a CPU torch's
    MemTracker, counting the module's and the optimizer's tensors with the step's own)."""
    step, grad_to_none, state = target.make_step(built.fn, built.module, batch)
    ms = time_ms(step, device=device, grad_to_none=grad_to_none, warmup_ms=warmup_ms, rep_ms=rep_ms)
    for t in grad_to_none:
        t.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return ms, torch.cuda.max_memory_allocated(device) / 2**30
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*state)
    with tracker, warnings.catch_warnings():
        # MemTracker attributes memory to modules through global module hooks, which a compiled module's
        # wrapper fires once more (torch warns): the tensors, and so the peak, are counted once.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        step()
    return ms, tracker.get_tracker_snapshot("peak")[device]["Total"] / 2**30


def _run_variant(target, variant: str, base: nn.Module, batch: dict, reference: Reference, *, device,
                 warmup_ms, rep_ms) -> dict:
    """One row: build the variant on a copy of `base`, check it against eager, and time it if it agrees."""
    row = {"variant": variant, "status": "failed", "error": ""}
    same = _same_as_fused(variant, target)
    if same:
        return {**row, "status": "unavailable", "error": same}
    start = time.perf_counter()
    try:
        built = VARIANT_BUILDERS[variant](_copy_to(base, device), device=device)
    except VariantUnavailable as exc:
        return {**row, "status": "unavailable", "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the table says what broke; the other variants still run
        return {**row, "error": _error_text(exc, " (build)")}
    row["detail"] = built.detail
    try:
        run = target.check_run(built.fn, built.module, batch)
        row["setup_s"] = time.perf_counter() - start  # includes torch.compile's compilation
        row["loss"] = run.loss
        out_err, grad_err, worst = compare(run, reference.run)
        row.update(out_err=out_err, grad_err=grad_err, worst_grad=worst)
        if not (out_err <= reference.out_tol and grad_err <= reference.grad_tol):  # NaN fails too
            what = "output" if target.name == "layer" else "loss"
            error = (f"mismatch: {what} error {out_err:.3g} (tolerance {reference.out_tol:.2g}), gradient error "
                     f"{grad_err:.3g} at {worst or '-'} (tolerance {reference.grad_tol:.2g})")
            return {**row, "status": "mismatch", "error": error}  # not timed
        row["time_ms"], row["peak_mem_gib"] = _time_variant(target, built, batch, device=device,
                                                            warmup_ms=warmup_ms, rep_ms=rep_ms)
        row["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - compile failure, out of memory, a kernel's error
        row["error"] = _error_text(exc)
    return row


def _variant_summary(row: dict) -> str:
    if row["status"] == "ok":
        text = f"{row['time_ms']:.4g} ms"
        if not math.isnan(row.get("peak_mem_gib", math.nan)):
            text += f", {row['peak_mem_gib']:.2f} GiB"
        return text + f" (out err {row['out_err']:.2g}, grad err {row['grad_err']:.2g})"
    return f"{row['status']}: {row['error']}"


def _run_target(name: str, size: ModelSize, *, variants: Sequence[str], device, dtype, progress: bool,
                warmup_ms, rep_ms, seed: int) -> list[dict]:
    target = make_target(name, size)
    why = target.unavailable()
    if why:
        _log_progress(progress, f"[{name}] unavailable: {why}")
        return [{"target": name, "shape": size.label(name), "dtype": _dtype_name(dtype), "tokens": size.tokens,
                 "variant": v, "status": "unavailable", "error": why} for v in variants]
    start = time.perf_counter()
    _log_progress(progress, f"[{name}] {size.label(name)} {_dtype_name(dtype)}: building on {device} ...")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            base = target.build(device, dtype)  # initialised where it will run (fast on a GPU)
    batch = target.batch(device, dtype, seed=seed)
    base = base.to("cpu")  # between variants only the variant's own copy lives on the device
    params = sum(p.numel() for p in base.parameters())
    flops = step_flops(name, size, _matmul_params(base, size))
    common = {"target": name, "shape": size.label(name), "dtype": _dtype_name(dtype), "params": params,
              "tokens": size.tokens}
    try:
        reference = _reference(target, base, batch, device=device, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the next target still runs
        error = _error_text(exc, " (eager reference)")
        _log_progress(progress, f"[{name}] {error}")
        _free(device)
        return [{**common, "variant": v, "status": "failed", "error": error} for v in variants]
    _log_progress(progress, f"[{name}] tolerance: out {reference.out_tol:.2g}, grad {reference.grad_tol:.2g} "
                            f"({reference.basis}) ({time.perf_counter() - start:.1f} s)")
    rows = []
    for variant in variants:
        variant_start = time.perf_counter()
        row = _run_variant(target, variant, base, batch, reference, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms)
        row = {**common, **row, "out_tol": reference.out_tol, "grad_tol": reference.grad_tol}
        if row.get("time_ms") is not None and row["status"] == "ok":
            seconds = row["time_ms"] * 1e-3
            row["tokens_per_s"] = size.tokens / seconds
            row["tflops"] = flops / seconds / 1e12
        rows.append(row)
        if variant in COMPILED_VARIANTS:
            torch._dynamo.reset()
        _free(device)
        _log_progress(progress, f"[{name}] {variant}: {_variant_summary(row)} ({time.perf_counter() - variant_start:.1f} s)")
    return rows


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def _add_speedups(df, peak: float):
    """speedup_vs_X = X's time / this row's time for the same target (> 1: this row is faster); MFU."""
    for baseline in ("eager", "compile"):
        times = df[df["variant"] == baseline].set_index("target")["time_ms"]
        df[f"speedup_vs_{baseline}"] = df["target"].map(times) / df["time_ms"]
    df["mfu_pct"] = 100.0 * df["tflops"] * 1e12 / peak if peak == peak else math.nan
    return df


@contextlib.contextmanager
def _cpu_threads(device: torch.device, threads: int | None):
    previous = torch.get_num_threads()
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _resolve_names(given, valid: Sequence[str], what: str) -> list[str]:
    names = list(valid if given is None else ([given] if isinstance(given, str) else given))
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise ValueError(f"unknown {what}(s) {', '.join(unknown) or '(none given)'}; valid {what}s: {', '.join(valid)}")
    return list(dict.fromkeys(names))


def run_model_benchmark(*, targets: Sequence[str] = TARGETS, variants: Sequence[str] | None = None, device=None,
                        dtype=None, quick: bool = False, out_dir=None, progress: bool = True,
                        sizes: dict[str, ModelSize] | None = None, seed: int = SEED,
                        cpu_threads: int | None = CPU_THREADS, write_report: bool = True, **timing):
    """Time each variant of each target; returns one row per (target, variant).

    device: None / "auto" (CUDA if available), "cuda", "cpu" or a torch.device. dtype: "bf16", "fp16",
    "fp32" or a torch.dtype (default: bf16 on CUDA, fp32 on CPU); parameters are in that dtype (no
    autocast: every variant runs the same bf16 tensors, the setting the fused kernels are written for).
    sizes: per-target `ModelSize` overriding the defaults (tests pass tiny ones). timing: warmup_ms and
    rep_ms for `kernels.time_ms`. Writes results.csv, report.md and plot.png under `out_dir` (default
    reports/model-<device>-<timestamp>/) unless write_report is False; the directory is in
    df.attrs["report_dir"], the environment in df.attrs["meta"].
    """
    import pandas as pd

    unknown = sorted(set(timing) - {"warmup_ms", "rep_ms"})
    if unknown:
        raise TypeError(f"unknown timing option(s) {unknown}; valid: warmup_ms, rep_ms")
    device = resolve_device(device)
    targets = _resolve_names(targets, TARGETS, "target")
    variants = _resolve_names(variants, VARIANTS, "variant")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; valid dtypes: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    chosen = {**default_sizes(device.type, quick=quick), **(sizes or {})}
    cuda = device.type == "cuda"
    warmup_ms = timing.get("warmup_ms") or (CUDA_WARMUP_MS if cuda else CPU_WARMUP_MS)
    rep_ms = timing.get("rep_ms") or (CUDA_REP_MS if cuda else CPU_REP_MS)

    _log_progress(progress, f"model benchmark on {device_name(device)}: targets {', '.join(targets)}; "
                            f"variants {', '.join(variants)}; {_dtype_name(dtype)}")
    rows = []
    with _cpu_threads(device, cpu_threads):
        for name in targets:
            rows.extend(_run_target(name, chosen[name], variants=variants, device=device, dtype=dtype,
                                    progress=progress, warmup_ms=warmup_ms, rep_ms=rep_ms, seed=seed))
        meta = environment(device, math.nan)
    peak = peak_flops(device, dtype)
    meta.update(dtype=_dtype_name(dtype), peak_tflops=peak / 1e12, quick=quick,
                sizes={name: dataclasses.asdict(chosen[name]) for name in targets},
                timing={"warmup_ms": warmup_ms, "rep_ms": rep_ms})

    df = pd.DataFrame(rows, columns=list(RESULT_COLUMNS))
    df["device"] = meta["device"]
    for column in ("error", "detail", "worst_grad"):
        df[column] = df[column].astype(object).fillna("").astype(str)
    df = _add_speedups(df, peak)
    df = stamp_provenance(df, meta)  # every row says where it was taken
    df.attrs["meta"] = meta
    if write_report:
        df.attrs["report_dir"] = str(write_model_report(df, out_dir=out_dir, meta=meta))
    return df


def exit_status(df) -> int:
    """The command's exit status: 1 when a variant disagreed with eager or no row ran cleanly, else 0."""
    status = df["status"].astype(str)
    return 1 if (status == "mismatch").any() or not (status == "ok").any() else 0


# ------------------------------------------------------------------------------------------------ report


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def target_table(df, target: str) -> str:
    """One markdown table per target: a row per variant, timing columns empty where it did not run."""

    sub = df[df["target"] == target]
    headers = ["variant", "ms / step", "tokens/s", "peak GiB", "vs eager", "vs compile", "TFLOP/s", "MFU",
               "out err", "grad err", "status"]
    rows = []
    for _, r in sub.iterrows():
        if r["status"] == "ok" or r["error"].startswith(r["status"]):  # "mismatch: ...", "failed: ..."
            status = r["error"] or r["status"]
        else:
            status = f"{r['status']}: {r['error']}"
        status = status.replace("|", "/")
        if r["detail"]:
            status += f" ({r['detail']})"
        rows.append([r["variant"], format_value(r["time_ms"], ".2f"), format_value(r["tokens_per_s"], ",.0f"),
                     format_value(r["peak_mem_gib"], ".3g"), format_value(r["speedup_vs_eager"], ".2f", "x"),
                     format_value(r["speedup_vs_compile"], ".2f", "x"), format_value(r["tflops"], ".3g"),
                     format_value(r["mfu_pct"], ".1f", "%"), format_value(r["out_err"], ".2g"), format_value(r["grad_err"], ".2g"), status])
    return markdown_table(headers, rows, align=["l"] + ["r"] * 9 + ["l"])


def render_model_markdown(df, meta: dict) -> str:
    lines = [
        "# Model benchmark",
        "",
        f"- Device: {meta.get('device', '?')}" + (f" (driver {meta['driver']})" if meta.get("driver") else ""),
        f"- torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, python {meta.get('python', '?')}"
        + (f", CUDA {meta['cuda']}" if meta.get("cuda") else "") + f", tridist {meta.get('tridist', '?')}"
        + (f" at {meta['commit'][:12]}" if meta.get("commit") else ""),
        f"- Date: {meta.get('date', '?')}" + (f"; CPU threads: {meta['threads']}" if meta.get("threads") else ""),
        f"- dtype: {meta.get('dtype', '?')} parameters and activations (no autocast); AdamW(foreach=True), "
        f"lr {LEARNING_RATE:g}",
        "",
        "- layer: one Llama decoder layer, forward + backward (input requires grad, fixed output gradient). "
        "model: the causal LM's training step (forward with labels, backward, AdamW step, zero_grad); hf-model: "
        "that step on transformers' LlamaForCausalLM, whose LM head and loss `fuse` fuses (fused-no-lce: "
        "`fuse(model, linear_cross_entropy=False)`, the logits kept).",
        "- Time: median ms per step; CUDA: CUDA events (`triton.testing.do_bench`'s method); CPU: wall clock. "
        "Peak GiB: one step after the timing, `torch.cuda.max_memory_allocated` (CUDA) or torch's MemTracker "
        "with the module's and the optimizer's tensors (CPU).",
        "- `vs X`: X's time / this variant's time (> 1: faster). TFLOP/s: model FLOPs (6 x matmul weights x "
        "tokens + attention's S x S matmuls) / time; MFU against the datasheet dense peak"
        + (f" ({meta['peak_tflops']:.0f} TFLOP/s)." if _finite(meta.get("peak_tflops")) else " (unknown here)."),
        "- Check before timing: one forward + backward against eager on the same weights and batch; out err = "
        "relative L2 error of the loss (model) or of the layer's update `out - x` (layer), grad err = the "
        "worst over all gradients. Over tolerance: a `mismatch` row, not timed.",
    ]
    if meta.get("device_type") == "cpu":
        lines += ["", "On the CPU the fused variants run whatever `kernels` runs for CPU tensors (a PyTorch "
                      "implementation, or the Triton interpreter under TRITON_INTERPRET=1): these numbers check "
                      "the pipeline, not the kernels."]
    sizes = meta.get("sizes", {})
    for target in dict.fromkeys(df["target"]):
        sub = df[df["target"] == target]
        first = sub.iloc[0]
        tol = f"tolerance: out {format_value(first['out_tol'], '.2g')}, grad {format_value(first['grad_tol'], '.2g')}"
        lines += ["", f"## {target}", "", f"{first['shape']}, {first['params']:,} parameters, "
                                          f"{first['tokens']:,} tokens per step; {tol}"]
        if target in sizes and sizes[target].get("rope_theta"):
            lines[-1] += f"; rope base {sizes[target]['rope_theta']:g}"
        lines += ["", target_table(df, target)]
    return "\n".join(lines) + "\n"


def plot_model_results(df, path) -> Path:
    """One column per target: tokens/s per variant (a variant that did not run shows its status instead) and,
    below, each variant's peak memory where one was measured."""
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state is touched

    targets = list(dict.fromkeys(df["target"])) or ["-"]
    memory = len(df) and bool((df["peak_mem_gib"].astype(float) > 0).any())
    fig = Figure(figsize=(5.5 * len(targets), 4.2 * (2 if memory else 1)))
    grid = fig.subplots(2 if memory else 1, len(targets), squeeze=False)
    palette = matplotlib.colormaps["tab10"]
    colors = {v: palette(i) for i, v in enumerate(VARIANTS)}

    def bars(ax, names, values, labels, ylabel, title):
        ax.bar(range(len(names)), values, color=[colors.get(v, "gray") for v in names])
        top = max(values, default=0.0) or 1.0
        for i, (value, label) in enumerate(zip(values, labels)):
            ax.text(i, value + 0.01 * top, label, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, top * 1.15)
        ax.set_title(title, fontsize=8)

    for ax, target in zip(grid[0], targets):
        sub = df[df["target"] == target]
        labels = [format_value(r["speedup_vs_eager"], ".2f", "x") if r["status"] == "ok" else r["status"]
                  for _, r in sub.iterrows()]
        bars(ax, list(sub["variant"]), [float(v) if v == v else 0.0 for v in sub["tokens_per_s"]], labels,
             "tokens / s", f"{target}: {sub['shape'].iloc[0] if len(sub) else ''}")
    for ax, target in zip(grid[1] if memory else (), targets):
        sub = df[(df["target"] == target) & (df["peak_mem_gib"].astype(float) > 0)]
        values = [float(v) for v in sub["peak_mem_gib"]]
        bars(ax, list(sub["variant"]), values, [f"{v:.3g}" for v in values], "peak memory (GiB)",
             f"{target}: peak memory of a step")
    fig.suptitle("Throughput per variant (labels: speedup vs eager)" + ("\nand peak memory" if memory else ""), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)  # PNG through matplotlib's Agg renderer
    return path


def default_report_dir(device: str, *, root: str | Path = "reports") -> Path:

    return Path(root) / f"model-{device_slug(device)}-{datetime.datetime.now():%Y%m%d-%H%M%S}"


def write_model_report(df, *, out_dir=None, meta: dict) -> Path:
    """results.csv (every row with its provenance), report.md and plot.png; returns the directory."""
    out = Path(out_dir) if out_dir else default_report_dir(meta.get("device", "device"))
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "results.csv", index=False)
    (out / "report.md").write_text(render_model_markdown(df, meta))
    if len(df):
        plot_model_results(df, out / "plot.png")
    return out


if __name__ == "__main__":  # python -m tridist.bench.model_bench [tridist bench model options]
    from tridist.bench.cli import main

    sys.exit(main(["bench", "model", *sys.argv[1:]]))
