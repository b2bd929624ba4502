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
* mixture-of-experts blocks (every layer is read, since MoE and dense layers mix): experts are either
  3-D stacked weights ([experts, out, in] or [experts, in, out]: gate_up or gate/up, and down) on one
  module, or an `nn.ModuleList` of identical MLPs; the router is the 2-D weight of [experts, hidden]
  (a Linear to the expert count, or a bare parameter) beside them, in the module that holds both (the
  MoE block); any other MLP in that block is a shared expert (always active; a gate of one output
  beside it, Qwen2-MoE's, counts as its part); top-k comes from an attribute (top_k,
  num_experts_per_tok, ...) of the block, the router or a config. The attention group is then found
  among the layer's other projections;
* Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): a module with transformers' head attributes for it
  (num_k_heads, num_v_heads, head_k_dim, head_v_dim) and a depthwise convolution marks a layer whose token mixer
  it is; the attention is then read from another layer, and each part of the mixer is classified by its shapes
  (`LinearAttention`);
* outside the layers: the embedding ([vocab, hidden]), the final norm (a 1-D `weight` of hidden
  entries) and the LM head: a Linear [vocab, hidden], or a bare [hidden, vocab] parameter (Paddle's
  `x @ weight`); tied to the embedding, a Linear whose weight is the embedding's (Hugging Face's
  `tie_word_embeddings`), or none (the forward multiplies by the embedding's weight itself).

What is found is returned as a `ModelStructure` (qualified names that a tensor-parallel plan can
use); what is missing raises `UnrecognisedModel`, whose message says what and how to fix it.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported inside from_module: the cost model itself needs no torch
    from torch import nn

__all__ = ["ChannelMixer", "GatedDeltaNet", "LatentAttention", "LinearAttention", "ModelSpec", "ModelStructure",
           "SelectiveScan", "ShortConvolution", "UnrecognisedModel", "PRESETS", "preset",
           "recognise"]

QK_NORMS = (None, "head", "projection")  # ModelSpec.qk_norm

# Attribute names that hold head counts, in order of preference (HF, Megatron, Meta Llama, GPT-2).
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "num_attention_heads_per_partition")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "num_query_groups", "n_kv_head")
_KV_GROUP_ATTRS = ("num_key_value_groups",)  # query heads per kv head
_HEAD_DIM_ATTRS = ("head_dim", "head_size", "kv_channels")


class UnrecognisedModel(ValueError):
    """The module does not look like a Llama-like decoder; the message says what was missing.

    Callers such as `to_distributed` catch it and fall back to data parallel with sharding, which
    needs no knowledge of the model's structure. `layers` names the decoder-layer list where one was found
    before the layers' insides were not recognised (None otherwise): pipeline stages, micro-batches and
    full-layer recompute need that list and nothing else of the structure.
    """

    def __init__(self, message: str, *, layers: str | None = None):
        super().__init__(message)
        self.layers = layers


@dataclass(frozen=True)
class ModelStructure:
    """Where the parts of a recognised model live, as qualified module/parameter names.

    Names inside a decoder layer are given relative to the layer (e.g. "self_attn.q_proj") and as
    patterns over all layers via `pattern` ("llama.layers.*.self_attn.q_proj", Paddle's plan-key
    convention). Packed projections are named in `qkv` / `gate_up` (and `q`/`k`/`v` or `gate`/`up`
    are None); `lm_head_param` is the parameter of the LM head and `lm_head_layout` says how it is
    applied: "linear" ([vocab, hidden], `F.linear`) or "matmul" ([hidden, vocab], `x @ weight`). A model of linear
    mixers alone (Mamba's blocks: a norm and a state-space mixer) has no attention and no MLP: `attention`, `o`,
    `mlp` and `down` are None, `linear_attention` names the mixer of every layer.
    """

    layers: str
    num_layers: int
    attention: str | None
    o: str | None
    mlp: str | None
    down: str | None
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    gate: str | None = None
    up: str | None = None
    gate_up: str | None = None
    qkv_sizes: tuple[int, ...] | None = None  # the packed qkv's [q, k, v] widths (unequal with grouped-query heads)
    # The packed qkv holds [q..q k v] per key/value head (`_INTERLEAVED_QKV`), not [q | k | v]: a contiguous split
    # over ranks that divide the key/value heads gives each rank its own heads whole.
    qkv_interleaved: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3): the projection from the compressed key/value latent to
    # every head's keys and values ("self_attn.kv_b_proj"); `q` is then the query's per-head projection
    # (q_b_proj, or q_proj without a query latent) and `k`/`v` are None.
    latent_kv: str | None = None
    latent_kv_down: str | None = None  # its down-projection ("self_attn.kv_a_proj_with_mqa"): latent + rotary key
    latent_rotary_features: int = 0  # that projection's last outputs: the rotary key every head uses
    # A projection from the hidden states beside q/k/v giving the attention's output a gate per query head, one per
    # feature (AFMoE's and Beam's gate_proj: heads x head_dim) or one per head (Laguna's g_proj with gate_per_head):
    # split with the query heads (its outputs head-major).
    attention_gate: str | None = None
    layer_norms: tuple[str, ...] = ()
    qk_norms: tuple[str, ...] = ()  # norms of the queries/keys inside attention (ModelSpec.qk_norm says which kind)
    embedding: str | None = None
    # A learned absolute position embedding beside it (GPT-2's and GPTBigCode's wpe, OPT's and BioGPT's
    # embed_positions): an nn.Embedding of the hidden width outside the layers with a row per position (the config's
    # max positions, plus an offset of up to 2: OPT's and BioGPT's).
    position_embedding: str | None = None
    final_norm: str | None = None
    lm_head: str | None = None
    lm_head_param: str | None = None
    lm_head_layout: str | None = None
    tied_embeddings: bool = False
    # A model without a vocabulary head that ends in a head of its own (sequence or token classification, a reward
    # model's `score`, question answering): that module's name (`lm_head` is then None, `tied_embeddings` True).
    task_head: str | None = None
    moe_layers: tuple[int, ...] = ()  # indices of the layers whose MLP is a mixture of experts
    moe: str | None = None  # the MoE block, relative to a layer (e.g. "mlp"); `mlp`/`down`/... name the dense layers' MLP
    router: str | None = None  # its router's parameter, relative to a layer ("mlp.gate.weight")
    experts: str | None = None  # the experts' container ("mlp.experts"): stacked 3-D weights or a ModuleList
    expert_layout: str | None = None  # "stacked" or "list"
    shared_experts: tuple[str, ...] = ()  # always-active MLPs inside the MoE block ("mlp.shared_expert")
    # Gated DeltaNet linear attention in some layers (Qwen3-Next, Qwen3.5): those layers' token mixer, which
    # replaces `attention` (and `q`/`k`/`v`/`qkv`/`o`, read from a layer with attention) there.
    linear_attention: "LinearAttention | None" = None
    # Modules of a decoder layer holding parameters that no plan names (outside the attention, the MLP or MoE block,
    # the norms and a linear mixer: LongCat-Flash's second attention and MLP beside its first; Falcon-H1's Mamba mixer
    # where it cannot be split), the top-most of each, layer-relative: whole on every tensor-parallel rank, and no
    # sequence parallel (on a rank's slice their gradients would be partial; `distcore.auto.unsupported`).
    unplanned: tuple[str, ...] = ()
    # Blocks of one part (Nemotron-H: a norm and one mixer each, Mamba-2, attention, an MLP or experts): the layers
    # without a token mixer (an MLP or MoE block alone) and those without an MLP (attention or a linear mixer alone).
    # `attention`, `mlp`, `moe` and the linear mixer may then be one name ("mixer"), each in its own layers.
    mixer_free_layers: tuple[int, ...] = ()
    mlp_free_layers: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    def pattern(self, relative: str) -> str:
        """A layer-relative name as a pattern over every layer: 'mlp.up_proj' -> 'model.layers.*.mlp.up_proj'."""
        return f"{self.layers}.*.{relative}" if self.layers else f"*.{relative}"

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def experts_modules(self) -> list[str]:
        """The qualified name of every MoE layer's experts module."""
        return [f"{self.layers}.{i}.{self.experts}" if self.layers else f"{i}.{self.experts}" for i in self.moe_layers]

    def tp_roles(self) -> dict[str, str]:
        """Tensor-parallel role of each part, keyed by Paddle-style pattern: "colwise" (q, k, v, qkv,
        gate, up, gate_up: split the output), "rowwise" (o, down: split the input), "embedding"
        (vocabulary-parallel), "lm_head" (the head's parameter; its layout says which dim is vocab),
        "norm" (replicated; sequence-parallel regions shard their activations). distcore maps these to
        its styles; packed projections need their parts split per rank, not the whole matrix. A
        mixture-of-experts model has no tensor-parallel plan yet (its MLP names differ per layer)."""
        if self.is_moe:
            raise ValueError("ModelStructure.tp_roles: no tensor-parallel roles for a mixture-of-experts model "
                             f"(MoE blocks {self.pattern(self.moe)} in layers {list(self.moe_layers)})")
        if self.linear_attention is not None:  # packed parts and per-head rows: no role string says them
            raise ValueError("ModelStructure.tp_roles: no tensor-parallel roles for linear attention (layers "
                             f"{list(self.linear_attention.layers)}); distcore.auto.tensor_parallel_plan splits it")
        roles = {}
        for name in (self.q, self.k, self.v, self.qkv, self.latent_kv, self.attention_gate, self.gate, self.up,
                     self.gate_up):
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
        if self.attention is None and self.o is None:
            pass  # linear mixers alone
        elif self.qkv:
            rows.append(("attention qkv (fused)", self.pattern(self.qkv)))
        elif self.latent_kv:
            rows.append(("attention q / latent kv", ", ".join(self.pattern(n) for n in (self.q, self.latent_kv))))
        else:
            rows += [("attention q/k/v", ", ".join(self.pattern(n) for n in (self.q, self.k, self.v)))]
        if self.attention_gate:
            rows.append(("attention output gate", self.pattern(self.attention_gate)))
        if self.o is not None:
            rows.append(("attention out", self.pattern(self.o)))
        if self.linear_attention is not None:
            linear = self.linear_attention
            heads = {"mamba2": f"{linear.num_k_heads} state groups, {linear.num_v_heads} heads",
                     "short_conv": f"{linear.num_k_heads} channels", "mamba1": f"{linear.num_k_heads} channels"}.get(
                linear.kind, f"{linear.num_k_heads} key, {linear.num_v_heads} value heads")
            rows.append(("linear attention", f"{self.pattern(linear.mixer)} in layers {_ranges(linear.layers)} ({heads})"))
        if self.is_moe:
            rows.append(("MoE block", f"{self.pattern(self.moe)} in layers {_ranges(self.moe_layers)}"))
            rows.append(("router", self.pattern(self.router)))
            rows.append((f"experts ({self.expert_layout})", self.pattern(self.experts)))
            if self.shared_experts:
                rows.append(("shared experts", ", ".join(self.pattern(n) for n in self.shared_experts)))
        if self.down is not None:  # the dense MLP (of the dense layers, in a mixture-of-experts model)
            dense = " (dense layers)" if self.is_moe else ""
            if self.gate_up:
                rows.append((f"mlp gate_up (packed){dense}", self.pattern(self.gate_up)))
            elif self.gate:
                rows.append((f"mlp gate/up{dense}", f"{self.pattern(self.gate)}, {self.pattern(self.up)}"))
            else:
                rows.append((f"mlp up{dense}", self.pattern(self.up)))
            rows.append((f"mlp down{dense}", self.pattern(self.down)))
        rows.append(("layer norms", ", ".join(self.pattern(n) for n in self.layer_norms) or "-"))
        if self.mixer_free_layers or self.mlp_free_layers:
            rows.append(("one-part blocks", f"no token mixer in layers {_ranges(self.mixer_free_layers) or '-'}, "
                                            f"no MLP in layers {_ranges(self.mlp_free_layers) or '-'}"))
        if self.unplanned:
            rows.append(("whole on every tp rank", ", ".join(self.pattern(n) for n in self.unplanned)))
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


def _check_integers(owner: str, obj, names: tuple[str, ...], *, minimum: int = 1,
                    what: str = "a positive integer") -> None:
    """Raise naming the first of `obj`'s fields `names` that is not an integer (bools are not) of at least `minimum`."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{owner}: {name} must be {what}, got {value!r}")


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention's widths (DeepSeek-V2/V3): the query through a `q_lora_rank` latent (0: a
    straight projection, as DeepSeek-V2-Lite), keys and values through one `kv_lora_rank` latent that the same
    down-projection joins to a `rope_head_dim` rotary key shared by every head, and value heads `v_head_dim`
    wide. A query or key head is ModelSpec.head_dim wide: `head_dim - rope_head_dim` from the latent, then the
    rotary part."""

    kv_lora_rank: int
    rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0

    def __post_init__(self) -> None:
        what = "a positive integer (q_lora_rank: or 0)"
        _check_integers("LatentAttention", self, ("kv_lora_rank", "rope_head_dim", "v_head_dim"), what=what)
        _check_integers("LatentAttention", self, ("q_lora_rank",), minimum=0, what=what)


@dataclass(frozen=True)
class GatedDeltaNet:
    """Gated DeltaNet linear-attention layers (Qwen3-Next, Qwen3.5, Lara Mini) as the cost model prices them; their
    names in a model are the structure's (`ModelStructure.linear_attention`, a `LinearAttention`). `layers`: their
    indices (the model's other layers are attention layers). Each mixes tokens with `num_k_heads` query and key
    heads of `head_k_dim` and `num_v_heads` value heads of `head_v_dim` (a multiple: a key head serves a group of
    value heads), after a depthwise causal convolution of `conv_kernel_size` over the packed [q | k | v] channels.
    Its projections are transformers' (packed or not): from the hidden size to q, k, v, the output gate z (one
    value width) and one β and one decay per value head; and from the value heads back to the hidden size.
    `key_heads_replicable`: tensor parallel may exceed the key heads where they divide it, each computed on tp /
    num_k_heads ranks (a Mamba-2 mixer's state groups, priced as such a layer: B and C as q and k); their q and k
    (B and C) are then partial sums all-reduced forward and backward. `packed_split_outputs`: the outputs per token of
    the projections that pack unequal parts (Qwen3.5's [q | k | v], Mamba-2's [z | x | B | C | dt]), which tensor
    parallel splits on their input features: their output reduce-scattered forward, its gradient all-gathered
    backward (0: none). `beside_attention`: the mixer runs beside the attention in its layers, both on the layer's
    input (Falcon-H1's parallel hybrid), not in the attention's place: those layers cost both."""

    layers: tuple[int, ...]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int = 4
    key_heads_replicable: bool = False
    packed_split_outputs: int = 0
    beside_attention: bool = False

    def __post_init__(self) -> None:
        _check_integers("GatedDeltaNet", self, ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
                                                "conv_kernel_size"))
        _check_integers("GatedDeltaNet", self, ("packed_split_outputs",), minimum=0, what="a non-negative integer")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"GatedDeltaNet: num_v_heads={self.num_v_heads} must be a multiple of "
                             f"num_k_heads={self.num_k_heads} (a key head serves a group of value heads)")
        layers = tuple(self.layers)
        if not layers or sorted(set(layers)) != list(layers) or layers[0] < 0:
            raise ValueError(f"GatedDeltaNet: layers must be increasing layer indices, got {self.layers!r}")
        object.__setattr__(self, "layers", layers)

    @property
    def key_size(self) -> int:
        """The query (and the key) width: key heads x their width."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_size(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_channels(self) -> int:
        """The convolution's channels: the packed [q | k | v]."""
        return 2 * self.key_size + self.value_size

    def projections(self, hidden: int) -> tuple[tuple[int, int, str], ...]:
        """As `ModelSpec.attention_projections`: (in, out, what tensor parallel splits). From the hidden size: q, k,
        v, z and β and the decay per value head (column-parallel, packed or not); back: row-parallel."""
        return (hidden, self.conv_channels + self.value_size + 2 * self.num_v_heads, "out"), (self.value_size, hidden, "in")

    def matmul_parameters(self, hidden: int) -> int:
        return sum(n_in * n_out for n_in, n_out, _ in self.projections(hidden))

    @property
    def other_parameters(self) -> int:
        """The mixer's parameters besides its projections: the convolution's weight, a time-step bias and a decay
        per value head, and its gated output norm's weight (one value head wide, used by every head). distcore
        keeps each whole on every tensor-parallel rank (LocalParameterRows, ShardLocalParameters) and sums their
        gradients over those ranks."""
        return self.conv_channels * self.conv_kernel_size + 2 * self.num_v_heads + self.head_v_dim

    def summary(self) -> str:
        return (f"{len(self.layers)} Gated DeltaNet layers ({self.num_k_heads} key heads of {self.head_k_dim}, "
                f"{self.num_v_heads} value heads of {self.head_v_dim})")


