"""`fuse(model)`: swap the fused kernels into a Llama-style model written in plain PyTorch, in place.

Candidates are found by structure and confirmed by behaviour, never by class name alone:
- RMSNorm: a module whose only parameter is a 1-D `weight` and which has an eps attribute
  (`variance_epsilon`, `eps` or `epsilon`). A probe run on random input must match RMSNorm with that
  eps; it also tells the offset (`w` or `1 + w`) and which rounding the module uses (seed: to the
  weight's dtype; Hugging Face: to the input's dtype). Replaced by FusedRMSNorm around the same Parameter.
- Gated MLP: a module with `gate_proj`, `up_proj`, `down_proj` (or `gate_up_proj`, `down_proj`)
  whose output on a probe equals `down(act(gate(x)) * up(x))` with act silu (SwiGLU: Llama, Qwen, Mistral) or
  gelu, exact or its tanh approximation (GeGLU: Gemma's `gelu_pytorch_tanh`). Replaced by FusedSwiGLUMLP with
  that activation around the same projection modules.
- Rotary: a module whose forward calls, by global name, a function named like `*rotary*`/`*rope*`
  that behaves like the seed's `apply_rotary_pos_emb(q, k, cos, sin, position_ids)` or Hugging Face's
  `apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)`. That instance's forward is
  rebound to a copy of itself whose global name points to the fused kernel (other instances and the
  defining module are untouched); calls the kernel cannot take fall back to the original function.
- LM head + loss: a transformers causal LM (an nn.Linear `lm_head`, PreTrainedModel's settable
  `loss_function`, a forward taking `labels`). The head becomes a FusedLMHead (an nn.Linear around the same
  Parameters) and the loss a CausalLMLinearCrossEntropy: in a call with labels the model's own forward
  runs, the head keeps the hidden states instead of computing the logits, and the loss is
  `linear_cross_entropy` over token chunks (the [tokens, vocab] logits are never held). As with
  Liger-Kernel's fused loss, such a call returns `logits=None`; a call without labels returns the
  logits as before. A probe confirms the tail of the forward (the head, any logit transform, the loss)
  on a stand-in for the decoder, with a thin head of the vocabulary's width: the same loss, also with
  `num_items_in_batch`; Gemma-2's final soft-capping and Cohere's and Granite's logit scales are read
  from the config and confirmed so. Code
  that runs the forward without the model's hooks (distcore's pipeline stages) arms the head with
  `labelled_call`. Under tensor parallel (ColwiseParallel: the head's weight a DTensor split on the
  vocabulary) the loss runs vocabulary-parallel (linear_cross_entropy on DTensors).
Parameters stay the same objects, so an optimizer built before `fuse` keeps working, and parameter
names are unchanged. Probes run on CPU copies with fresh random values, so a model still on the meta
device (built under `distcore.LazyGuard` or `torch.device("meta")`) is fused like a materialised one.
Modules with hooks, failing a probe, or (norms and MLPs) whose forward takes more than its input (Mamba 2's
gated RMSNorm: `norm(x, gate)`) are left alone and the report says why; `strict=True` turns
any candidate left alone into a `FuseError`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import types
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from ._common import is_dtensor
from .ops import rotary as rotary_op
from .ops.linear_cross_entropy import CausalLMLinearCrossEntropy, FusedLMHead
from .ops.rms_norm import FusedRMSNorm
from .ops.swiglu import ACTIVATIONS, FusedSwiGLUExperts, FusedSwiGLUMLP, stacked_experts_layout_error
from .reference import gated_reference, rms_norm_reference, rotary_reference

_EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")
_ROTARY_NAME_HINTS = ("rotary", "rope")


@dataclass
class FuseReport:
    """What `fuse` replaced and what it left alone (with the reason), by module name."""

    replaced: list[tuple[str, str]] = field(default_factory=list)  # (module name, what it became)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (module name, why not)

    def count(self, kind: str) -> int:
        return sum(1 for _, what in self.replaced if what.startswith(kind))

    def __str__(self) -> str:
        lines = [f"fused {len(self.replaced)} module(s), left {len(self.skipped)} alone"]
        lines += [f"  replaced {name or '<root>'}: {what}" for name, what in self.replaced]
        lines += [f"  skipped  {name or '<root>'}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


class FuseError(RuntimeError):
    """`fuse(..., strict=True)` found candidates it could not replace (the message lists each, with why)."""


def fuse(model: torch.nn.Module, *, rms_norm: bool = True, rotary: bool = True, swiglu: bool = True,
         linear_cross_entropy: bool = True, strict: bool = False) -> FuseReport:
    """Replace RMSNorm modules, gated MLPs (`swiglu`: SwiGLU and GeGLU MLPs, and a mixture of experts' stacked
    SwiGLU experts), rotary applications and a causal LM's head + loss of `model` in place.

    strict: raise FuseError, before changing anything, when a requested kind has a candidate that
    cannot be replaced (a look-alike computing something else, such as a gated MLP with quick_gelu or a
    LayerNorm, a module with hooks, a rotary function of another convention); pass that kind's flag False to
    leave it.
    """
    # The probes' runs and the new modules' default initialisation draw from the caller's generators otherwise: a
    # fused model would train on other random numbers (dropout, shuffling) than the unfused one from the same seed
    devices = sorted({t.device.index for t in model.parameters() if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        report = FuseReport()
        changes: list = []  # every probe runs first; the replacements are applied after, or not at all (strict)
        verdicts: dict = {}  # one probe per kind of module (_kind) or rotary function: a model's layers are alike
        for name, module in model.named_modules():
            if isinstance(module, (FusedRMSNorm, FusedSwiGLUMLP, FusedSwiGLUExperts)):
                continue
            if not name and (_looks_like_rms_norm(module) or _looks_like_swiglu_mlp(module)
                             or looks_like_stacked_experts(module)):
                report.skipped.append((name, "the model itself is the candidate; fuse the model that contains it"))
            elif rms_norm and _looks_like_rms_norm(module):
                _fuse_rms_norm(model, name, module, report, changes, verdicts)
            elif swiglu and _looks_like_swiglu_mlp(module):
                _fuse_swiglu_mlp(model, name, module, report, changes, verdicts)
            elif swiglu and looks_like_stacked_experts(module):
                _fuse_stacked_experts(model, name, module, report, changes, verdicts)
            if rotary:
                _fuse_rotary(name, module, report, changes, verdicts)
            if linear_cross_entropy and _looks_like_causal_lm(module):
                _fuse_lm_head_and_loss(model, name, module, report, changes)
            elif linear_cross_entropy and (why := _why_head_is_no_linear(module)):
                report.skipped.append((f"{name}.lm_head" if name else "lm_head", why))
        if strict and report.skipped:
            lines = "\n".join(f"  {name or '<root>'}: {why}" for name, why in report.skipped)
            raise FuseError(
                f"fuse(strict=True): {len(report.skipped)} candidate(s) cannot be fused:\n{lines}\n"
                "fuse without strict leaves them as they are; or pass "
                "rms_norm=/swiglu=/rotary=/linear_cross_entropy=False for that kind"
            )
        for change in changes:
            change()
    return report


# ------------------------------------------------------------------------------------------ helpers


def _why_not_probeable(module: torch.nn.Module) -> str | None:
    if module._forward_hooks or module._forward_pre_hooks:
        return "module has forward hooks, which a replacement would drop"
    return None


def _why_not_one_input(module: torch.nn.Module) -> str | None:
    """Why a norm or MLP candidate cannot be replaced by a module that takes one tensor, or None. A probe calls
    the candidate with its input alone; a forward that takes more (Mamba 2's gated RMSNorm: `norm(x, gate)`, the
    gate multiplied in before the norm) computes something else when the model passes the rest, which the probe
    never sees, and FusedRMSNorm would take that second tensor for a residual."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C function): nothing known of its inputs
        return "its forward's signature cannot be read; left as is"
    extra = [p.name for p in parameters[1:]] + [p.name for p in parameters[:1]
                                                 if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY)]
    if extra:
        return (f"its forward takes more than the input ({', '.join(extra)}), which the fused module would not "
                "honour; left as is")
    return None


