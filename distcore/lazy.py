"""LazyGuard: build a model on the meta device; materialise it later, whole or shard by shard.

Paddle's pattern, on torch:

    with distcore.LazyGuard():
        model = MyModel(config)          # parameters and buffers on "meta": no memory used
    for p in model.parameters():
        p.initialize()                   # one device: each tensor materialised in place
    # or: model, opt = distcore.parallelize(model, opt, mesh, config)
    #     every rank materialises only its own shards (tensor parallel, FSDP2), one parameter at a time

How: inside the guard, factories create meta tensors (torch's meta device context) and a
TorchFunctionMode records every op that produces or mutates a meta tensor: factories
(torch.empty/zeros/arange/randn ...), in-place initialisers (nn.init.*, reset_parameters: uniform_,
normal_, fill_, zero_, copy_, setitem ...) and out-of-place computations of buffers (a rotary
inv_freq, causal masks). Each tensor's value is the replay of its recorded ops on a real device.
Tensors are told apart by their storage, so aliases (`.data`, `detach()`, nn.Parameter(t)) share one
record, and a view (a slice, a transpose) reads its base through the same strides as on meta; an
in-place write into a view updates its base, as eagerly.

Seeding: each recorded op replays under the device's default generator seeded from (the guard's
seed, the index of the tensor it produces or mutates within the guard, the op's step on that tensor),
and the generator's state is restored afterwards. So a tensor's value does not depend on which other
tensors were materialised, in which order, on which rank or in which layout: single-device
materialisation and every distributed layout agree exactly (on the same device type: CPU and CUDA
generators differ). The values differ from an eager construction under the same torch.manual_seed
(eager draws all tensors from one stream), but follow the same initialisers (bounds, std, constants).
The guard's seed is one draw from the global CPU generator at entry (so re-seeding with
torch.manual_seed reproduces a model, and two guards in a row build different ones), or `seed=`.

Refused, with an error naming the tensor or op and the fix: reading values (item(), bool(), Python
control flow on a lazy tensor), an explicit `generator=`, meta tensors built outside the guard,
a tensor modified in place after the guard exited, ops without a meta implementation.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import hashlib
import itertools
import logging
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, distribute_tensor
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_flatten, tree_unflatten

log = logging.getLogger(__name__)

_RECIPE = "_tridist_lazy"  # attribute of a registered tensor: its _Recipe
_MODULE_RECIPES = "_tridist_lazy_recipes"  # attribute of a module: its _Records
# Ops that hand a tensor's value to Python: there is no value on meta (data-dependent control flow).
_VALUE_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__complex__", "__array__"}
_SEED_BITS = 63  # torch.Generator.manual_seed takes a non-negative 64-bit integer
_GUARD_SERIALS = itertools.count()  # the n-th LazyGuard of this process (the same on every SPMD rank)
_ACTIVE: list["LazyGuard"] = []


class LazyInitError(RuntimeError):
    """A pattern LazyGuard cannot record or replay faithfully; the message says how to fix it."""


# ------------------------------------------------------------------------------------ the record


@dataclass(eq=False)
class _Node:
    """One recorded op: `func(*args, **kwargs)` with tensors replaced by _Ref / _Const leaves.

    `output` picks the produced tensor among the flattened outputs; `mutated` is the leaf position of
    the tensor an in-place op writes (its value is then that tensor's base after the op).
    """

    func: Callable
    leaves: list
    spec: Any
    seed: tuple
    output: int | None = None
    mutated: int | None = None
    readers: int = 0  # how many later nodes read this one: more than one means replay must not mutate it

    @property
    def name(self) -> str:
        return resolve_name(self.func) or getattr(self.func, "__name__", repr(self.func))


@dataclass(frozen=True)
class _Ref:
    """A recorded tensor as an op read it: its base's node at that moment, seen through `view`
    ((size, stride, offset)) when it was a partial view, which needs the base laid out as on meta."""

    node: _Node
    view: tuple | None = None
    base_layout: tuple | None = None  # (stride, storage offset) of the base on meta


@dataclass(frozen=True)
class _Const:
    """A real tensor an op read (made outside the guard): used as is, unless changed since."""

    tensor: torch.Tensor
    version: int


@dataclass(eq=False)
class _Var:
    """One storage created inside a guard: the node that computes its current value, and its layout."""

    index: int  # creation order within the guard: part of every seed of its ops
    node: _Node | None
    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    steps: int = 0  # in-place ops recorded so far

    def ref(self, tensor: torch.Tensor, node: _Node | None = None) -> _Ref:
        """How `tensor` (an alias of this storage) reads it: the whole base, or a strided view of it."""
        if tensor.dtype != self.dtype:
            raise LazyInitError(
                f"LazyGuard: a {tensor.dtype} view of a {self.dtype} tensor (view(dtype)) cannot be replayed; "
                "convert with .to(dtype) instead"
            )
        geometry = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        node = node or self.node
        if geometry == (self.shape, self.stride, self.offset):
            return _Ref(node)
        return _Ref(node, geometry, (self.stride, self.offset))


@dataclass(eq=False)
class _Recipe:
    """How to compute a registered parameter or buffer: its variable's final value, through its view."""

    var: _Var
    view: tuple | None
    base_layout: tuple | None
    guard: tuple  # (serial, seed) of the LazyGuard that built it
    # The tensor's version counter when the guard exited (in-place changes after it would be lost);
    # None for a deep copy, whose fresh tensor has a counter of its own.
    version: int | None

    def __deepcopy__(self, memo) -> "_Recipe":
        """A deep copy of a lazy model replays the same values: share the record, not copy it."""
        return dataclasses.replace(self, version=None)

    def check(self, tensor: torch.Tensor, name: str) -> None:
        shape = self.view[0] if self.view else self.var.shape
        if tuple(tensor.shape) != shape:
            raise LazyInitError(
                f"LazyGuard: {name} has shape {tuple(tensor.shape)} but was built with shape {shape}; "
                "reshaping a lazily built tensor is not replayed: do it inside the LazyGuard"
            )
        if self.version is not None and not isinstance(tensor, DTensor) and tensor._version != self.version:
            raise LazyInitError(
                f"LazyGuard: {name} was modified in place after its LazyGuard exited; that change cannot be "
                "replayed. Do it inside the `with LazyGuard():` block, or after initialize()/materialize()"
            )

    def value(self, device: torch.device) -> torch.Tensor:
        """The tensor's full value on `device`, replayed from its record."""
        return _Replay(device).read(_Ref(self.var.node, self.view, self.base_layout))


class _Records(dict):
    """A module's {tensor name: (tensor, recipe)}, for the tensors that lose their own recipe
    attribute: DTensor parameters that tensor parallel / FSDP2 put in their place (found by name), and
    deep copies of the model (nn.Parameter's deepcopy drops attributes; found through the copy)."""

    def find(self, name: str, tensor: torch.Tensor) -> _Recipe | None:
        recorded, recipe = self.get(name, (None, None))
        if recorded is tensor or (recipe is not None and isinstance(tensor, DTensor)):
            return recipe
        return None  # another tensor took the recorded one's place: its record does not apply

    def __deepcopy__(self, memo) -> "_Records":
        # A module's parameters are copied before this attribute (set later): memo has their copies.
        return _Records({name: (memo.get(id(t), t), copy.deepcopy(r, memo)) for name, (t, r) in self.items()})


# ------------------------------------------------------------------------------------ the replay


class _Replay:
    """Evaluates recorded nodes on a real device, for one tensor at a time (bounded memory).

    Nodes read by several others are kept for this evaluation only; an in-place op mutates its
    input only when it is that input's sole reader, and a copy otherwise.
    """

    def __init__(self, device: torch.device):
        if _ACTIVE:
            raise LazyInitError("LazyGuard: materialise after the `with LazyGuard():` block, not inside it")
        if device.type == "meta":
            raise LazyInitError("LazyGuard: materialise on a real device (e.g. 'cpu' or 'cuda'), not 'meta'")
        self.device = device
        self.memo: dict[_Node, torch.Tensor] = {}

    def read(self, ref: _Ref) -> torch.Tensor:
        with torch.no_grad(), torch.device(self.device):
            return self._view(self.value(ref.node), ref)

    def value(self, node: _Node) -> torch.Tensor:
        if node in self.memo:
            return self.memo[node]
        base, leaves = None, []
        for position, leaf in enumerate(node.leaves):
            if position == node.mutated:
                base = self.value(leaf.node)
                base = base.clone() if leaf.node.readers > 1 else base  # others read it unmutated
                leaves.append(self._view(base, leaf))
            else:
                leaves.append(self._leaf(leaf))
        args, kwargs = tree_unflatten(leaves, node.spec)
        with _seeded(self.device, node.seed):
            out = node.func(*args, **kwargs)
        result = base if node.mutated is not None else tree_flatten(out)[0][node.output]
        if node.readers > 1:
            self.memo[node] = result
        return result

    def _leaf(self, leaf):
        if isinstance(leaf, _Ref):
            return self._view(self.value(leaf.node), leaf)
        if isinstance(leaf, _Const):
            if leaf.tensor._version != leaf.version:
                raise LazyInitError(
                    "LazyGuard: a tensor created outside the guard and read while building the model was modified "
                    "in place afterwards; the model's values would change. Pass a copy (.clone()) into the guard"
                )
            return leaf.tensor.to(self.device)
        if isinstance(leaf, torch.device) and leaf.type == "meta":
            return self.device
        return leaf

    @staticmethod
    def _view(base: torch.Tensor, ref: _Ref) -> torch.Tensor:
        if ref.view is None:
            return base
        if (tuple(base.stride()), base.storage_offset()) != ref.base_layout:
            raise LazyInitError(
                f"LazyGuard: a view of a tensor of shape {tuple(base.shape)} relies on its meta layout "
                f"(strides, offset) {ref.base_layout}, but the replayed tensor has "
                f"{(tuple(base.stride()), base.storage_offset())}; take the view of a .contiguous() tensor"
            )
        return base.as_strided(*ref.view)


@contextlib.contextmanager
def _seeded(device: torch.device, key: tuple):
    """Run with `device`'s default generator seeded from `key`, restoring its state afterwards, so
    that random ops (listed or not) draw from a stream that belongs to this op alone."""
    generator = _default_generator(device)
    state = generator.get_state()
    # A hash rather than arithmetic on the key: nearby keys must not give correlated streams.
    digest = hashlib.sha256(repr(key).encode()).digest()
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> (64 - _SEED_BITS))
    try:
        yield
    finally:
        generator.set_state(state)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    backend = getattr(torch, device.type)  # torch.cuda, torch.xpu, ...
    index = device.index if device.index is not None else backend.current_device()
    return backend.default_generators[index]