@dataclass(frozen=True)
class ChannelMixer:
    """A linear mixer whose channels are independent (LFM2's short convolution, Mamba-1's scan; MiniMax's lightning
    attention, whose heads are), as the cost model
    prices it in the attention's place (`ModelSpec.gated_delta_net` holds any kind of linear mixer): tensor parallel
    splits its `channels` as attention's heads (the units `num_k_heads` and `num_v_heads` name for
    `tensor_parallel_problems`). As GatedDeltaNet's it never runs beside the attention; unlike it, it has no key heads
    fewer than the ranks and no projection of unequal parts split on its inputs. Each kind says its `projections`,
    `other_parameters` (whole on every rank: distcore's LocalParameterRows), `core_flops` and `kept_elements`."""

    layers: tuple[int, ...]
    channels: int
    beside_attention = False
    key_heads_replicable = False
    packed_split_outputs = 0
    key_size = 0  # no keys (GatedDeltaNet's replicated-key terms read it)

    def __post_init__(self) -> None:
        _check_integers(type(self).__name__, self, tuple(f.name for f in dataclasses.fields(self) if f.name != "layers"))
        layers = tuple(self.layers)
        if not layers or sorted(set(layers)) != list(layers) or layers[0] < 0:
            raise ValueError(f"{type(self).__name__}: layers must be increasing layer indices, got {self.layers!r}")
        object.__setattr__(self, "layers", layers)

    @property
    def num_k_heads(self) -> int:  # the units tensor parallel splits: channels
        return self.channels

    num_v_heads = num_k_heads

    def projections(self, hidden: int) -> tuple[tuple[int, int, str], ...]:
        raise NotImplementedError

    def matmul_parameters(self, hidden: int) -> int:
        return sum(n_in * n_out for n_in, n_out, _ in self.projections(hidden))

    def kept_whole_elements(self) -> int:
        """What the mixer keeps per token for its backward that every tp rank holds whole (beside `kept_elements`, its
        channels' share): none unless a kind says so."""
        return 0


@dataclass(frozen=True)
class ShortConvolution(ChannelMixer):
    """Gated short-convolution layers (LFM2's, LFM2-MoE's, LFM3's: transformers' Lfm2ShortConv): a projection from
    the hidden size to three times `channels` features [B | C | x], B·x through a depthwise causal convolution of
    `conv_kernel_size` taps, its output gated by C, and a projection back to the hidden size. No state, no chunked
    recurrence: its core is elementwise. The convolution's weight stays whole on every tp rank, its gradient summed."""

    conv_kernel_size: int = 3

    def projections(self, hidden: int) -> tuple[tuple[int, int, str], ...]:
        """As `GatedDeltaNet.projections`: [B | C | x] column-parallel (three equal parts, each split on its
        outputs), the output projection row-parallel."""
        return (hidden, 3 * self.channels, "out"), (self.channels, hidden, "in")

    @property
    def other_parameters(self) -> int:
        """The convolution's weight (a bias, where the config asks for one, is not counted, as no bias is)."""
        return self.channels * self.conv_kernel_size

    def core_flops(self) -> tuple[float, float]:
        """(forward FLOPs per token, those its backward recomputes first) of the mixer between its projections:
        B·x and C·y (a multiply per channel each) and the convolution's taps (a multiply-add each); nothing is
        recomputed."""
        return self.channels * (2.0 * self.conv_kernel_size + 2.0), 0.0

    def kept_elements(self) -> int:
        """What the mixer keeps per token for its backward, in the compute dtype (measured with saved-tensor hooks on
        transformers' Lfm2ShortConv, causal_conv1d_fn's torch path): the input projection's output [B | C | x] (B and
        x for B·x's backward, C for the gate's), the convolution's input B·x and output, and the output projection's
        input: 6 per channel."""
        return 6 * self.channels

    def summary(self) -> str:
        return (f"{len(self.layers)} gated short-convolution layers ({self.channels} channels, "
                f"{self.conv_kernel_size} taps)")


@dataclass(frozen=True)
class SelectiveScan(ChannelMixer):
    """Mamba-1 layers (Jamba's: transformers' JambaMambaMixer): `channels` (intermediate_size) channels, each with
    `state_size` states, a depthwise causal convolution of `conv_kernel_size` taps, a time step of rank `dt_rank`.
    Projections: the hidden size to [x | z] (2 x channels), the channels to [dt | B | C] (dt_rank + 2 x state_size:
    row-parallel under tp, its output all-reduced forward and its gradient backward, `shared_outputs`), the channels
    back. The time step's up-projection dt_proj (dt_rank to the channels, whose weight its code multiplies by itself),
    the convolution, A_log and D are whole on every tp rank (each rank computes its channels' rows), their gradients
    summed."""

    state_size: int
    dt_rank: int
    conv_kernel_size: int = 4

    @property
    def shared_outputs(self) -> int:
        """The selective projection's outputs per token, [dt | B | C], summed over the tp ranks both ways."""
        return self.dt_rank + 2 * self.state_size

    def projections(self, hidden: int) -> tuple[tuple[int, int, str], ...]:
        """As `GatedDeltaNet.projections`: [x | z] split on its outputs, the selective and the output projections on
        their inputs. (dt_proj, whole on every rank, is among `other_parameters`, its work in `core_flops`.)"""
        c = self.channels
        return (hidden, 2 * c, "out"), (c, self.shared_outputs, "in"), (c, hidden, "in")

    @property
    def other_parameters(self) -> int:
        """dt_proj's weight (dt_rank per channel), the convolution's weight, A_log (a row of states per channel), D (one
        per channel) and the norms over dt, B and C (Jamba's; biases are not counted, as no bias is)."""
        return self.channels * (self.dt_rank + self.conv_kernel_size + self.state_size + 1) + self.shared_outputs

    def core_flops(self) -> tuple[float, float]:
        """(forward FLOPs per token, those its backward recomputes first) of the selective scan as mamba-ssm's kernel
        runs it: 9 per channel and state (Gu & Dao 2023, section 3.3: discretising A and B, the state update and C·h),
        and dt_proj's multiply-adds (dt_rank per channel: this rank's rows of a weight held whole); its backward
        recomputes the states (the scan's forward work again), storing none."""
        scan = 9.0 * self.channels * self.state_size
        return scan + 2.0 * self.dt_rank * self.channels, scan

    def kept_elements(self) -> int:
        """What the mixer keeps per token for its backward as mamba-ssm's and causal-conv1d's kernels run it, in the
        compute dtype, of its channels: [x | z] (2 per channel), the convolution's output and the time step dt_proj
        gives (one per channel each), the scan's output (one per channel, the output projection's input); dt, B and C
        are `kept_whole_elements`. transformers' torch path (no mamba-ssm) keeps far more (its states, per channel
        and state)."""
        return 5 * self.channels

    def kept_whole_elements(self) -> int:
        """dt, B and C before and after their norms: the selective projection's all-reduced output, whole on every tp
        rank."""
        return 2 * self.shared_outputs

    def summary(self) -> str:
        return (f"{len(self.layers)} Mamba-1 layers ({self.channels} channels of {self.state_size} states, time-step "
                f"rank {self.dt_rank})")