# What every fresh nn.Module holds in its __dict__: torch's bookkeeping, not state a forward reads.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}
# Of those, the dicts a kind does not capture (buffers and every kind of hook): a module with any is probed alone.
_UNCAPTURED = frozenset(a for a, v in vars(torch.nn.Module()).items() if isinstance(v, dict)) - {"_parameters", "_modules"}


def _kind(module: torch.nn.Module) -> tuple | None:
    """What a probe of `module` can depend on, hashable: its class, its parameters (name, type, shape and
    dtype: probes replace their values; one registered as None by its name), its plain attributes by exact
    type and value (_by_value; anything else, such as a shared config object, by identity) and its
    children's kinds. Modules of one kind compute the same function of their input and parameters, so one
    probe's verdict holds for all of them. None (probe it on its own) for a module with buffers or hooks,
    or a forward replaced on the instance: what those do to a probe is not captured here. (State outside
    the instance, such as class attributes or globals, is the class's code: alike for every instance.)"""
    internals = vars(module)
    if "forward" in internals or any(internals.get(a) for a in _UNCAPTURED):
        return None
    attributes = tuple((attr, _by_value(value)) for attr, value in sorted(internals.items()) if attr not in _MODULE_INTERNALS)
    # A parameter registered as None is a name a forward can test for; a subclass (DTensor) probes its own way.
    parameters = tuple((n, None) if p is None else (n, type(p), tuple(p.shape), p.dtype) for n, p in module._parameters.items())
    children = []
    for child_name, child in module._modules.items():
        child_kind = _kind(child) if child is not None else ()
        if child_kind is None:
            return None
        children.append((child_name, child_kind))
    return type(module), attributes, parameters, tuple(children)


_PLAIN_TYPES = (type(None), bool, int, float, str)


def _by_value(value):
    """Plain values (None, bool, int, float, str, tuples of them) with their exact type: Python counts
    True, 1 and 1.0 equal, and an Enum member equal to its value, while a forward may test which it is.
    Any other object by identity (the model holds it during the call, so its id is its own)."""
    if type(value) in _PLAIN_TYPES:
        return type(value), value
    if type(value) is tuple and all(type(v) in _PLAIN_TYPES for v in value):
        return tuple, tuple((type(v), v) for v in value)
    return "object", id(value)


def _probed(verdicts: dict, what: str, kind, probe):
    """probe()'s result, run once per (what, kind) in one `fuse` call; kind None: run every time."""
    if kind is None:
        return probe()
    if (what, kind) not in verdicts:
        verdicts[what, kind] = probe()
    return verdicts[what, kind]


def _replace(model: torch.nn.Module, name: str, old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Put `new` where `old` was, keeping old's plain attributes (sizes, eps) for code that reads them."""
    _copy_plain_attributes(old, new)
    # Not new.train(...): that recurses into the children, and a SwiGLU replacement's children are the
    # original projections, which keep their own modes (e.g. a frozen adapter in eval mode).
    new.training = old.training
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent._modules[child] = new


def _copy_plain_attributes(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Set on `target` the public plain values (int, float, str, bool) of `source` that it lacks."""
    for attr, value in vars(source).items():
        if not attr.startswith("_") and attr not in vars(target) and isinstance(value, (int, float, str, bool)):
            setattr(target, attr, value)


def _probe_input(shape) -> torch.Tensor:
    """fp32 CPU rows with a clear non-zero mean and different scales: a LayerNorm (which subtracts
    the mean) or a scale-dependent op cannot pass for an RMSNorm or a SwiGLU on such input."""
    generator = torch.Generator(device="cpu").manual_seed(1234)
    rows = torch.randn(shape, generator=generator)
    scale = torch.rand((*shape[:-1], 1), generator=generator) * 3 + 0.5
    return rows * scale + 2.0


def _probe_copy(module: torch.nn.Module) -> torch.nn.Module:
    """An fp32 copy of `module` with fresh random parameters.

    Probing the live module could be fooled by its current values (a zero-initialised down
    projection makes every activation look alike) and by half-precision rounding.
    """
    probe = _cpu_copy(module).float()
    generator = torch.Generator(device="cpu").manual_seed(4321)
    with torch.no_grad():
        for param in probe.parameters():
            param.copy_(fresh_probe_values(param.shape, generator))
    return probe


def fresh_probe_values(shape, generator: torch.Generator) -> torch.Tensor:
    """A probe's fresh fp32 values for a parameter of `shape`: matrices scaled by 1/sqrt(fan-in), vectors around
    0.5 (a zero-mean norm weight or bias would hide what it scales or shifts)."""
    if len(shape) > 1:
        return torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    return torch.randn(shape, generator=generator) + 0.5


def _cpu_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` on the CPU; a meta module's copy gets uninitialised storage (probes fill it)."""
    if any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers())):
        return copy.deepcopy(module).to_empty(device="cpu")
    return copy.deepcopy(module).cpu()


def _run(module: torch.nn.Module, x: torch.Tensor, *, training: bool = True):
    """A probe copy's module(x) without autograd, or the exception it raised (a probe must never crash fuse). In
    training mode by default, as the fused layer will train: a module that draws at random there (Seed-OSS's MLP
    applies dropout, 0.1 by default) then differs from the formula and is left alone; probed in the caller's eval
    mode (from_pretrained's) it was fused, and its dropout lost in training. (Its draws come from the generators
    fuse forks for its whole run: the caller's random state is kept.)"""
    module.train(training)
    try:
        with torch.no_grad():
            return module(x), None
    except Exception as error:  # noqa: BLE001 - reported in the FuseReport
        return None, f"{type(error).__name__}: {error}"


def _close(a, b: torch.Tensor) -> bool:
    """fp32 probes of the same math agree to rounding; anything else is a different op."""
    if not torch.is_tensor(a) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ RMSNorm


def _looks_like_rms_norm(module: torch.nn.Module) -> bool:
    params = dict(module.named_parameters())
    weight = params.get("weight")
    return (
        len(params) == 1
        and weight is not None
        and weight.dim() == 1
        and any(isinstance(getattr(module, a, None), float) for a in _EPS_ATTRIBUTES)
    )


def _fuse_rms_norm(model, name, module, report, changes, verdicts) -> None:
    why = _why_not_probeable(module) or _why_not_one_input(module)
    if why:
        report.skipped.append((name, f"RMSNorm candidate: {why}"))
        return
    eps = next(getattr(module, a) for a in _EPS_ATTRIBUTES if isinstance(getattr(module, a, None), float))
    verdict = _probed(verdicts, "rms_norm", _kind(module), partial(_rms_norm_verdict, module, eps))
    if isinstance(verdict, str):
        report.skipped.append((name, verdict))
        return
    offset, cast_to = verdict
    changes.append(partial(_replace, model, name, module, FusedRMSNorm.from_parameter(module.weight, eps, offset=offset, cast_to=cast_to)))
    report.replaced.append((name, f"rms_norm: FusedRMSNorm(eps={eps}, offset={offset}, cast_to={cast_to!r})"))