# ------------------------------------------------------------------------------------ the record


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class _Recorder(TorchFunctionMode):
    """Records each op that creates or mutates a meta tensor; everything else runs unrecorded."""

    def __init__(self, guard: "LazyGuard"):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        metas = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_meta]
        if metas and getattr(func, "__name__", "") in _VALUE_READS:
            raise LazyInitError(
                f"LazyGuard: {resolve_name(func) or func.__name__} reads the value of a tensor of shape "
                f"{tuple(metas[0][1].shape)}, but values do not exist until materialisation (data-dependent "
                "Python control flow). Compute it from Python numbers, or build this module outside LazyGuard"
            )
        before = [(i, t, t._version, *self.guard.var_and_node(t)) for i, t in metas]
        try:
            out = func(*args, **kwargs)
        except Exception as error:
            error.add_note(f"(while LazyGuard ran {resolve_name(func) or func} on the meta device)")
            raise
        mutated = [entry for entry in before if entry[1]._version != entry[2]]
        outputs = tree_flatten(out)[0]
        fresh = [j for j, o in enumerate(outputs) if isinstance(o, torch.Tensor) and o.is_meta and self.guard.var_of(o) is None]
        if mutated or fresh:
            self._record(func, leaves, spec, before, _written(mutated, leaves, kwargs), [(j, outputs[j]) for j in fresh])
        return out

    def _record(self, func, leaves, spec, before, mutated, fresh) -> None:
        name = resolve_name(func) or repr(func)
        if any(isinstance(leaf, torch.Generator) for leaf in leaves):
            raise LazyInitError(
                f"LazyGuard: {name} got an explicit generator=; LazyGuard seeds every tensor itself so that its "
                "value does not depend on materialisation order. Drop the generator (seed with LazyGuard(seed=...))"
            )
        if mutated and fresh:
            raise LazyInitError(f"LazyGuard: {name} both writes a lazily built tensor and creates one; split it in two ops")
        recorded = list(leaves)
        for position, tensor, _, var, node in before:
            if var is None:
                raise LazyInitError(
                    f"LazyGuard: {name} reads a meta tensor of shape {tuple(tensor.shape)} that was not built inside "
                    "this LazyGuard, so its values are unknown; create it inside the `with LazyGuard():` block"
                )
            recorded[position] = var.ref(tensor, node)
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
                recorded[position] = _Const(leaf, leaf._version)
        for leaf in recorded:
            if isinstance(leaf, _Ref):
                leaf.node.readers += 1
        guard = self.guard
        if mutated:
            position, tensor, _, var, _ = mutated
            var.steps += 1
            var.node = _Node(func, recorded, spec, (guard.seed, var.index, var.steps), mutated=position)
            guard.refresh_version(tensor)
            return
        # Outputs of one op share its seed, so replaying it once per output gives consistent outputs.
        seed = (guard.seed, guard.next_index, 0)
        for output, tensor in fresh:
            guard.new_var(tensor, _Node(func, recorded, spec, seed, output=output))


