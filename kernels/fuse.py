"""`fuse(model)`: swap the fused kernels into a Llama-style model written in plain PyTorch, in place.

Candidates are found by structure and confirmed by behaviour, never by class name alone:
- RMSNorm: a module whose only parameter is a 1-D `weight` and which has an eps attribute
  (`variance_epsilon`, `eps` or `epsilon`). A probe run on random input must match RMSNorm with that
  eps; it also tells the offset (`w` or `1 + w`) and which rounding the module uses (seed: to the
  weight's dtype; Hugging Face: to the input's dtype). Replaced by FusedRMSNorm around the same Parameter.
- SwiGLU MLP: a module with `gate_proj`, `up_proj`, `down_proj` (or `gate_up_proj`, `down_proj`)
  whose output on a probe equals `down(silu(gate(x)) * up(x))`. Replaced by FusedSwiGLUMLP around the
  same projection modules.
- Rotary: a module whose forward calls, by global name, a function named like `*rotary*`/`*rope*`
  that behaves like the seed's `apply_rotary_pos_emb(q, k, cos, sin, position_ids)` or Hugging Face's
  `apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)`. That instance's forward is
  rebound to a copy of itself whose global name points to the fused kernel (other instances and the
  defining module are untouched); calls the kernel cannot take fall back to the original function.
Parameters stay the same objects, so an optimizer built before `fuse` keeps working, and parameter
names are unchanged. Modules with hooks, on the meta device, or failing a probe are left alone, and
the report says why.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .ops import rotary as rotary_op
from .ops.rms_norm import FusedRMSNorm
from .ops.swiglu import FusedSwiGLUMLP
from .reference import rms_norm_reference, rotary_reference

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


def fuse(model: torch.nn.Module, *, rms_norm: bool = True, rotary: bool = True, swiglu: bool = True) -> FuseReport:
    """Replace RMSNorm modules, SwiGLU MLPs and rotary applications of `model` in place."""
    report = FuseReport()
    # Collect first: the module tree changes as we replace.
    for name, module in list(model.named_modules()):
        if isinstance(module, (FusedRMSNorm, FusedSwiGLUMLP)):
            continue
        if not name and (_looks_like_rms_norm(module) or _looks_like_swiglu_mlp(module)):
            report.skipped.append((name, "the model itself is the candidate; fuse the model that contains it"))
        elif rms_norm and _looks_like_rms_norm(module):
            _fuse_rms_norm(model, name, module, report)
        elif swiglu and _looks_like_swiglu_mlp(module):
            _fuse_swiglu_mlp(model, name, module, report)
        if rotary:
            _fuse_rotary(name, module, report)
    return report


# ------------------------------------------------------------------------------------------ helpers


def _why_not_probeable(module: torch.nn.Module) -> str | None:
    tensors = list(module.parameters())
    if any(t.device.type == "meta" for t in tensors):
        return "parameters are on the meta device; call fuse after materialising the model"
    if module._forward_hooks or module._forward_pre_hooks:
        return "module has forward hooks, which a replacement would drop"
    return None


def _replace(model: torch.nn.Module, name: str, old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Put `new` where `old` was, keeping old's plain attributes (sizes, eps) for code that reads them."""
    for attr, value in vars(old).items():
        if not attr.startswith("_") and attr not in vars(new) and isinstance(value, (int, float, str, bool)):
            setattr(new, attr, value)
    # Not new.train(...): that recurses into the children, and a SwiGLU replacement's children are the
    # original projections, which keep their own modes (e.g. a frozen adapter in eval mode).
    new.training = old.training
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent._modules[child] = new