def _rms_norm_verdict(module: torch.nn.Module, eps: float) -> tuple[float, str] | str:
    """(offset, cast_to) of an RMSNorm look-alike, from probes, or why it is left alone."""
    cast_to = _rms_norm_cast_convention(module)
    probe = _probe_copy(module)
    x = _probe_input((4, module.weight.shape[0]))
    out, error = _run(probe, x)
    if error:
        return f"RMSNorm candidate: its forward failed on a probe ({error}); left as is"
    offset = None
    if cast_to is not None:
        offset = next(
            (o for o in (0.0, 1.0) if _close(out, rms_norm_reference(x, probe.weight, eps, offset=o, cast_to=cast_to))),
            None,
        )
    if offset is None:
        return f"has a 1-D weight and eps={eps} but its output is not RMSNorm(x) * (w or 1 + w); left as is"
    return offset, cast_to


def _rms_norm_cast_convention(module: torch.nn.Module) -> str | None:
    """Which dtype the module rounds to, told apart on a bf16-weight copy fed fp32 input.

    The seed rounds to a half-precision weight's dtype (bf16 out); Hugging Face rounds to the input's
    dtype and then multiplies by the weight (fp32 out).
    """
    probe_module = _cpu_copy(module).to(torch.bfloat16)
    with torch.no_grad():
        probe_module.weight.fill_(1.0)  # only the output's dtype is read; a meta copy's storage is garbage
    x = _probe_input((2, module.weight.shape[0]))
    out, error = _run(probe_module, x)
    if error or not torch.is_tensor(out):  # a module that rejects mixed dtypes follows neither
        return None
    return {torch.bfloat16: "weight", torch.float32: "input"}.get(out.dtype)


# --------------------------------------------------------------------------------------------- SwiGLU


def _looks_like_swiglu_mlp(module: torch.nn.Module) -> bool:
    children = module._modules
    return "down_proj" in children and ("gate_up_proj" in children or {"gate_proj", "up_proj"} <= set(children))


def _fuse_swiglu_mlp(model, name, module, report, changes, verdicts) -> None:
    why = _why_not_probeable(module) or _why_not_one_input(module)
    if why:
        report.skipped.append((name, f"SwiGLU MLP candidate: {why}"))
        return
    children = module._modules
    in_features = getattr(children.get("gate_up_proj") or children["gate_proj"], "in_features", None)
    if in_features is None:
        report.skipped.append((name, "SwiGLU MLP candidate: projections without in_features; left as is"))
        return
    activation, why_not = _probed(verdicts, "swiglu", _kind(module), partial(_gated_mlp_verdict, module, in_features))
    if why_not:
        report.skipped.append((name, why_not))
        return
    if "gate_up_proj" in children:
        fused = FusedSwiGLUMLP.from_linears(gate_up_proj=children["gate_up_proj"], down_proj=children["down_proj"],
                                            activation=activation)
    else:
        fused = FusedSwiGLUMLP.from_linears(
            gate_proj=children["gate_proj"], up_proj=children["up_proj"], down_proj=children["down_proj"],
            activation=activation,
        )
    changes.append(partial(_replace, model, name, module, fused))
    kind = "swiglu" if activation == "silu" else f"geglu ({activation})"
    report.replaced.append((name, f"{kind}: FusedSwiGLUMLP"))


def _gated_mlp_verdict(module: torch.nn.Module, in_features: int) -> tuple[str | None, str | None]:
    """(activation, None) when a probe shows `module` computes down(act(gate(x)) * up(x)) with act one of the fused
    kernels' (silu: SwiGLU; gelu's tanh approximation or exact gelu: GeGLU), else (None, why it is left alone).
    The activation is the one whose output lies closest to the module's (gelu's two forms differ by ~1e-4, a
    few times `_close`'s tolerance at the probe's scale; the module's own activation matches to fp32 rounding)."""
    probe = _probe_copy(module)
    x = _probe_input((2, 3, in_features))
    out, error = _run(probe, x)
    if error:
        return None, f"SwiGLU MLP candidate: its forward failed on a probe ({error}); left as is"
    with torch.no_grad():
        if "gate_up_proj" in probe._modules:
            gate, up = probe.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = probe.gate_proj(x), probe.up_proj(x)
        candidates = {activation: probe.down_proj(gated_reference(gate, up, activation)) for activation in ACTIVATIONS}
    if torch.is_tensor(out) and out.shape == candidates["silu"].shape:
        closest = min(candidates, key=lambda activation: (candidates[activation] - out).abs().max().item())
        if _close(out, candidates[closest]):
            return closest, None
        if any(_close(_run(probe, x, training=False)[0], candidate) for candidate in candidates.values()):
            return None, ("SwiGLU MLP candidate: computes down(act(gate(x)) * up(x)) in eval mode only (dropout, or "
                          "another random draw in training): the fused layer would lose it in training; left as is")
    return None, ("has gate/up/down projections but its output is not down(act(gate(x)) * up(x)) for act silu, gelu "
                  "or gelu's tanh approximation; left as is")


# ---------------------------------------------------------------------------- Mixture-of-experts experts


def looks_like_stacked_experts(module: torch.nn.Module) -> bool:
    """Hugging Face's experts layout: 3-D `gate_up_proj` and `down_proj` of the module itself."""
    params = module._parameters
    return all(isinstance(params.get(n), torch.Tensor) and params[n].dim() == 3 for n in ("gate_up_proj", "down_proj"))


def _fuse_stacked_experts(model, name, module, report, changes, verdicts) -> None:
    why = _why_not_probeable(module)
    if why:
        report.skipped.append((name, f"SwiGLU experts candidate: {why}"))
        return
    why_not = _probed(verdicts, "swiglu-experts", _kind(module), partial(experts_verdict, module))
    if why_not:
        report.skipped.append((name, why_not))
        return
    changes.append(partial(_replace, model, name, module, FusedSwiGLUExperts(module.gate_up_proj, module.down_proj)))
    report.replaced.append((name, "swiglu: FusedSwiGLUExperts"))


def stacked_experts_copy(module: torch.nn.Module, count: int, fill=None) -> torch.nn.Module:
    """A copy of experts `module` for `count` of its experts, none of its weights copied: each parameter of its
    own stacked on the expert count (a first dim equal to gate_up_proj's, or to the first parameter's) becomes
    [count, ...], the others keep their shape; `fill(shape, dtype)` makes them (None: meta placeholders, for a
    caller passing real ones through torch.func.functional_call). Its `config` is shared (transformers picks the
    experts' implementation from it at each call) and an int `num_experts` of its own set to `count`. Probing a
    few experts instead of a copy of all of them keeps a real-size model's probe small."""
    own = dict(module.named_parameters(recurse=False))
    stacked = own.get("gate_up_proj", next(iter(own.values()), None))
    experts = stacked.shape[0] if stacked is not None and stacked.dim() >= 2 else None
    memo = {}
    for param in own.values():
        shape = (count, *param.shape[1:]) if param.dim() >= 2 and param.shape[0] == experts else tuple(param.shape)
        value = fill(shape, param.dtype) if fill is not None else torch.empty(shape, dtype=param.dtype, device="meta")
        memo[id(param)] = torch.nn.Parameter(value, requires_grad=param.requires_grad)
    config = getattr(module, "config", None)
    if config is not None:
        memo[id(config)] = config
    copied = copy.deepcopy(module, memo)
    if isinstance(vars(copied).get("num_experts"), int):
        copied.num_experts = count
    return copied