def _written(mutated: list, leaves: list, kwargs: dict):
    """The (position, tensor, version, var, node) entry an in-place op wrote, or None.

    Views share their base's version counter, so every alias among the inputs looks written
    (`x.add_(x)`, `t[0] = t[1]`): the written one is `out=` if given, else `self` (the first leaf).
    The other aliases are read as they were before the op, which is what elementwise ops see.
    """
    if not mutated:
        return None
    if len({id(entry[3]) for entry in mutated}) > 1:
        raise LazyInitError("LazyGuard: an op writes several lazily built tensors at once; split it into one op per tensor")
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        position = max(i for i, leaf in enumerate(leaves) if leaf is out)  # kwargs flatten after args
        return next(entry for entry in mutated if entry[0] == position)
    return min(mutated, key=lambda entry: entry[0])


# ------------------------------------------------------------------------------------ the guard


class LazyGuard:
    """`with LazyGuard(): model = Model()`: parameters and buffers on meta, their initialisation
    recorded; `p.initialize()`, `materialize(model)` or `parallelize(...)` then make them real.

    seed: the base of every tensor's seed; default one draw from the global CPU generator, so that
    `torch.manual_seed(s)` before the guard reproduces the model (seed every rank alike).
    """

    def __init__(self, seed: int | None = None):
        self._seed_arg = seed

    def __enter__(self) -> "LazyGuard":
        if _ACTIVE:
            raise LazyInitError("LazyGuard: already inside a LazyGuard; nest the model construction in one guard")
        self.seed = self._seed_arg if self._seed_arg is not None else int(
            torch.randint(0, 2**_SEED_BITS - 1, (), generator=torch.default_generator, device="cpu")
        )
        self.serial = next(_GUARD_SERIALS)
        self.next_index = 0
        self._vars: dict[int, tuple[_Var, torch.Tensor]] = {}  # storage -> (var, its first tensor, kept alive)
        self._registered: dict[tuple[int, str], tuple[weakref.ref, str]] = {}
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(torch.device("meta"))
        self._stack.enter_context(_Recorder(self))
        for register in (
            torch.nn.modules.module.register_module_parameter_registration_hook,
            torch.nn.modules.module.register_module_buffer_registration_hook,
        ):
            self._stack.callback(register(self._on_register).remove)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        _ACTIVE.pop()
        self._stack.close()
        try:
            if exc_info[0] is None:
                self._attach_recipes()
        finally:
            self._vars.clear()  # releases the meta tensors kept to pin storages

    # --- bookkeeping used by the recorder

    def new_var(self, tensor: torch.Tensor, node: _Node) -> None:
        var = _Var(self.next_index, node, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype)
        self.next_index += 1
        # The tensor is kept so its storage (our key) cannot be freed and its address reused.
        self._vars[_storage(tensor)] = (var, tensor)

    def var_of(self, tensor: torch.Tensor) -> _Var | None:
        entry = self._vars.get(_storage(tensor))
        if entry is not None:
            return entry[0]
        recipe = getattr(tensor, _RECIPE, None)  # a registered tensor of an earlier guard
        return recipe.var if recipe is not None and recipe.view is None else None

    def var_and_node(self, tensor: torch.Tensor) -> tuple[_Var | None, _Node | None]:
        var = self.var_of(tensor)
        return var, (var.node if var is not None else None)

    @staticmethod
    def refresh_version(tensor: torch.Tensor) -> None:
        """A registered tensor of an earlier guard, changed in this one: the change is recorded, so
        its version counter moves on legitimately."""
        recipe = getattr(tensor, _RECIPE, None)
        if recipe is not None:
            recipe.version = tensor._version

    def _on_register(self, module: torch.nn.Module, name: str, tensor) -> None:
        self._registered[(id(module), name)] = (weakref.ref(module), name)

    def _attach_recipes(self) -> None:
        """Give every meta parameter and buffer registered in the guard its recipe (on the tensor, for
        initialize(), and on its module by name, for the DTensors that parallelize puts in its place)."""
        for module_ref, name in self._registered.values():
            module = module_ref()
            tensor = None if module is None else module._parameters.get(name, module._buffers.get(name))
            if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
                continue
            entry = self._vars.get(_storage(tensor))
            if entry is None:
                continue  # built outside the guard: materialize() names it
            ref = entry[0].ref(tensor)
            recipe = _Recipe(entry[0], ref.view, ref.base_layout, (self.serial, self.seed), tensor._version)
            setattr(tensor, _RECIPE, recipe)
            tensor.initialize = types.MethodType(initialize, tensor)
            module.__dict__.setdefault(_MODULE_RECIPES, _Records())[name] = (tensor, recipe)


