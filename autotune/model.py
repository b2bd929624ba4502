"""The model profile the cost model needs (`ModelSpec`), named presets, and recognition of a plain
`nn.Module` as a Llama-like decoder (`ModelSpec.from_module`).

Recognition works by structure, never by class names, and only reads shapes and attributes, so it
runs on the meta device (no forward, no memory for the weights):

* the decoder layers are the largest `nn.ModuleList` whose entries all have the same type;
* inside one layer, Linear-like modules (a 2-D `weight`) are grouped by their parent module; the
  attention group holds the output projection (out = hidden) and either separate q/k/v (three
  in = hidden) or a fused qkv (out = q + 2 kv); the MLP group holds down (out = hidden) and either
  separate gate/up, a packed gate_up (out = 2 ffn) or one up projection (plain GELU MLP);
* head counts come from attributes (num_heads, num_attention_heads, n_heads, num_key_value_heads,
  num_key_value_groups, head_dim, ... on the attention module, the layer or a `config`), else from a
  rotary table (`inv_freq` holds head_dim / 2 entries) and the projection shapes;
* q/k norms (Qwen3's per-head, OLMo2's over the whole projection): norm-like modules (a 1-D `weight`
  and no matrix) under the attention module whose size is head_dim, or the q or kv width; they are
  not layer norms, even when q's width equals the hidden size;
* outside the layers: the embedding ([vocab, hidden]), the final norm (a 1-D `weight` of hidden
  entries) and the LM head: a Linear [vocab, hidden], or a bare [hidden, vocab] parameter (Paddle's
  `x @ weight`); tied to the embedding, a Linear whose weight is the embedding's (Hugging Face's
  `tie_word_embeddings`), or none (the forward multiplies by the embedding's weight itself).

What is found is returned as a `ModelStructure` (qualified names that a tensor-parallel plan can
use); what is missing raises `UnrecognisedModel`, whose message says what and how to fix it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported inside from_module: the cost model itself needs no torch
    from torch import nn

__all__ = ["ModelSpec", "ModelStructure", "UnrecognisedModel", "PRESETS", "preset", "recognise"]

QK_NORMS = (None, "head", "projection")  # ModelSpec.qk_norm

# Attribute names that hold head counts, in order of preference (HF, Megatron, Meta Llama, GPT-2).
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_attention_heads_per_partition")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "num_query_groups", "n_kv_head")
_KV_GROUP_ATTRS = ("num_key_value_groups",)  # query heads per kv head
_HEAD_DIM_ATTRS = ("head_dim", "head_size", "kv_channels")


class UnrecognisedModel(ValueError):
    """The module does not look like a Llama-like decoder; the message says what was missing.

    Callers such as `to_distributed` catch it and fall back to data parallel with sharding, which
    needs no knowledge of the model's structure.
    """


@dataclass(frozen=True)
class ModelStructure:
    """Where the parts of a recognised model live, as qualified module/parameter names.

    Names inside a decoder layer are given relative to the layer (e.g. "self_attn.q_proj") and as
    patterns over all layers via `pattern` ("llama.layers.*.self_attn.q_proj", Paddle's plan-key
    convention). Packed projections are named in `qkv` / `gate_up` (and `q`/`k`/`v` or `gate`/`up`
    are None); `lm_head_param` is the parameter of the LM head and `lm_head_layout` says how it is
    applied: "linear" ([vocab, hidden], `F.linear`) or "matmul" ([hidden, vocab], `x @ weight`).
    """

    layers: str
    num_layers: int
    attention: str
    o: str
    mlp: str
    down: str
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    gate: str | None = None
    up: str | None = None
    gate_up: str | None = None
    qkv_sizes: tuple[int, ...] | None = None  # the packed qkv's [q, k, v] widths (unequal with grouped-query heads)
    layer_norms: tuple[str, ...] = ()
    qk_norms: tuple[str, ...] = ()  # norms of the queries/keys inside attention (ModelSpec.qk_norm says which kind)
    embedding: str | None = None
    final_norm: str | None = None
    lm_head: str | None = None
    lm_head_param: str | None = None
    lm_head_layout: str | None = None
    tied_embeddings: bool = False
    notes: tuple[str, ...] = ()

    def pattern(self, relative: str) -> str:
        """A layer-relative name as a pattern over every layer: 'mlp.up_proj' -> 'model.layers.*.mlp.up_proj'."""
        return f"{self.layers}.*.{relative}" if self.layers else f"*.{relative}"

    def tp_roles(self) -> dict[str, str]:
        """Tensor-parallel role of each part, keyed by Paddle-style pattern: "colwise" (q, k, v, qkv,
        gate, up, gate_up: split the output), "rowwise" (o, down: split the input), "embedding"
        (vocabulary-parallel), "lm_head" (the head's parameter; its layout says which dim is vocab),
        "norm" (replicated; sequence-parallel regions shard their activations). distcore maps these to
        its styles; packed projections need their parts split per rank, not the whole matrix."""
        roles = {}
        for name in (self.q, self.k, self.v, self.qkv, self.gate, self.up, self.gate_up):
            if name:
                roles[self.pattern(name)] = "colwise"
        roles[self.pattern(self.o)] = "rowwise"
        roles[self.pattern(self.down)] = "rowwise"
        for name in self.layer_norms:
            roles[self.pattern(name)] = "norm"
        if self.embedding:
            roles[self.embedding] = "embedding"
        if self.final_norm:
            roles[self.final_norm] = "norm"
        if not self.tied_embeddings and self.lm_head_param:
            roles[self.lm_head_param] = "lm_head"
        return roles

    def describe(self) -> str:
        """Human-readable summary (one role per line)."""
        rows = [("decoder layers", f"{self.layers} ({self.num_layers})")]
        if self.qkv:
            rows.append(("attention qkv (fused)", self.pattern(self.qkv)))
        else:
            rows += [("attention q/k/v", ", ".join(self.pattern(n) for n in (self.q, self.k, self.v)))]
        rows.append(("attention out", self.pattern(self.o)))
        if self.gate_up:
            rows.append(("mlp gate_up (packed)", self.pattern(self.gate_up)))
        elif self.gate:
            rows.append(("mlp gate/up", f"{self.pattern(self.gate)}, {self.pattern(self.up)}"))
        else:
            rows.append(("mlp up", self.pattern(self.up)))
        rows.append(("mlp down", self.pattern(self.down)))
        rows.append(("layer norms", ", ".join(self.pattern(n) for n in self.layer_norms) or "-"))
        if self.qk_norms:
            rows.append(("q/k norms", ", ".join(self.pattern(n) for n in self.qk_norms)))
        rows.append(("embedding", self.embedding or "-"))
        rows.append(("final norm", self.final_norm or "-"))
        head = f"{self.lm_head_param} ({self.lm_head_layout})"
        if self.tied_embeddings:
            head = f"{self.lm_head} (tied to the embedding)" if self.lm_head else "tied to the embedding"
        rows.append(("lm head", head))
        width = max(len(r[0]) for r in rows)
        lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer: everything the cost model reads.

    Beyond the contract's fields: `head_dim` (default hidden / heads), `gated_mlp` (SwiGLU: three
    MLP matrices; False for GPT's two), `tied_embeddings`, `flash_attention` (no s x s attention
    matrix is stored: the attention core is recomputed in the backward pass), `dropout` (Megatron's
    GPT stores dropout masks), `packed_unequal_qkv` (q/k/v packed in one projection with grouped-query
    heads: distcore's tensor parallel reduce-scatters its output, which equal parts do not need),
    `qk_norm` (norms of the queries and keys inside attention: "head" for Qwen3-style RMSNorms over
    head_dim applied to every head, whose weights' gradients tensor parallel sums over its ranks;
    "projection" for OLMo2-style RMSNorms over all heads' features, whose statistics tensor parallel
    all-reduces; None without; their weights are counted with the layer's norms), and a display `name`.
    `structure` is set by `from_module`.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_kv_heads: int | None = None
    seq_len: int = 2048
    head_dim: int | None = None
    gated_mlp: bool = True
    tied_embeddings: bool = False
    flash_attention: bool = True
    dropout: bool = False
    packed_unequal_qkv: bool = False
    qk_norm: str | None = None
    name: str = ""
    structure: ModelStructure | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelSpec: {name} must be a positive integer, got {value!r}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"ModelSpec: qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"ModelSpec: hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                    "pass head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec: num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    # ------------------------------------------------------------------------------ derived sizes

    @property
    def q_size(self) -> int:
        """Width of the query projection's output (heads x head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection's output: smaller than q_size with GQA."""
        return self.num_kv_heads * self.head_dim

    @property
    def attention_parameters(self) -> int:
        """q, k, v and output projections (no biases)."""
        return self.hidden_size * (2 * self.q_size + 2 * self.kv_size)

    @property
    def mlp_parameters(self) -> int:
        """gate, up and down (SwiGLU), or up and down (GELU)."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_hidden_size

    @property
    def layer_matmul_parameters(self) -> int:
        return self.attention_parameters + self.mlp_parameters

    @property
    def qk_norm_parameters(self) -> int:
        """The q and k norms' weights per layer: head_dim each (per head), q_size + kv_size (per projection)."""
        if self.qk_norm == "head":
            return 2 * self.head_dim
        if self.qk_norm == "projection":
            return self.q_size + self.kv_size
        return 0

    @property
    def layer_norm_parameters(self) -> int:
        """Two RMSNorm weights per layer (LayerNorm biases ignored: 2h of ~12h^2), plus the q/k norms'
        (replicated under tensor parallel, like the layer norms)."""
        return 2 * self.hidden_size + self.qk_norm_parameters

    @property
    def layer_parameters(self) -> int:
        return self.layer_matmul_parameters + self.layer_norm_parameters

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_parameters(self) -> int:
        """Total parameters: layers + embedding + (untied) LM head + final norm."""
        head = 0 if self.tied_embeddings else self.embedding_parameters
        return self.num_layers * self.layer_parameters + self.embedding_parameters + head + self.hidden_size

    def describe(self) -> str:
        kv = f", kv heads {self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        mlp = "SwiGLU" if self.gated_mlp else "GELU"
        label = f"{self.name}: " if self.name else ""
        return (f"{label}{self.num_parameters / 1e9:.2f}B params, L={self.num_layers} h={self.hidden_size} "
                f"heads={self.num_heads}{kv} ffn={self.ffn_hidden_size} ({mlp}) vocab={self.vocab_size} "
                f"seq={self.seq_len}")

    # ---------------------------------------------------------------------------------- recognition

    @classmethod
    def from_module(cls, model: "nn.Module", seq_len: int = 2048, **overrides) -> "ModelSpec":
        """Profile a Llama-like `model` by its structure (works on the meta device).

        `overrides` replace recognised fields (e.g. `num_heads=32` when the model stores no head
        count anywhere). The returned spec's `.structure` names the parts it found. Raises
        `UnrecognisedModel` with what was missing.
        """
        structure, fields = _recognise(model, overrides)
        fields.update(overrides)
        fields.setdefault("name", type(model).__name__)
        return cls(seq_len=seq_len, structure=structure, **fields)


def recognise(model: "nn.Module") -> ModelStructure:
    """Only the structure of `model` (see `ModelSpec.from_module`)."""
    return _recognise(model, {})[0]


# ---------------------------------------------------------------------------------------- presets


def _megatron_gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """Megatron-LM's GPT (Narayanan et al. 2021, Table 1): GELU MLP of 4h, vocab 51200, seq 2048,
    tied input/output embeddings, dropout, and (2021) attention that stores the s x s scores."""
    return ModelSpec(num_layers=layers, hidden_size=hidden, num_heads=heads, ffn_hidden_size=4 * hidden,
                     vocab_size=51200, seq_len=2048, gated_mlp=False, tied_embeddings=True,
                     flash_attention=False, dropout=True, name=name)


PRESETS: dict[str, ModelSpec] = {
    # Llama 2 (Touvron et al. 2023, Table 1 and the released configs): vocab 32000, context 4096.
    "llama2-7b": ModelSpec(32, 4096, 32, 11008, 32000, seq_len=4096, name="llama2-7b"),
    "llama2-13b": ModelSpec(40, 5120, 40, 13824, 32000, seq_len=4096, name="llama2-13b"),
    "llama2-70b": ModelSpec(80, 8192, 64, 28672, 32000, num_kv_heads=8, seq_len=4096, name="llama2-70b"),
    # Llama 3 8B / 70B released configs: vocab 128256, GQA with 8 kv heads, context 8192.
    "llama3-8b": ModelSpec(32, 4096, 32, 14336, 128256, num_kv_heads=8, seq_len=8192, name="llama3-8b"),
    "llama3-70b": ModelSpec(80, 8192, 64, 28672, 128256, num_kv_heads=8, seq_len=8192, name="llama3-70b"),
    # Llama 3 405B (Llama Team, "The Llama 3 Herd of Models", 2024, Table 3): 126 layers, model dim 16384,
    # FFN 53248, 128 heads, 8 kv heads; trained on 16 pipeline stages of 7, 8 x 14, 7 layers (Sec. 3.3.2).
    "llama3-405b": ModelSpec(126, 16384, 128, 53248, 128256, num_kv_heads=8, seq_len=8192, name="llama3-405b"),
    # GPT-3 175B (Brown et al. 2020): 96 layers, d_model 12288, 96 heads, context 2048; vocab as
    # padded by Megatron (50257 -> 51200).
    "gpt3-175b": dataclasses.replace(_megatron_gpt("gpt3-175b", 96, 12288, 96), flash_attention=True, dropout=False),
    # Narayanan et al. 2021 Table 1 (A100-80GB weak scaling).
    "megatron-1.7b": _megatron_gpt("megatron-1.7b", 24, 2304, 24),
    "megatron-3.6b": _megatron_gpt("megatron-3.6b", 30, 3072, 32),
    "megatron-7.5b": _megatron_gpt("megatron-7.5b", 36, 4096, 32),
    "megatron-18.4b": _megatron_gpt("megatron-18.4b", 40, 6144, 48),
    "megatron-39.1b": _megatron_gpt("megatron-39.1b", 48, 8192, 64),
    "megatron-76.1b": _megatron_gpt("megatron-76.1b", 60, 10240, 80),
    "megatron-145.6b": _megatron_gpt("megatron-145.6b", 80, 12288, 96),
    "megatron-310.1b": _megatron_gpt("megatron-310.1b", 96, 16384, 128),
    "megatron-1t": _megatron_gpt("megatron-1t", 128, 25600, 160),
}


def preset(name: str, **overrides) -> ModelSpec:
    """A named preset, optionally with fields replaced (e.g. `seq_len=8192`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


# ------------------------------------------------------------------------------ recognition details


@dataclass
class _Linear:
    """A Linear-like module or bare weight inside a layer: name relative to the layer, in/out widths."""

    name: str
    parent: str
    in_features: int
    out_features: int
    bare: bool = False  # a bare parameter of unknown [in, out] / [out, in] convention

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1].lower()


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _find_layer_list(model) -> tuple[str, object]:
    """The decoder layers: the ModuleList of same-type entries holding the most parameters."""
    from torch import nn

    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        types = {type(child) for child in module}
        if len(types) != 1:
            continue
        size = _numel(module)
        if size and (best is None or (size, len(module)) > best[0]):
            best = ((size, len(module)), name, module)
    if best is None:
        raise UnrecognisedModel(
            "no decoder-layer list found: expected an nn.ModuleList of identical blocks (e.g. model.layers) "
            "holding the transformer layers; fall back to data parallel (with sharding), or pass a ModelSpec")
    return best[1], best[2]


def _linears(block) -> list[_Linear]:
    """Every 2-D weight in `block` as a Linear: nn.Linear-style [out, in] unless the module is not a
    Linear and applies a bare [in, out] parameter (decided by the caller from the hidden size)."""
    from torch import nn

    found = []
    for name, module in block.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Embedding) or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            continue
        if isinstance(module, nn.Linear) or hasattr(module, "in_features"):
            found.append(_Linear(name, _parent(name), int(module.in_features), int(module.out_features)))
        else:  # unknown convention: record [rows, cols]; resolved against the hidden size later
            found.append(_Linear(name, _parent(name), int(weight.shape[1]), int(weight.shape[0]), bare=True))
    return found


def _orient(linears: list[_Linear], hidden: int) -> None:
    """Bare [in, out] weights were read as [out, in]; flip those that only make sense flipped."""
    for lin in linears:
        if lin.bare and lin.in_features != hidden and lin.out_features == hidden:
            lin.in_features, lin.out_features = lin.out_features, lin.in_features


def _norm_names(block, hidden: int) -> list[str]:
    """Modules of the block with a 1-D `weight` of `hidden` entries (RMSNorm/LayerNorm)."""
    names = []
    for name, module in block.named_modules():
        weight = getattr(module, "weight", None)
        if weight is not None and getattr(weight, "dim", lambda: 0)() == 1 and weight.shape[0] == hidden:
            names.append(name)
    return names


def _qk_norms(attn_module, attention: str, head_dim: int, q_size: int, kv_size: int,
              hidden: int) -> tuple[str | None, tuple[str, ...]]:
    """(kind, layer-relative names) of the q/k norms: norm-like modules (a 1-D `weight`, no parameter of
    more dimensions) under the attention module, of head_dim entries ("head": one weight applied to every
    head, Qwen3) or of the q / kv projection's width ("projection": all heads' features, OLMo2). A q/kv-wide
    one makes it "projection" even when kv's width is head_dim (a single kv head). When the attention
    projections sit in the layer itself (`attention` is ""), hidden-wide norms are the layer's own."""
    names, kinds = [], set()
    widths = {q_size, kv_size} - {head_dim}
    for name, module in attn_module.named_modules():
        if not name:
            continue
        params = list(module.parameters(recurse=False))
        weight = getattr(module, "weight", None)
        if (weight is None or not any(p is weight for p in params) or weight.dim() != 1
                or any(p.dim() != 1 for p in params)):
            continue
        size = int(weight.shape[0])
        if not attention and size == hidden:
            continue
        if size in widths:
            kinds.add("projection")
        elif size == head_dim:
            kinds.add("head")
        else:
            continue
        names.append(_join(attention, name))
    kind = "projection" if "projection" in kinds else "head" if kinds else None
    return kind, tuple(names)