def stacked_expert_count(module: torch.nn.Module) -> tuple[int | None, str]:
    """(the expert count, "") when every parameter of `module` is its own and stacked on one expert count (a
    first dim of at least 2 shared by all) and it holds no buffers, else (None, why not): what a copy holding
    some of its experts (`stacked_experts_copy`) can stand for the whole of."""
    own = dict(module.named_parameters(recurse=False))
    if not own or len(own) != len(list(module.parameters())) or list(module.buffers()):
        return None, "its parameters are not all its own (or it holds buffers)"
    counts = {p.shape[0] if p.dim() >= 2 else None for p in own.values()}
    if len(counts) != 1 or None in counts or next(iter(counts)) < 2:
        return None, f"its parameters are not all stacked on one expert count (shapes {[tuple(p.shape) for p in own.values()]})"
    return next(iter(counts)), ""


def _few_experts_probe(module: torch.nn.Module, few: int = 4) -> torch.nn.Module:
    """A probe copy of stacked experts `module` (fresh fp32 parameters, as `_probe_copy`'s) holding `few` of its
    experts where that shows what a copy of all of them would: its parameters are all its own and stacked, and
    its forward reads the expert count from its own `num_experts` (Hugging Face's experts do). Else (a
    submodule or buffer, which a few-expert copy keeps live; a count read from elsewhere) a copy of all."""
    experts, _ = stacked_expert_count(module)
    if experts is None or experts <= few or vars(module).get("num_experts") != experts:
        return _probe_copy(module)
    fresh = torch.Generator(device="cpu").manual_seed(4321)
    return stacked_experts_copy(module, few, lambda shape, _: fresh_probe_values(shape, fresh))


def experts_verdict(module: torch.nn.Module) -> str | None:
    """None when `module` holds stacked SwiGLU experts (3-D gate_up_proj [experts, 2·ffn, hidden] and
    down_proj [experts, hidden, ffn]) and a probe shows `module(x, top_k_index, top_k_weights)` is each
    token's k experts, down(silu(gate) * up), weighted and summed (Hugging Face's experts interface);
    else why not (fuse leaves such a module alone; distcore's expert parallel refuses it)."""
    if not looks_like_stacked_experts(module):
        return "SwiGLU experts candidate: no 3-D gate_up_proj and down_proj parameters of its own"
    problem = stacked_experts_layout_error(module.gate_up_proj, module.down_proj)
    if problem:
        return f"SwiGLU experts candidate: {problem} (a transposed layout); left as is"
    probe = _few_experts_probe(module)
    experts, hidden = probe.gate_up_proj.shape[0], probe.gate_up_proj.shape[2]
    generator = torch.Generator(device="cpu").manual_seed(99)
    tokens, k = 7, min(2, experts)
    x = _probe_input((tokens, hidden))
    index = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=generator)
    try:
        with torch.no_grad():
            out = probe(x, index, weights)
    except Exception as error:  # noqa: BLE001 - reported in the FuseReport
        return f"SwiGLU experts candidate: its forward failed on a probe ({type(error).__name__}: {error}); left as is"
    with torch.no_grad():
        expected = FusedSwiGLUExperts(probe.gate_up_proj, probe.down_proj, grouped_mm=False)(x, index, weights)
    if not _close(out, expected):
        return ("has 3-D gate_up_proj/down_proj experts but its output is not each token's experts' "
                "down(silu(gate) * up), weighted and summed; left as is")
    return None


# --------------------------------------------------------------------------------------------- Rotary

# How each known calling convention maps its arguments to the fused op:
#   seed: apply_rotary_pos_emb(q, k, cos, sin, position_ids): bshd, cos [1, T, 1, D], positions gathered.
#   hf:   apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) (transformers >= 4.48), or the older
#         (q, k, cos, sin, position_ids=None, unsqueeze_dim=1): cos [B, S, D] already per position
#         (position_ids unused); unsqueeze_dim=1 means bhsd, 2 means bshd. GPT-NeoX's and Phi's version
#         rotates the first cos.shape[-1] features and passes the rest (partial rotary): told apart by a
#         probe with a half-width table, and only then are narrower tables given to the kernel. Cohere's
#         pairs adjacent features (GPT-J's interleaved rotation, tables repeat_interleave'd): told apart
#         by probes with such tables. GLM-4's and ERNIE 4.5's pair adjacent features too, but take the usual
#         [freqs | freqs] tables and rotate pair j by the table's first half's entry j (repeat_interleave'd
#         inside): the kernel gets that first half, one entry per pair (GLM-4: over a partial rotary width).
#         DeepSeek-V3's `apply_rotary_pos_emb_interleave` (also deepseek_v32, glm4_moe_lite, mistral_large4,
#         longcat_flash, dots3_note ... in transformers 5) pairs them so too and writes pair j's results to
#         (j, j + D/2): the kernel's `deinterleave`. gpt-oss's takes tables of one entry per pair
#         ([B, S, D/2]) and pairs (j, j + D/2): the kernel's half tables (`half_table`).
#   one tensor: apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1) (Gemma 3n, Gemma 4), called for q and for k:
#         probed as the pair of its calls; each call runs the kernel on x with a k of no heads.
#   complex: apply_rotary_emb(xq, xk, freqs_cis) (Llama 4: bshd; DeepSeek-V2: bhsd): freqs_cis complex
#         [B, S, D/2], pairs (2j, 2j + 1) multiplied by freqs_cis[j] in fp32, cast back to q's dtype: the kernel's
#         interleaved pairs with freqs_cis.real / .imag as half tables (any magnitude: DeepSeek-V2 scales it).
#         Where the function returns q's dtype from tables of a wider one (ERNIE computes in fp32 and casts
#         back), the kernel's fp32 computation rounded once to q's dtype is that, and fp32 tables are taken.


@dataclass(frozen=True)
class _RotaryConvention:
    name: str  # "seed", "hf" or "complex"
    signature: inspect.Signature
    layouts: tuple[int, ...] = ()  # hf: the unsqueeze_dim values the function was seen to handle
    layout: str = "bshd"  # complex: q and k's layout
    half_table: bool = False  # hf, rotate-half: tables of one entry per pair rotate twice their width (gpt-oss)
    one_tensor: bool = False  # hf: (x, cos, sin, unsqueeze_dim) rotates one tensor per call (Gemma 4)
    partial: bool = False  # hf: features past the table's width pass through
    interleaved: bool = False  # hf: pairs (2j, 2j + 1) rotate together (else (j, j + D/2))
    first_half: bool = False  # hf, interleaved: pair j rotates by the table's entry j (GLM-4, ERNIE 4.5)
    deinterleave: bool = False  # hf, first_half: pair j's results written to (j, j + D/2) (DeepSeek-V3)
    keeps_dtype: bool = False  # returns q's dtype from tables of a wider dtype (computes wide, casts back)

    def __str__(self) -> str:
        pairs = (", interleaved pairs" + (" from the table's first half" if self.first_half else "")
                 + (" written as halves" if self.deinterleave else ""))
        return (f"{self.name} convention" + (f" ({self.layout})" if self.name == "complex" else "")
                + (", one tensor per call" if self.one_tensor else "")
                + (pairs if self.interleaved and self.name != "complex" else "")
                + (", tables of one entry per pair" if self.half_table else "")
                + (", partial rotary" if self.partial else ""))