# ------------------------------------------------------------------------------------ materialisation


def initialize(tensor: torch.Tensor, device=None) -> torch.Tensor:
    """Paddle's `param.initialize()`: materialise one LazyGuard tensor in place on `device` (default:
    torch's default device). The Parameter object stays the same, so optimizers built on it keep it."""
    if not tensor.is_meta:
        return tensor  # already materialised
    if isinstance(tensor, DTensor):
        raise LazyInitError("LazyGuard: materialise distributed parameters with distcore.lazy.materialize(model)")
    recipe = getattr(tensor, _RECIPE, None)
    if recipe is None:
        raise LazyInitError(f"LazyGuard: this meta tensor of shape {tuple(tensor.shape)} was not built under LazyGuard")
    recipe.check(tensor, f"tensor of shape {tuple(tensor.shape)}")
    device = torch.device(device) if device is not None else torch.get_default_device()
    real = torch.empty_like(tensor, device=device)
    with torch.no_grad():
        real.copy_(recipe.value(device))
    _install(tensor, real, f"the tensor of shape {tuple(tensor.shape)}")
    return tensor


def materialize(module: torch.nn.Module, device=None, *, strict: bool = True) -> torch.nn.Module:
    """Materialise every LazyGuard tensor still on meta in `module`'s tree, on `device` (default:
    torch's default device); a DTensor gets only this rank's shard (tensor parallel, FSDP2).

    One tensor at a time: the peak is one full tensor on top of the local shards. Only modules in the
    tree are visited (a pipeline stage's stand-ins for other stages hold nothing). With DTensors this is
    collective (it checks that every rank seeded its guards alike). strict=False leaves meta tensors that
    were not built under LazyGuard as they are, with a warning, instead of raising.
    """
    device = torch.device(device) if device is not None else torch.get_default_device()
    plan, unknown = _plan(module)
    if plan:
        _refuse_skipped_transformers_init(module)
    if unknown:
        message = (
            f"LazyGuard: {unknown[:5]}{' ...' if len(unknown) > 5 else ''} are on the meta device but were not built "
            "under LazyGuard, so their values are unknown; build the model inside `with distcore.LazyGuard():`, "
            "or give them values yourself (to_empty + init, or load_state_dict(..., assign=True))"
        )
        if strict:
            raise LazyInitError(message)
        log.warning("%s; left on meta", message)
    if any(isinstance(tensor, DTensor) for _, _, tensor, _, _ in plan):
        _check_seeds_agree(plan)
    with torch.no_grad():
        for owner, name, tensor, recipe, qualified in plan:
            _install(tensor, _local_value(tensor, recipe.value(device), device), qualified)
            getattr(owner, _MODULE_RECIPES, {}).pop(name, None)
    return module