def _first_attr(objects, attrs) -> int | None:
    for obj in objects:
        if obj is None:
            continue
        for attr in attrs:
            value = getattr(obj, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _rotary_head_dim(block, model) -> int | None:
    """head_dim from a rotary table: `inv_freq` holds head_dim / 2 frequencies."""
    for module in (block, model):
        for name, buf in module.named_buffers():
            if name.rsplit(".", 1)[-1] == "inv_freq" and buf.dim() == 1:
                return 2 * int(buf.shape[0])
    return None


def _hint(name: str, words: tuple[str, ...]) -> bool:
    lowered = name.lower()
    return any(w in lowered for w in words)


_ATTN_WORDS = ("attn", "attention")
_MLP_WORDS = ("mlp", "ffn", "feed_forward", "feedforward")


def _group_roles(linears: list[_Linear], hidden: int, block) -> tuple[str, str]:
    """(attention parent, mlp parent): the two groups of projections, by shapes, attributes and names."""
    groups: dict[str, list[_Linear]] = {}
    for lin in linears:
        groups.setdefault(lin.parent, []).append(lin)
    outs = {p: [l for l in g if l.out_features == hidden] for p, g in groups.items()}
    candidates = [p for p in groups if outs[p] and any(l.in_features == hidden for l in groups[p])]
    if len(candidates) < 2:
        raise UnrecognisedModel(
            f"could not find separate attention and MLP blocks in a decoder layer ({type(block).__name__}): "
            f"projections found {[f'{l.name} [{l.in_features}->{l.out_features}]' for l in linears]}; expected "
            "an attention module (q/k/v or qkv + output projection) and an MLP module (gate/up or gate_up + down)")

    def attention_score(parent: str) -> int:
        module = block.get_submodule(parent) if parent else block
        score = 0
        if _first_attr([module], _HEAD_ATTRS + _KV_HEAD_ATTRS + _HEAD_DIM_ATTRS) is not None:
            score += 4
        if _hint(parent, _ATTN_WORDS):
            score += 2
        if _hint(parent, _MLP_WORDS):
            score -= 2
        group = groups[parent]
        if len(group) == 4:
            score += 3  # q, k, v, o (a gated MLP has 3 projections)
        if len(group) == 2 and any(l.out_features == 3 * outs[parent][-1].in_features for l in group):
            score += 1  # packed qkv of multi-head attention (3 equal parts); a packed gate_up has 2
        return score

    ranked = sorted(candidates, key=lambda p: (-attention_score(p), candidates.index(p)))
    attention = ranked[0]
    mlp_candidates = [p for p in candidates if p != attention]
    mlp = max(mlp_candidates, key=lambda p: (_hint(p, _MLP_WORDS), -candidates.index(p)))
    return attention, mlp


def _output_projection(group: list[_Linear], hidden: int, words: tuple[str, ...]) -> _Linear:
    """The projection back to the hidden size: out = hidden, preferring in != hidden, then a telling
    name (o_proj, out_proj, down_proj, w2, ...), then the last registered."""
    outs = [l for l in group if l.out_features == hidden]
    narrowed = [l for l in outs if l.in_features != hidden] or outs
    named = [l for l in narrowed if any(_name_matches(l.leaf, w) for w in words)]
    return (named or narrowed)[-1]


def _name_matches(leaf: str, word: str) -> bool:
    """'o' matches 'o' and 'o_proj' (not 'q_proj'); longer words match anywhere ('out' in 'attn_out')."""
    return leaf == word or leaf.startswith(word + "_") or (len(word) > 2 and word in leaf)


_O_WORDS = ("o_proj", "out_proj", "o", "wo", "dense", "c_proj", "proj_out")
_DOWN_WORDS = ("down", "w2", "fc2", "out", "c_proj", "dense_4h_to_h")


def _attention_parts(group: list[_Linear], hidden: int) -> dict:
    """q/k/v/o or qkv/o in the attention group, with q and kv widths."""
    o = _output_projection(group, hidden, _O_WORDS)
    ins = [l for l in group if l.in_features == hidden and l is not o]
    q_size = o.in_features
    if len(ins) >= 3:
        by_name = {}
        for lin in ins:
            leaf = lin.leaf
            for role in ("q", "k", "v"):
                if leaf.startswith(role) or leaf.startswith(f"w{role}") or f"_{role}_" in f"_{leaf}_":
                    by_name.setdefault(role, lin)
        if len(by_name) == 3:
            q, k, v = by_name["q"], by_name["k"], by_name["v"]
        else:
            q = next((l for l in ins if l.out_features == q_size), ins[0])
            rest = [l for l in ins if l is not q]
            k, v = rest[0], rest[1]
        if k.out_features != v.out_features:
            raise UnrecognisedModel(f"key and value projections differ in width ({k.name}: {k.out_features}, "
                                    f"{v.name}: {v.out_features}); expected equal k/v projections")
        return dict(q=q.name, k=k.name, v=v.name, o=o.name, q_size=q.out_features, kv_size=k.out_features)
    if len(ins) == 1:
        qkv = ins[0]
        rest = qkv.out_features - q_size
        if rest <= 0 or rest % 2:
            raise UnrecognisedModel(
                f"fused projection {qkv.name} has {qkv.out_features} outputs, which is not q ({q_size}) + 2 x kv")
        return dict(qkv=qkv.name, o=o.name, q_size=q_size, kv_size=rest // 2)
    raise UnrecognisedModel(
        f"attention block has {len(ins)} input projection(s) {[l.name for l in ins]}; expected q/k/v or a fused qkv")


def _mlp_parts(group: list[_Linear], hidden: int) -> dict:
    """gate/up/down, gate_up/down or up/down in the MLP group, with the ffn width and gating."""
    down = _output_projection(group, hidden, _DOWN_WORDS)
    ins = [l for l in group if l.in_features == hidden and l is not down]
    ffn = down.in_features
    if len(ins) == 2:
        gate = next((l for l in ins if "gate" in l.leaf or l.leaf == "w1"), ins[0])
        up = next((l for l in ins if l is not gate), ins[1])
        if gate.out_features != ffn or up.out_features != ffn:
            raise UnrecognisedModel(f"MLP projections {gate.name}/{up.name} do not match {down.name}'s input ({ffn})")
        return dict(gate=gate.name, up=up.name, down=down.name, ffn=ffn, gated=True)
    if len(ins) == 1:
        lin = ins[0]
        if lin.out_features == 2 * ffn:
            return dict(gate_up=lin.name, down=down.name, ffn=ffn, gated=True)
        if lin.out_features == ffn:
            return dict(up=lin.name, down=down.name, ffn=ffn, gated=False)
        raise UnrecognisedModel(f"MLP input projection {lin.name} has {lin.out_features} outputs; expected "
                                f"{ffn} (plain) or {2 * ffn} (packed gate_up) to match {down.name}")
    raise UnrecognisedModel(
        f"MLP block has {len(ins)} input projection(s) {[l.name for l in ins]}; expected gate/up, gate_up or up")


def _heads(attn_module, block, model, head_dim_hint: int | None, q_size: int, kv_size: int,
           overrides: dict) -> tuple[int, int, int]:
    """(heads, kv heads, head_dim) from attributes, configs, the rotary table or the shapes."""
    configs = [getattr(o, "config", None) for o in (attn_module, block, model)]
    objects = [attn_module, block, *configs, model]
    heads = overrides.get("num_heads") or _first_attr(objects, _HEAD_ATTRS)
    head_dim = overrides.get("head_dim") or _first_attr([attn_module, block, *configs], _HEAD_DIM_ATTRS)
    if head_dim is None and heads:
        head_dim = q_size // heads if q_size % heads == 0 else None
    if head_dim is None:
        head_dim = head_dim_hint
    if heads is None and head_dim:
        heads = q_size // head_dim if q_size % head_dim == 0 else None
    if heads is None or head_dim is None or heads * head_dim != q_size:
        raise UnrecognisedModel(
            f"could not determine the number of attention heads (query width {q_size}): set a head-count "
            f"attribute such as num_heads on the attention module, or call "
            f"ModelSpec.from_module(model, num_heads=...)")
    kv_heads = overrides.get("num_kv_heads") or _first_attr(objects, _KV_HEAD_ATTRS)
    if kv_heads is None:
        groups = _first_attr([attn_module, block], _KV_GROUP_ATTRS)
        kv_heads = heads // groups if groups else kv_size // head_dim
    if kv_heads * head_dim != kv_size:
        kv_heads = kv_size // head_dim  # the shapes win over a stale attribute
    return heads, kv_heads, head_dim


def _outer_parts(model, layers_name: str, hidden: int) -> dict:
    """Embedding, final norm and LM head outside the layer list."""
    from torch import nn

    inside = layers_name + "."
    embedding = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and not name.startswith(inside) and module.embedding_dim == hidden:
            if embedding is None or module.num_embeddings > embedding[1].num_embeddings:
                embedding = (name, module)
    if embedding is None:
        raise UnrecognisedModel(f"no token embedding (nn.Embedding of width {hidden}) outside {layers_name}")
    emb_name, emb = embedding
    vocab = emb.num_embeddings

    final_norm = None
    lm_head = None
    tied_head = None  # a Linear registered with the embedding's own weight
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.startswith(inside) or name.startswith(emb_name + "."):
            continue
        owner = _parent(name)
        if param.dim() == 1 and param.shape[0] == hidden and name.endswith("weight"):
            final_norm = owner  # the last one registered wins (the norm before the head)
        elif param.dim() == 2 and tuple(param.shape) in ((vocab, hidden), (hidden, vocab)):
            module = model.get_submodule(owner) if owner else model
            if param is emb.weight:
                if isinstance(module, nn.Linear) and name.endswith(".weight"):
                    tied_head = owner
                continue
            layout = "linear" if (isinstance(module, nn.Linear) or tuple(param.shape) == (vocab, hidden)) else "matmul"
            if vocab == hidden:  # square: the module type decides
                layout = "linear" if isinstance(module, nn.Linear) else "matmul"
            lm_head = (owner, name, layout)
    if lm_head is None:  # tied: the head is the embedding's weight, in a Linear of its own or not
        head = (tied_head, f"{tied_head}.weight") if tied_head else (None, emb_name + ".weight")
        return dict(embedding=emb_name, vocab=vocab, final_norm=final_norm, lm_head=head[0], lm_head_param=head[1],
                    lm_head_layout="linear", tied=True)
    return dict(embedding=emb_name, vocab=vocab, final_norm=final_norm, lm_head=lm_head[0], lm_head_param=lm_head[1],
                lm_head_layout=lm_head[2], tied=False)


def _recognise(model, overrides: dict) -> tuple[ModelStructure, dict]:
    from torch import nn

    if not isinstance(model, nn.Module):
        raise UnrecognisedModel(f"expected an nn.Module, got {type(model).__name__}")
    layers_name, layers = _find_layer_list(model)
    block = layers[0]
    linears = _linears(block)
    # The hidden size: the embedding width if there is one, else the most common projection input.
    emb_dims = [m.embedding_dim for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    widths = [l.in_features for l in linears] + [l.out_features for l in linears]
    hidden = overrides.get("hidden_size") or (max(emb_dims, key=widths.count) if emb_dims else
                                              max(set(widths), key=widths.count) if widths else None)
    if not hidden:
        raise UnrecognisedModel(f"no projections found in the decoder layer {layers_name}.0 ({type(block).__name__})")
    _orient(linears, hidden)
    attention, mlp = _group_roles(linears, hidden, block)
    attn = _attention_parts([l for l in linears if l.parent == attention], hidden)
    mlp_parts = _mlp_parts([l for l in linears if l.parent == mlp], hidden)
    attn_module = block.get_submodule(attention) if attention else block
    heads, kv_heads, head_dim = _heads(attn_module, block, model, _rotary_head_dim(block, model),
                                       attn["q_size"], attn["kv_size"], overrides)
    outer = _outer_parts(model, layers_name, hidden)
    qk_norm, qk_norms = _qk_norms(attn_module, attention, head_dim, attn["q_size"], attn["kv_size"], hidden)
    norms = tuple(n for n in _norm_names(block, hidden) if n not in qk_norms)  # OLMo2's q norm can be hidden-wide
    notes = []
    biases = [n for n, p in block.named_parameters() if n.endswith("bias")]
    if biases:
        notes.append(f"{len(biases)} bias vector(s) per layer are not counted by the cost model")
    if len(norms) != 2:
        notes.append(f"{len(norms)} norm(s) per layer found (the cost model assumes 2)")
    structure = ModelStructure(
        layers=layers_name, num_layers=len(layers), attention=attention, o=attn["o"], mlp=mlp,
        down=mlp_parts["down"], q=attn.get("q"), k=attn.get("k"), v=attn.get("v"), qkv=attn.get("qkv"),
        gate=mlp_parts.get("gate"), up=mlp_parts.get("up"), gate_up=mlp_parts.get("gate_up"),
        qkv_sizes=(attn["q_size"], attn["kv_size"], attn["kv_size"]) if attn.get("qkv") else None, layer_norms=norms,
        qk_norms=qk_norms, embedding=outer["embedding"], final_norm=outer["final_norm"],
        lm_head=outer["lm_head"], lm_head_param=outer["lm_head_param"], lm_head_layout=outer["lm_head_layout"],
        tied_embeddings=outer["tied"], notes=tuple(notes),
    )
    fields = dict(
        num_layers=len(layers), hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        ffn_hidden_size=mlp_parts["ffn"], vocab_size=outer["vocab"], gated_mlp=mlp_parts["gated"],
        tied_embeddings=outer["tied"],
        packed_unequal_qkv=bool(attn.get("qkv")) and attn["q_size"] != attn["kv_size"], qk_norm=qk_norm,
    )
    return structure, fields