def _probe_input(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """Random rows with a clear non-zero mean and different scales: a LayerNorm (which subtracts
    the mean) or a scale-dependent op cannot pass for an RMSNorm or a SwiGLU on such input."""
    generator = torch.Generator(device="cpu").manual_seed(1234)
    rows = torch.randn(shape, generator=generator)
    scale = torch.rand((*shape[:-1], 1), generator=generator) * 3 + 0.5
    return (rows * scale + 2.0).to(device=like.device, dtype=dtype or like.dtype)


def _probe_copy(module: torch.nn.Module) -> torch.nn.Module:
    """An fp32 copy of `module` with fresh random parameters.

    Probing the live module could be fooled by its current values (a zero-initialised down
    projection makes every activation look alike) and by half-precision rounding.
    """
    probe = copy.deepcopy(module).float()
    generator = torch.Generator(device="cpu").manual_seed(4321)
    with torch.no_grad():
        for param in probe.parameters():
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            fresh = torch.randn(param.shape, generator=generator) / fan_in**0.5 + (0.0 if param.dim() > 1 else 0.5)
            param.copy_(fresh)
    return probe


def _run(module: torch.nn.Module, x: torch.Tensor):
    """module(x) without autograd, or the exception it raised (a probe must never crash fuse)."""
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


def _fuse_rms_norm(model, name, module, report) -> None:
    why = _why_not_probeable(module)
    if why:
        report.skipped.append((name, f"RMSNorm candidate: {why}"))
        return
    eps = next(getattr(module, a) for a in _EPS_ATTRIBUTES if isinstance(getattr(module, a, None), float))
    weight = module.weight
    cast_to = _rms_norm_cast_convention(module)
    probe = _probe_copy(module)
    x = _probe_input((4, weight.shape[0]), weight, dtype=torch.float32)
    out, error = _run(probe, x)
    if error:
        report.skipped.append((name, f"RMSNorm candidate: its forward failed on a probe ({error}); left as is"))
        return
    offset = None
    if cast_to is not None:
        offset = next(
            (o for o in (0.0, 1.0) if _close(out, rms_norm_reference(x, probe.weight, eps, offset=o, cast_to=cast_to))),
            None,
        )
    if offset is None:
        report.skipped.append(
            (name, f"has a 1-D weight and eps={eps} but its output is not RMSNorm(x) * (w or 1 + w); left as is")
        )
        return
    _replace(model, name, module, FusedRMSNorm.from_parameter(weight, eps, offset=offset, cast_to=cast_to))
    report.replaced.append((name, f"rms_norm: FusedRMSNorm(eps={eps}, offset={offset}, cast_to={cast_to!r})"))


def _rms_norm_cast_convention(module: torch.nn.Module) -> str | None:
    """Which dtype the module rounds to, told apart on a bf16-weight copy fed fp32 input.

    The seed rounds to a half-precision weight's dtype (bf16 out); Hugging Face rounds to the input's
    dtype and then multiplies by the weight (fp32 out).
    """
    probe_module = copy.deepcopy(module).to(torch.bfloat16)
    x = _probe_input((2, module.weight.shape[0]), module.weight, dtype=torch.float32)
    out, error = _run(probe_module, x)
    if error or not torch.is_tensor(out):  # a module that rejects mixed dtypes follows neither
        return None
    return {torch.bfloat16: "weight", torch.float32: "input"}.get(out.dtype)


# --------------------------------------------------------------------------------------------- SwiGLU


def _looks_like_swiglu_mlp(module: torch.nn.Module) -> bool:
    children = module._modules
    return "down_proj" in children and ("gate_up_proj" in children or {"gate_proj", "up_proj"} <= set(children))


def _fuse_swiglu_mlp(model, name, module, report) -> None:
    why = _why_not_probeable(module)
    if why:
        report.skipped.append((name, f"SwiGLU MLP candidate: {why}"))
        return
    children = module._modules
    weight = next(module.parameters())
    in_features = getattr(children.get("gate_up_proj") or children["gate_proj"], "in_features", None)
    if in_features is None:
        report.skipped.append((name, "SwiGLU MLP candidate: projections without in_features; left as is"))
        return
    probe = _probe_copy(module)
    x = _probe_input((2, 3, in_features), weight, dtype=torch.float32)
    out, error = _run(probe, x)
    if error:
        report.skipped.append((name, f"SwiGLU MLP candidate: its forward failed on a probe ({error}); left as is"))
        return
    with torch.no_grad():
        if "gate_up_proj" in children:
            gate, up = probe.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = probe.gate_proj(x), probe.up_proj(x)
        expected = probe.down_proj(F.silu(gate) * up)
    if not _close(out, expected):
        report.skipped.append(
            (name, "has gate/up/down projections but its output is not down(silu(gate(x)) * up(x)); left as is")
        )
        return
    if "gate_up_proj" in children:
        fused = FusedSwiGLUMLP.from_linears(gate_up_proj=children["gate_up_proj"], down_proj=children["down_proj"])
    else:
        fused = FusedSwiGLUMLP.from_linears(
            gate_proj=children["gate_proj"], up_proj=children["up_proj"], down_proj=children["down_proj"]
        )
    _replace(model, name, module, fused)
    report.replaced.append((name, "swiglu: FusedSwiGLUMLP"))


# --------------------------------------------------------------------------------------------- Rotary

# How each known calling convention maps its arguments to the fused op.
#   seed: apply_rotary_pos_emb(q, k, cos, sin, position_ids): bshd, cos [1, T, 1, D], positions gathered.
#   hf:   apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1): cos [B, S, D] already
#         per position (position_ids unused); unsqueeze_dim=1 means bhsd, 2 means bshd.
_CONVENTIONS = ("seed", "hf")


def _rotary_function_names(module: torch.nn.Module) -> list[str]:
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or "forward" in vars(module):  # already fused, or its forward was replaced by someone
        return []
    names = []
    for global_name in code.co_names:
        value = forward.__globals__.get(global_name)
        if isinstance(value, types.FunctionType) and any(h in global_name.lower() for h in _ROTARY_NAME_HINTS):
            names.append(global_name)
    return names


def _fuse_rotary(name: str, module: torch.nn.Module, report: FuseReport) -> None:
    function_names = _rotary_function_names(module)
    if not function_names:
        return
    forward = type(module).forward
    new_globals = dict(forward.__globals__)
    fused_names = []
    for function_name in function_names:
        original = forward.__globals__[function_name]
        convention = _rotary_convention(original)
        if convention is None:
            report.skipped.append(
                (name, f"calls {function_name}, which does not behave like the seed's or Hugging Face's rotary")
            )
            continue
        new_globals[function_name] = _rotary_adapter(original, convention)
        fused_names.append(f"{function_name} ({convention} convention)")
    if not fused_names:
        return
    rebound = types.FunctionType(forward.__code__, new_globals, forward.__name__, forward.__defaults__, forward.__closure__)
    rebound.__kwdefaults__ = forward.__kwdefaults__
    module.forward = types.MethodType(rebound, module)
    report.replaced.append((name, "rotary: " + ", ".join(fused_names)))


def _rotary_convention(function) -> str | None:
    """The calling convention `function` follows, found by running it on a probe and comparing."""
    batch, seq_len, heads, kv_heads, head_dim = 2, 5, 4, 2, 8
    generator = torch.Generator().manual_seed(99)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    positions = torch.stack([torch.arange(seq_len).flip(0), torch.arange(seq_len)])
    q = torch.randn(batch, seq_len, heads, head_dim, generator=generator)
    k = torch.randn(batch, seq_len, kv_heads, head_dim, generator=generator)
    expected = rotary_reference(q, k, cos, sin, positions)

    def agrees(out, want):
        return isinstance(out, tuple) and len(out) == 2 and all(_close(a, b) for a, b in zip(out, want))

    try:
        with torch.no_grad():
            if agrees(function(q, k, cos[None, :, None], sin[None, :, None], positions), expected):
                return "seed"
            per_position = cos[positions], sin[positions]  # [B, S, D], as HF's rotary embedding returns
            out = function(q.transpose(1, 2), k.transpose(1, 2), *per_position)
            if isinstance(out, tuple) and agrees(tuple(t.transpose(1, 2) for t in out), expected):
                return "hf"
    except Exception:  # a function of another signature or semantics: not one we can replace
        return None
    return None


def _rotary_adapter(original, convention: str):
    """A drop-in for `original` that runs the fused kernel and falls back to `original` when it can't."""

    if convention == "seed":

        def fused_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, *args, **kwargs):
            if not args and not kwargs and _kernel_accepts(q, k, cos, sin, position_ids, "bshd"):
                return rotary_op.apply_rotary_pos_emb(q, k, cos, sin, position_ids, layout="bshd")
            return original(q, k, cos, sin, position_ids, *args, **kwargs)

    else:

        def fused_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, *args, **kwargs):
            layout = {1: "bhsd", 2: "bshd"}.get(unsqueeze_dim)
            # HF's tables are already per position; its position_ids argument is unused.
            if layout and not args and not kwargs and _kernel_accepts(q, k, cos, sin, None, layout):
                return rotary_op.apply_rotary_pos_emb(q, k, cos, sin, layout=layout)
            return original(q, k, cos, sin, position_ids, unsqueeze_dim, *args, **kwargs)

    fused_apply_rotary_pos_emb.__wrapped__ = original
    return fused_apply_rotary_pos_emb


def _kernel_accepts(q, k, cos, sin, position_ids, layout) -> bool:
    if torch.promote_types(q.dtype, cos.dtype) != q.dtype:
        return False  # eager `q * cos` would promote (bf16 q, fp32 tables): keep that output dtype
    try:
        rotary_op._validate(q, k, cos, sin, position_ids, layout=layout, rotary_dim=None)
    except (ValueError, TypeError):
        return False
    return True