def _rotary_function_names(module: torch.nn.Module) -> list[str]:
    # The code that calls the rotary function by global name is the innermost of a decorated forward's
    # (`__wrapped__`, followed to the end): transformers decorates attention forwards (`deprecate_kwarg`, 5.24).
    forward = inspect.unwrap(getattr(type(module), "forward", None))
    code = getattr(forward, "__code__", None)
    if code is None or "forward" in vars(module):  # already fused, or its forward was replaced by someone
        return []
    names = []
    for global_name in code.co_names:
        value = forward.__globals__.get(global_name)
        if isinstance(value, types.FunctionType) and any(h in global_name.lower() for h in _ROTARY_NAME_HINTS):
            names.append(global_name)
    return names


def _fuse_rotary(name: str, module: torch.nn.Module, report: FuseReport, changes: list, verdicts: dict) -> None:
    function_names = _rotary_function_names(module)
    if not function_names:
        return
    forward = type(module).forward
    defined = inspect.unwrap(forward).__globals__
    adapters = {}
    fused_names = []
    for function_name in function_names:
        original = defined[function_name]
        convention = _probed(verdicts, "rotary", original, partial(_rotary_convention, original))
        if convention is None:
            report.skipped.append(
                (name, f"calls {function_name}, which does not behave like the seed's or Hugging Face's rotary")
            )
            continue
        adapters[function_name] = _rotary_adapter(original, convention)
        fused_names.append(f"{function_name} ({convention})")
    if not fused_names:
        return
    rebound = _with_globals(forward, _fused_globals(type(module), adapters))
    if rebound is None:
        report.skipped.append((name, f"calls {', '.join(fused_names)} inside a decorator whose wrapper cannot be made "
                                     "to call a fused copy (no plain function, no closure over what it wraps, or "
                                     "another way to call it); left as is"))
        return
    changes.append(partial(setattr, module, "forward", types.MethodType(rebound, module)))
    report.replaced.append((name, "rotary: " + ", ".join(fused_names)))


def _with_globals(function, globals_: dict):
    """A copy of `function` whose code, and that of every function it wraps (`__wrapped__`), reads `globals_`
    where it read the innermost function's globals; a decorator's wrapper keeps its own globals and calls the
    copy of what it wrapped in its place (the closure cells holding it). None where that cannot be made sure: a
    level that is no plain Python function (a class-based decorator, functools.lru_cache), a wrapper that holds
    what it wraps in no closure cell, or one that can also reach it another way (a functools.partial of it, or a
    helper closing over it, in another cell: the copy would not be what runs)."""
    if not isinstance(function, types.FunctionType):
        return None
    wrapped = getattr(function, "__wrapped__", None)
    if wrapped is None:
        return _copied(function, globals_, function.__closure__)
    cells = function.__closure__ or ()
    holds = [index for index, cell in enumerate(cells) if _cell_value(cell) is wrapped]
    if not holds or any(_reaches(_cell_value(cell), wrapped) for index, cell in enumerate(cells) if index not in holds):
        return None
    inner = _with_globals(wrapped, globals_)
    if inner is None:
        return None
    copied = _copied(function, function.__globals__,
                     tuple(types.CellType(inner) if index in holds else cell for index, cell in enumerate(cells)))
    copied.__wrapped__ = inner
    return copied


def _copied(function: types.FunctionType, globals_: dict, closure) -> types.FunctionType:
    """`function` with these globals and closure cells, and everything else of it (defaults, keyword-only
    defaults, the attributes functools.wraps copies); its module is its globals' (`_fused_globals`' own name)."""
    copied = types.FunctionType(function.__code__, globals_, function.__name__, function.__defaults__, closure)
    copied.__kwdefaults__ = function.__kwdefaults__
    copied.__qualname__, copied.__doc__ = function.__qualname__, function.__doc__
    copied.__annotations__ = dict(function.__annotations__)
    copied.__dict__.update(function.__dict__)
    return copied


def _reaches(value, target) -> bool:
    """Whether a closure cell's value is another way to call `target`: a functools.partial of it, or a
    function whose own closure holds it."""
    if isinstance(value, partial):
        return value.func is target
    return isinstance(value, types.FunctionType) and any(_cell_value(cell) is target for cell in value.__closure__ or ())


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name the closure has not bound yet)
        return None


def _fused_globals(cls: type, adapters: dict) -> dict:
    """The globals a fused forward of `cls` runs with: its module's, with the rotary functions replaced.

    They are a module of their own, registered in sys.modules (one per class and set of adapters):
    torch.compile finds a function's globals by its module name, and would otherwise guard on the
    original module's functions."""
    forward = inspect.unwrap(cls.forward)
    base = forward.__globals__.get("__name__", cls.__module__)
    name = f"{base}.__tridist_fused_{cls.__qualname__.replace('.', '_')}_{'_'.join(sorted(adapters))}__"
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in forward.__globals__.items() if k not in ("__name__", "__spec__", "__loader__")})
        module.__dict__.update(adapters)
        sys.modules[name] = module
    return sys.modules[name].__dict__