def _refuse_skipped_transformers_init(module: torch.nn.Module) -> None:
    """transformers runs a model's weight initialisation (`_init_weights`: its initializer_range, its mixers' decays,
    ...) from its constructor only where the default device is not meta, and inside LazyGuard it is meta: the model
    would materialise with whatever its modules' own constructors recorded (torch's defaults, and uninitialised
    memory where a parameter is `torch.empty` until `_init_weights`: Falcon-H1's Mamba D, A_log, dt_bias). A
    transformers model (`initialize_weights` and `_init_weights`) never initialised (no `_is_hf_initialized`, which
    transformers sets) is refused, naming the fix: the same call inside the guard, which LazyGuard then records."""
    for name, owner in module.named_modules():
        if (callable(getattr(owner, "initialize_weights", None)) and callable(getattr(owner, "_init_weights", None))
                and hasattr(owner, "config") and not getattr(owner, "_is_hf_initialized", False)):
            raise LazyInitError(
                f"LazyGuard: the transformers model {type(owner).__name__}{f' ({name})' if name else ''} was built on the meta "
                "device, where transformers skips its weight initialisation (_init_weights): materialised, it would "
                "hold torch's default initialisation and, where its code leaves a parameter to _init_weights, "
                "uninitialised memory. Call model.initialize_weights() inside the `with LazyGuard():` block, after "
                "building it")