@dataclass(frozen=True)
class LightningAttention(ChannelMixer):
    """MiniMax's lightning attention layers (MiniMax-Text-01, MiniMax-M1: transformers' MiniMaxLightningAttention):
    `channels` heads (the units tensor parallel splits, each independent) of `head_dim`, a linear attention with a
    decay per head run in blocks of `block_size` tokens (each block's scores within it, a state of head_dim x head_dim
    per head across blocks). Projections: the hidden size to [q k v] per head and to the output gate, the heads back.
    Its norm over every head's features (whole on every tp rank, its statistics summed over them) is its only other
    parameter."""

    head_dim: int
    block_size: int

    @property
    def width(self) -> int:
        return self.channels * self.head_dim

    def projections(self, hidden: int) -> tuple[tuple[int, int, str], ...]:
        """As `GatedDeltaNet.projections`: [q k v] and the output gate split on their outputs, the output projection on
        its inputs."""
        return (hidden, 3 * self.width, "out"), (hidden, self.width, "out"), (self.width, hidden, "in")

    @property
    def other_parameters(self) -> int:
        """The norm's weight over every head's features."""
        return self.width

    def core_flops(self) -> tuple[float, float]:
        """(forward FLOPs per token, those its backward recomputes first) of transformers' blocked torch path, per head:
        the block's scores q·kᵀ and their product with v (block_size x head_dim multiply-adds each), the product of q
        with the state and the state's update kᵀ·v (head_dim² each); its backward recomputes nothing."""
        return 4.0 * self.channels * (self.block_size * self.head_dim + self.head_dim ** 2), 0.0

    def kept_elements(self) -> int:
        """What the mixer keeps per token for its backward, in the compute dtype, as transformers' torch path runs it
        (measured with saved-tensor hooks: a least-squares fit over 2-8 heads of 8-32 features, blocks of 8-32 tokens,
        at 64 tokens, gave 13.0 per head feature, 0.86 per head and block token, 1.08 per head and head_dim² / block):
        the projections' outputs and their activations, the heads' transposed copies, the block's scores with and
        without their decay, the states."""
        return self.channels * (13 * self.head_dim + self.block_size + self.head_dim ** 2 // self.block_size)

    def summary(self) -> str:
        return (f"{len(self.layers)} lightning attention layers ({self.channels} heads of {self.head_dim}, blocks of "
                f"{self.block_size} tokens)")


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet linear-attention mixer (transformers' Qwen3-Next, Qwen3.5, Qwen3.5-MoE): what tensor
    parallel splits by head, as names relative to the mixer. Its heads are independent, as attention's are: a
    rank runs whole heads (key heads and the value heads grouped with them). `columns`: the projections from the
    hidden states, each with its output's part sizes, each part split evenly (one part: a contiguous split, right
    where the output is one kind of feature or grouped by key head; Qwen3.5's in_proj_qkv packs [q | k | v]).
    `output`: the projection back to the hidden size (row-parallel). `rows`: parameters with rows per channel or
    per head, with their part sizes (the depthwise convolution over the packed [q | k | v] channels; the per-head
    decay and time-step biases). `shared`: modules whose weight every head uses (the gated output norm).
    `counts`: the mixer's integer attributes that count heads or channels, which each rank holds 1/tp of (a dotted
    name: a submodule's). `row_dims`: the dim of a `rows` parameter its rows lie along where not 0 (Kimi Linear's
    decay A_log, [1, 1, heads, 1]). `units`: a column's or row parameter's count of indivisible units per part
    (heads, groups) where some part has other units than the heads; `part_counts`: counts of such parts' features
    ({attribute: ((size, units), ...)}); `group_norm`: a norm whose statistics run over groups of heads, which must
    be summed over the ranks where tp exceeds the groups (`num_k_heads`).

    Kimi Delta Attention mixers (Kimi Linear, Ling's hybrid: `kind` "kda") are read into the same form: separate q, k
    and v projections with the convolution over their channels, per-channel decay gates and an output gate (from the
    hidden states, or from a low-rank latent of one head's width, whose down-projection stays whole), one head count
    for keys and values. So are Mamba-2 mixers (Bamba, Granite 4.0-H: `kind` "mamba2", `_mamba2_mixer`), their state
    groups (n_groups) as the key heads and their heads as the value heads; so are LFM2's gated short convolutions
    (`kind` "short_conv", `_short_convolution`), their channels as the heads, and Mamba-1 mixers (Jamba's: `kind`
    "mamba1", `_mamba1_mixer`), their channels as the heads, whose selective projection `row_shared` ((name, its
    outputs)) is row-parallel with its output's gradient summed over the ranks. `beside_attention`: the mixer runs beside
    the attention in the same layers, both on the layer's normed input (Falcon-H1's Mamba-2 mixer), not in its place:
    both are split. MiniMax's lightning attention (`kind` "lightning", `_lightning_attention`) too: its heads' [q k v]
    packed per head, its decays buffers of a row per head, and `whole_norm`, a norm over every head's features whose
    statistics tensor parallel sums over the ranks."""

    mixer: str
    layers: tuple[int, ...]
    num_k_heads: int
    num_v_heads: int
    columns: tuple[tuple[str, tuple[int, ...]], ...]
    output: str
    rows: tuple[tuple[str, tuple[int, ...]], ...]
    shared: tuple[str, ...]
    counts: tuple[str, ...]
    row_dims: tuple[tuple[str, int], ...] = ()
    units: tuple[tuple[str, tuple[int, ...]], ...] = ()
    part_counts: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()
    group_norm: str | None = None
    kind: str = "gdn"
    beside_attention: bool = False
    row_shared: tuple[str, int] | None = None
    whole_norm: str | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer: everything the cost model reads.

    Beyond the contract's fields: `head_dim` (default hidden / heads), `gated_mlp` (SwiGLU: three
    MLP matrices; False for GPT's two), `tied_embeddings`, `flash_attention` (no s x s attention
    matrix is stored: the attention core is recomputed in the backward pass), `softmax_fp32` (without flash attention:
    the scores' softmax runs in fp32 and keeps that output for its backward beside the probabilities cast back to
    the compute dtype, as transformers' eager attention does: 6 bytes per score in bf16 where Megatron's fused
    softmax keeps 2), `dropout` (Megatron's
    GPT stores dropout masks), `packed_unequal_qkv` (q/k/v packed in one projection with grouped-query
    heads: distcore's tensor parallel reduce-scatters its output, which equal parts do not need, unless
    `qkv_interleaved`: [q..q k v] per key/value head, split contiguously as GPT-NeoX's and Falcon's are),
    `qk_norm` (norms of the queries and keys inside attention: "head" for Qwen3-style RMSNorms over
    head_dim applied to every head, whose weights' gradients tensor parallel sums over its ranks;
    "projection" for OLMo2-style RMSNorms over all heads' features, whose statistics tensor parallel
    all-reduces; None without; their weights are counted with the layer's norms), `latent_attention`
    (DeepSeek's multi-head latent attention: its projections and attention core priced as they run, the
    down-projections to the latents whole on every tensor-parallel rank; None: q/k/v projections),
    `v_head_dim` (the value heads' width where it is not head_dim's, as in MiMo-V2-Flash: 128 beside query/key heads
    of 192; None: head_dim; latent attention has its own), `attention_output_gate` (gated attention: a gate on each
    query head's output features, q_size more outputs of the query projection in Qwen3-Next and Qwen3.5, of a
    projection of its own in AFMoE and Beam), `gated_delta_net` (the layers whose token mixer is Gated DeltaNet linear
    attention, LFM2's gated short convolution (`ShortConvolution`) or Mamba-1 (`SelectiveScan`), and their shapes;
    None: attention in every layer), and a display `name`. `structure` is set by `from_module`.

    Mixture of experts: `num_experts` routed experts (0: a dense model) of `expert_ffn_hidden_size`
    (default `ffn_hidden_size`) in the layers `moe_layers` (default: every layer; the others are dense
    layers of `ffn_hidden_size`), `experts_per_token` of them (top-k) run for each token, and
    `shared_ffn_hidden_size` the total width of the shared experts every token also runs (0: none;
    DeepSeek's n shared experts of width w are one MLP of n·w). Experts use the dense MLP's form
    (`gated_mlp`). The router is a [num_experts, hidden] matrix. `expert_input_size`: the routed experts' width
    where a latent projection narrows the hidden states before them and widens their output after (Nemotron's
    latent MoE, `moe_latent_size`; the projections run every token, whole on every tp rank, and expert parallel
    sends the latent; None: the hidden size). `expert_load_imbalance`: under expert
    parallel, the busiest rank's routed tokens over the mean. 1.2 is an assumption for dropless routing
    trained with a load-balancing loss, not a measurement; 1.0 is perfectly balanced routing (benchmarks
    that force it, such as NeMo AutoModel's "fake balanced gate").
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_kv_heads: int | None = None
    seq_len: int = 2048
    head_dim: int | None = None
    v_head_dim: int | None = None
    gated_mlp: bool = True
    tied_embeddings: bool = False
    flash_attention: bool = True
    softmax_fp32: bool = False
    dropout: bool = False
    packed_unequal_qkv: bool = False
    qkv_interleaved: bool = False
    qk_norm: str | None = None
    latent_attention: LatentAttention | None = None
    attention_output_gate: bool = False
    gated_delta_net: "GatedDeltaNet | ShortConvolution | SelectiveScan | None" = None
    num_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_hidden_size: int | None = None
    shared_ffn_hidden_size: int = 0
    expert_input_size: int | None = None
    moe_layers: tuple[int, ...] | None = None
    expert_load_imbalance: float = 1.2
    # The head's output width where it is not the vocabulary's: a task head (a classifier's labels; the
    # structure's task_head); None: an LM head of vocab_size outputs.
    head_outputs: int | None = None
    # Parameters of each decoder layer in modules no plan names (ModelStructure.unplanned): whole on every
    # tensor-parallel rank, priced as matmuls over every token there.
    unplanned_parameters: int = 0
    # Blocks of one part (Nemotron-H's: a norm and one mixer each): the layers without a token mixer (an MLP or MoE
    # block alone; not Gated DeltaNet layers) and those without an MLP (attention or a linear mixer alone; not MoE
    # layers). Each such layer has one norm.
    mixer_free_layers: tuple[int, ...] = ()
    mlp_free_layers: tuple[int, ...] = ()
    # A multimodal model's parameters outside its language model (a vision tower, its projector to the text width):
    # whole on every tensor-parallel rank, on the first pipeline stage (model states and gradient traffic priced;
    # their compute is not: it runs on the batch's images, which the spec does not know).
    media_parameters: int = 0
    # A learned position embedding's [positions, hidden] (GPT-2's wpe, OPT's, StarCoder's): whole on every tensor-parallel
    # rank, on the first pipeline stage.
    position_parameters: int = 0
    # A final norm's weight (hidden) before the head, on the last pipeline stage: False for a model without one (GPT-1;
    # OLMo's norm without parameters).
    final_norm: bool = True
    # The leading decoder layers whose outputs the model adds to before the next layer takes them (Qwen3-VL's text
    # model adds its vision tower's deepstack features after each of its first 3): no pipeline stage may end among
    # them (strategy.validate: the first stage holds more).
    layers_added_to: int = 0
    # The share of the parameters that train (requires_grad): peft's LoRA adapters beside frozen weights (0.1-1%), a
    # frozen embedding or vision tower. Gradients, optimizer states, their data-parallel traffic and the optimizer
    # step are priced for that share, and the backward's weight-gradient GEMMs too; the weights, ZeRO-3's gathers of
    # them and the input-gradient GEMMs for every parameter. Spread evenly over the model (LoRA's adapters on every
    # layer are; a frozen part in one place is not). 1.0: every parameter trains.
    trainable_fraction: float = 1.0
    name: str = ""
    structure: ModelStructure | None = field(default=None, compare=False, hash=False, repr=False)

    def __hash__(self) -> int:
        """The fields' hash, computed once: the cost model's memoised terms hash the spec on every lookup."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.compare))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __post_init__(self) -> None:
        _check_integers("ModelSpec", self, ("num_layers", "hidden_size", "vocab_size", "seq_len"))
        fraction = self.trainable_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 < fraction <= 1:
            raise ValueError(f"ModelSpec: trainable_fraction must be a share of the parameters in (0, 1] (1: every "
                             f"parameter trains; peft's LoRA: ~0.01), got {fraction!r}")
        object.__setattr__(self, "trainable_fraction", float(fraction))  # (a numpy scalar: one hash, one study name)
        # 0 heads, 0 MLP width: a model without attention or without an MLP in any layer (Mamba's)
        _check_integers("ModelSpec", self, ("num_heads", "ffn_hidden_size"), minimum=0, what="a non-negative integer")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"ModelSpec: qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if not self.num_heads:
            self._check_without_attention()
            return
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
        latent = self.latent_attention
        if self.v_head_dim is not None:
            _check_integers("ModelSpec", self, ("v_head_dim",))
            if latent is not None or self.attention_output_gate:
                raise ValueError("ModelSpec: v_head_dim is the value heads' width of plain attention; latent attention "
                                 "sets its own (LatentAttention.v_head_dim), and a gate from the query projection "
                                 "takes query-wide heads: set one of them")
        if latent is not None and self.attention_output_gate:
            raise ValueError("ModelSpec: attention_output_gate is a gate from the query projection, which latent "
                             "attention has not; set one of them")
        if latent is not None and not latent.rope_head_dim < self.head_dim:
            raise ValueError(f"ModelSpec: latent attention's rotary part ({latent.rope_head_dim}) must be narrower "
                             f"than a query head (head_dim={self.head_dim})")
        self._check_layers()

    def _check_layers(self) -> None:
        _check_integers("ModelSpec", self, ("layers_added_to",), minimum=0, what="a non-negative integer")
        if self.layers_added_to > self.num_layers:
            raise ValueError(f"ModelSpec: layers_added_to={self.layers_added_to} counts more layers than the "
                             f"{self.num_layers}")
        linear = self.gated_delta_net
        if linear is not None and linear.layers[-1] >= self.num_layers:
            raise ValueError(f"ModelSpec: gated_delta_net.layers must be layer indices in [0, {self.num_layers}), "
                             f"got {linear.layers!r}")
        self._check_experts()
        self._check_one_part_blocks()
        if not self.ffn_hidden_size and set(self.mlp_free_layers) | set(self.moe_layer_indices) != set(range(self.num_layers)):
            raise ValueError("ModelSpec: ffn_hidden_size=0 (no MLP) needs every layer an MoE layer or a block without an "
                             "MLP (mlp_free_layers); give the dense MLP's width")

    def _check_without_attention(self) -> None:
        """num_heads=0: no layer attends (each a linear mixer's, not beside attention, or a block without a token
        mixer); the attention's other widths are 0 too."""
        for name in ("num_kv_heads", "head_dim", "v_head_dim"):
            if getattr(self, name) not in (None, 0):
                raise ValueError(f"ModelSpec: num_heads=0 (no attention) takes no {name} (got {getattr(self, name)!r})")
            object.__setattr__(self, name, None if name == "v_head_dim" else 0)
        if self.latent_attention is not None or self.attention_output_gate or self.qk_norm:
            raise ValueError("ModelSpec: num_heads=0 (no attention) takes no latent_attention, attention_output_gate or "
                             "qk_norm")
        self._check_layers()
        linear = self.gated_delta_net
        mixers = set(linear.layers) if linear is not None and not linear.beside_attention else set()
        attending = sorted(set(range(self.num_layers)) - mixers - set(self.mixer_free_layers))
        if attending:
            raise ValueError(f"ModelSpec: num_heads=0 (no attention) needs every layer a linear mixer's "
                             f"(gated_delta_net.layers) or a block without a token mixer (mixer_free_layers); layers "
                             f"{attending} are neither: give the attention's heads")

    def _check_one_part_blocks(self) -> None:
        for name in ("mixer_free_layers", "mlp_free_layers"):
            layers = tuple(getattr(self, name))
            if sorted(set(layers)) != list(layers) or not all(0 <= i < self.num_layers for i in layers):
                raise ValueError(f"ModelSpec: {name} must be increasing layer indices in [0, {self.num_layers}), "
                                 f"got {getattr(self, name)!r}")
            object.__setattr__(self, name, layers)
        clashes = [("mixer_free_layers", "mlp_free_layers", set(self.mlp_free_layers)),
                   ("mixer_free_layers", "gated_delta_net.layers", set(self.linear_layer_indices)),
                   ("mlp_free_layers", "moe_layers", set(self.moe_layer_indices))]
        for first, second, others in clashes:
            both = sorted(set(getattr(self, first)) & others)
            if both:
                raise ValueError(f"ModelSpec: layers {both} are in both {first} and {second}: a block without a "
                                 "token mixer holds no linear mixer, one without an MLP no experts, and no block is "
                                 "without both")

    def _check_experts(self) -> None:
        _check_integers("ModelSpec", self, ("num_experts", "experts_per_token", "shared_ffn_hidden_size"), minimum=0,
                        what="a non-negative integer")
        if not (isinstance(self.expert_load_imbalance, (int, float)) and self.expert_load_imbalance >= 1.0):
            raise ValueError(f"ModelSpec: expert_load_imbalance is the busiest rank's tokens over the mean, at least "
                             f"1.0, got {self.expert_load_imbalance!r}")
        if not self.num_experts:
            if (self.experts_per_token or self.shared_ffn_hidden_size or self.moe_layers or self.expert_ffn_hidden_size
                    or self.expert_input_size):
                raise ValueError("ModelSpec: experts_per_token, expert_ffn_hidden_size, shared_ffn_hidden_size, "
                                 "expert_input_size and moe_layers describe a mixture of experts: set num_experts too "
                                 "(0 is a dense model)")
            return
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"ModelSpec: experts_per_token (top-k) must be between 1 and num_experts="
                             f"{self.num_experts}, got {self.experts_per_token}")
        if self.expert_input_size is not None:
            _check_integers("ModelSpec", self, ("expert_input_size",))
        if self.expert_ffn_hidden_size is None:
            object.__setattr__(self, "expert_ffn_hidden_size", self.ffn_hidden_size)
        elif not isinstance(self.expert_ffn_hidden_size, int) or self.expert_ffn_hidden_size < 1:
            raise ValueError(f"ModelSpec: expert_ffn_hidden_size must be a positive integer, got "
                             f"{self.expert_ffn_hidden_size!r}")
        if self.moe_layers is not None:  # None stays None (every layer), so that a replaced num_layers follows
            layers = tuple(self.moe_layers)
            if not layers or sorted(set(layers)) != list(layers) or not all(0 <= i < self.num_layers for i in layers):
                raise ValueError(f"ModelSpec: moe_layers must be increasing layer indices in [0, {self.num_layers}), "
                                 f"got {self.moe_layers!r}")
            object.__setattr__(self, "moe_layers", layers)

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
    def key_size(self) -> int:
        """Width of the keys the attention core reads per token: kv_size, or every head's under latent attention."""
        return self.q_size if self.latent_attention else self.kv_size

    @property
    def value_size(self) -> int:
        """Width of the values the attention core reads per token (the value projection's output): kv_size, the
        key/value heads' of v_head_dim, or, under latent attention, every value head's."""
        latent = self.latent_attention
        if latent:
            return self.num_heads * latent.v_head_dim
        return self.num_kv_heads * self.v_head_dim if self.v_head_dim else self.kv_size

    @property
    def attention_output_size(self) -> int:
        """Width of the attention core's output (the output projection's input): q_size, or the value heads'."""
        latent = self.latent_attention
        if latent:
            return self.num_heads * latent.v_head_dim
        return self.num_heads * self.v_head_dim if self.v_head_dim else self.q_size

    @property
    def attention_projections(self) -> tuple[tuple[int, int, str | None], ...]:
        """Each attention projection as (in features, out features, what tensor parallel splits: "out" for a
        column-parallel one, "in" for a row-parallel one, None for one kept whole on every rank): q/k/v in
        one and the output; under latent attention the latents' down-projections (whole) and up-projections
        (split by head)."""
        h, latent = self.hidden_size, self.latent_attention
        if latent is None:
            queries = (2 if self.attention_output_gate else 1) * self.q_size
            return (h, queries + self.kv_size + self.value_size, "out"), (self.attention_output_size, h, "in")
        query = (((h, latent.q_lora_rank, None), (latent.q_lora_rank, self.q_size, "out")) if latent.q_lora_rank
                 else ((h, self.q_size, "out"),))
        up = self.num_heads * (self.head_dim - latent.rope_head_dim + latent.v_head_dim)  # keys' latent part, values
        return (*query, (h, latent.kv_lora_rank + latent.rope_head_dim, None), (latent.kv_lora_rank, up, "out"),
                (self.attention_output_size, h, "in"))

    @property
    def attention_parameters(self) -> int:
        """The attention projections' weights (no biases)."""
        return sum(n_in * n_out for n_in, n_out, _ in self.attention_projections)

    @property
    def attention_unsplit_parameters(self) -> int:
        """Of those, the weights tensor parallel keeps whole on every rank (latent attention's down-projections)."""
        return sum(n_in * n_out for n_in, n_out, split in self.attention_projections if split is None)

    @property
    def mlp_matrices(self) -> int:
        """Matrices of one MLP: gate, up and down (SwiGLU), or up and down (GELU)."""
        return 3 if self.gated_mlp else 2

    @property
    def mlp_parameters(self) -> int:
        """The dense layers' MLP."""
        return self.mlp_matrices * self.hidden_size * self.ffn_hidden_size

    # ------------------------------------------------------------------------ mixture of experts

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """The MoE layers' indices (`moe_layers`, or every layer when it is None; none in a dense model)."""
        if not self.is_moe:
            return ()
        return tuple(range(self.num_layers)) if self.moe_layers is None else self.moe_layers

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_indices)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def expert_width(self) -> int:
        """The width the routed experts take and return: `expert_input_size` (a latent), else the hidden size."""
        return self.expert_input_size or self.hidden_size

    @property
    def expert_parameters(self) -> int:
        """One routed expert's MLP."""
        return self.mlp_matrices * self.expert_width * (self.expert_ffn_hidden_size or 0)

    @property
    def router_parameters(self) -> int:
        return self.num_experts * self.hidden_size

    @property
    def latent_projection_parameters(self) -> int:
        """The projections to the experts' latent and back (0 without one)."""
        return 2 * self.hidden_size * self.expert_input_size if self.expert_input_size else 0

    @property
    def moe_whole_parameters(self) -> int:
        """An MoE block's parameters besides its experts: the router and the latent projections, which every token
        runs, whole on every tensor-parallel rank."""
        return self.router_parameters + self.latent_projection_parameters

    @property
    def shared_expert_parameters(self) -> int:
        return self.mlp_matrices * self.hidden_size * self.shared_ffn_hidden_size

    @property
    def moe_mlp_parameters(self) -> int:
        """An MoE layer's MLP: every routed expert, the router (and latent projections) and the shared experts."""
        return self.num_experts * self.expert_parameters + self.moe_whole_parameters + self.shared_expert_parameters

    @property
    def moe_active_mlp_parameters(self) -> int:
        """What one token runs in an MoE layer: top-k experts, the router (and latent projections), the shared experts."""
        return self.experts_per_token * self.expert_parameters + self.moe_whole_parameters + self.shared_expert_parameters

    @property
    def layer_matmul_parameters(self) -> int:
        return self.attention_parameters + self.mlp_parameters

    # ------------------------------------------------------------------ Gated DeltaNet (linear attention)

    @property
    def linear_layer_indices(self) -> tuple[int, ...]:
        """The layers whose token mixer is Gated DeltaNet linear attention (their MLP dense or MoE as any layer's)."""
        return self.gated_delta_net.layers if self.gated_delta_net else ()

    @property
    def num_linear_layers(self) -> int:
        return len(self.linear_layer_indices)

    @property
    def linear_mixer_parameters(self) -> int:
        """A Gated DeltaNet layer's mixer, which holds attention's place (and the q/k norms') in it: its projections
        and its other parameters (0 without such layers)."""
        linear = self.gated_delta_net
        return linear.matmul_parameters(self.hidden_size) + linear.other_parameters if linear else 0

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
    def head_width(self) -> int:
        """The head's outputs per token: the vocabulary for an LM head, the labels for a task head."""
        return self.head_outputs or self.vocab_size

    @property
    def head_parameters(self) -> int:
        """The head's own weight (none where it is the embedding's)."""
        return 0 if self.tied_embeddings else self.head_width * self.hidden_size

    @property
    def moe_layer_parameters(self) -> int:
        """An MoE layer: attention, the MoE MLP and the norms."""
        return self.attention_parameters + self.moe_mlp_parameters + self.layer_norm_parameters

    @property
    def num_parameters(self) -> int:
        """Total parameters: layers (dense and MoE) + embedding + (untied) LM head + final norm."""
        layers = self.num_dense_layers * self.layer_parameters + self.num_moe_layers * self.moe_layer_parameters
        # A Gated DeltaNet layer: its mixer in place of attention and the q/k norms (beside them: Falcon-H1's)
        beside = self.gated_delta_net is not None and self.gated_delta_net.beside_attention
        layers += self.num_linear_layers * (self.linear_mixer_parameters - (0 if beside else self.attention_parameters
                                                                            + self.qk_norm_parameters))
        layers += self.num_layers * self.unplanned_parameters
        # Blocks of one part: no attention (nor q/k norms) or no MLP, and one norm.
        layers -= len(self.mixer_free_layers) * (self.attention_parameters + self.qk_norm_parameters + self.hidden_size)
        layers -= len(self.mlp_free_layers) * (self.mlp_parameters + self.hidden_size)
        return (layers + self.embedding_parameters + self.position_parameters + self.head_parameters
                + self.final_norm_parameters + self.media_parameters)

    @property
    def final_norm_parameters(self) -> int:
        return self.hidden_size if self.final_norm else 0

    @property
    def active_parameters(self) -> int:
        """Parameters one token runs through (the routed experts it is not sent to left out)."""
        idle = self.num_moe_layers * (self.num_experts - self.experts_per_token) * self.expert_parameters
        return self.num_parameters - idle

    def describe(self) -> str:
        kv = f", kv heads {self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        mlp = "SwiGLU" if self.gated_mlp else "GELU"
        label = f"{self.name}: " if self.name else ""
        size = f"{self.num_parameters / 1e9:.2f}B params"
        if self.is_moe:
            shared = f" + shared ffn {self.shared_ffn_hidden_size}" if self.shared_ffn_hidden_size else ""
            latent = f" on a latent of {self.expert_input_size}" if self.expert_input_size else ""
            dense = (f", {self.num_dense_layers - len(self.mlp_free_layers)} dense layers"
                     if self.num_dense_layers - len(self.mlp_free_layers) else "")
            size += (f" ({self.active_parameters / 1e9:.2f}B active), MoE {self.num_experts} experts top-"
                     f"{self.experts_per_token} of ffn {self.expert_ffn_hidden_size}{latent}{shared}{dense}")
        if self.gated_delta_net:
            size += f", {self.gated_delta_net.summary()}"
        if self.mixer_free_layers or self.mlp_free_layers:
            size += (f", blocks of one part ({len(self.mixer_free_layers)} without a token mixer, "
                     f"{len(self.mlp_free_layers)} without an MLP)")
        if self.trainable_fraction < 1:
            size += f", {self.trainable_fraction:.2%} of them trained"
        heads = f"heads={self.num_heads}{kv}" if self.num_heads else "no attention"
        ffn = f"ffn={self.ffn_hidden_size} ({mlp})" if self.ffn_hidden_size else "no MLP"
        return (f"{label}{size}, L={self.num_layers} h={self.hidden_size} {heads} {ffn} vocab={self.vocab_size} "
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
        fields["trainable_fraction"] = trainable_fraction(model)
        fields.update(overrides)
        fields.setdefault("name", type(model).__name__)
        return cls(seq_len=seq_len, structure=structure, **fields)


def trainable_fraction(model: "nn.Module") -> float:
    """The share of `model`'s parameters (each counted once, tied ones too) that require grad, rounded to 6 digits
    (a spec's field, in the search's study names); 1.0 where none does (nothing to price but a full training)."""
    counts = {id(p): (p.numel(), p.requires_grad) for p in model.parameters()}
    total = sum(n for n, _ in counts.values())
    trained = sum(n for n, grad in counts.values() if grad)
    return round(trained / total, 6) or 1e-6 if total and trained else 1.0


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
    # Mixtures of experts (the released configs; seq_len as the training benchmarks below use them).
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1): 32 layers, dim 4096, 32 heads, 8 kv heads,
    # SwiGLU experts of 14336, 8 experts top-2, vocab 32000: 46.7B parameters, 12.9B active.
    "mixtral-8x7b": ModelSpec(32, 4096, 32, 14336, 32000, num_kv_heads=8, num_experts=8, experts_per_token=2,
                              seq_len=4096, name="mixtral-8x7b"),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, hidden 2048, 32 heads of 128, 4 kv heads,
    # per-head q/k RMSNorms, 128 experts of 768 top-8 in every layer, vocab 151936: 30.5B, 3.3B active.
    "qwen3-30b-a3b": ModelSpec(48, 2048, 32, 768, 151936, num_kv_heads=4, head_dim=128, qk_norm="head",
                               num_experts=128, experts_per_token=8, seq_len=4096, name="qwen3-30b-a3b"),
    # Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct config.json; transformers' Qwen3NextConfig defaults): 48
    # layers, hidden 2048; every fourth layer gated attention (16 heads of 256, 2 kv heads, per-head q/k norms), the
    # others Gated DeltaNet (16 key heads, 32 value heads, both 128 wide, convolution of 4); 512 experts of 512
    # top-10 and a shared expert of 512 in every layer, vocab 151936: 79.7B (the model: 80B; its shared experts'
    # one-output gates, 98k parameters, not counted).
    "qwen3-next-80b-a3b": ModelSpec(48, 2048, 16, 512, 151936, num_kv_heads=2, head_dim=256, qk_norm="head",
                                    attention_output_gate=True, num_experts=512, experts_per_token=10,
                                    shared_ffn_hidden_size=512, seq_len=4096, name="qwen3-next-80b-a3b",
                                    gated_delta_net=GatedDeltaNet(layers=tuple(i for i in range(48) if i % 4 != 3),
                                                                  num_k_heads=16, num_v_heads=32, head_k_dim=128,
                                                                  head_v_dim=128)),
    # gpt-oss-20b (openai/gpt-oss-20b config.json): 24 layers, hidden 2880, 64 heads of 64, 8 kv heads, 32
    # experts of 2880 top-4, vocab 201088: 20.9B. Priced as full causal attention in every layer (the model
    # alternates 128-token sliding windows) and without the experts' biases.
    "gpt-oss-20b": ModelSpec(24, 2880, 64, 2880, 201088, num_kv_heads=8, head_dim=64, num_experts=32,
                             experts_per_token=4, seq_len=4096, name="gpt-oss-20b"),
    # DeepSeek-V3-like (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", Sec. 4.2): 61 layers, hidden 7168, the
    # first 3 dense (ffn 18432), then 256 routed experts of 2048 top-8 and 1 shared expert of 2048, vocab
    # 129280; multi-head latent attention of 128 heads (query latent 1536, key/value latent 512, rotary key 64,
    # query heads 192 wide, value heads 128): 671B parameters (the model: 671B), 37.6B active counting the
    # embedding and the head (DeepSeek counts 37B); no multi-token prediction.
    "deepseek-v3-like": ModelSpec(61, 7168, 128, 18432, 129280, head_dim=192, num_experts=256,
                                  latent_attention=LatentAttention(kv_lora_rank=512, rope_head_dim=64, v_head_dim=128,
                                                                   q_lora_rank=1536),
                                  experts_per_token=8, expert_ffn_hidden_size=2048, shared_ffn_hidden_size=2048,
                                  moe_layers=tuple(range(3, 61)), seq_len=4096, name="deepseek-v3-like"),
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
    """The decoder layers: the ModuleList holding the most parameters of those whose entries are of one type, or of
    entries that differ in their token mixer alone (Jamba's Mamba and attention layers, two classes of the same
    children but the mixer: `_alike_but_the_mixer`; the experts of one of its layers, a list of one type, hold
    fewer)."""
    from torch import nn

    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        size = _numel(module)
        if not size or (len({type(child) for child in module}) > 1 and not _alike_but_the_mixer(module)):
            continue
        if best is None or (size, len(module)) > best[0]:
            best = ((size, len(module)), name, module)
    if best is None:
        raise UnrecognisedModel(
            "no decoder-layer list found: expected an nn.ModuleList of identical blocks (e.g. model.layers) "
            "holding the transformer layers; fall back to data parallel (with sharding), or pass a ModelSpec")
    return best[1], best[2]