def _rotary_convention(function) -> _RotaryConvention | None:
    """The calling convention `function` follows, found by running it on probes and comparing."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if [p.name for p in positional[3:4]] == ["unsqueeze_dim"]:  # (x, cos, sin, unsqueeze_dim): q's call, then k's
        convention = _rotary_convention(_RotaryPair(function))
        return None if convention is None else replace(convention, signature=signature, one_tensor=True)
    if not (len(positional) >= 4 or len(params) == len(positional) == 3):
        return None  # (q, k, cos, sin, ...) or the complex convention's three arguments
    batch, seq_len, heads, kv_heads, head_dim = 2, 5, 4, 2, 8
    generator = torch.Generator().manual_seed(99)
    positions = torch.stack([torch.arange(seq_len).flip(0), torch.arange(seq_len)])
    q = torch.randn(batch, seq_len, heads, head_dim, generator=generator)
    k = torch.randn(batch, seq_len, kv_heads, head_dim, generator=generator)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)

    def tables(width, interleaved=False):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width))
        freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)
        emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat([freqs, freqs], -1)
        return emb.cos(), emb.sin()

    def agrees(call, want, bhsd=False) -> bool:
        try:  # each probe on its own: a function of another convention raises on the other's arguments
            with torch.no_grad():
                out = call()
        except Exception:  # noqa: BLE001 - not this convention
            return False
        if not (isinstance(out, tuple) and len(out) == 2 and all(torch.is_tensor(t) for t in out)):
            return False
        out = tuple(t.transpose(1, 2) for t in out) if bhsd else out
        return all(_close(a, b) for a, b in zip(out, want))

    if len(params) == 3:  # (xq, xk, freqs_cis): complex tables of one entry per pair, of any magnitude
        cos, sin = (table[positions][..., :head_dim // 2] for table in tables(head_dim))  # [B, S, D/2] per position
        freqs_cis = 1.25 * torch.complex(cos, sin)
        expected = rotary_reference(q, k, freqs_cis.real, freqs_cis.imag, interleaved=True, rotary_dim=head_dim)
        for layout, call in (("bshd", lambda: function(q, k, freqs_cis)), ("bhsd", lambda: function(qt, kt, freqs_cis))):
            if agrees(call, expected, bhsd=layout == "bhsd"):
                return _RotaryConvention("complex", signature, layout=layout, interleaved=True)
        return None

    cos, sin = tables(head_dim)
    expected = rotary_reference(q, k, cos, sin, positions)
    seed_call = lambda: function(q, k, cos[None, :, None], sin[None, :, None], positions)  # noqa: E731
    if len(params) >= 5 and params[4].name != "unsqueeze_dim" and agrees(seed_call, expected):
        return _RotaryConvention("seed", signature)
    if "unsqueeze_dim" not in signature.parameters:  # HF's, old or new, names it; anything else is unknown
        return None

    def hf_layouts(cos, sin, expected) -> tuple[int, ...]:
        return tuple(
            dim for dim, call in (
                (1, lambda: function(qt, kt, cos[positions], sin[positions], unsqueeze_dim=1)),  # [B, S, D] per position
                (2, lambda: function(q, k, cos[positions], sin[positions], unsqueeze_dim=2)),
            ) if agrees(call, expected, bhsd=dim == 1)
        )

    layouts = hf_layouts(cos, sin, expected)
    if 1 in layouts:  # the default layout must work: calls rarely pass unsqueeze_dim
        half_cos, half_sin = tables(head_dim // 2)
        partial_expected = rotary_reference(q, k, half_cos, half_sin, positions, rotary_dim=head_dim // 2)
        partial = agrees(lambda: function(qt, kt, half_cos[positions], half_sin[positions], unsqueeze_dim=1),
                         partial_expected, bhsd=True)
        return _RotaryConvention("hf", signature, layouts=layouts, partial=partial)
    half_cos, half_sin = cos[..., :head_dim // 2], sin[..., :head_dim // 2]  # gpt-oss's: one entry per pair
    layouts = hf_layouts(half_cos, half_sin, expected)
    if 1 in layouts:
        return _RotaryConvention("hf", signature, layouts=layouts, half_table=True)
    cos, sin = tables(head_dim, interleaved=True)
    layouts = hf_layouts(cos, sin, rotary_reference(q, k, cos, sin, positions, interleaved=True))
    if 1 in layouts:  # interleaved pairs over the whole head (no partial variant is known to transformers)
        return _RotaryConvention("hf", signature, layouts=layouts, interleaved=True)

    def first_half_expected(width, deinterleave):  # GLM's: [freqs | freqs] tables of `width`, pair j by freqs[j]
        cos, sin = tables(width)
        return cos, sin, rotary_reference(q, k, cos[..., :width // 2], sin[..., :width // 2], positions,
                                          interleaved=True, deinterleave=deinterleave, rotary_dim=width)

    for deinterleave in (False, True):  # GLM's results in pairs, DeepSeek's as halves
        cos, sin, expected = first_half_expected(head_dim, deinterleave)
        layouts = hf_layouts(cos, sin, expected)
        if 1 in layouts:
            break
    else:
        return None
    half_cos, half_sin, partial_expected = first_half_expected(head_dim // 2, deinterleave)
    partial = agrees(lambda: function(qt, kt, half_cos[positions], half_sin[positions], unsqueeze_dim=1),
                     partial_expected, bhsd=True)
    try:  # bf16 q and k with the fp32 tables: does it return q's dtype (ERNIE 4.5 casts back) or the promoted one?
        with torch.no_grad():
            out = function(qt.bfloat16(), kt.bfloat16(), cos[positions], sin[positions], unsqueeze_dim=1)
        keeps_dtype = out[0].dtype == torch.bfloat16
    except Exception:  # noqa: BLE001 - mixed dtypes refused: the kernel then never gets them either
        keeps_dtype = False
    return _RotaryConvention("hf", signature, layouts=layouts, partial=partial, interleaved=True, first_half=True,
                             deinterleave=deinterleave, keeps_dtype=keeps_dtype)


class _RotaryPair:
    """A one-tensor rotary `function(x, cos, sin, unsqueeze_dim)` as the pair of its calls on q and on k: the
    signature the Hugging Face probes call."""

    def __init__(self, function):
        self.function = function
        names = ("q", "k", "cos", "sin", "unsqueeze_dim")
        self.__signature__ = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, **({"default": 1} if n == names[-1] else {}))
             for n in names])

    def __call__(self, q, k, cos, sin, unsqueeze_dim=1):
        return self.function(q, cos, sin, unsqueeze_dim), self.function(k, cos, sin, unsqueeze_dim)


def _rotary_adapter(original, convention: _RotaryConvention):
    """A drop-in for `original` that runs the fused kernel and falls back to `original` when it can't.

    Written out per signature (no `inspect` at call time: torch.compile traces this function)."""
    if convention.name == "seed":

        def fused_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, *args, **kwargs):
            if not args and not kwargs and _kernel_accepts(q, k, cos, sin, position_ids, "bshd"):
                return rotary_op.apply_rotary_pos_emb(q, k, cos, sin, position_ids, layout="bshd")
            return original(q, k, cos, sin, position_ids, *args, **kwargs)

    elif convention.one_tensor:

        def fused_apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1, *args, **kwargs):
            # x beside a k of no heads (the heads are dim 1 in bhsd, unsqueeze_dim 1); DTensors (a block in global
            # view) run the original, whose ops DTensor shards
            if not args and not kwargs and torch.is_tensor(x) and x.dim() == 4 and not is_dtensor(x):
                out = _hf_fused(x, x[:, :0] if unsqueeze_dim == 1 else x[:, :, :0], cos, sin, unsqueeze_dim, convention)
                if out is not None:
                    return out[0]
            return original(x, cos, sin, unsqueeze_dim, *args, **kwargs)

    elif convention.name == "complex":

        def fused_apply_rotary_pos_emb(xq, xk, freqs_cis, *args, **kwargs):
            if not args and not kwargs:
                out = _complex_fused(xq, xk, freqs_cis, convention.layout)
                if out is not None:
                    return out
            return original(xq, xk, freqs_cis, *args, **kwargs)

    elif "position_ids" in convention.signature.parameters:  # transformers < 4.48 and DeepSeek-V3: position_ids unused

        def fused_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, *args, **kwargs):
            if not args and not kwargs:
                out = _hf_fused(q, k, cos, sin, unsqueeze_dim, convention)
                if out is not None:
                    return out
            return original(q, k, cos, sin, position_ids, unsqueeze_dim, *args, **kwargs)

    else:

        def fused_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
            if not args and not kwargs:
                out = _hf_fused(q, k, cos, sin, unsqueeze_dim, convention)
                if out is not None:
                    return out
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)

    fused_apply_rotary_pos_emb.__wrapped__ = original
    return fused_apply_rotary_pos_emb


def _hf_fused(q, k, cos, sin, unsqueeze_dim, convention: _RotaryConvention):
    """A Hugging Face convention's call on the kernel, or None where the kernel would not give the function's
    answer: an unsqueeze_dim not seen to work, tables narrower than the head where the function rotates it whole,
    a dtype the kernel would not return. The tables' width of features rotates (twice it with `half_table`);
    `first_half` gives the kernel the tables' first halves, one entry per pair."""
    rotary_dim = cos.shape[-1] * (2 if convention.half_table else 1)
    if unsqueeze_dim not in convention.layouts or not (convention.partial or rotary_dim == q.shape[-1]):
        return None
    layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
    if convention.first_half:
        cos, sin = cos[..., :rotary_dim // 2], sin[..., :rotary_dim // 2]
    if not _kernel_accepts(q, k, cos, sin, None, layout, rotary_dim=rotary_dim, keeps_dtype=convention.keeps_dtype):
        return None
    return rotary_op.apply_rotary_pos_emb(q, k, cos, sin, layout=layout, interleaved=convention.interleaved,
                                          deinterleave=convention.deinterleave, rotary_dim=rotary_dim)


def _complex_fused(xq, xk, freqs_cis, layout: str):
    """Llama 4's / DeepSeek-V2's `apply_rotary_emb(xq, xk, freqs_cis)` on the kernel (freqs_cis's real and
    imaginary parts as half tables, fp32 math rounded once to q's dtype as `.type_as(xq)` does), or None where the
    kernel would not give its answer (other table shapes: the function's broadcasting then decides)."""
    if not (torch.is_tensor(freqs_cis) and freqs_cis.is_complex() and freqs_cis.dim() == 3 and torch.is_tensor(xq)
            and 2 * freqs_cis.shape[-1] == xq.shape[-1]):
        return None
    cos, sin = freqs_cis.real, freqs_cis.imag
    if not _kernel_accepts(xq, xk, cos, sin, None, layout, rotary_dim=xq.shape[-1], keeps_dtype=True):
        return None
    return rotary_op.apply_rotary_pos_emb(xq, xk, cos, sin, layout=layout, interleaved=True, rotary_dim=xq.shape[-1])


def _kernel_accepts(q, k, cos, sin, position_ids, layout, *, rotary_dim=None, keeps_dtype=False) -> bool:
    if k is None:
        return False  # q alone (Mistral Large 3's `k=None`): the original rotates it
    if not keeps_dtype and torch.promote_types(q.dtype, cos.dtype) != q.dtype:
        return False  # eager `q * cos` would promote (bf16 q, fp32 tables): keep that output dtype
    try:
        rotary_op._validate(q, k, cos, sin, position_ids, layout=layout, rotary_dim=rotary_dim)
    except (ValueError, TypeError):
        return False
    return True


# ---------------------------------------------------------------------------- causal LM: head + loss

_PROBE_WIDTH = 8  # the probe head's input width: the tail's math does not depend on the hidden size
_PROBE_TOKENS = (2, 6)
# Probe logits of standard deviation ~17 (weights N(0, 6^2) on 8 inputs of unit scale): soft-capping at
# Gemma-2's 30 changes them by several percent, any logit scaling by its factor; rounding of the same fp32
# math differs by ~1e-6 relative, so _close's 1e-4 separates the two.
_PROBE_LOGIT_SCALE = 6.0


def _looks_like_causal_lm(module: torch.nn.Module) -> bool:
    """A transformers causal LM: an nn.Linear `lm_head`, PreTrainedModel's `loss_function` property (with its
    setter) and a forward that takes `labels`."""
    head = module._modules.get("lm_head")
    return isinstance(head, torch.nn.Linear) and not isinstance(head, FusedLMHead) and _has_settable_loss(module)


def _has_settable_loss(module: torch.nn.Module) -> bool:
    """PreTrainedModel's `loss_function` property (with its setter) and a forward that takes `labels`."""
    loss_property = getattr(type(module), "loss_function", None)
    if not isinstance(loss_property, property) or loss_property.fset is None:
        return False
    return forward_takes(module, "labels")


def _why_head_is_no_linear(module: torch.nn.Module) -> str | None:
    """Why a transformers causal LM's head + loss is left alone where its `lm_head` is a module of its own rather than
    an nn.Linear (BERT-style decoders: BertGenerationOnlyLMHead holding the Linear as `decoder`); None otherwise."""
    head = module._modules.get("lm_head")
    if head is None or isinstance(head, (torch.nn.Linear, FusedLMHead)) or not _has_settable_loss(module):
        return None
    kind = f"{type(head).__module__}.{type(head).__qualname__}"  # (peft's lora.Linear is called Linear too)
    return (f"LM head + loss candidate: lm_head is a {kind}, not an nn.Linear; the fused loss replaces a causal LM's "
            "nn.Linear head (its logits come from the module's own forward here)")


def _fuse_lm_head_and_loss(model, name, module, report, changes) -> None:
    head_name = f"{name}.lm_head" if name else "lm_head"
    why = _why_not_probeable(module.lm_head) or _why_not_a_plain_linear(module.lm_head)
    if why:
        report.skipped.append((head_name, f"LM head + loss candidate: {why}"))
        return
    softcap, scale = _logit_transform(module)
    if scale != 1.0 and module.lm_head.bias is not None:
        report.skipped.append((head_name, "LM head + loss candidate: its logits are scaled and its head has a bias "
                                          "(the fused loss scales the hidden states); left as is"))
        return
    why_not = _lm_loss_verdict(module, softcap, scale)
    if why_not:
        report.skipped.append((head_name, why_not))
        return
    head, original = module.lm_head, module.loss_function

    def apply():
        fused = FusedLMHead(head)
        _replace(model, head_name, head, fused)
        module.loss_function = CausalLMLinearCrossEntropy(fused, original, softcap, scale)
        module.register_forward_pre_hook(_capture_hidden_states, with_kwargs=True)
        module.register_forward_hook(_drop_stand_in_logits, always_call=True)

    changes.append(apply)
    report.replaced.append((head_name, "linear_cross_entropy: FusedLMHead + the loss over token chunks "
                                       "(calls with labels return logits=None)"))


def _why_not_a_plain_linear(head: torch.nn.Linear) -> str | None:
    """Why a head that is an nn.Linear may compute more than `hidden @ weight.T + bias`, or None. The probe runs
    a thin nn.Linear in the head's place, so a subclass's own forward or state would go unseen and be dropped by
    FusedLMHead: transformers 5.24's Dory multiplies its logits by a learned per-token `logit_scale`, whose
    product with a constant is 1 at initialisation (the losses agree) and which would never have been trained."""
    extra = []
    if type(head).forward is not torch.nn.Linear.forward:
        extra.append(f"its own forward ({type(head).__name__}.forward)")
    if "forward" in vars(head):  # put on the instance (accelerate's hooks do so)
        extra.append("a forward set on the instance")
    state = sorted(({name for name, _ in head.named_parameters()} | {name for name, _ in head.named_buffers()})
                   - {"weight", "bias"})
    if state:
        extra.append(f"{', '.join(state)} beside weight and bias")
    if not extra:
        return None
    return (f"the head is an nn.Linear with {' and '.join(extra)}, which the fused loss (hidden @ weight.T + bias) "
            "would drop; left as is")


def _logit_transform(module: torch.nn.Module) -> tuple[float | None, float]:
    """(soft-capping, scale) of the logits that a causal LM's config names, as transformers' forwards apply
    them: Gemma-2's `final_logit_softcapping`, Cohere's `logit_scale` and Falcon-H1's `lm_head_multiplier`
    (logits * s), Granite's `logits_scaling` (logits / s). Only candidates: the probe (`_lm_loss_verdict`) confirms
    that the forward applies them."""
    config = getattr(module, "config", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = 1.0
    if isinstance(getattr(config, "logit_scale", None), (int, float)):
        scale = float(config.logit_scale)
    elif isinstance(getattr(config, "lm_head_multiplier", None), (int, float)):
        scale = float(config.lm_head_multiplier)
    elif isinstance(getattr(config, "logits_scaling", None), (int, float)) and config.logits_scaling:
        scale = 1.0 / config.logits_scaling
    return softcap, scale


def forward_takes(module: torch.nn.Module, name: str) -> bool:
    """Whether the forward of `module`'s class takes an argument `name` (False where its signature cannot be read)."""
    try:
        return name in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


def forward_argument(module: torch.nn.Module, name: str, args: tuple, kwargs: dict):
    """The value of `name` in the call `module(*args, **kwargs)`, passed by keyword or by position
    (`model(ids, mask, None, None, None, labels)`); None where not given. Bound against the forward of the
    module's class: pipeline parallel puts its runner, `forward(*args, **kwargs)`, in the instance's place."""
    if kwargs.get(name) is not None or not args:
        return kwargs.get(name)
    try:
        return inspect.signature(type(module).forward).bind_partial(module, *args).arguments.get(name)
    except (TypeError, ValueError):  # the forward's own call fails the same way, with its own message
        return None


def _capture_hidden_states(module, args, kwargs):
    """Forward pre-hook of a fused causal LM: in a call with labels its head keeps the hidden states."""
    head = module._modules.get("lm_head")
    if isinstance(head, FusedLMHead):  # not a head put in its place since (resize_token_embeddings does)
        labelled = forward_argument(module, "labels", args, kwargs) is not None
        head.capturing, head.stood_in, head.hidden = labelled, False, None
    return None


def _drop_stand_in_logits(module, args, output):
    """Forward hook: the call is over; a call whose head stood in for the logits returns logits=None."""
    head = module._modules.get("lm_head")
    if not isinstance(head, FusedLMHead):
        return None
    stood_in, head.capturing, head.stood_in, head.hidden = head.stood_in, False, False, None
    if not stood_in:  # no labels, or a head that computed real logits (tensor parallel)
        return None
    if isinstance(output, dict) and "logits" in output:  # a ModelOutput: rebuilt without the stand-in
        return type(output)(**{key: value for key, value in output.items() if key != "logits"})
    return None


@contextlib.contextmanager
def labelled_call(model: torch.nn.Module, args: tuple, kwargs: dict):
    """What fuse's hooks do around a call of a fused causal LM, for code that runs its forward without the
    module's hooks (distcore's pipeline stages call the forward function on a stage's view of the model):
    arms the head for a call with labels and yields `finish(output)`, which returns the call's output as the
    model returns it (logits=None where the head stood in). A model without a fused head: `finish` returns
    the output unchanged."""
    head = model._modules.get("lm_head")
    if not isinstance(head, FusedLMHead):
        yield lambda output: output
        return
    _capture_hidden_states(model, args, kwargs)
    try:
        yield lambda output: _drop_stand_in_logits(model, args, output) or output
    finally:
        head.capturing, head.stood_in, head.hidden = False, False, None


def _lm_loss_verdict(module: torch.nn.Module, softcap, scale: float) -> str | None:
    """None when the tail of `module`'s forward (its head, any logit transform, its loss function) computes
    what CausalLMLinearCrossEntropy computes with `softcap` and `scale`, else why the head and loss are left
    alone.

    Probed on the model itself for one call each way, with two parts swapped for the call and put back:
    the decoder (`base_model_prefix`) by a stand-in that returns fixed hidden states of width 8, and the head
    by a thin fp32 head (vocabulary x 8, seeded): no decoder layer runs and no real weight is read, so a
    model of any size, or still on the meta device, is probed in a few milliseconds."""
    head, prefix = module.lm_head, getattr(module, "base_model_prefix", "")
    base = module._modules.get(prefix) if isinstance(prefix, str) else None
    if base is None and isinstance(module._modules.get("model"), torch.nn.Module):
        # transformers' causal LMs keep their decoder as `model`; a class shared with a multimodal model can
        # name another prefix (Llama4ForCausalLM: "language_model"). The probe below shows whether it is that.
        prefix, base = "model", module._modules["model"]
    if base is None:
        return f"LM head + loss candidate: no decoder child named by base_model_prefix ({prefix!r}) or `model`; left as is"
    try:
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
    except ImportError:  # a look-alike outside transformers
        return "LM head + loss candidate: transformers is not importable; left as is"

    class _DecoderOutput(BaseModelOutputWithPastAndCrossAttentions):
        """The stand-in decoder's output: the probe's hidden states; any other field a forward reads is None."""

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)
            return None

    generator = torch.Generator(device="cpu").manual_seed(2468)
    hidden = torch.randn((*_PROBE_TOKENS, _PROBE_WIDTH), generator=generator)
    labels = torch.randint(0, head.out_features, _PROBE_TOKENS, generator=generator)
    labels[0, :2] = -100  # ignored labels (padding), as collators write them
    thin = torch.nn.Linear(_PROBE_WIDTH, head.out_features, bias=head.bias is not None)
    with torch.no_grad():
        thin.weight.copy_(torch.randn(thin.weight.shape, generator=generator) * _PROBE_LOGIT_SCALE)
        if thin.bias is not None:
            thin.bias.copy_(torch.randn(thin.bias.shape, generator=generator))
    fused = FusedLMHead(thin)

    class _StandIn(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return _DecoderOutput(last_hidden_state=hidden)

        def __getattr__(self, name: str):
            try:
                return super().__getattr__(name)
            except AttributeError:
                if isinstance(base._modules.get(name), torch.nn.Module):  # OPT calls self.model.decoder(...)
                    return self
                raise

    # A mixture of experts' router load-balancing loss, which the forward adds from the decoder's router logits
    # (the head plays no part in it), is left out of the probe: the stand-in decoder has no router logits.
    no_router_loss = {"output_router_logits": False} if forward_takes(module, "output_router_logits") else {}
    saved_loss = vars(module).get("_loss_function", _UNSET)
    original = module.loss_function
    losses = {}
    try:
        stand_in = _StandIn()
        _copy_plain_attributes(base, stand_in)  # values the forward may read (Falcon-H1's lm_head_multiplier)
        module._modules[prefix] = stand_in
        for variant, lm_head in (("original", thin), ("fused", fused)):
            module._modules["lm_head"] = lm_head
            if variant == "fused":
                module.loss_function = CausalLMLinearCrossEntropy(fused, original, softcap, scale)
            for items in (None, 7.0):
                kwargs = {"labels": labels} if items is None else {"labels": labels, "num_items_in_batch": items}
                # The forward called as a function (the model's own hooks stay out): armed as they would.
                with torch.no_grad(), labelled_call(module, (), kwargs):
                    output = type(module).forward(module, input_ids=labels, **kwargs, **no_router_loss)
                losses[variant, items] = output["loss"] if isinstance(output, dict) else output[0]
    except Exception as error:  # noqa: BLE001 - reported in the FuseReport
        return f"LM head + loss candidate: its forward failed on a probe ({type(error).__name__}: {error}); left as is"
    finally:
        module._modules[prefix], module._modules["lm_head"] = base, head
        if saved_loss is _UNSET:
            vars(module).pop("_loss_function", None)
        else:
            module._loss_function = saved_loss
    for items in (None, 7.0):
        if not _close(losses["fused", items], losses["original", items].float()):
            logits = "lm_head(hidden)" if scale == 1.0 else f"{scale:g} * lm_head(hidden)"
            return ("LM head + loss candidate: the loss of its forward is not the cross-entropy of "
                    f"{f'softcap({logits})' if softcap else logits} over shifted labels "
                    f"(a probe gives {float(losses['original', items]):.6g}, the fused loss "
                    f"{float(losses['fused', items]):.6g}): another logit transform or loss; left as is")
    return None


_UNSET = object()