def _plan(module: torch.nn.Module):
    """(owner, name, tensor, recipe, qualified name) for each distinct meta tensor of the tree, and the names of
    meta tensors without a recipe."""
    plan, unknown, seen = [], [], set()
    for prefix, owner in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(owner, kind).items():
                if tensor is None or id(tensor) in seen or not tensor.is_meta:
                    continue
                seen.add(id(tensor))
                qualified = f"{prefix}.{name}" if prefix else name
                recipe = getattr(tensor, _RECIPE, None) or getattr(owner, _MODULE_RECIPES, _Records()).find(name, tensor)
                if recipe is None:
                    unknown.append(qualified)
                    continue
                recipe.check(tensor, qualified)
                plan.append((owner, name, tensor, recipe, qualified))
    return plan, unknown


def _local_value(tensor: torch.Tensor, full: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor`'s storage on `device` holding `full`'s values: for a DTensor, only this rank's shard.

    distribute_tensor with src_data_rank=None slices locally without communicating, placement by
    placement (Shard, the _StridedShard FSDP2 uses over tensor parallel, Replicate; uneven shards
    as torch.chunk), exactly as DTensor lays out its shards. FSDP2 all-gathers from a padded copy of
    the local tensor, which it (re)builds from the parameter's local tensor at its lazy init before the
    first forward (as after torchtitan's to_empty): the unpadded local tensor is what we fill.
    """
    if not isinstance(tensor, DTensor):
        return torch.empty_like(tensor, device=device).copy_(full)
    if any(isinstance(p, Partial) for p in tensor.placements):
        raise LazyInitError(
            f"LazyGuard: cannot materialise a Partial DTensor {tensor.placements}; parameters are Shard or Replicate"
        )
    local = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
    real = torch.empty_like(tensor, device=device)  # a DTensor with this rank's local shape
    real.to_local().copy_(local)
    return real


def _install(tensor: torch.Tensor, real: torch.Tensor, name: str) -> None:
    """Put `real` in place of meta `tensor`, keeping the Python object (optimizers, tied weights and
    FSDP2 hold it) and its attributes other than the recipe. A meta tensor cannot take a real one
    through `.data =` (incompatible tensor types), so the two are swapped."""
    _release_weak_references(tensor, name)
    attributes = {k: v for k, v in tensor.__dict__.items() if k != _RECIPE}
    if isinstance(tensor, torch.nn.Parameter):
        real = torch.nn.Parameter(real, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, real)
    tensor.__dict__.update(attributes)


def _release_weak_references(tensor: torch.Tensor, name: str) -> None:
    """torch.utils.swap_tensors refuses a tensor that a weak reference points to. torch leaves such references in
    garbage cycles: a FakeTensorMode that saw the meta parameters (the pipeline's probe forward runs the model on
    fake tensors before parallelize materialises it) holds one to each until the collector frees the mode, which
    depends on when the collector last ran (a young collection during the probe promotes the mode to an older
    generation, collected far more rarely). One full collection frees every dead one; a weak reference that a
    live object holds is an error naming the tensor."""
    if not weakref.getweakrefs(tensor):
        return
    gc.collect()  # once per materialisation: after it, only live references remain
    if weakref.getweakrefs(tensor):
        raise LazyInitError(
            f"LazyGuard: cannot materialise {name}: a weak reference to it is alive (torch.utils.swap_tensors, which "
            "keeps the tensor's identity for the optimizers and tied weights that hold it, refuses such a tensor); "
            "drop the weak references (a weakref.ref, a WeakKeyDictionary or WeakTensorKeyDictionary keyed on the "
            "parameter) before materialising")


def _check_seeds_agree(plan) -> None:
    """Shards from different ranks form one tensor only if every rank replays the same seeds: compare
    each guard's seed across ranks (guards are numbered in program order, alike on SPMD ranks)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    mine = {recipe.guard[0]: recipe.guard[1] for *_, recipe, _ in plan}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        differing = [serial for serial in mine.keys() & theirs.keys() if mine[serial] != theirs[serial]]
        if differing:
            raise LazyInitError(
                f"LazyGuard: rank {dist.get_rank()} and rank {rank} built the model under different seeds, so their "
                "shards would not form one model; call torch.manual_seed(<same value>) on every rank before "
                "LazyGuard, or pass LazyGuard(seed=...)"
            )