def _alike_but_the_mixer(layers) -> bool:
    """Entries of two or more classes whose children bear the same names (at least two: the MLP, a norm) but their
    token mixer, one each (Jamba's `mamba` or `self_attn`), and their norms (children of vectors alone: OLMo-Hybrid's
    pre-norm linear-attention layers beside post-norm attention layers)."""
    children = [{name: child for name, child in layer.named_children() if any(True for _ in child.parameters())}
                for layer in layers]
    common = set.intersection(*(set(c) for c in children))

    def mixers(own: dict) -> int:  # the children not shared holding a matrix
        return sum(any(p.dim() > 1 for p in child.parameters()) for name, child in own.items() if name not in common)

    return (len(common) >= 2 and len({frozenset(c) for c in children}) > 1
            and all(mixers(own) == 1 for own in children))


def is_lora_layer(module) -> bool:
    """A peft LoRA layer wrapping a projection (peft's `lora.Linear`, injected in its place by `get_peft_model`): its
    `base_layer` beside `lora_A` and `lora_B` module dicts (duck-typed: peft is not a dependency)."""
    from torch import nn

    return (module is not None and isinstance(getattr(module, "base_layer", None), nn.Module)
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict))


def _is_linear(module) -> bool:
    """An nn.Linear, or a LoRA layer wrapping one (read as the projection it wraps: its in/out features)."""
    from torch import nn

    return isinstance(module, nn.Linear) or is_lora_layer(module) and isinstance(module.base_layer, nn.Linear)


def _outside_lora_layers(module):
    """`module.named_modules()` without what LoRA layers hold (their base layer and adapters): each LoRA layer stands
    for its projection."""
    inside = None
    for name, child in module.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        inside = f"{name}." if is_lora_layer(child) else inside
        yield name, child


def _linears(block) -> list[_Linear]:
    """Every 2-D weight in `block` as a Linear: nn.Linear-style [out, in] unless the module is not a
    Linear and applies a bare [in, out] parameter (decided by the caller from the hidden size). A LoRA layer is its
    projection."""
    from torch import nn

    found = []
    for name, module in _outside_lora_layers(block):
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Embedding) or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            continue
        if isinstance(module, nn.Linear) or hasattr(module, "in_features"):
            found.append(_Linear(name, _parent(name), int(module.in_features), int(module.out_features)))
        elif is_conv1d(module):  # GPT-2's [in, out] weight
            found.append(_Linear(name, _parent(name), int(weight.shape[0]), int(weight.shape[1])))
        else:  # unknown convention: record [rows, cols]; resolved against the hidden size later
            found.append(_Linear(name, _parent(name), int(weight.shape[1]), int(weight.shape[0]), bare=True))
    return found


def is_conv1d(module) -> bool:
    """transformers' Conv1D (GPT-2, GPT-1, GPT-SW3): a Linear whose weight is stored [in, out] (`nx`, `nf`) and applied
    as `addmm(bias, x, weight)`."""
    weight = getattr(module, "weight", None)
    return (any(cls.__name__ == "Conv1D" for cls in type(module).__mro__) and isinstance(getattr(module, "nf", None), int)
            and getattr(weight, "shape", None) is not None and tuple(weight.shape) == (module.nx, module.nf))


def _orient(linears: list[_Linear], hidden: int) -> None:
    """Bare [in, out] weights were read as [out, in]; flip those that only make sense flipped."""
    for lin in linears:
        if lin.bare and lin.in_features != hidden and lin.out_features == hidden:
            lin.in_features, lin.out_features = lin.out_features, lin.in_features


def _unplanned_modules(block, covered: list[str]) -> tuple[tuple[str, ...], int]:
    """(the top-most modules of `block` holding parameters outside every `covered` name, their parameters): a module
    with parameters of its own under none of them, not norm-like (1-D parameters only and no child holding any: those
    run on sequence slices as the layer norms do), taken up to its highest ancestor that holds nothing covered."""
    def under(name: str, prefix: str) -> bool:
        return not prefix or name == prefix or name.startswith(prefix + ".")

    modules = dict(block.named_modules())
    found: list[str] = []
    for name, module in modules.items():
        own = list(module.parameters(recurse=False))
        if not name or not own or any(under(name, c) for c in covered):
            continue
        if all(p.dim() == 1 for p in own) and len(own) == sum(1 for _ in module.parameters()):
            continue  # norm-like
        top, parts = name, name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            ancestor = ".".join(parts[:i])
            if any(under(c, ancestor) for c in covered):
                break
            top = ancestor
        if top not in found:  # (the highest such ancestor: one per subtree holding nothing covered)
            found.append(top)
    return tuple(found), sum(p.numel() for f in found for p in modules[f].parameters())


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


def readable_attr(obj, name: str):
    """`getattr(obj, name, None)`, also None where reading raises: transformers' heterogeneous configs (per-layer
    attributes, Dots 3's) raise a RuntimeError on a global read of an attribute that may differ per layer, and
    such a value is not the model's anyway (the layers' shapes then decide)."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - any refusal to read is "not available"
        return None


def _first_attr(objects, attrs) -> int | None:
    for obj in objects:
        if obj is None:
            continue
        for attr in attrs:
            value = readable_attr(obj, attr)
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


def _group_roles(linears: list[_Linear], hidden: int, block, moe_block: str | None = None,
                 mlp: bool = True) -> tuple[str, str | None]:
    """(attention parent, mlp parent): the two groups of projections, by shapes, attributes and names. With
    `moe_block` (a layer whose MLP is that mixture of experts, its projections left out of `linears`), or without
    `mlp` (a block of attention alone), only the attention group is looked for, and the MLP parent is None."""
    alone = moe_block is not None or not mlp
    groups: dict[str, list[_Linear]] = {}
    for lin in linears:
        groups.setdefault(lin.parent, []).append(lin)
    outs = {p: [l for l in g if l.out_features == hidden] for p, g in groups.items()}
    candidates = [p for p in groups if outs[p] and any(l.in_features == hidden for l in groups[p])]
    if len(candidates) < (1 if alone else 2):
        found = [f'{l.name} [{l.in_features}->{l.out_features}]' for l in linears]
        if moe_block is not None:
            raise UnrecognisedModel(
                f"could not find the attention block beside the mixture of experts {moe_block} in a decoder layer "
                f"({type(block).__name__}): projections found {found}; expected q/k/v or qkv + output projection")
        raise UnrecognisedModel(
            f"could not find separate attention and MLP blocks in a decoder layer ({type(block).__name__}): "
            f"projections found {found}; expected an attention module (q/k/v or qkv + output projection) and an "
            "MLP module (gate/up or gate_up + down), or a mixture of experts (a router to the expert count beside "
            "3-D stacked expert weights or a list of expert MLPs)")

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
    if alone:
        return attention, None
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


def _mixer_output(module, width: int, hidden: int, *, recurse: bool = False) -> str | None:
    """The name of a linear mixer's projection from its `width` features back to the hidden size (a child, or any
    submodule with `recurse`); where several have that shape (a square gate beside it), the one whose name says
    output (out_proj, o_proj), as for attention. None: no such projection."""
    modules = module.named_modules() if recurse else module.named_children()
    candidates = [_Linear(n, "", c.in_features, c.out_features) for n, c in modules
                  if _is_linear(c) and (c.in_features, c.out_features) == (width, hidden)]
    return _output_projection(candidates, hidden, _O_WORDS).name if candidates else None


def _name_matches(leaf: str, word: str) -> bool:
    """'o' matches 'o' and 'o_proj' (not 'q_proj'); longer words match anywhere ('out' in 'attn_out')."""
    return leaf == word or leaf.startswith(word + "_") or (len(word) > 2 and word in leaf)


# Packed q/k/v projections that hold [q..q k v] per key/value head: every transformers model naming it so (GPT-NeoX,
# Bloom, Persimmon: [q k v] per head; Falcon: per key/value head, its multi-query layout's one head making it
# [q | k | v]). Code packing [q | k | v] with several key/value heads under this name (ChatGLM's remote code) computes
# other numbers when split so, which distcore's block check finds before training: the block then runs in global
# view, whatever the layout (block_check.py).
_INTERLEAVED_QKV = ("query_key_value",)
# An attention's own output gate: a projection from the hidden states beside q/k/v of one of these names (AFMoE's and
# Beam's gate_proj, Laguna's g_proj), read as such where its width fits the query heads (`_recognise_layers`).
_ATTENTION_GATE_WORDS = ("gate", "g")
_O_WORDS = ("o_proj", "out_proj", "o", "wo", "dense", "c_proj", "proj_out")
_DOWN_WORDS = ("down", "w2", "fc2", "out", "c_proj", "dense_4h_to_h")


def _attention_parts(group: list[_Linear], hidden: int) -> dict:
    """q/k/v/o or qkv/o in the attention group, with q and kv widths."""
    o = _output_projection(group, hidden, _O_WORDS)
    ins = [l for l in group if l.in_features == hidden and l is not o]
    q_size = o.in_features
    latent = [l for l in group if l.in_features != hidden and l is not o]
    if latent:
        return _latent_attention_parts(ins, latent, o)
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
        # Value heads may be wider or narrower than the query/key heads (MiMo-V2-Flash: 192 and 128): the output
        # projection then takes heads x the value heads' width, which `_value_head_dim` checks once heads are known.
        # Qwen3-Next's and Qwen3.5's gated attention: the query projection also gives each head its output gate,
        # [query | gate] per head, twice what the output projection takes (a contiguous tp split keeps heads whole).
        gated_query = q.out_features == 2 * o.in_features
        q_size = o.in_features if gated_query else q.out_features
        # A projection of its own for the gate (its width checked against the heads once they are known); any other
        # projection beside q/k/v stays whole on every rank, which the block check finds wrong if it is
        gates = [l for l in ins if l not in (q, k, v) and any(_name_matches(l.leaf, w) for w in _ATTENTION_GATE_WORDS)
                 and q_size % l.out_features == 0]
        return dict(q=q.name, k=k.name, v=v.name, o=o.name, kv_size=k.out_features, v_size=v.out_features,
                    o_size=o.in_features, gated_query=gated_query, q_size=q_size, gate=gates[0].name if len(gates) == 1 else None,
                    gate_size=gates[0].out_features if len(gates) == 1 else 0)
    if len(ins) == 1:
        qkv = ins[0]
        rest = qkv.out_features - q_size
        if rest <= 0 or rest % 2:
            raise UnrecognisedModel(
                f"fused projection {qkv.name} has {qkv.out_features} outputs, which is not q ({q_size}) + 2 x kv")
        return dict(qkv=qkv.name, o=o.name, q_size=q_size, kv_size=rest // 2)
    raise UnrecognisedModel(
        f"attention block has {len(ins)} input projection(s) {[l.name for l in ins]}; expected q/k/v or a fused qkv")


def _value_head_dim(attn: dict, heads: int, kv_heads: int, head_dim: int, where: str) -> int | None:
    """The value heads' width where the value projection's differs from the key projection's (None: equal): the
    value projection holds kv_heads of them and the output projection takes heads of them; else refused."""
    v_size, kv_size = attn.get("v_size", attn["kv_size"]), attn["kv_size"]
    if v_size == kv_size:
        return None
    value = v_size // kv_heads
    if v_size % kv_heads or attn["o_size"] != heads * value or attn.get("gated_query") or attn.get("gate"):
        raise UnrecognisedModel(
            f"{where}: key and value projections differ in width ({attn['k']}: {kv_size}, {attn['v']}: {v_size}), and "
            f"the value projection's {v_size} outputs are not {kv_heads} value heads whose {heads} query heads' outputs "
            f"the output projection takes ({attn['o']}: {attn['o_size']} inputs); expected equal k/v projections, or "
            "value heads of their own width")
    return value


def _latent_attention_parts(ins: list[_Linear], latent: list[_Linear], o: _Linear) -> dict:
    """Multi-head latent attention (DeepSeek-V2/V3): the hidden state goes down to a key/value latent (with a
    rotary key shared by the heads: kv_a_proj_with_mqa) and, optionally, a query latent (q_a_proj); second
    projections take the latents up to every head (kv_b_proj, q_b_proj). Recognised by its names, the
    DeepSeek ones: a second-stage projection of another naming is not guessed at. q_size is the query heads'
    width, and kv_size too (every head has its own key); `latent_widths` become the spec's LatentAttention
    (`_latent_attention`), which the cost model prices."""
    def leaf_of(lin):
        return lin.leaf.lower()

    kv_b = [l for l in latent if leaf_of(l).startswith("kv_b")]
    q_b = [l for l in latent if leaf_of(l).startswith("q_b")]
    kv_a = [l for l in ins if leaf_of(l).startswith("kv_a")]
    q_a = [l for l in ins if leaf_of(l).startswith("q_a")]
    q_whole = [l for l in ins if leaf_of(l) in ("q_proj", "q")]
    q = q_b[0] if q_b and q_a else (q_whole[0] if q_whole and not q_b else None)
    if len(kv_b) != 1 or len(kv_a) != 1 or q is None or len(latent) != len(kv_b) + len(q_b):
        raise UnrecognisedModel(
            f"attention block has projections from inside the block ({[l.name for l in latent]}) beside "
            f"{[l.name for l in ins]}: expected q/k/v, a fused qkv, or DeepSeek's latent attention (kv_a_proj*, "
            "kv_b_proj, and q_a_proj + q_b_proj or q_proj)")
    # The latents' widths (query latent, key/value latent, rotary key) and the up-projection's and output's
    # widths: LatentAttention once the heads are known (`_latent_attention`).
    widths = (q_a[0].out_features if q_b else 0, kv_b[0].in_features, kv_a[0].out_features - kv_b[0].in_features,
              kv_b[0].out_features, o.in_features)
    # An output gate of its own from the hidden states (Ling's hybrid: one per head), split with the query heads
    # (its width checked against them once they are known, as for q/k/v attention)
    gates = [l for l in ins if l not in (q, *kv_a, *q_a) and any(_name_matches(l.leaf, w) for w in _ATTENTION_GATE_WORDS)]
    return dict(q=q.name, latent_kv=kv_b[0].name, latent_kv_down=kv_a[0].name, o=o.name, q_size=q.out_features,
                kv_size=q.out_features, latent_widths=widths, gate=gates[0].name if len(gates) == 1 else None,
                gate_size=gates[0].out_features if len(gates) == 1 else 0)


def _latent_attention(widths: tuple[int, ...], heads: int, head_dim: int) -> LatentAttention | None:
    """LatentAttention from `_latent_attention_parts`' widths and the query heads, or None when they do not fit
    together as DeepSeek's do (the up-projection: every head's key part from the latent and its value)."""
    q_lora, kv_lora, rope, up, output = widths
    value_dim = output // heads
    if output % heads or not 0 < rope < head_dim or up != heads * (head_dim - rope + value_dim):
        return None
    return LatentAttention(kv_lora_rank=kv_lora, rope_head_dim=rope, v_head_dim=value_dim, q_lora_rank=q_lora)


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
    config = getattr(model, "config", None)
    max_positions = _first_attr([config], ("max_position_embeddings", "n_positions"))
    positions = [name for name, module in model.named_modules()
                 if isinstance(module, nn.Embedding) and not name.startswith(inside) and module is not emb
                 and module.embedding_dim == hidden and isinstance(max_positions, int)
                 and max_positions <= module.num_embeddings <= max_positions + 2]
    position_embedding = positions[0] if len(positions) == 1 else None

    final_norm = None
    lm_head = None
    tied_head = None  # a Linear registered with the embedding's own weight
    task_head = None  # a Linear from the hidden size to something else than the vocabulary (a classifier)
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.startswith(inside) or name.startswith(emb_name + "."):
            continue
        owner = _parent(name)
        if param.dim() == 1 and param.shape[0] == hidden and name.endswith("weight"):
            final_norm = owner  # the last one registered wins (the norm before the head)
        elif (param.dim() == 2 and param.shape[1] == hidden and param.shape[0] != vocab and name.endswith(".weight")
              and isinstance(model.get_submodule(owner), nn.Linear)):
            task_head = owner  # the last one registered wins
        elif param.dim() == 2 and tuple(param.shape) in ((vocab, hidden), (hidden, vocab)):
            module = model.get_submodule(owner) if owner else model
            if isinstance(module, nn.Embedding) and param is not emb.weight:
                continue  # another lookup table, never the head (Gemma 4's per-layer inputs: [vocab, layers x width])
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
                    lm_head_layout="linear", tied=True, task_head=None if tied_head else task_head,
                    position_embedding=position_embedding)
    return dict(embedding=emb_name, vocab=vocab, final_norm=final_norm, lm_head=lm_head[0], lm_head_param=lm_head[1],
                lm_head_layout=lm_head[2], tied=False, task_head=None, position_embedding=position_embedding)


# Attribute names that hold the number of experts each token is sent to (HF, Megatron, torchtitan).
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "experts_per_token", "moe_top_k", "moe_router_topk", "topk",
                "top_k_experts")  # the last: Gemma 4's


def _ranges(indices: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2, 5'."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class _MoEBlock:
    """A mixture-of-experts block found in one layer (names relative to the layer)."""

    block: str
    router: str
    experts: str
    layout: str  # "stacked" or "list"
    num_experts: int
    expert_ffn: int
    gated: bool
    shared: tuple[str, ...]
    shared_ffn: int
    top_k: int | None
    latent: int = 0  # the experts' width where projections to a latent and back surround them (Nemotron's)

    def shape(self) -> tuple:
        return (self.num_experts, self.expert_ffn, self.gated, self.shared_ffn, self.top_k, self.latent)


def _stacked_experts(module, hidden: int) -> tuple[int, int, bool] | None:
    """(experts, ffn, gated) of 3-D expert weights held directly by `module` ([E, out, in] as Hugging Face
    stores them, or [E, in, out]): the output projection maps ffn -> hidden, the input one(s) hidden ->
    ffn (gate and up), 2·ffn (packed gate_up) or ffn alone (a plain MLP)."""
    weights = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    if len(weights) < 2 or len({p.shape[0] for _, p in weights}) != 1 or weights[0][1].shape[0] < 2:
        return None
    widths = []  # the non-hidden width of each weight
    for _, p in weights:
        a, b = int(p.shape[1]), int(p.shape[2])
        if hidden not in (a, b):
            return None
        widths.append(b if a == hidden else a)
    down = next((i for i, (n, _) in enumerate(weights) if any(_name_matches(n.lower(), w) for w in _DOWN_WORDS)),
                len(weights) - 1)
    ffn = widths[down]
    inputs = sorted(w for i, w in enumerate(widths) if i != down)
    if inputs == [2 * ffn]:
        return int(weights[0][1].shape[0]), ffn, True
    if inputs == [ffn, ffn]:
        return int(weights[0][1].shape[0]), ffn, True
    if inputs == [ffn]:
        return int(weights[0][1].shape[0]), ffn, False
    return None


def _mlp_of(module, hidden: int) -> dict | None:
    """_mlp_parts of a module that is one MLP (hidden -> ffn -> hidden), else None."""
    linears = _linears(module)
    _orient(linears, hidden)
    if not (any(l.out_features == hidden for l in linears) and any(l.in_features == hidden for l in linears)):
        return None  # not hidden -> ... -> hidden (e.g. Qwen2-MoE's shared-expert gate, hidden -> 1)
    try:
        return _mlp_parts(linears, hidden)
    except UnrecognisedModel:
        return None


def _listed_experts(module, hidden: int) -> tuple[int, int, bool] | None:
    """(experts, ffn, gated) of an nn.ModuleList of identical MLPs."""
    from torch import nn

    if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(m) for m in module}) != 1:
        return None
    parts = [_mlp_of(m, hidden) for m in module]
    if any(p is None for p in parts) or len({(p["ffn"], p["gated"]) for p in parts}) != 1:
        return None
    return len(module), parts[0]["ffn"], parts[0]["gated"]


def _latent_width(block, hidden: int) -> int:
    """The latent width of `block`'s projections from the hidden size to a narrower latent and back, one Linear each
    (Nemotron's fc1_latent_proj and fc2_latent_proj around its experts), else 0."""
    linears = [c for c in block.children() if _is_linear(c)]
    down = {c.out_features for c in linears if c.in_features == hidden and c.out_features < hidden}
    up = {c.in_features for c in linears if c.out_features == hidden and c.in_features < hidden}
    return next(iter(down)) if len(down) == 1 and down == up else 0


def _moe_block(layer, hidden: int) -> _MoEBlock | None:
    """The layer's mixture-of-experts block, if it has one (see the module docstring). Experts on a latent narrower
    than the hidden size, projected to and from it by the block (`_latent_width`), are read at that width."""
    for name, module in layer.named_modules():
        block_name = _parent(name)
        block = layer.get_submodule(block_name) if block_name else layer
        found, layout, latent = _stacked_experts(module, hidden), "stacked", 0
        if found is None and name and (width := _latent_width(block, hidden)):
            found = _stacked_experts(module, width)
            latent = width if found is not None else 0
        if found is None:
            found, layout = _listed_experts(module, hidden), "list"
        if found is None:
            continue
        num_experts, ffn, gated = found
        inside_experts = name + "."
        router = None
        for pname, param in block.named_parameters():
            full = _join(block_name, pname)
            if full.startswith(inside_experts) or param.dim() != 2:
                continue
            if tuple(param.shape) in ((num_experts, hidden), (hidden, num_experts)) and num_experts != hidden:
                router = full
                break
        if router is None:
            continue  # stacked weights without a router beside them are not a mixture of experts
        router_owner = _parent(router)
        shared, shared_ffn = [], 0
        for child_name, child in block.named_children():
            full = _join(block_name, child_name)
            if full in (name, router_owner):
                continue
            parts = _mlp_of(child, hidden)
            if parts is not None:
                shared.append(full)
                shared_ffn += parts["ffn"]
        if not shared and block_name and "." not in block_name:
            # An MLP beside the block in the layer, which every token runs (Granite's shared_mlp, added to the block's
            # output): a shared expert outside the block
            for child_name, child in layer.named_children():
                parts = _mlp_of(child, hidden) if _hint(child_name, ("shared", *_MLP_WORDS)) else None
                if child_name != block_name and parts is not None:
                    shared.append(child_name)
                    shared_ffn += parts["ffn"]
        objects = [block, layer.get_submodule(router_owner) if router_owner else layer]
        objects += [getattr(o, "config", None) for o in objects]
        top_k = _first_attr(objects, _TOP_K_ATTRS)
        return _MoEBlock(block_name, router, name, layout, num_experts, ffn, gated, tuple(shared), shared_ffn, top_k,
                         latent)
    return None


def _moe_layers(layers, hidden: int, overrides: dict) -> tuple[dict[int, _MoEBlock], dict]:
    """({layer index: its MoE block}, the spec's expert fields): every MoE layer must have the same shape."""
    blocks = {i: b for i, layer in enumerate(layers) if (b := _moe_block(layer, hidden)) is not None}
    if not blocks:
        return {}, {}
    shapes = {b.shape() for b in blocks.values()}
    if len(shapes) != 1 or len({(b.block, b.router, b.experts) for b in blocks.values()}) != 1:
        raise UnrecognisedModel(
            "mixture-of-experts layers differ in structure or shape (experts, expert ffn, gated, shared ffn, top-k): "
            + "; ".join(f"layer {i}: {b.block} {b.shape()}" for i, b in blocks.items()))
    first = next(iter(blocks.values()))
    top_k = overrides.get("experts_per_token") or first.top_k
    if not top_k:
        raise UnrecognisedModel(
            f"mixture of experts {first.block} ({first.num_experts} experts): the number of experts per token was "
            f"not found (an attribute such as {', '.join(_TOP_K_ATTRS[:3])} on the block, its router or a config); "
            "call ModelSpec.from_module(model, experts_per_token=...)")
    fields = dict(num_experts=first.num_experts, experts_per_token=top_k, expert_ffn_hidden_size=first.expert_ffn,
                  shared_ffn_hidden_size=first.shared_ffn, expert_input_size=first.latent or None,
                  moe_layers=None if len(blocks) == len(layers) else tuple(blocks))  # None: every layer
    experts = layers[next(iter(blocks))].get_submodule(first.experts)
    if first.layout == "stacked" and runs_every_token(experts) and "experts_per_token" not in overrides:
        # Llama 4's experts: every expert runs every token (the router's weights zero the others' outputs), so
        # all of them cost per token, and under expert parallel every rank gets the same rows (no imbalance).
        fields.update(experts_per_token=first.num_experts, expert_load_imbalance=1.0)
    return blocks, fields


def runs_every_token(experts: "nn.Module") -> bool:
    """Whether stacked experts run every expert on every token: their forward takes the hidden states alone
    (Llama 4's, on [experts x tokens] rows), not Hugging Face's routed (hidden_states, top_k_index,
    top_k_weights). distcore's expert parallel probes the rest before it splits them."""
    signature = inspect.signature(experts.forward)

    def takes(n: int) -> bool:
        try:
            signature.bind(*[None] * n)
        except TypeError:
            return False
        return True

    return takes(1) and not takes(3)


def _recognise(model, overrides: dict) -> tuple[ModelStructure, dict]:
    from torch import nn

    if not isinstance(model, nn.Module):
        raise UnrecognisedModel(f"expected an nn.Module, got {type(model).__name__}")
    layers_name, layers = _find_layer_list(model)
    try:
        return _recognise_layers(model, layers_name, layers, overrides)
    except UnrecognisedModel as error:
        error.layers = error.layers or layers_name
        raise


def _recognise_layers(model, layers_name: str, layers, overrides: dict) -> tuple[ModelStructure, dict]:
    from torch import nn

    emb_dims = [m.embedding_dim for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    hidden = overrides.get("hidden_size") or _hidden_size(layers[0], emb_dims)
    if not hidden:
        raise UnrecognisedModel(f"no projections found in the decoder layer {layers_name}.0 ({type(layers[0]).__name__})")
    moe_blocks, moe_fields = _moe_layers(layers, hidden, overrides)
    dense = [i for i in range(len(layers)) if i not in moe_blocks]
    mixers = {i: found for i, layer in enumerate(layers) if (found := _linear_mixer(layer)) is not None}
    # A Mamba-2 mixer in every layer runs beside the attention (Falcon-H1's parallel hybrid), not in its place: both
    # are split, in every layer. (A model of Mamba-2 layers alone has no attention to read the structure from, and is
    # refused there.)
    beside = (len(mixers) == len(layers) and all(_is_mamba2_mixer(layers[i].get_submodule(n)) for i, n in mixers.items())
              and any(not l.name.startswith(mixers[0] + ".") for l in _linears(layers[0])))  # and something else
    beside_mixer, beside_note = None, None
    if beside:
        try:
            beside_mixer = dataclasses.replace(_linear_attention(layers_name, layers, mixers, hidden),
                                               beside_attention=True)
        except UnrecognisedModel as error:  # read as before: a module no plan names, whole on every tp rank
            mixers, beside, beside_note = {}, False, f"the Mamba-2 mixers beside the attention are not split ({error})"
    mixer_free, mlp_free = _one_part_blocks(layers, hidden, moe_blocks, mixers)
    attention_layers = [i for i in range(len(layers)) if (beside or i not in mixers) and i not in mixer_free]
    dense_mlp = [i for i in dense if i not in mlp_free]  # the layers holding a dense MLP
    if not attention_layers and not moe_blocks and len(mlp_free) == len(layers):
        return _recognise_mixers_alone(model, layers_name, layers, mixers, hidden)
    if not attention_layers:
        raise UnrecognisedModel(f"every layer of {layers_name} mixes tokens by linear attention ({mixers[0]}) and "
                                "holds an MLP or experts beside it: no attention layer to read the structure from")
    # Attention (and the dense MLP) are read from a dense attention layer where there is one, else from an MoE
    # layer without its MoE block's projections.
    index = next((i for i in dense if i in attention_layers), attention_layers[0])
    # Where every dense layer mixes tokens by linear attention (Kimi Linear's and Ling's first layers), the attention
    # is read from an MoE layer and the dense MLP from the first dense layer, beside its linear mixer; where blocks
    # hold one part each (Nemotron-H), from the first block holding an MLP.
    mlp_layer = index if index in dense_mlp else (dense_mlp[0] if dense_mlp else index)
    if not dense_mlp and not moe_blocks:
        # Blocks of one part and none of them an MLP or experts (a Nemotron-H layout of Mamba-2 and attention blocks
        # alone): no MLP to read the structure's MLP from; refused as before, so that data parallel still applies.
        raise UnrecognisedModel(f"no decoder layer of {layers_name} holds an MLP or a mixture of experts (blocks of one "
                                f"part: {len(mlp_free)} without an MLP); expected an MLP module beside or instead of "
                                "the token mixer")
    block = layers[index]
    moe = moe_blocks.get(index) or (next(iter(moe_blocks.values())) if moe_blocks else None)
    linears = _linears(block)
    if moe is not None and index in moe_blocks:
        linears = [l for l in linears if not (l.name == moe.block or l.name.startswith(moe.block + "."))]
    if beside:  # the mixer beside the attention is read on its own (_linear_attention)
        linears = [l for l in linears if not (l.name == mixers[index] or l.name.startswith(mixers[index] + "."))]
    _orient(linears, hidden)
    try:
        attention, mlp = _group_roles(linears, hidden, block, moe_block=moe.block if index in moe_blocks else None,
                                      mlp=index not in mlp_free)
    except UnrecognisedModel as error:
        if not beside:
            raise
        # A Mamba-2 mixer and an MLP in every layer (Bamba without attention layers): no attention beside the mixer
        raise UnrecognisedModel(f"every layer of {layers_name} mixes tokens by linear attention ({mixers[index]}) and "
                                f"holds no attention beside it to read the structure from ({error})") from None
    attn_module = block.get_submodule(attention) if attention else block
    _refuse_sequence_mixers(attn_module, attention or "the layer", layers_name, index)
    attn = _attention_parts([l for l in linears if l.parent == attention], hidden)
    if mlp_layer != index:
        mixer = mixers.get(mlp_layer)
        dense_linears = [l for l in _linears(layers[mlp_layer])
                         if mixer is None or not (l.name == mixer or l.name.startswith(mixer + "."))]
        _orient(dense_linears, hidden)
        parents = {l.parent for l in dense_linears}
        if len(parents) != 1:
            raise UnrecognisedModel(f"{layers_name}: the dense layers ({_ranges(tuple(dense))}) all mix tokens by linear "
                                    f"attention, and the projections of {layers_name}.{mlp_layer} beside its mixer "
                                    f"({[l.name for l in dense_linears]}) are no one MLP module")
        mlp = parents.pop()
        mlp_parts = _mlp_parts(dense_linears, hidden)
    else:
        mlp_parts = _mlp_parts([l for l in linears if l.parent == mlp], hidden) if dense_mlp else {}
    head_overrides = overrides
    if attn.get("latent_kv") and "head_dim" not in overrides and getattr(attn_module, "qk_head_dim", None):
        # DeepSeek's config head_dim is the rotary part alone; a query head is qk_head_dim wide.
        head_overrides = {**overrides, "head_dim": attn_module.qk_head_dim}
    heads, kv_heads, head_dim = _heads(attn_module, block, model, _rotary_head_dim(block, model),
                                       attn["q_size"], attn["kv_size"], head_overrides)
    if heads % kv_heads:
        raise UnrecognisedModel(
            f"{layers_name}.{index}.{attention or ''}: {heads} query heads of width {head_dim} do not group over "
            f"{kv_heads} key/value heads (projection widths {attn['q_size']} and {attn['kv_size']}): not attention "
            "as tridist reads it; call ModelSpec.from_module(model, num_heads=..., num_kv_heads=...) if it is")
    v_head_dim = _value_head_dim(attn, heads, kv_heads, head_dim, f"{layers_name}.{index}.{attention or ''}")
    shape_notes = _check_layers_alike(layers_name, layers, index, mlp if dense_mlp else None, moe_blocks, tuple(mixers),
                                      attention=attention,
                                      one_part=block_parts(mixer_free, mlp_free))
    linear = beside_mixer or (_linear_attention(layers_name, layers, mixers, hidden) if mixers else None)
    linear_shape = _gated_delta_net_shape(layers, linear, hidden) if linear else None
    outer = _outer_parts(model, layers_name, hidden)
    qk_norm, qk_norms = _qk_norms(attn_module, attention, head_dim, attn["q_size"], attn["kv_size"], hidden)
    if attn.get("latent_kv"):  # the latents' norms (q_a_layernorm, kv_a_layernorm) are not q/k norms
        qk_norm, qk_norms = None, ()
    norms = tuple(n for n in _norm_names(block, hidden) if n not in qk_norms)  # OLMo2's q norm can be hidden-wide
    if moe is not None:  # norms inside the experts (none in the families known) are not layer norms
        norms = tuple(n for n in norms if not n.startswith(moe.block + "."))
    notes = list(shape_notes) + ([beside_note] if beside_note else [])
    projections = [attn.get(k) for k in ("q", "k", "v", "o", "qkv", "latent_kv", "latent_kv_down", "gate")]
    covered = [attention or None, *([None] if attention else projections), *norms, *qk_norms,
               linear.mixer if linear else None]
    dense_covered = [mlp or None, *([None] if mlp else [mlp_parts.get(k) for k in ("gate", "up", "down", "gate_up")])]
    unplanned, unplanned_parameters = (), 0
    moe_parts = ([moe.block, *moe.shared] if moe.block else [moe.router.rpartition(".")[0].partition(".")[0], moe.experts,
                                                              *moe.shared]) if moe is not None else []
    kinds: dict[tuple[bool, ...], int] = {}  # the first layer of each kind (MoE or dense, linear mixer or attention,
    for i in range(len(layers)):               # of one part or both)
        kinds.setdefault((i in moe_blocks, i in mixers, i in mixer_free, i in mlp_free), i)
    for (in_moe, *_), i in kinds.items():
        found, count = _unplanned_modules(layers[i], [c for c in covered + (moe_parts if in_moe else dense_covered) if c])
        unplanned, unplanned_parameters = tuple(dict.fromkeys(unplanned + found)), max(unplanned_parameters, count)
    # (the attention's layer and, where the MLP is read from another, the MLP's: a Nemotron-H MLP block's biases)
    biases = [n for i in dict.fromkeys((index, mlp_layer)) for n, _ in layers[i].named_parameters() if n.endswith("bias")]
    # (a block of one part has one norm: Nemotron-H's)
    notes += _layer_notes(unplanned, len(biases), len(norms), 1 if index in mlp_free else 2)
    if moe is not None and moe_fields.get("expert_load_imbalance") == 1.0:
        notes.append(f"{moe.experts} runs every expert on every token (weighted by the router): priced as "
                     f"{moe_fields['num_experts']} experts per token, not the router's top-{moe.top_k}")
    if linear is not None:
        notes += _linear_mixer_notes(linear, linear_shape, hidden)
    # a gate per query head, or per output feature of the heads (their values' width under latent attention)
    gate_widths = (heads, attn["latent_widths"][4] if attn.get("latent_kv") else heads * head_dim)
    gate = attn.get("gate") if attn.get("gate_size") in gate_widths else None
    if gate and (attn["gate_size"] == heads or attn.get("latent_kv")):
        notes.append(f"{gate} gives {'one output gate per head' if attn['gate_size'] == heads else 'an output gate per feature'}"
                     f" ({attn['gate_size']}), priced as none")
    latent = _latent_attention(attn["latent_widths"], heads, head_dim) if attn.get("latent_kv") else None
    if latent:
        notes.append(f"multi-head latent attention priced as it runs ({latent})")
    elif attn.get("latent_kv"):
        notes.append("multi-head latent attention whose widths do not fit DeepSeek's is priced as multi-head "
                     "attention with its query heads' width")
    if moe is not None and moe.gated != mlp_parts.get("gated", moe.gated):
        notes.append("the experts' MLP form (gated or not) differs from the dense layers'; the cost model prices "
                     "both as the dense one")
    interleaved = bool(attn.get("qkv")) and attn["qkv"].rpartition(".")[2] in _INTERLEAVED_QKV
    structure = ModelStructure(
        layers=layers_name, num_layers=len(layers), attention=attention, o=attn["o"],
        mlp=mlp if dense_mlp else moe.block, down=mlp_parts.get("down"), q=attn.get("q"), k=attn.get("k"),
        v=attn.get("v"), qkv=attn.get("qkv"), latent_kv=attn.get("latent_kv"), latent_kv_down=attn.get("latent_kv_down"),
        attention_gate=gate,
        latent_rotary_features=attn["latent_widths"][2] if attn.get("latent_kv") else 0,  # the down-projection's rotary key
        gate=mlp_parts.get("gate"), up=mlp_parts.get("up"), gate_up=mlp_parts.get("gate_up"),
        qkv_sizes=(attn["q_size"], attn["kv_size"], attn["kv_size"]) if attn.get("qkv") else None,
        qkv_interleaved=interleaved, layer_norms=norms,
        qk_norms=qk_norms, embedding=outer["embedding"], position_embedding=outer["position_embedding"],
        final_norm=outer["final_norm"],
        lm_head=outer["lm_head"], lm_head_param=outer["lm_head_param"], lm_head_layout=outer["lm_head_layout"],
        tied_embeddings=outer["tied"], task_head=outer["task_head"], moe_layers=tuple(moe_blocks),
        moe=moe.block if moe else None, router=moe.router if moe else None, experts=moe.experts if moe else None,
        expert_layout=moe.layout if moe else None, shared_experts=moe.shared if moe else (), linear_attention=linear,
        unplanned=unplanned, mixer_free_layers=mixer_free, mlp_free_layers=mlp_free, notes=tuple(notes),
    )
    eager = _eager_attention(model)
    fields = dict(
        num_layers=len(layers), hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        v_head_dim=v_head_dim, ffn_hidden_size=mlp_parts.get("ffn") or moe.expert_ffn,
        gated_mlp=mlp_parts.get("gated", moe.gated if moe else True),
        packed_unequal_qkv=bool(attn.get("qkv")) and attn["q_size"] != attn["kv_size"], qkv_interleaved=interleaved,
        qk_norm=qk_norm,
        latent_attention=latent, flash_attention=not eager,
        attention_output_gate=bool(attn.get("gated_query") or gate and attn["gate_size"] != heads
                                   and not attn.get("latent_kv")),  # per feature (latent attention's: priced as none)
        softmax_fp32=eager, unplanned_parameters=unplanned_parameters,
        gated_delta_net=linear_shape, mixer_free_layers=mixer_free, mlp_free_layers=mlp_free, **moe_fields,
    )
    return _with_outer_fields(model, structure, fields, outer)


def _layer_notes(unplanned: tuple[str, ...], biases: int, norms: int, expected_norms: int) -> list[str]:
    """The structure's notes on what a decoder layer holds beyond what the cost model prices: modules no plan names,
    biases, and a norm count other than `expected_norms`."""
    notes = []
    if unplanned:
        notes.append(f"{', '.join(unplanned)} in the decoder layers hold parameters no plan names: whole on every "
                     "tensor-parallel rank, priced as matmuls over every token there")
    if biases:
        notes.append(f"{biases} bias vector(s) per layer are not counted by the cost model")
    if norms != expected_norms:
        notes.append(f"{norms} norm(s) per layer found (the cost model assumes {expected_norms})")
    return notes


def _with_outer_fields(model, structure: ModelStructure, fields: dict, outer: dict) -> tuple[ModelStructure, dict]:
    """(structure, fields) with the spec's fields read outside the decoder layers (`outer`: _outer_parts') and from the
    model itself: the vocabulary, the head, media encoders, learned positions, the final norm, the layers the model
    adds to; a note on media encoders' parameters."""
    fields = dict(
        fields, vocab_size=outer["vocab"],
        tied_embeddings=outer["tied"] and not outer["task_head"],  # a task head has its own weight
        head_outputs=model.get_submodule(outer["task_head"]).out_features if outer["task_head"] else None,
        media_parameters=_media_parameters(model, structure),
        position_parameters=(model.get_submodule(structure.position_embedding).weight.numel()
                             if structure.position_embedding else 0),
        final_norm=structure.final_norm is not None, layers_added_to=_layers_added_to(model, structure.layers))
    if fields["media_parameters"]:
        structure = dataclasses.replace(structure, notes=(*structure.notes, (
            f"{fields['media_parameters']:,} parameters outside the language model (its media encoders and their "
            "projection): whole on every tp rank, on the first pipeline stage; their compute is not priced")))
    return structure, fields


def _recognise_mixers_alone(model, layers_name: str, layers, mixers: dict[int, str], hidden: int
                            ) -> tuple[ModelStructure, dict]:
    """A model whose every block is a norm and a linear mixer, no attention and no MLP (Mamba, Mamba-2, Falcon Mamba:
    a state-space mixer in each block): the structure names the mixer (`linear_attention`), the block's norm, the
    embedding, final norm and head, and every layer as a block without an MLP; `attention`, `o`, `mlp` and `down` are
    None, and the spec has no attention heads and no MLP width (0)."""
    indices = tuple(range(len(layers)))
    linear = _linear_attention(layers_name, layers, mixers, hidden)  # (refuses a mixer it does not read, naming it)
    notes = _check_layers_alike(layers_name, layers, 0, None, {}, indices, one_part=block_parts((), indices))
    norms = tuple(n for n in _norm_names(layers[0], hidden) if not n.startswith(linear.mixer + "."))
    unplanned, unplanned_parameters = _unplanned_modules(layers[0], [linear.mixer, *norms])
    biases = [n for n, _ in layers[0].named_parameters() if n.endswith("bias")]
    notes += _layer_notes(unplanned, len(biases), len(norms), 1)  # (a block of one part: one norm)
    outer = _outer_parts(model, layers_name, hidden)
    shape = _gated_delta_net_shape(layers, linear, hidden)
    structure = ModelStructure(
        layers=layers_name, num_layers=len(layers), attention=None, o=None, mlp=None, down=None, layer_norms=norms,
        embedding=outer["embedding"], position_embedding=outer["position_embedding"], final_norm=outer["final_norm"],
        lm_head=outer["lm_head"], lm_head_param=outer["lm_head_param"], lm_head_layout=outer["lm_head_layout"],
        tied_embeddings=outer["tied"], task_head=outer["task_head"], linear_attention=linear, unplanned=unplanned,
        mlp_free_layers=indices, notes=(*notes, *_linear_mixer_notes(linear, shape, hidden)))
    fields = dict(num_layers=len(layers), hidden_size=hidden, num_heads=0, num_kv_heads=0, head_dim=0, ffn_hidden_size=0,
                  unplanned_parameters=unplanned_parameters, gated_delta_net=shape, mlp_free_layers=indices)
    return _with_outer_fields(model, structure, fields, outer)


def _linear_mixer_notes(linear: LinearAttention, shape, hidden: int) -> list[str]:
    """The structure's notes on its linear mixers: what they are and how the cost model prices them (`shape`)."""
    kind = {"kda": "Kimi Delta Attention, priced as a Gated DeltaNet of its heads",
            "mamba2": "Mamba-2 state-space mixers, priced as a Gated DeltaNet of their groups (B and C as q and "
                      "k) and heads (x as v)",
            "short_conv": "gated short convolutions (LFM2's)",
            "mamba1": "Mamba-1 selective scans",
            "lightning": "MiniMax's lightning attention"}.get(linear.kind, "Gated DeltaNet linear attention")
    priced = {"short_conv": "their convolution and gates priced as elementwise work",
              "mamba1": "priced as mamba-ssm's selective-scan kernels run it",
              "lightning": "priced as transformers' blocked torch path runs it"}.get(
        linear.kind, "priced as flash-linear-attention's chunked kernels run it")
    notes = [f"layers {_ranges(linear.layers)} mix tokens by {kind}"
             f"{' beside their attention' if linear.beside_attention else ''}, {priced}"]
    widths = sum(sum(parts) for _, parts in linear.columns)
    expected = sum(n_out for n_in, n_out, split in shape.projections(hidden) if split == "out")
    if widths != expected:
        notes.append(f"{linear.mixer}'s projections from the hidden size give {widths} features, priced as "
                     f"transformers' q, k, v, z, b and a ({expected})")
    return notes


# The keyword arguments through which the module holding the decoder layers takes rows it adds to its first layers'
# outputs at a mask's positions (Qwen3-VL's deepstack features: the image and video tokens' mask over the sequence, one
# rows tensor per layer reached, as many as its vision config's deepstack_visual_indexes).
DEEPSTACK_ARGUMENTS = ("visual_pos_masks", "deepstack_visual_embeds")


def _layers_added_to(model: "nn.Module", layers_name: str) -> int:
    """How many leading decoder layers' outputs the model adds its deepstack features to (ModelSpec.layers_added_to):
    the length of its vision config's deepstack_visual_indexes where the layers' holder takes DEEPSTACK_ARGUMENTS."""
    holder = model.get_submodule(layers_name.rpartition(".")[0])
    if not all(name in inspect.signature(holder.forward).parameters for name in DEEPSTACK_ARGUMENTS):
        return 0
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


def media_configs(model: "nn.Module") -> list:
    """A transformers multimodal model's sub-configs other than the text one (a vision tower's `vision_config`, an
    audio tower's): what its media encoders are built from. [] for a model of text alone."""
    config = getattr(model, "config", None)
    subs = [getattr(config, name, None) for name in getattr(config, "sub_configs", None) or {} if name != "text_config"]
    return [sub for sub in subs if sub is not None]


def _media_parameters(model: "nn.Module", structure: ModelStructure) -> int:
    """A multimodal model's parameters outside its language model: every parameter outside the module holding the
    decoder-layer list and the LM head, where the config has media sub-configs (`media_configs`: Qwen2-VL's `visual`,
    LLaVA's `vision_tower` and `multi_modal_projector`); 0 otherwise."""
    root = structure.layers.rpartition(".")[0]
    if not media_configs(model) or not root:
        return 0
    inside = {id(p) for p in model.get_submodule(root).parameters()}
    if structure.lm_head:
        inside |= {id(p) for p in model.get_submodule(structure.lm_head).parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in inside)


# transformers' Gated DeltaNet mixers (Qwen3-Next, Qwen3.5, Lara Mini) keep their head counts and widths as these
# attributes; `_LINEAR_ATTENTION_COUNTS` are those a rank holds 1/tp of (the head widths are whole on every rank).
_GATED_DELTA_NET_ATTRS = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
_LINEAR_ATTENTION_COUNTS = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")


def block_parts(mixer_free_layers, mlp_free_layers) -> dict[int, str]:
    """{index: "mlp" (a block without a token mixer) or "mixer" (without an MLP)} of the blocks of one part; the other
    layers hold both parts."""
    return {**{i: "mlp" for i in mixer_free_layers}, **{i: "mixer" for i in mlp_free_layers}}


def _one_part_blocks(layers, hidden: int, moe_blocks: dict, mixers: dict[int, str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(layers without a token mixer, layers without an MLP): decoder blocks of one part, as Nemotron-H's (a norm and
    one mixer each). A block whose projections are all its MoE block's is an MoE block alone; all its linear
    mixer's, a linear mixer alone; all of one module, attention alone where that module has a head count or width
    (`_HEAD_ATTRS`, ...) and no convolution (a state-space mixer not read), else an MLP alone where they form one
    (`_mlp_of`); each holding every parameter of the block but its norms'. Any other block holds both parts."""
    from torch import nn

    def holds_only(layer, part: str) -> bool:  # every parameter but the norms' (1-D) in `part`
        return all(p.dim() < 2 or n.startswith(part + ".") for n, p in layer.named_parameters())

    mixer_free, mlp_free = [], []
    for i, layer in enumerate(layers):
        inside = [name for name in (moe_blocks[i].block if i in moe_blocks else None, mixers.get(i)) if name is not None]
        outside = [l for l in _linears(layer) if not any(l.name == n or l.name.startswith(n + ".") for n in inside)]
        if not outside:
            if (i in moe_blocks) != (i in mixers) and len(inside) == 1 and holds_only(layer, inside[0]):
                (mixer_free if i in moe_blocks else mlp_free).append(i)
            continue
        parents = {l.parent for l in outside}
        if inside or len(parents) != 1 or "" in parents:  # (projections of the layer itself: no module to read)
            continue
        part = next(iter(parents))
        module = layer.get_submodule(part)
        if not holds_only(layer, part) or any(isinstance(m, nn.Conv1d) for m in module.modules()):
            continue  # parameters no part holds (experts without a router), a mixer not read (a convolution)
        if _first_attr([module], _HEAD_ATTRS + _KV_HEAD_ATTRS + _HEAD_DIM_ATTRS) is not None:
            mlp_free.append(i)
        elif _mlp_of(module, hidden) is not None:
            mixer_free.append(i)
    return tuple(mixer_free), tuple(mlp_free)


def _linear_mixer(layer) -> str | None:
    """The name (relative to `layer`) of its linear-attention mixer, or None: a Gated DeltaNet mixer (a module with
    transformers' head attributes for one, `_GATED_DELTA_NET_ATTRS`, and a depthwise nn.Conv1d child: a group per
    channel), a Kimi Delta Attention mixer (`_is_kimi_delta_attention`), a Mamba-2 mixer (`_is_mamba2_mixer`), a
    Mamba-1 mixer (`_is_mamba1_mixer`), a gated short convolution (`_is_short_convolution`) or MiniMax's lightning
    attention (`_is_lightning_attention`)."""
    from torch import nn

    for name, module in layer.named_modules():
        if (_is_kimi_delta_attention(module) or _is_mamba2_mixer(module) or _is_mamba1_mixer(module)
                or _is_short_convolution(module) or _is_lightning_attention(module)):
            return name
        if not all(isinstance(readable_attr(module, a), int) for a in _GATED_DELTA_NET_ATTRS):
            continue
        if any(isinstance(c, nn.Conv1d) and c.groups == c.in_channels == c.out_channels for c in module.children()):
            return name
    return None


# transformers' Kimi Delta Attention mixers (Kimi Linear, Ling's bailing_hybrid) keep one head count and width for
# keys and values; `_KDA_COUNTS` are the attributes a rank holds 1/tp of, on the mixer and on its forget gate.
_KDA_ATTRS = ("num_heads", "head_dim")
_KDA_COUNTS = ("num_heads", "qkv_dim", "conv_dim")


def _is_kimi_delta_attention(module) -> bool:
    """A module with `num_heads` and `head_dim` and a depthwise nn.Conv1d child over 3 x heads x head_dim channels
    (its separate q, k and v projections' outputs), beside a child holding the decay's `A_log`."""
    from torch import nn

    if not all(isinstance(readable_attr(module, a), int) for a in _KDA_ATTRS):
        return False
    width = 3 * module.num_heads * module.head_dim
    return (any(isinstance(c, nn.Conv1d) and c.groups == c.in_channels == c.out_channels == width
                for c in module.children())
            and any(isinstance(getattr(c, "A_log", None), nn.Parameter) for c in module.children()))


def _kimi_delta_attention(where: str, name: str, module, layer_indices: tuple[int, ...], hidden: int) -> LinearAttention:
    """A Kimi Delta Attention mixer as tensor parallel splits it by head (LinearAttention, kind "kda"): every Linear
    whose outputs are per head (heads x head_dim, or one per head) is column-parallel (q, k, v, the beta and gate
    projections, the decay gate's projection, also where it takes a low-rank latent); a latent's down-projection
    (found by its up-projection beside it: `latent_down`) is whole on every rank; the projection back to the hidden
    size is row-parallel; the convolution over [q | k | v], the per-channel time-step bias and the per-head decay are this
    rank's rows; a norm over one head's features is shared. Anything else is refused, naming it."""
    from torch import nn

    heads, head_dim = int(module.num_heads), int(module.head_dim)
    width = heads * head_dim
    linears = [_Linear(n, "", c.in_features, c.out_features) for n, c in _outside_lora_layers(module) if _is_linear(c)]
    output = _mixer_output(module, width, hidden, recurse=True)  # by its name where q, k and v are as wide
    by_name = {l.name: l for l in linears}

    def latent_down(lin: _Linear) -> bool:
        """A low-rank latent's down-projection (Kimi's f_a_proj, g_a_proj: the hidden size to one head's width), by
        its up-projection beside it (the same name with _b_, taking that width): whole on every rank. By the pair,
        not the width alone, which a per-head projection shares where heads == head_dim."""
        up = by_name.get(lin.name.replace("_a_proj", "_b_proj"))
        return up is not None and up is not lin and (lin.in_features, lin.out_features) == (hidden, up.in_features)

    columns, rows, row_dims, shared = [], [], [], []
    for child_name, child in module.named_modules():
        params = dict(child.named_parameters(recurse=False))
        if not child_name or child_name == output or not params and not _is_linear(child):
            continue
        if _is_linear(child):
            if latent_down(by_name[child_name]):
                continue
            if child.out_features in (width, heads) and child.in_features in (hidden, head_dim):
                columns.append((child_name, (child.out_features,)))
            else:
                raise UnrecognisedModel(f"{where}.{child_name} ({child.in_features} -> {child.out_features}) is none of "
                                        f"a Kimi Delta Attention mixer's projections ({heads} heads of {head_dim})")
            continue
        if isinstance(child, nn.Conv1d) and child.groups == child.out_channels == 3 * width:
            rows += [(f"{child_name}.{pname}", (width,) * 3) for pname in params]
            continue
        if all(p.dim() == 1 and p.shape[0] == head_dim for p in params.values()):
            shared.append(child_name)
            continue
        for pname, param in params.items():
            full = f"{child_name}.{pname}"
            along = [d for d, size in enumerate(param.shape) if size != 1]
            if len(along) == 1 and param.shape[along[0]] in (heads, width):
                rows.append((full, (param.shape[along[0]],)))
                if along[0]:
                    row_dims.append((full, along[0]))
            else:
                raise UnrecognisedModel(f"{where}.{full} {tuple(param.shape)} is no parameter of one entry per head "
                                        f"({heads}) or per channel ({width}), which tensor parallel would split")
    if output is None or not any(parts == (width,) * 3 for _, parts in rows):
        raise UnrecognisedModel(f"{where}: a Kimi Delta Attention mixer needs a projection back to the hidden size "
                                f"and a convolution over its [q | k | v] channels; found {output or 'no output projection'}")
    counts = [a for a in _KDA_COUNTS if isinstance(readable_attr(module, a), int)]
    counts += [f"{c}.{a}" for c, child in module.named_children() for a in _KDA_COUNTS
               if isinstance(readable_attr(child, a), int) and any(True for _ in child.parameters(recurse=False))]
    return LinearAttention(mixer=name, layers=layer_indices, num_k_heads=heads, num_v_heads=heads,
                           columns=tuple(columns), output=output, rows=tuple(rows), shared=tuple(shared),
                           counts=tuple(counts), row_dims=tuple(row_dims), kind="kda")


def _short_convolution_parts(module) -> tuple[str, str, str] | None:
    """(input projection, convolution, output projection) names of a gated short convolution (LFM2's Lfm2ShortConv):
    a module whose only parameters are a depthwise nn.Conv1d child over C channels, a Linear child to [B | C | x]
    (3C outputs) and a Linear child from C features back to that one's input width; None for any other module."""
    from torch import nn

    children = {name: child for name, child in module.named_children()
                if any(True for _ in child.parameters())}
    if len(children) != 3 or any(True for _ in module.parameters(recurse=False)):
        return None
    convs = [n for n, c in children.items() if isinstance(c, nn.Conv1d) and c.groups == c.in_channels == c.out_channels]
    if len(convs) != 1:
        return None
    width = children[convs[0]].out_channels
    linears = {n: c for n, c in children.items() if _is_linear(c)}
    ins = [n for n, c in linears.items() if c.out_features == 3 * width]
    outs = [n for n, c in linears.items() if c.in_features == width and n not in ins]
    if len(ins) != 1 or len(outs) != 1 or linears[outs[0]].out_features != linears[ins[0]].in_features:
        return None
    return ins[0], convs[0], outs[0]


def _is_short_convolution(module) -> bool:
    return _short_convolution_parts(module) is not None


def _short_convolution(name: str, module, layer_indices: tuple[int, ...]) -> LinearAttention:
    """A gated short convolution as tensor parallel splits it by channel (LinearAttention, kind "short_conv"; its
    channels as the heads, each independent): the input projection [B | C | x] column-parallel part by part, the
    output projection row-parallel, the depthwise convolution's rows (weight, bias) this rank's channels. Its code
    reads no count of channels (it chunks the projection's output in three), so none is localised."""
    projection, conv, output = _short_convolution_parts(module)
    width = module.get_submodule(conv).out_channels
    return LinearAttention(
        mixer=name, layers=layer_indices, num_k_heads=width, num_v_heads=width,
        columns=((projection, (width,) * 3),), output=output,
        rows=tuple((f"{conv}.{pname}", (width,)) for pname, _ in module.get_submodule(conv).named_parameters()),
        shared=(), counts=(), kind="short_conv")


# transformers' Mamba-2 mixers (Mamba2Mixer and its copies in Bamba, Granite 4.0-H, Zamba 2, Nemotron-H, Falcon-H1)
# keep their shapes as these attributes.
_MAMBA2_ATTRS = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim")


def _is_mamba2_mixer(module) -> bool:
    """A module with Mamba-2's shape attributes (`_MAMBA2_ATTRS`), a per-head `A_log` of its own and a depthwise
    nn.Conv1d child over its conv_dim channels ([x | B | C])."""
    from torch import nn

    if not all(isinstance(readable_attr(module, a), int) for a in _MAMBA2_ATTRS):
        return False
    a_log = getattr(module, "A_log", None)
    return (isinstance(a_log, nn.Parameter) and tuple(a_log.shape) == (module.num_heads,)
            and any(isinstance(c, nn.Conv1d) and c.groups == c.in_channels == c.out_channels == module.conv_dim
                    for c in module.children()))


def _mamba2_mixer(where: str, name: str, module, layer_indices: tuple[int, ...], hidden: int) -> LinearAttention:
    """A Mamba-2 mixer as tensor parallel splits it by head (LinearAttention, kind "mamba2"; `num_k_heads` its
    n_groups state groups, `num_v_heads` its heads): the input projection [z | x | B | C | dt] column-parallel part by
    part (z, x and dt with the heads; B and C with the groups: where tp exceeds the groups, each rank computes its
    group's, shared with tp / n_groups ranks), the output projection row-parallel, the convolution's rows over
    [x | B | C], dt_bias, A_log and D (one per head) and the gated norm's weight (one per feature of x) this rank's,
    the norm's statistics summed over the ranks sharing a group (`group_norm`). Anything else is refused, naming it."""
    from torch import nn

    heads, head_dim, groups, state = (int(getattr(module, a)) for a in _MAMBA2_ATTRS[:4])
    inner, conv_dim = int(module.intermediate_size), int(module.conv_dim)
    bc = groups * state
    if inner != heads * head_dim or conv_dim != inner + 2 * bc or heads % groups:
        raise UnrecognisedModel(f"{where}: a Mamba-2 mixer of {heads} heads of {head_dim} in {groups} groups with "
                                f"intermediate_size={inner} and conv_dim={conv_dim}, which do not add up "
                                f"(heads x head_dim, intermediate_size + 2 x n_groups x ssm_state_size)")
    parts, units = (inner, inner, bc, bc, heads), (heads, heads, groups, groups, heads)  # [z | x | B | C | dt]
    columns, output, rows, row_units, group_norm = [], None, [], [], None
    for child_name, child in module.named_children():
        params = dict(child.named_parameters())
        if _is_linear(child) and (child.in_features, child.out_features) == (hidden, sum(parts)):
            columns.append((child_name, parts))
        elif _is_linear(child) and (child.in_features, child.out_features) == (inner, hidden):
            output = child_name
        elif isinstance(child, nn.Conv1d) and child.groups == child.out_channels == conv_dim:
            for pname in params:
                rows.append((f"{child_name}.{pname}", (inner, bc, bc)))
                row_units.append((f"{child_name}.{pname}", (heads, groups, groups)))
        elif (set(params) == {"weight"} and tuple(params["weight"].shape) == (inner,)
              and readable_attr(child, "group_size") == inner // groups):
            group_norm = child_name
            rows.append((f"{child_name}.weight", (inner,)))
            row_units.append((f"{child_name}.weight", (heads,)))
        elif params:
            _refuse_foreign_part(where, child_name, child, params, "a Mamba-2 mixer's",
                                 f"the input projection {hidden} -> {sum(parts)} [z | x | B | C | dt], the output "
                                 f"projection {inner} -> {hidden}, the convolution over its {conv_dim} [x | B | C] "
                                 f"channels, a gated norm over {inner} features in groups of {inner // groups}")
    rows += _per_head_parameters(where, module, heads, "head")
    row_dims = []
    for bname, buffer in module.named_buffers(recurse=False):
        # Falcon-H1's mup_vector ([1, 1, in_proj's outputs]: a µP multiplier per feature of [z | x | B | C | dt]),
        # which its code multiplies the input projection's output by: split as that output is
        if buffer.dim() and buffer.shape[-1] == sum(parts) and buffer.numel() == sum(parts):
            rows.append((bname, parts))
            row_units.append((bname, units))
            row_dims.append((bname, buffer.dim() - 1))
        else:
            raise UnrecognisedModel(f"{where}.{bname} (a buffer of shape {tuple(buffer.shape)}) is none of a Mamba-2 "
                                    f"mixer's parts tensor parallel splits (a vector over its input projection's "
                                    f"{sum(parts)} outputs)")
    if len(columns) != 1 or output is None or not any(n.endswith(".weight") and p == (inner, bc, bc) for n, p in rows):
        raise UnrecognisedModel(f"{where}: a Mamba-2 mixer needs one input projection {hidden} -> {sum(parts)}, an "
                                f"output projection {inner} -> {hidden} and a convolution over its {conv_dim} channels; "
                                f"found input projection(s) {[n for n, _ in columns]}, output {output}")
    # Falcon-H1's mixer also keeps n_groups x ssm_state_size (B's and C's width) as an attribute of its own
    widths = (("groups_time_state_size", ((bc, groups),)),) if readable_attr(module, "groups_time_state_size") == bc else ()
    return LinearAttention(
        mixer=name, layers=layer_indices, num_k_heads=groups, num_v_heads=heads, columns=tuple(columns), output=output,
        rows=tuple(rows), shared=(), counts=("num_heads", "intermediate_size"),
        units=((columns[0][0], units), *row_units), row_dims=tuple(row_dims),
        part_counts=(("n_groups", ((groups, groups),)), ("conv_dim", ((inner, heads), (bc, groups), (bc, groups))),
                     *widths),
        group_norm=group_norm, kind="mamba2")


# transformers' Mamba-1 mixers (Jamba's JambaMambaMixer, MambaMixer, FalconMambaMixer) keep their shapes as these
# attributes; `intermediate_size` counts the channels each rank holds 1/tp of.
_MAMBA1_ATTRS = ("intermediate_size", "ssm_state_size", "time_step_rank")


def _is_mamba1_mixer(module) -> bool:
    """A module with Mamba-1's shape attributes (`_MAMBA1_ATTRS`), an `A_log` of its own of one row of states per
    channel ([intermediate_size, ssm_state_size]) and a depthwise nn.Conv1d child over its channels."""
    from torch import nn

    if not all(isinstance(readable_attr(module, a), int) for a in _MAMBA1_ATTRS):
        return False
    a_log = getattr(module, "A_log", None)
    return (isinstance(a_log, nn.Parameter) and tuple(a_log.shape) == (module.intermediate_size, module.ssm_state_size)
            and any(isinstance(c, nn.Conv1d) and c.groups == c.in_channels == c.out_channels == module.intermediate_size
                    for c in module.children()))


def _mamba1_mixer(where: str, name: str, module, layer_indices: tuple[int, ...], hidden: int) -> LinearAttention:
    """A Mamba-1 mixer as tensor parallel splits it by channel (LinearAttention, kind "mamba1"; its channels as the
    heads, each with its own states), as Megatron's and vLLM's Mamba layers are split: the input projection [x | z]
    column-parallel part by part, the selective projection x_proj (channels to the time-step rank, B and C)
    row-parallel with its output's gradient summed over the ranks too (`row_shared`: every rank's channels use the
    whole dt, B and C, so each rank's gradient of them is a share), the norms over dt, B and C (Jamba's) shared, this
    rank's rows of the convolution, of dt_proj (its code multiplies by `dt_proj.weight` itself) and of A_log and D,
    the output projection row-parallel, `intermediate_size` local. Anything else is refused, naming it."""
    from torch import nn

    inner, state, rank = (int(getattr(module, a)) for a in _MAMBA1_ATTRS)
    selective = rank + 2 * state
    columns, output, row_shared, rows, shared, conv = [], None, None, [], [], None
    for child_name, child in module.named_children():
        params = dict(child.named_parameters())
        shape = (child.in_features, child.out_features) if _is_linear(child) else None
        if shape == (hidden, 2 * inner):
            columns.append((child_name, (inner, inner)))
        elif shape == (inner, selective) and row_shared is None:
            # Before the output projection: where dt_rank + 2 x ssm_state_size is the hidden size, the two have one
            # shape, and the selective one is registered first (transformers' Mamba-1 mixers define them in the
            # order their forward calls them)
            row_shared = child_name
        elif shape == (inner, hidden) and output is None:
            output = child_name
        elif shape == (rank, inner):
            rows += [(f"{child_name}.{pname}", (inner,)) for pname in params]
        elif isinstance(child, nn.Conv1d) and child.groups == child.out_channels == inner:
            conv = child_name
            rows += [(f"{child_name}.{pname}", (inner,)) for pname in params]
        elif params and all(p.dim() == 1 and p.shape[0] in (rank, state) for p in params.values()):
            shared.append(child_name)
        elif params:
            _refuse_foreign_part(where, child_name, child, params, "a Mamba-1 mixer's",
                                 f"the input projection {hidden} -> {2 * inner} [x | z], the selective projection "
                                 f"{inner} -> {selective} [dt | B | C], the time-step projection {rank} -> {inner}, the "
                                 f"output projection {inner} -> {hidden}, the convolution over its {inner} channels, "
                                 "norms over dt, B or C")
    for pname, param in module.named_parameters(recurse=False):
        if param.shape[0] != inner or param.dim() > 2:
            raise UnrecognisedModel(f"{where}.{pname} {tuple(param.shape)} is no parameter of one row per channel "
                                    f"({inner}), which tensor parallel would split with the channels")
        rows.append((pname, (inner,)))
    if len(columns) != 1 or output is None or row_shared is None or conv is None:
        raise UnrecognisedModel(f"{where}: a Mamba-1 mixer needs an input projection {hidden} -> {2 * inner}, a "
                                f"selective projection {inner} -> {selective}, an output projection {inner} -> {hidden} "
                                f"and a convolution over its {inner} channels; found input projection(s) "
                                f"{[n for n, _ in columns]}, selective {row_shared}, output {output}")
    return LinearAttention(
        mixer=name, layers=layer_indices, num_k_heads=inner, num_v_heads=inner, columns=tuple(columns), output=output,
        rows=tuple(rows), shared=tuple(shared), counts=("intermediate_size",), row_shared=(row_shared, selective),
        kind="mamba1")


# transformers' MiniMaxLightningAttention keeps its shapes as these attributes.
_LIGHTNING_ATTRS = ("num_attention_heads", "head_dim", "block_size")


def _is_lightning_attention(module) -> bool:
    """A module with lightning attention's shape attributes (`_LIGHTNING_ATTRS`) and a buffer `slope_rate` of one decay
    rate per head ([heads, 1, 1]): MiniMax-Text-01's and MiniMax-M1's linear layers."""
    if not all(isinstance(readable_attr(module, a), int) for a in _LIGHTNING_ATTRS):
        return False
    rate = getattr(module, "_buffers", {}).get("slope_rate")
    return rate is not None and rate.dim() == 3 and rate.shape[0] == module.num_attention_heads


def _lightning_attention(where: str, name: str, module, layer_indices: tuple[int, ...], hidden: int) -> LinearAttention:
    """MiniMax's lightning attention as tensor parallel splits it by head (LinearAttention, kind "lightning"): its
    projection to [q k v] of each head (3 x heads x head_dim, laid out per head: a contiguous split keeps each head's
    three together) and its output gate (heads x head_dim) column-parallel, the projection back to the hidden size
    row-parallel, this rank's rows of its decay buffers (a row per head: slope_rate, query_decay, key_decay along dim
    0, diagonal_decay along dim 1; its code reads them itself), its norm over every head's features with its
    statistics summed over the ranks (`whole_norm`), `num_attention_heads` local. Anything else is refused, naming it."""
    heads, head_dim = int(module.num_attention_heads), int(module.head_dim)
    width = heads * head_dim
    output = _mixer_output(module, width, hidden)  # by its name where the gate has that shape too
    columns, whole_norm = [], None
    for child_name, child in module.named_children():
        params = dict(child.named_parameters())
        if child_name == output:
            continue
        if _is_linear(child) and child.in_features == hidden and child.out_features in (width, 3 * width):
            columns.append((child_name, (child.out_features,)))
        elif params and all(p.dim() == 1 and p.shape[0] == width for p in params.values()) and whole_norm is None:
            whole_norm = child_name
        elif params:
            _refuse_foreign_part(where, child_name, child, params, "a lightning attention's",
                                 f"the projection {hidden} -> {3 * width} to [q k v] per head, the output gate "
                                 f"{hidden} -> {width}, the output projection {width} -> {hidden}, a norm over its "
                                 f"{width} features")
    # The decays are computed from slope_rate ([heads, 1, 1]) by broadcasting: their heads lie on the third dim from
    # the end (diagonal_decay [1, heads, block, block]; its block may be as long as the heads are many)
    rows, row_dims = [], []
    for bname, buffer in module.named_buffers(recurse=False):
        along = buffer.dim() - 3
        if along < 0 or buffer.shape[along] != heads:
            raise UnrecognisedModel(f"{where}.{bname} {tuple(buffer.shape)} is no buffer of one row per head ({heads}) "
                                    "on its third dim from the end, as a decay from slope_rate is, which tensor "
                                    "parallel would split with the heads")
        rows.append((bname, (heads,)))
        if along:
            row_dims.append((bname, along))
    if (any(True for _ in module.parameters(recurse=False)) or output is None or whole_norm is None
            or sorted(size for _, (size,) in columns) != [width, 3 * width]):
        raise UnrecognisedModel(f"{where}: a lightning attention needs projections to [q k v] ({3 * width}) and to its "
                                f"output gate ({width}), one back to the hidden size and a norm over its {width} "
                                f"features, and no parameters of its own; found columns {[n for n, _ in columns]}, "
                                f"output {output}, norm {whole_norm}")
    return LinearAttention(
        mixer=name, layers=layer_indices, num_k_heads=heads, num_v_heads=heads, columns=tuple(columns), output=output,
        rows=tuple(rows), shared=(), counts=("num_attention_heads",), row_dims=tuple(row_dims),
        whole_norm=whole_norm, kind="lightning")


def _refuse_foreign_part(where: str, child_name: str, child, params: dict, mixer: str, parts: str) -> None:
    """Raise naming `child` (its parameters' shapes) as none of `mixer` parts tensor parallel splits (`parts`)."""
    shapes = ", ".join(f"{pname} {tuple(p.shape)}" for pname, p in params.items())
    raise UnrecognisedModel(f"{where}.{child_name} ({type(child).__name__}: {shapes}) is none of {mixer} parts tensor "
                            f"parallel splits ({parts})")


def _per_head_parameters(where: str, module, heads: int, what: str) -> list[tuple[str, tuple[int]]]:
    """A mixer's own parameters (not its children's) as `rows` of one entry per head (`what`: the heads' name in the
    error): dt_bias, A_log, D. Any other shape is refused, naming it."""
    rows = []
    for pname, param in module.named_parameters(recurse=False):
        if tuple(param.shape) != (heads,):
            raise UnrecognisedModel(f"{where}.{pname} {tuple(param.shape)} is no parameter of one entry per {what} "
                                    f"({heads}), which tensor parallel would split with the heads")
        rows.append((pname, (heads,)))
    return rows


def _linear_attention(layers_name: str, layers, mixers: dict[int, str], hidden: int) -> LinearAttention:
    """The Gated DeltaNet mixer of the `mixers` layers ({index: its name}), read from the first of them (the others
    hold the same parameters: _check_layers_alike). Anything of it that is not a projection from the hidden size,
    the output projection, the depthwise convolution over the packed [q | k | v] channels, a per-value-head
    parameter or a norm over one value head's features is refused, naming it."""
    from torch import nn

    index = min(mixers)
    if len(set(mixers.values())) > 1:
        raise UnrecognisedModel(f"{layers_name}: linear-attention mixers under different names in different layers "
                                f"({sorted(set(mixers.values()))})")
    name = mixers[index]
    module = layers[index].get_submodule(name)
    where = f"{layers_name}.{index}.{name}"
    if _is_kimi_delta_attention(module):
        return _kimi_delta_attention(where, name, module, tuple(sorted(mixers)), hidden)
    if _is_mamba2_mixer(module):
        return _mamba2_mixer(where, name, module, tuple(sorted(mixers)), hidden)
    if _is_short_convolution(module):
        return _short_convolution(name, module, tuple(sorted(mixers)))
    if _is_mamba1_mixer(module):
        return _mamba1_mixer(where, name, module, tuple(sorted(mixers)), hidden)
    if _is_lightning_attention(module):
        return _lightning_attention(where, name, module, tuple(sorted(mixers)), hidden)
    num_k_heads, num_v_heads, head_k_dim, head_v_dim = (int(getattr(module, a)) for a in _GATED_DELTA_NET_ATTRS)
    if num_v_heads % num_k_heads:
        raise UnrecognisedModel(f"{where}: {num_v_heads} value heads do not group over {num_k_heads} key heads")
    packed = (num_k_heads * head_k_dim, num_k_heads * head_k_dim, num_v_heads * head_v_dim)  # [q | k | v]
    value_dim = packed[2]
    # Where the value heads are as wide as the hidden size, a square gate projection beside it (Qwen3.5's in_proj_z)
    output = _mixer_output(module, value_dim, hidden)
    columns, outputs, rows, shared = [], [], [], []
    for child_name, child in module.named_children():
        params = dict(child.named_parameters())
        if child_name == output:
            outputs.append(child_name)
        elif _is_linear(child) and child.in_features == hidden:
            columns.append((child_name, packed if child.out_features == sum(packed) else (child.out_features,)))
        elif isinstance(child, nn.Conv1d) and child.groups == child.out_channels == sum(packed):
            rows += [(f"{child_name}.{pname}", packed) for pname in params]
        elif params and all(p.dim() == 1 and p.shape[0] == head_v_dim for p in params.values()):
            shared.append(child_name)
        elif params:
            _refuse_foreign_part(where, child_name, child, params, "a Gated DeltaNet mixer's",
                                 f"projections from the hidden size {hidden}, one back to it from the {value_dim} value "
                                 f"features, the depthwise convolution over the {sum(packed)} packed [q | k | v] "
                                 f"channels, norms over a value head's {head_v_dim} features")
    rows += _per_head_parameters(where, module, num_v_heads, "value head")
    if len(outputs) != 1 or not columns or not any(size == packed for _, size in rows):
        raise UnrecognisedModel(f"{where}: a Gated DeltaNet mixer needs projections from the hidden size, one output "
                                f"projection and a convolution over its [q | k | v] channels; found {outputs or 'no'} "
                                f"output projection(s), columns {[n for n, _ in columns]}")
    return LinearAttention(
        mixer=name, layers=tuple(sorted(mixers)), num_k_heads=num_k_heads, num_v_heads=num_v_heads,
        columns=tuple(columns), output=outputs[0], rows=tuple(rows), shared=tuple(shared),
        counts=tuple(a for a in _LINEAR_ATTENTION_COUNTS if isinstance(readable_attr(module, a), int)))


def _gated_delta_net_shape(layers, linear: LinearAttention, hidden: int) -> "GatedDeltaNet | ChannelMixer":
    """The cost model's shapes of the `linear` layers (read from the first one's mixer: the others are alike)."""
    from torch import nn

    mixer = layers[linear.layers[0]].get_submodule(linear.mixer)
    if linear.kind == "lightning":  # no convolution
        return LightningAttention(layers=linear.layers, channels=int(mixer.num_attention_heads),
                                  head_dim=int(mixer.head_dim), block_size=int(mixer.block_size))
    conv = next(c for c in mixer.children() if isinstance(c, nn.Conv1d))
    if linear.kind == "short_conv":
        return ShortConvolution(layers=linear.layers, channels=conv.out_channels, conv_kernel_size=conv.kernel_size[0])
    if linear.kind == "mamba1":
        return SelectiveScan(layers=linear.layers, channels=int(mixer.intermediate_size), state_size=int(mixer.ssm_state_size),
                             dt_rank=int(mixer.time_step_rank), conv_kernel_size=conv.kernel_size[0])
    # distcore's rule (packed.packed_colwise): a packing of equal parts without units of their own splits each part
    # on the outputs; any other packing splits the weight on its inputs and reduce-scatters the output
    units = dict(linear.units)
    common = dict(layers=linear.layers, conv_kernel_size=conv.kernel_size[0], beside_attention=linear.beside_attention,
                  packed_split_outputs=sum(
        sum(parts) for name, parts in linear.columns if len(parts) > 1 and (len(set(parts)) > 1 or name in units)))
    if linear.kind == "mamba2":  # B and C as q and k (a group's state wide), x as v (a head wide), z as the gate
        return GatedDeltaNet(num_k_heads=int(mixer.n_groups), num_v_heads=int(mixer.num_heads),
                             head_k_dim=int(mixer.ssm_state_size), head_v_dim=int(mixer.head_dim),
                             key_heads_replicable=True, **common)
    if linear.kind == "kda":  # one head count and width for keys and values: priced as a Gated DeltaNet of them
        heads, head_dim = int(mixer.num_heads), int(mixer.head_dim)
        return GatedDeltaNet(num_k_heads=heads, num_v_heads=heads, head_k_dim=head_dim, head_v_dim=head_dim, **common)
    return GatedDeltaNet(**common, **{a: int(getattr(mixer, a)) for a in _GATED_DELTA_NET_ATTRS})


def _eager_attention(model) -> bool:
    """Whether the model runs transformers' eager attention (`config._attn_implementation == "eager"`), which
    multiplies q and k into the s x s scores and keeps their fp32 softmax and its cast for the backward
    (`flash_attention=False, softmax_fp32=True`); SDPA, FlashAttention and flex attention store no scores. A model
    without that setting (hand-written): False, as its `F.scaled_dot_product_attention` runs on a GPU."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == "eager"


def _refuse_sequence_mixers(module, name: str, layers_name: str, index: int) -> None:
    """A convolution in the attention block marks a state-space or linear-attention mixer that `_linear_mixer` did
    not read (a mixer of another make than those it reads: RecurrentGemma's temporal block, RWKV-style mixers):
    their projections pack per-head state parameters beside q/k/v, which no attention plan of tensor parallel splits
    right."""
    from torch import nn

    convs = [n for n, m in module.named_modules() if isinstance(m, nn.Conv1d)]
    if convs:
        raise UnrecognisedModel(
            f"{layers_name}.{index}: {name} holds a convolution ({', '.join(convs[:2])}): a state-space or "
            f"linear-attention mixer ({type(module).__name__}: Mamba, Gated DeltaNet, short convolutions), which "
            "tensor parallel does not split; pipeline and data parallel need only the decoder-layer list")


def _check_layers_alike(layers_name: str, layers, template: int, mlp: str | None, moe_blocks: dict,
                        linear_layers: tuple[int, ...] = (), attention: str | None = None,
                        one_part: dict[int, str] | None = None) -> list[str]:
    """Every decoder layer holds the template layer's parameters (by name) outside its MLP or MoE block, and every
    dense layer the template's dense MLP: the structure names one layer's modules, and the tensor-parallel,
    pipeline and recompute plans apply those names to every layer. The `linear_layers` (Gated DeltaNet's, whose
    mixer the structure names apart) are held to the first of them outside their MLP instead. Layers of one class
    can differ otherwise too (MiniMax's linear-attention layers beside full-attention ones: refused). Shapes may
    differ (Gemma 4's global layers have wider heads): the plans split each layer's own weights and the
    tensor-parallel check runs every kind of block; the notes say the cost model prices every layer as the
    template. So may the `attention` module's own parameters (not its submodules'), which no plan names: MiMo-V2-Flash's
    sliding-window layers hold a sink per head that its full-attention layers have not (the block check finds each
    layer's per-head parameters and splits them with the heads). An MoE block's shape is checked by _moe_layers. Blocks
    of one part (`one_part`: index -> "mixer" or "mlp"; Nemotron-H's) are held, whole, to the first block of their
    kind (its part, MoE or not, linear mixer or not). Returns the notes."""

    def parameters(i: int) -> tuple[dict, dict]:  # (outside the MLP or MoE block, inside a dense MLP)
        inner = moe_blocks[i].block if i in moe_blocks else mlp
        outside, inside = {}, {}
        for name, param in layers[i].named_parameters():
            inner_part = inner is not None and (name == inner or name.startswith(inner + "."))
            (inside if inner_part else outside)[name] = tuple(param.shape)
        return outside, inside

    def own(name: str) -> bool:  # a parameter of the attention module itself
        return attention is not None and name.startswith(attention + ".") and "." not in name[len(attention) + 1:]

    one_part = one_part or {}
    both = [i for i in range(len(layers)) if i not in one_part]
    if template not in both:  # (a block of attention alone): the others held to the first attention layer of both parts
        template = next((i for i in both if i not in linear_layers), template)
    first_linear = next((i for i in linear_layers if i in both), None)
    want_attention = parameters(template)[0]
    want_mlp = parameters(next((i for i in both if i not in moe_blocks), template))[1]  # a dense layer's
    want_linear = parameters(first_linear)[0] if first_linear is not None else None
    reshaped, own_parameters = set(), set()
    firsts: dict[tuple, int] = {}  # the first block of each one-part kind
    for i, part in one_part.items():
        like = firsts.setdefault((part, i in moe_blocks, i in linear_layers), i)
        got, want = ({n: tuple(p.shape) for n, p in layers[j].named_parameters()} for j in (i, like))
        if got.keys() != want.keys():
            differ = sorted(set(got) ^ set(want))
            raise UnrecognisedModel(
                f"decoder layers differ: {layers_name}.{i} is not {layers_name}.{like}'s ({', '.join(differ[:3])}"
                f"{', ...' if len(differ) > 3 else ''}), though both hold one part ({part}); fall back to data parallel "
                "(with sharding)")
        if got != want:
            reshaped.add(i)
    for i in both:
        outside, inside = parameters(i)
        like, want_outside = (first_linear, want_linear) if i in linear_layers else (template, want_attention)
        for what, got, want in (("outside its MLP", outside, want_outside),
                                ("in its MLP", None if i in moe_blocks or mlp is None else inside, want_mlp)):
            if got is None or got == want:
                continue
            differ = sorted(set(got) ^ set(want))
            if i not in linear_layers and differ and all(own(n) for n in differ):
                own_parameters.update(differ)
                got, want = ({n: v for n, v in d.items() if n not in differ} for d in (got, want))
            if got == want:
                continue
            if got.keys() == want.keys():
                reshaped.add(i)
                continue
            differ = sorted(set(got) ^ set(want))
            shown = ", ".join(f"{n} {'only here' if n in got else 'missing'}" for n in differ[:3])
            raise UnrecognisedModel(
                f"decoder layers differ: {layers_name}.{i} {what} is not {layers_name}.{like}'s ({shown}"
                f"{', ...' if len(differ) > 3 else ''}): the structure names one layer's modules in every layer "
                "(layers of another kind beside the others are read for Gated DeltaNet linear attention alone); "
                "fall back to data parallel (with sharding)")
    notes = [f"{', '.join(sorted(own_parameters))} in some layers only (priced as none)"] if own_parameters else []
    if not reshaped:
        return notes
    like = f"layer {template}" + (f" (or, linear attention, layer {linear_layers[0]})" if linear_layers else "")
    return notes + [f"layers {_ranges(tuple(sorted(reshaped)))} have other parameter shapes than {like}; the cost "
                    f"model prices every layer as layer {template}"]


def _hidden_size(block, emb_dims: list[int]) -> int | None:
    """The hidden size: the embedding width if there is one, else the most common projection width."""
    linears = _linears(block)
    widths = [l.in_features for l in linears] + [l.out_features for l in linears]
    if emb_dims:
        return max(emb_dims, key=widths.count)
    return max(set(widths), key=widths.count) if widths else None
